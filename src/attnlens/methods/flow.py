"""Attention flow (Abnar & Zuidema, ACL 2020): max-flow through the layered graph of rollout matrices.

Nodes are the tokens of every layer; the edge from token ``i`` of layer ``l`` down to token ``j`` of layer ``l-1``
has capacity ``Â^l[i, j]`` with ``Â^l = 0.5 mean_h A^l + 0.5 I`` (residual-augmented attention, restricted to
the real tokens). A token's score is the maximum flow from the explained node of the top layer to that token
at the input layer; the scores of one example are normalised to sum to 1.

Max-flow runs in scipy's compiled solver (``scipy.sparse.csgraph.maximum_flow``, Dinic) on integer capacities
``round(Â * FLOW_SCALE)``. Rounding moves each capacity by at most ``0.5 / FLOW_SCALE`` (4.7e-10), so a flow
value is off by at most ``(edges in its minimum cut) * 0.5 / FLOW_SCALE``: below 1e-4 (absolute, before the
normalisation) for 128 tokens and 12 layers, and usually far less.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from .registry import ATTENTION, MethodOutput, register

FLOW_SCALE = 2**30  # integer capacity of a weight of 1; total flow <= FLOW_SCALE < 2**31 (scipy uses int32)
# Work per example = sources x sinks x edges; measured 4e-8 to 1.5e-7 s per unit (2 shared CPU cores), so
# 5e7 is 2 to 7 s: 128 tokens x 6 layers (1e7, 0.4 s) passes quietly, 256 tokens x 6 layers (8.4e7) warns.
SLOW_WORK = 5e7


def rollout_matrices(attentions: list[torch.Tensor] | np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
    """``Â^l = 0.5 mean_h A^l + 0.5 I`` for one example, over the kept (real) tokens: ``(L, n, n)``.

    ``attentions`` is a list of L ``(H, N, N)`` tensors (or an array ``(L, H, N, N)``); ``keep`` a boolean mask
    ``(N,)`` of the tokens to keep (default: all).
    """
    att = np.stack([np.asarray(a.detach().double().cpu() if torch.is_tensor(a) else a, dtype=np.float64)
                    for a in attentions])
    mean = att.mean(axis=1)
    if keep is not None:
        mean = mean[:, keep][:, :, keep]
    n = mean.shape[-1]
    return 0.5 * mean + 0.5 * np.eye(n)[None]


def _flow_graph(mats: np.ndarray, source: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """CSR arrays of the layered graph below the source node; the sink-edge data is filled in per sink.

    Node 0 is the source (token ``source`` of the top layer L), then one block of n nodes per layer L-1 ... 1,
    then the sink. Input-layer tokens other than the sink would be dead ends, so the input layer is reduced to
    the one sink node and its in-edges get the capacities ``Â^1[:, sink]``.
    """
    n_layers, n, _ = mats.shape
    caps = np.rint(mats * FLOW_SCALE).astype(np.int64)
    n_blocks = n_layers - 1  # layers L-1 ... 1
    sink = 1 + n_blocks * n
    indptr = [np.array([0, n])]
    indices = [1 + np.arange(n)]
    data = [caps[n_layers - 1][source]]
    # block b is layer L-1-b; its edges use Â of that layer (index L-2-b) towards block b+1
    for b in range(n_blocks - 1):
        layer = n_layers - 2 - b
        start = indptr[-1][-1]
        indptr.append(start + n * np.arange(1, n + 1))
        indices.append(np.tile(1 + (b + 1) * n + np.arange(n), n))
        data.append(caps[layer].reshape(-1))
    start = indptr[-1][-1]
    indptr.append(start + np.arange(1, n + 1))  # layer-1 nodes: one edge each, to the sink
    indices.append(np.full(n, sink))
    data.append(np.zeros(n, dtype=np.int64))
    indptr.append(np.array([indptr[-1][-1]]))  # the sink has no out-edges
    return (np.concatenate(data).astype(np.int32), np.concatenate(indices).astype(np.int32),
            np.concatenate(indptr).astype(np.int32), sink)


def flow_from(mats: np.ndarray, source: int) -> np.ndarray:
    """Max-flow values ``(n,)`` from token ``source`` of the top layer to every token of the input layer.

    ``mats`` is ``(L, n, n)``: ``mats[l-1] = Â^l``, rows are queries (the upper layer's tokens). Not normalised.
    """
    n_layers, n, _ = mats.shape
    if n_layers == 1:  # a single edge from the source to each sink
        return mats[0, source].copy()
    data, indices, indptr, sink = _flow_graph(mats, source)
    caps1 = np.rint(mats[0] * FLOW_SCALE).astype(np.int32)
    size = sink + 1
    out = np.empty(n)
    for j in range(n):  # one compiled max-flow per input token (the loop is over sinks, not edges)
        data[-n:] = caps1[:, j]
        graph = csr_matrix((data, indices, indptr), shape=(size, size))
        out[j] = maximum_flow(graph, 0, sink, method="dinic").flow_value
    return out / FLOW_SCALE


def attention_flow(mats: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Normalised flow scores ``(n,)``: ``sum_q weights[q] * flow_from(q) / sum(flow_from(q))``.

    ``weights`` ``(n,)`` are the explained query row's weights (one-hot at the classification token, or uniform
    over real tokens for encoder streams explained as a whole).
    """
    n_layers, n, _ = mats.shape
    sources = np.flatnonzero(weights)
    work = len(sources) * n * (n_layers - 1) * n * n
    if work > SLOW_WORK:
        warnings.warn(
            f"attention flow on {n} tokens x {n_layers} layers from {len(sources)} source node(s) needs "
            f"{len(sources) * n} max-flow runs on graphs of {(n_layers - 1) * n * n} edges; this may take minutes",
            stacklevel=3,
        )
    out = np.zeros(n)
    for q in sources:
        flows = flow_from(mats, int(q))
        total = flows.sum()
        if total > 0:
            out += weights[q] * flows / total
    return out


@register(
    "flow",
    needs={ATTENTION},
    summary="attention flow: max-flow from the explained token through the residual-augmented attention graph",
    citation="Abnar & Zuidema, Quantifying Attention Flow in Transformers, ACL 2020",
    class_specific=False,
    self_attention_only=True,
)
def compute(ctx) -> MethodOutput:
    cap = ctx.capture
    atts = torch.stack([a.detach() for a in cap.attentions], dim=1)  # (B, L, H, N, N)
    key_mask = cap.key_mask.bool().cpu().numpy()
    weights = cap.query_weights.detach().double().cpu().numpy()
    scores = torch.zeros(cap.key_mask.shape, dtype=torch.float32)
    for b in range(atts.shape[0]):
        keep = key_mask[b]
        mats = rollout_matrices(atts[b], keep)
        w = weights[b][keep]
        scores[b, torch.from_numpy(np.flatnonzero(keep))] = torch.from_numpy(attention_flow(mats, w)).float()
    return MethodOutput(scores.to(cap.key_mask.device), None, space="keys")
