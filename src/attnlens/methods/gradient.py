"""Gradient baselines on the input embeddings, from Captum, scores summed over the embedding dimension.

``inputxgradient`` and ``integratedgradients`` are signed; ``saliency`` sums |gradient| by default (Captum's
default; ``abs=False`` gives the signed sum).

``saliency`` and ``inputxgradient`` read the embedding gradient of the shared pass by default (one backward for
all methods); ``engine="captum"`` runs Captum's ``Saliency`` / ``InputXGradient`` instead (the tests check both agree).
``integratedgradients`` runs its own passes on the token embeddings with Captum's quadrature rules (our loop:
it also checks completeness per input and can choose the number of steps from a tolerance).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ..core.batch_state import BatchContext
from ..core.batching import keeps_logits
from ..core.logit_rows import LogitRows
from ..core.memory import (
    Storage,
    gradient_pass_storage,
    held_step_bytes,
    model_dims,
    pass_row_bytes,
    rows_that_fit,
)
from ..core.modelstate import attention_switched, runs_sdpa, without_cache
from ..core.recomputing import recomputing
from ..errors import InputError
from ..models.architectures import architecture_for
from ..models.prefixes import last_token_rows
from .registry import EMBEDDINGS, GRADIENTS, OWN_PASS, MethodOutput, check_flag, check_integer, register

ENGINES = ("shared", "captum")
BASELINES = ("auto", "pad", "mask", "unk")


@contextmanager
def _embeddings_replaced(module: torch.nn.Module, embeddings: torch.Tensor) -> Iterator[None]:
    """Within the block, the first output of the model's embedding ``module`` is ``embeddings`` (some models call
    that module again, e.g. GPT-2 for token types, which must stay untouched)."""
    replaced: list[bool] = []

    def substitute(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor:
        if replaced:
            return output
        replaced.append(True)
        return embeddings

    handle = module.register_forward_hook(substitute)
    try:
        yield
    finally:
        handle.remove()


def embedding_forward(ctx: BatchContext) -> tuple[Callable[..., torch.Tensor], torch.Tensor, tuple[torch.Tensor, ...]]:
    """A Captum forward function over the input-token embeddings, returning each example's explained scalar.

    Token ids, the other inputs and the targets travel as additional arguments, so Captum expands them together
    with the embeddings (IG's steps). Returns the forward function, the embeddings of the batch and the
    additional arguments.
    """
    module = ctx.adapter.embedding_module(ctx.model)
    keys = [k for k in ctx.inputs if k != "input_ids"]

    def forward(embeddings: torch.Tensor, input_ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        kwargs = dict(zip(keys, rest[:-1], strict=True))
        mask = kwargs.get("attention_mask", torch.ones_like(input_ids))
        read = LogitRows.of(ctx.model, ctx.head, mask, rest[-1])  # a language model's logits where they are read
        kwargs.update(without_cache(ctx.model))
        with _embeddings_replaced(module, embeddings):
            logits = ctx.head.logits(ctx.model(input_ids=input_ids, **kwargs, **read.model_kwargs()))
        return ctx.head.scalar(logits, read.targets(ctx.head, rest[-1]), ctx.target_kind, read.mask(mask))

    with torch.no_grad():
        embeddings = module(ctx.inputs["input_ids"])
    extra = (ctx.inputs["input_ids"],) + tuple(ctx.inputs[k] for k in keys) + (ctx.targets,)
    return forward, embeddings, extra


def _sequence_forward(ctx: BatchContext, base_ids: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                                                        torch.Tensor, torch.Tensor]:
    """For rows that are prefixes of one causal sequence (``ctx.sequence``, a generation's steps): a function of
    ``k`` points on the sequence's embeddings ``(k, N, D)`` giving every row's explained scalar at each point,
    ``(k, B)`` — one forward per point serves every row, since row ``b`` reads the sequence's first tokens only.
    Also returns the sequence's embeddings and its baseline's (the longest row of ``base_ids``), ``(1, N, D)``."""
    module = ctx.adapter.embedding_module(ctx.model)
    sequence = ctx.sequence
    assert sequence is not None
    # Only each row's last position is read: where the model can, project only those onto the vocabulary (the
    # LM head is a fifth of a small LLM's forward, and its backward would otherwise run over every position)
    read = LogitRows.of(ctx.model, ctx.head, ctx.token_mask, ctx.targets)
    mask = read.mask(ctx.token_mask)

    def forward(points: torch.Tensor) -> torch.Tensor:
        inputs = {name: t.expand(len(points), *t.shape[1:]) for name, t in sequence.items()}
        with _embeddings_replaced(module, points):
            logits = ctx.head.logits(ctx.model(**inputs, **read.model_kwargs()))  # (k, kept positions, V)
        rows = [last_token_rows(logits[j: j + 1], mask) for j in range(len(points))]
        return torch.stack([ctx.head.scalar(rows_logits, ctx.targets, ctx.target_kind, rows_mask)
                            for rows_logits, rows_mask in rows])

    longest = int(ctx.token_mask.long().sum(1).argmax())
    with torch.no_grad():
        x = module(sequence["input_ids"])
        base = module(base_ids[longest: longest + 1])
    return forward, x, base


def _captum_gradients(ctx: BatchContext, multiply: bool) -> torch.Tensor:
    """Captum's Saliency (signed) or InputXGradient on the token embeddings: ``(B, N, D)``."""
    from captum.attr import InputXGradient, Saliency  # Captum's import takes a while: only where it runs

    forward, embeddings, extra = embedding_forward(ctx)
    embeddings.requires_grad_(True)
    with torch.enable_grad():
        if multiply:
            attr = InputXGradient(forward).attribute(embeddings, additional_forward_args=extra)
        else:
            attr = Saliency(forward).attribute(embeddings, abs=False, additional_forward_args=extra)
    return attr.detach()


def _check_engine(engine: str = "shared") -> None:
    if engine not in ENGINES:
        raise InputError(f"engine={engine!r}; choose one of {', '.join(ENGINES)}")


def _check_saliency(engine: str = "shared", abs: bool = True) -> None:  # noqa: A002
    _check_engine(engine)
    check_flag("saliency", "abs", abs)


@register(
    "saliency",
    needs={EMBEDDINGS, GRADIENTS},
    summary="Gradient of the target w.r.t. the input token embeddings, |·| summed over dimensions.",
    citation="Simonyan et al. 2014; Captum Saliency",
    check=_check_saliency,
)
def saliency(ctx: BatchContext, engine: str = "shared", abs: bool = True) -> MethodOutput:  # noqa: A002
    # Captum's Saliency takes |gradient| by default, and so do we: when a LayerNorm follows the embeddings
    # (BERT & co.), the gradient w.r.t. the embedding sums to ~0 over dimensions, so the signed sum says nothing.
    _check_saliency(engine, abs)
    grads = _captum_gradients(ctx, multiply=False) if engine == "captum" else ctx.capture.embedding_grads
    decoder = ctx.capture.decoder_embedding_grads if engine == "shared" else None
    return MethodOutput((grads.abs() if abs else grads).sum(-1), space="tokens",
                        meta=_decoder_share(None if decoder is None else decoder.abs() if abs else decoder))


def _reads_the_embeddings_length(model: torch.nn.Module, stream: str, task: str) -> str | None:
    """Why input × gradient says nothing of a model whose word embeddings go straight into a normalisation."""
    if architecture_for(model.config).normalises_embeddings(model.config):
        return (f"inputxgradient sums to 0 on model type {model.config.model_type!r}: its word embeddings go straight "
                "into a normalisation, so its output does not change with their length (e · ∇e = 0); use saliency, "
                "integratedgradients or attnlrp")
    return None


@register(
    "inputxgradient",
    needs={EMBEDDINGS, GRADIENTS},
    summary="Input embeddings × their gradient, summed over dimensions.",
    citation="Shrikumar et al. 2016; Captum InputXGradient",
    check=_check_engine,
    applies=_reads_the_embeddings_length,
)
def inputxgradient(ctx: BatchContext, engine: str = "shared") -> MethodOutput:
    _check_engine(engine)
    if engine == "captum":
        return MethodOutput(_captum_gradients(ctx, multiply=True).sum(-1), space="tokens")
    cap = ctx.capture
    decoder = None
    if cap.decoder_embeddings is not None and cap.decoder_embedding_grads is not None:
        decoder = cap.decoder_embedding_grads * cap.decoder_embeddings
    return MethodOutput((cap.embedding_grads * cap.embeddings).sum(-1), space="tokens", meta=_decoder_share(decoder))


def _decoder_share(per_dimension: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
    """``{"decoder_inputs": (B,)}``: an encoder-decoder's decoder inputs' share (``(B, M, D)`` summed over their
    positions and dimensions; positions after the explained one contribute zero), reported beside the encoder
    tokens' scores; ``None`` for single-stream models."""
    if per_dimension is None:
        return None
    return {"decoder_inputs": per_dimension.sum((1, 2)).detach()}


def check_baseline(baseline: str) -> None:
    """An :class:`InputError` unless ``baseline`` names a baseline token (one of ``BASELINES``)."""
    if baseline not in BASELINES:
        raise InputError(f"baseline={baseline!r}; choose one of {', '.join(BASELINES)}")


def baseline_ids(ctx: BatchContext, baseline: str) -> torch.Tensor:
    """Input ids with every real non-special token replaced by the baseline token (special tokens kept).

    ``auto`` is the padding token, except for decoder-only models, whose head finds the last real token by the
    padding id: there it is the unknown token (or EOS).
    """
    check_baseline(baseline)
    tok = ctx.tokenizer
    if baseline == "auto":
        baseline = "unk" if ctx.adapter.family == "decoder" else "pad"
    candidates = {
        "pad": [getattr(tok, "pad_token_id", None), getattr(ctx.model.config, "pad_token_id", None)],
        "mask": [getattr(tok, "mask_token_id", None)],
        "unk": [getattr(tok, "unk_token_id", None), getattr(tok, "eos_token_id", None)],
    }[baseline]
    token_id = next((c for c in candidates if c is not None), None)
    if token_id is None:
        raise InputError(f"the tokenizer has no {baseline} token for the integrated-gradients baseline")
    ids = ctx.inputs["input_ids"]
    replace = ctx.token_mask.bool() & ~ctx.special_mask.bool()
    return torch.where(replace, torch.full_like(ids, int(token_id)), ids)


# ----------------------------------------------------------------------------- integrated gradients
QUADRATURES = ("gausslegendre", "riemann_trapezoid", "riemann_middle", "riemann_left", "riemann_right")
# Defaults chosen from bench/ig_convergence.py (docs/integrated-gradients.md): the trapezoid rule, doubled from 4
# points until the relative completeness gap is <= 1 %, reached every SST-2 dev / IMDB input measured with ~20
# evaluations on average (nested: each doubling reuses the earlier points), against 50 for a fixed count.
DEFAULT_RULE = "riemann_trapezoid"
DEFAULT_TOLERANCE = 0.01  # when neither n_steps nor tolerance is given
ADAPTIVE_START = 4  # first count of the adaptive schedule (about doubled until the tolerance is met)
TYPICAL_STEPS = 20  # what the default schedule took on average (for the progress bar's plan)
# The adaptive schedule stops at 49 points (4, 7, 13, 25, 49): classifiers needed 25 at most (SST-2, IMDB);
# a gap still open at 49 is a rough path, not a quadrature error (SmolLM2's next-token logit jumps by ~16 over
# 0.005 of the straight path from its baseline, and 193 points left its gap at 48x the gain).
DEFAULT_MAX_STEPS = 64
# over a generation's steps each step holds its (N, D) gradient sums, their new part and a copy while they are
# updated (Method.step_vectors: counted in the budget)
STEP_VECTORS = 3
GAP_FLOOR = 1e-4  # |F(x) - F(baseline)| below this counts as this when the gap is made relative


def quadrature(rule: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Nodes in [0, 1] and weights (summing to 1) of the ``n``-point ``rule`` for ∫₀¹ g(α) dα."""
    if rule == "gausslegendre":
        x, w = np.polynomial.legendre.leggauss(n)
        return (x + 1) / 2, w / 2
    k = np.arange(n, dtype=np.float64)
    if rule == "riemann_trapezoid":
        if n == 1:
            return np.array([0.5]), np.array([1.0])
        w = np.full(n, 1.0 / (n - 1))
        w[[0, -1]] /= 2
        return k / (n - 1), w
    offset = {"riemann_left": 0.0, "riemann_middle": 0.5, "riemann_right": 1.0}[rule]
    return (k + offset) / n, np.full(n, 1.0 / n)


def next_count(rule: str, n: int) -> int:
    """The next count of the adaptive schedule: about twice ``n``, and nested (every old node is a new one,
    weighted half as much) for the trapezoid (n → 2n-1) and left/right (n → 2n) rules, so that their old
    evaluations are reused."""
    return 2 * n - 1 if rule == "riemann_trapezoid" and n > 1 else 2 * n


def _nested(rule: str, n: int) -> bool:
    return (rule == "riemann_trapezoid" and n > 1) or rule in ("riemann_left", "riemann_right")


def _rows(args: tuple[torch.Tensor, ...], index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(a.index_select(0, index) for a in args)


def _weighted_gradients(
    forward: Callable[..., torch.Tensor], x: torch.Tensor, base: torch.Tensor, extra: tuple[torch.Tensor, ...],
    alphas: np.ndarray, weights: np.ndarray, chunk: int, progress: Callable[[int], None],
) -> torch.Tensor:
    """``Σ_k w_k ∇F(base + α_k (x - base))`` per example, ``(B, N, D)``: rows (example, node) in passes of
    ``chunk`` rows (each example's scalar depends on its own row only, so one backward of the sum serves all)."""
    n_ex, k = x.shape[0], len(alphas)
    a = torch.as_tensor(alphas, dtype=x.dtype, device=x.device)
    w = torch.as_tensor(weights, dtype=x.dtype, device=x.device)
    diff = x - base
    out = torch.zeros_like(x)
    for start in range(0, n_ex * k, chunk):
        r = torch.arange(start, min(start + chunk, n_ex * k), device=x.device)
        b, j = r // k, r % k
        point = (base.index_select(0, b) + a[j, None, None] * diff.index_select(0, b)).requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(forward(point, *_rows(extra, b)).sum(), point)
        out.index_add_(0, b, grad * w[j, None, None])
        progress(len(r))
    return out


def _sequence_weighted_gradients(
    forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, base: torch.Tensor, active: torch.Tensor,
    alphas: np.ndarray, weights: np.ndarray, chunk: int, progress: Callable[[int], None],
) -> torch.Tensor:
    """:func:`_weighted_gradients` of the rows ``active`` of a batch of prefixes of one sequence (``x``, ``base``:
    its ``(1, N, D)`` embeddings and baseline): one forward per node for all rows, then each row's gradient of
    its own scalar by a batched vector-Jacobian product; ``(len(active), N, D)``. At most ``chunk`` (row, node)
    pairs per backward, as in :func:`_weighted_gradients`."""
    a = torch.as_tensor(alphas, dtype=x.dtype, device=x.device)
    w = torch.as_tensor(weights, dtype=x.dtype, device=x.device)
    out = torch.zeros(len(active), *x.shape[1:], dtype=x.dtype, device=x.device)
    group = min(len(active), chunk)
    for first in range(0, len(active), group):
        rows = active[first: first + group]
        per_pass = max(1, chunk // len(rows))  # nodes per forward
        pick = torch.arange(len(rows), device=x.device)
        for start in range(0, len(a), per_pass):
            nodes = slice(start, start + per_pass)
            point = (base + a[nodes, None, None] * (x - base)).requires_grad_(True)
            seeds = torch.zeros(len(rows), len(point), len(rows), dtype=x.dtype, device=x.device)
            seeds[pick, :, pick] = w[nodes]  # row r's seed: weight w_k on its own scalar at node k
            with torch.enable_grad():
                (grad,) = torch.autograd.grad(forward(point)[:, rows], point, grad_outputs=seeds,
                                              is_grads_batched=True)
            out[first: first + len(rows)] += grad.sum(1)
            progress(len(rows) * len(point))
    return out


def _values(forward: Callable[..., torch.Tensor], x: torch.Tensor, extra: tuple[torch.Tensor, ...],
            chunk: int) -> torch.Tensor:
    """The explained scalar of each row of ``x`` (no graph), in passes of ``chunk`` rows."""
    with torch.no_grad():
        parts = [forward(x[s : s + chunk], *(t[s : s + chunk] for t in extra)) for s in range(0, len(x), chunk)]
    return torch.cat(parts)


def _check_ig_options(n_steps: int | None, internal_batch_size: int | None, tolerance: float | None,
                      max_steps: int, method: str) -> None:
    for name, value in (("n_steps", n_steps), ("internal_batch_size", internal_batch_size), ("max_steps", max_steps)):
        check_integer("integratedgradients", name, value, 1, none=True)
    if method not in QUADRATURES:
        raise InputError(f"integratedgradients method={method!r}; choose one of {', '.join(QUADRATURES)}")
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not 0 < tolerance < 1):
        raise InputError(f"integratedgradients tolerance must be a number in (0, 1) (a relative completeness gap, "
                         f"e.g. 0.01), got {tolerance!r}")
    if tolerance is not None and n_steps is not None and n_steps > max_steps:
        raise InputError(f"integratedgradients n_steps={n_steps} is more than max_steps={max_steps}")


def _check_ig(n_steps: int | None = None, method: str = DEFAULT_RULE, tolerance: float | None = None,
              max_steps: int = DEFAULT_MAX_STEPS, internal_batch_size: int | None = None,
              baseline: str = "auto") -> None:
    """Integrated gradients' option values."""
    _check_ig_options(n_steps, internal_batch_size, tolerance, max_steps, method)
    check_baseline(baseline)


@register(
    "integratedgradients",
    needs={OWN_PASS},
    many_passes=True,
    step_vectors=STEP_VECTORS,
    summary="Integrated gradients on the input token embeddings from a baseline of padding tokens.",
    citation="Sundararajan et al. 2017; Captum IntegratedGradients",
    check=_check_ig,
)
def integratedgradients(
    ctx: BatchContext, n_steps: int | None = None, method: str = DEFAULT_RULE, tolerance: float | None = None,
    max_steps: int = DEFAULT_MAX_STEPS, internal_batch_size: int | None = None, baseline: str = "auto",
) -> MethodOutput:
    """IG on the token embeddings, ``(x - x') · ∫₀¹ ∇F(x' + α (x - x')) dα`` by a ``method`` quadrature rule
    (Captum's rules; the trapezoid by default).

    Completeness (Sundararajan et al. 2017) gives a check: ``delta = Σ attributions - (F(x) - F(x'))`` (Captum's
    convergence delta), recorded per input in the explanation's meta with ``relative_gap = |delta| / |F(x) -
    F(x')|``, the steps used and the ``tolerance`` applied (absent with a fixed count). With a ``tolerance``, each
    input starts at ``n_steps`` (default 4) points and about doubles them until its relative gap is at most
    ``tolerance`` or ``max_steps`` would be passed (a warning names the inputs that did not converge); nested
    rules (trapezoid, left, right) reuse their earlier evaluations. ``n_steps`` alone: a fixed count. Neither:
    ``tolerance=0.01`` from 4 points. ``internal_batch_size``: rows (input × point) per forward+backward;
    default: as many as the memory budget allows at this batch's length.
    """
    _check_ig_options(n_steps, internal_batch_size, tolerance, max_steps, method)
    with contextlib.ExitStack() as stack:
        storage = _ig_storage(ctx)
        if not storage.eager:  # fused attention: IG reads no attention probabilities
            try:
                stack.enter_context(attention_switched(ctx.model, "sdpa"))
            except (ValueError, NotImplementedError, ImportError):  # the model refuses the switch after all
                storage = Storage(eager=True, backward=True, logit_rows=storage.logit_rows)
        if storage.recompute:
            stack.enter_context(recomputing(ctx.model, ctx.token_mask.shape[1]))
        chunk = internal_batch_size or _rows_in_budget(ctx, ctx.token_mask.shape[1], storage)
        return _integrated(ctx, n_steps, method, tolerance, max_steps, chunk, baseline)


def _ig_storage(ctx: BatchContext) -> Storage:
    """What one row of integrated gradients' passes holds in this batch: fused attention where the model has it
    (not over a generation's prefixes, whose rows take batched vector-Jacobian products), each layer recomputed
    where keeping its activations would not fit what the budget leaves; the engine's estimate decides alike."""
    fused = ctx.sequence is None and runs_sdpa(ctx.model)
    logit_rows = ctx.head.logit_positions_per_input if keeps_logits(ctx.model) and ctx.sequence is None else 0
    return gradient_pass_storage(model_dims(ctx.model), ctx.token_mask.shape[1], _budget_for_passes(ctx), fused,
                                 logit_rows)


def _budget_for_passes(ctx: BatchContext) -> int:
    """What the batch's budget leaves for the passes: beside the shared pass's tensors and, over a generation's
    steps, each step's sums (:data:`STEP_VECTORS`)."""
    if ctx.sequence is None:
        return ctx.budget_left()
    rows, n = ctx.token_mask.shape
    held = rows * held_step_bytes(model_dims(ctx.model), n, STEP_VECTORS)
    return max(1, ctx.budget_left() - held)


def _integrated(ctx: BatchContext, n_steps: int | None, method: str, tolerance: float | None, max_steps: int,
                chunk: int, baseline: str) -> MethodOutput:
    base_ids = baseline_ids(ctx, baseline)
    n_ex = ctx.token_mask.shape[0]

    planned = n_steps or TYPICAL_STEPS  # the progress bar's plan (an adaptive run may take more or fewer)

    def progress(rows: int) -> None:  # rows of points evaluated: one pass per n_ex of them
        if ctx.progress is not None:
            ctx.progress(rows / (n_ex * planned))

    path = None  # a generation's x − x', shared by its rows
    if ctx.sequence is None:
        forward, x, extra = embedding_forward(ctx)
        with torch.no_grad():
            base = ctx.adapter.embedding_module(ctx.model)(base_ids)
        ends = _values(forward, torch.cat([x, base]), tuple(torch.cat([t, t]) for t in extra), chunk)
        gain = ends[:n_ex] - ends[n_ex:]  # F(x) - F(x')

        def weighted(active: torch.Tensor, alphas: np.ndarray, weights: np.ndarray) -> torch.Tensor:
            return _weighted_gradients(forward, x[active], base[active], _rows(extra, active), alphas, weights,
                                       chunk, progress)
    else:  # a generation's steps: every node's forward runs once, on the whole sequence
        row_values, x1, base1 = _sequence_forward(ctx, base_ids)
        with torch.no_grad():
            ends = row_values(torch.cat([x1, base1]))
        gain = ends[0] - ends[1]
        x, base = x1.expand(n_ex, *x1.shape[1:]), base1.expand(n_ex, *base1.shape[1:])
        path = (x1 - base1)[0]  # (N, D): every row's x − x' (its positions past the row get no gradient)

        def weighted(active: torch.Tensor, alphas: np.ndarray, weights: np.ndarray) -> torch.Tensor:
            return _sequence_weighted_gradients(row_values, x1, base1, active, alphas, weights, chunk, progress)
    if n_steps is None and tolerance is None:
        tolerance = DEFAULT_TOLERANCE
    steps = n_steps or min(ADAPTIVE_START, max_steps)
    sums = torch.zeros_like(x)  # Σ w ∇F per input at the current count
    used = torch.zeros(n_ex, dtype=torch.long)
    delta = torch.zeros_like(gain)
    active = torch.arange(n_ex, device=x.device)
    previous: int | None = None
    while True:
        alphas, weights = quadrature(method, steps)
        if previous is not None and _nested(method, previous):  # new rule = old rule / 2 + the new nodes
            old = set(np.round(quadrature(method, previous)[0], 12))
            new = np.array([i for i, a in enumerate(np.round(alphas, 12)) if a not in old])
            # in place: a generation's rows hold one (N, D) sum each, and a copy more at a time
            sums.index_copy_(0, active, sums.index_select(0, active).mul_(0.5).add_(
                weighted(active, alphas[new], weights[new])))
        else:
            sums.index_copy_(0, active, weighted(active, alphas, weights))
        used[active.cpu()] = steps
        delta[active] = _token_products(x, base, path, sums, active).sum(-1) - gain[active]  # completeness
        gap = delta[active].abs() / gain[active].abs().clamp_min(GAP_FLOOR)
        if tolerance is None:
            break
        active = active[gap > tolerance]
        if not len(active) or next_count(method, steps) > max_steps:
            break
        previous, steps = steps, next_count(method, steps)
    attr = _token_products(x, base, path, sums).detach()
    gaps = delta.abs() / gain.abs().clamp_min(GAP_FLOOR)
    if tolerance is not None and bool((gaps > tolerance).any()):
        warnings.warn(f"integratedgradients: {int((gaps > tolerance).sum())} of {n_ex} inputs did not reach "
                      f"tolerance {tolerance} within max_steps={max_steps} (largest relative gap "
                      f"{float(gaps.max()):.3g}); their gaps are in the explanations' meta. A gap that stays large "
                      "as steps grow means the model's output is rough along the straight path from the baseline "
                      "(common in LLMs): read those attributions with care", stacklevel=3)
    meta = {"delta": delta.detach(), "relative_gap": gaps.detach(), "n_steps": used}
    if tolerance is not None:  # the tolerance applied, also where the options left it to the default
        meta["tolerance"] = torch.full((n_ex,), float(tolerance), dtype=torch.float64)
    return MethodOutput(attr, space="tokens", meta=meta)


def _token_products(x: torch.Tensor, base: torch.Tensor, path: torch.Tensor | None, sums: torch.Tensor,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """``(x − x') · Σ w ∇F`` per token, ``(rows, N)``, of the rows ``rows`` (default: all): the attributions,
    whose sum over the tokens is the completeness check's. ``path`` (a generation's ``(N, D)`` x − x', shared by
    its rows) spares the rows' copies of it."""
    if rows is not None:
        sums = sums.index_select(0, rows)
    if path is not None:
        return torch.einsum("nd,bnd->bn", path, sums)
    if rows is not None:
        x, base = x[rows], base[rows]
    return ((x - base) * sums).sum(-1)


def _rows_in_budget(ctx: BatchContext, n_tokens: int, storage: Storage) -> int:
    """Rows per forward+backward keeping ``storage`` that fit in what the batch's budget leaves beside the shared
    pass's tensors."""
    return rows_that_fit(_budget_for_passes(ctx), pass_row_bytes(model_dims(ctx.model), n_tokens, storage))
