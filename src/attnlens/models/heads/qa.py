"""Extractive question answering: start and end logits ``(B, N, 2)``, a target is a span of token positions,
the explained scalar start logit + end logit; the predicted span decoded as SQuAD does (:func:`best_spans`)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...errors import InputError, ModelError
from .classification import PREDICTED, TARGET_KINDS, Head


def best_spans(start: torch.Tensor, end: torch.Tensor, allowed: torch.Tensor, max_answer_length: int) -> torch.Tensor:
    """SQuAD span decoding: per example the ``(s, e)`` maximising ``start[s] + end[e]`` with ``s <= e <
    s + max_answer_length`` and both positions ``allowed``.

    Args:
        start, end: ``(B, N)`` start and end logits.
        allowed: ``(B, N)`` positions an answer may use (the context's tokens, never special tokens); an example
            with no allowed position falls back on all positions.
        max_answer_length: longest answer in tokens.

    Returns:
        ``(B, 2)`` long tensor of start and end positions.
    """
    allowed = allowed.bool()
    allowed = torch.where(allowed.any(1, keepdim=True), allowed, torch.ones_like(allowed))
    n = start.shape[1]
    pos = torch.arange(n, device=start.device)
    length = pos[None, :] - pos[:, None]  # [s, e] -> e - s
    valid = (length >= 0) & (length < max_answer_length)
    valid = valid[None] & allowed[:, :, None] & allowed[:, None, :]
    total = start.detach().float()[:, :, None] + end.detach().float()[:, None, :]
    flat = total.masked_fill(~valid, float("-inf")).flatten(1).argmax(1)
    return torch.stack([flat // n, flat % n], 1)


class QAHead(Head):
    """Extractive question answering: start and end logits over the tokens.

    Args:
        max_answer_length: longest predicted answer span in tokens (30, as HF's question-answering pipeline).
    """

    task = "qa"
    model_suffix = "ForQuestionAnswering"
    auto_class = "AutoModelForQuestionAnswering"
    kind = "an extractive QA model"

    def __init__(self, max_answer_length: int = 30) -> None:
        self.max_answer_length = max_answer_length

    def logits(self, outputs: Any) -> torch.Tensor:
        return torch.stack([outputs.start_logits, outputs.end_logits], -1)

    def _masked(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(~token_mask.bool()[..., None], torch.finfo(logits.dtype).min)

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, 2)`` best spans (:func:`best_spans`) within ``answer_mask`` (default: all real tokens)."""
        allowed = token_mask if answer_mask is None else answer_mask.bool() & token_mask.bool()
        return best_spans(logits[..., 0], logits[..., 1], allowed, self.max_answer_length)

    def values(self, logits: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        if kind == "logit":
            return logits
        masked = self._masked(logits, token_mask)
        if kind == "probability":
            return masked.softmax(1)
        if kind == "loss":
            return masked.log_softmax(1)
        raise ValueError(f"unknown target kind {kind!r}; choose one of {', '.join(TARGET_KINDS)}")

    def scalar(self, logits: torch.Tensor, targets: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        values = self.values(logits, kind, token_mask)  # (B, N, 2)
        start = values[..., 0].gather(1, targets[:, :1]).squeeze(1)
        end = values[..., 1].gather(1, targets[:, 1:]).squeeze(1)
        if kind == "probability":  # probability of the span
            return start * end
        return start + end

    def probabilities(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return self._masked(logits.float(), token_mask).softmax(1)

    rows_from_targets = True
    query_rows_per_input = 2

    def explained_rows(self, targets: torch.Tensor | None) -> torch.Tensor | None:
        """The span's start and end: the rows whose states the head reads."""
        return targets

    def last_read_row(self, targets: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
        """The later of the span's start and end rows."""
        return None if targets is None else targets.max(1).values

    def query_weights(self, targets: torch.Tensor | None, n_queries: int) -> torch.Tensor | None:
        """Half on the span's start row, half on its end row (the whole weight on one row for a one-token span):
        the attention methods read the rows the start and end logits are read from."""
        if targets is None:
            return None
        one_hot = torch.nn.functional.one_hot(targets, n_queries).to(torch.float64)
        return one_hot.mean(1)

    def read_rows(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The start logit (column 0) at each span's start and the end logit (column 1) at its end."""
        example = torch.arange(targets.shape[0], device=targets.device)
        return (torch.cat([example, example]), torch.cat([targets[:, 0], targets[:, 1]]),
                torch.cat([torch.zeros_like(example), torch.ones_like(example)]))

    # ---------------------------------------------------------------- targets
    def labels(self, config: Any) -> list[str]:
        """QA models have no class names."""
        return []

    def resolve_targets(self, target: Any, n: int, labels: list[str]) -> list[Any]:
        """A user target (``None``, a ``(start, end)`` pair, or one per input) as ``n`` checked spans,
        ``(PREDICTED, PREDICTED)`` for "the predicted span"."""
        if isinstance(target, (np.ndarray, torch.Tensor)):
            target = target.tolist()
        # two integers are one span, as a tuple or a list ([7, 9]): one per input would be spans, not integers
        if target is None or (isinstance(target, (tuple, list)) and len(target) == 2
                              and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in target)):
            return [_span(target)] * n
        if not isinstance(target, Sequence) or isinstance(target, str) or len(target) != n:
            raise InputError(f"target must be None, a (start, end) pair, or a list with one per input ({n} inputs)")
        return [_span(t) for t in target]

    def check_targets(self, lengths: list[int], targets: list[Any]) -> None:
        for i, (n, t) in enumerate(zip(lengths, targets, strict=True)):
            if max(t) >= n:
                raise InputError(f"target span {t} of input {i} is beyond its {n} tokens")

    def locate(self, encoded: list[Any], targets: list[Any]) -> list[Any]:
        """The targets as they are; a warning where an input is one text rather than a (question, context) pair
        (its answer is then sought in all of it)."""
        single = [i for i, e in enumerate(encoded) if isinstance(e.text, str)]
        if single:
            warnings.warn(f"an extractive QA model reads (question, context) pairs, but input {single[0]} is one "
                          "text: its answer is sought anywhere in it, without a question", stacklevel=4)
        return super().locate(encoded, targets)

    def pending(self, targets: list[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        wanted = torch.tensor(targets, dtype=torch.long, device=device)
        return wanted, (wanted < 0).any(-1, keepdim=True)

    def answer_mask(self, batch: list[Any], like: torch.Tensor) -> torch.Tensor | None:
        """The non-special tokens of each input's context (:func:`context_positions`)."""
        mask = torch.zeros_like(like, dtype=torch.bool)
        for b, e in enumerate(batch):
            mask[b, : len(e.ids)] = torch.tensor(context_positions(e))
        return mask

    # ---------------------------------------------------------------- display
    def shown_probabilities(self, probs: np.ndarray, target: Any) -> list[float]:
        """The probabilities of the explained start and end positions."""
        return [float(probs[target[0], 0]), float(probs[target[1], 1])]

    def meta(self) -> dict[str, Any]:
        return {"task": self.task, "max_answer_length": self.max_answer_length}

    def annotate(self, explanation: Any) -> None:
        """The explained and predicted spans as text, for JSON readers."""
        explanation.meta.update(answer=explanation.span_text(),
                                predicted_answer=explanation.span_text(explanation.predicted))

    # ------------------------------------------------------------------ checks
    def check_predict_proba(self) -> None:
        raise ModelError("predict_proba is for sequence classifiers; this is a QA model")

    def with_max_answer_length(self, value: int) -> Head:
        return qa_head(value)


def _span(t: Any) -> tuple[int, int]:
    """One QA target: ``None`` (the predicted span) or a ``(start, end)`` pair with ``0 <= start <= end``."""
    if t is None:
        return (PREDICTED, PREDICTED)
    if (isinstance(t, (tuple, list)) and len(t) == 2
            and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in t) and min(t) >= 0):
        if int(t[1]) < int(t[0]):
            raise InputError(f"QA target span {tuple(int(x) for x in t)} ends before it starts: "
                             "give (start, end) with end >= start")
        return (int(t[0]), int(t[1]))
    raise InputError(f"a QA target is a (start, end) pair of token positions (>= 0), got {t!r}")


def context_positions(e: Any) -> list[bool]:
    """Token positions an extractive QA answer may use: the non-special tokens of the context, which is the
    second sequence of a (question, context) pair (sequence id 1, else token type 1); all non-special tokens of
    a single text. ``e`` is an :class:`~attnlens.core.encoding.Encoded` input."""
    if isinstance(e.text, list):
        if e.sequence_ids is not None:
            return [s == 1 and not sp for s, sp in zip(e.sequence_ids, e.special, strict=True)]
        if e.type_ids is not None and any(e.type_ids):
            return [t == 1 and not sp for t, sp in zip(e.type_ids, e.special, strict=True)]
        raise InputError("this tokenizer marks neither which tokens are the context nor token types, so an answer "
                         "could be read from the question: load the model's fast tokenizer (use_fast=True)")
    return [not sp for sp in e.special]


QA = QAHead()


def qa_head(max_answer_length: int) -> QAHead:
    if isinstance(max_answer_length, bool) or not isinstance(max_answer_length, int) or max_answer_length < 1:
        raise InputError(f"max_answer_length must be a positive number of tokens, got {max_answer_length!r}")
    return QA if max_answer_length == QA.max_answer_length else QAHead(max_answer_length)
