// attnlens serve: the page. Plain JavaScript, no dependencies. Every text from the server (tokens, labels,
// file names) reaches the page through textContent or attribute setters, never as markup.
"use strict";

const $ = (id) => document.getElementById(id);
const FAST = ["rawatt", "rollout", "agrad", "gae", "attcat", "inputxgradient"];
const LINEAR = new Set(["cat", "inputxgradient"]);  // their summed step rows are the stretch's own explanation
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04",
  "#db2777", "#65a30d", "#7c3aed", "#0d9488", "#b91c1c", "#1d4ed8", "#a16207", "#be185d", "#15803d", "#6d28d9",
  "#c2410c", "#0e7490"];
const state = { models: [], facts: null, exp: null, expRequest: null, faith: null, attention: null,
  attentionText: null, gen: null, genModel: null, genRange: null, bench: null, benchName: null, benchSort: null, job: null };
const results = new Map();  // (kind, request) -> result: switching views never asks twice

class Cancelled extends Error {}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function svgEl(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const fmt = (v, d = 3) => (v === null || v === undefined || Number.isNaN(v) ? "n/a" : Number(v).toFixed(d));
// significant digits, whatever the scale (scores of about 1e-4 stay apart instead of all reading 0.000)
const sig = (v, d = 4) => (v === null || v === undefined || Number.isNaN(v) ? "n/a" : String(Number(Number(v).toPrecision(d))));
// a score as written: NaN says so (it is a score that is not a number, not a missing one)
const scoreText = (v) => (Number.isNaN(v) ? "NaN" : sig(v));

// ------------------------------------------------------------------ server
// a number JSON cannot write (a NaN or infinite score) comes as {"$float": "NaN" | "Infinity" | "-Infinity"}
function numbers(key, v) {
  return v !== null && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length === 1
    && typeof v["$float"] === "string" ? Number(v["$float"]) : v;
}
// the largest finite |value| (an infinite score is drawn full, relative to nothing)
function peak(values, skip) {
  let max = 0;
  for (let j = 0; j < values.length; j++) {
    const v = values[j];
    if (!(skip && skip[j]) && Number.isFinite(v)) max = Math.max(max, Math.abs(v));
  }
  return max;
}
async function api(path, options) {
  const init = Object.assign({ headers: { "content-type": "application/json" } }, options || {});
  const response = await fetch(path, init);
  let body;
  try { body = JSON.parse(await response.text(), numbers); } catch (e) { body = { error: "the server answered " + response.status }; }
  if (!response.ok && response.status !== 202) throw new Error(body.error || "the server answered " + response.status);
  return body;
}

function showError(message) {
  const box = $("error");
  box.hidden = !message;
  box.textContent = message || "";
  if (message) showNote(null);
}

// what a computation that succeeded warns of (truncation, unknown tokens): beside the result, not as an error
function showNote(message) {
  const box = $("note");
  box.hidden = !message;
  box.textContent = message || "";
}

function showStatus(text, progress) {
  $("status").hidden = text === null;
  if (text === null) return;
  $("status-text").textContent = text;
  $("status-progress").value = progress || 0;
}

// Queue a computation, follow its progress, return its result (or throw Cancelled / its one-line error).
async function runJob(kind, request, label) {
  const key = kind + " " + JSON.stringify(request);
  showNote(null);  // a held reply's notes were shown when it came
  if (results.has(key)) return results.get(key);
  showError(null);
  showStatus(label + " …", 0);
  let job = await api("/api/jobs", { method: "POST", body: JSON.stringify({ kind, request }) });
  state.job = job.id;
  try {
    while (job.state === "queued" || job.state === "running") {
      const waiting = job.state === "queued" ? ` (waiting: ${job.position === null || job.position === undefined ? 0 : job.position} ahead)` : "";
      showStatus(`${label}${waiting} ${Math.round(100 * job.progress)}%`, job.progress);
      await sleep(job.state === "queued" ? 250 : 120);
      job = await api("/api/jobs/" + encodeURIComponent(job.id));
    }
  } finally {
    if (state.job === job.id) { state.job = null; showStatus(null); }
  }
  if (job.state === "cancelled") throw new Cancelled("cancelled");
  if (job.state !== "done") throw new Error(job.error || "the computation failed");
  if (job.warnings && job.warnings.length) showNote("note: " + job.warnings.join("\n"));
  results.set(key, job.result);
  return job.result;
}

// Each view draws the reply to its latest request only: a reply that arrives after a newer request of the view
// (or after the page drew a reply it held) is dropped, never drawn over the newer one.
const latest = {};
function ticket(view) {
  const n = (latest[view] = (latest[view] || 0) + 1);
  return () => {
    if (latest[view] === n) return true;
    document.body.dataset.dropped = Number(document.body.dataset.dropped || 0) + 1;  // the page's tests wait on it
    return false;
  };
}

// A view's result, or, where its computation fails, the view's earlier output hidden under the error (it would
// read as the new input's)
async function replacing(output, pending, current) {
  try { return await pending; } catch (err) {
    if (!current()) return new Promise(() => {});  // a newer request's view stays: this one ends here, unseen
    if (!(err instanceof Cancelled)) $(output).hidden = true;
    throw err;
  }
}

async function guarded(action) {
  try { await action(); } catch (err) {
    if (err instanceof Cancelled) showError("cancelled");
    else showError(err.message || String(err));
  }
}

// ------------------------------------------------------------------ tokens and colours
function readable(token, encoding) {
  if (encoding === "byte-level") token = token.replace(/\u0120/g, " ").replace(/\u010a/g, "\u21b5").replace(/\u0109/g, "\u21e5");
  else if (encoding === "sentencepiece") token = token.replace(/\u2581/g, " ").replace(/<0x0A>/g, "\u21b5");
  return visible(token);
}
// a token's text made visible: newline and tab as arrows, other control and bidi characters as their escapes (a
// bidi override would make the page show other text than the tokens explained)
function visible(text) {
  return text.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5")
    .replace(/[\u0000-\u001f\u007f-\u009f\u202a-\u202e\u2066-\u2069]/g, (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));
}
function tokenTexts(exp) {
  if (Array.isArray(exp.token_text)) return exp.token_text.map(visible);
  const encoding = exp.meta && exp.meta.token_encoding;
  return exp.tokens.map((t) => readable(t, encoding));
}
// green supports the target, red opposes it: the colours of attnlens' HTML and terminal views (viz/colors.py)
function shade(value, max) {
  if (Number.isNaN(value)) return "rgb(156, 163, 175)";  // grey: not a number (as the HTML and terminal views)
  const a = !Number.isFinite(value) ? 0.85 : max > 0 ? Math.min(1, Math.abs(value) / max) * 0.85 : 0;
  return `rgba(${value >= 0 ? "22, 163, 74" : "220, 38, 38"}, ${a.toFixed(3)})`;
}
function labelName(exp, index) {
  if (Array.isArray(index)) return "[" + index.join(", ") + "]";
  return exp.labels && exp.labels[index] !== undefined ? exp.labels[index] : String(index);
}

// One row per method, one column per token; `extra(row)` adds cells after the tokens. Up to DENSE tokens each cell
// is a table cell showing its token; longer inputs draw each row as one canvas strip of CELL-pixel columns under a
// strip of vertical token labels (512 tokens x 20 methods stay one short task), and pointing at a column tells its
// token and value.
const DENSE = 100, CELL = 10, STRIP = 16, LABELS = 64;
function renderHeatmap(table, texts, special, rows, extra) {
  const frag = document.createDocumentFragment(), dense = texts.length > DENSE;
  table.classList.toggle("dense", dense);
  if (dense) {
    const tr = document.createElement("tr"), td = el("td", null, "strip");
    tr.appendChild(document.createElement("th"));
    td.appendChild(labelStrip(texts, special));
    tr.appendChild(td);
    frag.appendChild(tr);
  }
  for (const row of rows) {
    const tr = document.createElement("tr");
    tr.dataset.method = row.name;
    const th = el("th", row.name, "method");
    if (row.title) th.title = row.title;
    tr.appendChild(th);
    const max = peak(row.values, special);
    if (dense) {
      const td = el("td", null, "strip");
      td.appendChild(rowStrip(texts, special, row.values, max));
      tr.appendChild(td);
    } else {
      for (let j = 0; j < texts.length; j++) {
        const td = el("td", texts[j], special[j] ? "cell special" : "cell");
        td.title = `${texts[j]}: ${scoreText(row.values[j])}`;
        if (!special[j] && j < row.values.length) td.style.backgroundColor = shade(row.values[j], max);
        tr.appendChild(td);
      }
    }
    if (extra) extra(tr, row);
    frag.appendChild(tr);
  }
  table.replaceChildren(frag);
}

function rowStrip(texts, special, values, max) {
  const canvas = document.createElement("canvas"), ctx = canvas.getContext("2d");
  canvas.width = texts.length * CELL;
  canvas.height = STRIP;
  for (let j = 0; j < texts.length; j++) {
    ctx.fillStyle = special[j] || j >= values.length ? "#f3f4f6" : shade(values[j], max);
    ctx.fillRect(j * CELL, 0, CELL - 1, STRIP);
  }
  canvas.onmousemove = (ev) => {
    const j = Math.min(texts.length - 1, Math.floor(ev.offsetX / CELL));
    canvas.title = `${texts[j]}: ${scoreText(values[j])}`;
  };
  return canvas;
}

function labelStrip(texts, special) {
  const canvas = document.createElement("canvas"), ctx = canvas.getContext("2d");
  canvas.width = texts.length * CELL;
  canvas.height = LABELS;
  ctx.font = "10px system-ui, sans-serif";
  ctx.textBaseline = "middle";
  ctx.rotate(-Math.PI / 2);
  for (let j = 0; j < texts.length; j++) {
    ctx.fillStyle = special[j] ? "#9ca3af" : "#374151";
    ctx.fillText(texts[j].length > 10 ? texts[j].slice(0, 9) + "…" : texts[j], -LABELS + 2, j * CELL + CELL / 2, LABELS - 4);
  }
  canvas.onmousemove = (ev) => { canvas.title = texts[Math.min(texts.length - 1, Math.floor(ev.offsetX / CELL))]; };
  return canvas;
}

// ------------------------------------------------------------------ models and methods
function currentModel() { return state.models.find((m) => m.name === $("model").value); }

function fillMethods(box, facts, chosen) {
  box.replaceChildren();
  for (const m of facts.methods) {
    const label = el("label", null, m.unsupported ? "unsupported" : "");
    const input = el("input");
    input.type = "checkbox";
    input.value = m.id;
    input.disabled = Boolean(m.unsupported);
    input.checked = !m.unsupported && chosen.includes(m.id);
    label.title = m.unsupported || m.summary;
    label.append(input, document.createTextNode(m.id));
    box.appendChild(label);
  }
}
const chosenMethods = (box) => Array.from(box.querySelectorAll("input:checked")).map((i) => i.value);

function setOptions(select, pairs) {
  select.replaceChildren(...pairs.map(([value, text]) => { const o = el("option", text); o.value = value; return o; }));
}

function onModel() {
  const facts = currentModel();
  state.facts = facts;
  $("model-kind").textContent = facts.kind;
  const chosen = FAST.filter((id) => facts.methods.some((m) => m.id === id && !m.unsupported));
  fillMethods($("methods"), facts, chosen);
  fillMethods($("gen-methods"), facts, chosen);
  fillSourceMethods(facts);
  const kinds = facts.task === "qa" ? ["qa"] : facts.language_model ? ["prompt"] : facts.task === "token" ? ["text"] : ["text", "pair"];
  for (const o of $("input-kind").options) o.hidden = !kinds.includes(o.value);
  $("input-kind").value = kinds[0];
  const labels = (facts.labels || []).map((l, i) => [String(i), l]);
  setOptions($("target"), [["", facts.task === "token" ? "predicted label" : "predicted class"], ...labels]);
  setOptions($("contrast"), [["", "none"], ...labels]);
  onInputKind();
}

function onInputKind() {
  const kind = $("input-kind").value, task = state.facts.task;
  $("text-b-label").hidden = !(kind === "pair" || kind === "qa");
  $("text-a-name").textContent = kind === "qa" ? "question" : kind === "pair" ? "first sentence" : kind === "prompt" ? "prompt" : "text";
  $("text-b-name").textContent = kind === "qa" ? "context" : "second sentence";
  $("span-box").hidden = task !== "qa";
  $("token-box").hidden = task !== "token";
  $("target-box").hidden = task === "qa" || state.facts.language_model;
  $("contrast-box").hidden = task === "qa" || task === "token" || state.facts.language_model;
}

// ------------------------------------------------------------------ explain
function explainRequest(words) {
  const kind = $("input-kind").value, a = $("text-a").value, b = $("text-b").value;
  const req = { model: state.facts.name, texts: [kind === "pair" || kind === "qa" ? [a, b] : a],
    methods: chosenMethods($("methods")), target_kind: $("target-kind").value, words };
  if (!req.methods.length) throw new Error("choose at least one method");
  const task = state.facts.task;
  if (task === "qa" && $("span").value.trim()) {
    const parts = $("span").value.split(",").map((s) => Number(s.trim()));
    if (parts.length !== 2 || parts.some((p) => !Number.isInteger(p))) throw new Error("answer span: give START,END token positions");
    req.target = parts;
  } else if ($("target").value !== "" && !$("target-box").hidden) req.target = Number($("target").value);
  if (task === "token") {
    const t = $("token").value.trim();
    if (!t) throw new Error("token classifier: give the token to explain (a word or a position)");
    req.token = /^\d+$/.test(t) ? Number(t) : t;
  }
  if ($("contrast").value !== "" && !$("contrast-box").hidden) req.contrast = Number($("contrast").value);
  return req;
}

async function explain() {
  const req = explainRequest($("words").checked);
  const current = ticket("explain");
  ticket("faithfulness");  // a measurement under way belongs to the explanation shown before
  ticket("inside");
  const [exp] = await replacing("explain-out", runJob("explain", req, "explaining"), current);
  if (!current()) return;
  state.exp = exp;
  state.expRequest = req;
  state.faith = results.get("faithfulness " + JSON.stringify(Object.assign({}, req, { words: false }))) || null;
  renderExplanation(exp);
}

function renderExplanation(exp) {
  const t0 = performance.now();
  $("explain-out").hidden = false;
  const texts = tokenTexts(exp), methods = Object.keys(exp.scores);
  const pred = $("prediction");
  pred.replaceChildren();
  const p = exp.probabilities || [], meta = exp.meta || {};
  if (meta.target_token !== undefined) {  // a language model's next token: its probabilities hold p(target) alone
    const token = (t, id) => (t !== undefined ? JSON.stringify(t) : "token #" + id);
    pred.append("explaining next token ", el("b", token(meta.target_token, exp.target)), ` (p = ${fmt(p[0])})`);
    if (meta.contrast !== undefined && meta.contrast !== null) pred.append(" − ", el("b", token(meta.contrast_token, meta.contrast)));
    pred.append(exp.predicted === exp.target ? ", the greedy choice" : "; greedy choice: ");
    if (exp.predicted !== exp.target) pred.append(el("b", token(meta.predicted_token, exp.predicted)));
  } else if (state.facts.task === "qa" && Array.isArray(exp.predicted)) {
    pred.append("answer ", el("b", texts.slice(exp.predicted[0], exp.predicted[1] + 1).join(" ")));
  } else if (!Array.isArray(exp.predicted)) {
    pred.append("predicted ", el("b", labelName(exp, exp.predicted)));
    if (p[exp.predicted] !== undefined) pred.append(` (p = ${fmt(p[exp.predicted])})`);
  }
  if (meta.target_token === undefined) {
    pred.append(" · explained ", el("b", labelName(exp, exp.target)));
    if (meta.contrast !== undefined && meta.contrast !== null) pred.append(" − ", el("b", labelName(exp, meta.contrast)));
  }
  const rows = methods.map((m) => ({ name: m, values: exp.scores[m] }));
  renderHeatmap($("heatmap"), texts, exp.special, rows, (tr, row) => {
    const td = el("td", null, "faith");
    fillFaith(td, row.name);
    tr.appendChild(td);
  });
  const top = $("top-tokens"), listed = toldApart(texts, exp.special);
  top.replaceChildren();
  for (const m of methods) {
    const box = el("div");
    box.appendChild(el("b", m));
    // the tokens that support the target most: a token against it is never listed among them
    const order = exp.scores[m].map((v, j) => [v, j]).filter(([v, j]) => !exp.special[j] && v > 0).sort((x, y) => y[0] - x[0]);
    for (const [v, j] of order.slice(0, 5)) box.appendChild(el("span", `${listed[j]}  ${v.toPrecision(3)}`));
    if (!order.length) box.appendChild(el("span", "none above 0", "muted"));
    top.appendChild(box);
  }
  $("faithfulness").disabled = !(state.facts.task === "classification" && !(exp.meta && exp.meta.contrast !== undefined && exp.meta.contrast !== null));
  document.body.dataset.explained = methods.join(",");
  state.attentionText = null;
  $("heatmap").getBoundingClientRect();  // the layout belongs to the task measured
  return performance.now() - t0;
}

// the top-token lists' labels: a text standing more than once among the ranked tokens gets its occurrence
// ("best#1", "best#2"), as the terminal and HTML views list it
function toldApart(texts, special) {
  const counts = {}, seen = {};
  texts.forEach((t, j) => { if (!special[j]) counts[t] = (counts[t] || 0) + 1; });
  return texts.map((t, j) => (special[j] || counts[t] < 2 ? t : `${t}#${(seen[t] = (seen[t] || 0) + 1)}`));
}

function sparkline(levels, fractions) {
  const w = 64, h = 20, svg = svgEl("svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}` });
  svg.appendChild(svgEl("line", { x1: 0, y1: h / 2, x2: w, y2: h / 2, stroke: "#e5e7eb" }));
  const pts = levels.map((v, i) => `${(fractions[i] * w).toFixed(1)},${(h / 2 - v * (h / 2 - 1)).toFixed(1)}`);
  svg.appendChild(svgEl("polyline", { points: pts.join(" "), fill: "none", stroke: "#dc2626", "stroke-width": 1.5 }));
  const title = svgEl("title");
  title.textContent = "drop in p(predicted) after deleting the top 0…100% tokens: " + levels.map((v) => v.toFixed(2)).join(" ");
  svg.appendChild(title);
  return svg;
}

function fillFaith(td, method) {
  td.replaceChildren();
  const f = state.faith && state.faith[0] && state.faith[0].methods[method];
  if (!f) return;
  if (f.aopc && f.aopc.levels) td.appendChild(sparkline(f.aopc.levels, state.faith[0].fractions.aopc));
  td.append(`AOPC ${fmt(f.aopc && f.aopc.value)} · comp ${fmt(f.comprehensiveness && f.comprehensiveness.value)} · suff ${fmt(f.sufficiency && f.sufficiency.value)}`);
  td.dataset.aopc = f.aopc ? f.aopc.value : "";
}

async function faithfulness() {
  const req = Object.assign({}, state.expRequest, { words: false });
  const current = ticket("faithfulness");
  const faith = await runJob("faithfulness", req, "measuring faithfulness");
  if (!current()) return;
  state.faith = faith;
  for (const tr of $("heatmap").querySelectorAll("tr")) fillFaith(tr.querySelector("td.faith"), tr.dataset.method);
}

// ------------------------------------------------------------------ inside the model
async function showInside() {
  const exp = state.exp;
  if (!exp) { showError("explain an input first: this view shows its layers and attention"); return; }
  const layered = Object.keys(exp.layers || {});
  const select = $("layer-method"), keep = select.value;
  setOptions(select, layered.map((m) => [m, m]));
  if (layered.includes(keep)) select.value = keep;
  renderLayers();
  const text = exp.text;
  const key = JSON.stringify([state.expRequest.model, text]);
  if (state.attentionText === key) return;
  const current = ticket("inside");
  const attention = await runJob("attention", { model: state.expRequest.model, text }, "reading attention");
  if (!current()) return;
  state.attention = attention;
  state.attentionText = key;
  const a = state.attention.attention;
  setOptions($("hv-layer"), Array.from({ length: a.layers }, (_, l) => [l, "layer " + l]));
  setOptions($("hv-head"), [["-1", "mean over heads"], ...Array.from({ length: a.heads }, (_, h) => [h, "head " + h])]);
  $("hv-layer").value = a.layers - 1;
  renderModelView();
  await drawHeadView();
}

function renderLayers() {
  const exp = state.exp, m = $("layer-method").value, table = $("layer-heatmap");
  if (!m || !exp.layers[m]) { table.replaceChildren(el("caption", "no layered method in this explanation (e.g. attcat, cat, rawatt, gae)")); return; }
  const texts = tokenTexts(exp);
  const rows = exp.layers[m].map((values, l) => ({ name: "layer " + l, values }));
  renderHeatmap(table, texts, exp.special, rows);
}

function renderModelView() {
  const a = state.attention.attention, th = state.attention.thumbnails, t = th.size, box = $("model-view");
  box.style.gridTemplateColumns = `48px repeat(${a.heads}, 66px)`;
  const frag = document.createDocumentFragment();
  frag.appendChild(el("span", ""));
  for (let h = 0; h < a.heads; h++) frag.appendChild(el("span", "head " + h, "axis"));
  for (let l = 0; l < a.layers; l++) {
    frag.appendChild(el("span", "layer " + l, "axis"));
    for (let h = 0; h < a.heads; h++) {
      const canvas = document.createElement("canvas");
      canvas.width = canvas.height = t;
      canvas.title = `layer ${l}, head ${h}`;
      canvas.dataset.layer = l;
      canvas.dataset.head = h;
      const ctx = canvas.getContext("2d"), img = ctx.createImageData(t, t), base = (l * a.heads + h) * t * t;
      for (let k = 0; k < t * t; k++) {
        const v = th.values[base + k] / 255;
        img.data[4 * k] = Math.round(255 - 218 * v); img.data[4 * k + 1] = Math.round(255 - 156 * v);
        img.data[4 * k + 2] = Math.round(255 - 20 * v); img.data[4 * k + 3] = 255;
      }
      ctx.putImageData(img, 0, 0);
      canvas.onclick = () => { $("hv-layer").value = l; $("hv-head").value = h; drawHeadView(); };
      frag.appendChild(canvas);
    }
  }
  box.replaceChildren(frag);
}

function bytesOf(b64) {
  const s = atob(b64), out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}
async function inflate(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}
const decoded = { key: null, values: null, scales: null };
async function headMatrix(l, h) {  // row-major n x n Float32Array of one head (h < 0: the mean over heads)
  const a = state.attention.attention, n = a.n, qmax = a.bits === 16 ? 65535 : 255;
  const key = state.attentionText + ":" + l;
  if (decoded.key !== key) {
    const raw = await inflate(bytesOf(a.values[l]));
    decoded.values = a.bits === 16 ? new Uint16Array(raw.buffer) : raw;
    decoded.scales = new Float32Array(bytesOf(a.scales[l]).buffer);
    decoded.key = key;
  }
  const m = new Float32Array(n * n), heads = h >= 0 ? [h] : Array.from({ length: a.heads }, (_, k) => k);
  for (const k of heads) for (let i = 0; i < n; i++) {
    const s = decoded.scales[k * n + i] / qmax / heads.length, base = (k * n + i) * n;
    for (let j = 0; j < n; j++) m[i * n + j] += decoded.values[base + j] * s;
  }
  return m;
}

async function drawHeadView() {
  const l = Number($("hv-layer").value), h = Number($("hv-head").value), limit = Number($("hv-links").value);
  const n = state.attention.attention.n, m = await headMatrix(l, h);
  for (const c of $("model-view").querySelectorAll("canvas")) c.classList.toggle("chosen", +c.dataset.layer === l && +c.dataset.head === h);
  const a = state.attention;
  const texts = Array.isArray(a.token_text) ? a.token_text.map(visible) : a.tokens.map((t) => readable(t, a.meta.token_encoding));
  // the strongest links only: at 512 tokens a line per pair would be 262,144 lines
  const order = Array.from(m.keys()).filter((k) => m[k] > 0).sort((x, y) => m[y] - m[x]).slice(0, limit);
  const max = order.length ? m[order[0]] : 1, rowH = 16, width = 260, height = n * rowH;
  const box = $("head-view"), left = el("div", null, "col left"), right = el("div", null, "col");
  const svg = svgEl("svg", { width, height, viewBox: `0 0 ${width} ${height}` });
  const lines = [];
  for (const k of order) {
    const i = Math.floor(k / n), j = k % n;
    const line = svgEl("line", { x1: 0, y1: i * rowH + rowH / 2, x2: width, y2: j * rowH + rowH / 2,
      stroke: "#2563eb", "stroke-width": 1.5, "stroke-opacity": (0.1 + 0.9 * m[k] / max).toFixed(3) });
    line.dataset.q = i;
    lines.push(line);
  }
  svg.append(...lines);
  const focus = (i) => {
    for (const line of lines) line.style.display = i === null || +line.dataset.q === i ? "" : "none";
    for (const [c, span] of Array.from(left.children).entries()) span.classList.toggle("hot", c === i);
  };
  texts.forEach((t, i) => {
    const a = el("span", t), b = el("span", t);
    a.onmouseenter = () => focus(i);
    a.onmouseleave = () => focus(null);
    if (state.attention.special[i]) { a.className = b.className = "special"; }
    left.appendChild(a);
    right.appendChild(b);
  });
  box.replaceChildren(left, svg, right);
  $("hv-caption").textContent = `layer ${l}, ${h >= 0 ? "head " + h : "mean over heads"}: the ${order.length} strongest of ${n * n} links (query left, key right); point at a token for its own`;
  document.body.dataset.headView = `${l}:${h}`;
}

// ------------------------------------------------------------------ generation
async function generate() {
  const req = { model: state.facts.name, prompt: $("prompt").value, methods: chosenMethods($("gen-methods")),
    max_new_tokens: Number($("max-new").value), chat: $("chat").checked };
  if (!req.methods.length) throw new Error("choose at least one method");
  if ($("force").value) req.target = $("force").value;
  if ($("gen-contrast").value) req.contrast = $("gen-contrast").value;
  const current = ticket("generate");
  const [g] = await replacing("generate-out", runJob("generate", req, "generating and explaining"), current);
  if (!current()) return;
  state.gen = g;
  state.genModel = req.model;
  state.genRange = null;
  renderGeneration();
}

const PART = "\u00b7";  // a generated token that holds only the first bytes of a character
// the text each prompt and generated token spells: the JSON's own when it gives it, else read from the token
function generationTexts(g) {
  const enc = g.meta && g.meta.token_encoding;
  const prompt = Array.isArray(g.prompt_token_text) ? g.prompt_token_text.map(visible) : g.prompt_tokens.map((t) => readable(t, enc));
  const gen = Array.isArray(g.generated_token_text) ? g.generated_token_text.map(visible) : g.generated_tokens.map((t) => readable(t, enc));
  return prompt.concat(gen);
}

function renderGeneration() {
  const g = state.gen, answer = $("answer");
  $("generate-out").hidden = false;
  answer.replaceChildren();
  const shown = generationTexts(g);
  g.prompt_tokens.forEach((t, i) => { if (!g.prompt_special[i]) answer.appendChild(el("span", shown[i], "tok prompt")); });
  let anchor = null;
  g.generated_ids.forEach((_, t) => {
    // each step's token as the continuation spells it: a character split over several tokens shows on the one
    // that completes it, the tokens of its first bytes as a dot
    const chip = el("span", shown[g.prompt_tokens.length + t] || PART, "tok gen");
    chip.dataset.step = t;
    chip.title = `step ${t}: p = ${fmt(g.probabilities[t])}`;
    chip.onmousedown = (ev) => {
      ev.preventDefault();
      anchor = ev.shiftKey && state.genRange ? state.genRange[0] : t;
      chooseSteps(Math.min(anchor, t), Math.max(anchor, t));
    };
    chip.onmouseenter = (ev) => { if (anchor !== null && ev.buttons === 1) chooseSteps(Math.min(anchor, t), Math.max(anchor, t)); };
    answer.appendChild(chip);
  });
  document.onmouseup = () => { anchor = null; };
  chooseSteps(0, 0);
}

function chooseSteps(t0, t1) {
  const g = state.gen;
  state.genRange = [t0, t1];
  for (const chip of $("answer").querySelectorAll("span.gen")) chip.classList.toggle("chosen", +chip.dataset.step >= t0 && +chip.dataset.step <= t1);
  const n = g.prompt_tokens.length + t1;  // the tokens before the last chosen step
  const tokens = generationTexts(g).slice(0, n);
  const special = generationSpecial(g).slice(0, n);
  const rows = Object.keys(g.scores).map((m) => {
    const values = new Array(n).fill(0);
    for (let t = t0; t <= t1; t++) for (let j = 0; j < n; j++) values[j] += g.scores[m][t][j];
    return { name: m, values, title: t1 > t0 && !LINEAR.has(m) ? "sum of the steps' rows (not the stretch's own explanation for this method)" : "" };
  });
  renderHeatmap($("gen-heatmap"), tokens, special, rows);
  const cap = stepCaption(g, t0, t1);
  if (t0 === t1) cap.append(` (p = ${fmt(g.probabilities[t0])}${g.forced ? ", forced" : ""}${g.contrast_ids ? `, minus ${g.contrast ? JSON.stringify(g.contrast[t0]) : "the contrast token"}` : ""})`);
  else cap.append(" — the rows of its steps summed");
  $("stretch-answer").hidden = t0 === t1 || Boolean(g.contrast_ids);
  document.body.dataset.step = `${t0}-${t1}`;
  delete document.body.dataset.stretch;
}

// Which of prompt + continuation no step scores, as the Python views read them (never shaded, nor counted in a
// row's colour scale): special tokens (an end-of-text token inside a forced continuation, too) and, of an
// encoder-decoder, the sequence its attention stream does not read (the prompt for the decoder's own attention).
function generationSpecial(g) {
  const meta = g.meta || {};
  const generated = meta.generated_special || g.generated_tokens.map(() => false);
  const special = g.prompt_special.concat(generated);
  if (meta.task !== "seq2seq-lm") return special;
  const decoder = meta.attention === "decoder", nPrompt = g.prompt_tokens.length;
  return special.map((sp, i) => sp || (i < nPrompt) === decoder);
}

function stepCaption(g, t0, t1) {
  const enc = g.meta && g.meta.token_encoding;
  const bpe = enc === "byte-level" || enc === "sentencepiece";  // their decoded tokens carry their own spaces
  const texts = generationTexts(g).slice(g.prompt_tokens.length + t0, g.prompt_tokens.length + t1 + 1);
  const chosen = texts.join(bpe ? "" : " ") || "(the first bytes of a character)";
  const cap = $("step-caption");
  cap.replaceChildren(t0 === t1 ? `step ${t0}: ` : `steps ${t0}–${t1}: `, el("b", chosen));
  return cap;
}

// The chosen steps explained as one answer (its summed logit / log-probability, one pass per method): the prompt
// and the tokens generated before the stretch are the input, the stretch's tokens the answer.
async function explainStretch() {
  const g = state.gen, [t0, t1] = state.genRange;
  const req = { model: state.genModel, prompt_ids: g.prompt_ids.concat(g.generated_ids.slice(0, t0)),
    answer_ids: g.generated_ids.slice(t0, t1 + 1), methods: Object.keys(g.scores),
    target_kind: (g.meta && g.meta.target_kind) || "logit" };
  const [exp] = await runJob("answer", req, "explaining the stretch as one answer");
  if (state.gen !== g || state.genRange[0] !== t0 || state.genRange[1] !== t1) return;  // another stretch since
  const n = g.prompt_tokens.length + t1;  // the last answer token explains nothing: the same columns as the sum
  const special = generationSpecial(g).slice(0, n);
  const rows = Object.keys(exp.scores).map((m) => ({ name: m, values: exp.scores[m].slice(0, n), title: "" }));
  renderHeatmap($("gen-heatmap"), generationTexts(g).slice(0, n), special, rows);
  stepCaption(g, t0, t1).append(" — the stretch explained as one answer");
  $("stretch-answer").hidden = true;
  document.body.dataset.stretch = `${t0}-${t1}`;
}

// ------------------------------------------------------------------ sources of an answer
function fillSourceMethods(facts) {
  const box = $("src-methods"), tokenLevel = { methods: facts.methods };
  fillMethods(box, tokenLevel, facts.source_defaults);
  for (const id of facts.source_methods) {
    const label = el("label"), input = el("input");
    input.type = "checkbox";
    input.value = id;
    input.checked = facts.source_defaults.includes(id);
    label.title = (facts.source_summaries || {})[id] || id;
    label.append(input, document.createTextNode(id));
    box.appendChild(label);
  }
}

async function attribute() {
  const req = { model: state.facts.name, context: $("src-context").value, query: $("src-query").value,
    sources: $("src-kind").value, methods: chosenMethods($("src-methods")), max_new_tokens: Number($("src-max-new").value) };
  if (!req.methods.length) throw new Error("choose at least one method");
  if ($("src-answer").value.trim()) req.answer = $("src-answer").value;
  const current = ticket("attribute");
  const result = await replacing("sources-out", runJob("attribute", req, "attributing the answer"), current);
  if (!current()) return;
  $("sources-out").hidden = false;
  const line = $("src-answer-line");
  line.replaceChildren("answer ", el("b", visible(result.answer)));
  const methods = Object.keys(result.sources.length ? result.sources[0].scores : {});
  const head = el("tr");
  head.append(el("th", "#"), el("th", "source"), ...methods.map((m) => el("th", m)));
  const rows = [head];
  const max = {}, top = {};
  for (const m of methods) {
    const values = result.sources.map((s) => s.scores[m]);
    max[m] = Math.max(1e-12, peak(values));
    top[m] = values.reduce((best, v, i) => (!Number.isNaN(v) && (best < 0 || v > values[best]) ? i : best), -1);
  }
  result.sources.forEach((s, i) => {
    const tr = el("tr");
    tr.append(el("td", i, "num"), el("td", visible(s.text), "text"));
    for (const m of methods) {
      const td = el("td", scoreText(s.scores[m]), top[m] === i ? "num top" : "num");
      td.style.backgroundColor = shade(s.scores[m], max[m]);
      tr.appendChild(td);
    }
    rows.push(tr);
  });
  $("src-table").replaceChildren(...rows);
  document.body.dataset.attributed = String(result.sources.length);
}

// ------------------------------------------------------------------ benchmarks
async function loadBenchmarks() {
  const list = await api("/api/benchmarks");
  setOptions($("bench-select"), list.results.map((r) => [r.name, `${r.name} (${r.dataset || "?"}, ${r.n_examples ?? "?"} examples)`]));
  if (list.results.length) await openBenchmark();
  else $("bench-note").textContent = "no results folders: start the server with --results DIR (a folder written by attnlens benchmark)";
}

async function openBenchmark() {
  const name = $("bench-select").value;
  const key = "bench " + name;
  if (!results.has(key)) results.set(key, await api("/api/benchmarks/" + encodeURIComponent(name)));
  if ($("bench-select").value !== name) return;  // a folder chosen since is shown instead (a late reply is dropped)
  if (state.benchName !== name) state.benchSort = null;  // a folder opened again keeps the order chosen on it
  state.benchName = name;
  state.bench = results.get(key);
  const b = state.bench;
  $("bench-facts").textContent = `${b.model || ""} · ${b.dataset || ""} ${b.split || ""} · ${b.n_examples} examples · accuracy ${fmt(b.accuracy)} · ${b.protocol || ""}`;
  renderBenchTable();
  renderCurves();
  const metrics = Object.keys(b.metrics || {});
  setOptions($("bench-metric"), metrics.map((m) => [m, m]));
  renderExamples();
}

function renderBenchTable() {
  const b = state.bench, metrics = Object.keys(b.metrics || {}), table = $("bench-table");
  let methods = Object.keys(b.table);
  if (state.benchSort) {
    const [metric, dir] = state.benchSort;
    const val = (m) => (b.table[m][metric] && b.table[m][metric].mean !== null ? b.table[m][metric].mean : null);
    methods.sort((x, y) => (val(x) === null) - (val(y) === null) || dir * ((val(x) ?? 0) - (val(y) ?? 0)));
  }
  const head = el("tr");
  head.appendChild(el("th", "method"));
  for (const metric of metrics) {
    const info = b.metrics[metric] || {};
    const th = el("th", `${metric} ${info.lower_is_better ? "↓" : "↑"}`);
    th.title = (info.description || "") + " (click to sort)";
    th.onclick = () => {
      const dir = state.benchSort && state.benchSort[0] === metric ? -state.benchSort[1] : (info.lower_is_better ? 1 : -1);
      state.benchSort = [metric, dir];
      renderBenchTable();
    };
    head.appendChild(th);
  }
  const rows = [head];
  const best = {};
  for (const metric of metrics) {
    const vals = methods.map((m) => b.table[m][metric] && b.table[m][metric].mean).filter((v) => v !== null && v !== undefined);
    best[metric] = vals.length ? (b.metrics[metric].lower_is_better ? Math.min(...vals) : Math.max(...vals)) : null;
  }
  for (const m of methods) {
    const tr = el("tr");
    tr.appendChild(el("td", m));
    for (const metric of metrics) {
      const c = b.table[m][metric];
      const td = el("td", c ? fmt(c.mean) : "n/a");
      if (c && c.low !== null) td.append(" ", el("span", `[${fmt(c.low)}, ${fmt(c.high)}]`, "ci"));
      if (c && c.mean !== null && best[metric] !== null && Math.abs(c.mean - best[metric]) <= 1e-12 * Math.max(1, Math.abs(best[metric]))) td.className = "best";
      tr.appendChild(td);
    }
    rows.push(tr);
  }
  table.replaceChildren(...rows);
  $("bench-note").textContent = `mean over the examples [${Math.round(100 * b.confidence)}% confidence interval of the mean, Student t]; best per metric in green`;
}

function lineChart(title, xs, series, yLabel) {
  const w = 360, h = 220, pad = 34, fig = el("figure");
  const all = series.flatMap((s) => s.ys).filter((v) => v !== null && Number.isFinite(v));
  if (!all.length) return null;
  let lo = Math.min(0, ...all), hi = Math.max(...all);
  if (hi === lo) hi = lo + 1;
  const x0 = Math.min(...xs), x1 = Math.max(...xs) || 1;
  const X = (x) => pad + (x - x0) / (x1 - x0 || 1) * (w - pad - 8), Y = (y) => h - pad + 8 - (y - lo) / (hi - lo) * (h - pad - 8);
  const svg = svgEl("svg", { width: w, height: h, viewBox: `0 0 ${w} ${h}` });
  svg.appendChild(svgEl("rect", { x: pad, y: 0, width: w - pad - 8, height: h - pad + 8, fill: "#fff", stroke: "#e5e7eb" }));
  for (const v of [lo, (lo + hi) / 2, hi]) {
    const t = svgEl("text", { x: pad - 4, y: Y(v) + 4, "text-anchor": "end", "font-size": 10, fill: "#6b7280" });
    t.textContent = v.toFixed(2);
    svg.appendChild(t);
  }
  for (const v of [x0, x1]) {
    const t = svgEl("text", { x: X(v), y: h - pad + 22, "text-anchor": "middle", "font-size": 10, fill: "#6b7280" });
    t.textContent = String(v);
    svg.appendChild(t);
  }
  series.forEach((s, k) => {
    const pts = s.ys.map((y, i) => (y === null ? null : `${X(xs[i]).toFixed(1)},${Y(y).toFixed(1)}`)).filter(Boolean);
    svg.appendChild(svgEl("polyline", { points: pts.join(" "), fill: "none", stroke: PALETTE[k % PALETTE.length],
      "stroke-width": 1.6, "stroke-dasharray": s.dashed ? "4 3" : "" }));
  });
  const legend = el("div", null, "legend");
  series.forEach((s, k) => { const i = el("i"); i.style.background = PALETTE[k % PALETTE.length]; const span = el("span"); span.append(i, s.name); legend.appendChild(span); });
  fig.append(svg, el("figcaption", `${title} (y: ${yLabel})`), legend);
  return fig;
}

function renderCurves() {
  const curves = state.bench.curves || {}, box = $("bench-curves");
  const figs = [];
  if (curves.aopc) {
    const methods = Object.keys(curves.aopc).filter((m) => curves.aopc[m].drop.length);
    if (methods.length) figs.push(lineChart("AOPC: top tokens deleted (fraction)", curves.aopc[methods[0]].fractions,
      methods.map((m) => ({ name: m, ys: curves.aopc[m].drop })), "mean drop in p(ŷ)"));
  }
  if (curves.occlusion && curves.occlusion.series) {
    const s = curves.occlusion.series, keys = Object.keys(s).filter((k) => k.endsWith(":top") || k === "random");
    figs.push(lineChart("occlusion: top tokens dropped (count)", curves.occlusion.k,
      keys.map((k) => ({ name: k.replace(":top", ""), ys: s[k].accuracy, dashed: k === "random" })), "accuracy"));
  }
  box.replaceChildren(...figs.filter(Boolean));
  $("bench-curves-panel").hidden = !figs.filter(Boolean).length;
}

function renderExamples() {
  const b = state.bench, metric = $("bench-metric").value, box = $("bench-examples");
  box.replaceChildren();
  $("bench-examples-panel").hidden = !metric;
  for (const m of Object.keys(b.table)) {
    const c = b.table[m][metric];
    if (!c || !c.best.length) continue;
    const col = el("div");
    col.appendChild(el("div", m, "method"));
    for (const [kind, list] of [["best", c.best], ["worst", c.worst]]) {
      for (const ex of list) {
        const text = Array.isArray(ex.text) ? ex.text.join(" ‖ ") : ex.text;
        const button = el("button", `${kind} ${fmt(ex.value)} · #${ex.index} ${text === null || text === undefined ? "(text not stored)" : visible(text)}`);
        button.disabled = ex.text === null || ex.text === undefined;
        button.onclick = () => guarded(() => openExample(ex.text, m));
        col.appendChild(button);
      }
    }
    box.appendChild(col);
  }
}

async function openExample(text, method) {
  // the example is explained by the model the benchmark scored, or not at all: another model's heatmap beside the
  // benchmark's value would show what the benchmark did not measure
  const bench = state.bench, served = state.models.find((m) => m.source === bench.model_source || m.name === bench.model);
  if (!served) throw new Error(`the benchmark's model (${bench.model}) is not served here: start attnlens serve with it to explain its examples`);
  if ($("model").value !== served.name) { $("model").value = served.name; onModel(); }
  selectTab("explain");
  const pair = Array.isArray(text);
  if (pair && !Array.from($("input-kind").options).some((o) => o.value === "pair" && !o.hidden)) throw new Error("this model does not take sentence pairs");
  const shown = (kind) => Array.from($("input-kind").options).some((o) => o.value === kind && !o.hidden);
  if (pair) $("input-kind").value = state.facts.task === "qa" ? "qa" : "pair";
  else if (shown("text")) $("input-kind").value = "text";  // a pair chosen before would send [text, ""]
  onInputKind();
  $("text-a").value = pair ? text[0] : text;
  $("text-b").value = pair ? text[1] : "";
  const box = $("methods").querySelector(`input[value="${CSS.escape(method)}"]`);
  if (box && !box.disabled) box.checked = true;
  await explain();
}

// ------------------------------------------------------------------ tabs and start
function selectTab(name) {
  for (const b of $("tabs").querySelectorAll("button")) b.setAttribute("aria-selected", String(b.dataset.tab === name));
  for (const s of document.querySelectorAll("section.tab")) s.hidden = s.id !== "tab-" + name;
  document.body.dataset.tab = name;
  // the open tab is in the address (#sources): a reload or a shared link opens it again
  if (location.hash !== "#" + name) history.replaceState(null, "", "#" + name);
}

async function start() {
  const info = await api("/api/models");
  state.models = info.models;
  setOptions($("model"), info.models.map((m) => [m.name, m.name]));
  $("model").onchange = onModel;
  onModel();
  $("input-kind").onchange = onInputKind;
  $("explain-form").onsubmit = (ev) => { ev.preventDefault(); guarded(explain); };
  $("words").onchange = () => { if (state.exp) guarded(explain); };
  $("target").onchange = () => { if (state.exp) guarded(explain); };
  $("contrast").onchange = () => { if (state.exp) guarded(explain); };
  $("faithfulness").onclick = () => guarded(faithfulness);
  $("generate-form").onsubmit = (ev) => { ev.preventDefault(); guarded(generate); };
  $("stretch-answer").onclick = () => guarded(explainStretch);
  $("sources-form").onsubmit = (ev) => { ev.preventDefault(); guarded(attribute); };
  $("layer-method").onchange = renderLayers;
  for (const id of ["hv-layer", "hv-head", "hv-links"]) $(id).onchange = () => guarded(drawHeadView);
  $("bench-select").onchange = () => guarded(openBenchmark);
  $("bench-metric").onchange = renderExamples;
  $("cancel").onclick = () => { if (state.job) api("/api/jobs/" + encodeURIComponent(state.job), { method: "DELETE" }).catch(() => {}); };
  for (const b of $("tabs").querySelectorAll("button")) {
    b.onclick = () => {
      selectTab(b.dataset.tab);
      showError(null);
      if (b.dataset.tab === "inside") guarded(showInside);
      if (b.dataset.tab === "bench" && !state.bench) guarded(loadBenchmarks);
      if ((b.dataset.tab === "generate" || b.dataset.tab === "sources") && !state.facts.language_model) {
        const lm = state.models.find((m) => m.language_model);
        if (lm) { $("model").value = lm.name; onModel(); } else showError("no language model is served: start the server with --model of one");
      }
    };
  }
  const lm = state.facts.language_model;
  if (lm) $("input-kind").value = "prompt";
  window.addEventListener("hashchange", openTabOfAddress);
  openTabOfAddress();
  document.body.dataset.ready = "1";
}

// the tab the address names (#generate), opened as a click on it would; an address naming no tab leaves the page
function openTabOfAddress() {
  const name = decodeURIComponent(location.hash.slice(1));
  const button = [...$("tabs").querySelectorAll("button")].find((b) => b.dataset.tab === name);
  if (button && document.body.dataset.tab !== name) button.click();
}

// the browser test measures rendering through this
window.attnlens = { renderExplanation: (exp) => { state.exp = exp; state.expRequest = { model: state.facts.name, text: exp.text }; state.faith = null; return renderExplanation(exp); } };
document.addEventListener("DOMContentLoaded", () => guarded(start));
