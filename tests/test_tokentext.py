"""Byte-level BPE tokens are shown as the text they spell (``ĠcafÃ©`` reads ``café``), never guessed."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from attnlens import Explainer, Explanation
from attnlens.results.tokentext import (
    BYTE_LEVEL,
    SENTENCEPIECE,
    WORDPIECE,
    byte_spans,
    decode_byte_level,
    readable,
    readable_tokens,
    token_encoding,
    token_text,
    token_texts,
)
from attnlens.testing.tiny_models import build_tiny
from attnlens.viz.colors import shown_tokens
from attnlens.viz.generation import generation_html, render_generation
from attnlens.viz.terminal import render_terminal

TEXT = "The café's naïve charm 🙂\nends"


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE trained here on a few sentences (offline); "é" and "ï" stay two byte tokens."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["The cafe charm ends here", "the naive charm of the cafe"] * 5, vocab_size=300,
                            min_frequency=1, special_tokens=["<pad>", "<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, pad_token="<pad>", eos_token="<eos>")


def test_the_alphabet_is_gpt2s():
    # an independent copy of the table (transformers' own) decodes every byte back
    for b, c in bytes_to_unicode().items():
        assert decode_byte_level(c).encode("utf-8", errors="backslashreplace") in (bytes([b]), f"\\x{b:02x}".encode())


@pytest.mark.parametrize(("token", "shown"), [
    ("Ġcapital", "capital"),
    ("ĠcafÃ©", "café"),
    ("Ã¯ve", "ïve"),
    ("Ċ", "\n"),
    ("Ġ", "␣"),
    ("ĠĠ", "␣␣"),
    ("ðŁ", "\\xf0\\x9f"),  # the first two bytes of an emoji split over tokens: escaped, not dropped
    ("ĠThe", "The"),
    ("▁the", "▁the"),  # not in the alphabet: left as it is
])
def test_readable_byte_level_tokens(token, shown):
    assert readable(token, BYTE_LEVEL) == shown
    assert readable(token, None) == token  # other tokenizers' tokens are shown as they are


@pytest.mark.parametrize(("token", "shown"), [
    ("▁the", "the"),
    ("ing", "ing"),
    ("▁", "␣"),
    ("<0x0A>", "\n"),
    ("<0xC3><0xA9>", "é"),  # a word's byte tokens joined (to_words without offsets)
    ("<0xC3>", "\\xc3"),
    ("Ġthe", "Ġthe"),
])
def test_readable_sentencepiece_tokens(token, shown):
    assert readable(token, SENTENCEPIECE) == shown


@pytest.fixture(scope="module")
def sp_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (``▁`` marks a word's start) trained here on a few sentences."""
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(["the cafe charm ends here", "the naive charm of the cafe"] * 5, vocab_size=120,
                           min_frequency=1, special_tokens=["<pad>", "<eos>", "<unk>"])
    return PreTrainedTokenizerFast(tokenizer_object=sp._tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def test_the_tokenizer_says_how_it_spells(byte_tokenizer, sp_tokenizer, tokenizer):
    assert token_encoding(byte_tokenizer) == BYTE_LEVEL
    assert token_encoding(sp_tokenizer) == SENTENCEPIECE
    assert token_encoding(tokenizer) == WORDPIECE


def test_sentencepiece_explanations_show_words_without_marks(sp_tokenizer):
    model = build_tiny("llama", vocab_size=len(sp_tokenizer), pad_token_id=sp_tokenizer.pad_token_id,
                       bos_token_id=sp_tokenizer.eos_token_id, eos_token_id=sp_tokenizer.eos_token_id,
                       task="causal-lm")
    exp = Explainer(model, sp_tokenizer).explain("the naive charm", methods="rawatt")[0]
    assert exp.meta["token_encoding"] == SENTENCEPIECE and any(t.startswith("▁") for t in exp.tokens)
    shown = render_terminal(exp, color=False)
    assert "▁" not in shown and "naive" in shown


@pytest.fixture(scope="module")
def lm_explainer(byte_tokenizer) -> Explainer:
    model = build_tiny("gpt2", vocab_size=len(byte_tokenizer), pad_token_id=byte_tokenizer.pad_token_id,
                       bos_token_id=byte_tokenizer.eos_token_id, eos_token_id=byte_tokenizer.eos_token_id,
                       task="causal-lm")
    return Explainer(model, byte_tokenizer)


def test_an_explanation_keeps_its_tokens_and_shows_their_text(lm_explainer, tmp_path):
    exp = lm_explainer.explain(TEXT, methods="rawatt,saliency")[0]
    assert exp.meta["token_encoding"] == BYTE_LEVEL
    assert "Ã" in "".join(exp.tokens)  # the contract keeps the tokenizer's tokens
    shown = render_terminal(exp, color=False)
    assert "café" in shown or ("caf" in shown and "é" in shown)
    assert "Ã" not in shown and "Ġ" not in shown and "Ċ" not in shown
    page = exp.to_html()
    assert "Ã" not in page and "Ġ" not in page
    words = exp.to_words()
    assert {"café", "naïve", "🙂"} <= set(words.tokens) and "token_encoding" not in words.meta
    assert "naïve" in render_terminal(words, color=False)
    no_offsets = dataclasses.replace(exp, offsets=None).to_words()  # words spelled from their tokens' bytes
    assert {"café", "naïve", "🙂"} <= set(no_offsets.tokens)
    exp.save(tmp_path / "e.json")
    again = Explanation.load(tmp_path / "e.json")
    assert again.meta["token_encoding"] == BYTE_LEVEL and again.tokens == exp.tokens
    assert json.loads((tmp_path / "e.json").read_text())["tokens"] == exp.tokens


def test_views_and_top_k_show_a_character_split_over_tokens_whole(lm_explainer):
    exp = lm_explainer.explain("naïve 日本 🙂", methods="rawatt,saliency")[0]
    # the vocabulary lacks these characters: one token alone spells some of their bytes only
    assert any("\\x" in readable(t, BYTE_LEVEL) for t in exp.tokens)
    shown = render_terminal(exp, color=False)
    for view in (shown, exp.to_html()):
        assert "\\x" not in view
        assert "日" in view and "本" in view and "🙂" in view
    ranked = [t for t, _ in exp.top_k("saliency", len(exp.tokens))]
    assert not any("\\x" in t for t in ranked)
    assert {"日", "本", "🙂"} <= set(ranked)
    assert "".join(exp.token_text) == "naïve 日本 🙂"  # the JSON's texts still put the input together


def test_a_generation_shows_the_text_of_its_tokens(lm_explainer):
    g = lm_explainer.explain_generation(TEXT, max_new_tokens=2, methods="rawatt")
    assert g.meta["token_encoding"] == BYTE_LEVEL
    for shown in (render_generation(g, color=False), generation_html(g)):
        assert "Ã" not in shown and "Ġ" not in shown


def test_wordpiece_explanations_show_their_tokens_as_they_are(tokenizer):
    model = build_tiny("bert", vocab_size=tokenizer.vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    exp = Explainer(model, tokenizer).explain("the cat", methods="rawatt")[0]
    assert exp.meta["token_encoding"] == WORDPIECE and shown_tokens(exp) == exp.tokens


def test_a_wordpiece_generation_spaces_its_words_whether_or_not_a_piece_continues_one(tokenizer):
    """A WordPiece language model's continuation reads as words (``" very good film"``), its character offsets
    and ``tokens_in`` the same whichever tokens come later (they were joined without spaces unless some token
    was a ``##`` piece)."""
    model = build_tiny("bart", vocab_size=tokenizer.vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       task="seq2seq-lm")
    ex = Explainer(model, tokenizer)
    plain = ex.explain_generation("the movie was", methods=["rawatt"], target=" very good film")
    pieced = ex.explain_generation("the movie was", methods=["rawatt"], target=" very good films")
    assert plain.generated_tokens == ["very", "good", "film"] and pieced.generated_tokens[-1] == "##s"
    assert plain.text == " very good film" and pieced.text == " very good films"
    # each word's span is its own characters, not the space put before it
    assert plain.generated_offsets == pieced.generated_offsets[:3] == [(1, 5), (6, 10), (11, 15)]
    assert pieced.generated_offsets[3] == (15, 16) and pieced.text[15:16] == "s"
    assert plain.tokens_in(6, 10) == pieced.tokens_in(6, 10) == [1] and plain.tokens_in(5, 6) == []


def test_the_json_gives_each_token_its_text_and_top_k_speaks_text(lm_explainer, byte_tokenizer):
    exp = lm_explainer.explain(TEXT, methods="rawatt,saliency")[0]
    d = json.loads(json.dumps(exp.to_dict()))
    assert d["tokens"] == exp.tokens and len(d["token_text"]) == len(d["tokens"])
    # the tokens' texts put together are the input (the tokenizer's decoder, independently: the same)
    assert "".join(d["token_text"]) == TEXT == byte_tokenizer.decode(exp.input_ids)
    assert "" in d["token_text"]  # the emoji's bytes span tokens: the token that completes it holds it whole
    assert " charm" in d["token_text"] and "\n" in d["token_text"]
    for tok, _ in exp.top_k("saliency", len(exp.tokens)):
        assert not {"Ġ", "Ã", "Ċ"} & set(tok)
    assert {t for t, _ in exp.top_k("saliency", len(exp.tokens))} >= {"charm", "\n"}
    assert Explanation.from_dict(d) == exp  # the text is derived, not a second source of truth


def test_a_generations_json_gives_its_tokens_text(lm_explainer, byte_tokenizer):
    g = lm_explainer.explain_generation(TEXT, target=" the naïve café", methods="rawatt")
    d = json.loads(json.dumps(g.to_dict()))
    assert "".join(d["prompt_token_text"]) == TEXT
    assert "".join(d["generated_token_text"]) == " the naïve café" == byte_tokenizer.decode(g.generated_ids)
    assert len(d["prompt_token_text"]) == len(d["prompt_tokens"])
    assert len(d["generated_token_text"]) == len(d["generated_tokens"])


def test_a_generations_text_and_offsets_are_the_continuation_when_characters_span_tokens(lm_explainer,
                                                                                        byte_tokenizer):
    target = " the naïve café 🙂"  # "ï", "é" and the emoji are several byte tokens each
    g = lm_explainer.explain_generation(TEXT, target=target, methods="rawatt")
    assert "\ufffd" in "".join(g.generated)  # each token decoded alone cannot spell them
    assert g.text == target == byte_tokenizer.decode(g.generated_ids)
    assert [g.text[a:b] for a, b in g.generated_offsets] == g.to_dict()["generated_token_text"]
    start = target.index("café")
    steps = g.tokens_in(start, start + len("café"))
    assert byte_tokenizer.decode([g.generated_ids[t] for t in steps]).strip() == "café"
    emoji = g.tokens_in(len(target) - 1, len(target))
    assert byte_tokenizer.decode([g.generated_ids[t] for t in emoji]) == "🙂"  # every token of its bytes
    assert len(emoji) > 1 and g.generated_offsets[emoji[0]][0] == g.generated_offsets[emoji[0]][1]
    assert "\ufffd" not in render_generation(g, color=False).split("\n")[0]


@pytest.mark.parametrize(("encoding", "token", "text"), [
    (BYTE_LEVEL, "ĠParis", " Paris"), (BYTE_LEVEL, "ĊĊ", "\n\n"), (BYTE_LEVEL, "ĠcafÃ©", " café"),
    (SENTENCEPIECE, "▁Paris", " Paris"), (SENTENCEPIECE, "<0x0A>", "\n"), (None, "##ing", "##ing"),
])
def test_token_text_keeps_the_spaces_that_display_drops(encoding, token, text):
    assert token_text(token, encoding) == text


def test_a_generation_steps_words_are_what_whitespace_separates(lm_explainer):
    """A generation's tokens have no tokenizer alignment: its steps' words are read from the text the tokens spell,
    so the words are the prompt's whitespace-separated words, and their scores sum their tokens'."""
    g = lm_explainer.explain_generation(TEXT, target=" the end", methods="rawatt")
    step = g.step(len(g.generated_ids) - 1)
    words = step.to_words()
    spelled = "".join(step.token_text)
    assert spelled.startswith(TEXT + " the") and len(step.tokens) == len(g.prompt_ids) + len(g.generated_ids) - 1
    assert words.tokens == spelled.split()
    assert len(words.tokens) < len(step.tokens)  # "café's" and the emoji's byte tokens are one word each
    np.testing.assert_allclose(words.scores["rawatt"].sum(), step.scores["rawatt"].sum())


@pytest.fixture(scope="module")
def llama_tokenizer():
    """transformers 5's LlamaTokenizer (a Metaspace pre-tokenizer that does not split, ``▁`` prepended to the
    start of a text) over a byte-fallback BPE trained here."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(byte_fallback=True))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    bpe.train_from_iterator(["the capital of France is Paris", "a charming cafe"] * 10,
                            trainers.BpeTrainer(vocab_size=320, special_tokens=specials))
    spec = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tokenizer = transformers.LlamaTokenizer(vocab=spec["vocab"], merges=merges)
    tokenizer.pad_token = "<unk>"
    return tokenizer


def test_a_continuation_is_tokenized_as_it_follows_the_prompt(llama_tokenizer, byte_tokenizer):
    """A SentencePiece tokenizer marks the start of a text as a word start: ``"Paris"`` alone reads ``"▁Paris"``
    (``" Paris"``). A forced continuation, a contrast and a cited answer are read as they continue the prompt:
    glued to it unless they begin with a space."""
    from attnlens.core.encoding import continuation_encoding

    tok = llama_tokenizer
    prompt = tok("the capital of France is", add_special_tokens=False)["input_ids"]
    glued, spaced = continuation_encoding(tok, "Paris")[0], continuation_encoding(tok, " Paris")[0]
    assert not tok.convert_ids_to_tokens(glued)[0].startswith("▁")
    assert tok.convert_ids_to_tokens(spaced)[0].startswith("▁")
    assert tok.decode(prompt + glued).endswith("isParis") and tok.decode(prompt + spaced).endswith("is Paris")
    assert continuation_encoding(byte_tokenizer, "Paris")[0] == byte_tokenizer("Paris")["input_ids"]
    model = build_tiny("llama", vocab_size=len(tok), pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       task="causal-lm")
    ex = Explainer(model, tok)
    for target in ("Paris", " Paris"):
        g = ex.explain_generation("the capital of France is", target=target, methods="rawatt")
        assert g.text == target


@pytest.mark.parametrize("given", ["ids", "generated"])
def test_a_cited_answer_keeps_the_leading_space_its_first_token_spells(llama_tokenizer, given, monkeypatch):
    """Decoded alone, a SentencePiece tokenizer drops the leading space of a text's first word (``▁Par`` reads
    ``Par``); a cited answer given as token ids, or generated, reads as it continues the prompt: its text is
    exactly the continuation explained, and giving that text back explains the same tokens."""
    from attnlens.sources import attribute

    tok = llama_tokenizer
    model = build_tiny("llama", vocab_size=len(tok), pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       task="causal-lm")
    ex = Explainer(model, tok)
    from attnlens.core.encoding import continuation_encoding

    ids = continuation_encoding(tok, " Paris is")[0]
    assert tok.convert_ids_to_tokens(ids)[0].startswith("▁") and not tok.decode(ids).startswith(" ")
    context, query = "the capital of France is Paris. a charming cafe", "the capital of France?"
    if given == "generated":
        monkeypatch.setattr(attribute, "greedy", lambda runner, prompt, n: list(ids))
    r = ex.attribute_context(context, query, answer=ids if given == "ids" else None, methods=["loo"], chat=False)
    assert r.answer == " Paris is" and r.answer_tokens[0].startswith(" ") and "".join(r.answer_tokens) == r.answer
    assert r.answer_offsets[0][0] == 0 and r.answer_offsets[-1][1] == len(r.answer) and r.meta["answer_ids"] == ids
    assert tok.decode(tok(r.prompt)["input_ids"] + ids).endswith(r.prompt[-10:] + r.answer)
    again = ex.attribute_context(context, query, answer=r.answer, methods=["loo"], chat=False)
    assert again.meta["answer_ids"] == ids and again.meta["answer_logprob"] == pytest.approx(r.meta["answer_logprob"])


def test_words_of_a_tokenizer_whose_word_ids_run_on_are_what_whitespace_separates(llama_tokenizer):
    """transformers 5's Llama (and Gemma) tokenizers do not pre-split on spaces: every token gets word id 0, so the
    words are read from the whitespace between the tokens' spans; the word scores sum their tokens'."""
    tokenizer = llama_tokenizer
    text = "the capital of France is Paris, a charming cafe"
    assert set(tokenizer(text).word_ids()) - {None} == {0}  # the tokenizer's word ids run on
    model = build_tiny("llama", vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    (exp,) = Explainer(model, tokenizer).explain(text, methods="rawatt")
    words = exp.to_words()
    assert [w for w, s in zip(words.tokens, words.special, strict=True) if not s] == text.split()
    np.testing.assert_allclose(words.scores["rawatt"].sum(), exp.scores["rawatt"].sum())
    real = [i for i, s in zip(words.word_ids, words.special, strict=True) if not s]
    assert real == list(range(len(real)))  # one index per word


@pytest.mark.parametrize(("tokens", "texts"), [
    (["Ġ", "ðŁ", "į", "°", "Ġb"], [" ", "", "", "🍰", " b"]),  # whole, to the token completing it
    (["a", "ðŁ", "ĩ", "</s>"], ["a", "\\xf0\\x9f", "\\x87", "</s>"]),  # cut off: each byte on its own token
    (["ðŁ", "Ġb"], ["\\xf0\\x9f", " b"]),
    (["Ã", "©", "Ã"], ["", "é", "\\xc3"]),
])
def test_bytes_that_never_complete_a_character_stay_on_their_tokens(tokens, texts):
    assert token_texts(tokens, {"token_encoding": BYTE_LEVEL}) == texts


def test_a_generations_step_labels_show_the_characters_their_tokens_spell(lm_explainer):
    """Decoded alone, each token of an emoji's bytes reads U+FFFD; the steps' labels (views, ``target_token``)
    show the character on each of them."""
    g = lm_explainer.explain_generation(TEXT, target=" ok 🙂", methods="rawatt")
    emoji = g.tokens_in(len(g.text) - 1, len(g.text))
    assert len(emoji) > 1 and all("\ufffd" in g.generated[t] for t in emoji[:-1])
    assert [g.step_labels[t] for t in emoji] == ["🙂"] * len(emoji)
    assert g.step(emoji[0]).meta["target_token"] == "🙂"
    shown = render_generation(g, color=False)
    assert "\ufffd" not in shown and f"{emoji[0]}: '🙂'" in shown
    assert "\ufffd" not in generation_html(g)


def test_byte_spans_cover_every_character_a_token_takes_bytes_of():
    meta = {"token_encoding": BYTE_LEVEL}
    tokens = ["ĠðŁ", "ĩ", "«", "ðŁ", "ĩ", "·", "!"]  # " 🇫🇷!" with the space and 🇫's first bytes in one token
    assert token_texts(tokens, meta) == [" ", "", "🇫", "", "", "🇷", "!"]
    assert byte_spans(tokens, meta) == [(0, 2), (1, 2), (1, 2), (2, 3), (2, 3), (2, 3), (3, 4)]
    assert byte_spans(["a", "##b"], {}) is None


def test_tokens_in_a_character_include_the_token_holding_its_first_bytes_beside_other_text():
    from attnlens import Generation

    tokens = ["ĠðŁ", "ĩ", "«", "ðŁ", "ĩ", "·", "!"]  # " 🇫🇷!": the space and 🇫's first bytes in one token
    g = Generation(prompt="x", prompt_tokens=["x"], prompt_ids=[0], prompt_special=[False], generated_tokens=tokens,
                   generated_ids=list(range(1, 8)), generated=["\ufffd"] * 7, meta={"token_encoding": BYTE_LEVEL})
    assert g.text == " 🇫🇷!"
    assert g.tokens_in(1, 2) == [0, 1, 2] and g.tokens_in(2, 3) == [3, 4, 5] and g.tokens_in(0, 1) == [0]
    assert g.tokens_in(3, 4) == [6]


def test_words_and_spans_keep_a_decomposed_accent_the_tokenizer_strips():
    """An uncased BERT tokenizer strips accents: a decomposed one (``e`` + U+0301) falls outside every token's
    span, though it belongs to the letter before it."""
    from conftest import make_model, make_tokenizer

    (e,) = Explainer(make_model("bert"), make_tokenizer()).explain("in cafe\u0301 today", methods="rawatt")
    assert e.offsets[2] == (3, 7)  # "cafe" without its accent
    assert e.span_text((2, 2)) == "cafe\u0301" and e.span_text((1, 2)) == "in cafe\u0301"
    words = e.to_words()
    assert [w for w, s in zip(words.tokens, words.special, strict=True) if not s] == ["in", "cafe\u0301", "today"]


def test_tokens_added_as_text_to_a_byte_level_vocabulary_read_as_text(byte_tokenizer, tmp_path):
    """``tokenizer.add_tokens(["naïve"])`` stores the token as text; read in the byte alphabet (where ``ï`` is a
    byte) it would be mojibake."""
    import copy

    tokenizer = copy.deepcopy(byte_tokenizer)
    tokenizer.add_tokens(["naïve", "Ünïcode"])
    model = build_tiny("gpt2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, task="causal-lm")
    (e,) = Explainer(model, tokenizer).explain("the naïve Ünïcode charm", methods="rawatt")
    assert "naïve" in e.tokens and e.meta["text_tokens"] == ["naïve", "Ünïcode"]
    assert "".join(e.token_text) == "the naïve Ünïcode charm"
    assert "naïve" in readable_tokens(e.tokens, e.meta)
    e.save(tmp_path / "e.json")
    back = Explanation.load(tmp_path / "e.json")
    assert back.token_text == e.token_text
    assert "text_tokens" not in e.to_words().meta


def test_a_decomposed_accent_the_pre_tokenizer_splits_off_stays_in_its_word(byte_tokenizer):
    """A byte-level pre-tokenizer splits a combining mark off its letter (``"e"``, ``"\\u0301"``, ``"t\\u00e9"``
    are three of its words); a reader sees one word, its accent once, and the word's score is its tokens' sum."""
    model = build_tiny("gpt2", vocab_size=len(byte_tokenizer), pad_token_id=byte_tokenizer.pad_token_id,
                       bos_token_id=byte_tokenizer.eos_token_id, eos_token_id=byte_tokenizer.eos_token_id,
                       task="causal-lm")
    text = "x e\u0301t\u00e9 y"
    (e,) = Explainer(model, byte_tokenizer).explain(text, methods="rawatt")
    assert len(set(e.word_ids[1:-1])) > 3  # the tokenizer's own words part the accent
    words = e.to_words()
    shown = [w for w, s in zip(words.tokens, words.special, strict=True) if not s]
    assert shown == ["x", "e\u0301t\u00e9", "y"]
    groups = [g for g in e.word_groups() if not e.special[g[0]]]
    assert words.scores["rawatt"][[not s for s in words.special]][1] == pytest.approx(
        float(e.scores["rawatt"][groups[1]].sum()))


def test_the_explorers_attention_answer_spells_each_token_as_the_heatmap_does(byte_tokenizer):
    from attnlens.core.memory import parse_budget
    from attnlens.serve.compute import attention

    model = build_tiny("gpt2", vocab_size=len(byte_tokenizer), pad_token_id=byte_tokenizer.pad_token_id,
                       bos_token_id=byte_tokenizer.eos_token_id, eos_token_id=byte_tokenizer.eos_token_id,
                       task="causal-lm")
    ex = Explainer(model, byte_tokenizer)
    answer = attention(ex, TEXT, parse_budget("1GiB"))
    (e,) = ex.explain(TEXT, methods="rawatt")
    assert answer["token_text"] == e.token_text and "".join(answer["token_text"]) == TEXT


def test_an_encoder_decoders_output_never_joins_the_last_input_word(byte_tokenizer):
    model = build_tiny("bart", vocab_size=len(byte_tokenizer), pad_token_id=byte_tokenizer.pad_token_id,
                       bos_token_id=byte_tokenizer.eos_token_id, eos_token_id=byte_tokenizer.eos_token_id,
                       task="seq2seq-lm")
    g = Explainer(model, byte_tokenizer).explain_generation("the cafe charm", methods=["inputxgradient"],
                                                            target="charming cafe")
    step = g.step(2)
    assert not step.token_text[g.n_prompt][:1].isspace()  # the output's first token has no space before it
    groups = [grp for grp in step.word_groups() if not step.special[grp[0]]]
    assert all(max(grp) < g.n_prompt or min(grp) >= g.n_prompt for grp in groups)  # no word spans both texts
    words = step.to_words()
    assert [w for w, s in zip(words.tokens, words.special, strict=True) if not s][:3] == ["the", "cafe", "charm"]


def test_byte_level_word_offsets_cut_the_word_without_its_space(byte_tokenizer):
    model = build_tiny("gpt2", vocab_size=len(byte_tokenizer), pad_token_id=byte_tokenizer.pad_token_id,
                       bos_token_id=byte_tokenizer.eos_token_id, eos_token_id=byte_tokenizer.eos_token_id,
                       task="causal-lm")
    (e,) = Explainer(model, byte_tokenizer).explain(TEXT, methods="rawatt")
    words = e.to_words()
    for word, (a, b), special in zip(words.tokens, words.offsets, words.special, strict=True):
        if not special:
            assert TEXT[a:b] == word, (word, TEXT[a:b])


def test_a_word_of_a_newline_and_spaces_keeps_its_newline_in_the_word_view():
    """Words read from byte-level tokens (a generation step's have no offsets): a word of whitespace only, one
    token of a newline and the indentation after it (SmolLM2's ``"ĊĠ"``), shows as the token does, ``"\n␣"``,
    not as ``"␣"`` (its newline stripped)."""
    e = Explanation(text="lait:\n  the", tokens=["l", "ait", ":", "ĊĠ", "Ġthe"], special=[False] * 5, target=0,
                    predicted=0, probabilities=[1.0], labels=["x"], scores={"m": np.arange(5.0)},
                    word_ids=[0, 0, 0, 1, 2], meta={"token_encoding": BYTE_LEVEL})
    words = e.to_words()
    assert words.tokens == ["lait:", "\n␣", "the"] and shown_tokens(words)[1:] == shown_tokens(e)[3:]
    np.testing.assert_array_equal(words.scores["m"], [3.0, 3.0, 4.0])


def test_an_unknown_token_a_byte_level_tokenizer_never_writes_for_text_is_special(tokenizer):
    """A byte-level BPE spells any text: its ``unk_token`` (SmolLM2's ``<|endoftext|>``) is a control token and is
    never ranked; a WordPiece ``[UNK]`` stands for a word of the input and is."""
    from attnlens.core.encoding import special_ids

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the cafe charm ends here"] * 5, vocab_size=280, min_frequency=1,
                            special_tokens=["<|endoftext|>", "<eos>"])
    byte_level = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, unk_token="<|endoftext|>", eos_token="<eos>")
    assert byte_level.unk_token_id in special_ids(byte_level)
    assert tokenizer.unk_token_id not in special_ids(tokenizer) and tokenizer.cls_token_id in special_ids(tokenizer)
