"""Reproduce the papers' evaluations with attnlens and write ``docs/reproduction.md``.

1. AttCAT Tables 1-2 (SST-2 column): AOPC, LOdds and Kendall-τ of every method on SST-2 dev with
   ``../shared/models/minilm-sst2``, under the papers' equations (``paper``) and the AttCAT code's quirks
   (``attcat-code``), next to the paper's BERT-base numbers.
2. Karpekov & Miller 2023, Charts 2 and 5-6: occlusion curves (random / rawatt top / agrad top / agrad bottom) and the
   consistency (silhouette) of rawatt and agrad on the IMDB 2,000-review sample with ``minilm-imdb``.
3. Method study: AOPC and LOdds of the attention, norm/decomposition and gradient methods on SST-2 dev
   (``minilm-sst2``) and 200 reviews of the IMDB sample at 256 tokens (``minilm-imdb``), run with
   ``attnlens benchmark`` itself (the command lines in the document are the ones run).

Results directories go to ``results/reproduction/`` and are resumed when present, so the script can be stopped
and started again. Run: ``python scripts/reproduce.py [--sst2-limit N] [--attcat-limit N] [--imdb-limit N]``.
The method study's runs go to ``results/method-study/``; ``python scripts/reproduce.py --study [--no-run]`` runs
(or, with ``--no-run``, only summarises, partial runs included) them and rewrites that section of the document alone.
Run it from the repository root (the runs record the model path as given).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from attnlens.data import load_dataset
from attnlens.evaluation.metrics import EvalConfig
from attnlens.evaluation.results import BenchmarkSettings, read_run
from attnlens.evaluation.runner import BenchmarkRun, run_benchmark
from attnlens.evaluation.summary import best_methods, summarize
from attnlens.explainer import Explainer
from attnlens.methods.registry import get_method, list_methods

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT.parent / "shared" / "models"
DATA = ROOT.parent / "shared" / "data"
SLOW = ("integratedgradients",)  # 50 forward+backward passes per example and class: hours on 2 CPU cores

# AttCAT (Qiang et al. 2022) Table 1, SST2 column (AOPC ↑, LOdds ↓) and Table 2 (Kendall-τ ↓), BERT-base.
PAPER_SST2 = {
    "rawatt": (0.331, -0.885, None),
    "rollout": (0.286, -0.641, None),
    "grads": (0.335, -0.252, 0.150),
    "attgrads": (0.351, -0.603, 0.116),
    "partiallrp": (0.341, -0.922, 0.955),
    "transatt": (0.354, -1.038, 0.336),
    "cat": (0.352, -1.115, 0.101),
    "attcat": (0.371, -1.319, 0.018),
}
PAPER_ORDER = list(PAPER_SST2)


def fmt(v: float | None, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def rank_of(values: dict[str, float | None], lower_is_better: bool) -> list[str]:
    items = [(m, v) for m, v in values.items() if v is not None]
    return [m for m, _ in sorted(items, key=lambda x: x[1], reverse=not lower_is_better)]


def spearman(a: list[str], b: list[str]) -> float | None:
    common = [m for m in a if m in b]
    if len(common) < 3:
        return None
    from scipy.stats import spearmanr

    return float(spearmanr([a.index(m) for m in common], [b.index(m) for m in common]).statistic)


def sst2_section(paper: dict[str, Any], code: dict[str, Any]) -> list[str]:
    methods = paper["methods"]
    lines = [
        "## 1. AttCAT Tables 1-2, SST-2 column",
        "",
        f"Model `minilm-sst2` (MiniLM-L6-H384, dev accuracy {fmt(paper['accuracy'])} here) on SST-2 dev "
        f"({paper['n_examples']} sentences under `paper`, {code['n_examples']} under `attcat-code`). The paper used "
        "BERT-base (`textattack/bert-base-uncased-SST-2`), so absolute values are not expected to match; the "
        "ranking of methods is what can agree. `paper` = the equations as published (predicted class, 0-100 % "
        "of the non-special tokens in 10 % steps, signed AOPC, τ_b of the score vectors); `attcat-code` = the "
        "authors' notebooks (gold class, 9 levels of 11.1 % counted with [CLS]/[SEP], inputs under 10 tokens "
        "skipped, |p0 − pk|, τ of argsort sequences). See `docs/benchmark-format.md` for the definitions.",
        "",
        "| method | AOPC ↑ paper | AOPC ↑ ours (paper) | AOPC ↑ ours (attcat-code) | LOdds ↓ paper | LOdds ↓ ours "
        "(paper) | LOdds ↓ ours (attcat-code) | τ ↓ paper | τ ↓ ours (paper) | τ ↓ ours (attcat-code) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = [m for m in PAPER_ORDER if m in methods or m in PAPER_SST2] + [m for m in methods if m not in PAPER_SST2]
    for m in order:
        ref = PAPER_SST2.get(m, (None, None, None))
        ours = paper["results"].get(m, {})
        theirs = code["results"].get(m, {})
        missing = m not in methods
        cells = [fmt(ref[0]), "—" if missing else fmt(ours.get("aopc")), "—" if missing else fmt(theirs.get("aopc")),
                 fmt(ref[1]), "—" if missing else fmt(ours.get("lodds")), "—" if missing else fmt(theirs.get("lodds")),
                 fmt(ref[2]), "—" if missing else fmt(ours.get("kendall")),
                 "—" if missing else fmt(theirs.get("kendall"))]
        lines.append(f"| {m}{' (not run)' if missing else ''} | " + " | ".join(cells) + " |")
    lines += ["", "**Where we agree and where not** (computed from the table above):", ""]
    lines += sst2_findings(paper, code)
    return lines


def sst2_findings(paper: dict[str, Any], code: dict[str, Any]) -> list[str]:
    out = []
    shared = [m for m in PAPER_ORDER if m in paper["methods"]]
    for label, res in (("paper", paper["results"]), ("attcat-code", code["results"])):
        for idx, name, lower in ((0, "aopc", False), (1, "lodds", True), (2, "kendall", True)):
            ref_rank = rank_of({m: PAPER_SST2[m][idx] for m in shared}, lower)
            our_rank = rank_of({m: res[m].get(name) for m in shared}, lower)
            rho = spearman(ref_rank, our_rank)
            best_ref, best_ours = (ref_rank or [None])[0], (our_rank or [None])[0]
            verdict = "agrees" if best_ref == best_ours else "differs"
            out.append(
                f"- {name.upper()} ({label} protocol): best among the paper's methods is **{best_ours}** here, "
                f"**{best_ref}** in the paper ({verdict}); rank correlation with the paper's order over "
                f"{len(our_rank)} shared methods: ρ = {fmt(rho, 2)}. Our order: {', '.join(our_rank)}."
            )
    res = paper["results"]
    att = [m for m in ("rawatt", "rollout") if m in res and res[m].get("aopc") is not None]
    others = [m for m in shared if m not in ("rawatt", "rollout") and res[m].get("aopc") is not None]
    if att and others:
        worst = max(res[m]["aopc"] for m in att)
        beaten = [m for m in others if res[m]["aopc"] > worst]
        out.append(
            f"- The paper finds attention-only methods (RawAtt, Rollout) worst on AOPC. Here (paper protocol) "
            f"{len(beaten)} of {len(others)} gradient/CAT methods beat both: "
            f"{'agrees' if len(beaten) == len(others) else 'partly agrees' if beaten else 'does not agree'}."
        )
    if "cat" in res and "attcat" in res:
        for name, lower in (("aopc", False), ("lodds", True), ("kendall", True)):
            a, c = res["attcat"].get(name), res["cat"].get(name)
            if a is None or c is None:
                continue
            better = a < c if lower else a > c
            out.append(f"- AttCAT vs CAT on {name.upper()} (paper protocol): {fmt(a)} vs {fmt(c)}; the paper's "
                       f"ablation (AttCAT better) {'holds' if better else 'does not hold'} here.")
    missing = [m for m in PAPER_ORDER if m not in paper["methods"]]
    if missing:
        out.append(f"- Not run: {', '.join(missing)} (not available in this build or excluded for CPU time).")
    out.append("- Absolute values differ from the paper's: a 6-layer MiniLM is not BERT-base, and under the `paper` "
               "protocol our Kendall τ (τ_b of the score vectors) is strongly negative for gradient methods, whose "
               "scores for the two classes of a binary head are near mirror images; the paper's small positive τ "
               "values come from comparing argsort sequences (the `attcat-code` column).")
    return out


def imdb_section(imdb: dict[str, Any], pred: dict[str, Any], n_total: int, image: Path | None,
                 emb: list[Path]) -> list[str]:
    occ = imdb["curves"]["occlusion"]
    ks = occ["k"]
    show = [k for k in ks if k in (0, 2, 6, 10, 18, 20, 30, 40)]
    series = [s for s in ("random", "rawatt:top", "agrad:top", "agrad:bottom") if s in occ["series"]]
    lines = [
        "## 2. Karpekov & Miller: occlusion curves and consistency on IMDB",
        "",
        "The protocol of Karpekov & Miller, \"Is Attention Truly All We Need?\", 2023 (DistilBERT on IMDB). "
        f"Model `minilm-imdb` (MiniLM-L6-H384 fine-tuned on 5,000 IMDB reviews, max 256 tokens) on "
        f"**{imdb['n_examples']} of the {n_total} reviews** of the balanced IMDB test sample "
        "(`test_sample2000_seed0.jsonl`, subset drawn with seed 0; inputs truncated to 256 tokens). The subset is "
        "forced by CPU time: each review needs ~85 forward passes of up to 256 tokens. Tokens are dropped by "
        f"setting their attention mask to 0 (`{occ['drop']}`), as Karpekov & Miller do; `random` draws among the real "
        "tokens (they drew among all 512 padded positions). As in their code, AGrad explains the "
        "cross-entropy loss of the gold label (`--target gold --target-kind loss`); the last two rows explain the "
        f"predicted class's logit instead (attnlens' default). Accuracy at k = 0: {fmt(imdb['accuracy'])}.",
        "",
        "Accuracy relative to k = 0 (absolute accuracy in brackets):",
        "",
        "| strategy | " + " | ".join(f"k={k}" for k in show) + " |",
        "|---|" + "---:|" * len(show),
    ]
    for s in series:
        rel, acc = occ["series"][s]["relative"], occ["series"][s]["accuracy"]
        lines.append(f"| {s} | " + " | ".join(f"{fmt(rel[ks.index(k)], 2)} ({fmt(acc[ks.index(k)], 2)})"
                                                 for k in show) + " |")
    pocc = pred["curves"]["occlusion"]["series"]
    for s in ("agrad:top", "agrad:bottom"):
        if s in pocc:
            rel, acc = pocc[s]["relative"], pocc[s]["accuracy"]
            lines.append(f"| {s} (predicted-class logit) | " + " | ".join(
                f"{fmt(rel[ks.index(k)], 2)} ({fmt(acc[ks.index(k)], 2)})" for k in show) + " |")
    if image is not None:
        lines += ["", f"![occlusion curves](images/{image.name})"]
    lines += ["", "**Where we agree and where not:**", ""]
    s = occ["series"]
    k40 = ks.index(max(ks))

    def at(name: str, k: int) -> float | None:
        return s[name]["relative"][ks.index(k)] if name in s else None

    r, a, g, b = (s.get(x, {}).get("relative", [None] * len(ks))[k40] for x in series_names())
    lines.append(f"- Random dropping barely moves accuracy in Karpekov & Miller (Chart 1). Here {max(ks)} random "
                 f"tokens leave {fmt(r, 2)} of the accuracy: {'agrees' if r is not None and r > 0.9 else 'differs'}.")
    lines.append(f"- Karpekov & Miller (DistilBERT, Chart 2): attention top-40 costs ~30 % of the accuracy, AGrad "
                 f"top-40 ~70 %. Here: rawatt top-{max(ks)} keeps {fmt(a, 2)}, agrad top-{max(ks)} keeps {fmt(g, 2)}. "
                 f"AGrad hurts more than raw attention: "
                 f"{'agrees' if a is not None and g is not None and g < a else 'does not agree'}.")
    half = next((k for k in ks if at("agrad:top", k) is not None and at("agrad:top", k) <= 0.5), None)
    lines.append(f"- Karpekov & Miller: dropping 18 AGrad-top tokens halves accuracy. Here accuracy first falls to "
                 f"half at k = {half if half is not None else f'> {max(ks)}'}.")
    lines.append(f"- Karpekov & Miller: dropping AGrad-bottom tokens raises accuracy (91 % → almost 100 %, +12 % "
                 f"relative). Here agrad bottom-{max(ks)}: {fmt(b, 2)} relative, from {fmt(imdb['accuracy'], 2)} "
                 f"at k = 0 ({verdict_bottom(b)}). Explaining the predicted class instead, agrad bottom-{max(ks)} "
                 f"gives {fmt(pocc_bottom(pred, max(ks)), 2)}: removing evidence against the prediction cannot "
                 "flip it.")
    cons = imdb.get("consistency") or {}
    if "rawatt" in cons and "agrad" in cons:
        sr, sg = cons["rawatt"]["silhouette"], cons["agrad"]["silhouette"]
        lines.append(f"- Consistency (Karpekov & Miller Charts 5-6, DistilBERT, 100 reviews): silhouette 0.348 for "
                     f"attention, 0.569 for AGrad. Here ({cons['agrad']['n_examples']} correctly classified reviews, "
                     f"top-5 tokens, last-layer states): {fmt(sr)} for rawatt, {fmt(sg)} for agrad: AGrad more "
                     f"consistent {'holds' if sr is not None and sg is not None and sg > sr else 'does not hold'}. "
                     f"With predicted-class logit explanations: {fmt(pcons_sil(pred, 'agrad'))} for agrad.")
        lines += [""] + [f"![embedding](images/{p.name})" for p in emb]
    return lines


ATTENTION_FAMILY = ("rawatt", "rollout", "flow", "attgrads", "agrad", "gae", "cat", "attcat")


def generation_section(path: Path) -> list[str]:
    """The figures of ``bench/generation_faithfulness.py --json results/generation_faithfulness.json``, if run."""
    if not path.is_file():
        return []
    import json
    import sys

    sys.path.insert(0, str(ROOT / "bench"))
    from generation_faithfulness import table  # the one table of that benchmark

    f = json.loads(path.read_text(encoding="utf-8"))
    res, secs = f["results"], f["seconds"]
    lines = [
        "## 4. Generation: faithfulness on a decoder-only LLM (`bench/generation_faithfulness.py`)",
        "",
        "SmolLM2-135M-Instruct (`--model smollm2`, Llama architecture, 30 layers × 9 heads), each example's next "
        "token explained with every method that applies to a causal LM, and the top "
        "0, 10, ..., 100% of the prompt's *text* tokens (never the template's) deleted (AOPC, higher is better) "
        "or replaced by the pad token (LOdds, lower is better), on CPU:",
        "",
    ]
    for name, r in res.items():
        if r.get("choices"):
            what = (f"zero-shot classification, template `{r['template']!r}`; the model's choice between "
                    f"{' and '.join(repr(c) for c in r['choices'])} explained as the contrast chosen − other, its "
                    "probability renormalised over the two tracked; accuracy against the gold labels")
        else:
            what = (f"template `{r['template']!r}`; the first token of the expected answer explained (logit) and its "
                    "vocabulary probability tracked; accuracy = the answer's first token is the top next token")
        mean_p = sum(e["p"] for e in r["examples"]) / r["n"]
        lines.append(f"- **{name}**: {r['n']} prompts; {what}: {r['accuracy']:.1%}; mean p(explained token) "
                     f"{mean_p:.2f}; {secs[name]:.0f} s.")
    lines += ["", table(res), ""]
    for name, r in res.items():
        ranked = sorted(r["methods"], key=lambda m: -(r["methods"][m]["aopc"] or 0.0))
        att = [m for m in ranked if m in ATTENTION_FAMILY]
        lines.append(f"{name}: best AOPC {ranked[0]} ({r['methods'][ranked[0]]['aopc']:.3f}), best attention-family "
                     f"method {att[0]} (rank {ranked.index(att[0]) + 1} of {len(ranked)}), raw attention rank "
                     f"{ranked.index('rawatt') + 1}, rollout rank {ranked.index('rollout') + 1}.")
    return lines + [""]


def speed_section(path: Path) -> list[str]:
    """The figures of ``bench/eval_speed.py --json results/eval_speed.json``, if it was run."""
    if not path.is_file():
        return []
    f = json.loads(path.read_text(encoding="utf-8"))
    return [
        "## 3. Speed (`bench/eval_speed.py`)",
        "",
        f"All non-LRP methods × AOPC + LOdds + Kendall τ on SST-2 dev ({f['n_examples']} sentences) with "
        f"`minilm-sst2`, {f['threads']} CPU threads (shared with other jobs while measured):",
        "",
        "| run | seconds |",
        "|---|---:|",
        f"| attnlens, {len(f['methods'])} methods (all but integratedgradients) | {f['full_seconds']:.0f} "
        f"(explain {f['explain_seconds']:.0f} + evaluate {f['evaluate_seconds']:.0f}) |",
        f"| + integratedgradients (50 steps, 2 classes; explanations measured on {f['loop_examples']} examples and "
        f"scaled, its perturbations not included) | {f['estimated_total_seconds']:.0f} (estimate) |",
        f"| batch-1, one-method-at-a-time loop with every non-LRP method, {f['loop_examples']} examples scaled to "
        f"{f['n_examples']} | {f['loop_scaled_seconds']:.0f} |",
        "",
        f"The run takes {f['full_seconds'] / 60:.1f} min without integrated gradients and an estimated "
        f"{f['estimated_total_seconds'] / 60:.1f} min with it (a fixed 50 steps; the default is adaptive from 4; "
        "run in full with `--with-ig`: [Performance](performance.md#evaluating)): its 50-step "
        "path integral, done for two classes "
        "because of Kendall τ, costs more than everything else together. Speed-up over the batch-1 loop: "
        f"{f['loop_scaled_seconds'] / f['estimated_total_seconds']:.1f}x.",
        "",
    ]


def pocc_bottom(pred: dict[str, Any], k: int) -> float | None:
    occ = pred["curves"]["occlusion"]
    series = occ["series"].get("agrad:bottom")
    return None if series is None else series["relative"][occ["k"].index(k)]


def verdict_bottom(b: float | None) -> str:
    if b is None:
        return "not measured"
    return "agrees" if b > 1 else "no rise" if b >= 0.99 else "disagrees: it falls"


def merge(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from runs of different method groups on the same examples."""
    out = dict(summaries[0])
    out["methods"] = [m for s in summaries for m in s["methods"]]
    out["results"] = {m: r for s in summaries for m, r in s["results"].items()}
    out["timing"] = {"seconds": sum(s["timing"].get("seconds", 0.0) for s in summaries)}
    return out


def pcons_sil(pred: dict[str, Any], method: str) -> float | None:
    return (pred.get("consistency") or {}).get(method, {}).get("silhouette")


def series_names() -> tuple[str, str, str, str]:
    return ("random", "rawatt:top", "agrad:top", "agrad:bottom")

# --- Method study: attention, norm/decomposition and gradient methods on SST-2 and IMDB ---------------------------
ISSUE11_METHODS = ["attnlrp", "integratedgradients", "grads", "agrad", "attcat", "decompx", "alti", "globenc",
                   "attnnorm", "valuezeroing", "rawatt"]
REFERENCES = ("integratedgradients", "attnlrp")  # the methods the issue asks an attention-based method to beat
NOT_ATTENTION = ("integratedgradients", "attnlrp", "grads")  # the rest read attention (weights, norms, gradients)
IMDB_METHODS = [m for m in ISSUE11_METHODS if m != "valuezeroing"]
STUDY_RUNS: dict[str, tuple[str, list[str]]] = {
    "sst2-dev": ("`minilm-sst2` × SST-2 dev (872 sentences)", [
        "--model", "../shared/models/minilm-sst2", "--dataset", "sst2", "--split", "dev",
        "--methods", ",".join(ISSUE11_METHODS), "--chunk-size", "16"]),
    "imdb-sample": ("`minilm-imdb` × IMDB test sample (200 of the 2,000 reviews, seed 0, 256 tokens)", [
        "--model", "../shared/models/minilm-imdb", "--dataset", "imdb", "--split", "sample2000", "--limit", "200",
        "--max-length", "256", "--methods", ",".join(IMDB_METHODS), "--chunk-size", "8"]),
}
ISSUE11_COMMON = ["--metrics", "aopc,lodds", "--seed", "0", "--threads", "1"]
ISSUE11_NOTES = {
    "imdb-sample": "Value zeroing is left out for CPU time: its cost grows as N² FFN evaluations per layer "
                   "([Value zeroing](methods/value-zeroing.md)).",
}


def study_args(name: str, out: Path) -> list[str]:
    """The ``attnlens benchmark`` arguments of the method study's run ``name`` (paths relative to the repository
    root)."""
    where = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
    return ["benchmark", *STUDY_RUNS[name][1], *ISSUE11_COMMON, "--out", f"{where}/{name}"]


def study_summary(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The summary of a (possibly partial) results directory and its per-example rows; ``None`` if never run."""
    if not (run_dir / "run.json").is_file():
        return None
    import tempfile

    from attnlens.evaluation.results import complete_examples, read_rows

    run = read_run(run_dir / "run.json")
    settings = BenchmarkSettings(**run["settings"])
    rows = read_rows(run_dir / "examples.jsonl", repair=False)  # a run may be appending to it: never cut it
    with tempfile.TemporaryDirectory() as tmp:  # summarise a copy of the complete lines, the run's files untouched
        Path(tmp, "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        summary = summarize(tmp, settings, timing={"seconds": run.get("seconds")})
    done = complete_examples(rows, settings.methods)
    return summary, [r for r in rows if r["index"] in done and r["method"] is not None]


def paired(rows: list[dict[str, Any]], a: str, b: str, metric: str) -> tuple[float, float] | None:
    """Mean per-example difference ``a − b`` of ``metric`` and its standard error (paired: same examples)."""
    va = {r["index"]: r["metrics"].get(metric) for r in rows if r["method"] == a}
    vb = {r["index"]: r["metrics"].get(metric) for r in rows if r["method"] == b}
    d = [va[i] - vb[i] for i in va if i in vb and va[i] is not None and vb[i] is not None]
    if len(d) < 2:
        return None
    t = torch.tensor(d, dtype=torch.float64)
    return float(t.mean()), float(t.std() / len(d) ** 0.5)


def study_section(out: Path) -> list[str]:
    lines = [
        "## 5. Method study: attention, norm/decomposition and gradient methods (AOPC, LOdds)",
        "",
        "Protocol `paper` (predicted class, its logit explained; 0-100 % of the real tokens deleted (AOPC) or "
        "replaced by [PAD] (LOdds) in 10 % steps), seed 0, one CPU thread, run with `attnlens benchmark` itself "
        "(`python scripts/reproduce.py --study` runs the commands below and rewrites this section; a run that "
        "was stopped is resumed, and a partial one is summarised over the examples it finished, the first chunks "
        "in data-set order). Best value per column in bold. Δ = paired mean difference over the same examples "
        "± its standard error.",
        "",
    ]
    for name, (title, _) in STUDY_RUNS.items():
        got = study_summary(out / name)
        lines += [f"### {title}", "", "```bash", "attnlens " + " ".join(study_args(name, out)), "```", ""]
        if got is None:
            lines += ["Not run yet.", ""]
            continue
        summary, rows = got
        res = summary["results"]
        done, planned = summary["n_examples"], summary["n_planned"]
        seconds = (summary.get("timing") or {}).get("seconds")
        lines.append(f"{done} of {planned} examples done{' (partial run)' if done < planned else ''}; model "
                     f"accuracy on them {fmt(summary['accuracy'])}; compute {fmt(seconds, 0)} s."
                     + (f" {ISSUE11_NOTES[name]}" if name in ISSUE11_NOTES else ""))
        lines += ["", "| method | AOPC ↑ | LOdds ↓ |", "|---|---:|---:|"]
        best = {m: best_methods(summary, m) for m in ("aopc", "lodds")}
        order = sorted(res, key=lambda m: -(res[m].get("aopc") if res[m].get("aopc") is not None else -9))
        for m in order:
            cells = [f"**{fmt(res[m].get(k))}**" if m in best[k] else fmt(res[m].get(k)) for k in ("aopc", "lodds")]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines += ["", *study_findings(res, rows), ""]
    return lines


def study_findings(res: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """What the table says about the issue's goal, computed from it."""
    out = []
    attention = [m for m in res if m not in NOT_ATTENTION and res[m].get("aopc") is not None]
    refs = [m for m in REFERENCES if m in res and res[m].get("aopc") is not None]
    if not attention or not refs:
        return out
    for metric, label, lower in (("aopc", "AOPC", False), ("lodds", "LOdds", True)):
        key = (lambda m, metric=metric: res[m][metric]) if lower else (lambda m, metric=metric: -res[m][metric])
        top = min(attention, key=key)
        ref = min(refs, key=key)
        diff = paired(rows, top, ref, metric)
        beats = key(top) < key(ref)
        out.append(f"- {label}: best attention-based method **{top}** ({fmt(res[top][metric])}), best of "
                   f"integrated gradients / AttnLRP **{ref}** ({fmt(res[ref][metric])}); Δ = "
                   + ("n/a" if diff is None else f"{diff[0]:+.3f} ± {diff[1]:.3f}")
                   + f": {'ahead' if beats else 'behind'}"
                   + (" (|Δ| < 2 standard errors: not a clear difference)." if diff and abs(diff[0]) < 2 * diff[1]
                      else "."))
    winners = [m for m in attention if all(
        (res[m][k] < res[r][k]) if k == "lodds" else (res[m][k] > res[r][k]) for r in refs for k in ("aopc", "lodds"))]
    out.append("- An attention-based method ahead of both integrated gradients and AttnLRP on both metrics: "
               + (", ".join(winners) if winners else "none") + ".")
    return out


def section_span(text: str, heading: str) -> tuple[int, int] | None:
    """Where the section starting with ``heading`` is in ``text``: from the heading to the next ``## `` heading
    (or the end), or ``None``."""
    start = text.find(heading)
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    return start, len(text) if end < 0 else end


def kept_section(doc: Path, heading: str) -> list[str] | None:
    """The lines of the section starting with ``heading`` in the current ``doc`` (up to the next ``## ``), or
    ``None``: a section whose analysis is written by hand is carried over, not rendered again."""
    text = doc.read_text(encoding="utf-8") if doc.is_file() else ""
    span = section_span(text, heading)
    return None if span is None else text[span[0]: span[1]].rstrip("\n").split("\n") + [""]


def write_study(doc: Path, out: Path) -> None:
    """Replace (or append) section 5 of ``doc``, leaving the other sections as they are."""
    text = doc.read_text(encoding="utf-8") if doc.is_file() else "# Reproduction report\n"
    section = "\n".join(study_section(out)).rstrip() + "\n"
    span = section_span(text, "## 5. Method study")
    new = text.rstrip() + "\n\n" + section if span is None else text[:span[0]] + section + text[span[1]:]
    doc.write_text(new, encoding="utf-8")


def run_study(out: Path, names: list[str]) -> None:
    """Run (or resume) the method study's benchmarks with the CLI, one after the other."""
    for name in names:
        subprocess.run([sys.executable, "-m", "attnlens.cli", *study_args(name, out)], cwd=ROOT, check=True)


def main() -> None:
    os.environ.setdefault("ATTNLENS_DATA", str(DATA))  # the benchmark commands it runs name no --data-root
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sst2-limit", type=int, default=None, help="SST-2 dev subset under `paper` (default all)")
    parser.add_argument("--attcat-limit", type=int, default=None, help="SST-2 subset under `attcat-code`")
    parser.add_argument("--imdb-limit", type=int, default=100, help="IMDB sample subset for the occlusion curves")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CPU is shared: keep it small)")
    parser.add_argument("--with-slow", action="store_true", help=f"also run {', '.join(SLOW)}")
    parser.add_argument("--out", default=str(ROOT / "results" / "reproduction"))
    parser.add_argument("--doc", default=str(ROOT / "docs" / "reproduction.md"))
    parser.add_argument("--study", action="store_true",
                        help="only the method study's runs and section 5 of the document")
    parser.add_argument("--study-runs", default=",".join(STUDY_RUNS), help="which of the method study's runs to do")
    parser.add_argument("--no-run", action="store_true", help="with --study: summarise what is there, run nothing")
    parser.add_argument("--study-out", default=str(ROOT / "results" / "method-study"))
    args = parser.parse_args()
    if args.study:
        if not args.no_run:
            run_study(Path(args.study_out), [n for n in args.study_runs.split(",") if n])
        write_study(Path(args.doc), Path(args.study_out))
        print(f"wrote section 5 of {args.doc}")
        return
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    t0 = time.perf_counter()

    sst2_model = MODELS / "minilm-sst2"
    ex = Explainer.from_pretrained(str(sst2_model))
    methods = [m for m in list_methods() if args.with_slow or m not in SLOW]
    # LRP methods get their own results directories, so that either group can be (re)run on its own
    groups = {"": [m for m in methods if not get_method(m).lrp], "-lrp": [m for m in methods if get_method(m).lrp]}
    name = str(sst2_model.resolve())
    metrics = "aopc,lodds,kendall"
    runs: dict[str, list[dict[str, Any]]] = {"paper": [], "attcat-code": []}
    for suffix, group in groups.items():
        if not group:
            continue
        runs["paper"].append(run_benchmark(
            ex, load_dataset("sst2", "dev", limit=args.sst2_limit, root=DATA), out / f"sst2-paper{suffix}",
            methods=group, metrics=metrics, model_name=name))
        runs["attcat-code"].append(run_benchmark(
            ex, load_dataset("sst2", "dev", limit=args.attcat_limit, root=DATA), out / f"sst2-attcat-code{suffix}",
            methods=group, metrics=metrics, model_name=name,
            config=EvalConfig(protocol="attcat-code", pad_token_id=ex.pad_id)))
    paper, code = merge(runs["paper"]), merge(runs["attcat-code"])

    imdb_model = MODELS / "minilm-imdb"
    ex_imdb = Explainer.from_pretrained(str(imdb_model), max_length=256)
    full_imdb = load_dataset("imdb", "sample2000", root=DATA)
    imdb_subset = load_dataset("imdb", "sample2000", limit=args.imdb_limit, root=DATA)
    common = BenchmarkRun(methods=["rawatt", "agrad"], metrics="occlusion,consistency",
                          model_name=str(imdb_model.resolve()), batch_size=8, eval_batch_size=16,
                          config=EvalConfig(pad_token_id=ex_imdb.pad_id), chunk_size=16)
    # Karpekov & Miller explain the cross-entropy loss of the gold label; the predicted-class logit run is for contrast
    imdb = run_benchmark(ex_imdb, imdb_subset, out / "imdb-occlusion-gold", common, target="gold", target_kind="loss")
    imdb_pred = run_benchmark(ex_imdb, imdb_subset, out / "imdb-occlusion", common)
    images = Path(args.doc).resolve().parent / "images"
    images.mkdir(parents=True, exist_ok=True)
    occ_png, emb_pngs = None, []
    try:
        from attnlens.viz.plots import plot_embedding, plot_occlusion_curves

        occ_png = images / "reproduction-imdb-occlusion.png"
        plot_occlusion_curves(imdb, occ_png, series=[s for s in series_names() if s in imdb["curves"]["occlusion"]
                                                      ["series"]])
        for m in ("rawatt", "agrad"):
            if imdb.get("consistency", {}).get(m, {}).get("points"):
                p = images / f"reproduction-imdb-consistency-{m}.png"
                plot_embedding(imdb["consistency"], m, p, label_names=["negative", "positive"])
                emb_pngs.append(p)
    except ImportError:  # plotting is optional for the report
        pass

    elapsed = time.perf_counter() - t0
    timings = {k: v["timing"].get("seconds") for k, v in (("sst2-paper", paper), ("sst2-attcat-code", code),
                                                           ("imdb-gold", imdb), ("imdb-predicted", imdb_pred))}
    doc = [
        "# Reproduction report",
        "",
        f"Generated by `scripts/reproduce.py` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"(torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s), {platform.machine()}). Compute time "
        "of the runs (cumulative when resumed): "
        + ", ".join(f"{k} {fmt(v, 0)} s" for k, v in timings.items())
        + f"; this invocation {elapsed:.0f} s. Results directories: `results/reproduction/` (not committed; rerun "
        "the script to regenerate them; it resumes what is there).",
        "",
        f"Methods run: {', '.join(methods)}."
        + ("" if args.with_slow else f" Left out for CPU time: {', '.join(SLOW)} (`--with-slow` runs it)."),
        "",
        *sst2_section(paper, code),
        "",
        *imdb_section(imdb, imdb_pred, len(full_imdb), occ_png, emb_pngs),
        "",
        # section 3 comes from bench/eval_speed.py's JSON when it is here, else the document's is kept
        *(speed_section(ROOT / "results" / "eval_speed.json") or kept_section(Path(args.doc), "## 3. Speed")
          or []),
        # section 4's tables and analysis are maintained by hand (chunked runs joined with --merge); kept as is
        *(kept_section(Path(args.doc), "## 4. Generation")
          or generation_section(ROOT / "results" / "generation_faithfulness.json")),
        "",
        *study_section(Path(args.study_out)),
    ]
    # sections kept from the document end in a blank line of their own: one blank line between sections
    Path(args.doc).write_text(re.sub(r"\n{3,}", "\n\n", "\n".join(doc)), encoding="utf-8")
    print(f"wrote {args.doc} in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
