"""The reproduction scripts' report sections, from summaries shaped as run_benchmark writes them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))  # as when a script runs: its folder first on the path

from doc_sections import replace_section  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qa_precision_section_ranks_methods_and_states_the_model(tmp_path):
    qa = _load("qa_precision")
    summary = {"n_examples": 3, "results": {"rawatt": {"precision_at_k": 1.5}, "attcat": {"precision_at_k": 2.25},
                                            "flow": {"precision_at_k": None}},
               "curves": {"precision_at_k": {"k": 20, "perfect": 3.5}}, "timing": {"seconds": 120.0}}
    trained = {"eval": {"exact_match": 0.4, "f1": 0.5, "n": 10}, "train_seconds": 600}
    lines = qa.section(summary, trained, 3)
    table = [line for line in lines if line.startswith("| ") and "Precision" not in line]
    assert [row.split(" | ")[0] for row in table] == ["| attcat", "| rawatt", "| flow"]
    assert "| attcat | 2.25 |" in lines and "| flow | n/a |" in lines
    text = "\n".join(lines)
    assert "exact match 0.400 and F1 0.500" in text and "3.50" in text and "10 min" in text
    doc = tmp_path / "reproduction.md"
    doc.write_text("# Report\n\n## 1. First\n\nold\n", encoding="utf-8")
    replace_section(doc, qa.HEADING, lines)
    replace_section(doc, qa.HEADING, lines)  # replaced, not appended twice
    assert doc.read_text(encoding="utf-8").count(qa.HEADING) == 1
    assert "## 1. First" in doc.read_text(encoding="utf-8")
