"""Speed of the LRP methods and of attention flow on a real model.

Figures: the time of ``partiallrp + transatt + attnlrp`` (one shared capture pass for ∇A plus one LRP pass per
batch) divided by the time of one plain forward + backward over the same batches (gradient of the target logits
w.r.t. the embeddings, eager attention), and attention flow's seconds per sentence.

Run: ``OMP_WAIT_POLICY=PASSIVE python bench/lrp_flow_speed.py [model_dir] [--n N] [--batch-size 32]``
(default: ``../shared/models/minilm-sst2`` on the SST-2 dev set).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import attnlens.methods.lrp_methods  # noqa: F401  (registers the LRP methods)
from attnlens import Explainer
from attnlens.lrp import lrp_pass

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "minilm-sst2"
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "sst2" / "dev.jsonl"
LRP_METHODS = ["partiallrp", "transatt", "attnlrp"]


def _batches(ex: Explainer, texts: list[str], batch_size: int) -> list[dict[str, torch.Tensor]]:
    encoded = ex.encode(texts)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))  # as Explainer.explain batches
    out = []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        inputs, _ = ex._inputs([encoded[i].ids for i in idx], [encoded[i].type_ids for i in idx])
        out.append(inputs)
    return out


def _plain_forward_backward(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Seconds for one forward and one backward (to the embeddings) per batch, eager attention."""
    emb = model.get_input_embeddings()
    leaf: dict[str, torch.Tensor] = {}

    def hook(_m, _i, out):
        leaf["x"] = out.detach().requires_grad_(True)
        return leaf["x"]

    handle = emb.register_forward_hook(hook)
    try:
        start = time.perf_counter()
        for inputs in batches:
            logits = model(**inputs).logits
            target = logits.gather(1, logits.detach().argmax(-1, keepdim=True)).sum()
            torch.autograd.grad(target, leaf["x"])
        return time.perf_counter() - start
    finally:
        handle.remove()


def run(model_dir: str | Path, texts: list[str], batch_size: int = 32) -> dict:
    """Time the LRP methods and flow on ``texts``; returns the figures as a dict."""
    ex = Explainer.from_pretrained(model_dir)
    model = ex.model.eval()
    batches = _batches(ex, texts, batch_size)
    _plain_forward_backward(model, batches[:1])  # warm-up
    plain = _plain_forward_backward(model, batches)

    start = time.perf_counter()
    for inputs in batches:
        with torch.no_grad():
            targets = model(**inputs).logits.argmax(-1)
        lrp_pass(model, inputs, targets)
    lrp_only = time.perf_counter() - start

    start = time.perf_counter()
    ex.explain(texts, methods=LRP_METHODS, batch_size=batch_size)
    lrp_methods = time.perf_counter() - start

    start = time.perf_counter()
    ex.explain(texts, methods=["rawatt"], batch_size=batch_size)
    forward_only = time.perf_counter() - start
    flow_texts = texts[: min(len(texts), 200)]
    start = time.perf_counter()
    ex.explain(flow_texts, methods=["flow"], batch_size=batch_size)
    flow_total = time.perf_counter() - start
    # flow's own cost: subtract the engine's forward pass (measured with rawatt on the same texts, scaled)
    flow_per_sentence = max(flow_total - forward_only * len(flow_texts) / len(texts), 0.0) / len(flow_texts)
    n_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    return {
        "model": str(model_dir),
        "n_texts": len(texts),
        "mean_tokens": n_tokens / len(texts),
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
        "plain_forward_backward_s": plain,
        "lrp_pass_s": lrp_only,
        "lrp_pass_ratio": lrp_only / plain,
        "lrp_methods_s": lrp_methods,
        "lrp_methods_ratio": lrp_methods / plain,
        "flow_s_per_sentence": flow_per_sentence,
        "flow_sentences": len(flow_texts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", default=str(DEFAULT_MODEL))
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="JSONL file with a 'text' field")
    parser.add_argument("--n", type=int, default=None, help="use the first N texts (default: all)")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with open(args.data, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    texts = texts[: args.n] if args.n else texts
    figures = run(args.model_dir, texts, args.batch_size)
    for key, value in figures.items():
        print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")


if __name__ == "__main__":
    main()
