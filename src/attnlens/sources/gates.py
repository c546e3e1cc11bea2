"""``attngate``: how much the answer's log-probability depends on the attention paid to each source.

Every source gets a gate ``g_s`` on the attention paid to its tokens, in every layer and head: the key's softmax
weight is multiplied by ``g_s`` and the row renormalised (``log g_s`` added to its logits). ``g = 1`` is the model
as it is; ``g = 0`` hides the source from attention (the ``"mask"`` ablation). The score is the derivative
``∂ log p(answer) / ∂ g_s`` at half-open gates (``gate``, default ½) — for random ablations that keep each source
with probability ½ (ContextCite's design), the first-order estimate of the log-probability a source adds when kept.

Which queries are gated (``queries``):

- ``"after"`` (default): those after the last source token — the query, the template and the answer. The context
  runs once without a graph (fused attention, its keys and values cached); the positions after it run again with
  the gates and are differentiated, so the backward covers a few dozen positions however long the context. The
  context's own representations are left as they are: the score is what the answer reads from each source
  through the question and answer positions.
- ``"all"``: every query, the context's too (one forward and one backward over the whole prompt; where the
  layers' activations would not fit the memory budget, the backward recomputes each layer).

``steps`` > 1 averages the derivatives at ``steps`` gate values spread evenly over (0, 1) (their midpoints: 1/8,
3/8, 5/8, 7/8 for four): a midpoint-rule estimate of the integral of the derivative along the path from closed to
open gates, as integrated gradients takes along its inputs. As the steps grow the scores add up to the answer's
log-probability with every source visible minus with every source hidden; with a few steps they do not (the
log-probability moves fastest just above closed gates). With ``queries="after"`` the context still runs once;
each step adds one forward and backward of the positions after it.

The gates' logarithm rides on one extra dimension of the queries and keys (``q' = [q, 1]``,
``k' = [k, log g / scale]``), so attention stays fused and no ``N × N`` mask is built. Where the model softcaps
its attention logits (Gemma 2), the gates must act after the cap: the gated queries' attention is computed as eager
attention computes it, which ``queries="after"`` keeps to a few rows (``queries="all"`` is refused there).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch
from torch import nn

from ..core.answer_engine import answer_logprob
from ..core.batching import keeps_logits
from ..core.memory import (
    Storage,
    gradient_pass_storage,
    model_dims,
    parse_budget,
    pass_row_bytes,
    readable_size,
)
from ..core.modelstate import explaining
from ..core.recomputing import recomputing
from ..core.row_attention import (
    RowAttentionUnsupported,
    causal_and_scale,
    dispatches_attention,
    register_implementation,
    repeat_kv,
    softcaps,
    softmax_dtype,
    unsupported,
)
from ..errors import InputError
from .ablation import CiteJob
from .methods import source_method

__all__ = ["IMPLEMENTATION", "gated_attention", "gating", "source_gate_gradients", "ungateable"]

IMPLEMENTATION = "attnlens_gates"  # the name it is registered under in transformers' attention interfaces
_LOG_GATES: ContextVar[tuple[torch.Tensor, bool] | None] = ContextVar("attnlens_log_gates", default=None)


def gated_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """One attention layer (transformers' attention-interface signature) by SDPA with the active per-key log-gates
    (:func:`gating`) added to every query's logits. Returns ``(B, Q, H, d)`` outputs and no probabilities."""
    active = _LOG_GATES.get()
    softcap = kwargs.get("softcap")
    bad = [k for k in unsupported(kwargs) if k != "softcap"]
    if active is None or bad:
        raise RowAttentionUnsupported(f"gated attention with {', '.join(bad) or 'no gates'}")
    log_gates, batched = active
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    b, h, n, _ = query.shape
    keys = key.shape[2]
    if batched and log_gates.shape[0] != b:
        raise RowAttentionUnsupported(f"{log_gates.shape[0]} rows of gates for a batch of {b}")
    if log_gates.dim() - batched >= 2:  # one row of gates per layer (and head)
        layer = getattr(module, "layer_idx", None)
        if layer is None or layer >= log_gates.shape[int(batched)]:
            raise RowAttentionUnsupported("per-layer gates on attention modules that do not know their layer")
        log_gates = log_gates[:, layer] if batched else log_gates[layer]
    if kwargs.get("sliding_window") is not None and keys < log_gates.shape[-1]:
        log_gates = log_gates[..., -keys:]  # a cache that keeps a sliding window holds the last positions alone
    if log_gates.shape[-1] != keys or (log_gates.dim() - batched == 2 and log_gates.shape[-2] != h):
        raise RowAttentionUnsupported(f"gates of shape {tuple(log_gates.shape)} for {h} heads and {keys} keys")
    log_gates = log_gates.reshape(b if batched else 1, -1, keys)  # (batch or 1, heads or 1, keys)
    causal, scale = causal_and_scale(module, query, attention_mask, is_causal, scaling)
    if softcap is not None:
        return _softcapped(query, key, value, attention_mask, log_gates, scale, causal, float(softcap)), None
    gates = (log_gates / scale).to(key.dtype)[..., None].expand(b, h, keys, 1)
    query = torch.cat([query, query.new_ones(b, h, n, 1)], -1)
    key = torch.cat([key, gates], -1)
    value = torch.cat([value, value.new_zeros(b, h, keys, 1)], -1)  # fused kernels take one head size
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                     scale=scale, is_causal=causal)[..., :-1]
    return out.transpose(1, 2).contiguous(), None


def _softcapped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                log_gates: torch.Tensor, scale: float, causal: bool, softcap: float) -> torch.Tensor:
    """``(B, Q, H, d)``: attention whose logits are softcapped (``cap · tanh(logits / cap)``, Gemma 2's) before the
    mask and the gates are added, as eager attention computes it (the gates must act after the cap, so they
    cannot ride on the fused kernel's dot products). Its ``H × Q × K`` scores exist at once: the gated passes keep
    the queries few (``queries="after"``)."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    q, k = scores.shape[-2:]
    if mask is None and causal:  # the last q of k positions
        mask = torch.ones(q, k, dtype=torch.bool, device=scores.device).tril(k - q)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    scores = scores + log_gates.to(scores.dtype)[:, :, None]
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype(scores.dtype)).to(value.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def ungateable(model: nn.Module) -> str | None:
    """Why :func:`gated_attention` cannot stand in for ``model``'s attention, or ``None`` where it can: the model
    must run its attention through transformers' attention interface."""
    if not dispatches_attention(model):
        return "it does not run transformers' attention interface"
    return None


def check_gateable(model: nn.Module) -> None:
    """:class:`InputError` (one line) where :func:`ungateable` gives a reason."""
    why = ungateable(model)
    if why:
        raise InputError(f"attngate cannot gate {type(model).__name__}'s attention ({why}); use at2, loo or "
                         "contextcite")


def registered() -> str:
    """:data:`IMPLEMENTATION`, registered in transformers' attention and attention-mask interfaces."""
    return register_implementation(IMPLEMENTATION, gated_attention)


@contextmanager
def gating(log_gates: torch.Tensor, batched: bool = False) -> Iterator[None]:
    """Within the block, :func:`gated_attention` adds ``log_gates`` ``(K,)`` to every query's logits of each key,
    in every layer (``(L, K)``: row ``l`` in layer ``l``; ``(L, H, K)``: row ``[l, h]`` in head ``h`` of layer
    ``l``). ``batched``: ``log_gates`` has one more, leading axis, one entry per input of the batch."""
    token = _LOG_GATES.set((log_gates, batched))
    try:
        yield
    finally:
        _LOG_GATES.reset(token)


GRANULARITIES = ("source", "layer", "head")
QUERIES = ("all", "after")


def source_gate_gradients(job: CiteJob, gate: float | Sequence[float], queries: str = "all",
                          per: str = "source", record_open: bool = False) -> tuple[np.ndarray, float]:
    """``(∂ log p / ∂ g_s for every source, log p)`` with every source's gate at ``gate``; with several gates, the
    mean of the derivatives at each (every source's gate at that value) and ``log p`` at the first.

    ``per``: ``"source"`` one gate per source, ``(n_sources,)`` derivatives; ``"layer"`` one per layer and source,
    ``(L, n_sources)``; ``"head"`` one per layer, head and source, ``(L, H, n_sources)`` (sums over the extra axes
    give the coarser gates' derivatives). ``queries``: ``"all"`` gates the attention of every query; ``"after"``
    only that of the queries after the last source token (the query, the template and the answer): the context
    runs once without a graph (once for all gates), and the gate values run as one batch (as many as the memory
    budget holds) whose backward covers only those few positions.

    ``record_open``: where the job does not hold the answer's log-probability of the model as it is yet
    (``job.cache["full"]``, which the other methods and the result read), keep it: the log-probability at open
    gates where one of ``gate`` is 1, else, with ``queries="after"``, from one more forward of the positions after
    the context on its cached keys and values (no graph)."""
    points = [float(gate)] if isinstance(gate, (int, float)) else [float(g) for g in gate]
    if not points or not all(0.0 < g <= 1.0 for g in points):
        raise InputError(f"attngate needs gate values in (0, 1], got {points}")
    model = job.runner.model
    if per not in GRANULARITIES or queries not in QUERIES:
        raise InputError(f"per must be one of {', '.join(GRANULARITIES)} and queries one of {', '.join(QUERIES)}; "
                         f"got per={per!r}, queries={queries!r}")
    check_gateable(model)
    record = record_open and "full" not in job.cache
    open_pass = record and _opens_after(queries, points)
    ids = job.prompt.ids + job.prefix_ids + job.answer_ids
    owner = torch.as_tensor(job.token_source + [-1] * (len(ids) - len(job.token_source)))
    inside = owner >= 0
    device = job.runner.device
    config = model.config
    rows = {"source": (), "layer": (int(config.num_hidden_layers),),
            "head": (int(config.num_hidden_layers), int(config.num_attention_heads))}[per]
    k = len(job.answer_ids)
    keep = {"logits_to_keep": k + 1} if keeps_logits(model) else {}
    inputs = torch.tensor([ids], device=device)
    cut, recompute, group = _plan(job, queries, len(points), open_pass)
    context_cache = None
    if cut:  # the context's keys and values, once, without a graph
        with torch.no_grad(), explaining(model, "sdpa"):
            context_cache = model(input_ids=inputs[:, :cut], use_cache=True,
                                  **({"logits_to_keep": 1} if keep else {})).past_key_values
    grads, logprobs = [], []
    for start in range(0, len(points), group):  # a batch of gate values per pass
        batch = points[start:start + group]
        size = len(batch)
        log_gate = torch.tensor([math.log(g) for g in batch], dtype=torch.float32, device=device)
        log_gate = log_gate.reshape(size, *[1] * len(rows), 1).repeat(1, *rows, len(job.sources)).requires_grad_(True)
        per_token = torch.zeros(size, *rows, len(ids), dtype=torch.float32, device=device)
        per_token[..., inside.to(device)] = log_gate[..., owner[inside].to(device)]
        cache: dict[str, Any] = {"use_cache": False}
        if context_cache is not None:  # each pass appends its positions to the cache: all but the last use a copy
            last = start + size == len(points) and not open_pass
            past = context_cache if last else copy.deepcopy(context_cache)
            if size > 1:
                past.batch_repeat_interleave(size)
            cache = {"past_key_values": past, "use_cache": True}
        with torch.enable_grad(), explaining(model, registered()), gating(per_token, batched=True), \
                (recomputing(model, inputs.shape[1] - cut) if recompute else nullcontext()):
            try:
                logits = model(input_ids=inputs[:, cut:].expand(size, -1), **cache, **keep).logits
            except RowAttentionUnsupported as err:
                raise InputError(f"attngate cannot gate {type(model).__name__}'s attention ({err}); use at2, loo "
                                 "or contextcite") from None
            logprob = answer_logprob(job.runner, logits[:, -(k + 1):].float(), job.answer_ids)
            # the batch's inputs do not interact: one backward of the sum gives each its derivatives
            (grad,) = torch.autograd.grad(logprob.sum(), log_gate)
        at = torch.tensor(batch, dtype=grad.dtype, device=device).reshape(size, *[1] * (grad.dim() - 1))
        grads.append(grad / at)  # d/dg = d/d(log g) / g
        logprobs += logprob.detach().tolist()
    if open_pass:  # the model as it is: the positions after the context on its keys and values, no gates
        with torch.no_grad(), explaining(model, "sdpa"):
            logits = model(input_ids=inputs[:, cut:], past_key_values=context_cache, use_cache=True, **keep).logits
        job.cache["full"] = float(answer_logprob(job.runner, logits, job.answer_ids)[0])
    elif record and 1.0 in points:
        job.cache["full"] = logprobs[points.index(1.0)]
    return torch.cat(grads).mean(0).double().cpu().numpy(), logprobs[0]


def _opens_after(queries: str, points: Sequence[float]) -> bool:
    """Whether the answer's log-probability at open gates (``record_open``) takes a pass of its own: the positions
    after the context once more, where the queries after it are gated and no gate value is 1."""
    return queries == "after" and 1.0 not in points


def _plan(job: CiteJob, queries: str, gates: int = 1, open_pass: bool = False) -> tuple[int, bool, int]:
    """``(cut, recompute, group)`` of the gated passes: the first gated query (0: every query is), whether the
    backward recomputes each layer, and how many gate values one pass takes as a batch (with
    ``queries="after"``, as many as the memory budget holds; every query gated: one); :class:`InputError` when
    one gate value's pass would not fit the memory budget, or would gate every query of a model whose softcapped
    attention then runs eager over the whole prompt. ``open_pass``: a forward of the positions after the context
    at open gates follows."""
    if queries == "all" and softcaps(job.runner.model):
        raise InputError(f"attngate with queries='all' cannot gate {type(job.runner.model).__name__}'s softcapped "
                         "attention over the whole prompt; use queries='after' (the default)")
    n = len(job.prompt.ids) + len(job.prefix_ids) + len(job.answer_ids)
    logit_rows = len(job.answer_ids) + 1 if keeps_logits(job.runner.model) else 0
    if queries == "after":
        cut = after_context(job)
        return cut, False, _after_group(job, cut, n - cut, logit_rows, gates, open_pass)
    return 0, _recomputes(job, n, logit_rows), 1


def after_context(job: CiteJob) -> int:
    """The first position ``queries="after"`` gates: the one after the last source token (never past the row that
    predicts the first explained token)."""
    last = max((i for i, s in enumerate(job.token_source) if s >= 0), default=-1)
    return min(last + 1, len(job.prompt.ids) + len(job.prefix_ids) - 1)


def _after_group(job: CiteJob, cut: int, tail: int, logit_rows: int, gates: int = 1,
                 open_pass: bool = False) -> int:
    """How many of ``gates`` gate values one ``queries="after"`` pass takes as a batch within the memory budget:
    a fused forward over the ``cut`` context tokens that keeps every layer's keys and values, then per batch a
    forward + backward over the ``tail`` positions after it for each gate value, on a copy of those keys and
    values per value (the context's own kept while another pass follows: ``open_pass`` or more values), whose
    queries attend to all keys. :class:`InputError` when not even one fits."""
    dims, budget = model_dims(job.runner.model), parse_budget(job.memory_budget)
    n = cut + tail
    cache = 2 * dims.layers * n * dims.hidden * dims.itemsize  # keys and values (fewer with grouped queries)
    context = pass_row_bytes(dims, cut, Storage(eager=False, logit_rows=1))
    after = pass_row_bytes(dims, tail, Storage(eager=False, backward=True, logit_rows=logit_rows))
    scores = 2 * dims.layers * dims.heads * tail * n * dims.itemsize  # the tail's attention and its gradient
    # what the fused attention keeps for its backward: every head's keys and values with the gates' column
    gated = 2 * dims.layers * n * (dims.hidden + dims.heads) * dims.itemsize

    def need(size: int) -> int:
        copies = 1 + size if gates > 1 or open_pass else 1
        return cache * copies + max(context, size * (after + scores + gated))

    if need(1) > budget:
        raise InputError(f"attngate over {n:,} tokens needs about {readable_size(need(1))}, more than the memory "
                         f"budget of {readable_size(budget)} (shorten the context or raise --memory-budget / "
                         "memory_budget=)")
    return next(size for size in range(gates, 0, -1) if need(size) <= budget)


def _recomputes(job: CiteJob, n: int, logit_rows: int) -> bool:
    """Whether the pass gating every query (a fused forward + backward of ``n`` tokens) recomputes each layer in
    the backward (its activations would not fit the memory budget); :class:`InputError` when even that would not
    fit."""
    model = job.runner.model
    dims, budget = model_dims(model), parse_budget(job.memory_budget)
    storage = gradient_pass_storage(dims, n, budget, True, logit_rows)  # recomputing only where it can
    need = pass_row_bytes(dims, n, storage)
    if need > budget:
        raise InputError(f"attngate's forward + backward over {n:,} tokens needs about {readable_size(need)}, more "
                         f"than the memory budget of {readable_size(budget)} (shorten the context or raise "
                         "--memory-budget / memory_budget=)")
    return storage.recompute


def _checked(gate: Any, queries: Any, steps: Any = 1) -> tuple[list[float], str]:
    """The gate values whose derivatives are averaged, and ``queries``; :class:`InputError` on bad options."""
    if isinstance(gate, bool) or not isinstance(gate, (int, float)) or not 0.0 < float(gate) <= 1.0:
        raise InputError(f"attngate: gate must be a number in (0, 1], got {gate!r}")
    if queries not in QUERIES:
        raise InputError(f"attngate: queries must be one of {', '.join(QUERIES)}, got {queries!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"attngate: steps must be an integer >= 1, got {steps!r}")
    if steps > 1 and float(gate) != 0.5:
        raise InputError(f"attngate: with steps={steps} the gates run through the midpoints of (0, 1), so gate "
                         f"cannot be set (got {gate!r})")
    points = [float(gate)] if steps == 1 else [(i + 0.5) / steps for i in range(steps)]
    return points, str(queries)


def _check(job: CiteJob, gate: Any = 0.5, queries: Any = "after", steps: Any = 1) -> None:
    """attngate's options, the model and the memory, before any method of the job runs."""
    points, queries = _checked(gate, queries, steps)
    check_gateable(job.runner.model)
    _plan(job, queries, len(points), open_pass=_opens_after(queries, points))  # the most attngate may run


@source_method("attngate", "Attention gates: the derivative of the answer's log-probability with respect to a gate "
               "on the attention the question and answer pay to the source (every layer and head), at half-open "
               "gates (or averaged along the gates' path from closed to open, steps > 1); one forward of the "
               "context, then one forward and backward of the positions after it for every step at once.",
               "attention-gate gradient (first-order attention masking, after attribution patching: Nanda 2023, "
               "Kramár et al. 2024)",
               # the context's forward + the batched pass after it (queries="all": a whole pass per step)
               forwards=lambda n, steps=1, queries="after", **_: 2 if queries == "after" else steps,
               check=_check, why_not=ungateable, check_values=_checked,
               gate=0.5, queries="after", steps=1)
def attngate(job: CiteJob, gate: float = 0.5, queries: str = "after",
             steps: int = 1) -> tuple[np.ndarray, dict[str, Any]]:
    points, queries = _checked(gate, queries, steps)
    scores, logprob = source_gate_gradients(job, points, queries, record_open=True)
    return scores, ({"gated_logprob": logprob} if steps == 1 else {"gates": points})
