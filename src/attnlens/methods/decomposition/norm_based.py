"""attnnorm (Kobayashi et al. 2020, 2021), GlobEnc (Modarressi et al. 2022) and ALTI (Ferrando et al. 2022)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...core.batch_state import BatchContext
from ...core.memory import model_dims
from ...errors import InputError
from ...models.architectures import architecture_for
from ...models.layer_modules import module_at
from ..attention import carried_rows
from ..registry import (
    ATTENTION_CHUNKS,
    ATTENTION_ROWS,
    HIDDEN,
    MethodOutput,
    check_flag,
    register,
)
from . import alti_hinge
from .alti_plus import alti_plus
from .layers import (
    LayerOutput,
    anatomy_of,
    applicability,
    attention_sum,
    check_layer,
    final_norm,
    head_maps,
    head_outputs,
    layer_blocks,
    layer_output,
    layer_parts,
    ln_part,
    stream_pass_bytes,
    value_terms,
    value_vectors,
)
from .pair_norms import (
    Mixing,
    ResidualTerms,
    alti_block,
    alti_rows,
    gram_matrices,
    norm_matrix,
    norm_rows,
    row_normalised,
)

ATTNNORM_VARIANTS = ("attn", "attn_res", "attn_res_ln")


_CHECKED_ROWS = 8  # rows at which a pre-LN layer's output is recomputed and compared with the model's


def _check_attnnorm(variant: str = "attn") -> None:
    """attnnorm's option values (whether the variant fits the model is checked with it)."""
    if variant not in ATTNNORM_VARIANTS:
        raise InputError(f"variant={variant!r}; choose one of {', '.join(ATTNNORM_VARIANTS)}")


def _check_globenc(normalize: bool | None = None) -> None:
    """GlobEnc's option values."""
    check_flag("globenc", "normalize", normalize, none=True)


def _attnnorm_fits(model: Any, stream: str, task: str, options: Mapping[str, Any]) -> str | None:
    """Why attnnorm's ``variant`` is not defined on such a model's ``stream``: the residual LayerNorm variant
    needs a post-LN layer's norm after its residual sum, the residual variants a query that is one of the keys."""
    variant = options.get("variant", "attn")
    if stream in ("decoder", "cross") and (variant == "attn_res_ln" or (variant == "attn_res" and stream == "cross")):
        return (f"attnnorm variant={variant!r} is not defined on attention={stream!r}: "
                + ("the residual is the decoder's state, not one of the keys" if stream == "cross" else
                   "a decoder layer's cross-attention comes between its residual sum and that LayerNorm")
                + "; use 'attn'" + (" or 'attn_res'" if stream == "decoder" else ""))
    if stream not in ("decoder", "cross") and variant == "attn_res_ln" and anatomy_of(model).pre_ln:
        return ("attnnorm variant='attn_res_ln' reads the LayerNorm after a post-LN layer's residual sum; this "
                f"{model.config.model_type!r} model is pre-LN (none there): use 'attn' or 'attn_res'")
    return None


def _stream_norms(ctx: BatchContext, variant: str) -> list[torch.Tensor]:
    """attnnorm's rows on an encoder-decoder's decoder self-attention or cross-attention stream: per decoder
    layer ‖Σ_h A^h_ij f^h(x_j)‖ (+ x_i with ``"attn_res"``, decoder stream only), f^h the stream's value and output
    projections of the layer's self-attention input (decoder: the layer input, through LN1 when pre-LN) or of the
    encoder's output (cross). No residual LayerNorm variant: in a decoder layer the cross-attention comes between."""
    cap, model, stream = ctx.capture, ctx.model, ctx.stream
    anatomy = anatomy_of(model)
    spec = architecture_for(model.config).layers
    at = cap.rows_at()
    mats = []
    with torch.no_grad():
        for block, attn, x in zip(spec.modules(model, "decoder"), cap.attention_rows, cap.hidden, strict=False):
            if stream == "decoder":  # the self-attention's pieces only (a decoder layer's FFN sits elsewhere)
                mods = {k: module_at(block, path) for k, path in
                        (("value", spec.value), ("output", anatomy.output), ("ln1", anatomy.ln1))}
                a = mods["ln1"](x) if anatomy.pre_ln else x
            else:  # the keys are the encoder's output, x (the same for every layer)
                mods = {"value": module_at(block, anatomy.cross_value),
                        "output": module_at(block, anatomy.cross_output)}
                a = x
            f = head_outputs(mods, value_vectors(mods, a, attn.shape[1], spec))
            # the residual (decoder stream) is the decoder state at the rows; cross attention has none
            residual = x[:, at.to(x.device)] if stream == "decoder" else x[:, :0]
            m = norm_matrix(Mixing(residual, attn, f, at), lambda v: v, None, variant == "attn_res")
            mats.append(m * cap.key_mask.to(m.dtype)[:, None, :])
    return mats


def _attnnorm_rows(ctx: BatchContext, variant: str) -> list[torch.Tensor]:
    """attnnorm's matrices ``(B, R, N)`` at the captured attention rows of every layer (the explained rows under
    fused attention, every row with whole maps): each layer's value and output projections recomputed from its
    input h^{l-1}, and the layer's output at those rows recomputed and checked against the captured h^l (a wrong
    anatomy is an error, never a silently wrong score)."""
    cap, model = ctx.capture, ctx.model
    anatomy = anatomy_of(model)
    spec = architecture_for(model.config).layers
    blocks = layer_blocks(model)
    final = final_norm(model, anatomy)
    hidden, rows_attn, real = list(cap.hidden), list(cap.attention_rows), cap.key_mask.bool()
    if ctx.sequence is not None:  # the rows are prefixes of one sequence: its tensors alone (a batch of one)
        hidden, rows_attn = [h[:1] for h in hidden], [a[:1] for a in rows_attn]
        real = ctx.sequence["attention_mask"].bool().to(real.device)
    at = cap.rows_at().to(hidden[0].device)
    mats = []
    with torch.no_grad():
        for i, (block, attn) in enumerate(zip(blocks, rows_attn, strict=True)):
            mods = layer_parts(block, model, anatomy)
            x = hidden[i]
            xr = x[:, at]
            f, v = value_terms(mods, mods["ln1"](x) if anatomy.pre_ln else x, attn.shape[1], spec)
            pre1, attn, f = attention_sum(mods, xr, attn, f, v)
            o = layer_output(mods, anatomy, xr, pre1, final if i == len(blocks) - 1 else None)
            std1 = o.std1
            check_layer(model, i, o.got, hidden[i + 1][:, at], real[:, at])
            mixing = Mixing(xr, attn, f, at)
            if variant == "attn_res_ln":
                m = norm_matrix(mixing, functools.partial(ln_part, ln=mods["ln1"]), 1 / std1, True)
            else:
                m = norm_matrix(mixing, lambda v: v, None, variant == "attn_res")
            if ctx.sequence is not None:
                m = m.expand(ctx.token_mask.shape[0], *m.shape[1:])
            mats.append(m * cap.key_mask.to(m.dtype)[:, None, :])
    return mats


@register(
    "attnnorm",
    needs={ATTENTION_ROWS, HIDDEN},
    class_specific=False,
    applies=applicability("attnnorm", streams=("encoder", "decoder", "cross")),
    fits=_attnnorm_fits,
    summary="Norm of the attention-weighted value vectors, last layer, row c: ‖Σ_h A^h_cj f^h(x_j)‖ (variants add "
    "the residual and LN1).",
    citation="Kobayashi et al. 2020 (EMNLP); variants Kobayashi et al. 2021 (EMNLP)",
    check=_check_attnnorm,
)
def attnnorm(ctx: BatchContext, variant: str = "attn") -> MethodOutput:
    """``variant``: ``"attn"`` ‖Σ_h αf‖ (2020), ``"attn_res"`` ‖Σ_h αf + δ_ij x_i‖, ``"attn_res_ln"`` ‖LN1(·)‖
    (2021's ATB+RES and ATB+RES+LN; post-LN encoders only: a pre-LN layer has no LayerNorm after the residual
    sum). Per layer; the score is the last layer's. Reads only the explained rows of each layer's attention, so it
    runs under fused attention on long inputs."""
    _check_attnnorm(variant)
    reason = _attnnorm_fits(ctx.model, ctx.stream, ctx.head.task, {"variant": variant})
    if reason:
        raise InputError(reason)
    cap = ctx.capture
    mats = _stream_norms(ctx, variant) if ctx.stream in ("decoder", "cross") else _attnnorm_rows(ctx, variant)
    layers = torch.stack([cap.explained_row(m) for m in mats], 1)
    return MethodOutput(layers[:, -1], layers)


def _through_both(v: torch.Tensor, ln1: nn.LayerNorm, ln2: nn.LayerNorm) -> torch.Tensor:
    """A summand through LN1 and LN2 without β and 1/s (post-LN; the scales are applied to the norms)."""
    return ln_part(ln_part(v, ln1), ln2)


@dataclass
class _LayerRows:
    """One layer recomputed at a chunk of query rows ``at`` ``(R,)``: the residual there ``x`` ``(B, R, D)``, the
    weights ``attn`` ``(B, H, R, N)`` and values ``f`` ``(B, H, N, D)`` as the summands take them
    (:func:`attention_sum`), and its :class:`LayerOutput` there."""

    at: torch.Tensor
    x: torch.Tensor
    attn: torch.Tensor
    f: torch.Tensor
    out: LayerOutput


class _ChunkedLayers:
    """A layer matrix (GlobEnc's, ALTI's) at chunks of query rows, for
    :func:`~attnlens.methods.attention.carried_rows`: each layer recomputed from its input h^{l-1} and the
    chunk's attention, its output checked against h^l at those rows, then :meth:`matrix` of the chunk; padding
    rows and columns zeroed, rows normalised where the method says. Layers are read top-down, chunk by chunk; a
    layer's value vectors ``(B, H, N, D)`` are computed once, on its first chunk. On a generation's rows (prefixes
    of one sequence) the sequence alone is recomputed and its matrix viewed for every row.

    A pre-LN layer's matrices read only its attention block, so its FFN is recomputed (and the output checked)
    at a few real rows (:data:`_CHECKED_ROWS`) of its first chunk holding one alone: a wrong anatomy shows on any
    row, and the FFN at every row would cost another forward. Post-LN matrices read the layer's norms at every
    row, so every chunk is recomputed and checked."""

    def __init__(self, ctx: BatchContext) -> None:
        cap, model = ctx.capture, ctx.model
        self.ctx = ctx
        self.anatomy = anatomy_of(model)
        self.blocks = layer_blocks(model)
        self.spec = architecture_for(model.config).layers
        self.final = final_norm(model, self.anatomy)
        self.hidden, self.real = list(cap.hidden), cap.key_mask.bool()
        if ctx.sequence is not None:  # the rows are prefixes of one sequence: its tensors alone (a batch of one)
            self.hidden = [h[:1] for h in self.hidden]
            self.real = ctx.sequence["attention_mask"].bool().to(self.real.device)
        self.layer: int | None = None

    def begin(self, j: int, heads: int) -> None:
        """Layer j's first chunk is next: its modules and value vectors."""
        mods = layer_parts(self.blocks[j], self.ctx.model, self.anatomy)
        x = self.hidden[j]
        self.layer, self.mods, self.x, self.checked = j, mods, x, False
        self.f, self.v = value_terms(mods, mods["ln1"](x) if self.anatomy.pre_ln else x, heads, self.spec)

    def matrix(self, rows: _LayerRows) -> torch.Tensor:
        """``(B, R, N)``: the method's layer matrix at the chunk's rows."""
        raise NotImplementedError

    def normalised(self, m: torch.Tensor) -> torch.Tensor:
        """The chunk's rows after the padding was zeroed (default: each row divided by its sum)."""
        return row_normalised(m)

    def __call__(self, j: int, start: int, a: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
        if j != self.layer:
            self.begin(j, a.shape[1])
        mods = self.mods
        if self.ctx.sequence is not None:
            a = a[:1]
        rows = slice(start, start + a.shape[2])
        xr = self.x[:, rows]
        with torch.no_grad():
            pre1, a, f = attention_sum(mods, xr, a, self.f, self.v)
            real_rows = self.real[:, rows]
            if self.anatomy.pre_ln:  # the attention block's sum is all the matrices read
                o = LayerOutput(pre1, pre1, pre1.new_zeros(*pre1.shape[:-1], 0))
                if not self.checked:  # the layer recomputed at a few real rows shows a wrong anatomy as well
                    few = torch.nonzero(real_rows.any(0)).flatten()[:_CHECKED_ROWS]
                    got = layer_output(mods, self.anatomy, xr[:, few], pre1[:, few],
                                        self.final if j == len(self.blocks) - 1 else None).got
                    check_layer(self.ctx.model, j, got, self.hidden[j + 1][:, rows][:, few], real_rows[:, few])
                    self.checked = len(few) > 0
            else:
                o = layer_output(mods, self.anatomy, xr, pre1, self.final if j == len(self.blocks) - 1 else None)
                check_layer(self.ctx.model, j, o.got, self.hidden[j + 1][:, rows], real_rows)
                self.checked = bool(real_rows.any())
            m = self.matrix(_LayerRows(torch.arange(rows.start, rows.stop, device=a.device), xr, a, f, o))
            cap = self.ctx.capture
            b = cap.query_mask.shape[0]
            m = m.expand(b, *m.shape[1:]) if m.shape[0] != b else m
            real = cap.query_mask.bool()[:, rows, None] & cap.key_mask.bool()[:, None, :]
            return self.normalised(m * real.to(m.dtype))


class _GlobEncRows(_ChunkedLayers):
    """GlobEnc's N^l_ij = ‖LN2(LN1(z_ij))‖ (post-LN) or ‖z_ij‖ (pre-LN) at a chunk of rows."""

    def __init__(self, ctx: BatchContext, normalize: bool | None) -> None:
        super().__init__(ctx)
        self.normalize = normalize
        self.largest: torch.Tensor | None = None

    def begin(self, j: int, heads: int) -> None:
        super().begin(j, heads)
        self.g = None
        self.largest = None

    def matrix(self, rows: _LayerRows) -> torch.Tensor:
        if self.anatomy.pre_ln:
            transform, scale = (lambda v: v), None
        else:
            ln1, ln2 = self.mods["ln1"], self.mods["ln2"]
            transform = functools.partial(_through_both, ln1=ln1, ln2=ln2)
            scale = 1 / (rows.out.std1 * rows.out.std2)
        if self.g is None:  # f, and the residual's terms, as the summands take them: once per layer
            self.g = transform(rows.f).double()
            self.gram = gram_matrices(self.g)
            self.residual = ResidualTerms.of(self.g, transform(self.x))
        m = norm_rows(rows.attn, self.g, self.gram, self.residual, rows.at)
        # at least float32: the unnormalised product over the layers overflows half precision (MiniLM in float16)
        m = m.clamp_min(0).sqrt().to(torch.promote_types(rows.x.dtype, torch.float32))
        return m if scale is None else m * scale.to(m.dtype)

    def normalised(self, m: torch.Tensor) -> torch.Tensor:
        pre_ln = self.anatomy.pre_ln
        if pre_ln and self.normalize is False:  # divided by the largest row sum once the layer is read
            top = m.sum(-1).amax(-1)
            self.largest = top if self.largest is None else torch.maximum(self.largest, top)
            return m
        return row_normalised(m) if self.normalize or (self.normalize is None and pre_ln) else m

    def divisor(self, j: int) -> torch.Tensor | None:
        """``(B,)``: what layer j's matrix is divided by (its largest row sum), or ``None``."""
        if self.largest is None:
            return None
        return self.largest.clamp_min(torch.finfo(self.largest.dtype).tiny)


class _AltiRows(_ChunkedLayers):
    """ALTI's c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁) at a chunk of rows (:func:`alti_rows`)."""

    def begin(self, j: int, heads: int) -> None:
        super().begin(j, heads)
        self.g: torch.Tensor | None = None
        self.low_rank: alti_hinge.LowRank | None = None

    def matrix(self, rows: _LayerRows) -> torch.Tensor:
        summand = (lambda v: v) if self.anatomy.pre_ln else functools.partial(ln_part, ln=self.mods["ln1"])
        if self.g is None and self.low_rank is None:  # LN1 is linear per summand: it commutes with the sum
            g = summand(rows.f).transpose(1, 2).contiguous()  # key-major
            self.low_rank = self._low_rank(summand(head_maps(self.mods, rows.f.shape[1], rows.f)), g)
            self.g = g if self.low_rank is None else None  # the factors hold the vectors themselves
        std1 = rows.out.std1 if rows.out.std1 is not None else rows.x.new_ones(*rows.x.shape[:2], 1)
        return alti_rows(rows.attn / std1[:, None], self.g, summand(rows.x) / std1, rows.out.y1, rows.at,
                         self.low_rank)

    def _low_rank(self, maps: torch.Tensor, g: torch.Tensor) -> alti_hinge.LowRank | None:
        """The layer's vectors ``g`` ``(B, N, H, D)`` in factors, ``g[b, j, h] = v[b, h, j] @ maps[h]``, where
        the contributions are computed from them (:func:`~attnlens.methods.decomposition.alti_hinge.applies`),
        checked on a few keys (``None`` where they do not give the vectors: those are then read as they are)."""
        v = self.v.to(maps.dtype)
        if v.shape[-1] != maps.shape[1] or not alti_hinge.applies(g, v, maps):
            return None
        few = g[:, :_CHECKED_ROWS]
        got = torch.einsum("bhje,hed->bjhd", v[:, :, :_CHECKED_ROWS], maps)
        scale = few.abs().amax().clamp_min(torch.finfo(few.dtype).tiny)
        tol = 1e-4 if few.dtype == torch.float32 else 1e-10
        if (got - few).abs().amax() > tol * scale:
            return None
        return alti_hinge.LowRank.of(v, maps, g)


@register(
    "globenc",
    needs={ATTENTION_CHUNKS, HIDDEN},
    class_specific=False,
    self_attention_only=True,
    applies=applicability("globenc"),
    summary="GlobEnc: N^l_ij = ‖LN2(LN1(z_ij))‖ (attention, residual and both LayerNorms, FFN left out; pre-LN "
    "decoders: ‖z_ij‖ with rows normalised, their residual stream being a plain sum), rolled out over layers; "
    "s_j = (N^L···N^1)[c, j].",
    citation="Modarressi et al. 2022 (NAACL), as in the authors' code",
    check=_check_globenc,
)
def globenc(ctx: BatchContext, normalize: bool | None = None) -> MethodOutput:
    """``normalize``: divide each row of N^l by its sum before the rollout. Default: not for post-LN encoders
    (the authors' code, where LN2 already puts every row on one scale), and for pre-LN decoders, whose residual
    stream has no such norm: a row's scale grows with depth and differs between tokens by orders of magnitude
    (SmolLM2's first token: norms in the thousands), so the unnormalised product over its 30 layers gives that
    token everything. With ``normalize=False`` on a pre-LN model each N^l is divided by one positive number per
    example (its largest row sum), which keeps the scores' proportions and the product finite."""
    _check_globenc(normalize)
    cap = ctx.capture
    # every layer's maps read a chunk of query rows at a time (recomputed under fused attention), the explained
    # row carried down through the layers: nothing N x N per head is kept
    reader = _GlobEncRows(ctx, normalize)
    layers = carried_rows(cap.query_weights, cap.map_chunks(), reader, mix=1.0, keep=0.0, divisor=reader.divisor)
    return MethodOutput(layers[:, -1], layers)


def _alti_own_bytes(model: Any, stream: str, n: int) -> int:
    """ALTI's bytes per input of ``n`` tokens beside the shared pass. On an encoder-decoder's decoder and cross
    streams, ALTI+'s pass of its own over every stream, whose decoder reads as many tokens (a generation's fewer:
    an upper bound). On an accelerator, the block of vectors t_ij it forms, hidden-size wide
    (:func:`~attnlens.methods.decomposition.pair_norms.alti_rows`): on short inputs more than the chunks of
    probabilities the shared estimate counts."""
    if stream in ("decoder", "cross") and getattr(model.config, "is_encoder_decoder", False):
        return stream_pass_bytes(model, n, n)
    dims = model_dims(model)
    if dims.device == "cpu":  # a compiled loop, nothing written to memory
        return 0
    return min(alti_block(dims.device), n * n * dims.hidden) * max(dims.itemsize, 4)


@register(
    "alti",
    needs={ATTENTION_CHUNKS, HIDDEN},
    class_specific=False,
    applies=applicability("alti", streams=("encoder", "decoder", "cross")),
    own_memory=_alti_own_bytes,
    summary="ALTI: c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁), T_i(x_j) = LN1(z_ij), y_i = LN1's output (pre-LN "
    "decoders: T_i(x_j) = z_ij, y_i the residual stream after attention), rows normalised to 1, rolled out over "
    "layers; s_j = (C^L···C^1)[c, j]. Encoder-decoders' decoder and cross streams: ALTI+, the target prefix's and "
    "the source's shares.",
    citation="Ferrando, Gállego & Costa-jussà 2022 (EMNLP), as in the authors' code; ALTI+: Ferrando, Gállego, "
    "Alastruey, Escolano & Costa-jussà 2022 (EMNLP)",
)
def alti(ctx: BatchContext) -> MethodOutput:
    """On an encoder-decoder's ``decoder`` and ``cross`` streams, ALTI+ (:func:`alti_plus`): the shares of the
    source tokens (``cross``) or of the target prefix's (``decoder``); what the other stream holds is reported per
    input in ``meta``, so the shares account for the whole 1: ``target_share`` on ``cross``, ``source_share`` and
    the decoder start token's ``start_share`` (which no token column shows) on ``decoder``."""
    cap = ctx.capture
    if ctx.stream in ("decoder", "cross"):
        source, target = alti_plus(ctx)
        if ctx.stream == "cross":
            return MethodOutput(source[:, -1], source, meta={"target_share": target[:, -1].sum(-1)})
        return MethodOutput(target[:, -1], target, meta={"source_share": source[:, -1].sum(-1),
                                                         "start_share": target[:, -1, 0]})
    layers = carried_rows(cap.query_weights, cap.map_chunks(), _AltiRows(ctx), mix=1.0, keep=0.0)
    return MethodOutput(layers[:, -1], layers)
