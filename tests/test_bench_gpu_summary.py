"""The GPU bench's summary of a CUDA memory snapshot (bench/long_context_gpu.py), from a trace shaped as
torch.cuda.memory._dump_snapshot writes it: what is alive at the traced peak, grouped by Python stack."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from long_context_gpu import snapshot_peak  # noqa: E402


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
