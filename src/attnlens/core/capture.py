"""The shared pass: one forward (and at most one backward) pass per batch serves every capture-based method.

The pass keeps only what the requested methods declare (:func:`attnlens.methods.registry.capture_request`):
attention-only requests run without a graph and keep no hidden states, and gradients are taken only of the
tensors whose gradients some method reads. A new kind of tensor (e.g. value vectors, for a method that needs
them) is one constant in the registry's ``CAPTURED`` and one recorder below (a forward hook, as for the
embeddings).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from ..methods.registry import ATTENTION, CAPTURED, EMBEDDINGS, HIDDEN
from ..models.adapters import Adapter
from ..models.heads import CLASSIFICATION, Head
from ..models.prefixes import RowViews, last_token_rows, row_gradients
from .batch_state import Capture


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _without_hidden_states(outputs: Any) -> Any:
    """``outputs`` of a pass run without ``output_hidden_states``, with empty tuples where the adapters read
    hidden states (``hidden_states``, ``encoder_hidden_states``, ...)."""
    if dataclasses.is_dataclass(outputs):
        for f in dataclasses.fields(outputs):
            if f.name.endswith("hidden_states") and getattr(outputs, f.name) is None:
                setattr(outputs, f.name, ())
    return outputs


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
    keep: Collection[str] = CAPTURED,
    differentiate: Collection[str] | None = None,
    sequence: dict[str, torch.Tensor] | None = None,
) -> tuple[Capture, torch.Tensor]:
    """Run ``model`` once on a padded batch, keeping the tensors named in ``keep`` (attention probabilities,
    hidden states, input embeddings: the registry's ``ATTENTION``, ``HIDDEN``, ``EMBEDDINGS``), and, if
    ``gradients``, take the gradients of the summed per-example target scalars w.r.t. those in ``differentiate``
    (default: all of ``keep``) in one backward pass (:func:`torch.autograd.grad`: nothing is written to ``.grad``
    and weight gradients are never computed). What is not kept stays ``None`` in the capture.
    ``targets=None`` explains each example's predicted class (QA: the best span within ``answer_mask``).
    ``sequence``: inputs (a batch of one) of a causal sequence whose prefixes the batch's rows are (the steps of a
    generation, :attr:`BatchContext.sequence`): the model runs once, on it, and the capture holds its tensors
    viewed as the batch's rows; each row's gradients are of its own target, by batched vector-Jacobian
    products through that one forward (``is_grads_batched``).
    Returns the capture and the targets.
    """
    keep = frozenset(keep)
    differentiate = keep if differentiate is None else frozenset(differentiate) & keep
    gradients = gradients and bool(differentiate)
    store: dict[str, torch.Tensor] = {}

    def keep_embeddings(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        # The embedding output is the graph's leaf when the parameters are frozen; make it require grad so
        # the backward reaches attention and hidden states either way.
        if "embeddings" not in store:
            if torch.is_grad_enabled() and not output.requires_grad:
                output.requires_grad_(True)
            store["embeddings"] = output
        return output

    hooked = gradients or EMBEDDINGS in keep
    handle = adapter.embedding_module(model).register_forward_hook(keep_embeddings) if hooked else None
    try:
        with torch.set_grad_enabled(gradients):
            # Attention probabilities are always asked for: the adapters read the stream's layout from them.
            outputs = model(**(inputs if sequence is None else sequence), output_attentions=True,
                            output_hidden_states=HIDDEN in keep, return_dict=True)
    finally:
        if handle is not None:
            handle.remove()
    views = RowViews(token_mask.shape[0])
    if sequence is not None:  # the batch's rows are prefixes of the one sequence that ran
        outputs = views.outputs(outputs)
        if "embeddings" in store:
            store["embeddings"] = views.view(store["embeddings"])
    if HIDDEN not in keep:
        outputs = _without_hidden_states(outputs)

    positions = head.explained_positions(targets)  # token classification: the explained token's row
    if positions is None:
        cls = adapter.classification_index(inputs["input_ids"], token_mask, model.config)
    else:
        cls = positions
    stream_tensors = adapter.select(outputs, stream, token_mask, cls)
    weights = head.query_weights(targets, stream_tensors.query_mask.shape[1])
    if weights is not None:
        stream_tensors.query_weights = weights
    logits = head.logits(outputs)
    if targets is None:
        targets = head.predicted(logits, token_mask, answer_mask)
    recorded = {
        ATTENTION: list(stream_tensors.attentions),
        HIDDEN: list(stream_tensors.hidden),
        EMBEDDINGS: [store["embeddings"]] if "embeddings" in store else [],
    }

    def kept(kind: str, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        return [t.detach() for t in tensors] if kind in keep else None

    embeddings = kept(EMBEDDINGS, recorded[EMBEDDINGS])
    capture = Capture(
        logits=logits.detach(),
        attentions=kept(ATTENTION, recorded[ATTENTION]),
        query_mask=stream_tensors.query_mask,
        key_mask=stream_tensors.key_mask,
        query_weights=stream_tensors.query_weights.to(logits.dtype),
        self_attention=stream_tensors.self_attention,
        hidden=kept(HIDDEN, recorded[HIDDEN]),
        embeddings=embeddings[0] if embeddings else None,
    )
    if gradients:
        wanted = _unique([t for kind in sorted(differentiate) for t in recorded[kind]])
        if sequence is None:
            y = head.scalar(logits, targets, target_kind, token_mask)
            grads = torch.autograd.grad(y.sum(), wanted, allow_unused=True)
        else:  # row b's gradient is of y[b] alone: one vector-Jacobian product per row, batched
            last_logits, last_mask = last_token_rows(views.bases[id(logits)], token_mask)
            y = head.scalar(last_logits, targets, target_kind, last_mask)
            grads = row_gradients(y, [views.bases[id(t)] for t in wanted])
        by_id = {id(t): (g if g is not None else torch.zeros_like(t)) for t, g in zip(wanted, grads, strict=True)}

        def grads_of(kind: str) -> list[torch.Tensor] | None:
            return [by_id[id(t)].detach() for t in recorded[kind]] if kind in differentiate else None

        capture.attention_grads = grads_of(ATTENTION)
        capture.hidden_grads = grads_of(HIDDEN)
        embedding_grads = grads_of(EMBEDDINGS)
        capture.embedding_grads = embedding_grads[0] if embedding_grads else None
    return capture, targets
