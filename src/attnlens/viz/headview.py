"""Interactive attention head view: one self-contained HTML page where the reader picks a layer and a head (or
the mean over heads) and sees that attention matrix over the tokens, rows attending to columns (the bertviz view
of the lecture, without bertviz). The tokens travel as JSON and are put on the page with ``textContent``, so no
token can inject markup.

The matrices are stored compactly so that a 512-token page of a 6-layer, 12-head model stays a few MB: every
attention row is quantised to 8 bits (16 bits for small pages) relative to its own largest value, each layer is
deflate-compressed and base64-encoded, and the page decodes one layer when it is shown (``DecompressionStream``).
Up to :data:`TABLE_MAX_TOKENS` tokens the matrix is an HTML table with the values; longer inputs are drawn on a
canvas, one pixel block per cell, with the value under the pointer shown in a status line.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Sequence

import numpy as np

from ..errors import InputError
from .html import STYLE, _e

TABLE_MAX_TOKENS = 100  # above this, a canvas: a table of N^2 cells gets slow to build and to read
PRECISE_MAX_VALUES = 1 << 22  # pages with at most this many attention values keep 16 bits per value

_STYLE = "canvas.attn { image-rendering: pixelated; } p.tokens { font-size: .8em; }\n"

_SCRIPT = """
const data = JSON.parse(document.getElementById("attnlens-data").textContent);
const layerSel = document.getElementById("layer"), headSel = document.getElementById("head");
const grid = document.getElementById("grid"), caption = document.getElementById("caption");
const n = data.n, heads = data.heads, qmax = data.bits === 16 ? 65535 : 255;
function option(sel, value, text) { const o = document.createElement("option"); o.value = value;
  o.textContent = text; sel.appendChild(o); }
for (let l = 0; l < data.layers; l++) option(layerSel, l, "layer " + l);
option(headSel, -1, "mean over heads");
for (let h = 0; h < heads; h++) option(headSel, h, "head " + h);
layerSel.value = data.layers - 1;
function bytesOf(b64) { const s = atob(b64), out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i); return out; }
async function inflate(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer()); }
let cached = {layer: -1, values: null, scales: null};  // one decoded layer at a time
async function layer(l) {
  if (cached.layer !== l) {
    const raw = await inflate(bytesOf(data.values[l]));
    cached = {layer: l, values: data.bits === 16 ? new Uint16Array(raw.buffer) : raw,
              scales: new Float32Array(bytesOf(data.scales[l]).buffer)};
  }
  return cached; }
async function matrix(l, h) {  // row-major n x n Float32Array
  const {values, scales} = await layer(l), m = new Float32Array(n * n);
  const chosen = h >= 0 ? [h] : Array.from({length: heads}, (_, k) => k);
  for (const k of chosen) for (let i = 0; i < n; i++) {
    const s = scales[k * n + i] / qmax / chosen.length, base = (k * n + i) * n;
    for (let j = 0; j < n; j++) m[i * n + j] += values[base + j] * s; }
  return m; }
function cell(tag, text, cls) { const c = document.createElement(tag); c.textContent = text;
  if (cls) c.className = cls; return c; }
function drawTable(m, max) {
  const table = document.createElement("table"); table.className = "grid";
  const head = document.createElement("tr"); head.appendChild(cell("th", ""));
  data.tokens.forEach((t, j) => head.appendChild(cell("th", t, "tokcol" + (data.special[j] ? " special" : ""))));
  table.appendChild(head);
  for (let i = 0; i < n; i++) {
    const tr = document.createElement("tr");
    tr.appendChild(cell("th", data.tokens[i], "row" + (data.special[i] ? " special" : "")));
    for (let j = 0; j < n; j++) { const v = m[i * n + j], td = cell("td", v.toFixed(2)), a = v / max;
      td.style.background = "rgba(37, 99, 235, " + a.toFixed(3) + ")"; td.style.color = a > 0.55 ? "#fff" : "#111827";
      td.title = data.tokens[i] + " \\u2192 " + data.tokens[j] + ": " + v.toFixed(4); tr.appendChild(td); }
    table.appendChild(tr);
  }
  grid.replaceChildren(table); }
function drawCanvas(m, max) {
  const px = Math.max(1, Math.min(6, Math.floor(1600 / n))), canvas = document.createElement("canvas");
  canvas.width = canvas.height = n * px; canvas.className = "attn";
  const ctx = canvas.getContext("2d"), img = ctx.createImageData(n * px, n * px);
  for (let i = 0; i < n; i++) for (let j = 0; j < n; j++) {
    const a = m[i * n + j] / max, r = Math.round(255 - 218 * a), g = Math.round(255 - 156 * a),
          b = Math.round(255 - 20 * a);
    for (let y = i * px; y < (i + 1) * px; y++) for (let x = j * px; x < (j + 1) * px; x++) {
      img.data.set([r, g, b, 255], (y * n * px + x) * 4); }
  }
  ctx.putImageData(img, 0, 0);
  const status = cell("p", "point at a cell to read its value", "meta");
  canvas.onmousemove = (ev) => {
    const rect = canvas.getBoundingClientRect(), i = Math.floor((ev.clientY - rect.top) / rect.height * n),
          j = Math.floor((ev.clientX - rect.left) / rect.width * n);
    if (i < 0 || i >= n || j < 0 || j >= n) return;
    status.textContent = "token " + i + " " + data.tokens[i] + " \\u2192 token " + j + " " + data.tokens[j] + ": " +
      m[i * n + j].toFixed(4); };
  const strip = document.createElement("p"); strip.className = "tokens";
  data.tokens.forEach((t, i) => { strip.appendChild(cell("span", t, "tok" + (data.special[i] ? " special" : "")));
    strip.appendChild(document.createTextNode(" ")); });
  grid.replaceChildren(status, canvas, strip); }
let pending = 0;
async function draw() {
  const l = +layerSel.value, h = +headSel.value, ticket = ++pending;
  let m;
  try { m = await matrix(l, h); }
  catch (err) { caption.textContent = "cannot decode the attention data in this browser: " + err; return; }
  if (ticket !== pending) return;  // a newer choice was made meanwhile
  let max = 1e-12; for (const v of m) if (v > max) max = v;
  if (n <= data.table_max) drawTable(m, max); else drawCanvas(m, max);
  caption.textContent = "layer " + l + ", " + (h >= 0 ? "head " + h : "mean over heads") +
    ": row i shows how much token i attends to each column token (shade relative to the largest value)";
  document.body.dataset.drawn = l + ":" + h;
}
layerSel.onchange = draw; headSel.onchange = draw; draw();
"""


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def encode_attentions(att: np.ndarray) -> dict:
    """The compact form of ``(L, H, N, N)`` attention probabilities that the page decodes.

    Each row (one query token of one head) is divided by its largest value and quantised to ``bits`` bits;
    per layer, ``values`` holds the deflate-compressed little-endian integers (head, row, column order) and
    ``scales`` the float32 row maxima, both base64. The error of a value is at most ``row max / (2^bits - 1) / 2``.
    """
    n_layers, n_heads, n, _ = att.shape
    bits = 16 if att.size <= PRECISE_MAX_VALUES else 8
    qmax = (1 << bits) - 1
    values, scales = [], []
    for layer in att:  # one layer's float32 copies at a time, whatever the input's dtype and size
        layer = np.nan_to_num(np.array(layer, dtype=np.float32), copy=False)
        if layer.min() < 0:
            raise InputError("attentions must be probabilities (non-negative)")
        peak = layer.max(axis=-1)  # (H, N)
        layer /= np.where(peak > 0, peak, 1.0)[..., None]
        np.clip(layer, 0.0, 1.0, out=layer)
        layer *= qmax
        q = np.rint(layer, out=layer).astype("<u2" if bits == 16 else "u1")
        values.append(_b64(zlib.compress(q.tobytes(), 1)))
        scales.append(_b64(peak.astype("<f4").tobytes()))
    return {"layers": n_layers, "heads": n_heads, "n": n, "bits": bits, "values": values, "scales": scales}


def decode_attentions(payload: dict) -> np.ndarray:
    """``(L, H, N, N)`` attention values from :func:`encode_attentions`'s output (what the page shows)."""
    n_layers, n_heads, n, bits = payload["layers"], payload["heads"], payload["n"], payload["bits"]
    dtype = "<u2" if bits == 16 else "u1"
    out = np.empty((n_layers, n_heads, n, n), dtype=np.float64)
    for i in range(n_layers):
        q = np.frombuffer(zlib.decompress(base64.b64decode(payload["values"][i])), dtype=dtype)
        peak = np.frombuffer(base64.b64decode(payload["scales"][i]), dtype="<f4").reshape(n_heads, n, 1)
        out[i] = q.reshape(n_heads, n, n) / ((1 << bits) - 1) * peak
    return out


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
    att = np.asarray(attentions)  # not copied: the page is encoded a layer at a time (encode_attentions)
    if att.ndim != 4 or att.shape[2] != att.shape[3] or att.shape[2] != len(tokens) or 0 in att.shape[:2]:
        raise InputError(f"attentions must have shape (layers, heads, {len(tokens)}, {len(tokens)}); got {att.shape}")
    special = [False] * len(tokens) if special is None else [bool(s) for s in special]
    encoded = encode_attentions(att)
    layers = encoded.pop("values")
    payload = {"tokens": [str(t) for t in tokens], "special": special, "table_max": TABLE_MAX_TOKENS, **encoded}
    # "</" and "<!--" inside a script element would end or confuse it: escape "<" in the JSON text (the layers'
    # base64 has none, and goes in as it is: the page is the one copy of it beside the encoded layers)
    data = json.dumps(payload).replace("<", "\\u003c")
    title = title or "attnlens attention view"
    return "".join([
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        f"<title>{_e(title)}</title><style>{STYLE}{_STYLE}</style></head>\n",
        f"<body>\n<h1>{_e(title)}</h1>\n",
        '<p><label>Layer <select id="layer"></select></label> ',
        '<label>Head <select id="head"></select></label></p>\n',
        '<p class="meta" id="caption">decoding&hellip;</p>\n<div class="scroll" id="grid"></div>\n',
        '<script type="application/json" id="attnlens-data">', data[:-1], ', "values": ["',
        *_separated(layers, '", "'), '"]}</script>\n',
        f"<script>{_SCRIPT}</script>\n</body></html>\n",
    ])


def _separated(items: list[str], separator: str) -> list[str]:
    """``items`` with ``separator`` between them, as pieces for one ``"".join`` (no joined copy of the items)."""
    out = [separator] * (2 * len(items) - 1)
    out[::2] = items
    return out


def page_bytes(layers: int, heads: int, n: int) -> int:
    """The most bytes :func:`attention_view_html` holds beside its ``(layers, heads, n, n)`` input: while a layer
    is encoded its float32 copy, the masks of its missing values, its quantised, deflated and base64 bytes; and
    the page's text twice (the encoded layers and the page), whatever deflate saves."""
    values = layers * heads * n * n
    width = 2 if values <= PRECISE_MAX_VALUES else 1  # bytes per quantised value
    text = (values * width + 64 * layers) * 4 // 3 + 2**16  # base64 of (at worst) incompressible bytes, the page
    return heads * n * n * (4 + 2 + 6 * width) + 2 * text
