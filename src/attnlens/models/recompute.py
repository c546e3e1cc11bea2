"""Recomputing a model's layers in the backward instead of keeping their activations (gradient checkpointing),
for the passes whose activations would not fit the memory budget: the shared pass under fused attention
(:mod:`attnlens.core.capture`), AttnLRP's fused pass (:mod:`attnlens.lrp.relevance`), integrated gradients and the
attention gates, each through :func:`attnlens.core.recomputing.recomputing`, which sets the C allocator for it.

A layer is recomputed with attnlens' context variables (:mod:`contextvars`) as its forward saw them: the
recording attention and the LRP rules read their state from context variables, and on a GPU the backward,
recomputations included, runs in autograd's own thread, where that state would otherwise be missing."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# the name every attnlens context variable starts with (what a recomputation carries)
OWN_PREFIX = "attnlens_"


@contextmanager
def recomputed_layers(model: nn.Module) -> Iterator[int]:
    """Within the block, a backward recomputes each Transformer layer of ``model`` (transformers' checkpointing
    layers) from its input instead of keeping its activations (non-reentrant checkpointing, so gradients of tensors
    inside a layer, as the kept rows, are still taken). Yields how many layers were switched; their forwards are
    restored.

    Each layer's forward (the class's, or an instance's own: an LRP rule's) is wrapped here rather than switched on
    through transformers' flags: transformers checkpoints a layer only while its own training flag is set, and
    some layers (BART's, mBART's, OPT's) apply dropout by that flag. The layers stay in eval mode. The passes run
    without a key/value cache (:func:`attnlens.core.modelstate.without_cache`), which a recomputed layer would
    append to again."""
    from functools import partial

    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    saved = [m.__dict__.get("forward") for m in layers]
    try:
        for m in layers:
            m.forward = partial(_recomputed, m.forward)
        yield len(layers)
    finally:
        for m, own in zip(layers, saved, strict=True):
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own


def checkpointed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` under non-reentrant checkpointing: its activations are not kept, and the
    backward runs it again with attnlens' own context variables as they were at the first run (whichever thread
    the backward runs in).

    Only attnlens' variables travel to the recomputation: another library's (transformers' output collector)
    would hold the pass's hidden states, whose graph holds this checkpoint, a cycle through autograd that Python's
    collector cannot see, so every pass would stay in memory."""
    from torch.utils.checkpoint import checkpoint

    carried = [(var, value) for var, value in contextvars.copy_context().items() if var.name.startswith(OWN_PREFIX)]
    first = True

    def run(*inner: Any, **named: Any) -> Any:
        nonlocal first
        if first:
            first = False
            return contextvars.copy_context().run(function, *inner, **named)
        return contextvars.Context().run(_restored, carried, function, *inner, **named)

    return checkpoint(run, *args, use_reentrant=False, **kwargs)


def _restored(carried: list[tuple[contextvars.ContextVar[Any], Any]], function: Callable[..., Any], *args: Any,
              **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` after setting ``carried`` variables (in a fresh context, which is dropped)."""
    for var, value in carried:
        var.set(value)
    return function(*args, **kwargs)


def _recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)``, recomputed in the backward (:func:`checkpointed`) when a graph is built."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpointed(forward, *args, **kwargs)


def recomputable(model: nn.Module) -> bool:
    """Whether ``model`` has layers :func:`recomputed_layers` can switch (transformers' checkpointing layers)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return any(isinstance(m, GradientCheckpointingLayer) for m in model.modules())
