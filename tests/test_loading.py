"""Loading: the model the user gave, correctly, or one line saying why not.

Checkpoints without the task head, directories without tokenizer files or config.json, corrupt or empty weights,
``train --out`` on a file, and GPT-2 without ``pad_token_id`` through integrated gradients."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CLS as CLS_ID
from conftest import PAD, V, make_model, make_tokenizer
from conftest import SEP as SEP_ID
from transformers import BertConfig, BertForMaskedLM, BertModel, GPT2Config, GPT2LMHeadModel

from attnlens import Explainer, InputError, ModelError
from attnlens.cli import main

BERT = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
            max_position_embeddings=64)


def save(model: torch.nn.Module, path: Path, tokenizer: bool = True) -> str:
    model.save_pretrained(path)
    if tokenizer:
        make_tokenizer().save_pretrained(path)
    return str(path)


def cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI, assert exit status 2 with one ``attnlens: error:`` line, return that line."""
    capsys.readouterr()  # drop what the test's setup printed (save_pretrained's progress bar)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlens: error:") and "\n" not in err, err
    return err


@pytest.fixture
def classifier_dir(tmp_path: Path) -> str:
    return save(make_model("bert"), tmp_path / "cls")


# ------------------------------------------------------------------------------------ missing task head
@pytest.mark.parametrize("kind", ["BertModel", "BertForMaskedLM", "GPT2LMHeadModel"])
def test_checkpoint_without_the_head_is_refused(tmp_path, capsys, kind):
    torch.manual_seed(0)
    if kind == "GPT2LMHeadModel":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=64))
        head = "score.weight"
    else:
        model = {"BertModel": BertModel, "BertForMaskedLM": BertForMaskedLM}[kind](BertConfig(**BERT))
        head = "classifier.weight"
    path = save(model, tmp_path / kind)
    if kind == "GPT2LMHeadModel":  # a language model loads as one; as a classifier it has no head
        assert Explainer.from_pretrained(path).head.task == "causal-lm"
        with pytest.raises(ModelError, match=rf"task head \(.*{head}.*\).*this is a {kind} checkpoint.*"
                                             r"load it without task="):
            Explainer.from_pretrained(path, task="classification")
        return
    with pytest.raises(ModelError, match=rf"task head \(.*{head}.*\).*this is a {kind} checkpoint"):
        Explainer.from_pretrained(path)
    err = cli_error(capsys, ["explain", "--model", path, "--methods", "rawatt", "a good movie"])
    assert head in err and kind in err
    if kind == "BertModel":
        assert "base model without a task head" in err and "attnlens train" in err
    else:
        assert "language model" in err


def test_classifier_loaded_as_qa_is_refused(classifier_dir, tmp_path, capsys):
    with pytest.raises(ModelError, match=r"qa_outputs\.weight.*BertForSequenceClassification.*sequence classifier"):
        Explainer.from_pretrained(classifier_dir, task="qa")
    err = cli_error(capsys, ["benchmark", "--model", classifier_dir, "--dataset", "squad", "--limit", "2",
                             "--methods", "rawatt", "--out", str(tmp_path / "run")])
    assert "qa_outputs" in err and "extractive QA model" in err
    assert not (tmp_path / "run" / "examples.jsonl").exists()


def test_complete_checkpoints_still_load(classifier_dir):
    ex = Explainer.from_pretrained(classifier_dir)
    original = make_model("bert")
    for (name, p), q in zip(ex.model.named_parameters(), original.parameters(), strict=True):
        assert torch.equal(p, q), name  # exactly the saved weights, nothing re-initialised


@pytest.mark.parametrize(("family", "task"), [("bert", "token"), ("gpt2", "causal-lm")])
def test_a_checkpoint_is_refused_as_another_tasks_model_even_where_its_weights_load(tmp_path, family, task):
    """A sequence classifier's head loads under a token classifier's names (``classifier``); GPT-2's LM head is
    tied to the embeddings: nothing is missing, yet the head would compute something it was not trained for."""
    path = save(make_model(family), tmp_path / family)
    with pytest.raises(ModelError, match=r"whose head was trained for another task .* \(task='classification'\)$"):
        Explainer.from_pretrained(path, task=task)


def test_a_misspelt_keyword_is_named_in_one_line(classifier_dir):
    with pytest.raises(ModelError, match=r"unexpected keyword argument 'max_lenght' \(neither an attnlens option"):
        Explainer.from_pretrained(classifier_dir, max_lenght=8)


def test_a_keyword_that_names_a_loader_parameter_is_named_in_one_line(classifier_dir):
    with pytest.raises(ModelError, match=r"unexpected keyword argument 'auto'"):
        Explainer.from_pretrained(classifier_dir, auto=1)


def test_explainer_options_reach_the_explainer_through_from_pretrained(classifier_dir):
    ex = Explainer.from_pretrained(classifier_dir, name="my-model", max_answer_length=7, max_length=12)
    assert (ex.name, ex.max_length) == ("my-model", 12)
    assert Explainer.from_pretrained(classifier_dir).name == classifier_dir


def test_attention_implementation_is_refused_in_one_line(classifier_dir):
    with pytest.raises(InputError, match="leave out attn_implementation="):
        Explainer.from_pretrained(classifier_dir, attn_implementation="sdpa")


def test_train_still_trains_a_new_head_on_a_base_encoder(tmp_path, capsys):
    torch.manual_seed(0)
    base = save(BertModel(BertConfig(**BERT)), tmp_path / "base")
    rows = [{"text": t, "label": y} for t, y in [("a good movie", 1), ("a bad film", 0)] * 6]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["train", "--model", base, "--data-file", str(data), "--out", str(out), "--no-progress",
                 "--batch-size", "4"]) == 0
    assert "attnlens: " in (said := capsys.readouterr()).err and said.out == ""  # notices go to stderr
    assert "a new 2-label head is trained from scratch" in said.err
    assert Explainer.from_pretrained(out).labels == ["LABEL_0", "LABEL_1"]  # the trained head is complete


def test_explainer_docstring_says_it_cannot_check_a_model_object():
    assert "cannot tell whether its task head was trained" in Explainer.__doc__


# ------------------------------------------------------------------------------------------ tokenizer
def test_directory_without_tokenizer_files_is_refused(classifier_dir, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(Path(classifier_dir) / f, bare / f)
    with pytest.raises(ModelError, match="tokenizer of .*none of its files.*tokenizer.json"):
        Explainer.from_pretrained(bare)
    err = cli_error(capsys, ["explain", "--model", str(bare), "--methods", "rawatt", "a charming journey"])
    assert "tokenizer" in err and "save_pretrained" in err
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a good movie", "label": 1}\n{"text": "a bad film", "label": 0}\n' * 3)
    err = cli_error(capsys, ["train", "--model", str(bare), "--data-file", str(data), "--out", str(tmp_path / "o")])
    assert "tokenizer" in err and not (tmp_path / "o").exists()


def test_vocabulary_far_smaller_than_the_embeddings_is_refused():
    model = make_model("bert")
    n = len(make_tokenizer())
    model.resize_token_embeddings(2 * n + 1)  # tokenizer < 50% of the rows
    with pytest.raises(ModelError, match=rf"has {n} tokens but the model's embedding matrix has {2 * n + 1} rows"):
        Explainer(model, make_tokenizer())
    model.resize_token_embeddings(2 * n)  # exactly half: accepted
    Explainer(model, make_tokenizer())


def test_mostly_unknown_tokens_warn_with_the_count(capsys, classifier_dir):
    ex = Explainer.from_pretrained(classifier_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex.explain(["zebra xylophone quokka good"], methods="rawatt")
    assert [str(w.message) for w in caught if "unknown to the tokenizer" in str(w.message)] == [
        "3 of the 4 tokens of the inputs are unknown to the tokenizer ([UNK]): the explanation is of [UNK] "
        "tokens; is this the tokenizer the model was trained with?"
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ex.explain(["zebra good movie"], methods="rawatt")  # 1 of 3: no warning
    assert not [w for w in caught if "unknown to the tokenizer" in str(w.message)]
    capsys.readouterr()
    assert main(["explain", "--model", classifier_dir, "--methods", "rawatt", "zebra quokka"]) == 0  # the CLI warns too
    warned = [line for line in capsys.readouterr().err.splitlines() if "unknown" in line]
    assert len(warned) == 1 and warned[0].startswith("attnlens: warning: 2 of the 2 tokens of the inputs are unknown")


# -------------------------------------------------------------------------------- corrupt checkpoints
@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_corrupt_or_empty_weights_are_one_line(classifier_dir, tmp_path, capsys, damage):
    weights = Path(classifier_dir) / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"empty": b"", "truncated": data[: len(data) * 9 // 10], "garbage": b"\x07" * 300}[damage])
    state = "is empty (0 bytes)" if damage == "empty" else "is corrupt or truncated"
    expected = f"could not load model {classifier_dir}: model.safetensors {state}"
    with pytest.raises(ModelError, match="model.safetensors"):
        Explainer.from_pretrained(classifier_dir)
    assert expected in cli_error(capsys, ["explain", "--model", classifier_dir, "--methods", "rawatt", "good"])
    assert expected in cli_error(capsys, ["benchmark", "--model", classifier_dir, "--dataset", "sst2", "--limit",
                                          "2", "--methods", "rawatt", "--out", str(tmp_path / "run")])
    rows = tmp_path / "d.jsonl"
    rows.write_text('{"text": "a good movie", "label": 1}\n{"text": "a bad film", "label": 0}\n' * 3)
    assert expected in cli_error(capsys, ["train", "--model", classifier_dir, "--data-file", str(rows),
                                          "--out", str(tmp_path / "o"), "--no-progress"])


def test_corrupt_pytorch_bin_is_one_line(classifier_dir, capsys):
    (Path(classifier_dir) / "model.safetensors").unlink()
    (Path(classifier_dir) / "pytorch_model.bin").write_bytes(b"not a pickle")
    err = cli_error(capsys, ["explain", "--model", classifier_dir, "--methods", "rawatt", "good"])
    assert "pytorch_model.bin is corrupt or truncated" in err


@pytest.mark.parametrize("content", [None, "{}", "{bad"])
def test_directory_that_is_not_a_model(tmp_path, capsys, content):
    d = tmp_path / "notamodel"
    d.mkdir()
    if content is not None:
        (d / "config.json").write_text(content)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a good movie", "label": 1}\n{"text": "a bad film", "label": 0}\n' * 3)
    err = cli_error(capsys, ["train", "--model", str(d), "--data-file", str(data), "--out", str(tmp_path / "o")])
    assert str(d) in err and ("config.json" in err or "model_type" in err)
    err = cli_error(capsys, ["explain", "--model", str(d), "--methods", "rawatt", "good"])
    assert str(d) in err and ("config.json" in err or "model_type" in err)


# ------------------------------------------------------------------------------------------ train --out
@pytest.mark.parametrize("where", ["file", "under_file"])
def test_train_out_on_or_under_a_file_fails_before_training(classifier_dir, tmp_path, capsys, monkeypatch, where):
    import attnlens.train as train_module

    monkeypatch.setattr(train_module, "load_model", lambda *a, **k: pytest.fail("training started"))
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = afile if where == "file" else afile / "sub" / "model"
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a good movie", "label": 1}\n{"text": "a bad film", "label": 0}\n' * 3)
    err = cli_error(capsys, ["train", "--model", classifier_dir, "--data-file", str(data), "--out", str(out)])
    assert ("is an existing file" if where == "file" else f"cannot be created: {afile} is a file") in err
    assert afile.read_text() == "keep me"


# ---------------------------------------------------------------------------- GPT-2 without pad_token_id
def test_gpt2_without_pad_token_equals_gpt2_with_one():
    tok = make_tokenizer()
    texts = ["the movie was not very good", "bad", "i really loved this film"]
    with_pad = make_model("gpt2")
    without = make_model("gpt2")
    without.config.pad_token_id = None
    assert with_pad.config.pad_token_id == PAD
    options = {"integratedgradients": {"n_steps": 8}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = Explainer(with_pad, tok).explain(texts, methods="all", options=options, batch_size=4)
        got = Explainer(without, tok).explain(texts, methods="all", options=options, batch_size=4)
    assert without.config.pad_token_id is None  # the user's config is left as it was
    assert "integratedgradients" in got[0].scores and set(got[0].scores) == set(want[0].scores)
    for g, w in zip(got, want, strict=True):
        assert g.predicted == w.predicted
        np.testing.assert_allclose(g.probabilities, w.probabilities, rtol=1e-5, atol=1e-6)
        for m in w.scores:
            np.testing.assert_allclose(g.scores[m], w.scores[m], rtol=1e-4, atol=1e-6, err_msg=m)


def test_gpt2_without_pad_token_scores_perturbations_like_gpt2_with_one():
    """The benchmark's scorer batches variants of different lengths: without a pad id it goes one at a time."""
    from attnlens.evaluation.perturb import ModelPredictor, Variant

    with_pad, without = make_model("gpt2"), make_model("gpt2")
    without.config.pad_token_id = None
    variants = [Variant.of(v) for v in ([CLS_ID, 5, 6, 7, SEP_ID], [CLS_ID, 8, SEP_ID], [CLS_ID, 9, 10, SEP_ID])]
    want = ModelPredictor(with_pad, PAD, batch_size=8)(variants)
    got = ModelPredictor(without, None, batch_size=8)(variants)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert without.config.pad_token_id is None


def test_gpt2_without_pad_token_config_restored_on_error():
    model = make_model("gpt2")
    model.config.pad_token_id = None
    ex = Explainer(model, make_tokenizer())
    with pytest.raises(ModelError, match="padded batch"):  # compute_batch on a padded batch cannot work
        batch = ex.encode(["the movie", "bad"])
        ex.compute_batch(batch, [-1, -1], [], {})
    assert model.config.pad_token_id is None


def test_head_of_another_shape_is_refused(classifier_dir):
    with pytest.raises(ModelError, match=r"classifier\.weight.*another shape.*would be random"):
        Explainer.from_pretrained(classifier_dir, num_labels=3, ignore_mismatched_sizes=True)
    with pytest.raises(ModelError, match="other shapes than the config asks for"):
        Explainer.from_pretrained(classifier_dir, num_labels=3)


# ------------------------------------------------------------------------------------ a hub that cannot be reached
@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No name resolves (no network), no proxy is configured, and the HuggingFace cache is a fresh directory."""
    from huggingface_hub import constants

    from attnlens.models import hub

    monkeypatch.setattr(hub, "_resolves", lambda host: False)
    for name in hub.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_id_loads_from_the_cache_when_the_hub_cannot_be_reached(offline):
    """The cache layout huggingface_hub writes (a snapshot named by refs/main): loaded without a request."""
    snapshot = offline / "models--someone--tiny-bert" / "snapshots" / "0123abc"
    save(make_model("bert"), snapshot)
    (offline / "models--someone--tiny-bert" / "refs").mkdir()
    (offline / "models--someone--tiny-bert" / "refs" / "main").write_text("0123abc")
    (exp,) = Explainer.from_pretrained("someone/tiny-bert").explain(["the movie was great"], methods=["rawatt"])
    (want,) = Explainer.from_pretrained(str(snapshot)).explain(["the movie was great"], methods=["rawatt"])
    assert exp.tokens == want.tokens and exp.predicted_label == want.predicted_label
    np.testing.assert_array_equal(exp.scores["rawatt"], want.scores["rawatt"])


def test_a_hub_id_not_in_the_cache_is_one_line_when_the_hub_cannot_be_reached(offline, capsys):
    line = cli_error(capsys, ["explain", "--model", "someone/not-cached", "good"])
    assert "hub (huggingface.co) cannot be reached" in line and "not in the local cache" in line
    with pytest.raises(ModelError, match="cannot be reached"):
        Explainer.from_pretrained("someone/not-cached")


def test_behind_a_proxy_the_hub_is_not_judged_unreachable(monkeypatch):
    from attnlens.models import hub

    monkeypatch.setattr(hub, "_resolves", lambda host: False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert hub.hub_unreachable() is None and hub.cache_only("someone/model") == {}
    monkeypatch.delenv("HTTPS_PROXY")
    for name in hub.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert hub.hub_unreachable() == "huggingface.co" and hub.cache_only("someone/model") == {"local_files_only": True}


def test_the_callers_local_files_only_is_taken_as_given(offline, classifier_dir):
    """``local_files_only`` among the model options is the caller's choice, for every file; a local directory
    loads either way."""
    with pytest.raises(ModelError, match="could not load model 'someone/not-cached'"):
        Explainer.from_pretrained("someone/not-cached", local_files_only=True)
    assert Explainer.from_pretrained(classifier_dir, local_files_only=False).explain(["good"], methods=["rawatt"])
