"""The README's examples run, and its method table lists every registered method."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import SHARED

from attnlens import list_methods

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_method_table_lists_every_method():
    table_ids = set(re.findall(r"^\| `(\w+)` \|", README, flags=re.M))
    assert table_ids == set(list_methods())


@pytest.mark.slow
def test_python_quick_start_runs(tmp_path, monkeypatch, capsys):
    if not (SHARED / "models" / "minilm-sst2").is_dir():
        pytest.skip("reference model not found")
    block = re.search(r"## Python quick start\n\n```python\n(.*?)```", README, flags=re.S).group(1)
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "shared").symlink_to(SHARED)  # so that ../shared/... resolves as in the README
    monkeypatch.chdir(work)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    exps = namespace["exps"]
    assert exps[0].top_k("attcat", 1)[0][0] == "t"
    assert (work / "out.json").is_file()
    assert "attcat" in capsys.readouterr().out
