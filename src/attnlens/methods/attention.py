"""Methods built from attention probabilities and their gradients (one shared pass).

Notation: A^l ``(B, H, Q, K)`` softmax attention of layer l, ∇A^l its gradient w.r.t. the explained scalar,
E_h the mean over heads, "row c" the explained query row(s) (``Capture.row``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..core.batch_state import BatchContext, Capture
from .registry import ATTENTION, ATTENTION_MEANS, ATTENTION_ROWS, GRADIENTS, MethodOutput, register


def rollout_matrices(attentions: Iterable[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Â^l = 0.5·E_h A^l + 0.5·I per layer (Abnar & Zuidema 2020): the residual connection as identity.

    ``attentions`` are L tensors ``(..., H, N, N)`` (a capture's ``(B, H, N, N)``, or one example's); returns L
    tensors ``(..., N, N)``, computed in ``dtype`` (default: the attention's).
    """
    out = []
    for a in attentions:
        mean = (a if dtype is None else a.to(dtype)).mean(-3)
        out.append(0.5 * mean + 0.5 * torch.eye(mean.shape[-1], dtype=mean.dtype, device=mean.device))
    return out


def propagate(steps: Iterable[torch.Tensor], *, residual: bool = False) -> list[torch.Tensor]:
    """Per-layer matrices ``M^l`` (bottom layer first) chained upwards; returns ``P^1 ... P^L``.

    Plain: ``P^1 = M^1``, ``P^l = M^l P^{l-1}`` (rollout, TransAtt). ``residual``: ``P^0 = I``,
    ``P^l = P^{l-1} + M^l P^{l-1}`` (GAE's self-attention rule: ``(I + M^l) P^{l-1}`` without forming ``I + M^l``).
    """
    out: list[torch.Tensor] = []
    joint = None
    for m in steps:
        if joint is None:
            joint = m + torch.eye(m.shape[-1], dtype=m.dtype, device=m.device) if residual else m
        else:
            joint = joint + m @ joint if residual else m @ joint
        out.append(joint)
    return out


def rollout_rows(weights: torch.Tensor, means: list[torch.Tensor]) -> torch.Tensor:
    """``(B, L, N)``: row ``weights`` ``(B, N)`` of the rollout up to each layer, ``P^l = Â^l···Â^1`` with
    ``Â = 0.5·M + 0.5·I`` for the head-mean maps ``means`` (L tensors ``(B, N, N)``, bottom layer first).

    Each row is carried down from its layer, ``v ← 0.5·v M^j + 0.5·v``: L(L+1)/2 products of a row with an
    ``N × N`` map, instead of the L ``N × N`` matrix products of :func:`propagate` (and no ``Â`` is formed)."""
    rows = []
    for top in range(len(means)):
        v = weights.to(means[top].dtype)
        for m in reversed(means[: top + 1]):
            v = 0.5 * torch.einsum("bq,bqk->bk", v, m) + 0.5 * v
        rows.append(v)
    return torch.stack(rows, 1)


def _stack_rows(capture: Capture, matrices: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([capture.row(m) for m in matrices], 1)  # (B, L, K)


def _stack_explained(capture: Capture, rows: list[torch.Tensor]) -> torch.Tensor:
    """``(B, L, K)``: the explained row of each layer's ``(B, R, K)`` matrix over the captured attention rows."""
    return torch.stack([capture.explained_row(r) for r in rows], 1)


@register(
    "rawatt",
    needs={ATTENTION_ROWS},
    class_specific=False,
    summary="Last layer's attention from the classification position, mean over heads: E_h A^L[c, j].",
    citation="Jain & Wallace 2019; seed 000 Eq. 1",
)
def rawatt(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    layers = _stack_explained(cap, [a.mean(1) for a in cap.attention_rows])
    return MethodOutput(layers[:, -1], layers)


@register(
    "rollout",
    needs={ATTENTION_MEANS},
    class_specific=False,
    self_attention_only=True,
    summary="Attention rollout: R = Â^L···Â^1 with Â = 0.5·E_h A + 0.5·I; s_j = R[c, j].",
    citation="Abnar & Zuidema 2020",
)
def rollout(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    layers = rollout_rows(cap.query_weights, cap.head_means())  # row c of the rollout up to each layer
    return MethodOutput(layers[:, -1], layers)


@register(
    "grads",
    needs={ATTENTION_ROWS, GRADIENTS},
    summary="Gradient of the target w.r.t. the last layer's attention, row c, mean over heads: E_h ∇A^L[c, j].",
    citation="AttCAT paper (Qiang et al. 2022), baseline 'Grads'",
)
def grads(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    layers = _stack_explained(cap, [g.mean(1) for g in cap.attention_row_grads])
    return MethodOutput(layers[:, -1], layers)


@register(
    "attgrads",
    needs={ATTENTION, GRADIENTS},
    summary="Grad-SAM: mean over layers, heads and real query rows of A ⊙ ReLU(∇A).",
    citation="Barkan et al. 2021 (Grad-SAM)",
)
def attgrads(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    per_layer = [cap.query_mean((a * g.clamp_min(0)).mean(1)) for a, g in zip(cap.attentions, cap.attention_grads)]
    layers = torch.stack(per_layer, 1)
    return MethodOutput(layers.mean(1), layers)


@register(
    "agrad",
    needs={ATTENTION_ROWS, GRADIENTS},
    summary="Attention × its gradient in the last layer, row c, mean over heads: E_h (A^L ⊙ ∇A^L)[c, j].",
    citation="Liu et al. 2021; seed 000 Eq. 2",
)
def agrad(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    layers = _stack_explained(cap, [(a * g).mean(1) for a, g in zip(cap.attention_rows, cap.attention_row_grads)])
    return MethodOutput(layers[:, -1], layers)


@register(
    "gae",
    needs={ATTENTION, GRADIENTS},
    self_attention_only=True,
    summary="Generic attention explainability: R = I; R ← R + E_h ReLU(∇A ⊙ A)·R per layer; s_j = R[c, j].",
    citation="Chefer, Gur & Wolf 2021 (ICCV), self-attention rule",
)
def gae(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    a_bars = ((g * a).clamp_min(0).mean(1) for a, g in zip(cap.attentions, cap.attention_grads))
    layers = _stack_rows(cap, propagate(a_bars, residual=True))
    return MethodOutput(layers[:, -1], layers)
