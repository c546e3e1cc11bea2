"""DecompX (Modarressi et al. 2023): each token's share of the explained logit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...core.batch_state import BatchContext
from ...core.memory import model_dims
from ...errors import InputError
from ...models.architectures import HEAD_ACTIVATIONS, Anatomy, architecture_for
from ...models.layer_modules import module_at
from ...models.prefixes import row_gradients
from ..registry import (
    ATTENTION_CHUNKS,
    HIDDEN,
    LAYER_GRAPH,
    MethodOutput,
    check_flag,
    register,
)
from .decompx_seq2seq import seq2seq_decompx_bytes, seq2seq_output
from .layers import (
    Layer,
    activation_ratio,
    anatomy_of,
    applicability,
    check_layer,
    final_norm,
    layer_blocks,
    layer_parts,
    ln_part,
    model_layers,
    pass_states,
)
from .linearised import HeldAttention, head_logit, layer_rest, layer_values, output_weights, vjp

BIAS_MODES = ("absdot", "token")


_ELEMENTS = 2**24  # elements of one (B, rows, N, D) block: bounds the memory of the per-source-token vectors


def _check_decompx(bias: str = "token", contrast: bool = False) -> None:
    """DecompX's option values."""
    if bias not in BIAS_MODES:
        raise InputError(f"bias={bias!r}; choose one of {', '.join(BIAS_MODES)}")
    check_flag("decompx", "contrast", contrast)


def _decompx_fits(model: Any, stream: str, task: str, options: Mapping[str, Any]) -> str | None:
    """Why DecompX with ``options`` cannot explain such a model: ``bias='absdot'`` shares the biases of a post-LN
    encoder's sequence classifier (the authors' setting) and of nothing else."""
    bias = options.get("bias", "token")
    if bias == "token":
        return None
    if architecture_for(model.config).family == "encoder-decoder":
        return (f"decompx bias={bias!r} propagates every token's vectors through an encoder; on an "
                "encoder-decoder use bias='token' (the default)")
    if anatomy_of(model).pre_ln:
        return (f"decompx bias={bias!r} (sharing each bias among the tokens) is implemented for post-LN encoders; "
                f"this {model.config.model_type!r} model is pre-LN: use bias='token' (the default)")
    if task != "classification":
        return (f"decompx bias={bias!r} decomposes a sequence classifier's first token; for a {task} model use "
                "bias='token' (the default)")
    return None


# --- DecompX ------------------------------------------------------------------------------------------------------
def _add_bias(vectors: torch.Tensor, bias: torch.Tensor, mode: str) -> torch.Tensor:
    """Add ``bias`` (broadcast to ``(..., D)``) to the decomposition ``vectors`` ``(..., K, D)``: ``"absdot"``
    shares it among the K sources in proportion to |vector · bias| (the authors' default); ``"token"`` puts it on
    the last source, the bias term."""
    bias = bias.expand(*vectors.shape[:-2], vectors.shape[-1]).unsqueeze(-2)
    if mode == "token":
        vectors[..., -1:, :] += bias
        return vectors
    w = (vectors * bias).sum(-1, keepdim=True).abs()
    return vectors + w / (w.sum(-2, keepdim=True) + 1e-12) * bias


def _decompose_layer(e: torch.Tensor, layer: Layer, first: bool, rows: slice, mode: str) -> torch.Tensor:
    """DecompX through one layer: ``e`` ``(b, N, K, D)`` decomposes the layer's input over K sources; returns the
    decomposition of its output at ``rows``. ``layer``'s tensors are already cut to the b examples of ``e``."""
    mods = layer.modules
    b, n, k, d = e.shape
    h = layer.attn.shape[1]
    v = torch.einsum("bjkd,ed->bjke", e, mods["value"].weight)
    bias = mods["output"].bias
    if first:  # layer 1: the value bias goes with each token's value, as in the authors' code
        idx = torch.arange(n, device=e.device)
        v[:, idx, idx] += mods["value"].bias
    else:
        bias = bias + mods["output"].weight @ mods["value"].bias
    mixed = torch.einsum("bhij,bjkhv->bikhv", layer.attn[:, :, rows], v.view(b, n, k, h, d // h))
    r = torch.einsum("bikhv,dhv->bikd", mixed, mods["output"].weight.view(d, h, d // h)) + e[:, rows]
    r = _add_bias(r, bias, mode)
    r = _add_bias(ln_part(r, mods["ln1"], layer.std1[:, rows, None]), mods["ln1"].bias, mode)
    u = _add_bias(torch.einsum("bikd,fd->bikf", r, mods["ffn_in"].weight), mods["ffn_in"].bias, mode)
    u = u * layer.theta[:, rows].unsqueeze(2)
    r = r + _add_bias(torch.einsum("bikf,df->bikd", u, mods["ffn_out"].weight), mods["ffn_out"].bias, mode)
    return _add_bias(ln_part(r, mods["ln2"], layer.std2[:, rows, None]), mods["ln2"].bias, mode)


def _decompose_head(e: torch.Tensor, state: torch.Tensor, model: nn.Module, anatomy: Anatomy,
                    mode: str) -> torch.Tensor:
    """The head's steps on the first token's decomposition ``e`` ``(b, K, D)`` (its real state ``state``), each
    activation linearised through the origin as in the FFN: ``(b, K, C)``."""
    for linear_path, act_path in anatomy.head:
        linear = module_at(model, linear_path)
        pre = linear(state)
        e = torch.einsum("bkd,cd->bkc", e, linear.weight)
        if linear.bias is not None:
            e = _add_bias(e, linear.bias, mode)
        if act_path is None:
            state = pre
            continue
        act = HEAD_ACTIVATIONS.get(act_path) or module_at(model, act_path)
        state = act(pre)
        e = e * activation_ratio(state, pre).unsqueeze(1)
    return e


def decompx_logits(ctx: BatchContext, bias: str = "absdot") -> torch.Tensor:
    """DecompX of every logit: ``(B, N + 1, C)``, the contribution of each input token (the last row: the bias
    term, all zero with ``bias="absdot"``, which shares every bias among the tokens). Summed over the N + 1 rows
    it gives the model's logits (up to the 1e-12 guards of the bias shares)."""
    if bias not in BIAS_MODES:
        raise InputError(f"bias={bias!r}; choose one of {', '.join(BIAS_MODES)}")
    key = f"decompx.{bias}"
    if key in ctx.cache:
        return ctx.cache[key]
    cap, model = ctx.capture, ctx.model
    anatomy = anatomy_of(model)
    if anatomy.pre_ln:
        raise InputError("decompx bias='absdot' (sharing each bias among the tokens) and decompx_logits are "
                         "implemented for post-LN encoders; for this pre-LN model use bias='token' (the default)")
    layers = model_layers(ctx)
    x0 = cap.hidden[0]
    bsz, n, d = x0.shape
    width = max(d, max(layer.theta.shape[-1] for layer in layers))
    step = max(1, _ELEMENTS // (n * (n + 1) * width))  # examples per chunk: one (b, N, N+1, F) block in memory
    out = []
    with torch.no_grad():
        for start in range(0, bsz, step):
            ex = slice(start, min(bsz, start + step))
            b = ex.stop - ex.start
            e = x0.new_zeros(b, n, n + 1, d)
            idx = torch.arange(n, device=x0.device)
            e[:, idx, idx] = x0[ex]  # each token starts as its own embedding
            for i, layer in enumerate(layers):
                part = layer.cut(ex)
                last = i == len(layers) - 1
                e = _decompose_layer(e, part, i == 0, slice(0, 1) if last else slice(0, n), bias)
            out.append(_decompose_head(e[:, 0], cap.hidden[-1][ex, 0], model, anatomy, bias))
    result = torch.cat(out, 0)
    ctx.cache[key] = result
    return result


def decompx_token_scores(ctx: BatchContext, contrast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DecompX with ``bias="token"`` for the explained logits (``contrast``: z_t − Σ_c p_c z_c): ``(scores (B,
    N), bias (B,))``.

    With attention, norm scales and activation ratios held at their values in the real pass, the network is
    affine in its input and every bias goes to the bias term, so DecompX's decomposition is linear: a token's share
    of the logit is the gradient of that linearised network times the token's vectors. These are the token's input
    state through the residual of layer 1 and its layer-1 value vector (which carries the value bias, and in a
    pre-LN model LN1's β, as the value bias goes with the token in the authors' code). The bias term is the logit
    minus the token scores. The logit is read where the head reads: the first token (encoders), the last real one
    (decoders).

    The gradient is taken layer by layer from the top: each layer's linearised graph is rebuilt from its input
    hidden state (its values there are the real pass's, so its held scales are), its vector-Jacobian product taken
    and the graph freed; the attention's product with the values is held at the real weights (:class:`HeldAttention`:
    fused attention on the queries and keys the pass kept, or the maps a chunk of query rows at a time, as
    :meth:`~attnlens.core.batch_state.BatchContext.map_chunks` gives them), so no ``N × N`` map is kept under
    fused attention. A generation's steps (rows reading one sequence) carry one cotangent each.
    """
    cap, model = ctx.capture, ctx.model
    anatomy = anatomy_of(model)
    blocks = layer_blocks(model)
    spec = architecture_for(model.config).layers
    final = final_norm(model, anatomy)
    hidden, real = pass_states(ctx)
    chunks = cap.map_chunks()
    heads = model_dims(model).heads
    with torch.enable_grad():
        top = hidden[-1].detach().requires_grad_(True)
        logit = head_logit(ctx, top, anatomy, contrast)
        if ctx.sequence is None:
            g = torch.autograd.grad(logit.sum(), top)[0].unsqueeze(0)  # (1, B, N, D)
        else:  # each step's row its own cotangent over the one sequence: (R, 1, N, D)
            g = row_gradients(logit, [top])[0].unsqueeze(1)
        for i in reversed(range(len(blocks))):
            mods = layer_parts(blocks[i], model, anatomy)
            h = hidden[i].detach().requires_grad_(True)
            v = layer_values(mods, anatomy, h, heads, spec)
            held = HeldAttention(chunks, i, g.shape[0])
            mixed = held.apply(v).requires_grad_(True)
            out = layer_rest(blocks[i], mods, anatomy, h, mixed, final if i == len(blocks) - 1 else None)
            check_layer(model, i, out.detach(), hidden[i + 1], real)
            g_h, g_mixed = vjp(out, [h, mixed], g)
            g_v = held.transposed(g_mixed.view(*g_mixed.shape[:3], *v.shape[2:]))
            if i == 0:  # layer 1's value vectors are sources of their own (their tokens'), not paths to x0
                g, value0, g_value0 = g_h, v.detach(), g_v
            else:
                g = g_h + vjp(v, [h], g_v)[0]
    x0 = hidden[0].detach()
    scores = ((g * x0).sum(-1) + (g_value0 * value0).flatten(3).sum(-1))  # (R, B, N)
    scores = scores[0] if ctx.sequence is None else scores[:, 0]
    return scores, logit.detach() - (scores * cap.key_mask.bool()).sum(-1)


def _seq2seq_pass_bytes(model: Any, stream: str, n: int) -> int:
    """An encoder-decoder's DecompX runs a pass of its own over every stream (:func:`seq2seq_decompx`): its bytes
    per input of ``n`` tokens, whose decoder reads as many (a generation's fewer: an upper bound)."""
    return seq2seq_decompx_bytes(model, n, n) if getattr(model.config, "is_encoder_decoder", False) else 0


@register(
    "decompx",
    needs={ATTENTION_CHUNKS, HIDDEN, LAYER_GRAPH},
    logits_only=True,
    applies=applicability("decompx", head=True),
    summary="DecompX: each token's share of the target logit, its vector propagated through attention, residuals, "
    "norms, the FFN (activation linearised through the origin; a gated FFN's product split half and half), "
    "pooler and classifier (or a language model's output embeddings, a token or QA head at the explained "
    "positions); signed.",
    citation="Modarressi et al. 2023 (ACL); bias='absdot' as in the authors' code",
    check=_check_decompx,
    fits=_decompx_fits,
    own_memory=_seq2seq_pass_bytes,
)
def decompx(ctx: BatchContext, bias: str = "token", contrast: bool = False) -> MethodOutput:
    """``bias``: ``"token"`` keeps every bias in a separate term (the authors' ``include_bias_token=True,
    bias_decomp_type=None``), so the scores sum to the logit minus that term, computed in one backward pass of the
    linearised network; ``"absdot"`` shares each bias among the tokens by |vector · bias| (the authors' default),
    by propagating all N×N decomposed vectors (about N/3 times the cost of a forward+backward pass), so the bias
    term is 0. The bias term is reported per input as ``meta["decompx"]["bias"]``: scores + bias = the explained
    logit. ``contrast``: decompose z_t − Σ_c p_c z_c (the target logit against the probability-weighted mean
    logit; for two classes (1 − p_t)(z_t − z_other)) instead of z_t, what moves the target's probability. On an
    encoder-decoder both stacks are decomposed (:func:`seq2seq_decompx`): the scores are the encoder's input
    tokens' shares and the decoder inputs' share is ``meta["decompx"]["decoder_inputs"]``."""
    _check_decompx(bias, contrast)
    reason = _decompx_fits(ctx.model, ctx.stream, ctx.head.task, {"bias": bias})
    if reason:
        raise InputError(reason)
    if architecture_for(ctx.model.config).family == "encoder-decoder":
        return seq2seq_output(ctx, contrast)
    if (ctx.target_kind == "loss" and ctx.head.task not in ("token", "qa")
            and ctx.head.read_rows(ctx.targets) is not None):
        contrast = True  # an answer's log-probabilities: each token's z_t − Σ_c p_c z_c, their first-order change
    elif ctx.target_kind != "logit":
        raise InputError(f"decompx decomposes the logits; target_kind={ctx.target_kind!r} is not supported")
    if bias == "token":
        scores, term = decompx_token_scores(ctx, contrast)
        return MethodOutput(scores, meta={"bias": term})
    contributions = decompx_logits(ctx, bias)  # (B, N + 1, C): the last row, the bias term, all zero here
    weights = output_weights(ctx.capture.logits, ctx.targets, contrast)
    shares = torch.einsum("bnc,bc->bn", contributions, weights)
    return MethodOutput(shares[:, :-1], meta={"bias": shares[:, -1]})
