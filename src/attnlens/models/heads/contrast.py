"""Contrastive targets: the explained logit minus that of a contrast class or token."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from ...errors import InputError
from .classification import Head
from .qa import QAHead
from .token import TokenHead


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
        """The base head's checks, and a target that is its own contrast is refused (its difference is 0)."""
        same = [k + 1 for k, (t, c) in enumerate(targets) if c is not None and t == c]
        if same:
            which = f"input {same[0]}: " if len(targets) > 1 else ""
            raise InputError(f"{which}the target is the contrast ({self.contrast}): the explained difference would be "
                             "0 everywhere; give another contrast")
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
        """The explained class alone in ``target`` (the contrast is in ``meta["contrast"]``); a warning where the
        predicted class, explained by default, is the contrast itself (every score is then 0)."""
        explanation.target, explanation.meta["contrast"] = explanation.target
        if explanation.target == explanation.meta["contrast"]:
            text = explanation.text if isinstance(explanation.text, str) else " / ".join(explanation.text)
            warnings.warn(f"input {text!r:.60}: the explained class {explanation.target} is the contrast: target − "
                          "contrast is 0, and so is every score (name another --target / target=)", stacklevel=2)
        self.base.annotate(explanation)


def with_contrast(head: Head, contrast: Any, labels: list[str]) -> ContrastHead:
    """``head`` explaining target − ``contrast`` (one class index or label name for every input), checked."""
    if isinstance(head, (QAHead, TokenHead)):
        raise InputError("contrast applies to sequence classifiers and language models, not to extractive QA spans "
                         "or token classifiers")
    if contrast is None or isinstance(contrast, bool) or not isinstance(contrast, (int, str, np.integer)):
        raise InputError(f"contrast must be one class index or label name (the same for every input), got "
                         f"{contrast!r:.60}")
    try:
        index = head._resolve_one(contrast, labels)
    except InputError as exc:  # the head's message speaks of a target: here it is the contrast
        raise InputError(str(exc).replace("target", "contrast", 1)) from None
    return ContrastHead(head, index)
