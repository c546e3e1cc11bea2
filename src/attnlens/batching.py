"""Length-sorted, right-padded batches of token-id sequences: the one place where attnlens pads inputs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def length_sorted_chunks(lengths: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    """Indices of the sequences, shortest first, in chunks of ``batch_size`` (padding stays small)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    for start in range(0, len(order), max(1, int(batch_size))):
        yield order[start : start + batch_size]


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
    ``token_type_ids`` (zeros where a sequence has none, as tokenizers make for single texts).
    """
    n = max(len(x) for x in ids)
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
