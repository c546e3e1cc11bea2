"""Recomputing a model's layers in the backward instead of keeping their activations (gradient checkpointing),
for the passes whose activations would not fit the memory budget: the shared pass under fused attention
(:mod:`attnlens.core.capture`) and AttnLRP's fused pass (:mod:`attnlens.lrp.relevance`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def recomputed_layers(model: nn.Module) -> Iterator[int]:
    """Within the block, a backward recomputes each Transformer layer of ``model`` from its input instead of
    keeping its activations (transformers' gradient checkpointing, non-reentrant, so gradients of tensors inside
    a layer, as the kept rows, are still taken). Yields how many layers were switched; the flags are restored."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    saved = [(m.__dict__.get("gradient_checkpointing"), m.__dict__.get("_gradient_checkpointing_func"), m.training)
             for m in layers]
    try:
        for m in layers:  # the layer itself in training mode (its submodules, dropout included, stay in eval)
            m.gradient_checkpointing = True
            m._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
            m.training = True
        yield len(layers)
    finally:
        for m, (flag, func, training) in zip(layers, saved, strict=True):
            for name, value in (("gradient_checkpointing", flag), ("_gradient_checkpointing_func", func)):
                if value is None:
                    m.__dict__.pop(name, None)
                else:
                    setattr(m, name, value)
            m.training = training


def recomputable(model: nn.Module) -> bool:
    """Whether ``model`` has layers :func:`recomputed_layers` can switch (transformers' checkpointing layers)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return any(isinstance(m, GradientCheckpointingLayer) for m in model.modules())
