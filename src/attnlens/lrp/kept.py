"""What AttnLRP's fused forward keeps for its backward, counted on the model's own layers.

A fused LRP pass that keeps every layer's activations (:func:`~attnlens.lrp.lrp_pass` with ``fused=True,
recompute=False``) holds what its rules save per token and layer: the linear layers' inputs, the gate's halves,
the normalisation's input, the fused attention's queries, keys, values and output. That differs from what a plain
backward keeps (the rules save some tensors the plain layers do not, and fused attention keeps no maps) and by
architecture (the feed-forward's width and gate, grouped keys and values). Rather than list them,
:func:`kept_vectors` runs the pass's forward on two short probes and counts what autograd saves: SmolLM2-135M
keeps 17.5 hidden-size vectors per token and layer, where the floor of a plain backward's estimate counts 30.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..core.batching import keeps_logits
from ..core.modelstate import without_cache
from ..errors import InputError, ModelError
from ..models.feed_forward import saved_storages
from .patch import lrp_mode, runs_fused
from .state import PassState

# the probes' lengths: the count is the difference of what they save, per token (what does not grow with the
# length, such as the last position's logits, cancels)
PROBE_TOKENS = (16, 32)
# per model: (its parameters' dtype and device when counted, the count); weak, so a model is not kept alive by it
_COUNTED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[torch.dtype, str], float | None]] = \
    weakref.WeakKeyDictionary()


def kept_vectors(model: nn.Module, layers: int, hidden: int) -> float | None:
    """Vectors of ``hidden`` values (in the parameters' dtype) per token and per each of ``layers`` layers that
    AttnLRP's fused forward (its rules, ε = 0) keeps for a backward that does not recompute the layers: what autograd
    saves on a probe of :data:`PROBE_TOKENS` tokens (parameters aside, an encoder-decoder's decoder reading as many
    tokens as its encoder), the embeddings' and the output's share spread over the layers.

    ``None`` where it cannot be counted: a model whose LRP pass does not run fused (:func:`runs_fused`), weights not
    materialised (the meta device), or a forward that fails on the probe."""
    try:
        first = next(model.parameters())
    except (AttributeError, StopIteration):
        return None
    key = (first.dtype, first.device.type)
    cached = _COUNTED.get(model)
    if cached is None or cached[0] != key:
        cached = _COUNTED[model] = (key, _count(model, first))
    count = cached[1]
    if count is None or layers <= 0 or hidden <= 0:
        return None
    return count / (layers * hidden * first.element_size())


def _count(model: nn.Module, weight: torch.Tensor) -> float | None:
    """Bytes saved per token beyond the parameters (the slope between the two probes), or ``None``."""
    if weight.device.type == "meta":
        return None
    try:
        if not runs_fused(model):
            return None
    except (ModelError, AttributeError):
        return None
    short, long = (_saved(model, n, weight.device) for n in PROBE_TOKENS)
    if short is None or long is None or long < short:
        return None
    return (long - short) / (PROBE_TOKENS[1] - PROBE_TOKENS[0])


def _saved(model: nn.Module, n: int, device: torch.device) -> int | None:
    """Bytes autograd saves per row in the fused AttnLRP forward over two rows of ``n`` tokens, the second with its
    first position padded, so that the attention runs with a mask as a padded batch's does (where a masked kernel
    keeps more, such as a copy of the key heads per query head, that is counted). Constant ids: the count does
    not depend on them, and the global random state is left alone."""
    ids = torch.full((2, n), 1, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    if keeps_logits(model):
        inputs["logits_to_keep"] = 1
    state = PassState(rules="attnlrp", fused=True)
    try:
        with torch.enable_grad(), lrp_mode(model, state), saved_storages(model.parameters()) as saved:
            model(**inputs, **without_cache(model))
            total = sum(saved.values()) // 2
    except (RuntimeError, TypeError, ValueError, ModelError, InputError):  # a forward the probe cannot drive
        return None
    finally:
        state.release()
    return total
