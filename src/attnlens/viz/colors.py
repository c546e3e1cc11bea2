"""Shared helpers of the renderers: method selection, score normalisation and the green/red colour scale.

The colour scale follows AttCAT Fig. 5: green supports the explained class, red opposes it, and the shade's
intensity is ``|score|`` divided by the largest finite ``|score|`` of the same method on the same example (special
tokens excluded, since they are never ranked). An infinite score is drawn at full intensity, a NaN in grey.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import InputError
from ..results.tokentext import readable_tokens, token_texts

POSITIVE_RGB = (22, 163, 74)  # green
NEGATIVE_RGB = (220, 38, 38)  # red
NEUTRAL_RGB = (255, 255, 255)
NAN_RGB = (156, 163, 175)  # grey: a score that is not a number (neither white, a zero, nor a colour)
# Noise floors of the normalisation: a row is divided by at least NOISE_ATOL, and a layer row by at least
# NOISE_RTOL x the largest |score| of any layer of the example (float32 sums carry relative errors ~1e-7).
NOISE_ATOL = 1e-12
NOISE_RTOL = 1e-5


class Explained(Protocol):
    """What the renderers read of an explanation; :class:`attnlens.Explanation` is one.

    viz types against this protocol rather than importing the result type: ``Explanation.show()`` and
    ``Explanation.to_html()`` import viz, so the arrow runs one way only (result type -> renderers).
    """

    text: str | list[str]
    tokens: list[str]
    special: list[bool]
    target: Any
    predicted: Any
    probabilities: list[float]
    scores: dict[str, np.ndarray]
    layers: dict[str, np.ndarray]
    sequence_ids: list[int | None] | None
    offsets: list[tuple[int, int]] | None
    meta: dict[str, Any]

    @property
    def is_qa(self) -> bool: ...

    @property
    def is_answer(self) -> bool: ...

    @property
    def is_multi_label(self) -> bool: ...

    def label_name(self, index: int) -> str: ...

    def span_text(self, span: Sequence[int] | None = None) -> str: ...

    def ranking(self, method: str, reverse: bool = False) -> list[int]: ...

    def to_words(self, aggregation: str = "sum") -> Explained: ...


def shown_tokens(exp: Explained) -> list[str]:
    """The tokens as a reader sees them (byte-level BPE and SentencePiece decoded: ``Ġcapital`` reads ``capital``)."""
    return readable_tokens(list(exp.tokens), exp.meta)


def top_split(exp: Explained, method: str, k: int) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """The ``k`` highest positive and the ``k`` lowest negative tokens of ``method`` (shown tokens, scores)."""
    order, lowest = exp.ranking(method), exp.ranking(method, reverse=True)  # ties in token order either way
    shown, scores = told_apart(exp), exp.scores[method]  # tokens as a reader sees them
    pairs = lambda ranked: [(shown[i], float(scores[i])) for i in ranked]  # noqa: E731
    return [(t, s) for t, s in pairs(order) if s > 0][:k], [(t, s) for t, s in pairs(lowest) if s < 0][:k]


def told_apart(exp: Explained) -> list[str]:
    """Each token as the top-token lists show it: as a reader sees it, and where the same text stands more than
    once among the ranked (non-special) tokens, followed by which occurrence it is (``best#1``, ``best#2``), so
    that two entries of one list are never the same string."""
    shown = [_visible(t) for t in shown_tokens(exp)]
    ranked = [i for i, sp in enumerate(exp.special) if not sp]
    counts: dict[str, int] = {}
    for i in ranked:
        counts[shown[i]] = counts.get(shown[i], 0) + 1
    seen: dict[str, int] = {}
    labels = list(shown)
    for i in ranked:
        if counts[shown[i]] > 1:
            seen[shown[i]] = seen.get(shown[i], 0) + 1
            labels[i] = f"{shown[i]}#{seen[shown[i]]}"
    return labels


def _visible(token: str) -> str:
    """A token or word of spaces only shows them (``␣``), as the token views do; other whitespace the views
    escape."""
    return token.replace(" ", "␣") if not token.strip() else token


def select_methods(exp: Explained, methods: Sequence[str] | None) -> list[str]:
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


def prepare(exps: Explained | Sequence[Explained], words: bool) -> list[Explained]:
    """A list of explanations, aggregated to words when asked."""
    if _is_explanation(exps):
        exps = [exps]
    exps = list(exps)
    if not all(map(_is_explanation, exps)):
        raise InputError("expected Explanation objects")
    if not words:
        return exps
    return [e if e.meta.get("granularity") == "word" else e.to_words() for e in exps]  # words stay as aggregated


def _is_explanation(x: object) -> bool:
    """Whether ``x`` is an explanation, by what the renderers use (viz does not import the result type)."""
    return all(hasattr(x, a) for a in ("tokens", "special", "scores", "to_words"))


def normalized(scores: np.ndarray, special: Sequence[bool] | None = None, floor: float = NOISE_ATOL) -> np.ndarray:
    """Scores divided by their largest finite magnitude over non-special tokens, so values lie in [-1, 1].

    Special tokens get 0 (they are drawn dimmed, not coloured); ±inf gets ±1 (full colour) and NaN stays NaN
    (drawn grey, :func:`shade`). The divisor is at least ``floor``, so a row of numerical noise (all ``|s|`` far
    below the floor) stays blank instead of being blown up to full colour; an all-zero row stays zero.
    """
    s = np.asarray(scores, dtype=np.float64)
    if special is not None:
        s = np.where(np.asarray(special, dtype=bool), 0.0, s)
    finite = np.isfinite(s)
    peak = max(float(np.abs(s[finite]).max()) if finite.any() else 0.0, floor)
    with np.errstate(invalid="ignore", divide="ignore"):
        scaled = s / peak if peak > 0 else np.zeros_like(s)
    return np.where(finite, scaled, np.sign(s))  # sign: ±inf -> ±1, NaN -> NaN


def prob_text(p: float) -> str:
    """A probability as the views print it: three decimals, or two significant digits below 0.001 (``2.3e-04``),
    so that two small probabilities stay apart."""
    return f"{p:.3f}" if not 0 < p < 0.001 else f"{p:.1e}"


def layers_add_up(layers: np.ndarray, scores: np.ndarray | None) -> bool:
    """Whether the per-layer scores add up to the method's scores (CAT, AttCAT: AttCAT Eq. 12); ``scores``
    ``None``: assumed. Other methods' layers are each layer's own state (raw attention, the rollout so far)."""
    if scores is None:
        return True
    total, s = np.asarray(layers, dtype=np.float64).sum(0), np.asarray(scores, dtype=np.float64)
    if total.shape != s.shape:
        return False
    return bool(np.allclose(np.nan_to_num(total), np.nan_to_num(s), rtol=1e-4,
                            atol=1e-6 * max(float(np.abs(np.nan_to_num(s)).max(initial=0.0)), 1e-12)))


def layer_rows(layers: np.ndarray, scores: np.ndarray | None = None) -> tuple[list[str], np.ndarray]:
    """Rows of the layer x token heatmap (AttCAT Fig. 4): one per layer, then ``sum`` and ``rollout`` where the
    layers add up to the method's ``scores`` (:func:`layers_add_up`).

    ``sum`` adds the layers' scores (AttCAT Eq. 12); ``rollout`` multiplies them element-wise, the rollout
    operation the AttCAT authors compare against. For a method whose layers are each layer's own state the two
    rows would mean nothing (the sum of a rollout's partial products is not its score): only the layers are given.
    """
    arr = np.asarray(layers, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0:
        raise InputError(f"layer scores must have shape (n_layers, n_tokens), got {arr.shape}")
    names = [f"L{i}" for i in range(arr.shape[0])]
    if not layers_add_up(arr, scores):
        return names, arr
    rows = np.vstack([arr, arr.sum(0, keepdims=True), arr.prod(0, keepdims=True)])
    return names + ["sum", "rollout"], rows


def normalized_layer_rows(rows: np.ndarray, special: Sequence[bool] | None = None,
                          n_layers: int | None = None) -> np.ndarray:
    """The rows of :func:`layer_rows` (``n_layers`` layers, then ``sum`` and ``rollout`` when there are more
    rows; default: the last two rows are those) normalised to [-1, 1] with a noise floor.

    Every row is shown relative to its own largest magnitude, so a layer whose scores are small but real is
    still readable; but a layer row is divided by at least ``NOISE_RTOL`` x the example's largest layer
    magnitude, so numerical noise (max |s| 3e-12 next to layers of order 1) is drawn blank. ``sum`` has the same
    floor. ``rollout``, the product of the layers, is noise when one of its factors is: then it is divided by
    the product of the layers' divisors (at least its own peak), so it is drawn blank too.
    """
    rows = np.asarray(rows, dtype=np.float64)
    mask = np.zeros(rows.shape[1], dtype=bool) if special is None else np.asarray(special, dtype=bool)
    clean = np.where(mask, 0.0, np.nan_to_num(rows, nan=0.0, posinf=0.0, neginf=0.0))
    peaks = np.abs(clean).max(axis=1) if clean.shape[1] else np.zeros(len(rows))
    n_layers = len(rows) - 2 if n_layers is None else n_layers
    scale = float(peaks[:n_layers].max())
    floors = np.full(len(rows), max(NOISE_RTOL * scale, NOISE_ATOL))
    layer_divisors = np.maximum(peaks[:n_layers], floors[:n_layers])
    noisy = bool((peaks[:n_layers] < floors[:n_layers]).any())
    if len(rows) > n_layers:  # the rollout row
        floors[-1] = float(np.prod(layer_divisors)) if noisy else 0.0
    return np.vstack([normalized(row, special, floor=f) for row, f in zip(rows, floors, strict=True)])


def shade(value: float) -> tuple[int, int, int]:
    """RGB colour of a normalised score in [-1, 1]: white at 0, full green at +1, full red at -1; grey for NaN."""
    if np.isnan(value):
        return NAN_RGB
    v = float(np.clip(value, -1.0, 1.0))
    target = POSITIVE_RGB if v >= 0 else NEGATIVE_RGB
    t = abs(v)
    return tuple(round(n + (c - n) * t) for n, c in zip(NEUTRAL_RGB, target, strict=True))  # type: ignore[return-value]


def hex_color(rgb: tuple[int, int, int]) -> str:
    """``#rrggbb`` form of an RGB triple."""
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def text_of(exp: Explained) -> str:
    """The explained text as one string (sentence pairs joined with `` [SEP] ``; QA: ``question: … context: …``)."""
    if exp.is_qa and isinstance(exp.text, list) and len(exp.text) == 2:
        return f"question: {exp.text[0]}  context: {exp.text[1]}"
    return " [SEP] ".join(exp.text) if isinstance(exp.text, list) else str(exp.text)


def _sources(exp: Explained) -> list[str]:
    return [str(t) for t in exp.text] if isinstance(exp.text, list) else [str(exp.text)]


def explained_text(exp: Explained) -> tuple[str, str]:
    """The part of the text the model read and the part cut off by truncation (``""`` when nothing was cut).

    Uses the tokens' character offsets; for a sentence pair each side is cut where its last kept token ends.
    Without offsets (slow tokenizers) the whole text is returned as explained.
    """
    sources = _sources(exp)
    if not exp.meta.get("truncated_tokens") or exp.offsets is None:
        return text_of(exp), ""
    kept, cut = [], []
    for seq, source in enumerate(sources):
        ends = [
            end
            for i, (_, end) in enumerate(exp.offsets)
            if not exp.special[i] and (exp.sequence_ids[i] if exp.sequence_ids is not None else 0) == seq
        ]
        stop = max(ends, default=0)
        kept.append(source[:stop])
        cut.append(source[stop:].strip())
    return " [SEP] ".join(kept), " [SEP] ".join(c for c in cut if c)


def truncation_note(exp: Explained) -> str | None:
    """One sentence saying how many tokens truncation cut from this input, or None when nothing was cut."""
    n = int(exp.meta.get("truncated_tokens") or 0)
    if n <= 0:
        return None
    return (
        f"input truncated: {n} token{'s' if n != 1 else ''} beyond the longest input (the model's, or the "
        "max_length set) were cut and are not explained"
    )


def answer_positions(exp: Explained) -> set[int]:
    """QA: the token positions of the explained answer span; token classification: the explained token (empty
    for sequence classifiers)."""
    if "position" in exp.meta and exp.meta.get("task") == "token":
        return {int(exp.meta["position"])}
    if exp.is_answer:  # a language model's answer: [start, end), its end excluded
        start, end = exp.target  # type: ignore[misc]
        return set(range(int(start), int(end)))
    if not exp.is_qa:
        return set()
    start, end = exp.target  # type: ignore[misc]
    return set(range(int(start), int(end) + 1))


def _span(exp: Explained, span: object) -> str:
    start, end = span  # type: ignore[misc]
    unit = "word" if exp.meta.get("granularity") == "word" else "token"
    where = f"{unit} {start}" if start == end else f"{unit}s {start}-{end}"
    return f'"{exp.span_text(span)}" ({where})'  # type: ignore[arg-type]


def prediction_line(exp: Explained) -> str:
    """One-line summary of the prediction and of what is explained, e.g. ``predicted positive (0.930),
    explaining positive`` (``explaining positive − negative`` against a contrast); QA: the explained answer span
    as text with its start and end probabilities; multi-label: the labels with p > 0.5 (independent sigmoid
    probabilities) and the explained label."""
    probs = exp.probabilities
    if exp.is_answer:  # probabilities: each answer token's
        start, end = (int(i) for i in exp.target)  # type: ignore[union-attr]
        logprob = exp.meta.get("answer_logprob")
        told = "" if logprob is None else f", log-probability {float(logprob):.3f}"
        spelled = "".join(token_texts(exp.tokens[start:end], exp.meta))  # as the tokens spell it, spaces included
        return f"explaining the answer {spelled!r} (tokens {start}-{end - 1}){told}"
    if exp.is_qa:
        p_start, p_end = (list(probs) + [float("nan")] * 2)[:2]
        line = f"answer: {_span(exp, exp.target)}, p(start) {p_start:.3f}, p(end) {p_end:.3f}"
        if list(exp.predicted) == list(exp.target):  # type: ignore[arg-type]
            return line + " (the predicted answer)"
        return line + f"; predicted answer: {_span(exp, exp.predicted)}"

    def p(i: int) -> float:
        return probs[i] if 0 <= i < len(probs) else float("nan")

    target = int(exp.target)  # type: ignore[arg-type]
    contrast = exp.meta.get("contrast")
    against = "" if contrast is None else f" − {exp.label_name(int(contrast))}"
    if exp.is_multi_label:
        chosen = [int(i) for i in exp.predicted]  # type: ignore[union-attr]
        shown = ", ".join(f"{exp.label_name(i)} ({p(i):.3f})" for i in chosen) or "none"
        return f"predicted labels (p > 0.5 each, independent): {shown}; explaining {exp.label_name(target)} " \
               f"(p {p(target):.3f}){against}"
    predicted = int(exp.predicted)  # type: ignore[arg-type]
    if str(exp.meta.get("task", "")).endswith("-lm"):  # a language model's next token (probabilities: p(target))
        target_name = repr(exp.meta["target_token"]) if "target_token" in exp.meta else f"token #{target}"
        line = f"explaining next token {target_name} (p {prob_text(p(0))})"
        if contrast is not None:
            line += " − " + (repr(exp.meta["contrast_token"]) if "contrast_token" in exp.meta
                             else f"token #{int(contrast)}")
        greedy = repr(exp.meta["predicted_token"]) if "predicted_token" in exp.meta else f"token #{predicted}"
        return line + (", the greedy choice" if predicted == target else f"; greedy choice: {greedy}")
    line = f"predicted {exp.label_name(predicted)} ({p(predicted):.3f}), explaining {exp.label_name(target)}{against}"
    if exp.meta.get("task") == "token" and "position" in exp.meta:
        unit = "word" if exp.meta.get("granularity") == "word" else "token"
        position = int(exp.meta["position"])
        return f"{unit} {position} {shown_tokens(exp)[position]!r}: {line}"
    return line


def probabilities_line(exp: Explained) -> str:
    """Every class's probability (multi-label: independent per label); empty for QA and language models, whose
    probabilities (start and end; the explained token's) :func:`prediction_line` gives."""
    if exp.is_qa or str(exp.meta.get("task", "")).endswith("-lm"):
        return ""
    listed = ", ".join(f"{exp.label_name(i)}: {p:.3f}" for i, p in enumerate(exp.probabilities))
    return f"label probabilities (sigmoid, independent) {listed}" if exp.is_multi_label else f"probabilities {listed}"
