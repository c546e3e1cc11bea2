"""What the shared pass's fused forward keeps for its backward, counted on the model's own layers.

The gradient methods' shared pass with fused attention (:func:`~attnlens.core.capture.run_capture` in its rows
mode, :func:`~attnlens.core.row_attention.row_attention` in every layer) keeps, for a backward that does not
recompute the layers, what autograd saves per token and layer: the linear layers' inputs, the normalisations',
the attention kernel's queries, keys, values and output, and the keys the explained rows were recomputed from.
The estimate's floor for a plain backward counts 30 hidden-size vectors per token and layer; SmolLM2-135M's pass
saves 20.8 at 512 tokens. :func:`capture_vectors` runs the pass's forward on two short probes
(:mod:`attnlens.core.saved_probe`) as the pass would run it for that storage and counts what autograd saves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from ..models.adapters import Adapter
from .capture import taking_gradients
from .memory import Dims, Storage
from .modelstate import attention_switched, explaining, without_cache
from .row_attention import RowRecorder, recording, registered, rows_unsupported
from .saved_probe import Counts, counted, saved_per_token

_COUNTED: Counts = Counts()


def capture_vectors(model: nn.Module, adapter: Adapter, storage: Storage, layers: int, hidden: int
                    ) -> float | None:
    """Vectors of ``hidden`` values (in the parameters' dtype) per token and per each of ``layers`` layers that the
    shared pass planned as ``storage`` (fused attention with a backward, :attr:`Storage.recorded`) saves for a
    backward that does not recompute the layers: counted on probes with one explained row, the received attention,
    head means, map factors and hidden states as ``storage`` keeps them (the kept rows, hidden states and factors
    themselves are counted apart by :func:`~attnlens.core.memory.pass_row_bytes`).

    ``None`` where it cannot be counted: a storage that is not such a pass, a model whose attention the rows pass
    cannot stand in for, weights not materialised (the meta device), or a forward that fails on the probe."""
    if not (storage.recorded and storage.backward) or layers <= 0 or hidden <= 0:
        return None
    features = (storage.rows > 0, storage.received, storage.means, storage.factors, storage.factor_grads,
                storage.hidden)
    count = counted(_COUNTED, model, features, lambda: _count(model, adapter, storage))
    if count is None:
        return None
    return count / (layers * hidden * next(model.parameters()).element_size())


def capture_pass_dims(model: nn.Module, adapter: Adapter, dims: Dims, storage: Storage | None) -> Dims:
    """``dims`` with what the shared pass planned as ``storage`` keeps per token and layer counted on ``model``
    (:func:`capture_vectors`), for its estimate where it keeps the layers' activations; unchanged where it cannot
    be counted."""
    vectors = None if storage is None else capture_vectors(model, adapter, storage, dims.layers, dims.hidden)
    return dims if vectors is None else dataclasses.replace(dims, capture_vectors=vectors)


def _count(model: nn.Module, adapter: Adapter, storage: Storage) -> float | None:
    """Bytes saved per token beyond the parameters, or ``None``."""
    if rows_unsupported(model):
        return None

    def forward(inputs: dict[str, torch.Tensor]) -> None:
        mask = inputs["attention_mask"]
        n = mask.shape[1]
        weights = mask.to(torch.float64) / mask.sum(1, keepdim=True)
        recorder = RowRecorder(rows=mask.new_tensor([n - 1]) if storage.rows else None,
                               received_weights=weights if storage.received else None, means=storage.means,
                               factors=storage.factors, factor_grads=storage.factors and storage.factor_grads)
        with ExitStack() as stack:
            stack.enter_context(explaining(model))
            stack.enter_context(attention_switched(model, registered()))
            stack.enter_context(recording(recorder))
            # the pass differentiates its input embeddings, whether or not the parameters take gradients
            stack.enter_context(_embeddings_taking_gradients(adapter.embedding_module(model)))
            try:
                model(**inputs, output_hidden_states=storage.hidden, return_dict=True, **without_cache(model))
            finally:
                recorder.release()

    return saved_per_token(model, forward)


@contextmanager
def _embeddings_taking_gradients(module: nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s output takes gradients, as the shared pass's embeddings hook makes it."""
    handle = module.register_forward_hook(lambda _, __, output: taking_gradients(output))
    try:
        yield
    finally:
        handle.remove()
