"""Evaluation of explanations: faithfulness (AOPC, LOdds, ERASER, occlusion), confidence (Kendall τ),
consistency (silhouette) and precision@K, with a batched, resumable benchmark runner.

Modules: ``metrics`` (each metric: its description, per-example value and summary curve), ``perturb`` (perturbed
inputs on token ids and their batched scoring), ``runner`` (the chunked explain + score loop), ``results`` (the
results directory's files and lock), ``summary`` (``summary.json`` and the tables)."""

from .metrics import (
    ALL_METRICS,
    DEFAULT_METRICS,
    PROTOCOLS,
    EvalConfig,
    Item,
    MetricInfo,
    Result,
    answer_token_positions,
    consistency,
    kendall_tau,
    metric_info,
    precision_at_k,
    resolve_metrics,
    score_examples,
)
from .perturb import ModelPredictor, Variant, perturb
from .results import BenchmarkSettings, results_lock
from .runner import BenchmarkRun, run_benchmark
from .summary import best_methods, summarize, write_tables

__all__ = [
    "ALL_METRICS", "DEFAULT_METRICS", "PROTOCOLS", "BenchmarkRun", "BenchmarkSettings", "EvalConfig", "Item",
    "MetricInfo", "ModelPredictor", "Result", "Variant", "answer_token_positions", "best_methods", "consistency",
    "kendall_tau",
    "metric_info", "perturb", "precision_at_k", "resolve_metrics", "results_lock", "run_benchmark",
    "score_examples", "summarize", "write_tables",
]
