"""Shared pieces of the benchmarks: data, length-sorted batches as the engine makes them, the plain-pass baseline."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its thread pool

import torch  # noqa: E402

from attnlens import Explainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MODEL = SHARED / "models" / "minilm-sst2"
SST2_DEV = SHARED / "data" / "sst2" / "dev.jsonl"


def sst2_dev(limit: int | None = None) -> list[dict]:
    """SST-2 dev rows (``text``, ``label``), all 872 unless ``limit``."""
    rows = [json.loads(line) for line in SST2_DEV.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def engine_batches(ex: Explainer, texts: list[str], batch_size: int) -> list[dict[str, torch.Tensor]]:
    """Model inputs in the length-sorted batches :meth:`Explainer.explain` uses."""
    encoded = ex.encode(texts)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
    batches = []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        inputs, _ = ex._inputs([encoded[i].ids for i in idx], [encoded[i].type_ids for i in idx])
        batches.append(inputs)
    return batches


def plain_forward_backward(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], *,
                           weights: bool = False) -> float:
    """Seconds for one plain forward and one backward of the summed predicted-class logits per batch.

    ``weights=False`` differentiates w.r.t. the embedding output only (what any explanation needs at least);
    ``weights=True`` is a training-style ``loss.backward()`` that also computes every parameter gradient.
    """
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
            if weights:
                target.backward()
            else:
                torch.autograd.grad(target, leaf["x"])
        elapsed = time.perf_counter() - start
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    return elapsed
