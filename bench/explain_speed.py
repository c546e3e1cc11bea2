"""How fast attnlens explains, on ``../shared/models/minilm-sst2`` and the SST-2 dev set (872 sentences).

1. The ten fast methods (rawatt, rollout, grads, attgrads, agrad, gae, cat, attcat, saliency, inputxgradient)
   through ``Explainer.explain`` (one shared forward/backward pass per batch), divided by one plain
   forward+backward pass over the same batches. Target: <= 1.3.
2. Examples/s against a loop over single examples with one pass per method, as the reference code works
   (timed on ``--loop-examples`` sentences, scaled). Target: >= 20x.
3. The LRP methods (partiallrp + transatt + attnlrp) as a ratio to the plain pass (target <= 4) and attention
   flow's seconds per sentence (``lrp_flow_speed.run``).

Run: ``python bench/explain_speed.py [--limit N] [--batch-size 32] [--loop-examples 50] [--no-lrp]``.
Timings that are compared are interleaved batch by batch on this shared machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402

from common import MODEL, batch_inputs, plain_forward_backward, setup, timed  # noqa: E402

FAST = ["rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat", "saliency", "inputxgradient"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, help="use only the first N dev sentences")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--loop-examples", type=int, default=50, help="examples timed in the one-at-a-time loop")
    parser.add_argument("--no-lrp", action="store_true", help="skip the LRP and flow figures")
    args = parser.parse_args()

    texts, ex, batches = setup(args.limit, args.batch_size)
    model = ex.model.eval()

    totals = {"plain": 0.0, "plain_weights": 0.0, "attnlens": 0.0}
    for i, batch in enumerate([batches[0]] + batches):  # the first round is a warm-up
        inputs = batch_inputs(ex, batch)
        t = {
            "plain": plain_forward_backward(model, inputs),
            "plain_weights": plain_forward_backward(model, inputs, weights=True),
            # end to end, from text to Explanation objects (tokenization included)
            "attnlens": timed(ex.explain, [e.text for e in batch], methods=FAST, batch_size=args.batch_size),
        }
        if i:
            for k, v in t.items():
                totals[k] += v
    ratio = totals["attnlens"] / totals["plain"]
    print(f"plain forward+backward (gradient to the embeddings): {totals['plain']:7.2f} s")
    print(f"plain forward+backward (with weight gradients):      {totals['plain_weights']:7.2f} s")
    print(f"attnlens, {len(FAST)} methods from one shared pass:        {totals['attnlens']:7.2f} s "
          f"({len(texts) / totals['attnlens']:.1f} examples/s)")
    print(f"ratio to the plain forward+backward: {ratio:.2f} (target <= 1.3); "
          f"to the training-style backward: {totals['attnlens'] / totals['plain_weights']:.2f}")

    loop_texts = texts[: args.loop_examples]
    loop = sum(timed(ex.explain, [text], methods=[m], batch_size=1) for text in loop_texts for m in FAST)
    loop_rate = len(loop_texts) / loop
    rate = len(texts) / totals["attnlens"]
    print(f"one example at a time, one pass per method ({len(loop_texts)} examples): {loop:.2f} s, "
          f"{loop_rate:.2f} examples/s ({len(texts) / loop_rate:.0f} s for {len(texts)})")
    print(f"speed-up of attnlens over that loop: {rate / loop_rate:.1f}x (target >= 20x)")

    if not args.no_lrp:
        from lrp_flow_speed import run

        lrp = run(MODEL, texts, args.batch_size)
        print(f"LRP methods (partiallrp + transatt + attnlrp): {lrp['lrp_methods_s']:.2f} s, "
              f"{lrp['lrp_methods_ratio']:.2f}x the plain forward+backward (target <= 4); an attnlrp pass alone "
              f"{lrp['lrp_pass_ratio']:.2f}x, a chefer pass {lrp['lrp_pass_chefer_ratio']:.2f}x, both from one "
              f"forward {lrp['lrp_passes_joint_ratio']:.2f}x")
        print(f"attention flow: {lrp['flow_s_per_sentence']:.4f} s per sentence ({lrp['flow_sentences']} sentences)")


if __name__ == "__main__":
    main()
