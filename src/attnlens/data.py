"""Data sets for evaluation: SST-2, IMDB, Yelp/Amazon polarity, MNLI, QQP and SQuAD v1.1/v2.0.

Every data set loads from plain local files first: from the folder given as ``root`` (CLI ``--data-root``), else
from ``$ATTNLENS_DATA``, laid out as ``<folder>/<data set>/<split file>`` in these formats:

- classification JSON Lines (optionally gzipped): ``{"text", "label"}`` per line (``sentence``/``content``/
  ``review`` are accepted for ``text``);
- sentence pairs: ``{"text_a", "text_b", "label"}`` (``premise``/``hypothesis`` and ``question1``/``question2``
  are accepted too);
- SQuAD JSON (optionally gzipped): ``{"data": [{"paragraphs": [{"context", "qas": [...]}]}]}``. Besides ``dev``,
  SQuAD has the splits ``fit`` (the articles at even positions of the dev file's ``data`` list: 0, 2, 4, ...)
  and ``eval`` (odd positions): fit on one, evaluate on the other, never on the same articles.

Any file of the same shape can be passed as a path instead of a name. When the local files are missing and the
``datasets`` package is installed, the HuggingFace hub is tried as a last resort (it needs network access).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InputError

DATA_ENV = "ATTNLENS_DATA"


@dataclass(frozen=True)
class DatasetSpec:
    """Where a named data set lives locally and on the hub, and what its labels mean."""

    name: str
    task: str  # "classification", "pair" or "qa"
    folder: str
    files: dict[str, tuple[str, ...]]  # split -> candidate file names inside the folder, first found wins
    default_split: str
    labels: tuple[str, ...] = ()
    hub: tuple[str, str | None] | None = None  # (path, config) for datasets.load_dataset
    hub_splits: dict[str, str] = field(default_factory=dict)  # our split name -> hub split name
    part_of: dict[str, str] = field(default_factory=dict)  # a split drawn from another -> that split

    def same_examples(self, a: str, b: str) -> bool:
        """Whether splits ``a`` and ``b`` share examples (the same split, or one drawn from the other)."""
        a, b = SPLIT_ALIASES.get(a, a), SPLIT_ALIASES.get(b, b)
        return self.part_of.get(a, a) == self.part_of.get(b, b)


def _cands(stem: str) -> tuple[str, ...]:
    return (f"{stem}.jsonl", f"{stem}.jsonl.gz")


# SQuAD articles by their position in the dev file's ``data`` list: "fit" the even ones (0, 2, 4, ...), "eval" the
# odd ones. Everything that fits on some articles and evaluates on others (attnlens train, AT2's weights) splits
# them here, so that nothing is ever evaluated on articles it was fitted on.
SQUAD_PARTS = {"fit": 0, "eval": 1}


def squad_part(articles: Sequence[Any], part: str) -> list[tuple[int, Any]]:
    """``(position, article)`` of the SQuAD ``articles`` (a dev file's ``data`` list) in ``part``: ``"fit"``
    holds those at even positions (0, 2, 4, ...), ``"eval"`` those at odd positions (1, 3, 5, ...)."""
    if part not in SQUAD_PARTS:
        raise InputError(f"SQuAD part {part!r}; choose fit (articles at even positions) or eval (odd positions)")
    return [(i, articles[i]) for i in range(SQUAD_PARTS[part], len(articles), 2)]


def _squad_files(*names: str) -> dict[str, tuple[str, ...]]:
    return {"dev": names, **{part: names for part in SQUAD_PARTS}}


SPECS: dict[str, DatasetSpec] = {
    "sst2": DatasetSpec(
        "sst2", "classification", "sst2",
        {"dev": _cands("dev"), "train": _cands("train"), "test": _cands("test")},
        "dev", ("negative", "positive"), ("glue", "sst2"),
        {"dev": "validation", "train": "train", "test": "test"},
    ),
    "imdb": DatasetSpec(
        "imdb", "classification", "imdb",
        {"test": _cands("test"), "train": _cands("train"), "sample2000": _cands("test_sample2000_seed0")},
        "test", ("negative", "positive"), ("imdb", None), {"test": "test", "train": "train"},
        part_of={"sample2000": "test"},
    ),
    "yelp_polarity": DatasetSpec(
        "yelp_polarity", "classification", "yelp_polarity",
        {"test": _cands("test"), "train": _cands("train")},
        "test", ("negative", "positive"), ("yelp_polarity", None), {"test": "test", "train": "train"},
    ),
    "amazon_polarity": DatasetSpec(
        "amazon_polarity", "classification", "amazon_polarity",
        {"test": _cands("test"), "train": _cands("train")},
        "test", ("negative", "positive"), ("amazon_polarity", None), {"test": "test", "train": "train"},
    ),
    "mnli": DatasetSpec(
        "mnli", "pair", "mnli",
        {
            "dev_matched": ("dev_matched.jsonl", "dev_matched.jsonl.gz", "dev_matched_textfooler1000.jsonl"),
            "dev_mismatched": (
                "dev_mismatched.jsonl", "dev_mismatched.jsonl.gz", "dev_mismatched_textfooler1000.jsonl",
            ),
            "train": _cands("train"),
        },
        "dev_matched", ("entailment", "neutral", "contradiction"), ("glue", "mnli"),
        {"dev_matched": "validation_matched", "dev_mismatched": "validation_mismatched", "train": "train"},
    ),
    "qqp": DatasetSpec(
        "qqp", "pair", "qqp",
        {"dev": _cands("dev"), "train": _cands("train")},
        "dev", ("not_duplicate", "duplicate"), ("glue", "qqp"), {"dev": "validation", "train": "train"},
    ),
    "squad": DatasetSpec(
        "squad", "qa", "squad_v1.1",
        _squad_files("dev-v1.1.json", "dev-v1.1.json.gz", "dev-v1.1.reconstructed.json.gz"),
        "dev", (), ("squad", None), {"dev": "validation"},
    ),
    "squad_v2": DatasetSpec(
        "squad_v2", "qa", "squad_v2.0",
        _squad_files("dev-v2.0.json", "dev-v2.0.json.gz", "dev-v2.0.reconstructed.json.gz"),
        "dev", (), ("squad_v2", None), {"dev": "validation"},
    ),
}
ALIASES = {
    "glue/sst2": "sst2", "sst-2": "sst2", "glue/mnli": "mnli", "multi_nli": "mnli", "glue/qqp": "qqp",
    "squad_v1": "squad", "squad_v1.1": "squad", "squad1": "squad", "squad_v2.0": "squad_v2", "squad2": "squad_v2",
    "yelp": "yelp_polarity", "amazon": "amazon_polarity",
}
SPLIT_ALIASES = {"validation": "dev", "val": "dev", "validation_matched": "dev_matched",
                 "validation_mismatched": "dev_mismatched"}


@dataclass
class Example:
    """One labelled input.

    ``text`` is a string, or ``[text_a, text_b]`` for a sentence pair and ``[question, context]`` for QA.
    QA examples carry ``answers`` (``[{"text", "answer_start"}]``, character offsets into the context; empty for
    unanswerable SQuAD v2 questions) and have ``label`` ``None``.
    """

    id: str
    text: str | list[str]
    label: int | None = None
    answers: list[dict[str, Any]] | None = None

    @property
    def is_pair(self) -> bool:
        return isinstance(self.text, list)


@dataclass
class Dataset:
    """A loaded split: its examples, in file order (or a seeded subset of them, still in file order)."""

    name: str
    split: str
    task: str
    examples: list[Example]
    labels: list[str] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    @property
    def texts(self) -> list[str | list[str]]:
        """Inputs in the form :meth:`Explainer.explain` takes (strings or ``[a, b]`` pairs)."""
        return [e.text for e in self.examples]

    @property
    def gold(self) -> list[int | None]:
        return [e.label for e in self.examples]


# a class name that only numbers its class (transformers' default ``LABEL_0``, or ``"0"``): it says nothing of what
# the class means
_NUMBERED = re.compile(r"(label[ _-]?)?\d+", re.IGNORECASE)


def names_classes(names: Sequence[str]) -> bool:
    """Whether ``names`` (class names in index order) say what the classes are: every one is given and none is
    a bare number such as transformers' default ``LABEL_0``."""
    return bool(names) and not any(_NUMBERED.fullmatch(str(n).strip()) for n in names)


def class_order(data_names: Sequence[str], model_names: Sequence[str]) -> list[int] | None:
    """Where each class of a data set is among a model's classes, matched by name (case and surrounding spaces
    ignored): ``order[i]`` is the model's index of the data's class ``i``. ``None`` when either side only numbers
    its classes or the two sides do not name the same classes."""
    if not (names_classes(data_names) and names_classes(model_names)) or len(data_names) != len(model_names):
        return None
    index = {str(n).strip().casefold(): i for i, n in enumerate(model_names)}
    order = [index.get(str(n).strip().casefold()) for n in data_names]
    if None in order or len(set(order)) != len(order) or len(index) != len(model_names):
        return None
    return [int(i) for i in order]  # type: ignore[arg-type]


TASKS = ("classification", "pair", "qa")  # what a data file holds


def known_datasets() -> list[str]:
    """Names :func:`load_dataset` accepts (besides file paths)."""
    return list(SPECS)


def data_root(root: str | os.PathLike[str] | None = None) -> Path | None:
    """The local data folder: ``root``, else ``$ATTNLENS_DATA``; ``None`` when neither is given."""
    if root is not None:
        return Path(root).expanduser()
    env = os.environ.get(DATA_ENV)
    return Path(env).expanduser() if env else None


def names_a_file(name: str | os.PathLike[str]) -> bool:
    """Whether :func:`load_dataset` reads ``name`` as a file (a path with a suffix, or one that exists) rather
    than as a known data set's name; a file has no splits."""
    key = str(name)
    path = Path(key).expanduser()
    return key.lower() not in SPECS and key.lower() not in ALIASES and bool(path.suffix or path.exists())


def load_dataset(
    name: str | os.PathLike[str],
    split: str | None = None,
    *,
    limit: int | None = None,
    seed: int = 0,
    root: str | os.PathLike[str] | None = None,
    task: str | None = None,
    hub: bool = True,
    labels: Sequence[str] | None = None,
) -> Dataset:
    """Load a data set by name (see :func:`known_datasets`) or from a file of the same shape.

    Args:
        name: a known name (``sst2``, ``imdb``, ``mnli``, ``squad`` ...) or a path to a ``.jsonl[.gz]`` /
            SQuAD ``.json[.gz]`` file.
        split: split name (``dev``, ``test``, ``train``; IMDB also ``sample2000``; MNLI ``dev_matched`` /
            ``dev_mismatched``); the data set's default when ``None``.
        limit: keep ``limit`` examples drawn with ``random.Random(seed)``, in their original order.
        seed: seed of the subset.
        root: local data folder (default: see :func:`data_root`).
        task: for files: ``classification``, ``pair`` or ``qa`` (guessed from the content if ``None``).
        hub: whether to fall back to the HuggingFace hub (needs ``datasets`` and network access).
        labels: for files: the classes' names by id, so that rows may give a label by its name (a named data
            set's rows read its own names).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InputError(f"limit must be a positive whole number of examples, got {limit!r}")
    if task not in (None, *TASKS):
        raise InputError(f"task must be one of {', '.join(TASKS)} (or None to tell from the file), got {task!r}")
    key = str(name)
    path = Path(key).expanduser()
    if names_a_file(key):
        if not path.is_file():
            raise InputError(f"data file {key} does not exist")
        ds = _load_file(path, task=task, name=path.name, split=split or path.stem,
                        labels=list(labels) if labels else None)
        return _subset(ds, limit, seed)
    spec = SPECS.get(ALIASES.get(key.lower(), key.lower()))
    if spec is None:
        raise InputError(
            f"unknown dataset {key!r}; known datasets: {', '.join(known_datasets())} (or give a path to a "
            ".jsonl / SQuAD .json file)"
        )
    split = SPLIT_ALIASES.get(split, split) if split else spec.default_split
    if split not in spec.files:
        raise InputError(f"dataset {spec.name!r} has no split {split!r}; its splits: {', '.join(spec.files)}")
    base = data_root(root)
    if base is None and not (hub and importlib.util.find_spec("datasets")):
        raise InputError(f"no data folder for {spec.name}: pass --data-root DIR (root= in Python) or set ${DATA_ENV}")
    tried: list[str] = []
    if base is not None:
        for fname in spec.files[split]:
            f = base / spec.folder / fname
            tried.append(str(f))
            if f.is_file():
                part = split if spec.task == "qa" and split in SQUAD_PARTS else None
                ds = _load_file(f, task=spec.task, name=spec.name, split=split, labels=list(spec.labels), part=part)
                return _subset(ds, limit, seed)
    if hub:
        ds = _load_hub(spec, split, tried)
        return _subset(ds, limit, seed)
    raise InputError(f"no local file for {spec.name}/{split}; looked for {', '.join(tried) or 'no data folder'}")


def split_files(name: str, split: str, root: str | os.PathLike[str] | None = None) -> set[Path]:
    """The local files (resolved) of split ``split`` of the known data set ``name`` and of every split sharing its
    examples (:meth:`DatasetSpec.same_examples`): the files an evaluation of a model trained on it must not read."""
    spec = SPECS.get(ALIASES.get(name.lower(), name.lower()))
    base = data_root(root)
    if spec is None or base is None:
        return set()
    split = SPLIT_ALIASES.get(split, split)
    return {(base / spec.folder / f).resolve() for other in spec.files if spec.same_examples(split, other)
            for f in spec.files[other] if (base / spec.folder / f).is_file()}


def _subset(ds: Dataset, limit: int | None, seed: int) -> Dataset:
    if limit is None or limit >= len(ds.examples):
        return ds
    keep = sorted(random.Random(seed).sample(range(len(ds.examples)), limit))
    ds.examples = [ds.examples[i] for i in keep]
    return ds


# a line ends at \n, \r\n or a lone \r (old Mac files); never a \r then a \n apart, even in a longer pattern
LINE_BREAK = r"(?:\r\n|\r(?!\n)|\n)"
_LINE_BREAK = re.compile(LINE_BREAK)


def text_lines(text: str) -> list[str]:
    """The lines of a file's text, split at ``\\n``, ``\\r\\n`` and ``\\r`` only: not at the other characters
    :meth:`str.splitlines` breaks at (form feed, U+2028, U+0085, ...), which a text or a JSON string may hold."""
    lines = _LINE_BREAK.split(text)
    if lines and not lines[-1]:
        lines.pop()
    return lines


def _open_text(path: Path):
    """The file as UTF-8 text (gzipped where its name ends in .gz); a leading byte-order mark is not read as text."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return path.open("r", encoding="utf-8-sig")


def iter_jsonl(
    path: str | os.PathLike[str], what: str | None = None, *, skip_bad: bool = False
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of a JSON Lines file (optionally gzipped).

    A line that is not a JSON object raises :class:`InputError` naming the file and line (``what`` replaces the
    file name in messages, e.g. ``"--file x.jsonl"``); with ``skip_bad`` it is skipped instead (files written
    by attnlens itself, whose only bad line is one torn by an interruption).
    """
    path = Path(path)
    where = what or str(path)
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    if skip_bad:
                        continue
                    raise InputError(f"{where}, line {lineno}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    if skip_bad:
                        continue
                    raise InputError(f"{where}, line {lineno}: expected a JSON object")
                yield lineno, row
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # EOFError: a gzip file cut short
        raise InputError(f"{where}: cannot read it ({exc})") from None


def row_text(row: dict[str, Any], key: str, where: str) -> str:
    """``row[key]`` if it is a string; a null, number or list is a broken row, not the text "None"."""
    value = row[key]
    if not isinstance(value, str):
        raise InputError(f"{where}: field {key!r} is {json.dumps(value)[:40]}, not a text string")
    return value


_TEXT_KEYS = ("text", "sentence", "content", "review")
# the field names of a sentence pair in a JSON Lines row, first and second text (load_dataset, explain --file)
PAIR_KEYS = (("text_a", "text_b"), ("premise", "hypothesis"), ("question1", "question2"), ("sentence1", "sentence2"),
             ("question", "context"))  # the last: a QA input, as SQuAD names its fields


def _load_file(
    path: Path, *, task: str | None, name: str, split: str, labels: list[str] | None = None, part: str | None = None
) -> Dataset:
    stem = path.name[:-3] if path.name.endswith(".gz") else path.name
    if task == "qa" or (task is None and stem.endswith(".json")):
        try:
            with _open_text(path) as f:
                doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} is not a SQuAD-style JSON file: {exc}") from None
        except (OSError, EOFError, UnicodeDecodeError) as exc:  # not gzip, cut short, not UTF-8
            raise InputError(f"{path}: cannot read it ({exc})") from None
        return Dataset(name, split, "qa", squad_examples(doc, source=str(path), part=part), [], str(path))
    examples: list[Example] = []
    kind = task
    for lineno, row in iter_jsonl(path):
        ex, row_kind = _row_example(row, lineno, path, labels)
        if kind in (None, "classification", "pair") and kind not in (None, row_kind):
            raise InputError(f"{path}:{lineno}: expected a {kind} row, got {sorted(row)}")
        kind = row_kind
        examples.append(ex)
    if not examples:
        raise InputError(f"{path} holds no examples")
    if not labels:
        names = {}
        for _, row in iter_jsonl(path):  # label names, where rows carry them (MNLI's label_text)
            if "label_text" in row and row.get("label") is not None:
                names[int(row["label"])] = str(row["label_text"])
        labels = [names[i] for i in sorted(names)] if names and sorted(names) == list(range(len(names))) else []
    return Dataset(name, split, kind or "classification", examples, labels, str(path))


class LabelNamesWithoutClasses(InputError):
    """A data file's row gives its label by a class name, and no class names were given to read it by."""


def _row_example(row: dict[str, Any], lineno: int, path: Path,
                 names: Sequence[str] | None = None) -> tuple[Example, str]:
    ident = str(row.get("id", row.get("idx", lineno - 1)))
    label = row.get("label")
    wanted = "an integer class id" + (f" or one of {', '.join(names)}" if names else "")
    if isinstance(label, bool) or (isinstance(label, float) and not label.is_integer()):
        raise InputError(f"{path}:{lineno}: label must be {wanted}, got {label!r}")
    if names and isinstance(label, str) and label in names:  # a class by its name
        label = list(names).index(label)
    if label is not None:
        try:
            label = int(label)
        except (TypeError, ValueError):
            error = LabelNamesWithoutClasses if isinstance(label, str) and not names else InputError
            raise error(f"{path}:{lineno}: label must be {wanted}, got {label!r}") from None
    where = f"{path}:{lineno}"
    for a, b in PAIR_KEYS:
        if a in row and b in row:
            return Example(ident, [row_text(row, a, where), row_text(row, b, where)], label), "pair"
    for k in _TEXT_KEYS:
        if k in row:
            text = row_text(row, k, where)
            if "title" in row and k == "content" and row["title"]:  # amazon_polarity: title + content
                text = f"{row['title']}. {text}"
            return Example(ident, text, label), "classification"
    raise InputError(
        f"{path}:{lineno}: a row needs 'text' (or {', '.join(_TEXT_KEYS[1:])}) or a pair "
        f"({', '.join('/'.join(p) for p in PAIR_KEYS)}); got keys {sorted(row)}"
    )


def squad_examples(doc: dict[str, Any], source: str = "", part: str | None = None) -> list[Example]:
    """Examples ``[question, context]`` with their gold answers from a SQuAD v1.1/v2.0 document; ``part``
    (``"fit"`` or ``"eval"``, see :func:`squad_part`) keeps the questions of those articles only."""
    if "data" not in doc:
        raise InputError(f"{source or 'document'} is not SQuAD JSON: no 'data' key")
    articles = doc["data"] if part is None else [a for _, a in squad_part(doc["data"], part)]
    out: list[Example] = []
    for article in articles:
        for para in article.get("paragraphs", []):
            context = para["context"]
            for qa in para.get("qas", []):
                answers = [] if qa.get("is_impossible") else list(qa.get("answers", []))
                out.append(Example(str(qa["id"]), [qa["question"], context], None, answers))
    return out


def squad_file(root: str | os.PathLike[str] | None = None, name: str = "squad") -> Path:
    """The local SQuAD dev file (``name`` ``squad`` for v1.1, ``squad_v2``) under ``root`` or ``$ATTNLENS_DATA``."""
    spec = SPECS[name]
    base = data_root(root)
    if base is not None:
        for fname in spec.files["dev"]:
            path = base / spec.folder / fname
            if path.is_file():
                return path
    title = {"squad": "SQuAD v1.1", "squad_v2": "SQuAD v2.0"}[name]
    raise InputError(f"{title} dev not found: put {spec.files['dev'][0]}(.gz) under DATA/{spec.folder}/ and pass "
                     f"--data-root DATA (or set ${DATA_ENV})")


def squad_articles(root: str | os.PathLike[str] | None = None, name: str = "squad") -> list[dict[str, Any]]:
    """The ``data`` list (articles, in file order) of the local SQuAD dev file (see :func:`squad_file`)."""
    path = squad_file(root, name)
    try:
        with _open_text(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not a SQuAD-style JSON file: {exc}") from None
    except (OSError, EOFError, UnicodeDecodeError) as exc:  # not gzip, cut short, not UTF-8
        raise InputError(f"{path}: cannot read it ({exc})") from None
    if "data" not in doc:
        raise InputError(f"{path} is not SQuAD JSON: no 'data' key")
    return doc["data"]


def _load_hub(spec: DatasetSpec, split: str, tried: Sequence[str]) -> Dataset:
    where = f"looked for {', '.join(tried)}" if tried else f"no data folder (--data-root or ${DATA_ENV})"
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise InputError(
            f"no local file for {spec.name}/{split} ({where}) and the 'datasets' package is not installed "
            "to fetch it from the HuggingFace hub (pip install attnlens[hub])"
        ) from None
    if spec.hub is None or split not in spec.hub_splits:
        raise InputError(f"no local file for {spec.name}/{split} ({where}) and no hub split for it")
    path, config = spec.hub
    try:
        hf = datasets.load_dataset(path, config, split=spec.hub_splits[split])
    except Exception as exc:  # offline, renamed, ...: one readable line
        raise InputError(f"no local file for {spec.name}/{split} ({where}); the hub failed too: {exc}") from None
    examples: list[Example] = []
    for i, row in enumerate(hf):
        if spec.task == "qa":
            ans = row["answers"]
            answers = [{"text": t, "answer_start": s} for t, s in zip(ans["text"], ans["answer_start"])]
            examples.append(Example(str(row["id"]), [row["question"], row["context"]], None, answers))
        else:
            ex, _ = _row_example(dict(row), i + 1, Path(f"{path}/{config or ''}"))
            examples.append(ex)
    return Dataset(spec.name, split, spec.task, examples, list(spec.labels), f"hub:{path}/{config or ''}")
