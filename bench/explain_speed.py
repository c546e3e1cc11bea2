"""How fast attnlens explains: all fast methods from one shared pass vs. a plain forward+backward, and vs. the
reference implementations' way (one example at a time, one pass per method).

Run: ``python bench/explain_speed.py [--limit N] [--loop-examples 50] [--batch-size 32]``
on ``../shared/models/minilm-sst2`` and the SST-2 dev set (872 sentences). Targets (issue 2): ratio to a plain
forward+backward <= 1.3; examples/s >= 20x the single-example, one-pass-per-method loop.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from common import MODEL, engine_batches, plain_forward_backward, sst2_dev

from attnlens import Explainer

FAST = ["rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat", "saliency", "inputxgradient"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, help="explain only the first N dev sentences")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--loop-examples", type=int, default=50, help="examples timed in the one-at-a-time loop")
    parser.add_argument("--repeats", type=int, default=3, help="take the fastest of this many runs")
    args = parser.parse_args()

    texts = [r["text"] for r in sst2_dev(args.limit)]
    ex = Explainer.from_pretrained(MODEL)  # eager attention
    model = ex.model
    batches = engine_batches(ex, texts, args.batch_size)
    n_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    print(f"model {MODEL.name}, {len(texts)} sentences, {n_tokens} tokens, batch {args.batch_size}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")

    ex.explain(texts[: args.batch_size], methods=FAST, batch_size=args.batch_size)  # warm-up
    model.eval()
    plain_grad, plain_weights, ours = [], [], []
    for _ in range(args.repeats):  # interleaved, so background load hits all three alike
        plain_grad.append(plain_forward_backward(model, batches))
        plain_weights.append(plain_forward_backward(model, batches, weights=True))
        start = time.perf_counter()
        ex.explain(texts, methods=FAST, batch_size=args.batch_size)
        ours.append(time.perf_counter() - start)
    t_plain, t_weights, t_ours = min(plain_grad), min(plain_weights), min(ours)
    print(f"plain forward+backward (to the embeddings):      {t_plain:7.2f} s")
    print(f"plain forward+backward (with weight gradients):  {t_weights:7.2f} s")
    print(f"attnlens, {len(FAST)} methods from one shared pass:    {t_ours:7.2f} s  "
          f"({len(texts) / t_ours:.1f} examples/s)")
    print(f"ratio to plain forward+backward: {t_ours / t_plain:.2f} (target <= 1.3); "
          f"to a training-style backward: {t_ours / t_weights:.2f}")

    loop_texts = texts[: args.loop_examples]
    start = time.perf_counter()
    for text in loop_texts:
        for m in FAST:
            ex.explain([text], methods=[m], batch_size=1)
    t_loop = time.perf_counter() - start
    loop_rate = len(loop_texts) / t_loop
    print(f"one example at a time, one pass per method ({len(loop_texts)} examples): {t_loop:.2f} s "
          f"({loop_rate:.2f} examples/s; {len(texts) / loop_rate:.0f} s scaled to {len(texts)})")
    print(f"speed-up over the loop: {len(texts) / t_ours / loop_rate:.1f}x (target >= 20x)")


if __name__ == "__main__":
    main()
