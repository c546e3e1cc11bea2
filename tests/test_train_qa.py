"""attnlens train --dataset squad: window labels, span search, SQuAD's EM/F1, the article split, a short run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import CLS, DATA, PAD, SEP, V, make_model, make_tokenizer, needs
from transformers import AutoModelForQuestionAnswering

from attnlens import Explainer, InputError
from attnlens.cli import main
from attnlens.data import Example, load_dataset, squad_articles
from attnlens.evaluation.squad import exact_match, normalize_answer, span_f1, squad_scores
from attnlens.testing.tiny_models import build_tiny
from attnlens.train_qa import answer_tokens, best_span, load_qa_split, make_windows

needs_squad = needs((DATA / "squad_v1.1").is_dir(), "needs ../shared/data/squad_v1.1")

CONTEXT = ("the movie was really boring and the plot was dull but the actors were never bad , "
           "the story is charming and i loved it . this film is the best")


def qa_example(answer: str, question: str = "is the film good ?") -> Example:
    start = CONTEXT.index(answer)
    return Example("q", [question, CONTEXT], None, [{"text": answer, "answer_start": start}])


def test_answer_tokens_by_hand():
    #  tokens: [CLS] q [SEP] "the"(0,3) "movie"(4,9) "was"(10,13) [SEP]
    offsets = [None, None, None, (0, 3), (4, 9), (10, 13), None]
    assert answer_tokens(offsets, 4, 9, 0) == (4, 4)
    assert answer_tokens(offsets, 0, 13, 0) == (3, 5)
    assert answer_tokens(offsets, 6, 12, 0) == (4, 5)  # inside tokens: the tokens that hold those characters
    assert answer_tokens(offsets, 10, 20, 0) == (0, 0)  # runs past the window: CLS
    assert answer_tokens([None, None], 0, 3, 0) == (0, 0)


@pytest.mark.parametrize("answer", ["really boring", "charming", "the best", "the movie"])
def test_window_labels_point_at_the_gold_characters(answer):
    tok = make_tokenizer()
    ex = qa_example(answer)
    start = CONTEXT.index(answer)
    windows = make_windows(tok, [ex], max_length=16, doc_stride=4)
    assert len(windows.features) > 3  # the context is cut into several windows
    holding = 0
    for feat, offsets, s, e in zip(windows.features, windows.offsets, windows.starts, windows.ends, strict=True):
        ids = feat["input_ids"]
        assert len(ids) <= 16 and ids[0] == CLS
        spans = [o for o in offsets if o is not None]
        inside = spans[0][0] <= start and spans[-1][1] >= start + len(answer)
        if inside:
            holding += 1
            assert 0 < s <= e
            assert CONTEXT[offsets[s][0] : offsets[e][1]] == answer
        else:
            assert (s, e) == (0, 0)  # the CLS token
    assert holding >= 1 and holding < len(windows.features)


def test_a_window_too_short_for_its_stride_after_the_question_is_refused_in_one_line():
    tok = make_tokenizer()
    example = qa_example("charming")
    n_question = len(tok(example.text[0], add_special_tokens=False)["input_ids"])
    room = 16 - n_question - 3  # [CLS] question [SEP] context [SEP]
    make_windows(tok, [example], max_length=16, doc_stride=room - 1)
    with pytest.raises(InputError, match=rf"^with --max-length 16, a window leaves {room} tokens of context after the "
                                         rf"longest question \({n_question} tokens\).*more than --doc-stride {room} "):
        make_windows(tok, [example], max_length=16, doc_stride=room)


def test_windows_share_doc_stride_tokens_and_cover_the_context():
    tok = make_tokenizer()
    windows = make_windows(tok, [qa_example("charming")], max_length=16, doc_stride=4)
    context_spans = [[o for o in offs if o is not None] for offs in windows.offsets]
    for a, b in zip(context_spans, context_spans[1:], strict=False):
        assert a[-4:] == b[:4]  # consecutive windows overlap by doc_stride tokens
    assert context_spans[0][0][0] == 0 and context_spans[-1][-1][1] == len(CONTEXT)


def test_best_span_is_the_best_allowed_one():
    offsets = [None, None, (0, 3), (4, 9), (10, 13), (14, 20), None]
    start = np.array([9.0, 0, 1, 5, 0, 2, 9])
    end = np.array([9.0, 0, 0, 1, 4, 3, 9])
    # special tokens (CLS, SEP) are never chosen; best is start 3, end 4 (5 + 4)
    assert best_span(start, end, offsets) == (9.0, 3, 4)
    assert best_span(start, end, offsets, max_answer_tokens=1) == (6.0, 3, 3)  # 5 + 1 (one token)
    end2 = np.array([0, 0, 0, 0, 0, 0, 0.0])
    end2[2] = 10  # an end before the best start is not a span
    assert best_span(start, end2, offsets) == (11.0, 2, 2)
    assert best_span(start, end, [None] * 7) is None


def test_squad_normalisation_exact_match_and_f1_by_hand():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert exact_match("the Eiffel Tower.", "Eiffel tower") == 1.0
    assert exact_match("Eiffel", "Eiffel Tower") == 0.0
    assert span_f1("in Paris France", "Paris") == pytest.approx(0.5)  # precision 1/3, recall 1
    assert span_f1("Denver Broncos", "the Broncos of Denver") == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))
    assert span_f1("", "Paris") == 0.0
    scores = squad_scores(["Paris", "in Paris France", "Lyon"], [["Paris"], ["London", "Paris"], ["Nice"]])
    assert scores == {"exact_match": round(1 / 3, 4), "f1": round((1 + 0.5 + 0) / 3, 4), "n": 3}


@needs_squad
def test_the_split_is_by_article_parity():
    articles = squad_articles()
    fit, held = load_qa_split("fit"), load_qa_split("eval")
    assert set(fit.article) == set(range(0, len(articles), 2))
    assert set(held.article) == set(range(1, len(articles), 2))
    for split in (fit, held):
        for ex, position in zip(split.examples, split.article, strict=True):
            contexts = {p["context"] for p in articles[position]["paragraphs"]}
            assert ex.text[1] in contexts
    assert {e.id for e in fit.examples}.isdisjoint(e.id for e in held.examples)
    assert len(fit.examples) + len(held.examples) == len(load_dataset("squad"))
    # the benchmark's --split eval holds the same questions, in the same order
    assert [e.id for e in load_dataset("squad", "eval")] == [e.id for e in held.examples]
    assert [e.id for e in load_dataset("squad", "fit")] == [e.id for e in fit.examples]
    limited = load_qa_split("eval", limit=7, seed=3)
    assert len(limited.examples) == 7 and set(limited.article) <= set(held.article)
    assert limited.articles_used()["positions"] == sorted(set(limited.article))


@pytest.fixture
def tiny_qa(tmp_path) -> str:
    path = tmp_path / "tiny-qa"
    build_tiny("bert", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
               model_suffix="ForQuestionAnswering").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


@needs_squad
def test_two_steps_on_real_squad_write_a_qa_model_explainer_loads(tmp_path, tiny_qa):
    fit = load_qa_split("fit", limit=8, seed=0)
    windows = make_windows(make_tokenizer(), fit.examples, max_length=48, doc_stride=16)
    batch = math.ceil(len(windows.features) / 2)  # two steps make one epoch
    out = tmp_path / "out"
    argv = ["train", "--model", tiny_qa, "--dataset", "squad", "--limit", "8", "--eval-limit", "6",
            "--max-length", "48", "--doc-stride", "16", "--batch-size", str(batch), "--lr", "1e-2",
            "--out", str(out), "--quiet"]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["train_examples"] == 8
    assert metrics["train_windows"] == len(windows.features) and metrics["max_len"] == 48
    assert metrics["eval"]["n"] == 6 and 0 <= metrics["eval"]["exact_match"] <= metrics["eval"]["f1"] <= 1
    used = metrics["articles"]
    assert used["train"]["positions"] == sorted(set(fit.article))
    assert all(p % 2 == 0 for p in used["train"]["positions"]) and all(p % 2 == 1 for p in used["eval"]["positions"])
    titles = [a["title"] for a in squad_articles()]
    assert used["eval"]["titles"] == [titles[p] for p in used["eval"]["positions"]]

    before = AutoModelForQuestionAnswering.from_pretrained(tiny_qa).state_dict()
    after = AutoModelForQuestionAnswering.from_pretrained(out).state_dict()
    assert not torch.equal(before["qa_outputs.weight"], after["qa_outputs.weight"])  # it trained
    explainer = Explainer.from_pretrained(str(out))
    assert type(explainer.model).__name__ == "BertForQuestionAnswering" and explainer.head.task == "qa"


@needs_squad
def test_the_default_window_is_cut_to_a_model_that_takes_fewer_tokens(tmp_path, tiny_qa):
    out = tmp_path / "o"
    argv = ["train", "--model", tiny_qa, "--dataset", "squad", "--limit", "2", "--eval-limit", "2", "--out", str(out),
            "--quiet"]
    assert main(argv) == 0  # a 64-position model: windows of 64 tokens sharing 21 (a third), not 384 and 128
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["max_len"] == 64 and metrics["doc_stride"] == 21


@needs_squad
def test_another_tasks_head_needs_reinit_head(tmp_path, capsys):
    classifier = tmp_path / "clf"
    make_model("bert").save_pretrained(classifier)
    make_tokenizer().save_pretrained(classifier)
    capsys.readouterr()
    argv = ["train", "--model", str(classifier), "--dataset", "squad", "--limit", "2", "--eval-limit", "2",
            "--max-length", "48", "--doc-stride", "16", "--out", str(tmp_path / "o"), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "BertForSequenceClassification" in err and "--reinit-head" in err
    assert not (tmp_path / "o").exists()
    assert main([*argv, "--reinit-head"]) == 0
    said = capsys.readouterr()
    assert said.out == "" and said.err == ""  # --quiet: not even the notice that the head is replaced
    assert Explainer.from_pretrained(str(tmp_path / "o")).head.task == "qa"


@pytest.mark.parametrize("extra, message", [
    (["--split", "dev"], "--split: --dataset squad trains on the articles at even positions"),
    (["--eval-file", "x.jsonl"], "--eval-file"),
    (["--eval-fraction", "0.5"], "--eval-fraction: --dataset squad trains on the articles at even positions"),
    (["--max-length", "48", "--doc-stride", "48"], "--doc-stride 48 must be less than --max-length 48"),
    (["--doc-stride", "0"], "--doc-stride must be >= 1"),
    (["--max-length", "24", "--doc-stride", "8", "--limit", "40"],  # questions too long for such windows
     "a window leaves"),
])
def test_cli_errors_are_one_line(tmp_path, tiny_qa, capsys, extra, message):
    argv = ["train", "--model", tiny_qa, "--dataset", "squad", "--out", str(tmp_path / "o"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlens: error:") and "\n" not in err and message in err


@pytest.mark.parametrize("name, value", [("split", "dev"), ("eval_split", "train"), ("eval_file", "x.jsonl"),
                                         ("text_field", "t"), ("text_pair_field", "u"), ("label_field", "y"),
                                         ("eval_fraction", 0.5)])
def test_every_classification_option_away_from_its_default_is_refused_by_the_python_api(tmp_path, tiny_qa,
                                                                                     name, value):
    from dataclasses import replace

    from attnlens.train import TrainConfig
    from attnlens.train_qa import train_qa

    config = TrainConfig(model=tiny_qa, out=str(tmp_path / "o"), dataset="squad")
    with pytest.raises(InputError, match=f"^--{name.replace('_', '-')}: --dataset squad trains on"):
        train_qa(replace(config, **{name: value}))
    assert not (tmp_path / "o").exists()


def test_squad_v2_and_squad_files_are_refused(tmp_path, tiny_qa, capsys):
    assert main(["train", "--model", tiny_qa, "--dataset", "squad_v2", "--out", str(tmp_path / "o")]) == 2
    assert "squad (SQuAD v1.1) only" in capsys.readouterr().err
    doc = tmp_path / "mini.json"
    doc.write_text(json.dumps({"data": [{"paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "1", "question": "Where is Paris?", "answers": [{"text": "France", "answer_start": 12}]}]}]}]}))
    assert main(["train", "--model", tiny_qa, "--data-file", str(doc), "--out", str(tmp_path / "o")]) == 2
    assert "--dataset squad" in capsys.readouterr().err


@needs_squad
def test_max_length_beyond_the_models_positions(tmp_path, tiny_qa, capsys):
    argv = ["train", "--model", tiny_qa, "--dataset", "squad", "--limit", "2", "--eval-limit", "2",
            "--out", str(tmp_path / "o"), "--max-length", "384"]
    assert main(argv) == 2  # the tiny model has 64 positions
    assert "--max-length 384 is more than the 64 positions" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
