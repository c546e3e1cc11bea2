"""The interactive attention head view: data round-trip, escaping, and a real render in headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from conftest import make_model, make_tokenizer

from attnlens import Explainer, InputError
from attnlens.cli import main
from attnlens.viz.headview import attention_view_html


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
    np.testing.assert_allclose(np.array(data["attentions"]), att, atol=1e-5)
    with pytest.raises(InputError, match="shape"):
        attention_view_html(tokens, att[:, :, :2, :2])


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
    np.testing.assert_allclose(np.array(data["attentions"]), att, atol=1e-5)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless chromium not installed")
def test_renders_in_a_browser(tmp_path):
    att = np.full((2, 3, 4, 4), 0.25)
    att[1, 2] = np.eye(4)
    page = tmp_path / "view.html"
    page.write_text(attention_view_html(["[CLS]", "a", "<i>b</i>", "[SEP]"], att))
    result = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=60,
    )
    dom = result.stdout
    assert dom.count("<option") == 2 + 4  # 2 layers; mean + 3 heads
    assert dom.count("<td") == 16  # a 4 x 4 matrix was drawn
    assert "&lt;i&gt;b&lt;/i&gt;" in dom  # the token is text, not markup
    assert "layer 1, mean over heads" in dom
