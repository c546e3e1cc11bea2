"""The shared pass: one forward (and at most one backward) pass per batch serves every capture-based method."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .adapters import Adapter
from .context import Capture
from .heads import CLASSIFICATION, Head


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def run_capture(
    model: nn.Module,
    adapter: Adapter,
    inputs: dict[str, torch.Tensor],
    token_mask: torch.Tensor,
    stream: str,
    targets: torch.Tensor | None,
    target_kind: str,
    *,
    gradients: bool,
    head: Head = CLASSIFICATION,
    answer_mask: torch.Tensor | None = None,
) -> tuple[Capture, torch.Tensor]:
    """Run ``model`` once on a padded batch, keeping attention probabilities and hidden states, and, if
    ``gradients``, take the gradients of the summed per-example target scalars w.r.t. all of them in one
    backward pass (:func:`torch.autograd.grad`: nothing is written to ``.grad`` and weight gradients are never
    computed). ``targets=None`` explains each example's predicted class (QA: the best span within ``answer_mask``).
    Returns the capture and the targets.
    """
    store: dict[str, torch.Tensor] = {}

    def keep_embeddings(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        # The embedding output is the graph's leaf when the parameters are frozen; make it require grad so
        # the backward reaches attention and hidden states either way.
        if "embeddings" not in store:
            if torch.is_grad_enabled() and not output.requires_grad:
                output.requires_grad_(True)
            store["embeddings"] = output
        return output

    handle = adapter.embedding_module(model).register_forward_hook(keep_embeddings)
    try:
        with torch.set_grad_enabled(gradients):
            outputs = model(**inputs, output_attentions=True, output_hidden_states=True, return_dict=True)
    finally:
        handle.remove()

    cls = adapter.classification_index(inputs["input_ids"], token_mask, model.config)
    stream_tensors = adapter.select(outputs, stream, token_mask, cls)
    logits = head.logits(outputs)
    if targets is None:
        targets = head.predicted(logits, token_mask, answer_mask)
    embeddings = store.get("embeddings")

    capture = Capture(
        logits=logits.detach(),
        attentions=[a.detach() for a in stream_tensors.attentions],
        query_mask=stream_tensors.query_mask,
        key_mask=stream_tensors.key_mask,
        query_weights=stream_tensors.query_weights.to(logits.dtype),
        self_attention=stream_tensors.self_attention,
        hidden=[h.detach() for h in stream_tensors.hidden],
        embeddings=None if embeddings is None else embeddings.detach(),
    )
    if gradients:
        wanted = _unique(list(stream_tensors.attentions) + list(stream_tensors.hidden) + [embeddings])
        y = head.scalar(logits, targets, target_kind, token_mask).sum()
        grads = torch.autograd.grad(y, wanted, allow_unused=True)
        by_id = {id(t): (g if g is not None else torch.zeros_like(t)) for t, g in zip(wanted, grads, strict=True)}
        capture.attention_grads = [by_id[id(a)].detach() for a in stream_tensors.attentions]
        capture.hidden_grads = [by_id[id(h)].detach() for h in stream_tensors.hidden]
        capture.embedding_grads = by_id[id(embeddings)].detach()
    return capture, targets
