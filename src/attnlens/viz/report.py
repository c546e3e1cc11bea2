"""One self-contained HTML page of a benchmark results directory (see ``docs/benchmark-format.md``): run facts,
the methods x metrics table (best marked), metric bar charts, occlusion and AOPC curves, the embedding
projections of the consistency test, and a few example explanations. Figures are embedded as base64 PNG.
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..data import iter_jsonl
from ..errors import InputError
from ..paths import atomic_write_text, check_output_path
from ..results.explanation import Explanation
from .html import _e, _example, page

SUMMARY = "summary.json"
EXPLANATIONS = "explanations.jsonl"


def load_summary(results_dir: str | Path) -> dict[str, Any]:
    """``summary.json`` of a results directory, checked for the keys the report needs."""
    d = Path(results_dir)
    if not d.is_dir():
        raise InputError(f"results directory {d} {'is a file' if d.exists() else 'does not exist'}")
    f = d / SUMMARY
    if not f.is_file():
        raise InputError(f"no {SUMMARY} in {d}; run `attnlens benchmark --out {d}` first")
    try:
        summary = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"{f} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except UnicodeDecodeError:
        raise InputError(f"{f} is not a UTF-8 text file (not valid JSON)") from None
    if isinstance(summary, dict) and "n_lds" in summary and "metrics" in summary:
        raise InputError(f"{d} holds a context-attribution benchmark: its table is {d / 'summary.md'} (the report "
                         "draws the token-level benchmarks)")
    if not isinstance(summary, dict) or not isinstance(summary.get("results"), dict):
        raise InputError(f"{f} is not a benchmark summary: it has no 'results'")
    if not all(isinstance(r, dict) for r in summary["results"].values()):
        raise InputError(f"{f} is not a benchmark summary: 'results' must map methods to metric values")
    return summary


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(fig, alt: str) -> str:
    return f'<figure><img alt="{_e(alt)}" src="data:image/png;base64,{_png(fig)}"></figure>'


def _fmt(value: Any, digits: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return format(value, digits) if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _facts(summary: Mapping[str, Any]) -> str:
    keys = ["model", "dataset", "split", "n_examples", "n_planned", "accuracy", "protocol", "format"]
    rows = [(k, summary[k]) for k in keys if k in summary]
    rows += [(f"timing: {k}", v) for k, v in (summary.get("timing") or {}).items() if not isinstance(v, dict)]
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_fmt(v, '.4g'))}</td></tr>" for k, v in rows)
    return f'<table class="facts">{body}</table>'


def _results_table(summary: Mapping[str, Any]) -> str:
    from ..evaluation.summary import best_methods, direction

    results = summary.get("results") or {}
    methods = list(summary.get("methods") or results)
    infos = summary.get("metrics") or {}
    metrics = list(infos) or sorted({k for r in results.values() for k in r})
    best = {m: set(best_methods(summary, m)) for m in metrics}
    head = "<tr><th>method</th>"
    for m in metrics:
        info = infos.get(m, {})
        arrow = direction(info, short=True)
        head += f'<th title="{_e(info.get("description", ""))}">{_e(m)} {arrow}</th>'
    head += "</tr>"
    rows = []
    for method in methods:
        cells = []
        for m in metrics:
            v = (results.get(method) or {}).get(m)
            text = _e(_fmt(v))
            cells.append(f'<td class="best">{text}</td>' if method in best[m] else f"<td>{text}</td>")
        rows.append(f"<tr><th>{_e(method)}</th>{''.join(cells)}</tr>")
    legend = "".join(
        f"<li><b>{_e(m)}</b> ({direction(infos[m])} is better; range "
        f"{_e(_range(infos[m].get('range')))}, best {_e(_fmt(infos[m].get('best'), '.4g'))}): "
        f"{_e(infos[m].get('description', ''))}</li>"
        for m in metrics
        if m in infos
    )
    return f'<table class="results">{head}{"".join(rows)}</table><ul class="meta">{legend}</ul>'


def _range(r: Any) -> str:
    if not isinstance(r, (list, tuple)) or len(r) != 2:
        return "?"
    lo = "−∞" if r[0] is None else _fmt(r[0], ".4g")
    hi = "∞" if r[1] is None else _fmt(r[1], ".4g")
    return f"[{lo}, {hi}]"


def _figures(summary: Mapping[str, Any], label_names: list[str] | None) -> list[str]:
    from . import plots

    parts: list[str] = []
    results = summary.get("results") or {}
    has_values = any(plots._is_number(v) for r in results.values() for v in r.values())
    if has_values and summary.get("metrics"):
        parts.append("<h2>Metrics per method</h2>")
        parts.append(_figure(plots.plot_metric_bars(summary), "metric bar charts"))
    curves = summary.get("curves") or {}
    occ = curves.get("occlusion") or {}
    if occ.get("series"):
        parts.append("<h2>Occlusion curves</h2>")
        parts.append(
            '<p class="meta">Accuracy after dropping k tokens: at random, the top-scored first (<i>top</i>) or '
            "the most negative first (<i>bottom</i>); the protocol of Karpekov & Miller 2023"
            + (f" (drop = {_e(occ['drop'])})" if occ.get("drop") else "")
            + ".</p>"
        )
        parts.append('<div class="pair">')
        parts.append(_figure(plots.plot_occlusion_curves(summary, relative=True), "relative occlusion curves"))
        parts.append(_figure(plots.plot_occlusion_curves(summary, relative=False), "absolute occlusion curves"))
        parts.append("</div>")
    aopc = {m: c for m, c in (curves.get("aopc") or {}).items() if c.get("drop")}
    if aopc:
        parts.append("<h2>AOPC curves</h2>")
        trimmed = {**summary, "curves": {**curves, "aopc": aopc}}
        parts.append(_figure(plots.plot_aopc_curves(trimmed), "AOPC curves"))
    if (summary.get("sanity") or {}).get("methods"):
        parts.append("<h2>Sanity: explanations of ever more randomised models</h2>")
        parts.append('<div class="pair">')
        parts.append(_figure(plots.plot_sanity(summary), "rank correlation vs randomised depth"))
        parts.append(_figure(plots.plot_sanity(summary, absolute=True), "rank correlation of |scores|"))
        parts.append("</div>")
    consistency = {m: c for m, c in (summary.get("consistency") or {}).items() if c and c.get("points")}
    if consistency:
        parts.append("<h2>Consistency: embeddings of the top tokens</h2>")
        parts.append('<div class="pair">')
        for method in consistency:
            fig = plots.plot_embedding(consistency, method, label_names=label_names)
            parts.append(_figure(fig, f"embedding projection for {method}"))
        parts.append("</div>")
    return parts


def read_examples(results_dir: str | Path, n: int) -> list[Explanation]:
    """The first ``n`` explained examples of ``explanations.jsonl`` (not the other-class explanations kept for
    Kendall-τ); unreadable lines, such as the partial last line of an interrupted run, are skipped."""
    f = Path(results_dir) / EXPLANATIONS
    items: list[Explanation] = []
    if n <= 0 or not f.is_file():
        return items
    for _, row in iter_jsonl(f, skip_bad=True):
        if len(items) >= n:
            break
        try:
            exp = Explanation.from_dict(row)
        except (InputError, TypeError, ValueError, AttributeError, KeyError):
            continue
        if exp.meta.get("benchmark_role", "explained") == "explained":
            items.append(exp)
    return items


def _examples(items: list[Explanation], summary: Mapping[str, Any]) -> list[str]:
    if not items:
        return []
    methods = [m for m in summary.get("methods") or [] if all(m in e.scores for e in items)] or None
    parts = [f"<h2>Example explanations (first {len(items)})</h2>"]
    parts += [_example(e, i, methods, 5) for i, e in enumerate(items)]
    return parts


REPORT_STYLE = """
<style>
table.facts th { text-align: left; padding: 2px 12px 2px 0; font-weight: 600; }
table.results { border-collapse: collapse; margin: .5em 0; }
table.results th, table.results td { border: 1px solid #e5e7eb; padding: 4px 10px; text-align: right; }
table.results th:first-child { text-align: left; }
table.results td.best { font-weight: 700; background: #dcfce7; }
figure { margin: 1em 0; } figure img { max-width: 100%; }
div.pair { display: flex; flex-wrap: wrap; gap: 1em; } div.pair figure { flex: 1 1 45%; margin: 0; }
</style>
"""


def report_html(results_dir: str | Path, examples: int = 3, title: str | None = None) -> str:
    """The HTML report of a benchmark results directory (``summary.json`` and, if present, the first
    ``examples`` entries of ``explanations.jsonl``)."""
    d = Path(results_dir)
    summary = load_summary(d)
    name = " · ".join(str(summary[k]) for k in ("model", "dataset", "split") if summary.get(k))
    title = title or f"attnlens benchmark: {name or d.name}"
    body = [
        REPORT_STYLE,
        f"<h1>{_e(title)}</h1>",
        _facts(summary),
        "<h2>Results</h2>",
        '<p class="meta">Best value per metric in bold; n/a where a metric does not apply '
        "(e.g. Kendall-τ of class-agnostic methods).</p>",
        _results_table(summary),
    ]
    items = read_examples(d, examples if examples > 0 else 1)
    label_names = next((e.labels for e in items if e.labels), None)
    body += _figures(summary, label_names)
    body += _examples(items[:examples] if examples > 0 else [], summary)
    return page(title, "\n".join(body))


def write_report(results_dir: str | Path, out: str | Path | None = None, examples: int = 3) -> Path:
    """Write :func:`report_html` to ``out`` (default ``RESULTS_DIR/report.html``) and return the path."""
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 0:
        raise InputError(f"--examples must be an integer >= 0, got {examples!r}")
    path = check_output_path(out, "--out", directory=False) if out is not None else Path(results_dir) / "report.html"
    folder = Path(results_dir).expanduser().resolve()
    target = path.expanduser().resolve()
    if target.exists() and folder in target.parents and target.suffix.lower() not in (".html", ".htm"):
        raise InputError(f"--out {out} is a file of the results in {results_dir}; give another output file")
    html_text = report_html(results_dir, examples=examples)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, html_text)
    return path
