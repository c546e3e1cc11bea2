"""Each layer of a model recomputed from its own modules, the pieces the norm-based and decomposition
methods read (value vectors, norms, feed-forward terms), and the checks that the recomputation is the model's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...core.attention_chunks import WholeMaps
from ...core.batch_state import BatchContext
from ...core.memory import model_dims, readable_size, rows_that_fit
from ...errors import InputError, ModelError
from ...models.adapters import FIRST, LAST
from ...models.architectures import Anatomy, Layers, architecture_for
from ...models.layer_modules import feed_forward_modules, linear_rows, linear_weight, module_at, run_feed_forward
from ...models.norms import as_layer_norm, rms_eps, rms_gain


def anatomy_of(model: nn.Module) -> Anatomy | None:
    return architecture_for(model.config).anatomy_for(model.config)


def layer_blocks(model: nn.Module) -> list[nn.Module]:
    """The layers the anatomy describes, one per depth (its architecture entry's :class:`Layers`): an
    encoder-decoder's encoder layers, the only layers of the others."""
    layers = architecture_for(model.config).layers
    return layers.modules(model, "encoder" if layers.path("encoder") else "self")


def applicability(name: str, *, head: bool = False, streams: tuple[str, ...] = ("encoder",)
             ) -> Callable[[Any, str, str], str | None]:
    """Why ``name`` cannot explain a model: it needs a layer anatomy attnlens knows (and, for ``head``, a
    sequence classifier whose head reads the first token of an encoder or the last of a decoder, a token
    classifier, an extractive QA model or a causal language model); of an encoder-decoder it reads the attention
    ``streams``."""

    def why(model: Any, stream: str, task: str) -> str | None:
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", "?")
        anatomy = None if config is None else anatomy_of(model)
        if anatomy is None:
            # one wording for the whole family, so a skip notice names the reason once
            return ("the norm-based and decomposition methods need a layer anatomy attnlens knows (encoders: "
                    "BERT, RoBERTa, DeBERTa-v2, MPNet, ModernBERT, ...; pre-LN decoders: GPT-2, GPT-NeoX, Llama, "
                    f"Qwen, Gemma, Phi, OPT, ...; the encoders of BART, mBART, T5); this {model_type!r} model has "
                    f"none{' in this configuration' if callable(architecture_for(config).anatomy) else ''} "
                    "(docs/decomposition.md, 'Which models')")
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
        pooled = pooled_position(model)
        if head and task == "classification" and architecture_for(config).pooling_for(config) != pooled:
            return f"{name} needs a head that reads the {pooled} token; {model_type!r} pools differently"
        return None

    return why


def pooled_position(model: nn.Module) -> str:
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
        return v if self.pre_ln else ln_part(v, self.modules["ln1"])


def layer_norm_std(ln: nn.LayerNorm, v: torch.Tensor) -> torch.Tensor:
    return (v.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()


def activation_ratio(out: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """act(u)/u elementwise, 0 where u = 0 (there act(u) = 0 for GELU, ReLU and tanh)."""
    return torch.where(pre != 0, out / torch.where(pre != 0, pre, torch.ones_like(pre)), torch.zeros_like(pre))


_PARTS = ("value", "output", "ln1", "ln2", "post_attn_norm", "post_ffn_norm")  # beside the feed-forward's


def layer_parts(block: nn.Module, model: nn.Module, anatomy: Anatomy) -> dict[str, nn.Module]:
    """One layer's pieces by their :class:`Anatomy` names (the value projection: the entry's :class:`Layers`; a
    fused gate/up projection as its two halves, ``gate`` and ``ffn_in``)."""
    spec = architecture_for(model.config).layers
    paths = {k: spec.value if k == "value" else getattr(anatomy, k) for k in _PARTS}
    mods = {k: module_at(block, path) for k, path in paths.items() if path is not None}
    for k in ("ln1", "ln2", "post_attn_norm", "post_ffn_norm"):
        if k in mods:
            mods[k] = as_layer_norm(mods[k])
    mods.update(feed_forward_modules(block, anatomy))
    if spec.value_bias is not None:  # the value rows of the fused projection, the bias added after it included
        fused = mods["value"]
        bias = module_at(block, spec.value_bias).detach()
        weight = linear_weight(fused).detach()
        rows = spec.value_features(weight.shape[0], model.config.num_attention_heads,
                                   bias.shape[0] // model.config.num_attention_heads).to(weight.device)
        own = getattr(fused, "bias", None)
        mods["value"] = linear_rows(weight, rows, bias + (0 if own is None else own.detach()[rows]))
    return mods


def final_norm(model: nn.Module, anatomy: Anatomy) -> nn.Module | None:
    return None if anatomy.final_norm is None else as_layer_norm(module_at(model.base_model, anatomy.final_norm))


def value_vectors(mods: dict[str, nn.Module], a: torch.Tensor, heads: int, spec: Layers) -> torch.Tensor:
    """``(B, N, H, d_h)``: each head's value vectors of the value projection's input ``a`` (where ``spec`` says
    they are in its output; grouped-query attention's key/value heads repeated for their queries)."""
    out = mods["value"](a)
    b, n, _ = a.shape
    dh = linear_weight(mods["output"]).shape[1] // heads
    if spec.fused > 1 and spec.value_bias is None:  # with a value bias, layer_parts gives the value rows alone
        out = out[..., spec.value_features(out.shape[-1], heads, dh).to(out.device)]
    v = out.reshape(b, n, out.shape[-1] // dh, dh)
    return v if v.shape[2] == heads else v.repeat_interleave(heads // v.shape[2], dim=2)


def head_outputs(mods: dict[str, nn.Module], v: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D)``: f^h = v^h W_O^h, each head's value vectors ``v`` ``(B, N, H, d_h)`` through its slice of
    the output projection (no output bias)."""
    w = linear_weight(mods["output"])
    return torch.einsum("bjhv,dhv->bhjd", v, w.view(w.shape[0], v.shape[2], v.shape[3]))


def head_maps(mods: dict[str, nn.Module], heads: int, like: torch.Tensor) -> torch.Tensor:
    """``(H, d_h, D)``: each head's map W^h with f^h = v^h W^h as :func:`attention_sum`'s summands take them (its
    slice of the output projection, times the gain of a norm after the attention branch), in ``like``'s dtype."""
    w = linear_weight(mods["output"])  # (D, H·d_h)
    maps = w.T.reshape(heads, w.shape[1] // heads, w.shape[0]).to(like.dtype)
    return maps * rms_gain(mods["post_attn_norm"], like) if "post_attn_norm" in mods else maps


def value_terms(mods: dict[str, nn.Module], a: torch.Tensor, heads: int, spec: Layers
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f, v)`` of the value projection's input ``a``: each head's outputs f^h = v^h W_O^h ``(B, H, N, D)``
    (:func:`head_outputs`) and its value vectors ``(B, H, N, d_h)``, contiguous (for :func:`attention_sum`)."""
    v = value_vectors(mods, a, heads, spec)
    return head_outputs(mods, v), v.transpose(1, 2).contiguous()


def _output_bias(mods: dict[str, nn.Module]) -> torch.Tensor | float:
    bias = mods["output"].bias
    return 0.0 if bias is None else bias


def ffn_terms(mods: dict[str, nn.Module], y: torch.Tensor, ratio: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The FFN's output on ``y`` and act(u)/u of its activation's pre-activation u (a gated FFN's gate; none,
    width 0, for an FFN read as one module, or without ``ratio``)."""
    ff = run_feed_forward(mods, y)
    if not ratio or ff.pre is None or ff.act is None:
        return ff.output, y.new_zeros(*y.shape[:-1], 0)
    return ff.output, activation_ratio(ff.act, ff.pre)


def attention_sum(mods: dict[str, nn.Module], x: torch.Tensor, attn: torch.Tensor, f: torch.Tensor,
                   v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention block's residual sum at the query rows ``attn`` ``(B, H, R, N)`` holds (``x``: the residual
    there, ``(B, R, D)``), with the weights and values as its summands take them: under a norm after the
    attention branch (Gemma 2's) z_ij = Σ_h A^h_ij f^h_j ⊙ g / s_i (+ x_i), so A's rows are divided by that
    norm's scale s_i and f multiplied by its gain g.

    ``v``: the value vectors ``f`` came from, ``(B, H, N, d_h)`` (:func:`value_terms`): the branch is summed as
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
class LayerOutput:
    """A layer's output recomputed at some rows from its attention block's residual sum: ``got`` (what the pass's
    hidden state there must be), LN1's output ``y1`` (pre-LN: the residual stream after attention), the FFN's
    act(u)/u ``theta`` and, post-LN, the scales ``std1``, ``std2`` of LN1's and LN2's inputs ``(B, R, 1)``."""

    got: torch.Tensor
    y1: torch.Tensor
    theta: torch.Tensor
    std1: torch.Tensor | None = None
    std2: torch.Tensor | None = None


def layer_output(mods: dict[str, nn.Module], anatomy: Anatomy, x: torch.Tensor, pre1: torch.Tensor,
                  final: nn.Module | None = None, ratio: bool = True) -> LayerOutput:
    """The layer's output at the rows of ``x`` (its input there) and ``pre1`` (:func:`attention_sum`);
    ``final``: the model's final norm, for a pre-LN model's last layer (its hidden state is that norm's output);
    ``ratio``: with the FFN's act(u)/u (``theta``)."""
    if anatomy.pre_ln:
        ffn, theta = ffn_terms(mods, mods["ln2"](x if anatomy.parallel else pre1), ratio)
        got = pre1 + (mods["post_ffn_norm"](ffn) if "post_ffn_norm" in mods else ffn)
        return LayerOutput(final(got) if final is not None else got, pre1, theta)
    y1 = mods["ln1"](pre1)
    ffn, theta = ffn_terms(mods, y1, ratio)
    pre2 = y1 + ffn
    return LayerOutput(mods["ln2"](pre2), y1, theta, layer_norm_std(mods["ln1"], pre1),
                       layer_norm_std(mods["ln2"], pre2))


def output_error(got: torch.Tensor, want: torch.Tensor, real: torch.Tensor) -> tuple[float, float]:
    """``(error, tolerance)`` of a recomputed layer output ``got`` against the model's ``want`` at the ``real``
    rows: the largest difference, and the most rounding explains."""
    err = (got - want)[real].abs().max().item() if real.any() else 0.0
    # rounding grows with the precision the model runs in (bfloat16: eps 2^-7); a wrong anatomy is off by O(1)
    tol = max(1e-3, 4 * torch.finfo(want.dtype).eps)
    return err, tol * (1.0 + want[real].abs().max().item())


def check_layer(model: nn.Module, index: int, got: torch.Tensor, want: torch.Tensor, real: torch.Tensor) -> None:
    """Refuse a recomputed layer output that is not the model's (a wrong anatomy would give wrong scores)."""
    err, tol = output_error(got, want, real)
    if not err <= tol:
        raise ModelError(
            f"recomputing layer {index + 1} of this {model.config.model_type!r} model from its modules does not "
            f"reproduce its hidden states (max difference {err:.3g}): its architecture entry's anatomy does not "
            "describe it"
        )


def check_head(got: torch.Tensor, want: torch.Tensor, model_name: str) -> None:
    """Refuse a head recomputed from its modules whose logits ``(R, C)`` are not the model's ``want``."""
    err, tol = output_error(got, want.to(got.dtype), torch.ones(got.shape[:-1], dtype=torch.bool,
                                                                  device=got.device))
    if not err <= tol:
        raise ModelError(f"decompx: recomputing the head of {model_name} from its modules does not reproduce its "
                         f"logits (max difference {err:.3g})")


def pass_states(ctx: BatchContext) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Hidden states and real positions to recompute the layers from: the batch's, or, when its rows are prefixes
    of one sequence (a generation's steps), that sequence's alone (a batch of one), since a prefix's matrices are
    the top-left block of the sequence's (causal masking)."""
    cap = ctx.capture
    if ctx.sequence is None:
        return list(cap.hidden), cap.key_mask.bool()
    return [h[:1] for h in cap.hidden], ctx.sequence["attention_mask"].bool().to(cap.key_mask.device)


def pass_maps(ctx: BatchContext) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """:func:`pass_states` and every layer's whole attention maps: as the pass kept them, or assembled from its chunks
    (fused attention) where they fit what the budget leaves."""
    hidden, real = pass_states(ctx)
    cap = ctx.capture
    chunks = cap.map_chunks()
    if isinstance(chunks, WholeMaps):
        maps = list(chunks.maps)
    else:
        rows, n = cap.key_mask.shape
        need = chunks.n_layers * rows * model_dims(ctx.model).heads * n * n * hidden[0].element_size()
        if need > ctx.budget_left():
            raise InputError(f"decompx bias='absdot' propagates every token's vectors through every layer's whole "
                             f"attention maps, about {readable_size(need)} here, more than the "
                             f"{readable_size(ctx.budget_left())} the memory budget leaves; use bias='token' (the "
                             "default) or a larger budget")
        maps = [torch.cat([a for _, a, _ in chunks.chunks(i)], 2) for i in range(chunks.n_layers)]
    return hidden, maps if ctx.sequence is None else [a[:1] for a in maps], real


def model_layers(ctx: BatchContext) -> list[Layer]:
    """Every layer of the batch (or of the sequence its rows are prefixes of) recomputed from the shared pass
    (cached in ``ctx.cache`` for the other methods)."""
    if "decomposition.layers" in ctx.cache:
        return ctx.cache["decomposition.layers"]
    model = ctx.model
    anatomy = anatomy_of(model)
    blocks = layer_blocks(model)
    spec = architecture_for(model.config).layers
    final = final_norm(model, anatomy)
    hidden, attentions, real = pass_maps(ctx)
    out: list[Layer] = []
    with torch.no_grad():
        for i, (block, attn) in enumerate(zip(blocks, attentions, strict=True)):
            mods = layer_parts(block, model, anatomy)
            x = hidden[i]
            h = attn.shape[1]
            a = mods["ln1"](x) if anatomy.pre_ln else x
            f, v = value_terms(mods, a, h, spec)
            pre1, attn, f = attention_sum(mods, x, attn, f, v)
            o = layer_output(mods, anatomy, x, pre1, final if i == len(blocks) - 1 else None)
            check_layer(model, i, o.got, hidden[i + 1], real)
            if anatomy.pre_ln:
                ones = x.new_ones(*x.shape[:2], 1)
                out.append(Layer(x, attn, f, ones, pre1, o.theta, ones, mods, pre_ln=True))
            else:
                out.append(Layer(x, attn, f, o.std1, o.y1, o.theta, o.std2, mods))
    ctx.cache["decomposition.layers"] = out
    return out


def ln_part(v: torch.Tensor, ln: nn.LayerNorm, std: torch.Tensor | None = None) -> torch.Tensor:
    """LN applied to summands ``v`` ``(..., D)`` without β: (v − mean_d v) ⊙ γ, divided by ``std`` (broadcast to
    ``v[..., :1]``) when given."""
    out = (v - v.mean(-1, keepdim=True)) * ln.weight
    return out if std is None else out / std


def examples_per_pass(ctx: BatchContext, row_bytes: int, name: str) -> int:
    """How many examples a method's own pass over every stream of an encoder-decoder takes at once within what the
    budget leaves (:meth:`BatchContext.budget_left`); where one does not fit, an :class:`InputError` (one line)
    before the pass runs."""
    left = ctx.budget_left()
    if row_bytes > left:
        n = ctx.inputs["input_ids"].shape[1]
        raise InputError(f"{name} keeps every stream's attention maps of this encoder-decoder: an input of {n:,} "
                         f"tokens needs about {readable_size(row_bytes)}, more than the {readable_size(left)} the "
                         "memory budget leaves; shorten the input or raise the budget")
    return rows_that_fit(left, row_bytes)


def stream_pass_row_bytes(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """What one example of an own eager pass over an encoder-decoder (ALTI+'s, DecompX's) holds on ``inputs``
    (:func:`stream_pass_bytes`)."""
    source = inputs["input_ids"].shape[1]
    return stream_pass_bytes(model, source, decoder_length(inputs))


def decoder_length(inputs: dict[str, torch.Tensor]) -> int:
    """The decoder's positions in an encoder-decoder's ``inputs`` (its inputs are the encoder's where not given)."""
    return (inputs["decoder_input_ids"] if "decoder_input_ids" in inputs else inputs["input_ids"]).shape[1]


def stream_pass_bytes(model: nn.Module, source: int, target: int) -> int:
    """What one example of an own eager pass over an encoder-decoder (ALTI+'s, DecompX's) holds with ``source``
    encoder and ``target`` decoder positions: every stream's attention maps and every layer's states (encoder,
    decoder), about twice over while the layers are recomputed."""
    dims, spec = model_dims(model), architecture_for(model.config).layers
    enc, dec = len(spec.modules(model, "encoder")), len(spec.modules(model, "decoder"))
    maps = dims.heads * (enc * source * source + dec * target * (target + source))
    states = dims.hidden * ((enc + 1) * source + (dec + 1) * target)
    return 2 * (maps + states) * dims.itemsize
