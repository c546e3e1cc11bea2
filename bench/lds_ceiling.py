"""The largest LDS any per-source score vector reaches on a context benchmark's own ablations.

A method's LDS ranks ``Σ_kept score(source)`` against the answer's log-probability over the benchmark's random
ablations of each example. Searching the score vectors themselves for the best rank correlation on those same
ablations (in-sample: the ablations' results are known to the search) bounds from above what any method that gives
one score per source can reach there, whether it ablates or not. With a few sources (three passages: eight
subsets) the bound is tight enough to say how much room is left above a method.

Per example the search takes the in-sample least-squares fit, every method's own scores and ``--draws`` random
directions, and keeps the best. Reads ``records.jsonl`` of a run of ``attnlens benchmark --task context``;
writes a table (``--out``, default: print).

Run: ``python bench/lds_ceiling.py results/context/records.jsonl [--out bench/data/lds_ceiling.md]``.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import numpy as np

from attnlens.sources.ablation import random_masks, rank_agreement


def ceiling(masks: np.ndarray, actual: np.ndarray, candidates: np.ndarray) -> float:
    """The best rank agreement of ``masks @ c`` with ``actual`` over the rows ``c`` of ``candidates``."""
    best = -1.0
    for c in candidates:
        predicted = masks @ c
        if np.ptp(predicted) > 0:
            best = max(best, rank_agreement(predicted, actual))
    return best


def example_figures(record: dict, draws: int, rng: np.random.Generator) -> dict[str, float]:
    """One record's ceiling, its in-sample least-squares fit's LDS and every method's LDS."""
    n, settings = record["n_sources"], record["truth"]["settings"]
    # the benchmark's own masks: its settings and seed rule (attnlens.evaluation.context_benchmark)
    seed = settings["seed"] + zlib.crc32(record["id"].encode())
    masks = random_masks(settings["n_lds"], n, settings["keep_probability"], seed).astype(np.float64)
    actual = np.asarray(record["truth"]["actual"], dtype=np.float64)
    design = np.hstack([masks, np.ones((len(masks), 1))])
    fit = np.linalg.lstsq(design, actual, rcond=None)[0][:n]
    own = [np.asarray(m["scores"], dtype=np.float64) for m in record["methods"].values()]
    found = {"ceiling": ceiling(masks, actual, np.vstack([fit, *own, rng.standard_normal((draws, n))])),
             "least squares (in-sample)": rank_agreement(masks @ fit, actual)}
    found.update({m: r["lds"] for m, r in record["methods"].items()})
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", type=Path, help="records.jsonl of a context benchmark run")
    p.add_argument("--draws", type=int, default=20000, help="random score directions tried per example")
    p.add_argument("--out", type=Path, help="write the table here (default: print it)")
    args = p.parse_args()
    records = {}
    for line in args.records.read_text().splitlines():  # a later line for an id supersedes an earlier one
        r = json.loads(line)
        records[r["id"]] = r
    rng = np.random.default_rng(0)
    rows = [example_figures(r, args.draws, rng) for r in records.values()]
    n_lds = {r["truth"]["settings"]["n_lds"] for r in records.values()}
    names = list(rows[0])
    ablations = "/".join(map(str, sorted(n_lds)))
    lines = [f"{len(rows)} examples, {ablations} LDS ablations each; mean LDS (± 95% interval)", "",
             "| scores | lds |", "|---|---|"]
    for name in names:
        v = np.array([r[name] for r in rows if name in r], dtype=np.float64)
        lines.append(f"| {name} | {np.nanmean(v):.3f} ± {1.96 * np.nanstd(v) / np.sqrt(len(v)):.3f} |")
    table = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
