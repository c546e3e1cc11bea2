"""DecompX on encoder-decoders: both stacks linearised, the decoder's self- and cross-attention held at their
real weights."""

from __future__ import annotations

import torch
from torch import nn

from ...core.batch_state import BatchContext
from ...core.memory import model_dims
from ...core.modelstate import EAGER, attention_switched
from ...errors import InputError
from ...models.architectures import architecture_for
from ..registry import (
    MethodOutput,
)
from .layers import anatomy_of, check_head, decoder_length, examples_per_pass, stream_pass_bytes
from .linearised import head_steps, linear_layers, output_weights, through_head


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
    step = examples_per_pass(ctx, _seq2seq_decompx_row_bytes(model, ctx.inputs), "decompx")
    size = ctx.inputs["input_ids"].shape[0]
    parts = [_seq2seq_decompx_chunk(ctx, {k: v[b:b + step] for k, v in ctx.inputs.items()}, ctx.targets[b:b + step],
                                    contrast) for b in range(0, size, step)]
    return tuple(torch.cat([p[k] for p in parts]) for k in range(3))  # type: ignore[return-value]


def _seq2seq_decompx_row_bytes(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """What one example of :func:`seq2seq_decompx`'s pass holds on ``inputs`` (:func:`seq2seq_decompx_bytes`)."""
    return seq2seq_decompx_bytes(model, inputs["input_ids"].shape[1], decoder_length(inputs))


def seq2seq_decompx_bytes(model: nn.Module, source: int, target: int) -> int:
    """What one example of :func:`seq2seq_decompx`'s pass holds with ``source`` encoder and ``target`` decoder
    positions: every stream's maps and states (as ALTI+'s pass), and the linearised layers' graph, about ten
    states and two FFN activations per position and layer."""
    dims, spec = model_dims(model), architecture_for(model.config).layers
    enc, dec = len(spec.modules(model, "encoder")), len(spec.modules(model, "decoder"))
    width = int(getattr(model.config, "d_ff", 0) or getattr(model.config, "encoder_ffn_dim", 0) or 4 * dims.hidden)
    graph = (enc * source + dec * target) * (10 * dims.hidden + 2 * width)
    return stream_pass_bytes(model, source, target) + graph * dims.itemsize


def _seq2seq_decompx_chunk(ctx: BatchContext, inputs: dict[str, torch.Tensor], targets: torch.Tensor,
                           contrast: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`seq2seq_decompx` of the examples ``inputs`` with their ``targets``."""
    model, head = ctx.model, ctx.head
    anatomy = anatomy_of(model)
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
        memory, value0 = linear_layers(model, anatomy, spec.modules(model, "encoder"),
                                        list(out.encoder_hidden_states), list(out.encoder_attentions), enc_real, x0)
        d0 = hidden[0].detach().clone().requires_grad_(True)
        h, dvalue0 = linear_layers(model, decoder, spec.modules(model, "decoder"), hidden,
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
            state = through_head(head_steps(ctx, anatomy), state)
            check = state.detach()
        check_head(check, want, type(model).__name__)
        values = (state * _seq2seq_weights(check, label, head.task, contrast)).sum(-1)
        logit = torch.zeros(h.shape[0], dtype=values.dtype, device=values.device).index_add(0, example, values)
        g0, gv, gd, gdv = torch.autograd.grad(logit.sum(), [x0, value0, d0, dvalue0])
    scores = ((g0 * x0).sum(-1) + (gv * value0).flatten(2).sum(-1)).detach() * enc_real
    decoder_inputs = ((gd * d0).sum(-1) + (gdv * dvalue0).flatten(2).sum(-1)).detach().sum(-1)
    return scores, logit.detach() - scores.sum(-1) - decoder_inputs, decoder_inputs


def _seq2seq_weights(logits: torch.Tensor, label: torch.Tensor, task: str, contrast: bool) -> torch.Tensor:
    """The explained combination of an encoder-decoder's logits ``(R, C)`` read at their rows: a language model's
    ``(token, position, contrast token or -1)`` targets as the token's one-hot minus the contrast token's (or,
    with ``contrast``, the softmax); a classifier's or QA head's as :func:`output_weights`."""
    if task != "seq2seq-lm":
        return output_weights(logits, label, contrast)
    n = logits.shape[-1]
    w = torch.nn.functional.one_hot(label[:, 0], n).to(logits.dtype)
    other = label[:, 2]
    versus = torch.nn.functional.one_hot(other.clamp_min(0), n).to(logits.dtype) * (other >= 0)[:, None]
    if contrast:
        versus = torch.where((other >= 0)[:, None], versus, logits.softmax(-1))
    return w - versus


def seq2seq_output(ctx: BatchContext, contrast: bool) -> MethodOutput:
    """:func:`decompx` on an encoder-decoder (:func:`seq2seq_decompx`): the encoder's input tokens' shares, the
    decoder inputs' and the bias term's in ``meta``."""
    if ctx.target_kind == "loss" and ctx.head.task == "seq2seq-lm":
        contrast = True  # log p of a token: z_t − Σ_c p_c z_c, its first-order change (z_t − z_c against a contrast)
    elif ctx.target_kind != "logit":
        raise InputError(f"decompx decomposes the logits; target_kind={ctx.target_kind!r} is not supported")
    scores, term, decoder_inputs = seq2seq_decompx(ctx, contrast)
    return MethodOutput(scores, meta={"bias": term, "decoder_inputs": decoder_inputs})
