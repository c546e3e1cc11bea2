"""Evaluation results: one best-method rule, self-describing metric curves, one results reader, one ranking,
and renderers that do not import the result type."""

from __future__ import annotations

import ast
import csv
import json
from pathlib import Path

import numpy as np
import pytest

from attnlens.data import iter_jsonl
from attnlens.errors import InputError
from attnlens.evaluation import EvalConfig, best_methods, write_tables
from attnlens.evaluation.metrics import CURVES, METRICS
from attnlens.evaluation.results import read_rows
from attnlens.results.explanation import Explanation

VIZ = Path(__file__).resolve().parents[1] / "src" / "attnlens" / "viz"


def _summary(aopc: dict[str, float | None]) -> dict:
    return {
        "model": "m", "dataset": "d", "split": "dev", "n_examples": 3, "protocol": "paper",
        "metrics": {"aopc": {"lower_is_better": False}, "lodds": {"lower_is_better": True}},
        "results": {m: {"aopc": v, "lodds": -float(i)} for i, (m, v) in enumerate(aopc.items())},
    }


def test_one_best_methods_with_a_documented_tie_rule(tmp_path):
    # 0.1 + 0.2 and 0.3 differ in the last bit only: a tie, bold in the tables and the plots alike
    summary = _summary({"a": 0.1 + 0.2, "b": 0.3, "c": 0.29, "d": None})
    assert best_methods(summary, "aopc") == ["a", "b"]
    assert best_methods(summary, "lodds") == ["d"]
    write_tables(tmp_path, summary)
    table = (tmp_path / "table.md").read_text()
    assert "| a | **0.300** |" in table and "| b | **0.300** |" in table and "| c | 0.290 |" in table
    rows = {r["method"]: r["best_in"] for r in csv.DictReader((tmp_path / "table.csv").open())}
    assert rows == {"a": "aopc", "b": "aopc", "c": "", "d": "lodds"}
    from attnlens.viz import plots
    from attnlens.viz.report import _results_table

    assert plots.best_methods is best_methods
    assert _results_table(summary).count("<td class=\"best\">") == 3  # a, b (aopc) and d (lodds)


def test_a_metric_whose_best_is_inside_its_range_ranks_by_the_distance_to_it(tmp_path):
    """The randomisation test's correlation is best at 0: -0.3 is no better than 0.3, and 0.02 beats both."""
    from attnlens.evaluation.metrics import metric_info
    from attnlens.viz.report import _results_table

    summary = {"model": "m", "dataset": "d", "split": "dev", "n_examples": 3, "protocol": "paper",
               "metrics": {"sanity": metric_info("sanity").to_dict()},
               "results": {"a": {"sanity": -0.3}, "b": {"sanity": 0.02}, "c": {"sanity": 0.3}}}
    assert best_methods(summary, "sanity") == ["b"]
    write_tables(tmp_path, summary)
    table = (tmp_path / "table.md").read_text()
    assert "sanity →0" in table and "| b | **0.020** |" in table
    assert "closer to 0 is better" in _results_table(summary)


def test_each_metric_computes_its_own_curve():
    rows = {"x": [{"details": {"aopc": [0.0] * 11}}, {"details": {"aopc": [1.0] * 11}}, {"details": {"aopc": None}}],
            "y": []}
    curve = METRICS["aopc"](EvalConfig()).curve(rows, [])
    assert curve["x"] == {"fractions": [k / 10 for k in range(11)], "drop": [0.5] * 11}
    assert curve["y"]["drop"] == []
    code = METRICS["aopc"](EvalConfig(protocol="attcat-code")).curve({"x": []}, [])
    np.testing.assert_allclose(code["x"]["fractions"], np.linspace(0, 1, 10)[1:])
    assert METRICS["lodds"](EvalConfig()).curve(rows, []) is None  # a metric without a curve says so
    occ = METRICS["occlusion"](EvalConfig(occlusion_counts=(0, 2))).curve(
        {"x": [{"details": {"occlusion": {"top": [1, 0], "bottom": [1, 1]}}},
               {"details": {"occlusion": {"top": [1, 1], "bottom": [0, 1]}}}]},
        [{"baseline": {"occlusion_random": [1, 0]}}, {"baseline": {}}])
    assert occ["k"] == [0, 2] and occ["drop"] == "mask"
    assert occ["series"]["x:top"] == {"accuracy": [1.0, 0.5], "relative": [1.0, 0.5]}
    assert occ["series"]["x:bottom"] == {"accuracy": [0.5, 1.0], "relative": [1.0, 2.0]}
    assert occ["series"]["random"]["accuracy"] == [1.0, 0.0]
    pk = METRICS["precision_at_k"](EvalConfig(precision_k=2)).curve(
        {"x": [{"details": {"precision_at_k": 1}}, {"details": {"precision_at_k": 3}}, {"details": {}}]}, [])
    assert pk == {"k": 2, "answer_tokens": 2.0, "perfect": 1.5}
    assert set(CURVES) <= set(METRICS)


def test_results_rows_take_bad_lines_out_of_the_file_and_cut_a_torn_one(tmp_path):
    f = tmp_path / "examples.jsonl"
    content = b'{"index": 0}\n[1, 2]\nnot json\n\n{"index": 1}\n{"index": 2, "meth'
    f.write_bytes(content)
    with pytest.raises(InputError, match=r"line 2: expected a JSON object"):
        list(iter_jsonl(f))
    assert [n for n, _ in iter_jsonl(f, skip_bad=True)] == [1, 5]
    assert read_rows(f, repair=False) == [{"index": 0}, {"index": 1}]
    assert f.read_bytes() == content  # another process's file is left as it is
    with pytest.warns(UserWarning, match=r"examples.jsonl: 2 lines are not a results row"):
        assert read_rows(f) == [{"index": 0}, {"index": 1}]
    assert f.read_bytes() == b'{"index": 0}\n{"index": 1}\n'


def test_results_rows_cut_a_torn_line_without_a_warning(tmp_path, recwarn):
    f = tmp_path / "examples.jsonl"
    f.write_bytes(b'{"index": 0}\n{"index": 1, "meth')
    assert read_rows(f) == [{"index": 0}]
    assert f.read_bytes() == b'{"index": 0}\n' and not recwarn.list


def test_one_ranking_with_reverse():
    exp = Explanation("t", ["[CLS]", "a", "b", "c", "d", "[SEP]"], [True, False, False, False, False, True], 0, 0,
                      [1.0], {"m": np.array([9.0, 0.5, 2.0, 0.5, -1.0, 9.0])})
    assert exp.ranking("m") == [2, 1, 3, 4]  # ties keep token order
    assert exp.ranking("m", reverse=True) == [4, 1, 3, 2]
    assert exp.top_k("m", 2) == [("b", 2.0), ("a", 0.5)]
    with pytest.raises(InputError, match="no scores for method 'x'"):
        exp.ranking("x")


def test_renderers_do_not_import_the_result_type():
    """explanation.py imports viz (show, to_html); viz's renderers type against a protocol instead."""
    for name in ("colors", "html", "terminal", "plots", "headview"):
        tree = ast.parse((VIZ / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "explanation" not in {(m or "").rsplit(".", 1)[-1] for m in imported}, name
    from attnlens.viz import colors

    exp = Explanation("t", ["a"], [False], 0, 0, [1.0], {"m": np.array([1.0])})
    assert colors.prepare(exp, False) == [exp] and colors.prepare((exp, exp), False) == [exp, exp]
    for bad in ("text", [exp, {"tokens": []}], [json.dumps(exp.to_dict())]):
        with pytest.raises(InputError, match="expected Explanation objects"):
            colors.prepare(bad, False)


def test_explanation_files_read_json_lines_through_the_one_reader(tmp_path):
    """JSON Lines are split on newlines only (str.splitlines also split on U+2028 inside a JSON string)."""
    from attnlens.results.explanation import load_explanations

    exp = Explanation("a\u2028b", ["a", "b"], [False, False], 0, 0, [1.0], {"m": np.array([1.0, 2.0])})
    f = tmp_path / "e.jsonl"
    f.write_text("".join(json.dumps(exp.to_dict(), ensure_ascii=False) + "\n" for _ in range(2)), encoding="utf-8")
    assert [e.text for e in load_explanations(f)] == ["a\u2028b", "a\u2028b"]
    f.write_text(json.dumps(exp.to_dict()) + "\n[1]\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"e.jsonl, line 2: expected a JSON object"):
        load_explanations(f)
