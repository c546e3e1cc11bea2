"""A method's name means what its authors computed: the LRP methods against the reference rules.

``partiallrp`` and ``transatt`` default to Chefer et al.'s modified rules (``layers_ours.py``, what TransAtt's and
AttCAT's code run); they are pinned here against :mod:`lrp_reference`, a plain per-module re-computation of the
authors' relprop written independently of ``attnlens.lrp`` (batch size 1, explicit matrices).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_model
from lrp_reference import chefer_relprop, exact, last_layer_row, rollout_row
from scipy.stats import spearmanr

from attnlens import Explainer
from attnlens.errors import InputError
from attnlens.lrp import lrp_pass
from attnlens.methods import get_method

TEXTS = ["the movie was great", "i really didn ' t like this boring plot , but the actors were charming", "awful"]
SST2_DEV = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "sst2" / "dev.jsonl"


def _ones(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids[None], "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "token_type_ids": torch.zeros(1, len(ids), dtype=torch.long)}


def _with_exact_zero(model, tokenizer) -> torch.nn.Module:
    """Make word + position + segment embedding exactly 0 in one element (as happens with float16-stored
    weights, e.g. ../shared/models/minilm-sst2): the LayerNorm there must still output beta-ish, not 0."""
    emb = model.bert.embeddings
    tok = tokenizer(TEXTS[0])["input_ids"][1]
    with torch.no_grad():
        emb.position_embeddings.weight[1, 0] = 0.5
        emb.token_type_embeddings.weight[0, 0] = 0.25
        emb.word_embeddings.weight[tok, 0] = -0.75
    return model


def test_defaults_are_the_authors_rules():
    assert get_method("partiallrp").options["rules"] == "chefer"
    assert get_method("transatt").options["rules"] == "chefer"
    assert get_method("attnlrp").options["rules"] == "attnlrp"


@pytest.mark.parametrize("rules", ["chefer", "chefer-lrp"])
@pytest.mark.parametrize("target", [0, 1])
def test_rule_sets_equal_reference_relprop(rules, target, tokenizer):
    # float64 and exact division: R(A) of every layer equals the authors' rules computed module by module.
    model = _with_exact_zero(make_model("bert", seed=3), tokenizer).double().eval()
    ids = torch.tensor(tokenizer("the actors were charming but i didn ' t like this boring plot")["input_ids"])
    with exact():
        logits, expected, _ = chefer_relprop(model, ids, target, rules)
    res = lrp_pass(model, _ones(ids), target, rules=rules)
    torch.testing.assert_close(res.logits[0], logits, rtol=1e-12, atol=1e-12)
    for ours, ref in zip(res.attention_relevance, expected, strict=True):
        scale = ref.abs().max()
        torch.testing.assert_close(ours[0] / scale, ref / scale, rtol=0, atol=1e-9)


def test_chefer_forward_keeps_values_where_an_input_is_exactly_zero(tokenizer):
    # The identity rule must give back the value where a LayerNorm input is exactly 0, not 0: else the forward differs.
    model = _with_exact_zero(make_model("bert"), tokenizer).eval()
    ids = torch.tensor(tokenizer(TEXTS[0])["input_ids"])
    emb = model.bert.embeddings
    assert (emb.word_embeddings.weight[ids[1], 0] + emb.position_embeddings.weight[1, 0]
            + emb.token_type_embeddings.weight[0, 0]) == 0
    with torch.no_grad():
        plain = model(**_ones(ids)).logits
    for rules in ("chefer", "chefer-lrp"):
        torch.testing.assert_close(lrp_pass(model, _ones(ids), 0, rules=rules).logits, plain, rtol=1e-6, atol=1e-6)


def test_default_methods_equal_reference_computation(tokenizer):
    # The registered defaults, batched with padding (float32), against the reference one example at a time
    # (with the authors' 1e-9 stabiliser): the explained row of TransAtt (start_layer 0) and PartialLRP.
    model = _with_exact_zero(make_model("bert", seed=1), tokenizer).eval()
    targets = [1, 0, 1]
    exps = Explainer(model, tokenizer).explain(TEXTS, methods=["transatt", "partiallrp"], target=targets,
                                               batch_size=3)
    for e, t in zip(exps, targets, strict=True):
        _, rel, grads = chefer_relprop(model, torch.tensor(e.input_ids), t)
        for name, ref in (("transatt", rollout_row(grads, rel)), ("partiallrp", last_layer_row(rel))):
            ref = ref.numpy()
            np.testing.assert_allclose(e.scores[name] / np.abs(ref).max(), ref / np.abs(ref).max(), rtol=0,
                                       atol=1e-5, err_msg=name)


def test_chefer_lrp_is_not_conservative_and_old_name_is_refused(tokenizer):
    # layers_lrp.py divides x+ and x- by separate denominators, so relevance is not conserved (the input gets far
    # from the 1 put at the logit), as in the authors' code; the old name says where it went.
    model = make_model("bert").double().eval()
    ids = torch.tensor(tokenizer(TEXTS[1])["input_ids"])
    grown = lrp_pass(model, _ones(ids), 1, rules="chefer-lrp").input_relevance.sum()
    kept = lrp_pass(model, _ones(ids), 1, rules="chefer").input_relevance.sum()
    assert abs(kept - 1) < 1e-9 and abs(grown - 1) > 1, (kept, grown)
    with pytest.raises(InputError, match=r"'chefer-orig' is now called 'chefer-lrp'.*chefer, chefer-lrp, attnlrp, cp"):
        lrp_pass(model, _ones(ids), 1, rules="chefer-orig")
    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.raises(InputError, match="unknown LRP rules 'chefer-orig'"):
        ex.explain(TEXTS[:1], methods=["transatt"], options={"transatt": {"rules": "chefer-orig"}})


@pytest.mark.parametrize("rules", ["chefer", "chefer-lrp"])
def test_attnlrp_refuses_chefer_rules(rules, tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.raises(InputError, match=f"attnlrp takes rules 'attnlrp' \\(AttnLRP\\) or 'cp' \\(CP-LRP\\), "
                                         f"not '{rules}'"):
        ex.explain(TEXTS[:1], methods=["attnlrp"], options={"attnlrp": {"rules": rules}})
    (e,) = ex.explain(TEXTS[:1], methods=["attnlrp"], options={"attnlrp": {"rules": "cp"}})
    assert np.isfinite(e.scores["attnlrp"]).all()


@pytest.mark.parametrize("epsilon", [1e-3, -1.0, float("nan"), float("inf"), "0.1", True])
def test_epsilon_refused_where_it_means_nothing(epsilon, tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)
    match = "not 'chefer'" if epsilon == 1e-3 else "epsilon must be a finite number >= 0"
    with pytest.raises(InputError, match=match):
        ex.explain(TEXTS[:1], methods=["partiallrp"], options={"partiallrp": {"epsilon": epsilon}})


def test_start_layer_error_names_the_valid_range(tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)  # 2 layers
    with pytest.raises(InputError, match=r"start_layer=11 is out of range .* 2 layers: use 0 to 1, or -1 to -2"):
        ex.explain(TEXTS[:1], methods=["transatt"], options={"transatt": {"start_layer": 11}})


@pytest.mark.slow
def test_real_model_defaults_reproduce_reference(minilm_sst2):
    # minilm-sst2 (float16-stored weights), SST-2 dev sentences explained for their gold label; 12 and 17 have
    # exact zeros in their embedding sums (a pass-through rule that zeroed them would change their ranking).
    lines = SST2_DEV.read_text().splitlines()
    rows = [json.loads(lines[i]) for i in (0, 1, 2, 4, 12, 17)]
    labels = [r["label"] for r in rows]
    exps = minilm_sst2.explain([r["text"] for r in rows], methods=["transatt", "partiallrp"], target=labels)
    model = minilm_sst2.model.eval()
    for e, y in zip(exps, labels, strict=True):
        _, rel, grads = chefer_relprop(model, torch.tensor(e.input_ids), y)
        for name, ref in (("transatt", rollout_row(grads, rel)), ("partiallrp", last_layer_row(rel))):
            ours, ref = e.scores[name], ref.numpy()
            assert spearmanr(ours[1:], ref[1:]).correlation >= 0.99, name  # [CLS] apart, as the authors
            np.testing.assert_allclose(ours / np.abs(ref).max(), ref / np.abs(ref).max(), rtol=0, atol=1e-3,
                                       err_msg=name)
