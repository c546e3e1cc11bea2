"""Perturbation baselines from Captum on token features: occlusion, LIME and KernelSHAP.

Each input's features are its real non-special tokens (special tokens and padding are never perturbed). A token
is "removed" by replacing its input embedding with the embedding of a baseline token (``baseline``: the
padding token by default, the unknown token for decoder-only models, as for integrated gradients — see
:func:`attnlens.methods.gradient.baseline_ids`); that is the model's output on the token ids with the token
replaced, since the embedding module is the token lookup (positions stay those of the input: RoBERTa, which
numbers positions by skipping padding ids, sees the replaced token at its own position). In an encoder-decoder
(BART, T5) the encoder's input tokens are the features; the decoder reads the input unreplaced, as for
integrated gradients. The explained scalar is the one every method explains (``head.scalar``: the target's
logit by default).

- ``occlusion``: Captum's ``Occlusion`` with a one-token window: ``s_j = F(x) - F(x with token j replaced)``;
  M + 1 evaluations for M tokens.
- ``lime``: Captum's ``Lime`` (Ribeiro et al. 2016): ``n_samples`` random token subsets (each token kept with
  probability 1/2), weighted by an exponential kernel of their cosine distance to the input, fitted by a Lasso
  (Captum's defaults); the score is the token's coefficient.
- ``kernelshap``: Captum's ``KernelShap`` (Lundberg & Lee 2017): ``n_samples`` subsets weighted by the Shapley
  kernel, fitted by linear regression: approximate Shapley values.

Evaluations are batched: at most ``perturbations_per_eval`` perturbed copies of one input per forward (default:
as many as the memory budget allows at the batch's length, at most ``MAX_PER_EVAL``), so an input costs
``ceil(n_samples / per_eval)`` forwards (occlusion: ``ceil((M + 1) / per_eval)``) under ``torch.no_grad()``.
LIME and KernelSHAP sample with a generator seeded per input (``seed``), so an input gets the same samples alone
and in a batch.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ..core.batch_state import BatchContext
from ..core.memory import forward_row_bytes, model_dims, rows_that_fit
from .gradient import baseline_ids, check_baseline, embedding_forward
from .registry import OWN_PASS, MethodOutput, check_integer, register

MAX_PER_EVAL = 256  # perturbed copies per forward at most, whatever the budget (larger batches gain nothing on CPU)
DEFAULT_SAMPLES = 100  # LIME's and KernelSHAP's samples per input (Captum's defaults, 50 and 25, are noisy on text)
# inputs laid out (batch, token) as the input ids, cut to each input's length (decoder inputs of a seq2seq model
# are not among them: they are not the explained tokens)
TOKEN_ALIGNED = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids"})


def _per_eval(ctx: BatchContext, per_eval: int | None, name: str) -> int:
    check_integer(name, "perturbations_per_eval", per_eval, 1, none=True)
    if per_eval is not None:
        return per_eval
    n = int(ctx.token_mask.shape[1])
    return rows_that_fit(ctx.memory_budget, forward_row_bytes(model_dims(ctx.model), n), cap=MAX_PER_EVAL)


def _check_occlusion(baseline: str = "auto", perturbations_per_eval: int | None = None) -> None:
    """Occlusion's option values."""
    check_baseline(baseline)
    check_integer("occlusion", "perturbations_per_eval", perturbations_per_eval, 1, none=True)


def _sampled_check(name: str) -> Callable[..., None]:
    """The option check of a sampling method (LIME, KernelSHAP) called ``name``."""
    def check(n_samples: int = DEFAULT_SAMPLES, baseline: str = "auto", perturbations_per_eval: int | None = None,
              seed: int = 0) -> None:
        check_integer(name, "n_samples", n_samples, 2)
        check_baseline(baseline)
        check_integer(name, "perturbations_per_eval", perturbations_per_eval, 1, none=True)
        check_integer(name, "seed", seed)
    return check


def _per_input(
    ctx: BatchContext, baseline: str, attribute: Callable[[Any, torch.Tensor, torch.Tensor, int], torch.Tensor],
    evaluations: Callable[[int], int],
) -> torch.Tensor:
    """Token scores ``(B, N)`` from ``attribute(forward, x, base, b)`` run on each input ``b`` alone.

    ``x`` and ``base`` are ``(1, M, D)``: the embeddings of the input's M real non-special tokens and of their
    baseline; ``forward(points)`` maps ``(k, M, D)`` such points to the explained scalar of each, ``(k,)``, with
    the other positions (special tokens, padding) as they are. ``attribute`` returns ``(1, M, D)`` attributions,
    one value per token repeated over D (Captum's ``return_input_shape``). ``evaluations(M)`` is the number of
    points it evaluates for M tokens: progress is reported after every forward, so a listener sees thousands of
    samples move (and can stop them, by raising from its callback) instead of one report per input."""
    forward, embeddings, extra = embedding_forward(ctx)
    # the additional arguments are the token ids, the other inputs in their order, then the targets: an input's
    # token-aligned ones are cut to its length (no padding: an input scores the same alone and in a batch)
    names = ["input_ids", *(k for k in ctx.inputs if k != "input_ids"), "targets"]
    module = ctx.adapter.embedding_module(ctx.model)
    with torch.no_grad():
        base_embeddings = module(baseline_ids(ctx, baseline))
    features = ctx.token_mask.bool() & ~ctx.special_mask.bool()
    scores = torch.zeros(ctx.token_mask.shape, dtype=embeddings.dtype, device=embeddings.device)
    for b in range(len(embeddings)):
        positions = features[b].nonzero().squeeze(1)
        if len(positions) == 0:
            continue
        n = int(ctx.token_mask[b].sum())
        row = embeddings[b: b + 1, :n]
        row_extra = tuple(t[b: b + 1, :n] if name in TOKEN_ALIGNED else t[b: b + 1]
                          for name, t in zip(names, extra, strict=True))

        share = 1 / len(embeddings)  # of the batch's pass, per input
        expected = max(evaluations(len(positions)), 1)
        reported = 0.0

        def points_forward(points: torch.Tensor, row: torch.Tensor = row, row_extra: tuple = row_extra,
                           positions: torch.Tensor = positions, expected: int = expected,
                           share: float = share) -> torch.Tensor:
            nonlocal reported
            full = row.expand(len(points), *row.shape[1:]).clone()
            full[:, positions] = points
            out = forward(full, *(t.expand(len(points), *t.shape[1:]) for t in row_extra))
            if ctx.progress is not None:
                step = min(share * len(points) / expected, share - reported)
                reported += step
                ctx.progress(step)
            return out

        x = row[:, positions]
        base = base_embeddings[b: b + 1, positions]
        with torch.no_grad():
            attr = attribute(points_forward, x, base, b)
        scores[b, positions] = attr[0, :, 0].to(scores.dtype)
        if ctx.progress is not None and share > reported:
            ctx.progress(share - reported)
    return scores


@register(
    "occlusion",
    needs={OWN_PASS},
    many_passes=True,
    passes=lambda model, n, options: (n + 1) / 3,  # a forward per token and one of the input, ~⅓ pass each
    summary="Drop in the target when one token is replaced by the baseline token (Captum Occlusion).",
    citation="Zeiler & Fergus 2014; Captum Occlusion",
    check=_check_occlusion,
)
def occlusion(ctx: BatchContext, baseline: str = "auto", perturbations_per_eval: int | None = None) -> MethodOutput:
    per_eval = _per_eval(ctx, perturbations_per_eval, "occlusion")

    def attribute(forward: Any, x: torch.Tensor, base: torch.Tensor, _b: int) -> torch.Tensor:
        return _occlude(forward, x, base, per_eval)

    return MethodOutput(_per_input(ctx, baseline, attribute, lambda m: m + 1), space="tokens")


def _occlude(forward: Any, x: torch.Tensor, base: torch.Tensor, per_eval: int) -> torch.Tensor:
    """Captum's Occlusion of one token (all D features of a position) at a time."""
    from captum.attr import Occlusion  # Captum's import takes a while: only where it runs

    window = (1, x.shape[-1])
    return Occlusion(forward).attribute(x, sliding_window_shapes=window, strides=window, baselines=base,
                                        perturbations_per_eval=per_eval)


@contextmanager
def _own_randomness(seed: int) -> Iterator[None]:
    """Captum samples from torch's global generator: seeded with ``seed`` for the block. Its surrogate's
    scikit-learn fit (LIME) draws from NumPy's global generator, and scikit-learn's first import from Python's.
    All three are restored afterwards: the caller's random streams go on as if the method had not run."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def _sampled_passes(model: Any, n: int, options: Any) -> float:
    """A sampling method's work on one input, in passes: a forward per sample, about a third of a pass each."""
    samples = options.get("n_samples")
    return (samples if isinstance(samples, int) and samples > 0 else DEFAULT_SAMPLES) / 3


def _sampled(ctx: BatchContext, name: str, n_samples: int, baseline: str, perturbations_per_eval: int | None,
             seed: int) -> MethodOutput:
    from captum.attr import KernelShap, Lime  # Captum's import takes a while: only where it runs

    _sampled_check(name)(n_samples, baseline, perturbations_per_eval, seed)
    per_eval = _per_eval(ctx, perturbations_per_eval, name)
    explainer = {"lime": Lime, "kernelshap": KernelShap}[name]

    def attribute(forward: Any, x: torch.Tensor, base: torch.Tensor, b: int) -> torch.Tensor:
        if x.shape[1] == 1 and explainer is KernelShap:  # one player: its Shapley value is the occlusion drop
            return _occlude(forward, x, base, per_eval)  # (Captum's sampler divides by zero there)
        mask = torch.arange(x.shape[1], device=x.device)[None, :, None].expand_as(x)
        with _own_randomness(seed):
            return explainer(forward).attribute(x, baselines=base, feature_mask=mask, n_samples=n_samples,
                                                perturbations_per_eval=per_eval)

    def evaluations(m: int) -> int:  # a single token is occluded (M + 1 = 2) where KernelSHAP cannot sample
        return 2 if m == 1 and explainer is KernelShap else n_samples

    return MethodOutput(_per_input(ctx, baseline, attribute, evaluations), space="tokens")


@register(
    "lime",
    needs={OWN_PASS},
    many_passes=True,
    passes=_sampled_passes,
    summary="LIME: a sparse linear model of the target over random token subsets (Captum Lime).",
    citation="Ribeiro et al. 2016; Captum Lime",
    check=_sampled_check("lime"),
)
def lime(ctx: BatchContext, n_samples: int = DEFAULT_SAMPLES, baseline: str = "auto",
         perturbations_per_eval: int | None = None, seed: int = 0) -> MethodOutput:
    return _sampled(ctx, "lime", n_samples, baseline, perturbations_per_eval, seed)


@register(
    "kernelshap",
    needs={OWN_PASS},
    many_passes=True,
    passes=_sampled_passes,
    summary="KernelSHAP: Shapley values of the tokens from a kernel-weighted regression (Captum KernelShap).",
    citation="Lundberg & Lee 2017; Captum KernelShap",
    check=_sampled_check("kernelshap"),
)
def kernelshap(ctx: BatchContext, n_samples: int = DEFAULT_SAMPLES, baseline: str = "auto",
               perturbations_per_eval: int | None = None, seed: int = 0) -> MethodOutput:
    return _sampled(ctx, "kernelshap", n_samples, baseline, perturbations_per_eval, seed)
