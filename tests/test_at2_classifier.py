"""AT2 for classifiers (bench/at2_classifier.py) on a tiny random BERT: features, deletion targets, the ridge fit
and the path into attnlens's AOPC."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import WORDS, make_model, make_tokenizer

from attnlens import Explainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import at2_classifier as at2c  # noqa: E402


@pytest.fixture(scope="module")
def explainer() -> Explainer:
    return Explainer(make_model("bert", seed=3), make_tokenizer())


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 12)))) for _ in range(n)]


def test_features_are_the_cls_row_of_every_head_and_value_norms(explainer):
    exp = explainer.explain(_sentences(1)[0], "rawatt")[0]
    att = at2c.cls_features(explainer.model, exp, "att")
    model = explainer.model
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    n = len(exp.tokens)
    assert att.shape == (layers * heads, n)
    np.testing.assert_allclose(att.sum(1), 1.0, atol=1e-5)  # each head's [CLS] row is a distribution
    with torch.no_grad():
        out = model(input_ids=torch.tensor([exp.input_ids]), output_attentions=True, output_hidden_states=True)
    np.testing.assert_allclose(att[heads], out.attentions[1][0, 0, 0].numpy(), atol=1e-6)  # layer 1, head 0
    # value norms computed here from the layer's input, not from the hook
    vn = at2c.cls_features(model, exp, "att_vnorm")
    for layer in range(layers):
        with torch.no_grad():
            v = model.bert.encoder.layer[layer].attention.self.value(out.hidden_states[layer][0])  # (n, hidden)
        norms = v.reshape(n, heads, -1).norm(dim=-1).T.numpy()  # (heads, n)
        rows = slice(layer * heads, (layer + 1) * heads)
        np.testing.assert_allclose(vn[rows], att[rows] * norms, rtol=1e-4, atol=1e-6)
    assert not np.allclose(vn, att)


def test_deletion_effects_are_the_logits_without_each_token(explainer):
    exps = explainer.explain(_sentences(3, seed=1), "rawatt")
    dels = at2c.deletion_effects(explainer, exps)
    model = explainer.model
    for e, d in zip(exps, dels):
        assert d.positions == [i for i, s in enumerate(e.special) if not s]
        with torch.no_grad():
            base = model(input_ids=torch.tensor([e.input_ids])).logits[0].numpy()
            np.testing.assert_allclose(d.base, base, atol=1e-5)
            j = d.positions[2]
            ids = e.input_ids[:j] + e.input_ids[j + 1 :]
            gone = model(input_ids=torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(d.deleted[2], gone, atol=1e-5)
        c = int(np.argmax(base))
        assert d.target("logit")[2] == pytest.approx(base[c] - gone[c], abs=1e-5)
        p = np.exp(base) / np.exp(base).sum()
        q = np.exp(gone) / np.exp(gone).sum()
        assert d.target("prob")[2] == pytest.approx(p[c] - q[c], abs=1e-5)
        assert d.target("margin")[2] == pytest.approx((base[c] - base[1 - c]) - (gone[c] - gone[1 - c]), abs=1e-5)


def _planted(feats: list[np.ndarray], exps, w: np.ndarray, noise: float, seed: int) -> list[at2c.Deletions]:
    """Deletions whose logit targets are ``w · F[:, j]`` (+ noise): class 0 predicted, its logit drops by that."""
    rng = np.random.default_rng(seed)
    out = []
    for f, e in zip(feats, exps):
        pos = [i for i, s in enumerate(e.special) if not s]
        y = w @ f[:, pos] + noise * rng.standard_normal(len(pos))
        deleted = np.stack([1.0 - y, np.zeros(len(pos))], 1)
        out.append(at2c.Deletions(pos, np.array([1.0, 0.0]), deleted))
    return out


def test_fit_recovers_planted_head_weights(explainer):
    exps = explainer.explain(_sentences(60, seed=2), "rawatt")
    feats = [at2c.cls_features(explainer.model, e, "att") for e in exps]
    w = np.array([2.0, -1.0, 0.5, 3.0])
    fit = at2c.fit_weights(*at2c.design(feats, _planted(feats, exps, w, 0.01, 0)))
    np.testing.assert_allclose(fit["weights"], w, rtol=0.1, atol=0.1)
    assert fit["cv_r2"] > 0.95 and fit["r2"] > 0.95
    # targets unrelated to the features: nothing to recover, and cross-validation says so
    rng = np.random.default_rng(5)
    noise = [at2c.Deletions(d.positions, d.base, np.stack([rng.standard_normal(len(d.positions)),
                                                            np.zeros(len(d.positions))], 1))
             for d in _planted(feats, exps, w, 0.0, 0)]
    null = at2c.fit_weights(*at2c.design(feats, noise))
    assert null["cv_r2"] < 0.05
    assert null["alpha"] >= 100 * fit["alpha"]


def test_scores_go_through_attnlens_aopc(explainer):
    exps = explainer.explain(_sentences(12, seed=3), "rawatt")
    dels = at2c.deletion_effects(explainer, exps)
    oracle, anti = [], []
    for e, d in zip(exps, dels):
        s = np.zeros(len(e.tokens))
        s[d.positions] = d.target("prob")
        oracle.append(s)
        anti.append(-s)
    at2c.add_scores(exps, "oracle", oracle)
    at2c.add_scores(exps, "anti", anti)
    at2c.add_scores(exps, "random", at2c.random_scores(exps, 0))
    values = at2c.faithfulness(explainer, exps, ["oracle", "anti", "random"])
    assert set(values) == {"oracle", "anti", "random"} and all(len(v["aopc"]) == 12 for v in values.values())
    table = at2c.summarise(values, "oracle")
    assert table["oracle"]["aopc"]["mean"] > table["random"]["aopc"]["mean"] > table["anti"]["aopc"]["mean"]
    assert table["oracle"]["lodds"]["mean"] < table["anti"]["lodds"]["mean"]
    diff = table["anti"]["aopc"]["oracle_minus"]
    assert diff["mean"] == pytest.approx(table["oracle"]["aopc"]["mean"] - table["anti"]["aopc"]["mean"])
    assert "| oracle |" in at2c.markdown(table, "oracle")


def test_interval_is_the_normal_approximation():
    r = at2c.interval([1.0, 2.0, 3.0, 4.0])
    assert r["mean"] == 2.5 and r["n"] == 4
    assert r["ci95"] == pytest.approx(1.96 * np.std([1, 2, 3, 4], ddof=1) / 2)
