"""Context attribution: sources, the answer explained in one pass, ablations against hand computations, the
result's JSON contract and the ``attnlens cite`` command, on tiny random language models (and SmolLM2)."""

from __future__ import annotations

import copy
import html
import json
import re
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import CLS, PAD, SEP, V, make_tokenizer
from test_smollm2 import needs_llm

from attnlens import Explainer, InputError
from attnlens.cli import main
from attnlens.core.answer_engine import answer_logprobs
from attnlens.results.context_attribution import ContextAttribution, load_attributions, save_attributions
from attnlens.sources import DEFAULT_METHODS
from attnlens.sources import methods as source_methods
from attnlens.sources.ablation import ablated_context
from attnlens.sources.prompt import build_prompt, token_sources
from attnlens.sources.segment import split_sources
from attnlens.testing.tiny_models import build_tiny

CONTEXT = "the movie was great . the plot is dull .\n\nthe actors were charming . i loved this film ."
QUERY = "was it good ?"
ANSWER = "it was great"
CHAT = ("{% for m in messages %}[CLS] {{ m['role'] }} : {{ m['content'] }} [SEP] {% endfor %}"
        "{% if add_generation_prompt %}[CLS] assistant : {% endif %}")


def make_lm(family: str, seed: int = 0) -> torch.nn.Module:
    return build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, seed=seed,
                      task="causal-lm")


def lm_tokenizer(chat: bool = False):
    tok = make_tokenizer()
    tok.model_max_length = 256
    if chat:
        tok.chat_template = CHAT
    return tok


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def lm(request) -> Explainer:
    return Explainer(make_lm(request.param), lm_tokenizer(), max_length=64)


# ----------------------------------------------------------------------------------------------- sources
def test_sentence_passage_and_line_sources_are_exact_spans():
    sentences = split_sources(CONTEXT, "sentence")
    assert [s.text for s in sentences] == ["the movie was great .", "the plot is dull .",
                                           "the actors were charming .", "i loved this film ."]
    assert all(CONTEXT[s.start:s.end] == s.text for s in sentences)
    passages = split_sources(CONTEXT, "passage")
    assert [(s.start, s.end) for s in passages] == [(0, 40), (42, 88)]
    lines = split_sources("a\n\n  b c \nd", "line")
    assert [(s.text, s.start, s.end) for s in lines] == [("a", 0, 1), ("b c", 5, 8), ("d", 10, 11)]
    for newline in ("\r\n", "\r"):  # Windows and old Mac files
        text = f"a b.{newline}c d.{newline}{newline}e f."
        assert [s.text for s in split_sources(text, "line")] == ["a b.", "c d.", "e f."]
        assert [s.text for s in split_sources(text, "passage")] == [f"a b.{newline}c d.", "e f."]


@pytest.mark.parametrize("context", ["He said no.?!", "The answer is No.!? Really.!!", "It is 3.5 m.?!\n\nNext one.",
                                     "  (a) first.  (b) second.\t"])
def test_every_character_but_whitespace_is_in_one_sentence(context):
    covered = np.zeros(len(context), dtype=int)
    for s in split_sources(context, "sentence"):
        assert context[s.start:s.end] == s.text
        covered[s.start:s.end] += 1
    assert all(covered[i] == 1 for i, c in enumerate(context) if not c.isspace()), covered


def test_spans_may_be_numpy_integers_and_whitespace_only_spans_are_refused():
    context = "the movie .   the plot ."
    found = split_sources(context, [(np.int64(14), np.int64(24)), np.array([0, 11])])
    assert [s.text for s in found] == ["the plot .", "the movie ."]  # the caller's order
    assert split_sources(context, np.array([[14, 24], [0, 11]])) == found  # one array of spans
    with pytest.raises(InputError, match="source 0 .* is whitespace only"):
        split_sources(context, [(11, 14)])


def test_sentences_never_cross_a_blank_line():
    text = "First part without a stop\n\nsecond part. Third one."
    assert [s.text for s in split_sources(text)] == ["First part without a stop", "second part.", "Third one."]


def test_sources_given_as_spans_or_strings():
    assert [s.text for s in split_sources(CONTEXT, [(4, 9), (0, 3)])] == ["movie", "the"]
    found = split_sources(CONTEXT, ["the plot", "the actors"])
    assert [(s.start, s.end) for s in found] == [(22, 30), (42, 52)]


@pytest.mark.parametrize("context, sources, message", [
    ("", "sentence", "the context is empty"),
    ("  \n ", "sentence", "the context is empty"),
    (CONTEXT, "word", "sources='word'; choose one of sentence, passage, line"),
    (CONTEXT, [(0, 10), (5, 12)], "sources 0 and 1 overlap"),
    (CONTEXT, [(0, 500)], r"source 0 \(0, 500\) is outside the context"),
    (CONTEXT, [(4, 4)], "outside the context .* or empty"),
    (CONTEXT, [(0, 3, 4)], "source 0 must be a \\(start, end\\) pair"),
    (CONTEXT, ["the plot", "the movie"], "source 1 .* is not in the context"),
    (CONTEXT, [], "non-empty list"),
])
def test_bad_sources_are_one_clear_error(context, sources, message):
    with pytest.raises(InputError, match=message):
        split_sources(context, sources)


def test_tokens_map_to_the_source_holding_their_first_character():
    tok = lm_tokenizer()
    prompt = build_prompt(tok, CONTEXT, QUERY, chat=False)
    found = split_sources(CONTEXT)
    owner = token_sources(prompt, found)
    assert prompt.text[prompt.context_start:prompt.context_start + len(CONTEXT)] == CONTEXT
    for (a, b), k in zip(prompt.offsets, owner, strict=True):
        if k >= 0:
            start, end = found[k].start + prompt.context_start, found[k].end + prompt.context_start
            assert start <= a and b <= end, (prompt.text[a:b], found[k].text)
    words = [prompt.text[a:b] for (a, b), k in zip(prompt.offsets, owner, strict=True) if k == 1]
    assert words == ["the", "plot", "is", "dull", "."]
    assert owner[0] == -1 and prompt.ids[0] == CLS  # [CLS] and the template's words belong to no source



@pytest.mark.parametrize("query", ["what does {context} say ?", "is {query} a field ?"])
def test_a_query_holding_a_field_name_is_kept_as_written(query):
    """The template's fields are filled in one pass: the query's own text is never taken for a field."""
    prompt = build_prompt(lm_tokenizer(), CONTEXT, query, template="{context} | {query}", chat=False)
    assert prompt.text.endswith(f"{CONTEXT} | {query}") and prompt.text.count(CONTEXT) == 1

def test_chat_template_keeps_the_context_verbatim():
    tok = lm_tokenizer(chat=True)
    prompt = build_prompt(tok, CONTEXT, QUERY, chat=True)
    assert prompt.text.startswith("[CLS] user : Context: ") and prompt.text.endswith("[CLS] assistant : ")
    assert prompt.text[prompt.context_start:].startswith(CONTEXT)
    assert prompt.ids == tok.apply_chat_template([{"role": "user", "content": f"Context: {CONTEXT}\n\nQuery: {QUERY}"}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
    with pytest.raises(InputError, match="template must contain"):
        build_prompt(tok, CONTEXT, QUERY, template="{context} only", chat=True)
    with pytest.raises(InputError, match="no chat template"):
        build_prompt(lm_tokenizer(), CONTEXT, QUERY, chat=True)


# ---------------------------------------------------------------------------------------- one pass
def test_answer_in_one_pass_equals_the_sum_of_its_tokens_rows(lm):
    """The answer's summed log-probability explained in one pass equals, for methods linear in the explained
    value, the sum of the generation's per-token rows (and the mean for attention-row methods)."""
    prompt = "the movie was really"
    rowwise = ["rawatt", "alti", "grads", "agrad"]
    one = lm.explain_answer(prompt, " great , i loved it", ["inputxgradient", "attnlrp", "decompx", *rowwise])
    rows = lm.explain_generation(prompt, ["inputxgradient", "attnlrp", *rowwise], target=" great , i loved it",
                                 target_kind="loss")
    decompx = lm.explain_generation(prompt, ["decompx"], target=" great , i loved it",
                                    options={"decompx": {"contrast": True}})  # z_t − Σ p z: log p linearised
    n = len(one.tokens)
    assert one.target == [len(rows.prompt_ids), n] and len(rows.generated_ids) == n - len(rows.prompt_ids)
    np.testing.assert_allclose(one.probabilities, rows.probabilities, rtol=1e-5)
    assert one.meta["answer_logprob"] == pytest.approx(float(np.log(rows.probabilities).sum()), rel=1e-5)
    for m, ref in (("inputxgradient", rows.scores["inputxgradient"]), ("attnlrp", rows.scores["attnlrp"]),
                   ("decompx", decompx.scores["decompx"])):
        total = ref.sum(0)
        np.testing.assert_allclose(one.scores[m], total, atol=1e-5 * np.abs(total).max(), err_msg=m)
    for m in rowwise:  # the explained rows' mean (each row's keys up to its own position: the later ones 0)
        np.testing.assert_allclose(one.scores[m], rows.scores[m].mean(0), atol=1e-6, err_msg=m)


def test_an_explained_answer_is_shown_drawn_and_aggregated_to_words(lm, capsys):
    """An answer's target is its token span ``[start, end)``, not a QA span: the views outline its tokens and say
    what is explained, and its words cover the same tokens."""
    from attnlens.viz.colors import answer_positions, prediction_line

    e = lm.explain_answer("the movie was really", " great , i loved it", ["inputxgradient"])
    start, end = e.target
    assert e.is_answer and not e.is_qa and answer_positions(e) == set(range(start, end))
    line = prediction_line(e)
    assert line.startswith("explaining the answer ") and f"(tokens {start}-{end - 1})" in line
    e.show()
    assert "explaining the answer" in capsys.readouterr().out
    assert "explained answer span (outlined)" in e.to_html()
    words = e.to_words()
    assert words.is_answer and words.tokens[words.target[0]:words.target[1]] == ["great", ",", "i", "loved", "it"]
    np.testing.assert_allclose(words.scores["inputxgradient"].sum(), e.scores["inputxgradient"].sum(), rtol=1e-6)


@pytest.mark.parametrize("methods", [["attcat"], ["attgrads"], ["attcat", "attgrads", "cat", "rawatt"]])
def test_a_one_token_answer_is_explained_as_its_generation_step(lm, methods):
    """Methods averaging over query rows (AttCAT's received attention, Grad-SAM) average over the rows the answer
    can depend on: the answer's own last row, which feeds no explained logit, is not one of them."""
    prompt = "the movie was really"
    one = lm.explain_answer(prompt, " great", methods, target_kind="loss")
    step = lm.explain_generation(prompt, methods, target=" great", target_kind="loss")
    for m in methods:
        np.testing.assert_allclose(one.scores[m], step.scores[m][0], rtol=1e-5, atol=1e-6, err_msg=m)


def test_answer_logprobs_equal_each_prompt_alone_in_float64(lm):
    """Batched, left-padded, only the answer's positions projected: the same as each prompt run alone in float64
    (also with tokens hidden from attention)."""
    tok = lm.tokenizer
    prompts = [tok(t)["input_ids"] for t in ("the movie was", "a film , the plot is dull and the actors",
                                             "i really didn ' t like this")]
    answer = tok(" great film", add_special_tokens=False)["input_ids"]
    masks = [None, [0 if j in (2, 3) else 1 for j in range(len(prompts[1]))], [1] * len(prompts[2])]
    ref_model = copy.deepcopy(lm.model).double().eval()

    def alone(ids, mask=None):
        seq = torch.tensor([ids + answer])
        att = torch.ones_like(seq) if mask is None else torch.tensor([mask + [1] * len(answer)])
        with torch.no_grad():
            logp = ref_model(input_ids=seq, attention_mask=att,
                             position_ids=torch.arange(seq.shape[1])[None]).logits[0].log_softmax(-1)
        return sum(float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(answer))

    got = answer_logprobs(lm, prompts, answer)
    np.testing.assert_allclose(got, [alone(p) for p in prompts], rtol=1e-5)
    got = answer_logprobs(lm, prompts, answer, masks=masks, batch_size=1)
    np.testing.assert_allclose(got, [alone(p, m) for p, m in zip(prompts, masks, strict=True)], rtol=1e-5)


CACHED = ("gpt2", "gpt_neo", "gpt_neox", "gptj", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2",
          "phi", "phi3", "opt", "bloom", "falcon")


def _short_window_mistral() -> torch.nn.Module:
    """A tiny Mistral whose sliding window (8 tokens) is shorter than the prompts: its cache drops positions."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=24, num_key_value_heads=1, max_position_embeddings=64,
                                        sliding_window=8, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP)
    return transformers.MistralForCausalLM(config).eval()


@pytest.mark.parametrize("group", [1, 3], ids=["one-per-forward", "three-per-forward"])
@pytest.mark.parametrize("family", [*CACHED, "mistral-window8"])
def test_prompts_that_share_a_beginning_run_on_its_cache_with_the_same_logprobs(family, group, monkeypatch):
    """Leave-one-out's prompts begin as the whole prompt does until the source they leave out: the shared
    beginning runs once and each prompt from where it departs, on a key/value cache of it up to there (one
    prompt per forward on a CPU; on an accelerator several, left-padded after the beginning they all share). The
    log-probabilities equal each prompt run alone in float64 (Mixtral: float32); a sliding window shorter than
    the prompts, whose cache drops early positions, runs the batched forwards (Mistral's and Gemma 2's default
    windows, 4,096 tokens, hold these prompts)."""
    from attnlens.core import answer_engine

    forwards = []
    monkeypatch.setattr(answer_engine, "_prompts_per_cached_forward",
                        lambda device, fit, batch_size: forwards.append(fit) or min(fit, group))

    model = _short_window_mistral() if family == "mistral-window8" else make_lm(family)
    ex = Explainer(model, lm_tokenizer(), max_length=64)
    tok = ex.tokenizer
    reference = tok("the movie was great . the plot is dull . the actors were charming . i loved it")["input_ids"]
    prompts = [reference, reference[:3] + reference[8:], reference[:9] + reference[14:], reference[:-4],
               reference[:1] + reference[6:], [reference[1]] + reference[1:]]  # the last shares nothing
    answer = tok(" great film", add_special_tokens=False)["input_ids"]
    ref_model = copy.deepcopy(ex.model).eval()
    if family != "mixtral":  # its experts' grouped product has no float64 kernel
        ref_model.double()

    def alone(ids):
        seq = torch.tensor([ids + answer])
        with torch.no_grad():
            logp = ref_model(input_ids=seq, position_ids=torch.arange(seq.shape[1])[None]).logits[0].log_softmax(-1)
        return sum(float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(answer))

    batched = []
    real = answer_engine._batched_logprobs
    monkeypatch.setattr(answer_engine, "_batched_logprobs", lambda *a: batched.append(len(a[1])) or real(*a))
    done = []
    got = answer_logprobs(ex.runner, prompts, answer, reference=reference, progress=done.append)
    np.testing.assert_allclose(got, [alone(p) for p in prompts], rtol=1e-5)
    assert batched == ([] if family in CACHED else [len(prompts)]) and sum(done) == len(prompts)
    # prompts that share too little of it run batched
    batched.clear()
    answer_logprobs(ex.runner, prompts[1:], answer, reference=list(reversed(reference)))
    assert batched == [len(prompts) - 1]
    if family not in CACHED:
        return
    # random ablations that all drop the first source share little with the whole prompt but much with each
    # other: in lexicographic order each runs on the cache of the one before it
    chunks = [reference[:2], reference[2:5], *(reference[j:j + 3] for j in range(5, len(reference), 3))]
    keep = np.random.default_rng(0).random((10, len(chunks))) < 0.5
    keep[:, 0], keep[:, 1] = True, False
    ablated = [sum((c for c, kept in zip(chunks, row, strict=True) if kept), []) for row in keep]
    got = answer_logprobs(ex.runner, ablated, answer, reference=reference)
    np.testing.assert_allclose(got, [alone(p) for p in ablated], rtol=1e-5)
    assert batched == [len(prompts) - 1]  # no further batched forwards
    assert forwards and min(forwards) >= group  # the budget holds the groups


# -------------------------------------------------------------------------------------------- ablations
def _logprob_by_hand(ex: Explainer, context: str, answer: str) -> float:
    ids = ex.tokenizer(f"Context: {context}\n\nQuery: {QUERY}")["input_ids"]
    ans = ex.tokenizer(answer, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = ex.model(input_ids=torch.tensor([ids + ans])).logits[0].double().log_softmax(-1)
    return sum(float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(ans))


def test_loo_is_the_drop_when_each_source_is_removed_by_hand(lm):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"], chat=False)
    full = _logprob_by_hand(lm, CONTEXT, ANSWER)
    expected = [full - _logprob_by_hand(lm, ablated_context(CONTEXT, r.sources, [j != i for j in range(4)]), ANSWER)
                for i in range(4)]
    np.testing.assert_allclose(r.scores["loo"], expected, rtol=1e-4, atol=1e-5)
    assert r.meta["answer_logprob"] == pytest.approx(full, rel=1e-5)
    assert ablated_context(CONTEXT, r.sources, [True, False, True, True]) == (
        "the movie was great . \n\nthe actors were charming . i loved this film .")


def test_masked_ablation_hides_the_source_tokens(lm):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"], chat=False, ablation="mask")
    prompt = build_prompt(lm.tokenizer, CONTEXT, QUERY, chat=False)
    owner = token_sources(prompt, r.sources)
    answer = lm.tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    full = answer_logprobs(lm, [prompt.ids], answer)[0]
    for i in range(4):
        hidden = [[0 if k == i else 1 for k in owner]]
        assert r.scores["loo"][i] == pytest.approx(full - answer_logprobs(lm, [prompt.ids], answer, masks=hidden)[0],
                                                   rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("ablation", ["remove", "mask"])
def test_repeated_ablation_masks_run_once_and_keep_their_rows(lm, monkeypatch, ablation):
    from attnlens.sources import ablation as ablation_module
    from attnlens.sources.attribute import prepare_job

    job = prepare_job(lm.runner, CONTEXT, QUERY, answer=ANSWER, sources="sentence", ablation=ablation)
    keep = np.array([[1, 0, 1, 1], [0, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], dtype=bool)
    batches = []
    real = ablation_module.answer_logprobs
    monkeypatch.setattr(ablation_module, "answer_logprobs",
                        lambda runner, prompts, *a, **k: batches.append(len(prompts)) or real(runner, prompts, *a, **k))
    done = []
    job.progress = done.append
    values = ablation_module.ablation_logprobs(job, keep)
    assert batches == [3] and sum(done) == 5
    one_by_one = [ablation_module.ablation_logprobs(job, row[None])[0] for row in keep]
    np.testing.assert_allclose(values, one_by_one, rtol=1e-5, atol=1e-6)
    assert values[0] == values[2] and values[1] == values[4]


def test_source_methods_move_a_progress_bar_to_its_end(lm, monkeypatch):
    import tqdm.auto

    bars = []

    class Bar:
        def __init__(self, total, **_):
            self.total, self.n, self.updates = total, 0, []
            bars.append(self)

        def update(self, k=1):
            self.n += k
            self.updates.append(k)

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo", "contextcite"], chat=False,
                         options={"contextcite": {"n_ablations": 12}}, progress=True)
    (bar,) = [b for b in bars if b.total == 4 + 1 + 12]  # loo: one forward per source and the full prompt
    assert bar.n == bar.total
    # the forwards themselves moved it (the repeated masks counted as done): each method's top-up adds nothing
    assert bar.updates[-1] == 0 and len([k for k in bar.updates if k]) >= 3


@pytest.mark.parametrize("per_token", [False, True])
def test_a_progress_callable_sees_the_work_move_to_its_end_and_can_stop_it(lm, per_token):
    reports: list[tuple[float, int]] = []
    methods = ["inputxgradient", "loo", "contextcite"]
    options = {"contextcite": {"n_ablations": 12}}
    done = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=methods, chat=False, options=options,
                                per_token=per_token, progress=lambda f, d: reports.append((f, d)))
    fractions = [f for f, _ in reports]
    assert fractions == sorted(fractions) and reports[-1] == (pytest.approx(1.0), 1)
    assert [d for _, d in reports[:-1]] == [0] * (len(reports) - 1)
    # the token pass, then the ablation batches of each source method, each report a step further
    assert len(set(fractions)) >= (10 if per_token else 4)
    assert 0 < fractions[0] < 0.5

    class Stop(Exception):
        pass

    def stop(fraction: float, _done: int) -> None:
        if fraction > 0.5:
            raise Stop

    with pytest.raises(Stop):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=methods, chat=False, options=options,
                             per_token=per_token, progress=stop)
    assert set(done.scores) == set(methods)


def test_contextcite_recovers_a_linear_response(lm, monkeypatch):
    """With a log-probability that is linear in the kept sources, the Lasso surrogate finds the weights."""
    weights = np.array([2.0, -1.0, 0.0, 4.0])
    seen = {}

    def linear(job, keep):
        seen["shape"] = keep.shape
        return -10.0 + keep.astype(float) @ weights

    monkeypatch.setattr(source_methods, "ablation_logprobs", linear)
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["contextcite"], chat=False,
                             options={"contextcite": {"n_ablations": 40, "alpha": 1e-4}})
    assert seen["shape"] == (40, 4)
    np.testing.assert_allclose(r.scores["contextcite"], weights, atol=1e-2)
    assert r.meta["methods"]["contextcite"]["intercept"] == pytest.approx(-10.0, abs=1e-2)


# ------------------------------------------------------------------------------------------ the result
def test_source_scores_are_the_token_scores_summed_per_source(lm):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["inputxgradient", "decompx"], chat=False)
    owner = np.array(r.token_source)
    for m in ("inputxgradient", "decompx"):
        tok = r.token_scores[m]
        assert len(tok) == len(r.prompt_tokens) == len(owner)
        for i in range(len(r.sources)):
            assert r.scores[m][i] == pytest.approx(tok[owner == i].sum(), abs=1e-12)
        share = np.abs(tok[owner < 0]).sum() / np.abs(tok).sum()
        assert r.meta["outside_share"][m] == pytest.approx(share)
    direct = lm.explain_answer(r.prompt, r.answer, ["inputxgradient"])  # plain prompt: the same tokens
    # alone, inputxgradient's pass runs fused attention; beside decompx, eager attention with the whole maps: the
    # two round differently (docs/long-context.md: within 1e-5 of the largest score)
    want = direct.scores["inputxgradient"][:len(owner)]
    np.testing.assert_allclose(r.token_scores["inputxgradient"], want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_an_answer_stretch_is_explained_after_the_answer_before_it(lm):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["inputxgradient"], chat=False,
                             answer_span=(3, 6))  # "was"
    assert r.meta["explained"] == [3, 6] and r.meta["explained_text"] == "was"
    prompt = build_prompt(lm.tokenizer, CONTEXT, QUERY, chat=False)
    it = lm.tokenizer("it", add_special_tokens=False)["input_ids"]
    was = lm.tokenizer("was", add_special_tokens=False)["input_ids"]
    direct = lm.explain_answer(prompt.ids + it, was, ["inputxgradient"])
    np.testing.assert_allclose(r.token_scores["inputxgradient"], direct.scores["inputxgradient"][:len(prompt.ids)])
    assert r.answer_tokens == ["it", "was", "great"] and r.answer_offsets == [(0, 2), (3, 6), (7, 12)]
    with pytest.raises(InputError, match=r"answer_span \(5, 40\) is empty or outside the answer"):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"], chat=False, answer_span=(5, 40))


def test_default_methods_leave_out_what_the_budget_cannot_hold_and_say_so(lm, monkeypatch):
    from attnlens.core.answer_engine import methods_within_budget
    from attnlens.sources import attribute

    n = 200_000  # long enough for the tiny model's passes (AttnLRP's fused one too) to need more than 64 MiB
    need = {m: methods_within_budget(lm.runner, [m], n, 64 * 2**20)[1][m] for m in ("decompx", "attnlrp")}
    cheap, dear = sorted(need, key=need.get)
    assert need[cheap] < need[dear]
    budget = (need[cheap] + need[dear]) // 2  # holds the cheaper one alone, not the other
    assert methods_within_budget(lm.runner, ["decompx", "attnlrp"], n, budget) == ([cheap], {dear: need[dear]})
    assert methods_within_budget(lm.runner, ["decompx", "attnlrp"], n, 2**45)[1] == {}
    # attribute_context asks it at the prompt's length and warns about what it left out
    monkeypatch.setattr(attribute, "methods_within_budget", lambda runner, methods, n, budget, answer_tokens: (
        [m for m in methods if m != "attnlrp"], {"attnlrp": 5 * 2**30}))
    with pytest.warns(UserWarning, match="left out of the default methods at .* tokens.*attnlrp about 5.0 GiB"):
        r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, chat=False)
    assert r.methods == ["attngate", "loo"]


def test_default_methods_in_their_order_the_first_read_by_top(lm):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, chat=False)
    assert r.methods == list(DEFAULT_METHODS) == ["attngate", "attnlrp", "loo"]
    assert [i for i, _, _ in r.top(4)] == [i for i, _, _ in r.top(4, "attngate")]
    mixed = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, chat=False, methods="loo,rawatt,attngate")
    assert mixed.methods == ["loo", "rawatt", "attngate"]  # as named, token-level and source-level mixed


def test_defaults_leave_out_attention_gates_where_the_model_cannot_gate_and_a_named_one_is_refused(monkeypatch):
    """BLOOM computes its attention itself (ALiBi), not through transformers' attention interface that the gates
    stand in for: the defaults go on without ``attngate`` and say why; named, it is refused with one line before
    the answer is generated."""
    from attnlens.sources import attribute, gates

    ex = Explainer(make_lm("bloom"), lm_tokenizer(), max_length=64)
    why = "it does not run transformers' attention interface"
    assert gates.ungateable(ex.model) == why
    assert attribute.defaults_for(ex.model) == ["attnlrp", "loo"]
    with pytest.warns(UserWarning, match=rf"left out of the default methods: attngate cannot gate "
                                         rf"BloomForCausalLM's attention \({why}\)"):
        r = ex.attribute_context(CONTEXT, QUERY, answer=ANSWER, chat=False)
    assert r.methods == ["attnlrp", "loo"]
    generated: list[int] = []
    monkeypatch.setattr(attribute, "greedy", lambda *a, **k: generated.append(1) or [5])
    with pytest.raises(InputError, match=rf"^attngate cannot gate BloomForCausalLM's attention \({why}\); use at2, "
                                         r"loo or contextcite$"):
        ex.attribute_context(CONTEXT, QUERY, methods=["loo", "attngate"], chat=False)
    assert generated == []
    llama = make_lm("llama")
    assert gates.ungateable(llama) is None and attribute.defaults_for(llama) == ["attngate", "attnlrp", "loo"]


@pytest.mark.parametrize("methods", [["attnlrp"], ["loo", "attngate"]])
def test_methods_over_the_budget_are_refused_before_the_answer_is_generated(lm, monkeypatch, methods):
    from attnlens.core import engine
    from attnlens.sources import attribute, gates

    generated: list[int] = []
    answer_ids = lm.tokenizer(" " + ANSWER, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(attribute, "greedy", lambda *a, **k: generated.append(1) or list(answer_ids))
    with monkeypatch.context() as m:
        m.setattr(engine, "pass_row_bytes", lambda *a: 2**40)
        m.setattr(gates, "pass_row_bytes", lambda *a: 2**40)
        with pytest.raises(InputError, match=r"an input of \d+ tokens with attnlrp needs about|attngate over \d+ "
                                             r"tokens needs about"):
            lm.attribute_context(CONTEXT, QUERY, methods=methods, chat=False)
    assert generated == []
    r = lm.attribute_context(CONTEXT, QUERY, methods=methods, chat=False)  # within the budget: generated, scored
    assert generated == [1] and r.meta["generated"] and r.methods == methods


def test_per_token_rows_add_up_to_the_answer_and_equal_each_tokens_own_attribution(lm):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["inputxgradient", "loo"], chat=False,
                             per_token=True)
    assert r.token_row_steps == [0, 1, 2]
    for m in ("inputxgradient", "loo"):  # both are linear in the summed log-probability
        assert r.token_rows[m].shape == (3, len(r.sources))
        # loo's are differences of float32 log-probabilities of about 10 nats, from forwards of different lengths
        # (each token's ablations share a different beginning): 1e-5 is a few of their rounding steps
        np.testing.assert_allclose(r.token_rows[m].sum(0), r.scores[m], rtol=1e-5, atol=1e-5 if m == "loo" else 1e-6)
    was = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["inputxgradient", "loo"], chat=False,
                               answer_span=(3, 6))
    for m in ("inputxgradient", "loo"):
        np.testing.assert_allclose(r.token_rows[m][1], was.scores[m], rtol=1e-6, atol=1e-9)
    again = ContextAttribution.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again.token_row_steps == [0, 1, 2]
    np.testing.assert_array_equal(again.token_rows["loo"], r.token_rows["loo"])
    span = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"], chat=False, answer_span=(3, 12),
                                per_token=True)
    assert span.token_row_steps == [1, 2] and "token_rows" not in was.to_dict()


def test_the_html_page_shows_each_answer_tokens_top_source(lm):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["inputxgradient", "loo"], chat=False,
                             per_token=True)
    page = r.to_html()
    table = page.split('class="top ranked token-rows">', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr><td>(.*?)</td>(.*?)</tr>", table)
    assert [html.unescape(label) for label, _ in rows] == [repr(t) for t in r.answer_tokens]
    for row, (_, cells) in enumerate(rows):
        shown = re.findall(r'<td class="num" title="([^"]*)">\[(\d+)\] ([^<]+)</td>', cells)
        for m, (title, index, score) in zip(r.token_rows, shown, strict=True):
            best = int(np.argmax(r.token_rows[m][row]))
            assert int(index) == best and html.unescape(title) == r.sources[best].text
            assert float(score) == pytest.approx(r.token_rows[m][row, best], rel=1e-2)
    assert "token-rows" not in lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"],
                                                    chat=False).to_html()


def test_json_contract_and_round_trip(lm, tmp_path):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["rawatt", "loo"], chat=False)
    d = json.loads(r.to_json())
    assert set(d) == {"context", "query", "prompt", "answer", "sources", "meta"}
    assert d["prompt"][d["meta"]["context_start"]:].startswith(CONTEXT)
    for s in d["sources"]:
        assert CONTEXT[s["start"]:s["end"]] == s["text"] and set(s["scores"]) == {"rawatt", "loo"}
    r.save(tmp_path / "a.jsonl")
    (back,) = load_attributions(tmp_path / "a.jsonl")
    assert back.sources == r.sources and back.prompt_tokens == r.prompt_tokens
    for m in r.scores:
        np.testing.assert_array_equal(back.scores[m], r.scores[m])
        np.testing.assert_array_equal(back.token_scores.get(m, np.zeros(0)), r.token_scores.get(m, np.zeros(0)))
    assert r.ranked("loo")[0][2] == max(r.scores["loo"])


def test_attributions_whose_texts_hold_unicode_line_separators_read_back(lm, tmp_path):
    """JSON Lines split at newlines only: U+2028, U+0085 and form feeds stay inside a JSON string."""
    context = "the movie was great .\u2028the plot is dull .\x0c i loved this film .\x85"
    r = lm.attribute_context(context, QUERY, answer=ANSWER, methods=["rawatt"], chat=False)
    save_attributions([r, r], tmp_path / "two.jsonl")
    back = load_attributions(tmp_path / "two.jsonl")
    assert len(back) == 2 and all(b.context == context for b in back)


def test_a_generated_answer_is_the_greedy_continuation_without_the_end_token():
    ex = Explainer(make_lm("llama", seed=2), lm_tokenizer(), max_length=64)
    r = ex.attribute_context(CONTEXT, QUERY, methods=["rawatt"], chat=False, max_new_tokens=4)
    prompt = build_prompt(ex.tokenizer, CONTEXT, QUERY, chat=False)
    g = ex.explain_generation(prompt.text, ["rawatt"], max_new_tokens=4)
    assert g.generated_ids[-1] != SEP and r.meta["generated"]
    def decode(ids):
        return ex.tokenizer.decode(ids, clean_up_tokenization_spaces=False)

    # the text the generated tokens add after the prompt's (WordPiece joins words with a space)
    assert decode(prompt.ids) + r.answer == decode(prompt.ids + g.generated_ids)
    assert r.answer == " " + decode(g.generated_ids)
    assert "".join(r.answer_tokens).replace(" ", "") == r.answer.replace(" ", "")
    silent = Explainer(make_lm("gpt2", seed=0), lm_tokenizer(), max_length=64)  # answers [SEP] at once
    with pytest.raises(InputError, match="the model answered nothing"):
        silent.attribute_context(CONTEXT, QUERY, methods=["rawatt"], chat=False)



class _ByteTokenizer:
    """Token ids are UTF-8 bytes, decoded as byte-level tokenizers decode them (an unfinished character as U+FFFD);
    ids from 256 on are the byte strings of ``merged``."""

    def __init__(self, merged=()):
        self.merged = list(merged)

    def decode(self, ids, **_):
        return b"".join(bytes([i]) if i < 256 else self.merged[i - 256] for i in ids).decode("utf-8", errors="replace")


def test_a_generated_answer_that_stops_inside_a_character_keeps_whole_characters():
    from types import SimpleNamespace

    from attnlens.sources import attribute

    runner = SimpleNamespace(tokenizer=_ByteTokenizer())
    ids = list("ab 美".encode()) + list("国".encode())[:2]  # the token limit fell inside 国
    with pytest.warns(UserWarning, match="last 2 tokens stop inside a character"):
        kept = attribute._whole_characters(runner, ids)
    assert kept == list("ab 美".encode())
    text, spans = attribute._answer_offsets(runner, kept)
    assert text == "ab 美" and [text[a:b] for a, b in spans] == ["a", "b", " ", "", "", "美"]
    whole = list("ok 美".encode())
    assert attribute._whole_characters(runner, whole) == whole
    # a token holding whole characters and the first bytes of the next keeps its whole characters
    merged = SimpleNamespace(tokenizer=_ByteTokenizer(["c美".encode()[:2], "美".encode()[1:]]))
    text, spans = attribute._answer_offsets(merged, [ord("a"), ord("b"), 256, 257])
    assert text == "abc美" and [text[a:b] for a, b in spans] == ["a", "b", "c", "美"]

@pytest.mark.parametrize("kwargs, message", [
    (dict(query=""), "the query is empty"),
    (dict(answer=""), "the answer is empty"),
    (dict(answer="\n "), "the answer is empty"),  # as the command line refuses it
    (dict(methods=["nosuch"]), "nosuch"),
    (dict(ablation="zero"), "ablation='zero'"),
    (dict(options={"loo": {"n": 3}}), "loo has no option n"),
    (dict(options={"attcat": {}}), "options given for 'attcat'"),
    (dict(context="the movie " * 200), "longer than the model's maximum|no room for an answer"),
    (dict(template=5), "the template must be a string"),
    (dict(answer=None, max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(answer=None, max_new_tokens=-3), "max_new_tokens must be an integer >= 1, got -3"),
    (dict(answer=None, max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
])
def test_bad_input_is_one_clear_error(lm, kwargs, message):
    args = {"context": CONTEXT, "query": QUERY, "answer": ANSWER, "methods": ["loo"], "chat": False, **kwargs}
    with pytest.raises(InputError, match=message):
        lm.attribute_context(args.pop("context"), args.pop("query"), **args)


def test_html_shades_sources_and_escapes_text(lm):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["rawatt", "loo"], chat=False)
    r.query = "<script>alert(1)</script>"
    page = r.to_html()
    assert "<script>alert" not in page and "&lt;script&gt;" in page
    assert page.count('class="src"') == 2 * len(r.sources)  # one shaded context per method
    assert "loo: " in page and "rawatt: " in page


@pytest.mark.parametrize("count", [50, 51, 52])
def test_a_page_of_many_attributions_draws_fifty_and_counts_the_rest(lm, count):
    from attnlens.viz.sources import SHOWN_ATTRIBUTIONS, attribution_html

    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"], chat=False)
    page = attribution_html([r] * count)
    assert page.count('<section class="example">') == min(count, SHOWN_ATTRIBUTIONS) == 50
    assert (f"{count - 50} more not shown" in page) == (count > 50) and "0 more not shown" not in page


def test_scores_keep_their_digits_at_any_scale(lm, capsys):
    from rich.console import Console

    from attnlens.viz.sources import print_attribution, score_text

    assert [score_text(v) for v in (3.88621, 1.234e-4, -2e-7, 0.0)] == ["+3.886", "+0.0001234", "-2e-07", "+0"]
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"], chat=False)
    r.scores["loo"] = np.array([4e-5, 3e-5, 2e-5, 1e-5])[: len(r.sources)]
    print_attribution(r, console=Console(width=200))
    out = capsys.readouterr().out
    assert "+4e-05" in out and "+1e-05" in out and "+0.0000" not in out
    assert "loo: +4e-05" in r.to_html() and "[0] +4e-05" in r.to_html()


def test_the_terminal_view_prints_brackets_as_written(lm, capsys):
    """Retrieved text holds brackets (citations, code, wiki markup): printed as written, never read as markup."""
    from rich.console import Console

    from attnlens.viz.sources import print_attribution

    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"], chat=False, per_token=True)
    r.query, r.answer = "what [b]color[/b] is [/] it ?", " [red]blue[/red] is it"
    r.sources[0] = replace(r.sources[0], text="the flag [bold]color[/bold] is [link=http://x]red[/link] [/] [1]")
    r.meta["outside_share"] = {"loo": 0.0}
    print_attribution(r, console=Console(width=300, color_system=None))
    out = capsys.readouterr().out
    for text in (r.query, r.answer, r.sources[0].text):
        assert text in out


def test_a_result_read_back_without_its_tokens_keeps_and_shows_its_per_token_rows(lm, capsys, tmp_path):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"], chat=False, per_token=True)
    written = json.loads(json.dumps(r.to_dict(tokens=False)))
    back = ContextAttribution.from_dict(written)
    assert back.token_rows and not back.answer_tokens
    assert back.to_dict() == written  # the rows' spans too
    assert back.row_spans == r.row_spans and len(r.row_spans) == len(r.token_row_steps)
    back.show()
    out = capsys.readouterr().out
    assert "answer token 0" not in out
    for a, b in r.row_spans:
        assert repr(r.answer[a:b]) in out
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(written).encode())
    assert load_attributions(tmp_path / "bom.json")[0].to_dict() == written
    (tmp_path / "latin.json").write_bytes(b"\xe9")
    for path, message in ((tmp_path / "none.json", "no such file"), (tmp_path, "it is a folder"),
                          (tmp_path / "latin.json", "not a UTF-8 text file")):
        with pytest.raises(InputError, match=message):
            load_attributions(path)


@pytest.mark.parametrize(("first", "last", "span"), [
    (0, 5, (0, 15)),  # every token: the whole answer
    (0, 2, (0, 2)),  # two newline tokens: whitespace only, and explained
    (2, 5, (2, 15)),
    (4, 5, (10, 15)),  # " Paris" without its leading space
])
def test_the_explained_span_covers_every_explained_token(first, last, span):
    from attnlens.sources.attribute import _explained_span

    text = "\n\nAnswer: Paris"
    offsets = [(0, 1), (1, 2), (2, 8), (8, 9), (9, 15)]
    assert _explained_span(text, offsets, first, last) == span


# ------------------------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-lm")
    make_lm("llama").save_pretrained(path)
    lm_tokenizer().save_pretrained(path)
    return str(path)


def test_cli_context_benchmark_refuses_a_folder_another_run_is_writing(lm_dir, tmp_path, capsys):
    from attnlens.evaluation.results import results_lock

    out = tmp_path / "run"
    out.mkdir()
    with results_lock(out):  # another benchmark holds the folder
        code = main(["benchmark", "--task", "context", "--dataset", "squad-context", "--model", lm_dir,
                     "--methods", "loo", "--limit", "1", "--lds-ablations", "4", "--quiet", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is being written by another benchmark (pid" in err and "\n" not in err
    assert not list(out.iterdir())  # nothing written there


def test_cli_cite_json_terminal_and_html(lm_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ctx = tmp_path / "ctx.txt"
    ctx.write_text(CONTEXT, encoding="utf-8")
    base = ["cite", "--model", lm_dir, "--context-file", str(ctx), "--query", QUERY, "--answer", ANSWER,
            "--no-chat", "--methods", "inputxgradient,loo"]
    assert main([*base, "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["answer"] == ANSWER and len(d["sources"]) == 4 and d["prompt"].endswith(f"Query: {QUERY}")
    assert main([*base, "--sources", "passage"]) == 0
    out = capsys.readouterr().out
    assert "inputxgradient" in out and "loo" in out and "[0] the movie was great" in out
    assert main([*base, "--format", "html", "--out", str(tmp_path / "c.html")]) == 0
    assert 'class="src"' in (tmp_path / "c.html").read_text(encoding="utf-8")
    capsys.readouterr()
    for fmt in ("html", "json"):  # "-": standard output
        assert main([*base, "--format", fmt, "--out", "-"]) == 0
        assert ('class="src"' if fmt == "html" else '"sources"') in capsys.readouterr().out
    assert not (tmp_path / "-").exists()
    gated = ["--methods", "attngate,contextcite", "--options",
             '{"attngate": {"queries": "all", "gate": 1.0}, "contextcite": {"n_ablations": 8}}']
    assert main([*base[:-2], *gated, "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["meta"]["options"]["attngate"] == {"gate": 1.0, "queries": "all", "steps": 1}
    assert d["meta"]["options"]["contextcite"]["n_ablations"] == 8


def test_cli_cite_shows_a_bar_at_a_terminal_and_nothing_under_quiet(lm_dir, tmp_path, capsys, monkeypatch):
    import sys

    base = ["cite", "--model", lm_dir, "--context", CONTEXT, "--query", QUERY, "--answer", ANSWER, "--no-chat",
            "--methods", "loo", "--format", "json", "--out", str(tmp_path / "c.json")]
    assert main(base) == 0  # not a terminal: no bar, the file named
    assert capsys.readouterr().err.strip().splitlines() == [f"wrote {tmp_path / 'c.json'}"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(base) == 0
    assert "%|" in capsys.readouterr().err  # at a terminal: a progress bar
    assert main([*base, "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "c.json").read_text())["answer"] == ANSWER


def test_cli_cite_offsets_index_the_context_file_as_written(lm_dir, tmp_path, capsys):
    """A context file with Windows line endings is read as it is: the JSON's context is the file's text and each
    source's offsets select its text there."""
    text = "the movie was great .\r\nthe plot is dull .\r\n\r\nthe actors were charming ."
    ctx = tmp_path / "crlf.txt"
    ctx.write_bytes(text.encode("utf-8"))
    assert main(["cite", "--model", lm_dir, "--context-file", str(ctx), "--query", QUERY, "--answer", ANSWER,
                 "--no-chat", "--methods", "loo", "--sources", "line", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["context"] == text and text in d["prompt"]
    assert [text[s["start"]:s["end"]] for s in d["sources"]] == [
        "the movie was great .", "the plot is dull .", "the actors were charming ."]
    assert [s["text"] for s in d["sources"]] == [text[s["start"]:s["end"]] for s in d["sources"]]
    page = tmp_path / "crlf.html"
    assert main(["cite", "--model", lm_dir, "--context-file", str(ctx), "--query", QUERY, "--answer", ANSWER,
                 "--no-chat", "--methods", "loo", "--sources", "line", "--format", "html", "--out", str(page)]) == 0
    html_text = page.read_bytes().decode("utf-8")
    assert "\\x0d" not in html_text and "the movie was great .</span>\r\n" in html_text  # line breaks, not escapes

    ctx.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))  # a byte-order mark is not part of the text
    assert main(["cite", "--model", lm_dir, "--context-file", str(ctx), "--query", QUERY, "--answer", ANSWER,
                 "--no-chat", "--methods", "loo", "--sources", "line", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["context"] == text and d["sources"][0]["text"] == "the movie was great ."


def test_cli_cite_template_reads_newline_and_tab_escapes(lm_dir, capsys):
    r"""A template typed on one command line writes its line breaks as ``\n`` (as ``--help`` shows the default)."""
    assert main(["cite", "--model", lm_dir, "--context", CONTEXT, "--query", QUERY, "--answer", ANSWER, "--no-chat",
                 "--methods", "loo", "--template", r"Context: {context}\n\tQuery: {query} \\n \x",
                 "--format", "json"]) == 0
    prompt = json.loads(capsys.readouterr().out)["prompt"]
    assert prompt.endswith(f"Context: {CONTEXT}\n\tQuery: {QUERY} \\n \\x")


@pytest.mark.parametrize("extra, message", [
    (["--query", " "], "the query is empty"),
    (["--context", " "], "the context is empty"),
    (["--answer", " "], "--answer is empty"),
    (["--methods", "loo", "--n-ablations", "8"], "--n-ablations is an option of contextcite"),
    (["--answer-span", "x"], "--answer-span 'x'"),
    (["--methods", "at2,at2lrp", "--at2-weights", "w.json"], "name exactly one of them"),
    (["--methods", "loo", "--at2-weights", "w.json"], "--at2-weights is the weights file of at2 or at2lrp"),
    (["--context", "the movie " * 200], "longer than the model's maximum|no room for an answer"),
    (["--options", "{bad"], "--options is not valid JSON"),
    (["--top", "0"], "--top must be at least 1"),
    (["--format", "terminal"], "--out writes the html or json format"),
    (["--options", '{"loo": 1}'], "--options must map method ids to option objects"),
    (["--methods", "loo", "--options", '{"attngate": {"gate": 0.5}}'], "options given for 'attngate', which is not"),
    (["--methods", "attngate", "--options", '{"attngate": {"queries": "some"}}'], "queries must be one of all, after"),
    (["--methods", "contextcite", "--n-ablations", "8", "--options", '{"contextcite": {"n_ablations": 16}}'],
     "--n-ablations and --options both set contextcite's n_ablations"),
    (["--methods", "contextcite", "--options", '{"contextcite": {"alpha": -1}}'], "alpha .* must be a number >= 0"),
    (["--methods", "contextcite", "--options", '{"contextcite": {"seed": "a"}}'], "seed must be an integer >= 0"),
    (["--methods", "contextcite", "--options", '{"contextcite": {"keep_probability": "0.5"}}'],
     "keep_probability must be a number between 0 and 1"),
    (["--methods", "attngate", "--options", '{"attngate": {"steps": 0}}'], "steps must be an integer >= 1"),
    (["--max-new-tokens", "4"], "--max-new-tokens bounds a generated answer: leave it out with --answer"),
    (["--progress", "--quiet"], "--progress shows a bar that --quiet turns off"),
    (["--methods", "attngate,at2,attnlrp", "--ablation", "mask"],
     "--ablation sets how loo and contextcite take a source out"),
])
def test_cli_bad_input_exits_2_with_one_line_and_writes_nothing(lm_dir, tmp_path, capsys, extra, message):
    out = tmp_path / "c.json"
    args = ["cite", "--model", lm_dir, "--context", CONTEXT, "--query", QUERY, "--answer", ANSWER, "--no-chat",
            "--format", "json", "--out", str(out)]
    for i in range(0, len(extra), 2):  # the extra option replaces the base one
        if extra[i] in args:
            args[args.index(extra[i]) + 1] = extra[i + 1]
        else:
            args += extra[i:i + 2]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlens: error:")
    import re

    assert re.search(message, err[0]), err[0]
    assert not out.exists()


def test_cli_missing_context_file_is_one_line(lm_dir, tmp_path, capsys):
    args = ["cite", "--model", lm_dir, "--context-file", str(tmp_path / "none.txt"), "--query", QUERY]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.txt: no such file" in err[0]


def test_a_classifier_is_refused_before_it_is_asked_for_an_answer(tokenizer):
    from conftest import make_model

    from attnlens import Explainer
    from attnlens.errors import ModelError

    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.raises(ModelError, match="^attributing an answer to its context needs a decoder-only language model"):
        ex.attribute_context("Bob signed it. Alice watched.", "Who signed?")


# --------------------------------------------------------------------------------------------- SmolLM2
@pytest.mark.slow
@needs_llm
def test_smollm2_finds_the_passage_the_answer_came_from():
    ex = Explainer.from_pretrained("smollm2")
    context = ("The Eiffel Tower is a wrought-iron lattice tower in Paris. It is named after the engineer "
               "Gustave Eiffel, whose company designed and built it.\n\nThe Great Wall of China is a series of "
               "fortifications built across the northern borders of ancient Chinese states.\n\nMount Everest is "
               "the highest mountain above sea level, in the Himalayas.")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="at2 weights")  # the shipped weights were fitted on this model
        r = ex.attribute_context(context, "Who designed the Eiffel Tower?", answer="Gustave Eiffel designed it.",
                                 sources="passage", methods=["decompx", "attnlrp", "loo", "at2", "at2lrp"])
    for m in ("decompx", "attnlrp", "loo", "at2", "at2lrp"):
        assert r.ranked(m)[0][0] == 0, (m, r.scores[m])
    assert r.prompt.startswith("<|im_start|>") and r.meta["chat_template"]


# ------------------------------------------------------------------------------------------------- AT2
def test_at2_features_are_the_answer_rows_attention_to_each_source(lm):
    from attnlens.core.modelstate import explaining
    from attnlens.sources.at2 import at2_features
    from attnlens.sources.attribute import prepare_job

    job = prepare_job(lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)
    ids = job.prompt.ids + job.answer_ids
    with torch.no_grad(), explaining(lm.model):
        maps = lm.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    rows = list(range(len(job.prompt.ids) - 1, len(ids) - 1))
    owner = np.array(job.token_source + [-1] * len(job.answer_ids))
    expected = np.concatenate([
        [[a[0, h][rows][:, owner == s].sum(1).mean().item() for s in range(4)] for h in range(a.shape[1])]
        for a in maps])
    np.testing.assert_allclose(at2_features(job), expected, atol=1e-6)


def test_at2_rows_from_the_fused_pass_equal_the_eager_maps_rows(lm):
    from attnlens.core.row_attention import dispatches_attention
    from attnlens.sources.at2 import _answer_rows
    from attnlens.sources.attribute import prepare_job

    assert dispatches_attention(lm.model)  # the fused path is the one exercised
    job = prepare_job(lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)
    ids = job.prompt.ids + job.answer_ids
    rows = torch.arange(len(job.prompt.ids) - 1, len(ids) - 1)
    k = len(job.answer_ids)
    (fused, fused_logits), (eager, eager_logits) = (_answer_rows(lm.runner, ids, rows, path, answer=k)
                                                    for path in (True, False))
    assert len(fused) == len(eager) == lm.model.config.num_hidden_layers
    for f, e in zip(fused, eager):
        assert f.shape == e.shape == (lm.model.config.num_attention_heads, len(rows), len(ids))
        torch.testing.assert_close(f, e, rtol=1e-5, atol=1e-6)
    assert fused_logits.shape == eager_logits.shape == (1, k + 1, lm.model.config.vocab_size)
    torch.testing.assert_close(fused_logits, eager_logits, rtol=1e-5, atol=1e-5)


def test_at2_fit_on_noise_finds_nothing_on_held_out_prompts():
    """Targets unrelated to the features: on whole held-out prompts the chosen penalty ranks no better than chance
    and its R² is about zero or below, although the in-sample fit of the weakest penalty looks good."""
    from attnlens.sources.at2 import ALPHAS, _grouped_alpha, _ridge

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 40)), rng.normal(size=96)
    groups = np.repeat(np.arange(6), 16)
    alpha, cv_r2, cv_lds = _grouped_alpha(x, y, groups)
    assert cv_r2 < 0.05 and abs(cv_lds) < 0.3 and alpha in ALPHAS
    small = y - x @ _ridge(x, y, ALPHAS[0])
    assert 1 - small @ small / (y @ y) > 0.3  # what the in-sample R² would have claimed


def test_at2_fit_weighs_every_prompt_the_same_and_skips_prompts_without_effects(lm, monkeypatch):
    """One prompt whose ablations swing the log-probability 1,000 times more than the others' and follow other
    head weights does not set the fit: held-out ranking on the ordinary prompts stays right. A prompt whose
    ablations change nothing is left out; when all are like that the fit says so."""
    from attnlens.sources import at2 as at2_module
    from attnlens.sources.attribute import prepare_job

    truth, other = np.array([1.5, -0.5, 0.0, 2.0]), np.array([-2.0, 0.0, 3.0, -1.0])
    contexts = [CONTEXT, "the plot was dull . i hated it .\n\nthe film was bad . the actors were awful .",
                "a charming journey . the story is funny .\n\nthe best film ever . really good .",
                "what a mess . nothing works .\n\nsome scenes are fine . the music is good .", CONTEXT + " end ."]
    loud, flat = contexts[3], contexts[4]

    def effects(job, keep):
        feats = at2_module.at2_features(job)
        text = job.context
        if text == flat:
            return np.full(len(keep), -2.0)
        w = other * 1000.0 if text == loud else truth
        return keep.astype(float) @ (w @ feats)

    monkeypatch.setattr(at2_module, "ablation_logprobs", effects)
    jobs = [prepare_job(lm.runner, c, QUERY, answer=ANSWER, chat=False) for c in contexts]
    record = at2_module.fit_at2(lm.runner, jobs, n_ablations=24)
    fitted = np.asarray(record["weights"]).reshape(-1)
    for job in jobs[:3]:
        feats = at2_module.at2_features(job)
        assert np.corrcoef(fitted @ feats, truth @ feats)[0, 1] > 0.9
    flat_jobs = [prepare_job(lm.runner, flat, q, answer=ANSWER, chat=False) for q in (QUERY, QUERY + " again")]
    with pytest.raises(InputError, match="changed the answer's log-probability in the prompts of fewer than two"):
        at2_module.fit_at2(lm.runner, flat_jobs, n_ablations=8)
    with pytest.raises(InputError, match="needs the prompts of at least two questions"):
        at2_module.fit_at2(lm.runner, jobs[:1], n_ablations=8)


def test_at2_fit_holds_out_a_question_with_all_its_source_splits(lm, monkeypatch):
    """The same question of the same context split into sentences and into passages is one fold group of the
    penalty's cross-validation (held out together: the other split is not training data for it), while each prompt
    is still ranked on its own."""
    from attnlens.sources import at2 as at2_module
    from attnlens.sources.attribute import prepare_job

    seen = {}

    def spy(x, y, groups, together=None):
        seen.update(groups=groups, together=together)
        return at2_module.ALPHAS[0], 0.0, 0.0

    monkeypatch.setattr(at2_module, "_grouped_alpha", spy)
    monkeypatch.setattr(at2_module, "ablation_logprobs", lambda job, keep: keep.astype(float) @ np.arange(
        1.0, 1.0 + len(job.sources)))
    other = "the plot was dull . i hated it .\n\nthe film was bad . the actors were awful ."
    jobs = [prepare_job(lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False, sources=mode)
            for mode in ("sentence", "passage")] + [prepare_job(lm.runner, other, QUERY, answer=ANSWER, chat=False)]
    at2_module.fit_at2(lm.runner, jobs, n_ablations=8)
    rows = [np.unique(seen["groups"][seen["together"] == q]).tolist() for q in np.unique(seen["together"])]
    assert rows == [[0, 1], [2]]
    assert len(np.unique(seen["groups"])) == 3


def test_an_interrupted_at2_fit_resumes_from_its_cache(lm, monkeypatch, tmp_path):
    from attnlens.sources import at2 as at2_module
    from attnlens.sources.attribute import prepare_job

    calls = []

    def linear(job, keep):
        calls.append(len(keep))
        return keep.astype(float) @ np.linspace(2.0, -1.0, keep.shape[1])

    monkeypatch.setattr(at2_module, "ablation_logprobs", linear)
    jobs = [prepare_job(lm.runner, c, QUERY, answer=ANSWER, chat=False)
            for c in (CONTEXT, CONTEXT + " more .", CONTEXT + " and more .")]
    first = at2_module.fit_at2(lm.runner, jobs[:2], n_ablations=8, cache=tmp_path / "parts")
    assert len(calls) == 2 and len(list((tmp_path / "parts").glob("*.npz"))) == 2

    def boom(*args, **kwargs):
        raise AssertionError("a cached prompt was computed again")

    monkeypatch.setattr(at2_module, "at2_features", boom)
    again = at2_module.fit_at2(lm.runner, jobs[:2], n_ablations=8, cache=tmp_path / "parts")
    assert again["weights"] == first["weights"] and len(calls) == 2
    assert first["fit"]["prompts_from_cache"] == 0 and again["fit"]["prompts_from_cache"] == 2
    monkeypatch.undo()
    monkeypatch.setattr(at2_module, "ablation_logprobs", linear)
    at2_module.fit_at2(lm.runner, jobs, n_ablations=8, cache=tmp_path / "parts")  # only the new prompt runs
    assert len(calls) == 3 and len(list((tmp_path / "parts").glob("*.npz"))) == 3
    at2_module.fit_at2(lm.runner, jobs[:2], n_ablations=6, cache=tmp_path / "parts")  # other ablations: recomputed
    assert len(calls) == 5
    other = make_lm(lm.model.config.model_type, seed=1)  # another checkpoint: its prompts computed again
    at2_module.fit_at2(Explainer(other, lm_tokenizer(), max_length=64).runner, jobs[:2], n_ablations=6,
                       cache=tmp_path / "parts")
    assert len(calls) == 7
    at2_module.fit_at2(Explainer(other.double(), lm_tokenizer(), max_length=64).runner, jobs[:2], n_ablations=6,
                       cache=tmp_path / "parts")  # the same weights in another precision: computed again
    assert len(calls) == 9
    calls.clear()
    for part in (tmp_path / "parts").glob("*.npz"):  # damaged outside attnlens: computed again, with a warning
        part.write_bytes(part.read_bytes()[:40])
    with pytest.warns(UserWarning, match="cannot be read: its prompt is computed again"):
        again = at2_module.fit_at2(lm.runner, jobs[:2], n_ablations=6, cache=tmp_path / "parts")
    assert len(calls) == 2 and again["fit"]["prompts_from_cache"] == 0


def test_at2_fit_recovers_weights_that_explain_the_ablations(lm, monkeypatch, tmp_path):
    """When ablation effects are exactly linear in the attention features, the fitted per-head weights predict
    them; saved, they are loaded back for the same model, read with a warning on another checkpoint of its
    architecture and refused for another architecture."""
    from attnlens.sources import at2 as at2_module
    from attnlens.sources.attribute import prepare_job

    truth = np.array([1.5, -0.5, 0.0, 2.0])
    contexts = [CONTEXT, "the plot was dull . i hated it .\n\nthe film was bad . the actors were awful .",
                "a charming journey . the story is funny .\n\nthe best film ever . really good .", CONTEXT]

    def linear(job, keep):
        return -3.0 + keep.astype(float) @ (truth @ at2_module.at2_features(job))

    monkeypatch.setattr(at2_module, "ablation_logprobs", linear)
    jobs = [prepare_job(lm.runner, c, QUERY, answer=ANSWER, chat=False) for c in contexts]
    record = at2_module.fit_at2(lm.runner, jobs, n_ablations=16)
    fitted = np.asarray(record["weights"]).reshape(-1)
    for job in jobs:
        feats = at2_module.at2_features(job)
        np.testing.assert_allclose(fitted @ feats, truth @ feats, rtol=0.05, atol=0.02)
    assert record["fit"]["r2"] > 0.99 and record["fit"]["cv_r2"] > 0.95 and record["fit"]["prompts"] == 4
    path = at2_module.save_weights(record, tmp_path / "w.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the model the weights were fitted on: no warning
        r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["at2"], chat=False,
                                 options={"at2": {"weights": str(path)}})
    np.testing.assert_allclose(r.scores["at2"], fitted @ at2_module.at2_features(jobs[0]), rtol=1e-9)
    sibling = Explainer(make_lm(lm.model.config.model_type, seed=1), lm_tokenizer(), max_length=64)
    with pytest.warns(UserWarning, match=r"fitted on other parameters of this architecture \(a sample of them "
                      r"differs by \d+"):
        sibling.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["at2"], chat=False,
                                  options={"at2": {"weights": str(path)}})
    other = Explainer(make_lm("llama" if lm.model.config.model_type == "gpt2" else "gpt2"), lm_tokenizer(),
                      max_length=64)
    with pytest.raises(InputError, match="fitted on another model"):
        other.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["at2"], chat=False,
                                options={"at2": {"weights": str(path)}})
    with pytest.raises(InputError, match="no AT2 weights ship for"):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["at2"], chat=False)


@pytest.mark.parametrize("change, message", [
    (lambda d: d["weights"][0].__setitem__(0, float("nan")), "some weights are not finite numbers"),
    (lambda d: d["weights"][0].__setitem__(0, "x"), "not an attnlens AT2 weights file"),
    (lambda d: d["weights"][0].append(1.0), "not an attnlens AT2 weights file"),
    (lambda d: d.pop("weights"), "not an attnlens AT2 weights file"),
    (lambda d: d.__setitem__("weights", [1.0, 2.0]), r"weights of shape \(2,\)"),
    (lambda d: d.__setitem__("method_weights", [[1.0]]), "not an attnlens AT2 weights file"),
    (lambda d: d.__setitem__("weights", np.asarray(d["weights"]).reshape(1, -1).tolist()),  # as many, one row
     r"a grid of 1 × \d+ head weights and 0 method weights, where the model's \d+ layers"),
    (lambda d: d.__setitem__("method_weights", [1.0]), r"and 1 method weights, where the model's .* 0 method\(s\)"),
])
def test_a_malformed_at2_weights_file_is_one_line(lm, tmp_path, change, message):
    config = lm.model.config
    from attnlens.sources import at2 as at2_module

    record = {"fingerprint": at2_module._fingerprint(lm.model), "names": [lm.name],
              "weights": np.ones((config.num_hidden_layers, config.num_attention_heads)).tolist()}
    change(record)
    path = tmp_path / "w.json"
    path.write_text(json.dumps(record))
    with pytest.raises(InputError, match=message):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["at2"], chat=False,
                             options={"at2": {"weights": str(path)}})
    path.write_text("[1, 2]")
    with pytest.raises(InputError, match="not an attnlens AT2 weights file"):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["at2"], chat=False,
                             options={"at2": {"weights": str(path)}})


@pytest.mark.parametrize("extra, message", [
    (["--prompts", "5000"], r"--prompts 5000: the fit articles give 1,0\d\d prompts with passage sources \(half"),
    (["--distractors", "100000"], "--distractors 100000: no prompt of the fit articles can hold that many"),
    (["--prompts", "2"], r"--prompts 2: the ridge penalty .* give at least 4 prompts \(half with passage, half"),
    (["--prompts", "1"], r"--prompts 1: the ridge penalty is chosen on held-out questions: give at least 4 prompts"),
    (["--prompts", "1", "--sources", "sentence"], r"--prompts 1: .*give at least 2 prompts$"),
    (["--cache", "w.json"], "--cache w.json is the --out file"),
])
def test_cli_fit_at2_refuses_what_it_cannot_fit_before_loading(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.chdir(tmp_path)
    code = main(["fit-at2", "--model", str(tmp_path / "none"), "--out", "w.json", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("attnlens: error:") and "\n" not in err, err
    import re

    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_cli_fit_at2_refuses_to_write_over_its_squad_file(tmp_path, capsys):
    from attnlens.data import squad_file

    source = squad_file()
    root = tmp_path / "data"
    (root / source.parent.name).mkdir(parents=True)
    copy_ = root / source.parent.name / source.name
    copy_.write_bytes(source.read_bytes())
    code = main(["fit-at2", "--model", str(tmp_path / "none"), "--data-root", str(root), "--out", str(copy_)])
    assert code == 2 and "is the SQuAD file this command reads" in capsys.readouterr().err
    assert copy_.read_bytes() == source.read_bytes()


# ------------------------------------------------------------------------------------------- benchmark
def test_context_benchmark_metrics_against_direct_ablations(lm, tmp_path):
    from attnlens.evaluation.context_benchmark import ContextBenchmarkConfig, evaluate_example, run_context_benchmark
    from attnlens.sources.squad import ContextExample

    sources = split_sources(CONTEXT, "sentence")
    example = ContextExample("x1", CONTEXT, QUERY, ANSWER, sources, gold=0)
    config = ContextBenchmarkConfig(methods=["inputxgradient", "loo"], n_lds=12)
    external = {"peer": {"scores": [3.0, 2.0, 1.0, 0.0], "seconds": 0.5}}
    record = evaluate_example(lm, example, config, external)
    full = _logprob_by_hand(lm, CONTEXT, ANSWER)
    assert record["answer_logprob"] == pytest.approx(full, rel=1e-5)
    peer = record["methods"]["peer"]
    top3 = _logprob_by_hand(lm, ablated_context(CONTEXT, sources, [False, False, False, True]), ANSWER)
    assert peer["top3_drop"] == pytest.approx(full - top3, rel=1e-4, abs=1e-5)
    top1 = _logprob_by_hand(lm, ablated_context(CONTEXT, sources, [False, True, True, True]), ANSWER)
    assert peer["top1_drop"] == pytest.approx(full - top1, rel=1e-4, abs=1e-5) and peer["gold_hit"] == 1.0
    loo = record["methods"]["loo"]
    assert loo["top1_drop"] == pytest.approx(max(loo["scores"]), rel=1e-5)  # LOO's top source is its own drop
    assert -1.0 <= loo["lds"] <= 1.0 and peer["seconds"] == 0.5
    summary = run_context_benchmark(lm, [example], config, tmp_path / "run", external={"x1": external})
    assert summary["metrics"]["peer"]["top1_drop"]["mean"] == pytest.approx(peer["top1_drop"], rel=1e-6)
    with pytest.raises(InputError, match="external method 'loo' has the name of a method of this run"):
        evaluate_example(lm, example, config, {"loo": external["peer"]})
    again = run_context_benchmark(lm, [example], config, tmp_path / "run")  # resumed: nothing recomputed
    assert again["metrics"]["peer"]["lds"]["mean"] == summary["metrics"]["peer"]["lds"]["mean"]


def test_context_benchmark_takes_a_peers_new_scores_and_writes_strict_json(lm, tmp_path):
    """A peer's file that changed is scored again on resuming; one example's summary and records are JSON every
    parser reads (no NaN: an interval of one value is null); two examples under one id are refused."""
    from attnlens.evaluation.context_benchmark import ContextBenchmarkConfig, run_context_benchmark
    from attnlens.sources.squad import ContextExample

    example = ContextExample("x1", CONTEXT, QUERY, ANSWER, split_sources(CONTEXT, "sentence"), gold=2)
    config = ContextBenchmarkConfig(methods=["loo"], n_lds=8)
    wrong = {"x1": {"peer": {"scores": [0.0, 0.0, 0.0, 1.0], "seconds": float("nan")}}}  # none given: null on disk
    first = run_context_benchmark(lm, [example], config, tmp_path, external=wrong)
    assert first["metrics"]["peer"]["gold_hit"]["mean"] == 0.0
    right = {"x1": {"peer": {"scores": [0.0, 0.0, 1.0, 0.0], "seconds": 0.1}}}
    again = run_context_benchmark(lm, [example], config, tmp_path, external=right)
    assert again["metrics"]["peer"]["gold_hit"]["mean"] == 1.0 and again["metrics"]["peer"]["seconds"]["mean"] == 0.1

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))

    summary = strict((tmp_path / "summary.json").read_text())
    assert summary["metrics"]["loo"]["lds"]["ci95"] is None
    assert [strict(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()][0]["methods"]["peer"][
        "seconds"] is None
    with pytest.raises(InputError, match="two examples have the id 'x1'"):
        run_context_benchmark(lm, [example, example], config, tmp_path / "dup")


def test_external_scores_must_be_finite_numbers(tmp_path):
    from attnlens.evaluation.context_benchmark import read_external

    path = tmp_path / "peer.jsonl"
    path.write_text('{"id": "x1", "method": "peer", "scores": [0, 5, NaN]}\n')
    with pytest.raises(InputError, match="line 1: scores that are not finite numbers"):
        read_external([path])


def test_squad_context_splits_articles_by_parity_and_is_deterministic():
    from conftest import DATA, missing

    from attnlens.sources.squad import squad_context

    if not (DATA / "squad_v1.1").is_dir():
        missing("SQuAD v1.1 dev not found")
    fit = squad_context("fit", 6, root=DATA)
    ev = squad_context("eval", 6, root=DATA, sources="sentence")
    assert [e.id for e in squad_context("eval", 6, root=DATA, sources="sentence")] == [e.id for e in ev]
    import gzip

    with gzip.open(DATA / "squad_v1.1" / "dev-v1.1.reconstructed.json.gz", "rt") as f:
        titles = [a["title"] for a in json.load(f)["data"]]
    assert {e.meta["title"] for e in fit} <= set(titles[0::2]) and {e.meta["title"] for e in ev} <= set(titles[1::2])
    for e in fit + ev:
        assert e.answer in e.sources[e.gold].text or e.answer in e.context[e.sources[e.gold].start:]
        assert all(e.context[s.start:s.end] == s.text for s in e.sources)
        assert len(e.meta["passages"]) == 4
    hard = squad_context("fit", 4, root=DATA, hard=True)
    assert all(set(e.meta["passages"]) == {e.meta["title"]} for e in hard)


def _methods_scored(cb, monkeypatch) -> list[list[str]]:
    """The methods each of the context benchmark's scoring calls computes, in order, from now on."""
    asked: list[list[str]] = []
    real = cb.score_job
    monkeypatch.setattr(cb, "score_job", lambda job, methods, options: asked.append(methods) or real(job, methods,
                                                                                                     options))
    return asked


def test_context_benchmark_adds_a_method_to_finished_records_against_their_stored_ablations(lm, tmp_path,
                                                                                             monkeypatch):
    from attnlens.evaluation import context_benchmark as cb
    from attnlens.sources.squad import ContextExample

    example = ContextExample("x1", CONTEXT, QUERY, ANSWER, split_sources(CONTEXT, "sentence"), gold=0)
    fresh = cb.evaluate_example(lm, example, cb.ContextBenchmarkConfig(methods=["loo", "inputxgradient"], n_lds=8))
    cb.run_context_benchmark(lm, [example], cb.ContextBenchmarkConfig(methods=["loo"], n_lds=8), tmp_path)
    asked = _methods_scored(cb, monkeypatch)
    summary = cb.run_context_benchmark(lm, [example], cb.ContextBenchmarkConfig(methods=["loo", "inputxgradient"],
                                                                                n_lds=8), tmp_path)
    assert asked == [["inputxgradient"]]  # loo and the 8 random ablations were reused
    for metric in ("top1_drop", "top3_drop", "lds", "gold_hit"):
        assert summary["metrics"]["inputxgradient"][metric]["mean"] == pytest.approx(
            fresh["methods"]["inputxgradient"][metric], rel=1e-4, abs=1e-5)
        assert summary["metrics"]["loo"][metric]["mean"] == pytest.approx(fresh["methods"]["loo"][metric],
                                                                          rel=1e-4, abs=1e-5)
    with_options = cb.ContextBenchmarkConfig(methods=["loo", "inputxgradient", "contextcite"], n_lds=8,
                                             options={"contextcite": {"n_ablations": 8}})
    cb.run_context_benchmark(lm, [example], with_options, tmp_path)
    cb.run_context_benchmark(lm, [example], replace(with_options, methods=["loo", "contextcite", "rawatt"]), tmp_path)
    assert asked[-2:] == [["contextcite"], ["rawatt"]]  # options of a kept method are not passed to the others
    only = cb.run_context_benchmark(lm, [example], cb.ContextBenchmarkConfig(methods=["loo"], n_lds=8), tmp_path)
    assert set(only["metrics"]) == {"loo", "inputxgradient", "contextcite", "rawatt"} and len(asked) == 3
    cb.run_context_benchmark(lm, [example], cb.ContextBenchmarkConfig(methods=["loo"], n_lds=6), tmp_path)
    assert asked[-1] == ["loo"]  # other ground-truth settings: the record is recomputed whole
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records[-1]["truth"]["actual"]) == 6


def test_context_benchmark_recomputes_a_record_of_another_example_or_model_under_the_same_id(lm, tmp_path,
                                                                                             monkeypatch):
    """An id names an example only under one data set's settings (e.g. its distractors): a record made for other
    text under that id, or by another model, is not reused."""
    from attnlens.evaluation import context_benchmark as cb
    from attnlens.sources.squad import ContextExample

    config = cb.ContextBenchmarkConfig(methods=["loo"], n_lds=8)
    shorter = CONTEXT.split(" .")[0] + " ."
    first = ContextExample("x1", shorter, QUERY, ANSWER, split_sources(shorter, "sentence"), gold=0)
    cb.run_context_benchmark(lm, [first], config, tmp_path)
    example = ContextExample("x1", CONTEXT, QUERY, ANSWER, split_sources(CONTEXT, "sentence"), gold=0)
    fresh = cb.evaluate_example(lm, example, config)
    asked = _methods_scored(cb, monkeypatch)
    summary = cb.run_context_benchmark(lm, [example], config, tmp_path)
    assert asked == [["loo"]]
    assert summary["metrics"]["loo"]["lds"]["mean"] == pytest.approx(fresh["methods"]["loo"]["lds"], abs=1e-6)
    cb.run_context_benchmark(lm, [example], config, tmp_path)
    assert asked == [["loo"]]  # the same example and model: reused
    monkeypatch.setattr(lm, "name", "another-model")
    cb.run_context_benchmark(lm, [example], config, tmp_path)
    assert asked == [["loo"], ["loo"]]
    half = Explainer(copy.deepcopy(lm.model).to(torch.bfloat16), lm.tokenizer, max_length=64)
    monkeypatch.setattr(half, "name", "another-model")  # the same name, weights in another dtype
    cb.run_context_benchmark(half, [example], config, tmp_path)
    assert asked == [["loo"], ["loo"], ["loo"]]


def test_context_benchmark_cuts_a_torn_record_and_computes_that_example_again(lm, tmp_path, monkeypatch):
    from attnlens.evaluation import context_benchmark as cb
    from attnlens.sources.squad import ContextExample

    config = cb.ContextBenchmarkConfig(methods=["loo"], n_lds=8)
    examples = [ContextExample(f"x{i}", CONTEXT, QUERY, ANSWER, split_sources(CONTEXT, "sentence"), gold=0)
                for i in (1, 2)]
    cb.run_context_benchmark(lm, examples[:1], config, tmp_path)
    path = tmp_path / "records.jsonl"
    with path.open("a") as f:  # a write torn by an interruption
        f.write('{"id": "x2", "meth')
    asked = _methods_scored(cb, monkeypatch)
    cb.run_context_benchmark(lm, examples, config, tmp_path)
    assert asked == [["loo"]]  # x2 only
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["x1", "x2"]
    cb.run_context_benchmark(lm, examples, config, tmp_path)
    assert asked == [["loo"]]  # both records read back whole


def test_an_interrupted_context_benchmark_summarises_the_examples_it_finished(lm, tmp_path, monkeypatch):
    from attnlens.evaluation import context_benchmark as cb
    from attnlens.sources.squad import ContextExample

    config = cb.ContextBenchmarkConfig(methods=["loo"], n_lds=8)
    examples = [ContextExample(f"x{i}", CONTEXT, QUERY, ANSWER, split_sources(CONTEXT, "sentence"), gold=0)
                for i in (1, 2, 3)]
    real = cb.score_job

    def interrupt_the_second(job, methods, options):
        if calls.append(1) or len(calls) == 2:
            raise KeyboardInterrupt
        return real(job, methods, options)

    calls: list[int] = []
    monkeypatch.setattr(cb, "score_job", interrupt_the_second)
    with pytest.raises(KeyboardInterrupt):
        cb.run_context_benchmark(lm, examples, config, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["examples"] == 1 and summary["planned"] == 3 and summary["complete"] is False
    assert summary["metrics"]["loo"]["lds"]["n"] == 1
    monkeypatch.setattr(cb, "score_job", real)
    whole = cb.run_context_benchmark(lm, examples, config, tmp_path)
    assert whole["examples"] == 3 and "complete" not in whole


def test_cli_context_benchmark_refuses_a_folder_of_other_results(tmp_path, capsys):
    (tmp_path / "run.json").write_text("{}")
    code = main(["benchmark", "--task", "context", "--dataset", "squad-context", "--model", "/nonexistent/model",
                 "--methods", "loo", "--out", str(tmp_path)])
    assert code == 2 and "holds the results of another benchmark task (run.json)" in capsys.readouterr().err
    (tmp_path / "run.json").unlink()
    (tmp_path / "summary.json").write_text("{}")
    code = main(["benchmark", "--task", "context", "--dataset", "squad-context", "--model", "/nonexistent/model",
                 "--methods", "loo", "--out", str(tmp_path)])
    assert code == 2 and "holds a summary.json but no records.jsonl" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


@pytest.mark.parametrize("flag, value, message", [("--limit", "0", "--limit must be >= 1"),
                                                  ("--distractors", "-1", "--distractors must be >= 0"),
                                                  ("--seed", "-1", "--seed must be in 0..2**32-1")])
def test_cli_context_benchmark_refuses_bad_counts_before_loading(tmp_path, capsys, flag, value, message):
    code = main(["benchmark", "--task", "context", "--dataset", "squad-context", "--model", "/nonexistent/model",
                 "--methods", "loo", flag, value, "--out", str(tmp_path / "run")])
    assert code == 2 and message in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_context_benchmark_recomputes_at2_when_its_weights_change(lm, tmp_path, monkeypatch):
    """A record's AT2 scores name the weights they came from: the same options resolving to other weights (a
    refitted file, or newer shipped weights) are computed again, the same weights are not."""
    from attnlens.evaluation import context_benchmark as cb
    from attnlens.sources import at2 as at2_module
    from attnlens.sources.squad import ContextExample

    config = lm.model.config
    shape = (config.num_hidden_layers, config.num_attention_heads)
    record = {"fingerprint": at2_module._fingerprint(lm.model), "names": [lm.name], "weights": np.ones(shape).tolist()}
    monkeypatch.setattr(at2_module, "WEIGHTS_DIR", tmp_path / "shipped")
    at2_module.save_weights(record, tmp_path / "shipped" / "w.json")
    example = ContextExample("x1", CONTEXT, QUERY, ANSWER, split_sources(CONTEXT, "sentence"), gold=0)
    asked = _methods_scored(cb, monkeypatch)
    run = cb.ContextBenchmarkConfig(methods=["at2"], n_lds=6)
    first = cb.run_context_benchmark(lm, [example], run, tmp_path / "out")
    cb.run_context_benchmark(lm, [example], run, tmp_path / "out")
    assert asked == [["at2"]]
    record["weights"] = (-np.ones(shape)).tolist()
    at2_module.save_weights(record, tmp_path / "shipped" / "w.json")
    again = cb.run_context_benchmark(lm, [example], run, tmp_path / "out")
    assert asked == [["at2"], ["at2"]]
    assert again["metrics"]["at2"]["lds"]["mean"] == pytest.approx(-first["metrics"]["at2"]["lds"]["mean"])


def test_context_benchmark_recomputes_a_method_whose_default_options_changed(lm, tmp_path, monkeypatch):
    """A record names every option a source method ran with, its defaults too: the same command after a default
    changed computes the method again, and the record shows the new value."""
    from attnlens.evaluation import context_benchmark as cb
    from attnlens.sources.methods import SOURCE_METHODS
    from attnlens.sources.squad import ContextExample

    example = ContextExample("x1", CONTEXT, QUERY, ANSWER, split_sources(CONTEXT, "sentence"), gold=0)
    asked = _methods_scored(cb, monkeypatch)
    run = cb.ContextBenchmarkConfig(methods=["attngate"], n_lds=6)
    cb.run_context_benchmark(lm, [example], run, tmp_path)
    cb.run_context_benchmark(lm, [example], run, tmp_path)
    assert asked == [["attngate"]]
    spec = SOURCE_METHODS["attngate"]
    monkeypatch.setitem(SOURCE_METHODS, "attngate", replace(spec, options={**spec.options, "gate": 0.25}))
    cb.run_context_benchmark(lm, [example], run, tmp_path)
    assert asked == [["attngate"], ["attngate"]]
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert records[-1]["methods"]["attngate"]["options"] == {"gate": 0.25, "queries": "after", "steps": 1}


def test_at2_fit_with_a_token_method_learns_its_weight_beside_the_heads(lm, monkeypatch, tmp_path):
    """Ablation effects linear in the attention features plus 2 × AttnLRP's source scores: the joint fit
    predicts them, at2lrp loads those weights and scores a prompt with them, at2 refuses them, and a cached fit
    adding the method reuses the attention features and ablations."""
    from attnlens.sources import at2 as at2_module
    from attnlens.sources.attribute import prepare_job
    from attnlens.sources.token_scores import token_source_scores

    truth = np.array([1.5, -0.5, 0.0, 2.0])
    contexts = [CONTEXT, "the plot was dull . i hated it .\n\nthe film was bad . the actors were awful .",
                "a charming journey . the story is funny .\n\nthe best film ever . really good .",
                "what a mess . nothing works .\n\nsome scenes are fine . the music is good ."]

    def lrp(job):
        return token_source_scores(job, ["attnlrp"]).scores["attnlrp"]

    def linear(job, keep):
        return keep.astype(float) @ (truth @ at2_module.at2_features(job) + 2.0 * lrp(job))

    monkeypatch.setattr(at2_module, "ablation_logprobs", linear)
    jobs = [prepare_job(lm.runner, c, QUERY, answer=ANSWER, chat=False) for c in contexts]
    at2_module.fit_at2(lm.runner, jobs, n_ablations=16, cache=tmp_path / "parts")
    calls = []
    monkeypatch.setattr(at2_module, "ablation_logprobs", lambda job, keep: calls.append(1) or linear(job, keep))
    record = at2_module.fit_at2(lm.runner, jobs, n_ablations=16, methods=("attnlrp",), cache=tmp_path / "parts")
    assert calls == [] and record["methods"] == ["attnlrp"] and len(record["method_weights"]) == 1
    assert record["fit"]["prompts_from_cache"] == 4
    path = at2_module.save_weights(record, tmp_path / "lrp.json")
    for job in jobs:
        expected = truth @ at2_module.at2_features(job) + 2.0 * lrp(job)
        r = lm.attribute_context(job.context, QUERY, answer=ANSWER, methods=["at2lrp"], chat=False,
                                 options={"at2lrp": {"weights": str(path)}})
        np.testing.assert_allclose(r.scores["at2lrp"], expected, rtol=0.05, atol=0.05 * np.abs(expected).max())
    with pytest.raises(InputError, match="fitted with features attnlrp; at2 reads attention"):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["at2"], chat=False,
                             options={"at2": {"weights": str(path)}})
    with pytest.raises(InputError, match="no AT2 with attnlrp weights ship"):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["at2lrp"], chat=False)

    from attnlens.sources import attribute as attribute_module

    def nothing_runs(*args, **kwargs):
        raise AssertionError("a method ran although at2lrp was over the budget")

    def attnlrp_over(runner, methods, n, budget, answer_tokens):
        return [], {"attnlrp": 40 * 2**30}

    with monkeypatch.context() as m:  # over the budget: refused before at2, loo or the token pass run
        m.setattr(attribute_module, "methods_within_budget", attnlrp_over)
        m.setattr(at2_module, "at2_features", nothing_runs)
        m.setattr(source_methods, "ablation_logprobs", nothing_runs)
        m.setattr(attribute_module, "token_source_scores", nothing_runs)
        with pytest.raises(InputError, match=r"at2lrp runs attnlrp over the prompt: at \d+ tokens attnlrp about "
                                             r"40.0 GiB, more than the memory budget of 4.0 GiB"):
            lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["inputxgradient", "at2", "loo", "at2lrp"],
                                 chat=False, options={"at2lrp": {"weights": str(path)}})

    def over_budget(job, methods, *args, **kwargs):
        raise InputError("an input of 9,000 tokens with attnlrp needs about 40.0 GiB, more than the memory budget")

    monkeypatch.setattr(at2_module, "token_source_scores", over_budget)
    with pytest.raises(InputError, match="at2 with attnlrp reads their scores: an input of 9,000 tokens"):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["at2lrp"], chat=False,
                             options={"at2lrp": {"weights": str(path)}})


# ------------------------------------------------------------------------------------------- attngate
def _gated_logprob_by_hand(ex: Explainer, ids: list[int], owner: np.ndarray, answer: list[int],
                           gates: np.ndarray, first_row: int = 0, window: int | None = None) -> float:
    """The answer's log-probability with each source's keys weighted by its gate (``gates``: one per source, or
    ``(heads, sources)``: one per head and source), by eager attention with an additive float mask (log g on the
    source's keys) in float64; only the queries from ``first_row`` on are gated. ``window``: each query sees the
    ``window`` positions up to its own alone (a sliding window)."""
    from attnlens.core.modelstate import explaining

    model = copy.deepcopy(ex.model).double()
    n = len(ids) + len(answer)
    per_head = np.broadcast_to(gates, (model.config.num_attention_heads, len(gates.T)))
    bias = torch.zeros(len(per_head), n, n, dtype=torch.float64)
    for h, row in enumerate(per_head):
        for s, g in enumerate(row):
            bias[h, first_row:, np.nonzero(owner == s)[0]] = float(np.log(g))
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1) + bias
    if window is not None:
        mask += torch.full((n, n), float("-inf"), dtype=torch.float64).tril(-window)
    with torch.no_grad(), explaining(model):
        logits = model(input_ids=torch.tensor([ids + answer]), attention_mask=mask[None]).logits[0]
    logp = logits.log_softmax(-1)
    return sum(float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(answer))


def _derivative(f, at: np.ndarray, index: tuple, step: float = 1e-2) -> float:
    """∂f/∂at[index] by Richardson-extrapolated central differences (error O(step⁴)): steps large enough that
    the float32 rounding of the model's norms and softmax (HF computes them in float32 whatever the model's
    dtype) stays far below the tolerance."""
    def central(h: float) -> float:
        up, down = at.copy(), at.copy()
        up[index] += h  # above 1 a gate weighs the source's keys up: the derivative is two-sided there too
        down[index] -= h
        return (f(up) - f(down)) / (2 * h)

    return (4 * central(step / 2) - central(step)) / 3


def _after_context(owner: np.ndarray) -> int:
    """The first query that ``queries="after"`` gates: the one after the last source token."""
    return int(np.nonzero(owner >= 0)[0][-1]) + 1


@pytest.mark.parametrize("queries", ["all", "after"])
def test_attngate_is_the_derivative_of_the_gated_logprob(lm, queries):
    """Against central differences of the answer's log-probability with one source's gate moved, computed by
    eager attention with an additive mask in float64 (:func:`_derivative`); with ``queries="after"`` only the
    queries after the context are gated."""
    _check_gate_derivatives(lm, queries)


def test_attngate_on_softcapped_attention_is_the_derivative_of_the_gated_logprob():
    """Gemma 2 softcaps its attention logits before the mask: the gates act after the cap, as the additive mask of
    the eager reference does. Gating every query there would run eager over the whole prompt: refused."""
    from attnlens.sources.attribute import prepare_job
    from attnlens.sources.gates import source_gate_gradients

    ex = Explainer(make_lm("gemma2"), lm_tokenizer(), max_length=64)
    assert ex.model.config.attn_logit_softcapping is not None
    _check_gate_derivatives(ex, "after", step=5e-2)  # its float32 norms and softmax: larger steps (_derivative)
    job = prepare_job(ex.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)
    with pytest.raises(InputError, match="^attngate with queries='all' cannot gate Gemma2ForCausalLM's softcapped"):
        source_gate_gradients(job, 0.5, queries="all")


@pytest.mark.parametrize("queries", ["all", "after"])
def test_attngate_over_a_prompt_longer_than_the_sliding_window_is_the_derivative_of_the_gated_logprob(queries):
    """Mistral's cache keeps only its sliding window's last positions (8 here, shorter than the prompt), so the
    queries after the context see fewer keys than the prompt has: the gates of the keys kept are theirs."""
    model = _short_window_mistral()
    _check_gate_derivatives(Explainer(model, lm_tokenizer(), max_length=64), queries,
                            window=model.config.sliding_window)


def _check_gate_derivatives(ex: Explainer, queries: str, step: float = 1e-2, window: int | None = None) -> None:
    from attnlens.sources.attribute import prepare_job
    from attnlens.sources.gates import source_gate_gradients

    job = prepare_job(ex.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)
    owner = np.array(job.token_source)
    first_row = 0 if queries == "all" else _after_context(owner)
    assert queries == "all" or 0 < first_row < len(job.prompt.ids)
    assert window is None or window < first_row or queries == "all" and window < len(job.prompt.ids) / 3

    def by_hand(gates: np.ndarray) -> float:
        return _gated_logprob_by_hand(ex, job.prompt.ids, owner, job.answer_ids, gates, first_row, window)

    for gate in (0.5, 1.0):
        scores, logprob = source_gate_gradients(job, gate, queries=queries)
        gates = np.full(4, gate)
        assert logprob == pytest.approx(by_hand(gates), rel=1e-5)
        for s in range(4):
            assert scores[s] == pytest.approx(_derivative(by_hand, gates, (s,), step), rel=2e-3, abs=1e-4), (gate, s)
        assert np.abs(scores).max() > 1e-3


@pytest.mark.parametrize("queries", ["all", "after"])
def test_attngate_per_head_gates_are_the_derivatives_of_each_heads_gate(lm, queries):
    """Per-head derivatives summed over layers against central differences with one head's gate moved in every
    layer (float64 eager reference), and their sums against the per-layer and shared gates."""
    from attnlens.sources.attribute import prepare_job
    from attnlens.sources.gates import source_gate_gradients

    job = prepare_job(lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)
    owner = np.array(job.token_source)
    first_row = 0 if queries == "all" else _after_context(owner)
    shared, logprob = source_gate_gradients(job, 0.5, queries=queries)
    layers, logprob_layers = source_gate_gradients(job, 0.5, per="layer", queries=queries)
    heads, logprob_heads = source_gate_gradients(job, 0.5, per="head", queries=queries)
    config = lm.model.config
    assert layers.shape == (config.num_hidden_layers, 4)
    assert heads.shape == (config.num_hidden_layers, config.num_attention_heads, 4)
    np.testing.assert_allclose(layers.sum(0), shared, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(heads.sum(1), layers, rtol=1e-5, atol=1e-7)
    assert logprob_layers == pytest.approx(logprob, rel=1e-6) and logprob_heads == pytest.approx(logprob, rel=1e-6)
    head, s = config.num_attention_heads - 1, 2

    def by_hand(gates: np.ndarray) -> float:
        return _gated_logprob_by_hand(lm, job.prompt.ids, owner, job.answer_ids, gates, first_row)

    diff = _derivative(by_hand, np.full((config.num_attention_heads, 4), 0.5), (head, s))
    assert heads[:, head, s].sum() == pytest.approx(diff, rel=2e-3, abs=1e-4)


@pytest.mark.parametrize("queries", ["all", "after"])
@pytest.mark.parametrize("span", [None, (3, 6)])
def test_attngate_at_open_gates_leaves_the_answer_logprob_unchanged(lm, queries, span):
    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["attngate", "loo"], chat=False,
                             answer_span=span, options={"attngate": {"gate": 1.0, "queries": queries}})
    assert r.meta["methods"]["attngate"]["gated_logprob"] == pytest.approx(r.meta["answer_logprob"], rel=1e-5)
    assert r.scores["attngate"].shape == (4,) and np.isfinite(r.scores["attngate"]).all()


@pytest.mark.parametrize("queries", ["all", "after"])
def test_integrated_attngate_is_the_mean_of_the_derivatives_at_each_gate(lm, queries):
    """``steps=4`` averages the derivatives at gates 1/8, 3/8, 5/8, 7/8, each computed in a run of its own (with
    ``queries="after"`` the four passes share the context's cached keys and values)."""
    from attnlens.sources.attribute import prepare_job
    from attnlens.sources.gates import source_gate_gradients

    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["attngate"], chat=False,
                             options={"attngate": {"steps": 4, "queries": queries}})
    job = prepare_job(lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)
    alone = [source_gate_gradients(job, g, queries=queries)[0] for g in (0.125, 0.375, 0.625, 0.875)]
    np.testing.assert_allclose(r.scores["attngate"], np.mean(alone, 0), rtol=1e-5, atol=1e-7)
    assert r.meta["methods"]["attngate"]["gates"] == [0.125, 0.375, 0.625, 0.875]


GATED = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "gemma2", "phi3", "opt", "mistral-window8")


@pytest.mark.parametrize("per", ["source", "head"])
@pytest.mark.parametrize("family", GATED)
def test_attngate_gate_values_in_one_batch_match_each_value_alone(family, per, monkeypatch):
    """With the queries after the context gated, the gate values of ``steps`` run as one batch on copies of the
    context's keys and values (the softcapped attention of Gemma 2 and a cache that drops positions outside a
    sliding window included): the derivatives equal those of each value run alone, whatever the batch size."""
    from attnlens.sources import gates
    from attnlens.sources.attribute import prepare_job

    model = _short_window_mistral() if family == "mistral-window8" else make_lm(family)
    ex = Explainer(model, lm_tokenizer(), max_length=64)
    job = prepare_job(ex.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)
    values = [0.125, 0.375, 0.625, 0.875]
    alone = [gates.source_gate_gradients(job, g, queries="after", per=per) for g in values]
    batches = []
    real = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: batches.append(len(kw["input_ids"])) or real(*a, **kw))
    together, logprob = gates.source_gate_gradients(job, values, queries="after", per=per)
    assert batches == [1, 4]  # the context, then every gate value at once
    np.testing.assert_allclose(together, np.mean([a for a, _ in alone], 0), rtol=1e-5, atol=1e-7)
    assert logprob == pytest.approx(alone[0][1], rel=1e-6)
    monkeypatch.setattr(gates, "_after_group", lambda *a: 3)  # a budget that holds three values per pass
    batches.clear()
    again, _ = gates.source_gate_gradients(job, values, queries="after", per=per)
    assert batches == [1, 3, 1]
    np.testing.assert_allclose(again, together, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("options", [{}, {"steps": 4}, {"gate": 1.0}, {"gate": 1.0, "queries": "all"}],
                         ids=["half-open", "four-steps", "open", "open-every-query"])
def test_attngate_alone_reads_the_answer_logprob_from_its_own_passes(lm, monkeypatch, options, group):
    """Asked for alone, ``attngate`` gives the answer's log-probability the result reports from its own passes
    instead of a forward of the whole prompt: at open gates, its gated pass; else one more forward of the
    positions after the context on the context's cached keys and values. The same value as the ablation forwards
    give, and the same scores."""
    from attnlens.sources import ablation, gates

    reference = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo", "attngate"], chat=False,
                                     options={"attngate": options})
    monkeypatch.setattr(gates, "_after_group", lambda *a: group)
    monkeypatch.setattr(ablation, "answer_logprobs", lambda *a, **kw: pytest.fail("a forward of the whole prompt"))
    alone = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["attngate"], chat=False,
                                 options={"attngate": options})
    assert alone.meta["answer_logprob"] == pytest.approx(reference.meta["answer_logprob"], rel=1e-5)
    np.testing.assert_allclose(alone.scores["attngate"], reference.scores["attngate"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-rows", "eager-maps"])
def test_at2_alone_reads_the_answer_logprob_from_its_own_forward(lm, monkeypatch, tmp_path, fused):
    """Asked for alone, ``at2`` gives the answer's log-probability the result reports from its own forward of the
    whole prompt (its logits at the answer's positions), not from another forward: the value the ablation
    forwards give."""
    from attnlens.sources import ablation, at2

    config = lm.model.config
    weights = np.random.default_rng(0).normal(size=(config.num_hidden_layers, config.num_attention_heads))
    path = at2.save_weights({"fingerprint": at2._fingerprint(lm.model), "names": [lm.name],
                             "weights": weights.tolist()}, tmp_path / "w.json")
    options = {"at2": {"weights": str(path)}}
    reference = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo", "at2"], chat=False,
                                     options=options)
    if not fused:
        monkeypatch.setattr(at2, "rows_unsupported", lambda model: "eager")
    monkeypatch.setattr(ablation, "answer_logprobs", lambda *a, **kw: pytest.fail("a forward of the whole prompt"))
    alone = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["at2"], chat=False, options=options)
    assert alone.meta["answer_logprob"] == pytest.approx(reference.meta["answer_logprob"], rel=1e-5)
    np.testing.assert_allclose(alone.scores["at2"], reference.scores["at2"], rtol=1e-5, atol=1e-7)


def test_attngate_batches_as_many_gate_values_as_the_budget_holds(lm, monkeypatch):
    """The batch of gate values shrinks with the memory budget, down to one value per pass; a budget that holds
    not even one is refused before any pass."""
    from attnlens.sources import gates
    from attnlens.sources.attribute import prepare_job

    job = prepare_job(lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)
    cut = gates.after_context(job)
    n = len(job.prompt.ids) + len(job.answer_ids)
    monkeypatch.setattr(gates, "pass_row_bytes", lambda dims, tokens, storage: 2**24 * tokens)
    dims = gates.model_dims(lm.model)
    cache = 2 * dims.layers * n * dims.hidden * dims.itemsize
    step = (2**24 * (n - cut) + 2 * dims.layers * dims.heads * (n - cut) * n * dims.itemsize
            + 2 * dims.layers * n * (dims.hidden + dims.heads) * dims.itemsize)
    sizes = []
    for held in (8, 5, 2, 1):
        budget = cache * (1 + held) + max(2**24 * cut, held * step)
        sizes.append(gates._after_group(replace(job, memory_budget=budget), cut, n - cut, len(job.answer_ids) + 1,
                                        8))
    assert sizes == [8, 5, 2, 1]
    with pytest.raises(InputError, match=r"^attngate over \d+ tokens needs about"):
        gates._after_group(replace(job, memory_budget=cache * 2 + max(2**24 * cut, step) - 1), cut, n - cut,
                           len(job.answer_ids) + 1, 8)


@pytest.mark.parametrize("queries", ["all", "after"])
def test_integrated_attngate_adds_up_to_opening_every_gate(lm, queries):
    """Averaged along the path from closed to open gates, the scores add up to the answer's log-probability with
    every source visible minus with every source hidden (float64 eager reference). The midpoint rule needs many
    steps here: the sources hold most of the keys, so the log-probability moves fastest as their gates leave 0."""
    from attnlens.sources.attribute import prepare_job

    r = lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["attngate"], chat=False,
                             options={"attngate": {"steps": 400, "queries": queries}})
    job = prepare_job(lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)
    owner = np.array(job.token_source)
    first_row = 0 if queries == "all" else _after_context(owner)
    open_, closed = (_gated_logprob_by_hand(lm, job.prompt.ids, owner, job.answer_ids, np.full(4, g), first_row)
                     for g in (1.0, 1e-30))
    assert abs(open_ - closed) > 1e-2  # the sources matter to this answer
    assert r.scores["attngate"].sum() == pytest.approx(open_ - closed, rel=5e-3, abs=1e-4)


@pytest.mark.parametrize(("options", "message"), [
    ({"steps": 0}, "steps must be an integer >= 1, got 0"), ({"steps": 2.5}, "steps must be an integer"),
    ({"steps": True}, "steps must be an integer"),
    ({"steps": 4, "gate": 0.3}, "with steps=4 the gates run through the midpoints of")])
def test_attngate_refuses_bad_steps(lm, options, message):
    with pytest.raises(InputError, match=message):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["attngate"], chat=False,
                             options={"attngate": options})


@pytest.mark.parametrize("gate", [0, -0.5, 1.5, "half", True])
def test_attngate_refuses_a_gate_outside_zero_to_one(lm, gate):
    with pytest.raises(InputError, match="gate must be a number in"):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["attngate"], chat=False,
                             options={"attngate": {"gate": gate}})


def test_attngate_with_layers_recomputed_scores_the_same(lm, monkeypatch):
    from attnlens.sources import gates
    from attnlens.sources.attribute import prepare_job

    job = prepare_job(lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)
    kept, logprob = gates.source_gate_gradients(job, 0.5)
    switched = []
    real = gates.recomputing
    monkeypatch.setattr(gates, "_recomputes", lambda *a: True)
    monkeypatch.setattr(gates, "recomputing", lambda m, tokens: switched.append(tokens) or real(m, tokens))
    again, logprob_again = gates.source_gate_gradients(job, 0.5)
    n = len(job.prompt.ids) + len(job.prefix_ids) + len(job.answer_ids)
    assert switched and all(0 < tokens <= n for tokens in switched)
    np.testing.assert_allclose(again, kept, rtol=1e-5, atol=1e-7)
    assert logprob_again == pytest.approx(logprob, rel=1e-6)


@pytest.mark.parametrize(("queries", "message"), [("all", r"attngate's forward \+ backward over \d+ tokens"),
                                                   ("after", r"attngate over \d+ tokens")])
def test_attngate_over_the_memory_budget_is_refused_before_any_pass(lm, monkeypatch, queries, message):
    from attnlens.sources import gates

    monkeypatch.setattr(gates, "pass_row_bytes", lambda *a: 2**40)
    monkeypatch.setattr(gates, "gating", lambda *a: pytest.fail("the pass ran"))
    monkeypatch.setattr(gates, "explaining", lambda *a: pytest.fail("a pass ran"))
    with pytest.raises(InputError, match=message + " needs about 1024.0 GiB"):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo", "attngate"], chat=False,
                             options={"attngate": {"queries": queries}})


def test_attngate_refuses_unknown_queries(lm):
    with pytest.raises(InputError, match="queries must be one of all, after, got 'answer'"):
        lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["attngate"], chat=False,
                             options={"attngate": {"queries": "answer"}})


@pytest.mark.parametrize("options, message", [("{bad", "--options is not valid JSON"),
                                              ('["loo"]', "--options must map method ids to option objects")])
def test_cli_context_benchmark_refuses_bad_options_before_loading(tmp_path, capsys, options, message):
    code = main(["benchmark", "--task", "context", "--dataset", "squad-context", "--model", "/nonexistent/model",
                 "--methods", "loo", "--options", options, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]
    assert not (tmp_path / "run").exists()


def test_all_source_methods_leave_out_the_learned_ones():
    from attnlens.sources.attribute import split_methods
    from attnlens.sources.methods import SOURCE_METHODS

    token, source = split_methods("all")
    assert token == ["all"] and "at2" not in source and "at2lrp" not in source
    assert set(source) == set(SOURCE_METHODS) - {"at2", "at2lrp"} and {"loo", "contextcite", "attngate"} <= set(source)
    assert split_methods("at2lrp,loo") == ([], ["at2lrp", "loo"])


def test_the_context_summary_table_says_when_methods_were_measured_on_other_examples():
    from attnlens.evaluation.context_benchmark import markdown_table

    cell = {"mean": 0.5, "ci95": 0.1}
    summary = {"loo": {"lds": {**cell, "n": 4}, "seconds": {**cell, "n": 4}},
               "at2": {"lds": {**cell, "n": 3}, "seconds": {**cell, "n": 3}}}
    table = markdown_table(summary)
    assert "| loo | 4 |" in table and "| at2 | 3 |" in table
    assert "Not measured on the same examples: at2 (3) on fewer than the 4 of the others" in table
    assert "Not measured" not in markdown_table({"loo": summary["loo"]})


def test_value_zeroing_in_a_citation_holds_its_share_of_the_progress(lm, monkeypatch):
    """The token-level work is planned with the passes of the methods that run their own (value zeroing's grow
    with the length), so the progress it reports before the ablations start is its share of the whole."""
    from attnlens.core.progress import method_passes
    from attnlens.methods.registry import get_method
    from attnlens.sources.attribute import TOKEN_PASS_FORWARDS, prepare_job, token_forwards

    job = prepare_job(lm.runner, CONTEXT, QUERY, answer=ANSWER, sources="sentence")
    n = len(job.prompt.ids) + len(job.prefix_ids) + len(job.answer_ids)
    vz = get_method("valuezeroing")
    plan = method_passes(vz, lm.model, vz.options)(n)
    assert token_forwards(job, ["valuezeroing", "rawatt"], {}) == pytest.approx(TOKEN_PASS_FORWARDS * (1 + plan))
    assert token_forwards(job, ["rawatt"], {}) == TOKEN_PASS_FORWARDS and token_forwards(job, [], {}) == 0
    reports: list[float] = []
    at_ablations: list[float] = []
    real = source_methods.ablation_logprobs

    def ablations(job, keep, *args, **kwargs):
        at_ablations.append(reports[-1])
        return real(job, keep, *args, **kwargs)

    monkeypatch.setattr(source_methods, "ablation_logprobs", ablations)
    lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["valuezeroing", "loo"], chat=False,
                         progress=lambda f, d: reports.append(f))
    before = TOKEN_PASS_FORWARDS * (1 + plan)  # the token-level work, then loo's forwards: one per source and one
    assert at_ablations[0] == pytest.approx(before / (before + len(job.sources) + 1))
    assert reports[-1] == pytest.approx(1.0)
