"""What the compiled loops (numba) of the decomposition methods share: which tensors they read, and the split
of their items between threads (each loop releases the GIL)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

DTYPES = (torch.float32, torch.float64)

_POOLS: dict[int, ThreadPoolExecutor] = {}  # per thread count, started once per process
_POOLS_LOCK = threading.Lock()


def _forget_pools() -> None:
    """In a forked child: the parent's threads did not come along (nor may its lock be free); start afresh."""
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def compilable(*tensors: torch.Tensor) -> bool:
    """Whether a compiled loop reads these tensors: on the CPU, one float32 or float64 dtype for all."""
    dtype = tensors[0].dtype
    return dtype in DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)


def _pool(threads: int) -> ThreadPoolExecutor:
    """The threads the loops run on, started once per process (a layer's loop runs in a few milliseconds: starting
    threads for each took a tenth of ALTI's time at 512 tokens)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(threads)
        if pool is None:
            pool = _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="attnlens-loop")
        return pool


def split_between_threads(loop: Any, args: list[Any], items: int) -> None:
    """``loop(*args, start, stop, step)`` over ``[0, items)``, one call per thread torch uses, each taking every
    ``step``-th item from its own ``start``: interleaved, so that threads share items of unequal work evenly (a
    causal chunk's first keys are read by every row, its last by a few)."""
    threads = max(1, torch.get_num_threads())
    shares = min(threads, items)
    if shares <= 1:
        loop(*args, 0, items, 1)
        return
    pool = _pool(threads)
    for done in [pool.submit(loop, *args, start, items, shares) for start in range(shares)]:
        done.result()
