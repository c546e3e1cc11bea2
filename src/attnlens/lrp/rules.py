"""LRP rules written as modified gradients ("gradient x input" form of LRP).

Every rule here keeps the forward value of the operation it replaces and changes only its backward pass, so that
``relevance(t) = t * t.grad`` holds at every tensor ``t`` of the graph (Achtibat et al., ICML 2024, Sec. 3.5;
the same trick LXT calls "efficient" mode). An ordinary ``torch.autograd.grad`` from the explained logit then
runs the whole relevance pass in one backward.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by a fixed factor."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.factor, None


class _EpsilonGrad(torch.autograd.Function):
    """Identity forward; backward scales by ``factor * z / (z + eps * sign(z))``: the epsilon rule.

    With relevance ``R_z = z * g`` arriving at the output ``z`` of a sum (a Linear layer, a matmul), the inputs then
    receive ``x * W^T (factor * R_z / (z + eps sign z))``: the epsilon rule (Bach et al. 2015), where the
    stabiliser absorbs a little relevance. ``sign(0)`` counts as +1.
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, eps: float, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(z)
        ctx.eps, ctx.factor = eps, factor
        return z.view_as(z)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (z,) = ctx.saved_tensors
        denom = z + ctx.eps * torch.where(z >= 0, 1.0, -1.0).to(z.dtype)
        return grad * (ctx.factor * z / denom), None, None


def sum_rule(z: torch.Tensor, eps: float = 0.0, factor: float = 1.0) -> torch.Tensor:
    """Mark ``z`` (the output of a weighted sum) for the epsilon rule, with relevance scaled by ``factor``.

    ``eps=0`` is plain gradient x input (LRP-0), which needs no division; ``factor=0.5`` is the uniform rule
    for a product of two inputs (AttnLRP Eq. 7): each factor of ``A @ V`` or ``Q @ K^T`` gets half.
    """
    if eps > 0:
        return _EpsilonGrad.apply(z, eps, factor)
    if factor != 1.0:
        return _ScaleGrad.apply(z, factor)
    return z


def identity_rule(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an element-wise nonlinearity with ``fn(0) = 0``, passing relevance through unchanged.

    Identity rule (AttnLRP Eq. 9): ``R_x = R_y``. In gradient form ``y = x * stop_grad(fn(x) / x)``, so
    ``x * grad_x = y * grad_y`` element-wise. Where ``x == 0`` the ratio is 0 (and so is the relevance).
    """
    y = fn(x)
    safe = torch.where(x == 0, torch.ones_like(x), x)
    ratio = torch.where(x == 0, torch.zeros_like(x), y / safe)
    return x * ratio.detach()


def layer_norm(module: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm with the standard deviation treated as a constant (Ali et al. 2022; AttnLRP Sec. 3.3).

    The layer then is linear in ``x`` (centring, a fixed scale, the affine weight), so gradient x input applies
    the epsilon/LRP-0 rule to it and relevance is conserved up to what the bias ``beta`` absorbs.
    """
    dims = tuple(range(-len(module.normalized_shape), 0))
    mean = x.mean(dim=dims, keepdim=True)
    var = (x - mean).pow(2).mean(dim=dims, keepdim=True)
    y = (x - mean) / (var + module.eps).sqrt().detach()
    if module.weight is not None:
        y = y * module.weight
    if module.bias is not None:
        y = y + module.bias
    return y


def linear(module: nn.Linear, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``nn.Linear`` under the epsilon rule (``eps=0``: LRP-0, i.e. the unmodified gradient)."""
    return sum_rule(F.linear(x, module.weight, module.bias), eps)
