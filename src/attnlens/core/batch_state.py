"""What a method sees: the shared pass (:class:`Capture`) and the batch it explains (:class:`BatchContext`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..models.heads import CLASSIFICATION, TARGET_KINDS, Head
from .attention_chunks import AttentionChunks, WholeMaps
from .logit_rows import LogitRows
from .memory import DEFAULT_BUDGET

if TYPE_CHECKING:
    from ..models.adapters import Adapter

__all__ = ["TARGET_KINDS", "BatchContext", "Capture"]


@dataclass
class Capture:
    """Tensors of one forward (and, if needed, one backward) pass over a padded batch.

    Shapes: B examples, L layers of the explained attention stream, H heads, Q query and K key positions,
    N input tokens, D hidden size. Every tensor is detached; gradients are of the summed per-example target.
    The pass keeps only what the requested methods declare: anything else is ``None``.

    Attributes:
        logits: ``(B, C)`` classifier logits (``(B, N, 2)`` start/end logits for extractive QA; a language
            model's ``(B, K, V)`` at the K positions ``logit_rows`` kept: read them with its ``mask`` and
            ``targets``).
        attentions: L tensors ``(B, H, Q, K)``: softmax attention, rows are queries.
        attention_grads: gradients of the target w.r.t. ``attentions`` (``None`` without a backward pass).
        hidden: L+1 tensors ``(B, K, D)`` aligned with the keys; ``hidden[l]`` is the input of layer ``l+1``
            (``hidden[0]`` the embeddings) and ``hidden[L]`` the last layer's output.
        hidden_grads: their gradients, or ``None``.
        embeddings: ``(B, N, D)`` output of the input-embedding module (token space), or ``None``.
        embedding_grads: its gradient, or ``None``.
        decoder_embeddings: an encoder-decoder's decoder-input embeddings ``(B, M, D)`` where ``embeddings`` are
            kept (the encoder's), or ``None``.
        decoder_embedding_grads: their gradient, or ``None``.
        query_mask: ``(B, Q)`` real (non-padding) query positions.
        key_mask: ``(B, K)`` real key positions.
        query_weights: ``(B, Q)`` weights of the explained query row(s): one-hot at the classification position,
            or uniform over the real queries (BART's encoder stream). ``score = query_weights @ matrix``.
        self_attention: whether queries and keys are the same positions (square matrices; rollout needs it).
        attention_rows: L tensors ``(B, H, R, K)``: each layer's attention at the R query rows the explanation
            reads (``attentions`` themselves when the whole maps were kept: then R = Q).
        attention_row_grads: their gradients, or ``None``.
        row_weights: ``(B, R)`` weights of the explained row(s) among ``attention_rows``' rows
            (``query_weights`` when R = Q). ``score = row_weights @ rows`` (:meth:`explained_row`).
        row_positions: ``(R,)`` the query positions of ``attention_rows``' rows, or ``None`` when they are every
            query (R = Q); :meth:`rows_at` gives them either way.
        attention_received: L tensors ``(B, K)``: the attention each key receives, mean over heads and real
            query rows (what :meth:`query_mean` of the head-mean map gives), or ``None``.
        attention_means: L tensors ``(B, Q, K)``: every layer's whole map, mean over heads (reduced during the
            forward), or ``None``; :meth:`head_means` also gives them from the whole maps.
        attention_chunks: every layer's maps (and, where the method reads them, their gradients) read in chunks of
            query rows (:class:`~attnlens.core.attention_chunks.AttentionChunks`; recomputed under fused
            attention), or ``None``; :meth:`map_chunks` also gives them from the whole maps.
        logit_rows: the positions whose logits the pass computed (:class:`~attnlens.core.logit_rows.LogitRows`;
            every position by default).
    """

    logits: torch.Tensor
    query_mask: torch.Tensor
    key_mask: torch.Tensor
    query_weights: torch.Tensor
    self_attention: bool = True
    attentions: list[torch.Tensor] | None = None
    attention_grads: list[torch.Tensor] | None = None
    hidden: list[torch.Tensor] | None = None
    hidden_grads: list[torch.Tensor] | None = None
    embeddings: torch.Tensor | None = None
    embedding_grads: torch.Tensor | None = None
    decoder_embeddings: torch.Tensor | None = None
    decoder_embedding_grads: torch.Tensor | None = None
    attention_rows: list[torch.Tensor] | None = None
    attention_row_grads: list[torch.Tensor] | None = None
    row_weights: torch.Tensor | None = None
    row_positions: torch.Tensor | None = None
    attention_received: list[torch.Tensor] | None = None
    attention_means: list[torch.Tensor] | None = None
    attention_chunks: AttentionChunks | None = None
    logit_rows: LogitRows = field(default_factory=LogitRows)

    def logit_reading(self, head: Any, token_mask: torch.Tensor,
                      targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_mask`` and ``targets`` as ``head`` reads them against :attr:`logits`."""
        return self.logit_rows.mask(token_mask), self.logit_rows.targets(head, targets)

    def kept_bytes(self) -> int:
        """Bytes of the tensors the pass keeps for the methods (maps, rows, means, hidden states, embeddings, their
        gradients, the chunks' factors), each storage counted once: the rows and their gradients may be the maps'
        own."""
        held: dict[int, int] = {}
        for name in ("attentions", "attention_grads", "attention_rows", "attention_row_grads", "attention_received",
                     "attention_means", "hidden", "hidden_grads", "embeddings", "embedding_grads", "decoder_embeddings",
                     "decoder_embedding_grads"):
            value = getattr(self, name)
            for t in [] if value is None else (value if isinstance(value, list) else [value]):
                held[t.data_ptr()] = t.numel() * t.element_size()
        for t in [] if self.attention_chunks is None else self.attention_chunks.tensors():
            held[t.data_ptr()] = t.numel() * t.element_size()
        return sum(held.values())

    def __post_init__(self) -> None:
        # whole maps hold their own rows: the explained ones are read from them (R = Q)
        if self.attention_rows is None and self.attentions is not None:
            self.attention_rows, self.attention_row_grads = self.attentions, self.attention_grads
        if self.row_weights is None:
            self.row_weights = self.query_weights

    def received_attention(self) -> list[torch.Tensor]:
        """L tensors ``(B, K)``: the attention each key receives, mean over heads and real query rows — as the
        pass reduced it, or from the whole maps."""
        if self.attention_received is None:
            self.attention_received = [self.query_mean(a.mean(1)) for a in self.attentions]
        return self.attention_received

    def head_means(self) -> list[torch.Tensor]:
        """L tensors ``(B, Q, K)``: every layer's map, mean over heads — as the pass reduced it, or from the whole
        maps."""
        if self.attention_means is None:
            self.attention_means = [a.mean(1) for a in self.attentions]
        return self.attention_means

    def map_chunks(self) -> AttentionChunks:
        """Every layer's maps (and their gradients, when kept) in chunks of query rows — as the pass kept them, or
        from the whole maps."""
        if self.attention_chunks is None:
            self.attention_chunks = WholeMaps(self.attentions, self.attention_grads)
        return self.attention_chunks

    @property
    def n_layers(self) -> int:
        """L, from whichever per-layer tensors were kept (0 if none was)."""
        for tensors, extra in ((self.attentions, 0), (self.attention_grads, 0), (self.attention_rows, 0),
                               (self.attention_received, 0), (self.attention_means, 0), (self.hidden, 1),
                               (self.hidden_grads, 1)):
            if tensors is not None:
                return len(tensors) - extra
        return self.attention_chunks.n_layers if self.attention_chunks is not None else 0

    def query_mean(self, matrix: torch.Tensor) -> torch.Tensor:
        """Mean of ``matrix`` ``(B, Q, K)`` over the real query rows: ``(B, K)``."""
        m = self.query_mask.to(matrix.dtype)
        return torch.einsum("bq,bqk->bk", m, matrix) / m.sum(1, keepdim=True).clamp_min(1.0)

    def row(self, matrix: torch.Tensor) -> torch.Tensor:
        """The explained row of ``matrix`` ``(B, Q, K)`` (or ``(B, H, Q, K)``): ``query_weights @ matrix``."""
        if matrix.dim() == 4:
            return torch.einsum("bq,bhqk->bhk", self.query_weights.to(matrix.dtype), matrix)
        return torch.einsum("bq,bqk->bk", self.query_weights.to(matrix.dtype), matrix)

    def rows_at(self) -> torch.Tensor:
        """``(R,)``: the query position of each of :attr:`attention_rows`' rows."""
        if self.row_positions is not None:
            return self.row_positions
        return torch.arange(self.query_mask.shape[1], device=self.query_mask.device)

    def explained_row(self, rows: torch.Tensor) -> torch.Tensor:
        """The explained row of ``rows`` ``(B, R, K)`` (or ``(B, H, R, K)``), a matrix over
        :attr:`attention_rows`' rows: ``row_weights @ rows``."""
        w = self.row_weights.to(rows.dtype)
        return torch.einsum("br,bhrk->bhk" if rows.dim() == 4 else "br,brk->bk", w, rows)


@dataclass
class BatchContext:
    """One padded, length-sorted batch being explained, with everything a method may need.

    Attributes:
        model: the model (eval mode, eager attention) while the explainer runs.
        adapter: the architecture adapter of the model's family.
        inputs: model inputs (``input_ids``, ``attention_mask``, and ``token_type_ids`` where the model takes them).
        token_mask: ``(B, N)`` real (non-padding) input tokens.
        special_mask: ``(B, N)`` special tokens ([CLS], [SEP], ...), padding excluded.
        targets: ``(B,)`` explained class per example (``(B, 2)`` start/end positions for extractive QA).
        target_kind: ``"logit"``, ``"probability"`` or ``"loss"`` (log-probability of ``targets``).
        tokenizer: the tokenizer (for methods that need special token ids, e.g. baselines).
        head: what the model predicts (classification or extractive QA) and how the explained scalar is formed.
        stream: which attention explains (``"self"`` for encoder-/decoder-only, or BART's
            ``"encoder"``, ``"decoder"``, ``"cross"``).
        answer_mask: ``(B, N)`` positions an extractive QA answer may use (the context's non-special tokens),
            or ``None`` (classifiers).
        capture: the shared pass, or ``None`` when no requested method needs it.
        cache: scratch space shared by the methods of this batch (e.g. one LRP pass for several LRP methods).
        memory_budget: bytes a method running its own passes may plan for (integrated gradients sizes its
            internal batches from it).
        progress: called by long-running methods with the share of their work on the batch done since the last
            call (the shares of one method sum to 1 at most), so progress moves inside a batch; ``None``: nobody
            listens.
        meta: per-method, per-input figures the methods reported (:attr:`MethodOutput.meta`), filled by the engine.
        plan: the batch's methods and their options (defaults merged), set by the engine before any runs: a
            method whose pass could serve another's too reads what the others will ask for (the LRP passes).
        sequence: inputs (a batch of one) of the causal sequence that every row is a prefix of, when the rows
            are the steps of one generation of a decoder-only model; ``None`` otherwise. Row ``b`` is then the
            sequence's first ``token_mask[b].sum()`` tokens, and causal masking makes one forward over the
            sequence hold every row's forward: the shared pass runs once over it (gradients of the rows' targets
            by batched vector-Jacobian products) and integrated gradients evaluates each path point once.
    """

    model: torch.nn.Module
    adapter: Adapter
    inputs: dict[str, torch.Tensor]
    token_mask: torch.Tensor
    special_mask: torch.Tensor
    targets: torch.Tensor
    target_kind: str = "logit"
    stream: str = "self"
    tokenizer: Any = None
    head: Head = CLASSIFICATION
    answer_mask: torch.Tensor | None = None
    capture: Capture | None = None
    cache: dict[str, Any] = field(default_factory=dict)
    memory_budget: int = DEFAULT_BUDGET
    progress: Callable[[float], None] | None = None
    meta: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    plan: dict[str, dict[str, Any]] = field(default_factory=dict)
    sequence: dict[str, torch.Tensor] | None = None

    def budget_left(self) -> int:
        """What :attr:`memory_budget` leaves beside the shared pass's kept tensors (at least a quarter of it): the
        bytes a method's own passes may hold while they are alive."""
        held = 0 if self.capture is None else self.capture.kept_bytes()
        return max(self.memory_budget - held, self.memory_budget // 4)
