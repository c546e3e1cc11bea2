"""Progress of explain(): cost-weighted (ETA holds for length-sorted batches), moving inside batches."""

from __future__ import annotations

import pytest
from conftest import make_model, make_tokenizer

from attnlens import Explainer
from attnlens.core.progress import ExplainProgress, input_cost, method_passes, planned_passes
from attnlens.methods.registry import get_method

SHORT = ["good", "bad", "fine", "dull"]
LONG = ["the plot was boring but the actors were charming and the film is great i loved it",
        "i really didn ' t like this movie , the story was awful and the actors were dull too"]


@pytest.fixture(scope="module")
def ex() -> Explainer:
    return Explainer(make_model("bert"), make_tokenizer())


def test_cost_weights_grow_with_length():
    costs = [input_cost(n, 384) for n in (8, 32, 128, 512)]
    assert costs == sorted(costs) and costs[-1] > 4 * costs[2]  # attention makes it superlinear
    p = ExplainProgress([10, 40, 20], 16, {})
    assert sum(p.weights) == pytest.approx(3) and p.weights[0] < p.weights[2] < p.weights[1]


def test_planned_passes():
    assert planned_passes({"n_steps": 12, "tolerance": None}) == 12
    assert planned_passes({"n_steps": None, "tolerance": None}) == 20  # integrated gradients' adaptive default
    assert planned_passes({"n_steps": None, "tolerance": 0.01}) == 20
    assert planned_passes({"alpha": "cls"}) == 1 and planned_passes({"n_steps": "x"}) == 1


def test_callback_moves_per_batch_and_weights_long_inputs(ex):
    calls = []
    ex.explain(SHORT + LONG, methods=["rawatt", "attcat"], batch_size=2, progress=lambda f, n: calls.append((f, n)))
    fractions = [f for f, _ in calls]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    finished = [n for _, n in calls]
    assert finished == sorted(finished) and finished[-1] == 6 and {2, 4} <= set(finished)
    # shortest first: when the 4 short inputs are done, far less than 4/6 of the work is (the ETA knows)
    at_four = next(f for f, n in calls if n == 4)
    assert at_four < 0.5 * 4 / 6


def test_a_single_input_moves_with_each_method(ex):
    calls = []
    ex.explain(LONG[0], methods=["rawatt", "rollout", "attcat"], progress=lambda f, n: calls.append((f, n)))
    inside = [f for f, n in calls if n == 0 and 0 < f < 1]
    assert len(inside) >= 3  # the shared pass, then each method
    assert calls[-1] == (pytest.approx(1.0), 1)


def test_integrated_gradients_moves_inside_the_batch(ex):
    calls = []
    opts = {"integratedgradients": {"n_steps": 8, "internal_batch_size": 2}}
    ex.explain(SHORT[:2], methods=["rawatt", "integratedgradients"], options=opts,
               progress=lambda f, n: calls.append((f, n)))
    inside = sorted({round(f, 6) for f, n in calls if n == 0 and 0 < f < 1})
    assert len(inside) >= 8  # 2 inputs x 8 points in passes of 2 rows, plus the shared pass and rawatt
    # IG plans 8 of the 9 passes per input: it is most of the bar
    assert max(f for f, n in calls if n == 0) >= 8 / 9 - 1e-6


def test_bar_announces_ig_and_counts_inputs(ex, capsys):
    ex.explain(SHORT[:3], methods=["rawatt", "integratedgradients"], batch_size=2, progress=True,
               options={"integratedgradients": {"n_steps": 6}})
    err = capsys.readouterr().err
    assert "integratedgradients: 6 passes x 3 inputs = 18 forward+backward passes, ~86% of the work" in err
    assert "3/3 inputs done" in err and "100%" in err


def test_no_bar_by_default(ex, capsys):
    ex.explain(SHORT, methods=["rawatt", "integratedgradients"], options={"integratedgradients": {"n_steps": 2}})
    assert capsys.readouterr().err == ""


def test_a_plan_of_the_length_weights_each_input_by_its_whole_work():
    p = ExplainProgress([10, 40], 16, {"slow": lambda n: n / 10})
    work = [w * (1 + n / 10) for w, n in zip(p.weights, [10, 40])]
    assert sum(work) == pytest.approx(2)
    assert work[1] / work[0] == pytest.approx(input_cost(40, 16) * 5 / (input_cost(10, 16) * 2))
    assert "slow: the work of about 5 forward+backward passes over 2 inputs, ~" in p.announce()


def test_value_zeroing_plans_work_that_grows_with_the_length():
    from attnlens.methods.valuezeroing import planned_passes as vz_passes

    model = make_model("llama")
    assert vz_passes(model, 400, {}) == pytest.approx(4 * vz_passes(model, 100, {}))
    assert vz_passes(model, 100, {"rollout": False}) < vz_passes(model, 100, {})
    plan = method_passes(get_method("valuezeroing"), model, {"rollout": True})
    assert plan(400) == pytest.approx(vz_passes(model, 400, {}))
    assert method_passes(get_method("integratedgradients"), model, {"n_steps": 12})(400) == 12


@pytest.mark.parametrize("method", ["valuezeroing", "occlusion"])
def test_a_method_whose_work_grows_with_the_length_holds_its_share_of_the_bar(ex, method):
    calls = []
    text = " ".join(LONG)
    exp = ex.explain(text, methods=["rawatt", method], progress=lambda f, n: calls.append((f, n)))
    fractions = [f for f, _ in calls]
    assert fractions == sorted(fractions) and calls[-1] == (pytest.approx(1.0), 1)
    # the shared pass and rawatt are a small part of the planned work: the method's own reports move the rest
    n = len(exp[0].tokens)
    plan = method_passes(get_method(method), ex.model, get_method(method).options)(n)
    assert plan > 2
    assert fractions[0] == pytest.approx(0.5 / (1 + plan))  # the shared pass: half of the step it shares
    assert fractions[1] == pytest.approx(1 / (1 + plan))  # with rawatt's half: one pass of 1 + plan
    assert any(fractions[1] < f < 1 for f in fractions)  # the method's own reports move the rest
