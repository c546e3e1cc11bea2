"""Speed of the LRP methods and of attention flow on a real model.

Figures: the time of ``partiallrp + transatt + attnlrp`` (one shared capture pass for ∇A plus, per batch, one
LRP forward in the chefer layout with a backward for each rule set: ``"chefer"`` for partiallrp and transatt,
``"attnlrp"`` for attnlrp, ``lrp_passes``) divided by the time of one plain forward + backward over the same
batches (gradient of the target logits w.r.t. the embeddings, eager attention), one LRP pass alone of each rule
set and the joint one, the ``"attnlrp"`` pass fused with every layer's activations kept
(``lrp_pass(..., fused=True, recompute=False)``), ``attnlrp`` alone through the engine (which runs that fused pass
where the model allows it), and attention flow's seconds per sentence. ``--out F`` also writes them to ``F``
(JSON).

Run: ``OMP_WAIT_POLICY=PASSIVE python bench/lrp_flow_speed.py [model_dir] [--n N] [--batch-size 32] [--out F]``
(default: ``../shared/models/minilm-sst2`` on the SST-2 dev set).

``--flow-lengths`` times attention flow alone on long inputs instead: seconds per example at 32/128/256/512
tokens on random row-stochastic attention of MiniLM's shape (6 layers x 12 heads, explained from token 0) and on
one real 512-token IMDB review through ``../shared/models/minilm-imdb``, for the library's flow (in one process,
``new_s``, and with the max-flows shared among the processes of ``usable_cores()``, ``shared_s``) and for the
previous implementation (one max-flow on the full graph per input token, kept below as ``full_graph_flow``),
timed back to back in the same run, with a check that both give identical scores; for the review also a whole
flow explanation (forward, maps and max-flows; by default and with ``workers=1``) against one plain forward +
backward of it with fused attention (the medians of at least 5 interleaved runs).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path

import numpy as np  # noqa: E402
import torch
from common import MODEL, SHARED, SST2_DEV, batch_inputs, engine_batches, plain_forward_backward, read_texts, timed
from peak import machine

from attnlens import Explainer
from attnlens.core.forked import usable_cores
from attnlens.lrp import lrp_pass, lrp_passes
from attnlens.methods import flow as flow_method
from attnlens.methods import get_method

LRP_METHODS = ["partiallrp", "transatt", "attnlrp"]


def run(model_dir: str | Path, texts: list[str], batch_size: int = 32, flow_texts: int = 200) -> dict:
    """Time the LRP methods and flow on ``texts``; returns the figures as a dict.

    The timings of each batch are interleaved (plain pass, LRP pass, the three LRP methods through the engine,
    flow, an attention-only engine call), so that a machine whose load drifts biases no ratio.
    """
    ex = Explainer.from_pretrained(model_dir)
    model = ex.model.eval()
    batches = engine_batches(ex, texts, batch_size)
    specs = [get_method(m) for m in LRP_METHODS]
    opts = {s.name: s.check_options({}) for s in specs}
    flow_spec, raw_spec = get_method("flow"), get_method("rawatt")
    attnlrp = [get_method("attnlrp")]
    attnlrp_opts = {"attnlrp": attnlrp[0].check_options({})}
    totals = dict.fromkeys(("plain", "lrp_pass", "lrp_pass_chefer", "lrp_passes", "lrp_pass_fused", "attnlrp_method",
                            "lrp_methods", "flow", "forward_only"), 0.0)
    n_flow = 0
    for i, batch in enumerate([batches[0]] + batches):  # the first run is a warm-up
        inputs = batch_inputs(ex, batch)
        with torch.no_grad():
            targets = model(**inputs).logits.argmax(-1)
        t = {
            "plain": plain_forward_backward(model, inputs),
            "lrp_pass": timed(lrp_pass, model, inputs, targets),
            "lrp_pass_chefer": timed(lrp_pass, model, inputs, targets, rules="chefer", inputs_relevance=False),
            "lrp_passes": timed(lrp_passes, model, inputs, targets),
            "lrp_pass_fused": timed(lrp_pass, model, inputs, targets, fused=True, recompute=False),
            "attnlrp_method": timed(ex.compute_batch, batch, [-1] * len(batch), attnlrp, attnlrp_opts),
            "lrp_methods": timed(ex.compute_batch, batch, [-1] * len(batch), specs, opts),
        }
        if n_flow < flow_texts:
            t["flow"] = timed(ex.compute_batch, batch, [-1] * len(batch), [flow_spec], {"flow": {}})
            t["forward_only"] = timed(ex.compute_batch, batch, [-1] * len(batch), [raw_spec], {"rawatt": {}})
            n_flow += len(batch) if i else 0
        if i:
            for k, v in t.items():
                totals[k] += v
    n_tokens = sum(len(e.ids) for b in batches for e in b)
    return {
        "model": str(model_dir),
        "n_texts": len(texts),
        "mean_tokens": n_tokens / len(texts),
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
        "plain_forward_backward_s": totals["plain"],
        "lrp_pass_s": totals["lrp_pass"],
        "lrp_pass_ratio": totals["lrp_pass"] / totals["plain"],
        "lrp_pass_chefer_ratio": totals["lrp_pass_chefer"] / totals["plain"],
        "lrp_passes_joint_ratio": totals["lrp_passes"] / totals["plain"],
        "lrp_pass_fused_ratio": totals["lrp_pass_fused"] / totals["plain"],
        "attnlrp_method_ratio": totals["attnlrp_method"] / totals["plain"],
        "lrp_methods_s": totals["lrp_methods"],
        "lrp_methods_ratio": totals["lrp_methods"] / totals["plain"],
        # flow's own cost: the engine call with flow minus the same call with an attention-only method
        "flow_s_per_sentence": max(totals["flow"] - totals["forward_only"], 0.0) / max(n_flow, 1),
        "flow_sentences": n_flow,
    }


def full_graph_flow(mats: np.ndarray, source: int) -> np.ndarray:
    """The previous attention flow (the reference for timing and equality): one Dinic max-flow on the full
    integer-capacity graph per input token."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    n = mats.shape[1]
    data, indices, indptr, sink = flow_method._flow_graph(mats, source)
    caps1 = np.rint(mats[0] * flow_method.FLOW_SCALE).astype(np.int32)
    out = np.empty(n)
    for j in range(n):
        data[-n:] = caps1[:, j]
        graph = csr_matrix((data, indices, indptr), shape=(sink + 1, sink + 1))
        out[j] = maximum_flow(graph, 0, sink, method="dinic").flow_value
    return out / flow_method.FLOW_SCALE


def random_attention(n: int, layers: int = 6, heads: int = 12, seed: int = 0) -> np.ndarray:
    """Row-stochastic attention ``(L, H, n, n)``: softmax of scaled Gaussian logits (as the unit tests use)."""
    rng = np.random.default_rng(seed)
    return torch.softmax(torch.from_numpy(rng.normal(size=(layers, heads, n, n)) * 2.0), -1).numpy()


def imdb_review(model_dir: Path = SHARED / "models" / "minilm-imdb", min_words: int = 600) -> tuple[Explainer, str]:
    """The IMDB classifier's explainer and the first IMDB test review long enough to fill its 512 tokens."""
    with gzip.open(SHARED / "data" / "imdb" / "test.jsonl.gz", "rt", encoding="utf-8") as f:
        text = next(r["text"] for r in map(json.loads, f) if len(r["text"].split()) >= min_words)
    return Explainer.from_pretrained(model_dir), text


def imdb_attention(ex: Explainer, text: str) -> np.ndarray:
    """Attention ``(L, H, 512, 512)`` of the review."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "truncated to 512 tokens"
        _, _, att = ex.attention_maps(text)
    return att


def flow_against_plain(ex: Explainer, text: str, repeats: int) -> dict:
    """Seconds of a whole flow explanation of the review (the engine's forward, the maps and the max-flows) and
    of one plain forward + backward of it with fused attention, interleaved; the medians and their ratio."""
    from attnlens.core.modelstate import explaining

    inputs = dict(ex.tokenizer(text, truncation=True, max_length=512, return_tensors="pt"))
    times: dict[str, list[float]] = {"explain": [], "explain_1": [], "plain": []}
    one = {"flow": {"workers": 1}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ex.explain(text, methods=["flow"])  # warm-up
        for _ in range(repeats):
            times["explain"].append(timed(ex.explain, text, methods=["flow"]))
            times["explain_1"].append(timed(ex.explain, text, methods=["flow"], options=one))
            with explaining(ex.model, "sdpa"):
                times["plain"].append(plain_forward_backward(ex.model, inputs))
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"explain_s": med["explain"], "explain_1_process_s": med["explain_1"], "plain_s": med["plain"],
            "x_plain": med["explain"] / med["plain"], "x_plain_1_process": med["explain_1"] / med["plain"],
            "processes": usable_cores()}


def flow_lengths(lengths: tuple[int, ...] = (32, 128, 256, 512), old: bool = True, repeats: int = 2) -> list[dict]:
    """Seconds per example of attention flow (one-hot source at token 0, as for a [CLS] classifier): the library
    and, when ``old``, the full-graph reference timed right after it on the same attention; each the fastest of
    ``repeats`` runs."""
    ex, review = imdb_review()
    cases = [(f"random {n} tokens", random_attention(n)) for n in lengths] + [("minilm-imdb 512 tokens",
                                                                             imdb_attention(ex, review))]
    rows = []
    for name, att in cases:
        mats = flow_method.flow_matrices(att)
        times: dict[str, list[float]] = {"new": [], "shared": [], "old": []}
        for _ in range(repeats):  # interleaved; the minimum of each is the least disturbed by other load
            start = time.perf_counter()
            new = flow_method.flow_from(mats, 0)
            times["new"].append(time.perf_counter() - start)
            start = time.perf_counter()
            shared = flow_method.flow_from(mats, 0, workers=usable_cores())
            times["shared"].append(time.perf_counter() - start)
            if old:
                start = time.perf_counter()
                ref = full_graph_flow(mats, 0)
                times["old"].append(time.perf_counter() - start)
        row = {"case": name, "layers": mats.shape[0], "new_s": min(times["new"]), "shared_s": min(times["shared"]),
               "shared_identical": bool(np.array_equal(new, shared))}
        if old:
            row["old_s"] = min(times["old"])
            row["speedup"] = row["old_s"] / row["new_s"]
            row["identical"] = bool(np.array_equal(new, ref))
        if name.startswith("minilm-imdb"):
            row.update(flow_against_plain(ex, review, max(repeats, 5)))
        rows.append(row)
        print("  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", default=str(MODEL))
    parser.add_argument("--data", default=str(SST2_DEV), help="JSONL file with a 'text' field")
    parser.add_argument("--n", type=int, default=None, help="use the first N texts (default: all)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", help="also write the figures to this JSON file")
    parser.add_argument("--flow-lengths", action="store_true",
                        help="time attention flow alone at 32-512 tokens against the previous implementation")
    parser.add_argument("--no-old", action="store_true", help="with --flow-lengths: skip the previous implementation")
    parser.add_argument("--repeats", type=int, default=2, help="with --flow-lengths: runs per timing (the fastest)")
    args = parser.parse_args()
    if args.flow_lengths:
        flow_lengths(old=not args.no_old, repeats=args.repeats)
        return
    texts = read_texts(args.data, args.n)
    figures = run(args.model_dir, texts, args.batch_size)
    figures["machine"] = machine()
    for key, value in figures.items():
        print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
