"""How fast the norm-based and decomposition methods explain, on ``../shared/models/minilm-sst2`` and SST-2 dev.

Each of attnnorm, globenc, alti and decompx (and decompx with the authors' ``bias="absdot"``) through
``Explainer.explain`` (text to Explanation), as a ratio to one plain forward+backward pass over the same
batches (target: <= 2). Timings are interleaved batch by batch, so a drifting load on a shared
machine biases no ratio.

Run: ``python bench/decomposition_speed.py [--limit 256] [--batch-size 32]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402

from common import batch_inputs, plain_forward_backward, setup, timed  # noqa: E402

RUNS = {  # label -> (method, options)
    "attnnorm": ("attnnorm", {}),
    "globenc": ("globenc", {}),
    "alti": ("alti", {}),
    "decompx": ("decompx", {}),
    "decompx bias=absdot": ("decompx", {"bias": "absdot"}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=256, help="the first N dev sentences (0: all 872)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    texts, ex, batches = setup(args.limit or None, args.batch_size)
    totals = dict.fromkeys(["plain", *RUNS], 0.0)
    for i, batch in enumerate([batches[0]] + batches):  # the first round is a warm-up
        inputs = batch_inputs(ex, batch)
        times = {"plain": plain_forward_backward(ex.model, inputs)}
        for label, (method, options) in RUNS.items():
            times[label] = timed(ex.explain, [e.text for e in batch], methods=[method],
                                 options={method: options}, batch_size=args.batch_size)
        if i:
            for k, v in times.items():
                totals[k] += v
    print(f"plain forward+backward (gradient to the embeddings): {totals['plain']:.2f} s")
    for label in RUNS:
        print(f"{label:20s} {totals[label]:7.2f} s  {totals[label] / totals['plain']:5.2f}x the plain pass "
              "(target <= 2)")


if __name__ == "__main__":
    main()
