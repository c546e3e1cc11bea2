"""Perturbed inputs built on token ids (never by decoding and re-tokenizing), and batched scoring of them.

A :class:`Variant` is an immutable, hashable model input: token ids, optional token type ids and an optional
attention mask. Equal variants are equal keys, so a perturbation that several methods or metrics ask for (the
unperturbed input, "delete everything", the same top-k set) is scored once.

Three ways to take tokens out (``mode``):

- ``"delete"``: remove the positions; the sequence gets shorter (AOPC, ERASER comprehensiveness/sufficiency).
- ``"pad"``: replace the ids with the pad id and keep them attended (LOdds; AttCAT's code passes no mask).
- ``"mask"``: keep the ids but set their attention mask to 0 (the occlusion of Karpekov & Miller 2023).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..core.batching import batch_groups, pad_batch, predict_batches, scoring_chunks
from ..core.memory import DEFAULT_BUDGET
from ..core.modelstate import EAGER, explaining, without_cache
from ..errors import InputError
from ..models.architectures import finds_last_token_by_padding

MODES = ("delete", "pad", "mask")


@dataclass(frozen=True)
class Variant:
    """One model input as ids: ``attention_mask`` ``None`` means every token is attended."""

    input_ids: tuple[int, ...]
    token_type_ids: tuple[int, ...] | None = None
    attention_mask: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @classmethod
    def of(cls, input_ids: Sequence[int], token_type_ids: Sequence[int] | None = None) -> Variant:
        """A variant from (lists of) ids."""
        if token_type_ids is not None and len(token_type_ids) != len(input_ids):
            raise InputError("token_type_ids must have one entry per input id")
        return cls(tuple(int(i) for i in input_ids), None if token_type_ids is None else tuple(token_type_ids))

    def present(self) -> list[int]:
        """Ids the model can see: not deleted and not masked out."""
        if self.attention_mask is None:
            return list(self.input_ids)
        return [i for i, m in zip(self.input_ids, self.attention_mask) if m]


def perturb(base: Variant, positions: Iterable[int], mode: str, pad_token_id: int | None = None) -> Variant:
    """``base`` with ``positions`` taken out by ``mode`` (``delete``, ``pad`` or ``mask``)."""
    drop = set(int(p) for p in positions)
    if not drop:
        return base
    n = len(base.input_ids)
    if min(drop) < 0 or max(drop) >= n:
        raise InputError(f"perturbation position out of range 0..{n - 1}")
    if mode == "delete":
        keep = [i for i in range(n) if i not in drop]
        return Variant(
            tuple(base.input_ids[i] for i in keep),
            None if base.token_type_ids is None else tuple(base.token_type_ids[i] for i in keep),
            None if base.attention_mask is None else tuple(base.attention_mask[i] for i in keep),
        )
    if mode == "pad":
        if pad_token_id is None:
            raise InputError("replacing tokens by padding needs a tokenizer with a pad token")
        ids = tuple(pad_token_id if i in drop else t for i, t in enumerate(base.input_ids))
        return Variant(ids, base.token_type_ids, base.attention_mask)
    if mode == "mask":
        mask = base.attention_mask or (1,) * n
        return Variant(base.input_ids, base.token_type_ids, tuple(0 if i in drop else m for i, m in enumerate(mask)))
    raise InputError(f"unknown perturbation mode {mode!r}; choose one of {', '.join(MODES)}")


# A predictor maps variants to class probabilities (n, C). Metrics only ever see this callable.
Predict = Callable[[Sequence[Variant]], np.ndarray]


def predict_cached(predict: Predict, variants: Sequence[Variant], cache: dict[Variant, np.ndarray]) -> None:
    """Score the variants not yet in ``cache`` (each distinct one once) and add them to it."""
    todo = list(dict.fromkeys(v for v in variants if v not in cache))
    if not todo:
        return
    probs = np.asarray(predict(todo), dtype=np.float64)
    if probs.ndim != 2 or probs.shape[0] != len(todo):
        raise ValueError(f"predict returned shape {probs.shape} for {len(todo)} inputs; expected (n, n_classes)")
    for v, p in zip(todo, probs):
        cache[v] = p


class ModelPredictor:
    """Batched, length-sorted, ``no_grad`` scoring of variants with a HuggingFace classifier.

    Args:
        model: a ``*ForSequenceClassification`` model of any family. While scoring it is put in eval mode and,
            with ``fast_attention``, switched to PyTorch's SDPA attention (no attention probabilities are needed
            here); both are restored afterwards.
        pad_token_id: id used to right-pad batches (padding is never attended).
        batch_size: variants per forward pass at most.
        fast_attention: use SDPA while scoring when the model supports it (same results, ~20% faster on CPU).
        memory_budget: bytes a forward pass plans for: long variants go in batches of fewer than ``batch_size``
            (:func:`~attnlens.core.batching.scoring_chunks`).
    """

    def __init__(
        self, model: torch.nn.Module, pad_token_id: int | None, batch_size: int = 64, fast_attention: bool = True,
        memory_budget: int = DEFAULT_BUDGET,
    ) -> None:
        self.model, self.memory_budget = model, memory_budget
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        # a decoder head without a pad id cannot read padded rows: one variant per forward pass
        self.batch_size = 1 if finds_last_token_by_padding(model) else max(1, int(batch_size))
        self.fast_attention = fast_attention
        self.takes_token_types = "token_type_ids" in inspect.signature(model.forward).parameters

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _batches(self, variants: Sequence[Variant]) -> Iterable[tuple[list[int], dict[str, torch.Tensor]]]:
        """Batches of variants with every layer's hidden states kept, within the budget."""
        for idx in scoring_chunks(self.model, [len(v) for v in variants], self.batch_size, self.memory_budget,
                                  attention=self._attention, hidden=True,
                                  groups=batch_groups(self.model, [v.input_ids for v in variants])):
            chosen = [variants[i] for i in idx]
            with_types = self.takes_token_types and all(v.token_type_ids is not None for v in chosen)
            inputs, _ = pad_batch(
                [v.input_ids for v in chosen], self.pad_token_id, self.device,
                type_ids=[v.token_type_ids for v in chosen], masks=[v.attention_mask for v in chosen],
                with_types=with_types,
            )
            yield idx, inputs

    @property
    def _attention(self) -> str:
        return "sdpa" if self.fast_attention else EAGER

    @contextmanager
    def _scoring(self) -> Iterator[None]:
        with explaining(self.model, self._attention), torch.no_grad():
            yield

    def __call__(self, variants: Sequence[Variant]) -> np.ndarray:
        """Softmax probabilities ``(len(variants), n_classes)`` in input order."""
        return predict_batches(
            self.model, [v.input_ids for v in variants], self.pad_token_id, self.batch_size,
            type_ids=[v.token_type_ids for v in variants], masks=[v.attention_mask for v in variants],
            with_types=None if self.takes_token_types else False, attention=self._attention,
            memory_budget=self.memory_budget,
        )

    def hidden_states(self, variants: Sequence[Variant], positions: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Last-layer hidden states ``(len(positions[i]), D)`` of the given token positions of each variant.

        For encoder-decoder models the encoder's last layer is used (its positions are the input tokens).
        """
        out: list[np.ndarray] = [np.zeros((0, 0), dtype=np.float32)] * len(variants)
        with self._scoring():
            for idx, inputs in self._batches(variants):
                res = self.model(**inputs, output_hidden_states=True, **without_cache(self.model))
                states = getattr(res, "encoder_hidden_states", None) or res.hidden_states
                last = states[-1].float().cpu().numpy()
                for r, i in enumerate(idx):
                    out[i] = last[r, list(positions[i])].astype(np.float32)
        return out
