"""Metrics on hand-made "models" whose probabilities are a known function of the tokens they can see."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from attnlens.errors import InputError
from attnlens.evaluation import (
    EvalConfig,
    Item,
    Variant,
    consistency,
    kendall_tau,
    metric_info,
    perturb,
    precision_at_k,
    resolve_metrics,
    score_examples,
)
from attnlens.evaluation.metrics import answer_token_positions, attcat_code_counts, paper_counts
from attnlens.results.explanation import Explanation

CLS, SEP, PAD = 101, 102, 0


class LinearModel:
    """p(class 1) = sigmoid(sum of the weights of the visible tokens); records what it was asked."""

    def __init__(self, weights: dict[int, float], bias: float = 0.0):
        self.weights, self.bias = weights, bias
        self.calls: list[list[Variant]] = []

    def p1(self, visible: list[int]) -> float:
        z = self.bias + sum(self.weights.get(t, 0.0) for t in visible)
        return 1.0 / (1.0 + math.exp(-z))

    def __call__(self, variants):
        self.calls.append(list(variants))
        out = []
        for v in variants:
            p = self.p1(v.present())
            out.append([1 - p, p])
        return np.array(out)


def make_exp(ids, scores, other=None, target=1, predicted=1, method="m"):
    tokens = ["[CLS]"] + [f"t{i}" for i in ids] + ["[SEP]"]
    sc = {method: np.array([0.0, *scores, 0.0])}
    return Explanation(
        text="x", tokens=tokens, special=[True] + [False] * len(ids) + [True], target=target,
        predicted=predicted, probabilities=[0.5, 0.5], scores=sc, input_ids=[CLS, *ids, SEP],
        token_type_ids=[0] * (len(ids) + 2),
    )


WEIGHTS = {1: 2.0, 2: -1.0, 3: 0.5, 4: 1.5}


def p1_without(model, ids, removed):
    return model.p1([CLS] + [t for t in ids if t not in removed] + [SEP])


def test_counts_grids():
    assert paper_counts(4, [k / 10 for k in range(11)]) == [0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    # AttCAT: linspace(0,1,10)*12 = 0, 1.33, 2.67, 4, 5.33, 6.67, 8, 9.33, 10.67, 12 -> drop 0
    assert attcat_code_counts(12) == [1, 3, 4, 5, 7, 8, 9, 11, 12]


def test_aopc_and_lodds_paper_match_plain_loop():
    ids = [1, 2, 3, 4]
    model = LinearModel(WEIGHTS, bias=0.1)
    exp = make_exp(ids, [4.0, 1.0, 2.0, 3.0])  # ranking: t1, t4, t3, t2
    order = [1, 4, 3, 2]
    counts = [0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    p0 = p1_without(model, ids, set())
    assert p0 > 0.5  # class 1 is predicted
    want_aopc = np.mean([p0 - p1_without(model, ids, set(order[:c])) for c in counts])
    want_lodds = np.mean([math.log(p1_without(model, ids, set(order[:c])) / p0) for c in counts])
    (res,) = score_examples([Item(exp, label=1)], ["m"], ["aopc", "lodds"], model)
    assert res.methods["m"]["aopc"].value == pytest.approx(want_aopc)
    assert res.methods["m"]["lodds"].value == pytest.approx(want_lodds)  # pad weight 0: same as deleting here
    assert len(res.methods["m"]["aopc"].detail) == 11


def test_lodds_replaces_with_pad_and_keeps_it_attended():
    ids = [1, 2]
    model = LinearModel({1: 1.0, 2: 1.0, PAD: -5.0})  # the pad token itself pushes towards class 0
    exp = make_exp(ids, [2.0, 1.0])
    (res,) = score_examples([Item(exp, 1)], ["m"], ["lodds", "aopc"], model)
    p0 = model.p1([CLS, 1, 2, SEP])
    counts = [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]  # round(k/10 * 2), half to even
    pads = {0: [CLS, 1, 2, SEP], 1: [CLS, PAD, 2, SEP], 2: [CLS, PAD, PAD, SEP]}
    want = np.mean([math.log(model.p1(pads[c]) / p0) for c in counts])
    assert res.methods["m"]["lodds"].value == pytest.approx(want)
    dels = {0: [CLS, 1, 2, SEP], 1: [CLS, 2, SEP], 2: [CLS, SEP]}
    assert res.methods["m"]["aopc"].value == pytest.approx(np.mean([p0 - model.p1(dels[c]) for c in counts]))


def test_attcat_code_protocol_changes_grid_class_and_sign():
    ids = list(range(1, 11))  # 10 real tokens, 12 with [CLS]/[SEP]
    weights = {i: (1.0 if i % 2 else -0.8) for i in ids}
    model = LinearModel(weights)
    scores = [float(s) for s in [3, -1, 7, 2, -5, 0.5, 9, -2, 4, 1]]
    exp = make_exp(ids, scores, target=0)
    order = [ids[i] for i in sorted(range(10), key=lambda i: -scores[i])]
    gold = 0
    p0 = 1 - model.p1([CLS, *ids, SEP])  # gold class, not the predicted one
    counts = [min(c, 10) for c in [1, 3, 4, 5, 7, 8, 9, 11, 12]]
    want = np.mean([abs(p0 - (1 - p1_without(model, ids, set(order[:c])))) for c in counts])
    cfg = EvalConfig(protocol="attcat-code")
    (res,) = score_examples([Item(exp, gold)], ["m"], ["aopc"], model, cfg)
    assert res.methods["m"]["aopc"].value == pytest.approx(want)
    assert len(res.methods["m"]["aopc"].detail) == 9
    (paper,) = score_examples([Item(exp, gold)], ["m"], ["aopc"], model)
    assert paper.methods["m"]["aopc"].value != pytest.approx(want)
    # short inputs are skipped by the AttCAT code
    short = make_exp([1, 2, 3], [1.0, 2.0, 3.0])
    (res,) = score_examples([Item(short, 1)], ["m"], ["aopc", "lodds"], model, cfg)
    assert res.methods["m"]["aopc"].value is None and res.methods["m"]["lodds"].value is None


def test_comprehensiveness_and_sufficiency():
    ids = [1, 2, 3, 4]
    model = LinearModel(WEIGHTS)
    exp = make_exp(ids, [1.0, 4.0, 3.0, 2.0])  # ranking t2, t3, t4, t1
    order = [2, 3, 4, 1]
    counts = [0, 1, 1, 2, 2, 2, 3, 3, 4, 4]  # round(k/10*4) for k = 1..10
    p0 = model.p1([CLS, *ids, SEP])
    comp = np.mean([p0 - p1_without(model, ids, set(order[:c])) for c in counts])
    suff = np.mean([p0 - p1_without(model, ids, set(order[c:])) for c in counts])
    (res,) = score_examples([Item(exp, 1)], ["m"], ["comprehensiveness", "sufficiency"], model)
    assert res.methods["m"]["comprehensiveness"].value == pytest.approx(comp)
    assert res.methods["m"]["sufficiency"].value == pytest.approx(suff)


def test_occlusion_top_bottom_random_and_drop_modes():
    # class 1 iff token 7 is visible: dropping the top token flips it, dropping from the bottom never does
    ids = [5, 6, 7, 8, 9, 10]
    model = LinearModel({7: 10.0}, bias=-5.0)
    exp = make_exp(ids, [0.1, -0.3, 5.0, 0.2, -2.0, 0.0])
    cfg = EvalConfig(occlusion_counts=(0, 1, 2, 4, 6, 10))
    (res,) = score_examples([Item(exp, 1, index=3)], ["m"], ["occlusion"], model, cfg)
    curves = res.methods["m"]["occlusion"].detail
    assert curves["top"] == [1, 0, 0, 0, 0, 0]
    assert curves["bottom"] == [1, 1, 1, 1, 0, 0]  # 7 scores highest, so bottom reaches it only when all go
    assert res.methods["m"]["occlusion"].value == pytest.approx(0.0)
    # random: seeded, nested, among real tokens only, identical for every method
    rnd = res.baseline["occlusion_random"]
    again = score_examples([Item(exp, 1, index=3)], ["m"], ["occlusion"], model, cfg)[0].baseline
    assert rnd == again["occlusion_random"] and rnd[0] == 1 and rnd[-1] == 0
    assert rnd == sorted(rnd, reverse=True)
    # masking keeps ids and positions; deleting shortens; with this model both give the same accuracy
    masked = [v for v in model.calls[0] if v.attention_mask is not None]
    assert masked and all(len(v) == len(exp.input_ids) and v.input_ids == tuple(exp.input_ids) for v in masked)
    model.calls.clear()
    cfg_del = EvalConfig(occlusion_counts=(0, 1, 2, 4, 6, 10), occlusion_drop="delete")
    (res_del,) = score_examples([Item(exp, 1, index=3)], ["m"], ["occlusion"], model, cfg_del)
    assert res_del.methods["m"]["occlusion"].detail == curves
    assert all(v.attention_mask is None for v in model.calls[0])
    assert min(len(v) for v in model.calls[0]) == 2  # only [CLS] [SEP] left
    # wrong gold label: accuracy is measured against gold, not the prediction
    (res0,) = score_examples([Item(exp, 0, index=3)], ["m"], ["occlusion"], model, cfg)
    assert res0.methods["m"]["occlusion"].detail["top"] == [0, 1, 1, 1, 1, 1]


def _plain_tau_a(x, y):
    conc = disc = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        s = np.sign(x[i] - x[j]) * np.sign(y[i] - y[j])
        conc += s > 0
        disc += s < 0
    return (conc - disc) / (len(x) * (len(x) - 1) / 2)


def test_kendall_paper_vs_attcat_code():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=9), rng.normal(size=9)
    special = [True] + [False] * 7 + [True]
    assert kendall_tau(a, b, special) == pytest.approx(_plain_tau_a(a[1:-1], b[1:-1]))
    assert kendall_tau(a, b, special, "attcat-code") == pytest.approx(_plain_tau_a(np.argsort(-a), np.argsort(-b)))
    assert kendall_tau(a, -a, special) == pytest.approx(-1.0)
    assert kendall_tau([0, 1, 1, 0], [0, 2, 2, 0], [True, False, False, True]) is None  # constant -> undefined


def test_kendall_uses_other_class_explanations_and_skips_class_agnostic():
    ids = [1, 2, 3, 4]
    exp = make_exp(ids, [1.0, 2.0, 3.0, 4.0], target=1)
    exp.scores["agn"] = exp.scores["m"].copy()
    other = make_exp(ids, [4.0, 3.0, 1.0, 2.0], target=0)
    model = LinearModel(WEIGHTS)
    item = Item(exp, 1, other={0: other})
    (res,) = score_examples([item], ["m", "agn"], ["kendall"], model, class_specific={"m": True, "agn": False})
    assert res.methods["m"]["kendall"].value == pytest.approx(_plain_tau_a([1, 2, 3, 4], [4, 3, 1, 2]))
    assert res.methods["agn"]["kendall"].value is None
    with pytest.raises(InputError):
        score_examples([Item(exp, 1)], ["m"], ["kendall"], model)


def test_identical_perturbations_are_scored_once():
    ids = [1, 2, 3, 4]
    exp = make_exp(ids, [4.0, 3.0, 2.0, 1.0])
    exp.scores["same"] = exp.scores["m"].copy()
    model = LinearModel(WEIGHTS)
    score_examples([Item(exp, 1)], ["m", "same"], ["aopc", "comprehensiveness"], model)
    asked = [v for call in model.calls for v in call]
    assert len(asked) == len(set(asked)) == 5  # original + 4 deletion levels, shared by both methods and metrics


def test_perturb_on_ids():
    base = Variant.of([CLS, 5, 6, 7, SEP], [0, 0, 1, 1, 1])
    assert perturb(base, [2], "delete") == Variant((CLS, 5, 7, SEP), (0, 0, 1, 1), None)
    assert perturb(base, [1, 3], "pad", PAD).input_ids == (CLS, PAD, 6, PAD, SEP)
    m = perturb(base, [1], "mask")
    assert m.input_ids == base.input_ids and m.attention_mask == (1, 0, 1, 1, 1) and m.present() == [CLS, 6, 7, SEP]
    assert perturb(base, [], "delete") is base
    with pytest.raises(InputError):
        perturb(base, [9], "delete")
    with pytest.raises(InputError):
        perturb(base, [1], "blank")


def test_precision_at_k_and_answer_positions():
    exp = make_exp([1, 2, 3, 4, 5], [5.0, 4.0, 3.0, 2.0, 1.0])
    assert precision_at_k(exp, "m", [1, 2, 5], k=2) == 2
    assert precision_at_k(exp, "m", [4, 5], k=3) == 0
    exp.offsets = [(0, 0), (0, 4), (0, 3), (4, 9), (10, 14), (15, 20), (0, 0)]
    exp.sequence_ids = [None, 0, 1, 1, 1, 1, None]
    assert answer_token_positions(exp, [{"text": "lo wo", "answer_start": 7}]) == [3, 4]


def _plain_silhouette(x, labels):
    x, labels = np.asarray(x), np.asarray(labels)
    out = []
    for i in range(len(x)):
        d = np.linalg.norm(x - x[i], axis=1)
        same = labels == labels[i]
        a = d[same].sum() / (same.sum() - 1)
        b = min(d[labels == c].mean() for c in set(labels.tolist()) if c != labels[i])
        out.append((b - a) / max(a, b))
    return float(np.mean(out))


def test_consistency_silhouette_and_projection():
    rng = np.random.default_rng(1)
    vecs = [rng.normal(loc=(5 if lab else -5), size=(3, 4)) for lab in (0, 1, 0, 1)]
    labels = [0, 1, 0, 1]
    res = consistency(vecs, labels)
    x = np.concatenate(vecs)
    want = _plain_silhouette(x, [lab for lab in labels for _ in range(3)])
    assert res["silhouette"] == pytest.approx(want) and want > 0.8
    assert len(res["points"]) == 12 and len(res["points"][0]) == 2 and res["labels"][:3] == [0, 0, 0]
    assert consistency(vecs[:1], [0])["silhouette"] is None


def test_metric_infos_and_names():
    for name in resolve_metrics("all"):
        info = metric_info(name)
        lo, hi = info.range
        assert lo <= info.best <= hi and info.description
    assert metric_info("lodds").lower_is_better and not metric_info("aopc").lower_is_better
    assert metric_info("lodds").to_dict()["best"] is None  # -inf is not JSON
    assert resolve_metrics(None) == ["aopc", "lodds", "kendall"]
    with pytest.raises(InputError, match="available metrics"):
        resolve_metrics("aopc,nope")
    with pytest.raises(InputError):
        EvalConfig(protocol="other")


def test_other_classes_for_kendall():
    from attnlens.evaluation.metrics import kendall_other_classes

    assert kendall_other_classes(1, 2) == [0] and kendall_other_classes(2, 3) == [0, 1]
    assert kendall_other_classes(0, 2, "attcat-code") == [1]
    assert [kendall_other_classes(y, 3, "attcat-code") for y in range(3)] == [[1], [0], [1]]
