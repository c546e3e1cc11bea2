"""Memory budgets: parsing, per-row estimates, batches sized from the sequence length (tiny models)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from conftest import CLS, PAD, SEP, V, make_model, make_tokenizer

from attnlens import Explainer, InputError
from attnlens.cli import main
from attnlens.core import engine, memory
from attnlens.core import generation_engine as generation
from attnlens.core.memory import (
    backward_row_bytes,
    budget_chunks,
    model_dims,
    parse_budget,
    rows_that_fit,
    shared_pass_row_bytes,
)
from attnlens.methods import gradient
from attnlens.testing.tiny_models import build_tiny

SHORT, LONG = "good", "the plot was boring but the actors were charming and the film is great i loved it"


@pytest.mark.parametrize(("value", "expected"), [
    ("4GB", 4 * 10**9), ("512MiB", 512 * 2**20), ("1.5g", int(1.5e9)), (" 2 GiB ", 2 * 2**30), (10**9, 10**9),
    (None, 4 * 2**30),
])
def test_parse_budget(value, expected):
    assert parse_budget(value) == expected


@pytest.mark.parametrize("value", ["4XB", "-1GB", "GB", "10MB", 1000, True, [4], ""])
def test_bad_budget_is_one_line(value):
    with pytest.raises(InputError, match="memory budget"):
        parse_budget(value)


@pytest.mark.parametrize(("family", "layers"), [("bert", 2), ("gpt2", 2), ("bart", 4)])
def test_model_dims_read_the_config(family, layers):
    dims = model_dims(make_model(family))
    assert (dims.layers, dims.heads, dims.hidden, dims.itemsize) == (layers, 2, 16, 4)


def test_row_estimates_grow_with_length_and_fit():
    dims = model_dims(make_model("bert"))
    rows = [backward_row_bytes(dims, n) for n in (8, 16, 32, 64)]
    assert rows == sorted(rows) and rows[-1] > 4 * rows[1]  # the attention maps make it superlinear
    assert all(shared_pass_row_bytes(dims, n) > backward_row_bytes(dims, n) for n in (8, 64))
    assert rows_that_fit(1000, 300) == 3 and rows_that_fit(10, 300) == 1 and rows_that_fit(10**6, 1, cap=7) == 7


def test_budget_chunks_follow_the_length():
    lengths = [5, 100, 7, 90, 6, 80, 5, 300]
    cost = lambda n: n * 10  # noqa: E731
    chunks = list(budget_chunks(lengths, 3, 2000, cost))
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    order = [i for c in chunks for i in c]
    assert [lengths[i] for i in order] == sorted(lengths)  # shortest first
    for c in chunks:
        assert len(c) <= 3 and (len(c) == 1 or len(c) * cost(max(lengths[i] for i in c)) <= 2000)
    assert len(chunks[0]) == 3 and chunks[-1] == [7]  # short inputs keep the batch size; 300 tokens go alone


def test_small_budget_makes_smaller_batches_with_the_same_scores(monkeypatch):
    ex = Explainer(make_model("bert"), make_tokenizer())
    texts = [SHORT, LONG, SHORT + " movie", LONG + " !"]
    sizes = []
    compute = engine.compute_batch

    def spy(ex_, batch, *args, **kwargs):
        sizes.append(len(batch))
        return compute(ex_, batch, *args, **kwargs)

    monkeypatch.setattr(engine, "compute_batch", spy)
    big = ex.explain(texts, methods=["rollout", "attcat"], batch_size=4)
    assert sizes == [4]
    sizes.clear()
    n_long = len(ex.encode([LONG])[0].ids)
    # the smallest budget attnlens takes is 64 MiB and a row of the tiny model is far less: make the engine's
    # estimate of the two long rows half of it, so that they go in a batch of their own
    monkeypatch.setattr(engine, "shared_pass_row_bytes", lambda d, n: (64 * 2**20) // 2 if n >= n_long else 1)
    small = ex.explain(texts, methods=["rollout", "attcat"], batch_size=4, memory_budget="64MiB")
    assert sizes == [2, 2]
    for a, b in zip(big, small, strict=True):
        for m in a.scores:
            np.testing.assert_allclose(a.scores[m], b.scores[m], atol=1e-6)


def test_an_input_over_the_budget_alone_is_said_once(monkeypatch):
    ex = Explainer(make_model("bert"), make_tokenizer())
    n_long = len(ex.encode([LONG])[0].ids)
    monkeypatch.setattr(memory, "shared_pass_row_bytes", lambda d, n: 2**27 if n >= n_long else 1)  # 128 MiB
    with pytest.warns(UserWarning, match=f"an input of {n_long} tokens needs about 0.1 GiB.*it runs alone") as got:
        (e, _) = ex.explain([LONG, SHORT], methods=["attcat"], memory_budget="64MiB")
    assert len([w for w in got if "runs alone" in str(w.message)]) == 1 and "attcat" in e.scores
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex.explain([LONG], methods=["rollout"], memory_budget="64MiB")  # no gradients: no backward to hold


def test_ig_internal_batch_follows_budget_and_length(monkeypatch):
    ex = Explainer(make_model("bert"), make_tokenizer())
    chunks = []
    weighted = gradient._weighted_gradients

    def spy(*args):
        chunks.append(args[6])
        return weighted(*args)

    monkeypatch.setattr(gradient, "_weighted_gradients", spy)
    opts = {"integratedgradients": {"n_steps": 4}}
    for text in (SHORT, LONG):
        for budget in ("64MiB", "1GiB"):
            ex.explain(text, methods=["integratedgradients"], options=opts, memory_budget=budget)
    short_small, short_big, long_small, long_big = chunks
    dims = model_dims(ex.model)
    n_long = len(ex.encode([LONG])[0].ids)
    assert long_small == rows_that_fit(64 * 2**20, backward_row_bytes(dims, n_long))  # nothing captured besides
    assert short_small > long_small and short_big > long_big and long_big > long_small


def test_cli_memory_budget(capsys, tmp_path):
    assert main(["explain", "--memory-budget", "lots", "--methods", "rawatt", "good"]) == 2
    assert "attnlens: error: memory budget 'lots': give a size such as '4GB'" in capsys.readouterr().err
    assert main(["benchmark", "--model", "x", "--dataset", "sst2", "--out", str(tmp_path / "r"),
                 "--memory-budget", "1MB"]) == 2
    assert "below 64 MiB" in capsys.readouterr().err
    assert main(["explain", "--ig-steps", "8", "--methods", "rawatt", "good"]) == 2
    assert "integratedgradients, which --methods leaves out" in capsys.readouterr().err


def _lm_explainer() -> Explainer:
    return Explainer(build_tiny("llama", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                                task="causal-lm"), make_tokenizer())


def _count_batches(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = engine.compute_batch

    def counting(runner, batch, *args, **kwargs):
        sizes.append(len(batch))
        return real(runner, batch, *args, **kwargs)

    monkeypatch.setattr(engine, "compute_batch", counting)
    return sizes


def test_generation_steps_per_batch_follow_the_budget(monkeypatch):
    """Steps sharing one forward: the first costs a whole pass, each further one its gradients; a budget of
    64 MiB with (estimated) 32 MiB + 8 MiB per step takes 5 steps per batch, scores unchanged."""
    ex = _lm_explainer()
    prompt, target = "the movie was", " good but the plot was boring and the actors were bad"
    methods = ["rollout", "attcat", "inputxgradient"]
    full = ex.explain_generation(prompt, methods, target=target)
    n_steps = len(full.generated_ids)
    assert n_steps >= 8
    sizes = _count_batches(monkeypatch)
    monkeypatch.setattr(generation, "shared_pass_row_bytes", lambda d, n: 32 * 2**20)
    monkeypatch.setattr(generation, "step_gradient_bytes", lambda d, n: 8 * 2**20)
    small = ex.explain_generation(prompt, methods, target=target, memory_budget="64MiB")
    assert sizes == [5] * (n_steps // 5) + ([n_steps % 5] if n_steps % 5 else [])
    for m in methods:
        np.testing.assert_allclose(small.scores[m], full.scores[m], atol=1e-5, err_msg=m)
    sizes.clear()  # without gradients a forward keeps little: the batch size as asked
    ex.explain_generation(prompt, ["rollout"], target=target, memory_budget="64MiB")
    assert sizes == [n_steps]


def test_a_generation_over_the_budget_runs_one_step_at_a_time_and_says_so(monkeypatch):
    ex = _lm_explainer()
    full = ex.explain_generation("the movie was", ["attcat"], target=" good but bad")
    sizes = _count_batches(monkeypatch)
    for module in (generation, memory):  # the batch sizing and the warning
        monkeypatch.setattr(module, "shared_pass_row_bytes", lambda d, n: 2**27)  # 128 MiB
    with pytest.warns(UserWarning, match=r"a generation of \d+ tokens needs about 0.1 GiB.*steps run one at a") as got:
        g = ex.explain_generation("the movie was", ["attcat"], target=" good but bad", memory_budget="64MiB")
    said = [w for w in got if "one at a time" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__  # pointed at the caller's line
    assert sizes == [1] * len(g.generated_ids)
    np.testing.assert_allclose(g.scores["attcat"], full.scores["attcat"], atol=1e-5)
