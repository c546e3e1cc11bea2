"""Ablation methods over long prompts: each ablated prompt run on the key/value cache of the beginning it shares
with the whole prompt or with the ablated prompt before it, against the batched forwards of every ablated prompt
from its first token.

One SQuAD v1.1 evaluation-split question with its gold paragraph and enough distractor paragraphs to reach each
prompt length (passages as sources, the gold answer forced, as ``bench/cite_long.py`` builds them), attributed by
``--method`` (``loo`` or ``contextcite``) twice, each in a fresh process under ``/usr/bin/time -f %M`` (peak
resident memory, the model's weights included), at the default memory budget: once as ``attnlens cite`` runs it,
once with the cache switched off. The two give the same scores (the largest difference is printed) and the ratio
of their times is this run's.

Writes ``bench/data/METHOD_prefix_cache.json`` and ``.md``, keeping the lengths of earlier runs that this run does
not measure.

Run: ``python bench/prefix_cache.py [--method loo] [--tokens 1000 2000 4000]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from cite_long import example  # noqa: E402
from peak import measured  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("loo", "contextcite")


def outputs(method: str) -> tuple[Path, Path]:
    """The JSON and Markdown files of ``method``'s results."""
    stem = ROOT / "bench" / "data" / f"{method}_prefix_cache"
    return stem.with_suffix(".json"), stem.with_suffix(".md")


def run_case(method: str, tokens: int, cached: bool) -> dict:
    """``method`` on the example of ``tokens`` tokens in this process: seconds (the model loaded before), scores."""
    from attnlens import Explainer
    from attnlens.core import answer_engine

    if not cached:
        answer_engine.REUSE_SHARE = float("inf")  # every ablated prompt from its first token, batched
    e = example(tokens)
    ex = Explainer.from_pretrained("smollm2")
    start = time.perf_counter()
    r = ex.attribute_context(e.context, e.query, answer=e.answer, sources=[(s.start, s.end) for s in e.sources],
                             methods=[method])
    return {"seconds": time.perf_counter() - start, "prompt_tokens": len(r.prompt_tokens), "sources": len(r.sources),
            "scores": [float(v) for v in r.scores[method]]}


def table(results: list[dict]) -> str:
    lines = ["| prompt tokens | sources | cached: peak RSS, seconds | batched: peak RSS, seconds | × faster | "
             "largest score difference |", "|---|---|---|---|---|---|"]
    for r in results:
        c, b = r["cached"], r["batched"]
        if "seconds" not in c or "seconds" not in b:
            lines.append(f"| {r['tokens']} | — | {c.get('error', '')[:60]} | {b.get('error', '')[:60]} | — | — |")
            continue
        diff = max(abs(x - y) for x, y in zip(c["scores"], b["scores"], strict=True))
        lines.append(f"| {c['prompt_tokens']:,} | {c['sources']} | {c['peak_gib']:.2f} GiB, {c['seconds']:.1f} s | "
                     f"{b['peak_gib']:.2f} GiB, {b['seconds']:.1f} s | {b['seconds'] / c['seconds']:.2f} | "
                     f"{diff:.1e} nats |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=METHODS, default="loo")
    p.add_argument("--tokens", type=int, nargs="+", default=[1000, 2000])
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--one", nargs=3, metavar=("METHOD", "TOKENS", "CACHED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_case(args.one[0], int(args.one[1]), args.one[2] == "1")))
        return
    out_json, out_md = outputs(args.method)
    # earlier cases of other lengths are kept: a run measures only what it names
    kept = json.loads(out_json.read_text())["results"] if out_json.exists() else []
    results = []
    for tokens in args.tokens:
        row = {"tokens": tokens}
        for name, flag in (("cached", "1"), ("batched", "0")):
            row[name] = measured(__file__, ["--one", args.method, str(tokens), flag], args.timeout, {})
        results.append(row)
        print(json.dumps(row), flush=True)
    ran = {r["tokens"] for r in results}
    results = sorted([r for r in kept if r["tokens"] not in ran] + results, key=lambda r: r["tokens"])
    out_json.write_text(json.dumps({"results": results}, indent=1) + "\n")
    out_md.write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
