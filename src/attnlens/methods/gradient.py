"""Gradient baselines on the input embeddings, from Captum, scores summed over the embedding dimension.

``inputxgradient`` and ``integratedgradients`` are signed; ``saliency`` sums |gradient| by default (Captum's
default; ``abs=False`` gives the signed sum).

``saliency`` and ``inputxgradient`` read the embedding gradient of the shared pass by default (one backward for
all methods); ``engine="captum"`` runs Captum's ``LayerGradientXActivation`` instead (the tests check both agree).
``integratedgradients`` always runs Captum's ``LayerIntegratedGradients`` (its own passes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from captum.attr import LayerGradientXActivation, LayerIntegratedGradients

from ..context import BatchContext
from ..errors import InputError
from .registry import EMBEDDINGS, GRADIENTS, OWN_PASS, MethodOutput, register

ENGINES = ("shared", "captum")
BASELINES = ("auto", "pad", "mask", "unk")


def _forward(ctx: BatchContext) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]:
    """A Captum forward function over ``input_ids`` returning the per-class values the target kind explains."""
    keys = [k for k in ctx.inputs if k != "input_ids"]

    def forward(input_ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        logits = ctx.model(input_ids=input_ids, **dict(zip(keys, rest, strict=True))).logits
        if ctx.target_kind == "probability":
            return logits.softmax(-1)
        if ctx.target_kind == "loss":
            return logits.log_softmax(-1)
        return logits

    return forward, tuple(ctx.inputs[k] for k in keys)


def _captum_layer_grads(ctx: BatchContext, multiply: bool, reduce: bool = True) -> torch.Tensor:
    forward, extra = _forward(ctx)
    method = LayerGradientXActivation(forward, ctx.adapter.embedding_module(ctx.model), multiply_by_inputs=multiply)
    with torch.enable_grad():
        attr = method.attribute(ctx.inputs["input_ids"], target=ctx.targets, additional_forward_args=extra)
    return attr.sum(-1).detach() if reduce else attr.detach()


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise InputError(f"engine={engine!r}; choose one of {', '.join(ENGINES)}")


@register(
    "saliency",
    needs={EMBEDDINGS, GRADIENTS},
    summary="Gradient of the target w.r.t. the input token embeddings, |·| summed over dimensions.",
    citation="Simonyan et al. 2014; Captum Saliency",
    options={"engine": "shared", "abs": True},
)
def saliency(ctx: BatchContext, engine: str = "shared", abs: bool = True) -> MethodOutput:  # noqa: A002
    # Captum's Saliency takes |gradient| by default, and so do we: when a LayerNorm follows the embeddings
    # (BERT & co.), the gradient w.r.t. the embedding sums to ~0 over dimensions, so the signed sum says nothing.
    _check_engine(engine)
    if engine == "captum":
        grads = _captum_layer_grads(ctx, multiply=False, reduce=False)
    else:
        grads = ctx.capture.embedding_grads
    return MethodOutput((grads.abs() if abs else grads).sum(-1), space="tokens")


@register(
    "inputxgradient",
    needs={EMBEDDINGS, GRADIENTS},
    summary="Input embeddings × their gradient, summed over dimensions.",
    citation="Shrikumar et al. 2016; Captum InputXGradient",
    options={"engine": "shared"},
)
def inputxgradient(ctx: BatchContext, engine: str = "shared") -> MethodOutput:
    _check_engine(engine)
    if engine == "captum":
        return MethodOutput(_captum_layer_grads(ctx, multiply=True), space="tokens")
    cap = ctx.capture
    return MethodOutput((cap.embedding_grads * cap.embeddings).sum(-1), space="tokens")


def baseline_ids(ctx: BatchContext, baseline: str) -> torch.Tensor:
    """Input ids with every real non-special token replaced by the baseline token (special tokens kept).

    ``auto`` is the padding token, except for decoder-only models, whose head finds the last real token by the
    padding id: there it is the unknown token (or EOS).
    """
    if baseline not in BASELINES:
        raise InputError(f"baseline={baseline!r}; choose one of {', '.join(BASELINES)}")
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


@register(
    "integratedgradients",
    needs={OWN_PASS},
    summary="Integrated gradients on the input token embeddings from a baseline of padding tokens.",
    citation="Sundararajan et al. 2017; Captum LayerIntegratedGradients",
    options={"n_steps": 50, "internal_batch_size": 128, "baseline": "auto"},
)
def integratedgradients(
    ctx: BatchContext, n_steps: int = 50, internal_batch_size: int = 128, baseline: str = "auto"
) -> MethodOutput:
    forward, extra = _forward(ctx)
    method = LayerIntegratedGradients(forward, ctx.adapter.embedding_module(ctx.model))
    with torch.enable_grad():
        attr = method.attribute(
            ctx.inputs["input_ids"],
            baselines=baseline_ids(ctx, baseline),
            target=ctx.targets,
            additional_forward_args=extra,
            n_steps=int(n_steps),
            internal_batch_size=int(internal_batch_size),
        )
    return MethodOutput(attr.sum(-1).detach(), space="tokens")
