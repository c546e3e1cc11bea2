"""What AttnLRP's fused forward keeps for its backward, counted on the model's own layers.

A fused LRP pass that keeps every layer's activations (:func:`~attnlens.lrp.lrp_pass` with ``fused=True,
recompute=False``) holds what its rules save per token and layer: the linear layers' inputs, the gate's halves,
the normalisation's input, the fused attention's queries, keys, values and output. That differs from what a plain
backward keeps (the rules save some tensors the plain layers do not, and fused attention keeps no maps) and by
architecture (the feed-forward's width and gate, grouped keys and values). Rather than list them,
:func:`kept_vectors` runs the pass's forward on two short probes (:mod:`attnlens.core.saved_probe`) and counts
what autograd saves: SmolLM2-135M keeps 17.5 hidden-size vectors per token and layer, where the floor of a plain
backward's estimate counts 30.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.modelstate import without_cache
from ..core.saved_probe import Counts, counted, saved_per_token
from ..errors import ModelError
from .patch import lrp_mode, runs_fused
from .state import PassState

_COUNTED: Counts = Counts()


def kept_vectors(model: nn.Module, layers: int, hidden: int) -> float | None:
    """Vectors of ``hidden`` values (in the parameters' dtype) per token and per each of ``layers`` layers that
    AttnLRP's fused forward (its rules, ε = 0) keeps for a backward that does not recompute the layers: what autograd
    saves on the probes (parameters aside, an encoder-decoder's decoder reading as many tokens as its encoder), the
    embeddings' and the output's share spread over the layers.

    ``None`` where it cannot be counted: a model whose LRP pass does not run fused (:func:`runs_fused`), weights not
    materialised (the meta device), or a forward that fails on the probe."""
    count = counted(_COUNTED, model, "attnlrp", lambda: _count(model))
    if count is None or layers <= 0 or hidden <= 0:
        return None
    return count / (layers * hidden * next(model.parameters()).element_size())


def _count(model: nn.Module) -> float | None:
    """Bytes saved per token beyond the parameters, or ``None``."""
    try:
        if not runs_fused(model):
            return None
    except (ModelError, AttributeError):
        return None

    def forward(inputs: dict[str, torch.Tensor]) -> None:
        state = PassState(rules="attnlrp", fused=True)
        try:
            with lrp_mode(model, state):
                model(**inputs, **without_cache(model))
        finally:
            state.release()

    return saved_per_token(model, forward)
