"""A pass that recomputes each layer in its backward: the layers switched to gradient checkpointing
(:func:`~attnlens.models.recompute.recomputed_layers`) and the C allocator's policy for it
(:func:`~attnlens.core.allocator.for_layer_blocks`), together, so that no such pass runs without the other."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ..models.recompute import recomputed_layers
from .allocator import for_layer_blocks
from .memory import model_dims


@contextmanager
def recomputing(model: nn.Module, tokens: int) -> Iterator[int]:
    """Within the block, a backward through ``model`` over sequences of ``tokens`` tokens recomputes each layer
    from its input, and blocks of a quarter of a layer's hidden states or more go back to the system when freed.
    Yields how many layers were switched."""
    dims = model_dims(model)
    with for_layer_blocks(dims.hidden_bytes(tokens)), recomputed_layers(model) as switched:
        yield switched
