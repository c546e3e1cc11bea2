"""Context attribution over long prompts: peak memory and time of each method at the default memory budget.

One SQuAD v1.1 evaluation-split question with its gold paragraph and enough distractor paragraphs to reach the
prompt length asked for (passages as sources, the gold answer forced), attributed by one method at a time, each
in a fresh process under ``/usr/bin/time -f %M`` (peak resident memory, the model's weights included), with the
default memory budget (4 GiB). A method the budget refuses is recorded with the one line it printed.

Writes ``bench/data/cite_long.json`` and ``bench/data/cite_long.md``, keeping the cases of earlier runs that this
run does not measure (other methods or lengths).

Run: ``python bench/cite_long.py [--tokens 2000] [--methods at2 attngate rawatt ...]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak import measured  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["at2", "attngate", "rawatt", "inputxgradient", "decompx", "attnlrp", "at2lrp", "loo"]
OUT_JSON, OUT_MD = ROOT / "bench" / "data" / "cite_long.json", ROOT / "bench" / "data" / "cite_long.md"


def example(tokens: int):
    """The first evaluation question whose prompt, with as many distractors as needed, reaches ``tokens``."""
    from attnlens.sources.squad import squad_context

    for distractors in range(1, 60):
        (e,) = squad_context("eval", 1, distractors=distractors, sources="passage", seed=0)
        if len(e.context) / 4.2 >= tokens:  # about 4.2 characters per SmolLM2 token in SQuAD prose
            return e
    raise SystemExit(f"SQuAD dev has no prompt of {tokens} tokens")


def run_case(method: str, tokens: int) -> dict:
    """One method in this process: seconds (the model loaded before) and prompt length, or the refusal."""
    from attnlens import Explainer, InputError

    e = example(tokens)
    ex = Explainer.from_pretrained("smollm2")
    start = time.perf_counter()
    try:
        r = ex.attribute_context(e.context, e.query, answer=e.answer, sources=[(s.start, s.end) for s in e.sources],
                                 methods=[method])
    except InputError as exc:
        return {"refused": str(exc)}
    return {"seconds": time.perf_counter() - start, "prompt_tokens": len(r.prompt_tokens),
            "sources": len(r.sources), "gold_hit": int(r.ranked(method)[0][0] == e.gold)}


def measure(method: str, tokens: int, timeout: float) -> dict:
    return measured(__file__, ["--one", method, str(tokens)], timeout, {"method": method, "target_tokens": tokens})


def table(results: list[dict]) -> str:
    lines = ["| method | prompt tokens | sources | peak RSS | seconds | gold hit |", "|---|---|---|---|---|---|"]
    for r in results:
        if "seconds" in r:
            lines.append(f"| {r['method']} | {r['prompt_tokens']:,} | {r['sources']} | {r['peak_gib']:.2f} GiB | "
                         f"{r['seconds']:.1f} | {r['gold_hit']} |")
        else:
            why = r.get("refused") or r.get("error", "")
            lines.append(f"| {r['method']} | — | — | {r.get('peak_gib', float('nan')):.2f} GiB | refused: "
                         f"{why[:90]} | — |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2000, help="prompt length to reach (default 2000)")
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--one", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_case(args.one[0], int(args.one[1]))))
        return
    # earlier cases of other methods or lengths are kept: a run measures only what it names
    kept = json.loads(OUT_JSON.read_text())["results"] if OUT_JSON.exists() else []
    results = []
    for method in args.methods:
        results.append(measure(method, args.tokens, args.timeout))
        print(json.dumps(results[-1]), flush=True)
    ran = {(r["method"], r["target_tokens"]) for r in results}
    results = [r for r in kept if (r["method"], r.get("target_tokens", 2000)) not in ran] + results
    results.sort(key=lambda r: r.get("target_tokens", 2000))
    OUT_JSON.write_text(json.dumps({"results": results}, indent=1) + "\n")
    OUT_MD.write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
