"""A batch whose rows are prefixes of one causal sequence (the steps of a generation, ``BatchContext.sequence``).

Causal masking makes row ``b``'s forward the first ``len_b`` positions of one forward over the whole sequence,
so the model runs once: its tensors are handed out as per-row views (:class:`RowViews`), each row's explained
scalar is read at its own last token (:func:`last_token_rows`), and each row's gradients are of its own scalar,
by batched vector-Jacobian products through that one forward (:func:`row_gradients`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class RowViews:
    """Views of a batch-of-one forward's tensors as ``rows`` identical rows (no copy), remembering the tensor
    each view was made from: the backward differentiates those."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.bases: dict[int, torch.Tensor] = {}

    def view(self, t: torch.Tensor) -> torch.Tensor:
        view = t.expand(self.rows, *t.shape[1:])
        self.bases[id(view)] = t
        return view

    def outputs(self, outputs: Any) -> Any:
        """``outputs`` with every tensor the adapters and heads read (logits, attentions, hidden states) viewed."""
        for name in ("logits", "attentions", "hidden_states"):
            value = getattr(outputs, name, None)
            if isinstance(value, torch.Tensor):
                setattr(outputs, name, self.view(value))
            elif isinstance(value, tuple) and value:
                setattr(outputs, name, tuple(self.view(t) for t in value))
        return outputs


def last_positions(token_mask: torch.Tensor) -> torch.Tensor:
    """``(B,)`` each row's last real position: where a language model's head reads the row's next token."""
    return token_mask.long().sum(1) - 1


def last_token_rows(logits: torch.Tensor, token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(1, N, V)`` logits of one sequence read as the rows of a batch of its prefixes by a head that reads
    each row's last real token (language models): ``(B, 1, V)`` logits and their ``(B, 1)`` mask, gathered
    rather than viewed, so a batched backward per row carries one position's gradient, not ``N × V``."""
    last = last_positions(token_mask).to(logits.device)
    return logits[0, last][:, None], torch.ones(len(last), 1, dtype=token_mask.dtype, device=token_mask.device)


def row_gradients(values: torch.Tensor, wrt: Sequence[torch.Tensor], scale: torch.Tensor | None = None,
                  retain_graph: bool = False) -> tuple[torch.Tensor | None, ...]:
    """Row ``b``'s gradient of ``scale[b] * values[b]`` alone w.r.t. each of ``wrt`` (tensors of the one
    forward, a batch of one), ``(B, ...)`` each (``None`` where unused): one vector-Jacobian product per row,
    batched (``is_grads_batched``). ``retain_graph``: another backward through the forward follows."""
    seeds = torch.diag(torch.ones_like(values) if scale is None else scale)
    grads = torch.autograd.grad(values, list(wrt), grad_outputs=seeds, is_grads_batched=True, allow_unused=True,
                                retain_graph=retain_graph)
    return tuple(None if g is None else g[:, 0] for g in grads)
