"""Run one benchmark case in a fresh process under ``/usr/bin/time -f %M``: its peak resident memory and the JSON
line it printed last (the scripts' ``--one`` mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """The CPU a run measured on, in words: its model name, logical cores, vector extensions and PyTorch's
    version (time ratios depend on it: a CPU with faster matrix products shortens the plain pass more than the
    methods' loops)."""
    import platform

    import torch

    name, flags = platform.processor() or platform.machine(), ""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
        name = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        flags = next(line for line in text.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    vector = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    return f"{name}, {os.cpu_count()} logical cores, {vector}, torch {torch.__version__}"


def measured(script: str, args: list[str], timeout: float, record: dict) -> dict:
    """``record`` updated with ``peak_gib`` and the case's JSON result, or with ``error`` (a timeout, a crash)."""
    cmd = ["/usr/bin/time", "-f", "%M", sys.executable, script, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = dict(record)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**out, "error": f"over {timeout:.0f} s"}
    lines = proc.stderr.strip().splitlines()
    try:
        out["peak_gib"] = int(lines[-1]) / 2**20  # KiB
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        out["error"] = (lines[-2] if len(lines) > 1 else proc.stderr)[-300:]
    return out


def process_status(key: str) -> int:
    """A byte figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``: the peak since the last
    ``5`` written to ``/proc/self/clear_refs``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def write_records(out: Path, rows: list[dict]) -> None:
    """The cases' records as JSON Lines beside the Markdown table ``out`` (its folder made)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
