"""Every layer's and head's whole attention maps of one input, for the head and model views, within the memory
budget.

The views show what no method keeps on a long input: ``layers × heads × N × N`` probabilities (SmolLM2-135M at
4,096 tokens: 17 GiB in float32). They are planned like an explanation's passes: what the eager forward holds with
every map kept, or the float32 array handed back and what its caller holds beside it (the page of
:func:`attnlens.viz.headview.attention_view_html`: :func:`~attnlens.viz.headview.page_bytes`); where that exceeds
the budget the view is refused in one line, with the longest input that fits, before the model runs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..errors import InputError
from ..methods.registry import ATTENTION
from .allocator import for_budget_share
from .capture import run_capture
from .memory import Storage, longest_that_fits, model_dims, pass_row_bytes, readable_size
from .model_runner import ModelRunner
from .modelstate import explaining

_WHOLE_MAPS = Storage(eager=True, maps=True)  # an eager forward keeping every layer's maps
# what a caller holds beside the maps it asked for, in bytes, by (layers, heads, tokens): a page encoding them
Beside = Callable[[int, int, int], int]


def attention_view_bytes(model: torch.nn.Module, n: int, beside: Beside | None = None) -> int:
    """Bytes the maps of one input of ``n`` tokens take at their peak: the eager forward keeping every layer's
    maps, or the float32 array of them and what the caller holds beside it (``beside``: e.g.
    :func:`attnlens.viz.headview.page_bytes`), the larger."""
    dims = model_dims(model)
    maps = dims.maps * dims.heads * n * n
    after = 4 * maps + (0 if beside is None else beside(dims.maps, dims.heads, n))
    return max(pass_row_bytes(dims, n, _WHOLE_MAPS), after)


def check_attention_view(model: torch.nn.Module, n: int, budget: int, beside: Beside | None = None) -> int:
    """The bytes the maps of ``n`` tokens take (:func:`attention_view_bytes`), or an :class:`InputError` (one
    line, with the longest input that fits) where that is more than ``budget``."""
    need = attention_view_bytes(model, n, beside)
    if need > budget:
        fits = longest_that_fits(budget, lambda m: attention_view_bytes(model, m, beside))
        raise InputError(f"the attention view keeps every layer's and head's whole maps: {n:,} tokens need about "
                         f"{readable_size(need)}, more than the memory budget of {readable_size(budget)}; it "
                         f"fits up to {fits:,} tokens (shorten the input or raise --memory-budget / "
                         "memory_budget=)")
    return need


def whole_attention_maps(runner: ModelRunner, inputs: dict[str, torch.Tensor], token_mask: torch.Tensor,
                         budget: int, beside: Beside | None = None) -> np.ndarray:
    """``(L, H, Q, K)`` float32 attention probabilities of the explained stream of the one input in ``inputs``,
    each layer's maps moved into the array and dropped from the pass as it goes; an :class:`InputError` (one
    line) before the pass where they, and what the caller will hold beside them (``beside``), do not fit
    ``budget`` bytes."""
    for_budget_share(check_attention_view(runner.model, token_mask.shape[1], budget, beside), budget)
    with explaining(runner.model):
        capture, _ = run_capture(runner.model, runner.adapter, inputs, token_mask, runner.stream, None, "logit",
                                 gradients=False, head=runner.head, keep={ATTENTION})
    layers = capture.attentions
    first = layers[0][0]
    out = np.empty((len(layers), *first.shape), dtype=np.float32)
    for i in range(len(layers)):
        out[i] = layers[i][0].float().cpu().numpy()
        layers[i] = None  # the pass's copy of this layer goes as soon as the array holds it
    return out
