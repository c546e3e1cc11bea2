"""Explaining generation on tiny random language models: every method, step t = the prefix explained alone,
batching, teacher forcing, contrast linearity, the model left unchanged, clear errors."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import CLS, PAD, SEP, V, make_model, make_tokenizer

from attnlens import Explainer, Generation, InputError, ModelError, load_generations
from attnlens.core.encoding import Encoded
from attnlens.lrp import supports as lrp_supports
from attnlens.methods.registry import get_method
from attnlens.testing.tiny_models import build_tiny
from attnlens.viz.colors import prediction_line

PROMPT = "the movie was really"
DECODERS = ["gpt2", "llama"]
FAST = ["rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat", "flow", "saliency",
        "inputxgradient"]
LINEAR = ["grads", "agrad", "cat", "inputxgradient"]  # linear in the gradient of the explained scalar


def make_lm(family: str, seed: int = 0) -> torch.nn.Module:
    return build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, seed=seed,
                      task="causal-lm")


@pytest.fixture(scope="module", params=DECODERS)
def lm(request, tokenizer) -> Explainer:
    return Explainer(make_lm(request.param), tokenizer)


def test_every_method_runs_with_step_by_token_shapes(lm):
    g = lm.explain_generation(PROMPT, max_new_tokens=4, methods="all", options={"integratedgradients": {"n_steps": 4}})
    p, t = len(g.prompt_ids), len(g.generated_ids)
    assert 1 <= t <= 4 and g.predicted_ids == g.generated_ids and not g.forced
    assert g.tokens == g.prompt_tokens + g.generated_tokens and len(g.generated) == t
    assert {"integratedgradients", "flow", "attcat", "attnlrp", "transatt", "partiallrp"} <= set(g.methods)
    for m, s in g.scores.items():
        assert s.shape == (t, p + t) and np.isfinite(s).all(), m
        for step in range(t):  # a step is explained by the tokens before it only
            assert not s[step, p + step:].any(), m
        assert np.abs(s).max() > 0, m
    assert all(0 < q <= 1 for q in g.probabilities)


def _prefix_scores(ex: Explainer, ids: list[int], token: int, methods: list[str]) -> dict[str, np.ndarray]:
    """The prefix ``ids`` explained as one example of the classifier engine, target = ``token``."""
    e = Encoded(text="", ids=ids, type_ids=None, special=[False] * len(ids), tokens=["x"] * len(ids),
                word_ids=None, sequence_ids=None, offsets=None)
    specs = [get_method(m) for m in methods]
    _, out = ex.compute_batch([e], [token], specs, {m: s.check_options({}) for m, s in zip(methods, specs)})
    return {m: s[0].double().numpy() for m, (s, _) in out.items()}


def _assert_steps_equal_their_prefixes(ex: Explainer, g: Generation, methods: list[str]) -> None:
    """Every step of ``g`` equals its prefix explained alone as one classifier-engine example."""
    ids = g.prompt_ids + g.generated_ids
    for t, token in enumerate(g.generated_ids):
        n = len(g.prompt_ids) + t
        alone = _prefix_scores(ex, ids[:n], token, methods)
        for m in methods:
            np.testing.assert_allclose(g.scores[m][t, :n], alone[m], atol=1e-5, rtol=1e-4, err_msg=f"{m} step {t}")


def test_each_step_equals_its_prefix_explained_alone(lm):
    _assert_steps_equal_their_prefixes(lm, lm.explain_generation(PROMPT, max_new_tokens=5, methods=FAST), FAST)


def test_scores_match_independent_autograd_and_attention(lm):
    """Input × gradient, rawatt and the probabilities recomputed by hand from the model on each prefix."""
    g = lm.explain_generation(PROMPT, max_new_tokens=3, methods=["rawatt", "inputxgradient"])
    ids = g.prompt_ids + g.generated_ids
    emb = lm.model.get_input_embeddings()
    for t, token in enumerate(g.generated_ids):
        n = len(g.prompt_ids) + t
        x = emb(torch.tensor([ids[:n]])).detach().requires_grad_(True)
        out = lm.model(inputs_embeds=x, output_attentions=True)
        logit = out.logits[0, -1, token]
        (grad,) = torch.autograd.grad(logit, x)
        np.testing.assert_allclose(g.scores["inputxgradient"][t, :n], (grad * x).sum(-1)[0].detach().numpy(),
                                   atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(g.scores["rawatt"][t, :n], out.attentions[-1][0, :, -1].mean(0).detach().numpy(),
                                   atol=1e-6)
        assert g.probabilities[t] == pytest.approx(float(out.logits[0, -1].softmax(-1)[token].detach()), abs=1e-6)


def test_batch_of_steps_equals_step_by_step(lm):
    batched = lm.explain_generation(PROMPT, max_new_tokens=5, methods=FAST, batch_size=16)
    single = lm.explain_generation(PROMPT, max_new_tokens=5, methods=FAST, batch_size=1)
    assert batched.generated_ids == single.generated_ids
    for m in FAST:
        np.testing.assert_allclose(batched.scores[m], single.scores[m], atol=1e-5, rtol=1e-4, err_msg=m)


def test_the_heaps_are_trimmed_between_batches_of_steps(lm, monkeypatch):
    """Steps in several batches: the heaps' freed blocks go back to the system after every batch but the last,
    before the next batch's pass over a longer sequence (none after a single batch)."""
    from attnlens.core import generation_engine

    trimmed = []
    monkeypatch.setattr(generation_engine, "release_free_memory", lambda: trimmed.append(1) or True)
    lm.explain_generation(PROMPT, max_new_tokens=5, methods=["grads"], batch_size=2)
    assert len(trimmed) == 2  # batches of 2, 2 and 1 steps
    trimmed.clear()
    lm.explain_generation(PROMPT, max_new_tokens=5, methods=["grads"], batch_size=16)
    assert not trimmed


def test_teacher_forcing_the_greedy_continuation_reproduces_it(lm):
    greedy = lm.explain_generation(PROMPT, max_new_tokens=4, methods=FAST)
    forced = lm.explain_generation(PROMPT, target=greedy.generated_ids, methods=FAST)
    assert forced.forced and forced.generated_ids == greedy.generated_ids == forced.predicted_ids
    for m in FAST:
        np.testing.assert_allclose(forced.scores[m], greedy.scores[m], atol=1e-6, err_msg=m)
    np.testing.assert_allclose(forced.probabilities, greedy.probabilities, atol=1e-7)


def test_a_forced_step_names_the_greedy_token_where_the_model_disagreed(lm):
    """The greedy choice as text (not an id) in the step's prediction line and JSON; the step views mark the steps
    where the forced token is not it; small probabilities stay apart (not all 0.000)."""
    from attnlens.viz.generation import render_generation

    greedy = lm.explain_generation(PROMPT, max_new_tokens=2, methods="rawatt")
    other = next(w for w in ("good", "bad", "film") if w != greedy.generated[0].strip())
    g = lm.explain_generation(PROMPT, target=f" {other} {other}", methods="rawatt")
    assert g.predicted == [lm.tokenizer.decode([i]) for i in g.predicted_ids]
    assert g.predicted[0] == greedy.generated[0] != g.generated[0]
    line = prediction_line(g.step(0))
    assert f"greedy choice: {g.predicted[0]!r}" in line and "token #" not in line
    assert f"(greedy {g.predicted[0]!r})" in render_generation(g, color=False, width=300)
    assert Generation.from_dict(json.loads(json.dumps(g.to_dict()))).predicted == g.predicted
    from attnlens.viz.colors import prob_text

    assert (prob_text(2.3e-4), prob_text(1.9e-6), prob_text(0.25), prob_text(0.0)) == (
        "2.3e-04", "1.9e-06", "0.250", "0.000")


def test_forced_text_target_is_tokenized_without_special_tokens(lm, tokenizer):
    g = lm.explain_generation(PROMPT, target=" good film", methods="rawatt")
    assert g.generated_ids == tokenizer(" good film", add_special_tokens=False)["input_ids"]
    assert g.generated_tokens == ["good", "film"]


def test_contrast_is_the_difference_of_the_two_targets(lm):
    good, bad, film = [lm.tokenizer.convert_tokens_to_ids(w) for w in ("good", "bad", "film")]
    ig = {"integratedgradients": {"n_steps": 4}}  # linear in the scalar too (same baseline and steps)
    kw = dict(methods=LINEAR + ["integratedgradients"], options=ig)
    both = lm.explain_generation(PROMPT, target=[good, film], contrast=[bad, good], **kw)
    one = lm.explain_generation(PROMPT, target=[good, film], **kw)
    other = lm.explain_generation(PROMPT, target=[bad], **kw)
    other1 = lm.explain_generation(PROMPT, target=[good, good], **kw)  # step 1: "good" after "good"
    for m in LINEAR + ["integratedgradients"]:
        np.testing.assert_allclose(both.scores[m][0], one.scores[m][0] - np.pad(other.scores[m][0], (0, 1)),
                                   atol=1e-5, err_msg=m)
        np.testing.assert_allclose(both.scores[m][1], one.scores[m][1] - other1.scores[m][1], atol=1e-5, err_msg=m)
    target, contrast = good, bad
    both = lm.explain_generation(PROMPT, target=[target], contrast=[contrast], methods=LINEAR)
    other = lm.explain_generation(PROMPT, target=[contrast], methods=LINEAR)
    assert both.contrast_ids == [contrast] and both.contrast == [lm.tokenizer.decode([contrast])]
    assert both.contrast_probabilities == pytest.approx(other.probabilities)
    # log-probabilities differ by the logits' difference (the softmax normaliser cancels)
    loss = lm.explain_generation(PROMPT, target=[target], contrast=[contrast], methods=LINEAR, target_kind="loss")
    for m in LINEAR:
        np.testing.assert_allclose(loss.scores[m], both.scores[m], atol=1e-5, err_msg=m)


LRP = ["attnlrp", "transatt", "partiallrp"]


@pytest.mark.parametrize("family", ["gpt_neox", "phi", "qwen3", "gemma", "gpt_neo", "gptj", "gemma2", "opt", "bloom",
                                    "phi3", "falcon", "mixtral"])
def test_lrp_steps_on_the_other_lrp_decoders_equal_their_prefix(family, tokenizer):
    """GPT-NeoX, Phi and GPT-J (parallel blocks), Qwen3, Gemma, Gemma 2, GPT-Neo, BLOOM and Falcon (their own attention
    code), OPT: each step of the one LRP pass over the sequence equals its prefix explained alone."""
    ex = Explainer(make_lm(family), tokenizer)
    _assert_steps_equal_their_prefixes(ex, ex.explain_generation(PROMPT, target=" good but bad", methods=LRP), LRP)


def test_lrp_steps_equal_their_prefix_and_contrast_is_linear(lm):
    """The LRP methods take the step's scalar from the head: each step equals its prefix explained alone, and
    AttnLRP (linear in the explained scalar) of a contrast is the difference of the two targets' relevances."""
    _assert_steps_equal_their_prefixes(lm, lm.explain_generation(PROMPT, max_new_tokens=3, methods=LRP), LRP)
    good, bad = [lm.tokenizer.convert_tokens_to_ids(w) for w in ("good", "bad")]
    both = lm.explain_generation(PROMPT, target=[good], contrast=[bad], methods=["attnlrp"])
    one = lm.explain_generation(PROMPT, target=[good], methods=["attnlrp"])
    other = lm.explain_generation(PROMPT, target=[bad], methods=["attnlrp"])
    np.testing.assert_allclose(both.scores["attnlrp"], one.scores["attnlrp"] - other.scores["attnlrp"], atol=1e-5)
    assert np.abs(both.scores["attnlrp"]).max() > 1e-3


def test_model_is_left_unchanged(tokenizer):
    model = make_lm("llama").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    impl = model.config._attn_implementation
    Explainer(model, tokenizer).explain_generation(PROMPT, max_new_tokens=2, methods=FAST)
    assert model.training and model.config._attn_implementation == impl
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_save_and_load_round_trip(lm, tmp_path):
    g = lm.explain_generation(PROMPT, max_new_tokens=3, methods=["rawatt", "attcat"], contrast=None)
    g.save(tmp_path / "g.json")
    back = Generation.load(tmp_path / "g.json")
    assert back == g and back.text == g.text
    step = back.step(-1)
    assert step.tokens == g.tokens[: len(g.prompt_ids) + len(g.generated_ids) - 1]
    assert step.target == g.generated_ids[-1]
    from attnlens.viz.terminal import render_terminal

    assert f"explaining next token {g.step_labels[-1]!r} (p {g.probabilities[-1]:.3f})" in render_terminal(step)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt": "   "}, "prompt is empty"),
    ({"prompt": ["good", "bad"]}, "the prompt must be one string, got list"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"target": ""}, "tokenizes to nothing"),
    ({"target": [V + 5]}, "list of token ids"),
    ({"target": " good film", "contrast": " bad", "methods": "grads"}, "one contrast token per generated token"),
    ({"chat": True}, "no chat template"),
    ({"target": " good", "contrast": " bad", "methods": "rawatt,grads"}, "rawatt does not depend on the explained"),
    ({"methods": "nosuch"}, "unknown method"),
    ({"prompt": "good " * 60}, "the prompt has 62 tokens, more than the model's maximum of 48"),
])
def test_user_mistakes_are_one_line_errors(lm, kwargs, message):
    kwargs = {"prompt": PROMPT, "methods": "rawatt", **kwargs}
    with pytest.raises(InputError, match=message):
        lm.explain_generation(kwargs.pop("prompt"), **kwargs)


def test_explain_generation_needs_a_language_model(tokenizer):
    with pytest.raises(ModelError, match="needs a language model"):
        Explainer(make_model("gpt2"), tokenizer).explain_generation(PROMPT)


def test_explain_on_a_language_model_explains_the_next_token(lm):
    """explain() of a causal LM explains the next token: the first generation step."""
    g = lm.explain_generation(PROMPT, max_new_tokens=1, methods=["rawatt", "inputxgradient"])
    (e,) = lm.explain(PROMPT, methods=["rawatt", "inputxgradient"])
    assert e.target == e.predicted == g.generated_ids[0]
    assert e.probabilities == pytest.approx(g.probabilities)
    for m in ("rawatt", "inputxgradient"):
        np.testing.assert_allclose(e.scores[m], g.scores[m][0, : len(e.tokens)], atol=1e-6)
    with pytest.raises(InputError, match="out of range"):
        lm.explain(PROMPT, methods="rawatt", target=V + 1)
    good, bad = [lm.tokenizer.convert_tokens_to_ids(w) for w in ("good", "bad")]
    (c,) = lm.explain(PROMPT, methods="inputxgradient", target=good, contrast=bad)
    step = lm.explain_generation(PROMPT, target=[good], contrast=[bad], methods="inputxgradient")
    assert c.target == good and c.meta["contrast"] == bad
    # the terminal line names the tokens, not their ids
    assert e.meta["target_token"] == e.meta["predicted_token"] == g.generated[0]
    assert c.meta["target_token"] == lm.tokenizer.decode([good]) and "#" not in prediction_line(c)
    np.testing.assert_allclose(c.scores["inputxgradient"], step.scores["inputxgradient"][0, : len(c.tokens)],
                               atol=1e-6)


# ------------------------------------------------------------------------------ contrast for classifiers
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_classifier_contrast_is_the_difference_of_the_two_classes(family, tokenizer):
    ex = Explainer(make_model(family, num_labels=3), tokenizer)
    texts = ["a charming journey", "the plot was boring"]
    linear = LINEAR + ["integratedgradients", "attnlrp"]  # AttnLRP: linear in the explained scalar too
    kw = dict(methods=linear, options={"integratedgradients": {"n_steps": 4}})
    both = ex.explain(texts, target=1, contrast=2, **kw)
    one = ex.explain(texts, target=1, **kw)
    other = ex.explain(texts, target=2, **kw)
    for b, o, t in zip(both, one, other):
        assert b.target == 1 and b.meta["contrast"] == 2 and b.probabilities == pytest.approx(o.probabilities)
        for m in linear:
            np.testing.assert_allclose(b.scores[m], o.scores[m] - t.scores[m], atol=1e-5, err_msg=m)
    # the predicted class against a fixed one; the loss kind (log-probabilities) equals the logit difference
    chosen = {e.predicted for e in ex.explain(texts, methods=["grads"])}
    other = min({0, 1, 2} - chosen)  # a class neither text predicts (a class against itself is refused)
    predicted = ex.explain(texts, methods=LINEAR, contrast=f"LABEL_{other}")
    loss = ex.explain(texts, methods=LINEAR, target=[e.predicted for e in predicted], contrast=other,
                      target_kind="loss")
    for p, q in zip(predicted, loss):
        for m in LINEAR:
            np.testing.assert_allclose(p.scores[m], q.scores[m], atol=1e-5, err_msg=m)


def test_classifier_contrast_mistakes(tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.raises(InputError, match="contrast 7 is out of range"):
        ex.explain("good", methods="grads", contrast=7)
    with pytest.raises(InputError, match="one class index or label name"):
        ex.explain("good", methods="grads", contrast=[0, 1])
    with pytest.raises(InputError, match="rollout does not depend on the explained target"):
        ex.explain("good", methods="grads,rollout", contrast=0)
    with pytest.warns(UserWarning, match="skipping rawatt, rollout, flow, attnnorm, globenc, alti, valuezeroing: "
                                         ".*contrast does not apply"):
        (e,) = ex.explain("good", contrast=0)
    assert "grads" in e.scores and "rawatt" not in e.scores


def test_a_target_that_is_its_own_contrast_is_refused_or_warned(tokenizer, lm):
    """target − contrast is 0 when the two are the same: a named target is refused, a predicted one warned of."""
    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.raises(InputError, match="input 2: the target is the contrast"):
        ex.explain(["good", "bad"], methods="grads", target=[0, 1], contrast=1)
    predicted = ex.explain("good", methods="grads")[0].target
    with pytest.warns(UserWarning, match=f"input 'good': the explained class {predicted} is the contrast"):
        (e,) = ex.explain("good", methods="grads", contrast=predicted)
    assert not np.any(e.scores["grads"])
    good, bad = [lm.tokenizer.convert_tokens_to_ids(w) for w in ("good", "bad")]
    with pytest.raises(InputError, match="the contrast is the explained continuation itself"):
        lm.explain_generation(PROMPT, target=[good, bad], contrast=[good, bad], methods=["grads"])


# ------------------------------------------------------------------------------ views and CLI
def test_views_render_every_step(lm, tmp_path):
    from attnlens.viz.generation import generation_html, render_generation

    g = lm.explain_generation(PROMPT, max_new_tokens=3, methods=["rawatt", "inputxgradient"])
    text = render_generation(g, color=False, width=400)
    assert text.count("→") == 1 + 2 * len(g.generated_ids) and "inputxgradient" in text  # header + 1 per step
    page = generation_html(g)
    assert page.count('class="tok gen"') + page.count('class="tok special gen"') == 2 * len(g.generated_ids)
    assert "<script>" in page and "step × token heatmap" in page
    g.plot(path=tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 0


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory, tokenizer) -> str:
    path = tmp_path_factory.mktemp("lm") / "gpt2-lm"
    make_lm("gpt2").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_cli_generate_json_html_plot_and_head_view(lm_dir, tmp_path, capsys):
    from attnlens.cli import main

    out, page, png, view = (tmp_path / n for n in ("g.json", "g.html", "g.png", "view.html"))
    assert main(["explain", "--model", lm_dir, "--generate", "--max-new-tokens", "3", "--methods",
                 "rawatt,inputxgradient", "--format", "json", "--out", str(out), "--html", str(page),
                 "--plot", str(png), "--head-view", str(view), PROMPT]) == 0
    (d,) = json.loads(out.read_text())
    assert load_generations(out) == [Generation.from_dict(d)]
    assert {"prompt_tokens", "generated_tokens", "scores", "target_ids", "contrast_ids", "probabilities"} <= set(d)
    g = Generation.from_dict(d)
    assert g.scores["rawatt"].shape == (len(g.generated_ids), len(g.prompt_ids) + len(g.generated_ids))
    direct = Explainer.from_pretrained(lm_dir).explain_generation(PROMPT, max_new_tokens=3, methods="rawatt")
    assert g.generated_ids == direct.generated_ids
    np.testing.assert_allclose(g.scores["rawatt"], direct.scores["rawatt"], atol=1e-7)
    assert page.stat().st_size and png.stat().st_size and view.stat().st_size
    capsys.readouterr()
    assert main(["explain", "--model", lm_dir, "--generate", "--target", " good film", "--contrast", " bad movie",
                 "--methods", "grads", PROMPT]) == 0
    assert "→" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:bfloat16 on the CPU")
def test_cli_generate_passes_ig_steps_precision_and_memory_budget(lm_dir, tmp_path):
    """--ig-steps, --dtype and --memory-budget reach the generation (they were once read and then dropped)."""
    from attnlens.cli import main

    out = tmp_path / "g.json"
    assert main(["explain", "--model", lm_dir, "--generate", "--max-new-tokens", "2", "--methods",
                 "integratedgradients", "--ig-steps", "3", "--dtype", "bfloat16", "--memory-budget", "64MiB",
                 "--format", "json", "--out", str(out), PROMPT]) == 0
    (g,) = load_generations(out)
    assert g.meta["options"]["integratedgradients"]["n_steps"] == 3
    direct = Explainer.from_pretrained(lm_dir, dtype=torch.bfloat16).explain_generation(
        PROMPT, "integratedgradients", max_new_tokens=2, options={"integratedgradients": {"n_steps": 3}})
    np.testing.assert_allclose(g.scores["integratedgradients"], direct.scores["integratedgradients"], atol=1e-6)
    float32 = Explainer.from_pretrained(lm_dir).explain_generation(
        PROMPT, "integratedgradients", max_new_tokens=2, options={"integratedgradients": {"n_steps": 3}})
    assert not np.allclose(g.scores["integratedgradients"], float32.scores["integratedgradients"], atol=1e-6)


@pytest.mark.parametrize(("argv", "message"), [
    (["--chat"], "are for --generate"),
    (["--max-new-tokens", "8"], "are for --generate"),  # the default value, given without --generate
    (["--generate", "--max-new-tokens", "0"], "at least 1"),
    (["--generate", "--target", " good", "--contrast", " bad film", "--methods", "grads"],
     "one contrast token per generated token"),
    (["--generate", "--chat"], "no chat template"),
])
def test_cli_generation_mistakes(lm_dir, capsys, argv, message):
    from attnlens.cli import main

    capsys.readouterr()
    assert main(["explain", "--model", lm_dir, "--methods", "rawatt", *argv, PROMPT]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlens: error:") and message in err and "\n" not in err


# ------------------------------------------------------------------------------ encoder-decoder LMs
@pytest.fixture(scope="module", params=[(f, s) for f in ("bart", "t5") for s in ("encoder", "cross", "decoder")],
                ids=lambda p: "-".join(p))
def s2s(request, tokenizer) -> Explainer:
    family, stream = request.param
    model = build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                       task="seq2seq-lm")
    return Explainer(model, tokenizer, attention=stream)


PERTURBATION = ["occlusion", "lime", "kernelshap"]


def _s2s_methods(s2s: Explainer, methods: list[str]) -> list[str]:
    """``methods`` that apply to the stream: no propagation through cross attention, no input-embedding methods
    on the decoder stream (its tokens are not the encoder's input)."""
    skip = {"cross": {"rollout", "gae", "flow", "valuezeroing", "decompx"},
            "decoder": {"saliency", "inputxgradient", "integratedgradients", "attnlrp", "valuezeroing", "decompx",
                        *PERTURBATION}}
    return [m for m in methods if m not in skip.get(s2s.stream, set())]


def test_seq2seq_every_method_runs(s2s):
    with pytest.warns(UserWarning, match="skipping"):
        g = s2s.explain_generation(PROMPT, target=" good film .", methods="all",
                                   options={"integratedgradients": {"n_steps": 4}})
    p, t = len(g.prompt_ids), len(g.generated_ids)
    assert g.meta["task"] == "seq2seq-lm" and t == 3
    vz = [] if get_method("valuezeroing").unsupported(s2s.model, s2s.stream, "seq2seq-lm") else ["valuezeroing"]
    # GlobEnc reads the encoder's layers only and DecompX attributes to its input; attnnorm reads one attention at a
    # time and ALTI on the other streams is ALTI+, so every stream
    norm = ["attnnorm", "globenc", "alti", "decompx"] if s2s.stream == "encoder" else ["attnnorm", "alti"]
    # AttnLRP attributes to the encoder's input, as the gradient methods do; the other LRP methods read one
    # self-attention stream's attention relevance
    lrp = ["attnlrp"] if lrp_supports(s2s.model) else []
    assert set(g.methods) == set(_s2s_methods(s2s, FAST + ["integratedgradients"] + lrp + vz + norm + PERTURBATION))
    for m, s in g.scores.items():
        assert s.shape == (t, p + t) and np.isfinite(s).all(), m
        if s2s.stream == "decoder":  # over the continuation before each step (step 0 has only the start token)
            assert not s[:, :p].any() and not s[0].any() and np.abs(s[1:, p]).min() > 0, m
            assert all(not s[k, p + k:].any() for k in range(t)), m
        else:  # over the prompt
            assert not s[:, p:].any() and np.abs(s).max() > 0, m


def test_seq2seq_steps_equal_each_prefix_alone(s2s):
    """A batch row holds the whole decoder input; batch_size=1 cuts it at the step: the prefix alone."""
    methods = _s2s_methods(s2s, [*FAST, "attnnorm", "alti", "decompx"])
    batched = s2s.explain_generation(PROMPT, max_new_tokens=4, methods=methods, batch_size=8)
    single = s2s.explain_generation(PROMPT, max_new_tokens=4, methods=methods, batch_size=1)
    for m in methods:
        np.testing.assert_allclose(batched.scores[m], single.scores[m], atol=1e-5, rtol=1e-4, err_msg=m)
    np.testing.assert_allclose(batched.probabilities, single.probabilities, atol=1e-6)


def test_seq2seq_scores_match_independent_autograd(s2s):
    g = s2s.explain_generation(PROMPT, max_new_tokens=3, methods=_s2s_methods(s2s, ["rawatt", "inputxgradient"]))
    model = s2s.model
    enc_ids = torch.tensor([g.prompt_ids])
    emb = s2s.adapter.embedding_module(model)
    start = model.config.decoder_start_token_id
    for t, token in enumerate(g.generated_ids):
        decoder = torch.tensor([[start] + g.generated_ids[:t]])
        x = emb(enc_ids).detach().requires_grad_(True)  # the encoder's (scaled) token embeddings
        out = model(inputs_embeds=x, decoder_input_ids=decoder, output_attentions=True)
        (grad,) = torch.autograd.grad(out.logits[0, -1, token], x)
        if s2s.stream == "decoder":  # decoder key k >= 1 is generated token k - 1 (key 0: the start token)
            row = out.decoder_attentions[-1][0, :, -1].mean(0)[1:]
            np.testing.assert_allclose(g.scores["rawatt"][t, len(g.prompt_ids): len(g.prompt_ids) + t],
                                       row.detach().numpy(), atol=1e-6)
        else:
            np.testing.assert_allclose(g.scores["inputxgradient"][t, : len(g.prompt_ids)],
                                       (grad * x).sum(-1)[0].detach().numpy(), atol=1e-5, rtol=1e-4)
        if s2s.stream == "cross":
            row = out.cross_attentions[-1][0, :, -1].mean(0)
            np.testing.assert_allclose(g.scores["rawatt"][t, : len(g.prompt_ids)], row.detach().numpy(), atol=1e-6)
        assert g.probabilities[t] == pytest.approx(float(out.logits[0, -1].softmax(-1)[token].detach()), abs=1e-6)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_seq2seq_greedy_runs_one_decoder_token_per_step_with_the_tokens_of_the_whole_prefix(family, tokenizer):
    """The seq2seq greedy loop keeps the decoder's key/value cache: each step runs the new token alone, and the
    tokens are those of re-running the decoder over the whole prefix at every step."""
    from attnlens.core.generation_engine import _decoder_start, greedy

    model = build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, task="seq2seq-lm")
    ex = Explainer(model, tokenizer)
    prompt = tokenizer(PROMPT + " and the plot was good")["input_ids"]
    eos = {SEP, *([model.config.eos_token_id] if model.config.eos_token_id is not None else [])}
    decoded: list[int] = []
    hook = model.get_decoder().embed_tokens.register_forward_hook(
        lambda _m, args, _out: decoded.append(args[0].shape[-1]))
    ids = greedy(ex.runner, prompt, 8)
    hook.remove()
    assert decoded == [1] * len(ids)
    with torch.no_grad():
        inputs = torch.tensor([prompt])
        want = [_decoder_start(ex.runner)]
        for _ in range(8):
            logits = model(input_ids=inputs, decoder_input_ids=torch.tensor([want]), use_cache=False).logits
            want.append(int(logits[0, -1].argmax()))
            if want[-1] in eos:
                break
    assert ids == want[1:]


def test_seq2seq_step_ranks_only_the_sequence_its_stream_scores(s2s):
    g = s2s.explain_generation(PROMPT, target=" good film .", methods=["rawatt"])
    p = len(g.prompt_ids)
    step = g.step(2)  # the prompt and the first two generated tokens
    scored = range(p, p + 2) if s2s.stream == "decoder" else [i for i in range(p) if not g.prompt_special[i]]
    assert sorted(step.ranking("rawatt")) == sorted(scored)
    assert len(step.top_k("rawatt", 50)) == len(scored)
    assert step.tokens == g.tokens[: p + 2]  # every token is still shown


def test_seq2seq_views_draw_the_sequence_a_stream_does_not_score_blank(s2s):
    from attnlens.viz.generation import generation_html, render_generation, step_rows

    g = s2s.explain_generation(PROMPT, target=" good film .", methods=["rawatt"])
    p, t = len(g.prompt_ids), 2
    unscored = [i < p for i in range(p + t)] if s2s.stream == "decoder" else [i >= p for i in range(p + t)]
    assert g.unscored[: p + t] == [u or sp for u, sp in zip(unscored, g.special[: p + t])]
    assert g.step(t).special == g.unscored[: p + t]
    assert not step_rows(g, "rawatt")[t, : p + t][np.asarray(unscored)].any()
    colors = json.loads(re.search(r'data-colors="([^"]*)"', generation_html(g)).group(1).replace("&quot;", '"'))
    assert [c is None for c in colors[t][: p + t]] == g.unscored[: p + t]  # no colour: no score
    cells = re.findall(r"<tr><th class=\"row\">.*?</tr>", generation_html(g))[t]
    assert cells.count('title="') == sum(not u for u in g.unscored[: p + t])  # a score shown on scored cells
    drawn = [x for x in render_generation(g, width=400).splitlines() if f"{t}: " in x][0]
    assert "48;2;255;255;255" not in drawn  # a zero score's shade: an unscored token is drawn without one


def test_seq2seq_forcing_and_contrast(s2s):
    linear = _s2s_methods(s2s, LINEAR)
    greedy = s2s.explain_generation(PROMPT, max_new_tokens=3, methods=linear)
    forced = s2s.explain_generation(PROMPT, target=greedy.generated_ids, methods=linear)
    for m in linear:
        np.testing.assert_allclose(forced.scores[m], greedy.scores[m], atol=1e-6, err_msg=m)
    target, contrast = [s2s.tokenizer.convert_tokens_to_ids(w) for w in ("good", "bad")]
    both = s2s.explain_generation(PROMPT, target=[target, contrast], contrast=[contrast, target], methods=linear)
    one = s2s.explain_generation(PROMPT, target=[target, contrast], methods=linear)
    # step 0 contrasts "bad" after no token, step 1 "good" after "good": the same steps of two forced runs
    other0 = s2s.explain_generation(PROMPT, target=[contrast], methods=linear)
    other1 = s2s.explain_generation(PROMPT, target=[target, target], methods=linear)
    p = len(both.prompt_ids)
    for m in linear:
        np.testing.assert_allclose(both.scores[m][0], one.scores[m][0] - np.pad(other0.scores[m][0], (0, 1)),
                                   atol=1e-5, err_msg=m)
        np.testing.assert_allclose(both.scores[m][1, : p + 1], one.scores[m][1, : p + 1]
                                   - other1.scores[m][1, : p + 1], atol=1e-5, err_msg=m)


def test_seq2seq_checkpoint_loads_as_a_language_model(tmp_path, tokenizer):
    model = build_tiny("t5", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, task="seq2seq-lm")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ex = Explainer.from_pretrained(tmp_path, attention="cross")
    assert ex.head.task == "seq2seq-lm"
    g = ex.explain_generation(PROMPT, max_new_tokens=2, methods="attcat")
    direct = Explainer(model, tokenizer, attention="cross").explain_generation(PROMPT, max_new_tokens=2,
                                                                               methods="attcat")
    assert g.generated_ids == direct.generated_ids
    np.testing.assert_allclose(g.scores["attcat"], direct.scores["attcat"], atol=1e-6)


def test_seq2seq_mistakes(tokenizer):
    model = build_tiny("bart", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, task="seq2seq-lm")
    with pytest.raises(InputError, match="saliency attributes to the encoder's input embeddings"):
        Explainer(model, tokenizer, attention="decoder").explain_generation(PROMPT, methods="rawatt,saliency")
    with pytest.raises(ModelError, match="use explain_generation"):
        Explainer(model, tokenizer).explain(PROMPT, methods="rawatt")


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_seq2seq_starts_from_the_token_generate_starts_from(family, tokenizer):
    """``model.generate`` reads the decoder's start token from the generation config first: a greedy continuation
    and its explained steps start from the same token (and one set there alone is enough)."""
    model = build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, task="seq2seq-lm")
    model.generation_config.decoder_start_token_id = CLS  # the config says otherwise
    assert model.config.decoder_start_token_id != CLS
    ex = Explainer(model, tokenizer, attention="decoder")
    g = ex.explain_generation(PROMPT, max_new_tokens=4, methods=["rawatt"])
    inputs = {k: v for k, v in tokenizer(PROMPT, return_tensors="pt").items() if k != "token_type_ids"}
    want = model.generate(**inputs, max_new_tokens=4, do_sample=False, num_beams=1)[0].tolist()
    assert want[0] == CLS and g.generated_ids == want[1:len(g.generated_ids) + 1]
    with torch.no_grad():  # the explained probabilities are those of the continuation after that start token
        logits = model(**inputs, decoder_input_ids=torch.tensor([[CLS, *g.generated_ids[:-1]]])).logits[0]
    expected = logits.softmax(-1)[range(len(g.generated_ids)), g.generated_ids]
    assert g.probabilities == pytest.approx(expected.tolist(), rel=1e-5)
    model.config.decoder_start_token_id = None
    assert ex.explain_generation(PROMPT, max_new_tokens=2, methods=["rawatt"]).generated_ids == want[1:3]


def test_seq2seq_length_messages_speak_of_the_decoders_window(tokenizer):
    """An encoder-decoder's prompt goes to the encoder: the continuation alone is limited by the decoder's window."""
    model = build_tiny("bart", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, task="seq2seq-lm")
    ex = Explainer(model, tokenizer, attention="decoder")
    room = ex.max_length - 1
    with pytest.warns(UserWarning, match=f"decoder's window of {ex.max_length} positions holds after its start token: "
                                         f"generating at most {room}"):
        ex.explain_generation(PROMPT, max_new_tokens=room + 5, methods=["rawatt"])
    with pytest.raises(InputError, match=rf"continuation \({room + 1} tokens\) does not fit the decoder's window"):
        ex.explain_generation(PROMPT, target=[CLS + 1] * (room + 1), methods=["rawatt"])
    assert len(ex.explain_generation(PROMPT * 3, target=[CLS + 1] * room, methods=["rawatt"]).generated_ids) == room


def test_chat_prompt_goes_through_the_template(lm):
    import copy

    tok = copy.deepcopy(lm.tokenizer)
    tok.chat_template = "[CLS] {% for m in messages %}{{ m['content'] }}{% endfor %} good"
    g = Explainer(lm.model, tok).explain_generation(PROMPT, max_new_tokens=2, methods="rawatt", chat=True)
    assert g.prompt_tokens == ["[CLS]", "the", "movie", "was", "really", "good"] and g.meta["chat_template"]
    assert g.prompt == PROMPT and g.prompt_special[0] and not any(g.prompt_special[1:])


@pytest.mark.parametrize("ig", [{"n_steps": 5}, {"tolerance": 0.05, "max_steps": 9, "internal_batch_size": 3}])
def test_one_forward_over_the_sequence_equals_a_row_per_step(lm, monkeypatch, ig):
    """Steps read from one forward over prompt + continuation (gradients by batched vector-Jacobian products,
    integrated gradients' nodes shared by every step) equal each step run as its own padded row."""
    import attnlens.core.generation_engine as generation

    methods = [*FAST, "integratedgradients", "attnlrp", "transatt", "partiallrp", "valuezeroing"]
    kwargs = dict(methods=methods, max_new_tokens=5, batch_size=3, options={"integratedgradients": ig})
    shared = lm.explain_generation(PROMPT, **kwargs)
    contrast = dict(kwargs, methods=[m for m in methods if get_method(m).class_specific], target=shared.generated_ids,
                    contrast=[V - 1] * len(shared.generated_ids))
    contrasted = lm.explain_generation(PROMPT, **contrast)
    monkeypatch.setattr(generation, "ONE_PASS", False)
    rows = lm.explain_generation(PROMPT, **kwargs)
    rows_contrasted = lm.explain_generation(PROMPT, **contrast)
    assert shared.generated_ids == rows.generated_ids
    for a, b in ((shared, rows), (contrasted, rows_contrasted)):
        np.testing.assert_allclose(a.probabilities, b.probabilities, atol=1e-6)
        assert a.methods == b.methods
        gaps = a.meta["integratedgradients"]  # one figure per step, as explain() gives per input
        applied = {"tolerance"} if "tolerance" in ig else set()
        assert set(gaps) == {"delta", "relative_gap", "n_steps"} | applied
        assert all(len(v) == len(a.generated_ids) for v in gaps.values())
        np.testing.assert_allclose(gaps["delta"], b.meta["integratedgradients"]["delta"], atol=1e-4, rtol=1e-3)
        for m in a.methods:
            np.testing.assert_allclose(a.scores[m], b.scores[m], atol=1e-5, rtol=1e-4, err_msg=m)


def test_integrated_gradients_over_the_sequence_without_logits_to_keep(monkeypatch, tokenizer):
    """A causal LM whose forward does not take ``logits_to_keep`` (older or custom models): integrated gradients
    over a generation reads the full logits at each step's last token instead, with the same result."""
    import attnlens.core.generation_engine as generation

    model = make_lm("gpt2")
    plain_forward = type(model).forward

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs):
        assert "logits_to_keep" not in kwargs
        return plain_forward(self, input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                             **kwargs)

    model.__class__ = type("GPT2WithoutKeepLMHeadModel", (type(model),), {"forward": forward})
    ex = Explainer(model, tokenizer)
    kwargs = dict(methods=["integratedgradients"], max_new_tokens=4, options={"integratedgradients": {"n_steps": 5}})
    shared = ex.explain_generation(PROMPT, **kwargs)
    monkeypatch.setattr(generation, "ONE_PASS", False)
    rows = ex.explain_generation(PROMPT, **kwargs)
    np.testing.assert_allclose(shared.scores["integratedgradients"], rows.scores["integratedgradients"], atol=1e-5,
                               rtol=1e-4)


def test_adaptive_integrated_gradients_stops_at_49_points_by_default(lm):
    """The default max_steps (64) ends the adaptive schedule 4, 7, 13, 25, 49 at 49 points, with the warning."""
    with pytest.warns(UserWarning, match=r"within max_steps=64 .*rough along the straight path"):
        (e,) = lm.explain(PROMPT, methods=["integratedgradients"],
                          options={"integratedgradients": {"tolerance": 1e-12}})
    assert e.meta["integratedgradients"]["n_steps"] == 49


def test_value_zeroing_steps_on_bloom_equal_their_prefix(tokenizer):
    """BLOOM's ALiBi rows (batch × heads) cut per example in value zeroing's reruns, over a generation's steps."""
    ex = Explainer(make_lm("bloom"), tokenizer)
    g = ex.explain_generation(PROMPT, target=" good but bad", methods=["valuezeroing"])
    assert np.abs(g.scores["valuezeroing"]).max() > 0
    _assert_steps_equal_their_prefixes(ex, g, ["valuezeroing"])


# ------------------------------------------------------------------------------ long generations: cap, progress
def test_cli_caps_max_new_tokens_at_the_window_with_one_warning_and_shows_progress(lm_dir, tmp_path, capsys):
    from attnlens.cli import main

    out = tmp_path / "g.json"
    capsys.readouterr()
    assert main(["explain", "--model", lm_dir, "--generate", "--max-new-tokens", "100000", "--max-length", "24",
                 "--methods", "rawatt", "--format", "json", "--out", str(out), PROMPT]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("attnlens: warning:")]
    assert len(warned) == 1 and "max_new_tokens=100000" in warned[0] and "at most" in warned[0]
    assert "generating" in err and "explaining steps" in err  # the two bars, each with elapsed<remaining
    assert re.search(r"\d+:\d+<\d+:\d+", err)
    (g,) = load_generations(out)
    n_prompt, n = len(g.prompt_ids), len(g.generated_ids)
    assert f"at most {24 - n_prompt}" in warned[0]
    eos = Explainer.from_pretrained(lm_dir).model.config.eos_token_id
    assert n_prompt + n == 24 or (n_prompt + n < 24 and g.generated_ids[-1] == eos)
    assert g.meta["max_new_tokens"] == 24 - n_prompt


def test_cli_quiet_prints_no_bar_warning_or_notice(lm_dir, tmp_path, capsys):
    from attnlens.cli import main

    out = tmp_path / "g.json"
    capsys.readouterr()
    assert main(["explain", "--model", lm_dir, "--generate", "--max-new-tokens", "100000", "--max-length", "24",
                 "--methods", "rawatt", "--format", "json", "--out", str(out), "--quiet", PROMPT]) == 0
    assert capsys.readouterr().err == "" and out.is_file()


def test_generation_progress_callback_counts_every_step(tokenizer):
    ex = Explainer(make_lm("gpt2"), tokenizer)
    calls: list[tuple[float, int]] = []
    g = ex.explain_generation(PROMPT, target=" good film , really", methods="rawatt,grads", batch_size=2,
                              progress=lambda done, steps: calls.append((done, steps)))
    n = len(g.generated_ids)
    assert n > 2 and calls[-1] == (pytest.approx(1.0), n)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)  # never backwards
    assert {s for _, s in calls} >= {2, n}  # steps finished per batch of two


def test_a_cut_off_write_leaves_the_old_file_and_no_partial_one(lm_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the output is written: the command stops (status 130), the file there before is unchanged and
    no temporary file stays behind."""
    from pathlib import Path

    from attnlens.cli import main

    out = tmp_path / "g.json"
    out.write_text("earlier run\n", encoding="utf-8")
    real = Path.write_text

    def interrupted(self, data, *args, **kwargs):  # half of the document, then Ctrl-C
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", interrupted)
    assert main(["explain", "--model", lm_dir, "--generate", "--max-new-tokens", "2", "--methods", "rawatt",
                 "--format", "json", "--out", str(out), PROMPT]) == 130
    monkeypatch.undo()
    assert "interrupted" in capsys.readouterr().err
    assert out.read_text(encoding="utf-8") == "earlier run\n" and sorted(tmp_path.iterdir()) == [out]


def test_deprecation_notices_of_transformers_stay_out_of_the_output(tokenizer):
    """The cached greedy loop passes ``past_key_values``, which recent transformers deprecate with a FutureWarning
    on every call: that is attnlens's business, not the user's. The user's own warnings still show."""
    import warnings

    model = make_lm("llama")
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with warnings.catch_warnings(record=True) as bare:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(input_ids=ids, past_key_values=model(input_ids=ids, use_cache=True).past_key_values,
                  use_cache=True)
    ex = Explainer(model, tokenizer)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ex.explain_generation(PROMPT, max_new_tokens=3, methods="rawatt")
        warnings.warn("the user's own", UserWarning, stacklevel=1)
    deprecations = [w for w in seen if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not deprecations, [str(w.message) for w in deprecations]
    assert [str(w.message) for w in seen] == ["the user's own"]
    if not any(issubclass(w.category, FutureWarning) for w in bare):
        pytest.skip("this transformers version deprecates nothing attnlens passes (nothing to filter)")


def test_prompt_and_continuation_offsets_point_at_their_characters(lm):
    g = lm.explain_generation(PROMPT, methods=["rawatt"], max_new_tokens=3)
    assert g.prompt_offsets is not None and len(g.prompt_offsets) == len(g.prompt_ids)
    for token, special, span in zip(g.prompt_tokens, g.prompt_special, g.prompt_offsets):
        if special:
            assert span is None
        else:
            a, b = span
            assert g.prompt[a:b].lower() == token.removeprefix("##").lower()
    starts = [s[0] for s in g.prompt_offsets if s is not None]
    assert starts == sorted(starts)
    assert [g.text[a:b] for a, b in g.generated_offsets] == g.generated
    assert g.tokens_in(0, len(g.text)) == list(range(len(g.generated_ids)))
    assert g.tokens_in(*g.generated_offsets[-1]) == [len(g.generated_ids) - 1]
    with pytest.raises(InputError, match="not a non-empty range"):
        g.tokens_in(2, 2)
    again = Generation.from_dict(json.loads(json.dumps(g.to_dict())))
    assert again.prompt_offsets == g.prompt_offsets and again.to_dict()["generated_offsets"] == [
        list(o) for o in g.generated_offsets]


@pytest.mark.parametrize("family", DECODERS)
def test_greedy_decoding_holds_no_attention_map_nor_every_positions_logits(family):
    """Generating after a long prompt runs fused attention and projects only the last position onto the
    vocabulary: nothing it holds grows with the square of the prompt or with the prompt times the vocabulary, and
    its tokens are those of a plain cached loop over the whole logits."""
    from attnlens.core.generation_engine import greedy
    from attnlens.testing.live_tensors import LiveTensorPeak

    config = make_lm(family).config
    for name in ("max_position_embeddings", "n_positions"):
        if hasattr(config, name):
            setattr(config, name, 1100)
    tokenizer = make_tokenizer()
    tokenizer.model_max_length = 1100
    torch.manual_seed(0)
    ex = Explainer(type(make_lm(family))(config).eval(), tokenizer, max_length=1100)
    prompt = [CLS] + [5 + i % 40 for i in range(999)]
    greedy(ex.runner, prompt[:8], 2)  # warm-up
    projected: list[int] = []
    ex.model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: projected.append(out.shape[1]))
    with LiveTensorPeak() as live:
        ids = greedy(ex.runner, prompt, 3)
    n, heads = len(prompt), config.num_attention_heads
    assert live.peak < heads * n * n * 4 // 2  # not even half of one layer's maps
    assert projected == [1] * len(ids)  # the last position's logits, the prompt's pass included
    projected.clear()
    with torch.no_grad():  # the same tokens as the model's own loop (eager attention, every position's logits)
        past, step, want = None, torch.tensor([prompt]), []
        for _ in range(3):
            out = ex.model(input_ids=step, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
            want.append(token)
            step = torch.tensor([[token]])
    assert ids[: len(want)] == want[: len(ids)]


def test_a_head_view_of_an_encoder_decoders_generation_is_refused_before_generating(tokenizer, tmp_path,
                                                                                    monkeypatch, capsys):
    from attnlens.cli import main

    path = tmp_path / "t5"
    build_tiny("t5", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
               task="seq2seq-lm").save_pretrained(path)
    tokenizer.save_pretrained(path)
    capsys.readouterr()  # what saving it printed
    monkeypatch.setattr(Explainer, "explain_generation", lambda *a, **k: pytest.fail("generated before refusing"))
    code = main(["explain", "--model", str(path), "--generate", "--methods", "rawatt", "--head-view",
                 str(tmp_path / "hv.html"), "the movie was"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "decoder-only models only" in err[0]
    assert not (tmp_path / "hv.html").exists()


def test_the_unknown_token_is_ranked_in_a_generation_as_in_an_explanation(lm):
    """``[UNK]`` stands for text of the prompt (a word the vocabulary lacks): not special, as ``explain`` keeps it."""
    g = lm.explain_generation("the movie zzzq was", max_new_tokens=2, methods="rawatt")
    unk = [i for i, t in enumerate(g.prompt_tokens) if t == "[UNK]"]
    assert unk and not any(g.prompt_special[i] for i in unk)
    assert g.prompt_special[0]  # [CLS] is


def test_a_generation_file_with_arrays_of_other_lengths_is_refused_in_one_line(tmp_path):
    from attnlens import Generation
    from attnlens.results.generation import load_generations

    g = Generation(prompt="a b", prompt_tokens=["a", "b"], prompt_ids=[5, 6], prompt_special=[False, False],
                   generated_tokens=["c", "d"], generated_ids=[7, 8], generated=["c", "d"],
                   scores={"m": np.ones((2, 4))}, probabilities=[0.5, 0.4], predicted_ids=[7, 8])
    d = g.to_dict()
    for key, value, message in (("probabilities", [0.5], "'probabilities' holds 1 entries, not 2"),
                                ("prompt_special", [False], "'prompt_special' holds 1 entries, not 2"),
                                ("scores", {"m": [[1.0] * 3] * 2}, r"scores\['m'\] has shape \(2, 3\)")):
        bad = {**d, key: value}
        (tmp_path / "g.json").write_text(json.dumps(bad))
        with pytest.raises(InputError, match=message):
            load_generations(tmp_path / "g.json")
    greedy = {k: v for k, v in d.items() if k != "predicted_ids"}
    assert Generation.from_dict(greedy).predicted_ids == [7, 8]
    with pytest.raises(InputError, match="'predicted_ids' is missing"):
        Generation.from_dict({**greedy, "forced": True})
    with pytest.raises(InputError, match="no 'prompt'"):
        Generation.from_dict({"text": "x"})


def test_a_wordpiece_continuation_reads_as_words():
    from attnlens import Generation

    g = Generation(prompt="it was", prompt_tokens=["it", "was"], prompt_ids=[5, 6], prompt_special=[False, False],
                   generated_tokens=["un", "##bel", "##ie", "##va", "##bly", "good"], generated_ids=list(range(7, 13)),
                   generated=["un", "##bel", "##ie", "##va", "##bly", "good"], scores={"m": np.zeros((6, 8))},
                   probabilities=[0.5] * 6, predicted_ids=list(range(7, 13)))
    assert g.text == " unbelievably good"
    assert g.tokens_in(1, 13) == [0, 1, 2, 3, 4] and g.tokens_in(14, 18) == [5]


def test_a_step_carries_its_own_figures():
    from attnlens import Generation

    g = Generation(prompt="a b", prompt_tokens=["a", "b"], prompt_ids=[5, 6], prompt_special=[False, False],
                   generated_tokens=["c", "d"], generated_ids=[7, 8], generated=["c", "d"],
                   scores={"integratedgradients": np.ones((2, 4))}, probabilities=[0.5, 0.4], predicted_ids=[7, 8],
                   meta={"integratedgradients": {"delta": [0.1, 0.2], "n_steps": [8, 16], "tolerance": 0.01}})
    assert g.step(1).meta["integratedgradients"] == {"delta": 0.2, "n_steps": 16, "tolerance": 0.01}
    assert g.meta["integratedgradients"]["delta"] == [0.1, 0.2]  # the generation's own stay whole
