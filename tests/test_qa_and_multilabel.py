"""QA and multi-label models: SQuAD span decoding, QA and multi-label explanations rendered everywhere
(terminal, HTML, plots, benchmark report), Precision@K as a documented count."""

from __future__ import annotations

import dataclasses
import html
import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PAD, V, make_model, make_tokenizer
from transformers import BertConfig, BertForQuestionAnswering, BertForSequenceClassification

from attnlens import Explainer, InputError
from attnlens.core.engine import batch_context
from attnlens.models.heads import MULTI_LABEL, best_spans, head_for
from attnlens.results.explanation import Explanation
from attnlens.viz.html import explanations_html
from attnlens.viz.terminal import render_terminal

QUESTION, CONTEXT = "what was the movie ?", "the movie was great but the plot was boring ."


@pytest.fixture(scope="module")
def qa() -> Explainer:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=64, initializer_range=0.3, pad_token_id=PAD)
    model = BertForQuestionAnswering(cfg).eval()
    model.set_attn_implementation("eager")
    return Explainer(model, make_tokenizer())


def _brute_force(start, end, allowed, max_len):
    pairs = [(s, e) for s, e in itertools.product(range(len(start)), repeat=2)
             if allowed[s] and allowed[e] and s <= e < s + max_len]
    return max(pairs, key=lambda p: float(start[p[0]] + end[p[1]]))


# ------------------------------------------------------------------ span decoding
def test_best_spans_match_a_brute_force_search():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = 3 + trial % 9
        start, end = torch.randn(4, n, generator=gen), torch.randn(4, n, generator=gen)
        allowed = torch.rand(4, n, generator=gen) > 0.3
        allowed[:, n // 2] = True  # at least one allowed position
        max_len = 1 + trial % 5
        got = best_spans(start, end, allowed, max_len)
        for b in range(4):
            assert tuple(got[b].tolist()) == _brute_force(start[b], end[b], allowed[b], max_len)


def test_predicted_span_is_the_squad_span_inside_the_context(qa):
    texts = [(QUESTION, CONTEXT), ("is the plot boring ?", "the film was good"), ("what ?", "great")]
    exps = qa.explain(texts, methods=["attcat"], batch_size=2)
    for (q, c), e in zip(texts, exps):
        enc = qa.tokenizer(q, c, return_tensors="pt")
        with torch.no_grad():
            out = qa.model(**enc)
        seq = enc.sequence_ids(0)
        allowed = [s == 1 and not sp for s, sp in zip(seq, e.special)]
        best = _brute_force(out.start_logits[0], out.end_logits[0], allowed, 30)
        assert e.predicted == e.target == list(best)
        assert e.target[0] <= e.target[1] and all(seq[i] == 1 for i in e.target)
        p_start = torch.softmax(out.start_logits[0], 0)[best[0]]
        p_end = torch.softmax(out.end_logits[0], 0)[best[1]]
        np.testing.assert_allclose(e.probabilities, [float(p_start), float(p_end)], rtol=1e-5)


def test_a_slow_tokenizer_without_token_types_reads_the_answer_from_the_context(qa, tmp_path):
    """A slow tokenizer gives no sequence ids: the special tokens that separate a pair tell the context apart; a
    pair they do not split in two (a literal separator in a text) is refused instead of read across it."""
    import transformers
    from conftest import VOCAB

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    slow = transformers.BertTokenizerLegacy(vocab_file=str(vocab), do_lower_case=True,
                                            model_input_names=["input_ids", "attention_mask"])
    assert not slow.is_fast
    ex = Explainer(qa.model, slow)
    (e,) = ex.explain([(QUESTION, CONTEXT)], methods=["rawatt"])
    (f,) = qa.explain([(QUESTION, CONTEXT)], methods=["rawatt"])
    assert e.token_type_ids is None and e.sequence_ids == f.sequence_ids
    assert e.target == e.predicted and all(e.sequence_ids[i] == 1 for i in e.target)  # inside the context
    from attnlens.models.heads import context_positions

    joined = dataclasses.replace(ex.encode([(QUESTION, CONTEXT)])[0], sequence_ids=None)  # GPT-2: a + b, no marks
    with pytest.raises(InputError, match="^this tokenizer marks neither which tokens are the context"):
        context_positions(joined)


def test_the_independent_argmaxes_are_not_the_answer(qa):
    """On this model the separate start/end argmaxes fall in the question ([1, 6]); the explained span is the best
    valid one, in the context."""
    enc = qa.tokenizer(QUESTION, CONTEXT, return_tensors="pt")
    with torch.no_grad():
        out = qa.model(**enc)
    naive = [int(out.start_logits[0].argmax()), int(out.end_logits[0].argmax())]
    (e,) = qa.explain([(QUESTION, CONTEXT)], methods=["attcat"])
    assert naive != e.predicted and enc.sequence_ids(0)[naive[0]] != 1


def test_max_answer_length_is_settable(qa):
    enc = qa.tokenizer(QUESTION, CONTEXT, return_tensors="pt")
    with torch.no_grad():
        out = qa.model(**enc)
    allowed = [s == 1 and not sp for s, sp in zip(enc.sequence_ids(0), qa.encode([(QUESTION, CONTEXT)])[0].special)]
    ex = Explainer(qa.model, qa.tokenizer, max_answer_length=1)
    (e,) = ex.explain([(QUESTION, CONTEXT)], methods=["attcat"])
    assert e.predicted[0] == e.predicted[1] and e.meta["max_answer_length"] == 1
    assert tuple(e.predicted) == _brute_force(out.start_logits[0], out.end_logits[0], allowed, 1)
    ex.max_answer_length = 3
    (e,) = ex.explain([(QUESTION, CONTEXT)], methods=["attcat"])
    assert tuple(e.predicted) == _brute_force(out.start_logits[0], out.end_logits[0], allowed, 3)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InputError, match="max_answer_length must be a positive"):
            Explainer(qa.model, qa.tokenizer, max_answer_length=bad)
    with pytest.raises(InputError, match="QA models only"):
        Explainer(make_model("bert"), make_tokenizer()).max_answer_length = 5


def test_a_target_span_ending_before_it_starts_is_refused(qa):
    for target in [(9, 4), [(9, 4)]]:
        with pytest.raises(InputError, match=r"^QA target span \(9, 4\) ends before it starts") as info:
            qa.explain([(QUESTION, CONTEXT)], methods=["attcat"], target=target)
        assert "\n" not in str(info.value)
    (e,) = qa.explain([(QUESTION, CONTEXT)], methods=["attcat"], target=(4, 4))  # a one-token span is fine
    assert e.target == [4, 4]
    for span in ([4, 6], np.array([4, 6]), torch.tensor([4, 6])):  # two integers are a span however given
        (e,) = qa.explain([(QUESTION, CONTEXT)], methods=["attcat"], target=span)
        assert e.target == [4, 6]
    with pytest.raises(InputError, match="a QA target is a \\(start, end\\) pair of token positions"):
        qa.explain([(QUESTION, CONTEXT)], methods=["attcat"], target=[(True, True)])


def test_one_text_given_to_a_qa_model_is_warned_of(qa):
    with pytest.warns(UserWarning, match=r"reads \(question, context\) pairs, but input 1 is one text"):
        pair, single = qa.explain([(QUESTION, CONTEXT), CONTEXT], methods=["rawatt"])
    assert single.target[0] >= 1 and pair.target[0] > len(qa.tokenizer(QUESTION)["input_ids"]) - 1


def test_qa_target_span_error_through_the_cli(qa, tmp_path, capsys):
    from attnlens.cli import main

    qa.model.save_pretrained(tmp_path / "m")
    qa.tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "in.jsonl").write_text(json.dumps({"text_a": QUESTION, "text_b": CONTEXT}) + "\n")
    capsys.readouterr()
    args = ["explain", "--model", str(tmp_path / "m"), "--file", str(tmp_path / "in.jsonl"), "--methods", "attcat"]
    assert main([*args, "--target", "9,4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["attnlens: error: QA target span (9, 4) ends before it starts: give (start, end) with end >= start"]
    assert main([*args, "--target", "9,11", "--format", "json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)
    assert d["target"] == [9, 11] and d["meta"]["task"] == "qa" and d["meta"]["answer"] == "was great but"
    assert Explanation.from_dict(d).span_text() == "was great but"
    assert d["meta"]["predicted_answer"] == Explanation.from_dict(d).span_text(d["predicted"])


# ------------------------------------------------------------------ QA rendering
def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_qa_terminal_view_shows_question_context_answer_and_probabilities(qa):
    (e,) = qa.explain([(QUESTION, CONTEXT)], methods=["attcat", "grads"], target=(9, 11))
    out = _plain(render_terminal(e, color=False, width=200))
    p_start, p_end = e.probabilities
    assert f"question: {QUESTION} context: {CONTEXT}" in out
    assert f'answer: "was great but" (tokens 9-11), p(start) {p_start:.3f}, p(end) {p_end:.3f}' in out
    assert f'predicted answer: "{e.span_text(e.predicted)}"' in out
    assert "attcat" in out and "top 5 for" in out
    coloured = render_terminal(e, color=True, width=200)
    assert re.search(r"\x1b\[[0-9;]*\b4;[0-9;]*m(was|great|but)\b", coloured)  # the answer span is underlined
    (p,) = qa.explain([(QUESTION, CONTEXT)], methods=["attcat"])
    assert "(the predicted answer)" in _plain(render_terminal(p, color=False, width=200))


def test_qa_word_aggregation_maps_the_span_to_word_positions(qa):
    text = ("what films ?", "the films was great and boring .")
    enc = qa.encode([text])[0]
    context = [k for k in range(len(enc.tokens)) if enc.sequence_ids[k] == 1 and not enc.special[k]]
    assert [enc.tokens[k] for k in context[:3]] == ["the", "film", "##s"]  # a word of two tokens
    (e,) = qa.explain([text], methods=["attcat"], target=(context[1], context[-1]))
    w = e.to_words()
    assert e.span_text() == w.span_text() == "films was great and boring ."
    assert w.tokens[w.target[0]] == "films" and w.tokens[w.target[1]] == "."
    out = _plain(render_terminal(e, color=False, width=200, words=True))
    assert f'answer: "films was great and boring ." (words {w.target[0]}-{w.target[1]})' in out


def test_qa_html_shows_question_context_answer_and_probabilities(qa):
    (e,) = qa.explain([(QUESTION, CONTEXT)], methods=["attcat", "grads"], target=(9, 11))
    page = explanations_html(e)
    p_start, p_end = e.probabilities
    assert f"<b>question</b>: {QUESTION}</p>" in page and f"<b>context</b>: {CONTEXT}</p>" in page
    assert (f"answer: &quot;was great but&quot; (tokens 9-11), p(start) {p_start:.3f}, p(end) {p_end:.3f}"
            in page)
    assert page.count('class="tok answer"') == 2 * 3  # the span's 3 tokens outlined, in both methods' rows
    assert "probabilities 0:" not in page  # no bogus "class" probabilities
    assert "Green supports the explained answer span (outlined)" in page


def test_qa_token_and_layer_heatmaps(qa, tmp_path):
    from attnlens.viz import plots

    (e,) = qa.explain([(QUESTION, CONTEXT)], methods=["attcat", "grads"], target=(9, 11))
    fig = plots.plot_token_heatmap(e, path=tmp_path / "t.png")
    title = fig.axes[0].get_title(loc="left")
    assert 'answer: "was great but" (tokens 9-11)' in title and "question: what was the movie" in title
    bold = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_fontweight() == "bold"]
    assert bold == ["was", "great", "but"]
    fig = plots.plot_layer_heatmap(e, "attcat", path=tmp_path / "l.svg")
    assert 'answer: "was great but"' in fig.axes[0].get_title(loc="left")
    assert (tmp_path / "t.png").stat().st_size > 0 and (tmp_path / "l.svg").stat().st_size > 0


def test_report_of_a_squad_run_shows_the_answers(qa, tmp_path):
    from attnlens.cli import main
    from attnlens.data import Dataset, Example
    from attnlens.evaluation import EvalConfig
    from attnlens.evaluation.runner import run_benchmark

    examples = [
        Example("a", [QUESTION, CONTEXT], None, [{"text": "great", "answer_start": CONTEXT.index("great")}]),
        Example("b", ["is the plot boring ?", "the plot was boring ."], None,
                [{"text": "boring", "answer_start": 13}]),
    ]
    run_benchmark(qa, Dataset("squad", "dev", "qa", examples), tmp_path, methods="attcat,grads", progress=False,
                  config=EvalConfig(precision_k=5))
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    exps = qa.explain([tuple(x.text) for x in examples], methods=["attcat"])
    for x, e in zip(examples, exps):
        assert f"<b>question</b>: {x.text[0]}</p>" in page and f"<b>context</b>: {x.text[1]}</p>" in page
        p_start, p_end = e.probabilities
        assert (f"answer: &quot;{e.span_text()}&quot;" in page and f"p(start) {p_start:.3f}, p(end) {p_end:.3f} "
                "(the predicted answer)" in page)
    assert "precision_at_k" in page and page.count('class="tok answer"') >= 2


# ------------------------------------------------------------------ multi-label
LABELS = {0: "joy", 1: "anger", 2: "fear", 3: "love"}
TEXT = "the movie was great but the plot was boring ."


@pytest.fixture(scope="module")
def multi() -> Explainer:
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=64, initializer_range=0.3, pad_token_id=PAD, num_labels=4,
                     problem_type="multi_label_classification", id2label=LABELS)
    model = BertForSequenceClassification(cfg).eval()
    model.set_attn_implementation("eager")
    return Explainer(model, make_tokenizer())


def _logits(ex: Explainer, text: str) -> torch.Tensor:
    with torch.no_grad():
        return ex.model(**ex.tokenizer(text, return_tensors="pt")).logits[0]


def test_multi_label_head_is_chosen_from_the_config(multi):
    assert multi.head is MULTI_LABEL and head_for(make_model("bert")) is not MULTI_LABEL


def test_multi_label_probabilities_prediction_and_default_target(multi):
    texts = [TEXT, "boring", "great film and great plot !"]
    exps = multi.explain(texts, methods=["attcat"])
    for text, e in zip(texts, exps):
        z = _logits(multi, text)
        p = torch.sigmoid(z)
        np.testing.assert_allclose(e.probabilities, p.numpy(), rtol=1e-5)
        assert abs(sum(e.probabilities) - 1) > 1e-3  # not a softmax
        assert e.predicted == [j for j in range(4) if p[j] > 0.5]
        assert e.target == int(z.argmax()) and e.meta["problem_type"] == "multi_label_classification"
    np.testing.assert_allclose(multi.predict_proba([multi.encode([TEXT])[0].ids])[0],
                               torch.sigmoid(_logits(multi, TEXT)).numpy(), rtol=1e-5)
    back = Explanation.from_dict(json.loads(json.dumps(exps[0].to_dict())))
    assert back == exps[0] and back.is_multi_label and back.predicted == exps[0].predicted


@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_multi_label_probability_and_loss_targets_scale_the_logit_gradient(multi, j):
    """d sigmoid(z_j) = sigmoid'(z_j) dz_j and d log sigmoid(z_j) = (1 - sigmoid(z_j)) dz_j: every method linear
    (or positively homogeneous) in the gradient scales by that factor; a softmax would mix in other labels."""
    methods = ["inputxgradient", "saliency", "grads"]
    s = float(torch.sigmoid(_logits(multi, TEXT)[j]))
    (logit,) = multi.explain(TEXT, methods=methods, target=j)
    (prob,) = multi.explain(TEXT, methods=methods, target=j, target_kind="probability")
    (loss,) = multi.explain(TEXT, methods=methods, target=LABELS[j], target_kind="loss")
    assert logit.target == prob.target == loss.target == j
    for m in methods:
        np.testing.assert_allclose(prob.scores[m], s * (1 - s) * logit.scores[m], rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(loss.scores[m], (1 - s) * logit.scores[m], rtol=1e-4, atol=1e-9)


def test_multi_label_integrated_gradients_complete_to_the_sigmoid(multi):
    from attnlens.methods.gradient import baseline_ids

    j = 3
    (e,) = multi.explain(TEXT, methods=["integratedgradients"], target=j, target_kind="probability",
                         options={"integratedgradients": {"n_steps": 300}})
    (enc,) = multi.encode([TEXT])
    ctx = batch_context(multi.runner, [enc], "probability")
    ctx.targets = torch.tensor([j])
    base = baseline_ids(ctx, "auto")
    with torch.no_grad():
        f_x = torch.sigmoid(multi.model(**ctx.inputs).logits[0, j])
        f_b = torch.sigmoid(multi.model(**{**ctx.inputs, "input_ids": base}).logits[0, j])
    assert e.scores["integratedgradients"].sum() == pytest.approx(float(f_x - f_b), rel=0.02, abs=2e-4)


def test_multi_label_lrp_probability_target_uses_the_sigmoid(multi):
    s = float(torch.sigmoid(_logits(multi, TEXT)[1]))
    (logit,) = multi.explain(TEXT, methods=["attnlrp"], target=1)
    (prob,) = multi.explain(TEXT, methods=["attnlrp"], target=1, target_kind="probability")
    # the output sigmoid gets the gradient x input rule: relevance scales by sigmoid'(z) z / z at the top
    np.testing.assert_allclose(prob.scores["attnlrp"], s * (1 - s) * logit.scores["attnlrp"], rtol=1e-4, atol=1e-9)


def test_multi_label_rendering(multi, tmp_path):
    from attnlens.viz import plots

    (e,) = multi.explain(TEXT, methods=["attcat", "grads"], target="anger")
    p = e.probabilities
    chosen = ", ".join(f"{LABELS[j]} ({p[j]:.3f})" for j in e.predicted) or "none"
    line = f"predicted labels (p > 0.5 each, independent): {chosen}; explaining anger (p {p[1]:.3f})"
    listed = "label probabilities (sigmoid, independent) " + ", ".join(f"{LABELS[j]}: {p[j]:.3f}" for j in range(4))
    out = _plain(render_terminal(e, color=False, width=200))
    assert line in out and listed in out
    page = explanations_html(e)
    assert html.escape(line) in page and listed in page
    fig = plots.plot_token_heatmap(e, path=tmp_path / "m.png")
    assert line in fig.axes[0].get_title(loc="left")
    nobody = Explanation.from_dict({**e.to_dict(), "predicted": []})
    assert "predicted labels (p > 0.5 each, independent): none; explaining anger" in render_terminal(
        nobody, color=False, width=200)


def test_benchmark_refuses_a_multi_label_model(multi, tmp_path):
    from attnlens.data import Dataset, Example
    from attnlens.evaluation.runner import run_benchmark

    ds = Dataset("sst2", "dev", "classification", [Example("a", TEXT, 1, None)])
    with pytest.raises(InputError, match="single-label classifiers; this model is multi-label"):
        run_benchmark(multi, ds, tmp_path, methods="attcat", progress=False)
    assert not (tmp_path / "run.json").exists()


@pytest.mark.parametrize("dataset", ["sst2", "squad"])
def test_benchmark_refuses_a_token_classifier_up_front_and_names_it(tmp_path, dataset):
    from attnlens.data import Dataset, Example
    from attnlens.evaluation.runner import run_benchmark

    model = make_model("bert", num_labels=3, model_suffix="ForTokenClassification")
    ds = (Dataset("sst2", "dev", "classification", [Example("a", TEXT, 1, None)]) if dataset == "sst2"
          else Dataset("squad", "dev", "qa", [Example("q", ["q?", TEXT], None, [])]))
    out = tmp_path / "out"
    with pytest.raises(InputError, match="^the benchmark scores sequence classifiers and extractive QA models; "
                                         "this model is a token classifier$"):
        run_benchmark(Explainer(model, make_tokenizer()), ds, out, methods="attcat", progress=False)
    assert not out.exists()


def test_serve_faithfulness_names_a_multi_label_model(multi):
    from attnlens.serve import compute

    with pytest.raises(InputError, match="this model is a multi-label classifier$"):
        compute.faithfulness(multi, multi.explain([TEXT], ["rawatt"]), ("aopc",), None, 1 << 30)


# ------------------------------------------------------------------ precision@K
def test_precision_at_k_is_a_documented_count_everywhere(tmp_path):
    from attnlens.evaluation import EvalConfig, precision_at_k
    from attnlens.evaluation.metrics import metric_info
    from attnlens.evaluation.summary import write_tables

    # hand-made: ranking of the real tokens by score is 3, 1, 4, 2, 5; the answer is tokens 1, 2, 5
    exp = Explanation(text="a b c d e", tokens=["[CLS]", "a", "b", "c", "d", "e", "[SEP]"],
                      special=[True, False, False, False, False, False, True], target=0, predicted=0,
                      probabilities=[1.0], scores={"m": np.array([9.0, 4.0, 2.0, 5.0, 3.0, 1.0, 9.0])})
    assert [precision_at_k(exp, "m", [1, 2, 5], k) for k in (1, 2, 3, 4, 5, 20)] == [0, 1, 1, 2, 3, 3]
    info = metric_info("precision_at_k", EvalConfig(precision_k=4)).to_dict()
    assert info["range"] == [0.0, 4.0] and info["best"] == 4.0 and not info["lower_is_better"]
    assert "count in [0, K]" in info["description"] and "K = 4" in info["description"]
    assert "not a fraction" in info["description"]
    for bad in (0, -1, 2.5):
        with pytest.raises(InputError, match="K of precision@K must be a positive"):
            EvalConfig(precision_k=bad)
    summary = {"model": "m", "dataset": "squad", "split": "dev", "n_examples": 1, "protocol": "paper",
               "metrics": {"precision_at_k": info}, "results": {"m": {"precision_at_k": 2.0}},
               "curves": {"precision_at_k": {"k": 4, "answer_tokens": 3.0, "perfect": 3.0}}}
    write_tables(tmp_path, summary)
    table = (tmp_path / "table.md").read_text()
    assert "| m | **2.000** |" in table
    assert "precision_at_k is a count, not a fraction: gold-answer tokens among the top K = 4" in table
    assert "(best reachable: 3.000)" in table
    docs = (Path(__file__).parents[1] / "docs" / "benchmark-format.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `precision_at_k`"))
    assert "| [0, K] |" in row and "a **count**, not a fraction" in row


def test_multi_label_model_through_the_cli(multi, tmp_path, capsys):
    from attnlens.cli import main

    multi.model.save_pretrained(tmp_path / "m")
    multi.tokenizer.save_pretrained(tmp_path / "m")
    capsys.readouterr()
    args = ["explain", "--model", str(tmp_path / "m"), "--methods", "attcat", TEXT]
    assert main([*args, "--format", "json", "--target", "love"]) == 0
    (d,) = json.loads(capsys.readouterr().out)
    p = torch.sigmoid(_logits(multi, TEXT))
    np.testing.assert_allclose(d["probabilities"], p.numpy(), rtol=1e-5)
    assert d["predicted"] == [j for j in range(4) if p[j] > 0.5] and d["target"] == 3
    assert d["meta"]["problem_type"] == "multi_label_classification"
    assert main(args) == 0
    out = _plain(capsys.readouterr().out)
    assert f"explaining {LABELS[int(p.argmax())]} (p {float(p.max()):.3f})" in out
    assert "label probabilities (sigmoid, independent) joy:" in out
