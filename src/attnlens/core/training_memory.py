"""What a fine-tuning step holds, and the micro-batches that keep it within a memory budget.

A training step holds, beside the model's weights, a gradient and AdamW's two moments per trainable parameter
(:data:`STATE_COPIES`), and, while the step's forward and backward run, the activations the backward reads: those of
an explanation's forward + backward (:func:`~attnlens.core.memory.pass_row_bytes`), plus, where the attention
probabilities are materialised, each attention's dropout mask and dropped probabilities. The optimiser's update then
holds one more parameter-sized temporary (its fused ``foreach`` operations). A batch whose activations do not fit
beside the states is split into micro-batches whose gradients add up to the batch's (each micro-batch's mean loss
weighted by its share of the batch), so the update is the one the whole batch gives, up to rounding and the random
dropout masks drawn.

The update also holds temporaries the size of the largest trainable tensor (:data:`LARGEST_COPIES`), and the
backward writes the word embeddings' gradient once more before adding it to the held one
(:data:`EMBEDDING_GRADIENT_COPIES`): for models whose word embeddings are most of their parameters these set the
peak of short steps. Peak RSS of one step beyond the loaded model (CPU, float32, batches of one length, default
attention) against :meth:`TrainingMemory.need`: MiniLM-L6 32 × 256 tokens 3.56 GiB (estimate 3.9), 8 × 512 2.69
(2.9); BERT-base 4 × 512 3.54 (4.8); GPT-2 4 × 512 4.19 (5.2); a 12-layer Llama of width 768, which has no
attention dropout, 4 × 512 1.75 (2.2). Steps over 8 × 16 tokens (the states and the update alone): MiniLM-L6
382 MiB (estimate 483), a 4-layer BERT of width 256 (word embeddings 71 % of its parameters) 245 (262), a 4-layer
GPT-2 of width 256 216 (258). ``bench/training_memory.py`` measures steps within budgets.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from torch import nn

from ..errors import InputError
from .allocator import BUDGET_SHARE, for_layer_blocks
from .memory import Dims, Storage, budget_chunks, longest_that_fits, model_dims, pass_row_bytes, readable_size
from .modelstate import EAGER, attention_implementation, runs_sdpa

STATE_COPIES = 3  # per trainable parameter: its gradient and AdamW's two moments
UPDATE_COPIES = 1  # the optimiser's update: one parameter-sized temporary beside the states
# beyond those, copies of the largest trainable tensor (the word embeddings, typically) a step holds at its peak: the
# update's per-tensor temporaries on a CPU (its square root and quotient) and heap blocks of their size that the
# allocator keeps; measured 0.75-2.4 beyond the states and one parameter-sized temporary (MiniLM-L6, a 4-layer BERT
# and a 4-layer GPT-2 of width 256, whose word embeddings are 52-71 % of their parameters)
LARGEST_COPIES = 3
# the backward of the word embeddings writes a dense gradient of their size before it is added to the held one
EMBEDDING_GRADIENT_COPIES = 1
DROPOUT_MASK_BYTES = 1  # a dropout mask holds one byte per value (bool)
TRAINED_BIAS_MAPS = 1  # maps per attention the backward of a model with score biases holds beyond the rest (T5's)
# config fields of the dropout on attention probabilities, by model family (T5's dropout_rate covers them too)
_ATTENTION_DROPOUT = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop", "attn_dropout",
                      "dropout_rate")


def materialises_maps(model: nn.Module) -> bool:
    """Whether a training step of ``model`` holds its ``heads × n × n`` attention probabilities: it runs eager
    attention, or fused attention with dropout on the probabilities (PyTorch's fused attention on a CPU falls back to
    the materialised computation for dropout; counted so on every device), or its config names no attention dropout
    attnlens knows."""
    if attention_implementation(model) in (EAGER, None) or not runs_sdpa(model):
        return True
    config = getattr(model, "config", None)
    rates = [getattr(config, name) for name in _ATTENTION_DROPOUT
             if isinstance(getattr(config, name, None), int | float)]
    return not rates or any(rate > 0 for rate in rates)


@dataclass(frozen=True)
class TrainingMemory:
    """The memory plan of fine-tuning one model within ``budget`` bytes.

    Attributes:
        budget: bytes the step may hold beside the model's weights.
        state_bytes: the trainable parameters' gradients and optimiser moments (held from the first step on).
        update_bytes: the optimiser update's temporary.
        dims: the model's sizes, as the explanation estimates read them.
        maps: whether the step holds attention probabilities (:func:`materialises_maps`).
    """

    budget: int
    state_bytes: int
    update_bytes: int
    dims: Dims
    maps: bool
    gradient_bytes: int = 0

    @classmethod
    def of(cls, model: nn.Module, budget: int) -> TrainingMemory:
        """The plan of ``model`` (its trainable parameters as they are now) within ``budget`` bytes."""
        sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
        trainable, largest = sum(sizes), max(sizes, default=0)
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        word = getattr(embeddings, "weight", None)
        embedding = word.numel() * word.element_size() if word is not None and word.requires_grad else 0
        return cls(budget, STATE_COPIES * trainable, UPDATE_COPIES * trainable + LARGEST_COPIES * largest,
                   model_dims(model), materialises_maps(model), EMBEDDING_GRADIENT_COPIES * embedding)

    def row_bytes(self, n: int) -> int:
        """Activations one example of ``n`` tokens holds through the step's forward and backward."""
        dims = self.dims
        row = pass_row_bytes(dims, n, Storage(eager=self.maps, backward=True))
        if self.maps:  # dropout on the probabilities: its mask and the dropped probabilities the backward reads
            row += dims.maps * dims.heads * n * n * (dims.itemsize + DROPOUT_MASK_BYTES)
        # a trained score bias (T5's relative positions): its backward held about one more map per attention
        # (T5-base, 4 x 512 tokens in one piece: 1.95 GiB beyond the rest of the estimate; one map per attention is
        # 1.69 GiB), though autograd saves none
        row += TRAINED_BIAS_MAPS * dims.maps * dims.heads * n * n * dims.itemsize * (dims.bias_maps > 0)
        return row

    @property
    def activation_budget(self) -> int:
        """Bytes left for a micro-batch's activations once the states (and the embeddings' gradient the backward
        writes) are held."""
        return self.budget - self.state_bytes - self.gradient_bytes

    def need(self, rows: int, n: int) -> int:
        """Bytes a step over ``rows`` examples padded to ``n`` tokens holds at its peak."""
        return self.state_bytes + max(rows * self.row_bytes(n) + self.gradient_bytes, self.update_bytes)

    def check(self, longest: int, what: str = "training") -> None:
        """Refuse (one line, before anything runs) when one example of ``longest`` tokens cannot be trained on within
        the budget: what it would need, and the longest example that fits."""
        if self.need(1, longest) <= self.budget:
            return
        states = readable_size(self.state_bytes)
        if self.state_bytes + self.update_bytes > self.budget:
            raise InputError(f"{what} needs about {readable_size(self.state_bytes + self.update_bytes)} for the "
                             f"trainable parameters' gradients, optimiser moments and update alone, more than the "
                             f"memory budget of {readable_size(self.budget)} (raise --memory-budget or train fewer "
                             "parameters with --freeze-layers N)")
        fits = longest_that_fits(self.activation_budget, self.row_bytes)
        raise InputError(f"{what} on examples of {longest:,} tokens needs about "
                         f"{readable_size(self.need(1, longest))} per example ({states} of it gradients and "
                         f"optimiser moments), more than the memory budget of {readable_size(self.budget)}; "
                         f"examples up to {fits:,} tokens fit (lower --max-length, raise --memory-budget or train "
                         "fewer parameters with --freeze-layers N)")

    def rows(self, n: int, cap: int) -> int:
        """Examples of ``n`` tokens one micro-batch holds (at least 1, at most ``cap``)."""
        return max(1, min(cap, self.activation_budget // max(1, self.row_bytes(n))))

    def allocator_policy(self, batch_size: int, longest: int) -> AbstractContextManager[None]:
        """The C allocator's policy for steps over ``batch_size`` examples of up to ``longest`` tokens: where a step
        fills half the budget or more, blocks of a quarter of one micro-batch's hidden states or more go back to the
        system when freed (:func:`~attnlens.core.allocator.for_layer_blocks`), so that the holes each micro-batch's
        freed activations leave in the heaps do not add up."""
        rows = self.rows(longest, batch_size)
        if self.need(rows, longest) < BUDGET_SHARE * self.budget:
            return nullcontext()
        return for_layer_blocks(self.dims.hidden_bytes(rows * longest))

    def micro_batches(self, lengths: Sequence[int]) -> Iterator[list[int]]:
        """Positions in ``lengths`` (one batch's examples): all of them in their order where the batch fits,
        else shortest first in micro-batches whose activations fit beside the states (one example at least:
        :meth:`check` refuses what not even that fits)."""
        if len(lengths) * self.row_bytes(max(lengths, default=1)) <= self.activation_budget:
            return iter([list(range(len(lengths)))])
        return budget_chunks(lengths, len(lengths), self.activation_budget, self.row_bytes)
