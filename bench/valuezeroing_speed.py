"""What value zeroing costs, on ``../shared/models/minilm-sst2`` and SST-2 dev sentences (default: the first 128).

Value zeroing evaluates each layer's post-attention part (residual, norms, FFN) at every pair of a row and a token
it attends to, where the layer's anatomy is known (MiniLM's is), else reruns each of the L layers once per token;
the figure is its time through ``Explainer.explain`` divided by one plain forward+backward pass over the same
batches (interleaved batch by batch, as ``explain_speed.py`` times), plus the rollout method's ratio from the same
run for scale.

Run: ``python bench/valuezeroing_speed.py [--limit 128] [--batch-size 32]``.

Measured (2026-12-02, first 128 dev sentences, 24.9 tokens on average, batch 32, a 2-core AVX-512 Xeon):
plain forward+backward 1.01 s, valuezeroing 10.9 s = 10.8x, rollout 0.6x.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402

from common import batch_inputs, plain_forward_backward, setup, timed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=128, help="use only the first N dev sentences")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    texts, ex, batches = setup(args.limit, args.batch_size)
    totals = {"plain": 0.0, "valuezeroing": 0.0, "rollout": 0.0}
    for i, batch in enumerate([batches[0]] + batches):  # the first round is a warm-up
        inputs = batch_inputs(ex, batch)
        t = {"plain": plain_forward_backward(ex.model, inputs)}
        for method in ("valuezeroing", "rollout"):
            t[method] = timed(ex.explain, [e.text for e in batch], methods=[method], batch_size=args.batch_size)
        if i:
            for k, v in t.items():
                totals[k] += v
    print(f"plain forward+backward: {totals['plain']:.2f} s")
    for method in ("valuezeroing", "rollout"):
        print(f"{method}: {totals[method]:.2f} s, {totals[method] / totals['plain']:.1f}x the plain "
              f"forward+backward ({len(texts) / totals[method]:.1f} sentences/s)")


if __name__ == "__main__":
    main()
