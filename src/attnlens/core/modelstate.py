"""Leave the user's model exactly as it was: eval mode and eager attention only while attnlens runs."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ..errors import ModelError
from ..models.quiet import quiet_third_party
from .fused_attention import FUSED, fused_implementation

EAGER = "eager"
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_HF_HOOK_FLAG = "_output_capturing_hooks_installed"  # transformers >= 5 hooks modules lazily to record outputs


_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: nn.Module) -> threading.RLock:
    """The lock that lets one thread at a time run attnlens on ``model`` (re-entrant: a call holding it may enter
    it again). A pass switches the model's attention implementation, patches forwards and installs hooks for its
    duration; two threads doing so on one model would record each other's switches as the original and remove
    each other's hooks. Every :func:`explaining` block holds it, and :class:`~attnlens.Explainer`'s calls hold it
    from start to end, so calls on one model from several threads (through one explainer or several) run one
    after another."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


def _forget_locks() -> None:
    """In a forked child only the forking thread runs: a lock another thread held at the fork would never be
    released there, so the child starts with none."""
    global _LOCKS_GUARD
    _LOCKS_GUARD = threading.Lock()
    _LOCKS.clear()


os.register_at_fork(after_in_child=_forget_locks)


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


def _resolved(model: nn.Module, implementation: str) -> str:
    """The implementation a pass switches ``model`` to: transformers' ``"sdpa"`` as
    :func:`~attnlens.core.fused_attention.fused_implementation` picks its variant, any other name as it is."""
    return fused_implementation(model) if implementation == FUSED else implementation


def without_cache(model: nn.Module) -> dict[str, bool]:
    """The forward keyword that stops ``model`` from building a key/value cache (``{}`` where it builds none).
    attnlens never reuses the cache of a pass it runs, and the cache holds every layer's keys and values (an
    encoder-decoder's decoder: four hidden-size vectors per token and layer) to the end of the pass; a layer
    recomputed in the backward must not append to it again."""
    return {"use_cache": False} if getattr(getattr(model, "config", None), "use_cache", None) is not None else {}


def runs_sdpa(model: nn.Module) -> bool:
    """Whether ``model`` can run its attention as PyTorch's fused attention (transformers' ``"sdpa"``)."""
    return bool(getattr(type(model), "_supports_sdpa", False))


@contextmanager
def attention_switched(model: nn.Module, implementation: str) -> Iterator[nn.Module]:
    """Within an :func:`explaining` block, run ``model``'s attention as ``implementation`` (a name registered in
    transformers' attention interface) and switch back afterwards; nothing else is touched."""
    original = attention_implementation(model)
    _set_attention_implementation(model, _resolved(model, implementation))
    try:
        yield model
    finally:
        _set_attention_implementation(model, original)


@contextmanager
def explaining(model: nn.Module, implementation: str = EAGER) -> Iterator[nn.Module]:
    """Put ``model`` in eval mode with eager attention (SDPA/flash return no attention probabilities) for the
    duration of the block (``implementation="sdpa"`` for forward passes that need no attention probabilities;
    models without an SDPA kernel stay eager; :func:`~attnlens.core.fused_attention.fused_implementation` picks
    the variant), and restore every module's ``training`` flag and the attention
    implementation afterwards, also when the block raises. Hooks added meanwhile are removed. Parameters are
    never modified: attnlens differentiates with :func:`torch.autograd.grad` w.r.t. activations, so no ``.grad``
    is written and ``requires_grad`` is untouched. Third-party deprecation notices about the arguments attnlens
    passes are kept out of the user's output meanwhile (:func:`attnlens.models.quiet.quiet_third_party`). The
    block holds :func:`model_lock`: other threads' blocks on ``model`` wait for it to end.
    """
    with model_lock(model), _explaining(model, implementation):
        yield model


@contextmanager
def _explaining(model: nn.Module, implementation: str) -> Iterator[nn.Module]:
    modules = dict(model.named_modules())
    training = {name: m.training for name, m in modules.items()}
    hooks = {name: {d: set(getattr(m, d, {}) or {}) for d in _HOOK_DICTS} for name, m in modules.items()}
    flags = {name: m.__dict__.get(_HF_HOOK_FLAG) for name, m in modules.items()}
    original = attention_implementation(model)
    try:
        model.eval()
        try:
            _set_attention_implementation(model, _resolved(model, implementation))
        except (ValueError, NotImplementedError, ImportError):  # no kernel of that kind for this architecture
            _set_attention_implementation(model, EAGER)
        now = attention_implementation(model)
        if implementation == EAGER and now not in (None, EAGER):
            # Some models (Falcon) cannot switch after construction: their attention probabilities, and
            # padded batches, would be silently wrong.
            raise ModelError(f"{type(model).__name__} cannot switch to eager attention after loading (it uses "
                             f"{now!r}); load it with attn_implementation='eager'")
        with quiet_third_party():
            yield model
    finally:
        _set_attention_implementation(model, original)
        for name, m in model.named_modules():
            if name in training:
                m.training = training[name]
            # Remove hooks that appeared while explaining (ours are removed already; these are the output
            # recorders transformers installs on first use) and reset transformers' "installed" flag with them.
            for d in _HOOK_DICTS:
                registered = getattr(m, d, None)
                if registered:
                    for key in set(registered) - hooks.get(name, {}).get(d, set()):
                        del registered[key]
            if name in flags and flags[name] is None and _HF_HOOK_FLAG in m.__dict__:
                del m.__dict__[_HF_HOOK_FLAG]


NO_TOKEN_ID = -1  # a padding id no token has


@contextmanager
def last_token_head(model: nn.Module) -> Iterator[nn.Module]:
    """Let a decoder-only classifier without ``config.pad_token_id`` (GPT-2's hub default) score batches of
    unpadded copies of one input, as Captum's integrated gradients makes them.

    Such heads (GPT-2, Llama, ...) find each row's last real token by the padding id and refuse batches of more
    than one row without one. For the duration of the block the config gets an id no token has, so the head
    reads the last position of every row, exactly what it reads for a single input; the config is restored
    afterwards. Only valid for rows without padding: attnlens explains such models one input at a time.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "pad_token_id", 0) is not None:
        yield model
        return
    with model_lock(model):
        config.pad_token_id = NO_TOKEN_ID
        try:
            yield model
        finally:
            config.pad_token_id = None
