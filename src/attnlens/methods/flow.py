"""Attention flow (Abnar & Zuidema, ACL 2020): max-flow through the layered graph of rollout matrices.

Nodes are the tokens of every layer; the edge from token ``i`` of layer ``l`` down to token ``j`` of layer ``l-1``
has capacity ``Â^l[i, j]`` with ``Â^l = 0.5 mean_h A^l + 0.5 I`` (residual-augmented attention, restricted to
the real tokens). A token's score is the maximum flow from the explained node of the top layer to that token
at the input layer; the scores of one example are normalised to sum to 1.

The values are the exact max-flows of the graph with integer capacities ``round(Â * FLOW_SCALE)``. Rounding
moves each capacity by at most ``0.5 / FLOW_SCALE`` (4.7e-10), so a flow value is off by at most
``(edges in its minimum cut) * 0.5 / FLOW_SCALE``: below 1e-4 (absolute, before the normalisation) for 128
tokens and 12 layers, and usually far less.

Speed: one max-flow per input token on the full graph (L n^2 edges) costs 25 s for 512 tokens x 6 layers.
Instead each value is sandwiched between two integers that are cheap to get and usually equal:
- an upper bound, the cheapest "token chain" cut (:func:`_chain_bound`, O(L n^2) for all sinks together): in
  trained and random attention the minimum cut is the source's edges (value 1), the sink's in-edges (its column
  sum), or, for a few tokens, the edges into the sink token's chain ``(l, j)`` from every other token;
- a lower bound, the max-flow of a sparse subgraph (scipy's Dinic on ~25 edges per node instead of n): the full
  rows of the tokens that carry the rollout from the source, the largest edges of every row and column, and
  every edge into the sink's chain. Any flow of a subgraph is a flow of the graph.
Where they differ, larger subgraphs and then the full graph decide, so the result is always the full graph's
integer max-flow, bit for bit.

scipy's max-flow holds the GIL, so threads cannot share the sinks; from ``PARALLEL_FROM`` tokens on, forked
processes do (the option ``workers``, by default the cores torch computes on). Each sink's value is computed
alone, so the scores do not depend on how many processes shared them.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import numpy as np
import torch
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from ..core.forked import map_chunks, usable_cores, why_not_forked
from ..core.memory import model_dims
from .attention import rollout_matrices
from .registry import ATTENTION_MEANS, MethodOutput, check_integer, register

FLOW_SCALE = 2**30  # integer capacity of a weight of 1; total flow <= FLOW_SCALE < 2**31 (scipy uses int32)
# Work per example = sources x sinks x nodes below the source (one sparse max-flow per sink); measured about
# 1.5e-6 s per unit (512 tokens x 6 layers = 1.3e6: ~2 s, bench/lrp_flow_speed.py --flow-lengths, 2 shared CPU
# cores), so 3e6 is ~5 s: one source passes quietly up to ~770 tokens x 6 layers; uniform query weights (one
# source per token) warn from ~85 tokens x 6 layers. k processes sharing the max-flows allow k times the work.
SLOW_WORK = 3e6


def flow_matrices(attentions: list[torch.Tensor] | np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
    """One example's rollout matrices (:func:`~attnlens.methods.attention.rollout_matrices`, in float64)
    restricted to the kept (real) tokens: ``(L, n, n)``.

    ``attentions`` is a list of L ``(H, N, N)`` tensors (or an array ``(L, H, N, N)``); ``keep`` a boolean mask
    ``(N,)`` of the tokens to keep (default: all).
    """
    mats = rollout_matrices((torch.as_tensor(a).detach().cpu() for a in attentions), torch.float64)
    out = torch.stack(mats).numpy()
    return out if keep is None else out[:, keep][:, :, keep]


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


def _chain_bound(caps: np.ndarray, source: int) -> np.ndarray:
    """Integer capacity of the cheapest "token chain" cut to every input token: an upper bound on each max-flow.

    ``F_k(j)`` bounds the flow from the source into token j of layer k: cut the source edges (``sum a``), or cut
    every edge into ``(k, j)`` from another token plus either the diagonal edge ``(k+1, j) -> (k, j)`` or, by
    recursion, a cut above ``(k+1, j)``. Two layers below the source the exact value is known (each middle node
    is one path: ``sum_u min(a_u, Â[u, j])``), so for two layers the bound is the max-flow itself.
    """
    n_layers = caps.shape[0]
    a = caps[n_layers - 1][source]
    bound = np.minimum(a[:, None], caps[n_layers - 2]).sum(axis=0)
    for k in range(n_layers - 3, -1, -1):
        diag = np.diagonal(caps[k])
        bound = np.minimum(caps[k].sum(axis=0) - diag + np.minimum(diag, bound), a.sum())
    return bound


def _kept_edges(mats: np.ndarray, source: int, rows: int, per_row: int) -> np.ndarray:
    """Edge mask ``(L, n, n)`` of a sparse subgraph likely to carry a maximum flow: the full rows of the ``rows``
    tokens that carry most of the rollout from the source in each layer, and the ``per_row`` largest edges of
    every row and of every column."""
    n_layers, n, _ = mats.shape
    keep = np.zeros(mats.shape, dtype=bool)
    mass = mats[n_layers - 1][source]
    for layer in range(n_layers - 1, 0, -1):  # nodes of layer `layer` have the out-edges mats[layer - 1]
        keep[layer - 1][_largest(mass, rows, axis=0)] = True
        mass = mass @ mats[layer - 1]
    np.put_along_axis(keep, _largest(mats, per_row, axis=2), True, axis=2)
    np.put_along_axis(keep, _largest(mats, per_row, axis=1), True, axis=1)
    return keep


def _largest(values: np.ndarray, k: int, axis: int) -> np.ndarray:
    """Indices of the ``k`` largest values along ``axis``, in no particular order (all of them if fewer)."""
    size = values.shape[axis]
    if k >= size:
        return np.indices(values.shape)[axis]
    return np.take(np.argpartition(-values, k - 1, axis=axis), np.arange(k), axis=axis)


class _Subgraph:
    """CSR arrays of the layered graph (as :func:`_flow_graph`) over the kept edges and the sink's token chain.

    The sink token of every layer above the input is a node of its own (``chain[b]``, numbered after the
    sink), with every edge into it and out of it; the sink token's ordinary node in each layer is cut off (its
    in-edges get capacity 0). So the graph's structure is the same for every sink: :meth:`max_flow` only writes
    the capacities, and node numbers rise along every row, so the indices stay sorted as scipy's max-flow wants
    them. Every edge into the chain is kept because the chain cut saturates them all; the chain's own
    out-edges (``n`` per layer) add little. The graph is a subgraph of the full one, so its max-flow is a lower
    bound of the full graph's."""

    def __init__(self, caps: np.ndarray, source: int, keep: np.ndarray):
        n_layers, n, _ = caps.shape
        self.caps, self.source, self.n = caps, source, n
        blocks = n_layers - 1  # block b holds the nodes of layer L-1-b; their out-edges are caps[L-2-b]
        self.sink = 1 + blocks * n
        chain = self.sink + 1 + np.arange(blocks)
        self.size = int(chain[-1]) + 1
        counts, indices, data = [[n + 1]], [1 + np.arange(n), chain[:1]], [caps[-1][source], [0]]
        # per block above layer 1: (its layer, the positions of its rows' edges into the chain one layer down,
        # and its kept edges' positions sorted by column with the column pointers)
        self.blocks: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        pos = n + 1
        for b in range(blocks - 1):
            layer, below = n_layers - 2 - b, 1 + (b + 1) * n
            mask = np.concatenate([keep[layer], np.ones((n, 1), dtype=bool)], axis=1)  # the chain edge is last
            r, c = np.nonzero(mask)
            to_chain = c == n
            c = np.minimum(c, n - 1)
            indices.append(np.where(to_chain, chain[b + 1], below + c))
            data.append(np.where(to_chain, 0, caps[layer][r, c]))
            counts.append(mask.sum(axis=1))
            kept = np.flatnonzero(~to_chain)
            pointers = np.concatenate([[0], np.cumsum(np.bincount(c[kept], minlength=n))])
            self.blocks.append((layer, pos + np.flatnonzero(to_chain), pointers,
                                pos + kept[np.argsort(c[kept], kind="stable")]))
            pos += len(r)
        counts += [np.ones(n, dtype=np.int64), [0]]  # layer 1 -> the sink; the sink has no out-edges
        indices.append(np.full(n, self.sink))
        data.append(np.zeros(n, dtype=np.int64))
        self.bottom = pos + np.arange(n)
        pos += n
        self.chain_rows: list[int] = []  # chain[b]: edges to every token one layer down, then to chain[b + 1]
        for b in range(blocks - 1):
            counts.append([n + 1])
            indices += [1 + (b + 1) * n + np.arange(n), chain[b + 1:b + 2]]
            data.append(np.zeros(n + 1, dtype=np.int64))
            self.chain_rows.append(pos)
            pos += n + 1
        counts.append([1])  # the last chain node (the sink token in layer 1): its edge to the sink
        indices.append([self.sink])
        data.append([0])
        self.chain_bottom = pos
        self.indices = np.concatenate(indices).astype(np.int32)
        self.data = np.concatenate(data).astype(np.int32)
        self.indptr = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int32)

    def max_flow(self, sink_token: int) -> int:
        """Integer max-flow from the source to input token ``sink_token`` within the subgraph."""
        j, caps, n = sink_token, self.caps, self.n
        data = self.data.copy()
        data[j], data[n] = 0, caps[-1][self.source, j]  # the source's edge goes to chain[0]
        for (layer, into, pointers, by_column), start in zip(self.blocks, self.chain_rows, strict=True):
            data[by_column[pointers[j]:pointers[j + 1]]] = 0  # the sink token's own node is cut off
            data[into] = caps[layer][:, j]
            data[start:start + n] = caps[layer][j]
            data[start + j], data[start + n] = 0, caps[layer][j, j]
        data[self.bottom] = caps[0][:, j]
        data[self.bottom[j]], data[self.chain_bottom] = 0, caps[0][j, j]
        graph = csr_matrix((data, self.indices, self.indptr), shape=(self.size, self.size))
        return int(maximum_flow(graph, 0, self.sink, method="dinic").flow_value)


# Subgraphs tried before the full graph: (full rows of the tokens carrying most rollout, largest edges per row/column)
SUBGRAPHS = ((16, 4), (32, 8), (64, 16))
# Below this many tokens one max-flow per sink on the full graph is cheaper than the subgraph attempts (measured
# on minilm-imdb attention: full graph 14 ms vs 47 ms at 32 tokens, 1.05 s vs 1.22 s at 192; the sandwich wins
# from ~224 tokens on: 1.8 s vs 2.3 s at 256, 2.1 s vs 28 s at 512).
SANDWICH_FROM = 224
# From this many tokens on the sinks' max-flows are shared among processes: a fork costs ~25 ms, and at 128 tokens
# x 6 layers two processes took 0.17-0.20 s against 0.21 s in one.
PARALLEL_FROM = 192


def flow_from(mats: np.ndarray, source: int, workers: int = 1) -> np.ndarray:
    """Max-flow values ``(n,)`` from token ``source`` of the top layer to every token of the input layer.

    ``mats`` is ``(L, n, n)``: ``mats[l-1] = Â^l``, rows are queries (the upper layer's tokens). Not normalised.

    Exact (the integer max-flow of the module docstring), computed by sandwiching: the chain-cut upper bound of
    :func:`_chain_bound` against the max-flow of a sparse subgraph (a lower bound: any flow there is a flow of
    the full graph). Where the two integers are equal, that is the max-flow; the few sinks left go to a larger
    subgraph, then to the full graph. From ``PARALLEL_FROM`` tokens on, the sinks are shared among ``workers``
    processes (:func:`~attnlens.core.forked.map_chunks`); the values do not depend on it.
    """
    n_layers, n, _ = mats.shape
    if n_layers == 1:  # a single edge from the source to each sink
        return mats[0, source].copy()
    caps = np.rint(mats * FLOW_SCALE).astype(np.int64)
    out = _chain_bound(caps, source)
    if n_layers == 2:  # exact: every path source -> (1, i) -> sink is its own chain
        return out / FLOW_SCALE
    parts = workers if n >= PARALLEL_FROM else 1
    chunks = [np.arange(k, n, parts) for k in range(parts)]  # interleaved: hard sinks cluster by position
    flows = map_chunks(partial(_exact_flows, mats, caps, source, out), chunks, parts)
    for chunk, values in zip(chunks, flows, strict=True):
        out[chunk] = values
    return out / FLOW_SCALE


def _exact_flows(mats: np.ndarray, caps: np.ndarray, source: int, bound: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """The integer max-flows from ``source`` to the input tokens ``sinks``, given their chain-cut upper bounds
    ``bound`` (indexed by token): subgraphs first (from ``SANDWICH_FROM`` tokens on), then the full graph."""
    n = mats.shape[1]
    out = bound[sinks].copy()
    todo = np.arange(len(sinks))  # positions in `sinks` whose max-flow is not known yet
    for rows, per_row in SUBGRAPHS if n >= SANDWICH_FROM else ():
        if not len(todo):
            break
        sub = _Subgraph(caps, source, _kept_edges(mats, source, rows, per_row))
        todo = np.array([i for i in todo if sub.max_flow(int(sinks[i])) != out[i]], dtype=np.int64)
    if len(todo):
        data, indices, indptr, sink = _flow_graph(mats, source)
        caps1 = caps[0].astype(np.int32)
        for i in todo:  # one compiled max-flow per remaining input token on the full graph
            data[-n:] = caps1[:, sinks[i]]
            graph = csr_matrix((data, indices, indptr), shape=(sink + 1, sink + 1))
            out[i] = maximum_flow(graph, 0, sink, method="dinic").flow_value
    return out


def attention_flow(mats: np.ndarray, weights: np.ndarray, workers: int = 1) -> np.ndarray:
    """Normalised flow scores ``(n,)``: ``sum_q weights[q] * flow_from(q) / sum(flow_from(q))``.

    ``weights`` ``(n,)`` are the explained query row's weights (one-hot at the classification token, or uniform
    over real tokens for encoder streams explained as a whole). ``workers``: processes sharing the max-flows.
    """
    n_layers, n, _ = mats.shape
    sources = np.flatnonzero(weights)
    work = len(sources) * n * (n_layers - 1) * n
    sharing = max(1, workers) if why_not_forked() is None else 1  # processes that will share the max-flows
    if work > SLOW_WORK * sharing:
        warnings.warn(
            f"attention flow on {n} tokens x {n_layers} layers from {len(sources)} source node(s) needs "
            f"{len(sources) * n} max-flow runs on graphs of about {25 * (n_layers - 1) * n} edges; "
            "this may take minutes",
            stacklevel=3,
        )
    out = np.zeros(n)
    for q in sources:
        flows = flow_from(mats, int(q), workers)
        total = flows.sum()
        if total > 0:
            out += weights[q] * flows / total
    return out


def _check_flow(workers: int | None = None) -> None:
    """Attention flow's option values."""
    check_integer("flow", "workers", workers, 1, none=True)


# bytes held per edge of an input's graph (layer x token x token) while its flows run: the float64 rollout
# matrices, their int64 capacities, the bounds' temporaries and, where a bound does not decide, the full graph
# with the residual one scipy builds (measured 51-68 bytes at 512 tokens x 12 layers on BERT- and Llama-sized
# models, peak RSS; rounded up)
FLOW_BYTES_PER_EDGE = 96


def _flow_memory(model: Any, stream: str, n: int) -> int:
    """What one input's flows hold beside the shared pass at ``n`` tokens (the layers of an encoder-decoder's
    two stacks counted together: an upper bound for one stream)."""
    return FLOW_BYTES_PER_EDGE * model_dims(model).layers * n * n


@register(
    "flow",
    needs={ATTENTION_MEANS},
    summary="attention flow: max-flow from the explained token through the residual-augmented attention graph",
    citation="Abnar & Zuidema, Quantifying Attention Flow in Transformers, ACL 2020",
    class_specific=False,
    self_attention_only=True,
    check=_check_flow,
    own_memory=_flow_memory,
)
def compute(ctx, workers: int | None = None) -> MethodOutput:
    """Attention flow of every explained row.

    ``workers``: processes that share an input's max-flows from ``PARALLEL_FROM`` tokens on (forked on Linux,
    from the main thread; elsewhere they run here). Default: the CPU cores torch computes on. The scores do not
    depend on it.
    """
    _check_flow(workers)
    workers = usable_cores() if workers is None else workers
    cap = ctx.capture
    key_mask = cap.key_mask.bool().cpu().numpy()
    weights = cap.query_weights.detach().double().cpu().numpy()
    scores = torch.zeros(cap.key_mask.shape, dtype=torch.float32)
    for b in range(len(key_mask)):
        keep = key_mask[b]
        mats = flow_matrices([m[b][None] for m in cap.head_means()], keep)  # one "head": the mean
        w = weights[b][keep]
        scores[b, torch.from_numpy(np.flatnonzero(keep))] = torch.from_numpy(attention_flow(mats, w, workers)).float()
    return MethodOutput(scores.to(cap.key_mask.device), None, space="keys")
