"""RMSNorm variants, read from the module itself rather than guessed from its class.

Llama, Qwen and T5 scale the normalised state by γ, Gemma by 1 + γ, and the epsilon attribute is named
``variance_epsilon`` or ``eps``. The methods that hold a norm's scale constant (DecompX, the LRP identity rule)
need the gain g of ``norm(x) = x / rms(x) ⊙ g``; asking the module for its output on a vector of ones gives
g / √(1 + ε) for every variant, so a new parametrisation cannot silently be read as Llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ModelError


def is_rms_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is an RMSNorm (a module whose class name ends with ``RMSNorm`` or T5's ``LayerNorm``
    without a mean, with an epsilon attribute)."""
    return type(norm).__name__.endswith(("RMSNorm", "T5LayerNorm")) and rms_eps(norm) is not None


def rms_eps(norm: nn.Module) -> float | None:
    """The epsilon under the root of an RMSNorm (``variance_epsilon`` or ``eps``), or ``None``."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def rms_gain(norm: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """The gain g of RMSNorm ``norm`` (``(D,)``, ``like``'s dtype and device), a constant: its output on a vector
    of ones times √(1 + ε)."""
    eps = rms_eps(norm)
    if eps is None:
        raise ModelError(f"{type(norm).__name__} has no epsilon attribute (variance_epsilon or eps): not an RMSNorm "
                         "attnlens can read")
    with torch.no_grad():
        ones = torch.ones(like.shape[-1], dtype=like.dtype, device=like.device)
        # 1/rms(ones) rounded as the modules round it (float32 statistics), so g comes back exactly, float64 too
        inv_rms = torch.rsqrt(torch.ones((), dtype=torch.float32, device=like.device) + eps)
        out = type(norm).forward(norm, ones)  # the class's forward: an LRP pass patches the instance's
        return (out.double() / inv_rms.double()).to(like.dtype)


def is_layer_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is a LayerNorm: ``nn.LayerNorm``, or a model's own class that computes one (DeBERTa's)."""
    return isinstance(norm, nn.LayerNorm) or type(norm).__name__ == "DebertaLayerNorm"


def as_layer_norm(norm: nn.Module) -> nn.Module:
    """``norm`` as the ``nn.LayerNorm`` (weight, bias, eps) the decomposition methods read: itself, or, for a
    model's own LayerNorm class that computes the same (DeBERTa's ``DebertaLayerNorm``: epsilon inside the root,
    statistics in float32), an ``nn.LayerNorm`` sharing its parameters."""
    if isinstance(norm, nn.LayerNorm) or not is_layer_norm(norm):
        return norm
    ln = nn.LayerNorm(norm.weight.shape[0], eps=float(norm.variance_epsilon), device="meta")
    ln.weight, ln.bias = norm.weight, norm.bias
    return ln
