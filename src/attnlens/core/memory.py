"""Memory budgets: parse ``"4GB"``, estimate what a pass over a padded batch holds, and size batches to fit.

The estimates are per *row* (one padded sequence of ``n`` tokens) of an eager-attention Transformer: a
forward + backward keeps, per layer, about ``ACTIVATION_VECTORS`` vectors of the hidden size per token (inputs
of the linear layers, layer norms, the feed-forward's wide activations) and ``ATTENTION_MAPS`` ``n × n`` maps per
head (scores, probabilities, dropout/softmax backward); the shared pass also keeps the captured attention maps,
hidden states and their gradients. The constants were fitted to peak RSS measured with ``bench/memory.py`` on
minilm-sst2 (32–512 tokens) and round up, so a budget is an upper bound in practice rather than an exact one.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

DEFAULT_BUDGET = 4 * 2**30  # bytes: what explain() plans for when no memory_budget is given
ACTIVATION_VECTORS = 24  # hidden-size vectors per token and layer held for a backward pass
ATTENTION_MAPS = 4  # n x n maps per head and layer held for a backward pass
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_budget(value: str | int | float | None) -> int:
    """Bytes of a memory budget: an int/float of bytes or a string such as ``"4GB"``, ``"512 MiB"``, ``"1.5g"``.

    ``None`` is :data:`DEFAULT_BUDGET`. Anything else, or less than 64 MiB, is an :class:`InputError`.
    """
    if value is None:
        return DEFAULT_BUDGET
    if isinstance(value, bool):
        raise InputError(f"memory budget must be a size such as '4GB', got {value!r}")
    if isinstance(value, (int, float)):
        size = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise InputError(f"memory budget {value!r}: give a size such as '4GB', '512MiB' or a number of bytes")
        size = float(m.group(1)) * _UNITS[unit]
    else:
        raise InputError(f"memory budget must be a size such as '4GB', got {value!r:.60}")
    if not size >= 64 * 2**20:
        raise InputError(f"memory budget {value!r} is below 64 MiB; attnlens needs at least that for one input")
    return int(size)


@dataclass(frozen=True)
class Dims:
    """What the estimates read from a model: layers (encoder + decoder), heads, hidden size, bytes per value."""

    layers: int
    heads: int
    hidden: int
    itemsize: int = 4


def model_dims(model: Any) -> Dims:
    """Layers, heads and hidden size from the model's config (HF attribute maps cover GPT-2's and BART's names);
    parameters' element size for the dtype. Unknown configs get BERT-base sizes (an overestimate for small
    models)."""
    cfg = getattr(model, "config", None)

    def get(*names: str) -> int:
        return next((int(getattr(cfg, n)) for n in names if isinstance(getattr(cfg, n, None), int)), 0)

    layers = get("num_hidden_layers", "n_layer", "num_layers") or 12
    layers += get("decoder_layers") if getattr(cfg, "is_encoder_decoder", False) else 0
    heads = get("num_attention_heads", "n_head") or 12
    hidden = get("hidden_size", "d_model", "n_embd", "dim") or 768
    try:
        itemsize = next(model.parameters()).element_size()
    except (AttributeError, StopIteration, TypeError):
        itemsize = 4
    return Dims(layers, heads, hidden, itemsize)


def backward_row_bytes(dims: Dims, n: int) -> int:
    """Bytes a forward + backward holds for one row of ``n`` tokens (integrated gradients' unit of work)."""
    per_layer = ACTIVATION_VECTORS * n * dims.hidden + ATTENTION_MAPS * dims.heads * n * n
    return dims.layers * per_layer * dims.itemsize


def forward_row_bytes(dims: Dims, n: int) -> int:
    """Bytes a forward without gradients holds for one row of ``n`` tokens (perturbation methods' unit of
    work): each layer's activations are freed once the next layer has read them, so about two layers' worth."""
    return 2 * backward_row_bytes(dims, n) // max(1, dims.layers)


def shared_pass_row_bytes(dims: Dims, n: int) -> int:
    """Bytes the shared pass holds for one row: a forward + backward, plus the captured attention maps and
    hidden states with their gradients (kept until the methods have read them)."""
    kept = 2 * dims.layers * (dims.heads * n * n + n * dims.hidden)
    return backward_row_bytes(dims, n) + kept * dims.itemsize


def step_gradient_bytes(dims: Dims, n: int) -> int:
    """Bytes each further step adds to a batch of generation steps that share one forward over their ``n``-token
    sequence: its own gradients of every layer's attention maps and hidden states (the forward and its
    activations are shared). With :func:`shared_pass_row_bytes` for the first step this matched peak RSS on
    SmolLM2 (408 tokens, 1, 4 and 8 steps per batch: estimates 1.8, 2.4, 3.3 GB; measured 1.7, 2.7, 3.3 GB)."""
    return dims.layers * (dims.heads * n * n + n * dims.hidden) * dims.itemsize


def warn_when_one_row_exceeds(dims: Dims, n: int, budget: int, what: str = "an input", alone: str = "it runs alone",
                              stacklevel: int = 3) -> None:
    """Warn once that ``what`` (an input, a generation) of ``n`` tokens needs more than ``budget`` for its
    shared pass on its own (a sequence cannot be split: ``alone`` says what happens instead)."""
    need = shared_pass_row_bytes(dims, n)
    if need > budget:
        warnings.warn(
            f"{what} of {n} tokens needs about {need / 2**30:.1f} GiB for its forward+backward pass with the "
            f"attention maps kept, more than the memory budget of {budget / 2**30:.1f} GiB; {alone} (a shorter "
            "input, or methods without gradients, need less)", stacklevel=stacklevel + 1)


def rows_that_fit(budget: int, row_bytes: int, cap: int | None = None) -> int:
    """How many rows of ``row_bytes`` fit in ``budget`` (at least 1, at most ``cap``)."""
    rows = max(1, budget // max(1, row_bytes))
    return min(rows, cap) if cap is not None else rows


def budget_chunks(
    lengths: Sequence[int], batch_size: int, budget: int, row_bytes: Callable[[int], int]
) -> Iterator[list[int]]:
    """Indices shortest first, in batches of at most ``batch_size`` whose padded rows fit ``budget``.

    Short inputs keep the full ``batch_size``; long ones go in smaller batches (one at least), so memory follows
    the sequence length instead of a fixed count.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunk: list[int] = []
    for i in order:
        # sorted: the newcomer is the longest, so it sets the padded length of the chunk
        if chunk and (len(chunk) >= batch_size or (len(chunk) + 1) * row_bytes(lengths[i]) > budget):
            yield chunk
            chunk = []
        chunk.append(i)
    if chunk:
        yield chunk
