"""A layer's modules found by the paths of its :class:`~attnlens.models.architectures.Anatomy`, and its
feed-forward run from them.

The decomposition methods recompute each layer from these pieces and the memory estimate counts what the
feed-forward saves for a backward pass (:mod:`attnlens.models.feed_forward`); both read the feed-forward here, so
a new way of writing one (a fused gate/up projection, a gate, one opaque module) is taught in one place.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from .architectures import Anatomy

_FEED_FORWARD_PARTS = ("ffn", "moe", "ffn_in", "act", "ffn_out", "gate")


def module_at(obj: Any, path: str) -> Any:
    """The attribute at dotted ``path`` of ``obj`` (``"mlp.down_proj"``; list indices as names: ``"layer.0"``).
    :class:`ModelError` (one line) where the path does not lead anywhere: an architecture entry naming a module
    this model lacks."""
    try:
        return functools.reduce(getattr, path.split("."), obj)
    except AttributeError:
        raise ModelError(f"{type(obj).__name__} has no module at {path!r}, which its architecture entry names "
                         "(attnlens.register_architecture)") from None


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The ``(out, in)`` weight of an ``nn.Linear`` or of transformers' ``Conv1D`` (GPT-2), which stores it
    transposed: ``Conv1D(x) = x @ W + b = F.linear(x, W.T, b)``."""
    return module.weight if isinstance(module, nn.Linear) else module.weight.T


def linear_rows(weight: torch.Tensor, rows: Any, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` viewing the output ``rows`` of a projection's ``weight`` ``(out, in)``, with ``bias`` (the
    rows' own, already selected) or none."""
    lin = nn.Linear(weight.shape[1], weight[rows].shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach()[rows], requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def halves(fused: nn.Linear) -> tuple[nn.Linear, nn.Linear]:
    """The first and second half of a fused projection's outputs as two ``nn.Linear`` viewing its weights."""
    half = fused.out_features // 2
    lower, upper = slice(0, half), slice(half, None)
    bias = fused.bias.detach() if fused.bias is not None else None
    return (linear_rows(fused.weight, lower, None if bias is None else bias[lower]),
            linear_rows(fused.weight, upper, None if bias is None else bias[upper]))


def feed_forward_modules(block: nn.Module, anatomy: Anatomy) -> dict[str, nn.Module]:
    """The feed-forward of layer ``block`` by its :class:`Anatomy` names: ``ffn`` (one module) or ``moe`` (experts),
    or ``ffn_in``, ``act``, ``ffn_out`` and, gated, ``gate``; a fused gate/up projection as ``gate_up`` and its
    two halves, ``gate`` and ``ffn_in``."""
    mods = {k: module_at(block, path) for k in _FEED_FORWARD_PARTS if (path := getattr(anatomy, k)) is not None}
    if anatomy.gate_up is not None:
        mods["gate_up"] = module_at(block, anatomy.gate_up)
        mods["gate"], mods["ffn_in"] = halves(mods["gate_up"])
    return mods


@dataclass
class FeedForwardOutput:
    """A feed-forward's ``output`` on some input, with its activation function's input ``pre`` and output ``act``
    (the gate's, gated), ``None`` for a feed-forward run as one module."""

    output: torch.Tensor
    pre: torch.Tensor | None = None
    act: torch.Tensor | None = None


def run_feed_forward(mods: dict[str, nn.Module], y: torch.Tensor) -> FeedForwardOutput:
    """The feed-forward whose modules ``mods`` holds (:func:`feed_forward_modules`) on its input ``y``, computed
    as the model computes it (a fused gate/up projection once, then split)."""
    if "ffn" in mods or "moe" in mods:
        out = mods["ffn" if "ffn" in mods else "moe"](y)
        return FeedForwardOutput(out[0] if isinstance(out, tuple) else out)
    if "gate" in mods:
        pre, up = mods["gate_up"](y).chunk(2, dim=-1) if "gate_up" in mods else (mods["gate"](y), mods["ffn_in"](y))
        return _after_first(mods, pre, up)
    return _after_first(mods, mods["ffn_in"](y), None)


def _after_first(mods: dict[str, nn.Module], pre: torch.Tensor, up: torch.Tensor | None) -> FeedForwardOutput:
    act = mods["act"](pre)
    return FeedForwardOutput(mods["ffn_out"](act if up is None else act * up), pre, act)


def first_projection(mods: dict[str, nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The feed-forward's first projections as one ``(out, in)`` weight and its bias (``None``: none): a gated
    feed-forward's gate rows, then ``ffn_in``'s; ``ffn_in``'s alone; ``None`` for a feed-forward run as one module
    or as experts. :func:`feed_forward_after_first` finishes the feed-forward from their output."""
    if "ffn" in mods or "moe" in mods:
        return None
    parts = [mods["gate"], mods["ffn_in"]] if "gate" in mods else [mods["ffn_in"]]
    weight = torch.cat([linear_weight(m).detach() for m in parts])
    biases = [m.bias for m in parts]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat([torch.zeros(linear_weight(m).shape[0], dtype=weight.dtype, device=weight.device)
                              if b is None else b.detach() for m, b in zip(parts, biases, strict=True)])


def feed_forward_after_first(mods: dict[str, nn.Module], first: torch.Tensor) -> FeedForwardOutput:
    """The feed-forward whose first projections gave ``first`` (their outputs side by side, as
    :func:`first_projection` orders them), finished as :func:`run_feed_forward` finishes it."""
    if "gate" in mods:
        pre, up = first.chunk(2, dim=-1)
        return _after_first(mods, pre, up)
    return _after_first(mods, first, None)
