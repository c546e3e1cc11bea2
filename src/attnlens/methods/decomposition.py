"""Norm-based and decomposition methods: attnnorm, globenc, alti, decompx (one shared forward pass, no gradients).

All four read a post-LN encoder layer ``h = LN2(y + FFN(y))``, ``y = LN1(x + Attn(x))`` as a sum of vectors, one
per source token j. With x the layer's input, A^h the attention of head h and f^h(x_j) = (x_j W_V^h + b_V^h) W_O^h
the value of token j through the output projection:

    z_ij = Σ_h A^h_ij f^h(x_j) + δ_ij x_i         (attention block + residual: Σ_j z_ij + b_O = x_i + Attn(x)_i)
    LN(v)_i = γ ⊙ (v − mean_d v) / s_i            (a LayerNorm applied to one summand; s_i: std of the real sum)

Nothing beyond the hidden states and attention of the shared pass is captured: each layer's value and output
projections, LayerNorm statistics and FFN activations are recomputed from its input h^{l-1} with the model's own
modules (an architecture's :class:`~attnlens.architectures.Anatomy` says where they are), and the recomputed
output is checked against the captured h^l, so a wrong anatomy is an error, never a silently wrong score.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..adapters import FIRST
from ..architectures import HEAD_ACTIVATIONS, Anatomy, architecture_for
from ..context import BatchContext, Capture
from ..errors import InputError, ModelError
from .attention import propagate
from .registry import ATTENTION, HIDDEN, MethodOutput, register

ATTNNORM_VARIANTS = ("attn", "attn_res", "attn_res_ln")
BIAS_MODES = ("absdot", "token")
_ELEMENTS = 2**24  # elements of one (B, rows, N, D) block: bounds the memory of the per-source-token vectors


def _attr(obj: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), obj)


def _anatomy(model: nn.Module) -> Anatomy | None:
    return architecture_for(model.config).anatomy


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's encoder layers, one per depth (its architecture entry's :class:`Layers`)."""
    return architecture_for(model.config).layers.modules(model)


def _applies(name: str, *, head: bool = False) -> Callable[[Any, str, str], str | None]:
    """Why ``name`` cannot explain a model: it needs an encoder anatomy (and, for ``head``, a sequence classifier
    whose head reads the first token)."""

    def why(model: Any, stream: str, task: str) -> str | None:
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", "?")
        if config is None or _anatomy(model) is None:
            # one wording for the whole family, so a skip notice names the reason once
            return ("the norm-based and decomposition methods need a post-LN encoder whose layer anatomy attnlens "
                    f"knows (BERT, RoBERTa, DistilBERT, ELECTRA, ...); model type {model_type!r} has none")
        if head and task != "classification":
            return f"{name} decomposes a sequence classifier's logits, not a {task} model's"
        if head and architecture_for(config).pooling_for(config) != FIRST:
            return f"{name} needs a head that reads the first token; {model_type!r} pools differently"
        return None

    return why


@dataclass
class Layer:
    """One encoder layer recomputed from its input ``x`` ``(B, N, D)`` and attention ``attn`` ``(B, H, N, N)``."""

    x: torch.Tensor
    attn: torch.Tensor
    f: torch.Tensor  # (B, H, N, D): f^h(x_j), value bias included
    std1: torch.Tensor  # (B, N, 1): s_i of LN1's input
    y1: torch.Tensor  # (B, N, D): LN1's output
    theta: torch.Tensor  # (B, N, F): act(u)/u of the FFN pre-activation u (the zero-origin linearisation)
    std2: torch.Tensor  # (B, N, 1): s_i of LN2's input
    modules: dict[str, nn.Module]


def _std(ln: nn.LayerNorm, v: torch.Tensor) -> torch.Tensor:
    return (v.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()


def _ratio(out: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """act(u)/u elementwise, 0 where u = 0 (there act(u) = 0 for GELU, ReLU and tanh)."""
    return torch.where(pre != 0, out / torch.where(pre != 0, pre, torch.ones_like(pre)), torch.zeros_like(pre))


_PARTS = ("value", "output", "ln1", "ffn_in", "act", "ffn_out", "ln2")


def _parts(block: nn.Module, model: nn.Module, anatomy: Anatomy) -> dict[str, nn.Module]:
    """One layer's pieces by their :class:`Anatomy` names (the value projection: the entry's :class:`Layers`)."""
    value = architecture_for(model.config).layers.value
    return {k: _attr(block, value if k == "value" else getattr(anatomy, k)) for k in _PARTS}


def _check_layer(model: nn.Module, index: int, got: torch.Tensor, want: torch.Tensor, real: torch.Tensor) -> None:
    """Refuse a recomputed layer output that is not the model's (a wrong anatomy would give wrong scores)."""
    err = (got - want)[real].abs().max().item() if real.any() else 0.0
    # rounding grows with the precision the model runs in (bfloat16: eps 2^-7); a wrong anatomy is off by O(1)
    tol = max(1e-3, 4 * torch.finfo(want.dtype).eps)
    if not err <= tol * (1.0 + want[real].abs().max().item()):
        raise ModelError(
            f"recomputing layer {index + 1} of this {model.config.model_type!r} model from its modules does not "
            f"reproduce its hidden states (max difference {err:.3g}): its architecture entry's anatomy does not "
            "describe it"
        )


def encoder_layers(ctx: BatchContext) -> list[Layer]:
    """Every layer of the batch recomputed from the shared pass (cached in ``ctx.cache`` for the other methods)."""
    if "decomposition.layers" in ctx.cache:
        return ctx.cache["decomposition.layers"]
    cap, model = ctx.capture, ctx.model
    anatomy = _anatomy(model)
    blocks = _blocks(model)
    real = cap.key_mask.bool()
    out: list[Layer] = []
    with torch.no_grad():
        for i, (block, attn) in enumerate(zip(blocks, cap.attentions, strict=True)):
            mods = _parts(block, model, anatomy)
            x = cap.hidden[i]
            b, n, d = x.shape
            h = attn.shape[1]
            v = mods["value"](x).view(b, n, h, d // h)
            f = torch.einsum("bjhv,dhv->bhjd", v, mods["output"].weight.view(d, h, d // h))
            pre1 = x + torch.einsum("bhij,bhjd->bid", attn, f) + mods["output"].bias
            y1 = mods["ln1"](pre1)
            u = mods["ffn_in"](y1)
            a = mods["act"](u)
            pre2 = y1 + mods["ffn_out"](a)
            _check_layer(model, i, mods["ln2"](pre2), cap.hidden[i + 1], real)
            out.append(Layer(x, attn, f, _std(mods["ln1"], pre1), y1, _ratio(a, u), _std(mods["ln2"], pre2), mods))
    ctx.cache["decomposition.layers"] = out
    return out


def _ln_part(v: torch.Tensor, ln: nn.LayerNorm, std: torch.Tensor | None = None) -> torch.Tensor:
    """LN applied to summands ``v`` ``(..., D)`` without β: (v − mean_d v) ⊙ γ, divided by ``std`` (broadcast to
    ``v[..., :1]``) when given."""
    out = (v - v.mean(-1, keepdim=True)) * ln.weight
    return out if std is None else out / std


def _norm_matrix(layer: Layer, transform: Callable[[torch.Tensor], torch.Tensor], scale: torch.Tensor | None,
                 residual: bool) -> torch.Tensor:
    """``(B, N, N)``: ‖M z_ij‖ · scale_i for a linear map M (``transform``), without forming the ``(B, N, N, D)``
    vectors: with g^h_j = M f^h(x_j) and G_j = [⟨g^h_j, g^k_j⟩]_hk, ‖Σ_h α^h_ij g^h_j‖² = α_ij^T G_j α_ij, plus, on
    the diagonal with the residual, 2 Σ_h α^h_ii ⟨g^h_i, M x_i⟩ + ‖M x_i‖²."""
    a = layer.attn.double()
    g = transform(layer.f).double()  # (B, H, N, D)
    gram = torch.einsum("bhjd,bkjd->bjhk", g, g)
    sq = (torch.einsum("bhij,bjhk->bkij", a, gram) * a).sum(1)
    if residual:
        m = transform(layer.x).double()  # (B, N, D)
        diag = 2 * torch.einsum("bhii,bhid,bid->bi", a, g, m) + (m * m).sum(-1)
        sq = sq + torch.diag_embed(diag)
    out = sq.clamp_min(0).sqrt().to(layer.x.dtype)
    return out if scale is None else out * scale


def _alti_matrix(layer: Layer) -> torch.Tensor:
    """``(B, N, N)``: max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), T_i(x_j) = LN1(z_ij), over chunks of query rows (only a
    block of the ``(B, N, N, D)`` vectors T in memory)."""
    ln1 = layer.modules["ln1"]
    g = _ln_part(layer.f, ln1)  # (B, H, N, D): LN1 is linear per summand, so it commutes with the attention sum
    m = _ln_part(layer.x, ln1) / layer.std1
    b, n, d = layer.x.shape
    step = max(1, _ELEMENTS // max(1, b * n * d))
    parts = []
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        t = torch.einsum("bhij,bhjd->bijd", layer.attn[:, :, rows] / layer.std1[:, None, rows], g)
        idx = torch.arange(rows.start, rows.stop, device=t.device)
        t[:, idx - rows.start, idx] += m[:, rows]
        y = layer.y1[:, rows]
        dist = torch.linalg.vector_norm(t.sub_(y.unsqueeze(2)), ord=1, dim=-1)
        parts.append((torch.linalg.vector_norm(y, ord=1, dim=-1).unsqueeze(-1) - dist).clamp_min(0))
    return torch.cat(parts, 1)


def _real_pairs(cap: Capture, m: torch.Tensor) -> torch.Tensor:
    """``m`` with rows and columns of padding set to 0."""
    real = cap.key_mask.bool()
    return m * (real[:, :, None] & real[:, None, :]).to(m.dtype)


def _row_normalised(m: torch.Tensor) -> torch.Tensor:
    return m / m.sum(-1, keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)


def _rows(cap: Capture, matrices: list[torch.Tensor]) -> MethodOutput:
    """The explained row of each layer's matrix; the score is the last layer's."""
    layers = torch.stack([cap.row(m) for m in matrices], 1)
    return MethodOutput(layers[:, -1], layers)


def _rolled_rows(cap: Capture, matrices: list[torch.Tensor]) -> MethodOutput:
    return _rows(cap, propagate(matrices))


@register(
    "attnnorm",
    needs={ATTENTION, HIDDEN},
    class_specific=False,
    applies=_applies("attnnorm"),
    summary="Norm of the attention-weighted value vectors, last layer, row c: ‖Σ_h A^h_cj f^h(x_j)‖ (variants add "
    "the residual and LN1).",
    citation="Kobayashi et al. 2020 (EMNLP); variants Kobayashi et al. 2021 (EMNLP)",
)
def attnnorm(ctx: BatchContext, variant: str = "attn") -> MethodOutput:
    """``variant``: ``"attn"`` ‖Σ_h αf‖ (2020), ``"attn_res"`` ‖Σ_h αf + δ_ij x_i‖, ``"attn_res_ln"`` ‖LN1(·)‖
    (2021's ATB+RES and ATB+RES+LN). Per layer; the score is the last layer's."""
    if variant not in ATTNNORM_VARIANTS:
        raise InputError(f"variant={variant!r}; choose one of {', '.join(ATTNNORM_VARIANTS)}")
    cap = ctx.capture
    mats = []
    for layer in encoder_layers(ctx):
        if variant == "attn_res_ln":
            m = _norm_matrix(layer, functools.partial(_ln_part, ln=layer.modules["ln1"]), 1 / layer.std1, True)
        else:
            m = _norm_matrix(layer, lambda v: v, None, variant == "attn_res")
        mats.append(_real_pairs(cap, m))
    return _rows(cap, mats)


@register(
    "globenc",
    needs={ATTENTION, HIDDEN},
    class_specific=False,
    self_attention_only=True,
    applies=_applies("globenc"),
    summary="GlobEnc: N^l_ij = ‖LN2(LN1(z_ij))‖ (attention, residual and both LayerNorms, FFN left out), rolled out "
    "over layers; s_j = (N^L···N^1)[c, j].",
    citation="Modarressi et al. 2022 (NAACL), as in the authors' code",
)
def globenc(ctx: BatchContext, normalize: bool = False) -> MethodOutput:
    """``normalize``: divide each row of N^l by its sum before the rollout (the authors' code does not)."""
    cap = ctx.capture
    mats = []
    for layer in encoder_layers(ctx):
        ln1, ln2 = layer.modules["ln1"], layer.modules["ln2"]
        m = _norm_matrix(layer, lambda v, ln1=ln1, ln2=ln2: _ln_part(_ln_part(v, ln1), ln2),
                         1 / (layer.std1 * layer.std2), True)
        m = _real_pairs(cap, m)
        mats.append(_row_normalised(m) if normalize else m)
    return _rolled_rows(cap, mats)


@register(
    "alti",
    needs={ATTENTION, HIDDEN},
    class_specific=False,
    self_attention_only=True,
    applies=_applies("alti"),
    summary="ALTI: c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), T_i(x_j) = LN1(z_ij), y_i = LN1's output, rows "
    "normalised to 1, rolled out over layers; s_j = (C^L···C^1)[c, j].",
    citation="Ferrando, Gállego & Costa-jussà 2022 (EMNLP), as in the authors' code",
)
def alti(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    mats = [_row_normalised(_real_pairs(cap, _alti_matrix(layer))) for layer in encoder_layers(ctx)]
    return _rolled_rows(cap, mats)


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
    r = _add_bias(_ln_part(r, mods["ln1"], layer.std1[:, rows, None]), mods["ln1"].bias, mode)
    u = _add_bias(torch.einsum("bikd,fd->bikf", r, mods["ffn_in"].weight), mods["ffn_in"].bias, mode)
    u = u * layer.theta[:, rows].unsqueeze(2)
    r = r + _add_bias(torch.einsum("bikf,df->bikd", u, mods["ffn_out"].weight), mods["ffn_out"].bias, mode)
    return _add_bias(_ln_part(r, mods["ln2"], layer.std2[:, rows, None]), mods["ln2"].bias, mode)


def _decompose_head(e: torch.Tensor, state: torch.Tensor, model: nn.Module, anatomy: Anatomy,
                    mode: str) -> torch.Tensor:
    """The head's steps on the first token's decomposition ``e`` ``(b, K, D)`` (its real state ``state``), each
    activation linearised through the origin as in the FFN: ``(b, K, C)``."""
    for linear_path, act_path in anatomy.head:
        linear = _attr(model, linear_path)
        pre = linear(state)
        e = torch.einsum("bkd,cd->bkc", e, linear.weight)
        if linear.bias is not None:
            e = _add_bias(e, linear.bias, mode)
        if act_path is None:
            state = pre
            continue
        act = HEAD_ACTIVATIONS.get(act_path) or _attr(model, act_path)
        state = act(pre)
        e = e * _ratio(state, pre).unsqueeze(1)
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
    anatomy = _anatomy(model)
    layers = encoder_layers(ctx)
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
                part = Layer(*(t[ex] for t in (layer.x, layer.attn, layer.f, layer.std1, layer.y1, layer.theta,
                                               layer.std2)), layer.modules)
                last = i == len(layers) - 1
                e = _decompose_layer(e, part, i == 0, slice(0, 1) if last else slice(0, n), bias)
            out.append(_decompose_head(e[:, 0], cap.hidden[-1][ex, 0], model, anatomy, bias))
    result = torch.cat(out, 0)
    ctx.cache[key] = result
    return result


def _frozen_ln(v: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
    """``ln(v)`` with its std held constant (a linear map of ``v``, as DecompX reads a LayerNorm)."""
    return (v - v.mean(-1, keepdim=True)) / _std(ln, v).detach() * ln.weight + ln.bias


def _linearised(act: Callable[[torch.Tensor], torch.Tensor], pre: torch.Tensor) -> torch.Tensor:
    """``act(pre)`` as ``pre`` times the constant ratio act(pre)/pre (the zero-origin linearisation)."""
    return pre * _ratio(act(pre), pre).detach()


def _output_weights(logits: torch.Tensor, targets: torch.Tensor, contrast: bool) -> torch.Tensor:
    """``(B, C)`` weights of the explained combination of logits: the target's one-hot, minus the softmax with
    ``contrast`` (z_t − Σ_c p_c z_c, the first-order change of log p_t)."""
    n = logits.shape[-1]
    if targets.dim() == 2:  # (target, contrast) pairs of a contrastive head: z_t − z_c, a combination of logits
        w = torch.nn.functional.one_hot(targets[:, 0], n) - torch.nn.functional.one_hot(targets[:, 1], n)
        return w.to(logits.dtype)
    w = torch.nn.functional.one_hot(targets, n).to(logits.dtype)
    return w - logits.softmax(-1) if contrast else w


def decompx_token_scores(ctx: BatchContext, contrast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DecompX with ``bias="token"`` for the explained logits (``contrast``: z_t − Σ_c p_c z_c), in one backward
    pass: ``(scores (B, N), bias (B,))``.

    With attention, LayerNorm stds and activation ratios held at their values in the real pass, the network is
    affine in its input and every bias goes to the bias term, so DecompX's decomposition is linear: a token's share
    of the logit is the gradient of that linearised network times the token's vectors. These are the token's input
    state through the residual of layer 1 and its layer-1 value vector (which carries the value bias, as in the
    authors' code). The bias term is the logit minus the token scores.
    """
    cap, model = ctx.capture, ctx.model
    anatomy = _anatomy(model)
    blocks = _blocks(model)
    real = cap.key_mask.bool()
    with torch.enable_grad():
        x0 = cap.hidden[0].detach().requires_grad_(True)
        h, value0 = x0, None
        for i, (block, attn) in enumerate(zip(blocks, cap.attentions, strict=True)):
            mods = _parts(block, model, anatomy)
            b, n, d = h.shape
            heads = attn.shape[1]
            v = mods["value"](h)
            if value0 is None:
                value0 = v = v.detach().requires_grad_(True)
            mixed = torch.einsum("bhij,bjhv->bihv", attn, v.view(b, n, heads, d // heads)).reshape(b, n, d)
            y1 = _frozen_ln(h + mods["output"](mixed), mods["ln1"])
            h = _frozen_ln(y1 + mods["ffn_out"](_linearised(mods["act"], mods["ffn_in"](y1))), mods["ln2"])
            _check_layer(model, i, h.detach(), cap.hidden[i + 1], real)
        state = h[:, 0]
        for linear_path, act_path in anatomy.head:
            state = _attr(model, linear_path)(state)
            if act_path is not None:
                state = _linearised(HEAD_ACTIVATIONS.get(act_path) or _attr(model, act_path), state)
        logit = (state * _output_weights(state.detach(), ctx.targets, contrast)).sum(-1)
        g0, gv = torch.autograd.grad(logit.sum(), [x0, value0])
    scores = ((g0 * x0).sum(-1) + (gv * value0).sum(-1)).detach()
    return scores, logit.detach() - (scores * real).sum(-1)


@register(
    "decompx",
    needs={ATTENTION, HIDDEN},
    applies=_applies("decompx", head=True),
    summary="DecompX: each token's share of the target logit, its vector propagated through attention, residuals, "
    "LayerNorms, the FFN (activation linearised through the origin), pooler and classifier; signed.",
    citation="Modarressi et al. 2023 (ACL); bias='absdot' as in the authors' code",
)
def decompx(ctx: BatchContext, bias: str = "token", contrast: bool = False) -> MethodOutput:
    """``bias``: ``"token"`` keeps every bias in a separate term (the authors' ``include_bias_token`` option), so
    the scores sum to the logit minus that term, computed in one backward pass of the linearised network;
    ``"absdot"`` shares each bias among the tokens by |vector · bias| (the authors' default), by propagating all
    N×N decomposed vectors (about N/3 times the cost of a forward+backward pass). ``contrast``: decompose
    z_t − Σ_c p_c z_c (the target logit against the probability-weighted mean logit; for two classes
    (1 − p_t)(z_t − z_other)) instead of z_t, what moves the target's probability."""
    if bias not in BIAS_MODES:
        raise InputError(f"bias={bias!r}; choose one of {', '.join(BIAS_MODES)}")
    if ctx.target_kind != "logit":
        raise InputError(f"decompx decomposes the logits; target_kind={ctx.target_kind!r} is not supported")
    if bias == "token":
        return MethodOutput(decompx_token_scores(ctx, contrast)[0])
    contributions = decompx_logits(ctx, bias)[:, :-1]  # (B, N, C), the bias term (all zero here) dropped
    weights = _output_weights(ctx.capture.logits, ctx.targets, contrast)
    return MethodOutput(torch.einsum("bnc,bc->bn", contributions, weights))
