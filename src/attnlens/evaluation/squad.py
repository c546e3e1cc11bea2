"""Exact match and F1 of predicted answers against SQuAD's gold answers, as the official SQuAD v1.1 evaluation
computes them: both texts are normalised (lower-cased, punctuation and the articles a/an/the removed,
whitespace collapsed), and each question scores its best match among its gold answers."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

__all__ = ["exact_match", "normalize_answer", "span_f1", "squad_scores"]

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD's normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalised texts are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def span_f1(prediction: str, gold: str) -> float:
    """F1 of the bags of normalised tokens of ``prediction`` and ``gold`` (0 when they share none)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: Sequence[str], golds: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean exact match and F1 (fractions in [0, 1]) of ``predictions``, each against the best of its gold
    answers, and ``n``, the number of questions."""
    if len(predictions) != len(golds):
        raise ValueError(f"{len(predictions)} predictions for {len(golds)} questions")
    if any(not g for g in golds):
        raise ValueError("every question needs at least one gold answer")
    em = [max(exact_match(p, g) for g in gs) for p, gs in zip(predictions, golds, strict=True)]
    f1 = [max(span_f1(p, g) for g in gs) for p, gs in zip(predictions, golds, strict=True)]
    n = len(predictions)
    return {"exact_match": round(sum(em) / n, 4) if n else 0.0, "f1": round(sum(f1) / n, 4) if n else 0.0, "n": n}
