"""What the compiled loops (numba) of the decomposition methods share: which tensors they read, and the split
of their items between threads (each loop releases the GIL)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

DTYPES = (torch.float32, torch.float64)


def compilable(*tensors: torch.Tensor) -> bool:
    """Whether a compiled loop reads these tensors: on the CPU, one float32 or float64 dtype for all."""
    dtype = tensors[0].dtype
    return dtype in DTYPES and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)


def split_between_threads(loop: Any, args: list[Any], items: int) -> None:
    """``loop(*args, start, stop)`` over ``[0, items)``, split into one range per thread torch uses."""
    threads = max(1, min(torch.get_num_threads(), items))
    if threads == 1:
        loop(*args, 0, items)
        return
    step = math.ceil(items / threads)
    with ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(loop, *args, s, min(items, s + step)) for s in range(0, items, step)]:
            done.result()
