"""What the engines need to run one model: the :class:`ModelRunner` record, which the
:class:`~attnlens.Explainer` builds and passes to :mod:`attnlens.core.engine` and
:mod:`attnlens.core.generation_engine` (so that neither reads an explainer, nor imports one)."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import InputError, ModelError
from ..models.adapters import Adapter
from ..models.architectures import finds_last_token_by_padding
from ..models.heads import Head
from .batching import pad_batch
from .modelstate import last_token_head

__all__ = ["ModelRunner", "takes_token_types"]


def takes_token_types(model: nn.Module, tokenizer: Any, head: Head) -> bool:
    """Whether token types go in: only where the model takes them and the tokenizer makes them (GPT-2 takes them
    but adds them as extra token embeddings, so they must match what the model was trained with)."""
    params = inspect.signature(model.forward).parameters
    made = "token_type_ids" in (getattr(tokenizer, "model_input_names", None) or ["token_type_ids"])
    return "token_type_ids" in params and made and not head.task.endswith("-lm")


@dataclass(frozen=True)
class ModelRunner:
    """A model with the facts the engines read: its tokenizer, task head, architecture adapter, the explained
    attention stream, the longest input, the padding id and its name in the explanations' metadata.

    Attributes:
        model: the HuggingFace model.
        tokenizer: its tokenizer.
        head: the task head (targets, probabilities, metadata): :mod:`attnlens.models.heads`.
        adapter: the architecture family's facts: :mod:`attnlens.models.adapters`.
        stream: the explained attention stream (``"self"``, or ``"encoder"``/``"decoder"``/``"cross"``).
        max_length: longest input in tokens.
        pad_id: the id padding positions get.
        name: how the model is named in the explanations' metadata.
        token_types: whether ``token_type_ids`` go in (:func:`takes_token_types`).
    """

    model: nn.Module
    tokenizer: Any
    head: Head
    adapter: Adapter
    stream: str
    max_length: int
    pad_id: int
    name: str
    token_types: bool

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are (the CPU for a model without any)."""
        try:
            return next(self.model.parameters()).device
        except StopIteration:
            return torch.device("cpu")

    @property
    def labels(self) -> list[str]:
        """Class names in index order (``id2label``); empty for QA models."""
        return self.head.labels(self.model.config)

    def with_head(self, head: Any) -> ModelRunner:
        """The same model explained with another head (e.g. a contrast)."""
        return dataclasses.replace(self, head=head)

    def with_adapter(self, adapter: Adapter) -> ModelRunner:
        """The same model read through another adapter (e.g. the rows of a seq2seq generation batch)."""
        return dataclasses.replace(self, adapter=adapter)

    def inputs(
        self,
        ids: Sequence[Sequence[int]],
        type_ids: Sequence[Sequence[int] | None] | None = None,
        masks: Sequence[Sequence[int]] | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Right-padded model inputs and the ``(B, N)`` mask of real tokens."""
        return pad_batch(ids, self.pad_id, self.device, type_ids=type_ids, masks=masks, with_types=self.token_types)

    def effective_batch_size(self, batch_size: int) -> int:
        """``batch_size`` checked, or 1 where the model's head cannot read a padded batch (with a warning)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise InputError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        if finds_last_token_by_padding(self.model):
            if batch_size > 1:
                warnings.warn(
                    "the model's config has no pad_token_id, so its head cannot find the last token of a padded "
                    "batch; explaining one input at a time (set model.config.pad_token_id to batch)",
                    stacklevel=3,
                )
            return 1
        return batch_size

    def head_without_padding(self, token_mask: torch.Tensor) -> AbstractContextManager[Any]:
        """Decoder-only models without a pad id get a temporary one, so that integrated gradients (Captum expands
        each input to a batch of ``n_steps`` copies) runs; inputs then go one at a time
        (:meth:`effective_batch_size`)."""
        if not finds_last_token_by_padding(self.model):
            return nullcontext()
        if not bool(token_mask.bool().all()):
            raise ModelError("the model's config has no pad_token_id, so its head cannot find the last token of a "
                             "padded batch: pass one input per batch, or set model.config.pad_token_id")
        return last_token_head(self.model)
