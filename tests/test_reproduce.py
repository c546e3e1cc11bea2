"""scripts/reproduce.py's method study: summaries of partial runs, paired differences, the section rewrite."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from test_benchmark import bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reproduce():
    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "scripts" / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_partial_run_is_summarised_without_touching_its_files(reproduce, tmp_path):
    partial, _ = bench(tmp_path, stop_after=5)
    with (tmp_path / "examples.jsonl").open("a") as f:  # a run still appending: its last line is not complete yet
        f.write('{"index": 7, "method": "grads", "metr')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    summary, rows = reproduce.study_summary(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert summary["n_examples"] == 5 and summary["n_planned"] == 11
    assert summary["results"] == partial["results"]
    assert sorted({r["index"] for r in rows}) == list(range(5)) and all(r["method"] for r in rows)
    assert reproduce.study_summary(tmp_path / "never-run") is None


def test_paired_difference_and_its_standard_error(reproduce):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=9), rng.normal(size=9)
    rows = [{"index": i, "method": "x", "metrics": {"aopc": float(a[i])}} for i in range(9)]
    rows += [{"index": i, "method": "y", "metrics": {"aopc": float(b[i])}} for i in range(8)]  # y lacks example 8
    rows.append({"index": 3, "method": "z", "metrics": {"aopc": None}})
    mean, se = reproduce.paired(rows, "x", "y", "aopc")
    d = a[:8] - b[:8]
    assert mean == pytest.approx(d.mean()) and se == pytest.approx(d.std(ddof=1) / np.sqrt(8))
    assert reproduce.paired(rows, "x", "z", "aopc") is None


def test_findings_name_a_method_ahead_of_both_references_on_both_metrics(reproduce):
    res = {"integratedgradients": {"aopc": 0.57, "lodds": -1.7}, "attnlrp": {"aopc": 0.58, "lodds": -1.6},
           "decompx": {"aopc": 0.59, "lodds": -1.65}, "alti": {"aopc": 0.40, "lodds": -1.0}}
    out = reproduce.study_findings(res, [])
    assert "**decompx** (0.590)" in out[0] and "ahead" in out[0]
    assert "behind" in out[1] and out[2].endswith(": none.")
    res["decompx"]["lodds"] = -1.8
    assert reproduce.study_findings(res, [])[2].endswith(": decompx.")


def test_section_4_is_replaced_and_the_rest_kept(reproduce, tmp_path):
    doc = tmp_path / "reproduction.md"
    doc.write_text("# Reproduction report\n\n## 1. One\n\nkept\n\n## 5. Method study: old\n\nstale\n\n"
                   "## 6. Later\n\nalso\n")
    reproduce.write_study(doc, tmp_path / "results")
    once = doc.read_text()
    assert "stale" not in once and "## 1. One\n\nkept" in once and once.rstrip().endswith("## 6. Later\n\nalso")
    assert once.count("## 5. Method study") == 1 and "Not run yet." in once
    reproduce.write_study(doc, tmp_path / "results")
    assert doc.read_text() == once
    fresh = tmp_path / "new.md"
    fresh.write_text("# Reproduction report\n\n## 1. One\n")
    reproduce.write_study(fresh, tmp_path / "results")
    assert fresh.read_text().startswith("# Reproduction report\n\n## 1. One\n\n## 5. Method study")
    assert json.loads(json.dumps(reproduce.study_args("sst2-dev", ROOT / "results" / "method-study")))[-1] == \
        "results/method-study/sst2-dev"


def test_a_hand_written_section_is_carried_over(reproduce, tmp_path):
    doc = tmp_path / "reproduction.md"
    doc.write_text("# Reproduction report\n\n## 3. Speed\n\nx\n\n## 4. Generation: on an LLM\n\n| a | b |\nby hand\n\n"
                   "## 5. Method study\n\ny\n")
    assert reproduce.kept_section(doc, "## 4. Generation") == ["## 4. Generation: on an LLM", "", "| a | b |",
                                                               "by hand", ""]
    assert reproduce.kept_section(doc, "## 7. None") is None
    assert reproduce.kept_section(tmp_path / "missing.md", "## 4. Generation") is None
