"""LRP rules written as modified gradients ("gradient x input" form of LRP).

Every rule here keeps the forward value of the operation it replaces and changes only its backward pass, so that
``relevance(t) = t * t.grad`` holds at every tensor ``t`` of the graph (Achtibat et al., ICML 2024, Sec. 3.5;
the same trick LXT calls "efficient" mode). An ordinary ``torch.autograd.grad`` from the explained logit then
runs the whole relevance pass in one backward.

The chefer rules below take an optional ``switch``: an object whose ``mode`` is read when the backward runs.
While it is ``"attnlrp"``, each of them runs AttnLRP's rule (ε = 0) for the same operation instead, so that one
forward in the chefer layout serves both rule sets: a backward per rule set, one forward (``lrp_passes``).
"""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..models.layer_modules import linear_weight
from ..models.norms import rms_eps, rms_gain


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


def weak(obj: Any) -> Any:
    """A weak reference to ``obj`` (``None`` for ``None``), for an autograd node's context: the pass state holds
    the graph's tensors, whose nodes would hold the state again, a cycle through C++ that Python's collector
    cannot see, so every pass's maps would stay alive."""
    return None if obj is None else weakref.ref(obj)


def strong(ref: Any) -> Any:
    """The object :func:`weak` refers to, or ``None``."""
    return None if ref is None else ref()


def _attnlrp_mode(switch: Any) -> bool:
    """Whether a backward now running should apply AttnLRP's rule (see the module docstring); ``switch``: a
    :func:`weak` reference to the pass state, or ``None``."""
    state = strong(switch)
    return state is not None and state.mode == "attnlrp"


class _Relay(torch.autograd.Function):
    """``y = fn(x)`` element-wise; backward ``grad * y / x`` (0 where ``x`` is 0 or not finite), so that the
    relevance ``x * grad_x = y * grad_y`` passes through element-wise unchanged.

    One autograd node instead of the graph of ``x * stop_grad(fn(x) / x)``: the forward runs ``fn`` alone and
    the ratio is formed only in the backward (the chefer pass has one per LayerNorm, softmax and activation).
    With ``other`` and a ``switch`` in AttnLRP mode the backward is instead ``other(x, y, grad)``: the backward
    of the operation as AttnLRP's pass writes it (:func:`softmax_backward`, :func:`layer_norm_backward`, ...).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn, other=None, switch: Any = None) -> torch.Tensor:  # type: ignore[override]
        y = fn(x)
        ctx.save_for_backward(x, y)
        ctx.other, ctx.switch = other, weak(switch)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, y = ctx.saved_tensors
        if ctx.other is not None and _attnlrp_mode(ctx.switch):
            return ctx.other(x, y, grad), None, None, None
        return grad * (y / x).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0), None, None, None


def identity_rule(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an element-wise nonlinearity with ``fn(0) = 0``, passing relevance through unchanged.

    Identity rule (AttnLRP Eq. 9): ``R_x = R_y``, i.e. in gradient form the backward multiplies by ``fn(x) / x``
    (``x * grad_x = y * grad_y`` element-wise). Where ``x == 0`` the ratio is 0 (and so is the relevance).
    """
    return _Relay.apply(x, fn, None, None)


def _ln_dims(module: nn.LayerNorm) -> tuple[int, ...]:
    return tuple(range(-len(module.normalized_shape), 0))


def _ln_sigma(module: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """The LayerNorm's standard deviation of ``x`` over its normalised dimensions (``eps`` included)."""
    return (x.var(dim=_ln_dims(module), unbiased=False, keepdim=True) + module.eps).sqrt()


def _inv_rms(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """1 / rms(x) of an RMSNorm, in float32 at least (as the stock module), ``eps`` included."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rms_eps(module))


def layer_norm(module: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm with the standard deviation treated as a constant (Ali et al. 2022; AttnLRP Sec. 3.3).

    The layer then is linear in ``x`` (centring, a fixed scale, the affine weight), so gradient x input applies
    the epsilon/LRP-0 rule to it and relevance is conserved up to what the bias ``beta`` absorbs.
    """
    dims = _ln_dims(module)
    y = (x - x.mean(dim=dims, keepdim=True)) / _ln_sigma(module, x).detach()
    if module.weight is not None:
        y = y * module.weight
    if module.bias is not None:
        y = y + module.bias
    return y


def softmax_backward(x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``y = softmax(x)`` over the last dimension: AttnLRP's softmax rule in gradient form."""
    return y * (grad - (grad * y).sum(-1, keepdim=True))


def layer_norm_backward(module: nn.LayerNorm):
    """The backward of :func:`layer_norm` (standard deviation constant): ``(g - mean g) / sigma``, ``g = w grad``."""
    def backward(x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        g = grad if module.weight is None else grad * module.weight
        return (g - g.mean(dim=_ln_dims(module), keepdim=True)) / _ln_sigma(module, x)
    return backward


def rms_norm_backward(module: nn.Module):
    """The backward of :func:`rms_norm` (root mean square constant): ``grad * g / rms``."""
    def backward(x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return grad * rms_gain(module, x) * _inv_rms(module, x).to(x.dtype)
    return backward


def rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm (``g * x / rms(x)``: Llama's g = weight, Gemma's 1 + weight, read by
    :func:`attnlens.models.norms.rms_gain`)
    with the root mean square treated as a constant.

    The identity rule on the normalisation (AttnLRP Sec. 3.3, LXT's ``rms_norm_forward``): the layer is then the
    linear map ``x * (g / rms)``, which passes relevance element-wise unchanged (no bias, nothing absorbed).
    Float32 statistics as the stock module, so the forward value is the model's (to rounding); a float64 input
    stays float64 (the stock module would round it to float32: checks in float64 stay exact).
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return rms_gain(module, x) * (xf * _inv_rms(module, x).detach()).to(x.dtype)


def gated(gate: torch.Tensor, up: torch.Tensor, constant_gate: bool = False) -> torch.Tensor:
    """Element-wise ``gate * up`` of a gated MLP under the uniform rule: each factor gets half of the product's
    relevance (AttnLRP Eq. 7 for multiplication; LXT's ``gated_mlp_forward`` halves the gradient the same way).
    ``constant_gate``: the gate is a constant and ``up`` takes all of it (CP-LRP, LXT's ``cp_gated_mlp_forward``).
    """
    if constant_gate:
        return gate.detach() * up
    return sum_rule(gate * up, 0.0, 0.5)


def linear(module: nn.Module, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``nn.Linear`` (or ``Conv1D``) under the epsilon rule (``eps=0``: LRP-0, i.e. the unmodified gradient)."""
    return sum_rule(F.linear(x, linear_weight(module), module.bias), eps)


def weighted_sum(rules_name: str, x: torch.Tensor, weight: torch.Tensor, eps: float = 0.0,
                 switch: Any = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with a weight tensor that is not a Linear module's (Mixtral's expert and
    router weights; DeBERTa's projection with the biases it adds after it) under the rule set's Linear rule: z+ for
    the chefer sets, else epsilon (0: LRP-0)."""
    if rules_name in ("chefer", "chefer-lrp"):
        return _ZPlusLinear.apply(x, weight, bias, rules_name == "chefer", switch)
    return sum_rule(F.linear(x, weight, bias), eps)


# ---------------------------------------------------------------- the authors' rules (Chefer et al. 2021)
def _safe_divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b == 0, torch.zeros_like(a), a / torch.where(b == 0, torch.ones_like(b), b))


class _ZPlusLinear(torch.autograd.Function):
    """``F.linear`` forward; backward applies the z+ rule (LRP alpha=1, beta=0) with one shared denominator.

    As ``layers_ours.Linear.relprop`` of Chefer et al.: ``Z = W+ x+ + W- x-`` (no bias), ``S = R / Z``,
    ``R_x = x+ * (W+^T S) + x- * (W-^T S)``. Only positive contributions receive relevance and the bias none,
    so the rule is conservative wherever ``Z != 0``. With ``shared=False`` the two parts get separate
    denominators, ``R / (W+ x+)`` and ``R / (W- x-)``, as in their ``layers_lrp.py`` (the rules of their LRP
    baselines), which counts the relevance of a row twice when both parts are non-zero.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                shared: bool = True, switch: Any = None) -> torch.Tensor:
        z = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight, z, bias)
        ctx.shared, ctx.switch = shared, weak(switch)
        return z

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight, z, bias = ctx.saved_tensors
        if _attnlrp_mode(ctx.switch):  # LRP-0: the gradient
            return grad @ weight, None, None, None, None
        rel = z * grad  # relevance R_z arriving at the output
        if ctx.shared:
            # 2 (W+ x+ + W- x-) = |W| |x| + W x: one matmul instead of two; with s = R / (|W| |x| + W x) the
            # input's share is x+ (2 W+^T s) + x- (2 W-^T s) = x (sign(x) |W|^T s + W^T s)
            w_abs = weight.abs()
            denom = F.linear(x.abs(), w_abs, None if bias is None else -bias).add_(z)  # z - b + |W| |x|
            s = rel.div_(denom).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # R / 0 (all inputs 0): none
            grad_x = torch.addcmul(s @ weight, s @ w_abs, torch.sign(x))
        else:
            w_pos, w_neg = weight.clamp(min=0), weight.clamp(max=0)
            s_pos = _safe_divide(rel, F.linear(x.clamp(min=0), w_pos))
            s_neg = _safe_divide(rel, F.linear(x.clamp(max=0), w_neg))
            grad_x = torch.where(x > 0, s_pos @ w_pos, s_neg @ w_neg)
        # where x == 0 the rule gives no relevance, and passes none further down (their safe_divide by 0)
        return grad_x.masked_fill_(x == 0, 0.0), None, None, None, None


def zplus_linear(module: nn.Module, x: torch.Tensor, shared: bool = True, switch: Any = None) -> torch.Tensor:
    """``nn.Linear`` (or ``Conv1D``) under the authors' z+ rule (``shared=False``: the two denominators of
    ``layers_lrp.py``)."""
    return _ZPlusLinear.apply(x, linear_weight(module), module.bias, shared, switch)


class _ZPlusOp(torch.autograd.Function):
    """``op(x, weight) + bias`` for an operation linear in ``x`` (a convolution) under the z+ rule of
    :class:`_ZPlusLinear` (``shared``: one denominator); the transposed maps ``W+^T S``, ``W-^T S`` are the
    operation's own vector-Jacobian products."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                op, shared: bool = True, switch: Any = None) -> torch.Tensor:
        z = op(x, weight)
        if bias is not None:  # channels first: (B, C, ...)
            z = z + bias.view(-1, *([1] * (z.dim() - 2)))
        ctx.save_for_backward(x, weight, z)
        ctx.op, ctx.shared, ctx.switch = op, shared, weak(switch)
        return z

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight, z = ctx.saved_tensors
        if _attnlrp_mode(ctx.switch):  # LRP-0: the operation's own vector-Jacobian product
            with torch.enable_grad():
                leaf = x.detach().requires_grad_(True)
                (grad_x,) = torch.autograd.grad(ctx.op(leaf, weight), leaf, grad)
            return grad_x, None, None, None, None, None
        rel = z * grad  # relevance R_z arriving at the output
        w_pos, w_neg = weight.clamp(min=0), weight.clamp(max=0)
        z_pos, z_neg = ctx.op(x.clamp(min=0), w_pos), ctx.op(x.clamp(max=0), w_neg)
        if ctx.shared:
            s_pos = s_neg = _safe_divide(rel, z_pos + z_neg)
        else:
            s_pos, s_neg = _safe_divide(rel, z_pos), _safe_divide(rel, z_neg)
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            (g_pos,) = torch.autograd.grad(ctx.op(leaf, w_pos), leaf, s_pos)
            (g_neg,) = torch.autograd.grad(ctx.op(leaf, w_neg), leaf, s_neg)
        grad_x = torch.where(x > 0, g_pos, g_neg)
        return grad_x.masked_fill_(x == 0, 0.0), None, None, None, None, None


def _conv_op(module: nn.Conv1d):
    if module.padding_mode != "zeros":
        raise ValueError(f"LRP covers zero-padded convolutions, not padding_mode={module.padding_mode!r}")
    return partial(F.conv1d, bias=None, stride=module.stride, padding=module.padding, dilation=module.dilation,
                   groups=module.groups)


def zplus_conv(module: nn.Conv1d, x: torch.Tensor, shared: bool = True, switch: Any = None) -> torch.Tensor:
    """``nn.Conv1d`` under the authors' z+ rule (as :func:`zplus_linear`)."""
    return _ZPlusOp.apply(x, module.weight, module.bias, _conv_op(module), shared, switch)


def conv(module: nn.Conv1d, x: torch.Tensor, eps: float) -> torch.Tensor:
    """``nn.Conv1d`` under the epsilon rule (a weighted sum, as :func:`linear`)."""
    return sum_rule(nn.Conv1d.forward(module, x), eps)


def capped(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's score and logit caps) under the identity rule."""
    return identity_rule(lambda z: torch.tanh(z / cap) * cap, x)


def pass_through(fn, x: torch.Tensor, other=None, switch: Any = None) -> torch.Tensor:
    """``fn(x)`` for any shape-preserving function, with the identity rule ``R_x = R_y`` element-wise.

    The authors' rule for LayerNorm and softmax (``RelProp.relprop`` returns R unchanged). Where ``x == 0`` or is
    not finite the output keeps its value ``fn(x)`` (a LayerNorm maps 0 to beta, not 0) but passes no relevance:
    ``x * grad`` is 0 there, and the authors' next ``safe_divide`` by that 0 drops it too.
    ``other(x, y, grad)``: the backward of the operation as AttnLRP writes it, run while ``switch`` is in AttnLRP
    mode.
    """
    return _Relay.apply(x, fn, other, switch)


class _NormalizedAdd(torch.autograd.Function):
    """Residual sum ``a + b`` whose backward splits relevance as Chefer et al.'s ``Add.relprop``, per example.

    The proportional split ``R_a = a * g``, ``R_b = b * g`` is rescaled so that each operand's total is
    ``|sum R_a| / (|sum R_a| + |sum R_b|) * sum R``. The authors sum over the whole tensor (mixing the batch);
    here every sum is over one example, so batching changes nothing.
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, value: torch.Tensor,  # type: ignore[override]
                switch: Any = None) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.switch = weak(switch)
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if _attnlrp_mode(ctx.switch):  # a plain sum
            return grad, grad, None, None
        a, b = ctx.saved_tensors
        dims = tuple(range(1, grad.dim()))
        shape = (-1,) + (1,) * (grad.dim() - 1)
        ra, rb = (a * grad).sum(dims), (b * grad).sum(dims)
        total = ra + rb
        norm = ra.abs() + rb.abs()
        fa = _safe_divide(_safe_divide(ra.abs(), norm) * total, ra)
        fb = _safe_divide(_safe_divide(rb.abs(), norm) * total, rb)
        return grad * fa.view(shape), grad * fb.view(shape), None, None


def normalized_residual(total: torch.Tensor, branch: torch.Tensor, switch: Any = None) -> torch.Tensor:
    """Re-express ``total = skip + branch`` (already computed) as a normalised residual sum; same value."""
    return _NormalizedAdd.apply(total - branch, branch, total.detach(), switch)
