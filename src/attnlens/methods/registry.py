"""The method registry: one entry per explanation method, declaring what the shared pass must capture.

A method is a small function ``compute(ctx, **options) -> MethodOutput`` of a
:class:`~attnlens.core.batch_state.BatchContext`.
Most methods only read ``ctx.capture`` (the tensors of the one shared forward/backward pass); methods that need
a pass of their own (Captum's integrated gradients, LRP) run it from ``ctx`` and may share it through
``ctx.cache``.

This module holds only the registry and imports no method module: the package :mod:`attnlens.methods` imports
the built-in method modules (which register themselves here), so whichever module is imported first, the
registry is complete once ``attnlens.methods`` is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError, ModelError, UnknownMethodError
from ..lrp.patch import check_supported

# What a method can ask the shared pass for. The pass keeps only what the requested methods declare.
ATTENTION = "attention"  # every layer's whole attention maps of the chosen stream (B, H, Q, K)
ATTENTION_ROWS = "attention_rows"  # every layer's attention rows at the explained queries only (B, H, R, K)
ATTENTION_RECEIVED = "attention_received"  # per layer, the attention each key receives: mean over heads and real
# queries (B, K), reduced during the forward (no gradient)
ATTENTION_MEANS = "attention_means"  # every layer's whole map, mean over heads (B, Q, K), reduced during the forward
# (no gradient): a head count fewer N x N maps than ATTENTION, and fused attention elsewhere
ATTENTION_CHUNKS = "attention_chunks"  # every layer's whole maps (and, with GRADIENTS, their gradients) read in chunks
# of query rows (Capture.map_chunks): recomputed from each layer's queries and keys under fused attention, nothing
# N x N kept; the whole maps where the pass runs eager attention
HIDDEN = "hidden"  # hidden states aligned with the attention keys
EMBEDDINGS = "embeddings"  # output of the input-embedding module (token space)
GRADIENTS = "gradients"  # gradients of the target w.r.t. the tensors above that the method declares (a backward)
OWN_PASS = "own_pass"  # the method runs its own computation from ctx (not the shared capture)
# the method rebuilds one layer's graph at a time from the kept hidden states and takes its backward there
# (DecompX's linearised layers): a backward's activations of one layer beside what the pass keeps
LAYER_GRAPH = "layer_graph"
# Tensors the shared pass can keep (attnlens.core.capture.run_capture). A new kind, e.g. the value vectors of each
# layer, is one constant here plus one recorder there (a forward hook on the layer's value projection).
# Tasks whose explained scalar the LRP pass can take from the head: a class logit; a token's logit at a position
# (a token classifier's, a causal or seq2seq LM's); an answer span's start + end logits (extractive QA).
LRP_TASKS = frozenset({"classification", "causal-lm", "seq2seq-lm", "token", "qa"})
CAPTURED = frozenset({ATTENTION, ATTENTION_ROWS, ATTENTION_RECEIVED, ATTENTION_MEANS, ATTENTION_CHUNKS, HIDDEN,
                      EMBEDDINGS})
# what the backward can reach
DIFFERENTIABLE = frozenset({ATTENTION, ATTENTION_ROWS, ATTENTION_CHUNKS, HIDDEN, EMBEDDINGS})
NEEDS = CAPTURED | {GRADIENTS, OWN_PASS, LAYER_GRAPH}
SPACES = ("keys", "tokens")  # what the last axis of a MethodOutput's scores runs over


@dataclass
class MethodOutput:
    """Scores of one method for a whole batch.

    ``scores`` is ``(B, K)`` and ``layers`` ``(B, L, K)`` (or ``None``). ``space`` says whether the last axis is the
    attention stream's key positions (``"keys"``, mapped to input tokens by the engine) or input tokens
    (``"tokens"``). The engine zeroes padding afterwards, so methods need not. ``meta``: per-input figures
    (tensors of shape ``(B,)``, e.g. integrated gradients' completeness gap), stored in each explanation's meta
    under the method's id.
    """

    scores: torch.Tensor
    layers: torch.Tensor | None = None
    space: str = "keys"
    meta: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class Method:
    """A registered explanation method."""

    name: str
    compute: Callable[..., MethodOutput]
    needs: frozenset[str]
    summary: str
    citation: str
    class_specific: bool = True
    self_attention_only: bool = False
    lrp: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    # runs passes in proportion to the input's length (value zeroing: every layer once per token)
    per_token_passes: bool = False
    # runs many forward passes per input (samples, integration steps, one per token): long enough to show progress
    many_passes: bool = False
    # hidden-size vectors per token it holds for each step of a generation explained in one batch (integrated
    # gradients: each step's gradient sums), beside its passes
    step_vectors: int = 0
    # why the method cannot explain a model (model, stream, task) -> reason or None, beyond the checks below
    applies: Callable[[Any, str, str], str | None] | None = None
    # the captured tensors whose gradients it reads, when not all differentiable ones (AttCAT: hidden states only)
    differentiate: frozenset[str] | None = None
    # explains logits only (target_kind="logit"; a whole answer's log-probabilities too, token by token)
    logits_only: bool = False
    # an own-pass method whose pass's forward computes the model's outputs on the batch's inputs: ``forward(ctx)``
    # runs (or finds) that pass and returns them (or None: it cannot), so that a batch that needs nothing else of
    # the shared pass runs no forward of its own (the engine builds the capture from them)
    forward: Callable[[Any], Any] | None = None
    # checks the values of the options that need no model (types, choices, ranges): ``check(**options)`` with
    # every option given, defaults included, raising :class:`InputError`; run before any model loads
    check: Callable[..., None] | None = None
    # why the method with these option values (defaults included) cannot explain such a model:
    # ``fits(model, stream, task, options)`` -> reason or None; judged once the model is known, before any pass
    fits: Callable[[Any, str, str, Mapping[str, Any]], str | None] | None = None
    # bytes one input of ``n`` tokens needs beside the shared pass in work the method does itself (a pass over
    # every stream of an encoder-decoder, a graph): ``own_memory(model, stream, n)`` (0 where none), so the
    # budget is judged with it before any pass runs
    own_memory: Callable[[Any, str, int], int] | None = None
    # the work of an own-pass method on one input of ``n`` tokens, in forward+backward passes of the model over it:
    # ``passes(model, n, options)`` (the progress bar's plan); ``None``: its ``n_steps`` option, or one pass
    passes: Callable[[Any, int, Mapping[str, Any]], float] | None = None

    @property
    def captured(self) -> frozenset[str]:
        """The tensors of the shared pass this method reads."""
        return self.needs & CAPTURED

    @property
    def differentiated(self) -> frozenset[str]:
        """The captured tensors whose gradients this method reads."""
        if GRADIENTS not in self.needs:
            return frozenset()
        return self.differentiate if self.differentiate is not None else self.captured & DIFFERENTIABLE

    def unsupported_kind(self, target_kind: str, answer: bool = False) -> str | None:
        """Why this method cannot explain ``target_kind`` (of a whole answer with ``answer``), or ``None``."""
        if self.logits_only and target_kind != "logit" and not (answer and target_kind == "loss"):
            return f"{self.name} decomposes the logits; target_kind={target_kind!r} is not supported"
        return None

    def unsupported(self, model: Any, stream: str, task: str) -> str | None:
        """Why this method cannot explain ``model`` (with this attention stream and task), or ``None``."""
        if self.self_attention_only and stream == "cross":
            return f"{self.name} needs self-attention; it is not defined for attention='cross'"
        if self.lrp:
            if task not in LRP_TASKS:
                return (f"{self.name} supports sequence and token classifiers, extractive QA and language models, "
                        f"not {task} models")
            try:
                check_supported(model)
            except ModelError as exc:
                return str(exc)
        why = self.applies(model, stream, task) if self.applies is not None else None
        if why is None and task == "seq2seq-lm" and stream == "decoder":  # scores over the continuation
            if EMBEDDINGS in self.needs:
                return (f"{self.name} attributes to the encoder's input embeddings, not to the decoder stream's "
                        "tokens: use attention='encoder' or 'cross' for it")
            if OWN_PASS in self.needs:
                return (f"{self.name} runs passes of its own, which are not defined on a seq2seq language model's "
                        "decoder stream: use attention='encoder' or 'cross' for it")
        return why

    def unsupported_options(self, model: Any, stream: str, task: str, options: Mapping[str, Any]) -> str | None:
        """Why this method, with ``options`` (checked, defaults included), cannot explain ``model`` (with this
        attention stream and task), or ``None``."""
        return self.fits(model, stream, task, options) if self.fits is not None else None

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Defaults merged with ``options``; unknown option names, and values the method's ``check`` refuses
        (those that need no model to be judged), raise :class:`InputError`."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            allowed = ", ".join(f"{k}={v!r}" for k, v in self.options.items()) or "none"
            raise InputError(f"method {self.name!r} has no option {', '.join(unknown)}; its options: {allowed}")
        merged = {**self.options, **options}
        if self.check is not None:
            self.check(**merged)
        return merged


_REGISTRY: dict[str, Method] = {}


def register(
    name: str,
    *,
    needs: set[str] | frozenset[str],
    summary: str,
    citation: str,
    class_specific: bool = True,
    self_attention_only: bool = False,
    lrp: bool = False,
    applies: Callable[[Any, str, str], str | None] | None = None,
    per_token_passes: bool = False,
    many_passes: bool = False,
    step_vectors: int = 0,
    differentiate: set[str] | frozenset[str] | None = None,
    logits_only: bool = False,
    forward: Callable[[Any], Any] | None = None,
    check: Callable[..., None] | None = None,
    fits: Callable[[Any, str, str, Mapping[str, Any]], str | None] | None = None,
    own_memory: Callable[[Any, str, int], int] | None = None,
    passes: Callable[[Any, int, Mapping[str, Any]], float] | None = None,
) -> Callable[[Callable[..., MethodOutput]], Callable[..., MethodOutput]]:
    """Decorator that adds ``compute`` to the registry under ``name``.

    ``compute(ctx, **options)`` gets the batch's :class:`~attnlens.core.batch_state.BatchContext` and returns a
    :class:`MethodOutput` of the whole batch (checked: a result that does not fit the batch, or an exception from
    a method defined outside attnlens, is one :class:`~attnlens.MethodError` line that names it). ``name`` is
    how users request it (no commas or spaces; not ``"all"``); registering a name again is refused unless it is
    the same function again (a notebook cell run twice replaces it). ``needs``: what the shared pass keeps for
    it, from :mod:`attnlens.methods.registry` (``ATTENTION``, ``ATTENTION_ROWS``, ``ATTENTION_RECEIVED``,
    ``ATTENTION_MEANS``, ``ATTENTION_CHUNKS``, ``HIDDEN``, ``EMBEDDINGS``, ``GRADIENTS``, ``LAYER_GRAPH``; or
    ``OWN_PASS`` for a method that runs passes of its own; docs/architecture.md says what each keeps).
    ``summary`` and ``citation``: one line each, shown by ``list_methods`` and the explorer.
    ``class_specific=False``: the scores do not depend on the explained target (raw attention), so a contrast is
    refused. ``self_attention_only``: it reads one self-attention stream (an encoder-decoder's cross stream is
    refused). ``lrp``: it runs an LRP pass (``attnlens.lrp``).

    ``applies(model, stream, task)`` returns why the method cannot explain such a model (``None``: it can); a
    request for ``"all"`` skips the method there, a named request raises the reason as an :class:`InputError`.

    The method's options and their defaults are the keyword arguments of ``compute`` after ``ctx`` (written once,
    in its signature). ``differentiate``: the captured tensors whose gradients it reads, when that is not every
    differentiable one it declares. ``logits_only``: it explains logits (``target_kind="logit"``), and a whole
    answer's log-probabilities. ``forward(ctx)``: for an ``OWN_PASS`` method whose pass runs the model on the
    batch's inputs as they are, that pass's model outputs (see :attr:`Method.forward`). ``check(**options)``:
    refuses option values that need no model to be judged (a type, a choice, a range) with an
    :class:`InputError`, so a command line fails on them before it loads a model; the method may check them again.
    ``fits(model, stream, task, options)``: why option values that depend on the model (a variant a pre-LN layer
    lacks, a layer index past its depth) cannot explain it, raised as an :class:`InputError` before any pass runs.
    ``own_memory(model, stream, n)``: the bytes per input of ``n`` tokens the method holds beside the shared pass
    in work of its own (DecompX's pass over every stream of an encoder-decoder, attention flow's graph; 0 where
    none), counted in the budget before any pass runs. ``many_passes``: it runs many forward passes per input
    (samples, integration steps; ``per_token_passes`` implies it), so a command shows its progress.
    ``step_vectors``: hidden-size vectors per token it holds beside its passes for each step of a generation it
    explains in one batch (counted in the budget). ``passes(model, n, options)``: for an ``OWN_PASS`` method, its
    work on one input of ``n`` tokens in forward+backward passes of the model over it (the progress bar's plan;
    default: its ``n_steps`` option, or one).
    """
    if not isinstance(name, str) or not name or name == "all" or any(c in name for c in ", \t\n"):
        raise ValueError(f"a method's name is a non-empty string without commas or spaces, other than 'all' (which "
                         f"requests every method); got {name!r}")
    if forward is not None and OWN_PASS not in needs:
        raise ValueError(f"method {name!r}: forward= is for methods that run their own pass (OWN_PASS)")
    if passes is not None and OWN_PASS not in needs:
        raise ValueError(f"method {name!r}: passes= is for methods that run their own pass (OWN_PASS)")
    bad = set(needs) - NEEDS
    if bad:
        raise ValueError(f"unknown needs {bad}; known: {sorted(NEEDS)}")
    if GRADIENTS in needs and not set(needs) & DIFFERENTIABLE:
        raise ValueError(f"method {name!r}: GRADIENTS of what? declare some of {sorted(DIFFERENTIABLE)}")
    if differentiate is not None and not set(differentiate) <= set(needs) & DIFFERENTIABLE:
        raise ValueError(f"method {name!r}: differentiate={sorted(differentiate)} must be among its "
                         "differentiable needs")

    def deco(compute: Callable[..., MethodOutput]) -> Callable[..., MethodOutput]:
        old = _REGISTRY.get(name)
        if old is not None and _origin(old.compute) != _origin(compute):  # the same function again: a notebook
            raise ValueError(f"method {name!r} is registered twice")    # cell run again replaces it
        _REGISTRY[name] = Method(
            name=name,
            compute=compute,
            needs=frozenset(needs),
            summary=summary,
            citation=citation,
            class_specific=class_specific,
            self_attention_only=self_attention_only,
            lrp=lrp,
            options=_option_defaults(name, compute),
            applies=applies,
            per_token_passes=per_token_passes,
            many_passes=many_passes or per_token_passes,
            step_vectors=step_vectors,
            differentiate=None if differentiate is None else frozenset(differentiate),
            logits_only=logits_only,
            forward=forward,
            check=check,
            fits=fits,
            own_memory=own_memory,
            passes=passes,
        )
        return compute

    return deco


def check_flag(method: str, name: str, value: object, none: bool = False) -> None:
    """An :class:`InputError` unless option ``name`` of ``method`` is True or False (with ``none``: or None)."""
    if not isinstance(value, bool) and not (none and value is None):
        raise InputError(f"{method} {name} must be True or False{' or None' if none else ''}, got {value!r}")


def check_integer(method: str, name: str, value: object, minimum: int | None = None, none: bool = False) -> None:
    """An :class:`InputError` unless option ``name`` of ``method`` is an integer (a bool is not), at least
    ``minimum`` where given (with ``none``: or None)."""
    if none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise InputError(f"{method} {name} must be an integer{bound}, got {value!r}")


def _origin(compute: Callable[..., Any]) -> tuple[str, str]:
    """Where a method's function was defined (its module and qualified name)."""
    return getattr(compute, "__module__", ""), getattr(compute, "__qualname__", repr(compute))


def _option_defaults(name: str, compute: Callable[..., MethodOutput]) -> dict[str, Any]:
    """``{option: default}`` from the parameters of ``compute`` after the first (the batch context)."""
    every = list(inspect.signature(compute).parameters.values())
    if not every or every[0].kind not in (every[0].POSITIONAL_ONLY, every[0].POSITIONAL_OR_KEYWORD):
        raise ValueError(f"method {name!r}: its function takes the batch context first (def {name}(ctx, ...))")
    params = every[1:]
    for p in params:
        if p.default is inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise ValueError(f"method {name!r}: option {p.name!r} needs a default value and a name")
    return {p.name: p.default for p in params}


def capture_request(methods: Iterable[Method]) -> tuple[frozenset[str], frozenset[str]]:
    """What the shared pass must keep for ``methods``, and of which of those it takes gradients."""
    methods = list(methods)
    keep = frozenset().union(*(m.captured for m in methods))
    return keep, frozenset().union(*(m.differentiated for m in methods))


def check_option_owners(options: Iterable[str], requested: Iterable[str],
                        among: str = "the requested methods") -> None:
    """An :class:`InputError` (one line) for the first method ``options`` holds options for that is not one of
    ``requested``: options are never silently dropped."""
    requested = set(requested)
    for name in options:
        if name not in requested:
            raise InputError(f"options given for {name!r}, which is not among {among}")


def get_method(name: str) -> Method:
    """The registered method ``name``; an unknown id raises an error that lists the available ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(
            f"unknown method {name!r}; available methods: {', '.join(list_methods())}"
        ) from None


def list_methods(*, include_lrp: bool = True) -> list[str]:
    """Ids of all registered methods, in registration order."""
    return [m for m, spec in _REGISTRY.items() if include_lrp or not spec.lrp]


def resolve_methods(methods: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Turn ``"all"``, ``None``, a comma-separated string or a list into a checked list of method ids."""
    if methods is None or methods == "all":
        return list_methods()
    if isinstance(methods, str):
        methods = [m.strip() for m in methods.split(",") if m.strip()]
    elif not isinstance(methods, (list, tuple)) or not all(isinstance(m, str) for m in methods):
        raise InputError(
            f"methods must be 'all', a comma-separated string or a list of method ids, got {methods!r:.80}"
        )
    if not methods:
        raise InputError(f"no methods given; available methods: {', '.join(list_methods())}")
    out: list[str] = []
    for m in methods:
        if m == "all":
            out.extend(x for x in list_methods() if x not in out)
            continue
        get_method(m)
        if m not in out:
            out.append(m)
    return out

