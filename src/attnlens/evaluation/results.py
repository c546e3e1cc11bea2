"""The results directory of a benchmark: its files, their rows, and the lock held while writing it.

``run.json`` holds the settings (a resumed run must match them) and the cumulative seconds; ``explanations.jsonl``
the explanations (cached: never recomputed); ``examples.jsonl`` one row per example and method plus one baseline
row per example; ``sanity.jsonl`` one row per randomised depth of the sanity metric, as each is finished;
``summary.json``, ``table.md`` and ``table.csv`` the summary (:mod:`.summary`). A data-parallel run
(:mod:`.parallel`) writes the same three work files per process under ``shards/RANK-of-COUNT/`` and merges them into
the top-level ones. See ``docs/benchmark-format.md`` and ``docs/scaling.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..data import Dataset, text_lines
from ..errors import AttnLensError, InputError
from ..results.explanation import Explanation
from .metrics import DATASET_METRICS

try:  # POSIX advisory locks; elsewhere the results directory is not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

FORMAT_VERSION = 1
FILES = ("examples.jsonl", "explanations.jsonl", "sanity.jsonl", "summary.json", "table.md", "table.csv", "run.json",
         "report.html")  # the last: attnlens report's page of these results
LOCK_FILE = ".lock"
SHARDS_DIR = "shards"  # one results directory per process of a data-parallel run


@dataclasses.dataclass
class BenchmarkSettings:
    """What a results directory was made with; a resumed run must match it."""

    model: str
    dataset: str
    split: str
    example_ids: list[str]
    methods: list[str]
    metrics: list[str]
    config: dict[str, Any]
    explain_options: dict[str, Any]
    target_kind: str
    target: str = "predicted"
    model_setup: dict[str, Any] = dataclasses.field(default_factory=dict)  # the longest input, dtype, stream
    # a shard's examples per chunk: the chunks shards share out (None: a run of one process, which has no plan to
    # agree on with others)
    chunk_size: int | None = None

    def key(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def differing_settings(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings (``BenchmarkSettings.key()``, as JSON) in which a recorded run ``before`` differs from ``now``;
    runs made before the target option explained the predicted class, and a shard's chunk size is compared with
    another shard's only (a one-process run may complete any shards' work)."""
    before = {"target": "predicted", **before}
    if before.get("chunk_size") is None or now.get("chunk_size") is None:
        before["chunk_size"] = now.get("chunk_size")
    return [k for k in dict.fromkeys([*now, *before]) if before.get(k) != now.get(k)]


# ------------------------------------------------------------------ JSON files
def read_rows(path: Path, repair: bool = True, row: Callable[[dict[str, Any]], bool] | None = None
              ) -> list[dict[str, Any]]:
    """Complete lines of a results JSONL file. A torn last line (interrupted write) is cut off the file, and any
    other line that is not a JSON object (or one ``row`` refuses, e.g. :func:`is_example_row`) is taken out of it
    with a warning (both are left in place with ``repair=False``: a file another process may be appending to); the
    rows of such lines are computed again."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    end = raw.rfind(b"\n") + 1
    lines = [line for line in text_lines(raw[:end].decode("utf-8", "replace")) if line.strip()]
    rows = [r for r in map(_object, lines) if r is not None and (row is None or row(r))]
    unique = _first_of_each(rows)
    if repair and end < len(raw):
        with path.open("r+b") as f:
            f.truncate(end)
    if repair and len(rows) < len(lines):
        bad = len(lines) - len(rows)
        warnings.warn(f"{path}: {bad} line{'s are' if bad > 1 else ' is'} not a results row (the file was changed "
                      "outside attnlens?); left out, and their rows computed again", stacklevel=2)
    if repair and len(unique) < len(rows):
        extra = len(rows) - len(unique)
        warnings.warn(f"{path}: {extra} row{'s' if extra > 1 else ''} of an example and method already there "
                      "(the file was changed outside attnlens?); the first of each is kept", stacklevel=2)
    if repair and len(unique) < len(lines):
        rewrite_rows(path, unique)
    return unique


def is_example_row(row: dict[str, Any], per_example: bool = True) -> bool:
    """Whether ``row`` is a row of ``examples.jsonl``: an example's index and a method's metrics, or (method
    ``null``) the example's baseline. ``per_example``: the run measures metrics per example, so a method's row
    holds some (a run of data-set metrics alone, ``sanity`` or ``consistency``, writes them empty)."""
    index = row.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0 or "method" not in row:
        return False
    if row["method"] is None:
        return "baseline" in row
    return isinstance(row.get("metrics"), dict) and (bool(row["metrics"]) or not per_example)


def example_row_of(metrics: Sequence[str] | None) -> Callable[[dict[str, Any]], bool]:
    """:func:`is_example_row` for a run measuring ``metrics``: its method rows hold some metric unless it measures
    data-set metrics alone (``None``: not known, so they hold some)."""
    per_example = metrics is None or any(m not in DATASET_METRICS for m in metrics)
    return lambda row: is_example_row(row, per_example)


def _first_of_each(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` without the later rows of an example and method already there (``examples.jsonl``'s rows: one per
    ``index`` and ``method``, the baseline's method ``null``); rows without an ``index`` are kept as they are."""
    seen: set[tuple[Any, Any]] = set()
    kept = []
    for row in rows:
        if "index" in row and "method" in row:
            key = (json.dumps(row["index"]), json.dumps(row["method"]))
            if key in seen:
                continue
            seen.add(key)
        kept.append(row)
    return kept


def _object(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def append_rows(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Append ``rows`` as JSON lines (flushed: a kill loses at most the line being written)."""
    if not rows:
        return
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, allow_nan=False) + "\n" for r in rows))
        f.flush()


def rewrite_rows(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Replace the content of a JSONL file by ``rows`` atomically (other processes may be reading it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


def shard_dirs(out: Path) -> list[Path]:
    """The per-process directories of data-parallel runs in ``out`` (``shards/RANK-of-COUNT``), in name order."""
    root = out / SHARDS_DIR
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def clear_results(out: Path) -> None:
    """Delete the results in ``out`` (its files and every shard), to start a run over."""
    for name in FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / SHARDS_DIR, ignore_errors=True)


@contextlib.contextmanager
def replacing_results(out: Path, resume: bool) -> Iterator[None]:
    """Within the block a run writes its results to ``out`` (over those there unless ``resume``). Where it stops on
    a refusal (:class:`~attnlens.errors.AttnLensError`: an input the run cannot explain), ``out`` is left as it
    was: the results it was to replace come back, and a run into a folder without results leaves none (its
    ``run.json`` would refuse the corrected command as other settings). An interruption keeps what was written,
    to resume."""
    for stale in out.glob(".replaced.*"):  # set aside by a run killed before it ended: nobody restores it now
        shutil.rmtree(stale, ignore_errors=True)
    had = bool(shard_dirs(out)) or any((out / name).exists() for name in FILES)
    aside = None
    if not resume:
        if had:  # set aside, not deleted, until the run has shown it can be made
            aside = Path(tempfile.mkdtemp(prefix=".replaced.", dir=out))
            for name in (*FILES, SHARDS_DIR):
                if (out / name).exists():
                    os.replace(out / name, aside / name)
        had = False
    try:
        yield
    except AttnLensError:
        if not had:
            clear_results(out)
            if aside is not None:
                for item in aside.iterdir():
                    os.replace(item, out / item.name)
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (a kill leaves the old or the new file, never a torn one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def read_run(path: Path) -> dict[str, Any]:
    """``run.json``; a file that is not one is an :class:`InputError`."""
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        run = None
    if not isinstance(run, dict) or not isinstance(run.get("settings"), dict):
        raise InputError(f"{path} is not a readable run file; use --overwrite to start over")
    return run


def finite(x: float | None) -> float | None:
    """``x`` as a float, ``None`` where it is missing or not finite (JSON has no NaN)."""
    return None if x is None or not math.isfinite(x) else float(x)


def jsonable(x: Any) -> Any:
    """``x`` with NumPy scalars as Python numbers and non-finite floats as ``None``."""
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float):
        return finite(x)
    if isinstance(x, np.generic):
        return jsonable(x.item())
    return x


# ------------------------------------------------------------------ rows
def target_key(target: Any) -> Any:
    """Hashable form of a target: a class index, or a (start, end) pair for QA."""
    return tuple(int(t) for t in target) if isinstance(target, (list, tuple)) else int(target)


def complete_examples(rows: Sequence[dict[str, Any]], methods: Sequence[str]) -> set[int]:
    """Indices of the examples of ``examples.jsonl`` with a row for every method and the baseline row."""
    seen: dict[int, set[Any]] = {}
    for r in rows:
        seen.setdefault(int(r["index"]), set()).add(r.get("method"))
    need = set(methods) | {None}
    return {i for i, s in seen.items() if need <= s}


def explanation_cache(rows: Sequence[dict[str, Any]]) -> dict[tuple[int, str, Any], Explanation]:
    """``(example index, role, target) -> explanation`` of the rows of ``explanations.jsonl``."""
    out = {}
    for r in rows:
        meta = r.get("meta") or {}
        if "example_index" in meta:
            out[(int(meta["example_index"]), meta.get("benchmark_role", "explained"), target_key(r["target"]))] = (
                Explanation.from_dict(r)
            )
    return out


def example_rows(dataset: Dataset, items: Sequence[Any], scores: Sequence[Any], methods: Sequence[str]) -> list[dict]:
    """The ``examples.jsonl`` rows of scored items: one per method (values and details), then the baseline."""
    rows = []
    for it, sc in zip(items, scores):
        head = {"index": it.index, "id": dataset[it.index].id, "label": it.label, "predicted": it.exp.predicted,
                "target": it.exp.target, "n_tokens": len(it.exp.tokens)}
        for m in methods:
            res = sc.methods[m]
            rows.append({**head, "method": m,
                         "metrics": {k: finite(r.value) for k, r in res.items()},
                         "details": {k: jsonable(r.detail) for k, r in res.items() if r.detail is not None}})
        rows.append({**head, "method": None, "baseline": sc.baseline})
    return rows


# ------------------------------------------------------------------ lock
@contextlib.contextmanager
def results_lock(out: Path, wait: bool = False) -> Iterator[None]:
    """Hold ``out/.lock`` while writing ``out``: an exclusive ``flock`` on a file holding our pid.

    A second writer gets :class:`InputError` naming the holder's pid (or, with ``wait``, waits for it: the short
    merge of a data-parallel run). The kernel drops the lock when its holder exits, however it exits, so a lock
    file left by a killed run is simply taken over.
    """
    if fcntl is None:  # pragma: no cover
        yield
        return
    path = out / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise InputError(
                f"{out} is being written by another benchmark (pid {holder}); wait for it to end or use another --out"
            ) from None
        except OSError as exc:  # a file system without flock (some network mounts): go on unlocked
            os.close(fd)
            warnings.warn(f"cannot lock {path} ({exc.strerror}); do not run two benchmarks on {out}", stacklevel=3)
            yield
            return
        try:  # the previous holder may have unlinked the file between our open and flock: lock the live one
            live = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            live = False
        if live:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)  # releases the lock


__all__ = [
    "FILES", "FORMAT_VERSION", "LOCK_FILE", "SHARDS_DIR", "BenchmarkSettings", "append_rows", "clear_results",
    "complete_examples", "example_rows", "explanation_cache", "finite", "jsonable", "read_rows", "read_run",
    "results_lock", "rewrite_rows", "shard_dirs", "target_key", "write_json",
]
