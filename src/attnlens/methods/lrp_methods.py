"""LRP-based methods: PartialLRP, TransAtt (Chefer et al.) and AttnLRP, reading shared relevance passes.

Notation as in :mod:`attnlens.methods.attention`; R(A^l) is the LRP relevance at the attention probabilities
of layer l (:func:`attnlens.lrp.lrp_pass`), computed once per batch and rule set and shared through
``ctx.cache["lrp"]``. Each method's default rules are those of its authors' code: ``partiallrp`` and
``transatt`` Chefer et al.'s modified rules (``"chefer"``, as TransAtt's and AttCAT's code run them),
``attnlrp`` AttnLRP's. Rule sets and their differences from the authors' code: ``docs/lrp.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..core.batch_state import BatchContext
from ..core.batching import keeps_logits
from ..core.memory import lrp_storage, model_dims, parse_budget
from ..errors import InputError
from ..lrp import LRPResult, lrp_pass, lrp_passes, runs_fused
from ..lrp.relevance import JOINT, check_settings
from .attention import propagate
from .registry import ATTENTION, GRADIENTS, OWN_PASS, MethodOutput, list_methods, register

ATTNLRP_RULES = ("attnlrp", "cp")  # rule sets whose input relevance is AttnLRP / CP-LRP
ATTENTION_READERS = ("partiallrp", "transatt")  # they read the attention relevance of their pass


def fused_lrp(model: Any, name: str, settings: Mapping[str, Mapping[str, Any]], group: Sequence[str]) -> bool:
    """Whether method ``name``'s LRP pass may run fused (:func:`attnlens.lrp.lrp_pass` ``fused=True``: no maps
    kept, layers recomputed) beside the methods ``group`` with their ``settings``: AttnLRP with its own rules and
    epsilon 0, no method of the group reading attention relevance, on a model whose attention the pass can
    fuse."""
    if name != "attnlrp" or any(m in ATTENTION_READERS for m in group):
        return False
    opts = settings.get(name, {})
    if opts.get("rules", "attnlrp") != "attnlrp" or float(opts.get("epsilon", 0.0)) != 0.0:
        return False
    return runs_fused(model)


def shared_lrp(ctx: BatchContext, rules: str, epsilon: float) -> LRPResult:
    """The batch's LRP pass for these settings, run once and cached in ``ctx.cache["lrp"]``.

    When the batch's methods (``ctx.plan``) ask for both the ``chefer`` and the ``attnlrp`` pass (ε = 0: the
    defaults of partiallrp/transatt and of attnlrp), one forward serves both (:func:`attnlens.lrp.lrp_passes`).
    Only ``attnlrp`` reads the input relevance, and it takes the AttnLRP and CP rule sets only: a chefer pass
    stops at the first layer's attention.
    """
    check_settings(rules, epsilon)
    cache = ctx.cache.setdefault("lrp", {})
    key = (rules, float(epsilon))
    if key in cache:
        return cache[key]
    one = ctx.sequence is not None  # a generation's steps: one pass over the sequence serves them all
    rows = ctx.token_mask if one else None
    reading: dict[str, Any] = {}
    targets = ctx.targets
    if not one:  # a language model's logits only where its head reads them, as the shared pass kept them
        logit_mask, targets = ctx.capture.logit_reading(ctx.head, ctx.token_mask, ctx.targets)
        reading = {"forward_kwargs": ctx.capture.logit_rows.model_kwargs(), "logit_mask": logit_mask}
    args = (ctx.model, ctx.sequence if one else ctx.inputs, targets, ctx.target_kind)
    joint = [(r, 0.0) for r in JOINT]
    if key in joint and set(joint) <= _planned_passes(ctx):
        with contextlib.suppress(InputError):  # the chefer rules do not apply: each pass alone says why, or runs
            cache.update(zip(joint, lrp_passes(*args, head=ctx.head, rows=rows, **reading)))
    if key not in cache:
        cache[key] = lrp_pass(*args, head=ctx.head, rules=rules, epsilon=epsilon, rows=rows,
                              inputs_relevance=rules in ATTNLRP_RULES, fused=_runs_fused(ctx, key), **reading)
    return cache[key]


def _runs_fused(ctx: BatchContext, key: tuple[str, float]) -> bool:
    """Whether this batch's pass for ``key`` runs fused: it may (:func:`fused_lrp`), and the eager pass would not
    fit the memory budget (the decision the engine's estimate makes, :func:`attnlens.core.memory.lrp_storage`)."""
    if ctx.sequence is not None or key != ("attnlrp", 0.0):
        return False
    if not fused_lrp(ctx.model, "attnlrp", {"attnlrp": {"rules": key[0], "epsilon": key[1]}}, list(ctx.plan)):
        return False
    rows, n = ctx.token_mask.shape
    budget = parse_budget(ctx.memory_budget) // max(1, rows)
    logit_rows = ctx.head.logit_positions_per_input if keeps_logits(ctx.model) else 0  # as the engine estimates
    return lrp_storage(model_dims(ctx.model), n, budget, True, logit_rows).recompute


def _planned_passes(ctx: BatchContext) -> set[tuple[str, float]]:
    """The (rule set, epsilon) of every LRP method the batch will run."""
    lrp = set(list_methods()) - set(list_methods(include_lrp=False))
    return {(opts.get("rules"), float(opts.get("epsilon", 0.0))) for name, opts in ctx.plan.items() if name in lrp}


def _reads_one_row(name: str) -> Callable[[Any, str, str], str | None]:
    """Why ``name``, which reads the relevance of one attention row (the head's), cannot explain a QA span."""
    def why(model: Any, stream: str, task: str) -> str | None:
        if task == "qa":  # its start and end logits are read at two positions, neither of them the [CLS] row
            return (f"{name} reads the attention relevance of the one row the head reads; an extractive QA span's "
                    "start and end logits are read at two other positions (attnlrp explains the span)")
        return None
    return why


def _rows(ctx: BatchContext, per_layer: list[torch.Tensor]) -> torch.Tensor:
    """Explained row of each ``(B, Q, K)`` matrix, stacked to ``(B, L, K)``."""
    return torch.stack([ctx.capture.row(m.to(ctx.capture.query_weights.dtype)) for m in per_layer], 1)


@register(
    "partiallrp",
    needs={ATTENTION, OWN_PASS},
    applies=_reads_one_row("partiallrp"),
    summary="Partial LRP: LRP relevance of the last layer's attention, E_h max(R(A^L), 0)[c, j].",
    citation="Voita et al. 2019 (ACL), as used by Chefer et al. 2021 and the AttCAT paper",
    lrp=True,
)
def partiallrp(ctx: BatchContext, rules: str = "chefer", epsilon: float = 0.0) -> MethodOutput:
    res = shared_lrp(ctx, rules, epsilon)
    layers = _rows(ctx, [r.clamp(min=0).mean(1) for r in res.attention_relevance])
    return MethodOutput(layers[:, -1], layers)


def transatt_rollout(
    grads: list[torch.Tensor], relevances: list[torch.Tensor], start_layer: int = 0
) -> list[torch.Tensor]:
    """Chefer et al.'s rollout: Ā^l = E_h max(∇A^l ⊙ R(A^l), 0); M^l = (Ā^l + I) / rowsum; returns the
    cumulative products ``M^l ··· M^start`` for l = start ... L-1 (each ``(B, N, N)``)."""
    n_layers = len(relevances)
    if not -n_layers <= start_layer < n_layers:
        raise InputError(f"transatt start_layer={start_layer} is out of range for a model with {n_layers} layers: "
                         f"use 0 to {n_layers - 1}, or -1 to -{n_layers} to count from the top")
    start_layer %= n_layers
    return propagate(_normalised(g, r) for g, r in zip(grads[start_layer:], relevances[start_layer:]))


def _normalised(grad: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """``(Ā + I) / rowsum`` with ``Ā = E_h max(∇A ⊙ R(A), 0)``."""
    a_bar = (grad * relevance).clamp(min=0).mean(1)
    m = a_bar + torch.eye(a_bar.shape[-1], dtype=a_bar.dtype, device=a_bar.device)
    return m / m.sum(-1, keepdim=True)


@register(
    "transatt",
    needs={ATTENTION, GRADIENTS, OWN_PASS},
    self_attention_only=True,
    applies=_reads_one_row("transatt"),
    summary="Transformer attribution: rollout of E_h max(∇A ⊙ R(A), 0) + I (row-normalised) from start_layer; "
    "row c.",
    citation="Chefer, Gur & Wolf, Transformer Interpretability Beyond Attention Visualization, CVPR 2021",
    lrp=True,
)
def transatt(ctx: BatchContext, start_layer: int = 0, rules: str = "chefer", epsilon: float = 0.0) -> MethodOutput:
    if not isinstance(start_layer, int) or isinstance(start_layer, bool):
        raise InputError(f"transatt start_layer must be an integer layer index, got {start_layer!r}")
    res = shared_lrp(ctx, rules, epsilon)
    joints = transatt_rollout(ctx.capture.attention_grads, res.attention_relevance, start_layer)
    layers = _rows(ctx, joints)  # rows of the products from start_layer up to each layer
    full = len(joints) == len(res.attention_relevance)  # per-layer rows only when the rollout starts at layer 0
    return MethodOutput(layers[:, -1], layers if full else None)


@register(
    "attnlrp",
    needs={OWN_PASS},
    summary="AttnLRP: relevance of the input embeddings under attention-aware LRP rules, summed over the "
    "hidden dimension (signed).",
    citation="Achtibat et al., AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers, ICML 2024",
    lrp=True,
)
def attnlrp(ctx: BatchContext, input: str = "embeddings", rules: str = "attnlrp", epsilon: float = 0.0) -> MethodOutput:
    if input not in ("embeddings", "word"):
        raise InputError(f"attnlrp input must be 'embeddings' (word + position + segment) or 'word', got {input!r}")
    if rules not in ATTNLRP_RULES:  # Chefer et al.'s rules propagate to the input too, but that is not AttnLRP
        raise InputError(f"attnlrp takes rules 'attnlrp' (AttnLRP) or 'cp' (CP-LRP), not {rules!r}; "
                         "the chefer rule sets are for partiallrp and transatt")
    res = shared_lrp(ctx, rules, epsilon)
    scores = res.input_relevance if input == "embeddings" else res.word_relevance
    return MethodOutput(scores, None, space="tokens")
