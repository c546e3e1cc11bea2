"""LRP pass and the LRP methods: rules against explicit formulas, conservation, padding, batching, model state."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import CLS, ENCODERS, PAD, SEP, V, make_model
from torch import nn

from attnlens import Explainer
from attnlens.core import engine
from attnlens.core.memory import model_dims
from attnlens.errors import AttnLensError, InputError, ModelError
from attnlens.lrp import lrp_pass, rules, supports
from attnlens.methods import get_method
from attnlens.methods.lrp_methods import kept_pass_dims
from attnlens.models.heads import QAHead, TokenHead
from attnlens.testing.tiny_models import build_tiny

TEXTS = ["the movie was great", "i really didn ' t like this boring plot , but the actors were charming", "awful"]


def bias_free(family: str, seed: int = 0) -> nn.Module:
    model = make_model(family, num_labels=3, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    return model


def padded_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask}


# ---------------------------------------------------------------- rules vs explicit LRP formulas
def test_epsilon_rule_equals_explicit_formula():
    torch.manual_seed(0)
    lin = nn.Linear(5, 4)
    x = torch.randn(2, 5, requires_grad=True)
    rel_out = torch.randn(2, 4)
    eps = 0.1
    z = rules.linear(lin, x, eps)
    (g,) = torch.autograd.grad(z, x, rel_out / z.detach())  # relevance R_z enters as gradient R_z / z
    ours = (x * g).detach()
    zz = lin(x).detach()
    explicit = torch.zeros(2, 5)
    for b in range(2):
        for i in range(5):
            for j in range(4):
                denom = zz[b, j] + eps * (1.0 if zz[b, j] >= 0 else -1.0)
                explicit[b, i] += x[b, i].detach() * lin.weight[j, i].detach() * rel_out[b, j] / denom
    torch.testing.assert_close(ours, explicit, rtol=1e-5, atol=1e-6)


def test_identity_rule_passes_relevance_elementwise():
    x = torch.tensor([-2.0, -0.3, 0.0, 0.5, 3.0], requires_grad=True)
    y = rules.identity_rule(nn.functional.gelu, x)
    torch.testing.assert_close(y, nn.functional.gelu(x))
    grad_y = torch.tensor([1.0, 2.0, 3.0, -1.0, 0.5])
    (g,) = torch.autograd.grad(y, x, grad_y)
    torch.testing.assert_close(x * g, y.detach() * grad_y)  # R_x = R_y


def test_softmax_gradient_x_input_is_the_attnlrp_softmax_rule():
    # AttnLRP Prop. 3.1: R_x_i = x_i (R_i - s_i sum_j R_j) with R_j = s_j g_j the relevance at the output.
    torch.manual_seed(1)
    x = torch.randn(6, requires_grad=True)
    s = torch.softmax(x, -1)
    g_out = torch.randn(6)
    (g,) = torch.autograd.grad(s, x, g_out)
    r_out = (s * g_out).detach()
    explicit = x.detach() * (r_out - s.detach() * r_out.sum())
    torch.testing.assert_close(x.detach() * g, explicit)


def test_layer_norm_rule_is_linear_map_with_frozen_std():
    torch.manual_seed(2)
    ln = nn.LayerNorm(6)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.zero_()
    x = torch.randn(6, requires_grad=True)
    y = rules.layer_norm(ln, x)
    torch.testing.assert_close(y, ln(x))
    rel_out = torch.randn(6)
    (g,) = torch.autograd.grad(y, x, rel_out / y.detach())
    std = (x.detach().var(unbiased=False) + ln.eps).sqrt()
    w = ln.weight.detach()[:, None] * (torch.eye(6) - 1 / 6) / std  # y_j = sum_i w[j, i] x_i
    explicit = torch.stack([sum(x[i].detach() * w[j, i] * rel_out[j] / y[j].detach() for j in range(6))
                            for i in range(6)])
    torch.testing.assert_close(x.detach() * g, explicit, rtol=1e-4, atol=1e-6)
    assert abs(float((x * g).detach().sum() - rel_out.sum())) < 1e-4  # bias-free: conserved


def _explicit_attnlrp_bert(model, ids: torch.Tensor, target: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """AttnLRP for a 1-layer BERT written out rule by rule (no autograd), batch of one, float64; its head a
    sequence classifier (``target`` a class), a token classifier (``(position, class)``) or extractive QA
    (``(start, end)``: the start logit at one position plus the end logit at the other).

    Returns the relevance of the summed input embeddings (n,) and of the attention probabilities (H, n, n).
    """
    def lin_rel(x, lin, z, r):  # epsilon/LRP-0 rule: R_x = x * W^T (R_z / z)
        return x * ((r / z) @ lin.weight)

    def ln_rel(x, ln, y, r):  # LayerNorm with constant std: y = M x + beta, M = diag(gamma)(I - 1/D)/std
        d = x.shape[-1]
        std = (x.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()
        m = ln.weight[None, :, None] * (torch.eye(d, dtype=x.dtype) - 1.0 / d)[None] / std[:, :, None]
        return x * torch.einsum("nji,nj->ni", m, r / y)

    bert, n = model.bert, ids.shape[0]
    emb, layer = bert.embeddings, bert.encoder.layer[0]
    sa, h_n = layer.attention.self, model.config.num_attention_heads
    e_sum = emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[:n] + emb.token_type_embeddings.weight[0]
    h0 = emb.LayerNorm(e_sum)
    q, k, v = sa.query(h0), sa.key(h0), sa.value(h0)
    heads = lambda t: t.view(n, h_n, -1).transpose(0, 1)  # noqa: E731
    scale = sa.attention_head_size ** -0.5
    scores = torch.einsum("hqd,hkd->hqk", heads(q), heads(k)) * scale
    a = scores.softmax(-1)
    ctx = torch.einsum("hqk,hkd->hqd", a, heads(v))
    ctx_flat = ctx.transpose(0, 1).reshape(n, -1)
    ao = layer.attention.output.dense(ctx_flat)
    r1 = ao + h0
    h1 = layer.attention.output.LayerNorm(r1)
    inter = layer.intermediate.dense(h1)
    act = nn.functional.gelu(inter)
    out = layer.output.dense(act)
    r2 = out + h1
    h2 = layer.output.LayerNorm(r2)
    if hasattr(model, "qa_outputs") or type(model).__name__.endswith("TokenClassification"):
        head = getattr(model, "qa_outputs", None) or model.classifier
        logits = head(h2)  # (n, 2) start and end logits / (n, C) per token
        r_logits = torch.zeros_like(logits)
        for pos, col in ([(target[0], 0), (target[1], 1)] if hasattr(model, "qa_outputs") else [target]):
            r_logits[pos, col] = logits[pos, col]
        r_h2 = lin_rel(h2, head, logits, r_logits)
    else:
        pre = model.bert.pooler.dense(h2[:1])
        pooled = torch.tanh(pre)
        logits = model.classifier(pooled)
        r_logits = torch.zeros_like(logits)
        r_logits[0, target] = logits[0, target]
        r_pre = lin_rel(pooled, model.classifier, logits, r_logits)  # tanh: identity rule
        r_h2 = torch.zeros_like(h2)
        r_h2[:1] = lin_rel(h2[:1], model.bert.pooler.dense, pre, r_pre)
    r_r2 = ln_rel(r2, layer.output.LayerNorm, h2, r_h2)
    r_act = lin_rel(act, layer.output.dense, out, out * r_r2 / r2)  # residual sum: proportional split
    r_h1 = h1 * r_r2 / r2 + lin_rel(h1, layer.intermediate.dense, inter, r_act)  # GELU: identity rule
    r_r1 = ln_rel(r1, layer.attention.output.LayerNorm, h1, r_h1)
    r_ctx = lin_rel(ctx_flat, layer.attention.output.dense, ao, ao * r_r1 / r1)
    r_ctx = heads(r_ctx) / ctx
    r_a = 0.5 * torch.einsum("hqk,hkd,hqd->hqk", a, heads(v), r_ctx)  # uniform rule on A V
    r_v = 0.5 * torch.einsum("hqk,hkd,hqd->hkd", a, heads(v), r_ctx)
    r_s = scores * (r_a - a * r_a.sum(-1, keepdim=True))  # AttnLRP softmax rule
    r_q = 0.5 * torch.einsum("hqd,hkd,hqk->hqd", heads(q), heads(k), scale * r_s / scores)
    r_k = 0.5 * torch.einsum("hqd,hkd,hqk->hkd", heads(q), heads(k), scale * r_s / scores)
    flat = lambda t: t.transpose(0, 1).reshape(n, -1)  # noqa: E731
    r_h0 = (h0 * r_r1 / r1 + lin_rel(h0, sa.query, q, flat(r_q)) + lin_rel(h0, sa.key, k, flat(r_k))
            + lin_rel(h0, sa.value, v, flat(r_v)))
    r_e = ln_rel(e_sum, emb.LayerNorm, h0, r_h0)
    return r_e.sum(-1), r_a


@pytest.mark.parametrize(("task", "target"), [("SequenceClassification", 1), ("TokenClassification", (4, 2)),
                                              ("QuestionAnswering", (2, 4))])
def test_whole_pass_equals_explicit_rule_by_rule_propagation(task, target):
    import transformers
    from transformers import BertConfig

    torch.manual_seed(8)
    cfg = BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
                     max_position_embeddings=16, initializer_range=0.4, attn_implementation="eager",
                     num_labels=2 if task == "QuestionAnswering" else 3)
    model = getattr(transformers, f"BertFor{task}")(cfg).double().eval()
    ids = torch.tensor([2, 7, 13, 21, 5, 3])
    with torch.no_grad():
        expected_input, expected_att = _explicit_attnlrp_bert(model, ids, target=target)
    head = {"TokenClassification": TokenHead(), "QuestionAnswering": QAHead()}.get(task)
    res = lrp_pass(model, {"input_ids": ids[None], "attention_mask": torch.ones(1, 6, dtype=torch.long)},
                   torch.tensor([target]) if head else target, head=head)
    torch.testing.assert_close(res.input_relevance[0], expected_input, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(res.attention_relevance[0][0], expected_att, rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------- conservation
@pytest.mark.parametrize("family", ENCODERS)
def test_conservation_cp_rules_bias_free(family):
    # CP-LRP cuts the softmax branch: every remaining rule is conservative, so without biases the input
    # relevance adds up to the target logit. Tolerance: 1e-4 relative + 1e-5 absolute (float32 sums).
    model = bias_free(family)
    res = lrp_pass(model, padded_batch(), [0, 1, 2], rules="cp")
    torch.testing.assert_close(res.input_relevance.sum(1), res.target, rtol=1e-4, atol=1e-5)
    assert res.target.abs().min() > 1e-3  # the check is not vacuous


@pytest.mark.parametrize("family", ENCODERS)
def test_conservation_attnlrp_up_to_softmax_absorption(family):
    # AttnLRP's softmax rule is the only non-conservative step of a bias-free model: input relevance plus the
    # relevance the softmaxes absorbed equals the target logit (same tolerance).
    model = bias_free(family)
    res = lrp_pass(model, padded_batch(), [2, 0, 1], track_softmax=True)
    torch.testing.assert_close(res.input_relevance.sum(1) + res.softmax_absorbed, res.target, rtol=1e-4, atol=1e-5)
    assert res.softmax_absorbed.abs().max() > 1e-5  # the softmax rule does absorb something


def test_epsilon_rule_absorbs_a_little_relevance():
    model = bias_free("bert")
    inputs = padded_batch(3)
    exact = lrp_pass(model, inputs, 1, rules="cp", epsilon=0.0)
    small = lrp_pass(model, inputs, 1, rules="cp", epsilon=1e-6)
    big = lrp_pass(model, inputs, 1, rules="cp", epsilon=1.0)
    torch.testing.assert_close(small.input_relevance.sum(1), exact.target, rtol=1e-3, atol=1e-5)
    gap = (big.input_relevance.sum(1) - big.target).abs()
    assert (gap > 1e-3 * big.target.abs()).all()  # a large epsilon visibly absorbs relevance
    torch.testing.assert_close(small.logits, exact.logits)


def test_log_probability_target_starts_from_the_softmax_rule():
    # target_kind="loss": relevance of logit k is logit_k * d log p_c / d logit_k, so the CP total is
    # logit_c - sum_k p_k logit_k.
    model = bias_free("distilbert")
    res = lrp_pass(model, padded_batch(), [0, 1, 2], "loss", rules="cp")
    p = res.logits.softmax(-1)
    expected = res.logits[torch.arange(3), torch.tensor([0, 1, 2])] - (p * res.logits).sum(-1)
    torch.testing.assert_close(res.input_relevance.sum(1), expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the authors' rule set ("chefer")
@pytest.mark.parametrize("shared", [True, False])
def test_zplus_rule_equals_explicit_formula(shared):
    torch.manual_seed(4)
    lin = nn.Linear(5, 4)
    x = torch.randn(2, 5, requires_grad=True)
    rel_out = torch.rand(2, 4)
    z = rules.zplus_linear(lin, x, shared=shared)
    torch.testing.assert_close(z, lin(x))
    (g,) = torch.autograd.grad(z, x, rel_out / z.detach())
    w, xd = lin.weight.detach(), x.detach()
    explicit = torch.zeros(2, 5)
    for b in range(2):
        for j in range(4):
            contrib = [max(xd[b, i] * w[j, i], 0.0) if xd[b, i] > 0 else (xd[b, i] * w[j, i] if w[j, i] < 0 else 0.0)
                       for i in range(5)]  # x+ W+ and x- W- terms: the positive contributions
            pos = sum(c for i, c in enumerate(contrib) if xd[b, i] > 0)
            neg = sum(c for i, c in enumerate(contrib) if xd[b, i] <= 0)
            for i in range(5):
                denom = pos + neg if shared else (pos if xd[b, i] > 0 else neg)
                explicit[b, i] += contrib[i] * rel_out[b, j] / denom if denom else 0.0
    torch.testing.assert_close(xd * g, explicit, rtol=1e-5, atol=1e-6)
    if shared:
        torch.testing.assert_close((xd * g).sum(1), rel_out.sum(1))  # conservative, bias ignored


def test_normalized_residual_splits_per_example():
    torch.manual_seed(5)
    a = torch.randn(3, 4, 2, requires_grad=True)
    b = torch.randn(3, 4, 2, requires_grad=True)
    g_out = torch.randn(3, 4, 2)
    total = a + b
    out = rules.normalized_residual(total, b)
    torch.testing.assert_close(out, total)
    ga, gb = torch.autograd.grad(out, [a, b], g_out)
    for ex in range(3):  # Chefer's Add.relprop on one example at a time
        ra, rb = (a[ex] * g_out[ex]).detach(), (b[ex] * g_out[ex]).detach()
        r_sum = ra.sum() + rb.sum()
        fa = ra.sum().abs() / (ra.sum().abs() + rb.sum().abs()) * r_sum
        fb = rb.sum().abs() / (ra.sum().abs() + rb.sum().abs()) * r_sum
        torch.testing.assert_close((a[ex] * ga[ex]).detach(), ra * fa / ra.sum())
        torch.testing.assert_close((b[ex] * gb[ex]).detach(), rb * fb / rb.sum())


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "electra"])
def test_chefer_rules_conserve_relevance_one_with_biases(family):
    # The authors' rules are all conservative (z+ ignores biases), and relevance starts at 1: with biases the
    # input relevance of each example sums to 1 (tolerance 1e-4; rows whose z+ denominator is 0 would lose some).
    model = make_model(family, num_labels=3)
    res = lrp_pass(model, padded_batch(), [0, 1, 2], rules="chefer")
    torch.testing.assert_close(res.input_relevance.sum(1), torch.ones(3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ENCODERS)
@pytest.mark.parametrize("rule_set", ["chefer", "chefer-lrp"])
def test_chefer_rules_batch_invariance(family, rule_set):
    # Per-example normalisation of the residual rule: a batch equals its examples one by one (float64: the
    # identity rules divide by activations, which amplifies float32 rounding to ~1e-5 in ALBERT).
    model = make_model(family, num_labels=3).double()
    inputs = padded_batch(6)
    res = lrp_pass(model, inputs, [2, 0, 1], rules=rule_set)
    pad = inputs["attention_mask"] == 0
    assert (res.input_relevance[pad] == 0).all()
    for b, t in enumerate([2, 0, 1]):
        n = int(inputs["attention_mask"][b].sum())
        one = lrp_pass(model, {k: v[b : b + 1, :n] for k, v in inputs.items()}, t, rules=rule_set)
        torch.testing.assert_close(res.input_relevance[b, :n], one.input_relevance[0], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(res.attention_relevance[-1][b, :, :n, :n], one.attention_relevance[-1][0],
                                   rtol=1e-9, atol=1e-10)


# ---------------------------------------------------------------- padding, batching, model state
@pytest.mark.parametrize("family", ENCODERS)
@pytest.mark.parametrize("rule_set", ["attnlrp", "cp"])
def test_padding_is_exactly_zero_and_batch_invariance(family, rule_set):
    assert_padding_zero_and_batch_invariant(make_model(family, num_labels=3), rule_set, rtol=1e-5, atol=1e-5)


def assert_padding_zero_and_batch_invariant(model: nn.Module, rule_set: str, rtol: float, atol: float,
                                            position: bool = False) -> None:
    """LRP of a padded batch of three: every relevance at padding is exactly 0 and each example equals its
    unpadded self alone (input and attention relevance; ``position``: the position relevance too)."""
    inputs = padded_batch(5)
    targets = [1, 2, 0]
    res = lrp_pass(model, inputs, targets, rules=rule_set)
    pad = inputs["attention_mask"] == 0
    assert (res.input_relevance[pad] == 0).all() and (res.word_relevance[pad] == 0).all()
    for r in res.attention_relevance:
        assert (r.permute(0, 2, 3, 1)[pad] == 0).all()  # padded query rows
        assert (r.permute(0, 3, 2, 1)[pad] == 0).all()  # padded key columns
    for b in range(3):
        n = int(inputs["attention_mask"][b].sum())
        one = lrp_pass(model, {k: v[b : b + 1, :n] for k, v in inputs.items()}, targets[b], rules=rule_set)
        torch.testing.assert_close(res.input_relevance[b, :n], one.input_relevance[0], rtol=rtol, atol=atol)
        if position:
            torch.testing.assert_close(res.position_relevance[b], one.position_relevance[0], rtol=rtol, atol=atol)
        for r_batch, r_one in zip(res.attention_relevance, one.attention_relevance):
            torch.testing.assert_close(r_batch[b, :, :n, :n], r_one[0], rtol=rtol, atol=atol)


def _snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "forward": {name: m.__dict__.get("forward") for name, m in model.named_modules()},
        "training": {name: m.training for name, m in model.named_modules()},
        "hooks": {name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                  for name, m in model.named_modules()},
        "requires_grad": {k: p.requires_grad for k, p in model.named_parameters()},
        "attn": model.config._attn_implementation,
    }


def _assert_unchanged(model: nn.Module, before: dict) -> None:
    after = _snapshot(model)
    for k in before["state"]:
        assert torch.equal(before["state"][k], after["state"][k]), k
    for key in ("forward", "training", "hooks", "requires_grad", "attn"):
        assert before[key] == after[key], key
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("family,rule_set", [("bert", "attnlrp"), ("roberta", "chefer"), ("albert", "chefer"),
                                             ("distilbert", "cp")])
def test_model_left_unchanged(family, rule_set):
    model = make_model(family, attn="sdpa").train()
    model.classifier.eval()  # mixed training flags must survive
    next(model.parameters()).requires_grad_(False)
    before = _snapshot(model)
    eps = 0.0 if rule_set == "chefer" else 1e-3  # the z+ rule has no epsilon
    res = lrp_pass(model, padded_batch(), 1, rules=rule_set, epsilon=eps)
    _assert_unchanged(model, before)
    assert len(res.attentions) == getattr(model.config, "num_hidden_layers", getattr(model.config, "n_layers", 0))
    with torch.no_grad():  # the LRP forward computes the model's own logits (in eval mode)
        model.eval()
        torch.testing.assert_close(res.logits, model(**padded_batch()).logits, rtol=1e-5, atol=1e-6)


def test_model_restored_after_an_error():
    model = make_model("bert")
    before = _snapshot(model)
    bad = padded_batch()
    bad["input_ids"] = bad["input_ids"] + 1000  # out of the vocabulary: fails inside the patched forward
    with pytest.raises(IndexError):
        lrp_pass(model, bad, 0)
    _assert_unchanged(model, before)
    with pytest.raises(InputError, match="targets"):
        lrp_pass(model, padded_batch(), 7)
    _assert_unchanged(model, before)


@pytest.fixture
def t5_without_lrp():
    """T5's entry without its LRP facts (every registered type has them), restored afterwards."""
    from dataclasses import replace

    from attnlens.models.architectures import ARCHITECTURES, register_architecture

    saved = ARCHITECTURES["t5"]
    register_architecture(replace(saved, lrp=None))
    yield
    register_architecture(saved)


def test_unsupported_architecture_is_a_clear_error(t5_without_lrp, tokenizer):
    model = make_model("t5")
    assert not supports(model) and supports(make_model("electra"))
    with pytest.raises(ModelError, match="BERT, RoBERTa, DistilBERT, ALBERT, ELECTRA"):
        lrp_pass(model, padded_batch(), 0)
    with pytest.raises(AttnLensError, match="LRP methods .* support BERT"):  # the engine may raise InputError
        Explainer(model, tokenizer).explain(TEXTS[:1], methods=["attnlrp"])


def test_bad_options_are_input_errors(tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.raises(InputError, match="rules"):
        ex.explain(TEXTS[:1], methods=["partiallrp"], options={"partiallrp": {"rules": "magic"}})
    with pytest.raises(InputError, match="start_layer"):
        ex.explain(TEXTS[:1], methods=["transatt"], options={"transatt": {"start_layer": 5}})
    with pytest.raises(InputError, match="input"):
        ex.explain(TEXTS[:1], methods=["attnlrp"], options={"attnlrp": {"input": "hidden"}})


# ---------------------------------------------------------------- the registered methods
LRP_METHODS = ["partiallrp", "transatt", "attnlrp", "flow"]


def test_rule_options_through_explainer(tokenizer):
    ex = Explainer(make_model("roberta"), tokenizer)
    opts = {m: {"rules": "attnlrp"} for m in ("partiallrp", "transatt")}
    opts["attnlrp"] = {"rules": "cp"}
    opts["transatt"]["start_layer"] = -1
    (e,) = ex.explain(TEXTS[1:2], methods=["partiallrp", "transatt", "attnlrp"], options=opts)
    (d,) = ex.explain(TEXTS[1:2], methods=["partiallrp", "transatt", "attnlrp"])
    model = ex.model
    inputs = {"input_ids": torch.tensor([e.input_ids]), "attention_mask": torch.ones(1, len(e.input_ids), dtype=int)}
    chefer = lrp_pass(model, inputs, e.target, rules="chefer")
    assert abs(chefer.input_relevance.sum() - 1) < 1e-4  # the authors' rules start from relevance 1
    assert not np.allclose(e.scores["partiallrp"], d.scores["partiallrp"])
    assert not np.allclose(e.scores["attnlrp"], d.scores["attnlrp"])
    assert "transatt" not in e.layers and d.layers["transatt"].shape == (2, len(d.tokens))
    with pytest.raises(InputError, match="attnlrp takes rules 'attnlrp' .* or 'cp'"):
        ex.explain(TEXTS[1:2], methods=["attnlrp"], options={"attnlrp": {"rules": "chefer"}})


@pytest.mark.parametrize("family", ENCODERS)
def test_methods_through_explainer(family, tokenizer):
    ex = Explainer(make_model(family), tokenizer)
    batch = ex.explain(TEXTS, methods=LRP_METHODS, batch_size=3)
    for text, e in zip(TEXTS, batch):
        for m in LRP_METHODS:
            assert e.scores[m].shape == (len(e.tokens),) and np.isfinite(e.scores[m]).all(), m
        assert (e.scores["partiallrp"] >= 0).all() and (e.scores["transatt"] >= 0).all()
        assert "partiallrp" not in e.layers  # its per-layer view is an option
        (single,) = ex.explain([text], methods=LRP_METHODS)
        for m in LRP_METHODS:
            np.testing.assert_allclose(e.scores[m], single.scores[m], rtol=1e-5, atol=1e-5, err_msg=m)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_partiallrp_alone_stops_at_the_last_layer_with_the_same_scores(family, tokenizer):
    """PartialLRP alone runs a pass that stops at the last layer's attention; its scores equal those it reads from
    a whole pass (shared with TransAtt, or its own with ``layers=True``, which also gives every layer's row, the
    last one the score), batched or one by one."""
    ex = Explainer(make_model(family), tokenizer)
    alone = ex.explain(TEXTS, methods=["partiallrp"], batch_size=3)
    shared = ex.explain(TEXTS, methods=["partiallrp", "transatt"], batch_size=3)
    every = ex.explain(TEXTS, methods=["partiallrp"], options={"partiallrp": {"layers": True}})
    for text, a, s, e in zip(TEXTS, alone, shared, every):
        np.testing.assert_allclose(a.scores["partiallrp"], s.scores["partiallrp"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(a.scores["partiallrp"], e.scores["partiallrp"], rtol=1e-5, atol=1e-7)
        assert "partiallrp" not in a.layers and e.layers["partiallrp"].shape == (2, len(e.tokens))
        np.testing.assert_allclose(e.layers["partiallrp"][-1], e.scores["partiallrp"], rtol=1e-6)
        (single,) = ex.explain([text], methods=["partiallrp"])
        np.testing.assert_allclose(a.scores["partiallrp"], single.scores["partiallrp"], rtol=1e-5, atol=1e-7)
    with pytest.raises(InputError, match="partiallrp layers must be True or False"):
        ex.explain(TEXTS[:1], methods=["partiallrp"], options={"partiallrp": {"layers": "yes"}})


def test_methods_equal_loop_recomputation(tokenizer):
    model = make_model("bert")
    ex = Explainer(model, tokenizer)
    text = "i really didn ' t like this boring plot"
    opts = {"transatt": {"start_layer": 0}}
    (e,) = ex.explain([text], methods=["partiallrp", "transatt", "attnlrp", "grads"], target=1, options=opts)
    inputs = {"input_ids": torch.tensor([e.input_ids]), "attention_mask": torch.ones(1, len(e.input_ids), dtype=int)}
    inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    res = lrp_pass(model, inputs, 1, rules="chefer")  # the default rules of partiallrp and transatt
    n = len(e.tokens)
    r_last = res.attention_relevance[-1][0].numpy()
    expected = np.array([np.mean([max(r_last[h, 0, j], 0.0) for h in range(r_last.shape[0])]) for j in range(n)])
    np.testing.assert_allclose(e.scores["partiallrp"], expected, rtol=1e-5, atol=1e-7)
    res_attnlrp = lrp_pass(model, inputs, 1)  # attnlrp's default rules
    np.testing.assert_allclose(e.scores["attnlrp"], res_attnlrp.input_relevance[0].numpy(), rtol=1e-5, atol=1e-7)
    # TransAtt with plain-gradient attention grads from a fresh autograd pass, rollout by explicit loops
    atts = []
    model.eval()
    out = model(**inputs, output_attentions=True)
    grads = torch.autograd.grad(out.logits[0, 1], list(out.attentions))
    joint = np.eye(n)
    for g, r in zip(grads, res.attention_relevance):
        prod = (g[0] * r[0]).numpy()
        a_bar = np.zeros((n, n))
        for i in range(n):
            for j in range(n):
                a_bar[i, j] = np.mean([max(prod[h, i, j], 0.0) for h in range(prod.shape[0])])
        m = a_bar + np.eye(n)
        m = m / m.sum(1, keepdims=True)
        joint = m @ joint
        atts.append(m)
    np.testing.assert_allclose(e.scores["transatt"], joint[0], rtol=1e-4, atol=1e-6)


def test_transatt_from_the_last_layer_is_its_one_layer_formula(tokenizer):
    model = make_model("bert")
    ex = Explainer(model, tokenizer)
    opts = {"transatt": {"start_layer": -1}}
    (e,) = ex.explain(["a charming and often boring plot"], methods=["transatt"], target=1, options=opts)
    ids = torch.tensor([e.input_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
    res = lrp_pass(model, inputs, 1, rules="chefer")
    out = model(**inputs, output_attentions=True)
    (g,) = torch.autograd.grad(out.logits[0, 1], [out.attentions[-1]])
    a_bar = (g[0] * res.attention_relevance[-1][0]).clamp(min=0).mean(0) + torch.eye(len(e.tokens))
    np.testing.assert_allclose(e.scores["transatt"], (a_bar / a_bar.sum(-1, keepdim=True))[0].numpy(), rtol=1e-5,
                               atol=1e-7)
    assert "transatt" not in e.layers


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_transatt_from_the_last_layer_reads_a_pass_that_stops_there(family, tokenizer, monkeypatch):
    """``start_layer=-1`` alone runs the LRP pass that stops at the last layer; its scores equal those read from
    a whole pass (``start_layer=1``, the same layer of these two-layer models), batched or one by one."""
    from attnlens.methods import lrp_methods

    stops = []
    real = lrp_methods.lrp_pass
    monkeypatch.setattr(lrp_methods, "lrp_pass", lambda *a, **k: stops.append(k["last_layer_only"]) or real(*a, **k))
    ex = Explainer(make_model(family), tokenizer)
    last = ex.explain(TEXTS, methods=["transatt"], options={"transatt": {"start_layer": -1}}, batch_size=3)
    whole = ex.explain(TEXTS, methods=["transatt"], options={"transatt": {"start_layer": 1}}, batch_size=3)
    assert stops == [True, False]
    for text, a, b in zip(TEXTS, last, whole):
        np.testing.assert_allclose(a.scores["transatt"], b.scores["transatt"], rtol=1e-5, atol=1e-7)
        (one,) = ex.explain([text], methods=["transatt"], options={"transatt": {"start_layer": -1}})
        np.testing.assert_allclose(a.scores["transatt"], one.scores["transatt"], rtol=1e-5, atol=1e-7)


def test_shared_pass_runs_once_per_batch(tokenizer):
    # forwards of the model per batch: the capture pass, then one LRP forward per rule set, except that the
    # chefer and attnlrp rule sets (partiallrp/transatt's and attnlrp's defaults) share one
    model = make_model("bert")
    # what AttnLRP's fused pass and the shared pass keep is counted once per model, on two short probes: not a
    # pass over the inputs
    kept_pass_dims(model, model_dims(model))
    ex = Explainer(model, tokenizer)
    engine.pass_cost(ex.runner, [get_method(m) for m in ("partiallrp", "transatt")])
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))

    def run(methods, **options):
        forwards.clear()
        out = ex.explain(TEXTS, methods=methods, batch_size=2, options=options)
        return len(forwards), out

    n, pair = run(["partiallrp", "transatt"])
    assert n == 4  # two batches: capture + one chefer pass each
    n, alone = run(["attnlrp"])
    assert n == 4
    n, trio = run(["partiallrp", "transatt", "attnlrp"])
    assert n == 4  # capture + one forward serving both rule sets
    for a, b, c in zip(pair, alone, trio):  # float32 passes: rounding of the seventh digit (1.8e-5 with AVX-512)
        for m in ("partiallrp", "transatt"):
            np.testing.assert_allclose(c.scores[m], a.scores[m], rtol=5e-5, atol=1e-6)
        np.testing.assert_allclose(c.scores["attnlrp"], b.scores["attnlrp"], rtol=5e-5, atol=1e-6)
    n, eps = run(["partiallrp", "transatt", "attnlrp"], attnlrp={"epsilon": 0.1})
    assert n == 6  # another epsilon: its own pass
    n, _ = run(["partiallrp", "attnlrp"], partiallrp={"rules": "attnlrp"})
    assert n == 4  # both read the one attnlrp pass
    for a, b in zip(trio, eps):
        np.testing.assert_allclose(b.scores["transatt"], a.scores["transatt"], rtol=1e-5, atol=1e-7)
        assert not np.allclose(b.scores["attnlrp"], a.scores["attnlrp"])


@pytest.mark.slow
def test_real_model_minilm_sst2(minilm_sst2):
    texts = ["a gorgeous , witty , seductive movie .", "the plot is nothing but boilerplate clichés ."]
    exps = minilm_sst2.explain(texts, methods=LRP_METHODS, target=1)
    for e in exps:
        for m in LRP_METHODS:
            assert np.isfinite(e.scores[m]).all() and np.abs(e.scores[m]).max() > 0, m
    pos = exps[0]
    words = [t for t, s in zip(pos.tokens, pos.special) if not s]
    top = words[int(np.argmax(pos.scores["attnlrp"][~np.array(pos.special)]))]
    assert top in {"gorgeous", "witty", "seductive"}, top  # positive evidence for the positive class


@pytest.mark.parametrize(("copy", "original"), [("xlm-roberta", "roberta"), ("camembert", "roberta"),
                                                ("ernie", "bert")])
@pytest.mark.parametrize("rule_set", ["attnlrp", "cp", "chefer", "chefer-lrp"])
def test_a_copy_of_an_architecture_gets_the_original_relevance(copy, original, rule_set):
    """XLM-R and CamemBERT are RoBERTa's modules under other class names, ERNIE is BERT's (with no task-type
    embeddings): with the same weights, every rule set gives the original's relevance."""
    import transformers

    model = make_model(copy, num_labels=3)
    config = getattr(transformers, {"roberta": "RobertaConfig", "bert": "BertConfig"}[original])(
        **{k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "architectures")})
    config._attn_implementation = model.config._attn_implementation
    twin = getattr(transformers, {"roberta": "RobertaForSequenceClassification",
                                  "bert": "BertForSequenceClassification"}[original])(config).eval()
    state = {k.replace("ernie.", "bert.", 1): v for k, v in model.state_dict().items()}
    assert not set(twin.load_state_dict(state, strict=False).missing_keys)
    inputs = padded_batch(3)
    got, want = (lrp_pass(m, inputs, [0, 1, 2], rules=rule_set) for m in (model, twin))
    torch.testing.assert_close(got.input_relevance, want.input_relevance, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.attention_relevance[-1], want.attention_relevance[-1], rtol=1e-6, atol=1e-7)
    assert got.input_relevance.abs().max() > 1e-3


@pytest.mark.parametrize("suffix", ["ForQuestionAnswering", "ForTokenClassification"])
def test_lrp_methods_on_qa_and_token_heads(suffix, tokenizer):
    """The LRP methods start from the head's scalar (a QA span's start + end logits, a token's class logit):
    through the explainer a batch equals its inputs one by one, padding scores 0, the chefer rules give relevance 1
    in all, and AttnLRP of a QA span is the sum of its start and its end explained alone (it is linear). On QA,
    PartialLRP and TransAtt read the span's start and end rows."""
    model = build_tiny("bert", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                       model_suffix=suffix)
    ex = Explainer(model, tokenizer)
    qa = suffix == "ForQuestionAnswering"
    texts = ([("what was good", "the movie was really good"), ("who", "a charming journey but boring")] if qa
             else ["the movie was really good", "bad", "a charming journey but the plot was boring"])
    target = (1, 0) if not qa else None
    methods = ["partiallrp", "transatt", "attnlrp"]
    batch = ex.explain(texts, methods=methods, batch_size=len(texts), target=target)
    for text, e in zip(texts, batch):
        (one,) = ex.explain([text], methods=methods, target=target)
        for m in methods:
            assert np.isfinite(e.scores[m]).all() and np.abs(e.scores[m]).max() > 0, m
            np.testing.assert_allclose(e.scores[m], one.scores[m], rtol=1e-5, atol=1e-6, err_msg=m)
    inputs = padded_batch(3)
    targets = torch.tensor([[1, 3], [2, 2], [0, 2]]) if qa else torch.tensor([[1, 0], [2, 1], [2, 1]])  # real
    head = QAHead() if qa else TokenHead()
    chefer = lrp_pass(model.double(), inputs, targets, head=head, rules="chefer")
    torch.testing.assert_close(chefer.input_relevance.sum(1), torch.ones(3, dtype=torch.float64), rtol=1e-4,
                               atol=1e-4)
    assert (chefer.input_relevance[inputs["attention_mask"] == 0] == 0).all()
    if qa:  # start + end = start alone + end alone
        both = lrp_pass(model, inputs, targets, head=head).input_relevance
        start, end = (lrp_pass(model, inputs, targets, head=_OneEnd(i)).input_relevance for i in (0, 1))
        torch.testing.assert_close(both, start + end, rtol=1e-9, atol=1e-10)
        assert start.abs().max() > 1e-3 and end.abs().max() > 1e-3


class _OneEnd(QAHead):
    """A QA head explaining the start (``end=0``) or the end logit alone."""

    def __init__(self, end: int) -> None:
        super().__init__()
        self.end = end

    def scalar(self, logits, targets, kind, token_mask):
        return self.values(logits, kind, token_mask)[..., self.end].gather(1, targets[:, self.end:][:, :1]).squeeze(1)
