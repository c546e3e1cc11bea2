"""The C allocator's policy on long inputs: large blocks go back to the system as soon as they are freed.

glibc's ``malloc`` serves blocks below its mmap threshold from its heaps, and raises that threshold (up to
32 MiB) each time a larger mapped block is freed. A pass over a long input allocates and frees many tensors of a
few to tens of MiB; in the heaps, the holes they leave are reused only by blocks that fit them, so the resident
size grows well past what is alive. On SmolLM2 at 4,096 tokens AGrad's pass peaked at 2.8 GB with the default
policy and at 1.7 GB with a fixed threshold of 8 MiB (every larger block mapped on its own and unmapped when
freed), for about a fifth more time. attnlens sets that threshold once a padded batch of
:data:`LONG_INPUT_TOKENS` or more is formed (:func:`for_long_inputs`), or a pass is planned at half the memory
budget or more (:func:`for_budget_share`), so that the memory budget holds; the
chunks of attention that are recomputed and reduced (``row_attention.CHUNK_ELEMENTS``, 4 MiB) stay below it and
reuse the heap's blocks. A pass that recomputes each layer in its backward (planned where keeping the
activations would not fit the budget) frees and allocates each layer's activations again, blocks of one layer's
hidden states and a few times that, and their holes in the heaps grew its resident size far past what was alive
(a ModernBERT-base-sized model's gradients over 2,048 tokens: 2.3 GiB resident for 0.27 GiB of tensors with an
8 MiB threshold, 0.3 GiB with 3 MiB); within such a pass the threshold is a quarter of a layer's hidden states
(:func:`for_layer_blocks`); so does a batch of explaining or scoring planned at :data:`BUDGET_SHARE` of the budget
or more, with a quarter of the batch's hidden states (:func:`attnlens.core.memory.budget_chunks`). A fine-tuning
step whose batch is split into micro-batches does the same with each
micro-batch's activations (MiniLM-L6, micro-batches of 15 × 256 tokens: 1.99 GiB at the second with an 8 MiB
threshold, 1.51 GiB with 2 MiB, the first alone 1.43 GiB), and so runs under the same threshold. Off glibc nothing
changes. Set ``ATTNLENS_KEEP_MALLOC=1`` to leave the allocator
as it is.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

LONG_INPUT_TOKENS = 1024
BUDGET_SHARE = 0.5  # a pass planned at this share of the memory budget or more sets the policy too
MMAP_THRESHOLD = 8 * 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
MIN_THRESHOLD = 2**19  # a recomputed pass never maps blocks below 512 KiB on their own (each costs a system call)
_threshold: int | None = None  # None: not set yet; 0: it cannot be set here; else the threshold in force


def set_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (``mallopt(M_MMAP_THRESHOLD, ...)``); whether it was set
    (``False`` off Linux/glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):  # musl or another libc
        return False


def for_long_inputs(tokens: int) -> None:
    """Before a pass over ``tokens`` padded tokens: from :data:`LONG_INPUT_TOKENS` on, fix the mmap threshold
    (once per process; not when ``ATTNLENS_KEEP_MALLOC`` is set)."""
    if tokens >= LONG_INPUT_TOKENS:
        _fix_threshold()


def for_budget_share(need: int, budget: int) -> None:
    """Before a pass planned at ``need`` bytes within a memory budget of ``budget``: from :data:`BUDGET_SHARE` of
    the budget on, fix the mmap threshold as for long inputs (once per process; not when ``ATTNLENS_KEEP_MALLOC``
    is set). A pass that fills most of its budget cannot afford the heaps' holes whatever its length: a T5-base-
    sized classifier's raw attention over 715 tokens, planned at 1.0 GiB, peaked at 1.22 GiB with the default
    policy and at 1.09 GiB with the fixed threshold."""
    if need >= BUDGET_SHARE * budget:
        _fix_threshold()


@contextmanager
def for_layer_blocks(block: int) -> Iterator[None]:
    """Within the block, a pass that frees and allocates blocks of ``block`` bytes again and again (one layer's
    hidden states, in a pass that recomputes each layer in its backward; one micro-batch's hidden states, in a
    fine-tuning step) maps every block of a quarter of that or more (at least :data:`MIN_THRESHOLD`, at most
    :data:`MMAP_THRESHOLD`) on its own; the threshold in force before (:data:`MMAP_THRESHOLD` when there was none)
    is restored after it. Not when ``ATTNLENS_KEEP_MALLOC`` is set."""
    global _threshold
    before = _threshold or MMAP_THRESHOLD
    wanted = min(before, max(MIN_THRESHOLD, block // 4))
    if os.environ.get("ATTNLENS_KEEP_MALLOC") or _threshold == 0 or wanted == _threshold:
        yield
        return
    if not set_mmap_threshold(wanted):
        _threshold = 0
        yield
        return
    _threshold = wanted
    try:
        yield
    finally:
        _threshold = before if set_mmap_threshold(before) else 0


def release_free_memory() -> bool:
    """Give the heaps' free blocks back to the system (glibc's ``malloc_trim(0)``), between two phases that each
    plan within the memory budget: a benchmark's explanations, then the forwards that score them (MiniLM, 8
    reviews of 256 tokens, GAE within 128 MiB: 161 MiB above the process's baseline without it, 122 MiB with
    it). Whether it ran (``False`` off glibc, or with ``ATTNLENS_KEEP_MALLOC`` set)."""
    if not sys.platform.startswith("linux") or os.environ.get("ATTNLENS_KEEP_MALLOC"):
        return False
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # musl or another libc
        return False
    return True


def _fix_threshold() -> None:
    global _threshold
    if _threshold is None and not os.environ.get("ATTNLENS_KEEP_MALLOC"):
        _threshold = MMAP_THRESHOLD if set_mmap_threshold() else 0
