"""The state of one LRP forward (:class:`PassState`), the thread's running pass, and the attention rules every
LRP forward shares (:func:`score_product`, :func:`attend`): what the patch (:mod:`attnlens.lrp.patch`) and the
per-architecture forwards (:mod:`attnlens.lrp.modules`) both build on."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from ..core.row_attention import LayerFactors, chunk_elements, fused_kernel, keys_seen, masked_scores
from . import rules

ATTN_NAME = "attnlens_lrp"  # the attention implementation an LRP forward runs (registered by attnlens.lrp.patch)
# the same under PassState.fused, with SDPA's masks (boolean, or none where causality alone masks)
FUSED_ATTN_NAME = "attnlens_lrp_fused"
# Chefer et al.'s two rule sets: their modified rules (layers_ours.py, what TransAtt and AttCAT's PartialLRP run)
# and the plain LRP rules of their baselines (layers_lrp.py, what their ERASER PartialLRP ran).
CHEFER = ("chefer", "chefer-lrp")


@dataclass
class PassState:
    """What the patched modules record during one LRP forward."""

    rules: str = "attnlrp"
    epsilon: float = 0.0
    # the rule set of the backward now running through a chefer-layout forward (``lrp_passes``): the chefer
    # rules read it (their ``switch``) and run AttnLRP's rule instead while it is "attnlrp"
    mode: str | None = None
    track_softmax: bool = False
    probs: list[torch.Tensor] = field(default_factory=list)
    softmax_inputs: list[torch.Tensor] = field(default_factory=list)
    # other softmaxes under the softmax rule (Mixtral's routing weights): (output, input) pairs, batch first,
    # recorded with track_softmax for the relevance they absorb
    other_softmaxes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    embedding_sum: torch.Tensor | None = None
    branches: dict[int, torch.Tensor] = field(default_factory=dict)  # residual branch per LayerNorm (chefer)
    word_embeddings: torch.Tensor | None = None
    decoder_sum: torch.Tensor | None = None  # an encoder-decoder's decoder inputs (LRPSupport.decoder_input)
    position_inputs: list[torch.Tensor] = field(default_factory=list)  # per-example relative-position leaves
    logit_cap: float | None = None  # the cap the pass applies to the model's raw logits (LRPSupport.logit_softcap)
    float32_scores: bool = False  # the attention interface computes the scores in float32 (LRPSupport.float32_scores)
    # attention through the interface runs fused (:func:`attend_fused`): no probabilities are kept, so no
    # attention relevance is read; AttnLRP with epsilon 0 only
    fused: bool = False
    attention_calls: int = 0  # attention computations seen (fused ones keep no probabilities)
    # a fused chefer pass: per layer what its maps are recomputed from, and 1/2 the modified gradient at its
    # attention output, whose product with the values is the modified gradient at the probabilities
    # (:class:`_FusedAttention`); a layer's index is fixed by its first call (a recomputed layer calls again)
    layer_index: dict[int, int] = field(default_factory=dict)
    factors: dict[int, LayerFactors | None] = field(default_factory=dict)
    # a pass whose backward stops at the last layer's attention: a layer's factors are let go (None) once the next
    # layer records its own, so only the last layer's stay
    last_factors_only: bool = False
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    # the attention output ``(B, H, N, d)`` of the latest layer a fused chefer forward ran (the last layer's once
    # the forward is done): a backward that stops there reads the last layer's gradient without running below it
    last_output: torch.Tensor | None = None
    # called by a fused chefer backward for each chunk of query rows it recomputes, top layer first:
    # ``(layer, first query row, A (B, H, q, K), R(A) there)``, K the keys the chunk's rows see
    chunk_reader: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None

    def release(self) -> None:
        """Let go of every tensor and reader the pass recorded (each field rebound, so a result that shares one of
        its containers keeps it). Called once the pass is done: layers recomputed in the backward hold the patched
        forwards, which hold this state, so whatever the backward left unrun (the layers below the last, when it
        stops there) would otherwise keep the state, and the state the graph, in a cycle through autograd's nodes
        that Python's collector cannot see."""
        self.probs, self.softmax_inputs, self.other_softmaxes, self.position_inputs = [], [], [], []
        self.embedding_sum = self.word_embeddings = self.decoder_sum = self.last_output = None
        self.branches, self.factors, self.output_grads, self.layer_index = {}, {}, {}, {}
        self.chunk_reader = None

    def logits(self, outputs: Any) -> Any:
        """The model's outputs with ``logit_cap`` applied to their logits under the identity rule."""
        if self.logit_cap is not None:
            outputs.logits = rules.capped(outputs.logits, self.logit_cap)
        return outputs

    def position_leaf(self, table: torch.Tensor, batch: int) -> torch.Tensor:
        """A per-example copy ``(B, P, D)`` of a shared relative-position table ``(P, D)``, recorded as a leaf:
        the relevance that reaches it (absorbed by these parameters) is then measured per example."""
        leaf = table.detach().unsqueeze(0).expand(batch, -1, -1).clone().requires_grad_(True)
        self.position_inputs.append(leaf)
        return leaf

    def position_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """A per-example relative-position score bias ``(B, ...)`` (BLOOM's and Falcon's ALiBi) as a leaf: the
        relevance of the scores it takes (a constant's share, like a bias's) is measured per example."""
        leaf = bias.detach().clone().requires_grad_(True)
        self.position_inputs.append(leaf)
        return leaf


# the state of the LRP pass running in this thread (lrp_mode sets it); a context variable, so that a layer
# recomputed in the backward (autograd's own thread on a GPU) runs in it too (attnlens.models.recompute)
_STATE: ContextVar[PassState | None] = ContextVar("attnlens_lrp_state", default=None)


def running_state() -> PassState | None:
    """The state of the LRP pass running in this thread, or ``None``."""
    return _STATE.get()


def set_running_state(state: PassState | None) -> None:
    """Make ``state`` the running pass's state (``None``: no pass is running)."""
    _STATE.set(state)


def active_state() -> PassState:
    """The running pass's state; a :class:`RuntimeError` outside an LRP pass."""
    state = running_state()
    if state is None:
        raise RuntimeError(f"attention implementation {ATTN_NAME!r} is only usable inside attnlens.lrp.lrp_pass")
    return state


def score_product(state: PassState, scores: torch.Tensor) -> torch.Tensor:
    """A bilinear attention-score term (``Q K^T``, or DeBERTa's content-position products) under the rule set:
    uniform rule (half the relevance to each factor, AttnLRP Eq. 7; Chefer et al.'s halved ``MatMul``) with the
    epsilon rule on the sum; cut from the graph under CP-LRP."""
    return scores.detach() if state.rules == "cp" else rules.sum_rule(scores, state.epsilon, 0.5)


def _attnlrp_attention_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                mask: torch.Tensor | None, scale: float, causal: bool, grad: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AttnLRP's (ε = 0) gradients at the query, key and value of fused attention: its true ones, scaled."""
    query, key, value = (t.detach().requires_grad_(True) for t in (query, key, value))
    with torch.enable_grad():
        out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                         is_causal=causal)
        dq, dk, dv = torch.autograd.grad(out, (query, key, value), grad)
    return dq * 0.25, dk * 0.25, dv * 0.5


def _chefer_attention_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               mask: torch.Tensor | None, scale: float, causal: bool, grad: torch.Tensor,
                               reader: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None,
                               layer: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`attend` under Chefer et al.'s rules at ``query``, ``key``, ``value``
    ``(B, H, N, d)`` for ``grad`` at the output, the probabilities recomputed a chunk of query rows at a time:
    ``A V`` halves the gradient (uniform rule), the softmax passes relevance through (``∂ ← ∂ · A / S``, 0 where
    ``S`` is 0 or masked) and ``q Kᵀ`` halves again (:func:`score_product`). ``reader``: given each chunk's
    probabilities and attention relevance ``R(A) = A ⊙ (½∂O) Vᵀ`` (:attr:`PassState.chunk_reader`, for
    ``layer``), so a method reading them needs no pass over the maps of its own."""
    b, h, n, _ = query.shape
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    half = 0.5 * grad
    step = max(1, chunk_elements(query.device, backward=True) // max(1, b * h * key.shape[2]))
    for start in range(0, n, step):
        stop = min(n, start + step)
        rows = torch.arange(start, stop, device=query.device)
        keys = slice(0, keys_seen(stop, key.shape[2], causal, mask))  # the keys no row of the chunk sees: left out
        k, v = key[:, :, keys], value[:, :, keys]
        s = masked_scores(query, k, mask, rows, causal, scale)
        a = torch.softmax(s, dim=-1)  # in the scores' dtype, as attend() computes it
        g = half[:, :, rows]
        dv[:, :, keys] += torch.matmul(a.transpose(2, 3), g)
        gs = torch.matmul(g, v.transpose(2, 3))
        if reader is not None:
            reader(layer, start, a, a * gs)
        gs.mul_((a / s).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0))
        gs.mul_(0.5 * scale)
        dq[:, :, rows] = torch.matmul(gs, k)
        dk[:, :, keys] += torch.matmul(gs.transpose(2, 3), query[:, :, rows])
    return dq, dk, dv


class _FusedAttention(torch.autograd.Function):
    """``softmax(Q Kᵀ · scale + mask) V`` by PyTorch's fused attention, nothing ``N × N`` kept between forward and
    backward, with the backward of the pass's rules.

    AttnLRP (ε = 0; no ``state``, or the AttnLRP backward of a joint pass, ``state.mode``): every rule of the
    attention is the true gradient scaled — the uniform rule gives each factor of ``A V`` half (V: ½ ∂, A: ½ ∂),
    the softmax keeps its true gradient, and the uniform rule on ``Q Kᵀ`` halves again (Q, K: ¼ ∂) — so the
    backward recomputes the fused attention with a graph and scales its true gradients
    (:func:`_attnlrp_attention_backward`): the same relevances as :func:`attend`'s eager rules, without the
    probabilities. Chefer et al.'s rules (a ``state``): the backward recomputes the probabilities chunk by chunk
    (:func:`_chefer_attention_backward`) and records half the gradient at the output
    (``state.output_grads[layer]``: the attention relevance is ``A ⊙ (that · Vᵀ)``)."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # type: ignore[override]
                mask: torch.Tensor | None, scale: float, causal: bool, state: PassState | None = None,
                layer: int = 0) -> torch.Tensor:
        ctx.save_for_backward(query, key, value)
        ctx.mask, ctx.scale, ctx.causal, ctx.state, ctx.layer = mask, scale, causal, rules.weak(state), layer
        return nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           is_causal=causal)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        query, key, value = ctx.saved_tensors
        state = rules.strong(ctx.state)
        if state is None or state.mode == "attnlrp":
            grads = _attnlrp_attention_backward(query, key, value, ctx.mask, ctx.scale, ctx.causal, grad)
        else:
            state.output_grads[ctx.layer] = (0.5 * grad).detach()
            grads = _chefer_attention_backward(query, key, value, ctx.mask, ctx.scale, ctx.causal, grad,
                                               state.chunk_reader, ctx.layer)
        return (*grads, None, None, None, None, None)


def attend_fused_chefer(state: PassState, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, groups: int, mask: torch.Tensor | None, scale: float,
                        causal: bool) -> torch.Tensor:
    """Chefer et al.'s attention through fused attention (:class:`_FusedAttention`): ``(B, H, Q, d)``, the
    layer's queries, keys and values (one per key head) and its output recorded on its first call."""
    layer = state.layer_index.setdefault(id(module), len(state.layer_index))
    first = layer not in state.factors  # not the layer recomputed in the backward
    if first:
        if state.last_factors_only and layer:
            state.factors[layer - 1] = None
        state.factors[layer] = LayerFactors(query.detach(), key.detach(), mask, causal, scale, groups,
                                            value.detach())
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = _FusedAttention.apply(query, key, value, mask, scale, causal, state, layer)
    if first:
        state.last_output = out
    return out


def attend_fused(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 scale: float, causal: bool = False, groups: int = 1) -> torch.Tensor:
    """AttnLRP's attention (ε = 0) through fused attention: ``(B, H, Q, d)``, no probabilities kept.
    ``mask``: SDPA's mask (boolean, or additive), ``causal``: no mask but causality; ``key`` and ``value`` one per
    key head, each serving ``groups`` query heads (grouped-query attention).

    Every rule of the attention is its true gradient scaled (:class:`_FusedAttention`), so where PyTorch runs a
    fused kernel for these inputs (its backward keeps the output and the rows' log-sum-exp, nothing ``N × N``)
    that kernel's own backward serves, the gradients scaled at Q, K (¼) and V (½): no forward recomputed in
    the backward. With grouped heads the kernel reads each key head for its group (``enable_gqa``), so the pass
    keeps the key heads, not a copy per query head. Where it would fall back to its unfused math (which keeps
    the probabilities for its backward), :class:`_FusedAttention` recomputes the attention in its backward
    instead."""
    grouped = groups > 1 and fused_kernel(query, key, value, mask, scale, causal, grouped=True)
    if groups > 1 and not grouped:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if grouped or fused_kernel(query, key, value, mask, scale, causal):
        return nn.functional.scaled_dot_product_attention(
            rules.sum_rule(query, 0.0, 0.25), rules.sum_rule(key, 0.0, 0.25), rules.sum_rule(value, 0.0, 0.5),
            attn_mask=mask, scale=scale, is_causal=causal, **({"enable_gqa": True} if grouped else {}))
    return _FusedAttention.apply(query, key, value, mask, scale, causal)


def attend(state: PassState, scores: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax of masked ``scores`` ``(B, H, Q, K)`` and ``A V`` under the rule set; records ``A``.

    AttnLRP: the softmax keeps its true gradient, which in gradient x input form *is* AttnLRP's softmax rule
    ``R_x = x (R_s - s sum R_s)``; uniform rule on ``A V``. CP-LRP (Ali et al. 2022): ``A`` is a leaf, so all
    relevance goes through ``V``; the relevance reaching ``A`` is measured but not propagated further.
    chefer, chefer-lrp: as AttnLRP but the softmax passes relevance through unchanged (identity), as in Chefer
    et al.'s code (their ``MatMul.relprop`` is the same proportional split, halved per factor).
    Returns ``(A V (B, H, Q, d), A)``.
    """
    cp = state.rules == "cp"
    state.attention_calls += 1
    if state.rules in CHEFER:
        probs = rules.pass_through(partial(nn.functional.softmax, dim=-1), scores, rules.softmax_backward, state)
    else:
        probs = nn.functional.softmax(scores, dim=-1)
    probs = probs.to(value.dtype)  # a model that computes its scores in float32 (GPT-Neo, GPT-J) casts back
    if cp:  # a leaf: relevance reaching A is measured there and goes no further
        probs = probs.detach().requires_grad_(True)
    state.probs.append(probs)
    if state.track_softmax:
        state.softmax_inputs.append(scores)
    return rules.sum_rule(torch.matmul(probs, value), state.epsilon, 1.0 if cp else 0.5), probs
