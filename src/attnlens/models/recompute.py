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
    """Within the block, a backward recomputes each Transformer layer of ``model`` from its input instead of
    keeping its activations (transformers' gradient checkpointing, non-reentrant, so gradients of tensors inside
    a layer, as the kept rows, are still taken). Yields how many layers were switched; the flags are restored.

    transformers checkpoints a layer only while the layer's own training flag is set, and some layers (BART's,
    mBART's, OPT's) apply dropout by that flag: it is set for the checkpointing decision alone, and cleared while
    the layer's forward runs, in a pass with gradients and without, first run and recomputation alike."""
    from functools import partial

    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    names = ("gradient_checkpointing", "_gradient_checkpointing_func", "forward")
    saved = [([m.__dict__.get(name) for name in names], m.training) for m in layers]
    try:
        for m in layers:  # the layer's own flag set (its submodules, dropout included, stay in eval)
            m.gradient_checkpointing = True
            m._gradient_checkpointing_func = partial(checkpointed, layer=m)
            m.training = True
            own = m.__dict__.get("forward")
            # an instance's own forward (an LRP rule's) bypasses the class's checkpointing; the class's runs the
            # layer as it is where no gradient is taken
            m.forward = (partial(_recomputed, m, own) if own is not None
                         else partial(_as_built_without_graph, m, m.forward))
        yield len(layers)
    finally:
        for m, (values, training) in zip(layers, saved, strict=True):
            for name, value in zip(names, values, strict=True):
                if value is None:
                    m.__dict__.pop(name, None)
                else:
                    setattr(m, name, value)
            m.training = training


def checkpointed(function: Callable[..., Any], *args: Any, layer: nn.Module | None = None, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` under non-reentrant checkpointing: its activations are not kept, and the
    backward runs it again with attnlens' own context variables as they were at the first run (whichever thread
    the backward runs in). ``layer``: the module ``function`` runs, in eval mode during both runs.

    Only attnlens' variables travel to the recomputation: another library's (transformers' output collector)
    would hold the pass's hidden states, whose graph holds this checkpoint, a cycle through autograd that Python's
    collector cannot see, so every pass would stay in memory."""
    from torch.utils.checkpoint import checkpoint

    carried = [(var, value) for var, value in contextvars.copy_context().items() if var.name.startswith(OWN_PREFIX)]
    first = True

    def run(*inner: Any, **named: Any) -> Any:
        nonlocal first
        with _evaluating(layer):
            if first:
                first = False
                return contextvars.copy_context().run(function, *inner, **named)
            return contextvars.Context().run(_restored, carried, function, *inner, **named)

    return checkpoint(run, *args, use_reentrant=False, **kwargs)


@contextmanager
def _evaluating(layer: nn.Module | None) -> Iterator[None]:
    """Within the block, ``layer``'s own training flag is off (restored after)."""
    if layer is None:
        yield
        return
    was = layer.training
    layer.training = False
    try:
        yield
    finally:
        layer.training = was


def _restored(carried: list[tuple[contextvars.ContextVar[Any], Any]], function: Callable[..., Any], *args: Any,
              **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` after setting ``carried`` variables (in a fresh context, which is dropped)."""
    for var, value in carried:
        var.set(value)
    return function(*args, **kwargs)


def _recomputed(layer: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)`` of ``layer``, recomputed in the backward (:func:`checkpointed`) when a graph is
    built; ``layer`` in eval mode either way."""
    if not torch.is_grad_enabled():
        with _evaluating(layer):
            return forward(*args, **kwargs)
    return checkpointed(forward, *args, layer=layer, **kwargs)


def _as_built_without_graph(layer: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The class's ``forward`` of ``layer``: checkpointed by transformers when a graph is built (the layer in eval
    mode while it runs: :func:`checkpointed`), else run in eval mode as it is."""
    if torch.is_grad_enabled():
        return forward(*args, **kwargs)
    with _evaluating(layer):
        return forward(*args, **kwargs)


def recomputable(model: nn.Module) -> bool:
    """Whether ``model`` has layers :func:`recomputed_layers` can switch (transformers' checkpointing layers)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return any(isinstance(m, GradientCheckpointingLayer) for m in model.modules())
