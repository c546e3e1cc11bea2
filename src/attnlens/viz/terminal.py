"""Coloured token heatmaps in the terminal (rich): a line of shaded tokens per method, then a top-token table.

Positive scores are shaded green, negative red; the shade's intensity is the score's magnitude relative to the
largest one of the same method on the same example (AttCAT Fig. 5). Special tokens are dimmed.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich.console import Console, Group
from rich.rule import Rule
from rich.style import Style
from rich.table import Table
from rich.text import Text

from .colors import (
    Explained,
    answer_positions,
    explained_text,
    normalized,
    prediction_line,
    prepare,
    probabilities_line,
    select_methods,
    shade,
    shown_tokens,
    top_split,
    truncation_note,
)
from .safetext import terminal_safe

TOP_K = 5


def _safe(text: object) -> Text:
    """Plain rich text (no markup parsed), control characters escaped: input text must not drive the terminal."""
    return Text(terminal_safe(text, one_line=True))


def _token_line(exp: Explained, method: str) -> Text:
    norm = normalized(exp.scores[method], exp.special)
    answer = answer_positions(exp)  # QA: the explained span is underlined
    line = Text()
    for i, (raw, v) in enumerate(zip(shown_tokens(exp), norm, strict=True)):
        tok = terminal_safe(raw, one_line=True)
        if i:
            line.append(" ")
        if exp.special[i]:
            line.append(tok, style=Style(dim=True))
        else:
            r, g, b = shade(v)
            line.append(tok, style=Style(color="black", bgcolor=f"rgb({r},{g},{b})", underline=i in answer))
    return line


def _top_cell(pairs: list[tuple[str, float]]) -> Text:
    return _safe(" · ".join(f"{tok} {score:+.3g}" for tok, score in pairs) or "-")


def _top_table(exp: Explained, methods: list[str], k: int) -> Table:
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("method", style="bold")
    table.add_column(f"top {k} for", overflow="fold")
    table.add_column(f"top {k} against", overflow="fold")
    for m in methods:
        pos, neg = top_split(exp, m, k)
        table.add_row(_safe(m), _top_cell(pos), _top_cell(neg))
    return table


def explanation_renderable(exp: Explained, methods: Sequence[str] | None = None, k: int = TOP_K) -> Group:
    """A rich renderable of one explanation: header, one shaded token line per method, top-token table."""
    chosen = select_methods(exp, methods)
    header = Text(terminal_safe(explained_text(exp)[0], one_line=True), overflow="ellipsis")
    parts: list = [Rule(header, align="left"), _safe(prediction_line(exp))]
    if exp.is_multi_label:  # the labels' probabilities are independent: show them all
        parts.append(_safe(probabilities_line(exp)))
    note = truncation_note(exp)
    if note:
        parts.append(Text(note, style="bold yellow"))
    lines = Table.grid(padding=(0, 2))
    lines.add_column(style="bold", no_wrap=True)
    lines.add_column(overflow="fold")
    for m in chosen:
        lines.add_row(_safe(m), _token_line(exp, m))
    parts.append(lines)
    if chosen:
        parts.append(Text(""))
        parts.append(_top_table(exp, chosen, k))
    return Group(*parts)


def print_explanations(
    exps: Explained | Sequence[Explained],
    methods: Sequence[str] | None = None,
    words: bool = False,
    console: Console | None = None,
    k: int = TOP_K,
) -> None:
    """Print explanations as coloured token heatmaps plus a per-method table of the top tokens.

    Args:
        exps: one explanation or several.
        methods: methods to show, in this order; default all methods of each explanation.
        words: aggregate subword scores to words first (sum, :meth:`Explanation.to_words`).
        console: the rich console to print on (default: a new one on stdout).
        k: how many tokens the top-token table lists for and against the explained class.
    """
    console = console or Console()
    for exp in prepare(exps, words):
        console.print(explanation_renderable(exp, methods, k))
        console.print()


def render_terminal(
    exps: Explained | Sequence[Explained],
    methods: Sequence[str] | None = None,
    words: bool = False,
    color: bool = True,
    width: int = 120,
    k: int = TOP_K,
) -> str:
    """What :func:`print_explanations` prints, as a string (ANSI colour codes included when ``color``)."""
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=width,
        force_terminal=color,
        color_system="truecolor" if color else None,
        no_color=not color,
        highlight=False,
    )
    print_explanations(exps, methods=methods, words=words, console=console, k=k)
    return buffer.getvalue()
