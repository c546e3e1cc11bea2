"""How much memory does generating an answer hold beside the model, before anything is explained?

``attnlens explain --generate`` and ``attnlens cite`` without ``--answer`` generate greedily first; the memory
budget is checked before that (at the prompt's length plus one token). Generating runs fused attention with the
key/value cache and computes the logits of the last position only, so it holds far less than explaining. Per
prompt length, a fresh process loads SmolLM2-135M-Instruct, warms up on a short prompt, resets the peak (Linux
``VmHWM`` through ``/proc/self/clear_refs``) and generates ``--new-tokens`` tokens greedily after a prompt of IMDB
reviews of that many tokens. Reported: the peak resident memory beyond what the process held before the call
(the model's weights are outside it) and the seconds the call took.

Run: ``python bench/generate_memory.py [--lengths 2048 4096 8100] [--new-tokens 4]
[--out bench/data/generate_memory.md]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak import ROOT, machine, measured, process_status  # noqa: E402

LENGTHS = (2048, 4096, 8100)


def case(n: int, new_tokens: int) -> dict:
    """One prompt length in this process: the peak beyond the process's resident memory before the call, and
    the seconds it took."""
    from long_context import _ids

    from attnlens import Explainer
    from attnlens.core.generation_engine import greedy

    ex = Explainer.from_pretrained("smollm2")
    prompt_ids, _ = _ids(ex, n, 0)
    greedy(ex.runner, prompt_ids[:16], 2)  # warm-up
    Path("/proc/self/clear_refs").write_text("5")
    before = process_status("VmRSS")
    start = time.perf_counter()
    generated = greedy(ex.runner, prompt_ids, new_tokens)
    seconds = time.perf_counter() - start
    peak = process_status("VmHWM") - before
    return {"prompt_tokens": len(prompt_ids), "new_tokens": len(generated), "peak_gib": peak / 2**30,
            "seconds": seconds}


def table(results: list[dict]) -> str:
    rows = ["| prompt tokens | new tokens | peak beyond the model, GiB | seconds |", "|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['prompt_tokens']:,} | — | {r['error']} | — |")
            continue
        rows.append(f"| {r['prompt_tokens']:,} | {r['new_tokens']} | {r['peak_gib']:.2f} | {r['seconds']:.1f} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "data" / "generate_memory.md")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(case(args.one, args.new_tokens)))
        return
    results = []
    for n in args.lengths:
        # the case's own peak (growth beyond the process before the call) replaces the process's whole one
        found = measured(__file__, ["--one", str(n), "--new-tokens", str(args.new_tokens)], args.timeout,
                         {"prompt_tokens": n})
        results.append(found)
        print(json.dumps(found), flush=True)
    text = ("SmolLM2-135M-Instruct generating greedily after a prompt of IMDB reviews; each length in a fresh "
            "process, the peak resident memory beyond the process's before the call.\n\n" + table(results)
            + f"\nMeasured on {machine()}.\n")
    args.out.write_text(text, encoding="utf-8")
    args.out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in results), encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
