"""The :class:`Explainer`: tokenizes, batches, runs the shared pass and every requested method, returns
:class:`~attnlens.explanation.Explanation` objects in input order."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from . import __version__
from .adapters import Adapter
from .architectures import adapter_for, architecture_for, finds_last_token_by_padding
from .batching import length_sorted_chunks, pad_batch, predict_batches
from .capture import run_capture
from .context import TARGET_KINDS, BatchContext
from .errors import InputError, ModelError
from .explanation import Explanation
from .heads import head_for
from .loading import (
    check_complete,
    check_model_dir,
    check_tokenizer_files,
    check_vocabulary,
    load_weights,
    quiet_transformers,
)
from .methods.registry import ATTENTION, GRADIENTS, OWN_PASS, capture_request, get_method, resolve_methods
from .modelstate import explaining, last_token_head

TextInput = Union[str, tuple[str, str], list[str]]  # noqa: UP007 (a runtime alias on Python 3.10)
UNKNOWN_WARNING_FRACTION = 0.5  # warn when more of the inputs' (non-special) tokens are the unknown token


@dataclass
class Encoded:
    """One tokenized input."""

    text: str | list[str]
    ids: list[int]
    type_ids: list[int] | None
    special: list[bool]
    tokens: list[str]
    word_ids: list[int | None] | None
    sequence_ids: list[int | None] | None
    offsets: list[tuple[int, int]] | None
    dropped: int = 0


class Explainer:
    """Explains a HuggingFace sequence classifier (or extractive QA model) with every registered method.

    Args:
        model: a ``...ForSequenceClassification`` model (encoder-only, decoder-only or encoder-decoder), or a
            ``...ForQuestionAnswering`` model, whose targets are (start, end) token positions.
        tokenizer: its tokenizer (a fast tokenizer enables word aggregation).
        attention: which attention to explain: ``None`` (the family's default), or for BART-like models
            ``"encoder"`` (default), ``"decoder"`` or ``"cross"``.
        max_length: longest input in tokens (default: what the model's position embeddings allow).
        name: how the model is named in the explanations' metadata.
        max_answer_length: QA models: the longest predicted answer span in tokens (default 30, as HF's
            question-answering pipeline). Predicted spans are decoded as SQuAD does: the best start + end logit
            with end >= start, within the context (the second sequence of a (question, context) pair).

    A model whose ``config.problem_type`` is ``"multi_label_classification"`` is explained as multi-label:
    independent sigmoid probabilities per label, ``predicted`` lists the labels with p > 0.5, and the default
    target is the highest-scoring label (any label can be explained with ``target=``).

    The model is never modified: it runs in eval mode with eager attention while explaining, and its flags and
    attention implementation are restored afterwards (also on errors).

    A model object cannot tell whether its task head was trained: one built from a checkpoint without that head
    (``AutoModelForSequenceClassification.from_pretrained`` of a base encoder or a language model) has a random
    head, and its explanations mean nothing. :meth:`from_pretrained` checks this; with a model you load yourself,
    check that ``from_pretrained(..., output_loading_info=True)`` reports no ``missing_keys``. The tokenizer is
    checked as far as the model allows: it must fit the embedding matrix (no more tokens than rows, and at least
    half as many), and inputs that are mostly ``[UNK]`` give a warning.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        attention: str | None = None,
        max_length: int | None = None,
        name: str | None = None,
        max_answer_length: int = 30,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ModelError(f"expected a PyTorch HuggingFace model, got {type(model).__name__}")
        if not callable(tokenizer) or not hasattr(tokenizer, "convert_ids_to_tokens"):
            raise ModelError(f"expected a HuggingFace tokenizer, got {type(tokenizer).__name__}")
        self.head = head_for(model, max_answer_length=max_answer_length)
        self.model = model
        self.tokenizer = tokenizer
        self.adapter: Adapter = adapter_for(model)
        self.stream = self.adapter.check_stream(attention)
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._check_vocabulary()
        self.max_length = self._max_length(max_length)
        # Token types go in only where the model takes them and the tokenizer makes them (GPT-2 takes them but
        # adds them as extra token embeddings, so they must match what the model was trained with).
        params = inspect.signature(model.forward).parameters
        made = "token_type_ids" in (getattr(tokenizer, "model_input_names", None) or ["token_type_ids"])
        self._takes_token_types = "token_type_ids" in params and made
        self.pad_id = self.adapter.pad_token_id(tokenizer, model.config)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        attention: str | None = None,
        max_length: int | None = None,
        device: str | torch.device | None = None,
        task: str | None = None,
        **model_kwargs: Any,
    ) -> Explainer:
        """Load a model and its tokenizer from a local directory (or a hub id when online), eager attention.

        ``task`` is ``"classification"`` (``AutoModelForSequenceClassification``) or ``"qa"``
        (``AutoModelForQuestionAnswering``); by default it follows the architecture the model's config names.

        Raises :class:`ModelError` (one line) when the checkpoint cannot be explained as it is: a task head that
        is not in the weights (a base encoder, a language model, a classifier loaded with ``task="qa"``: the head
        would be random), a directory without tokenizer files, corrupt or empty weights files.
        """
        from transformers import (
            AutoConfig,
            AutoModelForQuestionAnswering,
            AutoModelForSequenceClassification,
            AutoTokenizer,
        )

        if task not in (None, "classification", "qa"):
            raise InputError(f"task={task!r}; choose 'classification' or 'qa'")

        name = str(name_or_path)
        looks_local = name.startswith((".", "/", "~")) or Path(name).exists()
        if looks_local and not Path(name).expanduser().is_dir():
            raise ModelError(f"model directory not found: {name}")
        check_model_dir(name)
        try:
            with quiet_transformers():
                if task is None:
                    architectures = getattr(AutoConfig.from_pretrained(name), "architectures", None) or []
                    qa = any(a.endswith("ForQuestionAnswering") for a in architectures)
                    task = "qa" if qa else "classification"
                tokenizer = AutoTokenizer.from_pretrained(name)
            check_tokenizer_files(tokenizer, name)
            auto = AutoModelForQuestionAnswering if task == "qa" else AutoModelForSequenceClassification
            model, info = load_weights(auto, name, attn_implementation="eager", **model_kwargs)
        except OSError as exc:  # missing files, unknown hub id, no network
            raise ModelError(f"could not load model {name!r}: {str(exc).splitlines()[0]}") from exc
        except ValueError as exc:  # e.g. a config of another kind of model
            kind = "an extractive QA model" if task == "qa" else "a sequence classifier"
            raise ModelError(f"could not load {name!r} as {kind}: {str(exc).splitlines()[0]}") from exc
        check_complete(model, info, name, task)
        if device is not None:
            try:
                model.to(device)
            except (RuntimeError, AssertionError, ValueError) as exc:  # unknown device type, CUDA not compiled in
                raise InputError(f"cannot move the model to device {device!r}: {str(exc).splitlines()[0]}") from None
        return cls(model, tokenizer, attention=attention, max_length=max_length, name=name)

    # ----------------------------------------------------------------- checks
    @property
    def labels(self) -> list[str]:
        """Class names in index order (``id2label``); empty for QA models."""
        return self.head.labels(self.model.config)

    @property
    def max_answer_length(self) -> int | None:
        """QA models: the longest predicted answer span in tokens (settable); ``None`` for classifiers."""
        return getattr(self.head, "max_answer_length", None)

    @max_answer_length.setter
    def max_answer_length(self, value: int) -> None:
        self.head = self.head.with_max_answer_length(value)

    @property
    def device(self) -> torch.device:
        try:
            return next(self.model.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    def _check_vocabulary(self) -> None:
        check_vocabulary(self.tokenizer, self.model)

    def _max_length(self, requested: int | None) -> int:
        config = self.model.config
        limits = []
        for attr in ("max_position_embeddings", "n_positions"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and value > 0:
                if architecture_for(config).position_offset:  # positions start after the padding index
                    value -= int(getattr(config, "pad_token_id", 1) or 1) + 1
                limits.append(value)
                break
        tok_limit = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(tok_limit, int) and 0 < tok_limit < 1_000_000:
            limits.append(tok_limit)
        model_limit = min(limits) if limits else 512
        if requested is None:
            return model_limit
        if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)):
            raise InputError(f"max_length must be an integer, got {requested!r}")
        if requested < 2:
            raise InputError(f"max_length must be at least 2, got {requested}")
        if requested > model_limit:
            warnings.warn(
                f"max_length={requested} exceeds what the model supports; using {model_limit}", stacklevel=3
            )
            return model_limit
        return requested

    # --------------------------------------------------------------- encoding
    def _normalize_texts(self, texts: TextInput | Sequence[TextInput]) -> list[str | list[str]]:
        is_pair = isinstance(texts, tuple) and len(texts) == 2 and all(isinstance(t, str) for t in texts)
        if isinstance(texts, str) or is_pair:
            texts = [texts]
        if not isinstance(texts, Sequence) or len(texts) == 0:
            raise InputError("no texts to explain: pass a string, a (text_a, text_b) pair or a list of them")
        out: list[str | list[str]] = []
        for i, t in enumerate(texts):
            if isinstance(t, str):
                parts = [t]
            elif isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t):
                parts = list(t)
            else:
                raise InputError(f"input {i} is neither a string nor a pair of strings: {t!r:.80}")
            for p in parts:
                if not p.strip():
                    raise InputError(f"input {i} is empty or whitespace only")
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates, e.g. undecodable bytes from a non-UTF-8 terminal
                    raise InputError(
                        f"input {i} holds characters that are not valid Unicode (undecodable bytes?): {p!r:.80}"
                    ) from None
            out.append(parts[0] if len(parts) == 1 else parts)
        return out

    def encode(self, texts: TextInput | Sequence[TextInput], truncation: bool = True) -> list[Encoded]:
        """Tokenize inputs (no padding); over-long inputs are truncated with a warning or rejected."""
        items = self._normalize_texts(texts)
        fast = bool(getattr(self.tokenizer, "is_fast", False))
        encoded: list[Encoded] = []
        too_long: list[tuple[int, int]] = []
        for i, text in enumerate(items):
            args = (text,) if isinstance(text, str) else (text[0], text[1])
            kwargs = dict(add_special_tokens=True, return_special_tokens_mask=True, return_offsets_mapping=fast,
                          verbose=False)
            enc = self.tokenizer(*args, truncation=False, **kwargs)
            n = len(enc["input_ids"])
            dropped = 0
            if n > self.max_length:
                if not truncation:
                    raise InputError(
                        f"input {i} has {n} tokens, more than the model's maximum of {self.max_length} "
                        "(pass truncation=True to cut it)"
                    )
                enc = self.tokenizer(*args, truncation=True, max_length=self.max_length, **kwargs)
                dropped = n - len(enc["input_ids"])
                too_long.append((i, dropped))
            ids = [int(x) for x in enc["input_ids"]]
            if len(ids) > self.max_length:  # a tokenizer cannot cut a pair below its special tokens
                raise InputError(f"input {i}: max_length={self.max_length} is too short for its special tokens")
            if all(enc["special_tokens_mask"]):  # nothing but [CLS]/[SEP]: there is nothing to explain
                cut = f" after truncation to {self.max_length} tokens" if dropped else ""
                raise InputError(f"input {i} has no token to explain{cut} (only special tokens): {text!r:.80}")
            encoded.append(
                Encoded(
                    text=text,
                    ids=ids,
                    type_ids=[int(x) for x in enc["token_type_ids"]] if "token_type_ids" in enc else None,
                    special=[bool(x) for x in enc["special_tokens_mask"]],
                    tokens=self.tokenizer.convert_ids_to_tokens(ids),
                    word_ids=enc.word_ids() if fast else None,
                    sequence_ids=enc.sequence_ids() if fast else None,
                    offsets=[tuple(o) for o in enc["offset_mapping"]] if fast else None,
                    dropped=dropped,
                )
            )
        if too_long:
            detail = ", ".join(f"input {i}: {d} tokens" for i, d in too_long[:5])
            more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
            warnings.warn(
                f"{len(too_long)} input(s) longer than {self.max_length} tokens were truncated ({detail}{more} "
                "dropped)",
                stacklevel=3,
            )
        self._warn_unknown(encoded)
        rows = self.model.get_input_embeddings().num_embeddings
        worst = max(max(e.ids) for e in encoded)
        if worst >= rows:
            raise ModelError(
                f"the tokenizer produced token id {worst} but the model has only {rows} embeddings: "
                "tokenizer and model do not belong together"
            )
        return encoded

    def _warn_unknown(self, encoded: list[Encoded]) -> None:
        """Warn when most tokens of the inputs are the unknown token: the tokenizer is likely not the model's."""
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is None:
            return
        words = [i for e in encoded for i, s in zip(e.ids, e.special, strict=True) if not s]
        unknown = sum(i == unk for i in words)
        if words and unknown > UNKNOWN_WARNING_FRACTION * len(words):
            warnings.warn(
                f"{unknown} of the {len(words)} tokens of the inputs are unknown to the tokenizer "
                f"({self.tokenizer.unk_token}): the explanation is of {self.tokenizer.unk_token} tokens; "
                "is this the tokenizer the model was trained with?",
                stacklevel=4,
            )

    def _inputs(
        self,
        ids: Sequence[Sequence[int]],
        type_ids: Sequence[Sequence[int] | None] | None = None,
        masks: Sequence[Sequence[int]] | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Right-padded model inputs and the ``(B, N)`` mask of real tokens."""
        return pad_batch(ids, self.pad_id, self.device, type_ids=type_ids, masks=masks,
                         with_types=self._takes_token_types)

    def _effective_batch_size(self, batch_size: int) -> int:
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise InputError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        if finds_last_token_by_padding(self.model):
            if batch_size > 1:
                warnings.warn(
                    "the model's config has no pad_token_id, so its head cannot find the last token of a padded "
                    "batch; explaining one input at a time (set model.config.pad_token_id to batch)",
                    stacklevel=3,
                )
            return 1
        return batch_size

    def _head_without_padding(self, token_mask: torch.Tensor) -> AbstractContextManager[Any]:
        """Decoder-only models without a pad id get a temporary one, so that integrated gradients (Captum expands
        each input to a batch of ``n_steps`` copies) runs; inputs then go one at a time (_effective_batch_size)."""
        if not finds_last_token_by_padding(self.model):
            return nullcontext()
        if not bool(token_mask.bool().all()):
            raise ModelError("the model's config has no pad_token_id, so its head cannot find the last token of a "
                             "padded batch: pass one input per batch, or set model.config.pad_token_id")
        return last_token_head(self.model)

    # ---------------------------------------------------------------- explain
    def explain(
        self,
        texts: TextInput | Sequence[TextInput],
        methods: str | Sequence[str] | None = "all",
        *,
        target: Any = None,
        batch_size: int = 32,
        target_kind: str = "logit",
        truncation: bool = True,
        progress: bool = False,
        options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> list[Explanation]:
        """Explain each input with each method; one shared forward/backward pass per batch serves them all.

        Args:
            texts: a string, a ``(text_a, text_b)`` pair, or a list of them.
            methods: ``"all"``, a comma-separated string or a list of method ids (see ``list_methods()``).
            target: ``None`` (each input's predicted class; multi-label: its highest-scoring label; QA: its
                predicted answer span), a class index, a label name, a QA ``(start, end)`` span with end >= start,
                or one per input.
            batch_size: inputs per padded batch (inputs are sorted by length internally).
            target_kind: explain the ``"logit"`` (default), the ``"probability"``, or ``"loss"`` (the
                log-probability of ``target``, i.e. minus the cross-entropy; pass the gold labels as ``target``).
            truncation: cut inputs longer than the model's maximum (with a warning) instead of raising.
            progress: show a progress bar.
            options: per-method options, e.g. ``{"attcat": {"hidden": "output", "alpha": "cls"}}``.

        Returns:
            One :class:`Explanation` per input, in input order.
        """
        if target_kind not in TARGET_KINDS:
            raise InputError(f"target_kind={target_kind!r}; choose one of {', '.join(TARGET_KINDS)}")
        method_ids = resolve_methods(methods)
        requested = list(method_ids)
        specs = [get_method(m) for m in method_ids]
        words = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else list(methods or ["all"])
        asked_all = "all" in words
        reasons = {s.name: s.unsupported(self.model, self.stream, self.head.task) for s in specs}
        if asked_all:  # "all" means every method that applies to this model
            skipped = {m: r for m, r in reasons.items() if r}
            if skipped:
                warnings.warn(f"skipping {', '.join(skipped)}: " + "; ".join(dict.fromkeys(skipped.values())),
                              stacklevel=2)
            specs = [s for s in specs if s.name not in skipped]
            method_ids = [s.name for s in specs]
        else:
            for s in specs:
                if reasons[s.name]:
                    raise InputError(reasons[s.name])
        options = _check_options_mapping(options)
        for name in options:
            if name not in requested:
                raise InputError(f"options given for {name!r}, which is not among the requested methods")
        method_options = {s.name: s.check_options(dict(options.get(s.name, {}))) for s in specs}
        if target_kind == "loss" and target is None:
            raise InputError("target_kind='loss' explains the loss against given labels: pass them as target=")
        needs = set().union(*(s.needs for s in specs))
        gradients = GRADIENTS in needs

        encoded = self.encode(texts, truncation=truncation)
        targets = self.head.resolve_targets(target, len(encoded), self.labels)
        self.head.check_targets([len(e.ids) for e in encoded], targets)
        size = self._effective_batch_size(batch_size)
        results: list[Explanation | None] = [None] * len(encoded)
        with explaining(self.model), tqdm(total=len(encoded), disable=not progress, desc="explaining",
                                          unit="input") as bar:
            for idx in length_sorted_chunks([len(e.ids) for e in encoded], size):
                batch = [encoded[i] for i in idx]
                for i, exp in zip(idx, self._explain_batch(batch, [targets[i] for i in idx], specs,
                                                           method_options, target_kind, gradients), strict=True):
                    results[i] = exp
                bar.update(len(idx))
        return results  # type: ignore[return-value]

    def _context(self, batch: list[Encoded], target_kind: str) -> BatchContext:
        inputs, token_mask = self._inputs([e.ids for e in batch], [e.type_ids for e in batch])
        special = torch.zeros_like(token_mask, dtype=torch.bool)
        for b, e in enumerate(batch):
            special[b, : len(e.special)] = torch.tensor(e.special)
        answer_mask = self.head.answer_mask(batch, token_mask)
        return BatchContext(
            model=self.model,
            adapter=self.adapter,
            inputs=inputs,
            token_mask=token_mask,
            special_mask=special,
            targets=torch.zeros(len(batch), dtype=torch.long),
            target_kind=target_kind,
            stream=self.stream,
            tokenizer=self.tokenizer,
            head=self.head,
            answer_mask=answer_mask,
        )

    def compute_batch(
        self, batch: list[Encoded], targets: list[Any], specs: list[Any], method_options: dict[str, dict[str, Any]],
        target_kind: str = "logit", gradients: bool | None = None,
    ) -> tuple[BatchContext, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
        """Scores of one padded batch in token space: ``{method: (scores (B, N), layers (B, L, N) | None)}``.

        Padding positions are exactly zero. Used by :meth:`explain`; public for tests and evaluation code.
        """
        if gradients is None:
            gradients = any(GRADIENTS in s.needs for s in specs)
        ctx = self._context(batch, target_kind)
        wanted, unresolved = self.head.pending(targets, ctx.token_mask.device)
        if gradients and bool(unresolved.any()) and not bool(unresolved.all()):
            # The backward pass needs every target up front: resolve "predicted" entries with a cheap forward.
            with torch.no_grad(), explaining(self.model):
                logits = self.head.logits(self.model(**ctx.inputs))
            wanted = torch.where(unresolved, self.head.predicted(logits, ctx.token_mask, ctx.answer_mask), wanted)
            unresolved = torch.zeros_like(unresolved)
        with explaining(self.model), self._head_without_padding(ctx.token_mask):
            keep, differentiate = capture_request(specs)
            capture, _ = run_capture(
                self.model, self.adapter, ctx.inputs, ctx.token_mask, self.stream,
                None if bool(unresolved.all()) else wanted, target_kind, gradients=gradients, head=self.head,
                answer_mask=ctx.answer_mask, keep=keep, differentiate=differentiate,
            )
            ctx.targets = torch.where(
                unresolved, self.head.predicted(capture.logits, ctx.token_mask, ctx.answer_mask), wanted)
            ctx.capture = capture
            out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
            mask = ctx.token_mask.to(capture.logits.dtype)
            for spec in specs:
                with torch.set_grad_enabled(OWN_PASS in spec.needs):  # capture-only methods need no graph
                    result = spec.compute(ctx, **method_options.get(spec.name, {}))
                scores, layers = result.scores.detach(), None if result.layers is None else result.layers.detach()
                if result.space == "keys":  # zero keys the explained row cannot see, then map keys to tokens
                    key_mask = capture.key_mask.to(scores.dtype)
                    scores = self.adapter.keys_to_tokens(scores * key_mask, self.stream)
                    layers = None if layers is None else self.adapter.keys_to_tokens(
                        layers * key_mask[:, None, :], self.stream)
                scores = scores * mask
                layers = None if layers is None else layers * mask[:, None, :]
                out[spec.name] = (scores, layers)
        return ctx, out

    def _explain_batch(
        self, batch: list[Encoded], targets: list[Any], specs: list[Any], method_options: dict[str, dict[str, Any]],
        target_kind: str, gradients: bool,
    ) -> list[Explanation]:
        ctx, out = self.compute_batch(batch, targets, specs, method_options, target_kind, gradients)
        probs = self.head.probabilities(ctx.capture.logits, ctx.token_mask).cpu().numpy()
        predicted = self.head.prediction(ctx.capture.logits, ctx.token_mask, ctx.answer_mask)
        chosen = ctx.targets.cpu().tolist()
        explanations = []
        meta = {
            "model": self.name,
            "family": self.adapter.family,
            "attention": self.stream,
            "target_kind": target_kind,
            **self.head.meta(),
            "options": {k: v for k, v in method_options.items() if v},
            "attnlens": __version__,
        }
        # one device->host copy per method and batch, then cheap numpy slices per example
        host = {m: (s.double().cpu().numpy(), None if lay is None else lay.double().cpu().numpy())
                for m, (s, lay) in out.items()}
        for b, e in enumerate(batch):
            n = len(e.ids)
            scores = {m: s[b, :n].copy() for m, (s, _) in host.items()}
            layers = {m: lay[b, :, :n].copy() for m, (_, lay) in host.items() if lay is not None}
            explanations.append(
                Explanation(
                    text=e.text,
                    tokens=list(e.tokens),
                    special=list(e.special),
                    target=chosen[b],
                    predicted=predicted[b],
                    probabilities=self.head.shown_probabilities(probs[b], chosen[b]),
                    scores=scores,
                    layers=layers,
                    labels=self.labels or None,
                    word_ids=e.word_ids,
                    sequence_ids=e.sequence_ids,
                    offsets=e.offsets,
                    input_ids=list(e.ids),
                    token_type_ids=e.type_ids,
                    meta={**meta, "truncated_tokens": e.dropped} if e.dropped else dict(meta),
                )
            )
            self.head.annotate(explanations[-1])
        return explanations

    # ------------------------------------------------------------ prediction
    def predict_proba(
        self,
        input_ids: Sequence[Sequence[int]],
        token_type_ids: Sequence[Sequence[int] | None] | None = None,
        attention_masks: Sequence[Sequence[int]] | None = None,
        *,
        batch_size: int = 64,
    ) -> np.ndarray:
        """Class probabilities ``(n, C)`` for token-id sequences of any lengths (no gradients, length-sorted
        batches, SDPA attention while scoring); multi-label models give each label's independent sigmoid.
        ``attention_masks`` (one 0/1 list per sequence) lets callers hide tokens without deleting them."""
        self.head.check_predict_proba()
        if len(input_ids) == 0:
            return np.zeros((0, int(self.model.config.num_labels)))
        rows = self.model.get_input_embeddings().num_embeddings
        for i, ids in enumerate(input_ids):
            if len(ids) == 0 or min(ids) < 0 or max(ids) >= rows:
                raise InputError(f"input_ids[{i}] must be a non-empty list of token ids in 0..{rows - 1}")
        return predict_batches(self.model, input_ids, self.pad_id, self._effective_batch_size(batch_size),
                               type_ids=token_type_ids, masks=attention_masks, with_types=self._takes_token_types,
                               probabilities=self.head.probabilities)

    @torch.no_grad()
    def attention_maps(self, text: TextInput) -> tuple[list[str], list[bool], np.ndarray]:
        """Tokens, special flags and the attention probabilities ``(L, H, N, N)`` of the explained stream.

        Rows and columns are the stream's query and key positions: the input tokens, except in BART's decoder
        stream, whose position i holds input token i - 1 (position 0 is the decoder start token)."""
        (e,) = self.encode([text] if not isinstance(text, list) else [tuple(text)])
        ctx = self._context([e], "logit")
        with explaining(self.model):
            capture, _ = run_capture(self.model, self.adapter, ctx.inputs, ctx.token_mask, self.stream, None,
                                     "logit", gradients=False, head=self.head, keep={ATTENTION})
        att = torch.stack(capture.attentions, 0)[:, 0]  # (L, H, Q, K)
        return list(e.tokens), list(e.special), att.float().cpu().numpy()


def _check_options_mapping(options: Any) -> dict[str, dict[str, Any]]:
    """``options`` as a dict of per-method option dicts; anything else is an :class:`InputError`."""
    if options is None:
        return {}
    example = 'e.g. {"attcat": {"alpha": "cls"}}'
    if not isinstance(options, Mapping):
        raise InputError(f"options must map method ids to option dicts ({example}), got {options!r:.80}")
    out: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if not isinstance(name, str) or not isinstance(value, Mapping):
            raise InputError(f"options must map method ids to option dicts ({example}), got {name!r}: {value!r:.60}")
        out[name] = dict(value)
    return out
