"""The data-parallel benchmark: which examples each process takes, how their results merge, how processes start.

The unit of work is the runner's chunk (``chunk_size`` consecutive examples of the data set: explained, scored and
written together). With ``N`` processes, chunk ``c`` goes to process ``c % N``: every chunk is explained and scored
exactly as a single-process run does it (the same inputs in the same batches), so the merged results are the
single-process results, bit for bit. Each process writes its own results directory ``OUT/shards/RANK-of-N/``
(the runner's resumable files); every process merges what is complete into ``OUT`` when it ends (under ``OUT``'s
lock), so the last one to end leaves the full results. A process that dies loses at most its current chunk: run
the same command again and only the missing examples are computed, with any number of processes.

Processes come from ``accelerate launch`` (or ``torchrun``: the ranks are read through accelerate's
``PartialState``, which joins them in a gloo or NCCL process group), from ``attnlens benchmark --processes N``
(which starts ``N`` such processes on this machine itself), or from a scheduler that runs one command per shard
(``--shard RANK/N``, e.g. a Slurm array). See ``docs/scaling.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import InputError
from .results import (
    SHARDS_DIR,
    complete_examples,
    differing_settings,
    example_row_of,
    read_rows,
    read_run,
    results_lock,
    shard_dirs,
    target_key,
)

QUIET_TABLE = "ATTNLENS_NO_TABLE"  # workers of launch() leave printing the table to the command that started them
WORLD_ENV = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")  # as accelerate reads them


@dataclasses.dataclass(frozen=True)
class Shard:
    """Process ``index`` of ``count``: it takes chunks ``index, index + count, ...``."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and isinstance(self.index, int) and 0 <= self.index < self.count):
            raise InputError(f"shard {self.index}/{self.count}: give RANK/COUNT with 0 <= RANK < COUNT")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"RANK/COUNT"`` (e.g. ``"0/4"``, as ``$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT``)."""
        rank, sep, count = text.partition("/")
        if not (sep and rank.strip().isdigit() and count.strip().isdigit()):
            raise InputError(f"--shard {text!r}: give RANK/COUNT, e.g. 0/4")
        return cls(int(rank), int(count))

    @property
    def name(self) -> str:
        return f"{self.index}-of-{self.count}"

    def directory(self, out: Path) -> Path:
        """This process's results directory inside ``out``."""
        return out / SHARDS_DIR / self.name


def chunks(n_examples: int, chunk_size: int, shard: Shard | None = None) -> list[list[int]]:
    """The example indices of each chunk a process works on: all chunks, or every ``count``-th from ``index``."""
    grid = [list(range(s, min(s + chunk_size, n_examples))) for s in range(0, n_examples, chunk_size)]
    return grid if shard is None else grid[shard.index :: shard.count]


@contextlib.contextmanager
def shard_lock(directory: Path) -> Iterator[None]:
    """Hold the lock of a shard's directory, made if missing. A merge deletes the shards it took in (holding their
    lock for a moment): wait for it, and make the directory again if it went."""
    while True:
        directory.mkdir(parents=True, exist_ok=True)
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(results_lock(directory, wait=True))
        except FileNotFoundError:  # removed between mkdir and lock
            continue
        with stack:
            yield
        return


# ------------------------------------------------------------------ merge
@dataclasses.dataclass
class Merged:
    """What the results directories of one run hold together (the top level first, then the shards)."""

    examples: list[dict[str, Any]]  # rows of the complete examples, by example index
    explanations: list[dict[str, Any]]  # every cached explanation once, in a single-process run's order
    seconds: float  # compute seconds recorded by the merged directories
    shards: list[Path]
    read: dict[Path, tuple[int, int]] = dataclasses.field(default_factory=dict)  # shard -> work-file sizes read

    def unchanged(self, shard: Path) -> bool:
        """Whether ``shard``'s work files are as this merge read them (hold its lock when asking): only then is
        everything in it merged, so it may be removed. A process appends between its chunks, without the lock."""
        return self.read.get(shard) == _sizes(shard)


def _sizes(directory: Path) -> tuple[int, int]:
    sizes = [(directory / name).stat().st_size if (directory / name).exists() else -1
             for name in ("examples.jsonl", "explanations.jsonl")]
    return sizes[0], sizes[1]


def merge_sources(out: Path, settings: dict[str, Any], methods: Sequence[str], chunk_size: int) -> Merged:
    """Rows of ``out`` and of its shards: each complete example once (from the first directory holding it whole),
    ordered as a single-process run writes them; a shard made with other settings is an :class:`InputError`."""
    shards = shard_dirs(out)
    by_index: dict[int, list[dict[str, Any]]] = {}
    explanations: dict[tuple[int, str, Any], dict[str, Any]] = {}
    read: dict[Path, tuple[int, int]] = {}
    seconds = 0.0
    for directory in [out, *shards]:
        if directory != out:
            run = directory / "run.json"
            if run.exists():
                prev = read_run(run)
                if differing_settings(prev["settings"], settings):
                    raise InputError(f"{directory} holds results made with other settings; delete it or use "
                                     "--overwrite")
                seconds += float(prev.get("seconds", 0.0))
        mine = directory == out  # we hold out's lock; a shard may still be appended to by its process
        if not mine:
            read[directory] = _sizes(directory)  # before reading: a later append makes the shard "changed"
        rows = read_rows(directory / "examples.jsonl", repair=mine, row=example_row_of(settings.get("metrics")))
        complete = complete_examples(rows, methods) - set(by_index)
        for r in rows:
            if r["index"] in complete:
                by_index.setdefault(int(r["index"]), []).append(r)
        for r in read_rows(directory / "explanations.jsonl", repair=mine):
            meta = r.get("meta") or {}
            if "example_index" in meta:
                key = (int(meta["example_index"]), meta.get("benchmark_role", "explained"), target_key(r["target"]))
                explanations.setdefault(key, r)

    def order(key: tuple[int, str, Any]) -> tuple[Any, ...]:  # per chunk: its explained rows, then the others
        i, role, target = key
        return i // chunk_size, role != "explained", i, target

    return Merged(
        examples=[r for i in sorted(by_index) for r in by_index[i]],
        explanations=[explanations[k] for k in sorted(explanations, key=order)],
        seconds=seconds,
        shards=shards,
        read=read,
    )


# ------------------------------------------------------------------ processes
def launched_world_size() -> int:
    """How many processes a launcher (``accelerate launch``, ``torchrun``, MPI) started this one among."""
    for name in WORLD_ENV:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def join_launched(cpu: bool) -> tuple[Shard, Any]:
    """This process's shard and device among those ``accelerate launch`` started (accelerate's ``PartialState``:
    the gloo backend on CPUs, NCCL on GPUs with one GPU per process)."""
    from accelerate import PartialState

    state = PartialState(cpu=cpu)
    return Shard(state.process_index, state.num_processes), state.device


def from_first(value: Any) -> Any:
    """``value`` as the first launched process (rank 0) has it, in every process; each waits for rank 0 to get
    here (after it cleared a run started over, or failed to)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def leave_group() -> None:
    """Leave the process group cleanly (torch warns at exit otherwise)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(argv: Sequence[str], processes: int, threads: int) -> float:
    """Run ``python -m attnlens.cli ARGV`` in ``processes`` processes on this machine, with the environment
    ``accelerate launch --cpu`` (torchrun) gives its workers and ``threads`` torch threads each; wait for all of
    them and return the wall seconds. A process that fails is an :class:`InputError` after all have ended (the
    others' finished chunks are kept: the same command resumes)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes),
           "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", QUIET_TABLE: "1"}
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "attnlens.cli", *argv],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(processes)]
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:  # the children got the same SIGINT; let them save and stop
        for p in procs:
            p.wait()
        raise
    failed = [r for r, c in enumerate(codes) if c != 0]
    if failed:
        raise InputError(f"{len(failed)} of {processes} benchmark processes failed (rank {', '.join(map(str, failed))}"
                         f"; exit status {', '.join(str(codes[r]) for r in failed)}); the finished examples are "
                         "saved: run the same command again to resume")
    return time.perf_counter() - start


__all__ = ["Merged", "Shard", "chunks", "from_first", "join_launched", "launch", "launched_world_size", "merge_sources",
           "shard_lock"]
