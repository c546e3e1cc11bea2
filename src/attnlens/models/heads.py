"""What the model predicts and which scalar an explanation is of: sequence classification (single- or
multi-label), token classification or extractive QA.

- ``classification`` (``…ForSequenceClassification``): logits ``(B, C)``, a target is a class index.
- multi-label classification (``config.problem_type == "multi_label_classification"``): the same logits, but
  each label has its own independent probability ``sigmoid(logit)``; the predicted labels are those with
  p > 0.5 and the default explained target is the highest-scoring label.
- ``token`` (``…ForTokenClassification``, e.g. NER): logits ``(B, N, C)``; a target is one token's label: a
  ``(position, label)`` pair (the position a token index or a word of the input, the label defaulting to the
  label the model predicts there). Attention methods read that token's query row; the explained scalar is that
  token's label logit / probability / log-probability.
- ``qa`` (``…ForQuestionAnswering``): logits ``(B, N, 2)`` (start, end), a target is a ``(start, end)`` pair of
  token positions; the explained scalar is start logit + end logit, which equals the sum of the two separate
  explanations for every method linear in the gradient (the AttCAT authors explain both and add them). The
  predicted span is decoded as SQuAD does (:func:`best_spans`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import InputError, ModelError
from .prefixes import last_positions

TARGET_KINDS = ("logit", "probability", "loss")
PREDICTED = -1  # an internal target entry meaning "the model's prediction" (QA: both positions of the span)


class Head:
    """Sequence classification head (one label per input: softmax over the classes)."""

    task = "classification"
    multi_label = False
    model_suffix = "ForSequenceClassification"  # the HF model classes this head reads
    auto_class = "AutoModelForSequenceClassification"  # how from_pretrained loads one
    kind = "a sequence classifier"  # how messages name such a model

    def logits(self, outputs: Any) -> torch.Tensor:
        return outputs.logits

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The default explained target of each example: the highest-scoring class."""
        return logits.detach().argmax(-1)

    def prediction(self, logits: torch.Tensor, token_mask: torch.Tensor,
                   answer_mask: torch.Tensor | None = None) -> list[Any]:
        """What the model predicts, one entry per example, as :attr:`Explanation.predicted` stores it."""
        return self.predicted(logits, token_mask, answer_mask).cpu().tolist()

    def values(self, logits: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        """Per-class values of the target kind: logits, probabilities or log-probabilities."""
        if kind == "logit":
            return logits
        if kind == "probability":
            return logits.softmax(-1)
        if kind == "loss":  # minus cross-entropy, so that positive still means "supports the label"
            return logits.log_softmax(-1)
        raise ValueError(f"unknown target kind {kind!r}; choose one of {', '.join(TARGET_KINDS)}")

    def scalar(self, logits: torch.Tensor, targets: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        """``(B,)`` explained scalar; summing it over a batch keeps the examples independent."""
        return self.values(logits, kind, token_mask).gather(-1, targets.view(-1, 1)).squeeze(-1)

    def probabilities(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return logits.float().softmax(-1)

    # ---------------------------------------------------------------- targets
    def labels(self, config: Any) -> list[str]:
        """Class names in index order (``id2label``)."""
        n = int(config.num_labels)
        id2label = getattr(config, "id2label", None) or {}
        return [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(n)]

    def resolve_targets(self, target: Any, n: int, labels: list[str]) -> list[Any]:
        """A user target (``None``, a class index, a label name, or one per input) as ``n`` checked class
        indices, :data:`PREDICTED` for "the predicted class"."""
        if target is None or isinstance(target, (int, str, np.integer)):
            return [self._resolve_one(target, labels)] * n
        if isinstance(target, torch.Tensor):
            target = target.tolist()
        if not isinstance(target, Sequence) or len(target) != n:
            raise InputError(
                f"target must be None, a class index, a label name, or a list with one per input ({n} inputs)"
            )
        return [self._resolve_one(t, labels) for t in target]

    def _resolve_one(self, t: Any, labels: list[str]) -> int:
        if t is None:
            return PREDICTED
        if isinstance(t, str):
            lowered = {name.lower(): i for i, name in enumerate(labels)}
            if t.lower() in lowered:
                return lowered[t.lower()]
            if t.lstrip("-").isdigit():
                return self._resolve_one(int(t), labels)
            raise InputError(f"unknown label {t!r}; the model's labels are: {', '.join(labels)}")
        if isinstance(t, (int, np.integer)) and not isinstance(t, bool):
            if not 0 <= int(t) < len(labels):
                raise InputError(
                    f"target {t} is out of range: the model has {len(labels)} classes (0..{len(labels) - 1})"
                )
            return int(t)
        raise InputError(f"target must be a class index or label name, got {t!r}")

    def check_targets(self, lengths: list[int], targets: list[Any]) -> None:
        """Check resolved targets against the inputs' token counts (class indices need no check)."""

    def pending(self, targets: list[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Targets as a tensor, and the mask of the :data:`PREDICTED` entries, shaped to ``torch.where`` one
        with :meth:`predicted`."""
        wanted = torch.tensor(targets, dtype=torch.long, device=device)
        return wanted, wanted < 0  # PREDICTED (compute_batch callers may pass any negative)

    def answer_mask(self, batch: list[Any], like: torch.Tensor) -> torch.Tensor | None:
        """``(B, N)`` positions an answer may use (QA only; ``None`` here)."""
        return None

    def resolve(self, wanted: torch.Tensor, unresolved: torch.Tensor, logits: torch.Tensor,
                token_mask: torch.Tensor, answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The targets of :meth:`pending` with their :data:`PREDICTED` entries replaced by the prediction."""
        return torch.where(unresolved, self.predicted(logits, token_mask, answer_mask), wanted)

    def explained_positions(self, targets: torch.Tensor | None) -> torch.Tensor | None:
        """``(B,)`` the query position each example's explanation is of, where the target says it (token
        classification); ``None``: where the architecture's head reads (the adapter's classification position)."""
        return None

    def query_weights(self, targets: torch.Tensor | None, n_queries: int) -> torch.Tensor | None:
        """``(B, Q)`` weights of the explained query rows (``Capture.query_weights``) where the target says them:
        one-hot at :meth:`explained_positions`, uniform over several rows for a head that reads several
        (:class:`AnswerHead`, :class:`QAHead`); ``None``: where the architecture's head reads."""
        positions = self.explained_positions(targets)
        return None if positions is None else torch.nn.functional.one_hot(positions, n_queries)

    # the explained query rows depend on the targets, so a pass keeping only some rows needs them resolved first
    rows_from_targets = False
    # how many query rows of each input the explanation reads (the memory estimates)
    query_rows_per_input = 1

    def explained_rows(self, targets: torch.Tensor | None) -> torch.Tensor | None:
        """The positions of every query row :meth:`query_weights` weighs (any shape; repeats allowed), where a head
        reads several rows the targets name (a QA span's start and end, the rows predicting an answer's tokens);
        ``None``: the one row of :meth:`explained_positions` or the architecture's head."""
        return None

    # how many positions of each input's logits :meth:`logit_positions` reads (0: all; the memory estimates)
    logit_positions_per_input = 0

    def logit_positions(self, token_mask: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
        """``(K,)`` the positions, ascending, of a language model's ``(B, N, V)`` logits this head reads, when it
        reads only some (the pass then projects only those onto the vocabulary,
        :class:`~attnlens.core.logit_rows.LogitRows`); ``None``: it reads the model's whole output."""
        return None

    def targets_at(self, targets: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``targets`` read against logits kept at ``positions`` only: targets indexed by position are re-indexed;
        class and token ids stay as they are."""
        return targets

    def read_rows(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a head whose scalar sums logits read at token positions the targets name (a token's label, an
        extractive span's start and end, an answer's tokens): ``(example, position, class)`` index vectors of
        every value read (methods that decompose the logits, DecompX, decompose each at its position); ``None``
        where the scalar is read where the architecture's head reads (a pooled state)."""
        return None

    def locate(self, encoded: list[Any], targets: list[Any]) -> list[Any]:
        """Resolved targets checked against the encoded inputs (:class:`~attnlens.core.encoding.Encoded`), with
        anything that needs the tokens filled in (token classification: words as token positions)."""
        return targets

    # ---------------------------------------------------------------- display
    def shown_probabilities(self, probs: np.ndarray, target: Any) -> list[float]:
        """What :attr:`Explanation.probabilities` stores of one example's probabilities: every class."""
        return [float(p) for p in probs]

    def shown(self, logits: torch.Tensor, token_mask: torch.Tensor, targets: torch.Tensor) -> list[list[float]]:
        """:attr:`Explanation.probabilities` of each example of a batch (:meth:`shown_probabilities` of its
        :meth:`probabilities`)."""
        probs = self.probabilities(logits, token_mask).cpu().numpy()
        return [self.shown_probabilities(probs[b], t) for b, t in enumerate(targets.cpu().tolist())]

    def meta(self) -> dict[str, Any]:
        """The head's entries of every explanation's metadata."""
        return {"task": self.task}

    def annotate(self, explanation: Any) -> None:
        """Add per-example metadata to an explanation (nothing for classifiers)."""

    # ------------------------------------------------------------------ checks
    def check_predict_proba(self) -> None:
        """Raise when :meth:`Explainer.predict_proba` does not apply (it does to classifiers)."""

    def with_max_answer_length(self, value: int) -> Head:
        raise InputError("max_answer_length applies to extractive QA models only")


class MultiLabelHead(Head):
    """Multi-label classification: every label is an independent yes/no with probability ``sigmoid(logit)``."""

    multi_label = True
    threshold = 0.5

    def values(self, logits: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        """Per-label values: logits, sigmoid probabilities or log-sigmoid (minus the label's BCE loss when
        the label is present)."""
        if kind == "logit":
            return logits
        if kind == "probability":
            return logits.sigmoid()
        if kind == "loss":
            return torch.nn.functional.logsigmoid(logits)
        raise ValueError(f"unknown target kind {kind!r}; choose one of {', '.join(TARGET_KINDS)}")

    def probabilities(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return logits.float().sigmoid()

    def prediction(self, logits: torch.Tensor, token_mask: torch.Tensor,
                   answer_mask: torch.Tensor | None = None) -> list[Any]:
        """The labels with p > 0.5 of each example (ascending; possibly none)."""
        on = self.probabilities(logits.detach(), token_mask) > self.threshold
        return [row.nonzero().flatten().tolist() for row in on.cpu()]

    def meta(self) -> dict[str, Any]:
        return {"task": self.task, "problem_type": "multi_label_classification"}


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
        if target is None or (isinstance(target, tuple) and len(target) == 2
                              and all(isinstance(x, (int, np.integer)) for x in target)):
            return [_span(target)] * n
        if not isinstance(target, Sequence) or len(target) != n:
            raise InputError(f"target must be None, a (start, end) pair, or a list with one per input ({n} inputs)")
        return [_span(t) for t in target]

    def check_targets(self, lengths: list[int], targets: list[Any]) -> None:
        for i, (n, t) in enumerate(zip(lengths, targets, strict=True)):
            if max(t) >= n:
                raise InputError(f"target span {t} of input {i} is beyond its {n} tokens")

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
        return _qa_head(value)



def _span(t: Any) -> tuple[int, int]:
    """One QA target: ``None`` (the predicted span) or a ``(start, end)`` pair with ``0 <= start <= end``."""
    if t is None:
        return (PREDICTED, PREDICTED)
    if (isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, (int, np.integer)) for x in t)
            and min(t) >= 0):
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
    return [not sp for sp in e.special]


class TokenHead(Head):
    """Token classification (NER, POS tagging): one label per token; an explanation is of one token's label.

    Internal targets are ``(position, label)`` pairs, ``label`` :data:`PREDICTED` for the label the model
    predicts at ``position``. :class:`~attnlens.results.explanation.Explanation` shows the label as ``target`` and
    ``predicted`` (as for sequence classifiers), the token in ``meta["position"]`` / ``meta["token"]``, and every
    token's predicted label in ``meta["predicted_labels"]``.
    """

    task = "token"
    model_suffix = "ForTokenClassification"
    auto_class = "AutoModelForTokenClassification"
    kind = "a token classifier"

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, N)`` the predicted label of every token."""
        return logits.detach().argmax(-1)

    def prediction(self, logits: torch.Tensor, token_mask: torch.Tensor,
                   answer_mask: torch.Tensor | None = None) -> list[Any]:
        """The predicted label of every real token, one list per example."""
        labels = self.predicted(logits, token_mask).cpu()
        return [row[: int(n)].tolist() for row, n in zip(labels, token_mask.long().sum(1).cpu(), strict=True)]

    def scalar(self, logits: torch.Tensor, targets: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        """The value of label ``targets[:, 1]`` at token ``targets[:, 0]``."""
        rows = torch.arange(logits.shape[0], device=logits.device)
        return self.values(logits, kind, token_mask)[rows, targets[:, 0], targets[:, 1]]

    def read_rows(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Label ``targets[:, 1]`` at token ``targets[:, 0]``, one per example."""
        return torch.arange(targets.shape[0], device=targets.device), targets[:, 0], targets[:, 1]

    # ---------------------------------------------------------------- targets
    def resolve_targets(self, target: Any, n: int, labels: list[str]) -> list[Any]:
        """A user target (a token position or word, a ``(token, label)`` pair, or a list with one per input) as
        ``n`` ``(token, label)`` pairs; words stay strings until :meth:`locate` sees the tokens."""
        if target is None:
            raise InputError("a token classifier explains one token's label: pass the token as target= (its "
                             "position among the tokens, or a word of the input), or a (token, label) pair")
        if isinstance(target, (int, str, np.integer)) or (isinstance(target, tuple) and len(target) == 2):
            return [self._pair(target, labels)] * n
        if isinstance(target, torch.Tensor):
            target = target.tolist()
        if not isinstance(target, Sequence) or len(target) != n:
            raise InputError(f"target must be a token (position or word), a (token, label) pair, or a list with one "
                             f"per input ({n} inputs)")
        return [self._pair(t, labels) for t in target]

    def _pair(self, t: Any, labels: list[str]) -> tuple[int | str, int]:
        token, label = (t if isinstance(t, (tuple, list)) and len(t) == 2 else (t, None))
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, (int, str, np.integer)) or (
                not isinstance(token, str) and token < 0):
            raise InputError(f"the explained token is a position (>= 0) or a word of the input, got {token!r}")
        return (token if isinstance(token, str) else int(token), self._resolve_one(label, labels))

    def locate(self, encoded: list[Any], targets: list[Any]) -> list[Any]:
        """Words as the position of their first token; positions checked: within the input and not a special
        token (a token classifier is not trained on their labels)."""
        out = []
        for i, (e, (token, label)) in enumerate(zip(encoded, targets, strict=True)):
            position = _word_position(e, token, i) if isinstance(token, str) else token
            n = len(e.ids)
            if position >= n:
                raise InputError(f"token position {position} is beyond input {i}'s {n} tokens (0..{n - 1})")
            if e.special[position]:
                raise InputError(f"token {position} of input {i} is the special token {e.tokens[position]!r}, whose "
                                 "label a token classifier is not trained on: pick a token of the text")
            out.append((position, label))
        return out

    def check_targets(self, lengths: list[int], targets: list[Any]) -> None:
        for i, (n, (position, _)) in enumerate(zip(lengths, targets, strict=True)):
            if not isinstance(position, int) or position >= n:
                raise InputError(f"token position {position} is beyond input {i}'s {n} tokens (0..{n - 1})")

    def pending(self, targets: list[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        wanted = torch.tensor(targets, dtype=torch.long, device=device).view(-1, 2)
        return wanted, torch.stack([torch.zeros_like(wanted[:, 0], dtype=torch.bool), wanted[:, 1] < 0], 1)

    def resolve(self, wanted: torch.Tensor, unresolved: torch.Tensor, logits: torch.Tensor,
                token_mask: torch.Tensor, answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted labels at the explained positions (the positions are always given)."""
        at = self.predicted(logits, token_mask).gather(1, wanted[:, :1])
        return torch.where(unresolved, torch.cat([wanted[:, :1], at], 1), wanted)

    def explained_positions(self, targets: torch.Tensor | None) -> torch.Tensor | None:
        return None if targets is None else targets[:, 0]

    # ---------------------------------------------------------------- display
    def shown_probabilities(self, probs: np.ndarray, target: Any) -> list[float]:
        """Every label's probability at the explained token."""
        return [float(p) for p in probs[target[0]]]

    def annotate(self, explanation: Any) -> None:
        """The explained token moves from ``target`` to ``meta``: ``target`` and ``predicted`` become that token's
        explained and predicted labels; every token's predicted label is kept by name in the metadata."""
        position, label = explanation.target
        per_token = list(explanation.predicted)
        explanation.target, explanation.predicted = int(label), int(per_token[position])
        explanation.meta.update(position=int(position), token=explanation.tokens[position],
                                predicted_labels=[explanation.label_name(int(k)) for k in per_token])

    # ------------------------------------------------------------------ checks
    def check_predict_proba(self) -> None:
        raise ModelError("predict_proba is for sequence classifiers; this is a token classifier")


def _word_position(e: Any, word: str, index: int) -> int:
    """The position of the first token of the first word of input ``e`` equal to ``word`` (case-insensitive)."""
    wanted = word.strip().lower()
    groups: dict[Any, list[int]] = {}
    for i, w in enumerate(e.word_ids or []):
        if w is not None and not e.special[i]:
            groups.setdefault((None if e.sequence_ids is None else e.sequence_ids[i], w), []).append(i)
    words = []
    for (seq, _), positions in groups.items():
        source = e.text[seq or 0] if isinstance(e.text, list) else e.text
        text = source[e.offsets[positions[0]][0]:e.offsets[positions[-1]][1]] if e.offsets else ""
        if text.lower() == wanted:
            return positions[0]
        words.append(text)
    if not groups:
        raise InputError("words can be explained only with a fast tokenizer (it knows where words are): pass the "
                         "token position instead")
    raise InputError(f"input {index} has no word {word!r}; its words: {' '.join(words)}")


CLASSIFICATION = Head()
QA = QAHead()
TOKEN = TokenHead()


MULTI_LABEL = MultiLabelHead()
# from_pretrained's task=, by name
TASKS: dict[str, Head] = {"classification": CLASSIFICATION, "qa": QA, "token": TOKEN}


class LMHead(Head):
    """Next-token prediction of a causal language model (``…ForCausalLM``, GPT-2's ``…LMHeadModel``).

    Logits are ``(B, N, V)``; the prediction read is the one at each input's last real token (inputs are
    right-padded), a target is a token id, and the explained scalar is that token's logit (probability,
    log-probability) there. A generation step is such an input: the prompt plus the tokens generated before it
    (:mod:`attnlens.results.generation`). ``vocab_size`` bounds the token ids a user may give.
    """

    task = "causal-lm"
    model_suffix = "ForCausalLM"
    model_suffixes: tuple[str, ...] = ("ForCausalLM", "LMHeadModel")
    auto_class = "AutoModelForCausalLM"
    kind = "a causal language model"

    def __init__(self, vocab_size: int = 0, decode: Callable[[int], str] | None = None) -> None:
        self.vocab_size = int(vocab_size)
        self.decode = decode  # token id -> its text, to name the explained and predicted tokens

    def annotate(self, explanation: Any) -> None:
        """The explained and the greedy next token as text (``meta["target_token"]``, ``"predicted_token"``)."""
        if self.decode is not None:
            explanation.meta["target_token"] = self.decode(int(explanation.target))
            explanation.meta["predicted_token"] = self.decode(int(explanation.predicted))

    def matches(self, model_class: str) -> bool:
        """Whether ``model_class`` (a class or ``config.architectures`` name) is one of this head's models."""
        return model_class.endswith(self.model_suffixes)

    def last(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        """``(B, V)`` logits at each input's last real position (the prediction of the next token)."""
        rows = torch.arange(logits.shape[0], device=logits.device)
        return logits[rows, last_positions(token_mask).to(logits.device)]

    logit_positions_per_input = 1

    def logit_positions(self, token_mask: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
        """Each input's last real position (distinct ones, ascending): the only logits a next token is read from."""
        return torch.unique(last_positions(token_mask))

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The greedy next token of each input."""
        return self.last(logits.detach(), token_mask).argmax(-1)

    def values(self, logits: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        return super().values(self.last(logits, token_mask), kind, token_mask)

    def probabilities(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return self.last(logits, token_mask).float().softmax(-1)

    def labels(self, config: Any) -> list[str]:
        return []  # the vocabulary is not a list of class names (and far too long to store per explanation)

    def _resolve_one(self, t: Any, labels: list[str]) -> int:
        if t is None:
            return PREDICTED
        if isinstance(t, (int, np.integer)) and not isinstance(t, bool):
            if not 0 <= int(t) < self.vocab_size:
                raise InputError(f"target token id {t} is out of range: the vocabulary has {self.vocab_size} tokens")
            return int(t)
        raise InputError(f"a language model's target is a token id, got {t!r}; to explain a continuation given "
                         "as text, use explain_generation(prompt, target=...)")

    def shown_probabilities(self, probs: np.ndarray, target: Any) -> list[float]:
        """The probability of the explained token only (not the whole vocabulary)."""
        return [float(probs[target])]

    def check_predict_proba(self) -> None:
        raise ModelError("predict_proba is for sequence classifiers; this is a language model")


class AnswerHead(LMHead):
    """A causal language model's answer as a whole: the explained scalar is the sum, over the answer's tokens,
    of each token's log-probability (``target_kind="loss"``; ``"logit"``: the sum of their logits;
    ``"probability"``: the answer's probability, the exponential of that sum) given everything before it.

    The input is prompt + answer; an internal target is one example's ``labels``: for each input position ``p``
    the id of the answer token at ``p + 1`` that the logits at ``p`` predict, or ``-1`` where nothing is read,
    as a causal LM's training labels (shifted). Gradient, LRP and decomposition methods then cost one pass for
    the whole answer; attention-row methods read the mean of the rows that predict the answer's tokens.
    Targets always come from the caller (:func:`answer_labels`): nothing is predicted. ``answer_tokens``: the
    answer's length where known (the memory estimates count the logits of its positions only).
    """

    task = "causal-lm"

    def __init__(self, vocab_size: int = 0, decode: Callable[[int], str] | None = None,
                 answer_tokens: int = 0) -> None:
        super().__init__(vocab_size, decode)
        self.logit_positions_per_input = answer_tokens + 1 if answer_tokens else 0
        self.query_rows_per_input = max(1, answer_tokens)

    def explained_rows(self, targets: torch.Tensor | None) -> torch.Tensor | None:
        """The positions that predict an answer token."""
        return None if targets is None else torch.nonzero(targets >= 0, as_tuple=True)[1]

    def pending(self, targets: list[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        n = max(len(t) for t in targets)
        wanted = torch.full((len(targets), n), -1, dtype=torch.long, device=device)
        for b, t in enumerate(targets):
            wanted[b, : len(t)] = torch.as_tensor(list(t), dtype=torch.long, device=device)
        return wanted, torch.zeros(len(targets), 1, dtype=torch.bool, device=device)

    def resolve(self, wanted: torch.Tensor, unresolved: torch.Tensor, logits: torch.Tensor,
                token_mask: torch.Tensor, answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        return wanted

    def read_rows(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        example, position = torch.nonzero(targets >= 0, as_tuple=True)
        return example, position, targets[example, position]

    def explained_positions(self, targets: torch.Tensor | None) -> torch.Tensor | None:
        """The last position that predicts an answer token (where the adapters read one row)."""
        if targets is None:
            return None
        index = torch.arange(targets.shape[1], device=targets.device).expand_as(targets)
        return torch.where(targets >= 0, index, torch.full_like(index, -1)).max(1).values

    def query_weights(self, targets: torch.Tensor | None, n_queries: int) -> torch.Tensor | None:
        if targets is None:
            return None
        read = (targets[:, :n_queries] >= 0).to(torch.float64)
        return read / read.sum(1, keepdim=True).clamp_min(1.0)

    def logit_positions(self, token_mask: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
        """The positions that predict an answer token, and each input's last position (its greedy next token is
        shown)."""
        last = last_positions(token_mask)
        if targets is None:
            return torch.unique(last)
        return torch.unique(torch.cat([last, torch.nonzero(targets >= 0, as_tuple=True)[1].to(last.device)]))

    def targets_at(self, targets: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The labels at the kept positions (a label is indexed by the position that predicts it)."""
        return targets[:, positions.to(targets.device)]

    def token_values(self, logits: torch.Tensor, targets: torch.Tensor, kind: str) -> torch.Tensor:
        """``(B, N)`` each answer token's value (its logit or log-probability) at the position predicting it;
        0 elsewhere."""
        example, position, label = self.read_rows(targets)
        rows = logits[example, position]  # (R, V): only the rows that predict answer tokens
        if kind == "logit":
            read = rows.gather(-1, label[:, None])[:, 0]
        elif kind in ("loss", "probability"):
            read = rows.log_softmax(-1).gather(-1, label[:, None])[:, 0]
        else:
            raise ValueError(f"unknown target kind {kind!r}; choose one of {', '.join(TARGET_KINDS)}")
        out = torch.zeros(targets.shape, dtype=read.dtype, device=read.device)
        return out.index_put((example, position), read)

    def scalar(self, logits: torch.Tensor, targets: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        total = self.token_values(logits, targets, kind).sum(1)
        return total.exp() if kind == "probability" else total

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Each input's greedy next token (an answer is always given, so this is only shown)."""
        return self.last(logits.detach(), token_mask).argmax(-1)

    def prediction(self, logits: torch.Tensor, token_mask: torch.Tensor,
                   answer_mask: torch.Tensor | None = None) -> list[Any]:
        return self.predicted(logits, token_mask).cpu().tolist()

    def shown(self, logits: torch.Tensor, token_mask: torch.Tensor, targets: torch.Tensor) -> list[list[float]]:
        """Each answer token's probability given everything before it, in answer order."""
        with torch.no_grad():
            logp = self.token_values(logits.double(), targets, "loss")
        return [[float(np.exp(v)) for v, t in zip(row, labels) if t >= 0]
                for row, labels in zip(logp.cpu().tolist(), targets.cpu().tolist())]

    def annotate(self, explanation: Any) -> None:
        """The target as the answer's token span ``[start, end)`` (``meta["answer_span"]``), its text and
        log-probability."""
        labels = list(explanation.target)
        read = [p for p, t in enumerate(labels) if t >= 0]
        start, end = read[0] + 1, read[-1] + 2
        explanation.target = [start, end]
        explanation.meta["answer_span"] = [start, end]
        explanation.meta["answer_logprob"] = float(np.log(np.clip(explanation.probabilities, 1e-300, None)).sum())
        if self.decode is not None:
            explanation.meta["answer"] = "".join(self.decode(int(t)) for t in labels if t >= 0)
            explanation.meta["predicted_token"] = self.decode(int(explanation.predicted))

    def meta(self) -> dict[str, Any]:
        return {"task": "causal-lm", "explained": "answer"}


def answer_labels(n_prompt: int, answer_ids: Sequence[int]) -> list[int]:
    """An :class:`AnswerHead` target for the input ``prompt + answer`` (``n_prompt`` prompt tokens): position
    ``p`` predicts the token at ``p + 1``."""
    labels = [-1] * (n_prompt + len(answer_ids))
    for i, t in enumerate(answer_ids):
        labels[n_prompt - 1 + i] = int(t)
    return labels


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token id as its text, exactly (``" Paris"``: no special tokens skipped, no spaces cleaned up)."""
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


class Seq2SeqLMHead(LMHead):
    """Next-token prediction of an encoder-decoder language model (BART, T5 ``…ForConditionalGeneration``):
    logits ``(B, N_decoder, V)``. Only generation (:mod:`attnlens.results.generation`) feeds these models: every row of
    a batch holds the whole teacher-forced decoder input, so a target says where it is read, as a
    ``(token, decoder position, contrast token or -1)`` triple; the explained scalar is the token's value at
    that position, minus the contrast token's when there is one."""

    task = "seq2seq-lm"
    model_suffix = "ForConditionalGeneration"
    model_suffixes = ("ForConditionalGeneration",)
    auto_class = "AutoModelForSeq2SeqLM"
    kind = "a sequence-to-sequence language model"

    def resolve_targets(self, target: Any, n: int, labels: list[str]) -> list[Any]:
        raise ModelError("explain() reads one prediction per input; a sequence-to-sequence language model is "
                         "explained by what it generates: use explain_generation(prompt)")

    def pending(self, targets: list[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        wanted = torch.tensor(targets, dtype=torch.long, device=device)
        return wanted, torch.zeros(len(targets), 1, dtype=torch.bool, device=device)

    logit_positions_per_input = 0

    def logit_positions(self, token_mask: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor | None:
        """``None``: the decoder's logits are read where each target says, and decoder inputs are short."""
        return None

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The greedy token after the last decoder position, as a target triple (generation gives every target,
        so this is never what is explained)."""
        last = torch.full((logits.shape[0],), logits.shape[1] - 1, dtype=torch.long, device=logits.device)
        return torch.stack([logits.detach()[:, -1].argmax(-1), last, torch.full_like(last, -1)], -1)

    def at(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``(B, V)`` logits at each target's decoder position."""
        return logits[torch.arange(logits.shape[0], device=logits.device), targets[:, 1]]

    def scalar(self, logits: torch.Tensor, targets: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        values = Head.values(self, self.at(logits, targets), kind, token_mask)
        token, contrast = targets[:, 0:1], targets[:, 2:3]
        value = values.gather(-1, token)
        other = torch.where(contrast >= 0, values.gather(-1, contrast.clamp_min(0)), torch.zeros_like(value))
        return (value - other).squeeze(-1)


class ContrastHead:
    """``base``'s head explaining target − contrast: the difference of the two classes' (tokens') values.

    With ``target_kind="logit"`` that is logit(target) − logit(contrast); ``"probability"``: p(target) −
    p(contrast); ``"loss"``: log p(target) − log p(contrast), which for a softmax equals the logit difference
    (the normaliser cancels) and for a multi-label sigmoid is the difference of the two log-sigmoids.
    Internal targets are ``(target, contrast)`` pairs, so the contrast travels with each example (through
    batching and integrated gradients' expanded batches); ``contrast`` is the one every input gets from
    :meth:`resolve_targets` (``None`` when the caller passes pairs). Everything else is the base head's.
    """

    def __init__(self, base: Head, contrast: int | None = None) -> None:
        self.base = base
        self.contrast = contrast

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def shown(self, logits: torch.Tensor, token_mask: torch.Tensor, targets: torch.Tensor) -> list[list[float]]:
        return Head.shown(self, logits, token_mask, targets)  # type: ignore[arg-type]

    def resolve_targets(self, target: Any, n: int, labels: list[str]) -> list[Any]:
        return [(t, self.contrast) for t in self.base.resolve_targets(target, n, labels)]

    def check_targets(self, lengths: list[int], targets: list[Any]) -> None:
        self.base.check_targets(lengths, [t for t, _ in targets])

    def pending(self, targets: list[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        wanted = torch.tensor(targets, dtype=torch.long, device=device)
        return wanted, wanted[:, :1] < 0

    def resolve(self, wanted: torch.Tensor, unresolved: torch.Tensor, logits: torch.Tensor,
                token_mask: torch.Tensor, answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        return torch.where(unresolved, self.predicted(logits, token_mask, answer_mask), wanted)

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor,
                  answer_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The base head's prediction paired with the contrast."""
        chosen = self.base.predicted(logits, token_mask, answer_mask)
        other = torch.full_like(chosen, -1 if self.contrast is None else self.contrast)
        return torch.stack([chosen, other], -1)

    def scalar(self, logits: torch.Tensor, targets: torch.Tensor, kind: str, token_mask: torch.Tensor) -> torch.Tensor:
        values = self.base.values(logits, kind, token_mask)
        return (values.gather(-1, targets[:, :1]) - values.gather(-1, targets[:, 1:2])).squeeze(-1)

    def shown_probabilities(self, probs: np.ndarray, target: Any) -> list[float]:
        return self.base.shown_probabilities(probs, target[0])

    def meta(self) -> dict[str, Any]:
        return {**self.base.meta(), "contrast": self.contrast}

    def annotate(self, explanation: Any) -> None:
        """The explained class alone in ``target`` (the contrast is in ``meta["contrast"]``)."""
        explanation.target, explanation.meta["contrast"] = explanation.target
        self.base.annotate(explanation)


def with_contrast(head: Head, contrast: Any, labels: list[str]) -> ContrastHead:
    """``head`` explaining target − ``contrast`` (one class index or label name for every input), checked."""
    if isinstance(head, (QAHead, TokenHead)):
        raise InputError("contrast applies to sequence classifiers and language models, not to extractive QA spans "
                         "or token classifiers")
    if contrast is None or isinstance(contrast, bool) or not isinstance(contrast, (int, str, np.integer)):
        raise InputError(f"contrast must be one class index or label name (the same for every input), got "
                         f"{contrast!r:.60}")
    return ContrastHead(head, head._resolve_one(contrast, labels))


CAUSAL_LM = LMHead()
SEQ2SEQ_LM = Seq2SeqLMHead()
TASKS.update({"causal-lm": CAUSAL_LM, "seq2seq-lm": SEQ2SEQ_LM})
GENERATION_HEADS = (CAUSAL_LM, SEQ2SEQ_LM)


def task_of(architectures: Sequence[str]) -> str:
    """The task whose model classes a config's ``architectures`` name (default ``"classification"``)."""
    return next((t for t, h in TASKS.items() if any(_matches(h, a) for a in architectures)), "classification")


def _matches(head: Head, model_class: str) -> bool:
    matches = getattr(head, "matches", None)
    return matches(model_class) if matches else model_class.endswith(head.model_suffix)


def head_for(model: nn.Module, max_answer_length: int = 30) -> Head:
    """The head of ``model``: sequence classification (multi-label where ``config.problem_type`` says so), token
    classification or extractive QA (spans of at most ``max_answer_length`` tokens); anything else is an error."""
    name = type(model).__name__
    if name.endswith(CLASSIFICATION.model_suffix):
        multi = getattr(model.config, "problem_type", None) == "multi_label_classification"
        return MULTI_LABEL if multi else CLASSIFICATION
    if name.endswith(QA.model_suffix):
        return _qa_head(max_answer_length)
    if name.endswith(TOKEN.model_suffix):
        if getattr(model.config, "is_encoder_decoder", False):
            raise ModelError(f"token classifiers are explained for encoder and decoder models; {name} is an "
                             "encoder-decoder type")
        return TOKEN
    for generative in GENERATION_HEADS:
        if generative.matches(name):
            return type(generative)(int(model.get_output_embeddings().weight.shape[0]))
    raise ModelError(
        f"attnlens explains sequence classifiers (…ForSequenceClassification), token classifiers "
        f"(…ForTokenClassification), extractive QA models (…ForQuestionAnswering) and language models "
        f"(…ForCausalLM, …ForConditionalGeneration); got {name}. "
        "Load the model with AutoModelForSequenceClassification or AutoModelForCausalLM."
    )


def _qa_head(max_answer_length: int) -> QAHead:
    if isinstance(max_answer_length, bool) or not isinstance(max_answer_length, int) or max_answer_length < 1:
        raise InputError(f"max_answer_length must be a positive number of tokens, got {max_answer_length!r}")
    return QA if max_answer_length == QA.max_answer_length else QAHead(max_answer_length)
