"""Explaining what a language model generates: every registered method, for every generated token.

A generation step is one example of the classifier engine (:func:`attnlens.core.engine.compute_batch`): its input is
the prompt plus the tokens generated before it, and its head (:class:`attnlens.models.heads.LMHead`) reads the logit of
the step's token at the input's last position, which is the position that predicts it. The steps of one
generation go through the engine as the rows of padded batches: row ``t`` is the teacher-forced sequence
prompt + continuation with the tokens after step ``t`` masked as padding, so each method works unchanged.
Causal masking makes each row's forward and backward exactly those of the prefix alone; for decoder-only models
the batch therefore also carries the sequence itself (:attr:`attnlens.core.batch_state.BatchContext.sequence`) and the
model runs once over it: the shared pass, integrated gradients' path points and the LRP pass each take one
forward for all steps and each step's gradients by batched vector-Jacobian products (docs/generation.md).

Flow: :func:`explain_generation` encodes the prompt (optionally through the chat template), generates the
continuation greedily (or takes the forced ``target``), explains all steps in batches, and returns a
:class:`Generation`: step × token score matrices, the tokens, and each generated token's probability.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import InputError, ModelError
from ..methods.lrp_methods import ATTENTION_READERS
from ..methods.registry import GRADIENTS, LAYER_GRAPH, OWN_PASS
from ..models.adapters import EncoderDecoderAdapter, StreamTensors
from ..models.heads import ContrastHead, LMHead, Seq2SeqLMHead, decode_token
from ..results.generation import Generation
from ..results.tokentext import BYTE_LEVEL, SENTENCEPIECE, encoding_meta, token_texts
from ..version import __version__
from . import engine
from .allocator import release_free_memory
from .attention_view import Beside, whole_attention_maps
from .batch_state import BatchContext
from .batching import keeps_logits
from .encoding import Encoded, completing_spans, continuation_encoding, encode, spans_in, special_ids
from .fused_attention import FUSED
from .memory import (
    held_step_bytes,
    layer_graph_step_bytes,
    lrp_step_bytes,
    model_dims,
    parse_budget,
    rows_that_fit,
    step_gradient_bytes,
)
from .model_runner import ModelRunner
from .modelstate import explaining
from .progress import ExplainProgress, ProgressCallback, method_passes

__all__ = ["explain_generation", "greedy", "attention_maps", "encode_prompt", "token_ids_of"]

# Decoder-only steps share one forward over the sequence (BatchContext.sequence). False: each step's row runs
# its own forward over its prefix (the same numbers, up to rounding; the tests compare the two).
ONE_PASS = True


def explain_generation(
    runner: ModelRunner,
    prompt: str,
    methods: str | Sequence[str] | None = "all",
    *,
    max_new_tokens: int = 8,
    target: str | Sequence[int] | None = None,
    contrast: str | Sequence[int] | None = None,
    chat: bool = False,
    target_kind: str = "logit",
    batch_size: int = 16,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    memory_budget: str | int | None = None,
    progress: bool | ProgressCallback = False,
) -> Generation:
    """See :meth:`attnlens.Explainer.explain_generation`."""
    head = runner.head
    if not isinstance(head, LMHead):
        raise ModelError(f"explain_generation needs a language model (…ForCausalLM, …ForConditionalGeneration); "
                         f"{runner.name} is {head.kind}: use explain() for it")
    seq2seq = isinstance(head, Seq2SeqLMHead)
    decoder_stream = seq2seq and runner.stream == "decoder"  # scores over the continuation instead of the prompt
    if not isinstance(prompt, str):
        raise InputError(f"the prompt must be one string, got {type(prompt).__name__} (explain one prompt per call)")
    if not prompt.strip():
        raise InputError("the prompt is empty: give the text the model should continue")
    _check_count("max_new_tokens", max_new_tokens)
    size = runner.effective_batch_size(batch_size)
    budget = parse_budget(memory_budget)
    specs, method_options = engine.select_methods(runner, methods, target or "generated", target_kind, options,
                                                  contrast is not None)

    prompt_ids, template = encode_prompt(runner, prompt, chat)
    forced = target is not None
    one_pass = ONE_PASS and not seq2seq
    if not forced:
        max_new_tokens = capped_new_tokens(runner, len(prompt_ids), max_new_tokens)
        # refused before generating when even a one-token continuation would not fit the budget
        _refuse_long(runner, specs, len(prompt_ids) + 1 + (1 if seq2seq else 0), size, budget, one_pass)
    generated = (token_ids_of(runner, target, "target") if forced
                 else greedy(runner, prompt_ids, max_new_tokens, bar=progress is True))
    contrast_ids = None if contrast is None else token_ids_of(runner, contrast, "contrast")
    if contrast_ids is not None and len(contrast_ids) != len(generated):
        raise InputError(f"contrast has {len(contrast_ids)} token(s) but the explained continuation has "
                         f"{len(generated)}: give one contrast token per generated token (step t contrasts "
                         "token t)")
    if contrast_ids is not None and list(contrast_ids) == list(generated):
        raise InputError("the contrast is the explained continuation itself: each step's difference would be 0 "
                         "everywhere; give another contrast")
    same = [] if contrast_ids is None else [t for t, (a, b) in enumerate(zip(generated, contrast_ids)) if a == b]
    if same:
        warnings.warn(f"the contrast token at step(s) {', '.join(map(str, same))} is the explained token itself: "
                      "target − contrast is 0 there, and so is every score of those steps", stacklevel=3)
    # a decoder-only model reads prompt + continuation; an encoder-decoder's decoder reads start + continuation
    longest = len(generated) + 1 if seq2seq else len(prompt_ids) + len(generated)
    if longest > runner.max_length:
        if seq2seq:
            raise InputError(f"the continuation ({len(generated)} tokens) does not fit the decoder's window of "
                             f"{runner.max_length} positions (its start token + at most {runner.max_length - 1})")
        raise InputError(f"prompt ({len(prompt_ids)} tokens) + continuation ({len(generated)}) is longer than the "
                         f"model's maximum of {runner.max_length} tokens")

    gradients = any(GRADIENTS in s.needs for s in specs)
    size = _steps_per_batch(runner, specs, len(prompt_ids) + len(generated) + (1 if seq2seq else 0), size,
                            budget, gradients, one_pass=one_pass)

    specials = special_ids(runner.tokenizer)
    ids = prompt_ids + generated
    tokens = runner.tokenizer.convert_ids_to_tokens(ids)
    special = [i in specials for i in ids]
    n_prompt, n_steps = len(prompt_ids), len(generated)
    # decoder-only: step t is the prefix prompt + generated[:t]; seq2seq: the prompt (the decoder is added below)
    steps = [Encoded(text=prompt, ids=ids[: n_prompt + t], type_ids=None, special=special[: n_prompt + t],
                     tokens=tokens[: n_prompt + t], word_ids=None, sequence_ids=None, offsets=None)
             for t in range(0 if seq2seq else n_steps)]
    prompt_only = Encoded(text=prompt, ids=prompt_ids, type_ids=None, special=special[:n_prompt],
                          tokens=tokens[:n_prompt], word_ids=None, sequence_ids=None, offsets=None)

    scores = {s.name: np.zeros((n_steps, n_prompt + n_steps)) for s in specs}
    probabilities, predicted, contrast_probs = [0.0] * n_steps, [0] * n_steps, [0.0] * n_steps
    figures: dict[str, dict[str, list[Any]]] = {}  # per-step figures a method reports (IG's completeness gap)
    tracker = ExplainProgress([n_prompt + t for t in range(n_steps)], model_dims(runner.model).hidden,
                              {s.name: method_passes(s, runner.model, method_options.get(s.name, {}))
                               for s in specs if OWN_PASS in s.needs},
                              bar=progress is True, callback=progress if callable(progress) else None,
                              desc="explaining steps", unit="steps")
    tracker.start()
    for first in range(0, n_steps, size):
        rows = list(range(first, min(first + size, n_steps)))
        tracker.begin_batch(rows)
        if seq2seq:
            rows_runner, ctx, targets = _seq2seq_batch(runner, prompt_only, generated, rows, contrast_ids, target_kind)
            batch = [prompt_only] * len(rows)
        else:
            rows_runner, batch = runner, [steps[t] for t in rows]
            targets = [generated[t] for t in rows]
            if contrast_ids is not None:  # (token, contrast) pairs: each step has its own contrast
                rows_runner = runner.with_head(ContrastHead(head))
                targets = [(generated[t], contrast_ids[t]) for t in rows]
            ctx = engine.batch_context(rows_runner, batch, target_kind)
            if ONE_PASS:  # every row is a prefix of the longest: one forward over it serves them all
                ctx.sequence = runner.inputs([steps[rows[-1]].ids])[0]
        ctx, out = engine.compute_batch(rows_runner, batch, targets, specs, method_options, target_kind, gradients,
                                        ctx=ctx, memory_budget=budget, tracker=tracker)
        logits = (head.at(ctx.capture.logits, ctx.targets) if seq2seq
                  else head.last(ctx.capture.logits, ctx.capture.logit_rows.mask(ctx.token_mask)))
        probs = logits.float().softmax(-1)  # (B, V): the distribution each step's token was drawn from
        for b, t in enumerate(rows):
            for m, (sc, _) in out.items():
                if decoder_stream:  # decoder key k >= 1 is generated token k - 1; key 0, the start token, has none
                    scores[m][t, n_prompt: n_prompt + t] = sc[b, 1: t + 1].double().cpu().numpy()
                else:
                    n = n_prompt if seq2seq else n_prompt + t
                    scores[m][t, :n] = sc[b, :n].double().cpu().numpy()
            probabilities[t] = float(probs[b, generated[t]])
            for m, values in ctx.meta.items():
                for k, v in values.items():
                    figures.setdefault(m, {}).setdefault(k, [None] * n_steps)[t] = v[b].item()
            predicted[t] = int(probs[b].argmax())
            if contrast_ids is not None:
                contrast_probs[t] = float(probs[b, contrast_ids[t]])
        tracker.end_batch()
        if first + size < n_steps:  # the next batch's pass, over a longer sequence, plans within the budget again:
            del ctx, out  # this batch's capture goes first, and the heaps' freed blocks go back to the system
            release_free_memory()  # (allocator.py; blocks of the lengths this pass used fit the next one's badly)
    tracker.close()

    meta = {
        "model": runner.name, "family": runner.adapter.family, "attention": runner.stream, "target_kind": target_kind,
        **head.meta(), **encoding_meta(runner.tokenizer), "chat_template": template,
        "max_new_tokens": None if forced else max_new_tokens,
        "generated_special": special[n_prompt:],
        "options": {k: v for k, v in method_options.items() if v}, "attnlens": __version__,
        **figures,
    }
    return Generation(
        prompt=prompt, prompt_tokens=tokens[:n_prompt], prompt_ids=prompt_ids,
        prompt_offsets=prompt_offsets(runner, prompt, template, prompt_ids),
        prompt_special=special[:n_prompt], generated_tokens=tokens[n_prompt:],
        generated_ids=generated, generated=[decode_token(runner.tokenizer, i) for i in generated],
        scores=scores, probabilities=probabilities, predicted_ids=predicted, contrast_ids=contrast_ids,
        contrast_probabilities=None if contrast_ids is None else contrast_probs,
        contrast=None if contrast_ids is None else [_alone(runner.tokenizer, i, meta) for i in contrast_ids],
        predicted=[_alone(runner.tokenizer, i, meta) for i in predicted], forced=forced, meta=meta,
    )


def _alone(tokenizer: Any, token_id: int, meta: Mapping[str, Any]) -> str:
    """A token that stands alone (a greedy choice or a contrast) as text: decoded, or, where that gives U+FFFD
    for bytes that complete no character on their own, the bytes it spells as ``\\xNN`` escapes."""
    text = decode_token(tokenizer, token_id)
    if "\ufffd" not in text or meta.get("token_encoding") not in (BYTE_LEVEL, SENTENCEPIECE):
        return text
    return token_texts([str(tokenizer.convert_ids_to_tokens(int(token_id)))], dict(meta))[0]


def _steps_per_batch(runner: ModelRunner, specs: list[Any], n: int, size: int, budget: int, gradients: bool,
                     one_pass: bool) -> int:
    """How many of ``size`` steps one batch takes so that its pass over ``n`` tokens fits ``budget``: steps sharing
    one forward (``one_pass``) add their gradients each; otherwise each is a whole forward+backward. Without
    gradients a forward keeps little: ``size``. A sequence whose single step does not fit is refused up front."""
    cost = _refuse_long(runner, specs, n, size, budget, one_pass)
    lrp = [s.name for s in specs if s.lrp] if one_pass else []
    layer_graph = one_pass and any(LAYER_GRAPH in s.needs for s in specs)
    held = max((s.step_vectors for s in specs), default=0) if one_pass else 0
    if not gradients and not lrp and not layer_graph and not held:
        return size
    first = cost.total(n)
    if not one_pass:
        return rows_that_fit(budget, first, size)
    step = step_gradient_bytes(cost.dims, n, cost.storage(n)) if gradients and cost.shared_storage else 0
    if lrp:  # the LRP pass's rows come from one batched backward too (one backward per row where it runs fused)
        fused = all(name in cost.fusable and cost.own_storage(name, n).recompute for name in lrp)
        step += lrp_step_bytes(cost.dims, n, size, any(name in ATTENTION_READERS for name in lrp), fused)
    if layer_graph:  # each step's cotangent through every rebuilt layer (DecompX over the sequence)
        step += layer_graph_step_bytes(cost.dims, n)
    step += held_step_bytes(cost.dims, n, held)  # what a method holds for each step (integrated gradients' sums)
    return max(1, min(size, 1 + (budget - first) // step)) if step else rows_that_fit(budget, first, size)


def _refuse_long(runner: ModelRunner, specs: list[Any], n: int, size: int, budget: int,
                 one_pass: bool) -> engine.PassCost:
    """The passes' cost over a generation of ``n`` tokens in batches of ``size`` steps; :class:`InputError`
    (one line) when a single step would not fit ``budget``."""
    cost = engine.pass_cost(runner, specs, budget, prefixes=one_pass, steps=size if one_pass else 0)
    cost.refuse_over(n, budget, what="a generation")
    return cost


class _Seq2SeqSteps(EncoderDecoderAdapter):
    """The rows of a seq2seq generation batch: every row holds the whole teacher-forced decoder input and row b
    explains decoder position ``positions[b]`` (the one predicting its token). Causal masking keeps later decoder
    positions out of that position's forward and backward; they are also left out of the query rows that
    methods average over (cross stream). Encoder stream: as for BART classification (mean over its rows)."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def classification_index(self, input_ids: torch.Tensor, token_mask: torch.Tensor, config: Any,
                             skip_pad: bool = False) -> torch.Tensor:
        return self.positions.to(input_ids.device)

    def select(self, outputs: Any, stream: str, token_mask: torch.Tensor, cls: torch.Tensor) -> StreamTensors:
        if stream == "encoder":
            return super().select(outputs, stream, token_mask, cls)
        n_decoder = _decoder_length(outputs)
        rows = torch.arange(n_decoder, device=cls.device)[None, :] <= cls[:, None]
        one_hot = torch.nn.functional.one_hot(cls, n_decoder).float()
        if stream == "decoder":  # keys: the decoder input (start token + continuation) up to the step
            return StreamTensors(attentions=list(outputs.decoder_attentions),
                                 hidden=list(outputs.decoder_hidden_states), query_mask=rows, key_mask=rows,
                                 query_weights=one_hot, self_attention=True)
        return StreamTensors(
            attentions=list(outputs.cross_attentions),
            hidden=[outputs.encoder_last_hidden_state] * (len(outputs.cross_attentions) + 1),
            query_mask=rows, key_mask=token_mask.bool(), query_weights=one_hot, self_attention=False,
        )

    def keys_to_tokens(self, values: torch.Tensor, stream: str) -> torch.Tensor:
        return values  # decoder stream: the token space is the decoder input itself (see _seq2seq_batch)


def _decoder_length(outputs: Any) -> int:
    """The decoder positions of a seq2seq pass's outputs: its cross-attention's queries, or, where the pass kept no
    attention (an LRP pass serving the capture alone), its decoder states' or logits' positions."""
    cross, states = getattr(outputs, "cross_attentions", None), getattr(outputs, "decoder_hidden_states", None)
    if cross:
        return int(cross[0].shape[2])  # (B, H, decoder positions, encoder positions)
    return int(states[0].shape[1] if states else outputs.logits.shape[1])


def _seq2seq_batch(runner: ModelRunner, prompt: Encoded, generated: list[int], rows: list[int],
                   contrast_ids: list[int] | None, target_kind: str) -> tuple[ModelRunner, BatchContext, list[Any]]:
    """The runner, inputs and targets of seq2seq generation steps ``rows``: the prompt in the encoder,
    start token + the continuation up to the last row's step in the decoder, target triples (token, decoder
    position, contrast or -1)."""
    rows_runner = runner.with_adapter(_Seq2SeqSteps(torch.tensor(rows)))
    ctx = engine.batch_context(rows_runner, [prompt] * len(rows), target_kind)
    decoder = [_decoder_start(runner)] + generated[: rows[-1]]
    ctx.inputs["decoder_input_ids"] = torch.tensor([decoder] * len(rows), device=runner.device)
    if runner.stream == "decoder":  # scores over the decoder input: start token + continuation (placed by the caller)
        ctx.token_mask = torch.ones(len(rows), len(decoder), dtype=ctx.token_mask.dtype, device=runner.device)
        ctx.special_mask = torch.zeros_like(ctx.token_mask, dtype=torch.bool)
    targets = [(generated[t], t, -1 if contrast_ids is None else contrast_ids[t]) for t in rows]
    return rows_runner, ctx, targets


def _decoder_start(runner: ModelRunner) -> int:
    """The token an encoder-decoder's continuation starts from, as ``model.generate`` reads it: the generation
    config's ``decoder_start_token_id``, else the model config's."""
    for source in (getattr(runner.model, "generation_config", None), runner.model.config):
        start = getattr(source, "decoder_start_token_id", None)
        if start is not None:
            return int(start[0] if isinstance(start, (list, tuple)) else start)
    raise ModelError(f"{type(runner.model).__name__} has no decoder_start_token_id in its generation config or "
                     "config: set it to generate")


def room_to_generate(runner: ModelRunner, n_prompt: int) -> int:
    """How many tokens the model's window leaves for a continuation of a prompt of ``n_prompt`` tokens (an
    encoder-decoder's decoder: its window less the start token)."""
    if isinstance(runner.head, Seq2SeqLMHead):
        return runner.max_length - 1
    return runner.max_length - n_prompt


def capped_new_tokens(runner: ModelRunner, n_prompt: int, max_new_tokens: int) -> int:
    """``max_new_tokens``, or what the model's window allows after the prompt when that is fewer, with one warning
    line (a continuation past the window would have positions the model never learnt)."""
    room = room_to_generate(runner, n_prompt)
    if 1 <= room < max_new_tokens:
        window = (f"the decoder's window of {runner.max_length} positions holds after its start token"
                  if isinstance(runner.head, Seq2SeqLMHead) else
                  f"the model's window of {runner.max_length} tokens leaves after the {n_prompt}-token prompt")
        warnings.warn(f"max_new_tokens={max_new_tokens} is more than {window}: generating at most {room}", stacklevel=4)
        return room
    return max_new_tokens


@torch.no_grad()
def greedy(runner: ModelRunner, prompt_ids: list[int], max_new_tokens: int, *, bar: bool = False) -> list[int]:
    """The greedy continuation (argmax at every step, no sampling or logits processors) of at most
    ``max_new_tokens`` tokens (and at most what the model's window leaves), stopping after an end-of-sequence
    token; key/value cache reused between steps, fused attention where the model has it, and a causal model's
    logits at the last position only (the prompt's pass holds no ``N × N`` map and no ``N × vocabulary`` logits).
    ``bar``: a progress bar per generated token, with an ETA."""
    eos = eos_ids(runner)
    room = room_to_generate(runner, len(prompt_ids))
    if room < 1:
        raise InputError(f"the prompt has {len(prompt_ids)} tokens: no room to generate within the model's "
                         f"maximum of {runner.max_length}")
    with explaining(runner.model, FUSED), tqdm(total=min(max_new_tokens, room), desc="generating", unit="token",
                                           disable=not bar, leave=False) as shown:
        return _greedy_steps(runner, prompt_ids, min(max_new_tokens, room), eos, shown.update)


def _greedy_steps(runner: ModelRunner, prompt_ids: list[int], n: int, eos: set[int], step: Any) -> list[int]:
    """The greedy loop of :func:`greedy` (``n`` tokens at most); ``step(1)`` after every token."""
    ids = torch.tensor([prompt_ids], device=runner.device)
    past = None
    if isinstance(runner.head, Seq2SeqLMHead):  # encode once; the decoder runs one new token per step
        encoded = runner.model.get_encoder()(input_ids=ids, attention_mask=torch.ones_like(ids))
        decoder = [_decoder_start(runner)]
        for _ in range(n):
            result = runner.model(encoder_outputs=encoded, attention_mask=torch.ones_like(ids),
                                  decoder_input_ids=torch.tensor([decoder[-1:]], device=runner.device),
                                  past_key_values=past, use_cache=True)
            past = result.past_key_values
            decoder.append(int(result.logits[0, -1].argmax()))
            step(1)
            if decoder[-1] in eos:
                break
        return decoder[1:]
    out: list[int] = []
    last = {"logits_to_keep": 1} if keeps_logits(runner.model) else {}
    for _ in range(n):
        result = runner.model(input_ids=ids, past_key_values=past, use_cache=True, **last)
        past = result.past_key_values
        token = int(result.logits[0, -1].argmax())
        out.append(token)
        step(1)
        if token in eos:
            break
        ids = torch.tensor([[token]], device=runner.device)
    return out


def eos_ids(runner: ModelRunner) -> set[int]:
    """The token ids that end a generation (the model's generation config, config and tokenizer)."""
    found: set[int] = set()
    for source in (getattr(runner.model, "generation_config", None), runner.model.config, runner.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            found.update([value] if isinstance(value, int) else value)
    return found


def encode_prompt(runner: ModelRunner, prompt: str, chat: bool) -> tuple[list[int], bool]:
    """The prompt's token ids (with the tokenizer's special tokens, or through its chat template)."""
    if not chat:
        n = len(runner.tokenizer(prompt)["input_ids"])
        if n > runner.max_length:
            raise InputError(f"the prompt has {n} tokens, more than the model's maximum of {runner.max_length}")
        (e,) = encode(runner.tokenizer, runner.model, prompt, runner.max_length, truncation=False)
        return e.ids, False
    if not getattr(runner.tokenizer, "chat_template", None):
        raise InputError("the tokenizer has no chat template: drop chat=True (--chat) for this model")
    ids = runner.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=True)
    if isinstance(ids, Mapping) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids], True


def prompt_offsets(runner: ModelRunner, prompt: str, chat: bool,
                   prompt_ids: Sequence[int]) -> list[tuple[int, int] | None] | None:
    """Each prompt token's character span in ``prompt`` (``None`` for special and chat-template tokens), or
    ``None`` where the tokenizer cannot give offsets."""
    tokenizer = runner.tokenizer
    if not chat:
        return _completed(spans_in(tokenizer, prompt, prompt_ids, 0, len(prompt), add_special_tokens=True))
    rendered = str(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=False))
    start = rendered.find(prompt)
    if start < 0:  # the template rewrote the message: no verbatim span to point into
        return None
    return _completed(spans_in(tokenizer, rendered, prompt_ids, start, start + len(prompt), add_special_tokens=False))


def _completed(spans: list[tuple[int, int] | None] | None) -> list[tuple[int, int] | None] | None:
    """``spans`` with each character split over several byte tokens given to the token that completes it (empty
    spans before it), as :attr:`~attnlens.Generation.generated_offsets` gives the continuation's."""
    if spans is None:
        return None
    held = [k for k, span in enumerate(spans) if span is not None]
    out = list(spans)
    for k, span in zip(held, completing_spans([spans[k] for k in held])):
        out[k] = span
    return out


def token_ids_of(runner: ModelRunner, value: str | Sequence[int], what: str) -> list[int]:
    """A forced continuation or contrast as token ids: text (tokenized without special tokens; a decoder-only
    model's as it continues the prompt, :func:`~attnlens.core.encoding.continuation_encoding`) or ids."""
    rows = runner.model.get_input_embeddings().num_embeddings
    if isinstance(value, str):
        if isinstance(runner.head, Seq2SeqLMHead):  # the decoder's text starts here
            ids = list(runner.tokenizer(value, add_special_tokens=False)["input_ids"])
        else:
            ids = continuation_encoding(runner.tokenizer, value)[0]
        if not ids:
            raise InputError(f"{what}={value!r} tokenizes to nothing: give the text of at least one token")
        return [int(i) for i in ids]
    if (isinstance(value, Sequence) and value and all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
                                                      and 0 <= i < rows for i in value)):
        return [int(i) for i in value]
    raise InputError(f"{what} must be text or a non-empty list of token ids in 0..{rows - 1}, got {value!r:.60}")


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InputError(f"{name} must be an integer >= 1, got {value!r}")


def check_generation_view(runner: ModelRunner) -> None:
    """:class:`InputError` where a generation's head view cannot be drawn (before anything is generated)."""
    if isinstance(runner.head, Seq2SeqLMHead):
        raise InputError("the head view of a generation shows one self-attention over prompt + continuation: "
                         "decoder-only models only (an encoder-decoder's streams split them)")


@torch.no_grad()
def attention_maps(runner: ModelRunner, g: Generation, memory_budget: str | int | None = None,
                   beside: Beside | None = None) -> np.ndarray:
    """Attention probabilities ``(L, H, N, N)`` (float32) of the explained stream over the whole prompt +
    continuation of ``g`` (one forward pass), for the head view; refused in one line where they (and ``beside``)
    do not fit ``memory_budget`` (:func:`~attnlens.core.attention_view.whole_attention_maps`)."""
    check_generation_view(runner)
    inputs, mask = runner.inputs([g.prompt_ids + g.generated_ids])
    return whole_attention_maps(runner, inputs, mask, parse_budget(memory_budget), beside)
