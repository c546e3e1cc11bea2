"""Each task's head owns its targets (resolving, checking, the probabilities and metadata
shown), and the engine (attnlens.core.engine) only calls head methods."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PAD, V, make_model, make_tokenizer, randomise_biases_and_norms
from transformers import BertConfig, BertForQuestionAnswering

import attnlens
from attnlens import Explainer, InputError, ModelError
from attnlens.models.heads import CLASSIFICATION, MULTI_LABEL, PREDICTED, QA, Head, QAHead

SRC = Path(attnlens.__file__).parent
LABELS = ["negative", "positive"]


def test_classification_head_resolves_user_targets_on_its_own():
    assert CLASSIFICATION.resolve_targets(None, 2, LABELS) == [PREDICTED, PREDICTED]
    assert CLASSIFICATION.resolve_targets("Positive", 3, LABELS) == [1, 1, 1]
    assert CLASSIFICATION.resolve_targets(["0", np.int64(1)], 2, LABELS) == [0, 1]
    assert CLASSIFICATION.resolve_targets(torch.tensor([1, 0]), 2, LABELS) == [1, 0]
    assert MULTI_LABEL.resolve_targets([None, "negative"], 2, LABELS) == [PREDICTED, 0]
    with pytest.raises(InputError, match=r"^target 2 is out of range: the model has 2 classes \(0\.\.1\)$"):
        CLASSIFICATION.resolve_targets(2, 1, LABELS)
    with pytest.raises(InputError, match=r"^unknown label 'neutral'; the model's labels are: negative, positive$"):
        CLASSIFICATION.resolve_targets("neutral", 1, LABELS)
    with pytest.raises(InputError, match=r"one per input \(3 inputs\)"):
        CLASSIFICATION.resolve_targets([0, 1], 3, LABELS)
    with pytest.raises(InputError, match="class index or label name, got True"):
        CLASSIFICATION.resolve_targets([True], 1, LABELS)


def test_qa_head_resolves_and_checks_spans_on_its_own():
    assert QA.labels(None) == []
    assert QA.resolve_targets(None, 2, []) == [(PREDICTED, PREDICTED)] * 2
    assert QA.resolve_targets([(1, 2), None], 2, []) == [(1, 2), (PREDICTED, PREDICTED)]
    with pytest.raises(InputError, match=re.escape("QA target span (3, 1) ends before it starts")):
        QA.resolve_targets((3, 1), 1, [])
    with pytest.raises(InputError, match=re.escape("target span (2, 9) of input 1 is beyond its 6 tokens")):
        QA.check_targets([10, 6], [(0, 1), (2, 9)])
    wanted, pending = QA.pending([(1, 2), (PREDICTED, PREDICTED)], torch.device("cpu"))
    assert pending.tolist() == [[False], [True]] and wanted.tolist() == [[1, 2], [-1, -1]]
    assert QA.shown_probabilities(np.array([[0.1, 0.2], [0.3, 0.4]]), (1, 0)) == [0.3, 0.2]
    assert QA.meta() == {"task": "qa", "max_answer_length": 30}
    assert QA.with_max_answer_length(7).max_answer_length == 7
    with pytest.raises(InputError, match="max_answer_length applies to extractive QA models only"):
        CLASSIFICATION.with_max_answer_length(7)
    with pytest.raises(ModelError, match="predict_proba is for sequence classifiers; this is a QA model"):
        QAHead().check_predict_proba()
    assert MULTI_LABEL.meta() == {"task": "classification", "problem_type": "multi_label_classification"}


def test_engine_and_explainer_have_no_task_branches():
    for module in ("explainer.py", "core/engine.py", "core/encoding.py"):
        source = (SRC / module).read_text()
        assert not re.search(r"task\s*[!=]=|[!=]=\s*\"qa\"|\.multi_label\b|\(-1, -1\)", source), module


class _TaggingHead(Head):
    """A head that changes what is shown, to prove the engine asks the head."""

    def shown_probabilities(self, probs: np.ndarray, target: int) -> list[float]:
        return [float(probs[target])]

    def meta(self) -> dict:
        return {"task": "tagged"}

    def annotate(self, explanation) -> None:
        explanation.meta["tag"] = explanation.target


def test_the_engine_shows_what_the_head_says():
    ex = Explainer(make_model("bert"), make_tokenizer())
    plain = ex.explain(["good movie", "bad plot"], methods="rawatt", target=[None, 0])
    ex.head = _TaggingHead()
    tagged = ex.explain(["good movie", "bad plot"], methods="rawatt", target=[None, 0])
    for p, t in zip(plain, tagged, strict=True):
        assert t.target == p.target and t.meta["task"] == "tagged" and t.meta["tag"] == p.target
        assert t.probabilities == [p.probabilities[p.target]]
        np.testing.assert_array_equal(t.scores["rawatt"], p.scores["rawatt"])


def test_qa_explanations_still_carry_answers_and_the_explained_span_probabilities():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=64, initializer_range=0.3, pad_token_id=PAD)
    model = BertForQuestionAnswering(cfg).eval()
    ex = Explainer(model, make_tokenizer())
    pair = ("what was the movie ?", "the movie was great but the plot was boring .")
    (exp,) = ex.explain([pair], methods="rawatt", target=(8, 9))
    ctx, _ = ex.compute_batch(ex.encode([pair]), [(8, 9)], [], {})
    with torch.no_grad():
        probs = ex.head.probabilities(ex.head.logits(model(**ctx.inputs)), ctx.token_mask)[0]
    assert exp.probabilities == pytest.approx([float(probs[8, 0]), float(probs[9, 1])])
    assert exp.meta["answer"] == exp.span_text() and exp.meta["predicted_answer"] == exp.span_text(exp.predicted)
    assert exp.meta["task"] == "qa" and exp.meta["max_answer_length"] == 30


def test_tasks_are_named_in_one_table_that_loading_reads():
    from attnlens.models.heads import TASKS, task_of

    assert task_of(["BertForQuestionAnswering"]) == "qa"
    assert task_of(["RobertaForSequenceClassification"]) == task_of([]) == "classification"
    assert {t: (h.auto_class, h.kind) for t, h in TASKS.items()} == {
        "classification": ("AutoModelForSequenceClassification", "a sequence classifier"),
        "qa": ("AutoModelForQuestionAnswering", "an extractive QA model"),
        "token": ("AutoModelForTokenClassification", "a token classifier"),
        "causal-lm": ("AutoModelForCausalLM", "a causal language model"),
        "seq2seq-lm": ("AutoModelForSeq2SeqLM", "a sequence-to-sequence language model"),
    }
    assert task_of(["BertForTokenClassification"]) == "token"
    assert task_of(["GPT2LMHeadModel"]) == task_of(["LlamaForCausalLM"]) == "causal-lm"
    assert task_of(["T5ForConditionalGeneration"]) == "seq2seq-lm"
    with pytest.raises(InputError, match=r"^task='ner'; choose 'classification' or 'qa' or 'token' or 'causal-lm' "
                                         r"or 'seq2seq-lm'$"):
        Explainer.from_pretrained("/nonexistent", task="ner")
    loading = (SRC / "models" / "loading.py").read_text()
    assert 'if task == "qa"' not in loading


@pytest.mark.parametrize(("num_labels", "problem_type"), [(1, None), (1, "regression"), (3, "regression")])
def test_a_regression_head_is_refused_in_one_line(tokenizer, num_labels, problem_type):
    model = make_model("bert")
    model.config.num_labels = num_labels
    model.config.problem_type = problem_type
    with pytest.raises(ModelError, match=rf"is a regression model \({num_labels} outputs?, .* not regression outputs$"):
        Explainer(model, tokenizer)


def test_a_one_label_multi_label_classifier_is_still_a_classifier(tokenizer):
    model = make_model("bert")
    model.config.problem_type = "multi_label_classification"
    model.config.num_labels = 1
    assert Explainer(model, tokenizer).head is MULTI_LABEL


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_decoder_classifier_padding_with_its_final_token_is_explained_where_its_head_reads(family):
    """Fine-tuned with its EOS as padding, a decoder classifier reads the last token whose id is not the pad id:
    the token before an input's final [SEP]. Every method explains that row: raw attention is the model's own row
    there, and DecompX's shares and bias sum to the model's logit."""
    from conftest import SEP

    model = make_model(family)
    model.config.pad_token_id = SEP
    tokenizer = make_tokenizer()
    ex = Explainer(model, tokenizer)
    text = "good movie"
    (e,) = ex.explain([text], methods=["rawatt", "decompx"])
    inputs = tokenizer(text, return_tensors="pt")  # GPT-2 embeds token types too
    assert inputs["input_ids"][0, -1] == SEP
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    row = out.attentions[-1][0].mean(0)[-2].double().numpy()
    np.testing.assert_allclose(e.scores["rawatt"], row, atol=1e-6)
    logit = float(out.logits[0, e.target])
    assert abs(e.scores["decompx"].sum() + e.meta["decompx"]["bias"] - logit) < 1e-4
    batch = ex.explain([text, "the plot was boring but the actors were great"], methods=["rawatt"])
    np.testing.assert_allclose(batch[0].scores["rawatt"], e.scores["rawatt"], atol=1e-6)


# ------------------------------------------------------------------- causal models: the rows after the head's
def _without_final_sep(tokenizer):
    """The tiny tokenizer writing ``[CLS] text`` (no ``[SEP]`` appended): a text then ends where it is cut."""
    import copy

    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tokenizer)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 2)])
    return tok


@pytest.mark.parametrize("attn", ["eager", "sdpa"])  # whole maps, and the rows a pass with fused attention keeps
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("task", ["token", "qa", "classifier-before-eos"])
def test_a_causal_models_scores_ignore_the_tokens_after_the_rows_its_head_reads(family, task, attn):
    """Under causal attention the rows a head reads (a token's label, a QA span, a classifier's row before a final
    end-of-text token when the pad id is that token) compute nothing from the tokens after them: the input cut
    right after those rows has the same explained value, and every deterministic method the same scores on the
    tokens they share (Grad-SAM and AttCAT average over query rows: the rows after feed nothing the head reads)."""
    from conftest import SEP

    tokenizer = make_tokenizer()
    if task == "token":
        model = make_model(family, num_labels=3, model_suffix="ForTokenClassification", seed=1, attn=attn)
        full, cut, target, shared = "the movie was good and i loved it", "the movie was good", (4, 1), 5
    elif task == "qa":
        model = make_model(family, model_suffix="ForQuestionAnswering", seed=1, attn=attn)
        question = "was it good ?"
        full, cut = (question, "the movie was good and i loved it"), (question, "the movie was good")
        target = (8, 9)  # "was good" in the context: [CLS] was it good ? [SEP] the movie was good ...
        assert tokenizer.convert_ids_to_tokens(tokenizer(*cut)["input_ids"])[8:10] == ["was", "good"]
        shared = 10
    else:
        model = make_model(family, num_labels=3, seed=1, attn=attn)
        model.config.pad_token_id = SEP  # the head reads the row before the first [SEP]
        tokenizer = _without_final_sep(tokenizer)
        full, cut, target, shared = "the movie was good [SEP]", "the movie was good", 1, 5
    model = randomise_biases_and_norms(model.double(), seed=1)
    ex = Explainer(model, tokenizer)
    methods = [m for m in attnlens.list_methods() if m not in ("lime", "kernelshap")
               and not attnlens.get_method(m).unsupported(model, ex.stream, ex.head.task)]
    assert {"attcat", "attgrads"} <= set(methods)
    options = {"integratedgradients": {"n_steps": 8}}
    a, b = (ex.explain(t, methods, target=target, options=options)[0] for t in (full, cut))
    assert a.tokens[:shared] == b.tokens[:shared] and a.tokens[shared:] != b.tokens[shared:]
    if task != "qa":  # the same explained value (a QA model's probabilities are over every position)
        assert a.probabilities == pytest.approx(b.probabilities, rel=1e-9)
    for m in methods:
        assert a.scores[m][:shared] == pytest.approx(b.scores[m][:shared], rel=1e-6, abs=1e-12), m
