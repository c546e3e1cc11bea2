"""``attnlens explain``: output contract, input files and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import make_model, make_tokenizer

from attnlens.cli import main

CONTRACT = ["text", "tokens", "special", "target", "predicted", "probabilities", "scores", "layers"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bert")
    model = make_model("bert")
    model.config.id2label = {0: "negative", 1: "positive"}
    model.config.label2id = {"negative": 0, "positive": 1}
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


def test_jsonl_contract(model_dir, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("the movie was great\n\ni didn't like it\n", encoding="utf-8")
    code = main(["explain", "--model", model_dir, "--methods", "rawatt,attcat", "--format", "jsonl",
                 "--file", str(texts)])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["text"] for d in lines] == ["the movie was great", "i didn't like it"]
    for d in lines:
        for key in CONTRACT:
            assert key in d
        assert set(d["scores"]) == {"rawatt", "attcat"}
        assert len(d["scores"]["attcat"]) == len(d["tokens"]) == len(d["special"])
        assert len(d["layers"]["attcat"]) == 2 and len(d["layers"]["attcat"][0]) == len(d["tokens"])
        assert d["target"] == d["predicted"]


def test_json_pairs_target_and_out_file(model_dir, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"text_a": "the movie", "text_b": "was great"}) + "\n"
                     + json.dumps({"text": "a single text"}) + "\n", encoding="utf-8")
    out = tmp_path / "out.json"
    code = main(["explain", "--model", model_dir, "--methods", "agrad", "--target", "positive", "--format", "json",
                 "--file", str(pairs), "--out", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data[0]["text"] == ["the movie", "was great"] and data[1]["text"] == "a single text"
    assert all(d["target"] == 1 for d in data)
    assert capsys.readouterr().err.strip().endswith(f"wrote {out}")  # the file is named, as html and plots are


def test_terminal_html_and_plot(model_dir, tmp_path, capsys):
    html = tmp_path / "page.html"
    png = tmp_path / "heatmap.png"
    code = main(["explain", "the movie was <script>alert(1)</script> great", "--model", model_dir,
                 "--methods", "rollout,attcat", "--html", str(html), "--words", "--plot", str(png)])
    assert code == 0
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 300 and image[..., :3].std() > 0.05  # a real picture
    out = capsys.readouterr().out
    assert "attcat" in out and "rollout" in out
    page = html.read_text()
    assert "<script>alert" not in page and "&lt;script&gt;" in page


def test_top_k_sets_the_html_table_too(model_dir, tmp_path, capsys):
    """``--top-k`` sizes the HTML page's table of top tokens as it does the terminal's, with ``--html`` and with
    ``--format html``, and beside JSON."""
    for extra in (["--html", str(tmp_path / "a.html")], ["--format", "html", "--out", str(tmp_path / "b.html")],
                  ["--format", "json", "--out", str(tmp_path / "c.json"), "--html", str(tmp_path / "c.html")]):
        assert main(["explain", "the movie was great and long", "--model", model_dir, "--methods", "rollout",
                     "--top-k", "2", *extra]) == 0
        page = (tmp_path / extra[-1].rsplit("/", 1)[-1]).read_text()
        assert "top 2 for" in page and "top 5 for" not in page
    capsys.readouterr()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["explain", "x", "--model", "/nonexistent/model"], "model directory not found"),
        (["explain", "x", "--model", __file__], f"{__file__} is a file; a model is a directory holding"),
        (["explain", "--file", "/nonexistent.txt"], "no such file"),
        (["explain", "good", "--methods", "nope"], "unknown method 'nope'; available methods: rawatt"),
        (["explain", "good", "--target", "7"], "out of range"),
        (["explain"], "nothing to explain"),
    ],
)
def test_errors_are_one_line(model_dir, argv, message, capsys):
    if "--model" not in argv:
        argv = argv + ["--model", model_dir]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_model_from_the_environment_or_one_line_naming_both(model_dir, monkeypatch, capsys):
    monkeypatch.delenv("ATTNLENS_MODEL", raising=False)
    assert main(["explain", "good", "--methods", "rawatt"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("no model: pass --model M or set $ATTNLENS_MODEL") and len(err.splitlines()) == 1
    monkeypatch.setenv("ATTNLENS_MODEL", model_dir)
    assert main(["explain", "good", "--methods", "rawatt", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["tokens"] == ["[CLS]", "good", "[SEP]"]


def test_bad_files(model_dir, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    assert main(["explain", "--model", model_dir, "--file", str(empty)]) == 2
    assert "holds no texts" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"review": "no text field"}\n', encoding="utf-8")
    assert main(["explain", "--model", model_dir, "--file", str(bad)]) == 2
    assert 'line 2: no "text"' in capsys.readouterr().err


@pytest.mark.parametrize("separator", ["\x0c", "\u2028", "\u2029", "\x85", "\x0b", "\x1e"])
def test_a_file_is_split_at_newlines_only(tmp_path, separator):
    """Unicode line separators, form feeds and the like stay inside a text (str.splitlines breaks there)."""
    from attnlens.cli.explain import read_texts

    plain = tmp_path / "plain.txt"
    plain.write_text(f"the plot was thin{separator}but i loved it\r\nsecond review\rthird\n", encoding="utf-8")
    assert read_texts(str(plain)) == [f"the plot was thin{separator}but i loved it", "second review", "third"]
    lines = tmp_path / "lines.jsonl"
    lines.write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in (f"a{separator}b", "c")) + "\n",
                     encoding="utf-8")
    assert read_texts(str(lines)) == [f"a{separator}b", "c"]


@pytest.mark.parametrize(("line", "message"), [
    ({"text": "x", "text_a": "y", "text_b": "z"}, 'holds both "text" and "text_a"; give one text or one pair'),
    ({"text": 5}, "field 'text' is 5, not a text string"),
    ({"text": ["a", "b"]}, "field 'text' is [\"a\", \"b\"], not a text string"),
    ({"text_b": "only"}, '"text_b" without "text_a"; a pair needs both'),
    ({"text_a": "a", "text_b": None}, "field 'text_b' is null, not a text string"),
    ({"text": "   "}, "the text is empty or whitespace only"),
    ({"hypothesis": "h"}, '"hypothesis" without "premise"; a pair needs both'),
    ({"premise": "p", "hypothesis": "h", "question1": "q", "question2": "r"},
     "holds two pairs (premise/hypothesis and question1/question2); give one"),
    ({"label": 1}, 'no "text" field (or a pair: text_a/text_b, premise/hypothesis, question1/question2, '
                   'sentence1/sentence2, question/context)'),
])
def test_a_json_line_that_is_not_one_text_or_one_pair_is_named(model_dir, tmp_path, capsys, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps(line) + "\n", encoding="utf-8")
    assert main(["explain", "--model", model_dir, "--file", str(bad), "--methods", "rawatt"]) == 2
    assert capsys.readouterr().err.strip() == f"attnlens: error: --file {bad}, line 2: {message}"


def test_a_file_names_its_pairs_as_data_sets_do(tmp_path):
    """``--file`` reads a sentence pair under any of the field names ``load_dataset`` reads (MNLI's premise and
    hypothesis, QQP's question1 and question2, ...), in the file's order."""
    from attnlens.cli.explain import read_texts
    from attnlens.data import PAIR_KEYS

    rows = [{a: f"first {a}", b: f"second {b}", "label": 0} for a, b in PAIR_KEYS] + [{"text": "alone"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    assert read_texts(str(path)) == [(f"first {a}", f"second {b}") for a, b in PAIR_KEYS] + ["alone"]


def test_debug_shows_the_traceback(model_dir):
    from attnlens import InputError

    with pytest.raises(InputError):
        main(["--debug", "explain", "good", "--model", model_dir, "--methods", "nope"])


@pytest.mark.parametrize("fmt", ["json", "jsonl", "html"])
def test_out_dash_writes_the_document_to_standard_output(model_dir, tmp_path, capsys, monkeypatch, fmt):
    monkeypatch.chdir(tmp_path)
    assert main(["explain", "the movie was great", "--model", model_dir, "--methods", "rawatt", "--format", fmt,
                 "--out", "-"]) == 0
    captured = capsys.readouterr()
    assert list(tmp_path.iterdir()) == [] and "wrote" not in captured.err
    if fmt == "html":
        assert captured.out.lstrip().startswith("<!DOCTYPE html>") and "rawatt" in captured.out
    else:
        doc = json.loads(captured.out)
        assert (doc[0] if fmt == "json" else doc)["text"] == "the movie was great"


@pytest.mark.parametrize("argv", [
    ["explain", "good", "--html", "-"], ["explain", "good", "--plot", "-"],
    ["benchmark", "--dataset", "sst2", "--out", "-"], ["train", "--dataset", "sst2", "--out", "-"],
    ["report", "results", "--out", "-"],
])
def test_dash_is_refused_where_an_output_must_be_a_file_or_folder(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    assert main([*argv, "--model", str(tmp_path / "none")] if argv[0] != "report" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("attnlens: error:") and " -: give a " in err and "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


PLUGIN = '''
from attnlens import register
from attnlens.methods.registry import HIDDEN, MethodOutput


@register("hiddennorm", needs={HIDDEN}, summary="The last hidden state's norm.", citation="-")
def hiddennorm(ctx, scale: float = 1.0):
    return MethodOutput(scale * ctx.capture.hidden[-1].norm(dim=-1), space="tokens")
'''


def test_a_method_of_ones_own_runs_from_the_command_line_through_the_plugins_variable(model_dir, tmp_path, capsys,
                                                                                       monkeypatch):
    from attnlens.methods import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    plugin = tmp_path / "my_methods.py"
    plugin.write_text(PLUGIN, encoding="utf-8")
    argv = ["explain", "--model", model_dir, "--methods", "hiddennorm,rawatt", "--options",
            '{"hiddennorm": {"scale": 2}}', "--format", "json", "the movie was great"]
    assert main(argv) == 2
    assert "unknown method 'hiddennorm'" in capsys.readouterr().err
    monkeypatch.setenv("ATTNLENS_PLUGINS", str(plugin))
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert set(row["scores"]) == {"hiddennorm", "rawatt"}
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():  # the method's formula, computed here from the model's own hidden states (scale 2)
        hidden = model(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states[-1]
    np.testing.assert_allclose(row["scores"]["hiddennorm"], 2 * hidden[0].norm(dim=-1).numpy(), rtol=1e-5)
    assert main(argv) == 0  # a second command in the process finds the plugin imported
    capsys.readouterr()
    monkeypatch.setenv("ATTNLENS_PLUGINS", f"{plugin},no_such_module_here")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "$ATTNLENS_PLUGINS names no_such_module_here, which does not import" in err
