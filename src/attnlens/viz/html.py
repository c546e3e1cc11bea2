"""Self-contained HTML pages of explanations: methods stacked per example (AttCAT Fig. 5b) and layer x token
heatmaps of layered methods (AttCAT Fig. 4). No scripts, no external files; every piece of text is escaped.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .colors import (
    NAN_RGB,
    Explained,
    answer_positions,
    explained_text,
    hex_color,
    layer_rows,
    normalized,
    normalized_layer_rows,
    prediction_line,
    prepare,
    probabilities_line,
    select_methods,
    shade,
    shown_tokens,
    top_split,
    truncation_note,
)
from .safetext import html_safe

TOP_K = 5

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1100px;
       color: #1f2937; line-height: 1.4; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.1em; margin-top: 2.2em; }
h3 { font-size: 1em; margin: 1.2em 0 .4em; }
.example { border-top: 1px solid #d1d5db; padding-top: .5em; }
.meta { color: #4b5563; font-size: .9em; }
table.stack { border-collapse: collapse; margin: .5em 0; }
table.stack td { padding: 4px 6px; vertical-align: top; }
td.method { font-weight: 600; white-space: nowrap; font-family: ui-monospace, monospace; font-size: .9em; }
.tok { display: inline-block; padding: 1px 3px; margin: 1px 1px; border-radius: 3px; color: #111827; }
.special { color: #9ca3af; background: none; }
.tok.answer { outline: 2px solid #2563eb; }
table.grid { border-collapse: collapse; font-size: .8em; margin: .5em 0; }
table.grid th, table.grid td { border: 1px solid #e5e7eb; padding: 2px 4px; text-align: center; }
table.grid th.row { text-align: right; font-family: ui-monospace, monospace; }
table.grid th.tokcol { writing-mode: vertical-rl; transform: rotate(180deg); font-weight: 400; }
table.top { border-collapse: collapse; font-size: .9em; }
table.top th, table.top td { border-bottom: 1px solid #e5e7eb; padding: 3px 8px; text-align: left; }
.legend { display: inline-block; width: 160px; height: .8em; vertical-align: middle;
          background: linear-gradient(to right, rgb(220,38,38), #fff, rgb(22,163,74));
          border: 1px solid #d1d5db; }
.scroll { overflow-x: auto; }
details { margin: .6em 0; } summary { font-weight: 600; cursor: pointer; }
table.grid tr.sum > * { border-top: 2px solid #111827; }
.truncated { color: #92400e; background: #fef3c7; padding: .3em .6em; border-radius: 4px; }
.cut { color: #6b7280; }
"""


def _e(value: object) -> str:
    return html_safe(value)


def _token_spans(exp: Explained, scores: np.ndarray) -> str:
    norm = normalized(scores, exp.special)
    answer = answer_positions(exp)  # QA: the explained span is outlined
    spans = []
    for i, tok in enumerate(shown_tokens(exp)):
        if exp.special[i]:
            spans.append(f'<span class="tok special" title="special token">{html_safe(tok, True)}</span>')
        else:
            color = hex_color(shade(norm[i]))
            marked = " (explained token)" if exp.meta.get("task") == "token" else " (answer)"
            tip = f"{float(scores[i]):+.4g}" + (marked if i in answer else "")
            css = "tok answer" if i in answer else "tok"
            spans.append(f'<span class="{css}" style="background:{color}" title="{tip}">{html_safe(tok, True)}</span>')
    return " ".join(spans)


def _stack(exp: Explained, methods: list[str]) -> str:
    rows = [
        f'<tr><td class="method">{_e(m)}</td><td>{_token_spans(exp, np.asarray(exp.scores[m]))}</td></tr>'
        for m in methods
    ]
    return '<table class="stack">' + "".join(rows) + "</table>"


def _top_table(exp: Explained, methods: list[str], k: int) -> str:
    head = f"<tr><th>method</th><th>top {k} for</th><th>top {k} against</th></tr>"
    body = []
    for m in methods:
        pos, neg = top_split(exp, m, k)
        cell = lambda pairs: html_safe(" · ".join(f"{t} {s:+.3g}" for t, s in pairs) or "-", True)  # noqa: E731
        body.append(f"<tr><td>{_e(m)}</td><td>{cell(pos)}</td><td>{cell(neg)}</td></tr>")
    return '<table class="top">' + head + "".join(body) + "</table>"


def _non_finite_note(items: list[Explained], methods: Sequence[str] | None) -> str:
    """The legend's word on scores that are not finite, where some shown score is not: infinite ones are drawn
    at full intensity, relative to the largest finite one; NaN in grey."""
    values = [np.asarray(e.scores[m], dtype=np.float64) for e in items for m in select_methods(e, methods)]
    notes = []
    if any(np.isinf(v).any() for v in values):
        notes.append("&plusmn;inf at full intensity (the others relative to the largest finite score)")
    if any(np.isnan(v).any() for v in values):
        notes.append(f'<span class="tok" style="background:{hex_color(NAN_RGB)}">grey</span>: not a number (unranked)')
    return "; " + "; ".join(notes) if notes else ""


def _grid_value(v: float) -> str:
    return "nan" if np.isnan(v) else f"{v:+.2f}"


def layer_heatmap_html(exp: Explained, method: str) -> str:
    """An HTML table: one row per layer plus, where the layers add up to the score, ``sum`` and ``rollout``; one
    column per token (AttCAT Fig. 4).

    Each row is normalised by its own largest magnitude over non-special tokens; the last column gives that
    magnitude, so a row that is tiny in absolute terms (rollout, typically) is still visible as such. Rows of
    numerical noise stay blank (:func:`~attnlens.viz.colors.normalized_layer_rows`).
    """
    names, rows = layer_rows(exp.layers[method], exp.scores.get(method))
    if rows.shape[1] != len(exp.tokens):
        raise ValueError(f"{method}: layer scores have {rows.shape[1]} tokens, the explanation {len(exp.tokens)}")
    norms = normalized_layer_rows(rows, exp.special, len(exp.layers[method]))
    head = "<tr><th></th>" + "".join(f'<th class="tokcol">{html_safe(t, True)}</th>' for t in shown_tokens(exp))
    head += "<th>max |s|</th></tr>"
    body = []
    for name, row, norm in zip(names, rows, norms, strict=True):
        peak = float(np.abs(np.where(exp.special, 0.0, np.nan_to_num(row))).max())
        cells = []
        for i, v in enumerate(row):
            if exp.special[i]:
                cells.append('<td class="special"></td>')
            else:
                color = hex_color(shade(norm[i]))
                cells.append(f'<td style="background:{color}" title="{float(v):+.4g}">{_grid_value(norm[i])}</td>')
        css = ' class="sum"' if name == "sum" else ""
        body.append(f'<tr{css}><th class="row">{_e(name)}</th>{"".join(cells)}<td>{peak:.3g}</td></tr>')
    return '<div class="scroll"><table class="grid">' + head + "".join(body) + "</table></div>"


def _text_block(exp: Explained) -> list[str]:
    """The explained text; after truncation, a notice of how many tokens were cut and the cut text, folded."""
    kept, cut = explained_text(exp)
    parts = [f'<p class="text">{_e(kept)}</p>']
    note = truncation_note(exp)
    if note:
        parts.append(f'<p class="truncated"><strong>{_e(note)}.</strong></p>')
        if cut:
            parts.append(f'<details><summary>text not explained</summary><p class="cut">{_e(cut)}</p></details>')
    return parts


def _example(exp: Explained, index: int, methods: Sequence[str] | None, k: int) -> str:
    chosen = select_methods(exp, methods)
    parts = [f'<section class="example"><h2>Example {index + 1}</h2>']
    if exp.is_qa and isinstance(exp.text, list) and len(exp.text) == 2:
        parts.append(f'<p class="text"><b>question</b>: {_e(exp.text[0])}</p>')
        parts.append(f'<p class="text"><b>context</b>: {_e(exp.text[1])}</p>')
        note = truncation_note(exp)
        if note:
            parts.append(f'<p class="truncated"><strong>{_e(note)}.</strong></p>')
    else:
        parts.extend(_text_block(exp))
    probs = probabilities_line(exp)
    meta = _e(prediction_line(exp)) + (f" &middot; {_e(probs)}" if probs else "")
    parts.append(f'<p class="meta">{meta}</p>')
    parts.append('<div class="scroll">' + _stack(exp, chosen) + "</div>")
    if chosen:
        parts.append(_top_table(exp, chosen, k))
    layered = [m for m in chosen if m in exp.layers and np.asarray(exp.layers[m]).ndim == 2]
    for j, m in enumerate(layered):
        # collapsible (no script needed); the first one open
        parts.append(f"<details{' open' if j == 0 else ''}><summary>{_e(m)}: scores per layer</summary>")
        parts.append(layer_heatmap_html(exp, m))
        parts.append("</details>")
    parts.append("</section>")
    return "\n".join(parts)


def page(title: str, body: str) -> str:
    """Wrap an HTML body fragment into a complete page with the shared style sheet."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def explanations_html(
    exps: Explained | Sequence[Explained],
    methods: Sequence[str] | None = None,
    title: str | None = None,
    words: bool = False,
    k: int = TOP_K,
) -> str:
    """A self-contained HTML page: for every explanation, all methods' token heatmaps stacked for comparison,
    a top-token table, and a layer x token heatmap for each layered method.

    Args:
        exps: one explanation or several.
        methods: methods to show, in this order; default all methods of each explanation.
        title: page title (escaped); default "attnlens explanations".
        words: aggregate subword scores to words first (sum).
        k: how many tokens the top-token table lists for and against the explained class.
    """
    items = prepare(exps, words)
    title = title or "attnlens explanations"
    explained = "explained answer span (outlined)" if any(e.is_qa or e.is_answer for e in items) else (
        "explained label of the outlined token" if any(e.meta.get("task") == "token" for e in items)
        else "explained class")
    unusual = _non_finite_note(items, methods)
    intro = (
        f'<h1>{_e(title)}</h1>\n<p class="meta">Green supports the {explained}, red opposes it; shade = '
        "|score| relative to the largest of the same method on the same example. "
        f'Hover a token for its score. <span class="legend"></span> &minus;1 &hellip; +1{unusual}</p>'
    )
    sections = [_example(e, i, methods, k) for i, e in enumerate(items)]
    return page(title, intro + "\n" + "\n".join(sections))
