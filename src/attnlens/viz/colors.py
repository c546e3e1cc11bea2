"""Shared helpers of the renderers: method selection, score normalisation and the green/red colour scale.

The colour scale follows AttCAT Fig. 5: green supports the explained class, red opposes it, and the shade's
intensity is ``|score|`` divided by the largest ``|score|`` of the same method on the same example (special
tokens excluded, since they are never ranked).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import InputError
from ..explanation import Explanation

POSITIVE_RGB = (22, 163, 74)  # green
NEGATIVE_RGB = (220, 38, 38)  # red
NEUTRAL_RGB = (255, 255, 255)


def select_methods(exp: Explanation, methods: Sequence[str] | None) -> list[str]:
    """The methods to render: all of the explanation's methods by default, else those asked for, in order."""
    if methods is None:
        return list(exp.scores)
    if isinstance(methods, str):
        methods = [methods]
    missing = [m for m in methods if m not in exp.scores]
    if missing:
        raise InputError(
            f"this explanation has no scores for {', '.join(map(repr, missing))}; "
            f"it has: {', '.join(exp.scores) or 'none'}"
        )
    return list(methods)


def prepare(exps: Explanation | Sequence[Explanation], words: bool) -> list[Explanation]:
    """A list of explanations, aggregated to words when asked."""
    if isinstance(exps, Explanation):
        exps = [exps]
    exps = list(exps)
    if not all(isinstance(e, Explanation) for e in exps):
        raise InputError("expected Explanation objects")
    return [e.to_words() for e in exps] if words else exps


def normalized(scores: np.ndarray, special: Sequence[bool] | None = None) -> np.ndarray:
    """Scores divided by their largest magnitude over non-special tokens, so values lie in [-1, 1].

    Special tokens get 0 (they are drawn dimmed, not coloured); NaN counts as 0; an all-zero row stays zero.
    """
    s = np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if special is not None:
        s = np.where(np.asarray(special, dtype=bool), 0.0, s)
    peak = np.abs(s).max() if s.size else 0.0
    return s / peak if peak > 0 else np.zeros_like(s)


def layer_rows(layers: np.ndarray) -> tuple[list[str], np.ndarray]:
    """Rows of the layer x token heatmap (AttCAT Fig. 4): one per layer, then ``sum`` and ``rollout``.

    ``sum`` adds the layers' scores (AttCAT Eq. 12); ``rollout`` multiplies them element-wise, the rollout
    operation the AttCAT authors compare against.
    """
    arr = np.asarray(layers, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise InputError(f"layer scores must have shape (n_layers, n_tokens), got {arr.shape}")
    names = [f"L{i}" for i in range(arr.shape[0])] + ["sum", "rollout"]
    rows = np.vstack([arr, arr.sum(0, keepdims=True), arr.prod(0, keepdims=True)])
    return names, rows


def shade(value: float) -> tuple[int, int, int]:
    """RGB colour of a normalised score in [-1, 1]: white at 0, full green at +1, full red at -1."""
    v = float(np.clip(np.nan_to_num(value), -1.0, 1.0))
    target = POSITIVE_RGB if v >= 0 else NEGATIVE_RGB
    t = abs(v)
    return tuple(round(n + (c - n) * t) for n, c in zip(NEUTRAL_RGB, target, strict=True))  # type: ignore[return-value]


def hex_color(rgb: tuple[int, int, int]) -> str:
    """``#rrggbb`` form of an RGB triple."""
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def text_of(exp: Explanation) -> str:
    """The explained text as one string (sentence pairs joined with `` [SEP] ``; QA: ``question: … context: …``)."""
    if exp.is_qa and isinstance(exp.text, list) and len(exp.text) == 2:
        return f"question: {exp.text[0]}  context: {exp.text[1]}"
    return " [SEP] ".join(exp.text) if isinstance(exp.text, list) else str(exp.text)


def answer_positions(exp: Explanation) -> set[int]:
    """QA: the token positions of the explained answer span (empty for classifiers)."""
    if not exp.is_qa:
        return set()
    start, end = exp.target  # type: ignore[misc]
    return set(range(int(start), int(end) + 1))


def _span(exp: Explanation, span: object) -> str:
    start, end = span  # type: ignore[misc]
    unit = "word" if exp.meta.get("granularity") == "word" else "token"
    where = f"{unit} {start}" if start == end else f"{unit}s {start}-{end}"
    return f'"{exp.span_text(span)}" ({where})'  # type: ignore[arg-type]


def prediction_line(exp: Explanation) -> str:
    """One-line summary of the prediction and of what is explained, e.g. ``predicted positive (0.930),
    explaining positive``; QA: the explained answer span as text with its start and end probabilities;
    multi-label: the labels with p > 0.5 (independent sigmoid probabilities) and the explained label."""
    probs = exp.probabilities
    if exp.is_qa:
        p_start, p_end = (list(probs) + [float("nan")] * 2)[:2]
        line = f"answer: {_span(exp, exp.target)}, p(start) {p_start:.3f}, p(end) {p_end:.3f}"
        if list(exp.predicted) == list(exp.target):  # type: ignore[arg-type]
            return line + " (the predicted answer)"
        return line + f"; predicted answer: {_span(exp, exp.predicted)}"

    def p(i: int) -> float:
        return probs[i] if 0 <= i < len(probs) else float("nan")

    target = int(exp.target)  # type: ignore[arg-type]
    if exp.is_multi_label:
        chosen = [int(i) for i in exp.predicted]  # type: ignore[union-attr]
        shown = ", ".join(f"{exp.label_name(i)} ({p(i):.3f})" for i in chosen) or "none"
        return f"predicted labels (p > 0.5 each, independent): {shown}; explaining {exp.label_name(target)} " \
               f"(p {p(target):.3f})"
    predicted = int(exp.predicted)  # type: ignore[arg-type]
    return f"predicted {exp.label_name(predicted)} ({p(predicted):.3f}), explaining {exp.label_name(target)}"


def probabilities_line(exp: Explanation) -> str:
    """Every class's probability (multi-label: independent per label); empty for QA, whose start and end
    probabilities :func:`prediction_line` gives."""
    if exp.is_qa:
        return ""
    listed = ", ".join(f"{exp.label_name(i)}: {p:.3f}" for i, p in enumerate(exp.probabilities))
    return f"label probabilities (sigmoid, independent) {listed}" if exp.is_multi_label else f"probabilities {listed}"
