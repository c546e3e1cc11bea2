"""Extractive QA support and Captum integrated gradients (completeness), on tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import PAD, make_model, make_tokenizer
from transformers import BertConfig, BertForQuestionAnswering

from attnlens import Explainer, InputError, ModelError
from attnlens.core.engine import batch_context
from attnlens.methods.gradient import baseline_ids

QUESTION, CONTEXT = "what was the movie ?", "the movie was great but the plot was boring ."


@pytest.fixture(scope="module")
def qa():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=64, initializer_range=0.3, pad_token_id=PAD)
    model = BertForQuestionAnswering(cfg).eval()
    model.set_attn_implementation("eager")
    return Explainer(model, make_tokenizer())


def test_qa_explains_start_plus_end(qa):
    (e,) = qa.explain([(QUESTION, CONTEXT)], methods=["agrad", "attcat", "rawatt"])
    enc = qa.tokenizer(QUESTION, CONTEXT, return_tensors="pt")
    with torch.no_grad():
        out = qa.model(**enc)
    # SQuAD decoding: the best start + end logit over context tokens with start <= end (brute force)
    context = [i for i, s in enumerate(enc.sequence_ids(0)) if s == 1]
    st, en = out.start_logits[0], out.end_logits[0]
    best = list(max(((s, t) for s in context for t in context if s <= t < s + 30), key=lambda p: st[p[0]] + en[p[1]]))
    assert e.predicted == e.target == best
    assert e.meta["task"] == "qa" and e.labels is None
    last = len(e.tokens) - 1  # anchors (0, last) keep every span end >= start
    start = qa.explain([(QUESTION, CONTEXT)], methods=["agrad", "attcat"], target=(best[0], last))[0]
    end = qa.explain([(QUESTION, CONTEXT)], methods=["agrad", "attcat"], target=(0, best[1]))[0]
    zero = qa.explain([(QUESTION, CONTEXT)], methods=["agrad", "attcat"], target=(0, last))[0]
    # linear in the gradient: explain(start + end) = explain(start) + explain(end) - explain(anchors)
    for m in ["agrad", "attcat"]:
        np.testing.assert_allclose(e.scores[m], start.scores[m] + end.scores[m] - zero.scores[m], atol=1e-6)
    d = e.to_dict()
    assert d["target"] == best and len(d["probabilities"]) == 2


def test_qa_model_loads_from_a_directory(qa, tmp_path):
    qa.model.save_pretrained(tmp_path)
    qa.tokenizer.save_pretrained(tmp_path)
    loaded = Explainer.from_pretrained(tmp_path)  # the config names a QA architecture
    assert loaded.head.task == "qa"
    (a,) = loaded.explain([(QUESTION, CONTEXT)], methods=["attcat"])
    (b,) = qa.explain([(QUESTION, CONTEXT)], methods=["attcat"])
    np.testing.assert_allclose(a.scores["attcat"], b.scores["attcat"], atol=1e-6)


def test_qa_target_checks(qa):
    with pytest.raises(InputError, match="beyond its"):
        qa.explain([(QUESTION, CONTEXT)], methods=["agrad"], target=(3, 99))
    with pytest.raises(InputError, match="pair of token positions"):
        qa.explain([(QUESTION, CONTEXT)], methods=["agrad"], target=(5, -2))
    with pytest.raises(ModelError, match="sequence classifiers"):
        qa.predict_proba([[2, 3]])


@pytest.mark.parametrize("family", ["bert", "gpt2", "bart"])
def test_integrated_gradients_completeness(family):
    """Sum of IG attributions = f(x) - f(baseline), up to the Riemann error (Sundararajan et al. 2017)."""
    ex = Explainer(make_model(family), make_tokenizer())
    text = "the plot was boring but the film is great !"  # no [UNK]: it is gpt2's baseline token
    (e,) = ex.explain(text, methods=["integratedgradients"], target=1,
                      options={"integratedgradients": {"n_steps": 300}})
    (enc,) = ex.encode([text])
    ctx = batch_context(ex.runner, [enc], "logit")
    ctx.targets = torch.tensor([1])
    base = baseline_ids(ctx, "auto")
    assert int((base != ctx.inputs["input_ids"]).sum()) == len(enc.ids) - 2  # specials kept
    extra = {}
    if family == "bart":  # the attribution is to the encoder's token embeddings; the decoder keeps reading x
        from transformers.models.bart.modeling_bart import shift_tokens_right

        cfg = ex.model.config
        extra["decoder_input_ids"] = shift_tokens_right(ctx.inputs["input_ids"], cfg.pad_token_id,
                                                        cfg.decoder_start_token_id)
    with torch.no_grad():
        f_x = ex.model(**ctx.inputs).logits[0, 1]
        f_b = ex.model(**{**ctx.inputs, "input_ids": base, **extra}).logits[0, 1]
    assert e.scores["integratedgradients"].sum() == pytest.approx(float(f_x - f_b), rel=0.02, abs=2e-3)
