"""Peak resident memory of ``Explainer.explain`` per method and input length, on ``../shared/models/minilm-sst2``.

Each case (a method, or ``all``, at one length) runs in a fresh process: load the model, warm up on one short
input, then explain ``--inputs`` inputs of exactly that many tokens (batch size 32, the default memory budget
unless ``--memory-budget``). Reported: the peak resident set of the process (``ru_maxrss``: model, torch and
everything) and its increase over the resident set before the call (Linux ``VmHWM`` reset through
``/proc/self/clear_refs``), in MiB, with the seconds of the call. Integrated gradients runs ``--ig-steps`` steps:
its peak is set by its internal batch (from the budget), not by the step count.

Run: ``python bench/memory.py [--lengths 32,128,256,512] [--methods all,rawatt,...] [--inputs 32]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(method: str, tokens: int, inputs: int, ig_steps: int, budget: str | None) -> dict[str, float]:
    """Peak RSS (MiB) of one explain call of ``inputs`` inputs of ``tokens`` tokens, in this process."""
    import warnings

    from common import MODEL, read_texts

    from attnlens import Explainer

    warnings.simplefilter("ignore")
    ex = Explainer.from_pretrained(MODEL, max_length=tokens)
    text = " ".join(read_texts(limit=60))  # long enough to fill `tokens` after truncation
    texts = [" ".join(text.split()[i:]) for i in range(inputs)]  # distinct inputs, all cut to `tokens`
    assert all(len(e.ids) == tokens for e in ex.encode(texts))
    methods: str | list[str] = method
    if method.startswith("all-"):  # every method but these ("all-flow": flow takes 25 s per 512-token input)
        from attnlens.methods import list_methods

        methods = [m for m in list_methods() if m not in method[4:].split("+")]
    ig = method.startswith("all") or method == "integratedgradients"
    options = {"integratedgradients": {"n_steps": ig_steps}} if ig else None
    ex.explain(["a fine film"], methods, options=options)  # warm-up: lazy imports, thread pools
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current resident size
    before = _status("VmRSS")
    start = time.perf_counter()
    ex.explain(texts, methods, batch_size=32, options=options, memory_budget=budget)
    seconds = time.perf_counter() - start
    return {"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "increase_mib": (_status("VmHWM") - before) / 2**20, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="32,128,256,512")
    parser.add_argument("--methods", default=None, help="comma-separated cases: method ids, all, or all-M1+M2 "
                        "(every method but M1, M2); default: every method, then all")
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--ig-steps", type=int, default=4)
    parser.add_argument("--memory-budget", default=None)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: METHOD TOKENS in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.inputs, args.ig_steps, args.memory_budget)))
        return
    if args.methods:
        cases = args.methods.split(",")
    else:
        from attnlens.methods import list_methods

        cases = [*list_methods(), "all"]
    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"minilm-sst2, {args.inputs} inputs per case, batch size 32, memory budget "
          f"{args.memory_budget or 'default (4 GiB)'}, IG {args.ig_steps} steps; peak RSS of a fresh process (MiB)")
    print("| method | " + " | ".join(f"{n} tokens: peak / increase / s" for n in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for case in cases:
        cells = []
        for n in lengths:
            # A fixed mmap threshold makes glibc return every large freed block at once, so RSS follows live memory.
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            cmd = [sys.executable, __file__, "--one", case, str(n), "--inputs", str(args.inputs),
                   "--ig-steps", str(args.ig_steps)] + (["--memory-budget", args.memory_budget]
                                                        if args.memory_budget else [])
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode:
                cells.append("failed: " + (out.stderr.strip().splitlines() or ["?"])[-1][:60])
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            cells.append(f"{r['peak_mib']:.0f} / {r['increase_mib']:.0f} / {r['seconds']:.1f}")
        print(f"| {case} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
