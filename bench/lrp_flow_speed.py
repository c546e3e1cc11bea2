"""Speed of the LRP methods and of attention flow on a real model.

Figures: the time of ``partiallrp + transatt + attnlrp`` (one shared capture pass for ∇A plus one LRP pass per
batch and rule set: ``"chefer"`` for partiallrp and transatt, ``"attnlrp"`` for attnlrp) divided by the time of
one plain forward + backward over the same batches (gradient of the target logits w.r.t. the embeddings, eager
attention), one LRP pass alone of each rule set, and attention flow's seconds per sentence.

Run: ``OMP_WAIT_POLICY=PASSIVE python bench/lrp_flow_speed.py [model_dir] [--n N] [--batch-size 32]``
(default: ``../shared/models/minilm-sst2`` on the SST-2 dev set).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
from pathlib import Path

import torch
from common import MODEL, SST2_DEV, batch_inputs, engine_batches, plain_forward_backward, read_texts, timed

from attnlens import Explainer
from attnlens.lrp import lrp_pass
from attnlens.methods import get_method

LRP_METHODS = ["partiallrp", "transatt", "attnlrp"]


def run(model_dir: str | Path, texts: list[str], batch_size: int = 32, flow_texts: int = 200) -> dict:
    """Time the LRP methods and flow on ``texts``; returns the figures as a dict.

    The timings of each batch are interleaved (plain pass, LRP pass, the three LRP methods through the engine,
    flow, an attention-only engine call), so that a machine whose load drifts biases no ratio.
    """
    ex = Explainer.from_pretrained(model_dir)
    model = ex.model.eval()
    batches = engine_batches(ex, texts, batch_size)
    specs = [get_method(m) for m in LRP_METHODS]
    opts = {s.name: s.check_options({}) for s in specs}
    flow_spec, raw_spec = get_method("flow"), get_method("rawatt")
    totals = dict.fromkeys(("plain", "lrp_pass", "lrp_pass_chefer", "lrp_methods", "flow", "forward_only"), 0.0)
    n_flow = 0
    for i, batch in enumerate([batches[0]] + batches):  # the first run is a warm-up
        inputs = batch_inputs(ex, batch)
        with torch.no_grad():
            targets = model(**inputs).logits.argmax(-1)
        t = {
            "plain": plain_forward_backward(model, inputs),
            "lrp_pass": timed(lrp_pass, model, inputs, targets),
            "lrp_pass_chefer": timed(lrp_pass, model, inputs, targets, rules="chefer"),
            "lrp_methods": timed(ex.compute_batch, batch, [-1] * len(batch), specs, opts),
        }
        if n_flow < flow_texts:
            t["flow"] = timed(ex.compute_batch, batch, [-1] * len(batch), [flow_spec], {"flow": {}})
            t["forward_only"] = timed(ex.compute_batch, batch, [-1] * len(batch), [raw_spec], {"rawatt": {}})
            n_flow += len(batch) if i else 0
        if i:
            for k, v in t.items():
                totals[k] += v
    n_tokens = sum(len(e.ids) for b in batches for e in b)
    return {
        "model": str(model_dir),
        "n_texts": len(texts),
        "mean_tokens": n_tokens / len(texts),
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
        "plain_forward_backward_s": totals["plain"],
        "lrp_pass_s": totals["lrp_pass"],
        "lrp_pass_ratio": totals["lrp_pass"] / totals["plain"],
        "lrp_pass_chefer_ratio": totals["lrp_pass_chefer"] / totals["plain"],
        "lrp_methods_s": totals["lrp_methods"],
        "lrp_methods_ratio": totals["lrp_methods"] / totals["plain"],
        # flow's own cost: the engine call with flow minus the same call with an attention-only method
        "flow_s_per_sentence": max(totals["flow"] - totals["forward_only"], 0.0) / max(n_flow, 1),
        "flow_sentences": n_flow,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", default=str(MODEL))
    parser.add_argument("--data", default=str(SST2_DEV), help="JSONL file with a 'text' field")
    parser.add_argument("--n", type=int, default=None, help="use the first N texts (default: all)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    texts = read_texts(args.data, args.n)
    figures = run(args.model_dir, texts, args.batch_size)
    for key, value in figures.items():
        print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")


if __name__ == "__main__":
    main()
