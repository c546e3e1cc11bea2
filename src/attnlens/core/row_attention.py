"""Attention that keeps only what an explanation reads: fused attention (SDPA) for every layer's output, plus the
attention rows of the explained queries and the attention each key receives.

An eager forward materialises every layer's ``(B, H, N, N)`` probabilities and, with ``output_attentions``, keeps
them all (and autograd keeps them again for the backward): at 8k tokens that is gigabytes per layer. Most
methods read far less (their ``needs`` in :mod:`attnlens.methods.registry`): rows of the explained queries
(raw attention, Grads, AGrad, AttCAT's ``alpha="cls"``) or the attention each key receives (AttCAT). Under
:func:`recording`, every attention layer of a model that dispatches through transformers' attention interface
runs :func:`row_attention`: SDPA computes the layer's output without materialising the maps, the kept rows are
recomputed from the queries and keys (``softmax(q_r Kᵀ · scale + mask_r)``, as eager attention computes them) and
their values replace the rows' outputs, so the rows sit in the graph and the backward reaches them; the
received attention is summed over query chunks without a graph. Nothing of size ``H × N × N`` outlives one
chunk; methods that read every layer's head-mean map (rollout, flow) get it assembled from the chunks, ``N × N``
per layer rather than ``H × N × N``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

IMPLEMENTATION = "attnlens_rows"  # the name it is registered under in transformers' attention interfaces
# elements of one chunk of probabilities recomputed and reduced at once (4 MiB in float32: below the allocator's
# threshold for long inputs, so the chunks' temporaries reuse the heap's blocks; allocator.py)
CHUNK_ELEMENTS = 2**20
# the same in a backward that recomputes the probabilities to apply LRP rules (lrp/state.py): each chunk adds a
# rank-q update to the whole keys' and values' gradients, so larger chunks (16 MiB) read and write those less often
BACKWARD_CHUNK_ELEMENTS = 2**22
# both on an accelerator (64 MiB in float32): each chunk's kernels are launched one at a time from Python, and at
# the CPU's sizes the launches, not the kernels, took the time (a 4,096-token prompt: ~150 chunks per layer)
DEVICE_CHUNK_ELEMENTS = 2**24
UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux", "sinks", "head_mask")  # not reproduced here


def chunk_elements(device: torch.device | str, backward: bool = False) -> int:
    """Elements of one chunk of probabilities recomputed at once on ``device``: :data:`CHUNK_ELEMENTS` (in a
    backward applying LRP rules, :data:`BACKWARD_CHUNK_ELEMENTS`) on the CPU, :data:`DEVICE_CHUNK_ELEMENTS` on an
    accelerator."""
    if torch.device(device).type != "cpu":
        return DEVICE_CHUNK_ELEMENTS
    return BACKWARD_CHUNK_ELEMENTS if backward else CHUNK_ELEMENTS


class RowAttentionUnsupported(RuntimeError):
    """A layer's attention has a feature :func:`row_attention` does not reproduce (softcapping, a position bias,
    attention sinks, a head mask): the caller falls back to eager attention with the whole maps."""


@dataclass
class LayerFactors:
    """What one attention layer's maps are recomputed from.

    ``query`` ``(B0, H, N, d)``, ``key`` ``(B0, KV, N, d)`` (``KV`` key heads, each serving ``groups`` query heads),
    the layer's ``mask`` (as the attention function received it), ``causal`` and ``scale``; with gradients,
    ``value`` ``(B0, KV, N, d)`` and ``output`` ``(B0, H, N, d)``: the attention output in the pass's graph, whose
    gradient the backward takes. ``B0`` is the forward's batch (1 for a generation's prefixes).
    """

    query: torch.Tensor
    key: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    scale: float
    groups: int = 1
    value: torch.Tensor | None = None
    output: torch.Tensor | None = None


@dataclass
class RowRecorder:
    """What one forward keeps.

    ``rows``: ``(R,)`` query positions whose attention rows are kept (``None``: none); ``received_weights``:
    ``(B', Q)`` weights over the query rows (each output row's real queries, summing to 1) of the received
    attention (``None``: not reduced); with a forward batch of one and ``B' > 1`` rows every output row reads the
    one sequence (a generation's prefixes). Filled per layer: ``kept_rows`` ``(B, H, R, K)`` (in the graph) and
    ``received`` ``(B', K)``. ``means``: keep every layer's whole map, mean over heads, in ``mean_maps``
    ``(B, Q, K)`` (no graph). ``factors``: keep what each layer's maps are recomputed from in ``layer_factors``
    (:class:`LayerFactors`; ``factor_grads``: with the values and the attention
    output in the graph, for the maps' gradients).
    """

    rows: torch.Tensor | None = None
    received_weights: torch.Tensor | None = None
    means: bool = False
    factors: bool = False
    factor_grads: bool = False
    kept_rows: list[torch.Tensor] = field(default_factory=list)
    received: list[torch.Tensor] = field(default_factory=list)
    mean_maps: list[torch.Tensor] = field(default_factory=list)
    layer_factors: list[LayerFactors] = field(default_factory=list)
    calls: int = 0
    done: bool = False  # the forward is over: a layer run again (recomputed for the backward) records nothing

    def release(self) -> None:
        """Drop the references to what the pass kept (whoever took the lists keeps them). A backward that
        recomputes layers runs them with attnlens' context variables of their forward, which hold this recorder: kept
        tensors that are in the graph would otherwise hold the graph, and the graph the recorder, in a cycle
        through autograd that the garbage collector cannot see (the memory of every such pass, for good)."""
        self.kept_rows, self.received, self.mean_maps, self.layer_factors = [], [], [], []


_ACTIVE: ContextVar[RowRecorder | None] = ContextVar("attnlens_row_recorder", default=None)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(B, KV, N, d)`` key/value heads repeated to the query heads ``(B, KV * groups, N, d)`` (grouped-query
    attention), as eager attention does."""
    if groups == 1:
        return x
    b, kv, n, d = x.shape
    return x[:, :, None].expand(b, kv, groups, n, d).reshape(b, kv * groups, n, d)


def grouped_matmul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, q, m)`` times ``y`` ``(B, KV, m, p)`` per head: ``(B, H, q, p)``, where each of the ``KV``
    heads of ``y`` serves ``H / KV`` consecutive heads of ``x`` (:func:`repeat_kv`'s order), without repeating
    ``y`` (so a backward keeps the key heads, not a copy per query head)."""
    b, h, q, m = x.shape
    kv = y.shape[1]
    if kv == h:
        return torch.matmul(x, y)
    return torch.matmul(x.reshape(b, kv, (h // kv) * q, m), y).reshape(b, h, q, y.shape[-1])


def fused_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 scale: float, causal: bool, grouped: bool = False) -> bool:
    """Whether PyTorch's attention runs a fused kernel (not its math fallback) on these inputs (``grouped``: with
    fewer key heads than query heads, read through ``enable_gqa``, which PyTorch 2.5 and later take)."""
    from torch.nn.attention import SDPBackend

    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return False
    try:
        backend = choose(query, key, value, mask, 0.0, causal, scale=scale, **({"enable_gqa": True} if grouped else {}))
    except (RuntimeError, TypeError):
        return False
    return backend not in (int(SDPBackend.MATH), int(SDPBackend.ERROR))


def _masked_scores(scores: torch.Tensor, mask: torch.Tensor | None, queries: torch.Tensor, causal: bool
                   ) -> torch.Tensor:
    """``scores`` ``(B, H, q, K)`` of the query positions ``queries`` with the layer's mask applied as eager
    attention applies it (an additive float mask, or the dtype's minimum where a boolean mask is False)."""
    if mask is not None:
        m = mask[:, :, queries] if mask.shape[2] > 1 else mask
        if m.dtype == torch.bool:
            return scores.masked_fill(~m, torch.finfo(scores.dtype).min)
        return scores + m
    if causal:  # in place: the scores are the caller's own product
        keys = torch.arange(scores.shape[-1], device=scores.device)
        return scores.masked_fill_(keys[None, :] > queries[:, None], torch.finfo(scores.dtype).min)
    return scores


def masked_scores(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, queries: torch.Tensor,
                  causal: bool, scale: float) -> torch.Tensor:
    """The softmax's input ``(B, H, q, K)`` at the query positions ``queries``: ``q Kᵀ · scale`` with the mask
    applied as eager attention applies it (``key`` one per key head, each serving its group of query heads, or
    one per query head)."""
    scores = grouped_matmul(query[:, :, queries] * scale, key.transpose(2, 3))  # scaled on the q rows, not q × K
    return _masked_scores(scores, mask, queries, causal)


def keys_seen(stop: int, keys: int, causal: bool, mask: torch.Tensor | None) -> int:
    """How many leading keys the query rows before ``stop`` can see: ``stop`` where causality alone masks (no
    mask), else all ``keys``; the keys after them have probability 0 (and gradient 0) in every such row."""
    return stop if causal and mask is None else keys


def zero_padded(x: torch.Tensor, keys: int) -> torch.Tensor:
    """``x`` ``(..., k')`` over the first k' keys (:func:`keys_seen`), as ``(..., keys)`` with zeros after."""
    return x if x.shape[-1] == keys else nn.functional.pad(x, (0, keys - x.shape[-1]))


def probabilities(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, queries: torch.Tensor,
                  causal: bool, scale: float) -> torch.Tensor:
    """Softmax attention ``(B, H, q, K)`` of the query positions ``queries`` (the softmax in float32 at least,
    as eager attention computes it; a float64 model's in float64)."""
    scores = masked_scores(query, key, mask, queries, causal, scale)
    return torch.softmax(scores, dim=-1, dtype=softmax_dtype(query.dtype)).to(query.dtype)


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention probabilities are computed in: float32, or float64 for a float64 model (half-precision
    models' eager attention takes its softmax in float32; a float64 model's would lose digits there)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _received(recorder: RowRecorder, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
              causal: bool, scale: float) -> torch.Tensor:
    """``(B', K)``: Σ_q w[q] · mean_h A[h, q, k], over chunks of query rows (no graph, no ``N × N`` map)."""
    weights = recorder.received_weights
    b, h, n, _ = query.shape
    step = max(1, chunk_elements(query.device) // max(1, b * h * key.shape[2]))
    total = None
    with torch.no_grad():
        for start in range(0, n, step):
            queries = torch.arange(start, min(n, start + step), device=query.device)
            mean = probabilities(query, key, mask, queries, causal, scale).mean(1)  # (B, q, K)
            part = torch.einsum("bq,bqk->bk", weights[:, queries].to(mean.dtype), mean.expand(len(weights), -1, -1))
            total = part if total is None else total + part
    return total


def _fused_with_normalisers(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                            dropout: float) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The fused attention kernel SDPA runs for this layer, called so that it also returns each query row's
    log-normaliser: PyTorch's fused CPU kernel (float32 or float64) or, on CUDA in float32, the memory-efficient
    kernel. Only where no mask goes beyond causality, without dropout, with one head size (the normaliser
    rides on the queries in their dtype) and as many keys as queries; the CPU's kernel takes key heads that each
    serve a group of query heads, CUDA's one key head per query head; ``None`` otherwise. The callable takes
    ``(query, key, value, causal, scale)`` and returns ``(output, log_normalisers)``."""
    fits = mask is None and dropout == 0.0 and key.shape == value.shape and query.shape[0] == key.shape[0]
    fits = fits and query.shape[2:] == key.shape[2:] and query.shape[1] % key.shape[1] == 0
    if not fits:
        return None
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64):  # takes grouped key heads
        cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
        if cpu is None:
            return None
        return lambda q, k, v, causal, scale: cpu(q, k, v, 0.0, causal, scale=scale)[:2]
    if query.device.type == "cuda" and query.dtype == torch.float32 and query.shape == key.shape:
        efficient = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
        if efficient is None:
            return None

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
            out, lse = efficient(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
            return out, lse[..., : q.shape[2]]  # the kernel pads the normalisers to a multiple of 32 rows

        return run
    return None


def _head_size_multiple(device: torch.device) -> int:
    """What the head size of :func:`_received_fused`'s attention is rounded up to: CUDA's memory-efficient kernel
    takes multiples of 8 (of 4 in float32; 8 keeps the rows aligned either way)."""
    return 1 if device.type == "cpu" else 8


def _received_fused(op: Callable[..., tuple[torch.Tensor, torch.Tensor]], weights: torch.Tensor,
                    query: torch.Tensor, key: torch.Tensor, lse: torch.Tensor,
                    causal: bool, scale: float) -> torch.Tensor:
    """``(B', K)``: as :func:`_received`, from one more fused attention instead of every probability.

    ``A[q, k] = exp(scale · q·k − lse[q])``, so the weighted column sum ``Σ_q w[q] A[q, k]`` is an attention from
    each key over the queries: logits ``scale · k·q − lse[q]`` (``−lse`` rides on an extra dimension), whose
    log-normaliser is ``log Σ_q A[q, k]`` and whose output with values ``w[q]`` is that sum's ``w``-weighted share.
    Under causal masking key ``k`` sees the queries ``q ≥ k``: reversing the positions makes that causal again.
    """
    b, h, n, d = query.shape
    rows = weights.shape[0]
    ones = query.new_ones(b, h, n, 1)
    keys = torch.cat([key * scale, ones], -1)
    queries = torch.cat([query, -lse.to(query.dtype)[..., None]], -1)
    multiple = _head_size_multiple(query.device)
    if (d + 1) % multiple:  # zeros after the normaliser's dimension add nothing to the logits
        d = -(-(d + 1) // multiple) * multiple - 1
        keys, queries = (nn.functional.pad(x, (0, d + 1 - x.shape[-1])) for x in (keys, queries))
    # values: every output row's weights over the one sequence, or each sequence's own row
    columns = weights.T[None, None].expand(b, h, n, rows) if b == 1 else weights[:, None, :, None].expand(b, h, n, 1)
    if causal:
        keys, queries, columns = keys.flip(2), queries.flip(2), columns.flip(2)
    keys, queries = keys.contiguous(), queries.contiguous()
    parts, exact = [], torch.promote_types(query.dtype, torch.float32)
    with torch.no_grad():
        for start in range(0, columns.shape[-1], d + 1):
            block = columns[..., start: start + d + 1]
            values = torch.nn.functional.pad(block.to(query.dtype), (0, d + 1 - block.shape[-1])).contiguous()
            out, norm = op(keys, queries, values, causal, 1.0)
            parts.append(out[..., : block.shape[-1]].to(exact) * norm.to(exact).exp()[..., None])
    total = torch.cat(parts, -1)  # (B, H, K, columns)
    if causal:
        total = total.flip(2)
    total = total.mean(1).to(query.dtype)
    return total.transpose(1, 2)[0] if b == 1 else total[..., 0]


def _head_means(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                scale: float) -> torch.Tensor:
    """``(B, Q, K)``: the layer's attention, mean over heads, built from chunks of query rows (no graph; nothing
    ``H × N × N`` at once)."""
    b, h, n, _ = query.shape
    step = max(1, chunk_elements(query.device) // max(1, b * h * key.shape[2]))
    out = torch.empty(b, n, key.shape[2], dtype=query.dtype, device=query.device)
    with torch.no_grad():
        for start in range(0, n, step):
            queries = torch.arange(start, min(n, start + step), device=query.device)
            out[:, start: start + len(queries)] = probabilities(query, key, mask, queries, causal, scale).mean(1)
    return out


def row_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """One attention layer (transformers' attention-interface signature) by SDPA, keeping what the active
    :class:`RowRecorder` asks for. Returns ``(B, Q, H, d)`` outputs and no probabilities."""
    recorder = _ACTIVE.get()
    bad = unsupported(kwargs)
    if recorder is None or bad:
        raise RowAttentionUnsupported(f"attention with {', '.join(bad) or 'no recorder'}")
    record = not recorder.done
    recorder.calls += record
    groups = getattr(module, "num_key_value_groups", 1)
    own_key, own_value = key, value  # one per key head (grouped-query attention)
    causal, scale = causal_and_scale(module, query, attention_mask, is_causal, scaling)
    normalisers = recorder.received_weights is not None and record and not recorder.means
    # grouped key heads read as they are where the kernel takes them, so the backward keeps no copy per query head
    grouped = groups > 1 and fused_kernel(query, key, value, attention_mask, scale, causal, grouped=True)
    if grouped and normalisers and _fused_with_normalisers(query, key, value, attention_mask, dropout) is None \
            and _fused_with_normalisers(query, query, query, attention_mask, dropout) is not None:
        grouped = False  # the kernel returning the normalisers would run with a key head per query head (CUDA's)
    if groups > 1 and not grouped:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    fused = _fused_with_normalisers(query, key, value, attention_mask, dropout) if normalisers else None
    lse = None
    if fused is not None:  # the kernel SDPA runs, with the rows' log-normalisers for the received sums
        out, lse = fused(query, key, value, causal, scale)
    else:
        out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                         dropout_p=dropout, scale=scale, is_causal=causal,
                                                         **({"enable_gqa": True} if grouped else {}))
    if recorder.rows is not None:
        rows = recorder.rows.to(query.device)
        probs = probabilities(query, key, attention_mask, rows, causal, scale)
        # the kept rows produce their positions' outputs, so the target's gradient reaches them
        out = out.index_copy(2, rows, grouped_matmul(probs, value))
        if record:
            recorder.kept_rows.append(probs)
    if recorder.factors and record:
        grads = recorder.factor_grads
        # copies of views (a fused projection's slices) so that the projection's output is not kept whole
        recorder.layer_factors.append(LayerFactors(
            query.detach().contiguous(), own_key.detach().contiguous(), attention_mask, causal, scale, groups,
            value=own_value.detach().contiguous() if grads else None, output=out if grads else None))
    if recorder.means and record:
        recorder.mean_maps.append(_head_means(query, key, attention_mask, causal, scale))
    if recorder.received_weights is not None and record:
        weights = recorder.received_weights
        # with the head-mean map at hand, the received attention is its weighted column sum (no second softmax)
        if recorder.means:
            received = torch.einsum("bq,bqk->bk", weights.to(query.dtype),
                                    recorder.mean_maps[-1].expand(len(weights), -1, -1))
        elif lse is not None:
            heads = repeat_kv(key.detach(), query.shape[1] // key.shape[1])  # no graph: a temporary
            received = _received_fused(fused, weights, query.detach(), heads, lse.detach(), causal, scale)
        else:
            received = _received(recorder, query, key, attention_mask, causal, scale)
        recorder.received.append(received)
    return out.transpose(1, 2).contiguous(), None


def unsupported(kwargs: dict[str, Any]) -> list[str]:
    """The attention features among a layer's keyword arguments that SDPA stand-ins do not reproduce."""
    return [k for k in UNSUPPORTED_KWARGS if kwargs.get(k) is not None]


def causal_and_scale(module: nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None,
                     is_causal: bool | None, scaling: float | None) -> tuple[bool, float]:
    """Whether SDPA masks the layer causally by itself (no mask given, more than one query), and its scale, as
    the attention interface's arguments and the module say."""
    causal = (is_causal if is_causal is not None else getattr(module, "is_causal", True)) \
        and query.shape[2] > 1 and attention_mask is None
    return causal, scaling if scaling is not None else query.shape[-1] ** -0.5


def register_implementation(name: str, function: Any) -> str:
    """Register ``function`` as attention implementation ``name`` in transformers' attention interface, with
    SDPA's masks (boolean, or none where causality alone masks); returns ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


def registered() -> str:
    """:data:`IMPLEMENTATION`, registered in transformers' attention and attention-mask interfaces."""
    return register_implementation(IMPLEMENTATION, row_attention)


def dispatches_attention(model: nn.Module) -> bool:
    """Whether ``model``'s attention layers run whatever function its config's attention implementation names
    (transformers' attention interface), so :func:`row_attention` can stand in for them."""
    return bool(getattr(type(model), "_supports_attention_backend", False))


def softcaps(model: nn.Module) -> bool:
    """Whether ``model``'s attention softcaps its logits (Gemma 2), which the fused paths do not reproduce."""
    return getattr(getattr(model, "config", None), "attn_logit_softcapping", None) is not None


def rows_unsupported(model: nn.Module) -> str | None:
    """Why :func:`row_attention` cannot stand in for ``model``'s attention, as far as its class and config tell
    before any pass (so that a pass planned fused does not run eager), or ``None``: the model must dispatch its
    attention through transformers' interface, and its attention logits must not be softcapped (Gemma 2)."""
    if not dispatches_attention(model):
        return "it does not run transformers' attention interface"
    if softcaps(model):
        return "its attention logits are softcapped"
    return None


@contextmanager
def recording(recorder: RowRecorder) -> Iterator[RowRecorder]:
    """Within the block, :func:`row_attention` records into ``recorder`` (the model must be switched to
    :func:`registered`'s implementation, e.g. by ``explaining(model, registered())``)."""
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)
