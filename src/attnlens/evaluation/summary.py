"""The summary of a results directory: ``summary.json`` from ``examples.jsonl``, and the tables.

Nothing here knows a metric by name: each metric describes itself (:class:`~.metrics.MetricInfo`: range, best
value, direction, per-example or data-set level) and computes its own curve (:meth:`~.metrics.Metric.curve`).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..paths import atomic_output, atomic_write_text
from .metrics import CURVES, METRICS, EvalConfig, mean_or_none, metric_info
from .results import FORMAT_VERSION, BenchmarkSettings, complete_examples, example_row_of, finite, jsonable, read_rows


def summarize(
    out_dir: str | Path,
    settings: BenchmarkSettings,
    consist: dict[str, Any] | None = None,
    timing: dict[str, Any] | None = None,
    sanity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Aggregate ``examples.jsonl`` into ``summary.json``, ``table.md`` and ``table.csv``.

    ``consist`` and ``sanity``: the data-set metrics' results (:mod:`.metrics` consistency, :mod:`.sanity`)."""
    out = Path(out_dir)
    rows = read_rows(out / "examples.jsonl", row=example_row_of(settings.metrics))
    done = complete_examples(rows, settings.methods)
    rows = [r for r in rows if r["index"] in done]
    config = EvalConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.config.items()})
    by_method: dict[str, list[dict[str, Any]]] = {m: [] for m in settings.methods}
    baselines = []
    for r in rows:
        if r["method"] is None:
            baselines.append(r)
        else:
            by_method[r["method"]].append(r)
    metric_names = list(settings.metrics)
    infos = {name: metric_info(name, config) for name in metric_names}
    dataset_values = {  # data-set metric -> method -> its one value
        "consistency": {m: c.get("silhouette") for m, c in (consist or {}).items()},
        "sanity": {m: c.get("value") for m, c in ((sanity or {}).get("methods") or {}).items()},
    }
    results: dict[str, dict[str, float | None]] = {}
    for m in settings.methods:
        results[m] = {}
        for name in metric_names:
            if infos[name].level == "dataset":  # one value per method, computed on the whole data set
                results[m][name] = finite(dataset_values[name].get(m))
            else:
                results[m][name] = mean_or_none([r["metrics"].get(name) for r in by_method[m]])
    curves: dict[str, Any] = {}
    for name in CURVES:
        if name in metric_names:
            curve = METRICS[name](config).curve(by_method, baselines)
            if curve is not None:
                curves[name] = curve
    n_correct = sum(1 for b in baselines if b["label"] is not None and b["predicted"] == b["label"])
    n_labelled = sum(1 for b in baselines if b["label"] is not None)
    summary = {
        "format": FORMAT_VERSION,
        "model": settings.model,
        "dataset": settings.dataset,
        "split": settings.split,
        "n_examples": len(done),
        "n_planned": len(settings.example_ids),
        "accuracy": n_correct / n_labelled if n_labelled else None,
        "protocol": config.protocol,
        "config": settings.config,
        "methods": list(settings.methods),
        "metrics": {name: info.to_dict() for name, info in infos.items()},
        "results": results,
        "curves": curves,
        "consistency": {} if consist is None else consist,
        "sanity": {} if sanity is None else sanity,
        "timing": timing or {},
    }
    json_ready = json.loads(json.dumps(summary, default=jsonable))
    atomic_write_text(out / "summary.json", json.dumps(json_ready, indent=1, allow_nan=False))
    write_tables(out, summary)
    return json_ready


def ranking_key(info: Mapping[str, Any]) -> Callable[[float], float]:
    """A metric's values ranked from best to worst by this key, ascending (``info``: the metric's entry in a
    summary's ``metrics``): the distance to its ``best`` where it is ranked ``toward_best``, else the value, or
    its negative where higher is better."""
    if info.get("toward_best"):
        best = float(info.get("best") or 0.0)
        return lambda v: abs(v - best)
    return (lambda v: v) if info.get("lower_is_better") else (lambda v: -v)


def direction(info: Mapping[str, Any], short: bool = False) -> str:
    """How a metric ranks, as the tables (``short``: an arrow) and legends say it."""
    if info.get("toward_best"):
        best = f"{float(info.get('best') or 0.0):g}"
        return f"→{best}" if short else f"closer to {best}"
    if short:
        return "↓" if info.get("lower_is_better") else "↑"
    return "lower" if info.get("lower_is_better") else "higher"


def best_methods(summary: Mapping[str, Any], metric: str) -> list[str]:
    """The methods with the best value of ``metric`` in ``summary`` (:func:`ranking_key`).

    Tie rule: every method whose value equals the best one up to floating-point noise (relative and absolute
    tolerance 1e-12) is best; missing and non-finite values (n/a) never are. The tables (``table.md``,
    ``table.csv``), the report and the bar charts all mark the best methods with this one function.
    """
    info = (summary.get("metrics") or {}).get(metric, {})
    values = {m: r.get(metric) for m, r in (summary.get("results") or {}).items() if _is_number(r.get(metric))}
    if not values:
        return []
    key = ranking_key(info)
    best = min(key(v) for v in values.values())
    return [m for m, v in values.items() if math.isclose(key(v), best, rel_tol=1e-12, abs_tol=1e-12)]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def write_tables(out_dir: str | Path, summary: dict[str, Any]) -> None:
    """``table.md`` (best values in bold) and ``table.csv`` (plus a ``best_in`` column) of methods × metrics."""
    out = Path(out_dir)
    metrics = list(summary["metrics"])
    best = {n: best_methods(summary, n) for n in metrics}
    arrows = {n: direction(i, short=True) for n, i in summary["metrics"].items()}
    done, planned = summary["n_examples"], summary.get("n_planned", summary["n_examples"])
    count = f"{done} examples" if done == planned else f"{done} of {planned} examples, partial: resume to complete"
    lines = [
        f"{summary['model']} on {summary['dataset']}/{summary['split']} ({count}, "
        f"protocol {summary['protocol']}); best in bold.",
        "",
        "| method | " + " | ".join(f"{n} {arrows[n]}" for n in metrics) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    for m, res in summary["results"].items():
        cells = []
        for n in metrics:
            v = res.get(n)
            text = "n/a" if v is None else f"{v:.3f}"
            cells.append(f"**{text}**" if v is not None and m in best[n] else text)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if "precision_at_k" in metrics:
        pk = summary.get("curves", {}).get("precision_at_k", {})
        perfect = pk.get("perfect")
        lines += ["", f"precision_at_k is a count, not a fraction: gold-answer tokens among the top K = {pk.get('k')} "
                  "tokens, averaged over the answerable questions whose answer survived truncation" + (
                      "" if perfect is None else f" (best reachable: {perfect:.3f})") + "."]
    atomic_write_text(out / "table.md", "\n".join(lines) + "\n")
    with atomic_output(out / "table.csv") as tmp, tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["method", *metrics, "best_in"])
        for m, res in summary["results"].items():
            w.writerow([m, *("" if res.get(n) is None else f"{res[n]:.6g}" for n in metrics),
                        ";".join(n for n in metrics if m in best[n])])


__all__ = ["best_methods", "summarize", "write_tables"]
