"""Views of a :class:`~attnlens.results.context_attribution.ContextAttribution`: the answer and the sources
ranked by score in the terminal; the context with its sources shaded by score in HTML (every method's score on
hover)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .colors import hex_color, normalized, shade
from .html import page
from .safetext import html_safe, terminal_safe

__all__ = ["attribution_html", "print_attribution"]

EXTRA_STYLE = """
.context { white-space: pre-wrap; line-height: 1.7; border: 1px solid #e5e7eb; padding: .8em; border-radius: 6px; }
.src { border-radius: 3px; padding: 1px 0; }
.src:hover { outline: 1px solid #2563eb; }
.answer { background: #eff6ff; padding: .5em .8em; border-radius: 6px; white-space: pre-wrap; }
table.ranked td.num { text-align: right; font-family: ui-monospace, monospace; }
"""


def _e(value: object) -> str:
    return html_safe(value)


def score_text(value: float, digits: int = 4) -> str:
    """A signed score with ``digits`` significant digits, whatever its scale (a method whose scores are all about
    1e-4 still shows them apart, where a fixed number of decimals would print ``+0.0000``)."""
    return f"{value:+.{digits}g}"


def print_attribution(a: Any, k: int | None = None, console: Any = None) -> None:
    """The answer, then per method the sources from the highest score down (``k``: at most that many). The
    context's, query's and answer's text is printed as written (never read as rich markup)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def line(label: str, text: str) -> Text:
        return Text.assemble((label, "bold"), " ", terminal_safe(text))

    console = console or Console()
    console.print(line("Query:", a.query), highlight=False)
    console.print(line("Answer:", a.answer), highlight=False)
    explained = a.meta.get("explained")
    if explained and list(explained) != [0, len(a.answer)]:
        console.print(line("Explained:", a.meta.get("explained_text", "")), highlight=False)
    for m in a.methods:
        table = Table(title=Text(terminal_safe(m, one_line=True)), title_justify="left", show_lines=False)
        table.add_column("#", justify="right")
        table.add_column("score", justify="right")
        table.add_column("source")
        for rank, (i, s, v) in enumerate(a.ranked(m)[: k or None], 1):
            text = s.text if len(s.text) <= 110 else s.text[:107] + "..."
            table.add_row(str(rank), score_text(v), Text(f"[{i}] {terminal_safe(text, one_line=True)}"))
        console.print(table)
        share = a.meta.get("outside_share", {}).get(m)
        if share is not None:
            console.print(Text(f"  share of {terminal_safe(m, one_line=True)}'s token scores outside every source "
                               f"(template, query, special tokens): {share:.0%}"), highlight=False)
    if a.token_rows:
        table = Table(title="top source of each answer token", title_justify="left")
        table.add_column("token")
        for m in a.token_rows:
            table.add_column(Text(terminal_safe(m, one_line=True)), justify="right")
        for row, label in enumerate(_row_labels(a)):
            cells = [f"[{i}] {score_text(v, 3)}" for i, v in (_top_source(a, m, row) for m in a.token_rows)]
            table.add_row(Text(terminal_safe(label, one_line=True)), *cells)
        console.print(table)


def _row_labels(a: Any) -> list[str]:
    """Each per-token row's answer token, as ``repr`` spells it (``' Paris'``)."""
    spans, labels = a.row_spans, []
    for row, step in enumerate(a.token_row_steps):
        # a result read back without its token-level part has the rows and their spans, not every token
        if step < len(a.answer_tokens):
            labels.append(repr(a.answer_tokens[step]))
        else:
            labels.append(repr(a.answer[slice(*spans[row])]) if row < len(spans) else f"answer token {step}")
    return labels


def _top_source(a: Any, method: str, row: int) -> tuple[int, float]:
    """The source a per-token row of ``method`` scores highest (the first of tied ones) and its score."""
    values = a.token_rows[method][row]
    best = int(np.argmax(values))
    return best, float(values[best])


def _context_html(a: Any, method: str) -> str:
    norm = normalized(a.scores[method])
    parts, at = [], 0
    order = sorted(range(len(a.sources)), key=lambda i: a.sources[i].start)
    for i in order:
        s = a.sources[i]
        parts.append(_e(a.context[at:s.start]))
        tip = "&#10;".join(f"{_e(m)}: {score_text(float(a.scores[m][i]))}" for m in a.methods)
        color = hex_color(shade(float(norm[i])))
        parts.append(f'<span class="src" data-source="{i}" style="background:{color}" '
                     f'title="[{i}]&#10;{tip}">{_e(s.text)}</span>')
        at = s.end
    parts.append(_e(a.context[at:]))
    return f'<div class="context">{"".join(parts)}</div>'


def _ranked_table(a: Any, k: int) -> str:
    rows = ["<tr><th>method</th>" + "".join(f"<th>#{r}</th>" for r in range(1, k + 1)) + "</tr>"]
    for m in a.methods:
        cells = "".join(f'<td title="{_e(s.text)}">[{i}] {score_text(v)}</td>' for i, s, v in a.ranked(m)[:k])
        rows.append(f"<tr><td class='method'>{_e(m)}</td>{cells}</tr>")
    return f'<table class="top ranked">{"".join(rows)}</table>'


def _token_rows_table(a: Any) -> str:
    """Per explained answer token (``per_token=True``), each method's top source and its score; hover a cell for
    the source's text."""
    head = "<tr><th>answer token</th>" + "".join(f"<th>{_e(m)}</th>" for m in a.token_rows) + "</tr>"
    rows = [head]
    for row, label in enumerate(_row_labels(a)):
        cells = []
        for m in a.token_rows:
            i, v = _top_source(a, m, row)
            text = a.sources[i].text if i < len(a.sources) else ""
            cells.append(f'<td class="num" title="{_e(text)}">[{i}] {score_text(v, 3)}</td>')
        rows.append(f"<tr><td>{_e(label)}</td>{''.join(cells)}</tr>")
    return ('<p class="meta">top source of each answer token (its own log-probability explained)</p>'
            f'<table class="top ranked token-rows">{"".join(rows)}</table>')


SHOWN_ATTRIBUTIONS = 50  # attributions drawn on one page; the rest are counted


def attribution_html(items: Sequence[Any], methods: Sequence[str] | None = None) -> str:
    """One standalone page: for each attribution, the query, the answer, and per method the context with its
    sources shaded by that method's scores (hover a source for every method's score), and the top sources."""
    body = ["<h1>Which part of the context did the answer come from?</h1>",
            '<p class="meta">Sources shaded by score (green: the answer depends on it; red: against it); '
            'hover a source for every method\'s score. <span class="legend"></span> &minus;1 &hellip; +1, '
            "relative to the method's largest |score| over the sources</p>"]
    for n, a in enumerate(items):
        if n == SHOWN_ATTRIBUTIONS:
            body.append(f'<p class="meta">{len(items) - n} more not shown</p>')
            break
        shown = [m for m in (methods or a.methods) if m in a.scores]
        body.append('<section class="example">')
        body.append(f"<h2>Query: {_e(a.query)}</h2>")
        body.append(f'<div class="answer"><b>Answer:</b> {_e(a.answer)}</div>')
        if a.meta.get("answer_logprob") is not None:
            body.append(f'<p class="meta">log-probability of the explained answer: '
                        f'{float(a.meta["answer_logprob"]):.3f}; model {_e(a.meta.get("model", ""))}</p>')
        body.append(_ranked_table(a, min(3, len(a.sources))))
        if a.token_rows:
            body.append(_token_rows_table(a))
        for j, m in enumerate(shown):
            body.append(f"<details{' open' if j == 0 else ''}><summary>{_e(m)}</summary>")
            body.append(_context_html(a, m))
            share = a.meta.get("outside_share", {}).get(m)
            if share is not None:
                body.append(f'<p class="meta">share of the token scores outside every source: {share:.0%}</p>')
            body.append("</details>")
        body.append("</section>")
    return page("attnlens: context attribution", "\n".join(body)).replace("</style>", EXTRA_STYLE + "</style>", 1)

