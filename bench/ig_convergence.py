"""Integrated gradients: completeness gap against the number of steps, per quadrature rule.

For each data set (SST-2 dev on minilm-sst2; IMDB test reviews cut to 256 tokens on minilm-imdb), each rule and
each step count, explains the inputs with ``integratedgradients`` (predicted class, logit) and reads the relative
completeness gap ``|Σ attributions - (F(x) - F(x'))| / |F(x) - F(x')|`` that attnlens records per input. Prints
the median and 90th percentile of the gap, the share of inputs within 1 %, and the seconds; then the same for the
adaptive schedule (``tolerance=0.01``) with the mean steps it used.

Run: ``python bench/ig_convergence.py [--sst2 100] [--imdb 30] [--steps 4,8,16,32,64]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from common import MODEL, SHARED, read_texts

from attnlens import Explainer

RULES = ("riemann_trapezoid", "riemann_middle", "gausslegendre")


def imdb_texts(limit: int) -> list[str]:
    """The first ``limit`` IMDB test reviews (the data set's sample file, in its order)."""
    lines = (SHARED / "data" / "imdb" / "test_sample2000_seed0.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines[:limit]]


def gaps(ex: Explainer, texts: list[str], options: dict, batch_size: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Relative gaps and steps per input, and the seconds of the run."""
    start = time.perf_counter()
    exps = ex.explain(texts, methods=["integratedgradients"], batch_size=batch_size,
                      options={"integratedgradients": options})
    seconds = time.perf_counter() - start
    meta = [e.meta["integratedgradients"] for e in exps]
    return np.array([m["relative_gap"] for m in meta]), np.array([m["n_steps"] for m in meta]), seconds


def table(name: str, ex: Explainer, texts: list[str], steps: list[int], rules: tuple[str, ...], tol: float,
          batch_size: int, adaptive: tuple[str, ...]) -> None:
    lengths = [len(e.ids) for e in ex.encode(texts)]
    print(f"\n{name}: {len(texts)} inputs, {np.mean(lengths):.0f} tokens on average (max {max(lengths)})")
    print(f"| rule | steps | median gap | p90 gap | within {tol:.0%} | seconds |")
    print("|---|---:|---:|---:|---:|---:|")
    for rule in rules:
        for n in steps:
            g, _, s = gaps(ex, texts, {"method": rule, "n_steps": n}, batch_size)
            print(f"| {rule} | {n} | {np.median(g):.2e} | {np.percentile(g, 90):.2e} | {np.mean(g <= tol):.0%} "
                  f"| {s:.1f} |", flush=True)
    for rule in adaptive:
        g, used, s = gaps(ex, texts, {"method": rule, "tolerance": tol}, batch_size)
        print(f"| {rule}, tolerance {tol} | {used.mean():.1f} (mean), {used.max()} (max) | {np.median(g):.2e} "
              f"| {np.percentile(g, 90):.2e} | {np.mean(g <= tol):.0%} | {s:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sst2", type=int, default=100, help="SST-2 dev sentences (0: skip)")
    parser.add_argument("--imdb", type=int, default=30, help="IMDB test reviews at --imdb-tokens (0: skip)")
    parser.add_argument("--imdb-tokens", type=int, default=256)
    parser.add_argument("--steps", default="4,8,16,32,64")
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--adaptive-rules", default=None, help="rules run with --tolerance (default: --rules)")
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    rules = tuple(args.rules.split(","))
    adaptive = tuple(args.adaptive_rules.split(",")) if args.adaptive_rules else rules
    if args.sst2:
        table("SST-2 dev, minilm-sst2", Explainer.from_pretrained(MODEL), read_texts(limit=args.sst2), steps, rules,
              args.tolerance, args.batch_size, adaptive)
    if args.imdb:
        ex = Explainer.from_pretrained(SHARED / "models" / "minilm-imdb", max_length=args.imdb_tokens)
        table(f"IMDB test, minilm-imdb, {args.imdb_tokens} tokens", ex, imdb_texts(args.imdb), steps, rules,
              args.tolerance, args.batch_size, adaptive)


if __name__ == "__main__":
    main()
