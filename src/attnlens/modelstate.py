"""Leave the user's model exactly as it was: eval mode and eager attention only while attnlens runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

EAGER = "eager"


def attention_implementation(model: nn.Module) -> str | None:
    """The attention implementation the model's config names (``None`` if it names none)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _set_attention_implementation(model: nn.Module, value: str | None) -> None:
    if attention_implementation(model) == value:
        return
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None and value is not None:
        setter(value)
    else:  # older transformers: the config field is what the attention modules read
        model.config._attn_implementation = value


@contextmanager
def explaining(model: nn.Module) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode with eager attention (SDPA/flash return no attention probabilities) for the
    duration of the block, and restore every module's ``training`` flag and the attention implementation
    afterwards, also when the block raises. Parameters are never modified: attnlens differentiates with
    :func:`torch.autograd.grad` w.r.t. activations, so no ``.grad`` is written and ``requires_grad`` is untouched.
    """
    training = {name: m.training for name, m in model.named_modules()}
    implementation = attention_implementation(model)
    try:
        model.eval()
        _set_attention_implementation(model, EAGER)
        yield model
    finally:
        _set_attention_implementation(model, implementation)
        for name, m in model.named_modules():
            if name in training:
                m.training = training[name]
