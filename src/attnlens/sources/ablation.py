"""Ablating sources: the answer's log-probability when some sources are taken out of the context.

Two ways to take a source out (``ablation``):

- ``"remove"`` (default): delete exactly the source's characters from the context and tokenize the prompt again,
  as a user would who left that sentence out. Positions after it shift; the model sees a shorter prompt.
- ``"mask"``: keep every token but hide the source's tokens from attention (attention mask 0, positions kept).
  Cheaper to reason about token by token, but the model never saw such inputs in training.

The drop of the answer's log-probability is the ground truth of the benchmark (top-k drop, LDS) and the basis
of two methods: ``loo`` (leave one source out) and ``contextcite`` (random ablations, sparse linear surrogate,
Cohen-Wang et al. 2024).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.answer_engine import answer_logprobs
from ..core.model_runner import ModelRunner
from ..errors import InputError
from ..results.context_attribution import Source
from .prompt import Prompt, with_context

__all__ = ["ABLATIONS", "CiteJob", "ablated_context", "ablation_logprobs", "random_masks"]

ABLATIONS = ("remove", "mask")


@dataclass
class CiteJob:
    """One answer to attribute: what every source-level method reads.

    Attributes:
        runner: the model and its facts (a causal language model): :class:`~attnlens.core.model_runner.ModelRunner`.
        context: the context; ``sources`` its sources.
        prompt: the tokenized prompt; ``token_source`` each prompt token's source (-1: none).
        prefix_ids: token ids between the prompt and the explained answer tokens (the answer's own earlier
            tokens when only a stretch of it is explained; usually empty).
        answer_ids: the explained answer tokens.
        ablation: ``"remove"`` or ``"mask"``.
        memory_budget: bytes the forwards may plan for.
        query: the query; ``answer`` the whole answer text, ``answer_offsets`` its tokens' character spans,
            ``answer_token_ids`` its token ids, ``explained`` the explained character span of it, ``generated``
            whether the model generated it.
        progress: called with the number of forwards done, or ``None``.
        cache: shared between methods (the full prompt's log-probability, ablation results).
    """

    runner: ModelRunner
    context: str
    sources: list[Source]
    prompt: Prompt
    token_source: list[int]
    prefix_ids: list[int]
    answer_ids: list[int]
    ablation: str = "remove"
    memory_budget: int | None = None
    query: str = ""
    answer: str = ""
    answer_offsets: list[tuple[int, int]] = field(default_factory=list)
    answer_token_ids: list[int] = field(default_factory=list)
    explained: tuple[int, int] = (0, 0)
    generated: bool = False
    progress: Callable[[int], None] | None = None
    cache: dict[str, Any] = field(default_factory=dict)


def ablated_context(context: str, sources: Sequence[Source], keep: Sequence[bool]) -> str:
    """``context`` without the characters of the sources not kept."""
    parts, at = [], 0
    for s, k in sorted(zip(sources, keep), key=lambda p: p[0].start):
        if not k:
            parts.append(context[at:s.start])
            at = s.end
    parts.append(context[at:])
    return "".join(parts)


def random_masks(n: int, n_sources: int, keep_probability: float, seed: int) -> np.ndarray:
    """``(n, n_sources)`` boolean keep-masks, each source kept with ``keep_probability`` (ContextCite's
    ablation design)."""
    if not 0.0 < keep_probability < 1.0:
        raise InputError(f"keep_probability must be between 0 and 1, got {keep_probability}")
    return np.random.default_rng(seed).random((n, n_sources)) < keep_probability


def rank_agreement(predicted: np.ndarray, actual: np.ndarray) -> float:
    """Spearman correlation of predicted and actual ablation outcomes (the LDS of one prompt); 0 when either is
    constant (a constant prediction ranks nothing)."""
    from scipy.stats import spearmanr

    if np.ptp(predicted) == 0 or np.ptp(actual) == 0:
        return 0.0
    return float(spearmanr(predicted, actual).statistic)


def ablation_logprobs(job: CiteJob, keep: np.ndarray) -> np.ndarray:
    """The explained answer's log-probability with each row of ``keep`` ``(V, n_sources)`` (True: kept) applied
    to the context, ``(V,)``: all variants batched within the memory budget, each distinct row run once (with
    few sources, random masks repeat: three sources have eight)."""
    keep = np.asarray(keep, dtype=bool)
    if keep.ndim != 2 or keep.shape[1] != len(job.sources):
        raise InputError(f"ablation masks must be (variants, {len(job.sources)}), got {keep.shape}")
    distinct, where = np.unique(keep, axis=0, return_inverse=True)
    if job.progress is not None and len(distinct) < len(keep):
        job.progress(len(keep) - len(distinct))  # the repeats cost nothing
    return _distinct_logprobs(job, distinct)[where.reshape(-1)]


def _distinct_logprobs(job: CiteJob, keep: np.ndarray) -> np.ndarray:
    """:func:`ablation_logprobs` of rows that are all different."""
    reference = None
    if job.ablation == "remove":
        prompts, masks = [], None
        reference = job.prompt.ids + job.prefix_ids  # each variant runs on the cache of what it shares with it
        for row in keep:
            if row.all():
                ids = job.prompt.ids
            else:
                p = job.prompt
                ids = with_context(job.runner.tokenizer, p.prefix, ablated_context(job.context, job.sources, row),
                                   p.suffix, p.chat).ids
            prompts.append(ids + job.prefix_ids)
    elif job.ablation == "mask":
        prompts = [job.prompt.ids + job.prefix_ids] * len(keep)
        sources = np.asarray(job.token_source)
        masks = []
        for row in keep:
            hidden = (sources >= 0) & ~row[np.clip(sources, 0, None)]
            masks.append([0 if h else 1 for h in hidden] + [1] * len(job.prefix_ids))
    else:
        raise InputError(f"ablation={job.ablation!r}; choose one of {', '.join(ABLATIONS)}")
    return answer_logprobs(job.runner, prompts, job.answer_ids, masks=masks, memory_budget=job.memory_budget,
                           progress=job.progress, reference=reference)


def full_logprob(job: CiteJob) -> float:
    """The answer's log-probability with the whole context (computed once per job)."""
    if "full" not in job.cache:
        job.cache["full"] = float(ablation_logprobs(job, np.ones((1, len(job.sources)), dtype=bool))[0])
    return job.cache["full"]
