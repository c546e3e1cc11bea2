"""The core engine on tiny random models of every family: shapes, padding, batching, formulas, model safety."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from conftest import ENCODERS, FAMILIES, make_model

from attnlens import Explainer, InputError, list_methods
from attnlens.core.capture import run_capture
from attnlens.core.engine import batch_context
from attnlens.methods import registry

TEXTS = [
    "i really didn't like this movie .",
    "a charming journey",
    "the plot was boring but the actors were great !",
    "good",
]
CORE = ["rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat", "saliency", "inputxgradient"]


def explainer(family: str, tokenizer, **kw) -> Explainer:
    return Explainer(make_model(family), tokenizer, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_method_runs_with_right_shapes(family, tokenizer):
    ex = explainer(family, tokenizer)
    exps = ex.explain(TEXTS, methods=CORE + ["integratedgradients"], batch_size=3,
                      options={"integratedgradients": {"n_steps": 8}})
    assert len(exps) == len(TEXTS)
    for text, e in zip(TEXTS, exps):
        enc = tokenizer(text)
        assert e.input_ids == enc["input_ids"]
        assert e.tokens[0] == "[CLS]" and e.tokens[-1] == "[SEP]"
        assert e.special[0] and e.special[-1] and not any(e.special[1:-1])
        n = len(e.tokens)
        for m in CORE + ["integratedgradients"]:
            assert e.scores[m].shape == (n,), m
            assert np.isfinite(e.scores[m]).all(), m
        for m in ["rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat"]:
            assert e.layers[m].shape == (2, n), m
        assert abs(sum(e.probabilities) - 1) < 1e-5
        assert e.target == e.predicted == int(np.argmax(e.probabilities))
        for m in CORE:  # every method gives some signal on a non-trivial model
            assert np.abs(e.scores[m]).max() > 0, m


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_scores_exactly_zero_and_batch_invariance(family, tokenizer):
    ex = explainer(family, tokenizer)
    batch = ex.explain(TEXTS, methods=CORE, batch_size=len(TEXTS))
    for text, e in zip(TEXTS, batch):
        (alone,) = ex.explain([text], methods=CORE)
        for m in CORE:
            np.testing.assert_allclose(e.scores[m], alone.scores[m], atol=1e-5, rtol=1e-4, err_msg=m)
        np.testing.assert_allclose(e.probabilities, alone.probabilities, atol=1e-6)
    # padded positions of the raw batch tensors are exactly zero
    encoded = ex.encode(TEXTS)
    specs = [registry.get_method(m) for m in CORE]
    ctx, out = ex.compute_batch(encoded, [-1] * len(TEXTS), specs, {})
    pad = ~ctx.token_mask.bool()
    assert pad.any()
    for m, (scores, layers) in out.items():
        assert torch.all(scores[pad] == 0), m
        if layers is not None:
            assert torch.all(layers.permute(0, 2, 1)[pad] == 0), m


def test_results_come_back_in_input_order(tokenizer):
    ex = explainer("bert", tokenizer)
    texts = ["good", "the plot was boring but the actors were great !", "a charming journey"]
    exps = ex.explain(texts, methods=["rawatt"], batch_size=2)
    assert [e.text for e in exps] == texts


def _loop_reference(capture, b: int) -> dict[str, np.ndarray]:
    """Each method's formula recomputed with plain Python loops for example ``b`` (key space)."""
    A = [a[b].double().numpy() for a in capture.attentions]  # L x (H, Q, K)
    G = [g[b].double().numpy() for g in capture.attention_grads]
    Hs = [h[b].double().numpy() for h in capture.hidden]
    HG = [g[b].double().numpy() for g in capture.hidden_grads]
    w = capture.query_weights[b].double().numpy()
    qmask = capture.query_mask[b].numpy()
    L, H, Q, K = len(A), A[0].shape[0], A[0].shape[1], A[0].shape[2]
    real_q = [i for i in range(Q) if qmask[i]]

    def row(M):  # weighted explained row
        return np.array([sum(w[i] * M[i][j] for i in range(Q)) for j in range(K)])

    def mean_heads(M):
        return sum(M[h] for h in range(H)) / H

    ref = {}
    ref["rawatt"] = row(mean_heads(A[-1]))
    ref["grads"] = row(mean_heads(G[-1]))
    ref["agrad"] = row(mean_heads(A[-1] * G[-1]))
    att = np.zeros(K)
    for l in range(L):
        for h in range(H):
            for i in real_q:
                for j in range(K):
                    att[j] += A[l][h, i, j] * max(G[l][h, i, j], 0.0)
    ref["attgrads"] = att / (L * H * len(real_q))
    eye = np.eye(Q)
    R = eye.copy()
    for l in range(L):
        R = (0.5 * mean_heads(A[l]) + 0.5 * eye) @ R
    ref["rollout"] = row(R)
    R = eye.copy()
    for l in range(L):
        R = R + mean_heads(np.maximum(G[l] * A[l], 0)) @ R
    ref["gae"] = row(R)
    cat = np.zeros(K)
    attcat = np.zeros(K)
    for l in range(L):
        for j in range(K):
            c = sum(HG[l][j, d] * Hs[l][j, d] for d in range(Hs[l].shape[1]))
            alpha = sum(A[l][h, i, j] for h in range(H) for i in real_q) / (H * len(real_q))
            cat[j] += c
            attcat[j] += alpha * c
    ref["cat"] = cat
    ref["attcat"] = attcat
    return ref


@pytest.mark.parametrize(
    "family,attention", [("bert", None), ("distilbert", None), ("gpt2", None), ("llama", None), ("bart", "encoder"),
                         ("bart", "decoder")],
)
def test_formulas_match_loop_recomputation(family, attention, tokenizer):
    ex = explainer(family, tokenizer, attention=attention)
    methods = ["rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat"]
    exps = ex.explain(TEXTS, methods=methods, batch_size=len(TEXTS))
    # recompute the capture independently of the explainer's batching: one example at a time
    for text, e in zip(TEXTS, exps):
        (enc,) = ex.encode([text])
        ctx = batch_context(ex.runner, [enc], "logit")
        with torch.no_grad():
            pass
        capture, _ = run_capture(ex.model, ex.adapter, ctx.inputs, ctx.token_mask, ex.stream,
                                 torch.tensor([e.target]), "logit", gradients=True)
        ref = _loop_reference(capture, 0)
        for m in methods:
            expected = ex.adapter.keys_to_tokens(torch.tensor(ref[m])[None], ex.stream)[0].numpy()
            np.testing.assert_allclose(e.scores[m], expected, atol=1e-5, rtol=1e-4, err_msg=f"{family} {m}")


def test_gradients_equal_autograd_of_the_logit(tokenizer):
    """The captured gradients are d(target logit)/d(tensor): check the embedding one with Captum."""
    ex = explainer("bert", tokenizer)
    (e,) = ex.explain(["the movie was great"], methods=["saliency", "inputxgradient"],
                      options={"saliency": {"abs": False}})
    (c,) = ex.explain(["the movie was great"], methods=["saliency", "inputxgradient"],
                      options={"saliency": {"engine": "captum", "abs": False}, "inputxgradient": {"engine": "captum"}})
    for m in ["saliency", "inputxgradient"]:
        np.testing.assert_allclose(e.scores[m], c.scores[m], atol=1e-6, err_msg=m)


def test_target_switching_and_label_names(tokenizer):
    ex = Explainer(make_model("bert", num_labels=3), tokenizer)
    ex.model.config.id2label = {0: "neg", 1: "neu", 2: "pos"}
    ex.model.config.label2id = {"neg": 0, "neu": 1, "pos": 2}
    text = "the plot was boring but the actors were great !"
    by_class = [ex.explain(text, methods=["agrad", "attcat", "rawatt"], target=t)[0] for t in range(3)]
    assert [e.target for e in by_class] == [0, 1, 2]
    assert not np.allclose(by_class[0].scores["attcat"], by_class[1].scores["attcat"])
    np.testing.assert_allclose(by_class[0].scores["rawatt"], by_class[2].scores["rawatt"])  # class-agnostic
    (named,) = ex.explain(text, methods=["attcat"], target="POS")
    np.testing.assert_allclose(named.scores["attcat"], by_class[2].scores["attcat"])
    assert named.target_label == "pos"
    mixed = ex.explain([text, "good"], methods=["attcat"], target=[2, None])
    np.testing.assert_allclose(mixed[0].scores["attcat"], by_class[2].scores["attcat"], atol=1e-6)
    assert mixed[1].target == mixed[1].predicted


def test_target_kinds_differ_and_loss_needs_labels(tokenizer):
    ex = explainer("bert", tokenizer)
    text = "a charming journey"
    logit = ex.explain(text, methods=["agrad"], target=1)[0].scores["agrad"]
    prob = ex.explain(text, methods=["agrad"], target=1, target_kind="probability")[0].scores["agrad"]
    loss = ex.explain(text, methods=["agrad"], target=1, target_kind="loss")[0].scores["agrad"]
    assert not np.allclose(logit, prob)
    # d log p_t = d z_t - sum_c p_c d z_c: for two classes that is (1 - p_t) * d(z_t - z_other)
    p = ex.explain(text, methods=["rawatt"])[0].probabilities
    z_other = ex.explain(text, methods=["agrad"], target=0)[0].scores["agrad"]
    np.testing.assert_allclose(loss, (1 - p[1]) * (logit - z_other), atol=1e-6)
    np.testing.assert_allclose(prob, p[1] * loss, atol=1e-6)
    from attnlens import InputError

    with pytest.raises(InputError, match="labels"):
        ex.explain(text, methods=["agrad"], target_kind="loss")
    with pytest.raises(InputError, match="^target_kind='loss' explains the loss against given labels"):
        ex.explain([text, text], methods=["agrad"], target=[1, None], target_kind="loss")  # one left to predict


def test_a_token_classifiers_loss_needs_the_tokens_label(tokenizer):
    ex = Explainer(make_model("bert", num_labels=3, model_suffix="ForTokenClassification"), tokenizer)
    text = "a charming journey"
    with pytest.raises(InputError, match=r"a token classifier's as a \(token, label\) pair\)$"):
        ex.explain(text, methods=["agrad"], target=2, target_kind="loss")
    (e,) = ex.explain(text, methods=["agrad"], target=(2, 1), target_kind="loss")
    assert e.target == 1 and e.meta["position"] == 2


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_single_texts_and_pairs_mix_in_one_call_of_an_encoder_decoder_classifier(tokenizer, family):
    """Its head reads each row's last EOS and needs one EOS count per batch: batches never mix singles and pairs,
    and each input is explained (and scored) as alone."""
    ex = explainer(family, tokenizer)
    inputs = ["the movie was great", ("a dull film", "i hated it"), "bad", ("good", "really good fun")]
    together = ex.explain(inputs, methods=["grads"], batch_size=8)
    for text, e in zip(inputs, together, strict=True):
        (alone,) = ex.explain([text], methods=["grads"])
        np.testing.assert_allclose(e.scores["grads"], alone.scores["grads"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(e.probabilities, alone.probabilities, atol=1e-6)
    probs = ex.predict_proba([e.input_ids for e in together], batch_size=8)
    np.testing.assert_allclose(probs, [e.probabilities for e in together], atol=1e-5)


def test_the_encoder_streams_mean_over_queries_is_exact_in_float64(tokenizer):
    """BART's encoder stream reads the mean over the real query rows: weights 1/n built in float64, not rounded
    to float32 (exact only for n a power of two)."""
    model = make_model("bart").double()
    ex = Explainer(model, tokenizer, attention="encoder")
    for text in ["good", "a good movie"]:  # 3 and 5 tokens
        (e,) = ex.explain([text], methods=["rawatt"])
        with torch.no_grad():
            att = model(input_ids=torch.tensor([e.input_ids]), output_attentions=True).encoder_attentions[-1][0]
        np.testing.assert_allclose(e.scores["rawatt"], att.mean(0).mean(0).numpy(), rtol=0, atol=1e-14)


def test_sentence_pairs_pass_token_types(tokenizer):
    ex = explainer("bert", tokenizer)
    pair = ("the movie was great", "i loved it")
    (e,) = ex.explain([pair], methods=["attcat"])
    assert e.text == list(pair)
    assert e.token_type_ids is not None and set(e.token_type_ids) == {0, 1}
    assert e.tokens.count("[SEP]") == 2
    with torch.no_grad():
        enc = tokenizer(*pair, return_tensors="pt")
        probs = ex.model(**enc).logits.softmax(-1)[0].numpy()
    np.testing.assert_allclose(e.probabilities, probs, atol=1e-6)
    words = e.to_words()
    assert words.tokens == ["[CLS]", "the", "movie", "was", "great", "[SEP]", "i", "loved", "it", "[SEP]"]
    # each word keeps the tokenizer's word index, which restarts with the second sequence
    assert words.word_ids == [None, 0, 1, 2, 3, None, 0, 1, 2, None]
    assert words.sequence_ids == [None, 0, 0, 0, 0, None, 1, 1, 1, None]


def test_bart_streams(tokenizer):
    text = "the plot was boring but the actors were great !"
    encoder = Explainer(make_model("bart"), tokenizer, attention="encoder").explain(text, methods=CORE)[0]
    decoder = Explainer(make_model("bart"), tokenizer, attention="decoder").explain(text, methods=CORE)[0]
    cross = Explainer(make_model("bart"), tokenizer, attention="cross").explain(
        text, methods=["rawatt", "grads", "agrad", "attgrads", "cat", "attcat"])[0]
    assert not np.allclose(encoder.scores["rawatt"], decoder.scores["rawatt"])
    assert not np.allclose(encoder.scores["rawatt"], cross.scores["rawatt"])
    # the decoder never sees the final EOS as a key: it scores 0 there
    assert decoder.scores["rawatt"][-1] == 0
    assert np.isclose(cross.scores["rawatt"].sum(), 1.0, atol=1e-5)  # one cross-attention row
    from attnlens import InputError

    with pytest.raises(InputError, match="self-attention"):
        Explainer(make_model("bart"), tokenizer, attention="cross").explain(text, methods=["rollout"])
    with pytest.raises(InputError, match="choose one of"):
        Explainer(make_model("bart"), tokenizer, attention="sideways")
    with pytest.raises(InputError, match="not available"):
        Explainer(make_model("bert"), tokenizer, attention="cross")


def test_decoder_only_reads_last_real_token(tokenizer):
    ex = explainer("gpt2", tokenizer)
    (e,) = ex.explain("i really didn't like this movie .", methods=["rawatt", "rollout"])
    # causal attention from the last token: the explained row covers every token and sums to one
    assert np.isclose(e.scores["rawatt"].sum(), 1.0, atol=1e-5)
    assert np.isclose(e.scores["rollout"].sum(), 1.0, atol=1e-5)


# --------------------------------------------------------------------------- analytic cases
def test_analytic_one_layer_one_head(tokenizer):
    """A hand-set capture: rollout, agrad and attcat worked out by hand."""
    from attnlens.core.batch_state import BatchContext, Capture

    A = torch.tensor([[[[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]]])  # (1, 1, 3, 3)
    G = torch.tensor([[[[1.0, -2.0, 4.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]]])
    h0 = torch.tensor([[[1.0, 0.0], [2.0, 1.0], [0.0, -1.0]]])  # (1, 3, 2)
    g0 = torch.tensor([[[0.5, 0.0], [1.0, 1.0], [0.0, 2.0]]])
    cap = Capture(logits=torch.zeros(1, 2), attentions=[A], attention_grads=[G], hidden=[h0, h0],
                  hidden_grads=[g0, g0], query_mask=torch.ones(1, 3, dtype=torch.bool),
                  key_mask=torch.ones(1, 3, dtype=torch.bool), query_weights=torch.tensor([[1.0, 0.0, 0.0]]))
    ctx = BatchContext(model=None, adapter=None, inputs={}, token_mask=torch.ones(1, 3),
                       special_mask=torch.zeros(1, 3), targets=torch.zeros(1, dtype=torch.long), capture=cap)
    get = registry.get_method
    # rollout: 0.5*A + 0.5*I, row 0 = [0.8, 0.15, 0.05]
    np.testing.assert_allclose(get("rollout").compute(ctx).scores[0], [0.8, 0.15, 0.05], atol=1e-6)
    # agrad: (A*G)[0] = [0.6, -0.6, 0.4]
    np.testing.assert_allclose(get("agrad").compute(ctx).scores[0], [0.6, -0.6, 0.4], atol=1e-6)
    # CAT_j = sum_d g*h = [0.5, 3.0, -2.0]; alpha_j = column means of A = [0.3, 0.3, 0.4]
    np.testing.assert_allclose(get("cat").compute(ctx).scores[0], [0.5, 3.0, -2.0], atol=1e-6)
    np.testing.assert_allclose(get("attcat").compute(ctx).scores[0], [0.15, 0.9, -0.8], atol=1e-6)
    np.testing.assert_allclose(get("attcat").compute(ctx, alpha="cls").scores[0], [0.3, 0.9, -0.2], atol=1e-6)
    # gae: R = I + relu(G*A) @ I; row 0 = [1 + 0.6, 0, 0.4]
    np.testing.assert_allclose(get("gae").compute(ctx).scores[0], [1.6, 0.0, 0.4], atol=1e-6)
    # attgrads: mean over rows of A*relu(G) = rows [0.6,0,0.4],[0,0.5,0],[0,0,0.8] -> [0.2, 1/6, 0.4]
    np.testing.assert_allclose(get("attgrads").compute(ctx).scores[0], [0.2, 1 / 6, 0.4], atol=1e-6)


# --------------------------------------------------------------------------- model safety
def _snapshot(model):
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "training": {n: m.training for n, m in model.named_modules()},
        "attn": model.config._attn_implementation,
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                     for m in model.modules()),
    }


def _assert_same(before, after):
    assert before["state"].keys() == after["state"].keys()
    for k in before["state"]:
        assert torch.equal(before["state"][k], after["state"][k]), k
    for key in ("training", "attn", "requires_grad", "hooks"):
        assert before[key] == after[key], key
    assert all(g is None for g in after["grads"].values())


@pytest.mark.parametrize("family", ["bert", "gpt2", "bart"])
def test_model_left_untouched(family, tokenizer):
    model = make_model(family, attn="sdpa")
    model.train()
    model.classifier.eval() if hasattr(model, "classifier") else None  # a mixed-mode model must stay mixed
    for p in list(model.parameters())[:3]:
        p.requires_grad_(False)
    before = _snapshot(model)
    ex = Explainer(model, tokenizer)
    ex.explain(TEXTS, methods="all", options={"integratedgradients": {"n_steps": 4}})
    ex.predict_proba([tokenizer("good")["input_ids"]])
    _assert_same(before, _snapshot(model))


def test_model_restored_after_an_error_mid_way(tokenizer, monkeypatch):
    model = make_model("bert", attn="sdpa").train()
    before = _snapshot(model)

    def boom(ctx, **kw):
        raise RuntimeError("boom")

    broken = dataclasses.replace(registry.get_method("attcat"), compute=boom)
    monkeypatch.setitem(registry._REGISTRY, "attcat", broken)
    with pytest.raises(RuntimeError, match="boom"):
        Explainer(model, tokenizer).explain(TEXTS, methods=["rawatt", "attcat"])
    _assert_same(before, _snapshot(model))


def test_frozen_model_still_gets_gradients(tokenizer):
    model = make_model("bert")
    for p in model.parameters():
        p.requires_grad_(False)
    (e,) = Explainer(model, tokenizer).explain("the movie was great", methods=["attcat", "saliency"])
    assert np.abs(e.scores["attcat"]).max() > 0 and np.abs(e.scores["saliency"]).max() > 0


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_gradient_methods_inside_a_no_grad_block(tokenizer, mode):
    ex = explainer("bert", tokenizer)
    methods = ["attcat", "inputxgradient", "attnlrp", "rollout"]
    free = ex.explain(TEXTS, methods=methods)
    with mode():
        inside = ex.explain(TEXTS, methods=methods)
        assert not torch.is_grad_enabled()  # the caller's mode is back after the call
    for a, b in zip(free, inside, strict=True):
        for m in methods:
            np.testing.assert_array_equal(a.scores[m], b.scores[m])


def test_threads_sharing_a_model_take_turns(tokenizer):
    """A call on the model from a second thread (through another explainer) waits for the first call to end, so
    neither runs on the other's switched attention, patched forwards or hooks."""
    model = make_model("bert", attn="sdpa")
    first, second = Explainer(model, tokenizer), Explainer(model, tokenizer)
    methods = ["attnlrp", "rawatt", "inputxgradient", "occlusion"]
    texts = ["the movie was great", "i hated this boring plot"]
    want = [first.explain(t, methods=methods)[0].scores for t in texts]
    before = _snapshot(model)
    got, forwards_of_second = {}, []

    def run(ex, i):
        got[i] = ex.explain(texts[i], methods=methods)[0].scores

    other = threading.Thread(target=run, args=(second, 1))

    def pause_in_first_pass(_module, _args):
        if threading.current_thread() is other:
            forwards_of_second.append(bool(paused))
        elif not paused:  # the first call's first forward: let the other thread try to run meanwhile
            paused.append(True)
            other.start()
            other.join(timeout=0.5)
            paused.append(len(forwards_of_second))

    paused: list = []
    handle = model.get_input_embeddings().register_forward_pre_hook(pause_in_first_pass)
    try:
        run(first, 0)
        other.join()
    finally:
        handle.remove()
    assert paused[1] == 0, "the second thread ran a forward inside the first thread's call"
    assert forwards_of_second  # it ran after
    for i in range(2):
        for m in methods:
            np.testing.assert_allclose(got[i][m], want[i][m], rtol=1e-6, atol=1e-9)
    _assert_same(before, _snapshot(model))


def test_attention_only_requests_build_no_graph(tokenizer, monkeypatch):
    ex = explainer("bert", tokenizer)
    seen = []
    original = registry.get_method("rollout")

    def spy(ctx, **kw):
        seen.append((torch.is_grad_enabled(), ctx.capture.attention_grads))
        return original.compute(ctx, **kw)

    monkeypatch.setitem(registry._REGISTRY, "rollout", dataclasses.replace(original, compute=spy))
    ex.explain(TEXTS, methods=["rawatt", "rollout"])
    assert seen and all(not grad and grads is None for grad, grads in seen)


def test_sanity_randomized_classifier_changes_gradient_scores(tokenizer):
    """Adebayo et al. 2018: re-initializing the classifier head must change gradient-based explanations."""
    model = make_model("bert")
    text = "the plot was boring but the actors were great !"
    methods = ["grads", "agrad", "gae", "cat", "attcat", "saliency", "inputxgradient"]
    before = Explainer(model, tokenizer).explain(text, methods=methods, target=1)[0]
    torch.manual_seed(123)
    torch.nn.init.normal_(model.classifier.weight, std=1.0)
    after = Explainer(model, tokenizer).explain(text, methods=methods + ["rawatt"], target=1)[0]
    for m in methods:
        corr = np.corrcoef(before.scores[m], after.scores[m])[0, 1]
        assert corr < 0.99, m
    # raw attention does not look at the head at all: identical
    assert "rawatt" in after.scores


def test_list_methods_has_every_core_method():
    assert set(CORE + ["integratedgradients"]) <= set(list_methods())


@pytest.mark.parametrize("first", ["attnlens.methods.registry", "attnlens.methods.attention", "attnlens.methods.cat",
                                   "attnlens.methods.lrp_methods", "attnlens.core.capture", "attnlens.core.engine",
                                   "attnlens.core.batch_state"])
def test_registry_complete_whichever_module_is_imported_first(first):
    # The registry imports no method module (no lazy import to dodge a cycle): importing any module first gives
    # the full registry in its documented order.
    import subprocess
    import sys

    code = f"import {first}; from attnlens.methods.registry import list_methods; print(','.join(list_methods()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out.split(",") == list_methods()


@pytest.mark.parametrize("family", ENCODERS)
def test_word_aggregation(family, tokenizer):
    ex = explainer(family, tokenizer)
    (e,) = ex.explain("the actors loved the boring plots", methods=["attcat"])
    words = e.to_words()
    assert "plots" in words.tokens
    assert np.isclose(words.scores["attcat"].sum(), e.scores["attcat"].sum())
    i = words.tokens.index("plots")
    j = e.tokens.index("plot")
    assert np.isclose(words.scores["attcat"][i], e.scores["attcat"][j] + e.scores["attcat"][j + 1])
    assert np.isclose(e.to_words("max").scores["attcat"][i], max(e.scores["attcat"][j:j + 2]))
    assert np.isclose(e.to_words("mean").scores["attcat"][i], np.mean(e.scores["attcat"][j:j + 2]))
    assert words.word_ids == [None, *range(6), None]  # the tokenizer's word indices, not token positions
    assert words.to_words().tokens == words.tokens  # words stay words


def test_all_skips_methods_that_do_not_apply_but_explicit_requests_fail(tokenizer, entry_without_layers):
    from attnlens import InputError

    ex = explainer("deberta", tokenizer)  # an entry without LRP facts or layers
    with pytest.warns(UserWarning, match="skipping partiallrp, transatt, attnlrp"):
        (e,) = ex.explain("the movie was great", methods="all", options={"integratedgradients": {"n_steps": 4}})
    assert "partiallrp" not in e.scores and "attcat" in e.scores and "flow" in e.scores
    with pytest.raises(InputError, match="LRP methods"):
        ex.explain("the movie was great", methods=["attnlrp"])
    cross = Explainer(make_model("bart"), tokenizer, attention="cross")
    with pytest.warns(UserWarning, match="rollout"):
        (c,) = cross.explain("the movie was great", methods="all", options={"integratedgradients": {"n_steps": 4}})
    assert "rollout" not in c.scores and "gae" not in c.scores and "agrad" in c.scores


def test_methods_of_many_passes_give_the_heaps_free_blocks_back(tokenizer, monkeypatch):
    """Perturbed batches sized by each input's length leave holes in the C allocator's heaps, which a session of
    inputs of varied lengths would keep (MiniLM, occlusion and LIME over 40 lengths: +358 MB resident); the engine
    gives them back after each such method."""
    from attnlens.core import engine

    released = []
    monkeypatch.setattr(engine, "release_free_memory", lambda: released.append(True) or True)
    ex = explainer("bert", tokenizer)
    ex.explain(TEXTS, methods=["rawatt", "grads"])
    assert not released
    ex.explain(TEXTS, methods=["rawatt", "occlusion"])
    assert released


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_a_float64_model_with_a_sliding_window_explains_a_padded_batch_as_each_input_alone(family, tokenizer):
    """transformers' eager attention takes the softmax in float32, where a float64 model's mask is -inf: a padded
    query whose whole window is padding gets NaN, which the next layer carries into the real rows. Inputs whose
    lengths lie half a window or more apart never share a batch."""
    from attnlens.core.batching import attention_window, batch_groups

    model = make_model(family).double()
    model.config.sliding_window = 3
    assert attention_window(model.config) == 3
    ex = Explainer(model, tokenizer)
    texts = ["i didn ' t like this boring film , the plot was dull and the actors awful", "good movie"]
    methods = ["rawatt", "inputxgradient", "valuezeroing"]
    together = ex.explain(texts, methods=methods)
    for text, batched in zip(texts, together):
        (alone,) = ex.explain(text, methods=methods)
        assert batched.probabilities == pytest.approx(alone.probabilities, rel=1e-9)
        for m in methods:
            assert np.isfinite(batched.scores[m]).all()
            np.testing.assert_allclose(batched.scores[m], alone.scores[m], rtol=1e-7, atol=1e-12)
    ids = [[1] * 19, [1] * 4, [1] * 5]
    assert batch_groups(model, ids) == [(0, 19), (0, 4), (0, 5)]  # windows of 3: one length per half window
    assert batch_groups(model.float(), ids) is None  # float32 masks stay finite: any lengths share a batch


def test_scores_that_are_not_finite_are_blamed_on_the_model_where_its_own_output_is_not(tokenizer):
    from attnlens.core.engine import _warn_if_not_finite

    ex = explainer("bert", tokenizer)
    scores = torch.tensor([[0.1, float("nan")]])
    with pytest.warns(UserWarning, match=r"rawatt: 1 of its scores are not finite .*\(the model's own output is not "):
        _warn_if_not_finite("rawatt", scores, ex.runner, torch.tensor([[float("nan"), 0.0]]))
    with pytest.warns(UserWarning, match=r"the method's own arithmetic"):
        _warn_if_not_finite("rawatt", scores, ex.runner, torch.tensor([[1.0, 0.0]]))
