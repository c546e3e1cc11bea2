"""LRP-based methods: PartialLRP, TransAtt (Chefer et al.) and AttnLRP, reading shared relevance passes.

Notation as in :mod:`attnlens.methods.attention`; R(A^l) is the LRP relevance at the attention probabilities
of layer l (:func:`attnlens.lrp.lrp_pass`), computed once per batch and rule set and shared through
``ctx.cache["lrp"]``. Each method's default rules are those of its authors' code: ``partiallrp`` and
``transatt`` Chefer et al.'s modified rules (``"chefer"``, as TransAtt's and AttCAT's code run them),
``attnlrp`` AttnLRP's. Rule sets and their differences from the authors' code: ``docs/lrp.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..core.attention_chunks import AttentionChunks
from ..core.batch_state import BatchContext
from ..core.batching import keeps_logits
from ..core.logit_rows import LogitRows
from ..core.memory import (
    FUSED_LRP_STORAGE,
    LRP_STORAGE,
    Dims,
    Storage,
    lrp_step_bytes,
    lrp_storage,
    model_dims,
    pass_row_bytes,
)
from ..core.row_attention import zero_padded
from ..errors import InputError, ModelError
from ..lrp import LRPResult, lrp_pass, lrp_passes, runs_fused
from ..lrp.kept import kept_vectors
from ..lrp.relevance import JOINT, check_settings
from ..lrp.state import CHEFER
from ..models.architectures import architecture_for
from ..models.prefixes import last_positions
from .attention import RowCarrier, carried_rows
from .registry import (
    ATTENTION_CHUNKS,
    GRADIENTS,
    OWN_PASS,
    MethodOutput,
    check_flag,
    check_integer,
    list_methods,
    register,
)

ATTNLRP_RULES = ("attnlrp", "cp")  # rule sets whose input relevance is AttnLRP / CP-LRP
ATTENTION_READERS = ("partiallrp", "transatt")  # they read the attention relevance of their pass


def _one_stream(name: str) -> Callable[[Any, str, str], str | None]:
    """Why ``name``, which reads the LRP relevance of the attention maps, cannot explain a model: an
    encoder-decoder's pass runs three streams (encoder, decoder and cross attention) through one rule set, which
    the method's layer-by-layer reading does not separate."""

    def why(model: Any, stream: str, task: str) -> str | None:
        if architecture_for(model.config).family == "encoder-decoder":
            return (f"{name} reads the LRP relevance of one self-attention stream's maps, layer by layer; an "
                    "encoder-decoder runs three streams: use attnlrp (the relevance of the encoder's input tokens)")
        return None

    return why


def _fusable_rules(rules: str, epsilon: float) -> bool:
    """Whether a pass under these rules can run fused: AttnLRP with epsilon 0 (its rules are scaled gradients), or
    Chefer et al.'s rules (the attention's backward recomputed in chunks)."""
    return (rules == "attnlrp" and epsilon == 0.0) or rules in CHEFER


def fused_lrp(model: Any, name: str, settings: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether method ``name``'s LRP pass may run fused (:func:`attnlens.lrp.lrp_pass` ``fused=True``: no maps
    kept) with its ``settings``: AttnLRP with its own rules and epsilon 0, PartialLRP and
    TransAtt with Chefer et al.'s rules (only that fused pass keeps what recomputes the attention relevance), on a
    model whose attention the pass can fuse."""
    if name not in ("attnlrp", *ATTENTION_READERS):
        return False
    opts = settings.get(name, {})
    rules, epsilon = opts.get("rules", "attnlrp" if name == "attnlrp" else "chefer"), float(opts.get("epsilon", 0.0))
    # the attention readers need Chefer's rules (only that fused pass keeps the relevance's factors), AttnLRP its own
    return _fusable_rules(rules, epsilon) and (rules in CHEFER) == (name in ATTENTION_READERS) and runs_fused(model)


def fused_over_prefixes(model: Any, settings: Mapping[str, Mapping[str, Any]]) -> frozenset[str]:
    """The LRP methods of ``settings`` (per method its options, defaults included) whose pass over a generation's
    prefixes may run fused, one backward per step: AttnLRP (its rules, ε = 0), and PartialLRP without its per-layer
    view (Chefer et al.'s rules: its pass stops at the last layer's attention), each only as a pass of its own, not
    one it shares with another LRP method reading the same rules. Where both ask for their passes, the joint
    forward of the chefer and attnlrp rules (:func:`shared_lrp`) serves them only while its eager pass fits; beyond
    that each runs its own pass, fused where it may."""
    keys = _pass_keys(settings)
    found = set()
    for name, key in keys.items():
        if name == "attnlrp":
            eligible = key == ("attnlrp", 0.0)
        elif name == "partiallrp":
            eligible = key[0] in CHEFER and not settings[name].get("layers", False)
        else:
            eligible = False
        shared = key in {k for other, k in keys.items() if other != name}
        if eligible and not shared and fused_lrp(model, name, settings):
            found.add(name)
    return frozenset(found)


def kept_activation_passes(settings: Mapping[str, Mapping[str, Any]], prefixes: bool = False) -> frozenset[str]:
    """The LRP methods of ``settings`` whose pass, where it can run fused, always does and keeps every layer's
    activations where they fit the budget instead of recomputing each layer in its backward
    (:func:`attnlens.core.memory.lrp_storage` ``keep_activations``): AttnLRP's own pass (its rules, ε = 0) over a
    batch of inputs, read by no other method (not the joint pass with Chefer et al.'s rules, not PartialLRP under
    AttnLRP's rules, which reads the maps), and not over a generation's prefixes (``prefixes``)."""
    keys = _pass_keys(settings)
    key = keys.get("attnlrp")
    shared = key in {k for name, k in keys.items() if name != "attnlrp"}
    if prefixes or key != ("attnlrp", 0.0) or shared or _joint(key, keys):
        return frozenset()
    return frozenset({"attnlrp"})


def kept_pass_dims(model: Any, dims: Dims) -> Dims:
    """``dims`` with what AttnLRP's fused forward keeps per token and layer counted on ``model``
    (:func:`attnlens.lrp.kept.kept_vectors`), for the estimate of a pass that keeps the layers' activations
    (:func:`kept_activation_passes`); unchanged where it cannot be counted."""
    vectors = kept_vectors(model, dims.layers, dims.hidden)
    return dims if vectors is None else dataclasses.replace(dims, lrp_vectors=vectors)


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
    if not one:  # a language model's logits only where its head reads them, as the shared pass keeps them
        logit_rows = (ctx.capture.logit_rows if ctx.capture is not None
                      else LogitRows.of(ctx.model, ctx.head, ctx.token_mask, ctx.targets))
        logit_mask, targets = logit_rows.mask(ctx.token_mask), logit_rows.targets(ctx.head, ctx.targets)
        reading = {"forward_kwargs": logit_rows.model_kwargs(), "logit_mask": logit_mask}
    elif keeps_logits(ctx.model):  # the steps read the logits from the first step's last token on
        reading = {"forward_kwargs": {"logits_to_keep": int(rows.shape[1] - last_positions(rows).min())}}
    args = (ctx.model, ctx.sequence if one else ctx.inputs, targets, ctx.target_kind)
    joint = [(r, 0.0) for r in JOINT]
    # over a generation's steps the joint pass runs eager: where either pass would run fused, each runs its own
    if _joint(key, _planned_passes(ctx)) and not (one and any(_runs_fused(ctx, [k]) for k in joint)):
        fused = _runs_fused(ctx, joint)
        with contextlib.suppress(InputError):  # the chefer rules do not apply: each pass alone says why, or runs
            cache.update(zip(joint, lrp_passes(*args, head=ctx.head, rows=rows, fused=fused,
                                               last_layer_only=_last_layer_only(ctx, joint[0]),
                                               chunk_reader=_in_pass_reader(ctx, joint[0], fused), **reading)))
    if key not in cache:
        # R(A) only where a method of the batch (all of them, when no plan says which) reads it from this pass
        read = not ctx.plan or any(name in ATTENTION_READERS for name, k in _planned_passes(ctx).items() if k == key)
        last = _last_layer_only(ctx, key)
        storage = _fused_storage(ctx, [key])
        fused = storage is not None
        cache[key] = lrp_pass(*args, head=ctx.head, rules=rules, epsilon=epsilon, rows=rows,
                              inputs_relevance=rules in ATTNLRP_RULES and not last, fused=fused,
                              attention_relevance=read, progress=ctx.progress if one else None,
                              last_layer_only=last, chunk_reader=_in_pass_reader(ctx, key, fused),
                              recompute=storage is None or storage.recompute, **reading)
    return cache[key]


def _last_layer_only(ctx: BatchContext, key: tuple[str, float]) -> bool:
    """Whether the batch's pass ``key`` may stop at the last layer's attention (:func:`last_layer_only`)."""
    return last_layer_only(ctx.plan, key)


def last_layer_only(settings: Mapping[str, Mapping[str, Any]], key: tuple[str, float]) -> bool:
    """Whether the pass ``key`` ((rule set, epsilon)) of the methods of ``settings`` (per method its options,
    defaults included) may stop at the last layer's attention: every method that reads it reads that layer alone,
    ``partiallrp`` without its per-layer view or ``transatt`` from ``start_layer=-1`` (no plan: every method may
    read it, so no)."""
    readers = [name for name, k in _pass_keys(settings).items() if k == key]

    def last_only(name: str) -> bool:
        opts = settings[name]
        if name == "partiallrp":
            check_flag("partiallrp", "layers", opts.get("layers", False))
            return not opts.get("layers", False)
        return name == "transatt" and opts.get("start_layer") == -1

    return bool(readers) and all(last_only(name) for name in readers)


def last_layer_passes(settings: Mapping[str, Mapping[str, Any]], prefixes: bool = False) -> frozenset[str]:
    """The LRP methods of ``settings`` whose fused pass keeps the last layer's factors alone: a pass under Chefer
    et al.'s rules that stops at the last layer (:func:`last_layer_only`), not the joint pass with AttnLRP's rules
    (whose forward keeps every layer's for AttnLRP's backward). ``prefixes``: over a generation's steps, where a
    fused pass is always a pass of its own (:func:`fused_over_prefixes`)."""
    keys = _pass_keys(settings)
    return frozenset(name for name, key in keys.items()
                     if key[0] in CHEFER and last_layer_only(settings, key) and (prefixes or not _joint(key, keys)))


def _joint(key: tuple[str, float], keys: Mapping[str, tuple[str, float]]) -> bool:
    """Whether the pass ``key`` is served by the joint forward of the chefer and attnlrp rules (ε = 0,
    :func:`attnlens.lrp.lrp_passes`): it is one of the two, and the methods' passes (``keys``) ask for both."""
    joint = {(r, 0.0) for r in JOINT}
    return key in joint and joint <= set(keys.values())


def _check_partiallrp(rules: str = "chefer", epsilon: float = 0.0, layers: bool = False) -> None:
    """PartialLRP's option values."""
    check_settings(rules, epsilon)
    check_flag("partiallrp", "layers", layers)


def _transatt_fits(model: Any, stream: str, task: str, options: Mapping[str, Any]) -> str | None:
    """Why TransAtt's ``start_layer`` does not name one of the model's layers."""
    start_layer = options.get("start_layer", 0)
    try:
        n_layers = len(architecture_for(model.config).layers.modules(model))
    except (AttributeError, ModelError):  # no layer list known: the pass's own check judges it
        return None
    if not -n_layers <= start_layer < n_layers:
        return (f"transatt start_layer={start_layer} is out of range for a model with {n_layers} layers: use 0 to "
                f"{n_layers - 1}, or -1 to -{n_layers} to count from the top")
    return None


def _check_transatt(start_layer: int = 0, rules: str = "chefer", epsilon: float = 0.0) -> None:
    """TransAtt's option values (the layer's range needs the model)."""
    check_integer("transatt", "start_layer", start_layer)
    check_settings(rules, epsilon)


def _check_attnlrp(input: str = "embeddings", rules: str = "attnlrp", epsilon: float = 0.0) -> None:  # noqa: A002
    """AttnLRP's option values."""
    if input not in ("embeddings", "word"):
        raise InputError(f"attnlrp input must be 'embeddings' (word + position + segment) or 'word', got {input!r}")
    if rules not in ATTNLRP_RULES:  # Chefer et al.'s rules propagate to the input too, but that is not AttnLRP
        raise InputError(f"attnlrp takes rules 'attnlrp' (AttnLRP) or 'cp' (CP-LRP), not {rules!r}; "
                         "the chefer rule sets are for partiallrp and transatt")
    check_settings(rules, epsilon)


def _runs_fused(ctx: BatchContext, keys: list[tuple[str, float]]) -> bool:
    """Whether this batch's pass serving ``keys`` ((rule set, epsilon) pairs: two for the joint pass) runs fused
    (:func:`_fused_storage`)."""
    return _fused_storage(ctx, keys) is not None


def _fused_storage(ctx: BatchContext, keys: list[tuple[str, float]]) -> Storage | None:
    """``None`` where this batch's pass serving ``keys`` runs eager; where it runs fused, a fused storage whose
    ``recompute`` says whether its backward recomputes each layer (only that is read from it: what else the pass
    keeps, such as the factors of Chefer et al.'s rules, is the engine's estimate to count). It runs fused where
    its rules can, every planned method reading it may (:func:`fused_lrp`, as the engine's estimate asks), and the
    eager pass would not fit the memory budget, or always for AttnLRP's own pass, which then keeps the layers'
    activations where they fit (:func:`kept_activation_passes`; the decision the estimate makes,
    :func:`attnlens.core.memory.lrp_storage`). Over a generation's steps: where the eager pass with its steps'
    batched products would not fit what the budget leaves (whatever the estimate chose, so a batch never runs
    eager beyond it), each layer recomputed."""
    one = ctx.sequence is not None  # a generation's steps: AttnLRP's or PartialLRP's pass of its own runs fused
    planned = _planned_passes(ctx)
    if one and (len(keys) != 1 or not any(planned[name] == keys[0]
                                          for name in fused_over_prefixes(ctx.model, ctx.plan))):
        return None
    if not all(_fusable_rules(*key) for key in keys) or not runs_fused(ctx.model):
        return None
    if any(key in keys and not fused_lrp(ctx.model, name, ctx.plan) for name, key in planned.items()):
        return None
    rows, n = ctx.token_mask.shape
    dims = model_dims(ctx.model)
    if one:  # the eager pass over the sequence and its steps' batched products, beside what the shared pass keeps
        eager = dataclasses.replace(LRP_STORAGE, logit_rows=rows + 1 if keeps_logits(ctx.model) else 0)
        step = lrp_step_bytes(dims, n, rows, keys[0][0] in CHEFER)  # PartialLRP's pass keeps its R(A) per step
        return FUSED_LRP_STORAGE if pass_row_bytes(dims, n, eager) + rows * step > ctx.budget_left() else None
    budget = ctx.budget_left() // max(1, rows)  # beside what the shared pass keeps, as the estimate plans it
    logit_rows = ctx.head.logit_positions_per_input if keeps_logits(ctx.model) else 0  # as the engine estimates
    keep = len(keys) == 1 and any(planned.get(name) == keys[0] for name in kept_activation_passes(ctx.plan))
    storage = lrp_storage(kept_pass_dims(ctx.model, dims) if keep else dims, n, budget, True, logit_rows,
                          keep_activations=keep)
    return None if storage.eager else storage


def _planned_passes(ctx: BatchContext) -> dict[str, tuple[str, float]]:
    """The (rule set, epsilon) of the pass each LRP method of the batch will read."""
    return _pass_keys(ctx.plan)


def _pass_keys(settings: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[str, float]]:
    """The (rule set, epsilon) of the pass each LRP method of ``settings`` reads."""
    lrp = set(list_methods()) - set(list_methods(include_lrp=False))
    return {name: (opts.get("rules"), float(opts.get("epsilon", 0.0))) for name, opts in settings.items()
            if name in lrp}


def _explained_relevance(ctx: BatchContext, res: LRPResult) -> torch.Tensor:
    """``(B, L', K)``: per layer the pass holds (all, or the last alone) the explained row of
    E_h max(R(A^l), 0), from the query rows the explained row weighs (the relevance rows recomputed there after a
    fused pass)."""
    weights = ctx.capture.query_weights
    queries = torch.nonzero(weights.ne(0).any(0)).flatten()
    w = weights[:, queries]
    rows = [res.relevance_rows(j, queries).clamp(min=0).mean(1) for j in range(res.first_layer, res.n_layers)]
    return torch.stack([torch.einsum("bq,bqk->bk", w.to(r.dtype), r).to(weights.dtype) for r in rows], 1)


def _partiallrp_outputs(ctx: BatchContext) -> Any:
    """The model outputs of the LRP pass ``partiallrp`` reads (run here, and cached for the method)."""
    opts = ctx.plan.get("partiallrp", {})
    return shared_lrp(ctx, opts.get("rules", "chefer"), opts.get("epsilon", 0.0)).outputs


@register(
    "partiallrp",
    needs={OWN_PASS},
    forward=_partiallrp_outputs,
    summary="Partial LRP: LRP relevance of the last layer's attention, E_h max(R(A^L), 0)[c, j].",
    citation="Voita et al. 2019 (ACL), as used by Chefer et al. 2021 and the AttCAT paper",
    lrp=True,
    check=_check_partiallrp,
    applies=_one_stream("partiallrp"),
)
def partiallrp(ctx: BatchContext, rules: str = "chefer", epsilon: float = 0.0, layers: bool = False) -> MethodOutput:
    # without the per-layer view (and no other method reading the pass), its backward stops at the last layer
    check_flag("partiallrp", "layers", layers)
    per_layer = _explained_relevance(ctx, shared_lrp(ctx, rules, epsilon))
    return MethodOutput(per_layer[:, -1], per_layer if layers else None)


class _LayersFrom(AttentionChunks):
    """The chunks of ``maps``' layers ``start`` and above (layer 0 here is ``start`` there)."""

    def __init__(self, maps: AttentionChunks, start: int) -> None:
        self.maps, self.start = maps, start
        self.n_layers = maps.n_layers - start

    def chunks(self, layer: int, gradients: bool = False, narrow: bool = False
               ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        return self.maps.chunks(layer + self.start, gradients, narrow)

    def tensors(self) -> list[torch.Tensor]:
        return self.maps.tensors()

    def gradient_rows(self, layer: int, start: int, stop: int, keys: int) -> torch.Tensor:
        return self.maps.gradient_rows(layer + self.start, start, stop, keys)


def _transatt_matrix(grad: torch.Tensor, relevance: torch.Tensor, start: int, overwrite: bool = False
                     ) -> torch.Tensor:
    """TransAtt's M^l = (Ā^l + I) / rowsum, Ā^l = E_h max(∇A^l ⊙ R(A^l), 0), at the query rows ``start …`` of
    ``grad`` and ``relevance`` ``(B, H, q, K)``: ``(B, q, K)`` (``overwrite``: ``grad`` is a scratch tensor the
    product may be formed in)."""
    product = grad.mul_(relevance) if overwrite else grad * relevance.to(grad.dtype)
    m = product.clamp_(min=0).mean(1)
    q = m.shape[1]
    m[:, torch.arange(q, device=m.device), torch.arange(start, start + q, device=m.device)] += 1
    return m / m.sum(-1, keepdim=True)


class _TransAttRows:
    """TransAtt's M^l at a chunk of query rows (:func:`_transatt_matrix`): ∇A from the shared pass's chunks,
    R(A) at the same rows from the LRP pass."""

    def __init__(self, res: LRPResult, start_layer: int) -> None:
        self.res, self.start_layer = res, start_layer

    def __call__(self, layer: int, start: int, a: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
        queries = torch.arange(start, start + a.shape[2], device=a.device)
        relevance = self.res.relevance_rows(layer + self.start_layer, queries, a)  # the shared pass's A there
        return _transatt_matrix(grad, relevance, start)


class _CarriedInPass:
    """TransAtt's rows carried down while its fused LRP pass runs backward (:attr:`PassState.chunk_reader`):
    that backward recomputes each layer's probabilities a chunk of query rows at a time, top layer first, and
    forms R(A) there, so M^l is built from them and the shared pass's ∇A at the same rows, and no second pass
    over every layer's maps recomputes them."""

    def __init__(self, ctx: BatchContext, start_layer: int) -> None:
        cap = ctx.capture
        self.start_layer = start_layer
        self.maps = cap.map_chunks()
        self.keys = cap.query_weights.shape[-1]
        self.carrier = RowCarrier(cap.query_weights, self.maps.n_layers - start_layer, mix=1.0, keep=0.0)
        self.failed = False  # the layers did not arrive one after another from the top (e.g. a shared layer)

    def __call__(self, layer: int, start: int, a: torch.Tensor, relevance: torch.Tensor) -> None:
        j = layer - self.start_layer
        if j < 0 or self.failed:  # below the first layer TransAtt reads
            return
        if self.carrier.open and self.carrier.layer != j:
            self.carrier.end()
        if not self.carrier.expects(j):
            self.failed = True  # transatt then carries its rows over the maps recomputed once more
            return
        with torch.no_grad():
            grad = self.maps.gradient_rows(layer, start, start + a.shape[2], a.shape[3])
            m = zero_padded(_transatt_matrix(grad.to(relevance.dtype), relevance, start, overwrite=True), self.keys)
            self.carrier.add(j, start, m)

    def rows(self) -> torch.Tensor | None:
        """``(B, L', N)``, or ``None`` unless every layer from ``start_layer`` up was carried."""
        if self.carrier.open:
            self.carrier.end()
        return self.carrier.rows() if self.carrier.complete and not self.failed else None


def _in_pass_reader(ctx: BatchContext, key: tuple[str, float], fused: bool) -> _CarriedInPass | None:
    """A reader carrying TransAtt's rows during the pass serving ``key``, where that pass runs fused over a batch
    of inputs and TransAtt reads it (its carried rows are then in ``ctx.cache["transatt_rows"]``)."""
    opts = ctx.plan.get("transatt")
    if not fused or ctx.sequence is not None or opts is None or ctx.capture is None:
        return None
    if _planned_passes(ctx).get("transatt") != key:
        return None
    n_layers = ctx.capture.map_chunks().n_layers
    start = opts.get("start_layer", 0)  # an integer (the options were checked); its range needs the model
    if not -n_layers <= start < n_layers:
        return None  # transatt itself says why
    reader = _CarriedInPass(ctx, start % n_layers)
    ctx.cache.setdefault("transatt_rows", {})[key] = reader
    return reader


@register(
    "transatt",
    needs={ATTENTION_CHUNKS, GRADIENTS, OWN_PASS},
    self_attention_only=True,
    summary="Transformer attribution: rollout of E_h max(∇A ⊙ R(A), 0) + I (row-normalised) from start_layer; "
    "row c.",
    citation="Chefer, Gur & Wolf, Transformer Interpretability Beyond Attention Visualization, CVPR 2021",
    lrp=True,
    check=_check_transatt,
    applies=_one_stream("transatt"),
    fits=_transatt_fits,
)
def transatt(ctx: BatchContext, start_layer: int = 0, rules: str = "chefer", epsilon: float = 0.0) -> MethodOutput:
    _check_transatt(start_layer, rules, epsilon)
    res = shared_lrp(ctx, rules, epsilon)
    n_layers = res.n_layers
    if not -n_layers <= start_layer < n_layers:
        raise InputError(f"transatt start_layer={start_layer} is out of range for a model with {n_layers} layers: "
                         f"use 0 to {n_layers - 1}, or -1 to -{n_layers} to count from the top")
    start_layer %= n_layers
    cap = ctx.capture
    # rows of the products from start_layer up to each layer, carried down a chunk of query rows at a time: during
    # a fused pass's backward where it ran so, else over the maps recomputed once more
    in_pass = ctx.cache.get("transatt_rows", {}).get((rules, float(epsilon)))
    carried = in_pass.rows() if in_pass is not None and in_pass.start_layer == start_layer else None
    if carried is None:
        maps = _LayersFrom(cap.map_chunks(), start_layer)
        carried = carried_rows(cap.query_weights, maps, _TransAttRows(res, start_layer), mix=1.0, keep=0.0,
                               gradients=True)
    layers = carried.to(cap.query_weights.dtype)
    return MethodOutput(layers[:, -1], layers if start_layer == 0 else None)


def _attnlrp_outputs(ctx: BatchContext) -> Any:
    """The model outputs of the LRP pass ``attnlrp`` reads (run here, and cached for the method); ``None`` for
    rules it refuses (the method says why)."""
    opts = ctx.plan.get("attnlrp", {})
    rules = opts.get("rules", "attnlrp")
    if rules not in ATTNLRP_RULES:
        return None
    return shared_lrp(ctx, rules, opts.get("epsilon", 0.0)).outputs


@register(
    "attnlrp",
    needs={OWN_PASS},
    forward=_attnlrp_outputs,
    summary="AttnLRP: relevance of the input embeddings under attention-aware LRP rules, summed over the "
    "hidden dimension (signed).",
    citation="Achtibat et al., AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers, ICML 2024",
    lrp=True,
    check=_check_attnlrp,
)
def attnlrp(ctx: BatchContext, input: str = "embeddings", rules: str = "attnlrp", epsilon: float = 0.0) -> MethodOutput:
    _check_attnlrp(input, rules, epsilon)
    res = shared_lrp(ctx, rules, epsilon)
    scores = res.input_relevance if input == "embeddings" else res.word_relevance
    # an encoder-decoder's scores are its encoder's input tokens' (as the gradient methods'); what its decoder's
    # inputs take is reported beside them, so the two account for the explained scalar together
    meta = None if res.decoder_relevance is None else {"decoder_inputs": res.decoder_relevance.sum(-1)}
    return MethodOutput(scores, None, space="tokens", meta=meta)
