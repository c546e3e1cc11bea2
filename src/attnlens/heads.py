"""What the model predicts and which scalar an explanation is of: sequence classification (single- or
multi-label) or extractive QA.

- ``classification`` (``…ForSequenceClassification``): logits ``(B, C)``, a target is a class index.
- multi-label classification (``config.problem_type == "multi_label_classification"``): the same logits, but
  each label has its own independent probability ``sigmoid(logit)``; the predicted labels are those with
  p > 0.5 and the default explained target is the highest-scoring label.
- ``qa`` (``…ForQuestionAnswering``): logits ``(B, N, 2)`` (start, end), a target is a ``(start, end)`` pair of
  token positions; the explained scalar is start logit + end logit, which equals the sum of the two separate
  explanations for every method linear in the gradient (the AttCAT authors explain both and add them). The
  predicted span is decoded as SQuAD does (:func:`best_spans`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import InputError, ModelError

TARGET_KINDS = ("logit", "probability", "loss")


class Head:
    """Sequence classification head (one label per input: softmax over the classes)."""

    task = "classification"
    multi_label = False

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


CLASSIFICATION = Head()
QA = QAHead()


MULTI_LABEL = MultiLabelHead()


def head_for(model: nn.Module, max_answer_length: int = 30) -> Head:
    """The head of ``model``: sequence classification (multi-label where ``config.problem_type`` says so) or
    extractive QA (spans of at most ``max_answer_length`` tokens); anything else is an error."""
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        multi = getattr(model.config, "problem_type", None) == "multi_label_classification"
        return MULTI_LABEL if multi else CLASSIFICATION
    if name.endswith("ForQuestionAnswering"):
        if isinstance(max_answer_length, bool) or not isinstance(max_answer_length, int) or max_answer_length < 1:
            raise InputError(f"max_answer_length must be a positive number of tokens, got {max_answer_length!r}")
        return QA if max_answer_length == QA.max_answer_length else QAHead(max_answer_length)
    raise ModelError(
        f"attnlens explains sequence classifiers (…ForSequenceClassification) and extractive QA models "
        f"(…ForQuestionAnswering); got {name}. Load the model with AutoModelForSequenceClassification."
    )
