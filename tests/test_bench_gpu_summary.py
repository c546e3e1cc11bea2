"""The GPU bench's summary of a CUDA memory snapshot (bench/long_context_gpu.py), from a trace shaped as
torch.cuda.memory._dump_snapshot writes it: what is alive at the traced peak, grouped by Python stack."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from long_context_gpu import snapshot_peak, table  # noqa: E402


def _frames(line: int, where: str = "/site/attnlens/core/engine.py") -> list[dict]:
    return [{"filename": where, "line": line, "name": "run"}, {"filename": "CUDACachingAllocator.cpp", "line": 1,
                                                               "name": "malloc"}]


def test_the_peak_holds_what_was_alive_then_grouped_by_stack(tmp_path):
    mib = 2**20
    trace = [
        {"action": "alloc", "addr": 1, "size": 3 * mib, "frames": _frames(10)},
        {"action": "alloc", "addr": 2, "size": 3 * mib, "frames": _frames(10)},
        {"action": "alloc", "addr": 3, "size": 8 * mib, "frames": _frames(20, "/site/transformers/sdpa.py")},
        {"action": "free_requested", "addr": 3, "size": 8 * mib, "frames": []},
        {"action": "free_completed", "addr": 3, "size": 8 * mib, "frames": []},
        {"action": "alloc", "addr": 4, "size": 1 * mib, "frames": _frames(30)},  # after the peak
    ]
    path = tmp_path / "snap.pickle"
    with open(path, "wb") as f:
        pickle.dump({"device_traces": [trace], "segments": []}, f)
    text = snapshot_peak(path)
    lines = text.splitlines()
    assert "traced peak 0.014 GiB at event 2" in lines[0]
    assert "8.0 MiB in    1 blocks: sdpa.py:20:run" in lines[1]
    assert "6.0 MiB in    2 blocks: engine.py:10:run" in lines[2]
    assert "engine.py:30" not in text  # freed or allocated after the peak: not in it
    assert lines[-1].endswith("8.0 MiB: sdpa.py:20:run")


def test_each_ratio_is_to_the_plain_pass_timed_before_it_and_the_table_shows_every_plain_pass():
    """Cases run in groups, each after a plain pass of its own at the same length: a case's ratio divides by the
    plain pass before it, and the plain row shows each of them (one value shown and another divided by misled)."""
    rows = [{"model": "m", "method": "plain", "tokens": 8, "seconds": 0.2, "peak_gib": 1.0},
            {"model": "m", "method": "grads", "tokens": 8, "seconds": 0.4, "peak_gib": 1.0},
            {"model": "m", "method": "plain", "tokens": 8, "seconds": 0.1, "peak_gib": 1.0},
            {"model": "m", "method": "valuezeroing", "tokens": 8, "seconds": 1.0, "peak_gib": 1.0}]
    text = table(rows)
    assert "| plain | 1.00 GiB, 0.200 s / 0.100 s |" in text
    assert "| grads | 1.00 GiB, 0.400 s, 2.0× |" in text and "| valuezeroing | 1.00 GiB, 1.000 s, 10.0× |" in text
