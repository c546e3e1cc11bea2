"""Which positions of a language model's output a pass projects onto the vocabulary.

A causal language model's head multiplies every position's final state by the output embeddings: ``N × V`` logits
(SmolLM2 at 8k tokens: 1.6 GB, and as much again for their gradient), although a next token is read at one
position and an answer at the positions that predict its tokens. Where the head says which positions it reads
(:meth:`~attnlens.models.heads.Head.logit_positions`) and the model can project only some
(``logits_to_keep``), a pass keeps those: its logits are ``(B, K, V)``, and they are read with the token mask and
targets of :class:`LogitRows`, in the kept positions' coordinates. The explained scalar, the prediction and the
probabilities shown are the same numbers (the tests compare them with the whole output's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .batching import keeps_logits

__all__ = ["LogitRows"]


@dataclass(frozen=True)
class LogitRows:
    """The ``(K,)`` ascending positions whose logits a pass computed (``positions``), or ``None``: every
    position's."""

    positions: torch.Tensor | None = None

    @classmethod
    def of(cls, model: nn.Module, head: Any, token_mask: torch.Tensor, targets: torch.Tensor | None) -> LogitRows:
        """The positions ``head`` reads of a right-padded batch with ``token_mask`` and ``targets`` (``None``:
        predicted), where ``model`` can keep only those; every position otherwise."""
        if not keeps_logits(model):
            return cls()
        n = token_mask.shape[1]
        prefix = torch.arange(n, device=token_mask.device)[None, :] < token_mask.long().sum(1, keepdim=True)
        if not bool((prefix == token_mask.bool()).all()):  # the compact mask below relies on right padding
            return cls()
        positions = head.logit_positions(token_mask, targets)
        if positions is None or len(positions) >= n:
            return cls()
        return cls(positions)

    def model_kwargs(self) -> dict[str, Any]:
        """What the model's forward takes to compute only these positions' logits."""
        return {} if self.positions is None else {"logits_to_keep": self.positions}

    def mask(self, token_mask: torch.Tensor) -> torch.Tensor:
        """``token_mask`` at the kept positions: each row's last real kept position is its last real one, so a
        head reading the last real position reads the same logits."""
        return token_mask if self.positions is None else token_mask[:, self.positions.to(token_mask.device)]

    def targets(self, head: Any, targets: torch.Tensor) -> torch.Tensor:
        """``targets`` as ``head`` reads them against the kept positions' logits."""
        return targets if self.positions is None else head.targets_at(targets, self.positions)
