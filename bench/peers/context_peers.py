"""Run the peer context-attribution tools on attnlens's context benchmark examples, answers forced.

Methods: ``contextcite-N`` (ContextCite with N random ablations, LASSO surrogate; N = 32, 256, any number) and
``at2`` (AT2 with the estimator trained for SmolLM2 by train_at2.py). Each scores the examples file's sources
for the log-probability of the given answer; one output line per (example, method) with the wall time of that
example (the model loaded beforehand). Runs in the peers virtualenv, offline, on CPU:

    /work/peers-venv/bin/python bench/peers/context_peers.py --examples EX.jsonl --model DIR --out OUT.jsonl \\
        [--methods contextcite-32,contextcite-256,at2] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from peer_common import load_model, offline_nltk, read_examples

AT2_ESTIMATOR = Path(__file__).resolve().parent / "at2_smollm2_squad.json"


def make_scorer(method: str, args: argparse.Namespace):
    """``scores(model, tokenizer, example) -> array`` for one method name."""
    if method.startswith("contextcite-"):
        from contextcite_peer import contextcite_scores

        n = int(method.removeprefix("contextcite-"))
        return lambda model, tok, ex: contextcite_scores(model, tok, ex, num_ablations=n, batch_size=args.batch_size)
    if method == "at2":
        from at2_peer import at2_scores, load_estimator

        estimator = load_estimator(args.at2_estimator)
        return lambda model, tok, ex: at2_scores(model, tok, ex, estimator)
    raise SystemExit(f"unknown method {method!r}: contextcite-N or at2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", required=True, help="examples JSONL (id, context, query, answer, sources, gold)")
    parser.add_argument("--model", required=True, help="HuggingFace directory of the causal LM (SmolLM2)")
    parser.add_argument("--out", required=True, help="output JSONL: id, method, scores, seconds")
    parser.add_argument("--methods", default="contextcite-32,contextcite-256,at2")
    parser.add_argument("--limit", type=int, default=None, help="the first N examples only")
    parser.add_argument("--batch-size", type=int, default=8, help="ContextCite's ablation batch size")
    parser.add_argument("--at2-estimator", default=str(AT2_ESTIMATOR), help="AT2 estimator JSON (train_at2.py)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()

    offline_nltk()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    examples = read_examples(args.examples, args.limit)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    model, tokenizer = load_model(args.model)
    scorers = {m: make_scorer(m, args) for m in methods}
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    with open(args.out, "w", encoding="utf-8") as out, torch.inference_mode():
        for ex in examples:
            for method, scorer in scorers.items():
                t0 = time.perf_counter()
                scores = scorer(model, tokenizer, ex)
                took = time.perf_counter() - t0
                if scores.shape != (len(ex.sources),):
                    raise RuntimeError(f"{method} gave {scores.shape[0]} scores for {len(ex.sources)} sources")
                seconds[method].append(took)
                out.write(json.dumps({"id": ex.id, "method": method, "scores": [float(s) for s in scores],
                                      "seconds": round(took, 4)}) + "\n")
                out.flush()
                print(f"{ex.id} {method}: {took:.1f} s, top source {int(scores.argmax())} (gold {ex.gold})",
                      file=sys.stderr)
    print(f"{len(examples)} examples, torch threads {torch.get_num_threads()} -> {args.out}")
    for method, times in seconds.items():
        print(f"{method:>16}: {sum(times) / max(len(times), 1):8.2f} s per example")


if __name__ == "__main__":
    main()
