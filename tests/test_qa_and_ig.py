"""Extractive QA support and Captum integrated gradients (completeness), on tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import PAD, make_model, make_tokenizer
from transformers import BertConfig, BertForQuestionAnswering

from attnlens import Explainer, InputError, ModelError
from attnlens.core.engine import batch_context
from attnlens.lrp import lrp_pass
from attnlens.methods.gradient import baseline_ids
from attnlens.models.heads import QAHead

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
    start = qa.explain([(QUESTION, CONTEXT)], methods=["attcat"], target=(best[0], last))[0]
    end = qa.explain([(QUESTION, CONTEXT)], methods=["attcat"], target=(0, best[1]))[0]
    zero = qa.explain([(QUESTION, CONTEXT)], methods=["attcat"], target=(0, last))[0]
    # AttCAT reads no attention row, so it is linear in the gradient:
    # explain(start + end) = explain(start) + explain(end) - explain(anchors)
    np.testing.assert_allclose(e.scores["attcat"], start.scores["attcat"] + end.scores["attcat"]
                               - zero.scores["attcat"], atol=1e-6)
    d = e.to_dict()
    assert d["target"] == best and len(d["probabilities"]) == 2


@pytest.mark.parametrize("span", [None, (9, 11), (10, 10)])
def test_attention_methods_read_the_span_start_and_end_rows(qa, span):
    """The start logit is read from the start token's state and the end logit from the end token's: the
    attention methods read those two query rows, half each (a one-token span: its row), for the predicted span
    too. Reference: an independent pass, autograd of start + end logit, formulas in float64."""
    methods = ["rawatt", "attnnorm", "grads", "agrad", "rollout", "gae", "partiallrp", "transatt"]
    (e,) = qa.explain([(QUESTION, CONTEXT)], methods=methods, target=span)
    s, t = e.target
    enc = qa.tokenizer(QUESTION, CONTEXT, return_tensors="pt")
    out = qa.model(**enc, output_attentions=True)
    grads = torch.autograd.grad(out.start_logits[0, s] + out.end_logits[0, t], out.attentions)
    a = [x[0].detach().double() for x in out.attentions]
    g = [x[0].double() for x in grads]
    w = torch.zeros(a[0].shape[-1], dtype=torch.float64)
    w[s] += 0.5
    w[t] += 0.5
    eye = torch.eye(len(w), dtype=torch.float64)
    roll, gae = eye, eye
    for x, y in zip(a, g, strict=True):
        roll = (0.5 * x.mean(0) + 0.5 * eye) @ roll
        gae = gae + (x * y).clamp(min=0).mean(0) @ gae
    want = {"rawatt": w @ a[-1].mean(0), "grads": w @ g[-1].mean(0), "agrad": w @ (a[-1] * g[-1]).mean(0),
            "rollout": w @ roll, "gae": w @ gae}
    # PartialLRP: the last layer's attention relevance of the span's LRP pass (its own scalar), at the same rows
    relevance = lrp_pass(qa.model, dict(enc), torch.tensor([[s, t]]), head=QAHead(), rules="chefer")
    want["partiallrp"] = w.float() @ relevance.attention_relevance[-1][0].clamp(min=0).mean(0).float()
    for m, v in want.items():
        np.testing.assert_allclose(e.scores[m], v.numpy(), rtol=1e-4, atol=1e-6, err_msg=m)
    assert all(np.abs(e.scores[m]).max() > 1e-3 for m in methods)  # every method reads rows the span feeds


def test_span_rows_kept_alone_by_fused_attention_equal_the_whole_maps(qa):
    """With fused attention the pass keeps only the explained rows: both of each span, resolved first where the
    span is the predicted one; a batch of spans equals each alone."""
    import copy

    fused = copy.deepcopy(qa.model)
    fused.set_attn_implementation("sdpa")
    ex = Explainer(fused, qa.tokenizer)
    methods = ["rawatt", "attnnorm", "grads", "agrad", "attgrads", "rollout", "gae", "globenc", "alti", "flow",
               "valuezeroing", "partiallrp", "transatt", "decompx"]
    pairs = [(QUESTION, CONTEXT), ("who was boring ?", CONTEXT)]
    for targets in (None, [(9, 11), (10, 10)]):
        batch = ex.explain(pairs, methods=methods, target=targets, batch_size=2)
        for i, pair in enumerate(pairs):
            (alone,) = qa.explain([pair], methods=methods, target=tuple(batch[i].target))
            for m in methods:
                np.testing.assert_allclose(batch[i].scores[m], alone.scores[m], rtol=1e-4, atol=1e-6, err_msg=m)


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
