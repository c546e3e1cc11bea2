"""Rendering: nothing a user supplies can drive the terminal; truncation is said; noise stays blank."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from conftest import make_model, make_tokenizer

import attnlens.cli.explain as cli_explain
from attnlens import Explainer
from attnlens.cli import main
from attnlens.results.explanation import Explanation
from attnlens.viz import colors, plots
from attnlens.viz.html import explanations_html, layer_heatmap_html
from attnlens.viz.safetext import terminal_safe
from attnlens.viz.terminal import render_terminal

ATTACK = "\x1b[2J\x1b]0;pwned\x07"  # clear the screen, set the window title
SGR = re.compile(r"\x1b\[[0-9;]*m")  # the colour codes rich itself writes
UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


@pytest.fixture()
def model_dir(tmp_path):
    """A tiny BERT classifier on disk whose label names carry escape sequences too."""
    path = tmp_path / "model"
    model = make_model("bert")
    model.config.id2label = {0: f"neg{ATTACK}", 1: "pos\u202e"}
    model.config.label2id = {v: k for k, v in model.config.id2label.items()}
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


# ------------------------------------------------------------- terminal safety
def test_terminal_safe_escapes_controls_visibly_and_keeps_the_rest():
    assert terminal_safe(ATTACK) == "\\x1b[2J\\x1b]0;pwned\\x07"
    assert terminal_safe("a\tb\nc\rd\x7f\x9b\u202eé ✓") == "a\tb\nc\\x0dd\\x7f\\x9b\\u202eé ✓"
    assert terminal_safe("a\tb\nc", one_line=True) == "a\\tb\\nc"
    assert not UNSAFE.search(terminal_safe("".join(map(chr, range(0x2100)))))


def test_terminal_shows_zero_width_joiners_and_keeps_the_rest_of_the_line(model_dir):
    """Rich and the terminal measure an emoji family joined by U+200D differently, which cropped the tokens after
    it: the terminal shows zero-width characters as escapes (the HTML keeps them: a browser joins the family)."""
    from attnlens.viz.safetext import html_safe
    from attnlens.viz.terminal import render_terminal

    assert terminal_safe("👩\u200d👧\u200b") == "👩\\u200d👧\\u200b" and html_safe("👩\u200d👧") == "👩\u200d👧"
    ex = Explainer.from_pretrained(str(model_dir))
    (e,) = ex.explain(["good movie"], methods=["rawatt"])
    e.tokens[2] = "👩\u200d👩\u200d👧"
    shown = render_terminal(e, color=False, width=200)
    assert "good 👩\\u200d👩\\u200d👧 [SEP]" in shown and "\u200d" not in shown


def test_html_views_show_bidi_controls_and_newline_tokens_visibly(model_dir, tmp_path):
    """A bidi override in the input would make the page show other text than the tokens explained (the terminal
    escapes it, the HTML views too); a newline token is shown as ``\\n``, not a blank cell."""
    from attnlens.viz.safetext import html_safe

    assert html_safe("<b>\u202e\n") == "&lt;b&gt;\\u202e\n" and html_safe("\n", one_line=True) == "\\n"
    # a page reads a carriage return as a line break (a context with Windows line endings); a token shows it
    assert html_safe("a\r\nb\rc\x1b") == "a\r\nb\rc\\x1b" and html_safe("\r\n", one_line=True) == "\\x0d\\n"
    ex = Explainer.from_pretrained(str(model_dir))
    (e,) = ex.explain(["good \u202egnihtyreve tuoba dab\u202c movie"], methods=["rawatt"])
    page = explanations_html([e])
    assert not UNSAFE.search(page) and "\\u202e" in page
    e.tokens[2] = "\n"  # a tokenizer's newline token
    assert '>\\n</span>' in explanations_html([e])


def test_plots_and_top_token_tables_show_newlines_spaces_and_bidi_controls_visibly(model_dir):
    """Tick labels, titles and the top-token tables escape what the token views escape: a newline token reads
    ``\\n``, a bidi override its escape (it would draw the title's text, or a probability, backwards), a token of
    spaces ``␣``."""
    ex = Explainer.from_pretrained(str(model_dir))
    (e,) = ex.explain(["good \u202egnihtyreve tuoba dab\u202c movie"], methods=["rawatt"])
    e.tokens[1], e.tokens[2] = "\n", " "
    e.scores["rawatt"][1:3] = [0.9, 0.8]  # the two strongest tokens
    fig = plots.plot_token_heatmap(e)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels[1] == "\\n" and not any(UNSAFE.search(t) or "\n" in t for t in labels)
    title = fig.axes[0].get_title(loc="left")
    assert "\\u202e" in title and "\u202e" not in title
    page = explanations_html([e])
    top = page.split('<table class="top">')[1].split("</table>")[0]
    assert "\\n +0.9 · ␣ +0.8" in top
    assert "\\n +0.9 · ␣ +0.8" in render_terminal(e, width=200)


def test_cli_terminal_output_carries_no_control_bytes(model_dir, capsys):
    text = f"the movie was good {ATTACK} [bold]really[/bold]"
    assert main(["explain", text, "--model", str(model_dir), "--methods", "rawatt,attcat"]) == 0
    captured = capsys.readouterr()
    for stream in (captured.out, captured.err):
        assert "\x1b" not in stream and "\x07" not in stream and "\u202e" not in stream
    # escaped visibly, nothing lost: the text, the label names, and rich markup shown as typed
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in captured.out
    assert "neg\\x1b[2J" in captured.out or "pos\\u202e" in captured.out
    assert "[bold]really[/bold]" in captured.out


def test_colour_output_has_only_colour_codes(model_dir):
    exp = Explainer.from_pretrained(model_dir).explain(f"good {ATTACK} movie", methods=["rawatt"])[0]
    exp.tokens[1] = f"tok{ATTACK}"  # tokenizers that keep control characters in their tokens
    out = render_terminal(exp, color=True)
    assert SGR.search(out)  # coloured, yet nothing but colour codes is a terminal command
    assert not UNSAFE.search(SGR.sub("", out))
    assert "tok\\x1b[2J" in out


def test_cli_error_line_and_wrote_lines_are_escaped(model_dir, tmp_path, capsys):
    assert main(["explain", "good", "--model", str(tmp_path / f"missing{ATTACK}")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlens: error: ") and err.count("\n") == 1
    assert "\x1b" not in err and "\x07" not in err and "missing\\x1b[2J" in err
    page = tmp_path / f"page{ATTACK}.html"
    assert main(["explain", "good", "--model", str(model_dir), "--methods", "rawatt", "--format", "html",
                 "--out", str(page)]) == 0
    err = capsys.readouterr().err
    assert page.exists() and "\x1b" not in err and f"wrote {terminal_safe(str(page))}" in err


def test_cli_warnings_are_escaped_and_the_hook_is_undone(monkeypatch):
    seen = {}

    def run(args):
        seen["line"] = warnings.formatwarning(f"label {ATTACK}", UserWarning, "x.py", 1)
        return 0

    original = warnings.formatwarning
    monkeypatch.setattr(cli_explain, "run", run)
    assert main(["explain", "x"]) == 0
    assert "label \\x1b[2J\\x1b]0;pwned\\x07" in seen["line"] and "\x1b" not in seen["line"]
    assert warnings.formatwarning is original


# ----------------------------------------------------------------- truncation
TEXT = "the movie was good but the plot was boring and the story was dull"


def test_truncated_input_shows_what_was_explained_and_how_much_was_cut(model_dir):
    with pytest.warns(UserWarning, match="8 tokens dropped"):
        exp = Explainer.from_pretrained(model_dir, max_length=8).explain(TEXT, methods=["rawatt"])[0]
    assert exp.meta["truncated_tokens"] == 8  # 14 words + [CLS] [SEP] = 16 tokens, 8 kept
    kept, cut = colors.explained_text(exp)
    assert kept == " ".join(t for t, s in zip(exp.tokens, exp.special, strict=True) if not s)
    assert kept == "the movie was good but the" and cut == "plot was boring and the story was dull"
    out = render_terminal(exp, color=False)
    assert "input truncated: 8 tokens" in out and "boring" not in out
    page = explanations_html(exp)
    assert '<p class="text">the movie was good but the</p>' in page
    assert ("input truncated: 8 tokens beyond the longest input (the model&#x27;s, or the max_length set) were "
            "cut") in page
    assert re.search(r"<summary>text not explained</summary><p class=\"cut\">plot was boring", page)
    assert "input truncated: 8 tokens" in plots.plot_token_heatmap(exp).axes[0].get_title(loc="left")
    # an input that fits says nothing of the kind
    whole = Explainer.from_pretrained(model_dir).explain(TEXT, methods=["rawatt"])[0]
    assert "input truncated" not in render_terminal(whole, color=False) + explanations_html(whole)
    assert "input truncated" not in plots.plot_token_heatmap(whole).axes[0].get_title(loc="left")
    assert f'<p class="text">{TEXT}</p>' in explanations_html(whole)


def test_truncated_pair_is_cut_per_side(model_dir):
    with pytest.warns(UserWarning, match="truncated"):
        exp = Explainer.from_pretrained(model_dir, max_length=9).explain(
            [("the movie was good", "but the plot was boring and the story was dull")], methods=["rawatt"])[0]
    kept, cut = colors.explained_text(exp)
    words = [t for t, s in zip(exp.tokens, exp.special, strict=True) if not s]
    assert kept.replace(" [SEP] ", " ").split() == words
    assert (kept + " " + cut).replace(" [SEP] ", " ").split()[: len(words)] == words
    assert exp.meta["truncated_tokens"] == len(cut.replace(" [SEP] ", " ").split())


# ----------------------------------------------------------------- noise floor
def _noisy_exp() -> Explanation:
    layers = np.array(
        [
            [0.0, 0.8, -0.4, 0.2, 0.0],
            [0.0, 3e-12, -2e-12, 1e-12, 0.0],  # numerical noise
            [0.0, 0.01, 0.005, -0.002, 0.0],  # small but real
        ]
    )
    return Explanation(text="a b c", tokens=["[CLS]", "a", "b", "c", "[SEP]"],
                       special=[True, False, False, False, True], target=1, predicted=1,
                       probabilities=[0.4, 0.6], scores={"attcat": layers.sum(0)}, layers={"attcat": layers})


def test_noise_rows_normalise_to_blank_and_real_small_rows_stay_visible():
    exp = _noisy_exp()
    names, rows = colors.layer_rows(exp.layers["attcat"])
    norm = colors.normalized_layer_rows(rows, exp.special)
    assert np.abs(norm[1]).max() < 1e-6  # not 1.0 (3e-12 divided by itself)
    assert colors.shade(norm[1, 1]) == colors.NEUTRAL_RGB
    np.testing.assert_allclose(norm[2], [0.0, 1.0, 0.5, -0.2, 0.0])  # each real row still by its own peak
    np.testing.assert_allclose(norm[0], [0.0, 1.0, -0.5, 0.25, 0.0])
    assert np.abs(norm[names.index("rollout")]).max() < 1e-6  # a product with a noise layer is noise
    clean = colors.normalized_layer_rows(colors.layer_rows(exp.layers["attcat"][[0, 2]])[1], exp.special)
    np.testing.assert_allclose(clean[-1], [0.0, 1.0, -0.25, -0.05, 0.0])  # else rollout by its own peak
    # a row of noise alone (no reference) is blank through the absolute floor
    assert np.abs(colors.normalized(np.array([3e-13, -1e-13]))).max() < 0.5


def test_noise_row_is_white_in_html_and_in_the_plot():
    exp = _noisy_exp()
    table = layer_heatmap_html(exp, "attcat")
    noise_row = re.search(r'<th class="row">L1</th>(.*?)</tr>', table).group(1)
    assert noise_row.count("background:#ffffff") == 3 and "+0.00" in noise_row
    fig = plots.plot_layer_heatmap(exp, "attcat")
    shown = fig.axes[0].images[0].get_array()
    assert np.abs(shown[1, 1:4]).max() < 1e-6 and shown[0, 1] == 1.0
