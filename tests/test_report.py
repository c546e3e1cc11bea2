"""attnlens report: one self-contained HTML page of a benchmark results directory."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

from attnlens.cli import main
from attnlens.errors import InputError
from attnlens.results.explanation import Explanation, save_explanations
from attnlens.viz.report import read_examples, report_html

SUMMARY = Path(__file__).parent / "data" / "benchmark_summary.json"


def explanation(i: int, role: str = "explained") -> Explanation:
    tokens = ["[CLS]", "a", "<script>", "film", "[SEP]"]
    return Explanation(
        text=f"a <script>alert({i})</script> film",
        tokens=tokens,
        special=[True, False, False, False, True],
        target=1,
        predicted=1,
        probabilities=[0.1, 0.9],
        labels=["negative", "positive"],
        scores={m: np.array([0.0, 0.1 * (i + 1), -0.2, 0.3, 0.0]) for m in ("rawatt", "agrad", "attcat")},
        meta={"example_index": i, "benchmark_role": role},
    )


@pytest.fixture
def results(tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    shutil.copy(SUMMARY, d / "summary.json")
    save_explanations(
        [explanation(0), explanation(0, "other"), explanation(1), explanation(2)], d / "explanations.jsonl"
    )
    with (d / "explanations.jsonl").open("a") as f:
        f.write('{"text": "cut short by an interrup')  # the partial last line of an interrupted run
    return d


def images(page: str) -> list[np.ndarray]:
    out = []
    for b64 in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page):
        out.append(mpimg.imread(io.BytesIO(base64.b64decode(b64)), format="png"))
    return out


def test_report_cli_writes_page_with_tables_and_figures(results, capsys):
    out = results / "r.html"
    assert main(["report", str(results), "--out", str(out), "--examples", "2"]) == 0
    assert str(out) in capsys.readouterr().out
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert "&lt;script&gt;alert(0)&lt;/script&gt;" in page
    # bar charts, two occlusion plots (relative, absolute), AOPC curves, two embeddings
    pngs = images(page)
    assert len(pngs) == 6
    for img in pngs:
        assert img.shape[0] > 200 and img.shape[1] > 300 and img[..., :3].std() > 0.05
    for heading in ("Results", "Metrics per method", "Occlusion curves", "AOPC curves", "Consistency"):
        assert f"<h2>{heading}" in page
    # best per metric, by each metric's direction: attcat has the highest AOPC and the lowest LOdds / Kendall
    row = page.split("<tr><th>attcat</th>")[1].split("</tr>")[0]
    assert row.count('class="best"') == 3
    rawatt = page.split("<tr><th>rawatt</th>")[1].split("</tr>")[0]
    assert "<td>n/a</td>" in rawatt and 'class="best"' not in rawatt
    assert "kendall ↓" in page and "aopc ↑" in page
    # two examples, the explained ones only (not the other-class one, not the broken line)
    assert page.count('class="example"') == 2
    assert "alert(1)" in page and "alert(2)" not in page


@pytest.mark.parametrize("name", ["summary.json", "explanations.jsonl"])
def test_an_output_that_is_a_results_file_is_refused_and_the_file_kept(results, name, capsys):
    before = (results / name).read_bytes()
    assert main(["report", str(results), "--out", str(results / name)]) == 2
    assert "is a file of the results" in capsys.readouterr().err
    assert (results / name).read_bytes() == before


def test_default_output_path_and_no_examples(results):
    assert main(["report", str(results), "--examples", "0"]) == 0
    page = (results / "report.html").read_text()
    assert 'class="example"' not in page


def test_read_examples_skips_other_roles_and_broken_lines(results):
    items = read_examples(results, 10)
    assert [e.meta["example_index"] for e in items] == [0, 1, 2]


def test_summary_without_curves_or_consistency(tmp_path):
    summary = json.loads(SUMMARY.read_text())
    summary["curves"] = {"aopc": {"rawatt": {"fractions": [0.0, 0.5], "drop": []}}}
    summary["consistency"] = {}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = report_html(tmp_path)
    assert len(images(page)) == 1  # only the metric bars
    assert "Occlusion curves" not in page and "AOPC curves" not in page


def test_missing_or_broken_summary_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(InputError, match="no summary.json"):
        report_html(tmp_path)
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        report_html(tmp_path)
    (tmp_path / "summary.json").write_text("[]")
    with pytest.raises(InputError, match="not a benchmark summary"):
        report_html(tmp_path)
