"""What a layer's feed-forward keeps for a backward pass, counted on the model's own modules.

The feed-forward is most of what a layer's backward holds per token, and it differs by model more than anything
else there: its width (4× the hidden size in BERT and GPT-2, 2.67× in Llama's gated one), a gate (two wide
projections and their product), and the activation function, which PyTorch runs as one operation that saves its
input (GELU, ReLU, SiLU) or as a few (GPT-2's and Flan-T5's tanh-approximated ``gelu_new`` saves four wide
tensors). Rather than list them, :func:`feed_forward_saved_vectors` runs the first layer's feed-forward, as its
:class:`~attnlens.models.architectures.Anatomy` describes it, on a few tokens and counts what autograd saves.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from ..errors import ModelError
from .architectures import architecture_for
from .layer_modules import feed_forward_modules, run_feed_forward

PROBE_TOKENS = 8  # the probe's length: the count is per token, and linear in the length
# per model: (its hidden size and dtype when counted, the count); weak, so a model is not kept alive by it
_COUNTED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, torch.dtype | None], float | None]] = \
    weakref.WeakKeyDictionary()


def feed_forward_saved_vectors(model: nn.Module, hidden: int, dtype: torch.dtype | None) -> float | None:
    """Hidden-size vectors per token that one layer's feed-forward keeps for a backward pass: its input and the
    wide tensors its projections, gate and activation function save (parameters aside), counted exactly on a
    probe of :data:`PROBE_TOKENS` tokens of width ``hidden`` through the first layer's feed-forward in the model's
    dtype and device. ``dtype``: the model's parameters' (the count is kept per model, and counted again when the
    model is cast).

    ``None`` where it cannot be counted: a type without a layer anatomy, a mixture of experts, weights not
    materialised (the meta device)."""
    key = (hidden, dtype)
    cached = _COUNTED.get(model)
    if cached is None or cached[0] != key:
        cached = _COUNTED[model] = (key, _count(model, hidden))
    return cached[1]


def _count(model: nn.Module, hidden: int) -> float | None:
    try:
        arch = architecture_for(model.config)
    except (ModelError, AttributeError):
        return None
    anatomy = arch.anatomy_for(model.config)
    if arch.layers is None or anatomy is None or anatomy.moe is not None:
        return None
    try:
        block = arch.layers.modules(model, "encoder" if arch.layers.path("encoder") else "self")[0]
        mods = feed_forward_modules(block, anatomy)
        weight = next(block.parameters())
    except (AttributeError, IndexError, ModelError, StopIteration, TypeError):
        return None
    if weight.device.type == "meta":
        return None
    # constant values: the count does not depend on them, and the global random state is left alone
    probe = torch.full((1, PROBE_TOKENS, hidden), 0.5, dtype=weight.dtype, device=weight.device, requires_grad=True)
    try:
        with torch.enable_grad(), saved_storages(block.parameters()) as saved:
            run_feed_forward(mods, probe)
    except (RuntimeError, TypeError, ValueError):  # a feed-forward not called as the anatomy reads it
        return None
    return sum(saved.values()) / (probe.numel() * probe.element_size())


@contextmanager
def saved_storages(parameters: Iterable[torch.Tensor]) -> Iterator[dict[int, int]]:
    """Within the block, the bytes of every distinct storage autograd saves for a backward, by the storage's
    address, ``parameters``' own storages aside: what a backward pass will read beyond the weights."""
    skipped = {p.untyped_storage().data_ptr() for p in parameters}
    saved: dict[int, int] = {}

    held: list[torch.Tensor] = []  # alive as in a real pass, until the block ends: no address is reused

    def pack(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skipped:
            saved[storage.data_ptr()] = storage.nbytes()
        # held here, not by the graph: an operation that saves its own output (tanh, ReLU) would otherwise hold it
        # through its own node, a cycle through autograd that Python's collector cannot free
        held.append(tensor)

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("saved_storages records sizes only; no backward runs through its block")

    try:
        with saved_tensors_hooks(pack, unpack):
            yield saved
    finally:
        held.clear()
