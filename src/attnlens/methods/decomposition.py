"""Norm-based and decomposition methods: attnnorm, globenc, alti, decompx (one shared forward pass, no gradients).

All four read a layer's output as a sum of vectors, one per source token j. With x the layer's input, A^h the
attention of head h and f^h(a_j) = (a_j W_V^h + b_V^h) W_O^h the value of token j through the output projection:

    z_ij = Σ_h A^h_ij f^h(a_j) + δ_ij x_i         (attention block + residual: Σ_j z_ij + b_O = x_i + Attn_i)

- post-LN encoders (BERT): ``h = LN2(y + FFN(y))``, ``y = LN1(x + Attn(x))``, a_j = x_j, and a LayerNorm applied
  to one summand is LN(v)_i = γ ⊙ (v − mean_d v) / s_i (s_i: the std of the real sum);
- pre-LN decoders (GPT-2, Llama): ``h = y + FFN(LN2(y))``, ``y = x + Attn(LN1(x))``, a_j = LN1(x_j) (a norm of
  token j alone, so z_ij is token j's share), and the residual stream y_i = Σ_j z_ij + b_O is a plain sum.

Nothing beyond the hidden states and attention of the shared pass is captured: each layer's value and output
projections, norm statistics and FFN activations are recomputed from its input h^{l-1} with the model's own
modules (an architecture's :class:`~attnlens.models.architectures.Anatomy` says where they are), and the recomputed
output is checked against the captured h^l, so a wrong anatomy is an error, never a silently wrong score.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.attention_chunks import AttentionChunks, RecomputedChunks, WholeMaps
from ..core.batch_state import BatchContext
from ..core.memory import model_dims, rows_that_fit
from ..core.modelstate import EAGER, attention_switched
from ..core.row_attention import chunk_elements, repeat_kv
from ..errors import InputError, ModelError
from ..lrp.rules import linear_weight
from ..models.adapters import FIRST, LAST
from ..models.architectures import HEAD_ACTIVATIONS, Anatomy, Layers, architecture_for
from ..models.norms import as_layer_norm, is_rms_norm, rms_eps, rms_gain
from ..models.prefixes import last_positions, row_gradients
from . import alti_kernel
from .attention import carried_rows
from .registry import (
    ATTENTION_CHUNKS,
    ATTENTION_ROWS,
    HIDDEN,
    LAYER_GRAPH,
    MethodOutput,
    check_flag,
    register,
)

ATTNNORM_VARIANTS = ("attn", "attn_res", "attn_res_ln")
BIAS_MODES = ("absdot", "token")
_ELEMENTS = 2**24  # elements of one (B, rows, N, D) block: bounds the memory of the per-source-token vectors
# elements of ALTI's block of vectors t_ij (keys x rows x D): 8 MiB in float32, measured fastest on 2 CPU cores
# (2^19 to 2^23 tried; 12x faster than one (B, rows, N, D) einsum of 2^24 elements); on an accelerator, where each
# block's kernels are launched from Python, the chunk size of the recomputed maps (row_attention.chunk_elements)
_ALTI_BLOCK = 2**21
_CHECKED_ROWS = 8  # rows at which a pre-LN layer's output is recomputed and compared with the model's


def _attr(obj: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), obj)


def _anatomy(model: nn.Module) -> Anatomy | None:
    return architecture_for(model.config).anatomy_for(model.config)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The layers the anatomy describes, one per depth (its architecture entry's :class:`Layers`): an
    encoder-decoder's encoder layers, the only layers of the others."""
    layers = architecture_for(model.config).layers
    return layers.modules(model, "encoder" if layers.path("encoder") else "self")


def _applies(name: str, *, head: bool = False, streams: tuple[str, ...] = ("encoder",)
             ) -> Callable[[Any, str, str], str | None]:
    """Why ``name`` cannot explain a model: it needs a layer anatomy attnlens knows (and, for ``head``, a
    sequence classifier whose head reads the first token of an encoder or the last of a decoder, a token
    classifier, an extractive QA model or a causal language model); of an encoder-decoder it reads the attention
    ``streams``."""

    def why(model: Any, stream: str, task: str) -> str | None:
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", "?")
        anatomy = None if config is None else _anatomy(model)
        if anatomy is None:
            # one wording for the whole family, so a skip notice names the reason once
            return ("the norm-based and decomposition methods need a layer anatomy attnlens knows (encoders: "
                    "BERT, RoBERTa, DeBERTa-v2, MPNet, ModernBERT, ...; pre-LN decoders: GPT-2, GPT-NeoX, Llama, "
                    f"Qwen, Gemma, Phi, OPT, ...; the encoders of BART, mBART, T5); this {model_type!r} model has "
                    "none (docs/decomposition.md, 'Which models')")
        if head and anatomy.ffn is not None:
            return (f"{name} linearises each feed-forward network through its pieces; the architecture entry of "
                    f"model type {model_type!r} reads it as one module, which it does not decompose")
        if architecture_for(config).family == "encoder-decoder":
            if head and (anatomy.cross_value is None or anatomy.cross_norm is None):
                return (f"{name} needs the cross-attention's projections and norm, which model type "
                        f"{model_type!r}'s entry omits")
            if stream == "cross" and "cross" in streams and anatomy.cross_value is None:
                return f"{name} needs the cross-attention's projections, which model type {model_type!r}'s entry omits"
            if head and task not in ("classification", "qa", "seq2seq-lm"):
                return (f"{name} decomposes an encoder-decoder's classifier, extractive QA or language model logits, "
                        f"not a {task} model's")
            if head and stream not in streams:
                return (f"{name} attributes an encoder-decoder's logits to its encoder's input tokens, the columns of "
                        "attention='encoder' (the default); on the decoder and cross streams use alti (ALTI+)")
            if stream not in streams:
                return (f"{name} reads an encoder-decoder's encoder layers (attention='encoder'); on its decoder and "
                        "cross-attention layers, which mix two sequences, use alti (ALTI+)")
            return None
        if head and not (task in ("classification", "token", "qa") or (task == "causal-lm" and anatomy.pre_ln)):
            return (f"{name} decomposes the logits of a sequence or token classifier, an extractive QA model or a "
                    f"causal language model, not a {task} model's")
        pooled = _pooled(model)
        if head and task == "classification" and architecture_for(config).pooling_for(config) != pooled:
            return f"{name} needs a head that reads the {pooled} token; {model_type!r} pools differently"
        return None

    return why


def _pooled(model: nn.Module) -> str:
    """Where DecompX reads a classifier's pooled state: the first token of an encoder, the last of a decoder."""
    return LAST if architecture_for(model.config).family == "decoder" else FIRST


@dataclass
class Layer:
    """One layer recomputed from its input ``x`` ``(B, N, D)`` and attention ``attn`` ``(B, H, N, N)``."""

    x: torch.Tensor
    # (B, H, N, N): the weights the value vectors are mixed with (a branch normalised after the attention, Gemma
    # 2's: divided by that norm's scale of each query row, s_i)
    attn: torch.Tensor
    f: torch.Tensor  # (B, H, N, D): f^h(a_j), value bias included (times that norm's gain)
    std1: torch.Tensor  # (B, N, 1): s_i of LN1's input (post-LN; ones for pre-LN)
    y1: torch.Tensor  # (B, N, D): LN1's output (post-LN) or the residual stream after attention (pre-LN)
    theta: torch.Tensor  # (B, N, F): act(u)/u of the FFN (or gate) pre-activation u (the zero-origin linearisation)
    std2: torch.Tensor  # (B, N, 1): s_i of LN2's input (post-LN; ones for pre-LN)
    modules: dict[str, nn.Module]
    pre_ln: bool = False

    def cut(self, rows: slice) -> Layer:
        """The layer of examples ``rows`` only."""
        return Layer(*(t[rows] for t in (self.x, self.attn, self.f, self.std1, self.y1, self.theta, self.std2)),
                     self.modules, self.pre_ln)

    def summand(self, v: torch.Tensor) -> torch.Tensor:
        """A summand of the attention block's output as it enters the layer's output: through LN1 without β and
        1/s (post-LN), unchanged (pre-LN)."""
        return v if self.pre_ln else _ln_part(v, self.modules["ln1"])


def _std(ln: nn.LayerNorm, v: torch.Tensor) -> torch.Tensor:
    return (v.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()


def _ratio(out: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """act(u)/u elementwise, 0 where u = 0 (there act(u) = 0 for GELU, ReLU and tanh)."""
    return torch.where(pre != 0, out / torch.where(pre != 0, pre, torch.ones_like(pre)), torch.zeros_like(pre))


_PARTS = ("value", "output", "ln1", "ffn_in", "act", "ffn_out", "ln2", "gate", "ffn", "moe", "post_attn_norm",
          "post_ffn_norm")


def _parts(block: nn.Module, model: nn.Module, anatomy: Anatomy) -> dict[str, nn.Module]:
    """One layer's pieces by their :class:`Anatomy` names (the value projection: the entry's :class:`Layers`; a
    fused gate/up projection as its two halves, ``gate`` and ``ffn_in``)."""
    spec = architecture_for(model.config).layers
    paths = {k: spec.value if k == "value" else getattr(anatomy, k) for k in _PARTS}
    mods = {k: _attr(block, path) for k, path in paths.items() if path is not None}
    for k in ("ln1", "ln2", "post_attn_norm", "post_ffn_norm"):
        if k in mods:
            mods[k] = as_layer_norm(mods[k])
    if anatomy.gate_up is not None:
        mods["gate"], mods["ffn_in"] = _halves(_attr(block, anatomy.gate_up))
    if spec.value_bias is not None:  # the value rows of the fused projection, the bias added after it included
        fused = mods["value"]
        bias = _attr(block, spec.value_bias).detach()
        weight = linear_weight(fused).detach()
        rows = spec.value_features(weight.shape[0], model.config.num_attention_heads,
                                   bias.shape[0] // model.config.num_attention_heads).to(weight.device)
        own = getattr(fused, "bias", None)
        mods["value"] = _linear_rows(weight, rows, bias + (0 if own is None else own.detach()[rows]))
    return mods


def _linear_rows(weight: torch.Tensor, rows: Any, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` viewing the output ``rows`` of a projection's ``weight`` ``(out, in)``, with ``bias`` (the
    rows' own, already selected) or none."""
    lin = nn.Linear(weight.shape[1], weight[rows].shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach()[rows], requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def _halves(fused: nn.Linear) -> tuple[nn.Linear, nn.Linear]:
    """The first and second half of a fused projection's outputs as two ``nn.Linear`` viewing its weights."""
    half = fused.out_features // 2
    lower, upper = slice(0, half), slice(half, None)
    bias = fused.bias.detach() if fused.bias is not None else None
    return (_linear_rows(fused.weight, lower, None if bias is None else bias[lower]),
            _linear_rows(fused.weight, upper, None if bias is None else bias[upper]))


def _final_norm(model: nn.Module, anatomy: Anatomy) -> nn.Module | None:
    return None if anatomy.final_norm is None else as_layer_norm(_attr(model.base_model, anatomy.final_norm))


def _values(mods: dict[str, nn.Module], a: torch.Tensor, heads: int, spec: Layers) -> torch.Tensor:
    """``(B, N, H, d_h)``: each head's value vectors of the value projection's input ``a`` (where ``spec`` says
    they are in its output; grouped-query attention's key/value heads repeated for their queries)."""
    out = mods["value"](a)
    b, n, _ = a.shape
    dh = linear_weight(mods["output"]).shape[1] // heads
    if spec.fused > 1 and spec.value_bias is None:  # with a value bias, _parts gives the value rows alone
        out = out[..., spec.value_features(out.shape[-1], heads, dh).to(out.device)]
    v = out.reshape(b, n, out.shape[-1] // dh, dh)
    return v if v.shape[2] == heads else v.repeat_interleave(heads // v.shape[2], dim=2)


def _head_outputs(mods: dict[str, nn.Module], v: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D)``: f^h = v^h W_O^h, each head's value vectors ``v`` ``(B, N, H, d_h)`` through its slice of
    the output projection (no output bias)."""
    w = linear_weight(mods["output"])
    return torch.einsum("bjhv,dhv->bhjd", v, w.view(w.shape[0], v.shape[2], v.shape[3]))


def _value_terms(mods: dict[str, nn.Module], a: torch.Tensor, heads: int, spec: Layers
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f, v)`` of the value projection's input ``a``: each head's outputs f^h = v^h W_O^h ``(B, H, N, D)``
    (:func:`_head_outputs`) and its value vectors ``(B, H, N, d_h)``, contiguous (for :func:`_attention_sum`)."""
    v = _values(mods, a, heads, spec)
    return _head_outputs(mods, v), v.transpose(1, 2).contiguous()


def _output_bias(mods: dict[str, nn.Module]) -> torch.Tensor | float:
    bias = mods["output"].bias
    return 0.0 if bias is None else bias


def _ffn(mods: dict[str, nn.Module], y: torch.Tensor, ratio: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The FFN's output on ``y`` and act(u)/u of its activation's pre-activation u (a gated FFN's gate; none,
    width 0, for an FFN read as one module, or without ``ratio``)."""
    none = y.new_zeros(*y.shape[:-1], 0)
    if "ffn" in mods or "moe" in mods:
        out = mods["ffn" if "ffn" in mods else "moe"](y)
        return out[0] if isinstance(out, tuple) else out, none
    if "gate" in mods:
        g = mods["gate"](y)
        ga = mods["act"](g)
        return mods["ffn_out"](ga * mods["ffn_in"](y)), _ratio(ga, g) if ratio else none
    u = mods["ffn_in"](y)
    a = mods["act"](u)
    return mods["ffn_out"](a), _ratio(a, u) if ratio else none


def _attention_sum(mods: dict[str, nn.Module], x: torch.Tensor, attn: torch.Tensor, f: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention block's residual sum at the query rows ``attn`` ``(B, H, R, N)`` holds (``x``: the residual
    there, ``(B, R, D)``), with the weights and values as its summands take them: under a norm after the
    attention branch (Gemma 2's) z_ij = Σ_h A^h_ij f^h_j ⊙ g / s_i (+ x_i), so A's rows are divided by that
    norm's scale s_i and f multiplied by its gain g.

    ``v``: the value vectors ``f`` came from, ``(B, H, N, d_h)`` (:func:`_value_terms`): the branch is summed as
    the model does, Σ_h (A^h v^h) W_O^h, with D / d_h times fewer products than Σ_hj A^h_ij f^h_j."""
    mixed = torch.matmul(attn.to(v.dtype), v)  # (B, H, R, d_h)
    b, h, r, dh = mixed.shape
    branch = (mixed.transpose(1, 2).reshape(b, r, h * dh) @ linear_weight(mods["output"]).T).to(f.dtype)
    branch = branch + _output_bias(mods)
    if "post_attn_norm" not in mods:
        return x + branch, attn, f
    norm = mods["post_attn_norm"]
    scale = (branch.float().pow(2).mean(-1, keepdim=True) + rms_eps(norm)).sqrt().to(x.dtype)
    return x + norm(branch), attn / scale.unsqueeze(1), f * rms_gain(norm, x)


@dataclass
class _Output:
    """A layer's output recomputed at some rows from its attention block's residual sum: ``got`` (what the pass's
    hidden state there must be), LN1's output ``y1`` (pre-LN: the residual stream after attention), the FFN's
    act(u)/u ``theta`` and, post-LN, the scales ``std1``, ``std2`` of LN1's and LN2's inputs ``(B, R, 1)``."""

    got: torch.Tensor
    y1: torch.Tensor
    theta: torch.Tensor
    std1: torch.Tensor | None = None
    std2: torch.Tensor | None = None


def _layer_output(mods: dict[str, nn.Module], anatomy: Anatomy, x: torch.Tensor, pre1: torch.Tensor,
                  final: nn.Module | None = None, ratio: bool = True) -> _Output:
    """The layer's output at the rows of ``x`` (its input there) and ``pre1`` (:func:`_attention_sum`);
    ``final``: the model's final norm, for a pre-LN model's last layer (its hidden state is that norm's output);
    ``ratio``: with the FFN's act(u)/u (``theta``)."""
    if anatomy.pre_ln:
        ffn, theta = _ffn(mods, mods["ln2"](x if anatomy.parallel else pre1), ratio)
        got = pre1 + (mods["post_ffn_norm"](ffn) if "post_ffn_norm" in mods else ffn)
        return _Output(final(got) if final is not None else got, pre1, theta)
    y1 = mods["ln1"](pre1)
    ffn, theta = _ffn(mods, y1, ratio)
    pre2 = y1 + ffn
    return _Output(mods["ln2"](pre2), y1, theta, _std(mods["ln1"], pre1), _std(mods["ln2"], pre2))


@dataclass
class ValueZeroedLayer:
    """A layer recomputed from its pieces (its :class:`Anatomy`) at its input ``x`` ``(B, N, D)`` and attention
    ``attn`` ``(B, H, N, N)``, for value zeroing.

    Zeroing key j's value vector leaves every attention weight as it is (the weights do not read the values), so
    it removes exactly Σ_h A^h_ij f^h_j from row i's attention branch (f: the head's value vector through the
    output projection, the value bias included). The layer's output with it zeroed is then its post-attention part
    (the branch's own norm, Gemma 2's, the residual, norms, FFN) at that changed branch: nothing of the attention is
    rerun, and a pair with A_ij = 0 in every head is not changed at all. ``output`` is the layer's output
    recomputed the same way (compare with the model's before trusting the rest)."""

    mods: dict[str, nn.Module]
    anatomy: Anatomy
    x: torch.Tensor
    attn: torch.Tensor
    f: torch.Tensor
    pre1: torch.Tensor
    output: torch.Tensor
    branch: torch.Tensor | None = None  # the attention branch before a norm of its own (Gemma 2's), else None

    @staticmethod
    def applies(model: nn.Module) -> bool:
        """Whether :meth:`of` recomputes ``model``'s layers: a known anatomy whose zeroed outputs are a function of
        the attention branch alone (not experts, which route each vector; not an encoder-decoder's layers)."""
        anatomy = _anatomy(model)
        return not (anatomy is None or anatomy.moe or architecture_for(model.config).family == "encoder-decoder")

    @classmethod
    def of(cls, model: nn.Module, block: nn.Module, x: torch.Tensor, attn: torch.Tensor) -> ValueZeroedLayer | None:
        """The layer ``block`` of ``model`` at input ``x`` and attention ``attn``, or ``None`` where it does not
        apply (:meth:`applies`)."""
        if not ValueZeroedLayer.applies(model):
            return None
        anatomy = _anatomy(model)
        entry = architecture_for(model.config)
        mods = _parts(block, model, anatomy)
        f, v = _value_terms(mods, mods["ln1"](x) if anatomy.pre_ln else x, attn.shape[1], entry.layers)
        # the branch Σ_h (A^h v^h) W_O^h + b alone (no residual), once; a norm of its own (Gemma 2's) applies to it
        # before the residual sum, and the zeroing changes the branch inside that norm, so the branch is kept
        without_norm = {k: m for k, m in mods.items() if k != "post_attn_norm"}
        branch = _attention_sum(without_norm, torch.zeros_like(x), attn, f, v)[0]
        norm = mods.get("post_attn_norm")
        pre1 = x + (branch if norm is None else norm(branch))
        return cls(mods, anatomy, x, attn, f, pre1, _layer_output(mods, anatomy, x, pre1, ratio=False).got,
                   None if norm is None else branch)

    def reproduces(self, want: torch.Tensor, real: torch.Tensor) -> bool:
        """Whether :attr:`output` is the model's layer output ``want`` at the ``real`` rows, to the rounding
        :func:`_check_layer` allows."""
        err, tol = _output_error(self.output, want.to(self.output.dtype), real)
        return err <= tol

    def zeroed(self, example: int, rows: slice | torch.Tensor, keys: int) -> torch.Tensor:
        """``(R, keys, D)``: the layer's output at ``rows`` (a slice or positions) of ``example`` with the value
        vector of each of the first ``keys`` positions zeroed (one at a time)."""
        a = self.attn[example][:, rows, :keys].to(self.f.dtype)  # (H, R, K)
        delta = torch.bmm(a.permute(2, 1, 0), self.f[example, :, :keys].transpose(0, 1)).transpose(0, 1)  # (R, K, D)
        x = self.x[example][rows, None].expand_as(delta)
        if self.branch is None:
            pre = self.pre1[example][rows, None] - delta
        else:  # x + N(branch − δ)
            pre = x + self.mods["post_attn_norm"](self.branch[example][rows, None] - delta)
        return _layer_output(self.mods, self.anatomy, x, pre, ratio=False).got


def _output_error(got: torch.Tensor, want: torch.Tensor, real: torch.Tensor) -> tuple[float, float]:
    """``(error, tolerance)`` of a recomputed layer output ``got`` against the model's ``want`` at the ``real``
    rows: the largest difference, and the most rounding explains."""
    err = (got - want)[real].abs().max().item() if real.any() else 0.0
    # rounding grows with the precision the model runs in (bfloat16: eps 2^-7); a wrong anatomy is off by O(1)
    tol = max(1e-3, 4 * torch.finfo(want.dtype).eps)
    return err, tol * (1.0 + want[real].abs().max().item())


def _check_layer(model: nn.Module, index: int, got: torch.Tensor, want: torch.Tensor, real: torch.Tensor) -> None:
    """Refuse a recomputed layer output that is not the model's (a wrong anatomy would give wrong scores)."""
    err, tol = _output_error(got, want, real)
    if not err <= tol:
        raise ModelError(
            f"recomputing layer {index + 1} of this {model.config.model_type!r} model from its modules does not "
            f"reproduce its hidden states (max difference {err:.3g}): its architecture entry's anatomy does not "
            "describe it"
        )


def _check_head(got: torch.Tensor, want: torch.Tensor, model_name: str) -> None:
    """Refuse a head recomputed from its modules whose logits ``(R, C)`` are not the model's ``want``."""
    err, tol = _output_error(got, want.to(got.dtype), torch.ones(got.shape[:-1], dtype=torch.bool,
                                                                  device=got.device))
    if not err <= tol:
        raise ModelError(f"decompx: recomputing the head of {model_name} from its modules does not reproduce its "
                         f"logits (max difference {err:.3g})")


def _states(ctx: BatchContext) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Hidden states and real positions to recompute the layers from: the batch's, or, when its rows are prefixes
    of one sequence (a generation's steps), that sequence's alone (a batch of one), since a prefix's matrices are
    the top-left block of the sequence's (causal masking)."""
    cap = ctx.capture
    if ctx.sequence is None:
        return list(cap.hidden), cap.key_mask.bool()
    return [h[:1] for h in cap.hidden], ctx.sequence["attention_mask"].bool().to(cap.key_mask.device)


def _pass(ctx: BatchContext) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """:func:`_states` and every layer's whole attention maps: as the pass kept them, or assembled from its chunks
    (fused attention) where they fit what the budget leaves."""
    hidden, real = _states(ctx)
    cap = ctx.capture
    chunks = cap.map_chunks()
    if isinstance(chunks, WholeMaps):
        maps = list(chunks.maps)
    else:
        rows, n = cap.key_mask.shape
        need = chunks.n_layers * rows * model_dims(ctx.model).heads * n * n * hidden[0].element_size()
        if need > ctx.budget_left():
            raise InputError(f"decompx bias='absdot' propagates every token's vectors through every layer's whole "
                             f"attention maps, about {need / 2**30:.1f} GiB here, more than the "
                             f"{ctx.budget_left() / 2**30:.1f} GiB the memory budget leaves; use bias='token' (the "
                             "default) or a larger budget")
        maps = [torch.cat([a for _, a, _ in chunks.chunks(i)], 2) for i in range(chunks.n_layers)]
    return hidden, maps if ctx.sequence is None else [a[:1] for a in maps], real


def model_layers(ctx: BatchContext) -> list[Layer]:
    """Every layer of the batch (or of the sequence its rows are prefixes of) recomputed from the shared pass
    (cached in ``ctx.cache`` for the other methods)."""
    if "decomposition.layers" in ctx.cache:
        return ctx.cache["decomposition.layers"]
    model = ctx.model
    anatomy = _anatomy(model)
    blocks = _blocks(model)
    spec = architecture_for(model.config).layers
    final = _final_norm(model, anatomy)
    hidden, attentions, real = _pass(ctx)
    out: list[Layer] = []
    with torch.no_grad():
        for i, (block, attn) in enumerate(zip(blocks, attentions, strict=True)):
            mods = _parts(block, model, anatomy)
            x = hidden[i]
            h = attn.shape[1]
            a = mods["ln1"](x) if anatomy.pre_ln else x
            f, v = _value_terms(mods, a, h, spec)
            pre1, attn, f = _attention_sum(mods, x, attn, f, v)
            o = _layer_output(mods, anatomy, x, pre1, final if i == len(blocks) - 1 else None)
            _check_layer(model, i, o.got, hidden[i + 1], real)
            if anatomy.pre_ln:
                ones = x.new_ones(*x.shape[:2], 1)
                out.append(Layer(x, attn, f, ones, pre1, o.theta, ones, mods, pre_ln=True))
            else:
                out.append(Layer(x, attn, f, o.std1, o.y1, o.theta, o.std2, mods))
    ctx.cache["decomposition.layers"] = out
    return out


@dataclass
class _Mixing:
    """One attention's mixing alone, at some of its query rows: the residual ``x`` at those rows ``(B, R, D)``,
    their weights ``attn`` ``(B, H, R, Nk)``, the keys' transformed value vectors ``f`` ``(B, H, Nk, D)`` and the
    rows' query positions ``positions`` ``(R,)`` (``None``: every query, R = Nq; what :func:`_norm_matrix`
    reads)."""

    x: torch.Tensor
    attn: torch.Tensor
    f: torch.Tensor
    positions: torch.Tensor | None = None


def _ln_part(v: torch.Tensor, ln: nn.LayerNorm, std: torch.Tensor | None = None) -> torch.Tensor:
    """LN applied to summands ``v`` ``(..., D)`` without β: (v − mean_d v) ⊙ γ, divided by ``std`` (broadcast to
    ``v[..., :1]``) when given."""
    out = (v - v.mean(-1, keepdim=True)) * ln.weight
    return out if std is None else out / std


def _gram(g: torch.Tensor) -> torch.Tensor:
    """``(B, N, H, H)``: G_j = [⟨g^h_j, g^k_j⟩]_hk of per-head vectors ``g`` ``(B, H, N, D)``."""
    return torch.einsum("bhjd,bkjd->bjhk", g, g)


def _quadratic_rows(a: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``(B, R, N)``: Σ_hk a^h_ij a^k_ij G_j[h, k] for ``a`` ``(B, H, R, N)`` and the symmetric ``gram``
    ``(B, N, H, H)``, as H(H+1)/2 elementwise products over the rows (a batched ``H × H`` product per key moves the
    data around more than it computes: five times slower at H = 9)."""
    g = gram.permute(0, 2, 3, 1)  # (B, H, H, N): G[h, k] over the keys
    heads = a.shape[1]
    out = torch.zeros_like(a[:, 0])
    for h in range(heads):
        inner = a[:, h] * g[:, h, h, None, :]
        for k in range(h + 1, heads):
            inner.addcmul_(a[:, k], g[:, h, k, None, :], value=2.0)
        out.addcmul_(a[:, h], inner)
    return out


def _keys_used(a: torch.Tensor, at: torch.Tensor) -> int:
    """How many leading keys the rows of ``a`` ``(B, H, R, N)`` (positions ``at``) involve: up to the last key any
    row attends to or is (a causal chunk's rows attend to no key after their last one; their terms are 0 there)."""
    attended = torch.nonzero(a.abs().amax(dim=(0, 1, 2))).flatten()
    return max(int(attended[-1]) + 1 if len(attended) else 0, int(at.max()) + 1 if len(at) else 0)


def _norm_rows(a: torch.Tensor, g: torch.Tensor, gram: torch.Tensor, m: torch.Tensor | None,
               at: torch.Tensor) -> torch.Tensor:
    """``(B, R, N)`` in float64: ‖Σ_h α^h_ij g^h_j (+ δ_ij m_i)‖² at the query rows of ``a`` ``(B, H, R, N)``,
    whose positions are ``at`` ``(R,)``, with ``g`` ``(B, H, N, D)``, its :func:`_gram` and the residual ``m``
    ``(B, R, D)`` at those rows (``None``: no residual). Keys after :func:`_keys_used` give 0 without being
    computed."""
    stop = _keys_used(a, at)
    sq = a.new_zeros(a.shape[0], a.shape[2], a.shape[3], dtype=torch.float64)
    sq[..., :stop] = _quadratic_rows(a[..., :stop].double(), gram[:, :stop])
    if m is not None:
        rows = torch.arange(a.shape[2], device=a.device)
        diag = 2 * torch.einsum("bhr,bhrd,brd->br", a[:, :, rows, at].double(), g[:, :, at], m) + (m * m).sum(-1)
        sq[:, rows, at] += diag
    return sq


def _norm_matrix(layer: Layer | _Mixing, transform: Callable[[torch.Tensor], torch.Tensor],
                 scale: torch.Tensor | None, residual: bool) -> torch.Tensor:
    """``(B, R, N)``: ‖M z_ij‖ · scale_i for a linear map M (``transform``) at the query rows i the mixing holds
    (every row of a :class:`Layer`: R = N), without forming the ``(B, R, N, D)`` vectors: with g^h_j = M f^h(x_j)
    and G_j = [⟨g^h_j, g^k_j⟩]_hk, ‖Σ_h α^h_ij g^h_j‖² = α_ij^T G_j α_ij, plus, where j = i with the residual,
    2 Σ_h α^h_ii ⟨g^h_i, M x_i⟩ + ‖M x_i‖²."""
    g = transform(layer.f).double()  # (B, H, N, D)
    at = getattr(layer, "positions", None)
    at = torch.arange(layer.attn.shape[2], device=g.device) if at is None else at.to(g.device)
    m = transform(layer.x).double() if residual else None  # (B, R, D): the residual at the rows
    sq = _norm_rows(layer.attn, g, _gram(g), m, at)
    out = sq.clamp_min(0).sqrt().to(layer.x.dtype)
    return out if scale is None else out * scale


def alti_block(device: torch.device | str) -> int:
    """Elements of ALTI's block of vectors t_ij on ``device``: :data:`_ALTI_BLOCK` on the CPU, the chunk size of
    the recomputed maps on an accelerator (:func:`~attnlens.core.row_attention.chunk_elements`)."""
    return _ALTI_BLOCK if torch.device(device).type == "cpu" else chunk_elements(device)


def _alti_rows(a: torch.Tensor, g: torch.Tensor, m: torch.Tensor, y: torch.Tensor, at: torch.Tensor
               ) -> torch.Tensor:
    """``(B, R, N)``: max(0, ‖y_i‖₁ − ‖y_i − t_ij‖₁) with t_ij = Σ_h a^h_ij g^h_j + δ_ij m_i, at the query rows of
    ``a`` ``(B, H, R, N)`` (positions ``at``), ``g`` ``(B, N, H, D)`` (key-major), the residual ``m`` and ``y``
    ``(B, R, D)`` there.

    On the CPU (float32 / float64) a compiled loop forms each t a few rows at a time in cache and reduces it at
    once (:mod:`~attnlens.methods.alti_kernel`). Elsewhere the vectors t are formed a block of keys at a time
    (every example's) as one batched product over the keys, ``(B·keys, R, H) @ (B·keys, H, D)``, into a reused
    buffer of :func:`alti_block` elements (small enough to stay in cache while its distances are taken). Either
    way only the pairs that need it are computed: a row neither attending to a key nor placed there has t = 0, a
    distance of ‖y_i‖₁ and so 0, so each key is computed from the first row that needs it on (a causal chunk's
    earlier rows attend to no later key), and no key after the last one any row needs."""
    b, h, r, n = a.shape
    d = g.shape[-1]
    stop = _keys_used(a, at)
    norms = torch.linalg.vector_norm(y, ord=1, dim=-1)  # (B, R)
    # (B, keys, R): ‖y_i‖₁ where t_ij = 0; a copy, never a view of ``norms`` (with one key the expanded view is
    # already contiguous, and writing the distances into it would overwrite the norms)
    dist = norms.unsqueeze(1).expand(b, n, r).clone(memory_format=torch.contiguous_format)
    # per row the last key it needs (the last it attends to in any example and head, or its own position), as a
    # running maximum: the rows a block starting at key k needs begin at the first whose value reaches k
    last = torch.where(a.ne(0).any(1).any(0), torch.arange(n, device=a.device), -1).amax(-1)
    needed = torch.maximum(last, at).cummax(0).values.tolist()
    ak = a[:, :, :, :stop].permute(0, 3, 2, 1).contiguous()  # (B, keys, R, H)
    if alti_kernel.applies(ak, g, y, m):  # CPU: one compiled loop, no vectors t written to memory
        first = torch.searchsorted(torch.tensor(needed), torch.arange(stop))
        alti_kernel.distances(ak, g, y, m, at, first, dist)
        return (norms.unsqueeze(-1) - dist.transpose(1, 2)).clamp_min(0)
    positions = at.tolist()
    keys = max(1, min(stop, alti_block(a.device) // max(1, b * r * d)))  # keys per block, every example's at once
    buffer = a.new_empty(b * keys * r * d)
    for start in range(0, stop, keys):
        end = min(stop, start + keys)
        first = bisect.bisect_left(needed, start)
        rows = r - first
        if not rows:
            continue
        t = buffer[: b * (end - start) * rows * d].view(b * (end - start), rows, d)
        torch.bmm(ak[:, start:end, first:].reshape(-1, rows, h), g[:, start:end].reshape(-1, h, d), out=t)
        t = t.view(b, end - start, rows, d).sub_(y[:, None, first:])  # t_ij − y_i
        own = [k for k in range(first, r) if start <= positions[k] < end]  # rows whose own key is in the block
        if own:
            on = torch.tensor(own, device=a.device)
            t[:, at[on] - start, on - first] += m[:, on]
        dist[:, start:end, first:] = t.abs_().sum(-1)
    return (norms.unsqueeze(-1) - dist.transpose(1, 2)).clamp_min(0)


def _check_attnnorm(variant: str = "attn") -> None:
    """attnnorm's option values (whether the variant fits the model is checked with it)."""
    if variant not in ATTNNORM_VARIANTS:
        raise InputError(f"variant={variant!r}; choose one of {', '.join(ATTNNORM_VARIANTS)}")


def _check_globenc(normalize: bool | None = None) -> None:
    """GlobEnc's option values."""
    check_flag("globenc", "normalize", normalize, none=True)


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
    if _anatomy(model).pre_ln:
        return (f"decompx bias={bias!r} (sharing each bias among the tokens) is implemented for post-LN encoders; "
                f"this {model.config.model_type!r} model is pre-LN: use bias='token' (the default)")
    if task != "classification":
        return (f"decompx bias={bias!r} decomposes a sequence classifier's first token; for a {task} model use "
                "bias='token' (the default)")
    return None


def _attnnorm_fits(model: Any, stream: str, task: str, options: Mapping[str, Any]) -> str | None:
    """Why attnnorm's ``variant`` is not defined on such a model's ``stream``: the residual LayerNorm variant
    needs a post-LN layer's norm after its residual sum, the residual variants a query that is one of the keys."""
    variant = options.get("variant", "attn")
    if stream in ("decoder", "cross") and (variant == "attn_res_ln" or (variant == "attn_res" and stream == "cross")):
        return (f"attnnorm variant={variant!r} is not defined on attention={stream!r}: "
                + ("the residual is the decoder's state, not one of the keys" if stream == "cross" else
                   "a decoder layer's cross-attention comes between its residual sum and that LayerNorm")
                + "; use 'attn'" + (" or 'attn_res'" if stream == "decoder" else ""))
    if stream not in ("decoder", "cross") and variant == "attn_res_ln" and _anatomy(model).pre_ln:
        return ("attnnorm variant='attn_res_ln' reads the LayerNorm after a post-LN layer's residual sum; this "
                f"{model.config.model_type!r} model is pre-LN (none there): use 'attn' or 'attn_res'")
    return None


def _row_normalised(m: torch.Tensor) -> torch.Tensor:
    return m / m.sum(-1, keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)


def _stream_norms(ctx: BatchContext, variant: str) -> list[torch.Tensor]:
    """attnnorm's rows on an encoder-decoder's decoder self-attention or cross-attention stream: per decoder
    layer ‖Σ_h A^h_ij f^h(x_j)‖ (+ x_i with ``"attn_res"``, decoder stream only), f^h the stream's value and output
    projections of the layer's self-attention input (decoder: the layer input, through LN1 when pre-LN) or of the
    encoder's output (cross). No residual LayerNorm variant: in a decoder layer the cross-attention comes between."""
    cap, model, stream = ctx.capture, ctx.model, ctx.stream
    anatomy = _anatomy(model)
    spec = architecture_for(model.config).layers
    at = cap.rows_at()
    mats = []
    with torch.no_grad():
        for block, attn, x in zip(spec.modules(model, "decoder"), cap.attention_rows, cap.hidden, strict=False):
            if stream == "decoder":  # the self-attention's pieces only (a decoder layer's FFN sits elsewhere)
                mods = {k: _attr(block, path) for k, path in
                        (("value", spec.value), ("output", anatomy.output), ("ln1", anatomy.ln1))}
                a = mods["ln1"](x) if anatomy.pre_ln else x
            else:  # the keys are the encoder's output, x (the same for every layer)
                mods = {"value": _attr(block, anatomy.cross_value), "output": _attr(block, anatomy.cross_output)}
                a = x
            f = _head_outputs(mods, _values(mods, a, attn.shape[1], spec))
            # the residual (decoder stream) is the decoder state at the rows; cross attention has none
            residual = x[:, at.to(x.device)] if stream == "decoder" else x[:, :0]
            m = _norm_matrix(_Mixing(residual, attn, f, at), lambda v: v, None, variant == "attn_res")
            mats.append(m * cap.key_mask.to(m.dtype)[:, None, :])
    return mats


def _attnnorm_rows(ctx: BatchContext, variant: str) -> list[torch.Tensor]:
    """attnnorm's matrices ``(B, R, N)`` at the captured attention rows of every layer (the explained rows under
    fused attention, every row with whole maps): each layer's value and output projections recomputed from its
    input h^{l-1}, and the layer's output at those rows recomputed and checked against the captured h^l (a wrong
    anatomy is an error, never a silently wrong score)."""
    cap, model = ctx.capture, ctx.model
    anatomy = _anatomy(model)
    spec = architecture_for(model.config).layers
    blocks = _blocks(model)
    final = _final_norm(model, anatomy)
    hidden, rows_attn, real = list(cap.hidden), list(cap.attention_rows), cap.key_mask.bool()
    if ctx.sequence is not None:  # the rows are prefixes of one sequence: its tensors alone (a batch of one)
        hidden, rows_attn = [h[:1] for h in hidden], [a[:1] for a in rows_attn]
        real = ctx.sequence["attention_mask"].bool().to(real.device)
    at = cap.rows_at().to(hidden[0].device)
    mats = []
    with torch.no_grad():
        for i, (block, attn) in enumerate(zip(blocks, rows_attn, strict=True)):
            mods = _parts(block, model, anatomy)
            x = hidden[i]
            xr = x[:, at]
            f, v = _value_terms(mods, mods["ln1"](x) if anatomy.pre_ln else x, attn.shape[1], spec)
            pre1, attn, f = _attention_sum(mods, xr, attn, f, v)
            o = _layer_output(mods, anatomy, xr, pre1, final if i == len(blocks) - 1 else None)
            std1 = o.std1
            _check_layer(model, i, o.got, hidden[i + 1][:, at], real[:, at])
            mixing = _Mixing(xr, attn, f, at)
            if variant == "attn_res_ln":
                m = _norm_matrix(mixing, functools.partial(_ln_part, ln=mods["ln1"]), 1 / std1, True)
            else:
                m = _norm_matrix(mixing, lambda v: v, None, variant == "attn_res")
            if ctx.sequence is not None:
                m = m.expand(ctx.token_mask.shape[0], *m.shape[1:])
            mats.append(m * cap.key_mask.to(m.dtype)[:, None, :])
    return mats


@register(
    "attnnorm",
    needs={ATTENTION_ROWS, HIDDEN},
    class_specific=False,
    applies=_applies("attnnorm", streams=("encoder", "decoder", "cross")),
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
    return _ln_part(_ln_part(v, ln1), ln2)


@dataclass
class _LayerRows:
    """One layer recomputed at a chunk of query rows ``at`` ``(R,)``: the residual there ``x`` ``(B, R, D)``, the
    weights ``attn`` ``(B, H, R, N)`` and values ``f`` ``(B, H, N, D)`` as the summands take them
    (:func:`_attention_sum`), and its :class:`_Output` there."""

    at: torch.Tensor
    x: torch.Tensor
    attn: torch.Tensor
    f: torch.Tensor
    out: _Output


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
        self.anatomy = _anatomy(model)
        self.blocks = _blocks(model)
        self.spec = architecture_for(model.config).layers
        self.final = _final_norm(model, self.anatomy)
        self.hidden, self.real = list(cap.hidden), cap.key_mask.bool()
        if ctx.sequence is not None:  # the rows are prefixes of one sequence: its tensors alone (a batch of one)
            self.hidden = [h[:1] for h in self.hidden]
            self.real = ctx.sequence["attention_mask"].bool().to(self.real.device)
        self.layer: int | None = None

    def begin(self, j: int, heads: int) -> None:
        """Layer j's first chunk is next: its modules and value vectors."""
        mods = _parts(self.blocks[j], self.ctx.model, self.anatomy)
        x = self.hidden[j]
        self.layer, self.mods, self.x, self.checked = j, mods, x, False
        self.f, self.v = _value_terms(mods, mods["ln1"](x) if self.anatomy.pre_ln else x, heads, self.spec)

    def matrix(self, rows: _LayerRows) -> torch.Tensor:
        """``(B, R, N)``: the method's layer matrix at the chunk's rows."""
        raise NotImplementedError

    def normalised(self, m: torch.Tensor) -> torch.Tensor:
        """The chunk's rows after the padding was zeroed (default: each row divided by its sum)."""
        return _row_normalised(m)

    def __call__(self, j: int, start: int, a: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
        if j != self.layer:
            self.begin(j, a.shape[1])
        mods = self.mods
        if self.ctx.sequence is not None:
            a = a[:1]
        rows = slice(start, start + a.shape[2])
        xr = self.x[:, rows]
        with torch.no_grad():
            pre1, a, f = _attention_sum(mods, xr, a, self.f, self.v)
            real_rows = self.real[:, rows]
            if self.anatomy.pre_ln:  # the attention block's sum is all the matrices read
                o = _Output(pre1, pre1, pre1.new_zeros(*pre1.shape[:-1], 0))
                if not self.checked:  # the layer recomputed at a few real rows shows a wrong anatomy as well
                    few = torch.nonzero(real_rows.any(0)).flatten()[:_CHECKED_ROWS]
                    got = _layer_output(mods, self.anatomy, xr[:, few], pre1[:, few],
                                        self.final if j == len(self.blocks) - 1 else None).got
                    _check_layer(self.ctx.model, j, got, self.hidden[j + 1][:, rows][:, few], real_rows[:, few])
                    self.checked = len(few) > 0
            else:
                o = _layer_output(mods, self.anatomy, xr, pre1, self.final if j == len(self.blocks) - 1 else None)
                _check_layer(self.ctx.model, j, o.got, self.hidden[j + 1][:, rows], real_rows)
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
        if self.g is None:  # f as the summands take it is the same for every chunk of the layer
            self.g = transform(rows.f).double()
            self.gram = _gram(self.g)
        m = _norm_rows(rows.attn, self.g, self.gram, transform(rows.x).double(), rows.at)
        m = m.clamp_min(0).sqrt().to(rows.x.dtype)
        return m if scale is None else m * scale

    def normalised(self, m: torch.Tensor) -> torch.Tensor:
        pre_ln = self.anatomy.pre_ln
        if pre_ln and self.normalize is False:  # divided by the largest row sum once the layer is read
            top = m.sum(-1).amax(-1)
            self.largest = top if self.largest is None else torch.maximum(self.largest, top)
            return m
        return _row_normalised(m) if self.normalize or (self.normalize is None and pre_ln) else m

    def divisor(self, j: int) -> torch.Tensor | None:
        """``(B,)``: what layer j's matrix is divided by (its largest row sum), or ``None``."""
        if self.largest is None:
            return None
        return self.largest.clamp_min(torch.finfo(self.largest.dtype).tiny)


class _AltiRows(_ChunkedLayers):
    """ALTI's c_ij = max(0, ‖y_i‖₁ − ‖y_i − T_i(x_j)‖₁) at a chunk of rows (:func:`_alti_rows`)."""

    def begin(self, j: int, heads: int) -> None:
        super().begin(j, heads)
        self.g = None

    def matrix(self, rows: _LayerRows) -> torch.Tensor:
        summand = (lambda v: v) if self.anatomy.pre_ln else functools.partial(_ln_part, ln=self.mods["ln1"])
        if self.g is None:  # LN1 is linear per summand, so it commutes with the attention sum; key-major
            self.g = summand(rows.f).transpose(1, 2).contiguous()
        std1 = rows.out.std1 if rows.out.std1 is not None else rows.x.new_ones(*rows.x.shape[:2], 1)
        return _alti_rows(rows.attn / std1[:, None], self.g, summand(rows.x) / std1, rows.out.y1, rows.at)


@register(
    "globenc",
    needs={ATTENTION_CHUNKS, HIDDEN},
    class_specific=False,
    self_attention_only=True,
    applies=_applies("globenc"),
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


@register(
    "alti",
    needs={ATTENTION_CHUNKS, HIDDEN},
    class_specific=False,
    applies=_applies("alti", streams=("encoder", "decoder", "cross")),
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


# --- ALTI+ (encoder-decoders) -----------------------------------------------------------------------------------
def _key_major(f: torch.Tensor) -> torch.Tensor:
    """``(B, N, H, D)`` of per-head vectors ``(B, H, N, D)``, as :func:`_alti_rows` reads them."""
    return f.transpose(1, 2).contiguous()


def _alti_of_sum(attn: torch.Tensor, f: torch.Tensor, residual: torch.Tensor, pre: torch.Tensor, at: torch.Tensor,
                 norm: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ALTI of one residual sum ``pre`` = ``residual`` + Σ_h A^h f^h (+ bias): ``(c (B, R, N), the block's
    output)``; ``at``: the key each row's residual sits on. Post-LN (``norm`` given): each summand through the
    norm's linear part at pre's scale, the output norm(pre); pre-LN (``None``): the sum itself."""
    if norm is None:
        return _alti_rows(attn, _key_major(f), residual, pre, at), pre
    std, out = _std(norm, pre), norm(pre)
    return _alti_rows(attn / std[:, None], _key_major(_ln_part(f, norm)), _ln_part(residual, norm) / std, out, at), out


def _self_block(mods: dict[str, nn.Module], anatomy: Anatomy, spec: Layers, x: torch.Tensor, attn: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's self-attention block on its input ``x`` ``(B, N, D)``: ``(ALTI's c (B, N, N), the residual sum
    pre1, the block's output)`` — post-LN: LN1(pre1), each summand through LN1's linear part at pre1's scale;
    pre-LN: pre1 itself."""
    f, v = _value_terms(mods, mods["ln1"](x) if anatomy.pre_ln else x, attn.shape[1], spec)
    pre1, attn, f = _attention_sum(mods, x, attn, f, v)
    at = torch.arange(x.shape[1], device=x.device)
    c, out = _alti_of_sum(attn, f, x, pre1, at, None if anatomy.pre_ln else mods["ln1"])
    return c, pre1, out


def _cross_block(cross: dict[str, nn.Module], anatomy: Anatomy, spec: Layers, h: torch.Tensor, attn: torch.Tensor,
                 memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's cross-attention block on the decoder state ``h`` ``(B, T, D)`` (its residual) over the
    encoder's output ``memory`` ``(B, S, D)``: ``(ALTI's c (B, T, S + 1), the block's output)``, column S the
    residual's contribution (a key of its own that only the residual sits on)."""
    f, v = _value_terms(cross, memory, attn.shape[1], spec)
    pre, attn, f = _attention_sum(cross, h, attn, f, v)
    b, heads, t, s = attn.shape
    attn = torch.cat([attn, attn.new_zeros(b, heads, t, 1)], -1)
    f = torch.cat([f, f.new_zeros(b, heads, 1, f.shape[-1])], 2)
    return _alti_of_sum(attn, f, h, pre, torch.full((t,), s, device=h.device),
                        None if anatomy.pre_ln else cross["norm"])


def _encoder_rollout(model: nn.Module, anatomy: Anatomy, spec: Layers, hidden: list[torch.Tensor],
                     attentions: list[torch.Tensor], real: torch.Tensor) -> torch.Tensor:
    """``(B, S, S)``: ALTI rolled out over the encoder's layers, every row (C^L ⋯ C^1): each encoder output's
    contributions of the source tokens; each layer recomputed from its input and checked against the next."""
    blocks = spec.modules(model, "encoder")
    final = _final_norm(model, anatomy)
    keys = real[:, None, :].to(hidden[0].dtype)
    joint = None
    for i, (block, attn) in enumerate(zip(blocks, attentions, strict=True)):
        mods = _parts(block, model, anatomy)
        c, pre1, y1 = _self_block(mods, anatomy, spec, hidden[i], attn)
        got = _layer_output(mods, anatomy, hidden[i], pre1, final if i == len(blocks) - 1 else None).got
        _check_layer(model, i, got, hidden[i + 1], real)
        c = _row_normalised(c * keys)
        joint = c if joint is None else c @ joint
    return joint


def alti_plus(ctx: BatchContext) -> tuple[torch.Tensor, torch.Tensor]:
    """ALTI+ on an encoder-decoder: per decoder layer, the explained rows' contributions of the source tokens
    ``(B, L, S)`` and of the decoder's input positions ``(B, L, T)``; the two add up to 1 per layer.

    The encoder's ALTI is rolled out over every row (R, ``S × S``). In each decoder layer ALTI is taken of its
    self-attention block (c_self over the decoder positions, the residual on the row's own position) and of its
    cross-attention block (c_cross over the encoder outputs and one more column, the block's residual, the decoder
    state); the FFN, which mixes no tokens, is left out as in ALTI. Rolled out from the decoder's input (each
    position its own token): source ← c_cross R + c_res · (c_self · source), target ← c_res · (c_self · target).
    Runs one forward of its own over the batch, which keeps every stream's maps and states as the shared pass's
    forward does (the shared pass then keeps one stream's), and checks every recomputed layer against the model's
    states."""
    model = ctx.model
    anatomy = _anatomy(model)
    if anatomy.cross_norm is None or anatomy.cross_value is None:
        raise InputError(f"ALTI+ needs the cross-attention's projections and norm, which model type "
                         f"{model.config.model_type!r}'s entry omits")
    weights = ctx.capture.query_weights
    step = _examples_per_pass(ctx, _alti_plus_row_bytes(model, ctx.inputs), "alti (ALTI+)")
    parts = [_alti_plus_pass(model, anatomy, {k: v[b:b + step] for k, v in ctx.inputs.items()}, weights[b:b + step])
             for b in range(0, weights.shape[0], step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _examples_per_pass(ctx: BatchContext, row_bytes: int, name: str) -> int:
    """How many examples a method's own pass over every stream of an encoder-decoder takes at once within what the
    budget leaves (:meth:`BatchContext.budget_left`); where one does not fit, an :class:`InputError` (one line)
    before the pass runs."""
    left = ctx.budget_left()
    if row_bytes > left:
        n = ctx.inputs["input_ids"].shape[1]
        raise InputError(f"{name} keeps every stream's attention maps of this encoder-decoder: an input of {n:,} "
                         f"tokens needs about {row_bytes / 2**30:.1f} GiB, more than the {left / 2**30:.1f} GiB the "
                         "memory budget leaves; shorten the input or raise the budget")
    return rows_that_fit(left, row_bytes)


def _alti_plus_row_bytes(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """What one example of :func:`alti_plus`'s pass holds: every stream's attention maps and every layer's states
    (encoder, decoder), about twice over while the layers are recomputed."""
    dims, spec = model_dims(model), architecture_for(model.config).layers
    enc, dec = len(spec.modules(model, "encoder")), len(spec.modules(model, "decoder"))
    source = inputs["input_ids"].shape[1]
    target = inputs["decoder_input_ids"].shape[1] if "decoder_input_ids" in inputs else source
    maps = dims.heads * (enc * source * source + dec * target * (target + source))
    states = dims.hidden * ((enc + 1) * source + (dec + 1) * target)
    return 2 * (maps + states) * dims.itemsize


def _alti_plus_pass(model: nn.Module, anatomy: Anatomy, inputs: dict[str, torch.Tensor], weights: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`alti_plus` of the batch ``inputs`` with the explained rows' ``weights`` ``(B, T)``."""
    spec = architecture_for(model.config).layers
    decoder = anatomy.decoder or anatomy
    with torch.no_grad(), attention_switched(model, EAGER):  # every stream's maps
        out = model(**inputs, output_attentions=True, output_hidden_states=True, use_cache=False, return_dict=True)
    with torch.no_grad():
        ids = inputs["input_ids"]
        enc_real = inputs["attention_mask"].bool() if "attention_mask" in inputs else torch.ones_like(ids).bool()
        memory = out.encoder_last_hidden_state
        joint_enc = _encoder_rollout(model, anatomy, spec, list(out.encoder_hidden_states),
                                     list(out.encoder_attentions), enc_real)
        hidden = list(out.decoder_hidden_states)
        b, t, _ = hidden[0].shape
        dec_real = torch.ones(b, t, dtype=torch.bool, device=hidden[0].device)  # every decoder row is computed
        keys = torch.cat([enc_real[:, None, :], enc_real.new_ones(b, 1, 1)], -1).to(memory.dtype)  # + residual
        source = memory.new_zeros(b, t, memory.shape[1])
        target = torch.eye(t, dtype=memory.dtype, device=memory.device).expand(b, t, t)
        weights = weights.to(memory.dtype)[:, None, :]  # (B, 1, T): the explained rows
        blocks = spec.modules(model, "decoder")
        final = _final_norm(model, decoder)
        rows_source, rows_target = [], []
        for i, block in enumerate(blocks):
            mods = _parts(block, model, decoder)
            cross = {"value": _attr(block, anatomy.cross_value), "output": _attr(block, anatomy.cross_output),
                     "norm": _attr(block, anatomy.cross_norm)}
            c_self, _, h = _self_block(mods, decoder, spec, hidden[i], out.decoder_attentions[i])
            c_cross, h2 = _cross_block(cross, decoder, spec, h, out.cross_attentions[i], memory)
            ffn, _ = _ffn(mods, mods["ln2"](h2) if decoder.pre_ln else h2, ratio=False)
            got = h2 + ffn if decoder.pre_ln else mods["ln2"](h2 + ffn)
            if decoder.pre_ln and i == len(blocks) - 1 and final is not None:
                got = final(got)
            _check_layer(model, i, got, hidden[i + 1], dec_real)
            c_self, c_cross = _row_normalised(c_self), _row_normalised(c_cross * keys)
            residual = c_cross[..., -1:]
            source = c_cross[..., :-1] @ joint_enc + residual * (c_self @ source)
            target = residual * (c_self @ target)
            rows_source.append((weights @ source)[:, 0])
            rows_target.append((weights @ target)[:, 0])
    return torch.stack(rows_source, 1), torch.stack(rows_target, 1)


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


def _frozen_norm(v: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """``norm(v)`` with its scale held constant (a linear map of ``v``, as DecompX reads a LayerNorm): a
    LayerNorm (v − mean)/s ⊙ γ + β, an RMSNorm v/s ⊙ g (:func:`attnlens.models.norms.rms_gain`); no norm
    (``nn.Identity``, ModernBERT's first layer) is ``v``."""
    if isinstance(norm, nn.Identity):
        return v
    if isinstance(norm, nn.LayerNorm):
        out = (v - v.mean(-1, keepdim=True)) / _std(norm, v).detach()
        out = out if norm.weight is None else out * norm.weight
        return out if norm.bias is None else out + norm.bias
    if not is_rms_norm(norm):
        raise ModelError(f"decompx knows LayerNorm and RMSNorm, not {type(norm).__name__}")
    rms = (v.float().pow(2).mean(-1, keepdim=True) + rms_eps(norm)).sqrt().to(v.dtype)
    return v / rms.detach() * rms_gain(norm, v)


def _linearised(act: Callable[[torch.Tensor], torch.Tensor], pre: torch.Tensor) -> torch.Tensor:
    """``act(pre)`` as ``pre`` times the constant ratio act(pre)/pre (the zero-origin linearisation)."""
    return pre * _ratio(act(pre), pre).detach()


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


def _head_steps(ctx: BatchContext, anatomy: Anatomy) -> list[tuple[nn.Module, Callable | None]]:
    """From the pooled state to the logits: a language model's output embeddings, or the classification head's
    ``(linear or norm, activation)`` steps."""
    model = ctx.model
    if ctx.head.task == "causal-lm":  # Gemma 2 caps its logits, c · tanh(z / c): linearised as a head activation
        cap = getattr(model.config, "final_logit_softcapping", None)
        return [(model.get_output_embeddings(), None if not cap else functools.partial(_softcap, cap=float(cap)))]
    if ctx.head.task in ("token", "qa"):
        return _token_head_steps(model)
    return [(_attr(model, lin), None if act is None else HEAD_ACTIVATIONS.get(act) or _attr(model, act))
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


def _output_weights(logits: torch.Tensor, targets: torch.Tensor, contrast: bool) -> torch.Tensor:
    """``(B, C)`` weights of the explained combination of logits: the target's one-hot, minus the softmax with
    ``contrast`` (z_t − Σ_c p_c z_c, the first-order change of log p_t)."""
    n = logits.shape[-1]
    if targets.dim() == 2:  # (target, contrast) pairs of a contrastive head: z_t − z_c, a combination of logits
        w = torch.nn.functional.one_hot(targets[:, 0], n) - torch.nn.functional.one_hot(targets[:, 1], n)
        return w.to(logits.dtype)
    w = torch.nn.functional.one_hot(targets, n).to(logits.dtype)
    return w - logits.softmax(-1) if contrast else w


def _layer_values(mods: dict[str, nn.Module], anatomy: Anatomy, h: torch.Tensor, heads: int, spec: Layers
                  ) -> torch.Tensor:
    """A linearised layer's value vectors ``(B, N, H, d_h)`` of its input ``h`` (a pre-LN layer's through LN1 with
    its scale held)."""
    return _values(mods, _frozen_norm(h, mods["ln1"]) if anatomy.pre_ln else h, heads, spec)


def _layer_rest(block: nn.Module, mods: dict[str, nn.Module], anatomy: Anatomy, h: torch.Tensor,
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
        y = _frozen_norm(y + cross, as_layer_norm(_attr(block, anatomy.cross_norm)))
    return _frozen_norm(y + _linear_ffn(mods, y), mods["ln2"])


def _linear_layers(model: nn.Module, anatomy: Anatomy, blocks: list[nn.Module], hidden: list[torch.Tensor],
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
    final = _final_norm(model, anatomy)
    value0 = None
    for i, (block, attn) in enumerate(zip(blocks, attentions, strict=True)):
        mods = _parts(block, model, anatomy)
        v = _layer_values(mods, anatomy, h, attn.shape[1], spec)
        if value0 is None:
            value0 = v = v.detach().requires_grad_(True)
        mixed = None
        if cross is not None:  # the keys are the encoder's outputs (a pre-LN block normalises only its queries)
            memory, maps = cross
            parts = {"value": _attr(block, anatomy.cross_value), "output": _attr(block, anatomy.cross_output)}
            mixed = parts["output"](_mix(maps[i], _values(parts, memory, maps[i].shape[1], spec)))
        h = _layer_rest(block, mods, anatomy, h, _mix(attn, v), final if i == len(blocks) - 1 else None, mixed)
        _check_layer(model, i, h.detach(), hidden[i + 1], real)
    return h, value0


class _HeldAttention:
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


def _vjp(outputs: torch.Tensor, inputs: list[torch.Tensor], cotangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The vector-Jacobian products of ``outputs`` ``(B, ...)`` w.r.t. ``inputs`` for the ``R`` cotangents
    ``(R, B, ...)``: ``(R, *input.shape)`` each (batched where R > 1; 0 where an input is not used)."""
    if cotangents.shape[0] == 1:
        grads = torch.autograd.grad(outputs, inputs, cotangents[0], allow_unused=True)
        grads = tuple(None if g is None else g.unsqueeze(0) for g in grads)
    else:
        grads = torch.autograd.grad(outputs, inputs, cotangents, is_grads_batched=True, allow_unused=True)
    return tuple(torch.zeros(cotangents.shape[0], *x.shape, dtype=x.dtype, device=x.device) if g is None else g
                 for g, x in zip(grads, inputs, strict=True))


def _through_head(steps: list[tuple[nn.Module, Callable | None]], state: torch.Tensor) -> torch.Tensor:
    """``state`` through the head's ``(linear or norm, activation)`` steps (:func:`_head_steps`), linearised: each
    norm with its scale held, each activation as its ratio at the real pre-activation."""
    for linear, act in steps:
        state = _frozen_norm(state, linear) if _is_norm(linear) else linear(state)
        if act is not None:
            state = _linearised(act, state)
    return state


def _head_logit(ctx: BatchContext, h: torch.Tensor, anatomy: Anatomy, contrast: bool) -> torch.Tensor:
    """``(B,)``: the explained combination of logits, read where the head reads from the last hidden state ``h``
    (a generation's steps: the one sequence's, each row its own position), through the head's steps linearised."""
    cap, model = ctx.capture, ctx.model
    read = ctx.head.read_rows(ctx.targets)
    if read is not None:  # a head summing values read at several positions (an answer's tokens)
        example, position, label = read
        state = h[example, position]
    elif _pooled(model) == LAST:  # each row's last token (a generation's steps: each its own, in the sequence)
        last = last_positions(cap.key_mask.bool()).to(h.device)
        state = h[0, last] if ctx.sequence is not None else h[torch.arange(h.shape[0], device=h.device), last]
    else:
        state = h[:, 0]
    state = _through_head(_head_steps(ctx, anatomy), state)
    if read is not None and ctx.head.task in ("token", "qa"):  # the head found by name: its logits checked
        _check_head(state.detach(), cap.logits[example, position], type(model).__name__)
    if read is None:
        return (state * _output_weights(state.detach(), ctx.targets, contrast)).sum(-1)
    values = (state * _output_weights(state.detach(), label, contrast)).sum(-1)  # each at its own position
    rows = ctx.targets.shape[0] if ctx.sequence is not None else h.shape[0]
    return torch.zeros(rows, dtype=values.dtype, device=values.device).index_add(0, example, values)


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
    and the graph freed; the attention's product with the values is held at the real weights (:class:`_HeldAttention`:
    fused attention on the queries and keys the pass kept, or the maps a chunk of query rows at a time, as
    :meth:`~attnlens.core.batch_state.BatchContext.map_chunks` gives them), so no ``N × N`` map is kept under
    fused attention. A generation's steps (rows reading one sequence) carry one cotangent each.
    """
    cap, model = ctx.capture, ctx.model
    anatomy = _anatomy(model)
    blocks = _blocks(model)
    spec = architecture_for(model.config).layers
    final = _final_norm(model, anatomy)
    hidden, real = _states(ctx)
    chunks = cap.map_chunks()
    heads = model_dims(model).heads
    with torch.enable_grad():
        top = hidden[-1].detach().requires_grad_(True)
        logit = _head_logit(ctx, top, anatomy, contrast)
        if ctx.sequence is None:
            g = torch.autograd.grad(logit.sum(), top)[0].unsqueeze(0)  # (1, B, N, D)
        else:  # each step's row its own cotangent over the one sequence: (R, 1, N, D)
            g = row_gradients(logit, [top])[0].unsqueeze(1)
        for i in reversed(range(len(blocks))):
            mods = _parts(blocks[i], model, anatomy)
            h = hidden[i].detach().requires_grad_(True)
            v = _layer_values(mods, anatomy, h, heads, spec)
            held = _HeldAttention(chunks, i, g.shape[0])
            mixed = held.apply(v).requires_grad_(True)
            out = _layer_rest(blocks[i], mods, anatomy, h, mixed, final if i == len(blocks) - 1 else None)
            _check_layer(model, i, out.detach(), hidden[i + 1], real)
            g_h, g_mixed = _vjp(out, [h, mixed], g)
            g_v = held.transposed(g_mixed.view(*g_mixed.shape[:3], *v.shape[2:]))
            if i == 0:  # layer 1's value vectors are sources of their own (their tokens'), not paths to x0
                g, value0, g_value0 = g_h, v.detach(), g_v
            else:
                g = g_h + _vjp(v, [h], g_v)[0]
    x0 = hidden[0].detach()
    scores = ((g * x0).sum(-1) + (g_value0 * value0).flatten(3).sum(-1))  # (R, B, N)
    scores = scores[0] if ctx.sequence is None else scores[:, 0]
    return scores, logit.detach() - (scores * cap.key_mask.bool()).sum(-1)


# --- DecompX through an encoder-decoder ---------------------------------------------------------------------------
def seq2seq_decompx(ctx: BatchContext, contrast: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DecompX (``bias="token"``) on an encoder-decoder: ``(scores (B, S), bias (B,), decoder inputs (B,))``.

    The encoder is linearised as :func:`decompx_token_scores` does; each decoder layer too, its self-attention
    over the decoder's inputs and its cross-attention over the encoder's (linearised) outputs held at their real
    weights. The logit is read where the head reads: the decoder's state at the last EOS (classifiers), at each
    span position (extractive QA) or at the target's decoder position (language models). The scores are the
    encoder's input tokens' shares; the decoder's inputs (their states and layer-1 value vectors) take the share
    reported beside them, and the bias term is the rest, so the three sum to the explained logit. Runs one forward
    of its own (every stream's maps and states), in chunks of examples the memory budget holds; every recomputed
    layer and the head's logits are checked against the model's."""
    model = ctx.model
    step = _examples_per_pass(ctx, _seq2seq_decompx_row_bytes(model, ctx.inputs), "decompx")
    size = ctx.inputs["input_ids"].shape[0]
    parts = [_seq2seq_decompx_chunk(ctx, {k: v[b:b + step] for k, v in ctx.inputs.items()}, ctx.targets[b:b + step],
                                    contrast) for b in range(0, size, step)]
    return tuple(torch.cat([p[k] for p in parts]) for k in range(3))  # type: ignore[return-value]


def _seq2seq_decompx_row_bytes(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """What one example of :func:`seq2seq_decompx`'s pass holds: every stream's maps and states (as ALTI+'s
    pass), and the linearised layers' graph, about ten states and two FFN activations per position and layer."""
    dims, spec = model_dims(model), architecture_for(model.config).layers
    enc, dec = len(spec.modules(model, "encoder")), len(spec.modules(model, "decoder"))
    source = inputs["input_ids"].shape[1]
    target = inputs["decoder_input_ids"].shape[1] if "decoder_input_ids" in inputs else source
    width = int(getattr(model.config, "d_ff", 0) or getattr(model.config, "encoder_ffn_dim", 0) or 4 * dims.hidden)
    graph = (enc * source + dec * target) * (10 * dims.hidden + 2 * width)
    return _alti_plus_row_bytes(model, inputs) + graph * dims.itemsize


def _seq2seq_decompx_chunk(ctx: BatchContext, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                           contrast: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`seq2seq_decompx` of the examples ``inputs`` with their ``targets``."""
    model, head = ctx.model, ctx.head
    anatomy = _anatomy(model)
    decoder = anatomy.decoder or anatomy
    spec = architecture_for(model.config).layers
    ids = inputs["input_ids"]
    enc_real = inputs["attention_mask"].bool() if "attention_mask" in inputs else torch.ones_like(ids).bool()
    with torch.no_grad(), attention_switched(model, EAGER):  # every stream's maps
        out = model(**inputs, output_attentions=True, output_hidden_states=True, use_cache=False, return_dict=True)
    hidden = list(out.decoder_hidden_states)
    dec_real = torch.ones(hidden[0].shape[:2], dtype=torch.bool, device=hidden[0].device)  # every row computed
    with torch.enable_grad():
        x0 = out.encoder_hidden_states[0].detach().clone().requires_grad_(True)
        memory, value0 = _linear_layers(model, anatomy, spec.modules(model, "encoder"),
                                        list(out.encoder_hidden_states), list(out.encoder_attentions), enc_real, x0)
        d0 = hidden[0].detach().clone().requires_grad_(True)
        h, dvalue0 = _linear_layers(model, decoder, spec.modules(model, "decoder"), hidden,
                                    list(out.decoder_attentions), dec_real, d0,
                                    cross=(memory, list(out.cross_attentions)))
        logits = head.logits(out)
        rows = torch.arange(h.shape[0], device=h.device)
        if head.task == "qa":
            example, position, label = head.read_rows(targets)
            want = logits[example, position]
        elif head.task == "seq2seq-lm":
            example, position, label = rows, targets[:, 1], targets
            want = logits[example, position]
        else:  # a classifier reads the decoder's state at each row's last EOS (its decoder input is the shifted input)
            position = ctx.adapter.classification_index(ids, enc_real, model.config)
            example, label, want = rows, targets, logits
        state = h[example, position]
        if head.task == "seq2seq-lm":
            state = model.get_output_embeddings()(state * (anatomy.lm_scale(model.config) if anatomy.lm_scale else 1.0))
            offset = getattr(model, "final_logits_bias", None)  # BART's: a bias, which goes to the bias term
            check = state.detach() + (0 if offset is None else offset.to(state.dtype))
        else:
            state = _through_head(_head_steps(ctx, anatomy), state)
            check = state.detach()
        _check_head(check, want, type(model).__name__)
        values = (state * _seq2seq_weights(check, label, head.task, contrast)).sum(-1)
        logit = torch.zeros(h.shape[0], dtype=values.dtype, device=values.device).index_add(0, example, values)
        g0, gv, gd, gdv = torch.autograd.grad(logit.sum(), [x0, value0, d0, dvalue0])
    scores = ((g0 * x0).sum(-1) + (gv * value0).flatten(2).sum(-1)).detach() * enc_real
    decoder_inputs = ((gd * d0).sum(-1) + (gdv * dvalue0).flatten(2).sum(-1)).detach().sum(-1)
    return scores, logit.detach() - scores.sum(-1) - decoder_inputs, decoder_inputs


def _seq2seq_weights(logits: torch.Tensor, label: torch.Tensor, task: str, contrast: bool) -> torch.Tensor:
    """The explained combination of an encoder-decoder's logits ``(R, C)`` read at their rows: a language model's
    ``(token, position, contrast token or -1)`` targets as the token's one-hot minus the contrast token's (or,
    with ``contrast``, the softmax); a classifier's or QA head's as :func:`_output_weights`."""
    if task != "seq2seq-lm":
        return _output_weights(logits, label, contrast)
    n = logits.shape[-1]
    w = torch.nn.functional.one_hot(label[:, 0], n).to(logits.dtype)
    other = label[:, 2]
    versus = torch.nn.functional.one_hot(other.clamp_min(0), n).to(logits.dtype) * (other >= 0)[:, None]
    if contrast:
        versus = torch.where((other >= 0)[:, None], versus, logits.softmax(-1))
    return w - versus


@register(
    "decompx",
    needs={ATTENTION_CHUNKS, HIDDEN, LAYER_GRAPH},
    logits_only=True,
    applies=_applies("decompx", head=True),
    summary="DecompX: each token's share of the target logit, its vector propagated through attention, residuals, "
    "norms, the FFN (activation linearised through the origin; a gated FFN's product split half and half), "
    "pooler and classifier (or a language model's output embeddings, a token or QA head at the explained "
    "positions); signed.",
    citation="Modarressi et al. 2023 (ACL); bias='absdot' as in the authors' code",
    check=_check_decompx,
    fits=_decompx_fits,
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
        return _seq2seq_output(ctx, contrast)
    if (ctx.target_kind == "loss" and ctx.head.task not in ("token", "qa")
            and ctx.head.read_rows(ctx.targets) is not None):
        contrast = True  # an answer's log-probabilities: each token's z_t − Σ_c p_c z_c, their first-order change
    elif ctx.target_kind != "logit":
        raise InputError(f"decompx decomposes the logits; target_kind={ctx.target_kind!r} is not supported")
    if bias == "token":
        scores, term = decompx_token_scores(ctx, contrast)
        return MethodOutput(scores, meta={"bias": term})
    contributions = decompx_logits(ctx, bias)  # (B, N + 1, C): the last row, the bias term, all zero here
    weights = _output_weights(ctx.capture.logits, ctx.targets, contrast)
    shares = torch.einsum("bnc,bc->bn", contributions, weights)
    return MethodOutput(shares[:, :-1], meta={"bias": shares[:, -1]})


def _seq2seq_output(ctx: BatchContext, contrast: bool) -> MethodOutput:
    """:func:`decompx` on an encoder-decoder (:func:`seq2seq_decompx`): the encoder's input tokens' shares, the
    decoder inputs' and the bias term's in ``meta``."""
    if ctx.target_kind == "loss" and ctx.head.task == "seq2seq-lm":
        contrast = True  # log p of a token: z_t − Σ_c p_c z_c, its first-order change (z_t − z_c against a contrast)
    elif ctx.target_kind != "logit":
        raise InputError(f"decompx decomposes the logits; target_kind={ctx.target_kind!r} is not supported")
    scores, term, decoder_inputs = seq2seq_decompx(ctx, contrast)
    return MethodOutput(scores, meta={"bias": term, "decoder_inputs": decoder_inputs})
