"""The context-attribution benchmark: how well each method's source scores predict what ablating sources does to
the answer's log-probability (the metrics of ContextCite and AT2).

Per example (a prompt with its sources and a forced answer) and method:

- ``top1_drop`` / ``top3_drop``: the drop of the answer's log-probability when the method's k highest-scored
  sources are removed (higher is better);
- ``lds``: the linear datamodeling score, the Spearman correlation over ``n_lds`` random ablations (each source
  kept with probability 1/2, the same ablations for every method) between the method's prediction
  ``Σ_kept scores`` and the actual log-probability;
- ``gold_hit``: whether the top-scored source is the one holding the answer;
- ``seconds``: the method's time on this example.

Scores computed outside attnlens (peers run in their own environment) join through ``external`` files of
``{"id", "method", "scores", "seconds"}`` records and are scored against the same ablations.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.fused_attention import weights_dtype
from ..data import text_lines
from ..errors import InputError
from ..paths import atomic_write_text
from ..sources.ablation import ablation_logprobs, full_logprob, random_masks, rank_agreement
from ..sources.attribute import prepare_job, score_job
from ..sources.methods import method_identity
from ..sources.squad import ContextExample
from .results import jsonable, read_rows

if TYPE_CHECKING:
    from ..explainer import Explainer

__all__ = ["METRICS", "ContextBenchmarkConfig", "read_external", "run_context_benchmark", "summarize"]

METRICS = ("top1_drop", "top3_drop", "lds", "gold_hit", "seconds")


@dataclass
class ContextBenchmarkConfig:
    """What a context-attribution benchmark run does (the command's options)."""

    methods: Sequence[str]
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    n_lds: int = 32
    keep_probability: float = 0.5
    ablation: str = "remove"
    seed: int = 0
    memory_budget: int | None = None


def read_external(paths: Sequence[str | Path]) -> dict[str, dict[str, dict[str, Any]]]:
    """``{example id: {method: {"scores", "seconds"}}}`` from peers' JSON Lines files."""
    found: dict[str, dict[str, dict[str, Any]]] = {}
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8-sig")
        except (OSError, UnicodeDecodeError) as err:
            raise InputError(f"--external {path}: cannot be read ({getattr(err, 'strerror', None) or err})") from None
        for n, line in enumerate(text_lines(text), 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                found.setdefault(str(d["id"]), {})[str(d["method"])] = {
                    "scores": [float(v) for v in d["scores"]], "seconds": float(d.get("seconds", math.nan))}
            except (ValueError, KeyError, TypeError) as err:
                raise InputError(f"{path} line {n}: not an {{id, method, scores, seconds}} record ({err})") from None
            if not all(math.isfinite(v) for v in found[str(d["id"])][str(d["method"])]["scores"]):
                raise InputError(f"{path} line {n}: scores that are not finite numbers (NaN or inf) cannot be ranked")
    return found


def _lds(masks: np.ndarray, actual: np.ndarray, scores: np.ndarray) -> float:
    return rank_agreement(masks.astype(np.float64) @ scores, actual)


def _truth_settings(config: ContextBenchmarkConfig, ex: Explainer, example: ContextExample) -> dict[str, Any]:
    """What decides an example's ground truth: the ablation settings, the model (its name and its weights' dtype)
    and the example itself (a digest of its context, query, answer and sources: an id names the same example only
    under the same data set settings, e.g. the number of distractors)."""
    text = json.dumps([example.context, example.query, example.answer, [[s.start, s.end] for s in example.sources]])
    return {"n_lds": config.n_lds, "keep_probability": config.keep_probability, "ablation": config.ablation,
            "seed": config.seed, "model": ex.name, "dtype": weights_dtype(ex.model),
            "example": hashlib.sha256(text.encode()).hexdigest()[:16]}


def evaluate_example(ex: Explainer, example: ContextExample, config: ContextBenchmarkConfig,
                     external: Mapping[str, Mapping[str, Any]] | None = None,
                     previous: Mapping[str, Any] | None = None,
                     identities: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """One example's record: per method its scores and metrics, and the ablations' ground truth (the
    log-probability under each random ablation and under each removal a method asked for).

    With ``previous`` (this example's record from an earlier run with the same ground-truth settings), only the
    methods it lacks, or ran with other options, are computed, and the stored ablations are reused: a method can
    join a finished run at the cost of its own scores and its top-k removals. ``identities``: the run's method
    identities when the caller has them (default: resolved here)."""
    settings = _truth_settings(config, ex, example)
    previous = previous if previous and previous.get("truth", {}).get("settings") == settings else {}
    identities = identities if identities is not None else _identities(ex, config)
    kept = {m: r for m, r in previous.get("methods", {}).items()  # other methods of earlier runs stay
            if m not in config.methods or r.get("options") == identities[m]}
    job = prepare_job(ex.runner, example.context, example.query, answer=example.answer,
                      sources=[(s.start, s.end) for s in example.sources], ablation=config.ablation,
                      memory_budget=config.memory_budget)
    todo = [m for m in config.methods if m not in kept]
    scores: dict[str, np.ndarray] = {}
    seconds: dict[str, float] = {}
    if todo:
        scores, _, figures = score_job(job, todo, {m: o for m, o in config.options.items() if m in todo})
        seconds = dict(figures["seconds"])
    for method, record in (external or {}).items():
        kept.pop(method, None)
        if method in config.methods:
            raise InputError(f"external method {method!r} has the name of a method of this run: rename it in its "
                             f"file (e.g. {method}-peer)")
        if len(record["scores"]) != len(example.sources):
            raise InputError(f"external {method} scores for {example.id} have {len(record['scores'])} values; the "
                             f"example has {len(example.sources)} sources")
        scores[method] = np.asarray(record["scores"], dtype=np.float64)
        seconds[method] = record["seconds"]
    n = len(example.sources)
    truth = previous.get("truth")
    seed = config.seed + zlib.crc32(example.id.encode())  # the same ablations for an example in every run
    masks = random_masks(config.n_lds, n, config.keep_probability, seed)
    removed: dict[str, float] = dict(truth["removed"]) if truth else {}
    # every method's top-1 and top-3 removals not measured yet, deduplicated, batched with the random ablations
    tops = {}
    wanted: list[str] = []
    for m, s in scores.items():
        order = np.argsort(-s, kind="stable")
        tops[m] = [",".join(map(str, sorted(order[:k].tolist()))) for k in (1, min(3, n))]
        wanted += [t for t in tops[m] if t not in removed and t not in wanted]
    keep = np.ones((len(wanted), n), dtype=bool)
    for row, t in enumerate(wanted):
        keep[row, [int(i) for i in t.split(",")]] = False
    if truth:
        full, actual = float(previous["answer_logprob"]), np.asarray(truth["actual"], dtype=np.float64)
        values = ablation_logprobs(job, keep) if wanted else np.zeros(0)
    else:
        full = full_logprob(job)
        values = ablation_logprobs(job, np.vstack([masks, keep]))
        actual, values = values[: len(masks)], values[len(masks):]
    removed.update(zip(wanted, map(float, values)))
    methods = dict(kept)
    for m, s in scores.items():
        methods[m] = {
            "scores": s.tolist(),
            "top1_drop": float(full - removed[tops[m][0]]),
            "top3_drop": float(full - removed[tops[m][1]]),
            "lds": _lds(masks, actual, s),
            "gold_hit": float(int(np.argsort(-s, kind="stable")[0]) == example.gold),  # the top-1 removed
            "seconds": float(seconds.get(m, math.nan)),
            "options": identities.get(m, {}),
        }
    order = [*config.methods, *(external or {}), *(m for m in methods if m not in config.methods
                                                     and m not in (external or {}))]
    return {"id": example.id, "gold": example.gold, "n_sources": n, "answer_logprob": full,
            "methods": {m: methods[m] for m in order if m in methods},
            "truth": {"settings": settings, "actual": actual.tolist(), "removed": removed}}


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per method and metric: mean, 95% confidence half-width (normal approximation) and count."""
    table: dict[str, dict[str, list[float]]] = {}
    for r in records:
        for m, values in r["methods"].items():
            for metric in METRICS:
                v = values.get(metric)
                if v is not None and not math.isnan(v):
                    table.setdefault(m, {}).setdefault(metric, []).append(float(v))
    out: dict[str, dict[str, dict[str, float]]] = {}
    for m, metrics in table.items():
        out[m] = {}
        for metric, vs in metrics.items():
            a = np.asarray(vs)
            half = float(1.96 * a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else None  # null in JSON
            out[m][metric] = {"mean": float(a.mean()), "ci95": half, "n": len(a)}
    return out


def markdown_table(summary: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """The summary as a Markdown table, methods by descending LDS, with the number of examples each was measured
    on; where those differ (a method of an earlier run over other examples), a line under the table says so."""
    head = "| method | n | " + " | ".join(METRICS) + " |\n|---|---:|" + "---|" * len(METRICS)
    rows, counts = [], {}
    for m in sorted(summary, key=lambda k: -summary[k].get("lds", {}).get("mean", -9)):
        cells = []
        for metric in METRICS:
            v = summary[m].get(metric)
            cells.append("—" if v is None else (f"{v['mean']:.3f}" if metric == "seconds" or v["ci95"] is None
                                                 else f"{v['mean']:.3f} ± {v['ci95']:.3f}"))
        counts[m] = max((int(v.get("n", 0)) for v in summary[m].values()), default=0)
        rows.append(f"| {m} | {counts[m]} | " + " | ".join(cells) + " |")
    lines = [head, *rows]
    if len(set(counts.values())) > 1:
        most = max(counts.values())
        fewer = ", ".join(f"{m} ({n})" for m, n in counts.items() if n < most)
        lines += ["", f"Not measured on the same examples: {fewer} on fewer than the {most} of the others; compare "
                      "methods over the examples they share (records.jsonl), or run them on the same examples."]
    return "\n".join(lines)


def _identities(ex: Explainer, config: ContextBenchmarkConfig) -> dict[str, dict[str, Any]]:
    """Per method of the run, its options and what else decides its scores on this model (e.g. which AT2 weights
    the default resolves to): a record made with other identities is recomputed for that method."""
    return {m: method_identity(ex.runner, m, config.options.get(m, {})) for m in config.methods}


def _complete(record: Mapping[str, Any], config: ContextBenchmarkConfig, methods: Sequence[str],
              identities: Mapping[str, Mapping[str, Any]], settings: Mapping[str, Any],
              external: Mapping[str, Mapping[str, Any]] | None = None) -> bool:
    """Whether ``record`` already holds every method, with this run's options and ground-truth ``settings``, and
    each ``external`` method with the scores its file gives now."""
    if record.get("truth", {}).get("settings") != settings:
        return False
    have = record.get("methods", {})
    if any(m not in have or have[m].get("scores") != list(r["scores"]) for m, r in (external or {}).items()):
        return False
    return all(m in have and (m not in config.methods or have[m].get("options") == identities[m]) for m in methods)


def run_context_benchmark(
    ex: Explainer,
    examples: Sequence[ContextExample],
    config: ContextBenchmarkConfig,
    out: str | Path,
    *,
    external: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Evaluate every example and write ``summary.json`` and ``summary.md``; returns the summary.

    Records already in ``out/records.jsonl`` are reused: an example is recomputed only for the methods it lacks
    (or ran with other options), against its stored ablations; records made with other ground-truth settings
    (``n_lds``, keep probability, ablation, seed), another model or another example under the same id (other
    distractors, sources or data) are recomputed whole. The summary covers every method the records
    hold."""
    seen: set[str] = set()
    for e in examples:  # results are kept by id: two examples under one id would be one of them twice
        if e.id in seen:
            raise InputError(f"two examples have the id {e.id!r}: give each example an id of its own")
        seen.add(e.id)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    done: dict[str, dict[str, Any]] = {}
    for r in read_rows(path):  # a line torn by an interruption is cut off, and its example computed again
        if isinstance(r.get("id"), str):
            done[r["id"]] = r
    start = time.perf_counter()
    wanted = [*config.methods]
    identities = _identities(ex, config)
    finished: list[ContextExample] = []
    try:
        with path.open("a", encoding="utf-8") as f:
            for e in examples:
                ext = (external or {}).get(e.id, {})
                old = done.get(e.id)
                settings = _truth_settings(config, ex, e)
                if old is None or not _complete(old, config, [*wanted, *ext], identities, settings, ext):
                    done[e.id] = evaluate_example(ex, e, config, ext, previous=old, identities=identities)
                    f.write(json.dumps(jsonable(done[e.id])) + "\n")  # a later line for an id supersedes an earlier one
                    f.flush()
                finished.append(e)
                if progress is not None:
                    progress(1)
    except KeyboardInterrupt:  # the examples finished so far are summarised; the same command finishes the run
        _write_summary(ex, config, out, [done[e.id] for e in finished], len(examples), start)
        raise
    return _write_summary(ex, config, out, [done[e.id] for e in finished], len(examples), start)


def _write_summary(ex: Explainer, config: ContextBenchmarkConfig, out: Path, records: list[dict[str, Any]],
                   planned: int, start: float) -> dict[str, Any]:
    """``summary.json`` and ``summary.md`` of ``records`` (of ``planned`` examples: fewer after an interruption)."""
    summary = {"model": ex.name, "examples": len(records), "methods": list(config.methods),
               "n_lds": config.n_lds, "ablation": config.ablation, "seconds": round(time.perf_counter() - start, 1),
               "metrics": summarize(records)}
    if len(records) < planned:
        summary.update(planned=planned, complete=False)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    atomic_write_text(out / "summary.md", markdown_table(summary["metrics"]) + "\n")
    return summary
