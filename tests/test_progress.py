"""Progress of explain(): cost-weighted (ETA holds for length-sorted batches), moving inside batches."""

from __future__ import annotations

import pytest
from conftest import make_model, make_tokenizer

from attnlens import Explainer
from attnlens.core.progress import ExplainProgress, input_cost, planned_passes

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
