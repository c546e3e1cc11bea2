"""The ``attnlens explain`` command line: every user mistake is one line + exit 2 (found before the model
loads or anything is written), ``--methods all`` skips what does not apply as the API does, ``--format json``
loads back, ``--version``."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MODELS, make_model, make_tokenizer, missing
from transformers import BertConfig, BertForQuestionAnswering

import attnlens
from attnlens import Explainer, Explanation, InputError, list_methods, load_explanations
from attnlens.cli import main

LRP_MAPS = {"partiallrp", "transatt"}  # read one self-attention stream's attention relevance (not an encoder-decoder's)
SQUARE = {"rollout", "gae", "flow", "transatt", "valuezeroing"}  # need square self-attention (not BART's cross)
NORM = {"attnnorm", "globenc", "alti", "decompx"}  # need a layer anatomy (decompx: a classifier or a causal LM)
LABELS = {0: "negative", 1: "positive"}


def _save(model: torch.nn.Module, path: Path) -> str:
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli-models")
    out = {}
    for family in ("bert", "gpt2", "bart"):
        model = make_model(family)
        model.config.id2label, model.config.label2id = LABELS, {v: k for k, v in LABELS.items()}
        out[family] = _save(model, root / family)
    torch.manual_seed(0)
    qa = BertForQuestionAnswering(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                             intermediate_size=24, max_position_embeddings=64, pad_token_id=0,
                                             initializer_range=0.3))
    out["qa"] = _save(qa, root / "qa")
    return out


def _one_line_error(capsys, code: int) -> str:
    captured = capsys.readouterr()
    assert code == 2, captured
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------- --methods all on every family and stream
@pytest.mark.parametrize(
    "name,attention,skipped",
    [
        ("bert", None, set()),
        ("gpt2", None, set()),
        ("bart", None, LRP_MAPS),  # the norm methods read the encoder's layers, DecompX its decoder too
        ("bart", "encoder", LRP_MAPS),
        # attnnorm reads one attention, alti follows the row through both (ALTI+): every stream
        ("bart", "decoder", LRP_MAPS | NORM - {"attnnorm", "alti"}),
        ("bart", "cross", LRP_MAPS | SQUARE | NORM - {"attnnorm", "alti"}),
        ("qa", None, set()),  # the row readers read the span's start and end rows
    ],
)
def test_methods_all_skips_what_does_not_apply(models, name, attention, skipped, tmp_path, capsys):
    out = tmp_path / "out.json"
    text = ("was it great", "the movie was great") if name == "qa" else "the movie was great"
    pairs = tmp_path / "in.jsonl"
    pairs.write_text(json.dumps({"text_a": text[0], "text_b": text[1]} if name == "qa" else {"text": text}) + "\n")
    argv = ["explain", "--file", str(pairs), "--model", models[name], "--format", "json", "--out", str(out)]
    code = main(argv + (["--attention", attention] if attention else []))
    err = capsys.readouterr().err
    assert code == 0, err
    expected = [m for m in list_methods() if m not in skipped]
    (exp,) = load_explanations(out)
    assert exp.methods == expected
    notices = [line for line in err.splitlines() if line.startswith("attnlens: warning: skipping")]
    if skipped:  # one line naming every skipped method, and why
        assert len(notices) == 1, err
        names = ", ".join(m for m in list_methods() if m in skipped)
        assert notices[0].startswith(f"attnlens: warning: skipping {names}: ")
        assert any(why in notices[0] for why in ("support BERT", "need a layer anatomy", "one self-attention stream",
                                                 "reads an encoder-decoder's encoder layers"))
        if attention == "cross":
            assert "needs self-attention" in notices[0]
    else:
        assert notices == []
    # the same as the Python API gives
    api = Explainer.from_pretrained(models[name], attention=attention)
    with pytest.warns(UserWarning, match="skipping") if skipped else contextlib.nullcontext():
        (ref,) = api.explain([text], methods="all")
    assert ref.methods == expected
    for m in expected:
        assert exp.scores[m] == pytest.approx(ref.scores[m], abs=1e-6), m


@pytest.mark.slow
@pytest.mark.parametrize("name,attention", [("gpt2-scratch-sst2", None), ("bart-scratch-sst2", None),
                                            ("bart-scratch-sst2", "decoder"), ("bart-scratch-sst2", "cross")])
def test_methods_all_on_reference_models(name, attention, tmp_path, capsys):
    path = MODELS / name
    if not path.is_dir():
        missing(f"reference model not found at {path}")
    out = tmp_path / "out.jsonl"
    argv = ["explain", "a charming journey", "--model", str(path), "--format", "jsonl", "--out", str(out)]
    code = main(argv + (["--attention", attention] if attention else []))
    err = capsys.readouterr().err
    assert code == 0, err
    # seq2seq: AttnLRP but not the methods reading attention relevance, the norm methods (and DecompX) on the
    # encoder stream only but attnnorm on every stream (GPT-2, a pre-LN decoder, has all of them)
    bart = name.startswith("bart")
    norm = NORM - {"attnnorm", "alti"} if attention in ("decoder", "cross") else set()  # alti: ALTI+
    skipped = (LRP_MAPS | norm if bart else set()) | (SQUARE if attention == "cross" else set())
    (exp,) = load_explanations(out)
    assert exp.methods == [m for m in list_methods() if m not in skipped]
    assert exp.predicted == 1  # positive: the reference models get this sentence right
    assert sum(line.startswith("attnlens: warning: skipping") for line in err.splitlines()) == bool(skipped)


def test_methods_named_explicitly_still_refuse(models, capsys):
    code = main(["explain", "good", "--model", models["bart"], "--methods", "rawatt,transatt"])
    assert "one self-attention stream" in _one_line_error(capsys, code)


# ------------------------------------------------------------- option mistakes: one line, before loading
@pytest.mark.parametrize(
    "extra,message",
    [
        (["--top-k", "-1"], "--top-k must be at least 1, got -1"),
        (["--top-k", "0"], "--top-k must be at least 1, got 0"),
        (["--top-k", "3", "--generate"], "--top-k sets the tables of top tokens, which --format terminal and html "
                                            "and the --html page print (not --generate)"),
        (["--top-k", "3", "--format", "json"], "--top-k sets the tables of top tokens"),
        (["--top-k", "3", "--format", "jsonl"], "--top-k sets the tables of top tokens"),
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--batch-size", "-1"], "--batch-size must be at least 1, got -1"),
        (["--max-length", "1"], "--max-length must be at least 2 tokens, got 1"),
        (["--target-kind", "loss"], "--target-kind loss explains the loss against a given label: pass it as --target"),
        (["--out", "x.json"], "--out is for --format html/json/jsonl; use --html PATH for a page beside the terminal"),
        (["--format", "html", "--html", "x.html"], "with --format html, --out PATH names the page"),
        (["--plot", "heat.txt"], "--plot heat.txt: give a .png or .svg file name"),
        (["--plot", "a.png", "--format", "html", "--out", "a.png"], "--out and --plot both name a.png"),
        (["--options", "{"], "--options is not valid JSON"),
        (["--options", "[1]"], "--options must map method ids to option objects"),
        (["--methods", "attcat", "--options", '{"attcat": {"alphaa": 1}}'],
         "method 'attcat' has no option alphaa; its options: hidden='input', alpha='mean'"),
        (["--methods", "attcat", "--options", '{"rollout": {}}'], "--options sets rollout, which --methods leaves out"),
        (["--methods", "integratedgradients", "--ig-steps", "4", "--options",
          '{"integratedgradients": {"n_steps": 8}}'],
         "--ig-steps and --options both set integratedgradients' n_steps: give it once"),
    ],
)
def test_option_mistakes_are_refused_before_loading(extra, message, capsys):
    # a model path that does not exist: the option error must come first
    code = main(["explain", "good", "--model", "/nonexistent/model"] + extra)
    assert message in _one_line_error(capsys, code)


@pytest.mark.parametrize("option", ["--out", "--html", "--head-view", "--plot"])
def test_output_paths_that_cannot_be_written(option, tmp_path, capsys):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    fmt = ["--format", "json"] if option == "--out" else []
    suffix = ".png" if option == "--plot" else ".html"
    code = main(["explain", "good", "--model", "/nonexistent/model", *fmt, option, str(tmp_path)])
    assert f"{option} {tmp_path} is a directory; give a file name" in _one_line_error(capsys, code)
    under = a_file / f"x{suffix}"
    code = main(["explain", "good", "--model", "/nonexistent/model", *fmt, option, str(under)])
    assert f"{a_file} is a file, not a directory" in _one_line_error(capsys, code)
    assert a_file.read_text() == "x"



@pytest.mark.parametrize("option", ["--out", "--html"])
def test_an_output_that_is_the_input_file_is_refused_and_the_file_kept(option, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("a good movie\n")
    fmt = ["--format", "jsonl"] if option == "--out" else []
    code = main(["explain", "--file", str(texts), "--model", "/nonexistent/model", *fmt, option, str(texts)])
    assert f"{option} {texts} is the --file file this command reads" in _one_line_error(capsys, code)
    context = tmp_path / "context.txt"
    context.write_text("The tower is in Paris.")
    code = main(["cite", "--context-file", str(context), "--query", "Where?", "--model", "/nonexistent/model",
                 "--format", "json", "--out", str(context)])
    assert f"--out {context} is the --context-file file this command reads" in _one_line_error(capsys, code)
    assert texts.read_text() == "a good movie\n" and context.read_text() == "The tower is in Paris."


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no file can be created")
@pytest.mark.parametrize("option", ["--html", "--head-view", "--plot"])
def test_output_paths_where_no_file_can_be_created_are_refused_before_anything_is_written(option, tmp_path,
                                                                                         capsys):
    """Permissions allow it (as root they always do), but the place takes no files: refused up front, and the other
    output is not written either."""
    out = tmp_path / "e.json"
    target = "/proc/attnlens/x" + (".png" if option == "--plot" else ".html")
    code = main(["explain", "good", "--model", "/nonexistent/model", "--format", "json", "--out", str(out),
                 option, target])
    assert f"{option} {target} cannot be written: no file can be created in /proc" in _one_line_error(capsys, code)
    assert not out.exists()


@pytest.mark.parametrize("text", ["", "   "])
def test_empty_text_arguments(models, text, capsys):
    code = main(["explain", "good", text, "--model", models["bert"], "--methods", "rawatt"])
    assert "input 1 is empty or whitespace only" in _one_line_error(capsys, code)


def test_a_pair_with_an_empty_text_names_which_one():
    from attnlens.core.encoding import normalize_texts

    with pytest.raises(InputError, match=r"^input 1's second text is empty or whitespace only$"):
        normalize_texts(["good", ("fine", "  ")])


@pytest.mark.parametrize("argv", [["explain", "good", "--top-k", "abc"], ["explain", "good", "--bogus"],
                                  ["explain", "good", "--format", "xml"], ["nosuchcommand"]])
def test_usage_errors_are_one_line(argv, capsys):
    err = _one_line_error(capsys, main(argv))
    assert err.startswith("attnlens") and ": error: " in err and "--help" in err


def test_out_creates_missing_folders(models, tmp_path, capsys):
    out = tmp_path / "new" / "sub" / "page.html"
    assert main(["explain", "good", "--model", models["bert"], "--methods", "rawatt", "--format", "html",
                 "--out", str(out)]) == 0
    assert "<html" in out.read_text().lower()


# ------------------------------------------------------------- --file: JSON Lines or plain lines, decided per file
def test_file_plain_line_starting_with_a_brace(models, tmp_path, capsys):
    f = tmp_path / "texts.txt"
    f.write_text("{braces} are fun\n\nthe movie was great\n", encoding="utf-8")
    assert main(["explain", "--file", str(f), "--model", models["bert"], "--methods", "rawatt",
                 "--format", "jsonl"]) == 0
    texts = [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()]
    assert texts == ["{braces} are fun", "the movie was great"]



@pytest.mark.parametrize("content", ['{"text": "the movie was great"}\n', "the movie was great\n"])
def test_file_with_a_byte_order_mark_reads_as_without_it(content, models, tmp_path, capsys):
    """A leading UTF-8 byte-order mark (as some editors write) is not read as part of the first text."""
    f = tmp_path / "texts.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + content.encode("utf-8"))
    assert main(["explain", "--file", str(f), "--model", models["bert"], "--methods", "rawatt",
                 "--format", "jsonl"]) == 0
    assert [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()] == ["the movie was great"]

@pytest.mark.parametrize(
    "content,message",
    [
        ('{"text": "good"}\nplain text\n', "line 2: not a JSON object, but line 1 is one"),
        ('\nplain text\n{"text": "good"}\n', "line 3: a JSON object, but line 2 is plain text"),
        ('[\n {"text": "a"},\n {"text": "b"}\n]\n', "holds one JSON document"),
        ('{\n "text": "a"\n}\n', "holds one JSON document"),
    ],
)
def test_file_mixing_json_and_text_is_refused(content, message, tmp_path, capsys):
    f = tmp_path / "texts.txt"
    f.write_text(content, encoding="utf-8")
    code = main(["explain", "--file", str(f), "--model", "/nonexistent/model"])
    assert message in _one_line_error(capsys, code)


# ------------------------------------------------------------- --format json / jsonl load back
@pytest.mark.parametrize("fmt", ["json", "jsonl"])
@pytest.mark.parametrize("words", [False, True])
def test_json_output_loads_back(models, fmt, words, tmp_path):
    texts = ["the movie was great", "i didn ' t like it"]
    out = tmp_path / f"out.{fmt}"
    argv = ["explain", *texts, "--model", models["bert"], "--methods", "rawatt,attcat,rollout", "--target",
            "positive", "--format", fmt, "--out", str(out)] + (["--words"] if words else [])
    assert main(argv) == 0
    ref = Explainer.from_pretrained(models["bert"]).explain(texts, methods="rawatt,attcat,rollout", target=1)
    if words:
        ref = [e.to_words() for e in ref]
    loaded = load_explanations(out)
    assert len(loaded) == 2
    for got, want in zip(loaded, ref, strict=True):
        assert got.tokens == want.tokens and got.target == want.target == 1 and got.special == want.special
        assert got.methods == want.methods
        for m in want.methods:
            assert got.scores[m] == pytest.approx(want.scores[m], abs=1e-6)
            assert got.layers[m].shape == want.layers[m].shape
            assert got.layers[m] == pytest.approx(want.layers[m], abs=1e-6)
    assert Explanation.load(out) == loaded[0]
    # and what load writes back is the same file content
    again = tmp_path / "again.jsonl"
    attnlens.save_explanations(loaded, again)
    assert load_explanations(again) == loaded


def test_load_errors_are_one_line(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    with pytest.raises(attnlens.InputError, match="holds no explanations"):
        load_explanations(empty)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(attnlens.InputError, match="line 2: not valid JSON"):
        load_explanations(bad)
    numbers = tmp_path / "numbers.json"
    numbers.write_text("[1, 2]")
    with pytest.raises(attnlens.InputError, match="item 1 is not an attnlens explanation"):
        Explanation.load(numbers)


# ------------------------------------------------------------- --version
def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"attnlens {attnlens.__version__}"


def test_version_through_python_m():
    src = Path(attnlens.__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "attnlens.cli", "--version"], capture_output=True, text=True,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"attnlens {attnlens.__version__}"


def test_options_reach_the_methods(models, tmp_path, capsys):
    """``--options`` sets a method's options as ``Explainer.explain(options=...)`` does, beside the ``--ig-*`` flags."""
    text = "a charming and often funny journey"
    ex = Explainer.from_pretrained(models["bert"])
    opts = {"globenc": {"normalize": True}, "integratedgradients": {"n_steps": 4, "tolerance": None}}
    (want,) = ex.explain([text], methods=["globenc", "integratedgradients"], options=opts)
    (default,) = ex.explain([text], methods=["globenc"])
    assert abs(want.scores["globenc"] - default.scores["globenc"]).max() > 1e-4  # the option changes the scores
    out = tmp_path / "e.json"
    code = main(["explain", text, "--model", models["bert"], "--methods", "globenc,integratedgradients",
                 "--options", json.dumps({"globenc": {"normalize": True}, "integratedgradients": {"tolerance": None}}),
                 "--ig-steps", "4", "--format", "json", "--out", str(out), "--quiet"])
    assert code == 0, capsys.readouterr().err
    (got,) = load_explanations(out)
    for method in ("globenc", "integratedgradients"):
        np.testing.assert_allclose(got.scores[method], want.scores[method], rtol=1e-5, atol=1e-6)


def test_the_attcat_code_protocol_refuses_explaining_the_predicted_class(tmp_path, capsys):
    code = main(["benchmark", "--model", "/nonexistent/model", "--dataset", "sst2", "--protocol", "attcat-code",
                 "--target", "predicted", "--out", str(tmp_path / "run")])
    assert "--protocol attcat-code explains the gold label" in _one_line_error(capsys, code)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra", [["--hard"], ["--sources", "sentence"], ["--lds-ablations", "8"],
                                   ["--external", "peers.jsonl"], ["--write-examples", "ex.jsonl"]])
def test_context_benchmark_options_are_refused_for_classification(extra, tmp_path, capsys):
    code = main(["benchmark", "--model", "/nonexistent/model", "--dataset", "sst2", *extra, "--out",
                 str(tmp_path / "run")])
    assert "is an option of --task context" in _one_line_error(capsys, code)


@pytest.mark.parametrize("extra", [["--metrics", "aopc"], ["--processes", "2"], ["--protocol", "attcat-code"],
                                   ["--target", "gold"], ["--batch-size", "4"], ["--shard", "0/2"], ["--k", "5"]])
def test_classification_benchmark_options_are_refused_for_context(extra, tmp_path, capsys):
    code = main(["benchmark", "--task", "context", "--model", "/nonexistent/model", "--dataset", "squad-context",
                 "--methods", "loo", *extra, "--out", str(tmp_path / "run")])
    assert _one_line_error(capsys, code).endswith(f"{extra[0]} is an option of the classification and QA benchmark; "
                                                  "--task context does not read it: leave it out")
    assert not (tmp_path / "run").exists()


def test_a_context_benchmark_writes_nothing_before_its_model_loads(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text('{"id": "kept"}\n')
    code = main(["benchmark", "--task", "context", "--model", "/nonexistent/model", "--dataset", "squad-context",
                 "--methods", "loo", "--limit", "1", "--overwrite", "--write-examples", str(tmp_path / "ex.jsonl"),
                 "--out", str(run)])
    _one_line_error(capsys, code)
    assert (run / "records.jsonl").read_text() == '{"id": "kept"}\n' and not (tmp_path / "ex.jsonl").exists()
    code = main(["benchmark", "--task", "context", "--model", "/nonexistent/model", "--dataset", "squad-context",
                 "--methods", "loo", "--write-examples", str(tmp_path), "--out", str(tmp_path / "other")])
    assert "--write-examples" in _one_line_error(capsys, code) and not (tmp_path / "other").exists()


def test_a_missing_external_scores_file_is_one_line(tmp_path, capsys):
    code = main(["benchmark", "--task", "context", "--model", "/nonexistent/model", "--dataset", "squad-context",
                 "--external", str(tmp_path / "nosuch.jsonl"), "--out", str(tmp_path / "run")])
    assert "nosuch.jsonl: cannot be read" in _one_line_error(capsys, code)


def test_token_with_generate_is_refused(capsys):
    code = main(["explain", "--model", "/nonexistent/model", "--generate", "--token", "1", "The capital is"])
    assert "--token names the explained token of a token classifier" in _one_line_error(capsys, code)


def test_an_occlusion_max_below_its_step_is_refused(tmp_path, capsys):
    code = main(["benchmark", "--model", "/nonexistent/model", "--dataset", "sst2", "--occlusion-max", "1",
                 "--occlusion-step", "2", "--out", str(tmp_path / "run")])
    assert "--occlusion-max 1 is below --occlusion-step 2" in _one_line_error(capsys, code)


def test_a_split_of_a_data_file_is_refused(tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "good", "label": 1}\n')
    code = main(["benchmark", "--model", "/nonexistent/model", "--dataset", str(data), "--split", "dev", "--out",
                 str(tmp_path / "run")])
    assert "--split names a split of a known data set" in _one_line_error(capsys, code)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra", [["--split", "fit"], ["--hard"], ["--sources", "sentence"], ["--distractors", "1"]])
def test_squad_context_build_options_are_refused_with_an_examples_file(extra, tmp_path, capsys):
    examples = tmp_path / "examples.jsonl"
    examples.write_text("")
    code = main(["benchmark", "--task", "context", "--model", "/nonexistent/model", "--dataset", str(examples),
                 "--methods", "loo", *extra, "--out", str(tmp_path / "run")])
    assert f"{extra[0]} chooses how squad-context builds its examples" in _one_line_error(capsys, code)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("target", ["5", "-1,3", "5-6", "[5,6]", "positive"])
def test_a_qa_target_that_is_not_a_span_says_how_to_write_one(models, target, capsys):
    code = main(["explain", "was it great", "the movie was great", "--model", models["qa"], "--methods", "rawatt",
                 f"--target={target}"])
    assert _one_line_error(capsys, code).endswith(
        f"--target {target}: a QA model's target is the answer span as START,END, two token positions from 0 "
        "(e.g. --target 5,7)")


def test_a_file_of_squad_style_rows_explains_question_and_context(models, tmp_path, capsys):
    rows = tmp_path / "qa.jsonl"
    rows.write_text(json.dumps({"question": "was it great", "context": "the movie was great"}) + "\n")
    out = tmp_path / "qa.json"
    assert main(["explain", "--file", str(rows), "--model", models["qa"], "--methods", "rawatt", "--format", "json",
                 "--out", str(out), "--quiet"]) == 0
    assert json.loads(out.read_text())[0]["text"] == ["was it great", "the movie was great"]
    capsys.readouterr()


@pytest.mark.parametrize("name", ["bert", "qa"])
def test_generate_on_a_model_that_does_not_generate_says_to_leave_it_out(models, name, capsys):
    code = main(["explain", "the movie", "--model", models[name], "--generate", "--methods", "rawatt"])
    err = _one_line_error(capsys, code)
    assert "--generate needs a language model" in err and err.endswith("leave --generate out to explain its "
                                                                       "predictions")
