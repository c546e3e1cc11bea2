"""Methods built from attention probabilities and their gradients (one shared pass).

Notation: A^l ``(B, H, Q, K)`` softmax attention of layer l, ∇A^l its gradient w.r.t. the explained scalar,
E_h the mean over heads, "row c" the explained query row(s) (``Capture.row``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..core.attention_chunks import AttentionChunks
from ..core.batch_state import BatchContext, Capture
from .registry import ATTENTION_CHUNKS, ATTENTION_ROWS, GRADIENTS, MethodOutput, register


def rollout_matrices(attentions: Iterable[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Â^l = 0.5·E_h A^l + 0.5·I per layer (Abnar & Zuidema 2020): the residual connection as identity.

    ``attentions`` are L tensors ``(..., H, N, N)`` (a capture's ``(B, H, N, N)``, or one example's); returns L
    tensors ``(..., N, N)``, computed in ``dtype`` (default: the attention's).
    """
    out = []
    for a in attentions:
        mean = (a if dtype is None else a.to(dtype)).mean(-3)
        out.append(0.5 * mean + 0.5 * torch.eye(mean.shape[-1], dtype=mean.dtype, device=mean.device))
    return out


def propagate(steps: Iterable[torch.Tensor], *, residual: bool = False) -> list[torch.Tensor]:
    """Per-layer matrices ``M^l`` (bottom layer first) chained upwards; returns ``P^1 ... P^L``.

    Plain: ``P^1 = M^1``, ``P^l = M^l P^{l-1}`` (rollout, TransAtt). ``residual``: ``P^0 = I``,
    ``P^l = P^{l-1} + M^l P^{l-1}`` (GAE's self-attention rule: ``(I + M^l) P^{l-1}`` without forming ``I + M^l``).
    """
    out: list[torch.Tensor] = []
    joint = None
    for m in steps:
        if joint is None:
            joint = m + torch.eye(m.shape[-1], dtype=m.dtype, device=m.device) if residual else m
        else:
            joint = joint + m @ joint if residual else m @ joint
        out.append(joint)
    return out


# (layer, first query row of the chunk, A chunk (B, H, q, K), its gradient or None) -> M^layer at those rows (B, q, K)
Reduce = Callable[[int, int, torch.Tensor, torch.Tensor | None], torch.Tensor]


class RowCarrier:
    """Rows of ``P^l = M̂^l···M̂^1`` for every layer l (``M̂^j = mix·M^j + keep·I``), carried down from the top
    layer as the chunks of query rows of each ``M^j`` arrive (:func:`carried_rows`): every row started at or above
    layer j becomes ``mix·v M^j + keep·v``. Feed each layer's chunks with :meth:`add`, top layer first, and close
    it with :meth:`end` before the next; :meth:`rows` gives the ``(B, L, N)`` result."""

    def __init__(self, weights: torch.Tensor, n_layers: int, *, mix: float, keep: float) -> None:
        self.weights, self.n_layers, self.mix, self.keep = weights, n_layers, mix, keep
        self._rows: torch.Tensor | None = None
        self._product: torch.Tensor | None = None
        self.layer = n_layers  # the layer whose chunks are arriving (n_layers: none yet)
        self.done = n_layers  # the lowest layer closed

    def expects(self, j: int) -> bool:
        """Whether chunks of layer ``j`` may arrive now: the open layer's, or the one below the last closed."""
        return j == (self.layer if self.open else self.done - 1)

    def add(self, j: int, start: int, m: torch.Tensor) -> None:
        """Rows ``start …`` of ``M^j`` ``(B, q, N')``: its first ``N' ≤ N`` columns (the rest 0)."""
        if not self.expects(j):
            raise ValueError(f"layer {j}'s chunks arrived while the carrier expects layer "
                             f"{self.layer if self.open else self.done - 1}'s: the layers go top down, one at a time")
        if self._product is None:
            if self._rows is None:
                b, n = self.weights.shape
                self._rows = self.weights.new_zeros(b, self.n_layers, n, dtype=m.dtype)
            self._rows[:, j] = self.weights.to(m.dtype)
            self._product = torch.zeros_like(self._rows[:, j:])
            self.layer = j
        rows = self._rows[:, j:, start: start + m.shape[1]]
        self._product[..., : m.shape[-1]] += torch.einsum("bsq,bqk->bsk", rows, m)

    def end(self, scale: torch.Tensor | None = None) -> None:
        """Close the layer whose chunks arrived, ``M^j`` divided by ``scale`` ``(B,)`` if given."""
        if self._product is None:
            raise ValueError("no layer's chunks arrived since the last was closed")
        j, product = self.layer, self._product
        if scale is not None:
            product = product / scale.to(product.dtype)[:, None, None]
        rows = self._rows[:, j:]
        self._rows[:, j:] = self.mix * product + self.keep * rows if self.keep else self.mix * product
        self._product, self.done = None, j

    @property
    def open(self) -> bool:
        """Whether a layer's chunks are arriving (it is not closed yet)."""
        return self._product is not None

    @property
    def complete(self) -> bool:
        """Whether every layer was closed."""
        return self.done == 0 and self._product is None

    def rows(self) -> torch.Tensor:
        """``(B, L, N)``: the explained rows of every layer's product."""
        if not self.complete:
            raise ValueError(f"layers {self.done - 1} and below were not carried")
        return self._rows


def carried_rows(weights: torch.Tensor, maps: AttentionChunks, reduce: Reduce, *, mix: float, keep: float,
                 gradients: bool = False, divisor: Callable[[int], torch.Tensor | None] | None = None,
                 narrow: bool = False) -> torch.Tensor:
    """``(B, L, N)``: row ``weights`` ``(B, N)`` of ``P^l = M̂^l···M̂^1`` for every layer l, where
    ``M̂^j = mix·M^j + keep·I`` and ``M^j`` is built chunk by chunk of query rows by ``reduce`` from ``maps``
    (``gradients``: with ``∇A``). ``divisor(j)``: after layer j's chunks, ``(B,)`` numbers ``M^j`` is divided by
    (known only once every row was seen, e.g. its largest row sum), or ``None``. ``narrow``: ``reduce`` works on
    chunks that stop after the last key their rows see (:meth:`AttentionChunks.chunks`); a causal chunk's later
    keys are then never formed (on average half of them).

    Rollout (``mix = keep = 0.5``, the head mean), GAE's rule (``mix = keep = 1``: ``P^l = P^{l-1} + M^l P^{l-1}``)
    and plain products (``keep = 0``: GlobEnc, ALTI). Only rows of the products are read, so each layer's row is
    carried down instead (:class:`RowCarrier`). Each map is read once, a chunk of query rows at a time, and no
    ``N × N`` product is formed: ``L(L+1)/2`` products of a row with a map."""
    carrier = RowCarrier(weights, maps.n_layers, mix=mix, keep=keep)
    for j in reversed(range(maps.n_layers)):
        for start, a, g in maps.chunks(j, gradients, narrow):
            carrier.add(j, start, reduce(j, start, a, g))  # M^j at those rows (B, q, K)
        carrier.end(divisor(j) if divisor is not None else None)
    return carrier.rows()


def _head_mean(layer: int, start: int, a: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    return a.mean(1)


def _positive_gradient_weighted(layer: int, start: int, a: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    return torch.mul(g, a).clamp_min_(0).mean(1)  # GAE's Ā = E_h (∇A ⊙ A)⁺


def _stack_explained(capture: Capture, rows: list[torch.Tensor]) -> torch.Tensor:
    """``(B, L, K)``: the explained row of each layer's ``(B, R, K)`` matrix over the captured attention rows."""
    return torch.stack([capture.explained_row(r) for r in rows], 1)


@register(
    "rawatt",
    needs={ATTENTION_ROWS},
    class_specific=False,
    summary="Last layer's attention from the classification position, mean over heads: E_h A^L[c, j].",
    citation="Jain & Wallace 2019; Karpekov & Miller 2023, Eq. 1",
)
def rawatt(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    layers = _stack_explained(cap, [a.mean(1) for a in cap.attention_rows])
    return MethodOutput(layers[:, -1], layers)


@register(
    "rollout",
    needs={ATTENTION_CHUNKS},
    class_specific=False,
    self_attention_only=True,
    summary="Attention rollout: R = Â^L···Â^1 with Â = 0.5·E_h A + 0.5·I; s_j = R[c, j].",
    citation="Abnar & Zuidema 2020",
)
def rollout(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    # row c of the rollout up to each layer
    layers = carried_rows(cap.query_weights, cap.map_chunks(), _head_mean, mix=0.5, keep=0.5, narrow=True)
    return MethodOutput(layers[:, -1], layers)


@register(
    "grads",
    needs={ATTENTION_ROWS, GRADIENTS},
    summary="Gradient of the target w.r.t. the last layer's attention, row c, mean over heads: E_h ∇A^L[c, j]; "
            "0 at keys row c attends to in no head (masked: later tokens under causal masking, padding).",
    citation="AttCAT paper (Qiang et al. 2022), baseline 'Grads'",
)
def grads(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    layers = _stack_explained(cap, [_seen(a, g.mean(1)) for a, g in zip(cap.attention_rows, cap.attention_row_grads)])
    return MethodOutput(layers[:, -1], layers)


def _seen(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``m`` ``(B, R, K)`` with 0 at the keys that rows ``a`` ``(B, H, R, K)`` attend to in no head: keys masked for
    the row (a later token under causal masking, padding, outside a sliding window). Their attention entry has a
    gradient (the value the row would read there) but no effect the model can have, so it scores nothing."""
    return torch.where(a.ne(0).any(1), m, 0)


@register(
    "attgrads",
    needs={ATTENTION_CHUNKS, GRADIENTS},
    summary="Grad-SAM: mean over layers, heads and real query rows of A ⊙ ReLU(∇A).",
    citation="Barkan et al. 2021 (Grad-SAM)",
)
def attgrads(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    maps = cap.map_chunks()
    mask = cap.query_mask
    count = mask.sum(1, keepdim=True).clamp_min(1)
    per_layer = []
    for layer in range(maps.n_layers):
        total = None
        for start, a, g in maps.chunks(layer, gradients=True, narrow=True):  # a causal chunk's first keys alone
            m = mask[:, start: start + a.shape[2]].to(a.dtype)
            part = torch.einsum("bq,bqk->bk", m, g.clamp_min(0).mul_(a).mean(1))
            if total is None:
                total = part.new_zeros(part.shape[0], cap.key_mask.shape[1])
            total[..., : part.shape[-1]] += part  # the chunks widen down the rows
        per_layer.append(total / count.to(total.dtype))
    layers = torch.stack(per_layer, 1)
    return MethodOutput(layers.mean(1), layers)


@register(
    "agrad",
    needs={ATTENTION_ROWS, GRADIENTS},
    summary="Attention × its gradient in the last layer, row c, mean over heads: E_h (A^L ⊙ ∇A^L)[c, j].",
    citation="Liu et al. 2022; Karpekov & Miller 2023, Eq. 2",
)
def agrad(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    layers = _stack_explained(cap, [(a * g).mean(1) for a, g in zip(cap.attention_rows, cap.attention_row_grads)])
    return MethodOutput(layers[:, -1], layers)


@register(
    "gae",
    needs={ATTENTION_CHUNKS, GRADIENTS},
    self_attention_only=True,
    summary="Generic attention explainability: R = I; R ← R + E_h ReLU(∇A ⊙ A)·R per layer; s_j = R[c, j].",
    citation="Chefer, Gur & Wolf 2021 (ICCV), self-attention rule",
)
def gae(ctx: BatchContext) -> MethodOutput:
    cap = ctx.capture
    # row c of R after each layer, carried down (no N x N product)
    layers = carried_rows(cap.query_weights, cap.map_chunks(), _positive_gradient_weighted, mix=1.0, keep=1.0,
                          gradients=True, narrow=True)
    return MethodOutput(layers[:, -1], layers)
