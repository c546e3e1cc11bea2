"""The interactive attention head view: data round-trip, escaping, size, and real renders in headless Chromium.

The browser tests skip when Chromium is missing, except under ``CI=true`` (where .ci/run installs it): there a
missing browser fails them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import make_model, make_tokenizer

from attnlens import Explainer, InputError
from attnlens.cli import main
from attnlens.viz.headview import attention_view_html, decode_attentions

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
IN_CI = os.environ.get("CI", "").lower() == "true"
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
    assert size_mb < 20, size_mb  # was 78-154 MB at 362-512 tokens with the values as JSON numbers
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
