"""What the model predicts and which scalar an explanation is of: sequence classification or extractive QA.

- ``classification`` (``…ForSequenceClassification``): logits ``(B, C)``, a target is a class index.
- ``qa`` (``…ForQuestionAnswering``): logits ``(B, N, 2)`` (start, end), a target is a ``(start, end)`` pair of
  token positions; the explained scalar is start logit + end logit, which equals the sum of the two separate
  explanations for every method linear in the gradient (the AttCAT authors explain both and add them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import ModelError

TARGET_KINDS = ("logit", "probability", "loss")


class Head:
    """Sequence classification head."""

    task = "classification"

    def logits(self, outputs: Any) -> torch.Tensor:
        return outputs.logits

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return logits.detach().argmax(-1)

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


class QAHead(Head):
    """Extractive question answering: start and end logits over the tokens."""

    task = "qa"

    def logits(self, outputs: Any) -> torch.Tensor:
        return torch.stack([outputs.start_logits, outputs.end_logits], -1)

    def _masked(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(~token_mask.bool()[..., None], torch.finfo(logits.dtype).min)

    def predicted(self, logits: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        return self._masked(logits.detach(), token_mask).argmax(1)  # (B, 2): best start, best end

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


CLASSIFICATION = Head()
QA = QAHead()


def head_for(model: nn.Module) -> Head:
    """The head of ``model``: sequence classification or extractive QA; anything else is an error."""
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        return CLASSIFICATION
    if name.endswith("ForQuestionAnswering"):
        return QA
    raise ModelError(
        f"attnlens explains sequence classifiers (…ForSequenceClassification) and extractive QA models "
        f"(…ForQuestionAnswering); got {name}. Load the model with AutoModelForSequenceClassification."
    )
