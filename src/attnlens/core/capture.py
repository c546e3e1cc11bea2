"""The shared pass: one forward (and at most one backward) pass per batch serves every capture-based method.

The pass keeps only what the requested methods declare (:func:`attnlens.methods.registry.capture_request`):
attention-only requests run without a graph and keep no hidden states, and gradients are taken only of the
tensors whose gradients some method reads. Unless a method reads every layer's whole attention maps
(``ATTENTION``), models that dispatch their attention through transformers' interface run fused attention
(:mod:`attnlens.core.row_attention`) keeping only the explained rows (``ATTENTION_ROWS``) and the attention each
key receives (``ATTENTION_RECEIVED``); elsewhere (encoder-decoders, mean pooling, attention features the fused
path does not reproduce) the pass runs eager attention and those are read from the whole maps.
A new kind of tensor (e.g. value vectors, for a method that needs them) is one constant in the registry's
``CAPTURED`` and one recorder below (a forward hook, as for the embeddings).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from ..methods.registry import (
    ATTENTION,
    ATTENTION_CHUNKS,
    ATTENTION_MEANS,
    ATTENTION_RECEIVED,
    ATTENTION_ROWS,
    CAPTURED,
    EMBEDDINGS,
    HIDDEN,
)
from ..models.adapters import MEAN, Adapter
from ..models.heads import CLASSIFICATION, Head
from ..models.prefixes import RowViews, last_token_rows, row_gradients
from .attention_chunks import RecomputedChunks, WholeMaps
from .batch_state import Capture
from .logit_rows import LogitRows
from .memory import Storage
from .modelstate import attention_switched, without_cache
from .recomputing import recomputing
from .row_attention import (
    RowAttentionUnsupported,
    RowRecorder,
    recording,
    registered,
    rows_unsupported,
)

FULL_MAPS = "full"  # eager attention, every layer's whole maps returned (read by ATTENTION methods)
ROWS = "rows"  # fused attention keeping the explained rows and received attention (core/row_attention.py)


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def taking_gradients(embedded: torch.Tensor) -> torch.Tensor:
    """``embedded`` (an embedding's output), made to take gradients where autograd records: with frozen
    parameters it is the graph's leaf, and the pass's backward reaches the attention and hidden states from it."""
    if torch.is_grad_enabled() and not embedded.requires_grad:
        embedded.requires_grad_(True)
    return embedded


def _without_hidden_states(outputs: Any) -> Any:
    """``outputs`` of a pass run without ``output_hidden_states``, with empty tuples where the adapters read
    hidden states (``hidden_states``, ``encoder_hidden_states``, ...)."""
    if dataclasses.is_dataclass(outputs):
        for f in dataclasses.fields(outputs):
            if f.name.endswith("hidden_states") and getattr(outputs, f.name) is None:
                setattr(outputs, f.name, ())
    return outputs


def _without_attentions(outputs: Any) -> Any:
    """``outputs`` with empty tuples where the adapters read attention maps (``attentions``, an encoder-decoder's
    ``encoder_attentions``, ``decoder_attentions`` and ``cross_attentions``): another pass ran the forward and
    kept none."""
    outputs.attentions = ()
    if dataclasses.is_dataclass(outputs):
        for f in dataclasses.fields(outputs):
            if f.name.endswith("attentions"):
                setattr(outputs, f.name, ())
    return outputs


def capture_mode(model: nn.Module, adapter: Adapter, stream: str, keep: Collection[str],
                 positions_known: bool = False) -> str:
    """How a pass keeping ``keep`` runs on ``model``: :data:`ROWS` (fused attention, nothing ``N × N`` kept) when
    no method reads the whole maps and the model can (a single-stream family whose explained rows are single
    positions, attention through transformers' interface), else :data:`FULL_MAPS`. ``positions_known``: the head
    names the explained positions (token classification)."""
    if ATTENTION in keep or adapter.streams != ("self",) or rows_unsupported(model):
        return FULL_MAPS
    return ROWS if positions_known or adapter.pooling != MEAN else FULL_MAPS


def planned_storage(model: nn.Module, adapter: Adapter, stream: str, keep: Collection[str],
                    differentiate: Collection[str], gradients: bool, positions_known: bool = False,
                    rows_per_input: int = 1) -> Storage:
    """What :func:`run_capture` keeps per row for this request (the memory estimates read it); ``rows_per_input``:
    the query rows each input's explanation reads (:attr:`~attnlens.models.heads.Head.query_rows_per_input`)."""
    keep = frozenset(keep)
    grads = frozenset(differentiate) & keep if gradients else frozenset()
    attention = keep & {ATTENTION, ATTENTION_ROWS, ATTENTION_RECEIVED, ATTENTION_MEANS, ATTENTION_CHUNKS}
    if capture_mode(model, adapter, stream, keep, positions_known) == ROWS:
        return Storage(eager=False, backward=bool(grads), recorded=True,
                       rows=rows_per_input * int(ATTENTION_ROWS in keep), row_grads=ATTENTION_ROWS in grads,
                       received=ATTENTION_RECEIVED in keep,
                       means=ATTENTION_MEANS in keep, factors=ATTENTION_CHUNKS in keep,
                       factor_grads=ATTENTION_CHUNKS in grads,
                       hidden=HIDDEN in keep, hidden_grads=HIDDEN in grads, embeddings=EMBEDDINGS in keep,
                       embedding_grads=EMBEDDINGS in grads)
    # eager attention: the model returns every layer's whole maps (the adapters read the layout from them)
    return Storage(eager=True, backward=bool(grads), maps=True,
                   map_grads=bool(grads & {ATTENTION, ATTENTION_ROWS, ATTENTION_CHUNKS}),
                   received=bool(attention) and ATTENTION_RECEIVED in keep, means=ATTENTION_MEANS in keep,
                   chunked=ATTENTION_CHUNKS in keep, hidden=HIDDEN in keep,
                   hidden_grads=HIDDEN in grads, embeddings=EMBEDDINGS in keep, embedding_grads=EMBEDDINGS in grads)


def _layer_count(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    value = getattr(cfg, "num_hidden_layers", None)
    return value if isinstance(value, int) else None


def run_capture(
    model: nn.Module,
    adapter: Adapter,
    inputs: dict[str, torch.Tensor],
    token_mask: torch.Tensor,
    stream: str,
    targets: torch.Tensor | None,
    target_kind: str,
    *,
    gradients: bool,
    head: Head = CLASSIFICATION,
    answer_mask: torch.Tensor | None = None,
    keep: Collection[str] = CAPTURED,
    differentiate: Collection[str] | None = None,
    sequence: dict[str, torch.Tensor] | None = None,
    recompute: bool = False,
    outputs: Any = None,
) -> tuple[Capture, torch.Tensor]:
    """Run ``model`` once on a padded batch, keeping the tensors named in ``keep`` (the registry's ``ATTENTION``,
    ``ATTENTION_ROWS``, ``ATTENTION_RECEIVED``, ``HIDDEN``, ``EMBEDDINGS``), and, if ``gradients``, take the
    gradients of the summed per-example target scalars w.r.t. those in ``differentiate`` (default: every
    differentiable one of ``keep``) in one backward pass (:func:`torch.autograd.grad`: nothing is written to
    ``.grad`` and weight gradients are never computed). What is not kept stays ``None`` in the capture.
    ``targets=None`` explains each example's predicted class (QA: the best span within ``answer_mask``).
    ``sequence``: inputs (a batch of one) of a causal sequence whose prefixes the batch's rows are (the steps of a
    generation, :attr:`BatchContext.sequence`): the model runs once, on it, and the capture holds its tensors
    viewed as the batch's rows; each row's gradients are of its own target, by batched vector-Jacobian
    products through that one forward (``is_grads_batched``).
    ``recompute``: with fused attention, the backward recomputes each layer instead of keeping its activations
    (:func:`~attnlens.core.recomputing.recomputing`; for inputs whose activations would not fit).
    ``outputs``: the model's outputs on these inputs (with the logit rows' arguments), computed by another pass's
    forward (:attr:`~attnlens.methods.registry.Method.forward`): the capture is built from them and the model does
    not run; only for a request that keeps nothing and takes no gradients, with ``targets`` given.
    Returns the capture and the targets.
    """
    keep = frozenset(keep)
    differentiate = (keep - {ATTENTION_RECEIVED, ATTENTION_MEANS} if differentiate is None
                     else frozenset(differentiate) & keep)
    positions = head.explained_positions(targets)  # token classification: the explained token's row
    if positions is None:
        cls = adapter.classification_index(inputs["input_ids"], token_mask, model.config,
                                           skip_pad=head.finds_last_by_pad_id)
    else:
        cls = positions
    mode = capture_mode(model, adapter, stream, keep, positions is not None)
    if outputs is not None:
        if keep or gradients or targets is None or sequence is not None:
            raise ValueError("a capture from given outputs keeps nothing, takes no gradients and needs the targets")
        return _pass(model, adapter, inputs, token_mask, stream, targets, target_kind, False, head, answer_mask,
                     keep, differentiate, None, cls, positions, ROWS, RowRecorder(), outputs)
    if mode == ROWS:
        try:
            return _run(model, adapter, inputs, token_mask, stream, targets, target_kind, gradients, head,
                        answer_mask, keep, differentiate, sequence, cls, positions, ROWS, recompute)
        except RowAttentionUnsupported:
            pass  # a feature the fused path does not reproduce: the whole maps, as eager attention gives them
    return _run(model, adapter, inputs, token_mask, stream, targets, target_kind, gradients, head, answer_mask,
                keep, differentiate, sequence, cls, positions, FULL_MAPS)


def read_queries(head: Head, adapter: Adapter, stream: str, query_mask: torch.Tensor, targets: torch.Tensor | None,
                 rows: torch.Tensor) -> torch.Tensor:
    """``(B, Q)`` the query rows the explained value can depend on, of the real ones in ``query_mask`` (what the
    methods averaging over query rows average over: AttCAT's received attention, Grad-SAM): under causal
    attention none after the last row the head reads (``Head.last_read_row`` of ``rows``, the row each example's
    head reads). A decoder's token label, QA span or answer, or its classifier's row before a final end-of-text
    token, reads nothing the rows after it compute."""
    if not adapter.causal(stream):
        return query_mask
    last = head.last_read_row(targets, rows)
    if last is None:
        return query_mask
    index = torch.arange(query_mask.shape[1], device=query_mask.device)
    return query_mask & (index[None, :] <= last.to(query_mask.device)[:, None])


def _run(model: nn.Module, adapter: Adapter, inputs: dict[str, torch.Tensor], token_mask: torch.Tensor,
         stream: str, targets: torch.Tensor | None, target_kind: str, gradients: bool, head: Head,
         answer_mask: torch.Tensor | None, keep: frozenset[str], differentiate: frozenset[str],
         sequence: dict[str, torch.Tensor] | None, cls: torch.Tensor, positions: torch.Tensor | None, mode: str,
         recompute: bool = False) -> tuple[Capture, torch.Tensor]:
    """:func:`run_capture` in one ``mode``: with fused attention, the forward and the backward (which may
    recompute layers) run under the recording attention implementation."""
    with ExitStack() as stack:
        recorder = RowRecorder()
        if mode == ROWS:
            stack.enter_context(attention_switched(model, registered()))
            stack.enter_context(recording(recorder))
            if recompute and gradients:
                stack.enter_context(recomputing(model, token_mask.shape[1]))
        try:
            return _pass(model, adapter, inputs, token_mask, stream, targets, target_kind, gradients, head,
                         answer_mask, keep, differentiate, sequence, cls, positions, mode, recorder)
        finally:
            recorder.release()


def _pass(model: nn.Module, adapter: Adapter, inputs: dict[str, torch.Tensor], token_mask: torch.Tensor,
          stream: str, targets: torch.Tensor | None, target_kind: str, gradients: bool, head: Head,
          answer_mask: torch.Tensor | None, keep: frozenset[str], differentiate: frozenset[str],
          sequence: dict[str, torch.Tensor] | None, cls: torch.Tensor, positions: torch.Tensor | None, mode: str,
          recorder: RowRecorder, given: Any = None) -> tuple[Capture, torch.Tensor]:
    if mode == FULL_MAPS:  # rows, received attention and map chunks are read from the whole maps
        wants_maps = bool(keep & {ATTENTION, ATTENTION_ROWS, ATTENTION_RECEIVED, ATTENTION_MEANS, ATTENTION_CHUNKS})
        grad_kinds = {ATTENTION if k in (ATTENTION_ROWS, ATTENTION_CHUNKS) else k for k in differentiate}
    else:
        wants_maps = False
        grad_kinds = set(differentiate)
    gradients = gradients and bool(grad_kinds)
    store: dict[str, torch.Tensor] = {}
    several = head.explained_rows(targets)  # a head reading several rows (a QA span's start and end)
    if mode == ROWS:
        if several is None and head.rows_from_targets:
            raise ValueError("this head's explained rows follow its targets: resolve them before a rows pass")
        if ATTENTION_ROWS in keep:
            recorder.rows = torch.unique(cls if several is None else several)
        if ATTENTION_RECEIVED in keep:  # each use takes them in the model's dtype (a float64 one's too)
            m = read_queries(head, adapter, stream, token_mask.bool(), targets, cls).to(torch.float64)
            recorder.received_weights = m / m.sum(1, keepdim=True).clamp_min(1.0)
        recorder.means = ATTENTION_MEANS in keep
        recorder.factors = ATTENTION_CHUNKS in keep
        recorder.factor_grads = gradients and ATTENTION_CHUNKS in differentiate

    embedding = adapter.embedding_module(model)
    decoder_embedding = adapter.decoder_embedding_module(model)
    # where one module embeds both, its first call is the encoder's and its second the decoder's
    order = ("embeddings", "decoder_embeddings") if decoder_embedding is embedding else ("embeddings",)

    def kept_as(names: tuple[str, ...]) -> Any:
        def keep_embeddings(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            # The embedding output is the graph's leaf when the parameters are frozen; make it require grad so
            # the backward reaches attention and hidden states either way.
            name = next((n for n in names if n not in store), None)
            if name is not None:
                store[name] = taking_gradients(output)
            return output
        return keep_embeddings

    # a language model's logits only at the positions the head reads (where the model can)
    logit_rows = LogitRows.of(model, head, token_mask, targets)
    hooked = gradients or EMBEDDINGS in keep
    handles = [embedding.register_forward_hook(kept_as(order))] if hooked else []
    if hooked and decoder_embedding is not None and decoder_embedding is not embedding:
        handles.append(decoder_embedding.register_forward_hook(kept_as(("decoder_embeddings",))))
    try:
        with torch.set_grad_enabled(gradients):
            kwargs = dict(inputs if sequence is None else sequence, **logit_rows.model_kwargs(),
                          **without_cache(model))
            if given is not None:  # another pass ran the forward: nothing of the stream is kept
                outputs = _without_attentions(given)
            elif mode == ROWS:
                outputs = model(**kwargs, output_hidden_states=HIDDEN in keep, return_dict=True)
                recorder.done = True
                if recorder.calls != _layer_count(model):  # some layer did not come through the interface
                    raise RowAttentionUnsupported(f"{recorder.calls} attention layers recorded")
                outputs.attentions = tuple(recorder.kept_rows)
            else:
                # Attention probabilities are always asked for: the adapters read the stream's layout from them.
                outputs = model(**kwargs, output_attentions=True, output_hidden_states=HIDDEN in keep,
                                return_dict=True)
    finally:
        for handle in handles:
            handle.remove()
    views = RowViews(token_mask.shape[0])
    if sequence is not None:  # the batch's rows are prefixes of the one sequence that ran
        outputs = views.outputs(outputs)
        if "embeddings" in store:
            store["embeddings"] = views.view(store["embeddings"])
    if HIDDEN not in keep:
        outputs = _without_hidden_states(outputs)

    stream_tensors = adapter.select(outputs, stream, token_mask, cls)
    logits = head.logits(outputs)
    logit_mask = logit_rows.mask(token_mask)
    if targets is None:
        targets = head.predicted(logits, logit_mask, answer_mask)
    if stream_tensors.self_attention:  # the rows the explained value can depend on (a decoder's answer)
        stream_tensors.query_mask = read_queries(head, adapter, stream, stream_tensors.query_mask.bool(), targets,
                                                 cls).to(stream_tensors.query_mask.dtype)
    weights = head.query_weights(targets, stream_tensors.query_mask.shape[1])
    if weights is not None and stream_tensors.head_queries:
        stream_tensors.query_weights = weights
    query_weights = stream_tensors.query_weights.to(logits.dtype)
    maps = list(stream_tensors.attentions)
    # with fused attention, the maps' gradients come from the attention outputs' (attention_chunks.py)
    outputs_kept = [f.output for f in recorder.layer_factors if f.output is not None]
    recorded = {
        ATTENTION: maps if wants_maps else [],
        ATTENTION_ROWS: maps,
        ATTENTION_CHUNKS: [views.view(o) if sequence is not None else o for o in outputs_kept],
        HIDDEN: list(stream_tensors.hidden),
        # the encoder's input embeddings, then an encoder-decoder's decoder inputs'
        EMBEDDINGS: [store[k] for k in ("embeddings", "decoder_embeddings") if k in store],
    }

    def kept(kind: str, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        return [t.detach() for t in tensors] if kind in keep else None

    embeddings = kept(EMBEDDINGS, recorded[EMBEDDINGS])
    capture = Capture(
        logits=logits.detach(),
        attentions=kept(ATTENTION, recorded[ATTENTION]),
        query_mask=stream_tensors.query_mask,
        key_mask=stream_tensors.key_mask,
        query_weights=query_weights,
        self_attention=stream_tensors.self_attention,
        hidden=kept(HIDDEN, recorded[HIDDEN]),
        embeddings=embeddings[0] if embeddings else None,
        decoder_embeddings=embeddings[1] if embeddings and len(embeddings) > 1 else None,
        attention_rows=kept(ATTENTION_ROWS, recorded[ATTENTION_ROWS]),
        logit_rows=logit_rows,
    )
    if mode == ROWS:
        rows = recorder.rows if recorder.rows is not None else cls.new_zeros(0)
        capture.row_weights = query_weights[:, rows.to(query_weights.device)]  # each kept row's weight
        capture.row_positions = rows.to(cls.device)
        if ATTENTION_RECEIVED in keep:
            capture.attention_received = [r.to(logits.dtype) for r in recorder.received]
    else:
        capture.row_weights = query_weights
        if ATTENTION_RECEIVED in keep:
            capture.attention_received = Capture(logits=logits, attentions=[a.detach() for a in maps],
                                                 query_mask=stream_tensors.query_mask, key_mask=stream_tensors.key_mask,
                                                 query_weights=query_weights).received_attention()
    if ATTENTION_MEANS in keep:
        if mode == ROWS:
            capture.attention_means = [m if sequence is None else views.view(m) for m in recorder.mean_maps]
        else:  # a generation's rows view one sequence's maps: average the sequence's, then view
            capture.attention_means = [views.view(views.bases[id(a)].detach().mean(1)) if id(a) in views.bases
                                       else a.detach().mean(1) for a in maps]
    if gradients:
        wanted = _unique([t for kind in sorted(grad_kinds) for t in recorded[kind]])
        if sequence is None:
            y = head.scalar(logits, logit_rows.targets(head, targets), target_kind, logit_mask)
            grads = torch.autograd.grad(y.sum(), wanted, allow_unused=True)
        else:  # row b's gradient is of y[b] alone: one vector-Jacobian product per row, batched
            last_logits, last_mask = last_token_rows(views.bases[id(logits)], logit_mask)
            y = head.scalar(last_logits, targets, target_kind, last_mask)
            grads = row_gradients(y, [views.bases[id(t)] for t in wanted])
        by_id = {id(t): (g if g is not None else torch.zeros_like(t)) for t, g in zip(wanted, grads, strict=True)}

        def grads_of(kind: str, source: str | None = None) -> list[torch.Tensor] | None:
            source = source or kind
            return [by_id[id(t)].detach() for t in recorded[source]] if kind in differentiate else None

        capture.attention_grads = grads_of(ATTENTION)
        capture.attention_row_grads = grads_of(ATTENTION_ROWS)
        capture.hidden_grads = grads_of(HIDDEN)
        embedding_grads = grads_of(EMBEDDINGS)
        capture.embedding_grads = embedding_grads[0] if embedding_grads else None
        if embedding_grads and len(embedding_grads) > 1:
            capture.decoder_embedding_grads = embedding_grads[1]
    if ATTENTION_CHUNKS in keep:
        grads = None
        if gradients and ATTENTION_CHUNKS in differentiate:
            grads = grads_of(ATTENTION_CHUNKS, ATTENTION if mode == FULL_MAPS else None)
        if mode == ROWS:
            for f in recorder.layer_factors:
                f.output = None  # its gradient is taken: the graph can go
            capture.attention_chunks = RecomputedChunks(recorder.layer_factors, token_mask.shape[0], grads)
        else:
            capture.attention_chunks = WholeMaps([a.detach() for a in maps], grads)
    return capture, targets
