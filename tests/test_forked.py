"""Work spread over forked processes: where it runs, and the same results wherever it ran."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from attnlens.core.forked import map_chunks, usable_cores, why_not_forked

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="work is forked on Linux only")


def pid_and_double(chunk: list[int]) -> tuple[int, list[int]]:
    return os.getpid(), [2 * x for x in chunk]


@linux_only
def test_chunks_run_in_this_process_and_in_forked_children_in_order():
    chunks = [[1, 2], [3], [4, 5, 6]]
    results = map_chunks(pid_and_double, chunks, workers=3)
    assert [r[1] for r in results] == [[2, 4], [6], [8, 10, 12]]
    pids = [r[0] for r in results]
    assert pids[0] == os.getpid() and os.getpid() not in pids[1:]  # a child may take both of the others


def test_one_worker_runs_every_chunk_here():
    results = map_chunks(pid_and_double, [[1], [2]], workers=1)
    assert results == [(os.getpid(), [2]), (os.getpid(), [4])]


def test_outside_the_main_thread_every_chunk_runs_here():
    out = {}

    def run():
        out["why"] = why_not_forked()
        out["results"] = map_chunks(pid_and_double, [[1], [2], [3]], workers=3)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert out["why"] == "not the main thread"
    assert out["results"] == [(os.getpid(), [2]), (os.getpid(), [4]), (os.getpid(), [6])]


@linux_only
def test_chunks_of_a_child_that_dies_are_computed_here():
    parent = os.getpid()

    def dies_in_children(chunk: list[int]) -> list[int]:
        if os.getpid() != parent:
            os._exit(3)
        return [x + 1 for x in chunk]

    assert map_chunks(dies_in_children, [[1], [2], [3]], workers=3) == [[2], [3], [4]]


@linux_only
def test_an_error_in_a_child_reaches_the_caller():
    parent = os.getpid()

    def fails_in_children(chunk: list[int]) -> list[int]:
        if os.getpid() != parent:
            raise ValueError(f"bad chunk {chunk}")
        return chunk

    with pytest.raises(ValueError, match=r"bad chunk \[2\]"):
        map_chunks(fails_in_children, [[1], [2]], workers=2)


def test_usable_cores_follow_torch_threads(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert usable_cores() == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 10_000)
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


@linux_only
def test_a_fork_that_fails_leaves_every_chunk_to_this_process(monkeypatch):
    from concurrent.futures import ProcessPoolExecutor

    def no_fork(*_args, **_kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(ProcessPoolExecutor, "submit", no_fork)
    results = map_chunks(pid_and_double, [[1], [2], [3]], workers=3)
    assert results == [(os.getpid(), [2]), (os.getpid(), [4]), (os.getpid(), [6])]
