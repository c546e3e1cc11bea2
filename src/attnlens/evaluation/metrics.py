"""Faithfulness, confidence and consistency metrics; each describes itself (name, range, best, direction).

Per-example metrics work in two phases so that a runner can share and batch model calls: ``requests(item,
method)`` lists the perturbed inputs (:class:`~attnlens.evaluation.perturb.Variant`) the metric needs, and
``compute(item, method, probs)`` turns their probabilities into a value. :func:`score_examples` does both for
a list of examples with any ``predict(variants) -> (n, C)`` callable, so the math is testable on hand-made models.

Conventions (``protocol="paper"``, the default):

- ranking = the method's signed scores over the real, non-special tokens, highest first (ties keep token order);
  ``n`` = number of those tokens; ``ŷ`` = the class predicted on the unperturbed input.
- AOPC (AttCAT Eq. 13): delete the top ``round(k/100·n)`` tokens for k = 0, 10, …, 100; mean of p(ŷ|x) − p(ŷ|x̃_k).
- LOdds (Eq. 14): same grid, the tokens are replaced by the pad token (still attended); mean of log p(ŷ|x̃_k)/p(ŷ|x).
- comprehensiveness / sufficiency (ERASER, k = 10, …, 100 %): p(ŷ|x) − p(ŷ|x without the top k%) /
  p(ŷ|x) − p(ŷ|x with only the top k% of the real tokens).
- occlusion (Karpekov & Miller 2023): accuracy against the gold label after dropping the top / bottom / random
  0, 2, …, 40 tokens (attention mask 0 by default); the scalar is the mean accuracy over the nonzero counts of the
  top strategy.
- kendall (Eq. 15): Kendall τ_b between the scores of ŷ and of each other class over the real tokens, averaged.
- consistency (Karpekov & Miller 2023): silhouette of the last-layer hidden states of the top-5 tokens of correctly
  classified examples, clustered by gold class.
- precision@k (AttCAT, SQuAD): the number of gold-answer tokens among the k best-ranked tokens (a count in
  [0, k], as the AttCAT code computes and reports it, not a fraction).

``protocol="attcat-code"`` reproduces the AttCAT notebooks instead: explained and scored class = the gold label;
9 levels from ``np.linspace(0, 1, 10)`` of the length *including* [CLS]/[SEP] (k = 0 dropped, duplicates
removed); examples shorter than 10 tokens skipped; AOPC takes |p0 − pk|; τ compares ``argsort(-scores)`` index
sequences over all tokens, against one other class (1 − y; for three classes ``1 if y == 0 else y − 1``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from scipy import stats

from ..errors import InputError
from ..results.explanation import Explanation
from ..results.tokentext import readable
from .perturb import MODES, Predict, Variant, perturb, predict_cached

PROTOCOLS = ("paper", "attcat-code")
_EPS = 1e-12


@dataclass(frozen=True)
class EvalConfig:
    """Settings shared by all metrics of one run.

    Attributes:
        protocol: ``"paper"`` (the equations as published) or ``"attcat-code"`` (the AttCAT code's quirks).
        pad_token_id: id that replaces tokens for LOdds; ``None`` (default): the model's padding id, which
            :func:`~attnlens.evaluation.runner.run_benchmark` and the next-token benchmark fill in
            (:func:`score_examples`, which sees no model, takes 0).
        occlusion_counts: absolute numbers of tokens dropped for the occlusion curves.
        occlusion_drop: ``"mask"`` (attention mask 0, as Karpekov & Miller 2023 do) or ``"delete"``.
        seed: seed of the random occlusion strategy (combined with the example index).
        precision_k: K of precision@K.
        consistency_top: tokens per example for consistency.
    """

    protocol: str = "paper"
    pad_token_id: int | None = None
    occlusion_counts: tuple[int, ...] = tuple(range(0, 41, 2))
    occlusion_drop: str = "mask"
    seed: int = 0
    precision_k: int = 20
    consistency_top: int = 5

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise InputError(f"unknown protocol {self.protocol!r}; choose one of {', '.join(PROTOCOLS)}")
        if self.occlusion_drop not in ("mask", "delete"):
            raise InputError(f"occlusion drop must be 'mask' or 'delete', got {self.occlusion_drop!r}")
        if any(c < 0 for c in self.occlusion_counts):
            raise InputError("occlusion counts must be >= 0")
        if self.seed < 0:  # numpy's generators take non-negative seeds only
            raise InputError(f"seed must be >= 0, got {self.seed}")
        if isinstance(self.precision_k, bool) or not isinstance(self.precision_k, int) or self.precision_k < 1:
            raise InputError(f"K of precision@K must be a positive number of tokens, got {self.precision_k!r}")


@dataclass
class Item:
    """One example as the metrics see it.

    Attributes:
        exp: the explanation of the explained class (its ``input_ids`` are perturbed).
        label: gold class (``None`` if unknown).
        index: position in the data set (seeds the random occlusion strategy).
        other: class -> explanation of that class, for Kendall τ.
        answer_tokens: token positions of the gold answer, for precision@K.
        scored: the class whose probability the deletion metrics track where it is not the prediction: the
            explained gold label (``--target gold``); ``None``: the prediction ŷ.
    """

    exp: Explanation
    label: int | None = None
    index: int = 0
    other: dict[int, Explanation] = field(default_factory=dict)
    answer_tokens: list[int] | None = None
    scored: int | None = None

    @property
    def base(self) -> Variant:
        if self.exp.input_ids is None:
            raise InputError("explanations must carry input_ids to be evaluated")
        return Variant.of(self.exp.input_ids, self.exp.token_type_ids)

    @property
    def candidates(self) -> list[int]:
        return [i for i, s in enumerate(self.exp.special) if not s]


@dataclass
class Result:
    """A per-example value (``None`` where undefined) and optional details (levels, curves)."""

    value: float | None
    detail: Any = None


@dataclass(frozen=True)
class MetricInfo:
    """How to read a metric: what it measures, its range, its best value and its direction."""

    name: str
    range: tuple[float, float]
    best: float
    lower_is_better: bool
    description: str
    level: str = "example"  # "example": mean of per-example values; "dataset": one value per method
    class_specific_only: bool = False  # undefined (n/a) for class-agnostic methods
    # ranked by the distance to ``best``, which lies inside the range (a randomisation test's correlation: 0 is
    # best, and -0.3 is no better than 0.3); ``lower_is_better`` is then False
    toward_best: bool = False

    def to_dict(self) -> dict[str, Any]:
        def finite(x: float) -> float | None:  # JSON has no infinities: unbounded is null
            return x if math.isfinite(x) else None

        return {
            "range": [finite(self.range[0]), finite(self.range[1])],
            "best": finite(self.best),
            "lower_is_better": self.lower_is_better,
            "toward_best": self.toward_best,
            "description": self.description,
        }


def paper_counts(n: int, fractions: Sequence[float]) -> list[int]:
    """``round(f·n)`` for each fraction (NumPy rounding, half to even)."""
    return [int(np.round(f * n)) for f in fractions]


def attcat_code_counts(total: int) -> list[int]:
    """AttCAT's grid: ``int(round(g·total))`` for g in ``linspace(0, 1, 10)``, deduplicated, without 0."""
    counts = sorted({int(np.round(g * total)) for g in np.linspace(0, 1, 10)})
    return [c for c in counts if c > 0]


PAPER_FRACTIONS = tuple(k / 10 for k in range(11))  # 0, 10, ..., 100 %
ERASER_FRACTIONS = tuple(k / 10 for k in range(1, 11))  # 10, ..., 100 %


class Metric:
    """Base of the per-example metrics."""

    info: MetricInfo

    def __init__(self, config: EvalConfig) -> None:
        self.config = config

    @property
    def name(self) -> str:
        return self.info.name

    def applies(self, item: Item) -> bool:
        return True

    def requests(self, item: Item, method: str) -> list[Variant]:
        raise NotImplementedError

    def compute(self, item: Item, method: str, probs: Mapping[Variant, np.ndarray]) -> Result:
        raise NotImplementedError

    def curve(self, rows: Mapping[str, Sequence[Mapping[str, Any]]],
              baselines: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
        """This metric's curve for ``summary.json`` from the complete ``examples.jsonl`` rows (``rows``: method
        -> its rows; ``baselines``: the method-independent rows), or ``None`` for a metric without one."""
        return None

    # helpers
    def scored_class(self, item: Item, probs: Mapping[Variant, np.ndarray]) -> int:
        """The class whose probability is tracked: the explained class (paper: ŷ, or the gold label where that is
        what was explained: the ranking deleted is that class's), or the gold label (attcat-code)."""
        if self.config.protocol == "attcat-code" and item.label is not None:
            return int(item.label)
        if item.scored is not None:
            return int(item.scored)
        return int(np.argmax(probs[item.base]))


class _LevelMetric(Metric):
    """Remove the top-ranked tokens at several levels and compare one class's probability with the original."""

    mode = "delete"
    fractions: tuple[float, ...] = PAPER_FRACTIONS

    def levels(self, item: Item) -> list[int] | None:
        n = len(item.candidates)
        if self.config.protocol == "attcat-code":
            total = len(item.exp.tokens)
            if total < 10:  # the notebooks skip short inputs
                return None
            return [min(c, n) for c in attcat_code_counts(total)]
        return paper_counts(n, self.fractions)

    def variant(self, item: Item, order: list[int], count: int) -> Variant:
        return perturb(item.base, order[:count], self.mode, self.config.pad_token_id)

    def requests(self, item: Item, method: str) -> list[Variant]:
        levels = self.levels(item)
        if levels is None:
            return [item.base]
        order = item.exp.ranking(method)
        return [item.base] + [self.variant(item, order, c) for c in levels]

    def compute(self, item: Item, method: str, probs: Mapping[Variant, np.ndarray]) -> Result:
        levels = self.levels(item)
        if levels is None:
            return Result(None)
        c = self.scored_class(item, probs)
        p0 = float(probs[item.base][c])
        order = item.exp.ranking(method)
        pk = [float(probs[self.variant(item, order, k)][c]) for k in levels]
        per_level = [self.combine(p0, p) for p in pk]
        return Result(float(np.mean(per_level)), per_level)

    def combine(self, p0: float, pk: float) -> float:
        raise NotImplementedError


class AOPC(_LevelMetric):
    info = MetricInfo(
        "aopc", (-1.0, 1.0), 1.0, False,
        "AOPC (AttCAT Eq. 13): mean drop in p(ŷ) after deleting the top 0, 10, ..., 100% of the tokens; higher is "
        "better",
    )

    def combine(self, p0: float, pk: float) -> float:
        return abs(p0 - pk) if self.config.protocol == "attcat-code" else p0 - pk

    def curve(self, rows: Mapping[str, Sequence[Mapping[str, Any]]],
              baselines: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Per method, the mean drop at each deleted fraction (over the examples with every level)."""
        if self.config.protocol == "attcat-code":
            fractions = [float(g) for g in np.linspace(0, 1, 10)[1:]]
        else:
            fractions = [k / 10 for k in range(11)]
        out = {}
        for m, method_rows in rows.items():
            levels = [r["details"]["aopc"] for r in method_rows
                      if r.get("details", {}).get("aopc") is not None and len(r["details"]["aopc"]) == len(fractions)]
            drop = [float(np.mean(col)) for col in zip(*levels)] if levels else []
            out[m] = {"fractions": fractions, "drop": drop}
        return out


class LOdds(_LevelMetric):
    info = MetricInfo(
        "lodds", (-math.inf, math.inf), -math.inf, True,
        "Log-odds (AttCAT Eq. 14): mean log p(ŷ|x̃_k)/p(ŷ|x) after replacing the top 0, 10, ..., 100% of the "
        "tokens by [PAD]; lower is better",
    )
    mode = "pad"

    def combine(self, p0: float, pk: float) -> float:
        return math.log(max(pk, _EPS) / max(p0, _EPS))


class Comprehensiveness(_LevelMetric):
    info = MetricInfo(
        "comprehensiveness", (-1.0, 1.0), 1.0, False,
        "ERASER comprehensiveness: mean drop in p(ŷ) after deleting the top 10, 20, ..., 100% of the tokens; "
        "higher is better",
    )
    fractions = ERASER_FRACTIONS

    def levels(self, item: Item) -> list[int] | None:
        return paper_counts(len(item.candidates), self.fractions)

    def combine(self, p0: float, pk: float) -> float:
        return p0 - pk


class Sufficiency(Comprehensiveness):
    info = MetricInfo(
        "sufficiency", (-1.0, 1.0), -1.0, True,
        "ERASER sufficiency: mean drop in p(ŷ) when only the top 10, 20, ..., 100% of the tokens are kept; lower "
        "is better",
    )

    def variant(self, item: Item, order: list[int], count: int) -> Variant:
        return perturb(item.base, order[count:], "delete")


class Occlusion(Metric):
    """The occlusion test of Karpekov & Miller 2023; the per-example value is the mean top-strategy accuracy over
    nonzero counts."""

    info = MetricInfo(
        "occlusion", (0.0, 1.0), 0.0, True,
        "Occlusion (Karpekov & Miller 2023): accuracy vs. gold after dropping the top 2, 4, ..., 40 tokens "
        "(attention mask 0), averaged over the counts; lower is better. Curves (top/bottom/random) are in the summary",
    )

    def applies(self, item: Item) -> bool:
        return item.label is not None

    def _variants(self, item: Item, order: list[int]) -> list[Variant]:
        return [perturb(item.base, order[:k], self.config.occlusion_drop) for k in self.config.occlusion_counts]

    def random_order(self, item: Item) -> list[int]:
        rng = np.random.default_rng([self.config.seed, item.index])
        cands = item.candidates
        return [cands[i] for i in rng.permutation(len(cands))]

    def orders(self, item: Item, method: str | None) -> dict[str, list[int]]:
        if method is None:
            return {"random": self.random_order(item)}
        return {"top": item.exp.ranking(method), "bottom": item.exp.ranking(method, reverse=True)}

    def requests(self, item: Item, method: str | None) -> list[Variant]:
        return [v for order in self.orders(item, method).values() for v in self._variants(item, order)]

    def compute(self, item: Item, method: str | None, probs: Mapping[Variant, np.ndarray]) -> Result:
        if item.label is None:
            return Result(None)
        curves = {
            name: [int(int(np.argmax(probs[v])) == item.label) for v in self._variants(item, order)]
            for name, order in self.orders(item, method).items()
        }
        key = "random" if method is None else "top"
        nonzero = [c for k, c in zip(self.config.occlusion_counts, curves[key]) if k > 0]
        return Result(float(np.mean(nonzero)) if nonzero else None, curves)

    def curve(self, rows: Mapping[str, Sequence[Mapping[str, Any]]],
              baselines: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Accuracy (and accuracy relative to the unperturbed one) per count: random, then each method's top
        and bottom strategies."""
        series = {}
        rand = [b["baseline"]["occlusion_random"] for b in baselines if "occlusion_random" in b.get("baseline", {})]
        if rand:
            series["random"] = _accuracy_series(rand)
        for m, method_rows in rows.items():
            occ = [r["details"]["occlusion"] for r in method_rows if "occlusion" in r.get("details", {})]
            if occ:
                series[f"{m}:top"] = _accuracy_series([o["top"] for o in occ])
                series[f"{m}:bottom"] = _accuracy_series([o["bottom"] for o in occ])
        return {"k": list(self.config.occlusion_counts), "drop": self.config.occlusion_drop, "series": series}


def _accuracy_series(flags: Sequence[Sequence[int]]) -> dict[str, list[float | None]]:
    acc = [float(np.mean(col)) for col in zip(*flags)]
    rel = [a / acc[0] if acc and acc[0] > 0 else None for a in acc]
    return {"accuracy": acc, "relative": rel}


class Kendall(Metric):
    info = MetricInfo(
        "kendall", (-1.0, 1.0), -1.0, True,
        "Confidence (AttCAT Eq. 15): Kendall τ between the token scores for ŷ and for each other class, averaged; "
        "lower is better; n/a for class-agnostic methods",
        class_specific_only=True,
    )

    def requests(self, item: Item, method: str) -> list[Variant]:
        return []

    def compute(self, item: Item, method: str, probs: Mapping[Variant, np.ndarray]) -> Result:
        others = kendall_other_classes(item.exp.target, len(item.exp.probabilities), self.config.protocol)
        taus = []
        for c in others:
            other = item.other.get(c)
            if other is None or method not in other.scores:
                raise InputError(f"kendall needs the explanation of class {c} for method {method!r}")
            taus.append(kendall_tau(item.exp.scores[method], other.scores[method], item.exp.special,
                                    self.config.protocol))
        taus = [t for t in taus if t is not None]
        return Result(float(np.mean(taus)) if taus else None, taus)


def kendall_other_classes(target: int, n_classes: int, protocol: str = "paper") -> list[int]:
    """Classes whose explanations τ compares with the explained class ``target``."""
    if protocol == "attcat-code":
        return [1 - target] if n_classes == 2 else [1 if target == 0 else target - 1]
    return [c for c in range(n_classes) if c != target]


def kendall_tau(
    a: Sequence[float], b: Sequence[float], special: Sequence[bool], protocol: str = "paper"
) -> float | None:
    """τ_b of two score vectors over the real tokens (``paper``), or of their argsort sequences over all tokens
    (``attcat-code``); ``None`` where undefined (constant vectors, fewer than two tokens)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if protocol == "attcat-code":
        x, y = np.argsort(-a), np.argsort(-b)
    else:
        keep = ~np.asarray(special, dtype=bool)
        x, y = a[keep], b[keep]
    if len(x) < 2:
        return None
    tau = stats.kendalltau(x, y).statistic
    return None if tau is None or not np.isfinite(tau) else float(tau)


class PrecisionAtK(Metric):
    info = MetricInfo(
        "precision_at_k", (0.0, 20.0), 20.0, False,
        "Precision@K (AttCAT, SQuAD): the number of gold-answer tokens among the K = 20 best-ranked tokens, a count "
        "in [0, K] as the AttCAT code reports it (not a fraction; at most the answer's length); higher is better",
    )

    @classmethod
    def info_for(cls, k: int) -> MetricInfo:
        """The description with the run's K."""
        return replace(cls.info, range=(0.0, float(k)), best=float(k), description=cls.info.description.replace(
            "K = 20", f"K = {k}"))

    def applies(self, item: Item) -> bool:
        return item.answer_tokens is not None

    def requests(self, item: Item, method: str) -> list[Variant]:
        return []

    def compute(self, item: Item, method: str, probs: Mapping[Variant, np.ndarray]) -> Result:
        if item.answer_tokens is None:
            return Result(None)
        return Result(float(precision_at_k(item.exp, method, item.answer_tokens, self.config.precision_k)),
                      len(set(item.answer_tokens)))

    def curve(self, rows: Mapping[str, Sequence[Mapping[str, Any]]],
              baselines: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """K, the mean number of answer tokens and the best reachable mean (the same for every method)."""
        first = next(iter(rows.values()), [])
        spans = [r["details"]["precision_at_k"] for r in first
                 if r.get("details", {}).get("precision_at_k") is not None]
        k = self.config.precision_k
        return {"k": k, "answer_tokens": mean_or_none(spans), "perfect": mean_or_none([min(n, k) for n in spans])}


def precision_at_k(exp: Explanation, method: str, answer_tokens: Sequence[int], k: int = 20) -> int:
    """How many of the gold-answer token positions are among the ``k`` best-ranked real tokens: a count in
    ``[0, min(k, len(answer_tokens))]`` (the AttCAT code's ``cal_count``), not a fraction; divide by ``k`` for
    precision in the information-retrieval sense."""
    return len(set(exp.ranking(method)[:k]) & set(int(t) for t in answer_tokens))


def answer_token_positions(exp: Explanation, answers: Sequence[Mapping[str, Any]], context_sequence: int = 1,
                           first_only: bool = True) -> list[int]:
    """Token positions covering the gold answer's characters in the context (needs ``offsets``)."""
    if exp.offsets is None:
        raise InputError("precision@K needs token offsets (a fast tokenizer)")
    spans = [(int(a["answer_start"]), int(a["answer_start"]) + len(a["text"])) for a in answers]
    if first_only:
        spans = spans[:1]
    out = []
    for i, (s, e) in enumerate(exp.offsets):
        if exp.special[i] or e <= s:
            continue
        if exp.sequence_ids is not None and exp.sequence_ids[i] != context_sequence:
            continue
        if any(s < end and e > start for start, end in spans):
            out.append(i)
    return out


CONSISTENCY = MetricInfo(
    "consistency", (-1.0, 1.0), 1.0, False,
    "Consistency (Karpekov & Miller 2023): silhouette of the last-layer hidden states of the top-5 tokens of correctly "
    "classified examples, clustered by gold class; higher is better",
    level="dataset",
)

SANITY = MetricInfo(
    "sanity", (-1.0, 1.0), 0.0, False,
    "Model-parameter randomisation (Adebayo et al. 2018): Spearman ρ between the scores on the trained model and "
    "on models randomised from the head down, layer by layer, averaged over the depths; closer to 0 is better "
    "(curves per depth in the summary)",
    level="dataset", toward_best=True,
)
DATASET_METRICS = {"consistency": CONSISTENCY, "sanity": SANITY}  # one value per method, from the whole data set

METRICS: dict[str, type[Metric]] = {
    "aopc": AOPC,
    "lodds": LOdds,
    "comprehensiveness": Comprehensiveness,
    "sufficiency": Sufficiency,
    "occlusion": Occlusion,
    "kendall": Kendall,
    "precision_at_k": PrecisionAtK,
}
ALL_METRICS = [*METRICS, *DATASET_METRICS]
# left out of "all": precision_at_k (QA only) and sanity (it explains the data set once more per randomised layer)
NOT_IN_ALL = ("precision_at_k", "sanity")
CURVES = ("occlusion", "aopc", "precision_at_k")  # the metrics with a summary curve, in summary.json's order
DEFAULT_METRICS = ("aopc", "lodds", "kendall")


def mean_or_none(values: Sequence[float | None]) -> float | None:
    """Mean of the values that are not ``None``; ``None`` if there are none."""
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def metric_info(name: str, config: EvalConfig | None = None) -> MetricInfo:
    """The description of metric ``name`` (with ``config``'s K for precision@K)."""
    if name in DATASET_METRICS:
        return DATASET_METRICS[name]
    if name not in METRICS:
        raise InputError(f"unknown metric {name!r}; available metrics: {', '.join(ALL_METRICS)}")
    if name == "precision_at_k" and config is not None:
        return PrecisionAtK.info_for(config.precision_k)
    return METRICS[name].info


def resolve_metrics(metrics: str | Sequence[str] | None) -> list[str]:
    """``"all"``, ``None`` (the default set), a comma-separated string or a list -> checked metric names."""
    if metrics is None:
        return list(DEFAULT_METRICS)
    if isinstance(metrics, str):
        metrics = [m.strip() for m in metrics.split(",") if m.strip()]
    out: list[str] = []
    for m in metrics:
        names = [x for x in ALL_METRICS if x not in NOT_IN_ALL] if m == "all" else [m]
        for n in names:
            metric_info(n)
            if n not in out:
                out.append(n)
    if not out:
        raise InputError(f"no metrics given; available metrics: {', '.join(ALL_METRICS)}")
    return out


@dataclass
class ExampleScores:
    """Per-method results of one example, plus the method-independent random occlusion baseline."""

    methods: dict[str, dict[str, Result]]
    baseline: dict[str, Any] = field(default_factory=dict)


def score_examples(
    items: Sequence[Item],
    methods: Sequence[str],
    metrics: Sequence[str],
    predict: Predict,
    config: EvalConfig | None = None,
    class_specific: Mapping[str, bool] | None = None,
    cache: dict[Variant, np.ndarray] | None = None,
) -> list[ExampleScores]:
    """Every per-example metric for every method on every item, with each distinct variant scored once.

    ``class_specific`` maps method -> whether it is class-specific (Kendall is ``None`` for those that are not;
    default: all are). ``consistency`` is a data-set metric (see :func:`consistency`) and is skipped here.
    """
    config = config or EvalConfig()
    if config.pad_token_id is None:
        config = replace(config, pad_token_id=0)
    class_specific = class_specific or {}
    objs = [METRICS[m](config) for m in metrics if m in METRICS]
    cache = {} if cache is None else cache
    needed: list[Variant] = []
    for it in items:  # the metrics that perturb ask for the unperturbed input themselves
        for metric in objs:
            if not metric.applies(it):
                continue
            if isinstance(metric, Occlusion):
                needed.extend(metric.requests(it, None))
            for m in methods:
                if metric.info.class_specific_only and not class_specific.get(m, True):
                    continue
                needed.extend(metric.requests(it, m))
    predict_cached(predict, needed, cache)
    out = []
    for it in items:
        res: dict[str, dict[str, Result]] = {m: {} for m in methods}
        baseline: dict[str, Any] = {}
        for metric in objs:
            if isinstance(metric, Occlusion) and metric.applies(it):
                baseline["occlusion_random"] = metric.compute(it, None, cache).detail["random"]
            for m in methods:
                skip = metric.info.class_specific_only and not class_specific.get(m, True)
                res[m][metric.name] = Result(None) if skip or not metric.applies(it) else metric.compute(it, m, cache)
        out.append(ExampleScores(res, baseline))
    return out


def consistency_of(
    explanations: Mapping[int, Explanation],
    labels: Mapping[int, int | None],
    methods: Sequence[str],
    scorer: Any,
    config: EvalConfig,
) -> dict[str, Any]:
    """Consistency of each method: :func:`consistency` of the last-layer hidden states of the top
    ``config.consistency_top`` tokens of the correctly classified examples (``explanations`` and gold ``labels`` by
    example index; ``scorer.hidden_states(variants, positions)``, e.g. a
    :class:`~attnlens.evaluation.perturb.ModelPredictor`, gives the states). Adds ``tokens`` and ``n_examples``."""
    correct = [i for i in sorted(explanations) if labels[i] is not None and explanations[i].predicted == labels[i]]
    positions = {i: {m: explanations[i].ranking(m)[: config.consistency_top] for m in methods} for i in correct}
    union = {i: sorted({p for ps in positions[i].values() for p in ps}) for i in correct}
    variants = [Variant.of(explanations[i].input_ids or [], explanations[i].token_type_ids) for i in correct]
    states = scorer.hidden_states(variants, [union[i] for i in correct])
    by_example = dict(zip(correct, states))
    result = {}
    for m in methods:
        vecs, labs, tokens = [], [], []
        for i in correct:
            col = {p: r for r, p in enumerate(union[i])}
            pos = positions[i][m]
            vecs.append(by_example[i][[col[p] for p in pos]] if pos else np.zeros((0, 1)))
            labs.append(int(labels[i]))
            shown = explanations[i].meta.get("token_encoding")  # byte-level BPE as text: "great", not "Ġgreat"
            tokens.extend(readable(explanations[i].tokens[p], shown) for p in pos)
        res = consistency(vecs, labs, seed=config.seed)
        res["tokens"] = tokens
        res["n_examples"] = len(correct)
        result[m] = res
    return result


def consistency(vectors: Sequence[np.ndarray], labels: Sequence[int], seed: int = 0) -> dict[str, Any]:
    """Silhouette of token vectors clustered by label, and a 2-D PCA projection of them for plotting.

    ``vectors[i]`` is ``(n_i, D)`` (the top tokens of example i), ``labels[i]`` its gold class. Returns
    ``{"silhouette": float | None, "points": [[x, y], ...], "labels": [...]}``; the silhouette is ``None`` with
    fewer than two classes or fewer than three points.
    """
    from sklearn.decomposition import PCA
    from sklearn.metrics import silhouette_score

    rows = [np.asarray(v, dtype=np.float64).reshape(-1, np.asarray(v).shape[-1]) for v in vectors if len(v)]
    labs = [int(lab) for v, lab in zip(vectors, labels) for _ in range(len(v))]
    if not rows:
        return {"silhouette": None, "points": [], "labels": []}
    x = np.concatenate(rows, 0)
    sil = None
    if len(set(labs)) >= 2 and len(x) > len(set(labs)):
        sil = float(silhouette_score(x, labs))
    if len(x) >= 2:
        pts = PCA(n_components=min(2, x.shape[1], len(x)), random_state=seed).fit_transform(x)
        if pts.shape[1] < 2:
            pts = np.concatenate([pts, np.zeros((len(pts), 1))], 1)
    else:
        pts = np.zeros((len(x), 2))
    return {"silhouette": sil, "points": [[float(a), float(b)] for a, b in pts], "labels": labs}


__all__ = [
    "ALL_METRICS", "CONSISTENCY", "CURVES", "DEFAULT_METRICS", "METRICS", "MODES", "PROTOCOLS", "EvalConfig",
    "ExampleScores", "Item", "Metric", "MetricInfo", "Result", "answer_token_positions", "attcat_code_counts",
    "consistency", "consistency_of", "kendall_other_classes", "kendall_tau", "mean_or_none", "metric_info",
    "paper_counts", "precision_at_k", "resolve_metrics", "score_examples",
]
