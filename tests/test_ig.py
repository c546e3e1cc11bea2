"""Integrated gradients: quadrature rules, completeness gap, adaptive steps, internal batches (tiny models)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from captum.attr import IntegratedGradients
from conftest import make_model, make_tokenizer

from attnlens import Explainer, InputError
from attnlens.core.engine import batch_context
from attnlens.methods.gradient import QUADRATURES, baseline_ids, embedding_forward, next_count, quadrature

TEXTS = ["the movie was great", "the plot was boring but the actors were charming", "awful"]
IG = "integratedgradients"


@pytest.fixture(scope="module")
def ex() -> Explainer:
    return Explainer(make_model("bert"), make_tokenizer())


@pytest.mark.parametrize("rule", QUADRATURES)
def test_rules_integrate_what_they_should_exactly(rule):
    for n in (1, 2, 5, 8):
        a, w = quadrature(rule, n)
        assert len(a) == n and w.sum() == pytest.approx(1.0) and ((a >= 0) & (a <= 1)).all()
    a, w = quadrature(rule, 6)
    if rule == "gausslegendre":  # exact for polynomials of degree 2n - 1
        assert (w * a**11).sum() == pytest.approx(1 / 12, rel=1e-12)
    elif rule in ("riemann_trapezoid", "riemann_middle"):  # exact for straight lines
        assert (w * (3 * a + 1)).sum() == pytest.approx(2.5, rel=1e-12)


@pytest.mark.parametrize("rule", ["riemann_trapezoid", "riemann_left", "riemann_right"])
def test_nested_rules_contain_their_previous_nodes_at_half_weight(rule):
    n = 5
    a, w = quadrature(rule, n)
    a2, w2 = quadrature(rule, next_count(rule, n))
    for x, v in zip(a, w, strict=True):
        (j,) = np.flatnonzero(np.isclose(a2, x))
        assert w2[j] == pytest.approx(v / 2)


def _captum_ig(ex: Explainer, text: str, target: int, rule: str, n: int) -> np.ndarray:
    """Captum's own IntegratedGradients on the same embeddings, forward and baseline (an independent loop)."""
    (enc,) = ex.encode([text])
    ctx = batch_context(ex.runner, [enc], "logit")
    ctx.targets = torch.tensor([target])
    forward, x, extra = embedding_forward(ctx)
    with torch.no_grad():
        base = ex.model.get_input_embeddings()(baseline_ids(ctx, "auto"))
    attr = IntegratedGradients(forward).attribute(x, baselines=base, additional_forward_args=extra, n_steps=n,
                                                  method=rule)
    return attr.sum(-1)[0].detach().numpy()


@pytest.mark.parametrize("rule", ["gausslegendre", "riemann_trapezoid", "riemann_right"])
def test_matches_captum_for_the_same_rule_and_steps(ex, rule):
    (e,) = ex.explain(TEXTS[1], methods=[IG], target=1, options={IG: {"method": rule, "n_steps": 7}})
    # Captum's trapezoid weights are 1/n (ends halved): they sum to (n-1)/n; ours are the trapezoid rule's 1/(n-1)
    scale = 7 / 6 if rule == "riemann_trapezoid" else 1.0
    np.testing.assert_allclose(e.scores[IG], scale * _captum_ig(ex, TEXTS[1], 1, rule, 7), atol=1e-5)


def test_delta_in_meta_is_the_completeness_gap(ex):
    exps = ex.explain(TEXTS, methods=[IG], target=0, options={IG: {"n_steps": 5}})
    for text, e in zip(TEXTS, exps, strict=True):
        (enc,) = ex.encode([text])
        ctx = batch_context(ex.runner, [enc], "logit")
        with torch.no_grad():
            f_x = ex.model(**ctx.inputs).logits[0, 0]
            f_b = ex.model(**{**ctx.inputs, "input_ids": baseline_ids(ctx, "auto")}).logits[0, 0]
        m = e.meta[IG]
        assert m["n_steps"] == 5
        assert m["delta"] == pytest.approx(e.scores[IG].sum() - float(f_x - f_b), abs=1e-5)
        assert m["relative_gap"] == pytest.approx(abs(m["delta"]) / abs(float(f_x - f_b)), rel=1e-4)
    roundtrip = type(exps[0]).from_dict(exps[0].to_dict())
    assert roundtrip.meta[IG] == exps[0].meta[IG]


@pytest.mark.parametrize("rule", ["gausslegendre", "riemann_trapezoid"])
def test_tolerance_doubles_steps_per_input_until_the_gap_is_met(ex, rule):
    opts = {IG: {"method": rule, "tolerance": 0.005, "max_steps": 512}}
    exps = ex.explain(TEXTS, methods=[IG], options=opts, batch_size=3)
    schedule = [4]
    while next_count(rule, schedule[-1]) <= 512:
        schedule.append(next_count(rule, schedule[-1]))
    for text, e in zip(TEXTS, exps, strict=True):
        m = e.meta[IG]
        assert m["relative_gap"] <= 0.005 and m["n_steps"] in schedule
        # the adaptive result is the fixed rule at the count it stopped at (nested rules reused evaluations)
        (fixed,) = ex.explain(text, methods=[IG], options={IG: {"method": rule, "n_steps": m["n_steps"]}})
        np.testing.assert_allclose(e.scores[IG], fixed.scores[IG], atol=1e-5)
        if m["n_steps"] > 4:  # it stopped at the first count that met the tolerance
            previous = schedule[schedule.index(m["n_steps"]) - 1]
            (before,) = ex.explain(text, methods=[IG], options={IG: {"method": rule, "n_steps": previous}})
            assert before.meta[IG]["relative_gap"] > 0.005
        # each input's steps are its own: alone it gets the same
        (alone,) = ex.explain(text, methods=[IG], options=opts)
        assert alone.meta[IG]["n_steps"] == m["n_steps"]
        np.testing.assert_allclose(alone.scores[IG], e.scores[IG], atol=1e-5)


def test_unmet_tolerance_warns_and_is_recorded(ex):
    with pytest.warns(UserWarning, match=r"did not reach tolerance 1e-09 within max_steps=8"):
        exps = ex.explain(TEXTS, methods=[IG], options={IG: {"tolerance": 1e-9, "max_steps": 8,
                                                             "method": "gausslegendre"}})
    # every input ran to max_steps; those that missed the tolerance say by how much (in float32 a gap can also
    # round to exactly 0 on some CPUs)
    assert all(e.meta[IG]["n_steps"] == 8 for e in exps)
    assert any(e.meta[IG]["relative_gap"] > 1e-9 for e in exps)


def test_internal_batch_does_not_change_scores(ex):
    a = ex.explain(TEXTS, methods=[IG], options={IG: {"n_steps": 6, "internal_batch_size": 1}})
    b = ex.explain(TEXTS, methods=[IG], options={IG: {"n_steps": 6, "internal_batch_size": 1000}})
    c = ex.explain(TEXTS, methods=[IG], options={IG: {"n_steps": 6}}, memory_budget="64MiB")
    for x, y, z in zip(a, b, c, strict=True):
        np.testing.assert_allclose(x.scores[IG], y.scores[IG], atol=1e-5)
        np.testing.assert_allclose(x.scores[IG], z.scores[IG], atol=1e-5)


@pytest.mark.parametrize(("options", "message"), [
    ({"method": "simpson"}, "method='simpson'; choose one of gausslegendre"),
    ({"tolerance": 0}, "tolerance must be a number in"),
    ({"tolerance": "0.01"}, "tolerance must be a number in"),
    ({"tolerance": 1.5}, "tolerance must be a number in"),
    ({"max_steps": 0}, "max_steps must be an integer >= 1"),
    ({"n_steps": 16, "tolerance": 0.1, "max_steps": 8}, "n_steps=16 is more than max_steps=8"),
])
def test_bad_options_are_one_line_errors(ex, options, message):
    with pytest.raises(InputError, match=message):
        ex.explain("good movie", methods=[IG], options={IG: options})


def test_no_warning_when_converged(ex):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex.explain("good movie", methods=[IG], options={IG: {"tolerance": 0.05, "max_steps": 1024}})


def test_default_is_the_adaptive_trapezoid_and_n_steps_alone_is_fixed(ex):
    schedule = [4, 7, 13, 25, 49, 97, 193]  # trapezoid counts: n -> 2n - 1
    for e in ex.explain(TEXTS, methods=[IG]):
        assert e.meta[IG]["relative_gap"] <= 0.01 and e.meta[IG]["n_steps"] in schedule
        assert e.meta[IG]["tolerance"] == 0.01  # the default the options leave as None, recorded as applied
    (e,) = ex.explain(TEXTS[0], methods=[IG], options={IG: {"n_steps": 3}})
    assert e.meta[IG]["n_steps"] == 3 and "tolerance" not in e.meta[IG]
    (e,) = ex.explain(TEXTS[0], methods=[IG], options={IG: {"n_steps": 3, "tolerance": 0.2}})
    assert e.meta[IG]["tolerance"] == 0.2


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_fused_attention_and_recomputed_layers_give_the_eager_scores(family, monkeypatch):
    """Integrated gradients reads no attention probabilities: its passes run fused attention (and recompute each
    layer where the budget asks for it) with the eager passes' scores, padded batches included."""
    from attnlens.core import memory
    from attnlens.methods import gradient

    ex = Explainer(make_model(family), make_tokenizer())
    opts = {"integratedgradients": {"n_steps": 6}}
    seen = []
    real = gradient._integrated

    def spy(ctx, *args):
        seen.append(ctx.model.config._attn_implementation)
        return real(ctx, *args)

    monkeypatch.setattr(gradient, "_integrated", spy)
    fused = ex.explain(TEXTS, ["integratedgradients"], options=opts)
    monkeypatch.setattr(gradient, "gradient_pass_storage",
                        lambda *a, **k: memory.Storage(eager=False, backward=True, recompute=True))
    recomputed = ex.explain(TEXTS, ["integratedgradients"], options=opts)
    monkeypatch.setattr(gradient, "gradient_pass_storage", lambda *a, **k: memory.Storage(eager=True, backward=True))
    monkeypatch.setattr(gradient, "runs_sdpa", lambda model: False)
    eager = ex.explain(TEXTS, ["integratedgradients"], options=opts)
    assert seen == ["sdpa", "sdpa", "eager"]
    for runs in (fused, recomputed):
        for a, b in zip(runs, eager, strict=True):
            scale = np.abs(b.scores["integratedgradients"]).max()
            np.testing.assert_allclose(a.scores["integratedgradients"], b.scores["integratedgradients"], rtol=0,
                                       atol=1e-5 * scale)
