"""The server's state: the models given on the command line (each loaded once), the limits, the job queue and
the benchmark folders; turns checked requests into jobs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.memory import DEFAULT_BUDGET
from ..errors import InputError
from ..results.explanation import Explanation
from . import compute
from .benchmarks import find_results, read_results
from .jobs import Job, JobQueue
from .requests import (
    ExplainRequest,
    Limits,
    answer_request,
    attention_request,
    attribute_request,
    explain_request,
    faithfulness_metrics,
    generate_request,
)

CACHE_BYTES = 2**30  # the most the cache of results holds, whatever the budget
KINDS = ("explain", "faithfulness", "attention", "generate", "answer", "attribute")


@dataclass
class ServeState:
    """Everything the routes share.

    Attributes:
        explainers: model name (as the page and the API name it) -> loaded :class:`~attnlens.Explainer`.
        results: the ``--results`` folders.
        limits: what one request may ask for.
        memory_budget: bytes each computation plans within (they run one at a time); the cache of results holds
            at most as much again (at most :data:`CACHE_BYTES`).
    """

    explainers: Mapping[str, Any]
    results: list[Path] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    memory_budget: int = DEFAULT_BUDGET

    def __post_init__(self) -> None:
        if not self.explainers:
            raise InputError("serve at least one model")
        self.models = list(self.explainers)
        self.jobs = JobQueue(cache_bytes=min(CACHE_BYTES, self.memory_budget))
        self.facts = {name: compute.model_facts(name, ex) for name, ex in self.explainers.items()}

    def submit(self, kind: str, body: Any) -> Job:
        """Check ``body`` for a computation of ``kind`` and queue it (or answer it from the cache)."""
        budget = self.memory_budget
        if kind == "explain":
            req = explain_request(body, self.models, self.limits)
            return self.jobs.submit(req.model, kind, req.key(), lambda job: compute.explain(
                self._explanations(req, job), req))
        if kind == "faithfulness":
            req = replace(explain_request(body, self.models, self.limits), words=False)
            metrics = faithfulness_metrics(body)
            ex = self.explainers[req.model]
            return self.jobs.submit(req.model, kind, req.key("faithfulness") + repr(metrics),
                                    lambda job: compute.faithfulness(ex, self._explanations(req, job), metrics,
                                                                     job.report, budget))
        if kind == "attention":
            model, text = attention_request(body, self.models, self.limits)
            ex = self.explainers[model]
            return self.jobs.submit(model, kind, f"attention:{model}:{text!r}",
                                    lambda job: compute.attention(ex, text, budget, job.report))
        if kind == "generate":
            req = generate_request(body, self.models, self.limits)
            ex = self.explainers[req.model]
            return self.jobs.submit(req.model, kind, req.key(), lambda job: compute.generate(ex, req, job.report,
                                                                                             budget))
        if kind == "answer":
            req = answer_request(body, self.models, self.limits)
            ex = self.explainers[req.model]
            return self.jobs.submit(req.model, kind, req.key(), lambda job: compute.answer(ex, req, job.report,
                                                                                           budget))
        if kind == "attribute":
            req = attribute_request(body, self.models, self.limits)
            ex = self.explainers[req.model]
            return self.jobs.submit(req.model, kind, req.key(), lambda job: compute.attribute(ex, req, job.report,
                                                                                              budget))
        raise InputError(f"unknown kind {str(kind)[:40]!r}; choose one of {', '.join(KINDS)}")

    def _explanations(self, req: ExplainRequest, job: Job) -> list[Explanation]:
        """The token-level explanations of ``req``: rebuilt from a cached answer when there is one, so that
        measuring faithfulness after explaining does not explain again."""
        plain = replace(req, words=False)
        cached = self.jobs.cached(plain.key())
        if cached is not None:
            return [Explanation.from_dict(d) for d in cached]
        exps = compute.explanations(self.explainers[req.model], req, job.report, self.memory_budget)
        self.jobs.remember(plain.key(), compute.explain(exps, plain))
        return exps

    def benchmarks(self) -> dict[str, Path]:
        return find_results(self.results)

    def benchmark(self, name: str) -> dict[str, Any]:
        folders = self.benchmarks()
        if name not in folders:  # only names this server lists: never a path from the page
            raise LookupError(name)
        return read_results(name, folders[name])
