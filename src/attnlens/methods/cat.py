"""CAT and AttCAT: hidden state × gradient per token, optionally weighted by attention (Qiang et al. 2022)."""

from __future__ import annotations

import torch

from ..core.batch_state import BatchContext, Capture
from ..errors import InputError
from .registry import ATTENTION_RECEIVED, ATTENTION_ROWS, GRADIENTS, HIDDEN, MethodOutput, register

HIDDEN_CHOICES = ("input", "output")
ALPHA_CHOICES = ("mean", "cls")


def cat_per_layer(capture: Capture, hidden: str) -> torch.Tensor:
    """``(B, L, K)``: Σ_d (∇h ⊙ h)[j, d] for the states paired with each layer.

    ``hidden="input"`` pairs layer l with its input h^{l-1} (the authors' code), ``"output"`` with its output h^l
    (the paper's wording).
    """
    _check_cat(hidden)
    n = capture.n_layers
    idx = range(n) if hidden == "input" else range(1, n + 1)
    return torch.stack([(capture.hidden_grads[i] * capture.hidden[i]).sum(-1) for i in idx], 1)


def _check_cat(hidden: str = "input", alpha: str = "mean") -> None:
    """CAT's and AttCAT's option values."""
    if hidden not in HIDDEN_CHOICES:
        raise InputError(f"hidden={hidden!r}; choose one of {', '.join(HIDDEN_CHOICES)}")
    if alpha not in ALPHA_CHOICES:
        raise InputError(f"alpha={alpha!r}; choose one of {', '.join(ALPHA_CHOICES)}")


@register(
    "cat",
    needs={HIDDEN, GRADIENTS},
    summary="Σ over layers of Σ_d (∇h^{l-1} ⊙ h^{l-1})[j, d] (AttCAT Eq. 10 without attention).",
    citation="Qiang et al. 2022 (AttCAT), Eq. 10",
    check=_check_cat,
)
def cat(ctx: BatchContext, hidden: str = "input") -> MethodOutput:
    layers = cat_per_layer(ctx.capture, hidden)
    return MethodOutput(layers.sum(1), layers)


@register(
    "attcat",
    needs={ATTENTION_ROWS, ATTENTION_RECEIVED, HIDDEN, GRADIENTS},
    differentiate={HIDDEN},
    summary="Σ over layers of ᾱ^l_j · Σ_d (∇h^{l-1} ⊙ h^{l-1})[j, d]; ᾱ = attention token j receives, mean over "
    "heads and real query rows.",
    citation="Qiang et al. 2022 (AttCAT), Eq. 11 as in the authors' code",
    check=_check_cat,
)
def attcat(ctx: BatchContext, hidden: str = "input", alpha: str = "mean") -> MethodOutput:
    cap = ctx.capture
    _check_cat(hidden, alpha)
    if alpha == "mean":  # attention each token receives, averaged over all real queries (the authors' code)
        weights = torch.stack(cap.received_attention(), 1)
    else:  # the classification position's attention row (one reading of the paper)
        weights = torch.stack([cap.explained_row(a.mean(1)) for a in cap.attention_rows], 1)
    layers = weights * cat_per_layer(cap, hidden)
    return MethodOutput(layers.sum(1), layers)
