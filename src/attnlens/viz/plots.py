"""Matplotlib figures (Agg backend): token and layer heatmaps, attention head view, occlusion curves, metric
bar charts and the embedding projection of top tokens. Every ``plot_*`` function returns the figure and, given
``path``, saves it as PNG or SVG (chosen by the file extension).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..errors import InputError  # noqa: E402
from ..evaluation.summary import best_methods, direction  # noqa: E402  (the one tie rule, shared with the tables)
from ..paths import atomic_output  # noqa: E402
from .colors import (  # noqa: E402
    NAN_RGB,
    NEGATIVE_RGB,
    POSITIVE_RGB,
    Explained,
    answer_positions,
    hex_color,
    layer_rows,
    normalized,
    normalized_layer_rows,
    prediction_line,
    prepare,
    select_methods,
    shown_tokens,
    text_of,
    truncation_note,
)
from .safetext import terminal_safe  # noqa: E402

FORMATS = (".png", ".svg")
# Same scale as the terminal and HTML views: red (-1) .. white (0) .. green (+1).
SCORE_CMAP = LinearSegmentedColormap.from_list(
    "attnlens", [tuple(c / 255 for c in NEGATIVE_RGB), (1.0, 1.0, 1.0), tuple(c / 255 for c in POSITIVE_RGB)]
)
_MAX_INCHES = 60.0


def save_figure(fig: Figure, path: str | Path, dpi: int = 150) -> Path:
    """Save ``fig`` as PNG or SVG according to the extension of ``path``; creates missing parent folders."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise InputError(f"cannot save a figure as {path.suffix or 'a file without extension'!r}; use .png or .svg")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format=path.suffix.lower()[1:])
    return path


def _finish(fig: Figure, path: str | Path | None) -> Figure:
    if path is not None:
        try:
            save_figure(fig, path)
        finally:
            plt.close(fig)
    return fig


def _tex_safe(text: object, one_line: bool = True) -> str:
    """Text shown literally: control characters and bidi overrides as visible escapes (as the terminal and HTML
    views show them; an override would draw other text than the tokens explained), newlines too with
    ``one_line``, and ``$`` escaped (matplotlib would read a pair as mathtext)."""
    return terminal_safe(text, one_line=one_line).replace("$", r"\$")


def _width(n_columns: int, per_column: float = 0.42, extra: float = 2.0) -> float:
    return min(max(4.0, per_column * n_columns + extra), _MAX_INCHES)


def _one(exp: Explained | Sequence[Explained], words: bool) -> Explained:
    items = prepare(exp, words)
    if len(items) != 1:
        raise InputError(f"expected one explanation, got {len(items)}")
    return items[0]


def _heatmap(
    ax,
    norm: np.ndarray,
    special: Sequence[bool],
    tokens: Sequence[str],
    row_names: Sequence[str],
    annotate: bool,
) -> None:
    """Draw normalised rows (already in [-1, 1]) as coloured cells; special tokens' columns grey."""
    masked = np.ma.masked_array(norm, mask=np.broadcast_to(np.asarray(special, bool), norm.shape))
    cmap = SCORE_CMAP.with_extremes(bad="#f3f4f6")
    ax.imshow(masked, cmap=cmap, vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
    mark_nan(ax, norm, np.broadcast_to(np.asarray(special, bool), norm.shape))
    ax.set_xticks(range(len(tokens)), labels=[_tex_safe(t) for t in tokens], rotation=60, ha="right", fontsize=9)
    ax.set_yticks(range(len(row_names)), labels=[_tex_safe(r) for r in row_names], fontsize=9)
    for label, sp in zip(ax.get_xticklabels(), special, strict=True):
        if sp:
            label.set_color("#9ca3af")
    ax.tick_params(length=0)
    if annotate:
        for r in range(norm.shape[0]):
            for c in range(norm.shape[1]):
                if not special[c]:
                    ax.text(
                        c,
                        r,
                        f"{norm[r, c]:.2f}",
                        ha="center",
                        va="center",
                        fontsize=6.5,
                        color="white" if abs(norm[r, c]) > 0.6 else "#111827",
                    )


def mark_nan(ax, norm: np.ndarray, hidden: np.ndarray) -> None:
    """Paint the cells whose score is not a number (and not ``hidden``) in their own grey: imshow would draw them
    as the pale grey of special tokens."""
    for r, c in zip(*np.nonzero(np.isnan(norm) & ~hidden), strict=True):
        ax.add_patch(Rectangle((c - 0.5, r - 0.5), 1, 1, facecolor=hex_color(NAN_RGB), edgecolor="none"))


def _colorbar(fig: Figure, ax, label: str) -> None:
    sm = plt.cm.ScalarMappable(cmap=SCORE_CMAP, norm=plt.Normalize(-1, 1))
    fig.colorbar(sm, ax=ax, fraction=0.025, pad=0.02, label=label)


def _chunks(n: int, per_line: int) -> list[tuple[int, int]]:
    if per_line < 1:
        raise InputError(f"per_line must be >= 1, got {per_line}")
    return [(a, min(a + per_line, n)) for a in range(0, n, per_line)] or [(0, 0)]


def _blocks(
    exp: Explained,
    rows: np.ndarray,
    row_names: Sequence[str],
    per_line: int,
    annotate: bool | None,
    row_height: float,
    norm: np.ndarray | None = None,
) -> tuple[Figure, list]:
    """Rows x tokens heatmap, wrapped into blocks of ``per_line`` tokens (long inputs stay readable).

    Each row is normalised over the whole example before it is cut into blocks (unless ``norm`` is given).
    """
    if norm is None:
        norm = np.vstack([normalized(r, exp.special) for r in rows])
    spans = _chunks(len(exp.tokens), per_line)
    width = min(len(exp.tokens), per_line)
    block_height = 1.1 + row_height * len(row_names)  # rows plus the rotated token labels
    fig, axes = plt.subplots(
        len(spans),
        1,
        figsize=(_width(width), block_height * len(spans) + 0.4),
        squeeze=False,
        layout="constrained",  # keeps every block's token labels clear of the next block
    )
    axes = list(axes[:, 0])
    show_numbers = annotate if annotate is not None else width <= 40
    answer = answer_positions(exp)
    shown = shown_tokens(exp)
    for ax, (a, b) in zip(axes, spans, strict=True):
        _heatmap(ax, norm[:, a:b], exp.special[a:b], shown[a:b], row_names, show_numbers)
        ax.set_xlim(-0.5, width - 0.5)  # equal cell widths in every block
        for label, i in zip(ax.get_xticklabels(), range(a, b), strict=True):
            if i in answer:  # QA: the explained answer span in bold blue
                label.set_color("#2563eb")
                label.set_fontweight("bold")
    _colorbar(fig, axes, "normalised score")
    return fig, axes


def plot_token_heatmap(
    exp: Explained,
    methods: Sequence[str] | None = None,
    path: str | Path | None = None,
    words: bool = False,
    title: str | None = None,
    annotate: bool | None = None,
    per_line: int = 40,
) -> Figure:
    """Token heatmap of one explanation, one row per method (stacked for comparison, AttCAT Fig. 5b).

    Each row is normalised by its largest |score| over non-special tokens; special tokens are grey. Inputs
    longer than ``per_line`` tokens wrap into several blocks; ``annotate`` writes the values in the cells
    (default: when a block is at most 40 tokens wide).
    """
    exp = _one(exp, words)
    chosen = select_methods(exp, methods)
    if not chosen:
        raise InputError("nothing to plot: the explanation has no method scores")
    rows = np.vstack([np.asarray(exp.scores[m], dtype=np.float64) for m in chosen])
    fig, axes = _blocks(exp, rows, chosen, per_line, annotate, 0.45)
    axes[0].set_title(_tex_safe(title or _short_title(exp), one_line=False), fontsize=10, loc="left")
    return _finish(fig, path)


def plot_layer_heatmap(
    exp: Explained,
    method: str,
    path: str | Path | None = None,
    words: bool = False,
    title: str | None = None,
    annotate: bool | None = None,
    per_line: int = 40,
) -> Figure:
    """Layer x token heatmap of a layered method (AttCAT Fig. 4): rows L0..L(n-1), then ``sum`` and ``rollout``
    where the layers add up to the method's scores (CAT, AttCAT).

    Each row is normalised by its own largest magnitude, with a noise floor (rows of numerical noise stay
    blank, :func:`~attnlens.viz.colors.normalized_layer_rows`); the right-hand labels give that magnitude.
    """
    exp = _one(exp, words)
    if method not in exp.layers:
        raise InputError(f"method {method!r} has no per-layer scores here; layered: {', '.join(exp.layers) or 'none'}")
    n_layers = len(exp.layers[method])
    names, rows = layer_rows(exp.layers[method], exp.scores.get(method))
    if rows.shape[1] != len(exp.tokens):
        raise InputError(f"{method}: layer scores have {rows.shape[1]} tokens, the explanation {len(exp.tokens)}")
    fig, axes = _blocks(exp, rows, names, per_line, annotate, 0.32,
                        normalized_layer_rows(rows, exp.special, n_layers))
    peaks = [float(np.abs(np.where(exp.special, 0.0, np.nan_to_num(r))).max()) for r in rows]
    for ax in axes:
        if len(names) > n_layers:
            ax.axhline(n_layers - 0.5, color="#111827", lw=1.2)
        twin = ax.secondary_yaxis("right")
        twin.set_yticks(range(len(names)), labels=[f"{p:.2g}" for p in peaks], fontsize=7)
        twin.tick_params(length=0)
        twin.set_ylabel("max |score| of the row", fontsize=8)
    axes[0].set_title(_tex_safe(title or f"{method} per layer  |  {_short_title(exp)}", one_line=False), fontsize=10,
                      loc="left")
    return _finish(fig, path)


def plot_attention_head(
    tokens: Sequence[str],
    attentions: np.ndarray,
    layer: int,
    head: int | None,
    path: str | Path | None = None,
    special: Sequence[bool] | None = None,
    title: str | None = None,
) -> Figure:
    """Attention matrix of one layer and head over the tokens (rows attend to columns).

    Args:
        tokens: the N tokens.
        attentions: array of shape (L, H, N, N), e.g. from ``Explainer.attention_maps(text)``.
        layer: layer index (negative counts from the end).
        head: head index (negative counts from the end), or ``None`` for the mean over heads.
        special: optional flags; special tokens' labels are drawn grey.
    """
    att = np.asarray(attentions, dtype=np.float64)
    if att.ndim != 4 or att.shape[2] != att.shape[3]:
        raise InputError(f"attentions must have shape (layers, heads, tokens, tokens), got {att.shape}")
    n_layers, n_heads, n, _ = att.shape
    if len(tokens) != n:
        raise InputError(f"{len(tokens)} tokens but attention over {n} positions")
    if not -n_layers <= layer < n_layers:
        raise InputError(f"layer {layer} out of range: the model has {n_layers} layers")
    if head is not None and not -n_heads <= head < n_heads:
        raise InputError(f"head {head} out of range: the model has {n_heads} heads")
    matrix = att[layer].mean(0) if head is None else att[layer, head]
    size = min(max(4.0, 0.32 * n + 2.0), 30.0)
    fig, ax = plt.subplots(figsize=(size + 1.0, size))
    im = ax.imshow(matrix, cmap="Blues", vmin=0.0, vmax=max(float(matrix.max()), 1e-12), interpolation="nearest")
    ax.set_xticks(range(n), labels=[_tex_safe(t) for t in tokens], rotation=90, fontsize=8)
    ax.set_yticks(range(n), labels=[_tex_safe(t) for t in tokens], fontsize=8)
    if special is not None:
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            for label, sp in zip(labels, special, strict=True):
                if sp:
                    label.set_color("#9ca3af")
    ax.set_xlabel("attended token (key)")
    ax.set_ylabel("attending token (query)")
    fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02, label="attention weight")
    which = "mean over heads" if head is None else f"head {head % n_heads}"
    ax.set_title(title or f"layer {layer % n_layers}, {which}", fontsize=10)
    return _finish(fig, path)


# ----------------------------------------------------------------- benchmark results (summary.json)
def _summary_title(summary: Mapping[str, Any]) -> str:
    bits = [str(summary[k]) for k in ("model", "dataset", "split") if summary.get(k)]
    if summary.get("n_examples"):
        bits.append(f"n={summary['n_examples']}")
    return " · ".join(bits)


def _series_style(name: str) -> dict[str, Any]:
    if name == "random":
        return {"color": "#6b7280", "linestyle": "--", "marker": None}
    return {"linestyle": ":" if name.endswith(":bottom") else "-", "marker": "o", "markersize": 3}


def plot_occlusion_curves(
    summary: Mapping[str, Any],
    path: str | Path | None = None,
    relative: bool = True,
    series: Sequence[str] | None = None,
    title: str | None = None,
) -> Figure:
    """Accuracy after dropping k tokens by strategy (Karpekov & Miller 2023, Charts 1-4): random, ``<method>:top`` and
    ``<method>:bottom`` series from ``summary["curves"]["occlusion"]``.

    Args:
        relative: plot accuracy relative to k = 0 (Charts 2-4) instead of absolute accuracy (Chart 1).
        series: which series to draw (default all).
    """
    occ = (summary.get("curves") or {}).get("occlusion")
    if not occ or not occ.get("series"):
        raise InputError("the summary has no occlusion curves (curves.occlusion)")
    ks = list(occ["k"])
    names = list(series) if series is not None else list(occ["series"])
    unknown = [s for s in names if s not in occ["series"]]
    if unknown:
        raise InputError(f"unknown occlusion series {', '.join(unknown)}; have: {', '.join(occ['series'])}")
    key = "relative" if relative else "accuracy"
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = _method_colors([n.split(":")[0] for n in names if n != "random"])
    for name in names:
        ys = [np.nan if v is None else v for v in occ["series"][name][key]]
        if len(ys) != len(ks):
            raise InputError(f"occlusion series {name!r} has {len(ys)} values for {len(ks)} k's")
        style = _series_style(name)
        if name != "random":
            style["color"] = colors[name.split(":")[0]]
        ax.plot(ks, ys, label=name, **style)
    ax.set_xlabel("tokens dropped (k)")
    ax.set_ylabel("accuracy relative to k = 0" if relative else "accuracy")
    ax.grid(alpha=0.3)
    # outside the axes: with many methods the curves fill the whole plot
    ax.legend(fontsize=8, ncol=2 if len(names) > 16 else 1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title or f"Occlusion curves  |  {_summary_title(summary)}", fontsize=10)
    return _finish(fig, path)


def plot_aopc_curves(summary: Mapping[str, Any], path: str | Path | None = None, title: str | None = None) -> Figure:
    """Mean probability drop p(ŷ|x) − p(ŷ|x̃_k) against the fraction of top tokens deleted, per method
    (the curves whose mean is AOPC), from ``summary["curves"]["aopc"]``."""
    curves = (summary.get("curves") or {}).get("aopc")
    if not curves:
        raise InputError("the summary has no AOPC curves (curves.aopc)")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = _method_colors(list(curves))
    for method, c in curves.items():
        ys = [np.nan if v is None else v for v in c["drop"]]
        ax.plot(c["fractions"], ys, marker="o", markersize=3, label=method, color=colors[method])
    ax.set_xlabel("fraction of top tokens deleted")
    ax.set_ylabel("mean drop of p(ŷ|x)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2 if len(curves) > 6 else 1)
    ax.set_title(title or f"AOPC curves  |  {_summary_title(summary)}", fontsize=10)
    return _finish(fig, path)


def plot_sanity(summary: Mapping[str, Any], path: str | Path | None = None, title: str | None = None,
                absolute: bool = False) -> Figure:
    """Spearman ρ between each method's scores on the trained model and on the model randomised from the head
    down to each depth (Adebayo et al. 2018, Fig. 2), from ``summary["sanity"]``; ``absolute``: ρ of |scores|."""
    sanity = summary.get("sanity") or {}
    if not sanity.get("methods"):
        raise InputError("the summary has no sanity results (run the benchmark with --metrics sanity)")
    key = "spearman_abs" if absolute else "spearman"
    depths = ["none", *sanity["depths"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    colors = _method_colors(list(sanity["methods"]))
    for i, (method, c) in enumerate(sanity["methods"].items()):
        ys = [1.0, *(np.nan if v is None else v for v in c[key])]
        # beyond the palette's 20 colours, a line style tells methods of one colour apart
        ax.plot(range(len(depths)), ys, marker="o", markersize=3, label=method, color=colors[method],
                linestyle=("-", "--", ":")[(i // 20) % 3])
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(depths)), depths, rotation=30, ha="right", fontsize=8)
    ax.set_xlabel("randomised down to (cascading, from the head)")
    ax.set_ylabel("Spearman ρ with the trained model's scores" + (" (|scores|)" if absolute else ""))
    ax.set_ylim(-1.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(colors) > 6 else 1)
    ax.set_title(title or f"model randomisation  |  {_summary_title(summary)}", fontsize=10)
    return _finish(fig, path)


def _method_colors(methods: Sequence[str]) -> dict[str, Any]:
    unique = list(dict.fromkeys(methods))
    cmap = plt.get_cmap("tab10" if len(unique) <= 10 else "tab20")
    return {m: cmap(i % cmap.N) for i, m in enumerate(unique)}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def plot_metric_bars(
    summary: Mapping[str, Any],
    metrics: Sequence[str] | None = None,
    path: str | Path | None = None,
    title: str | None = None,
) -> Figure:
    """One bar chart per metric (AOPC, LOdds, ...), one bar per method; the best bar is outlined and missing
    values (e.g. Kendall-τ of class-agnostic methods) are marked n/a."""
    results = summary.get("results") or {}
    methods = list(summary.get("methods") or results)
    if not methods:
        raise InputError("the summary has no results")
    all_metrics = list(summary.get("metrics") or {})
    if not all_metrics:
        all_metrics = sorted({k for r in results.values() for k in r})
    chosen = list(metrics) if metrics is not None else all_metrics
    unknown = [m for m in chosen if m not in all_metrics]
    if unknown:
        raise InputError(f"unknown metric {', '.join(unknown)}; the summary has: {', '.join(all_metrics)}")
    if not chosen:
        raise InputError("the summary has no metrics")
    ncols = min(3, len(chosen))
    nrows = math.ceil(len(chosen) / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(4.4 * ncols, nrows * (0.3 * len(methods) + 1.6) + 0.4), squeeze=False
    )
    for ax in axes.flat[len(chosen) :]:
        ax.set_visible(False)
    colors = _method_colors(methods)
    for ax, metric in zip(axes.flat, chosen):
        info = (summary.get("metrics") or {}).get(metric, {})
        values = [results.get(m, {}).get(metric) for m in methods]
        best = set(best_methods(summary, metric))
        y = np.arange(len(methods))
        heights = [v if _is_number(v) else 0.0 for v in values]
        bars = ax.barh(y, heights, color=[colors[m] for m in methods])
        for bar, m, v in zip(bars, methods, values, strict=True):
            if not _is_number(v):
                ax.text(0, bar.get_y() + bar.get_height() / 2, " n/a", va="center", fontsize=8, color="#6b7280")
            else:
                ax.text(
                    v,
                    bar.get_y() + bar.get_height() / 2,
                    f" {v:.3g} ",
                    va="center",
                    fontsize=7,
                    ha="left" if v >= 0 else "right",
                )
            if m in best:
                bar.set_edgecolor("black")
                bar.set_linewidth(1.8)
        ax.set_yticks(y, labels=[f"{m} ★" if m in best else m for m in methods], fontsize=8)
        ax.invert_yaxis()
        ax.axvline(0, color="#111827", lw=0.8)
        arrow = f"{direction(info)} is better"
        ax.set_title(f"{metric} ({arrow})", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.margins(x=0.25)
        ax.xaxis.set_major_locator(MaxNLocator(5))
    fig.suptitle(title or _summary_title(summary), fontsize=10)
    fig.tight_layout()
    return _finish(fig, path)


def plot_embedding(
    consistency: Mapping[str, Any],
    method: str,
    path: str | Path | None = None,
    label_names: Sequence[str] | None = None,
    annotate: int = 30,
    title: str | None = None,
) -> Figure:
    """2-D projection of the top tokens' last-layer hidden states, coloured by the example's class, with the
    silhouette score in the title (Karpekov & Miller 2023, Charts 5-6).

    Args:
        consistency: ``summary["consistency"]``: method -> {"silhouette", "points", "labels", "tokens"}.
        label_names: class names for the legend (default the labels themselves).
        annotate: write the token next to this many points (spread over the cloud); 0 for none.
    """
    if method not in consistency:
        raise InputError(f"no consistency result for {method!r}; have: {', '.join(consistency) or 'none'}")
    c = consistency[method]
    points = np.asarray(c.get("points") or [], dtype=np.float64).reshape(-1, 2)
    labels = list(c.get("labels") or [])
    tokens = list(c.get("tokens") or [])
    if len(labels) != len(points) or (tokens and len(tokens) != len(points)):
        raise InputError(f"{method}: points, labels and tokens differ in length")
    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    classes = list(dict.fromkeys(labels))
    palette = {0: tuple(v / 255 for v in NEGATIVE_RGB), 1: tuple(v / 255 for v in POSITIVE_RGB)}
    other = plt.get_cmap("tab10")
    for j, cls in enumerate(sorted(classes, key=str)):
        idx = [i for i, lab in enumerate(labels) if lab == cls]
        known = label_names is not None and isinstance(cls, int) and 0 <= cls < len(label_names)
        name = label_names[cls] if known else str(cls)
        color = palette.get(cls, other(j)) if len(classes) <= 2 else other(j)
        ax.scatter(points[idx, 0], points[idx, 1], s=14, alpha=0.7, color=color, label=name)
    if tokens and annotate > 0 and len(points):
        step = max(1, len(points) // annotate)
        for i in range(0, len(points), step):
            ax.annotate(tokens[i], points[i], fontsize=7, alpha=0.8, xytext=(2, 2), textcoords="offset points")
    if classes:
        ax.legend(fontsize=8, title="class", title_fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    sil = c.get("silhouette")
    score = f"{sil:.3f}" if _is_number(sil) else "n/a"
    ax.set_title(title or f"Token embedding using {method}  |  Silhouette score: {score}", fontsize=10)
    return _finish(fig, path)


def _short_title(exp: Explained) -> str:
    text = text_of(exp)
    text = terminal_safe(text, one_line=True)
    text = text if len(text) <= 90 else text[:87] + "..."
    note = truncation_note(exp)  # the title's text is the input's; say when the explanation covers less of it
    return f"{text}\n{terminal_safe(prediction_line(exp), one_line=True)}" + (
        f"\n{terminal_safe(note, one_line=True)}" if note else "")
