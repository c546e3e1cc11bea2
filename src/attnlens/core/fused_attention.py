"""Fused attention (PyTorch's SDPA) that stays memory-efficient for grouped-query models in float32 on a GPU.

transformers' ``"sdpa"`` attention hands grouped-query layers (Llama, Mistral, Qwen: fewer key/value heads than
query heads) to SDPA with ``enable_gqa=True`` whenever no mask is needed. On CUDA in float32 the flash kernel
cannot run (it takes half precision only), and the memory-efficient kernel does not take grouped heads in every
PyTorch release, so SDPA falls back to its math kernel, which materialises every head's ``N × N`` probabilities
and keeps them for the backward: about 26 GiB for one forward + backward of SmolLM2-135M at 4,096 tokens. Where
that can happen, attnlens runs the layers through :func:`sdpa_repeated_heads` instead: the key and value heads are
repeated to the query heads first (``N × d`` per head, as eager attention does), and SDPA is called without
``enable_gqa``, so the memory-efficient kernel takes it. The output is the same function of the same inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .row_attention import dispatches_attention

FUSED = "sdpa"  # transformers' fused attention
FUSED_REPEATED_HEADS = "attnlens_sdpa_repeated_heads"  # registered in transformers' attention interfaces


class _RepeatedHeads:
    """An attention layer as SDPA sees it once its key/value heads are repeated: one group per head."""

    num_key_value_groups = 1

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def sdpa_repeated_heads(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention (same signature and result) with the key/value heads repeated to the query
    heads beforehand, so that SDPA is never asked for grouped-query attention."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    return sdpa_attention_forward(_RepeatedHeads(module), query, key, value, attention_mask, **kwargs)


def _register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(FUSED_REPEATED_HEADS, sdpa_repeated_heads)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FUSED_REPEATED_HEADS, sdpa_mask)
    return FUSED_REPEATED_HEADS


def grouped_query(model: nn.Module) -> bool:
    """Whether some attention layer of ``model`` has fewer key/value heads than query heads."""
    return any(getattr(m, "num_key_value_groups", 1) > 1 for m in model.modules())


def placement(model: nn.Module) -> tuple[str, torch.dtype | None]:
    """The device type and dtype of ``model``'s parameters (``("cpu", None)`` without parameters)."""
    param = next(model.parameters(), None)
    return ("cpu", None) if param is None else (param.device.type, param.dtype)


def weights_dtype(model: nn.Module) -> str | None:
    """The dtype of ``model``'s parameters by name (``"float32"``), as results record it; ``None`` without
    parameters."""
    dtype = placement(model)[1]
    return None if dtype is None else str(dtype).removeprefix("torch.")


def fused_implementation(model: nn.Module) -> str:
    """The attention implementation to run ``model``'s fused passes under: transformers' ``"sdpa"``, or
    :data:`FUSED_REPEATED_HEADS` for a grouped-query model in float32 on CUDA whose layers dispatch through
    transformers' attention interface (elsewhere SDPA's kernels take grouped heads: flash in half precision,
    PyTorch's fused CPU kernel)."""
    device, dtype = placement(model)
    if device != "cuda" or dtype != torch.float32:
        return FUSED
    if not dispatches_attention(model) or not grouped_query(model):
        return FUSED
    return _register()
