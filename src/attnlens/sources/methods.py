"""Source-level methods: each scores the sources of one :class:`~attnlens.sources.ablation.CiteJob` directly
(every token-level method of :mod:`attnlens.methods` is also one, through its token scores summed per source).

- ``loo``: leave one out: the drop of the answer's log-probability when that source alone is removed
  (one forward per source, batched).
- ``contextcite``: ContextCite (Cohen-Wang et al. 2024): ``n_ablations`` random ablations keeping each source
  with probability ``keep_probability``, and a sparse linear surrogate (scikit-learn's Lasso) from the keep-masks
  to the answer's log-probability; a source's score is its coefficient (the log-probability it adds when kept).
- ``at2``: learned attention attribution (:mod:`attnlens.sources.at2`): per layer and head, the attention from
  the answer to each source, weighted by a linear estimator fitted to ablation effects; one forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError
from .ablation import CiteJob, ablation_logprobs, full_logprob, random_masks

__all__ = ["SOURCE_METHODS", "SourceMethod", "method_identity", "source_method"]


@dataclass(frozen=True)
class SourceMethod:
    """A source-level method: ``compute(job, **options) -> (scores (n_sources,), meta)``; ``forwards(n_sources,
    **options)``: how many forwards it runs (for progress); ``identity(runner, **options)``: what else decides its
    scores on a model beside the option values (e.g. the weights a default resolves to), for records that must
    notice a change; ``token_methods``: the token-level methods whose pass it runs on the whole prompt (their memory
    is checked against the budget before anything runs); ``check(job, **options)``: raises
    :class:`~attnlens.errors.InputError` before any method of the job runs when its options or the memory budget
    rule it out; ``why_not(model)``: why the method cannot run on a model at all, or ``None`` where it can;
    ``check_values(**options)``: raises :class:`~attnlens.errors.InputError` for option values no model is needed
    to judge (called when a request's options are checked, before anything is loaded); ``ablates``: whether its
    scores come from forwards with sources taken out (the ``ablation`` setting applies to it)."""

    name: str
    compute: Callable[..., tuple[np.ndarray, dict[str, Any]]]
    summary: str
    citation: str
    forwards: Callable[..., int]
    options: dict[str, Any] = field(default_factory=dict)
    identity: Callable[..., dict[str, Any]] | None = None
    token_methods: tuple[str, ...] = ()
    check: Callable[..., None] | None = None
    why_not: Callable[[Any], str | None] | None = None
    check_values: Callable[..., None] | None = None
    ablates: bool = False

    def unsupported(self, model: Any) -> str | None:
        """Why this method cannot run on ``model``, or ``None`` where it can (as
        :meth:`attnlens.methods.Method.unsupported` says it of a token-level method)."""
        return None if self.why_not is None else self.why_not(model)


SOURCE_METHODS: dict[str, SourceMethod] = {}


def source_method(name: str, summary: str, citation: str, forwards: Callable[..., int],
                  identity: Callable[..., dict[str, Any]] | None = None, token_methods: tuple[str, ...] = (),
                  check: Callable[..., None] | None = None, why_not: Callable[[Any], str | None] | None = None,
                  check_values: Callable[..., None] | None = None, ablates: bool = False,
                  **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a source-level method under ``name`` (its keyword defaults are ``options``)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        SOURCE_METHODS[name] = SourceMethod(name, fn, summary, citation, forwards, options, identity, token_methods,
                                          check, why_not, check_values, ablates)
        return fn

    return wrap


def method_identity(runner: Any, name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options a method ``name`` runs with on ``runner``'s model (a source method's defaults included, so a
    changed default is noticed), plus what else decides its scores there (a source method's ``identity``): two runs
    whose identities are equal give the same scores."""
    spec = SOURCE_METHODS.get(name)
    if spec is None:
        return dict(options)
    found = check_source_options(name, dict(options))
    if spec.identity is not None:
        found.update(spec.identity(runner, **found))
    return found


def check_source_options(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` merged over the method's defaults; unknown options, and values the method's ``check_values``
    refuses, are an :class:`InputError`."""
    spec = SOURCE_METHODS[name]
    unknown = set(given) - set(spec.options)
    if unknown:
        raise InputError(f"{name} has no option {', '.join(sorted(unknown))}; its options: "
                         f"{', '.join(spec.options) or 'none'}")
    merged = {**spec.options, **given}
    if spec.check_values is not None:
        spec.check_values(**merged)
    return merged


@source_method("loo", "Leave one out: the drop of the answer's log-probability when the source alone is removed.",
               "leave-one-out ablation (e.g. Cohen-Wang et al. 2024's baseline)",
               forwards=lambda n, **_: n + 1, ablates=True)
def loo(job: CiteJob) -> tuple[np.ndarray, dict[str, Any]]:
    n = len(job.sources)
    keep = ~np.eye(n, dtype=bool)
    if "full" in job.cache:
        full = full_logprob(job)
        return full - ablation_logprobs(job, keep), {"answer_logprob": full}
    # the whole prompt with its ablations: one forward over the beginning they share (answer_logprobs' reference)
    values = ablation_logprobs(job, np.vstack([np.ones((1, n), dtype=bool), keep]))
    job.cache["full"] = full = float(values[0])
    return full - values[1:], {"answer_logprob": full}


def _contextcite_values(n_ablations: Any = 64, keep_probability: Any = 0.5, alpha: Any = 0.01,
                        seed: Any = 0) -> None:
    """contextcite's option values, judged before anything is loaded (:class:`InputError` on a bad one)."""
    def number(value: Any) -> bool:
        return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))

    if not (number(n_ablations) and float(n_ablations).is_integer() and n_ablations >= 2):
        raise InputError(f"contextcite: n_ablations must be an integer >= 2, got {n_ablations!r}")
    if not (number(keep_probability) and 0.0 < float(keep_probability) < 1.0):
        raise InputError(f"contextcite: keep_probability must be a number between 0 and 1, got {keep_probability!r}")
    if not (number(alpha) and np.isfinite(alpha) and float(alpha) >= 0.0):
        raise InputError(f"contextcite: alpha (the Lasso's penalty) must be a number >= 0, got {alpha!r}")
    if not (number(seed) and float(seed).is_integer() and seed >= 0):
        raise InputError(f"contextcite: seed must be an integer >= 0, got {seed!r}")


@source_method("contextcite", "ContextCite: random ablations and a sparse linear surrogate (Lasso) of the answer's "
               "log-probability; a source's score is its coefficient.", "Cohen-Wang et al. 2024 (NeurIPS)",
               forwards=lambda n, n_ablations=64, **_: int(n_ablations), check_values=_contextcite_values,
               ablates=True, n_ablations=64, keep_probability=0.5, alpha=0.01, seed=0)
def contextcite(job: CiteJob, n_ablations: int = 64, keep_probability: float = 0.5, alpha: float = 0.01,
                seed: int = 0) -> tuple[np.ndarray, dict[str, Any]]:
    from sklearn.linear_model import Lasso

    _contextcite_values(n_ablations, keep_probability, alpha, seed)
    n_ablations, seed = int(n_ablations), int(seed)
    masks = random_masks(n_ablations, len(job.sources), keep_probability, seed)
    y = ablation_logprobs(job, masks)
    fit = Lasso(alpha=alpha, fit_intercept=True).fit(masks.astype(np.float64), y)
    return np.asarray(fit.coef_, dtype=np.float64), {"intercept": float(fit.intercept_),
                                                     "n_ablations": n_ablations}
