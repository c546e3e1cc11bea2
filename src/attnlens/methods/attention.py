"""Methods built from attention probabilities and their gradients (one shared pass).

Notation: A^l ``(B, H, Q, K)`` softmax attention of layer l, ∇A^l its gradient w.r.t. the explained scalar,
E_h the mean over heads, "row c" the explained query row(s) (``Capture.row``).
"""

from __future__ import annotations

import torch

from ..context import BatchContext, Capture
from .registry import ATTENTION, GRADIENTS, MethodOutput, register


def rollout_matrices(capture: Capture) -> list[torch.Tensor]:
    """Â^l = 0.5·E_h A^l + 0.5·I per layer (Abnar & Zuidema 2020): the residual connection as identity."""
    n = capture.attentions[0].shape[-1]
    eye = torch.eye(n, dtype=capture.attentions[0].dtype, device=capture.attentions[0].device)
    return [0.5 * a.mean(1) + 0.5 * eye for a in capture.attentions]


def _stack_rows(capture: Capture, matrices: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([capture.row(m) for m in matrices], 1)  # (B, L, K)


@register(
    "rawatt",
    needs={ATTENTION},
    class_specific=False,
    summary="Last layer's attention from the classification position, mean over heads: E_h A^L[c, j].",
    citation="Jain & Wallace 2019; seed 000 Eq. 1",
)
def rawatt(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    layers = _stack_rows(cap, [a.mean(1) for a in cap.attentions])
    return MethodOutput(layers[:, -1], layers)


@register(
    "rollout",
    needs={ATTENTION},
    class_specific=False,
    self_attention_only=True,
    summary="Attention rollout: R = Â^L···Â^1 with Â = 0.5·E_h A + 0.5·I; s_j = R[c, j].",
    citation="Abnar & Zuidema 2020",
)
def rollout(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    joint = None
    cumulative = []
    for a_hat in rollout_matrices(cap):
        joint = a_hat if joint is None else a_hat @ joint
        cumulative.append(joint)
    layers = _stack_rows(cap, cumulative)  # row c of the rollout up to each layer
    return MethodOutput(layers[:, -1], layers)


@register(
    "grads",
    needs={ATTENTION, GRADIENTS},
    summary="Gradient of the target w.r.t. the last layer's attention, row c, mean over heads: E_h ∇A^L[c, j].",
    citation="AttCAT paper (Qiang et al. 2022), baseline 'Grads'",
)
def grads(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    layers = _stack_rows(cap, [g.mean(1) for g in cap.attention_grads])
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
    needs={ATTENTION, GRADIENTS},
    summary="Attention × its gradient in the last layer, row c, mean over heads: E_h (A^L ⊙ ∇A^L)[c, j].",
    citation="Liu et al. 2021; seed 000 Eq. 2",
)
def agrad(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    layers = _stack_rows(cap, [(a * g).mean(1) for a, g in zip(cap.attentions, cap.attention_grads)])
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
    b, _, q, _ = cap.attentions[0].shape
    relevance = torch.eye(q, dtype=cap.attentions[0].dtype, device=cap.attentions[0].device).expand(b, q, q)
    cumulative = []
    for a, g in zip(cap.attentions, cap.attention_grads):
        a_bar = (g * a).clamp_min(0).mean(1)
        relevance = relevance + a_bar @ relevance
        cumulative.append(relevance)
    layers = _stack_rows(cap, cumulative)
    return MethodOutput(layers[:, -1], layers)
