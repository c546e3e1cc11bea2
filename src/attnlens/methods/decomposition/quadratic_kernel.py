"""GlobEnc's and attention norm's quadratic forms on the CPU in one compiled loop (numba).

``Σ_hk a^h_ij a^k_ij G_j[h, k]`` for every row i and key j of a chunk: per row, the ``H(H+1)/2`` products over
the keys, each a contiguous pass in cache (the Gram matrices key-last), summed in float64 in the order the
elementwise PyTorch products take (the same numbers to float64's rounding), without the float64 copy of the
weights those need.
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

    def loop(a: np.ndarray, gram: np.ndarray, out: np.ndarray, start: int, stop: int, step: int) -> None:
        # items = (example, row) pairs, every step-th of [start, stop);
        # out[b, i, k] = Σ_hh' a[b,h,i,k] a[b,h',i,k] G[b,h,h',k]
        heads, rows, keys = a.shape[1], a.shape[2], out.shape[2]
        inner = np.empty(keys, dtype=np.float64)
        for item in range(start, stop, step):
            b = item // rows
            i = item % rows
            for k in range(keys):
                out[b, i, k] = 0.0
            for h in range(heads):
                for k in range(keys):
                    inner[k] = a[b, h, i, k] * gram[b, h, h, k]
                for h2 in range(h + 1, heads):
                    for k in range(keys):
                        inner[k] += 2.0 * a[b, h2, i, k] * gram[b, h, h2, k]
                for k in range(keys):
                    out[b, i, k] += a[b, h, i, k] * inner[k]

    options = {"nogil": True}
    try:
        return numba.njit(cache=True, **options)(loop)
    except RuntimeError:  # pragma: no cover - no writable cache directory: compile in each process
        return numba.njit(**options)(loop)


def applies(a: torch.Tensor, gram: torch.Tensor) -> bool:
    """Whether :func:`quadratic_rows` computes for these tensors: on the CPU, the weights in float32 or float64,
    the Gram matrices in float64, numba importable."""
    return compilable(a) and compilable(gram) and gram.dtype == torch.float64 and _compiled() is not None


def quadratic_rows(a: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``(B, R, N)`` in float64: Σ_hk a^h_ij a^k_ij G_j[h, k] for ``a`` ``(B, H, R, N)`` and the symmetric
    ``gram`` ``(B, N, H, H)`` (float64), as :func:`~attnlens.methods.decomposition.pair_norms.quadratic_rows`
    defines it."""
    b, _, r, n = a.shape
    with torch.no_grad():
        key_last = gram.permute(0, 2, 3, 1).contiguous()  # (B, H, H, N): each pair of heads' values over the keys
        out = torch.empty(b, r, n, dtype=torch.float64)
    split_between_threads(_compiled(), [a.detach().contiguous().numpy(), key_last.numpy(), out.numpy()], b * r)
    return out
