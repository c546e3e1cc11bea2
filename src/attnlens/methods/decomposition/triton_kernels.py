"""The pair norms on a CUDA GPU in Triton kernels, each pair of a row and a key reduced where it is formed.

- **ALTI's L1 distances.** The vectors ``t_ij = Σ_h a^h_ij g^h_j (+ m_i where j is i's own position)`` have the
  hidden size D for every pair. Formed by a batched product, each is written to the GPU's memory and read back to
  subtract ``y_i``, take absolute values and sum (SmolLM2 at 8,192 tokens: about 580 billion floats over its 30
  layers). Here a program holds a tile of keys × rows × a slice of D in registers, accumulates it over the heads
  and reduces it at once, so only the attention weights, the per-head vectors and the distances move through
  memory. Tiles whose rows all come before the first row a key needs are skipped (a causal chunk's earlier rows
  attend to no later key).
- **GlobEnc's and attention norm's quadratic forms** ``a_ijᵀ G_j a_ij`` in float64: a program reads a tile of
  keys × rows × heads of the weights once, and each key's Gram matrix a row at a time, instead of a float64 copy of
  the weights, a batched product written to memory and its sum.

Triton ships with PyTorch's CUDA builds; where it cannot be imported the callers use PyTorch operations.
"""

from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace
from typing import Any

import torch

# ALTI: a tile of keys x rows x channels held in registers, 8,192 accumulators per program of 4 warps (float32);
# eight tiles from 16 x 16 x 32 to 64 x 16 x 8 took 3.9-5.1 ms on one chunk of SmolLM2 at 8,176 tokens (an H200)
_KEYS, _ROWS, _CHANNELS, _WARPS = 16, 64, 8, 4
# quadratic forms: a tile of keys x rows, every head of it in registers: 8,192 float64s per program (64 keys:
# 0.17 ms on one chunk of SmolLM2 at 8,176 tokens on an H200, against 0.33-0.82 ms for smaller tiles)
_QUAD_KEYS, _QUAD_TILE = 64, 8192
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@functools.cache
def _kernels() -> Any:
    """The kernels (``alti``, ``quadratic``), or None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def alti(a, g, y, m, at, first, dist, heads, rows_n, keys_n, d_n, g_keys, dist_keys,
             acc_type: tl.constexpr, block_k: tl.constexpr, block_r: tl.constexpr, block_d: tl.constexpr):
        # a (B, H, R, N); g (B, G, H, D); y, m (B, R, D); at (R,); first (N,); dist (B, DK, R); all contiguous
        b = tl.program_id(0).to(tl.int64)
        k0 = tl.program_id(1) * block_k
        r0 = tl.program_id(2) * block_r
        # ``first`` does not decrease along the keys: the tile's first key needs the most rows
        if r0 + block_r > tl.load(first + k0):
            keys = k0 + tl.arange(0, block_k)
            rows = r0 + tl.arange(0, block_r)
            key_ok = keys < keys_n
            row_ok = rows < rows_n
            pair_ok = key_ok[:, None] & row_ok[None, :]
            own = tl.load(at + rows, mask=row_ok, other=-1)
            is_own = (own[None, :] == keys[:, None])[:, :, None]
            a_tile = a + b * heads * rows_n * keys_n + rows[None, :] * keys_n + keys[:, None]
            g_tile = g + b * g_keys * heads * d_n + keys[:, None] * heads * d_n
            y_rows = y + b * rows_n * d_n + rows[:, None] * d_n
            m_rows = m + b * rows_n * d_n + rows[:, None] * d_n
            total = tl.zeros([block_k, block_r], dtype=acc_type)
            for d0 in range(0, d_n, block_d):
                channels = d0 + tl.arange(0, block_d)
                channel_ok = channels < d_n
                row_channel = row_ok[:, None] & channel_ok[None, :]
                yv = tl.load(y_rows + channels[None, :], mask=row_channel, other=0.0).to(acc_type)
                mv = tl.load(m_rows + channels[None, :], mask=row_channel, other=0.0).to(acc_type)
                t = tl.where(is_own, mv[None, :, :], 0.0) - yv[None, :, :]
                for h in range(heads):
                    w = tl.load(a_tile + h * rows_n * keys_n, mask=pair_ok, other=0.0).to(acc_type)
                    gv = tl.load(g_tile + h * d_n + channels[None, :], mask=key_ok[:, None] & channel_ok[None, :],
                                 other=0.0).to(acc_type)
                    t += w[:, :, None] * gv[:, None, :]
                total += tl.sum(tl.abs(t), axis=2)
            needs = tl.load(first + keys, mask=key_ok, other=rows_n)
            out = dist + b * dist_keys * rows_n + keys[:, None] * rows_n + rows[None, :]
            tl.store(out, total.to(dist.dtype.element_ty), mask=pair_ok & (rows[None, :] >= needs[:, None]))

    @triton.jit
    def quadratic(a, gram, out, heads, rows_n, keys_n, block_k: tl.constexpr, block_r: tl.constexpr,
                  block_h: tl.constexpr):
        # a (B, H, R, N); gram (B, N, H, H) float64; out (B, R, N) float64; all contiguous
        b = tl.program_id(0).to(tl.int64)
        keys = tl.program_id(1) * block_k + tl.arange(0, block_k)
        rows = tl.program_id(2) * block_r + tl.arange(0, block_r)
        hs = tl.arange(0, block_h)
        key_ok = keys < keys_n
        row_ok = rows < rows_n
        pair_ok = key_ok[:, None] & row_ok[None, :]
        head_ok = hs < heads
        a_pairs = a + b * heads * rows_n * keys_n + rows[None, :] * keys_n + keys[:, None]  # (keys, rows)
        every = tl.load(a_pairs[:, :, None] + hs[None, None, :] * rows_n * keys_n,
                        mask=pair_ok[:, :, None] & head_ok[None, None, :], other=0.0).to(tl.float64)
        g_keys = gram + b * keys_n * heads * heads + keys[:, None] * heads * heads + hs[None, :]  # (keys, heads)
        total = tl.zeros([block_k, block_r], dtype=tl.float64)
        for h in range(heads):
            g_row = tl.load(g_keys + h * heads, mask=key_ok[:, None] & head_ok[None, :], other=0.0)
            inner = tl.sum(every * g_row[:, None, :], axis=2)  # (keys, rows): Σ_k G_j[h, k] a^k_ij
            w = tl.load(a_pairs + h * rows_n * keys_n, mask=pair_ok, other=0.0).to(tl.float64)
            total += w * inner
        tl.store(out + b * rows_n * keys_n + rows[None, :] * keys_n + keys[:, None], total, mask=pair_ok)

    return SimpleNamespace(alti=alti, quadratic=quadratic)


class KernelFailed(RuntimeError):
    """A kernel could not be compiled or launched here; the caller computes with PyTorch operations instead."""


_failure: str | None = None  # why the kernels failed in this process (then they are not tried again)


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels compute for these tensors: on one CUDA device, floating point, Triton importable, and
    no kernel failed to compile or launch in this process."""
    device = tensors[0].device
    return (device.type == "cuda" and all(t.device == device and t.dtype in _FLOATS for t in tensors)
            and _failure is None and _kernels() is not None)


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Run ``kernel``; a kernel that fails to compile or launch (a GPU or Triton release it does not support) is
    a one-time warning and :class:`KernelFailed`, after which :func:`applies` is false."""
    global _failure
    try:
        kernel[grid](*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - Triton raises many kinds; the PyTorch path computes the same
        _failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        warnings.warn(f"attnlens' Triton kernels cannot run here ({_failure}); the pair norms are computed with "
                      "PyTorch operations instead (same scores, slower)", stacklevel=3)
        raise KernelFailed(_failure) from exc


def alti_distances(a: torch.Tensor, g: torch.Tensor, y: torch.Tensor, m: torch.Tensor, at: torch.Tensor,
                   first: torch.Tensor, dist: torch.Tensor) -> None:
    """Write ``‖Σ_h a[b,h,i,k] g[b,k,h] + [at_i = k] m[b,i] − y[b,i]‖₁`` into ``dist[b, k, i]`` for every example
    ``b``, key ``k < a.shape[-1]`` and row ``i ≥ first[k]`` (the rows before ``first[k]`` are left as they are).

    ``a`` ``(B, H, R, N)``: the rows' attention; ``g`` ``(B, ≥N, H, D)`` the keys' per-head vectors; ``y``, ``m``
    ``(B, R, D)``; ``at`` ``(R,)`` each row's own key; ``first`` ``(N,)``, not decreasing; ``dist``
    ``(B, ≥N, R)``, contiguous. Accumulates in float32 (float64 for float64 inputs)."""
    if not dist.is_contiguous():
        raise ValueError("dist must be contiguous: the kernel writes into its memory")
    import triton.language as tl

    b, heads, r, n = a.shape
    if not (b and r and n):
        return
    wide = torch.float64 in (a.dtype, g.dtype, y.dtype, m.dtype)
    channels = _CHANNELS // 2 if wide else _CHANNELS
    a, g, y, m = (x.detach().contiguous() for x in (a, g, y, m))
    at = at.to(device=a.device, dtype=torch.int64).contiguous()
    first = first.to(device=a.device, dtype=torch.int64).contiguous()
    grid = (b, -(-n // _KEYS), -(-r // _ROWS))
    _launch(_kernels().alti, grid, a, g, y, m, at, first, dist, heads, r, n, g.shape[-1], g.shape[1], dist.shape[1],
            acc_type=tl.float64 if wide else tl.float32, block_k=_KEYS, block_r=_ROWS, block_d=channels,
            num_warps=_WARPS)


def quadratic_rows(a: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``(B, R, N)`` in float64: ``Σ_hk a^h_ij a^k_ij G_j[h, k]`` for the weights ``a`` ``(B, H, R, N)`` and the
    Gram matrices ``gram`` ``(B, N, H, H)`` (float64)."""
    b, heads, r, n = a.shape
    out = torch.empty(b, r, n, dtype=torch.float64, device=a.device)
    if not (b and r and n):
        return out
    a = a.detach().contiguous()
    gram = gram.detach().to(torch.float64).contiguous()
    block_h = max(2, 1 << (heads - 1).bit_length())
    block_r = max(1, _QUAD_TILE // (_QUAD_KEYS * block_h))
    grid = (b, -(-n // _QUAD_KEYS), -(-r // block_r))
    _launch(_kernels().quadratic, grid, a, gram, out, heads, r, n, block_k=_QUAD_KEYS, block_r=block_r,
            block_h=block_h)
    return out
