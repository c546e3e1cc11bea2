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
    """The explained text as one string (sentence pairs joined with `` [SEP] ``)."""
    return " [SEP] ".join(exp.text) if isinstance(exp.text, list) else str(exp.text)


def prediction_line(exp: Explanation) -> str:
    """``predicted positive (0.93), explaining positive`` style summary of the prediction."""

    def name(i: int) -> str:
        return exp.labels[i] if exp.labels and 0 <= i < len(exp.labels) else str(i)

    p = exp.probabilities[exp.predicted] if 0 <= exp.predicted < len(exp.probabilities) else float("nan")
    return f"predicted {name(exp.predicted)} ({p:.3f}), explaining {name(exp.target)}"
