"""Token-level methods summed per source: one shared pass over the prompt and the explained answer.

Every token-level method of :mod:`attnlens.methods` explains the answer's summed log-probability once
(:func:`attnlens.core.answer_engine.explain_answer`); a source's score is the sum of its tokens' scores. Used by
:func:`attnlens.sources.attribute.score_job` and by AT2 variants that take a token method's source scores as
features (:mod:`attnlens.sources.at2`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.answer_engine import explain_answer
from ..core.progress import ProgressCallback
from .ablation import CiteJob

__all__ = ["TokenSourceScores", "token_source_scores"]


@dataclass
class TokenSourceScores:
    """What one shared pass gives per method: ``scores`` (per source), ``token_scores`` (per prompt token),
    ``outside`` (the share of the absolute token mass outside every source), ``seconds`` (the pass's time split
    evenly between its methods), ``meta`` (what the methods report) and the answer's log-probability."""

    scores: dict[str, np.ndarray] = field(default_factory=dict)
    token_scores: dict[str, np.ndarray] = field(default_factory=dict)
    outside: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    answer_logprob: float | None = None


def token_source_scores(job: CiteJob, methods: Sequence[str], options: Mapping[str, Mapping[str, Any]] | None = None,
                        progress: bool | ProgressCallback = False) -> TokenSourceScores:
    """The token-level ``methods``' scores of the job's sources, from one pass (within the job's memory budget:
    over it, one :class:`~attnlens.errors.InputError` line before anything runs)."""
    out = TokenSourceScores()
    n_prompt = len(job.prompt.ids)
    src_index = np.asarray(job.token_source)
    inside = src_index >= 0
    start = time.perf_counter()
    exp = explain_answer(job.runner, job.prompt.ids + job.prefix_ids, job.answer_ids, list(methods),
                         text=job.prompt.text, target_kind="loss", options=dict(options or {}),
                         memory_budget=job.memory_budget, progress=progress)
    elapsed = time.perf_counter() - start
    out.answer_logprob = exp.meta.get("answer_logprob")
    n_input = n_prompt + len(job.prefix_ids)  # the answer's tokens before the explained ones are read too
    for m, s in exp.scores.items():
        tok = np.asarray(s[:n_prompt], dtype=np.float64)
        out.token_scores[m] = tok
        per_source = np.zeros(len(job.sources))
        np.add.at(per_source, src_index[inside], tok[inside])
        out.scores[m] = per_source
        # outside every source: template, query, special tokens, and the answer's tokens before the explained ones
        mass = float(np.abs(np.asarray(s[:n_input], dtype=np.float64)).sum())
        out.outside[m] = (mass - float(np.abs(tok[inside]).sum())) / mass if mass > 0 else 0.0
        out.seconds[m] = elapsed / len(exp.scores)  # one shared pass: its time split evenly
        if m in exp.meta:
            out.meta[m] = exp.meta[m]
    return out
