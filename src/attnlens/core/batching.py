"""Length-sorted, right-padded batches of token-id sequences: the one place where attnlens pads inputs, and the
one batched scorer of token-id sequences (:func:`predict_batches`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from .allocator import for_long_inputs
from .memory import DEFAULT_BUDGET, Storage, budget_chunks, model_dims, pass_row_bytes
from .modelstate import EAGER, attention_implementation, explaining, runs_sdpa, without_cache


def eos_groups(model: nn.Module, ids: Sequence[Sequence[int]]) -> list[int] | None:
    """For an encoder-decoder classifier (BART, T5, ...), whose head reads each row's last EOS and requires every
    row of a batch to hold the same number of them (a sentence pair holds more than a single text): each
    sequence's count, which a batch must not mix; ``None`` for other models."""
    config = model.config
    if not getattr(config, "is_encoder_decoder", False) or not type(model).__name__.endswith(
            "ForSequenceClassification"):
        return None
    eos = getattr(config, "eos_token_id", None)
    return [sum(1 for t in seq if t == eos) for seq in ids]


def attention_window(config: object) -> int | None:
    """The shortest window, in tokens, of a model that attends within windows (a sliding window: Mistral, Qwen2,
    Gemma 2, Phi-3; ModernBERT's local attention; GPT-Neo's local layers); ``None`` for full attention."""
    sizes = [getattr(config, name, None) for name in ("local_attention", "window_size")]
    if getattr(config, "use_sliding_window", True) is not False:  # Qwen2 names a window it may leave unused
        sizes.append(getattr(config, "sliding_window", None))
    sizes = [v for v in sizes if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(sizes) if sizes else None


def batch_groups(model: nn.Module, ids: Sequence[Sequence[int]]) -> list[tuple[int, int]] | None:
    """Keys of the sequences ``ids`` no batch may mix (``budget_chunks``' ``groups``); ``None`` where any may share a
    batch. An encoder-decoder classifier's EOS count (:func:`eos_groups`), and, for a float64 model that attends
    within windows, lengths half a window or more apart: the shorter one's padding would fill a padded query's whole
    window, and transformers' eager attention, which takes the softmax in float32, turns the float64 mask into
    ``-inf`` and such a row into NaN, which the next layer carries into the real rows (0 × NaN)."""
    eos = eos_groups(model, ids)
    window = attention_window(model.config) if next(model.parameters()).dtype == torch.float64 else None
    if eos is None and window is None:
        return None
    width = max(1, window // 2) if window is not None else None  # a local window reaches half of it each way
    return [(eos[i] if eos is not None else 0, len(seq) // width if width is not None else 0)
            for i, seq in enumerate(ids)]


def scoring_chunks(model: nn.Module, lengths: Sequence[int], batch_size: int, budget: int, *,
                   attention: str | None = "sdpa", logit_positions: int = 0, hidden: bool = False,
                   groups: Sequence[Any] | None = None) -> Iterator[list[int]]:
    """Indices of sequences of ``lengths``, shortest first, in batches of at most ``batch_size`` whose forward
    without gradients fits ``budget`` bytes: one layer's activations at a time, its attention maps where the model
    runs eager (``attention``; ``None``: the implementation the model is set to now, for forwards outside an
    ``explaining()`` block; or it has no fused attention), the logits of ``logit_positions`` positions per row
    (0: all), every layer's hidden states (``hidden``); no batch mixes two ``groups``."""
    implementation = attention if attention is not None else attention_implementation(model) or EAGER
    eager = implementation == EAGER or not runs_sdpa(model)
    storage = Storage(eager=eager, logit_rows=logit_positions, hidden=hidden)
    dims = model_dims(model)
    return budget_chunks(lengths, batch_size, budget, lambda n: pass_row_bytes(dims, n, storage), dims.hidden_bytes,
                         groups)


def pad_batch(
    ids: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device,
    *,
    type_ids: Sequence[Sequence[int] | None] | None = None,
    masks: Sequence[Sequence[int] | None] | None = None,
    with_types: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded model inputs and the ``(B, N)`` mask of real (non-padding) tokens.

    ``masks`` (0/1 per token) hide tokens from attention without deleting them; ``with_types`` adds
    ``token_type_ids`` (zeros where a sequence has none, as tokenizers make for single texts). From
    :data:`~attnlens.core.allocator.LONG_INPUT_TOKENS` tokens on, the C allocator's policy is set for long inputs
    (:func:`~attnlens.core.allocator.for_long_inputs`).
    """
    n = max(len(x) for x in ids)
    for_long_inputs(n)  # long inputs: large blocks back to the system when freed (allocator.py)
    input_ids = torch.full((len(ids), n), int(pad_id), dtype=torch.long)
    token_mask = torch.zeros((len(ids), n), dtype=torch.long)
    for b, seq in enumerate(ids):
        input_ids[b, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        token_mask[b, : len(seq)] = 1
    attention_mask = token_mask.clone()
    for b, m in enumerate(masks or []):
        if m is not None:
            attention_mask[b, : len(m)] = torch.as_tensor(list(m), dtype=torch.long)
    inputs = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    if with_types:
        types = torch.zeros((len(ids), n), dtype=torch.long)
        for b, seq in enumerate(type_ids or []):
            if seq is not None:
                types[b, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        inputs["token_type_ids"] = types.to(device)
    return inputs, token_mask.to(device)


def softmax(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Class probabilities of a single-label classifier's logits."""
    return logits.float().softmax(-1)


def keeps_logits(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes ``logits_to_keep`` (project only some positions onto the vocabulary)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def predict_batches(
    model: nn.Module,
    ids: Sequence[Sequence[int]],
    pad_id: int,
    batch_size: int,
    *,
    type_ids: Sequence[Sequence[int] | None] | None = None,
    masks: Sequence[Sequence[int] | None] | None = None,
    with_types: bool | None = False,
    probabilities: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = softmax,
    attention: str = "sdpa",
    last_only: bool = False,
    memory_budget: int = DEFAULT_BUDGET,
) -> np.ndarray:
    """Probabilities ``(len(ids), C)`` of token-id sequences of any lengths, in input order.

    Length-sorted batches of at most ``batch_size`` that fit ``memory_budget`` bytes (:func:`scoring_chunks`: fewer
    rows as the sequences grow), right-padded with ``pad_id``, under ``torch.no_grad()``, with the
    model in eval mode and its attention set to ``attention`` (SDPA: no attention probabilities are needed), both
    restored afterwards. ``probabilities(logits, attention_mask)`` turns logits into probabilities (softmax by
    default; a head's own rule, e.g. multi-label sigmoids). ``with_types``: pass token types (zeros where a
    sequence has none); ``None``: only in batches where every sequence has them. ``last_only`` (language
    models): ``probabilities`` gets each sequence's ``(B, V)`` logits at its last real position, and where the
    model can (``logits_to_keep``) only the batch's distinct last positions are projected onto the vocabulary.
    No sequences: ``(0, 0)``.
    """
    device = next(model.parameters()).device
    out: np.ndarray | None = None
    keeps = last_only and keeps_logits(model)
    chunks = scoring_chunks(model, [len(x) for x in ids], batch_size, memory_budget, attention=attention,
                            logit_positions=1 if keeps else 0, groups=batch_groups(model, ids))
    with explaining(model, attention), torch.no_grad():
        for idx in chunks:
            types = None if type_ids is None else [type_ids[i] for i in idx]
            batch_types = with_types if with_types is not None else (
                types is not None and all(t is not None for t in types))
            inputs, _ = pad_batch(
                [ids[i] for i in idx], pad_id, device, type_ids=types,
                masks=None if masks is None else [masks[i] for i in idx], with_types=batch_types,
            )
            if last_only:
                mask = inputs["attention_mask"]
                last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # the last attended position (a mask may have holes)
                kept, where = torch.unique(last, return_inverse=True)
                logits = model(**inputs, **({"logits_to_keep": kept} if keeps else {}), **without_cache(model)).logits
                logits = logits[torch.arange(len(last), device=logits.device), where if keeps else last]
            else:
                logits = model(**inputs, **without_cache(model)).logits
            probs = probabilities(logits, inputs["attention_mask"]).float().cpu().numpy()
            if out is None:
                out = np.zeros((len(ids), probs.shape[1]), dtype=np.float64)
            out[idx] = probs
    return out if out is not None else np.zeros((0, 0))
