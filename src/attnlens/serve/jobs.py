"""Computations of the server as jobs: one queue for all its models (one computation at a time, so that each can
plan within the whole memory budget; the others wait in the order they came), progress, cancellation, and a cache
of finished results keyed by what was asked, bounded in number and in bytes.

A job runs in its model's worker thread. It reports progress through :meth:`Job.report`, which is also where a
cancelled job stops: the computation's progress callback raises :class:`Cancelled` and the library unwinds as
for any error (the model is left as it was). A job cancelled while it waits never starts.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import AttnLensError

_PACKAGE = str(Path(__file__).resolve().parents[1])
QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "error", "cancelled"


class Cancelled(Exception):
    """Raised inside a running computation whose job was cancelled."""


@dataclass
class Job:
    """One computation: what it is, where it stands, and its result or error once it ended."""

    id: str
    model: str
    kind: str
    key: str
    state: str = QUEUED
    progress: float = 0.0
    result: Any = None
    error: str | None = None
    status: int = 200  # the HTTP status of its answer: 400 for a user mistake, 500 for a fault
    warnings: list[str] = field(default_factory=list)
    cached: bool = False
    started: float | None = None
    seconds: float | None = None
    future: Future | None = None
    holders: int = 1  # the requests answered by this job (an identical request under way shares it)
    _cancel: threading.Event = field(default_factory=threading.Event)

    def report(self, fraction: float, *_: Any) -> None:
        """Progress callback: records the fraction done; raises :class:`Cancelled` once the job is cancelled."""
        if self._cancel.is_set():
            raise Cancelled()
        self.progress = max(self.progress, min(1.0, float(fraction)))

    @property
    def finished(self) -> bool:
        return self.state in (DONE, FAILED, CANCELLED)

    def to_dict(self, position: int | None = None, with_result: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "model": self.model, "kind": self.kind, "state": self.state,
                               "progress": self.progress, "cached": self.cached, "warnings": self.warnings,
                               "seconds": self.seconds}
        if position is not None:
            out["position"] = position  # jobs ahead of this one
        if self.error is not None:
            out["error"] = self.error
        if with_result and self.state == DONE:
            out["result"] = self.result
        return out


def digest(key: str) -> str:
    """What a job and the cache keep of a request's key: its SHA-256, so that requests holding long texts (a key
    holds every text) keep a few dozen bytes each, not their texts, outside the cache's byte bound."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class JobQueue:
    """One FIFO worker for every model, the jobs it ran (the latest ``keep``) and a cache of at most ``cache_size``
    results taking at most ``cache_bytes`` together (the newest is kept whatever its size, until the next comes).
    A finished job whose result left the cache answers with a one-line error: ask again."""

    def __init__(self, *, cache_size: int = 256, cache_bytes: int = 2**30, keep: int = 512) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnlens-serve")
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._cache: OrderedDict[str, tuple[Any, list[str], int]] = OrderedDict()
        self._cached_bytes = 0
        self._waiting: list[str] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.cache_size, self.cache_bytes, self.keep = cache_size, cache_bytes, keep

    def submit(self, model: str, kind: str, key: str, compute: Callable[[Job], Any]) -> Job:
        """A job computing ``compute(job)`` (on ``model``) in the queue; a result cached under ``key`` (or a job
        with that key still under way) is answered without computing again."""
        key = digest(key)
        with self._lock:
            if key in self._cache:
                result, notes, _ = self._cache[key]
                self._cache.move_to_end(key)
                job = self._new(model, kind, key)
                job.state, job.progress, job.result, job.warnings, job.cached = DONE, 1.0, result, notes, True
                job.seconds = 0.0
                return job
            for job in reversed(self._jobs.values()):
                if job.key == key and not job.finished and not job._cancel.is_set():
                    job.holders += 1
                    return job
            job = self._new(model, kind, key)
            self._waiting.append(job.id)
            job.future = self._worker.submit(self._run, job, compute)
            return job

    def _new(self, model: str, kind: str, key: str) -> Job:
        job = Job(id=str(next(self._ids)), model=model, kind=kind, key=key)
        self._jobs[job.id] = job
        while len(self._jobs) > self.keep:
            old = next(iter(self._jobs.values()))
            if not old.finished:
                break
            self._jobs.popitem(last=False)
        return job

    def _run(self, job: Job, compute: Callable[[Job], Any]) -> Job:
        with self._lock:
            self._waiting.remove(job.id)
            if job._cancel.is_set():
                job.state = CANCELLED
                return job
            job.state, job.started = RUNNING, time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = compute(job)
            # attnlens's own notices (methods skipped, inputs truncated); not third-party deprecations
            job.warnings = list(dict.fromkeys(str(w.message) for w in caught if _PACKAGE in str(w.filename)))
            size = approximate_bytes(result)  # outside the lock: a large result takes a moment to walk
            with self._lock:
                job.result, job.progress, job.state = result, 1.0, DONE
                self._store(job.key, result, job.warnings, size)
        except Cancelled:
            job.state = CANCELLED
        except AttnLensError as exc:
            job.state, job.error, job.status = FAILED, " ".join(str(exc).split()), 400
        except Exception as exc:  # a fault of ours: the server goes on, the page shows one line
            job.state, job.error, job.status = FAILED, f"internal error: {type(exc).__name__}: {exc}", 500
        finally:
            job.seconds = time.perf_counter() - (job.started or time.perf_counter())
        return job

    def cached(self, key: str) -> Any:
        """The cached result under ``key``, or None."""
        with self._lock:
            hit = self._cache.get(digest(key))
            return None if hit is None else hit[0]

    def remember(self, key: str, result: Any) -> None:
        """Cache ``result`` under ``key`` (a by-product of another job, e.g. the explanations faithfulness needs)."""
        size = approximate_bytes(result)
        with self._lock:
            self._store(digest(key), result, [], size)

    def _store(self, key: str, result: Any, notes: list[str], size: int) -> None:
        """Cache ``result`` (``size`` bytes) under ``key``, the lock held; let the oldest go beyond the bounds."""
        if key in self._cache:
            self._cached_bytes -= self._cache.pop(key)[2]
        self._cache[key], self._cached_bytes = (result, notes, size), self._cached_bytes + size
        while len(self._cache) > 1 and (len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes):
            old, (_, _, old_size) = self._cache.popitem(last=False)
            self._cached_bytes -= old_size
            for job in self._jobs.values():  # nothing keeps the result alive once the cache lets it go
                if job.key == old and job.state == DONE:
                    job.result, job.state, job.status = None, FAILED, 410
                    job.error = ("this result was dropped from the server's cache to bound its memory: ask for it "
                                 "again")

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def position(self, job: Job) -> int | None:
        """How many jobs are ahead of ``job``, the one running included (0: it runs next), or None when it is not
        waiting."""
        with self._lock:
            if job.id not in self._waiting:
                return None
            running = sum(1 for j in self._jobs.values() if j.state == RUNNING)
            return running + self._waiting.index(job.id)

    def cancel(self, job: Job) -> None:
        """One of ``job``'s requests gives it up; with none left it stops: a waiting job never starts, a running
        one stops at its next progress report. A job shared by identical requests goes on for the others."""
        with self._lock:
            job.holders -= 1
            if job.holders > 0 or job.finished:
                return
        job._cancel.set()
        if job.future is not None and job.future.cancel():  # still waiting in the executor
            with self._lock:
                if job.id in self._waiting:
                    self._waiting.remove(job.id)
                job.state = CANCELLED

    def shutdown(self) -> None:
        for job in list(self._jobs.values()):
            if not job.finished:
                job._cancel.set()
        self._worker.shutdown(wait=False, cancel_futures=True)

    def running(self) -> bool:
        """Whether a computation is still under way (one cancelled but not yet at its next progress report too)."""
        with self._lock:
            return any(job.state == RUNNING for job in self._jobs.values())


def approximate_bytes(value: Any) -> int:
    """About the memory a JSON-like result (dicts, lists, strings, numbers) takes: its strings' characters and
    its containers' and numbers' objects."""
    total, todo = 0, [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            total += 49 + len(item)
        elif isinstance(item, dict):
            total += 64 + 16 * len(item)
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += 56 + 8 * len(item)
            todo.extend(item)
        else:
            total += 32
    return total
