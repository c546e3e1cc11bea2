"""How a context attribution's tokens map onto characters and sources: a character whose bytes a byte-level
tokenizer splits over several tokens (an emoji, CJK) belongs whole to the token that completes it, for a given
answer as for a generated one, and a span of the answer explains every token that spells it; the share outside
every source counts the answer's earlier tokens; sentences keep their closing punctuation; warnings where tokens
and sources do not meet as a reader expects. On a tiny GPT-2 with a byte-level BPE tokenizer trained here."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import transformers
from conftest import CLS, PAD, SEP, V, make_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from attnlens import Explainer, InputError
from attnlens.core.answer_engine import answer_logprobs
from attnlens.core.encoding import completing_spans
from attnlens.sources import attribute
from attnlens.sources.attribute import prepare_job
from attnlens.sources.segment import split_sources
from attnlens.testing.tiny_models import build_tiny

CONTEXT = "The cake emoji is 🍰. Tokyo is 東京. Paris is nice."
QUERY = "Repeat it"
ANSWER = "🍰 東京 ok"


@pytest.fixture(scope="module")
def byte_lm() -> Explainer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<pad>"])
    tok.train_from_iterator(["the cake is good. Tokyo is big. Paris is nice. Question: Answer:"] * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<pad>", model_max_length=256)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(fast), n_positions=256, n_embd=16, n_layer=2, n_head=2,
                                     pad_token_id=fast.pad_token_id, bos_token_id=fast.eos_token_id,
                                     eos_token_id=fast.eos_token_id, attn_implementation="eager")
    return Explainer(transformers.GPT2LMHeadModel(config).eval(), fast, max_length=256)


def _spelled(text: str, spans) -> list[str]:
    return [text[a:b] for a, b in spans]


def test_completing_spans_give_a_split_character_to_the_token_that_completes_it():
    # " 東" as one token holding the space and the first byte, then two tokens of its other bytes; "京" in two
    assert completing_spans([(0, 2), (1, 2), (1, 2), (2, 3), (2, 3)]) == [(0, 1), (1, 1), (1, 2), (2, 2), (2, 3)]
    assert completing_spans([(0, 1), (0, 1), (0, 1), (1, 7)]) == [(0, 0), (0, 0), (0, 1), (1, 7)]
    assert completing_spans([(0, 0), (0, 5), (0, 0), (5, 9)]) == [(0, 0), (0, 5), (0, 0), (5, 9)]  # no text: kept


def test_a_given_answer_is_spelled_as_the_same_answer_generated(byte_lm):
    tokenizer = byte_lm.tokenizer
    for text in (ANSWER, " 東京 is 🍰🍰", "café ok"):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        given = completing_spans([tuple(o) for o in tokenizer(text, add_special_tokens=False,
                                                              return_offsets_mapping=True)["offset_mapping"]])
        decoded, generated = attribute._answer_offsets(byte_lm.runner, ids)  # prefix decoding, as a generation
        assert decoded == text and given == generated
        assert "".join(_spelled(text, given)) == text


def test_the_attribution_spells_answer_and_prompt_tokens_without_overlap(byte_lm):
    r = byte_lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["rawatt"], chat=False)
    assert "".join(r.answer_tokens) == r.answer and r.answer_tokens[:2] == ["", ""]
    assert "".join(r.prompt_tokens) == r.prompt
    spelled = [(a, b) for a, b in r.token_offsets if b > a]
    assert all(b <= a2 for (_, b), (a2, _) in zip(spelled, spelled[1:]))  # in order, none overlapping
    cake = [k for k, t in enumerate(r.prompt_tokens) if t == "🍰"]
    assert len(cake) == 1 and r.token_source[cake[0] - 1] == r.token_source[cake[0]] == 0  # its bytes: source 0


def test_a_span_of_the_answer_explains_every_token_that_spells_it(byte_lm):
    ids = byte_lm.tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    emoji = len(byte_lm.tokenizer("🍰", add_special_tokens=False)["input_ids"])
    assert emoji == 4
    job = prepare_job(byte_lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False, answer_span=(0, 1))
    assert job.prefix_ids == [] and job.answer_ids == ids[:emoji] and job.explained == (0, 1)
    whole = prepare_job(byte_lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False, answer_span=(0, len(ANSWER)))
    assert whole.answer_ids == ids and whole.prefix_ids == []
    # the log-probability explained is the character's: the sum over its four byte tokens
    r = byte_lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"], chat=False, answer_span=(0, 1))
    per_token = answer_logprobs(byte_lm.runner, [job.prompt.ids], ids[:emoji])
    assert r.meta["answer_logprob"] == pytest.approx(float(np.sum(per_token)), rel=1e-5, abs=1e-6)
    tokyo = prepare_job(byte_lm.runner, CONTEXT, QUERY, answer=ANSWER, chat=False, answer_span=(2, 3))
    assert len(tokyo.prefix_ids) + len(tokyo.answer_ids) <= len(ids) and tokyo.explained == (2, 3)
    assert byte_lm.tokenizer.decode(tokyo.answer_ids) == "東"


def test_a_generation_stopped_inside_its_first_character_says_so(byte_lm, monkeypatch):
    first_byte = byte_lm.tokenizer("🍰", add_special_tokens=False)["input_ids"][:1]
    monkeypatch.setattr(attribute, "greedy", lambda *a, **k: list(first_byte))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(InputError, match="stops inside its first character"):
            byte_lm.attribute_context(CONTEXT, QUERY, methods=["rawatt"], chat=False)


def test_per_token_rows_carry_their_tokens_spans(byte_lm):
    r = byte_lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["rawatt"], chat=False, per_token=True)
    d = json.loads(r.to_json())
    spans = d["token_rows"]["spans"]
    assert len(spans) == len(d["token_rows"]["steps"]) == len(r.answer_tokens)
    assert "".join(r.answer[a:b] for a, b in spans) == r.answer


def test_the_outside_share_counts_the_answers_tokens_before_the_span(byte_lm):
    answer = " Paris is nice ok"
    span = (10, 14)  # " nice"
    r = byte_lm.attribute_context(CONTEXT, QUERY, answer=answer, methods=["inputxgradient"], chat=False,
                                  answer_span=span)
    job = prepare_job(byte_lm.runner, CONTEXT, QUERY, answer=answer, chat=False, answer_span=span)
    assert job.prefix_ids  # the answer's tokens before the span stay in the input
    exp = byte_lm.explain_answer(job.prompt.ids + job.prefix_ids, job.answer_ids, methods=["inputxgradient"],
                                 target_kind="loss")
    scores = np.abs(np.asarray(exp.scores["inputxgradient"], dtype=np.float64))
    n = len(job.prompt.ids)
    inside = np.asarray(job.token_source) >= 0
    want = 1.0 - scores[:n][inside].sum() / scores[: n + len(job.prefix_ids)].sum()
    assert r.meta["outside_share"]["inputxgradient"] == pytest.approx(want, rel=1e-6)
    assert scores[n:n + len(job.prefix_ids)].sum() > 0


def test_source_methods_alone_report_the_answers_logprob(byte_lm):
    with_loo = byte_lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["loo"], chat=False)
    alone = byte_lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["contextcite"], chat=False,
                                      options={"contextcite": {"n_ablations": 4}})
    assert alone.meta["answer_logprob"] == pytest.approx(with_loo.meta["answer_logprob"], rel=1e-6)


@pytest.mark.parametrize(("text", "sentences"), [
    ("He said no.?! Then he left.", ["He said no.?!", "Then he left."]),
    ("Really?!. Yes.", ["Really?!.", "Yes."]),
    ('He said "stop." Then he left.', ['He said "stop."', "Then he left."]),
    ('First one. "Quoted one." Next one.', ["First one.", '"Quoted one."', "Next one."]),
])
def test_sentences_keep_the_closing_punctuation_written_after_them(text, sentences):
    assert [s.text for s in split_sources(text, "sentence")] == sentences


def test_a_source_without_tokens_of_its_own_is_warned_about(byte_lm):
    # "a" inside "cake": the word's token starts at its "c", outside every source here
    sources = [(0, 3), (5, 6), (9, 19)]
    with pytest.warns(UserWarning, match=r"source 1 \(5, 6\) hold no token of their own"):
        r = byte_lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, sources=sources, methods=["rawatt", "loo"],
                                      chat=False)
    assert r.scores["rawatt"][1] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        byte_lm.attribute_context(CONTEXT, QUERY, answer=ANSWER, methods=["rawatt"], chat=False)


def test_special_token_text_in_the_context_is_warned_about():
    model = build_tiny("gpt2", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, task="causal-lm")
    ex = Explainer(model, make_tokenizer())
    with pytest.warns(UserWarning, match=r"special tokens \(\[SEP\]\)"):
        ex.attribute_context("the movie [SEP] was great .", "was it good ?", answer="it was", methods=["rawatt"],
                             chat=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex.attribute_context("the movie was great .", "was it good ?", answer="it was", methods=["rawatt"],
                             chat=False)


def test_prompt_offsets_give_a_split_character_to_the_token_that_completes_it_as_generated_offsets_do(byte_lm):
    text = "🍰 東京 ok"
    g = byte_lm.explain_generation(text, methods=["rawatt"], target=text, chat=False)
    assert g.text == text
    prompt = [(a, b) for a, b in g.prompt_offsets]  # no special tokens: every token has a span
    assert prompt == [tuple(o) for o in g.generated_offsets]
    assert "".join(_spelled(text, prompt)) == text and prompt[:4] == [(0, 0), (0, 0), (0, 0), (0, 1)]


def test_a_generated_answer_tokenized_otherwise_as_text_warns_and_its_ids_explain_it_again(byte_lm, monkeypatch):
    tokenizer = byte_lm.tokenizer
    split = tokenizer.convert_tokens_to_ids(["Ġ", "i", "s"])  # " is", one token when read as text
    assert tokenizer(" is", add_special_tokens=False)["input_ids"] != split
    monkeypatch.setattr(attribute, "greedy", lambda *a, **k: list(split))
    with pytest.warns(UserWarning, match="is tokenized otherwise when its text is read again"):
        generated = byte_lm.attribute_context(CONTEXT, QUERY, methods=["loo"], chat=False)
    assert generated.answer == " is" and generated.meta["answer_ids"] == split
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = byte_lm.attribute_context(CONTEXT, QUERY, answer=generated.meta["answer_ids"], methods=["loo"],
                                          chat=False)
        as_text = byte_lm.attribute_context(CONTEXT, QUERY, answer=" is", methods=["loo"], chat=False)
    assert again.answer == " is" and again.meta["generated"] is False
    assert again.meta["answer_logprob"] == pytest.approx(generated.meta["answer_logprob"], rel=1e-6)
    np.testing.assert_allclose(again.scores["loo"], generated.scores["loo"], rtol=1e-5, atol=1e-6)
    assert as_text.meta["answer_ids"] != split
    assert as_text.meta["answer_logprob"] != pytest.approx(generated.meta["answer_logprob"], rel=1e-3)
    with pytest.raises(InputError, match="answer must be text or a non-empty list of token ids"):
        byte_lm.attribute_context(CONTEXT, QUERY, answer=[10**9], methods=["loo"], chat=False)
