"""Independent CPU work spread over forked processes, for compiled code that holds the GIL (threads would not help).

The work runs in copies of this process made by ``fork``, so the children see the parent's arrays without
copying or pickling them; only the chunks' descriptions and the results travel. Forking is only done where it
is safe for this purpose: on Linux, from the main thread, outside daemon processes (a pool's worker may not have
children). Everywhere else, and where a child dies, the chunks run here, one after another; the results are the
same either way.

The children run numpy and scipy code only: torch's thread pool, which a fork does not carry over, is never
touched in them.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

# The function the children run, set just before they are forked (they inherit it; a closure need not pickle).
_TASK: Callable[[Any], Any] | None = None


def usable_cores() -> int:
    """The CPU cores torch computes on (``torch.get_num_threads()``), at most the cores this process may use."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = os.cpu_count() or 1
    return max(1, min(torch.get_num_threads(), allowed))


def why_not_forked() -> str | None:
    """Why work cannot be forked here (``None``: it can)."""
    if not sys.platform.startswith("linux"):
        return "fork is only used on Linux"
    if threading.current_thread() is not threading.main_thread():
        return "not the main thread"
    if multiprocessing.current_process().daemon:
        return "a daemon process may not have children"
    return None


def _run_task(chunk: Any) -> Any:
    assert _TASK is not None  # set in the parent before the fork
    return _TASK(chunk)


def map_chunks(fn: Callable[[T], R], chunks: Sequence[T], workers: int) -> list[R]:
    """``[fn(chunk) for chunk in chunks]``, with up to ``workers`` processes at once: this one runs the first
    chunk while forked children run the others.

    ``fn`` must not use torch (see the module's docstring). Where forking is not possible or fails, or a child
    dies, the chunks left run here, so the result never depends on where they ran.
    """
    global _TASK
    if workers <= 1 or len(chunks) <= 1 or why_not_forked() is not None:
        return [fn(c) for c in chunks]
    _TASK = fn
    results: list[Any] = [None] * len(chunks)
    done = [False] * len(chunks)
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns that forking a process with threads may deadlock: the children here only run
            # numpy/scipy code, never the locks of torch's threads.
            warnings.simplefilter("ignore", DeprecationWarning)
            pool = ProcessPoolExecutor(min(workers, len(chunks)) - 1,
                                       mp_context=multiprocessing.get_context("fork"))
            try:
                futures = {i: pool.submit(_run_task, chunks[i]) for i in range(1, len(chunks))}
            except (OSError, BrokenProcessPool):  # the fork itself failed (e.g. no memory): all chunks run here
                futures = {}
        try:
            results[0], done[0] = fn(chunks[0]), True
            for i, future in futures.items():
                try:
                    results[i], done[i] = future.result(), True
                except BrokenProcessPool:
                    break
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        _TASK = None
    for i, chunk in enumerate(chunks):
        if not done[i]:
            results[i] = fn(chunk)
    return results
