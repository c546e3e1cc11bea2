"""Results folders of ``attnlens benchmark`` offered by the server: only those under the ``--results`` folders
given on the command line, addressed by the names listed here (never a path from the page)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from ..errors import InputError
from ..evaluation.results import read_rows
from ..evaluation.summary import ranking_key
from ..viz.report import EXPLANATIONS, SUMMARY, load_summary

EXAMPLES = "examples.jsonl"
CONFIDENCE = 0.95
EXTREMES = 3  # best and worst examples listed per method and metric


def _token_level(folder: Path) -> bool:
    """Whether ``folder`` holds a token-level benchmark's results (a context-attribution benchmark's summary sits
    beside its ``records.jsonl``, without the ``run.json`` of a token-level run)."""
    return (folder / SUMMARY).is_file() and not ((folder / "records.jsonl").is_file()
                                                 and not (folder / "run.json").is_file())


def find_results(roots: list[Path]) -> dict[str, Path]:
    """Name -> results folder: each root that is one, and the folders right under a root that are (token-level
    benchmarks: the explorer's tables read their examples)."""
    found: dict[str, Path] = {}
    for root in roots:
        candidates = [root] if (root / SUMMARY).is_file() else sorted(p for p in root.iterdir() if p.is_dir())
        for folder in candidates:
            if _token_level(folder):
                name = folder.name if folder == root else f"{root.name}/{folder.name}"
                while name in found:
                    name += "'"
                found[name] = folder
    return found


def interval(values: list[float]) -> tuple[float | None, float | None]:
    """The two-sided Student-t confidence interval of the mean (None where fewer than two values)."""
    if len(values) < 2:
        return None, None
    mean, sem = float(np.mean(values)), float(stats.sem(values))
    if sem == 0 or not math.isfinite(sem):
        return mean, mean
    low, high = stats.t.interval(CONFIDENCE, len(values) - 1, loc=mean, scale=sem)
    return float(low), float(high)


def _texts(folder: Path) -> dict[int, Any]:
    """Example index -> the explained text, from ``explanations.jsonl``."""
    out: dict[int, Any] = {}
    for row in read_rows(folder / EXPLANATIONS, repair=False):
        meta = row.get("meta") or {}
        if meta.get("benchmark_role", "explained") == "explained" and isinstance(meta.get("example_index"), int):
            out.setdefault(meta["example_index"], row.get("text"))
    return out


def read_results(name: str, folder: Path) -> dict[str, Any]:
    """The summary of a results folder, with per method and metric the mean's confidence interval over the
    examples and the best and worst examples (their texts open in the explain view)."""
    try:
        summary = load_summary(folder)
    except InputError as exc:  # the page names folders, never the server's paths
        raise InputError(str(exc).replace(str(folder), name)) from None
    metrics = summary.get("metrics") or {}
    values: dict[str, dict[str, list[tuple[float, int]]]] = defaultdict(lambda: defaultdict(list))
    for row in read_rows(folder / EXAMPLES, repair=False):
        method = row.get("method")
        if not isinstance(method, str) or not isinstance(row.get("metrics"), dict):
            continue
        for metric, value in row["metrics"].items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                values[method][metric].append((float(value), int(row.get("index", -1))))
    texts = _texts(folder)
    table: dict[str, dict[str, Any]] = {}
    for method, by_metric in (summary.get("results") or {}).items():
        table[method] = {}
        for metric, mean in by_metric.items():
            pairs = values[method][metric]
            low, high = interval([v for v, _ in pairs])
            key = ranking_key(metrics.get(metric) or {})
            ranked = sorted(pairs, key=lambda p: key(p[0]))
            pick = lambda chosen: [{"index": i, "value": v, "text": texts.get(i)} for v, i in chosen]  # noqa: E731
            table[method][metric] = {"mean": mean, "low": low, "high": high, "n": len(pairs),
                                     "best": pick(ranked[:EXTREMES]), "worst": pick(ranked[::-1][:EXTREMES])}
    keep = ("model", "dataset", "split", "n_examples", "n_planned", "accuracy", "protocol", "methods", "metrics",
            "curves")
    return {"name": name, "confidence": CONFIDENCE, **{k: summary.get(k) for k in keep}, "table": table,
            "model_source": model_source(str(summary.get("model") or ""))}


def model_source(name: str) -> str:
    """The model a name stands for, as the page compares a benchmark's model with the served ones: a local path
    made absolute, a hub id or shorthand as it is."""
    path = Path(name).expanduser()
    return str(path.resolve()) if name and path.exists() else name


def check_roots(paths: list[str]) -> list[Path]:
    """The ``--results`` folders, each an existing folder."""
    roots = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_dir():
            raise InputError(f"--results {p}: {'is not a folder' if path.exists() else 'no such folder'}")
        roots.append(path.resolve())
    return roots
