"""The most tensor memory alive at once within a block: an exact count, independent of the C allocator, to check
memory estimates against.

:class:`LiveTensorPeak` sees every tensor an operation returns inside the block (a ``TorchDispatchMode``, so the
tensors autograd saves for the backward are seen too) and counts each storage's bytes from its creation until it
is freed. Storages created before the block (the model's weights) are not counted. Resident memory
(``/usr/bin/time -f %M``) adds the allocator's holes and the runtime to this, which the benchmarks measure.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveTensorPeak"]


class LiveTensorPeak(TorchDispatchMode):
    """Within ``with LiveTensorPeak() as live:``, ``live.peak`` is the largest number of bytes held at once by
    tensor storages created in the block, and ``live.bytes`` those held now.

    >>> import torch
    >>> with LiveTensorPeak() as live:
    ...     a = torch.ones(1000)           # 4,000 bytes
    ...     b = a * 2                      # 8,000 alive
    ...     del a
    ...     c = b + 1                      # still 8,000: a was freed
    >>> live.peak, live.bytes
    (8000, 8000)
    >>> weight = torch.ones(1000, 1000)
    >>> with LiveTensorPeak() as live:
    ...     t = weight.t()                 # a view of a tensor made before the block: nothing new
    ...     _ = weight.mul_(2)             # in place: nothing new
    >>> live.peak
    0
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: only storages the operation made are new
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                self._track(value.untyped_storage(), inputs)
        return out

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._alive or key in inputs:
            return
        self._alive.add(key)
        self.bytes += size
        self.peak = max(self.peak, self.bytes)
        # the storage's Python object lives as long as the storage (PyTorch preserves it while C++ holds it)
        weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        self._alive.discard(key)
        self.bytes -= size
