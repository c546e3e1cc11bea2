"""Coloured token heatmaps in the terminal (rich): a line of shaded tokens per method, then a top-token table.

Positive scores are shaded green, negative red; the shade's intensity is the score's magnitude relative to the
largest one of the same method on the same example (AttCAT Fig. 5); a 16-colour terminal shows it in four steps
of emphasis instead (:class:`ShadedTokens`). Special tokens are dimmed.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
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


# 16-colour terminals have one green and one red: the shade's intensity becomes four steps of emphasis instead
# (none, coloured text, bold coloured text, coloured background), upper bounds of |normalised score|
STEPS = (1 / 8, 3 / 8, 5 / 8)


class ShadedTokens:
    """A line of tokens shaded by their normalised scores, drawn for the console it is printed on: a background
    shade (truecolor and 256-colour terminals), or on 16-colour terminals four steps of emphasis (:data:`STEPS`),
    so that the order of the shades is kept either way. Special tokens are dimmed.

    Args:
        cells: ``(text, normalised score, underline)`` per token; a score of ``None`` marks a special token.
        tail: text printed after the tokens (a generation step's explained token).
    """

    def __init__(self, cells: Sequence[tuple[str, float | None, bool]], tail: Text | None = None) -> None:
        self.cells = list(cells)
        self.tail = tail

    def text(self, color_system: str | None) -> Text:
        """The line as rich text for a console of that colour system (``"standard"``/``"windows"``: 16 colours)."""
        few = color_system in ("standard", "windows")
        line = Text()
        for i, (tok, value, underline) in enumerate(self.cells):
            if i:
                line.append(" ")
            line.append(terminal_safe(tok, one_line=True), style=token_style(value, underline, few))
        if self.tail is not None:
            line.append_text(self.tail)
        return line

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.text(console.color_system)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.text(console.color_system))


def token_style(value: float | None, underline: bool = False, few_colours: bool = False) -> Style:
    """The style of one token: dimmed when special (``value`` ``None``); else black on the shade of ``value``
    (a normalised score), or with ``few_colours`` the emphasis step :data:`STEPS` puts it on (NaN: a grey
    background)."""
    if value is None:
        return Style(dim=True)
    if not few_colours:
        r, g, b = shade(value)
        return Style(color="black", bgcolor=f"rgb({r},{g},{b})", underline=underline)
    if np.isnan(value):
        return Style(color="black", bgcolor="bright_black", underline=underline)
    colour, size = ("green" if value >= 0 else "red"), abs(float(value))
    if size < STEPS[0]:
        return Style(underline=underline)
    if size < STEPS[1]:
        return Style(color=colour, underline=underline)
    if size < STEPS[2]:
        return Style(color=colour, bold=True, underline=underline)
    return Style(color="black", bgcolor=colour, bold=True, underline=underline)


def _token_line(exp: Explained, method: str) -> ShadedTokens:
    norm = normalized(exp.scores[method], exp.special)
    answer = answer_positions(exp)  # QA: the explained span is underlined
    return ShadedTokens([(raw, None if exp.special[i] else float(v), i in answer)
                         for i, (raw, v) in enumerate(zip(shown_tokens(exp), norm, strict=True))])


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
