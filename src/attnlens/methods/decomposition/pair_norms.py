"""The norm of each source token's vector at each row: GlobEnc's and attnnorm's norms through Gram matrices,
ALTI's L1 distances to the row's output (a compiled loop on the CPU), a chunk of rows at a time."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...core.row_attention import chunk_elements
from . import alti_hinge, alti_kernel, quadratic_kernel, triton_kernels
from .layers import Layer

# elements of ALTI's block of vectors t_ij (keys x rows x D): 8 MiB in float32, measured fastest on 2 CPU cores
# (2^19 to 2^23 tried; 12x faster than one (B, rows, N, D) einsum of 2^24 elements); on an accelerator, where each
# block's kernels are launched from Python, the chunk size of the recomputed maps (row_attention.chunk_elements)
_ALTI_BLOCK = 2**21
# blocks of keys of GlobEnc's and attention norm's quadratic forms on an accelerator (_quadratic_batched)
_QUADRATIC_BLOCKS = 2


@dataclass
class Mixing:
    """One attention's mixing alone, at some of its query rows: the residual ``x`` at those rows ``(B, R, D)``,
    their weights ``attn`` ``(B, H, R, Nk)``, the keys' transformed value vectors ``f`` ``(B, H, Nk, D)`` and the
    rows' query positions ``positions`` ``(R,)`` (``None``: every query, R = Nq; what :func:`norm_matrix`
    reads)."""

    x: torch.Tensor
    attn: torch.Tensor
    f: torch.Tensor
    positions: torch.Tensor | None = None


def gram_matrices(g: torch.Tensor) -> torch.Tensor:
    """``(B, N, H, H)``: G_j = [⟨g^h_j, g^k_j⟩]_hk of per-head vectors ``g`` ``(B, H, N, D)``."""
    return torch.einsum("bhjd,bkjd->bjhk", g, g)


def quadratic_rows(a: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``(B, R, N)`` in float64: Σ_hk a^h_ij a^k_ij G_j[h, k] for ``a`` ``(B, H, R, N)`` and the symmetric ``gram``
    ``(B, N, H, H)`` (float64).

    On the CPU as H(H+1)/2 elementwise products over the rows, in one compiled loop
    (:mod:`~attnlens.methods.decomposition.quadratic_kernel`; a batched ``H × H`` product per key moves the data
    around more than it computes there: five times slower at H = 9). On a CUDA GPU one Triton kernel reads each
    weight once (:mod:`~attnlens.methods.decomposition.triton_kernels`). On other accelerators each of those
    products would be a kernel launched from Python, so there it is one batched product per key,
    ``(B·N, R, H) @ (B·N, H, H)``, and a sum: a few kernels per block of keys (:func:`_quadratic_batched`)."""
    if triton_kernels.applies(a, gram):
        try:
            return triton_kernels.quadratic_rows(a, gram)
        except triton_kernels.KernelFailed:  # warned once; computed as other accelerators do
            pass
    if quadratic_kernel.applies(a, gram):
        return quadratic_kernel.quadratic_rows(a, gram)
    if a.device.type == "cpu":
        return _quadratic_elementwise(a.double(), gram)
    return _quadratic_batched(a, gram)


def _quadratic_elementwise(a: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    g = gram.permute(0, 2, 3, 1)  # (B, H, H, N): G[h, k] over the keys
    heads = a.shape[1]
    out = torch.zeros_like(a[:, 0])
    for h in range(heads):
        inner = a[:, h] * g[:, h, h, None, :]
        for k in range(h + 1, heads):
            inner.addcmul_(a[:, k], g[:, h, k, None, :], value=2.0)
        out.addcmul_(a[:, h], inner)
    return out


def _quadratic_batched(a: torch.Tensor, gram: torch.Tensor, blocks: int = _QUADRATIC_BLOCKS) -> torch.Tensor:
    """:func:`quadratic_rows` as ``(a_j G_j) · a_j`` per key j, the keys in ``blocks`` blocks: each block's
    key-major float64 copy of ``a`` and its product hold four float32s per element of the block, so two blocks
    hold as much as one float64 copy of the whole ``a`` (what the elementwise products hold)."""
    b, _, r, n = a.shape
    out = torch.empty(b, r, n, dtype=torch.float64, device=a.device)
    step = max(1, -(-n // blocks))
    for s in range(0, n, step):
        e = min(n, s + step)
        ak = a[..., s:e].permute(0, 3, 2, 1).to(torch.float64, memory_format=torch.contiguous_format)  # (B, K, R, H)
        out[..., s:e] = torch.matmul(ak, gram[:, s:e]).mul_(ak).sum(-1).transpose(1, 2)
    return out


def keys_used(a: torch.Tensor, at: torch.Tensor) -> int:
    """How many leading keys the rows of ``a`` ``(B, H, R, N)`` (positions ``at``) involve: up to the last key any
    row attends to or is (a causal chunk's rows attend to no key after their last one; their terms are 0 there)."""
    attended = torch.nonzero(a.abs().amax(dim=(0, 1, 2))).flatten()
    return max(int(attended[-1]) + 1 if len(attended) else 0, int(at.max()) + 1 if len(at) else 0)


def _keys_to_compute(a: torch.Tensor, at: torch.Tensor) -> int:
    """The leading keys :func:`norm_rows` computes: :func:`keys_used` on the CPU; every key on an accelerator,
    where finding the last attended key waits for the device (once per chunk) and costs more than the zero terms
    after it."""
    return keys_used(a, at) if a.device.type == "cpu" else a.shape[-1]


@dataclass
class ResidualTerms:
    """What the residual adds to :func:`norm_rows` at each position i of a layer, computed once per layer:
    ``cross`` ``(B, H, N)`` = ⟨g^h_i, m_i⟩ and ``square`` ``(B, N)`` = ‖m_i‖², float64."""

    cross: torch.Tensor
    square: torch.Tensor

    @classmethod
    def of(cls, g: torch.Tensor, m: torch.Tensor) -> ResidualTerms:
        """From per-head vectors ``g`` ``(B, H, N, D)`` and the residual ``m`` ``(B, N, D)`` at every position."""
        m = m.double()
        return cls(torch.einsum("bhnd,bnd->bhn", g, m), (m * m).sum(-1))


def norm_rows(a: torch.Tensor, g: torch.Tensor, gram: torch.Tensor, m: torch.Tensor | ResidualTerms | None,
               at: torch.Tensor) -> torch.Tensor:
    """``(B, R, N)`` in float64: ‖Σ_h α^h_ij g^h_j (+ δ_ij m_i)‖² at the query rows of ``a`` ``(B, H, R, N)``,
    whose positions are ``at`` ``(R,)``, with ``g`` ``(B, H, N, D)``, its :func:`gram_matrices` and the residual:
    ``m`` ``(B, R, D)`` at those rows, or its :class:`ResidualTerms` at every position (``None``: no residual).
    On the CPU, keys after :func:`keys_used` give 0 without being computed."""
    stop = _keys_to_compute(a, at)
    sq = a.new_zeros(a.shape[0], a.shape[2], a.shape[3], dtype=torch.float64)
    sq[..., :stop] = quadratic_rows(a[..., :stop], gram[:, :stop])
    if m is not None:
        rows = torch.arange(a.shape[2], device=a.device)
        own = a[:, :, rows, at].double()  # (B, H, R): each row's weights on its own position
        if isinstance(m, ResidualTerms):
            diag = 2 * (own * m.cross[:, :, at]).sum(1) + m.square[:, at]
        else:
            diag = 2 * torch.einsum("bhr,bhrd,brd->br", own, g[:, :, at], m) + (m * m).sum(-1)
        sq[:, rows, at] += diag
    return sq


def norm_matrix(layer: Layer | Mixing, transform: Callable[[torch.Tensor], torch.Tensor],
                 scale: torch.Tensor | None, residual: bool) -> torch.Tensor:
    """``(B, R, N)``: ‖M z_ij‖ · scale_i for a linear map M (``transform``) at the query rows i the mixing holds
    (every row of a :class:`Layer`: R = N), without forming the ``(B, R, N, D)`` vectors: with g^h_j = M f^h(x_j)
    and G_j = [⟨g^h_j, g^k_j⟩]_hk, ‖Σ_h α^h_ij g^h_j‖² = α_ij^T G_j α_ij, plus, where j = i with the residual,
    2 Σ_h α^h_ii ⟨g^h_i, M x_i⟩ + ‖M x_i‖²."""
    g = transform(layer.f).double()  # (B, H, N, D)
    at = getattr(layer, "positions", None)
    at = torch.arange(layer.attn.shape[2], device=g.device) if at is None else at.to(g.device)
    m = transform(layer.x).double() if residual else None  # (B, R, D): the residual at the rows
    sq = norm_rows(layer.attn, g, gram_matrices(g), m, at)
    out = sq.clamp_min(0).sqrt().to(layer.x.dtype)
    return out if scale is None else out * scale


def alti_block(device: torch.device | str) -> int:
    """Elements of ALTI's block of vectors t_ij on ``device``: :data:`_ALTI_BLOCK` on the CPU, the chunk size of
    the recomputed maps on an accelerator (:func:`~attnlens.core.row_attention.chunk_elements`)."""
    return _ALTI_BLOCK if torch.device(device).type == "cpu" else chunk_elements(device)


def alti_rows(a: torch.Tensor, g: torch.Tensor | None, m: torch.Tensor, y: torch.Tensor, at: torch.Tensor,
               low_rank: alti_hinge.LowRank | None = None) -> torch.Tensor:
    """``(B, R, N)``: max(0, ‖y_i‖₁ − ‖y_i − t_ij‖₁) with t_ij = Σ_h a^h_ij g^h_j + δ_ij m_i, at the query rows of
    ``a`` ``(B, H, R, N)`` (positions ``at``), ``g`` ``(B, N, H, D)`` (key-major), the residual ``m`` and ``y``
    ``(B, R, D)`` there.

    ``low_rank``: the vectors g in factors (:class:`~attnlens.methods.decomposition.alti_hinge.LowRank`; ``g``
    may then be ``None``); on the CPU (float32 / float64) the contributions are then a product of matrices of
    ``d_h`` features and a correction the pairs with large weights need
    (:mod:`~attnlens.methods.decomposition.alti_hinge`). Without them, on the CPU a compiled loop forms each t a
    few rows at a time in cache and reduces it at once (:mod:`~attnlens.methods.decomposition.alti_kernel`); on a
    CUDA GPU a Triton kernel forms a tile of them in registers
    (:mod:`~attnlens.methods.decomposition.triton_kernels`). Elsewhere the vectors t are formed
    a block of keys at a time (every example's) as one batched product over the keys,
    ``(B·keys, R, H) @ (B·keys, H, D)``, into a reused buffer of :func:`alti_block` elements (small enough to
    stay in cache while its distances are taken). Either way only the pairs that need it are computed: a row
    neither attending to a key nor placed there has t = 0, a distance of ‖y_i‖₁ and so 0, so each key is computed
    from the first row that needs it on (a causal chunk's earlier rows attend to no later key), and no key after
    the last one any row needs."""
    if low_rank is not None and alti_hinge.applies(a, y, m, low_rank.v, low_rank.maps, low_rank.g):
        return alti_hinge.contributions(a, low_rank, m, y, at, keys_used(a, at))
    if g is None:
        raise ValueError("alti_rows needs the vectors g where their factors are not read")
    b, h, r, n = a.shape
    d = g.shape[-1]
    norms = torch.linalg.vector_norm(y, ord=1, dim=-1)  # (B, R)
    # (B, keys, R): ‖y_i‖₁ where t_ij = 0; a copy, never a view of ``norms`` (with one key the expanded view is
    # already contiguous, and writing the distances into it would overwrite the norms)
    dist = norms.unsqueeze(1).expand(b, n, r).clone(memory_format=torch.contiguous_format)
    # per row the last key it needs (the last it attends to in any example and head, or its own position), as a
    # running maximum: the rows a block starting at key k needs begin at the first whose value reaches k
    last = torch.where(a.ne(0).any(1).any(0), torch.arange(n, device=a.device), -1).amax(-1)
    needed = torch.maximum(last, at).cummax(0).values
    if triton_kernels.applies(a, g, y, m):  # CUDA: one Triton kernel, no vectors t written to memory, no wait
        first = torch.searchsorted(needed, torch.arange(n, device=a.device))  # R past the last key needed
        try:
            triton_kernels.alti_distances(a, g, y, m, at, first, dist)
            return (norms.unsqueeze(-1) - dist.transpose(1, 2)).clamp_min(0)
        except triton_kernels.KernelFailed:  # warned once; it failed before it ran, so dist is as it was
            pass
    stop = keys_used(a, at)
    ak = a[:, :, :, :stop].permute(0, 3, 2, 1).contiguous()  # (B, keys, R, H)
    if alti_kernel.applies(ak, g, y, m):  # CPU: one compiled loop, no vectors t written to memory
        first = torch.searchsorted(needed, torch.arange(stop))
        alti_kernel.distances(ak, g, y, m, at, first, dist)
        return (norms.unsqueeze(-1) - dist.transpose(1, 2)).clamp_min(0)
    needed = needed.tolist()
    positions = at.tolist()
    keys = max(1, min(stop, alti_block(a.device) // max(1, b * r * d)))  # keys per block, every example's at once
    buffer = a.new_empty(b * keys * r * d)
    for start in range(0, stop, keys):
        end = min(stop, start + keys)
        first = bisect.bisect_left(needed, start)
        rows = r - first
        if not rows:
            continue
        t = buffer[: b * (end - start) * rows * d].view(b * (end - start), rows, d)
        torch.bmm(ak[:, start:end, first:].reshape(-1, rows, h), g[:, start:end].reshape(-1, h, d), out=t)
        t = t.view(b, end - start, rows, d).sub_(y[:, None, first:])  # t_ij − y_i
        own = [k for k in range(first, r) if start <= positions[k] < end]  # rows whose own key is in the block
        if own:
            on = torch.tensor(own, device=a.device)
            t[:, at[on] - start, on - first] += m[:, on]
        dist[:, start:end, first:] = t.abs_().sum(-1)
    return (norms.unsqueeze(-1) - dist.transpose(1, 2)).clamp_min(0)


def row_normalised(m: torch.Tensor) -> torch.Tensor:
    return m / m.sum(-1, keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)
