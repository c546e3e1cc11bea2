"""The package's layers, read from the source: no module imports one that imports it back, the engines never see
the :class:`Explainer`, and nothing below the command line imports the package face (``attnlens/__init__.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "attnlens"


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """The attnlens modules ``path`` imports anywhere: at the top, inside functions (lazy imports) and under
    ``if TYPE_CHECKING:``; ``from . import x`` of a submodule counts as that submodule."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("attnlens"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if not name.startswith("attnlens"):
                continue
            subs = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in MODULES]
            found.update(subs or [name])
    return {m for m in found if m in MODULES and m != here}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_and_only_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_imports_one_that_imports_it_back():
    graph = {m: _imports(p) - {"attnlens"} for m, p in MODULES.items() if m != "attnlens"}
    assert _cycle(graph) is None


def test_the_engines_take_a_record_not_the_explainer():
    for name in ("attnlens.core.engine", "attnlens.core.generation_engine", "attnlens.core.model_runner"):
        assert "attnlens.explainer" not in _imports(MODULES[name]), name


def test_only_the_command_line_imports_the_package_face():
    importers = {m for m, p in MODULES.items() if "attnlens" in _imports(p)}
    assert {m for m in importers if not m.startswith("attnlens.cli")} == set()
