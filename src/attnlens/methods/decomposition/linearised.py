"""The linearised network DecompX differentiates: norms with their scale held, activations through the origin,
attention at its real weights, one layer's graph at a time, and the head's steps to the explained logit."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from ...core.attention_chunks import AttentionChunks, RecomputedChunks
from ...core.batch_state import BatchContext
from ...core.row_attention import repeat_kv
from ...errors import ModelError
from ...models.adapters import LAST
from ...models.architectures import HEAD_ACTIVATIONS, Anatomy, Layers, architecture_for
from ...models.layer_modules import module_at
from ...models.norms import as_layer_norm, is_rms_norm, rms_eps, rms_gain
from ...models.prefixes import last_positions
from .layers import (
    activation_ratio,
    check_head,
    check_layer,
    final_norm,
    layer_norm_std,
    layer_parts,
    pooled_position,
    value_vectors,
)


def _frozen_norm(v: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``norm(v)`` with its scale held constant (a linear map of ``v``, as DecompX reads a LayerNorm): a
    LayerNorm (v − mean)/s ⊙ γ + β, an RMSNorm v/s ⊙ g (:func:`attnlens.models.norms.rms_gain`); no norm
    (``nn.Identity``, ModernBERT's first layer) is ``v``."""
    if isinstance(norm, nn.Identity):
        return v
    if isinstance(norm, nn.LayerNorm):
        out = (v - v.mean(-1, keepdim=True)) / layer_norm_std(norm, v).detach()
        out = out if norm.weight is None else out * norm.weight
        return out if norm.bias is None else out + norm.bias
    if not is_rms_norm(norm):
        raise ModelError(f"decompx knows LayerNorm and RMSNorm, not {type(norm).__name__}")
    rms = (v.float().pow(2).mean(-1, keepdim=True) + rms_eps(norm)).sqrt().to(v.dtype)
    return v / rms.detach() * rms_gain(norm, v)


def _linearised(act: Callable[[torch.Tensor], torch.Tensor], pre: torch.Tensor) -> torch.Tensor:
    """``act(pre)`` as ``pre`` times the constant ratio act(pre)/pre (the zero-origin linearisation)."""
    return pre * activation_ratio(act(pre), pre).detach()


def _linear_ffn(mods: dict[str, nn.Module], y: torch.Tensor) -> torch.Tensor:
    """The FFN on ``y`` with its activation linearised; a gated FFN's product act(gate(y)) ⊙ up(y) is split half
    and half between its two factors (each times the other's real value), which keeps its value and makes it
    linear in ``y``."""
    if "moe" in mods:
        return _linear_moe(mods["moe"], y)
    if "gate" not in mods:
        return mods["ffn_out"](_linearised(mods["act"], mods["ffn_in"](y)))
    g = _linearised(mods["act"], mods["gate"](y))
    u = mods["ffn_in"](y)
    return mods["ffn_out"](_split_product(g, u))


def _split_product(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``g ⊙ u`` split half and half between its factors, each times the other's real value: the same value,
    linear in both."""
    return 0.5 * (g * u.detach() + g.detach() * u)


def _linear_moe(moe: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """A routed mixture of gated experts (Mixtral's) on ``y`` ``(B, N, D)``, linear in ``y``: the routing held at its
    real value (which experts serve each token, and their weights: constants, as the norms' scales are), each
    expert's gated FFN linearised as :func:`_linear_ffn`'s."""
    flat = y.reshape(-1, y.shape[-1])
    with torch.no_grad():
        _, weights, index = moe.gate(flat)  # (T, k) renormalised top-k probabilities and their experts
    experts = moe.experts
    out = torch.zeros_like(flat)
    for e in range(experts.num_experts):
        token, slot = torch.where(index == e)
        if token.numel() == 0:
            continue
        gate, up = torch.nn.functional.linear(flat[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
        g = _linearised(experts.act_fn, gate)
        hidden = torch.nn.functional.linear(_split_product(g, up), experts.down_proj[e])
        out = out.index_add(0, token, hidden * weights[token, slot, None].to(hidden.dtype))
    return out.reshape(y.shape)


def _mix(attn: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(B, N, H·d_h)``: every head's attention-weighted values (``v``: ``(B, N, H, d_h)``), heads concatenated."""
    return torch.einsum("bhij,bjhv->bihv", attn, v).flatten(2)


def head_steps(ctx: BatchContext, anatomy: Anatomy) -> list[tuple[nn.Module, Callable | None]]:
    """From the pooled state to the logits: a language model's output embeddings, or the classification head's
    ``(linear or norm, activation)`` steps."""
    model = ctx.model
    if ctx.head.task == "causal-lm":  # Gemma 2 caps its logits, c · tanh(z / c): linearised as a head activation
        cap = getattr(model.config, "final_logit_softcapping", None)
        return [(model.get_output_embeddings(), None if not cap else functools.partial(_softcap, cap=float(cap)))]
    if ctx.head.task in ("token", "qa"):
        return _token_head_steps(model)
    return [(module_at(model, lin), None if act is None else HEAD_ACTIVATIONS.get(act) or module_at(model, act))
            for lin, act in anatomy.head]


def _token_head_steps(model: nn.Module) -> list[tuple[nn.Module, Callable | None]]:
    """A token classifier's or extractive QA model's head, applied to every token state: transformers names its
    output projection ``qa_outputs``, ``classifier`` or ``score``; ModernBERT's runs its prediction head (dense,
    activation, norm) first. The logits these steps give are checked against the model's own."""
    steps: list[tuple[nn.Module, Callable | None]] = []
    pre = getattr(model, "head", None)
    if pre is not None:
        if not all(isinstance(getattr(pre, a, None), nn.Module) for a in ("dense", "act", "norm")):
            raise ModelError(f"decompx does not know the head of {type(model).__name__}")
        steps += [(pre.dense, pre.act), (pre.norm, None)]
    for name in ("qa_outputs", "classifier", "score"):
        out = getattr(model, name, None)
        if isinstance(out, nn.Linear):
            return [*steps, (out, None)]
    raise ModelError(f"decompx does not know the output layer of {type(model).__name__}")


def _is_norm(module: nn.Module) -> bool:
    """Whether a head step is a norm (ModernBERT's head ends with a LayerNorm), read with its scale held."""
    return isinstance(module, nn.LayerNorm) or is_rms_norm(module)


def _softcap(z: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(z / cap)


def output_weights(logits: torch.Tensor, targets: torch.Tensor, contrast: bool) -> torch.Tensor:
    """``(B, C)`` weights of the explained combination of logits: the target's one-hot, minus the softmax with
    ``contrast`` (z_t − Σ_c p_c z_c, the first-order change of log p_t)."""
    n = logits.shape[-1]
    if targets.dim() == 2:  # (target, contrast) pairs of a contrastive head: z_t − z_c, a combination of logits
        w = torch.nn.functional.one_hot(targets[:, 0], n) - torch.nn.functional.one_hot(targets[:, 1], n)
        return w.to(logits.dtype)
    w = torch.nn.functional.one_hot(targets, n).to(logits.dtype)
    return w - logits.softmax(-1) if contrast else w


def layer_values(mods: dict[str, nn.Module], anatomy: Anatomy, h: torch.Tensor, heads: int, spec: Layers
                  ) -> torch.Tensor:
    """A linearised layer's value vectors ``(B, N, H, d_h)`` of its input ``h`` (a pre-LN layer's through LN1 with
    its scale held)."""
    return value_vectors(mods, _frozen_norm(h, mods["ln1"]) if anatomy.pre_ln else h, heads, spec)


def layer_rest(block: nn.Module, mods: dict[str, nn.Module], anatomy: Anatomy, h: torch.Tensor,
                mixed: torch.Tensor, final: nn.Module | None = None, cross: torch.Tensor | None = None
                ) -> torch.Tensor:
    """A linearised layer's output from its input ``h`` and its attention-mixed values ``mixed`` ``(B, N, H·d_h)``
    (heads concatenated; ``cross``: a decoder layer's cross-attention branch, already through its output
    projection): the output projection, residuals, norms with their scales held, the FFN with its activation
    linearised; ``final``: the model's final norm after a pre-LN model's last layer."""
    att = mods["output"](mixed)
    if anatomy.pre_ln:
        y = h + (_frozen_norm(att, mods["post_attn_norm"]) if "post_attn_norm" in mods else att)
        y = y if cross is None else y + cross
        ffn = _linear_ffn(mods, _frozen_norm(h if anatomy.parallel else y, mods["ln2"]))
        out = y + (_frozen_norm(ffn, mods["post_ffn_norm"]) if "post_ffn_norm" in mods else ffn)
        return out if final is None else _frozen_norm(out, final)
    y = _frozen_norm(h + att, mods["ln1"])
    if cross is not None:
        y = _frozen_norm(y + cross, as_layer_norm(module_at(block, anatomy.cross_norm)))
    return _frozen_norm(y + _linear_ffn(mods, y), mods["ln2"])


def linear_layers(model: nn.Module, anatomy: Anatomy, blocks: list[nn.Module], hidden: list[torch.Tensor],
                   attentions: list[torch.Tensor], real: torch.Tensor, h: torch.Tensor,
                   cross: tuple[torch.Tensor, list[torch.Tensor]] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers ``blocks`` linearised at the real pass (``hidden``, whole ``attentions``; attention, norm scales
    and activation ratios held at their values there) on the input ``h``, as one graph: ``(the last layer's
    output, the first layer's value vectors)``, the value vectors a leaf of their own (DecompX gives a token its
    layer-1 value vector, value bias included). ``cross``: a decoder's ``(memory, cross-attention maps)``, the
    encoder's output (linear in the encoder's input) and each layer's maps over it. Each recomputed layer is
    checked against the next hidden state at the ``real`` positions."""
    spec = architecture_for(model.config).layers
    final = final_norm(model, anatomy)
    value0 = None
    for i, (block, attn) in enumerate(zip(blocks, attentions, strict=True)):
        mods = layer_parts(block, model, anatomy)
        v = layer_values(mods, anatomy, h, attn.shape[1], spec)
        if value0 is None:
            value0 = v = v.detach().requires_grad_(True)
        mixed = None
        if cross is not None:  # the keys are the encoder's outputs (a pre-LN block normalises only its queries)
            memory, maps = cross
            parts = {"value": module_at(block, anatomy.cross_value), "output": module_at(block, anatomy.cross_output)}
            mixed = parts["output"](_mix(maps[i], value_vectors(parts, memory, maps[i].shape[1], spec)))
        h = layer_rest(block, mods, anatomy, h, _mix(attn, v), final if i == len(blocks) - 1 else None, mixed)
        check_layer(model, i, h.detach(), hidden[i + 1], real)
    return h, value0


class HeldAttention:
    """One layer's attention held at the real pass's weights, applied to (linearised) value vectors ``(B, N, H,
    d_h)`` and transposed for the vector-Jacobian products, without an ``N × N`` map kept: where the pass kept the
    layer's queries and keys and the layer has no mask beyond causality, by fused attention (PyTorch SDPA) on
    them, whose backward is the transposed product (one cotangent per example); otherwise through its maps a chunk
    of query rows at a time (:meth:`AttentionChunks.chunks`)."""

    def __init__(self, chunks: AttentionChunks, layer: int, cotangents: int) -> None:
        self.chunks, self.layer = chunks, layer
        factors = chunks.factors[layer] if isinstance(chunks, RecomputedChunks) else None
        self.fused = factors if factors is not None and factors.mask is None and cotangents == 1 else None

    def apply(self, v: torch.Tensor) -> torch.Tensor:
        """``(B, N, H·d_h)``: the attention applied to ``v``, heads concatenated (no graph)."""
        b, n, h, dh = v.shape
        f = self.fused
        if f is not None:
            self.values = v.detach().transpose(1, 2).contiguous().requires_grad_(True)
            with torch.enable_grad():
                self.out = nn.functional.scaled_dot_product_attention(
                    f.query[:b], repeat_kv(f.key, f.groups)[:b], self.values.to(f.query.dtype), scale=f.scale,
                    is_causal=f.causal)
            return self.out.detach().to(v.dtype).transpose(1, 2).flatten(2)
        out = v.new_zeros(b, n, h, dh)
        with torch.no_grad():
            for start, a, _ in self.chunks.chunks(self.layer):
                a = a[:b].to(v.dtype)
                out[:, start:start + a.shape[2]] = torch.einsum("bhqk,bkhv->bqhv", a, v[:, :a.shape[3]])
        return out.flatten(2)

    def transposed(self, g: torch.Tensor) -> torch.Tensor:
        """``(R, B, N, H, d_h)``: the vector-Jacobian products of :meth:`apply` with the cotangents ``g`` ``(R, B,
        N, H, d_h)`` of its output, ``Aᵀ g`` per head."""
        if self.fused is not None:
            (gv,) = torch.autograd.grad(self.out, self.values, g[0].transpose(1, 2).to(self.out.dtype))
            del self.out, self.values
            return gv.to(g.dtype).transpose(1, 2).unsqueeze(0)
        r, b, n, h, dh = g.shape
        out = torch.zeros_like(g)
        with torch.no_grad():
            for start, a, _ in self.chunks.chunks(self.layer):
                a = a[:b].to(g.dtype)
                stop, keys = start + a.shape[2], a.shape[3]
                out[:, :, :keys] += torch.einsum("bhqk,rbqhv->rbkhv", a, g[:, :, start:stop])
        return out


def vjp(outputs: torch.Tensor, inputs: list[torch.Tensor], cotangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The vector-Jacobian products of ``outputs`` ``(B, ...)`` w.r.t. ``inputs`` for the ``R`` cotangents
    ``(R, B, ...)``: ``(R, *input.shape)`` each (batched where R > 1; 0 where an input is not used)."""
    if cotangents.shape[0] == 1:
        grads = torch.autograd.grad(outputs, inputs, cotangents[0], allow_unused=True)
        grads = tuple(None if g is None else g.unsqueeze(0) for g in grads)
    else:
        grads = torch.autograd.grad(outputs, inputs, cotangents, is_grads_batched=True, allow_unused=True)
    return tuple(torch.zeros(cotangents.shape[0], *x.shape, dtype=x.dtype, device=x.device) if g is None else g
                 for g, x in zip(grads, inputs, strict=True))


def through_head(steps: list[tuple[nn.Module, Callable | None]], state: torch.Tensor) -> torch.Tensor:
    """``state`` through the head's ``(linear or norm, activation)`` steps (:func:`head_steps`), linearised: each
    norm with its scale held, each activation as its ratio at the real pre-activation."""
    for linear, act in steps:
        state = _frozen_norm(state, linear) if _is_norm(linear) else linear(state)
        if act is not None:
            state = _linearised(act, state)
    return state


def head_logit(ctx: BatchContext, h: torch.Tensor, anatomy: Anatomy, contrast: bool) -> torch.Tensor:
    """``(B,)``: the explained combination of logits, read where the head reads from the last hidden state ``h``
    (a generation's steps: the one sequence's, each row its own position), through the head's steps linearised."""
    cap, model = ctx.capture, ctx.model
    read = ctx.head.read_rows(ctx.targets)
    if read is not None:  # a head summing values read at several positions (an answer's tokens)
        example, position, label = read
        state = h[example, position]
    elif pooled_position(model) == LAST:  # each row's last token (a generation's steps: each its own, in the sequence)
        if ctx.sequence is not None:  # each step's last token
            state = h[0, last_positions(cap.key_mask.bool()).to(h.device)]
        else:
            last = ctx.adapter.classification_index(ctx.inputs["input_ids"], ctx.token_mask, model.config,
                                                    skip_pad=ctx.head.finds_last_by_pad_id).to(h.device)
            state = h[torch.arange(h.shape[0], device=h.device), last]
    else:
        state = h[:, 0]
    state = through_head(head_steps(ctx, anatomy), state)
    if read is not None and ctx.head.task in ("token", "qa"):  # the head found by name: its logits checked
        check_head(state.detach(), cap.logits[example, position], type(model).__name__)
    if read is None:
        return (state * output_weights(state.detach(), ctx.targets, contrast)).sum(-1)
    values = (state * output_weights(state.detach(), label, contrast)).sum(-1)  # each at its own position
    rows = ctx.targets.shape[0] if ctx.sequence is not None else h.shape[0]
    return torch.zeros(rows, dtype=values.dtype, device=values.device).index_add(0, example, values)
