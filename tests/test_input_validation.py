"""Cases found by scripts/fuzz_inputs.py: wrong types and odd values through the API and the CLI give one clear
error (exit 2), never a traceback or a silently wrong result."""

from __future__ import annotations

import json
import math
import re
import warnings

import numpy as np
import pytest
import torch
from conftest import make_model, make_tokenizer

from attnlens import Explainer, Explanation, load_explanations
from attnlens.cli import main
from attnlens.errors import InputError, ModelError
from attnlens.train import TrainConfig


@pytest.fixture(scope="module")
def ex() -> Explainer:
    return Explainer(make_model("bert"), make_tokenizer())


@pytest.fixture(scope="module")
def results_dir(model_dir, tmp_path_factory):
    """A finished tiny benchmark run."""
    root = tmp_path_factory.mktemp("bench")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n"
                            for i, t in enumerate(["the movie was good", "a boring plot", "i loved it"])))
    out = root / "out"
    assert main(["benchmark", "--model", model_dir, "--dataset", str(data), "--methods", "rawatt",
                 "--metrics", "aopc", "--occlusion-max", "2", "--quiet", "--out", str(out)]) == 0
    return out


def _cli_error(argv: list[str], capsys) -> str:
    """Run the CLI, assert exit 2 with one `attnlens: error:` line, return that line."""
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("attnlens: error: ")
    return err[-1]


# ------------------------------------------------------------------------------------------- explain API
@pytest.mark.parametrize("methods", [5, [["rawatt"]], {"rawatt"}, b"rawatt"])
def test_methods_of_a_wrong_type(ex, methods):
    with pytest.raises(InputError, match="methods must be|unknown method"):
        ex.explain("good movie", methods=methods)


@pytest.mark.parametrize("options", ["attcat", {"attcat": 5}, {"attcat": None}, [("attcat", {})], {3: {}}])
def test_options_of_a_wrong_type(ex, options):
    with pytest.raises(InputError, match="options must map method ids to option dicts"):
        ex.explain("good movie", methods="attcat", options=options)


@pytest.mark.parametrize("batch_size", [1.5, "8", None, True])
def test_batch_size_of_a_wrong_type(ex, batch_size):
    with pytest.raises(InputError, match="batch_size must be an integer"):
        ex.explain(["good movie", "bad film"], methods="rawatt", batch_size=batch_size)
    with pytest.raises(InputError, match="batch_size must be an integer"):
        ex.predict_proba([[2, 10, 3]], batch_size=batch_size)


def test_tokenizer_and_max_length_of_a_wrong_type():
    with pytest.raises(ModelError, match="expected a HuggingFace tokenizer, got NoneType"):
        Explainer(make_model("bert"), None)
    with pytest.raises(ModelError, match="expected a HuggingFace tokenizer, got str"):
        Explainer(make_model("bert"), "bert-base-uncased")
    with pytest.raises(InputError, match="max_length must be an integer, got '10'"):
        Explainer(make_model("bert"), make_tokenizer(), max_length="10")


def test_text_with_lone_surrogates(ex, model_dir, capsys):
    # what Python makes of undecodable bytes in argv or a file read with errors="surrogateescape"
    with pytest.raises(InputError, match="input 1 holds characters that are not valid Unicode"):
        ex.explain(["good", "good \udcff movie"], methods="rawatt")
    line = _cli_error(["explain", "--model", model_dir, "--methods", "rawatt", "good \udcff movie"], capsys)
    assert "not valid Unicode" in line


@pytest.mark.parametrize("value", [0, -5, "a", 2.5, True])
def test_integrated_gradients_steps(ex, value):
    for option in ("n_steps", "internal_batch_size"):
        with pytest.raises(InputError, match=f"integratedgradients {option} must be an integer >= 1"):
            ex.explain("good movie", methods="integratedgradients",
                       options={"integratedgradients": {option: value}})


def test_integrated_gradients_few_steps_still_work(ex):
    (e,) = ex.explain("good movie", methods="integratedgradients", options={"integratedgradients": {"n_steps": 3}})
    assert len(e.scores["integratedgradients"]) == len(e.tokens) and np.isfinite(e.scores["integratedgradients"]).all()


def test_saliency_abs_must_be_boolean(ex):
    with pytest.raises(InputError, match="saliency abs must be True or False"):
        ex.explain("good movie", methods="saliency", options={"saliency": {"abs": "no"}})


def test_top_k_of_a_wrong_type(ex):
    (e,) = ex.explain("the movie was very good", methods="rawatt")
    with pytest.raises(InputError, match="k must be an integer >= 0, got '3'"):
        e.top_k("rawatt", "3")
    assert len(e.top_k("rawatt", np.int64(2))) == 2


@pytest.mark.parametrize("ids", [[[]], [[2, 99999, 3]], [[2, -4, 3]], ["some text"], [[2, 1.5, 3]], [[2, True]]])
def test_predict_proba_bad_ids(ex, ids):
    with pytest.raises(InputError, match=r"input_ids\[0\] must be a non-empty list of token ids in 0\.\.63"):
        ex.predict_proba(ids)
    with pytest.raises(InputError, match="takes token ids, not text"):
        ex.predict_proba("some text")


@pytest.mark.parametrize(("types", "masks", "message"), [
    (None, [[1, 1, 1, 1]], r"attention_masks must give one list per sequence of input_ids \(2\), got 1"),
    (None, [[1, 1, 1, 1], [1, 1, 1, 1]], r"attention_masks\[1\] must be a list as long as input_ids\[1\] \(3 tokens\)"),
    (None, [[1, 1, 1, 1], [1, 7, 1]], r"attention_masks\[1\] holds 7; its values must be 0 or 1"),
    ([[0, 0, 0, 0], [0, 5, 0]], None, r"token_type_ids\[1\] holds 5; its values must be 0 or 1"),
    ([[0, 0, 0]], None, r"token_type_ids must give one list per sequence of input_ids \(2\), got 1"),
    ([[0, 0, 0], None], None, r"token_type_ids\[0\] must be a list as long as input_ids\[0\] \(4 tokens\)"),
])
def test_predict_proba_refuses_masks_and_types_that_do_not_fit_the_ids(ex, types, masks, message):
    """A mask longer than its sequence would un-hide the padding of a longer neighbour in the batch."""
    with pytest.raises(InputError, match=f"^{message}$"):
        ex.predict_proba([[2, 10, 11, 3], [2, 7, 3]], types, masks)


def test_predict_proba_refuses_sequences_longer_than_the_model_takes(ex):
    n = ex.runner.max_length + 1
    with pytest.raises(InputError, match=rf"^input_ids\[0\] has {n} tokens, more than the {n - 1} the model takes$"):
        ex.predict_proba([[2] + [10] * (n - 2) + [3]])


def test_a_pair_truncated_to_nothing_of_one_text_is_refused(ex):
    question, context = "where is the movie set", " ".join(["the movie was good"] * 40)
    with pytest.raises(InputError, match=r"^input 0: truncation to 4 tokens leaves nothing of its first text"):
        Explainer(ex.model, ex.tokenizer, max_length=4).explain([(question, context)], methods="rawatt")
    (kept,) = Explainer(ex.model, ex.tokenizer, max_length=24).explain([(question, context)], methods="rawatt")
    assert len(kept.tokens) == 24  # both texts keep tokens: explained as before


def test_predict_proba_equals_a_direct_call(ex):
    ids = [[2, 10, 11, 3], [2, 7, 3]]
    got = ex.predict_proba(ids)
    with torch.no_grad():
        want = [ex.model(input_ids=torch.tensor([x])).logits[0].softmax(-1).numpy() for x in ids]
    np.testing.assert_allclose(got, np.stack(want), atol=1e-5)


# ------------------------------------------------------------------------------------ explanation files
def test_loading_files_that_are_not_explanations(ex, tmp_path):
    binary = tmp_path / "x.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(InputError, match="is not a UTF-8 text file of attnlens results"):
        Explanation.load(binary)
    with pytest.raises(InputError, match="is not a UTF-8 text file"):
        load_explanations(binary)
    broken = tmp_path / "x.jsonl"
    broken.write_text(json.dumps(ex.explain("good", methods="rawatt")[0].to_dict()) + "\n{oops\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"x.jsonl, line 2: not valid JSON \(Expecting property name"):
        load_explanations(broken)
    (tmp_path / "n.json").write_text("5")
    with pytest.raises(InputError, match="item 1 is not an attnlens explanation"):
        Explanation.load(tmp_path / "n.json")


# ------------------------------------------------------------------------------------------------ train
@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--lr", "inf", "--lr must be a finite number > 0, got inf"),
        ("--epochs", "inf", "--epochs must be a finite number > 0, got inf"),
        ("--weight-decay", "nan", "--weight-decay must be a finite number >= 0, got nan"),
        ("--weight-decay", "-1", "--weight-decay must be a finite number >= 0, got -1.0"),
        ("--seed", "-1", "--seed must be in 0..2**32-1, got -1"),
        ("--device", "bogus", "--device 'bogus' is not a torch device"),
    ],
)
def test_train_options(flag, value, message, model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "good movie", "label": i % 2}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    line = _cli_error(["train", "--model", model_dir, "--data-file", str(data), "--no-progress", "--out", str(out),
                       flag, value], capsys)
    assert message in line
    assert not out.exists()  # refused before anything was trained or written


def test_train_device_that_is_not_there():
    missing = torch.cuda.device_count()  # the first index past the machine's GPUs (cuda:0 where it has none)
    with pytest.raises(InputError, match="no such CUDA device"):
        TrainConfig(model="m", out="o", dataset="sst2", device=f"cuda:{missing}").validate()


def test_train_out_that_is_a_file(model_dir, tmp_path, capsys):
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    line = _cli_error(["train", "--model", model_dir, "--dataset", "sst2", "--out", str(afile)], capsys)
    assert f"--out {afile} is an existing file" in line
    line = _cli_error(["train", "--model", model_dir, "--dataset", "sst2", "--out", str(afile / "sub")], capsys)
    assert f"{afile} is a file, not a directory" in line
    assert afile.read_text() == "x"



def test_train_out_that_holds_a_saved_model_is_kept_unless_overwrite(model_dir, tmp_path, capsys):
    """A folder holding a model is not replaced by accident: --overwrite says to."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "good movie", "label": i % 2}) + "\n" for i in range(8)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    argv = ["train", "--model", model_dir, "--data-file", str(data), "--no-progress", "--epochs", "1",
            "--max-length", "8", "--out", str(out)]
    assert "holds a saved model (config.json)" in _cli_error(argv, capsys)
    assert (out / "config.json").read_text() == '{"mine": true}'
    assert main([*argv, "--overwrite"]) == 0
    assert (out / "metrics.json").exists() and "mine" not in (out / "config.json").read_text()


def test_train_says_which_classes_have_no_example_and_how_many_texts_are_empty(model_dir, tmp_path, capsys):
    rows = [{"text": "good movie" if i % 2 else "", "label": 3 * (i % 2)} for i in range(8)]  # class 0: empty
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", "--model", model_dir, "--data-file", str(data), "--no-progress", "--epochs", "1",
                 "--max-length", "8", "--reinit-head", "--eval-fraction", "0.25", "--out", str(tmp_path / "o")]) == 0
    said = capsys.readouterr()
    assert "attnlens: warning: classes 1, 2 have no training example; the head has 4 classes" in said.err
    assert re.search(r"\d+ training texts? (is|are) empty", said.err)  # class 0 trains, so empty texts do
    assert "warning" not in said.out  # notices go to stderr

def test_train_config_accepts_finite_values():
    TrainConfig(model="m", out="o", dataset="sst2", lr=1e-3, epochs=0.5, weight_decay=0.0, seed=2**32 - 1).validate()
    assert math.isfinite(TrainConfig(model="m", out="o", dataset="sst2").lr)


# ----------------------------------------------------------------------------------------------- report
def test_report_negative_examples(results_dir, tmp_path, capsys):
    out = tmp_path / "r.html"
    line = _cli_error(["report", str(results_dir), "--out", str(out), "--examples", "-1"], capsys)
    assert "--examples must be an integer >= 0, got -1" in line
    assert not out.exists()


def test_report_out_paths(results_dir, tmp_path, capsys):
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    line = _cli_error(["report", str(results_dir), "--out", str(afile / "r.html")], capsys)
    assert f"{afile} is a file, not a directory" in line
    line = _cli_error(["report", str(results_dir), "--out", str(tmp_path)], capsys)
    assert "is a directory; give a file name" in line
    line = _cli_error(["report", str(afile)], capsys)
    assert f"results directory {afile} is a file" in line
    assert main(["report", str(results_dir), "--out", str(tmp_path / "new" / "r.html")]) == 0
    assert "<html" in (tmp_path / "new" / "r.html").read_text(encoding="utf-8").lower()


def test_report_summary_not_utf8(results_dir, tmp_path, capsys):
    import shutil

    copy = tmp_path / "res"
    shutil.copytree(results_dir, copy)
    (copy / "summary.json").write_bytes(b"\xff\xfe\x00garbage")
    line = _cli_error(["report", str(copy)], capsys)
    assert "is not a UTF-8 text file" in line


def test_report_on_a_context_benchmark_names_its_table(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps({"model": "m", "n_lds": 32, "metrics": {}}))
    line = _cli_error(["report", str(tmp_path)], capsys)
    assert "holds a context-attribution benchmark" in line and "summary.md" in line


def test_python_m_attnlens_cli_entry_point():
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    proc = subprocess.run([sys.executable, "-m", "attnlens.cli", "report", "/nonexistent/results"],
                          capture_output=True, text=True, env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "attnlens: error: results directory /nonexistent/results does not exist"


def test_from_pretrained_unknown_device(model_dir):
    with pytest.raises(InputError, match="cannot move the model to device 'bogus'"):
        Explainer.from_pretrained(model_dir, device="bogus")


def test_explain_empty_model_is_not_the_default(capsys):
    line = _cli_error(["explain", "--model", "", "--methods", "rawatt", "good movie"], capsys)
    assert line == "attnlens: error: --model is empty: give a model directory or hub id"


def test_fuzz_harness_lists_its_cases():
    """scripts/fuzz_inputs.py stays runnable: at least 200 distinct cases, each with a valid expectation."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_inputs.py"
    proc = subprocess.run([sys.executable, str(script), "--list"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[:-1]]
    ids = [r[0] for r in rows]
    assert len(ids) == len(set(ids)) >= 200
    assert {r[2] for r in rows} <= {"error", "ok", "either", "traceback"}
    assert {r[1] for r in rows} == {"cli", "sub", "api"}
    assert {i.split("/")[0] for i in ids} >= {"explain", "benchmark", "train", "report", "api"}


def test_inputs_with_nothing_to_explain():
    tok = make_tokenizer()
    ex = Explainer(make_model("bert"), tok)
    with pytest.raises(InputError, match="input 1 has no token to explain \\(only special tokens\\)"):
        ex.explain(["good", "\u200b\u200b"], methods="rawatt")  # zero-width spaces: the tokenizer drops them
    short = Explainer(make_model("bert"), tok, max_length=3)
    with pytest.raises(InputError, match="input 0 has no token to explain after truncation to 3 tokens"):
        short.explain([("good movie", "bad film")], methods="rawatt")
    with pytest.raises(InputError, match="input 0: max_length=2 is too short for its special tokens"):
        Explainer(make_model("bert"), tok, max_length=2).explain([("good movie", "bad film")], methods="rawatt")
    (e,) = short.explain("good movie", methods="rawatt")  # one real token fits: explained
    assert e.tokens == ["[CLS]", "good", "[SEP]"]


def test_null_texts_and_labels_are_not_data(model_dir, tmp_path, capsys):
    rows = [{"text": "good movie", "label": 1}, {"text": "bad film", "label": 0}] * 2
    cases = {
        "nulltext": (rows + [{"text": None, "label": 1}], "field 'text' is null, not a text string"),
        "numtext": (rows + [{"text": 5, "label": 1}], "field 'text' is 5, not a text string"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
        line = _cli_error(["train", "--model", model_dir, "--data-file", str(path), "--no-progress",
                           "--out", str(tmp_path / "out")], capsys)
        assert f"{path}:5: {message}" in line
    path = tmp_path / "nulllabel.jsonl"  # with --text-field, rows are read by train.read_rows
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"text": "ok", "label": None}]))
    line = _cli_error(["train", "--model", model_dir, "--data-file", str(path), "--text-field", "text",
                       "--no-progress", "--out", str(tmp_path / "out")], capsys)
    assert f"{path}:5: field 'label' is null; every training row needs a label" in line
    from attnlens.data import load_dataset

    path = tmp_path / "bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"text": None, "label": 1}]))
    with pytest.raises(InputError, match="bench.jsonl:5: field 'text' is null, not a text string"):
        load_dataset(str(path))
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"text": "good", "label": 0.7}]))
    with pytest.raises(InputError, match="bench.jsonl:1: label must be an integer class id, got 0.7"):
        load_dataset(str(path))
    path.write_text(json.dumps({"text": "good", "label": 1.0}) + "\n")
    assert load_dataset(str(path)).examples[0].label == 1


# ---------------------------------------------------------------- option values judged before any model loads
BAD_OPTION_VALUES = [
    ("attcat", {"alpha": "zzz"}, "alpha='zzz'"),
    ("cat", {"hidden": "middle"}, "hidden='middle'"),
    ("flow", {"workers": 0}, "flow workers"),
    ("saliency", {"abs": "yes"}, "saliency abs"),
    ("inputxgradient", {"engine": "fast"}, "engine='fast'"),
    ("integratedgradients", {"n_steps": 0}, "n_steps must be an integer >= 1"),
    ("integratedgradients", {"baseline": "zero"}, "baseline='zero'"),
    ("partiallrp", {"layers": 1}, "partiallrp layers"),
    ("partiallrp", {"rules": "nope"}, "rules"),
    ("transatt", {"start_layer": 1.5}, "start_layer must be an integer"),
    ("attnlrp", {"rules": "chefer"}, "attnlrp takes rules"),
    ("attnnorm", {"variant": "x"}, "variant='x'"),
    ("globenc", {"normalize": "yes"}, "globenc normalize"),
    ("decompx", {"contrast": "yes"}, "decompx contrast"),
    ("valuezeroing", {"rollout": 0}, "valuezeroing rollout"),
    ("occlusion", {"perturbations_per_eval": 0}, "perturbations_per_eval"),
    ("lime", {"n_samples": 1}, "n_samples must be an integer >= 2"),
    ("kernelshap", {"seed": "a"}, "seed must be an integer"),
]


@pytest.mark.parametrize(("method", "options", "message"), BAD_OPTION_VALUES)
def test_option_values_are_judged_without_a_model(method, options, message):
    """A value no model is needed to judge is refused by the method's option check (which the command line runs
    before it loads a model), and by the explainer likewise."""
    from attnlens.methods import get_method

    with pytest.raises(InputError, match=re.escape(message)):
        get_method(method).check_options(options)


def test_every_methods_defaults_pass_its_option_check():
    from attnlens.methods import get_method, list_methods

    for name in list_methods():
        method = get_method(name)
        assert method.check_options({}) == method.options


@pytest.mark.parametrize("argv", [
    ["explain", "--methods", "attcat", "--options", '{"attcat": {"alpha": "zzz"}}', "good movie"],
    ["explain", "--methods", "integratedgradients", "--ig-steps", "0", "good movie"],
    ["cite", "--context", "A cat sat.", "--query", "Who sat?", "--methods", "loo,partiallrp",
     "--options", '{"partiallrp": {"layers": "all"}}'],
    ["benchmark", "--dataset", "sst2", "--methods", "lime", "--options", '{"lime": {"n_samples": 1}}',
     "--out", "never-written"],
])
def test_the_command_line_refuses_option_values_before_it_loads_a_model(argv, capsys, tmp_path, monkeypatch):
    """A model that does not exist is never reached: the option's line comes first, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    line = _cli_error([argv[0], "--model", str(tmp_path / "no-such-model"), *argv[1:]], capsys)
    assert "no-such-model" not in line and any(w in line for w in ("alpha", "n_steps", "layers", "n_samples"))
    assert not list(tmp_path.iterdir())


def test_texts_from_any_iterable_and_files_with_a_byte_order_mark(ex, tmp_path):
    """A numpy array of strings or a generator is a list of texts; what is no list of texts is named."""
    (a, b) = ex.explain(np.array(["good movie", "bad movie"]), methods="rawatt")
    assert (a.text, b.text) == ("good movie", "bad movie")
    assert [e.text for e in ex.explain((t for t in ["good", "bad"]), methods="rawatt")] == ["good", "bad"]
    with pytest.raises(InputError, match="^texts must be a string, a \\(text_a, text_b\\) pair or a list of them, "
                                         "got int$"):
        ex.explain(5, methods="rawatt")
    with pytest.raises(InputError, match="^no texts to explain"):
        ex.explain(t for t in [])
    path = tmp_path / "bom.json"
    path.write_text("\ufeff" + json.dumps([a.to_dict()]), encoding="utf-8")
    (back,) = load_explanations(path)
    assert back.text == "good movie"


def test_truncation_must_be_a_boolean(ex):
    with pytest.raises(InputError, match="^truncation must be True or False, got 'no'$"):
        ex.explain("good movie", methods="rawatt", truncation="no")


def test_loading_a_missing_file_or_a_folder_is_one_line(tmp_path):
    from attnlens import Explanation, load_generations

    for load in (Explanation.load, load_explanations, load_generations):
        with pytest.raises(InputError, match="no such file"):
            load(tmp_path / "none.json")
    with pytest.raises(InputError, match="it is a folder"):
        Explanation.load(tmp_path)


def test_predict_proba_warns_of_a_pair_given_without_its_token_types(ex):
    """A sentence pair's ids without their segment ids read the second text as segment 0 (other probabilities
    than the explanation's): a warning says so; with the type ids of ``encode`` the probabilities are the
    explanation's."""
    (enc,) = ex.encode([("the movie was good", "a boring plot")])
    assert enc.type_ids is not None and max(enc.type_ids) == 1
    with pytest.warns(UserWarning, match=r"input_ids\[0\] holds a sentence pair but no token_type_ids were given"):
        ex.predict_proba([enc.ids])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        typed = ex.predict_proba([enc.ids], [enc.type_ids])
        ex.predict_proba([ex.encode(["the movie"])[0].ids])  # one text: nothing to say
    (exp,) = ex.explain([("the movie was good", "a boring plot")], methods="rawatt")
    np.testing.assert_allclose(typed[0], exp.probabilities, rtol=1e-5, atol=1e-6)
