"""Bad input gets clear errors; the Explanation result type round-trips and ranks correctly."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import make_model, make_tokenizer
from transformers import BertConfig, BertModel

from attnlens import Explainer, Explanation, InputError, ModelError, UnknownMethodError, list_methods
from attnlens.results.explanation import load_explanations, save_explanations


@pytest.fixture(scope="module")
def ex():
    return Explainer(make_model("bert"), make_tokenizer())


@pytest.mark.parametrize("bad", ["", "   ", ["ok text", "\n\t"], [("a pair", " ")]])
def test_empty_text_is_rejected(ex, bad):
    with pytest.raises(InputError, match="empty"):
        ex.explain(bad, methods=["rawatt"])


def test_no_texts_and_wrong_types(ex):
    with pytest.raises(InputError, match="no texts"):
        ex.explain([], methods=["rawatt"])
    with pytest.raises(InputError, match="neither a string"):
        ex.explain([3], methods=["rawatt"])


def test_long_text_is_truncated_with_a_warning_or_rejected(ex):
    long_text = " ".join(["good"] * 100)  # 102 tokens, the tiny tokenizer allows 48
    with pytest.warns(UserWarning, match=r"truncated \(input 0: 54 tokens"):
        (e,) = ex.explain(long_text, methods=["rawatt"])
    assert len(e.tokens) == 48 and e.tokens[-1] == "[SEP]"
    assert e.meta["truncated_tokens"] == 54
    with pytest.raises(InputError, match="102 tokens, more than the model's maximum of 48"):
        ex.explain(long_text, methods=["rawatt"], truncation=False)


def test_unknown_method_lists_available(ex):
    with pytest.raises(UnknownMethodError) as info:
        ex.explain("good", methods=["attcatt"])
    message = str(info.value)
    assert "attcatt" in message
    for m in list_methods():
        assert m in message


def test_bad_options(ex):
    with pytest.raises(InputError, match="has no option"):
        ex.explain("good", methods=["attcat"], options={"attcat": {"layer": 3}})
    with pytest.raises(InputError, match="choose one of input, output"):
        ex.explain("good", methods=["attcat"], options={"attcat": {"hidden": "middle"}})
    with pytest.raises(InputError, match="not among the requested"):
        ex.explain("good", methods=["rawatt"], options={"attcat": {"hidden": "output"}})
    with pytest.raises(InputError, match="target_kind"):
        ex.explain("good", methods=["rawatt"], target_kind="margin")


def test_targets_out_of_range_or_unknown(ex):
    with pytest.raises(InputError, match="out of range: the model has 2 classes"):
        ex.explain("good", methods=["agrad"], target=2)
    with pytest.raises(InputError, match="unknown label 'positive'; the model's labels are: LABEL_0, LABEL_1"):
        ex.explain("good", methods=["agrad"], target="positive")
    with pytest.raises(InputError, match=r"one per input \(2 inputs\)"):
        ex.explain(["good", "bad"], methods=["agrad"], target=[0])
    (e,) = ex.explain("good", methods=["agrad"], target="LABEL_1")
    assert e.target == 1


def test_not_a_classifier():
    model = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=8))
    with pytest.raises(ModelError, match="sequence classifiers.*BertModel"):
        Explainer(model, make_tokenizer())
    with pytest.raises(ModelError, match="PyTorch"):
        Explainer("bert-base-uncased", make_tokenizer())


def test_vocabulary_mismatch():
    small = make_model("bert")
    small.resize_token_embeddings(20)
    with pytest.raises(ModelError, match="does not belong to this model"):
        Explainer(small, make_tokenizer())


def test_missing_model_directory(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        Explainer.from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelError, match="could not load"):
        Explainer.from_pretrained(tmp_path)  # exists, but holds no model


def test_top_k_never_ranks_special_or_padding(ex):
    (e,) = ex.explain("the movie was great", methods=["rollout", "attcat"])
    ranked = [tok for tok, _ in e.top_k("rollout", 10)]
    assert "[CLS]" not in ranked and "[SEP]" not in ranked and "[PAD]" not in ranked
    assert sorted(ranked) == sorted(["the", "movie", "was", "great"])
    scores = [s for _, s in e.top_k("attcat", 4)]
    assert scores == sorted(scores, reverse=True)
    with pytest.raises(InputError, match="no scores for method 'gae'"):
        e.top_k("gae", 2)


def test_save_load_roundtrip(ex, tmp_path):
    exps = ex.explain(["the movie was great", ("a pair", "of texts")], methods=["attcat", "rollout"])
    path = tmp_path / "one.json"
    exps[0].save(path)
    loaded = Explanation.load(path)
    assert loaded == exps[0]
    np.testing.assert_array_equal(loaded.layers["attcat"], exps[0].layers["attcat"])
    save_explanations(exps, tmp_path / "all.jsonl")
    assert load_explanations(tmp_path / "all.jsonl") == exps
    d = exps[0].to_dict()
    for key in ("text", "tokens", "special", "target", "predicted", "probabilities", "scores", "layers"):
        assert key in d
    with pytest.raises(InputError, match="missing keys"):
        Explanation.from_dict({"text": "x"})


def test_decoder_without_pad_token_falls_back_to_single_inputs():
    model = make_model("gpt2")
    model.config.pad_token_id = None
    ex = Explainer(model, make_tokenizer())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exps = ex.explain(["the movie was great", "bad"], methods=["rawatt"], batch_size=8)
    assert any("pad_token_id" in str(w.message) for w in caught)
    assert len(exps) == 2


def test_not_a_number_scores_rank_last_and_an_explanation_equals_itself():
    scores = np.array([0.0, 0.5, np.nan, np.inf, -0.8, np.nan, 0.2, 0.0])
    exp = Explanation("t", ["[CLS]", "a", "b", "c", "d", "e", "f", "[SEP]"], [True] + [False] * 6 + [True], 0, 0,
                      [1.0], {"m": scores})
    assert exp.ranking("m") == [3, 1, 6, 4, 2, 5]
    assert exp.ranking("m", reverse=True) == [4, 6, 1, 3, 2, 5]
    assert [t for t, _ in exp.top_k("m", 2)] == ["c", "a"]
    assert exp == exp and exp == Explanation.from_dict(exp.to_dict())


def _pair_dict():
    return Explanation(["the movie", "was dull"], ["[CLS]", "the", "movie", "[SEP]", "was", "dull", "[SEP]"],
                       [True, False, False, True, False, False, True], 0, 0, [0.3, 0.7],
                       {"m": np.arange(7.0)}, layers={"m": np.ones((2, 7))}, word_ids=[None, 0, 1, None, 0, 1, None],
                       sequence_ids=[None, 0, 0, None, 1, 1, None],
                       offsets=[(0, 0), (0, 3), (4, 9), (0, 0), (0, 3), (4, 8), (0, 0)]).to_dict()


@pytest.mark.parametrize("change, message", [
    (lambda d: d.__setitem__("special", d["special"][:4]), "'special' must be a list of 7 booleans"),
    (lambda d: d.__setitem__("special", ["false"] * 7), "'special' must be a list of 7 booleans"),
    (lambda d: d["scores"].__setitem__("m", list(range(9))), r"scores\[.m.\] has shape \(9,\)"),
    (lambda d: d["layers"].__setitem__("m", [[1.0] * 6] * 2), r"layers\['m'\] has shape \(2, 6\)"),
    (lambda d: d.__setitem__("tokens", "[CLS]the"), "'tokens' must be a list of strings"),
    (lambda d: d.__setitem__("offsets", d["offsets"][:3]), "'offsets' must be a list of 7"),
    (lambda d: d.__setitem__("target", "positive"), "invalid literal"),
    (lambda d: d.__setitem__("probabilities", None), "'probabilities' must be a list of numbers"),
    (lambda d: d.__setitem__("meta", [1]), "'meta' must be an object"),
    (lambda d: d.__setitem__("scores", [1.0]), "'scores' and 'layers' must map methods"),
])
def test_a_malformed_explanation_is_refused_in_one_line(change, message):
    d = _pair_dict()
    change(d)
    with pytest.raises(InputError, match="not an attnlens explanation: .*" + message):
        Explanation.from_dict(d)


def test_a_pair_file_without_sequence_ids_reads_each_sides_offsets_in_its_own_text():
    d = _pair_dict()
    words = Explanation.from_dict(d).to_words().tokens
    del d["sequence_ids"]
    old = Explanation.from_dict(d)
    assert old.sequence_ids == [None, 0, 0, None, 1, 1, None] and old.to_words().tokens == words
    assert words == ["[CLS]", "the", "movie", "[SEP]", "was", "dull", "[SEP]"]


def test_words_cannot_be_aggregated_again_otherwise():
    exp = Explanation.from_dict(_pair_dict())
    words = exp.to_words("max")
    assert words.to_words("max") is words
    with pytest.raises(InputError, match="these are words already, their scores aggregated by max"):
        words.to_words()
