"""Shared pieces of the benchmarks: data, length-sorted batches as the engine makes them, the plain-pass baseline.

Timings that are compared are interleaved batch by batch, so that the drifting load of a shared machine biases
no ratio.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its thread pool

import torch  # noqa: E402

from attnlens import Explainer  # noqa: E402
from attnlens.explainer import Encoded  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MODEL = SHARED / "models" / "minilm-sst2"
SST2_DEV = SHARED / "data" / "sst2" / "dev.jsonl"


def read_texts(path: str | Path = SST2_DEV, limit: int | None = None) -> list[str]:
    """The ``text`` field of a JSON Lines file (default: SST-2 dev, 872 sentences), the first ``limit``."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = [r["text"] for r in rows]
    return texts[:limit] if limit else texts


def engine_batches(ex: Explainer, texts: list[str], batch_size: int) -> list[list[Encoded]]:
    """Encoded inputs in the length-sorted batches :meth:`Explainer.explain` makes."""
    encoded = ex.encode(texts)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
    return [[encoded[i] for i in order[s : s + batch_size]] for s in range(0, len(order), batch_size)]


def batch_inputs(ex: Explainer, batch: list[Encoded]) -> dict[str, torch.Tensor]:
    """Padded model inputs of one engine batch."""
    inputs, _ = ex.runner.inputs([e.ids for e in batch], [e.type_ids for e in batch])
    return inputs


def embedding_leaf(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], Any]:
    """A forward hook making the input-embedding output a fresh leaf that requires grad (``leaf["x"]`` after each
    forward), so a plain pass can differentiate w.r.t. it without weight gradients; remove the returned handle."""
    leaf: dict[str, torch.Tensor] = {}

    def hook(_m: torch.nn.Module, _i: Any, out: torch.Tensor) -> torch.Tensor:
        leaf["x"] = out.detach().requires_grad_(True)
        return leaf["x"]

    return leaf, model.get_input_embeddings().register_forward_hook(hook)


def setup(limit: int | None, batch_size: int) -> tuple[list[str], Any, list[list[Any]]]:
    """The SST-2 dev texts, the reference model's explainer and its length-sorted batches; prints the header line
    every speed benchmark starts with."""
    from peak import machine

    from attnlens import Explainer

    texts = read_texts(limit=limit)
    ex = Explainer.from_pretrained(MODEL)  # eager attention, as every attention method needs
    batches = engine_batches(ex, texts, batch_size)
    n_tokens = sum(len(e.ids) for b in batches for e in b)
    print(f"model {MODEL.name}; {len(texts)} sentences, {n_tokens / len(texts):.1f} tokens on average; "
          f"batch {batch_size}; {torch.get_num_threads()} threads; {machine()}")
    return texts, ex, batches


def plain_forward_backward(model: torch.nn.Module, inputs: dict[str, torch.Tensor], *, weights: bool = False) -> float:
    """Seconds for one plain forward and one backward of the summed predicted-class logits of a batch.

    ``weights=False`` differentiates w.r.t. the embedding output only (what any explanation needs at least);
    ``weights=True`` is a training-style ``backward()`` that also computes every parameter gradient.
    """
    leaf, handle = embedding_leaf(model)
    try:
        start = time.perf_counter()
        logits = model(**inputs).logits
        target = logits.gather(1, logits.detach().argmax(-1, keepdim=True)).sum()
        if weights:
            target.backward()
        else:
            torch.autograd.grad(target, leaf["x"])
        return time.perf_counter() - start
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start
