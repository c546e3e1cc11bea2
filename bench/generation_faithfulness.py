"""Faithfulness of every method on a decoder-only LLM's next token: SmolLM2-135M-Instruct (``--model smollm2``).

Two tasks (:func:`attnlens.evaluation.nexttoken.run_next_token_benchmark`):

1. Zero-shot SST-2: ``"Review: {text}\\nSentiment (positive or negative):"``; the model's choice between
   ``" positive"`` and ``" negative"`` is explained as the contrast chosen − other; AOPC tracks the chosen
   token's probability renormalised over the two (the zero-shot classifier's p(ŷ)). First ``--sst2`` dev sentences.
2. Factual prompts (``bench/data/factual_prompts.jsonl``, 20 capitals and 12 authors):
   ``"Fact: {text}"`` with the first token of the expected answer explained (its logit) and its vocabulary
   probability tracked.

Only the ``{text}`` tokens are ever taken out. AOPC deletes the top 0, 10, ..., 100% (higher is better), LOdds
replaces them by the pad token (lower is better). Run: ``python bench/generation_faithfulness.py [--sst2 100]
[--methods all] [--ig-steps 20] [--json out.json]``; prints a Markdown table. A long SST-2 run can go in chunks
(``--tasks SST-2 --sst2-from 50 --sst2 50 --json part2.json``, also in parallel processes), joined with
``--merge part1.json part2.json --json all.json`` (per-example rows concatenated, means recomputed); a run of
other methods over the same examples (``--methods attnnorm,alti``) adds them the same way.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from common import SST2_DEV  # noqa: E402

from attnlens import Explainer  # noqa: E402
from attnlens.evaluation.nexttoken import PromptExample, run_next_token_benchmark  # noqa: E402

FACTS = Path(__file__).resolve().parent / "data" / "factual_prompts.jsonl"
SST2_TEMPLATE = "Review: {text}\nSentiment (positive or negative):"
FACT_TEMPLATE = "Fact: {text}"


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def table(results: dict[str, dict]) -> str:
    """One Markdown table: a row per method, AOPC and LOdds per task."""
    tasks = list(results)
    head = "| method | " + " | ".join(f"{t} AOPC ↑ | {t} LOdds ↓" for t in tasks) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(tasks)]
    methods = list(next(iter(results.values()))["methods"])
    for m in sorted(methods, key=lambda m: -(results[tasks[0]]["methods"][m]["aopc"] or 0.0)):
        cells = []
        for t in tasks:
            r = results[t]["methods"][m]
            cells += [f"{r['aopc']:.3f}", f"{r['lodds']:.2f}"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merge(runs: list[dict]) -> dict:
    """One result from runs of the same task: chunks of the same methods over different examples are concatenated
    (in the order given), and a run of other methods over the same examples (same ids, in the same order) adds
    its methods to them; accuracy and per-method means are recomputed (a metric missing on an example is left out
    of its mean), seconds added."""
    results: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    for run in runs:
        for name, r in run["results"].items():
            seconds[name] = seconds.get(name, 0.0) + run["seconds"][name]
            into = results.get(name)
            if into is None:
                results[name] = {**r, "examples": [dict(e) for e in r["examples"]], "methods": dict(r["methods"])}
            elif set(into["methods"]) == set(r["methods"]):
                into["examples"] += [dict(e) for e in r["examples"]]
            elif [e["id"] for e in into["examples"]] == [e["id"] for e in r["examples"]] and \
                    not set(into["methods"]) & set(r["methods"]):
                for e, extra in zip(into["examples"], r["examples"]):
                    e.update({m: extra[m] for m in r["methods"]})
                into["methods"].update(r["methods"])
            else:
                raise SystemExit(f"{name}: merge chunks of the same methods, or runs of different methods over the "
                                 "same examples")
    for r in results.values():
        rows = r["examples"]
        r["n"] = len(rows)
        r["accuracy"] = sum(bool(e["correct"]) for e in rows) / len(rows)
        for m, metrics in r["methods"].items():
            for k in metrics:
                values = [e[m][k] for e in rows if e[m].get(k) is not None]
                metrics[k] = sum(values) / len(values) if values else None
    return {"results": results, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sst2", type=int, default=100, help="N SST-2 dev sentences (from --sst2-from)")
    parser.add_argument("--facts", type=int, default=None, help="first N factual prompts (default: all 32)")
    parser.add_argument("--methods", default="all")
    parser.add_argument("--ig-steps", type=int, default=20, help="integrated gradients' steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", help="write the full results (per example) here")
    parser.add_argument("--tasks", default="facts,SST-2", help="which tasks to run (comma-separated)")
    parser.add_argument("--sst2-from", type=int, default=0, help="skip the first K SST-2 dev sentences")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="join the results of chunked runs (see above)")
    args = parser.parse_args()
    if args.merge:
        merged = merge([json.loads(Path(f).read_text(encoding="utf-8")) for f in args.merge])
        if args.json:
            Path(args.json).write_text(json.dumps(merged, indent=1) + "\n")
        print(table(merged["results"]))
        return

    ex = Explainer.from_pretrained("smollm2")
    opts = {"integratedgradients": {"n_steps": args.ig_steps}} if args.methods in ("all",) or (
        "integratedgradients" in args.methods) else None
    sst2 = [PromptExample(str(r.get("idx", i)), r["text"].strip(), label=int(r["label"]))
            for i, r in enumerate(read_jsonl(SST2_DEV, args.sst2_from + args.sst2)) if i >= args.sst2_from]
    facts = [PromptExample(r["id"], r["text"], r["answer"]) for r in read_jsonl(FACTS, args.facts)]
    results, seconds = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "skipping ..." for the methods that do not apply to LMs
        for name, examples, kwargs in (
            ("facts", facts, {"template": FACT_TEMPLATE}),
            ("SST-2", sst2, {"template": SST2_TEMPLATE, "choices": [" negative", " positive"]}),
        ):
            if name not in args.tasks.split(","):
                continue
            t0 = time.perf_counter()
            results[name] = run_next_token_benchmark(ex, examples, methods=args.methods, batch_size=args.batch_size,
                                                     options=opts, **kwargs)
            seconds[name] = time.perf_counter() - t0
            r = results[name]
            print(f"{name}: {r['n']} prompts, accuracy {r['accuracy']:.3f}, mean p(explained token) "
                  f"{sum(e['p'] for e in r['examples']) / r['n']:.3f}, {seconds[name]:.0f} s", flush=True)
            if args.json:  # after each task: a long run keeps what it finished
                Path(args.json).write_text(json.dumps({"results": results, "seconds": seconds}, indent=1) + "\n")
    print()
    print(table(results))


if __name__ == "__main__":
    main()
