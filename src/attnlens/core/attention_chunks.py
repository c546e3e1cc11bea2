"""Every layer's attention maps (and their gradients) read in chunks of query rows, without keeping them.

Rollout, GAE and Grad-SAM read every layer's whole maps, but only through a reduction (a head mean, a product
with a few carried rows, a mean over query rows) that can be taken chunk by chunk. Under fused attention
(:mod:`attnlens.core.row_attention`) the pass keeps, per layer, the queries and keys the maps are computed from
(``softmax(q Kᵀ · scale + mask)``, as eager attention computes them) and, when the gradients are read, the values
and the attention output, whose gradient ``∂y/∂O`` gives the maps' gradient: ``∂y/∂A = (∂y/∂O) Vᵀ`` (the output is
``O = A V``). :class:`RecomputedChunks` recomputes the maps from those, a chunk of query rows at a time; about
``L · N · 2D`` floats are kept (``5D`` with gradients) instead of ``L · H · N²``. Where the pass kept the whole
maps (eager attention), :class:`WholeMaps` reads them in one chunk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from . import row_attention
from .row_attention import LayerFactors, keys_seen, probabilities, repeat_kv, zero_padded

__all__ = ["AttentionChunks", "LayerFactors", "RecomputedChunks", "WholeMaps"]


class AttentionChunks(ABC):
    """Per layer, ``(start, A, ∇A)`` for consecutive chunks of query rows: ``A`` ``(B, H, q, K)`` the rows
    ``start … start + q − 1`` of the layer's softmax attention and ``∇A`` their gradient (``None`` unless asked
    for). ``B`` is the capture's rows."""

    n_layers: int

    @abstractmethod
    def chunks(self, layer: int, gradients: bool = False, narrow: bool = False
               ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """Layer ``layer``'s (0 = the lowest) chunks; ``gradients``: with ``∇A``. ``narrow``: a chunk may stop
        after the last key its rows can see (``(B, H, q, K')``, ``K' ≤ K``: every later key has probability and
        gradient 0 there), for a reader that takes the missing keys as zeros."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (for memory accounting)."""

    @abstractmethod
    def gradient_rows(self, layer: int, start: int, stop: int, keys: int) -> torch.Tensor:
        """``(B, H, stop − start, keys)``: ``∇A`` of layer ``layer`` at query rows ``start … stop − 1`` and the
        first ``keys`` keys (a reader that has the probabilities from elsewhere), a tensor of its own that the
        caller may overwrite."""


class WholeMaps(AttentionChunks):
    """The whole maps ``(B, H, Q, K)`` (and their gradients) the pass kept, read as one chunk per layer."""

    def __init__(self, maps: list[torch.Tensor], grads: list[torch.Tensor] | None = None) -> None:
        self.maps, self.grads = maps, grads
        self.n_layers = len(maps)

    def chunks(self, layer: int, gradients: bool = False, narrow: bool = False
               ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        if gradients and self.grads is None:
            raise ValueError("the pass kept no attention gradients")
        yield 0, self.maps[layer], self.grads[layer] if gradients else None

    def tensors(self) -> list[torch.Tensor]:
        return list(self.maps) + list(self.grads or [])

    def gradient_rows(self, layer: int, start: int, stop: int, keys: int) -> torch.Tensor:
        if self.grads is None:
            raise ValueError("the pass kept no attention gradients")
        return self.grads[layer][:, :, start:stop, :keys].clone()


class RecomputedChunks(AttentionChunks):
    """The maps recomputed from :class:`LayerFactors`, ``chunk_elements`` probabilities at a time (default
    :func:`~attnlens.core.row_attention.chunk_elements` of the factors' device).

    ``rows``: the capture's row count ``B``; with a forward batch of one and ``rows > 1`` every row reads the one
    sequence (a generation's prefixes: causal masking makes each prefix's maps the top-left block of the
    sequence's). ``output_grads``: per layer ``(B, H, N, d)``, the gradient of each row's target w.r.t. the
    attention output.
    """

    def __init__(self, factors: list[LayerFactors], rows: int, output_grads: list[torch.Tensor] | None = None,
                 chunk_elements: int | None = None) -> None:
        self.factors, self.rows, self.output_grads = factors, rows, output_grads
        self.chunk_elements = chunk_elements
        self.n_layers = len(factors)
        self._values: tuple[int, torch.Tensor] | None = None  # one layer's values per query head

    def gradient_rows(self, layer: int, start: int, stop: int, keys: int) -> torch.Tensor:
        f = self.factors[layer]
        if self.output_grads is None or f.value is None:
            raise ValueError("the pass kept no attention gradients")
        if self._values is None or self._values[0] != layer:
            self._values = (layer, repeat_kv(f.value, f.groups))
        value = self._values[1]
        with torch.no_grad():
            return torch.matmul(self.output_grads[layer][:, :, start:stop].to(value.dtype),
                                value[:, :, :keys].transpose(2, 3))

    def chunks(self, layer: int, gradients: bool = False, narrow: bool = False
               ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        f = self.factors[layer]
        if gradients and (self.output_grads is None or f.value is None):
            raise ValueError("the pass kept no attention gradients")
        key = repeat_kv(f.key, f.groups)
        b, h, n, _ = f.query.shape
        k = key.shape[2]
        batch = max(b, self.rows)
        elements = self.chunk_elements or row_attention.chunk_elements(f.query.device)
        step = max(1, elements // max(1, batch * h * k))
        with torch.no_grad():
            for start in range(0, n, step):
                stop = min(n, start + step)
                queries = torch.arange(start, stop, device=f.query.device)
                seen = keys_seen(stop, k, f.causal, f.mask)  # computed on the keys the rows see, zero after
                width = seen if narrow else k
                a = zero_padded(probabilities(f.query, key[:, :, :seen], f.mask, queries, f.causal, f.scale), width)
                if a.shape[0] != self.rows:
                    a = a.expand(self.rows, *a.shape[1:])
                g = zero_padded(self.gradient_rows(layer, start, stop, seen).to(a.dtype), width) if gradients else None
                yield start, a, g

    def tensors(self) -> list[torch.Tensor]:
        held = [t for f in self.factors for t in (f.query, f.key, f.value, f.output, f.mask) if t is not None]
        return held + list(self.output_grads or [])
