"""Source attribution at matched cost: attention gates against ContextCite with fewer ablations.

ContextCite's quality grows with its number of ablations, and so does its time. This bench puts the methods that
need no ablations beside ContextCite at 4, 8, 16 and 32 ablations, so that each can be read at the cost of another.

Two parts:

- ``--time N``: seconds per example of each case, on the first ``N`` examples of the evaluation split (SQuAD v1.1
  dev, articles at odd positions; the gold paragraph + 2 distractors; sentence sources; the gold answer forced),
  each case run once per example in turn in one process, so that the machine's drifting load biases no ratio.
- ``--runs NAME=DIR:METHOD ...``: quality from runs of ``attnlens benchmark --task context`` (each ``DIR`` holds
  ``records.jsonl``; the same examples and LDS ablations in every run): mean LDS, top-1 drop and gold hit per case,
  and each case's paired difference (mean ± 95% interval) against ``--against``.

Run (the runs as in docs/context-attribution.md, "At matched cost")::

    python bench/matched_cost.py --time 10 --runs "attngate (4 steps)=results/gate4:attngate" \\
        "contextcite (8)=results/cc8:contextcite" ... --against "attngate (4 steps)" \\
        --out bench/data/context_matched_cost.md
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from attnlens import Explainer
from attnlens.sources.squad import squad_context

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
CASES: dict[str, tuple[str, dict]] = {
    "attngate": ("attngate", {}),
    "attngate (4 steps)": ("attngate", {"attngate": {"steps": 4}}),
    **{f"contextcite ({k})": ("contextcite", {"contextcite": {"n_ablations": k}}) for k in (4, 8, 16, 32)},
}
METRICS = ("lds", "top1_drop", "gold_hit")


def seconds_per_example(n: int, model: str = "smollm2") -> dict[str, float]:
    """Mean seconds per example of every case in :data:`CASES`, interleaved example by example."""
    ex = Explainer.from_pretrained(model)
    examples = squad_context("eval", n, distractors=2, sources="sentence", root=DATA)
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for example in examples:
        spans = [(s.start, s.end) for s in example.sources]
        for case, (method, options) in CASES.items():
            start = time.perf_counter()
            ex.attribute_context(example.context, example.query, answer=example.answer, sources=spans,
                                 methods=[method], options=options)
            times[case].append(time.perf_counter() - start)
    return {case: float(np.mean(t)) for case, t in times.items()}


def read_runs(specs: Sequence[str]) -> dict[str, dict[str, dict[str, float]]]:
    """``{case: {example id: {metric: value}}}`` from ``NAME=DIR:METHOD`` specs (a record rewritten later in a
    run's file replaces the earlier one)."""
    runs: dict[str, dict[str, dict[str, float]]] = {}
    for spec in specs:
        name, _, where = spec.partition("=")
        folder, _, method = where.rpartition(":")
        rows: dict[str, dict[str, float]] = {}
        for line in (Path(folder) / "records.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                if method in record["methods"]:
                    rows[record["id"]] = record["methods"][method]
        runs[name] = rows
    return runs


def interval(values: np.ndarray) -> str:
    """Mean ± 1.96 standard errors, signed (the benchmark's intervals)."""
    return f"{values.mean():+.3f} ± {1.96 * values.std(ddof=1) / math.sqrt(len(values)):.3f}"


def report(runs: dict[str, dict[str, dict[str, float]]], against: str, seconds: dict[str, float]) -> str:
    """Markdown: per case its means and time; per other case the paired difference ``against`` − it."""
    ids = sorted(set.intersection(*(set(rows) for rows in runs.values())))
    column = {name: {m: np.array([rows[i][m] for i in ids], dtype=float) for m in METRICS}
              for name, rows in runs.items()}
    lines = [f"{len(ids)} examples of the evaluation split.", "",
             "| method | lds | top1_drop | gold_hit | seconds |", "|---|---|---|---|---|"]
    for name, values in column.items():
        time_cell = f"{seconds[name]:.2f}" if name in seconds else "—"
        lines.append(f"| {name} | " + " | ".join(f"{values[m].mean():.3f}" for m in METRICS) + f" | {time_cell} |")
    lines += ["", f"| {against} − | lds | top1_drop | gold_hit | time ratio |", "|---|---|---|---|---|"]
    for name, values in column.items():
        if name == against:
            continue
        ratio = f"{seconds[against] / seconds[name]:.2f}" if against in seconds and name in seconds else "—"
        lines.append(f"| {name} | " + " | ".join(interval(column[against][m] - values[m]) for m in METRICS)
                     + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time", type=int, default=0, metavar="N", help="time every case on N examples")
    parser.add_argument("--runs", nargs="*", default=[], metavar="NAME=DIR:METHOD")
    parser.add_argument("--against", default="attngate (4 steps)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    seconds = seconds_per_example(args.time) if args.time else {}
    text = (f"Seconds per example: mean over the first {args.time} examples, every case in one process.\n\n"
            if seconds else "")
    if args.runs:
        text += report(read_runs(args.runs), args.against, seconds)
    else:
        text += "| method | seconds |\n|---|---|\n" + "".join(f"| {c} | {s:.2f} |\n" for c, s in seconds.items())
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    print(text, end="")


if __name__ == "__main__":
    main()
