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


def _synopsis() -> dict[str, set[str]]:
    """Option strings per command in the README's command-line synopsis ("" = options before the command)."""
    block = re.search(r"## Command line\n\n```\n(.*?)```", README, flags=re.S).group(1)
    options: dict[str, set[str]] = {}
    command = ""
    for line in block.splitlines():
        words = line.split()
        if words[:1] == ["attnlens"]:
            command = words[1] if len(words) > 1 and not words[1].startswith(("-", "[")) else ""
            line = " ".join(words[2:] if command else words[1:])
        options.setdefault(command, set()).update(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", line))
    return options


def test_cli_synopsis_lists_every_option():
    import argparse

    from attnlens.cli import build_parser

    def option_strings(parser: argparse.ArgumentParser) -> set[str]:
        return {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    expected = {"": option_strings(parser)} | {name: option_strings(p) for name, p in sub.choices.items()}
    listed = _synopsis()
    assert set(listed) == set(expected), "the synopsis has one entry per subcommand (and the global options)"
    for command, opts in expected.items():
        name = command or "attnlens"
        missing, unknown = sorted(opts - listed[command]), sorted(listed[command] - opts)
        assert not missing, f"{name}: missing from the README synopsis: {missing}"
        assert not unknown, f"{name}: unknown options in the README synopsis: {unknown}"


@pytest.mark.slow
def test_method_option_examples_run(minilm_sst2):
    """Every ``{"method": {...}}`` options example of the README is valid on the reference model."""
    import ast

    examples = [ast.literal_eval(m) for m in re.findall(r'`(?:options=)?(\{"\w+": \{[^`]*\}\})`', README)]
    assert {"attcat", "transatt", "integratedgradients"} <= {name for e in examples for name in e}
    for options in examples:
        (exp,) = minilm_sst2.explain(["a charming journey"], methods=list(options), options=options)
        assert exp.methods == list(options)


def test_methods_by_architecture_page_is_what_the_code_says():
    """docs/methods-by-architecture.md is regenerated from the applicability checks and compared: a method or an
    architecture entry that changes what applies must come with the page (``scripts/method_matrix.py --write``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("method_matrix", ROOT / "scripts" / "method_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (ROOT / "docs" / "methods-by-architecture.md").read_text(encoding="utf-8")
    assert page == module.matrix_markdown(), "run: python scripts/method_matrix.py --write"
    assert "| bert | classifier | " + " | ".join(["✓"] * len(list_methods())) + " |" in page
