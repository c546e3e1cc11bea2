"""Explaining what a language model generates: every registered method, for every generated token.

A generation step is one example of the classifier engine (:func:`attnlens.engine.compute_batch`): its input is
the prompt plus the tokens generated before it, and its head (:class:`attnlens.heads.LMHead`) reads the logit of
the step's token at the input's last position, which is the position that predicts it. The steps of one
generation go through the engine as the rows of padded batches: row ``t`` is the teacher-forced sequence
prompt + continuation with the tokens after step ``t`` masked as padding, so each method works unchanged.
Causal masking makes each row's forward and backward exactly those of the prefix alone; for decoder-only models
the batch therefore also carries the sequence itself (:attr:`attnlens.context.BatchContext.sequence`) and the
model runs once over it: the shared pass, integrated gradients' path points and the LRP pass each take one
forward for all steps and each step's gradients by batched vector-Jacobian products (docs/generation.md).

Flow: :func:`explain_generation` encodes the prompt (optionally through the chat template), generates the
continuation greedily (or takes the forced ``target``), explains all steps in batches, and returns a
:class:`Generation`: step × token score matrices, the tokens, and each generated token's probability.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import __version__, engine
from .adapters import EncoderDecoderAdapter, StreamTensors
from .context import BatchContext
from .encoding import Encoded, encode
from .errors import InputError, ModelError
from .explanation import Explanation, _read_dicts
from .heads import ContrastHead, LMHead, Seq2SeqLMHead, decode_token
from .memory import (
    model_dims,
    parse_budget,
    rows_that_fit,
    shared_pass_row_bytes,
    step_gradient_bytes,
    warn_when_one_row_exceeds,
)
from .methods.registry import GRADIENTS
from .modelstate import explaining
from .tokentext import encoding_meta

if TYPE_CHECKING:
    from .explainer import Explainer

__all__ = ["Generation", "explain_generation", "load_generations"]

# Decoder-only steps share one forward over the sequence (BatchContext.sequence). False: each step's row runs
# its own forward over its prefix (the same numbers, up to rounding; the tests compare the two).
ONE_PASS = True


@dataclass
class Generation:
    """Token scores of every generated token, for every method that was asked for.

    Step ``t`` explains generated token ``t`` (its logit, probability or log-probability; minus the contrast
    token's where a contrast was given) over the ``n_prompt + t`` tokens before it; its row of a score matrix is
    zero from column ``n_prompt + t`` on (a token cannot explain itself or what follows it).

    Attributes:
        prompt: the prompt as given (before any chat template).
        prompt_tokens, prompt_ids, prompt_special: the encoded prompt (chat template and special tokens
            included), special tokens flagged.
        generated_tokens, generated_ids: the explained continuation, one entry per step (greedy or forced).
        generated: each generated token decoded as text (``" Paris"``).
        scores: method id -> ``(n_generated, n_prompt + n_generated)`` matrix; row ``t`` explains step ``t``.
        probabilities: the probability of each generated token at its step (given the tokens before it).
        predicted_ids: the model's greedy choice at each step (equal to ``generated_ids`` unless forced).
        contrast_ids, contrast_probabilities: the contrast token of each step and its probability, or ``None``.
        forced: whether the continuation was given (teacher forcing) rather than generated greedily.
        meta: how it was made (model, target kind, chat template, method options, ...).
    """

    prompt: str
    prompt_tokens: list[str]
    prompt_ids: list[int]
    prompt_special: list[bool]
    generated_tokens: list[str]
    generated_ids: list[int]
    generated: list[str]
    scores: dict[str, np.ndarray] = field(default_factory=dict)
    probabilities: list[float] = field(default_factory=list)
    predicted_ids: list[int] = field(default_factory=list)
    contrast_ids: list[int] | None = None
    contrast_probabilities: list[float] | None = None
    forced: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ queries
    @property
    def methods(self) -> list[str]:
        return list(self.scores)

    @property
    def tokens(self) -> list[str]:
        """Prompt tokens followed by the generated ones: the columns of every score matrix."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def special(self) -> list[bool]:
        """Special-token flags of :attr:`tokens` (never ranked, shown greyed)."""
        return self.prompt_special + list(self.meta.get("generated_special", [False] * len(self.generated_ids)))

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def text(self) -> str:
        """The generated continuation as text."""
        return "".join(self.generated)

    def step(self, t: int) -> Explanation:
        """Step ``t`` as an :class:`Explanation` of its ``n_prompt + t`` input tokens (any renderer takes it)."""
        if not -len(self.generated_ids) <= t < len(self.generated_ids):
            raise InputError(f"step {t} is out of range: {len(self.generated_ids)} tokens were generated")
        t %= len(self.generated_ids)
        n = self.n_prompt + t
        meta = {**self.meta, "step": t, "target_token": self.generated[t]}
        if self.contrast_ids is not None:
            meta["contrast"] = self.contrast_ids[t]
        return Explanation(
            text=self.prompt, tokens=self.tokens[:n], special=self.special[:n],
            target=self.generated_ids[t], predicted=self.predicted_ids[t],
            probabilities=[self.probabilities[t]],
            scores={m: s[t, :n].copy() for m, s in self.scores.items()},
            input_ids=(self.prompt_ids + self.generated_ids)[:n], meta=meta,
        )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The JSON contract (docs/generation-format.md)."""
        return {
            "prompt": self.prompt,
            "prompt_tokens": self.prompt_tokens,
            "prompt_ids": self.prompt_ids,
            "prompt_special": self.prompt_special,
            "generated_tokens": self.generated_tokens,
            "generated_ids": self.generated_ids,
            "generated": self.generated,
            "target_ids": self.generated_ids,
            "contrast_ids": self.contrast_ids,
            "probabilities": self.probabilities,
            "contrast_probabilities": self.contrast_probabilities,
            "predicted_ids": self.predicted_ids,
            "forced": self.forced,
            "scores": {m: s.tolist() for m, s in self.scores.items()},
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Generation:
        try:
            return cls(
                prompt=d["prompt"], prompt_tokens=list(d["prompt_tokens"]), prompt_ids=list(d["prompt_ids"]),
                prompt_special=[bool(x) for x in d["prompt_special"]],
                generated_tokens=list(d["generated_tokens"]), generated_ids=list(d["generated_ids"]),
                generated=list(d["generated"]),
                scores={m: np.asarray(s, dtype=float).reshape(len(d["generated_ids"]), -1)
                        for m, s in d["scores"].items()},
                probabilities=list(d["probabilities"]), predicted_ids=list(d.get("predicted_ids") or []),
                contrast_ids=d.get("contrast_ids"), contrast_probabilities=d.get("contrast_probabilities"),
                forced=bool(d.get("forced", False)), meta=dict(d.get("meta") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"not an attnlens generation explanation: {type(exc).__name__}: {exc}") from None

    def save(self, path: str | Path) -> None:
        """Write the JSON form (:meth:`to_dict`) to ``path``."""
        Path(path).write_text(json.dumps(self.to_dict()), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Generation:
        """Read a :meth:`save` document (several: :func:`load_generations`)."""
        (g, *more) = load_generations(path)
        if more:
            raise InputError(f"{path} holds {1 + len(more)} generations: read them with load_generations")
        return g

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Generation):
            return NotImplemented
        mine, theirs = self.to_dict(), other.to_dict()
        return mine == theirs

    # ------------------------------------------------------------------ display
    def show(self, methods: Sequence[str] | None = None, **kwargs: Any) -> None:
        """Step × token heatmaps in the terminal (one per method)."""
        from .viz.generation import show_generation

        show_generation(self, methods, **kwargs)

    def to_html(self, methods: Sequence[str] | None = None, **kwargs: Any) -> str:
        """A standalone HTML page: the continuation, and hovering a generated token shows its step's scores."""
        from .viz.generation import generation_html

        return generation_html(self, methods, **kwargs)


    def plot(self, method: str | None = None, path: str | Path | None = None) -> Any:
        """Step × token heatmap of ``method`` (default: the first) as a matplotlib figure; PNG/SVG to ``path``."""
        from .viz.generation import plot_generation

        return plot_generation(self, method, path)


def load_generations(path: str | Path) -> list[Generation]:
    """Every generation of a file: one :meth:`Generation.save` document, a JSON array (``attnlens explain
    --generate --format json``) or JSON Lines (``--format jsonl``)."""
    if not Path(path).is_file():
        raise InputError(f"cannot read {path}: no such file")
    return [Generation.from_dict(d) for d in _read_dicts(path)]


# ---------------------------------------------------------------------------------------------------- engine
def explain_generation(
    ex: Explainer,
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
) -> Generation:
    """See :meth:`attnlens.Explainer.explain_generation`."""
    head = ex.head
    if not isinstance(head, LMHead):
        raise ModelError(f"explain_generation needs a language model (…ForCausalLM, …ForConditionalGeneration); "
                         f"{ex.name} is {head.kind}: use explain() for it")
    seq2seq = isinstance(head, Seq2SeqLMHead)
    decoder_stream = seq2seq and ex.stream == "decoder"  # scores over the continuation instead of the prompt
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("the prompt is empty: give the text the model should continue")
    _check_count("max_new_tokens", max_new_tokens)
    size = ex._effective_batch_size(batch_size)
    budget = parse_budget(memory_budget)
    specs, method_options = engine.select_methods(ex, methods, target or "generated", target_kind, options,
                                                  contrast is not None)
    if decoder_stream:
        specs = _decoder_stream_methods(specs, methods)

    prompt_ids, template = _prompt_ids(ex, prompt, chat)
    forced = target is not None
    generated = _token_ids(ex, target, "target") if forced else greedy(ex, prompt_ids, max_new_tokens)
    contrast_ids = None if contrast is None else _token_ids(ex, contrast, "contrast")
    if contrast_ids is not None and len(contrast_ids) != len(generated):
        raise InputError(f"contrast has {len(contrast_ids)} token(s) but the explained continuation has "
                         f"{len(generated)}: give one contrast token per generated token (step t contrasts "
                         "token t)")
    # a decoder-only model reads prompt + continuation; an encoder-decoder's decoder reads start + continuation
    longest = len(generated) + 1 if seq2seq else len(prompt_ids) + len(generated)
    if longest > ex.max_length:
        raise InputError(f"prompt ({len(prompt_ids)} tokens) + continuation ({len(generated)}) is longer than the "
                         f"model's maximum of {ex.max_length} tokens")

    gradients = any(GRADIENTS in s.needs for s in specs)
    size = _steps_per_batch(ex, len(prompt_ids) + len(generated) + (1 if seq2seq else 0), size, budget, gradients,
                            one_pass=ONE_PASS and not seq2seq)

    special_ids = set(getattr(ex.tokenizer, "all_special_ids", []) or [])
    ids = prompt_ids + generated
    tokens = ex.tokenizer.convert_ids_to_tokens(ids)
    special = [i in special_ids for i in ids]
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
    for first in range(0, n_steps, size):
        rows = list(range(first, min(first + size, n_steps)))
        if seq2seq:
            runner, ctx, targets = _seq2seq_batch(ex, prompt_only, generated, rows, contrast_ids, target_kind)
            batch = [prompt_only] * len(rows)
        else:
            runner, batch = ex, [steps[t] for t in rows]
            targets = [generated[t] for t in rows]
            if contrast_ids is not None:  # (token, contrast) pairs: each step has its own contrast
                runner = ex._with_head(ContrastHead(head))
                targets = [(generated[t], contrast_ids[t]) for t in rows]
            ctx = engine.batch_context(runner, batch, target_kind)
            if ONE_PASS:  # every row is a prefix of the longest: one forward over it serves them all
                ctx.sequence = ex._inputs([steps[rows[-1]].ids])[0]
        ctx, out = engine.compute_batch(runner, batch, targets, specs, method_options, target_kind, gradients,
                                        ctx=ctx, memory_budget=budget)
        logits = (head.at(ctx.capture.logits, ctx.targets) if seq2seq
                  else head.last(ctx.capture.logits, ctx.token_mask))
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

    meta = {
        "model": ex.name, "family": ex.adapter.family, "attention": ex.stream, "target_kind": target_kind,
        **head.meta(), **encoding_meta(ex.tokenizer), "chat_template": template,
        "max_new_tokens": None if forced else max_new_tokens,
        "generated_special": special[n_prompt:],
        "options": {k: v for k, v in method_options.items() if v}, "attnlens": __version__,
        **figures,
    }
    return Generation(
        prompt=prompt, prompt_tokens=tokens[:n_prompt], prompt_ids=prompt_ids,
        prompt_special=special[:n_prompt], generated_tokens=tokens[n_prompt:],
        generated_ids=generated, generated=[decode_token(ex.tokenizer, i) for i in generated],
        scores=scores, probabilities=probabilities, predicted_ids=predicted, contrast_ids=contrast_ids,
        contrast_probabilities=None if contrast_ids is None else contrast_probs, forced=forced, meta=meta,
    )


def _steps_per_batch(ex: Explainer, n: int, size: int, budget: int, gradients: bool, one_pass: bool) -> int:
    """How many of ``size`` steps one batch takes so that its pass over ``n`` tokens fits ``budget``: steps sharing
    one forward (``one_pass``) add their gradients each; otherwise each is a whole forward+backward. Without
    gradients a forward keeps little: ``size``. A sequence over the budget on its own runs alone, with a warning."""
    if not gradients:
        return size
    dims = model_dims(ex.model)
    warn_when_one_row_exceeds(dims, n, budget, what="a generation", alone="its steps run one at a time",
                              stacklevel=4)
    first = shared_pass_row_bytes(dims, n)
    if one_pass:
        return max(1, min(size, 1 + (budget - first) // step_gradient_bytes(dims, n)))
    return rows_that_fit(budget, first, size)


class _Seq2SeqSteps(EncoderDecoderAdapter):
    """The rows of a seq2seq generation batch: every row holds the whole teacher-forced decoder input and row b
    explains decoder position ``positions[b]`` (the one predicting its token). Causal masking keeps later decoder
    positions out of that position's forward and backward; they are also left out of the query rows that
    methods average over (cross stream). Encoder stream: as for BART classification (mean over its rows)."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def classification_index(self, input_ids: torch.Tensor, token_mask: torch.Tensor, config: Any) -> torch.Tensor:
        return self.positions.to(input_ids.device)

    def select(self, outputs: Any, stream: str, token_mask: torch.Tensor, cls: torch.Tensor) -> StreamTensors:
        if stream == "encoder":
            return super().select(outputs, stream, token_mask, cls)
        n_decoder = outputs.cross_attentions[0].shape[2]
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


def _seq2seq_batch(ex: Explainer, prompt: Encoded, generated: list[int], rows: list[int],
                   contrast_ids: list[int] | None, target_kind: str) -> tuple[Explainer, BatchContext, list[Any]]:
    """The explainer, inputs and targets of seq2seq generation steps ``rows``: the prompt in the encoder,
    start token + the continuation up to the last row's step in the decoder, target triples (token, decoder
    position, contrast or -1)."""
    positions = torch.tensor(rows)
    runner = copy.copy(ex)
    runner.adapter = _Seq2SeqSteps(positions)
    ctx = engine.batch_context(runner, [prompt] * len(rows), target_kind)
    decoder = [_decoder_start(ex)] + generated[: rows[-1]]
    ctx.inputs["decoder_input_ids"] = torch.tensor([decoder] * len(rows), device=ex.device)
    if ex.stream == "decoder":  # scores over the decoder input: start token + continuation (placed by the caller)
        ctx.token_mask = torch.ones(len(rows), len(decoder), dtype=ctx.token_mask.dtype, device=ex.device)
        ctx.special_mask = torch.zeros_like(ctx.token_mask, dtype=torch.bool)
    targets = [(generated[t], t, -1 if contrast_ids is None else contrast_ids[t]) for t in rows]
    return runner, ctx, targets


def _decoder_stream_methods(specs: list[Any], methods: Any) -> list[Any]:
    """The methods that apply to a seq2seq decoder stream: not those on input embeddings, which are the
    encoder's, nor those running passes of their own (integrated gradients, value zeroing), which perturb the
    encoder's input or have not been checked on the decoder stream (skipped with a warning under ``"all"``,
    refused when named)."""
    from .methods.registry import EMBEDDINGS, OWN_PASS

    bad = [s.name for s in specs if EMBEDDINGS in s.needs or OWN_PASS in s.needs]
    if bad and methods not in (None, "all"):
        raise InputError(f"{', '.join(bad)} attribute to the encoder's input embeddings, not to the decoder "
                         "stream's tokens: use attention='encoder' or 'cross' for them")
    if bad:
        warnings.warn(f"skipping {', '.join(bad)}: they attribute to the encoder's input or run passes of their own, "
                      "not defined for the decoder stream", stacklevel=3)
    return [s for s in specs if s.name not in bad]


def _decoder_start(ex: Explainer) -> int:
    start = getattr(ex.model.config, "decoder_start_token_id", None)
    if start is None:
        raise ModelError(f"{type(ex.model).__name__} has no decoder_start_token_id in its config: set it to "
                         "generate")
    return int(start)


@torch.no_grad()
def greedy(ex: Explainer, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The greedy continuation (argmax at every step, no sampling or logits processors) of at most
    ``max_new_tokens`` tokens, stopping after an end-of-sequence token; key/value cache reused between steps."""
    eos = _eos_ids(ex)
    room = ex.max_length - len(prompt_ids)
    if room < 1 and not isinstance(ex.head, Seq2SeqLMHead):
        raise InputError(f"the prompt has {len(prompt_ids)} tokens: no room to generate within the model's "
                         f"maximum of {ex.max_length}")
    out: list[int] = []
    with explaining(ex.model):
        ids = torch.tensor([prompt_ids], device=ex.device)
        if isinstance(ex.head, Seq2SeqLMHead):  # encode once; the short decoder input is re-run every step
            encoded = ex.model.get_encoder()(input_ids=ids, attention_mask=torch.ones_like(ids))
            decoder = [_decoder_start(ex)]
            for _ in range(min(max_new_tokens, ex.max_length - 1)):
                logits = ex.model(encoder_outputs=encoded, attention_mask=torch.ones_like(ids),
                                  decoder_input_ids=torch.tensor([decoder], device=ex.device)).logits
                decoder.append(int(logits[0, -1].argmax()))
                if decoder[-1] in eos:
                    break
            return decoder[1:]
        past = None
        for _ in range(min(max_new_tokens, room)):
            result = ex.model(input_ids=ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            if token in eos:
                break
            ids = torch.tensor([[token]], device=ex.device)
    return out


def _eos_ids(ex: Explainer) -> set[int]:
    found: set[int] = set()
    for source in (getattr(ex.model, "generation_config", None), ex.model.config, ex.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            found.update([value] if isinstance(value, int) else value)
    return found


def _prompt_ids(ex: Explainer, prompt: str, chat: bool) -> tuple[list[int], bool]:
    """The prompt's token ids (with the tokenizer's special tokens, or through its chat template)."""
    if not chat:
        n = len(ex.tokenizer(prompt)["input_ids"])
        if n > ex.max_length:
            raise InputError(f"the prompt has {n} tokens, more than the model's maximum of {ex.max_length}")
        (e,) = encode(ex.tokenizer, ex.model, prompt, ex.max_length, truncation=False)
        return e.ids, False
    if not getattr(ex.tokenizer, "chat_template", None):
        raise InputError("the tokenizer has no chat template: drop chat=True (--chat) for this model")
    ids = ex.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=True)
    if isinstance(ids, Mapping) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids], True


def _token_ids(ex: Explainer, value: str | Sequence[int], what: str) -> list[int]:
    """A forced continuation or contrast as token ids: text (tokenized without special tokens) or ids."""
    rows = ex.model.get_input_embeddings().num_embeddings
    if isinstance(value, str):
        ids = list(ex.tokenizer(value, add_special_tokens=False)["input_ids"])
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


@torch.no_grad()
def attention_maps(ex: Explainer, g: Generation) -> np.ndarray:
    """Attention probabilities ``(L, H, N, N)`` of the explained stream over the whole prompt + continuation of
    ``g`` (one forward pass), for the head view."""
    from .capture import run_capture
    from .methods.registry import ATTENTION

    if isinstance(ex.head, Seq2SeqLMHead):
        raise InputError("the head view of a generation shows one self-attention over prompt + continuation: "
                         "decoder-only models only (an encoder-decoder's streams split them)")
    inputs, mask = ex._inputs([g.prompt_ids + g.generated_ids])
    with explaining(ex.model):
        capture, _ = run_capture(ex.model, ex.adapter, inputs, mask, ex.stream, None, "logit", gradients=False,
                                 head=ex.head, keep={ATTENTION})
    return torch.stack(capture.attentions, 0)[:, 0].float().cpu().numpy()
