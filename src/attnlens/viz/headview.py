"""Interactive attention head view: one self-contained HTML page where the reader picks a layer and a head (or
the mean over heads) and sees that attention matrix over the tokens, rows attending to columns (the bertviz view
of the lecture, without bertviz). The attention values and tokens travel as JSON and are put on the page with
``textContent``, so no token can inject markup.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from ..errors import InputError
from .html import STYLE, _e

_SCRIPT = """
const data = JSON.parse(document.getElementById("attnlens-data").textContent);
const layerSel = document.getElementById("layer"), headSel = document.getElementById("head");
const grid = document.getElementById("grid"), caption = document.getElementById("caption");
function option(sel, value, text) { const o = document.createElement("option"); o.value = value;
  o.textContent = text; sel.appendChild(o); }
data.attentions.forEach((_, l) => option(layerSel, l, "layer " + l));
option(headSel, -1, "mean over heads");
data.attentions[0].forEach((_, h) => option(headSel, h, "head " + h));
layerSel.value = data.attentions.length - 1;
function matrix(l, h) {
  const heads = data.attentions[l];
  if (h >= 0) return heads[h];
  return heads[0].map((row, i) => row.map((_, j) => heads.reduce((s, m) => s + m[i][j], 0) / heads.length));
}
function cell(tag, text, cls) { const c = document.createElement(tag); c.textContent = text;
  if (cls) c.className = cls; return c; }
function draw() {
  const l = +layerSel.value, h = +headSel.value, m = matrix(l, h);
  const max = Math.max(...m.flat(), 1e-12);
  grid.replaceChildren();
  const head = document.createElement("tr"); head.appendChild(cell("th", ""));
  data.tokens.forEach((t, j) => head.appendChild(cell("th", t, "tokcol" + (data.special[j] ? " special" : ""))));
  grid.appendChild(head);
  m.forEach((row, i) => {
    const tr = document.createElement("tr");
    tr.appendChild(cell("th", data.tokens[i], "row" + (data.special[i] ? " special" : "")));
    row.forEach((v, j) => { const td = cell("td", v.toFixed(2)); const a = v / max;
      td.style.background = "rgba(37, 99, 235, " + a.toFixed(3) + ")"; td.style.color = a > 0.55 ? "#fff" : "#111827";
      td.title = data.tokens[i] + " \\u2192 " + data.tokens[j] + ": " + v.toFixed(4); tr.appendChild(td); });
    grid.appendChild(tr);
  });
  caption.textContent = "layer " + l + ", " + (h >= 0 ? "head " + h : "mean over heads") +
    ": row i shows how much token i attends to each column token (shade relative to the largest value)";
}
layerSel.onchange = draw; headSel.onchange = draw; draw();
"""


def attention_view_html(
    tokens: Sequence[str],
    attentions: np.ndarray,
    special: Sequence[bool] | None = None,
    title: str | None = None,
) -> str:
    """A self-contained HTML page to browse the attention of every layer and head.

    Args:
        tokens: the N tokens.
        attentions: ``(L, H, N, N)`` attention probabilities, e.g. from ``Explainer.attention_maps(text)``.
        special: which tokens are special (shown grey).
        title: page title (escaped).
    """
    att = np.asarray(attentions, dtype=np.float64)
    if att.ndim != 4 or att.shape[2] != att.shape[3] or att.shape[2] != len(tokens):
        raise InputError(f"attentions must have shape (layers, heads, {len(tokens)}, {len(tokens)}); got {att.shape}")
    special = [False] * len(tokens) if special is None else [bool(s) for s in special]
    payload = {"tokens": [str(t) for t in tokens], "special": special, "attentions": np.round(att, 5).tolist()}
    # "</" and "<!--" inside a script element would end or confuse it: escape "<" in the JSON text.
    data = json.dumps(payload).replace("<", "\\u003c")
    title = title or "attnlens attention view"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{STYLE}</style></head>\n<body>\n"
        f"<h1>{_e(title)}</h1>\n"
        '<p><label>Layer <select id="layer"></select></label> '
        '<label>Head <select id="head"></select></label></p>\n'
        '<p class="meta" id="caption"></p>\n<div class="scroll"><table class="grid" id="grid"></table></div>\n'
        f'<script type="application/json" id="attnlens-data">{data}</script>\n'
        f"<script>{_SCRIPT}</script>\n</body></html>\n"
    )
