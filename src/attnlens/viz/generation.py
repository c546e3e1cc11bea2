"""Step × token views of an explained generation (:class:`attnlens.results.generation.Generation`): terminal, HTML
(hover a generated token to see its step's scores on the text before it) and PNG/SVG.

Each step's row is normalised on its own (by its largest |score| over the scored tokens before the step), with
the same green/red scale as the classifier views; the tokens at and after the step are not part of the step's
input and are drawn blank, as are the tokens no step scores (special tokens, and the sequence an encoder-decoder's
attention stream does not read).
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console, Group
from rich.rule import Rule
from rich.style import Style
from rich.table import Table
from rich.text import Text

from ..errors import InputError
from .colors import hex_color, normalized, prob_text, shade, shown_tokens
from .safetext import html_safe, terminal_safe
from .terminal import ShadedTokens


def _methods(g: Any, methods: Sequence[str] | None) -> list[str]:
    if methods is None:
        return list(g.scores)
    unknown = [m for m in methods if m not in g.scores]
    if unknown:
        raise InputError(f"no scores for {', '.join(unknown)}; this generation has: {', '.join(g.scores)}")
    return list(methods)


def step_rows(g: Any, method: str) -> np.ndarray:
    """``(n_generated, n_tokens)`` rows of ``method`` normalised to [-1, 1], each over the tokens before its step
    (unscored tokens (:attr:`~attnlens.results.generation.Generation.unscored`) and the step's own and later tokens
    0)."""
    special = np.asarray(g.unscored, dtype=bool)
    rows = np.zeros_like(np.asarray(g.scores[method], dtype=np.float64))
    for t in range(rows.shape[0]):
        n = g.n_prompt + t
        rows[t, :n] = normalized(g.scores[method][t, :n], special[:n])
    return rows


def _header(g: Any) -> str:
    what = "forced" if g.forced else "greedy"
    line = f"prompt: {g.prompt!r}  →  {what} continuation: {g.text!r}"
    if g.contrast_ids is not None:
        line += f"  (each step explained against its contrast token; {g.meta.get('target_kind', 'logit')} difference)"
    return line


def _step_label(g: Any, t: int) -> str:
    label = f"{t}: {g.step_labels[t]!r} p={prob_text(g.probabilities[t])}"
    if g.contrast_ids is not None and g.contrast_probabilities is not None:
        # a Generation built with ids alone shows them
        other = repr(g.contrast[t]) if g.contrast is not None else f"#{g.contrast_ids[t]}"
        label += f" vs {other} p={prob_text(g.contrast_probabilities[t])}"
    if t < len(g.predicted_ids) and g.predicted_ids[t] != g.generated_ids[t]:  # forced where the model disagreed
        greedy = repr(g.predicted[t]) if g.predicted is not None else f"#{g.predicted_ids[t]}"
        label += f" (greedy {greedy})"
    return label


# ------------------------------------------------------------------------------------------------ terminal
def generation_renderable(g: Any, methods: Sequence[str] | None = None) -> Group:
    """A rich renderable: per method, one line per generated token showing its step's scores."""
    parts: list[Any] = [Rule(Text(terminal_safe(_header(g), one_line=True), overflow="ellipsis"), align="left")]
    for m in _methods(g, methods):
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(overflow="fold")
        rows = step_rows(g, m)
        shown, unscored = shown_tokens(g), g.unscored
        for t in range(len(g.generated_ids)):
            tail = Text(" → ")
            tail.append(terminal_safe(shown[g.n_prompt + t], one_line=True), style=Style(bold=True, underline=True))
            line = ShadedTokens([(shown[i], None if unscored[i] else float(rows[t, i]), False)
                                 for i in range(g.n_prompt + t)], tail)
            grid.add_row(Text(terminal_safe(_step_label(g, t), one_line=True)), line)
        parts += [Text(m, style="bold magenta"), grid, Text("")]
    return Group(*parts)


def show_generation(g: Any, methods: Sequence[str] | None = None, console: Console | None = None) -> None:
    """Print the step × token view of ``g`` (one block per method)."""
    (console or Console()).print(generation_renderable(g, methods))


def render_generation(g: Any, methods: Sequence[str] | None = None, color: bool = True, width: int = 120) -> str:
    """What :func:`show_generation` prints, as a string (ANSI colour codes included when ``color``)."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, force_terminal=color, color_system="truecolor" if color else None,
                      no_color=not color, highlight=False)
    show_generation(g, methods, console)
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------------ HTML
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #1f2937; padding: 0 1em; }
.tok { display: inline-block; padding: 1px 3px; margin: 1px; border-radius: 3px; }
.special { color: #9ca3af; }
.gen { cursor: pointer; border-bottom: 2px solid #6366f1; }
.gen.on { outline: 2px solid #2563eb; }
.future { color: #d1d5db; }
.meta { color: #4b5563; font-size: .9em; }
table.grid { border-collapse: collapse; font-size: .8em; }
table.grid td, table.grid th { border: 1px solid #e5e7eb; padding: 2px 4px; text-align: center; }
table.grid th.tokcol { writing-mode: vertical-rl; transform: rotate(180deg); font-weight: 400; }
table.grid th.row { text-align: right; font-family: ui-monospace, monospace; white-space: nowrap; }
.scroll { overflow-x: auto; }
"""
# Hovering generated token t colours the text with step t's scores (colours precomputed in Python).
_SCRIPT = """
document.querySelectorAll("section.method").forEach(function (sec) {
  var colors = JSON.parse(sec.dataset.colors), nPrompt = Number(sec.dataset.prompt);
  var toks = sec.querySelectorAll(".view .tok");
  function show(t) {
    toks.forEach(function (el, i) {
      var c = colors[t][i];
      el.style.background = c || "none";
      el.classList.toggle("future", i > nPrompt + t);  // not part of this step's input
      el.classList.toggle("on", i === nPrompt + t);
    });
  }
  sec.querySelectorAll(".view .gen").forEach(function (el) {
    el.addEventListener("mouseenter", function () { show(Number(el.dataset.step)); });
  });
  show(0);
});
"""


def _e(value: object) -> str:
    return html_safe(value)


def _method_section(g: Any, m: str) -> str:
    rows = step_rows(g, m)
    n_steps, n_tokens = rows.shape
    unscored = g.unscored
    colors = [[hex_color(shade(rows[t, i])) if i < g.n_prompt + t and not unscored[i] else None
               for i in range(n_tokens)] for t in range(n_steps)]
    spans = []
    shown = shown_tokens(g)
    for i, tok in enumerate(shown):
        css = "tok special" if g.special[i] else "tok"
        step = i - g.n_prompt
        if step >= 0:
            spans.append(f'<span class="{css} gen" data-step="{step}" title="{_e(_step_label(g, step))}">'
                         f"{html_safe(tok, True)}</span>")
        else:
            spans.append(f'<span class="{css}">{html_safe(tok, True)}</span>')
    head = "".join(f'<th class="tokcol">{html_safe(t, True)}</th>' for t in shown)
    body = []
    for t in range(n_steps):
        cells = []
        for i in range(n_tokens):
            if i < g.n_prompt + t and not unscored[i]:
                cells.append(f'<td style="background:{hex_color(shade(rows[t, i]))}" '
                             f'title="{float(g.scores[m][t, i]):+.4g}"></td>')
            else:
                cells.append('<td style="background:#f3f4f6"></td>')
        body.append(f'<tr><th class="row">{_e(_step_label(g, t))}</th>{"".join(cells)}</tr>')
    return (f'<section class="method" data-prompt="{g.n_prompt}" data-colors="{_e(json.dumps(colors))}">'
            f'<h2>{_e(m)}</h2>'
            f'<p class="view">{" ".join(spans)}</p>'
            f'<details><summary>step × token heatmap</summary><div class="scroll"><table class="grid">'
            f'<tr><th></th>{head}</tr>{"".join(body)}</table></div></details></section>')


def generation_html(gens: Any, methods: Sequence[str] | None = None, title: str | None = None) -> str:
    """A standalone page of one generation or several: per method, the prompt + continuation; hover a generated
    (underlined) token to colour the text before it by that step's scores; below, the step × token heatmap."""
    body = f"<h1>{_e(title or 'attnlens: generation')}</h1>"
    for g in gens if isinstance(gens, (list, tuple)) else [gens]:
        meta = f'model {_e(g.meta.get("model", "?"))} · explained: {_e(g.meta.get("target_kind", "logit"))}'
        body += (f"<hr><p>{_e(_header(g))}</p><p class=meta>{meta} · hover an underlined generated token to see "
                 f"what its step was explained by (green supports it, red opposes it)</p>"
                 + "".join(_method_section(g, m) for m in _methods(g, methods)))
    return (f"<!doctype html><html><head><meta charset=utf-8><title>{_e(title or 'attnlens')}</title>"
            f"<style>{_STYLE}</style></head><body>{body}<script>{_SCRIPT}</script></body></html>")


# ------------------------------------------------------------------------------------------------ PNG / SVG
def plot_generation(g: Any, method: str | None = None, path: str | Path | None = None) -> Any:
    """Step × token heatmap of one method (default: the first) as a matplotlib figure, saved to ``path``."""
    from .plots import SCORE_CMAP, _colorbar, _finish, _tex_safe, _width, mark_nan, plt

    chosen = _methods(g, [method] if method else list(g.scores)[:1])
    if not chosen:
        raise InputError("nothing to plot: the generation has no method scores")
    m = chosen[0]
    rows = step_rows(g, m)
    n_steps, n_tokens = rows.shape
    unscored = g.unscored
    hidden = np.array([[i >= g.n_prompt + t or unscored[i] for i in range(n_tokens)] for t in range(n_steps)])
    fig, ax = plt.subplots(figsize=(_width(n_tokens), 1.4 + 0.35 * n_steps), layout="constrained")
    ax.imshow(np.ma.masked_array(rows, mask=hidden), cmap=SCORE_CMAP.with_extremes(bad="#f3f4f6"), vmin=-1, vmax=1,
              aspect="auto", interpolation="nearest")
    mark_nan(ax, rows, hidden)
    ax.set_xticks(range(n_tokens), labels=[_tex_safe(t) for t in shown_tokens(g)], rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(n_steps), labels=[_tex_safe(_step_label(g, t)) for t in range(n_steps)], fontsize=8)
    ax.axvline(g.n_prompt - 0.5, color="#111827", lw=1)
    ax.set_title(_tex_safe(f"{m}: {g.prompt[:60]!r} → {g.text[:40]!r}"), fontsize=9, loc="left")
    _colorbar(fig, ax, "score / the step's max |score|")
    return _finish(fig, path)
