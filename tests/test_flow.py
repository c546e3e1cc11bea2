"""Attention flow: compiled max-flow against networkx, analytic cases, speed, and the registered method."""

from __future__ import annotations

import sys
import threading
import time
import warnings

import networkx as nx
import numpy as np
import pytest
import torch
from conftest import ENCODERS, make_model

from attnlens import Explainer
from attnlens.errors import InputError
from attnlens.methods import flow
from attnlens.methods.flow import FLOW_SCALE, _chain_bound, attention_flow, flow_from, flow_matrices


@pytest.fixture(autouse=True)
def sandwich_at_every_length(monkeypatch):
    """Inputs shorter than SANDWICH_FROM skip the bounds (plain full-graph max-flows are cheaper there); these
    tests check the bounds' exactness on small graphs, so they use them at every length."""
    monkeypatch.setattr(flow, "SANDWICH_FROM", 0)

def random_mats(rng: np.random.Generator, n_layers: int, n: int, heads: int = 2) -> np.ndarray:
    att = torch.softmax(torch.from_numpy(rng.normal(size=(n_layers, heads, n, n)) * 2.0), -1)
    return flow_matrices(list(att))


def networkx_flows(mats: np.ndarray, source: int) -> np.ndarray:
    """Reference: the full layered graph of Abnar & Zuidema, networkx's max-flow per input token."""
    n_layers, n, _ = mats.shape
    g = nx.DiGraph()
    for layer in range(1, n_layers + 1):
        for i in range(n):
            for j in range(n):
                g.add_edge((layer, i), (layer - 1, j), capacity=float(mats[layer - 1, i, j]))
    return np.array([nx.maximum_flow_value(g, (n_layers, source), (0, j)) for j in range(n)])


@pytest.mark.parametrize("n_layers,n,seed", [(2, 3, 0), (3, 5, 1), (4, 4, 2), (3, 6, 3), (2, 7, 4)])
def test_flow_matches_networkx(n_layers, n, seed):
    rng = np.random.default_rng(seed)
    mats = random_mats(rng, n_layers, n)
    source = int(rng.integers(n))
    ours = flow_from(mats, source)
    ref = networkx_flows(mats, source)
    # integer capacities: each edge is off by <= 0.5/FLOW_SCALE, a cut has < n_layers * n^2 edges
    assert np.abs(ours - ref).max() <= n_layers * n * n / FLOW_SCALE + 1e-12


def full_graph_flows(mats: np.ndarray, source: int) -> np.ndarray:
    """The integer max-flow on the full graph for every sink (the pre-sandwich implementation)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flow, "SUBGRAPHS", ())
        return flow_from(mats, source)


def peaked_mats(rng: np.random.Generator, n_layers: int, n: int, heads: int = 12) -> np.ndarray:
    """Attention shaped like a trained encoder's: every head puts much of its mass on [CLS], [SEP] or a neighbour."""
    logits = rng.normal(size=(n_layers, heads, n, n)) * 1.5
    for h in range(heads):
        target = [0, n - 1, None][h % 3]
        if target is None:
            logits[:, h, np.arange(n - 1), np.arange(1, n)] += 4.0  # attend to the next token
        else:
            logits[:, h, :, target] += 4.0
    return flow_matrices(list(torch.softmax(torch.from_numpy(logits), -1)))


@pytest.mark.parametrize("kind,n_layers,n,seed", [("random", 4, 64, 0), ("peaked", 4, 64, 1), ("random", 6, 72, 2)])
def test_flow_matches_networkx_at_64_tokens(kind, n_layers, n, seed):
    rng = np.random.default_rng(seed)
    mats = random_mats(rng, n_layers, n, heads=12) if kind == "random" else peaked_mats(rng, n_layers, n)
    ours = flow_from(mats, 0)
    sinks = [0, 1, n // 2, n - 1]  # networkx takes seconds per sink at this size: check a few, incl. the source token
    g = nx.DiGraph()
    for layer in range(1, n_layers + 1):
        for i in range(n):
            for j in range(n):
                g.add_edge((layer, i), (layer - 1, j), capacity=float(mats[layer - 1, i, j]))
    ref = np.array([nx.maximum_flow_value(g, (n_layers, 0), (0, j)) for j in sinks])
    np.testing.assert_allclose(ours[sinks], ref, rtol=0, atol=n_layers * n * n / FLOW_SCALE)
    # every sink: bit-identical to the integer max-flow on the full graph, and the chain cut bounds it from above
    full = full_graph_flows(mats, 0)
    np.testing.assert_array_equal(ours, full)
    assert (np.rint(full * FLOW_SCALE) <= _chain_bound(np.rint(mats * FLOW_SCALE).astype(np.int64), 0)).all()


@pytest.mark.parametrize("subgraphs", [(), ((1, 1),), ((2, 1), (4, 2))])
def test_every_path_of_the_sandwich_is_exact(monkeypatch, subgraphs):
    # tiny subgraphs leave sinks uncertified (they fall through to the larger subgraph and the full graph)
    rng = np.random.default_rng(5)
    for n_layers, n in [(3, 9), (5, 12), (6, 16)]:
        mats = peaked_mats(rng, n_layers, n, heads=4)
        source = int(rng.integers(n))
        expected = full_graph_flows(mats, source)
        monkeypatch.setattr(flow, "SUBGRAPHS", subgraphs)
        np.testing.assert_array_equal(flow_from(mats, source), expected)
        monkeypatch.undo()
        ref = networkx_flows(mats, source)
        assert np.abs(expected - ref).max() <= n_layers * n * n / FLOW_SCALE


def test_two_layers_need_no_max_flow(monkeypatch):
    monkeypatch.setattr(flow, "maximum_flow", None)  # the chain bound is the exact value for two layers
    mats = random_mats(np.random.default_rng(3), 2, 30)
    ref = networkx_flows(mats, 4)
    assert np.abs(flow_from(mats, 4) - ref).max() <= 2 * 30 * 30 / FLOW_SCALE


def test_flow_analytic_two_layers():
    # With two layers every path source -> (1, i) -> (0, j) is its own chain: flow = sum_i min(Â2[c,i], Â1[i,j]).
    rng = np.random.default_rng(7)
    mats = random_mats(rng, 2, 5)
    c = 2
    expected = np.array([sum(min(mats[1, c, i], mats[0, i, j]) for i in range(5)) for j in range(5)])
    np.testing.assert_allclose(flow_from(mats, c), expected, atol=1e-8)


def test_flow_one_layer_is_the_rollout_row():
    att = torch.tensor([[[[0.7, 0.2, 0.1], [0.3, 0.3, 0.4], [0.1, 0.1, 0.8]]]])  # (L=1, H=1, 3, 3)
    mats = flow_matrices(list(att))
    np.testing.assert_allclose(mats[0], 0.5 * att[0, 0].numpy() + 0.5 * np.eye(3))
    scores = attention_flow(mats, np.array([1.0, 0.0, 0.0]))
    np.testing.assert_allclose(scores, [0.85, 0.1, 0.05], atol=1e-8)


def test_uniform_weights_average_per_query_normalised_flows():
    rng = np.random.default_rng(11)
    mats = random_mats(rng, 3, 4)
    weights = np.full(4, 0.25)
    expected = np.zeros(4)
    for q in range(4):
        f = networkx_flows(mats, q)
        expected += 0.25 * f / f.sum()
    np.testing.assert_allclose(attention_flow(mats, weights), expected, atol=1e-7)


def test_real_token_restriction_drops_padding():
    att = torch.softmax(torch.randn(2, 2, 5, 5), -1)
    keep = np.array([True, True, True, False, False])
    mats = flow_matrices(list(att), keep)
    assert mats.shape == (2, 3, 3)
    np.testing.assert_allclose(mats[1], 0.5 * att[1].mean(0)[:3, :3].double().numpy() + 0.5 * np.eye(3))


def test_128_tokens_6_layers_is_fast():
    rng = np.random.default_rng(0)
    mats = random_mats(rng, 6, 128, heads=4)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # this size must not warn about being slow
        scores = attention_flow(mats, np.eye(128)[0])
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"flow took {elapsed:.2f} s"
    assert scores.shape == (128,) and abs(scores.sum() - 1) < 1e-9 and (scores >= 0).all()


def test_warns_when_slow(monkeypatch):
    monkeypatch.setattr(flow, "SLOW_WORK", 10)
    mats = random_mats(np.random.default_rng(0), 2, 4)
    with pytest.warns(UserWarning, match="max-flow runs"):
        attention_flow(mats, np.eye(4)[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="work is forked on Linux only")
def test_the_slow_warning_counts_only_processes_that_can_share(monkeypatch):
    monkeypatch.setattr(flow, "SLOW_WORK", 10)  # this case's work is 16: over 10, under 2 x 10
    mats = random_mats(np.random.default_rng(0), 2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attention_flow(mats, np.eye(4)[0], workers=2)  # two processes share it: no warning
    caught = {}

    def in_a_thread():  # no fork outside the main thread, so one process does all the work
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            attention_flow(mats, np.eye(4)[0], workers=2)
        caught["messages"] = [str(x.message) for x in w]

    t = threading.Thread(target=in_a_thread)
    t.start()
    t.join()
    assert any("max-flow runs" in m for m in caught["messages"])


TEXTS = ["the movie was great", "i really didn ' t like this boring plot , but the actors were charming", "awful"]


@pytest.mark.parametrize("family", ENCODERS + ["gpt2", "bart"])
def test_registered_flow_through_explainer(family, tokenizer):
    ex = Explainer(make_model(family), tokenizer)
    batch = ex.explain(TEXTS, methods=["flow"], batch_size=3)
    for text, e in zip(TEXTS, batch):
        s = e.scores["flow"]
        assert s.shape == (len(e.tokens),) and (s >= 0).all()
        assert abs(s.sum() - 1) < 1e-6
        (single,) = ex.explain([text], methods=["flow"])
        np.testing.assert_allclose(s, single.scores["flow"], atol=1e-5)


def test_registered_flow_equals_direct_computation(tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)
    (e,) = ex.explain(["the movie was not very good"], methods=["flow"])
    _, _, att = ex.attention_maps("the movie was not very good")
    mats = flow_matrices(list(torch.from_numpy(att)))
    expected = attention_flow(mats, np.eye(len(e.tokens))[0])  # BERT explains the [CLS] row
    np.testing.assert_allclose(e.scores["flow"], expected, atol=1e-6)


@pytest.mark.parametrize("kind", ["random", "peaked"])
def test_long_inputs_never_reach_the_full_graph(monkeypatch, kind):
    # the speed guarantee: on encoder-like and random attention every sink is settled by the sparse subgraphs
    rng = np.random.default_rng(9)
    mats = random_mats(rng, 6, 160, heads=12) if kind == "random" else peaked_mats(rng, 6, 160)
    expected = full_graph_flows(mats, 0)

    def no_full_graph(*_args):
        raise AssertionError("fell back to the full graph")

    monkeypatch.setattr(flow, "_flow_graph", no_full_graph)
    np.testing.assert_array_equal(flow_from(mats, 0), expected)


@pytest.mark.parametrize("n_layers,n,source", [(3, 7, 0), (5, 9, 4), (6, 12, 11)])
def test_a_subgraph_of_every_edge_is_the_full_graph_and_fewer_edges_bound_it_from_below(n_layers, n, source):
    mats = peaked_mats(np.random.default_rng(n), n_layers, n, heads=4)
    caps = np.rint(mats * FLOW_SCALE).astype(np.int64)
    full = np.rint(full_graph_flows(mats, source) * FLOW_SCALE).astype(np.int64)
    whole = flow._Subgraph(caps, source, np.ones(mats.shape, dtype=bool))
    chain_only = flow._Subgraph(caps, source, np.zeros(mats.shape, dtype=bool))
    sparse = flow._Subgraph(caps, source, flow._kept_edges(mats, source, 2, 1))
    for j in range(n):  # one structure serves every sink in turn: each answer must not depend on the one before
        assert whole.max_flow(j) == full[j]
        assert chain_only.max_flow(j) <= sparse.max_flow(j) <= full[j]


@pytest.mark.parametrize("sandwich_from", [0, 10_000])  # subgraphs first / the full graph for every sink
def test_flows_shared_among_processes_equal_those_computed_here(monkeypatch, sandwich_from):
    monkeypatch.setattr(flow, "SANDWICH_FROM", sandwich_from)
    monkeypatch.setattr(flow, "PARALLEL_FROM", 0)
    mats = peaked_mats(np.random.default_rng(4), 4, 48)
    alone = flow_from(mats, 0, workers=1)
    for workers in (2, 3):
        np.testing.assert_array_equal(flow_from(mats, 0, workers=workers), alone)


def test_flow_workers_option(tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)
    (alone,) = ex.explain(["the movie was not very good"], methods=["flow"], options={"flow": {"workers": 1}})
    (shared,) = ex.explain(["the movie was not very good"], methods=["flow"], options={"flow": {"workers": 2}})
    np.testing.assert_array_equal(alone.scores["flow"], shared.scores["flow"])
    for bad in (0, 1.5, True):
        with pytest.raises(InputError, match="flow workers must be an integer >= 1"):
            ex.explain(["the movie"], methods=["flow"], options={"flow": {"workers": bad}})


def test_the_graph_counts_in_the_memory_budget_before_any_forward(tokenizer, monkeypatch):
    """Each input's graph (layers x tokens x tokens edges) is held beside the shared pass: the estimate counts it,
    and an input whose graph the budget cannot hold is refused with the length that fits, before the model runs."""
    from attnlens.core import engine

    model = make_model("bert")
    ex = Explainer(model, tokenizer)
    with_graph = engine.pass_cost(ex.runner, [engine.get_method("flow")]).total(40)
    monkeypatch.setattr(flow, "FLOW_BYTES_PER_EDGE", 0)
    assert with_graph - engine.pass_cost(ex.runner, [engine.get_method("flow")]).total(40) == 96 * 2 * 40 * 40
    monkeypatch.setattr(flow, "FLOW_BYTES_PER_EDGE", 2**26)  # 2 layers x 5 x 5 edges fit 4 GiB, not 11 x 11
    forwards = []
    hook = model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(InputError, match=r"with flow needs about .* GiB.*flow up to \d+ tokens"):
            ex.explain(["the movie was great and the plot was fun"], methods=["flow"])
        assert forwards == []
    finally:
        hook.remove()
