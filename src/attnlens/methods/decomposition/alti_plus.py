"""ALTI+ on encoder-decoders: every stream's contributions, the encoder's rolled out through the cross-attention."""

from __future__ import annotations

import torch
from torch import nn

from ...core.batch_state import BatchContext
from ...core.modelstate import EAGER, attention_switched
from ...errors import InputError
from ...models.architectures import Anatomy, Layers, architecture_for
from ...models.layer_modules import module_at
from .layers import (
    anatomy_of,
    attention_sum,
    check_layer,
    examples_per_pass,
    ffn_terms,
    final_norm,
    layer_norm_std,
    layer_output,
    layer_parts,
    ln_part,
    stream_pass_row_bytes,
    value_terms,
)
from .pair_norms import alti_rows, row_normalised


# --- ALTI+ (encoder-decoders) -----------------------------------------------------------------------------------
def _key_major(f: torch.Tensor) -> torch.Tensor:
    """``(B, N, H, D)`` of per-head vectors ``(B, H, N, D)``, as :func:`alti_rows` reads them."""
    return f.transpose(1, 2).contiguous()


def _alti_of_sum(attn: torch.Tensor, f: torch.Tensor, residual: torch.Tensor, pre: torch.Tensor, at: torch.Tensor,
                 norm: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ALTI of one residual sum ``pre`` = ``residual`` + Σ_h A^h f^h (+ bias): ``(c (B, R, N), the block's
    output)``; ``at``: the key each row's residual sits on. Post-LN (``norm`` given): each summand through the
    norm's linear part at pre's scale, the output norm(pre); pre-LN (``None``): the sum itself."""
    if norm is None:
        return alti_rows(attn, _key_major(f), residual, pre, at), pre
    std, out = layer_norm_std(norm, pre), norm(pre)
    return alti_rows(attn / std[:, None], _key_major(ln_part(f, norm)), ln_part(residual, norm) / std, out, at), out


def _self_block(mods: dict[str, nn.Module], anatomy: Anatomy, spec: Layers, x: torch.Tensor, attn: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's self-attention block on its input ``x`` ``(B, N, D)``: ``(ALTI's c (B, N, N), the residual sum
    pre1, the block's output)`` — post-LN: LN1(pre1), each summand through LN1's linear part at pre1's scale;
    pre-LN: pre1 itself."""
    f, v = value_terms(mods, mods["ln1"](x) if anatomy.pre_ln else x, attn.shape[1], spec)
    pre1, attn, f = attention_sum(mods, x, attn, f, v)
    at = torch.arange(x.shape[1], device=x.device)
    c, out = _alti_of_sum(attn, f, x, pre1, at, None if anatomy.pre_ln else mods["ln1"])
    return c, pre1, out


def _cross_block(cross: dict[str, nn.Module], anatomy: Anatomy, spec: Layers, h: torch.Tensor, attn: torch.Tensor,
                 memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's cross-attention block on the decoder state ``h`` ``(B, T, D)`` (its residual) over the
    encoder's output ``memory`` ``(B, S, D)``: ``(ALTI's c (B, T, S + 1), the block's output)``, column S the
    residual's contribution (a key of its own that only the residual sits on)."""
    f, v = value_terms(cross, memory, attn.shape[1], spec)
    pre, attn, f = attention_sum(cross, h, attn, f, v)
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
    final = final_norm(model, anatomy)
    keys = real[:, None, :].to(hidden[0].dtype)
    joint = None
    for i, (block, attn) in enumerate(zip(blocks, attentions, strict=True)):
        mods = layer_parts(block, model, anatomy)
        c, pre1, y1 = _self_block(mods, anatomy, spec, hidden[i], attn)
        got = layer_output(mods, anatomy, hidden[i], pre1, final if i == len(blocks) - 1 else None).got
        check_layer(model, i, got, hidden[i + 1], real)
        c = row_normalised(c * keys)
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
    anatomy = anatomy_of(model)
    if anatomy.cross_norm is None or anatomy.cross_value is None:
        raise InputError(f"ALTI+ needs the cross-attention's projections and norm, which model type "
                         f"{model.config.model_type!r}'s entry omits")
    weights = ctx.capture.query_weights
    step = examples_per_pass(ctx, stream_pass_row_bytes(model, ctx.inputs), "alti (ALTI+)")
    parts = [_alti_plus_pass(model, anatomy, {k: v[b:b + step] for k, v in ctx.inputs.items()}, weights[b:b + step])
             for b in range(0, weights.shape[0], step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


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
        final = final_norm(model, decoder)
        rows_source, rows_target = [], []
        for i, block in enumerate(blocks):
            mods = layer_parts(block, model, decoder)
            cross = {"value": module_at(block, anatomy.cross_value), "output": module_at(block, anatomy.cross_output),
                     "norm": module_at(block, anatomy.cross_norm)}
            c_self, _, h = _self_block(mods, decoder, spec, hidden[i], out.decoder_attentions[i])
            c_cross, h2 = _cross_block(cross, decoder, spec, h, out.cross_attentions[i], memory)
            ffn, _ = ffn_terms(mods, mods["ln2"](h2) if decoder.pre_ln else h2, ratio=False)
            got = h2 + ffn if decoder.pre_ln else mods["ln2"](h2 + ffn)
            if decoder.pre_ln and i == len(blocks) - 1 and final is not None:
                got = final(got)
            check_layer(model, i, got, hidden[i + 1], dec_real)
            c_self, c_cross = row_normalised(c_self), row_normalised(c_cross * keys)
            residual = c_cross[..., -1:]
            source = c_cross[..., :-1] @ joint_enc + residual * (c_self @ source)
            target = residual * (c_self @ target)
            rows_source.append((weights @ source)[:, 0])
            rows_target.append((weights @ target)[:, 0])
    return torch.stack(rows_source, 1), torch.stack(rows_target, 1)
