"""What a pass's forward saves for its backward, counted on the model itself.

A backward that does not recompute the layers holds what autograd saved in the forward: the linear layers'
inputs, the normalisations', the activation functions', the attention kernel's queries, keys, values and
output. How much that is per token differs by architecture (the feed-forward's width and gate, grouped key
heads) and by how the pass runs (LRP rules save tensors plain layers do not; a kernel given a mask may save
more than a causal one). Rather than list it, :func:`saved_per_token` runs the pass's forward on two short
probes of :data:`PROBE_TOKENS` tokens and counts what autograd saves; the difference per token is what the
estimates in :mod:`attnlens.core.memory` multiply by the length.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import InputError, ModelError
from ..models.feed_forward import saved_storages
from .batching import keeps_logits

# the probes' lengths: the count is the difference of what they save, per token (what does not grow with the
# length, such as the last position's logits, cancels)
PROBE_TOKENS = (16, 32)
Counts = weakref.WeakKeyDictionary  # per model, weak: a model is not kept alive by what was counted on it


def probe_inputs(model: nn.Module, n: int) -> dict[str, torch.Tensor]:
    """Two rows of ``n`` constant ids on ``model``'s device, the second with its first position padded, so that
    the attention runs with a mask as a padded batch's does (where a masked kernel keeps more, such as a copy of
    the key heads per query head, that is counted); an encoder-decoder's decoder reads as many tokens; a language
    model projects its last position alone. Constant ids: the count does not depend on them, and the global random
    state is left alone."""
    device = next(model.parameters()).device
    ids = torch.full((2, n), 1, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    if keeps_logits(model):
        inputs["logits_to_keep"] = 1
    return inputs


def saved_per_token(model: nn.Module, forward: Callable[[dict[str, torch.Tensor]], Any]) -> float | None:
    """Bytes autograd saves per token and row, parameters aside, while ``forward`` runs the pass's forward on
    :func:`probe_inputs` (the slope between the two probes' lengths); ``None`` where the weights are not
    materialised (the meta device) or ``forward`` fails on a probe."""
    try:
        if next(model.parameters()).device.type == "meta":
            return None
    except (AttributeError, StopIteration):
        return None
    sizes = []
    for n in PROBE_TOKENS:
        try:
            with torch.enable_grad(), saved_storages(model.parameters()) as saved:
                forward(probe_inputs(model, n))
                sizes.append(sum(saved.values()) / 2)
        except (RuntimeError, TypeError, ValueError, ModelError, InputError):  # a forward the probe cannot drive
            return None
    short, long = sizes
    if long < short:
        return None
    return (long - short) / (PROBE_TOKENS[1] - PROBE_TOKENS[0])


def counted(counts: Counts, model: nn.Module, key: Any, count: Callable[[], float | None]) -> float | None:
    """``count()``, kept in ``counts`` per model and ``key`` together with the dtype and device of the model's
    parameters (counted again when the model is cast or moved)."""
    try:
        first = next(model.parameters())
    except (AttributeError, StopIteration):
        return None
    placed = (first.dtype, first.device.type, key)
    per_model = counts.setdefault(model, {})
    if placed not in per_model:
        per_model[placed] = count()
    return per_model[placed]
