"""The head of a sequence classifier (single- or multi-label), and :class:`Head`, the base every task's head
extends: what the model predicts and which scalar an explanation is of."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...errors import InputError

TARGET_KINDS = ("logit", "probability", "loss")


PREDICTED = -1  # an internal target entry meaning "the model's prediction" (QA: both positions of the span)


class Head:
    """Sequence classification head (one label per input: softmax over the classes)."""

    task = "classification"
    multi_label = False
    model_suffix = "ForSequenceClassification"  # the HF model classes this head reads
    auto_class = "AutoModelForSequenceClassification"  # how from_pretrained loads one
    kind = "a sequence classifier"  # how messages name such a model
    # a decoder family's head reads the last token whose id is not the pad id (transformers' decoder classifiers)
    finds_last_by_pad_id = True

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
                f"target must be None, a class index, a label name, or a list with one per input ({n} inputs); on "
                "the command line --target takes one class index or label name"
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

    def last_read_row(self, targets: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
        """``(B,)`` the last query row whose state the explained value reads, given ``rows``, the one row per
        example a head reads (:meth:`explained_positions`, else where the architecture's head reads); ``None``:
        not known. Under causal attention the rows after it feed nothing the head reads, and the methods
        averaging over query rows (AttCAT's received attention, Grad-SAM) leave them out."""
        return rows

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
    kind = "a multi-label classifier"

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


CLASSIFICATION = Head()


MULTI_LABEL = MultiLabelHead()
