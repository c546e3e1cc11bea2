"""Gradient baselines on the input embeddings, from Captum, scores summed over the embedding dimension.

``inputxgradient`` and ``integratedgradients`` are signed; ``saliency`` sums |gradient| by default (Captum's
default; ``abs=False`` gives the signed sum).

``saliency`` and ``inputxgradient`` read the embedding gradient of the shared pass by default (one backward for
all methods); ``engine="captum"`` runs Captum's ``Saliency`` / ``InputXGradient`` instead (the tests check both agree).
``integratedgradients`` always runs Captum's ``IntegratedGradients`` on the token embeddings (its own passes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from captum.attr import InputXGradient, IntegratedGradients, Saliency

from ..context import BatchContext
from ..errors import InputError
from .registry import EMBEDDINGS, GRADIENTS, OWN_PASS, MethodOutput, register

ENGINES = ("shared", "captum")
BASELINES = ("auto", "pad", "mask", "unk")


def _embedding_forward(ctx: BatchContext) -> tuple[Callable[..., torch.Tensor], torch.Tensor, tuple[torch.Tensor, ...]]:
    """A Captum forward function over the input-token embeddings, returning each example's explained scalar.

    The embeddings replace the first output of the model's embedding module (some models call that module again,
    e.g. GPT-2 for token types, which must stay untouched). Token ids, the other inputs and the targets travel as
    additional arguments, so Captum expands them together with the embeddings (IG's steps).
    Returns the forward function, the embeddings of the batch and the additional arguments.
    """
    module = ctx.adapter.embedding_module(ctx.model)
    keys = [k for k in ctx.inputs if k != "input_ids"]

    def forward(embeddings: torch.Tensor, input_ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        kwargs = dict(zip(keys, rest[:-1], strict=True))
        replaced = []

        def substitute(_module: torch.nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor:
            if replaced:
                return output
            replaced.append(True)
            return embeddings

        handle = module.register_forward_hook(substitute)
        try:
            logits = ctx.head.logits(ctx.model(input_ids=input_ids, **kwargs))
        finally:
            handle.remove()
        mask = kwargs.get("attention_mask", torch.ones_like(input_ids))
        return ctx.head.scalar(logits, rest[-1], ctx.target_kind, mask)

    with torch.no_grad():
        embeddings = module(ctx.inputs["input_ids"])
    extra = (ctx.inputs["input_ids"],) + tuple(ctx.inputs[k] for k in keys) + (ctx.targets,)
    return forward, embeddings, extra


def _captum_gradients(ctx: BatchContext, multiply: bool) -> torch.Tensor:
    """Captum's Saliency (signed) or InputXGradient on the token embeddings: ``(B, N, D)``."""
    forward, embeddings, extra = _embedding_forward(ctx)
    embeddings.requires_grad_(True)
    with torch.enable_grad():
        if multiply:
            attr = InputXGradient(forward).attribute(embeddings, additional_forward_args=extra)
        else:
            attr = Saliency(forward).attribute(embeddings, abs=False, additional_forward_args=extra)
    return attr.detach()


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise InputError(f"engine={engine!r}; choose one of {', '.join(ENGINES)}")


@register(
    "saliency",
    needs={EMBEDDINGS, GRADIENTS},
    summary="Gradient of the target w.r.t. the input token embeddings, |·| summed over dimensions.",
    citation="Simonyan et al. 2014; Captum Saliency",
)
def saliency(ctx: BatchContext, engine: str = "shared", abs: bool = True) -> MethodOutput:  # noqa: A002
    # Captum's Saliency takes |gradient| by default, and so do we: when a LayerNorm follows the embeddings
    # (BERT & co.), the gradient w.r.t. the embedding sums to ~0 over dimensions, so the signed sum says nothing.
    _check_engine(engine)
    if not isinstance(abs, bool):
        raise InputError(f"saliency abs must be True or False, got {abs!r}")
    grads = _captum_gradients(ctx, multiply=False) if engine == "captum" else ctx.capture.embedding_grads
    return MethodOutput((grads.abs() if abs else grads).sum(-1), space="tokens")


@register(
    "inputxgradient",
    needs={EMBEDDINGS, GRADIENTS},
    summary="Input embeddings × their gradient, summed over dimensions.",
    citation="Shrikumar et al. 2016; Captum InputXGradient",
)
def inputxgradient(ctx: BatchContext, engine: str = "shared") -> MethodOutput:
    _check_engine(engine)
    if engine == "captum":
        return MethodOutput(_captum_gradients(ctx, multiply=True).sum(-1), space="tokens")
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
    citation="Sundararajan et al. 2017; Captum IntegratedGradients",
)
def integratedgradients(
    ctx: BatchContext, n_steps: int = 50, internal_batch_size: int = 128, baseline: str = "auto"
) -> MethodOutput:
    for name, value in (("n_steps", n_steps), ("internal_batch_size", internal_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"integratedgradients {name} must be an integer >= 1, got {value!r}")
    forward, embeddings, extra = _embedding_forward(ctx)
    with torch.no_grad():
        reference = ctx.adapter.embedding_module(ctx.model)(baseline_ids(ctx, baseline))
    with torch.enable_grad():
        attr = IntegratedGradients(forward).attribute(
            embeddings,
            baselines=reference,
            additional_forward_args=extra,
            n_steps=n_steps,
            internal_batch_size=internal_batch_size,
        )
    return MethodOutput(attr.sum(-1).detach(), space="tokens")
