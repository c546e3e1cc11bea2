"""ALTI's contributions on the CPU as a linear part, a product of matrices, and a correction few pairs need.

ALTI's contribution of key j to row i is ``c_ij = ‖y_i‖₁ − ‖y_i − t_ij‖₁`` (clamped at 0), with
``t_ij = Σ_h a^h_ij g^h_j`` (plus the residual where j is i's own position). Channel by channel, with
``s = sign(y)`` (``+1`` at 0):

    |y| − |y − t| = s·t − 2·max(0, s·t − |y|)

so ``c_ij = Σ_h a^h_ij ⟨s_i, g^h_j⟩ − 2·Σ_c max(0, s_ic t_ijc − |y_ic|)``. The first sum is linear: with each head's
vectors of low rank, ``g^h_j = v^h_j W^h`` (``d_h`` value features through the head's slice of the output
projection), ``⟨s_i, g^h_j⟩ = ⟨W^h s_i, v^h_j⟩``, one matrix product of ``d_h`` (not ``D``) features per head. The
second, the hinge, is nonzero only in channels where ``|t_ijc| > |y_ic|``; as ``|t_ijc| ≤ β_ij = Σ_h |a^h_ij|
max_c |g^h_jc|``, only the channels with ``|y_ic| < β_ij`` (a prefix of row i's channels sorted by ``|y|``) need
it, and for most pairs (small weights) there are none. A few channels where a layer's vectors are largest get a
bound of their own (so that they do not loosen every other channel's). A row's own position (its residual), and a
pair whose bound passes the row's sorted channels, are computed over every channel.

The same numbers as :mod:`~attnlens.methods.decomposition.alti_kernel` computes (``‖y_i‖₁ − ‖y_i − t_ij‖₁`` at
once), without its cancellation: the difference of two norms of ``D`` numbers each rounds to the norms' scale,
where the linear part and the hinge round to the contribution's own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .compiled import compilable, split_between_threads

_OUTLIERS = 8  # channels whose bound is kept apart (a few channels carry most of a layer's largest values)
_PEAK_BLOCK = 2**20  # elements of the vectors read at once for the bounds
_SORTED = 64  # each row's smallest channels sorted by |y|; a pair whose prefix is longer reads every channel


@dataclass
class LowRank:
    """One layer's per-head vectors in factors, ``g[b, j, h] = v[b, h, j] @ maps[h]``: the value vectors ``v``
    ``(B, H, N, d_h)``, the heads' maps ``(H, d_h, D)``, the vectors themselves key-major ``g`` ``(B, N, H, D)``
    (a key's heads side by side, as the correction reads them), the ``outliers`` ``(E,)``:
    the channels where the vectors are largest, ``peak`` ``(B, N, H)`` = max_c |g[b, j, h, c]| over the other
    channels and ``peak_all`` over every channel."""

    v: torch.Tensor
    maps: torch.Tensor
    g: torch.Tensor
    outliers: torch.Tensor
    peak: torch.Tensor
    peak_all: torch.Tensor

    @classmethod
    def of(cls, v: torch.Tensor, maps: torch.Tensor, g: torch.Tensor) -> LowRank:
        """From the factors and the vectors ``g`` ``(B, N, H, D)`` they give (kept as they are, contiguous; the
        bounds read a block of keys at a time)."""
        with torch.no_grad():
            g = g.detach()
            largest = torch.maximum(g.amax(dim=(0, 1, 2)), -g.amin(dim=(0, 1, 2)))  # (D,) max |g| per channel
            outliers = largest.topk(min(_OUTLIERS, largest.shape[0] - 1)).indices.sort().values
            peak_all = g.new_empty(g.shape[:-1])
            peak = torch.empty_like(peak_all)
            step = max(1, _PEAK_BLOCK // max(1, g[:, :1].numel()))
            for s in range(0, g.shape[1], step):  # both bounds from one |g| of the block
                block = g[:, s: s + step].abs()
                peak_all[:, s: s + step] = block.amax(-1)
                block[..., outliers] = 0
                peak[:, s: s + step] = block.amax(-1)
            return cls(v.detach().contiguous(), maps.detach(), g.contiguous(), outliers, peak, peak_all)


@functools.cache
def _compiled() -> Any:
    """The compiled loop, or None where numba cannot be imported (the caller then computes another way)."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; a platform without its wheels falls back
        return None

    def loop(ak: np.ndarray, lin: np.ndarray, peak: np.ndarray, peak_all: np.ndarray, outliers: np.ndarray,
             ys: np.ndarray, order: np.ndarray, y: np.ndarray, g: np.ndarray, m: np.ndarray, at: np.ndarray,
             out: np.ndarray, start: int, stop: int, step: int) -> None:
        # items = (example, key) pairs, every step-th of [start, stop), key-major so that a key's vectors g
        # (g[b, k, h, c]) stay in cache over the rows; out[b, k, i] = max(0, ‖y_i‖₁ − ‖y_i − t_ik‖₁). Where every
        # channel is read, t is formed head by head over the channels (contiguous: vectorised), then reduced.
        keys, rows, heads = ak.shape[1], ak.shape[2], ak.shape[3]
        d = g.shape[3]
        w = np.empty(heads, dtype=ak.dtype)
        t = np.empty(d, dtype=ak.dtype)
        last = ys.shape[2] - 1
        for item in range(start, stop, step):
            b = item // keys
            k = item % keys
            for i in range(rows):
                if at[i] == k:  # t includes the residual: every channel, |y| − |y − t| as it stands
                    for c in range(d):
                        t[c] = m[b, i, c]
                    for h in range(heads):
                        x = ak[b, k, i, h]
                        for c in range(d):
                            t[c] += x * g[b, k, h, c]
                    s = 0.0
                    for c in range(d):
                        s += abs(y[b, i, c]) - abs(y[b, i, c] - t[c])
                    out[b, k, i] = 0.0 if s < 0 else s  # a NaN stays one
                    continue
                value = 0.0
                beta = 0.0  # bounds |t_c| in every channel but the outliers
                beta_all = 0.0  # and in those
                for h in range(heads):
                    x = ak[b, k, i, h]
                    w[h] = x
                    value += x * lin[b, h, k, i]
                    beta += abs(x) * peak[b, k, h]
                    beta_all += abs(x) * peak_all[b, k, h]
                if beta_all > ys[b, i, 0]:  # some channel may have |t| > |y|: the hinge over those with |y| < β
                    hinge = 0.0
                    if beta > ys[b, i, last]:  # beyond the sorted channels: every channel
                        for c in range(d):
                            t[c] = 0.0
                        for h in range(heads):
                            x = w[h]
                            for c in range(d):
                                t[c] += x * g[b, k, h, c]
                        for c in range(d):
                            e = (t[c] if y[b, i, c] >= 0 else -t[c]) - abs(y[b, i, c])
                            hinge += e if e > 0 else 0.0
                    else:  # the same sum over fewer channels, one at a time (written out: a call costs here)
                        for q in range(last):
                            if ys[b, i, q] >= beta:
                                break
                            c = order[b, i, q]
                            tc = 0.0
                            for h in range(heads):
                                tc += w[h] * g[b, k, h, c]
                            e = (tc if y[b, i, c] >= 0 else -tc) - abs(y[b, i, c])
                            if e > 0:
                                hinge += e
                        for c in outliers:  # those with β ≤ |y| < β_all (the ones below β were summed)
                            size = abs(y[b, i, c])
                            if beta <= size < beta_all:
                                tc = 0.0
                                for h in range(heads):
                                    tc += w[h] * g[b, k, h, c]
                                e = (tc if y[b, i, c] >= 0 else -tc) - size
                                if e > 0:
                                    hinge += e
                    value -= 2 * hinge
                out[b, k, i] = 0.0 if value < 0 else value

    options = {"nogil": True}
    try:
        return numba.njit(cache=True, **options)(loop)
    except RuntimeError:  # pragma: no cover - no writable cache directory: compile in each process
        return numba.njit(**options)(loop)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether :func:`contributions` computes for these tensors: on the CPU, one float32 or float64 dtype for all,
    numba importable."""
    return compilable(*tensors) and _compiled() is not None


def contributions(a: torch.Tensor, low: LowRank, m: torch.Tensor, y: torch.Tensor, at: torch.Tensor,
                  keys: int) -> torch.Tensor:
    """``(B, R, N)``: ``max(0, ‖y_i‖₁ − ‖y_i − t_ij‖₁)`` with ``t_ij = Σ_h a^h_ij g^h_j + [at_i = j] m_i`` for the
    first ``keys`` keys (0 after them, where no row attends), at the query rows of ``a`` ``(B, H, R, N)``.

    ``g`` in the factors ``low``; ``m``, ``y`` ``(B, R, D)``; ``at`` ``(R,)`` each row's own key. Every tensor
    on the CPU in one of float32 / float64 (:func:`applies`)."""
    b, _, r, n = a.shape
    with torch.no_grad():
        sign = torch.where(y >= 0, 1.0, -1.0).to(y.dtype)
        u = torch.matmul(sign.unsqueeze(1), low.maps.transpose(1, 2))  # (B, H, R, d_h): W^h s_i
        lin = torch.matmul(low.v[:, :, :keys], u.transpose(2, 3))  # (B, H, keys, R): ⟨s_i, g^h_j⟩
        ak = a[..., :keys].permute(0, 3, 2, 1).contiguous()  # (B, keys, R, H)
        # each row's smallest channels in increasing |y| (a pair needing more reads every channel)
        ys, order = y.abs().topk(min(_SORTED, y.shape[-1]), dim=-1, largest=False, sorted=True)
        out = a.new_zeros(b, n, r)
    arrays = [x.detach().contiguous().numpy() for x in (ak, lin, low.peak, low.peak_all, low.outliers, ys, order, y,
                                                         low.g, m)]
    own = at.to(torch.int64).contiguous().numpy()
    split_between_threads(_compiled(), [*arrays, own, out.numpy()], b * keys)
    # a row whose output is not finite has no finite contribution (the loop's comparisons would skip its channels)
    broken = ~torch.isfinite(y).all(-1, keepdim=True)
    return out.transpose(1, 2).masked_fill(broken, float("nan")) if bool(broken.any()) else out.transpose(1, 2)
