"""Behaviour on the real fine-tuned reference models in ../shared/models (slow-marked, still quick)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from conftest import DATA, MODELS, missing

from attnlens import Explainer

pytestmark = pytest.mark.slow
NEGATIVE = {"didn", "t"}  # the negation in "didn't"
FAST = ["rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat", "saliency", "inputxgradient"]


def sst2_dev(n: int) -> list[dict]:
    path = DATA / "sst2" / "dev.jsonl"
    if not path.is_file():
        missing(f"{path} not found")
    with path.open() as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def test_negative_sentence_ranks_a_negative_word(minilm_sst2):
    (e,) = minilm_sst2.explain("i really didn't like this movie .", methods=["attcat", "agrad"])
    assert e.predicted_label == "negative"
    for m in ["attcat", "agrad"]:
        top = {tok for tok, _ in e.top_k(m, 3)}
        assert top & NEGATIVE, (m, e.top_k(m, 3))


def test_positive_sentence(minilm_sst2):
    (e,) = minilm_sst2.explain("a charming and often affecting journey .", methods=["attcat"])
    assert e.predicted_label == "positive"
    assert e.top_k("attcat", 1)[0][0] in {"charming", "affecting"}


def test_32_dev_sentences_in_seconds_and_attcat_beats_random(minilm_sst2):
    rows = sst2_dev(32)
    start = time.perf_counter()
    exps = minilm_sst2.explain([r["text"] for r in rows], methods=FAST, batch_size=32)
    elapsed = time.perf_counter() - start
    assert elapsed < 60, f"explaining 32 sentences took {elapsed:.1f}s"
    accuracy = np.mean([e.predicted == r["label"] for e, r in zip(exps, rows)])
    assert accuracy > 0.75
    # deletion check: removing the top-20% tokens by AttCAT hurts the prediction more than removing random ones
    rng = np.random.default_rng(0)
    by_method: dict[str, list[list[int]]] = {"attcat": [], "random": []}
    base = []
    for e in exps:
        k = max(1, round(0.2 * sum(not s for s in e.special)))
        candidates = [i for i, s in enumerate(e.special) if not s]
        drops = {"attcat": set(e.ranking("attcat")[:k]), "random": set(rng.choice(candidates, k, replace=False))}
        for name, drop in drops.items():
            by_method[name].append([t for i, t in enumerate(e.input_ids) if i not in drop])
        base.append(e.probabilities[e.predicted])
    base = np.array(base)
    pred = np.array([e.predicted for e in exps])
    drop = {}
    for name, ids in by_method.items():
        p = minilm_sst2.predict_proba(ids)[np.arange(len(exps)), pred]
        drop[name] = float(np.mean(base - p))
    assert drop["attcat"] > drop["random"] + 0.05, drop


@pytest.mark.parametrize("name,attention", [("gpt2-scratch-sst2", None), ("bart-scratch-sst2", "encoder"),
                                            ("bart-scratch-sst2", "decoder"), ("bart-scratch-sst2", "cross"),
                                            ("minilm-imdb", None)])
def test_other_reference_models(name, attention):
    path = MODELS / name
    if not path.is_dir():
        missing(f"{path} not found")
    ex = Explainer.from_pretrained(path, attention=attention)
    methods = ["rawatt", "grads", "agrad", "attgrads", "cat", "attcat", "saliency"]
    if attention != "cross":
        methods += ["rollout", "gae"]
    texts = ["a charming and often affecting journey .", "a dull , boring and awful movie ."]
    exps = ex.explain(texts, methods=methods)
    assert [e.predicted_label for e in exps] == ["positive", "negative"]
    for e in exps:
        for m in methods:
            assert np.isfinite(e.scores[m]).all() and np.abs(e.scores[m]).max() > 0, m


@pytest.mark.parametrize("method", ["attnlrp", "decompx"])
def test_the_bart_classifier_through_both_stacks_beats_random_deletion(method):
    """AttnLRP and DecompX through BART's encoder, decoder and cross-attention: deleting each sentence's top 20% of
    tokens by its encoder-input score lowers the predicted class's probability far more than deleting random
    ones."""
    path = MODELS / "bart-scratch-sst2"
    if not path.is_dir():
        missing(f"{path} not found")
    ex = Explainer.from_pretrained(path)
    rows = sst2_dev(32)
    exps = ex.explain([r["text"] for r in rows], methods=[method], batch_size=32)
    rng = np.random.default_rng(0)
    kept: dict[str, list[list[int]]] = {method: [], "random": []}
    for e in exps:
        candidates = [i for i, s in enumerate(e.special) if not s]
        k = max(1, round(0.2 * len(candidates)))
        for name, drop in ((method, set(e.ranking(method)[:k])),
                           ("random", set(rng.choice(candidates, k, replace=False)))):
            kept[name].append([t for i, t in enumerate(e.input_ids) if i not in drop])
    pred = np.array([e.predicted for e in exps])
    base = np.array([e.probabilities[e.predicted] for e in exps])
    drop = {name: float(np.mean(base - ex.predict_proba(ids)[np.arange(len(exps)), pred]))
            for name, ids in kept.items()}
    assert drop[method] > drop["random"] + 0.2, drop
