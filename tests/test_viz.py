"""Terminal, HTML and matplotlib renderers: rendered output is inspected, not just produced."""

from __future__ import annotations

import io
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
from rich.console import Console

from attnlens.errors import InputError
from attnlens.results.explanation import Explanation
from attnlens.viz import colors, plots
from attnlens.viz.html import explanations_html
from attnlens.viz.terminal import render_terminal

SUMMARY = Path(__file__).parent / "data" / "benchmark_summary.json"
XSS = "<script>alert('x')</script>"


def make_exp(text: str = f"not a good film {XSS}") -> Explanation:
    tokens = ["[CLS]", "not", "a", "good", "film", "<script>", "[SEP]"]
    layers = np.array(
        [
            [0.0, -0.2, 0.1, 0.4, 0.1, 0.0, 0.0],
            [9.0, -1.0, 0.2, 0.8, -0.1, 0.05, 3.0],
            [0.0, 0.5, 0.5, 1.0, 0.2, 0.1, 0.0],
        ]
    )
    return Explanation(
        text=text,
        tokens=tokens,
        special=[True, False, False, False, False, False, True],
        target=1,
        predicted=0,
        probabilities=[0.7, 0.3],
        labels=["negative", "positive"],
        scores={
            "attcat": np.array([5.0, -0.8, 0.1, 0.4, 0.2, -0.1, 2.0]),
            "rawatt": np.array([0.3, 0.1, 0.05, 0.2, 0.1, 0.05, 0.2]),
        },
        layers={"attcat": layers},
        word_ids=[None, 0, 1, 2, 3, 4, None],
    )


# ------------------------------------------------------------------ colours
def test_normalized_ignores_special_tokens_and_keeps_nan_apart():
    norm = colors.normalized(np.array([5.0, -0.8, np.nan, 0.4]), [True, False, False, False])
    np.testing.assert_allclose(norm, [0.0, -1.0, np.nan, 0.5])
    assert not colors.normalized(np.zeros(3)).any()
    assert colors.shade(np.nan) == colors.NAN_RGB not in (colors.shade(0.0), colors.shade(1.0), colors.shade(-1.0))


def test_infinite_scores_are_drawn_full_and_the_others_relative_to_the_largest_finite_one():
    """+inf is full green and -inf full red (as their rank says), and the finite scores keep their shades
    relative to the largest finite one, not blown to full colour."""
    norm = colors.normalized(np.array([0.0, np.inf, 2.0, -1.0, -np.inf, 0.0]), [True] + [False] * 4 + [True])
    np.testing.assert_allclose(norm, [0.0, 1.0, 1.0, -0.5, -1.0, 0.0])
    exp = Explanation(text="a b c d", tokens=["[CLS]", "a", "b", "c", "d", "[SEP]"], special=[True] + [False] * 4
                      + [True], target=1, predicted=1, probabilities=[0.2, 0.8], labels=["neg", "pos"],
                      scores={"m": np.array([0.0, 1e30, 1e-30, 0.0, np.inf, 0.0])})
    page = explanations_html(exp)
    colours = dict((tip, colour) for colour, tip in re.findall(r'style="background:(#\w+)" title="([^"]+)"', page))
    assert colours["+inf"] == colours["+1e+30"] == colors.hex_color(colors.POSITIVE_RGB)
    assert colours["+1e-30"] == "#ffffff" and "inf at full intensity" in page


def test_nan_scores_are_grey_and_read_nan_in_every_view(tmp_path):
    """A NaN score is neither drawn nor printed as a zero: grey in the token views and the layer grid, ``nan`` in
    the grid's and the plot's numbers, and the page's legend says so."""
    exp = Explanation(text="a b c", tokens=["[CLS]", "a", "b", "c", "[SEP]"], special=[True, False, False, False, True],
                      target=1, predicted=1, probabilities=[0.2, 0.8], labels=["neg", "pos"],
                      scores={"m": np.array([0.0, np.nan, 0.5, -1.0, 0.0])},
                      layers={"m": np.array([[0.0, np.nan, 0.2, -0.5, 0.0], [0.0, 0.1, 0.3, -0.5, 0.0]])})
    grey = colors.hex_color(colors.NAN_RGB)
    page = explanations_html(exp)
    cells = re.findall(r'style="background:(#\w+)" title="([^"]+)">([^<]*)<', page)
    assert (grey, "+nan", "a") in cells and (grey, "+nan", "nan") in cells
    assert not any(tip == "+nan" and colour != grey for colour, tip, _ in cells)
    assert "not a number" in page
    assert "48;2;{};{};{}m".format(*colors.NAN_RGB) in render_terminal(exp, color=True)  # token a's background
    fig = plots.plot_token_heatmap(exp, annotate=True)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts[0] == "nan" and "0.00" not in texts
    assert [p.get_facecolor()[:3] for p in fig.axes[0].patches] == [tuple(c / 255 for c in colors.NAN_RGB)]


def test_tied_negative_tokens_are_listed_in_token_order_as_the_positive_ones():
    exp = Explanation(text="a b c d e", tokens=["[CLS]", "a", "b", "c", "d", "e", "[SEP]"],
                      special=[True] + [False] * 5 + [True], target=1, predicted=1, probabilities=[0.2, 0.8],
                      labels=["neg", "pos"], scores={"m": np.array([0.0, -0.5, -0.5, -0.5, 0.5, 0.5, 0.0])})
    pos, neg = colors.top_split(exp, "m", 1)
    assert pos == [("d", 0.5)] and neg == [("a", -0.5)]
    assert colors.top_split(exp, "m", 5)[1] == [("a", -0.5), ("b", -0.5), ("c", -0.5)]


def test_a_text_that_stands_twice_is_listed_with_its_occurrence_in_every_view():
    exp = Explanation(text="the best of the best", tokens=["[CLS]", "the", "best", "of", "the", "best", "[SEP]"],
                      special=[True] + [False] * 5 + [True], target=1, predicted=1, probabilities=[0.2, 0.8],
                      labels=["neg", "pos"], scores={"m": np.array([0.0, -0.1, 0.3, 0.05, -0.2, 0.2, 0.0])})
    pos, neg = colors.top_split(exp, "m", 5)
    assert pos == [("best#1", 0.3), ("best#2", 0.2), ("of", 0.05)]
    assert neg == [("the#2", -0.2), ("the#1", -0.1)]
    assert "best#1" in render_terminal(exp) and "best#2" in explanations_html(exp)
    alone = Explanation(text="a b", tokens=["[CLS]", "a", "b", "[SEP]"], special=[True, False, False, True],
                        target=1, predicted=1, probabilities=[0.2, 0.8], scores={"m": np.array([0, 1.0, 2, 0])})
    assert colors.top_split(alone, "m", 5)[0] == [("b", 2.0), ("a", 1.0)]  # a text that stands once keeps its form


def test_a_16_colour_terminal_keeps_the_order_of_the_shades_in_steps_of_emphasis():
    import io

    from rich.console import Console

    from attnlens.viz.terminal import explanation_renderable, token_style

    scores = [0.05, -0.05, 0.2, -0.2, 0.5, -0.5, 1.0, -1.0]
    words = [f"w{i}" for i in range(len(scores))]
    exp = Explanation(text=" ".join(words), tokens=["[CLS]", *words, "[SEP]"], special=[True, *[False] * 8, True],
                      target=1, predicted=1, probabilities=[0.2, 0.8], scores={"m": np.array([0.0, *scores, 0.0])})

    def printed(system):
        out = io.StringIO()
        Console(file=out, force_terminal=True, color_system=system, width=200).print(explanation_renderable(exp))
        return out.getvalue()

    standard = printed("standard")
    assert "48;2;" not in standard and "38;2;" not in standard  # no 24-bit colour where 16 colours are promised
    styles = [token_style(v, few_colours=True) for v in scores]
    for weaker, stronger in ((0, 2), (2, 4), (4, 6)):  # each step adds emphasis, for and against
        for sign in (0, 1):
            a, b = styles[weaker + sign], styles[stronger + sign]
            assert (a.bgcolor, a.bold, a.color) != (b.bgcolor, b.bold, b.color)
    assert styles[0] == token_style(0.0, few_colours=True)  # below the first step: as unscored
    assert styles[2].color.name == "green" and styles[3].color.name == "red" and not styles[2].bold
    assert styles[4].bold and styles[6].bgcolor.name == "green" and styles[7].bgcolor.name == "red"
    for step, word in ((styles[4], "w4"), (styles[7], "w7")):  # drawn with its own step's codes
        assert step.render(word, color_system=Console(color_system="standard").color_system) in standard
    assert "48;2;" in printed("truecolor")


def test_shade_endpoints():
    assert colors.shade(0.0) == (255, 255, 255)
    assert colors.shade(1.0) == colors.POSITIVE_RGB
    assert colors.shade(-1.0) == colors.NEGATIVE_RGB
    r, g, b = colors.shade(0.5)  # halfway between white and green
    assert (r, g, b) == tuple(round(255 + (c - 255) * 0.5) for c in colors.POSITIVE_RGB)


def test_layer_rows_sum_and_rollout():
    names, rows = colors.layer_rows(np.array([[1.0, -2.0], [3.0, 0.5]]))
    assert names == ["L0", "L1", "sum", "rollout"]
    np.testing.assert_allclose(rows[2], [4.0, -1.5])
    np.testing.assert_allclose(rows[3], [3.0, -1.0])


def test_unknown_method_is_an_input_error():
    with pytest.raises(InputError, match="nope"):
        render_terminal(make_exp(), methods=["nope"])


# ----------------------------------------------------------------- terminal
def test_terminal_plain_text_lists_tokens_and_top_table():
    out = render_terminal(make_exp(), color=False)
    assert "predicted negative (0.700), explaining positive" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("attcat "))
    assert "[CLS] not a good film <script> [SEP]" in line
    table_row = [ln for ln in out.splitlines() if ln.startswith("attcat ")][1]
    # top "for" ranks good > film > a (special [CLS] and [SEP] never ranked); "against": not, then <script>
    assert re.search(r"good \+0\.4 · film \+0\.2 · a \+0\.1\s+not -0\.8 · <script> -0\.1", table_row)


def test_terminal_colours_follow_sign_and_magnitude():
    out = render_terminal(make_exp(), methods=["attcat"], color=True)
    # "not" has the largest |score| of the non-special tokens and is negative: full red background
    r, g, b = colors.NEGATIVE_RGB
    assert re.search(rf"48;2;{r};{g};{b}mnot\x1b", out)
    # "good" = 0.4 / 0.8 = half green
    gr = colors.shade(0.5)
    assert re.search(rf"48;2;{gr[0]};{gr[1]};{gr[2]}mgood\x1b", out)
    # special tokens are dimmed, not shaded
    assert re.search(r"\x1b\[2m\[CLS\]\x1b\[0m", out)


def test_terminal_words_aggregates_subwords():
    exp = Explanation(
        text="unbelievable",
        tokens=["[CLS]", "un", "##believ", "##able", "[SEP]"],
        special=[True, False, False, False, True],
        target=0,
        predicted=0,
        probabilities=[1.0],
        scores={"m": np.array([0.0, 0.1, 0.2, 0.3, 0.0])},
    )
    out = render_terminal(exp, words=True, color=False)
    assert "unbelievable +0.6" in out


# --------------------------------------------------------------------- HTML
class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []
        self.cell_styles: list[tuple[str, str]] = []
        self._style = ""

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self._style = dict(attrs).get("style") or ""

    def handle_data(self, data):
        self.text.append(data)
        if self._style and data.strip():
            self.cell_styles.append((data.strip(), self._style))
        self._style = ""


def test_html_escapes_script_and_renders_it_as_text():
    page = explanations_html([make_exp()], title="<b>t</b>")
    assert "<script>" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    parser = _Collector()
    parser.feed(page)
    assert "script" not in parser.tags and "b" not in parser.tags
    assert XSS in "".join(parser.text)  # the browser shows the text as written
    assert parser.tags.count("html") == 1 and "style" in parser.tags


def test_html_stacks_methods_and_colours_tokens():
    page = explanations_html([make_exp(), make_exp("second")], methods=["rawatt", "attcat"])
    assert page.count('class="example"') == 2
    first = page.split('class="example"')[1]
    assert first.index(">rawatt<") < first.index(">attcat<")
    parser = _Collector()
    parser.feed(first)
    styles = dict(parser.cell_styles[:5])  # the rawatt row comes first: film/good shading
    assert styles["good"] == f"background:{colors.hex_color(colors.POSITIVE_RGB)}"
    red = colors.hex_color(colors.NEGATIVE_RGB)
    assert ("not", f"background:{red}") in parser.cell_styles  # attcat's "not" = -max


def _additive_exp() -> Explanation:
    """make_exp with AttCAT's scores the sum of its layers, as AttCAT's are."""
    exp = make_exp()
    exp.scores["attcat"] = exp.layers["attcat"].sum(0)
    return exp


def test_layer_rows_give_sum_and_rollout_only_where_the_layers_add_up_to_the_scores():
    """A method whose layers are each layer's own state (raw attention per layer, the rollout so far): a sum or
    product row would contradict its scores."""
    layers = np.array([[0.2, 0.8], [0.6, 0.4]])
    names, rows = colors.layer_rows(layers, scores=np.array([0.6, 0.4]))  # the score is the last layer
    assert names == ["L0", "L1"]
    np.testing.assert_array_equal(rows, layers)
    assert colors.layer_rows(layers, scores=np.array([0.8, 1.2]))[0] == ["L0", "L1", "sum", "rollout"]
    exp = make_exp()  # its AttCAT scores are not its layers' sum
    page = explanations_html(exp)
    assert '<th class="row">L2</th>' in page and '<th class="row">sum</th>' not in page
    fig = plots.plot_layer_heatmap(exp, "attcat")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["L0", "L1", "L2"]


def test_html_layer_heatmap_has_rows_per_layer_sum_and_rollout():
    page = explanations_html(_additive_exp())
    for name in ("L0", "L1", "L2", "sum", "rollout"):
        assert f'<th class="row">{name}</th>' in page
    grid = page.split('class="grid"')[1]
    sum_row = grid.split(">sum</th>")[1].split("</tr>")[0]
    # sum over layers of "good" = 2.2, the largest non-special |value|: +1.00, full green; [CLS] blank
    assert f'background:{colors.hex_color(colors.POSITIVE_RGB)}" title="+2.2">+1.00' in sum_row
    assert sum_row.count('<td class="special"></td>') == 2


def test_html_words_option():
    exp = make_exp()
    page = explanations_html(exp, words=True)
    assert ">film<" in page


# -------------------------------------------------------------------- plots
def _assert_png(path: Path, min_size: tuple[int, int] = (200, 200)) -> np.ndarray:
    assert path.exists() and path.stat().st_size > 5000
    img = mpimg.imread(path)
    assert img.shape[0] >= min_size[0] and img.shape[1] >= min_size[1]
    rgb = img[..., :3]
    assert rgb.std() > 0.05  # not blank
    return rgb


def _has_colour(rgb: np.ndarray, color: tuple[int, int, int], tol: float = 0.03) -> bool:
    target = np.array(color) / 255
    return bool((np.abs(rgb - target).max(-1) < tol).any())


def test_token_heatmap_png(tmp_path):
    out = tmp_path / "heat.png"
    plots.plot_token_heatmap(make_exp(), path=out)
    rgb = _assert_png(out)
    assert _has_colour(rgb, colors.POSITIVE_RGB) and _has_colour(rgb, colors.NEGATIVE_RGB)


def test_layer_heatmap_png_and_svg(tmp_path):
    png = tmp_path / "layers.png"
    plots.plot_layer_heatmap(make_exp(), "attcat", path=png)
    rgb = _assert_png(png)
    assert _has_colour(rgb, colors.NEGATIVE_RGB)
    svg = tmp_path / "layers.svg"
    plots.plot_layer_heatmap(make_exp(), "attcat", path=svg)
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    with pytest.raises(InputError, match="per-layer"):
        plots.plot_layer_heatmap(make_exp(), "rawatt")


def test_attention_head_png_and_validation(tmp_path):
    n = 7
    att = np.zeros((2, 3, n, n))
    att[1, 2] = np.eye(n)  # layer 1 head 2: every token attends to itself
    out = tmp_path / "head.png"
    fig = plots.plot_attention_head(make_exp().tokens, att, layer=1, head=2, path=out)
    rgb = _assert_png(out)
    image = fig.axes[0].images[0].get_array()
    np.testing.assert_allclose(np.asarray(image), np.eye(n))
    assert (rgb.min(-1) < 0.2).any()  # dark diagonal cells
    mean = plots.plot_attention_head(make_exp().tokens, att, layer=1, head=None)
    np.testing.assert_allclose(np.asarray(mean.axes[0].images[0].get_array()), np.eye(n) / 3)
    with pytest.raises(InputError, match="layer 5"):
        plots.plot_attention_head(make_exp().tokens, att, layer=5, head=0)
    with pytest.raises(InputError, match="shape"):
        plots.plot_attention_head(make_exp().tokens, att[0], layer=0, head=0)
    with pytest.raises(InputError, match="tokens"):
        plots.plot_attention_head(["a"], att, layer=0, head=0)


def test_bad_extension_is_refused(tmp_path):
    with pytest.raises(InputError, match=".png or .svg"):
        plots.plot_token_heatmap(make_exp(), path=tmp_path / "x.gif")


def test_dollar_signs_are_not_mathtext(tmp_path):
    exp = make_exp("costs $5 and $6")
    exp.tokens[2] = "$5"
    exp.tokens[3] = "$6"
    plots.plot_token_heatmap(exp, path=tmp_path / "d.png")
    _assert_png(tmp_path / "d.png")


@pytest.fixture
def summary() -> dict:
    return json.loads(SUMMARY.read_text())


def test_occlusion_curves_png(tmp_path, summary):
    out = tmp_path / "occ.png"
    fig = plots.plot_occlusion_curves(summary, path=out)
    _assert_png(out)
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert set(lines) == set(summary["curves"]["occlusion"]["series"])
    np.testing.assert_allclose(
        lines["agrad:top"].get_ydata(), summary["curves"]["occlusion"]["series"]["agrad:top"]["relative"]
    )
    absolute = plots.plot_occlusion_curves(summary, relative=False, series=["random"])
    assert absolute.axes[0].get_ylabel() == "accuracy"
    with pytest.raises(InputError, match="unknown occlusion series"):
        plots.plot_occlusion_curves(summary, series=["nope:top"])


def test_metric_bars_mark_best_and_missing(tmp_path, summary):
    out = tmp_path / "bars.png"
    fig = plots.plot_metric_bars(summary, path=out)
    _assert_png(out, (150, 600))
    assert len(fig.axes) == 3
    assert plots.best_methods(summary, "aopc") == ["attcat"]  # highest AOPC
    assert plots.best_methods(summary, "lodds") == ["attcat"]  # lowest LOdds
    kendall_ax = fig.axes[2]
    assert "lower is better" in kendall_ax.get_title()
    assert any(t.get_text().strip() == "n/a" for t in kendall_ax.texts)  # rawatt has no Kendall-tau
    widths = [p.get_width() for p in fig.axes[0].patches]
    np.testing.assert_allclose(widths, [0.112, 0.231, 0.298])


def test_aopc_curves_svg(tmp_path, summary):
    out = tmp_path / "aopc.svg"
    plots.plot_aopc_curves(summary, path=out)
    assert out.stat().st_size > 5000 and "<svg" in out.read_text()


def test_embedding_png_has_silhouette_in_title(tmp_path, summary):
    out = tmp_path / "emb.png"
    fig = plots.plot_embedding(summary["consistency"], "agrad", path=out, label_names=["negative", "positive"])
    rgb = _assert_png(out)
    assert fig.axes[0].get_title().endswith("Silhouette score: 0.569")
    assert _has_colour(rgb, colors.POSITIVE_RGB, 0.08) and _has_colour(rgb, colors.NEGATIVE_RGB, 0.08)
    with pytest.raises(InputError, match="no consistency"):
        plots.plot_embedding(summary["consistency"], "attcat")


# ------------------------------------------------------- with the explainer
def test_attention_head_view_of_a_tiny_model(tmp_path, tokenizer):
    from conftest import make_model

    from attnlens import Explainer

    ex = Explainer(make_model("bert"), tokenizer)
    tokens, special, att = ex.attention_maps("the movie was not good")
    assert att.shape == (2, 2, len(tokens), len(tokens))
    fig = plots.plot_attention_head(tokens, att, layer=1, head=0, special=special, path=tmp_path / "h.png")
    _assert_png(tmp_path / "h.png")
    np.testing.assert_allclose(np.asarray(fig.axes[0].images[0].get_array()), att[1, 0])
    np.testing.assert_allclose(att.sum(-1), 1.0, atol=1e-5)  # rows of attention probabilities


@pytest.mark.slow
def test_real_model_renders_everywhere(tmp_path, minilm_sst2):
    (exp,) = minilm_sst2.explain(["a charming and <b>moving</b> film"], methods=["rawatt", "attcat"])
    page = explanations_html(exp)
    assert "&lt;b&gt;moving&lt;/b&gt;" in page and "<b>" not in page
    assert page.count("<details") == 2  # both methods are layered: rows per layer + sum + rollout
    out = render_terminal(exp, color=False, width=200)
    assert "predicted positive" in out
    plots.plot_token_heatmap(exp, path=tmp_path / "t.png")
    plots.plot_layer_heatmap(exp, "attcat", path=tmp_path / "l.png")
    _assert_png(tmp_path / "t.png")
    _assert_png(tmp_path / "l.png")


def test_long_input_wraps_into_blocks_normalised_over_the_whole_example(tmp_path):
    n = 95
    scores = np.linspace(0.0, 1.0, n)  # the largest score is in the last block
    special = [True] + [False] * (n - 2) + [True]
    exp = Explanation(
        text="x",
        tokens=[f"t{i}" for i in range(n)],
        special=special,
        target=0,
        predicted=0,
        probabilities=[1.0],
        scores={"m": scores},
    )
    fig = plots.plot_token_heatmap(exp, path=tmp_path / "long.png", per_line=40)
    _assert_png(tmp_path / "long.png")
    blocks = [ax for ax in fig.axes if ax.images]
    assert len(blocks) == 3
    first = np.ma.getdata(blocks[0].images[0].get_array())[0]
    last = np.ma.getdata(blocks[2].images[0].get_array())[0]
    np.testing.assert_allclose(first[1:], scores[1:40] / scores[n - 2])  # one scale for all blocks
    assert last.shape == (15,) and np.ma.getmaskarray(blocks[2].images[0].get_array())[0, -1]  # [SEP] greyed
    with pytest.raises(InputError, match="per_line"):
        plots.plot_token_heatmap(exp, per_line=0)


def test_sentence_pair_and_show(capsys):
    exp = make_exp()
    exp.text = ["a premise <i>", "a hypothesis"]
    page = explanations_html(exp)
    assert "a premise &lt;i&gt; [SEP] a hypothesis" in page
    exp.show(methods=["rawatt"])  # Explanation.show prints through print_explanations
    out = capsys.readouterr().out
    assert "rawatt" in out and "attcat" not in out and "a premise <i> [SEP] a hypothesis" in out


def test_the_views_of_a_result_name_their_options():
    exp = make_exp()
    page = exp.to_html(methods=["rawatt"], title="My <page>", k=1)
    assert "My &lt;page&gt;" in page and "My <page>" not in page
    buffer = io.StringIO()
    exp.show(methods=["rawatt"], console=Console(file=buffer, width=100), k=1)
    assert "rawatt" in buffer.getvalue()
    with pytest.raises(TypeError, match="bogus"):
        exp.show(bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        exp.to_html(bogus=1)
