"""The interactive attention head view: data round-trip, escaping, size, and real renders in headless Chromium.

The browser tests skip when Chromium is missing, except under ``CI=true`` (where .ci/run installs it): there a
missing browser fails them.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import IN_CI, make_model, make_tokenizer

from attnlens import Explainer, InputError
from attnlens.cli import main
from attnlens.viz.headview import attention_view_html, decode_attentions, page_bytes

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(CHROMIUM is None and not IN_CI, reason="headless chromium not installed")


def _payload(page: str) -> dict:
    raw = re.search(r'<script type="application/json" id="attnlens-data">(.*?)</script>', page, re.S).group(1)
    return json.loads(raw)


def test_data_round_trips_and_markup_cannot_escape():
    rng = np.random.default_rng(0)
    att = rng.dirichlet(np.ones(3), size=(2, 2, 3))  # (L=2, H=2, N=3, N=3), rows sum to 1
    tokens = ["[CLS]", "</script><script>alert(1)</script>", "[SEP]"]
    page = attention_view_html(tokens, att, special=[True, False, True], title="<b>t</b>")
    assert page.count("<script") == 2  # the data block and the viewer, nothing injected
    assert "&lt;b&gt;t&lt;/b&gt;" in page
    data = _payload(page)
    assert data["tokens"] == tokens and data["special"] == [True, False, True]
    assert data["bits"] == 16  # a small page keeps 16 bits: error <= row max / 131070
    np.testing.assert_allclose(decode_attentions(data), att, atol=1e-5)
    with pytest.raises(InputError, match="shape"):
        attention_view_html(tokens, att[:, :, :2, :2])
    with pytest.raises(InputError, match="non-negative"):
        attention_view_html(tokens, -att)


def test_cli_writes_the_view_of_the_first_input(tmp_path):
    model_dir = tmp_path / "model"
    make_model("bert").save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "heads.html"
    assert main(["explain", "the movie was great", "bad", "--model", str(model_dir), "--methods", "rawatt",
                 "--head-view", str(out), "--format", "json", "--out", str(tmp_path / "x.json")]) == 0
    data = _payload(out.read_text())
    ex = Explainer.from_pretrained(model_dir)
    tokens, special, att = ex.attention_maps("the movie was great")
    assert data["tokens"] == tokens
    np.testing.assert_allclose(decode_attentions(data), att, atol=1e-5)


def test_the_decoder_streams_maps_come_with_the_tokens_at_its_positions():
    """BART's decoder reads the input shifted right: position 0 is the start token, position i input token i-1;
    the tokens returned (the view's labels) are those, and the cross stream (rows and columns of other tokens)
    is refused."""
    import torch

    model = make_model("bart")
    text = "the movie was great"
    tokens, special, att = Explainer(model, make_tokenizer(), attention="decoder").attention_maps(text)
    (e,) = Explainer(model, make_tokenizer()).encode([text])
    start = make_tokenizer().convert_ids_to_tokens(model.config.decoder_start_token_id)
    assert tokens == [start, *e.tokens[:-1]] and special == [True, *e.special[:-1]]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([e.ids]), output_attentions=True)
    np.testing.assert_allclose(att, torch.stack(out.decoder_attentions)[:, 0].numpy(), atol=1e-6)
    with pytest.raises(InputError, match="^the cross stream's maps have the decoder's positions as rows"):
        Explainer(model, make_tokenizer(), attention="cross").attention_maps(text)


def _dom(page: Path, tmp_path: Path) -> str:
    """The page's DOM after its scripts ran, from headless Chromium."""
    if CHROMIUM is None:
        pytest.fail("CI=true but chromium is not installed (.ci/run installs it): the browser tests must run in CI")
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=30000",  # let the asynchronous decoding and drawing finish before the dump
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@needs_browser
def test_renders_in_a_browser(tmp_path):
    att = np.full((2, 3, 4, 4), 0.25)
    att[1, 2] = np.eye(4)
    page = tmp_path / "view.html"
    page.write_text(attention_view_html(["[CLS]", "a", "<i>b</i>", "[SEP]"], att))
    dom = _dom(page, tmp_path)
    assert dom.count("<option") == 2 + 4  # 2 layers; mean + 3 heads
    assert dom.count("<td") == 16  # a 4 x 4 matrix was drawn
    assert "&lt;i&gt;b&lt;/i&gt;" in dom  # the token is text, not markup
    assert "layer 1, mean over heads" in dom
    assert 'data-drawn="1:-1"' in dom
    # mean over heads of layer 1: (0.25 + 0.25 + eye) / 3 -> 0.50 on the diagonal, 0.17 off it
    assert dom.count(">0.50</td>") == 4 and dom.count(">0.17</td>") == 12


@functools.cache
def _long_attention(n: int = 512, layers: int = 6, heads: int = 12) -> np.ndarray:
    """Row-stochastic attention where head h of layer l puts most of each row on token (i + l + h) mod n."""
    rng = np.random.default_rng(0)
    att = rng.random((layers, heads, n, n), dtype=np.float32) * 0.01
    rows = np.arange(n)
    for layer in range(layers):
        for head in range(heads):
            att[layer, head, rows, (rows + layer + head) % n] += 1.0
    return att / att.sum(-1, keepdims=True)


def test_a_512_token_view_is_compact_and_faithful():
    att = _long_attention()
    tokens = [f"w{i}" for i in range(512)]
    page = attention_view_html(tokens, att)
    size_mb = len(page.encode()) / 1e6
    assert size_mb < 20, size_mb  # 78-154 MB at 362-512 tokens with the values as JSON numbers
    data = _payload(page)
    assert data["bits"] == 8 and data["n"] == 512 and len(data["values"]) == 6
    decoded = decode_attentions(data)
    peak = att.max(-1, keepdims=True)
    assert (np.abs(decoded - att) <= peak / 510 + 1e-7).all()  # 8 bits per row, relative to the row's max
    assert "Math.max(..." not in page  # a spread over N^2 values overflowed the call stack above ~300 tokens


@needs_browser
def test_a_512_token_view_renders_and_switches_layers(tmp_path):
    att = _long_attention()
    tokens = ["[CLS]"] + [f"w{i}" for i in range(510)] + ["[SEP]"]
    page = attention_view_html(tokens, att, special=[True] + [False] * 510 + [True])
    switch = (  # what a reader does once the first view is drawn: pick layer 2, head 3, then point at (10, 15)
        "<script>const pick = () => { if (!document.body.dataset.drawn) return setTimeout(pick, 50);"
        " document.body.dataset.first = document.body.dataset.drawn + ' ' +"
        " caption.textContent; layerSel.value = 2; layerSel.dispatchEvent(new Event('change'));"
        " headSel.value = 3; headSel.dispatchEvent(new Event('change')); setTimeout(point, 50); };"
        "const point = () => { if (document.body.dataset.drawn !== '2:3') return setTimeout(point, 50);"
        " const c = document.querySelector('canvas'), r = c.getBoundingClientRect();"
        " c.dispatchEvent(new MouseEvent('mousemove', {clientX: r.left + 15.5 * r.width / 512,"
        " clientY: r.top + 10.5 * r.height / 512})); }; setTimeout(pick, 100);</script>"
    )
    (tmp_path / "view.html").write_text(page.replace("</body>", switch + "</body>"))
    dom = _dom(tmp_path / "view.html", tmp_path)
    assert re.search(r'data-first="5:-1 layer 5, mean over heads', dom)  # the last layer drawn first
    strip = re.search(r'<p class="tokens">(.*?)</p>', dom, re.S).group(1)
    assert len(re.findall(r'<span class="tok[ "]', strip)) == 512
    assert strip.count('class="tok special"') == 2 and ">w509</span>" in strip
    canvas = re.search(r"<canvas[^>]*>", dom).group(0)  # 3 px per cell
    assert 'width="1536"' in canvas and 'height="1536"' in canvas and 'class="attn"' in canvas
    assert 'data-drawn="2:3"' in dom and "layer 2, head 3" in dom
    shown = re.search(r"token 10 w9 \u2192 token 15 w14: ([0-9.]+)", dom)
    assert shown, "hovering the canvas shows the cell's value"
    assert abs(float(shown.group(1)) - att[2, 3, 10, 15]) <= att[2, 3, 10].max() / 510 + 1e-4  # decoded right


def _long_explainer(family: str, positions: int) -> Explainer:
    """A tiny random classifier of ``family`` that takes inputs of up to ``positions`` tokens."""
    tok = make_tokenizer()
    tok.model_max_length = positions
    config = make_model(family).config
    for name in ("max_position_embeddings", "n_positions"):
        if hasattr(config, name):
            setattr(config, name, positions)
    return Explainer(type(make_model(family))(config).eval(), tok, max_length=positions)


def _text(ex: Explainer, n: int) -> str:
    words = [w for w in ex.tokenizer.get_vocab() if w.isalpha()]
    text = " ".join(words[i % len(words)] for i in range(n - 2))
    assert len(ex.encode(text)[0].ids) == n
    return text


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama", "bart"])
def test_the_views_maps_and_page_stay_within_their_estimate(family):
    """What the view holds at once is within the estimate the budget is checked against: while its maps are
    computed, the pass's tensors (counted exactly); then the float32 array of the maps and the page's encoding
    (numpy arrays and text, by tracemalloc), each layer's tensors dropped as the array takes them."""
    import tracemalloc

    from attnlens.core.attention_view import attention_view_bytes
    from attnlens.testing.live_tensors import LiveTensorPeak

    ex = _long_explainer(family, 256)
    text = _text(ex, 192)
    ex.attention_maps(text)  # once before: what the first call sets up is not the view's
    tracemalloc.start()
    try:
        with LiveTensorPeak() as live:
            tokens, special, att = ex.attention_maps(text, beside=page_bytes)
            page = attention_view_html(tokens, att, special)
        arrays = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(page) > 0 and att.shape[2:] == (192, 192) and arrays >= att.nbytes + len(page)
    assert max(live.peak, arrays) <= attention_view_bytes(ex.model, 192, page_bytes)


def test_a_view_beyond_the_budget_is_refused_in_one_line_before_the_model_runs(tmp_path, capsys):
    from attnlens.core.attention_view import attention_view_bytes
    from attnlens.core.memory import parse_budget

    ex = _long_explainer("llama", 4096)
    text = _text(ex, 3000)  # 2 layers x 2 heads x 3,000^2 float32 maps: 144 MB, more than 64 MiB
    calls = []
    ex.model.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(InputError, match=r"^the attention view keeps every layer's and head's whole maps: 3,000 "
                                         r"tokens need about .* fits up to ([\d,]+) tokens") as refused:
        ex.attention_maps(text, memory_budget="64MiB")
    assert calls == []
    fits = int(re.search(r"fits up to ([\d,]+) tokens", str(refused.value)).group(1).replace(",", ""))
    budget = parse_budget("64MiB")
    assert attention_view_bytes(ex.model, fits) <= budget < attention_view_bytes(ex.model, fits + 1)

    model_dir = tmp_path / "model"
    ex.model.save_pretrained(model_dir)
    ex.tokenizer.save_pretrained(model_dir)
    capsys.readouterr()
    out, view = tmp_path / "x.json", tmp_path / "view.html"
    code = main(["explain", text, "--model", str(model_dir), "--methods", "rawatt", "--format", "json", "--out",
                 str(out), "--head-view", str(view), "--memory-budget", "64MiB"])
    captured = capsys.readouterr()
    assert code == 2 and len(captured.err.strip().splitlines()) == 1
    assert "the attention view keeps every layer's and head's whole maps: 3,000 tokens need about" in captured.err
    assert "more than the memory budget of 64 MiB" in captured.err
    assert not out.exists() and not view.exists()  # refused before the explanations: nothing written
