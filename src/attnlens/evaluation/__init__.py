"""Evaluation of explanations: faithfulness (AOPC, LOdds, ERASER, occlusion), confidence (Kendall τ),
consistency (silhouette) and precision@K, with a batched, resumable benchmark runner."""

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
from .perturb import ModelPredictor, Variant, from_id_predictor, perturb
from .runner import explainer_predictor, run_benchmark, summarize

__all__ = [
    "ALL_METRICS", "DEFAULT_METRICS", "PROTOCOLS", "EvalConfig", "Item", "MetricInfo", "ModelPredictor", "Result",
    "Variant", "answer_token_positions", "consistency", "explainer_predictor", "from_id_predictor",
    "kendall_tau", "metric_info", "perturb", "precision_at_k", "resolve_metrics", "run_benchmark",
    "score_examples", "summarize",
]
