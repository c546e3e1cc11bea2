"""bench/lds_ceiling.py: the best LDS a per-source score vector reaches on a context benchmark's own ablations."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import numpy as np

from attnlens.sources.ablation import random_masks, rank_agreement

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import lds_ceiling  # noqa: E402

SETTINGS = {"n_lds": 32, "keep_probability": 0.5, "ablation": "remove", "seed": 0}


def _record(example_id: str, effect) -> dict:
    """A record whose log-probability under each of the benchmark's masks is ``effect(mask)``; one method scores
    the sources (0.1, 0.2, 0.4)."""
    masks = random_masks(32, 3, 0.5, zlib.crc32(example_id.encode())).astype(np.float64)
    actual = np.array([effect(m) for m in masks])
    scores = np.array([0.1, 0.2, 0.4])
    return {"id": example_id, "n_sources": 3, "truth": {"settings": SETTINGS, "actual": actual.tolist()},
            "methods": {"m": {"scores": scores.tolist(), "lds": rank_agreement(masks @ scores, actual)}}}


def test_an_additive_effect_is_reached_exactly_and_the_ceiling_bounds_every_method():
    rng = np.random.default_rng(0)
    additive = lds_ceiling.example_figures(_record("a", lambda m: m @ [5.0, -1.0, 0.5]), 200, rng)
    assert additive["ceiling"] == additive["least squares (in-sample)"] == 1.0
    # an interaction no sum of scores follows: the ceiling is below 1 and above the method's own LDS
    joint = lds_ceiling.example_figures(_record("b", lambda m: 3.0 * m[0] * m[1] - m[2] + 0.3 * m[1]), 2000, rng)
    assert joint["m"] <= joint["ceiling"] < 1.0
    assert joint["least squares (in-sample)"] <= joint["ceiling"]


def test_the_table_reads_a_runs_records(tmp_path, capsys, monkeypatch):
    records = tmp_path / "records.jsonl"
    first = _record("a", lambda m: m @ [1.0, 2.0, 4.0])
    records.write_text("\n".join(json.dumps(r) for r in (_record("a", lambda m: -m[0]), first)) + "\n")
    out = tmp_path / "ceiling.md"
    monkeypatch.setattr(sys, "argv", ["lds_ceiling.py", str(records), "--draws", "50", "--out", str(out)])
    lds_ceiling.main()
    table = out.read_text()
    assert table.startswith("1 examples, 32 LDS ablations each")  # the later line for an id supersedes the first
    assert "| ceiling | 1.000 ± 0.000 |" in table and "| m | 1.000 ± 0.000 |" in table
    assert capsys.readouterr().out == table
