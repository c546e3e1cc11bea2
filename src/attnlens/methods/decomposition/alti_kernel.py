"""ALTI's L1 distances on the CPU in one compiled loop (numba), without materialising the vectors t_ij.

ALTI needs, per pair of a query row i and a key j, ``‖t_ij − y_i‖₁`` with ``t_ij = Σ_h a^h_ij g^h_j (+ m_i where
j is i's own position)``: ``H·D`` multiply-adds and ``D`` absolute values per pair. Built from PyTorch operations
the vectors are written to memory by a batched product and read back three times (subtract, absolute value, sum);
here each block of four rows is accumulated over the heads (three at a time) in a buffer that stays in the
core's L1 cache and reduced at once. The loop is compiled on first use (cached on disk by
numba) and releases the GIL, so the keys are split between as many Python threads as torch uses.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from .compiled import compilable, split_between_threads


@functools.cache
def _compiled() -> Any:
    """The compiled loop, or None where numba cannot be imported (the caller then uses PyTorch operations)."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; a platform without its wheels falls back
        return None

    def loop(ak: np.ndarray, g: np.ndarray, y: np.ndarray, m: np.ndarray, at: np.ndarray, first: np.ndarray,
             dist: np.ndarray, start: int, stop: int, step: int) -> None:
        # items = (example, key) pairs, every step-th of [start, stop);
        # dist[b, k, i] = ‖Σ_h ak[b,k,i,h] g[b,k,h] + δ m[b,i] − y[b,i]‖₁
        keys, rows, heads = ak.shape[1], ak.shape[2], ak.shape[3]
        d = g.shape[3]
        t = np.empty((4, d), dtype=g.dtype)
        for item in range(start, stop, step):
            b = item // keys
            k = item % keys
            for i0 in range(first[k], rows, 4):
                n = min(4, rows - i0)
                for q in range(n):
                    i = i0 + q
                    if at[i] == k:
                        for c in range(d):
                            t[q, c] = m[b, i, c] - y[b, i, c]
                    else:
                        for c in range(d):
                            t[q, c] = -y[b, i, c]
                if n == 4:  # three heads per sweep over the D channels: a third of the stores to t
                    h = 0
                    while h + 3 <= heads:
                        a00, a01, a02 = ak[b, k, i0, h], ak[b, k, i0, h + 1], ak[b, k, i0, h + 2]
                        a10, a11, a12 = ak[b, k, i0 + 1, h], ak[b, k, i0 + 1, h + 1], ak[b, k, i0 + 1, h + 2]
                        a20, a21, a22 = ak[b, k, i0 + 2, h], ak[b, k, i0 + 2, h + 1], ak[b, k, i0 + 2, h + 2]
                        a30, a31, a32 = ak[b, k, i0 + 3, h], ak[b, k, i0 + 3, h + 1], ak[b, k, i0 + 3, h + 2]
                        for c in range(d):
                            u, v, x = g[b, k, h, c], g[b, k, h + 1, c], g[b, k, h + 2, c]
                            t[0, c] += a00 * u + a01 * v + a02 * x
                            t[1, c] += a10 * u + a11 * v + a12 * x
                            t[2, c] += a20 * u + a21 * v + a22 * x
                            t[3, c] += a30 * u + a31 * v + a32 * x
                        h += 3
                    while h < heads:
                        w0, w1, w2, w3 = ak[b, k, i0, h], ak[b, k, i0 + 1, h], ak[b, k, i0 + 2, h], ak[b, k, i0 + 3, h]
                        for c in range(d):
                            v = g[b, k, h, c]
                            t[0, c] += w0 * v
                            t[1, c] += w1 * v
                            t[2, c] += w2 * v
                            t[3, c] += w3 * v
                        h += 1
                else:
                    for h in range(heads):
                        for q in range(n):
                            w = ak[b, k, i0 + q, h]
                            for c in range(d):
                                t[q, c] += w * g[b, k, h, c]
                for q in range(n):
                    s = 0.0
                    for c in range(d):
                        s += abs(t[q, c])
                    dist[b, k, i0 + q] = s

    # reassociation lets the sums vectorise; no assumption about NaN or infinity (a NaN still shows)
    options = {"nogil": True, "fastmath": {"reassoc", "contract"}}
    try:
        return numba.njit(cache=True, **options)(loop)
    except RuntimeError:  # pragma: no cover - no writable cache directory: compile in each process
        return numba.njit(**options)(loop)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether :func:`distances` computes for these tensors: :func:`~.compiled.compilable` ones, numba
    importable."""
    return compilable(*tensors) and _compiled() is not None


def distances(ak: torch.Tensor, g: torch.Tensor, y: torch.Tensor, m: torch.Tensor, at: torch.Tensor,
              first: torch.Tensor, dist: torch.Tensor) -> None:
    """Write ``‖Σ_h ak[b,k,i,h] g[b,k,h] + [at_i = k] m[b,i] − y[b,i]‖₁`` into ``dist[b, k, i]`` for every
    example ``b``, key ``k < ak.shape[1]`` and row ``i ≥ first[k]`` (the rows before ``first[k]`` are left as they
    are).

    ``ak`` ``(B, K, R, H)``: the rows' attention to the keys, key-major; ``g`` ``(B, ≥K, H, D)`` the keys'
    per-head vectors; ``y``, ``m`` ``(B, R, D)``; ``at`` ``(R,)`` each row's own key; ``first`` ``(K,)``;
    ``dist`` ``(B, ≥K, R)``, contiguous. Every tensor on the CPU in one of float32 / float64 (:func:`applies`)."""
    if not dist.is_contiguous():
        raise ValueError("dist must be contiguous: the loop writes into its memory")
    loop = _compiled()
    b, keys = ak.shape[0], ak.shape[1]
    arrays = [x.detach().contiguous().numpy() for x in (ak, g[:, :keys], y, m)]
    index = [x.detach().to(torch.int64).contiguous().numpy() for x in (at, first)]
    out = dist.detach().numpy()  # shares the caller's tensor's memory
    split_between_threads(loop, [*arrays, *index, out], b * keys)
