"""Memory budgets: parsing, per-row estimates, batches sized from the sequence length (tiny models)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CLS, PAD, SEP, V, make_model, make_tokenizer

from attnlens import Explainer, InputError, list_methods
from attnlens.cli import main
from attnlens.core import engine, memory
from attnlens.core import generation_engine as generation
from attnlens.core.memory import (
    Storage,
    backward_row_bytes,
    budget_chunks,
    model_dims,
    parse_budget,
    pass_row_bytes,
    rows_that_fit,
    shared_pass_row_bytes,
)
from attnlens.methods import gradient, registry
from attnlens.methods.lrp_methods import kept_pass_dims
from attnlens.models.heads import AnswerHead
from attnlens.testing.tiny_models import TINY, build_tiny

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


# an encoder-decoder's 2 + 2 layers compute 2 + 4 attentions (its decoder layers: self and cross)
# T5 holds its relative-position score biases through a pass (Architecture.bias_maps)
@pytest.mark.parametrize(("family", "layers", "maps", "bias"),
                         [("bert", 2, 2, 0), ("gpt2", 2, 2, 0), ("bart", 4, 6, 0), ("t5", 4, 6, 5)])
def test_model_dims_read_the_config(family, layers, maps, bias):
    dims = model_dims(make_model(family))
    assert (dims.layers, dims.maps, dims.heads, dims.hidden, dims.itemsize, dims.bias_maps) == (layers, maps, 2, 16,
                                                                                                 4, bias)


GROWTH_METHODS = ["rawatt", "rollout", "grads", "attcat", "globenc", "alti", "decompx", "attnlrp"]
# fused and eager self-attention, ALiBi, softcapping, whole masks, relative positions, both encoder-decoders
GROWTH_FAMILIES = ["bert", "gpt2", "llama", "bloom", "falcon", "gemma2", "modernbert", "deberta", "deberta-v2",
                   "bart", "t5"]


@pytest.mark.parametrize("method", GROWTH_METHODS)
@pytest.mark.parametrize("family", GROWTH_FAMILIES)
def test_the_estimate_grows_with_the_length_and_its_square_at_least_as_the_held_tensors_do(family, method):
    """The tensors an explanation holds at once (counted exactly, LiveTensorPeak) at 64, 128 and 192 tokens: their
    terms in the length and in its square (what dominates long inputs) are no larger than the memory estimate's.
    The quadratic terms cover every map a pass holds: the kept and working maps of the pass it plans (eager where
    the model's attention cannot run fused: Gemma 2's softcapping), and each architecture's score biases and whole
    masks (T5's, DeBERTa's, ModernBERT's, ...); the linear ones each layer's activations, what its feed-forward
    saves counted on the model (GPT-2's activation function, run as several operations, saves five wide tensors).
    Both are checked against resident memory at real sizes (bench/budget_promise.py)."""
    model = make_model(family)
    why = registry.get_method(method).unsupported(model, "encoder" if family in ("bart", "t5") else "self",
                                                  "classification")
    if why:
        pytest.skip(why)
    held, estimated = _held_and_estimated(model, method)
    assert _second_difference(held) <= _second_difference(estimated)
    assert _linear_term(held) <= _linear_term(estimated)


@pytest.mark.parametrize(("family", "settings", "saved"), [
    ("bert", {"intermediate_size": 64}, 1 + 4 * 2),  # its input; GELU's input, the output projection's input
    ("t5", {"d_ff": 64}, 1 + 4 * 1),  # ReLU saves its output, the one tensor the output projection saves too
    ("t5", {"d_ff": 64, "feed_forward_proj": "gated-gelu", "dense_act_fn": "gelu_new", "is_gated_act": True},
     1 + 4 * (4 + 3)),  # Flan-T5: gelu_new saves four; the gate and up outputs, their product
    ("gpt2", {"n_inner": 64}, 1 + 4 * (4 + 1)),
    ("llama", {"intermediate_size": 64}, 1 + 4 * 4),  # SiLU's input, its output, the up projection, the product
    ("phi3", {"intermediate_size": 64}, 1 + 4 * 4),  # one fused gate/up output (both halves), SiLU's, the product
    ("modernbert", {"intermediate_size": 64}, 1 + 4 * 4),  # the same with GELU
])
def test_the_feed_forward_count_is_what_autograd_saves(family, settings, saved):
    """A layer's feed-forward keeps its input and, per token, a number of wide (here 4 × hidden) tensors set by its
    activation function and gate: counted on the model, in hidden-size vectors, and read by the estimate above
    the least it counts (LAYER_VECTORS beside it)."""
    from attnlens.models.feed_forward import feed_forward_saved_vectors

    tiny = make_model(family)
    config = type(tiny.config)(**{**tiny.config.to_dict(), **settings})
    model = type(tiny)(config).eval()
    assert config.hidden_size * 4 == 64
    state = torch.get_rng_state()
    assert feed_forward_saved_vectors(model, config.hidden_size, torch.float32) == saved
    assert torch.equal(torch.get_rng_state(), state)  # the probe draws no random numbers
    dims = model_dims(model)
    assert dims.activation_vectors == max(memory.ACTIVATION_VECTORS, memory.LAYER_VECTORS + saved)
    assert dims.forward_vectors == max(memory.FORWARD_VECTORS, memory.FORWARD_LAYER_VECTORS + saved)
    with torch.device("meta"):  # weights never materialised: nothing to count on
        assert model_dims(type(tiny)(config)).activation_vectors == memory.ACTIVATION_VECTORS


def test_the_estimate_counts_the_mask_each_sliding_window_layer_keeps_for_the_backward():
    """ModernBERT's sliding-window layers each build their own windowed N × N mask, and fused attention keeps it
    for the backward: with six layers (four of them windowed) the held tensors' term in the square of the length
    stays within the estimate's (Architecture.layer_mask_maps)."""
    tiny = make_model("modernbert")
    settings = {k: v for k, v in tiny.config.to_dict().items() if k != "layer_types"}
    settings.update(num_hidden_layers=6, global_attn_every_n_layers=3, local_attention=16)
    config = type(tiny.config)(**settings)
    assert config.layer_types.count("sliding_attention") == 4
    held, estimated = _square_terms(type(tiny)(config), "grads")
    assert held <= estimated


def test_the_estimate_counts_one_layers_per_head_value_vectors_where_rows_and_hidden_states_are_read():
    """Attention norm (the explained rows and the hidden states, no chunks) forms each layer's per-head value
    vectors, H × N × D of them, in VALUE_VECTOR_COPIES float32 copies: the estimate holds that term."""
    dims = memory.Dims(layers=6, heads=12, hidden=384)
    n = 256
    rows_only = memory.Storage(eager=False, rows=True)
    with_hidden = dataclasses.replace(rows_only, hidden=True)
    hidden_only = memory.Storage(eager=False, hidden=True)
    values = memory.VALUE_VECTOR_COPIES * 12 * n * 384 * 4
    states = 7 * n * 384 * 4  # every layer's input and the last output
    grown = memory.pass_row_bytes(dims, n, with_hidden) - memory.pass_row_bytes(dims, n, rows_only)
    assert grown == states + values
    assert memory.pass_row_bytes(dims, n, hidden_only) - memory.pass_row_bytes(dims, n, memory.Storage(eager=False)) \
        == states  # without rows or chunks no value vectors are formed


def test_the_estimate_counts_the_position_terms_each_deberta_layer_keeps_for_its_gathers():
    """DeBERTa-v2's layers each build their content-to-position and position-to-content terms, heads × N ×
    2·buckets values, before gathering them into N × N, and each gather keeps its input for the backward: with 128
    position buckets the held tensors' term in the length (not its square: the span is fixed) stays within the
    estimate's (Architecture.position_terms)."""
    tiny = make_model("deberta-v2")
    config = type(tiny.config)(**{**tiny.config.to_dict(), "position_buckets": 128, "max_relative_positions": 256})
    model = type(tiny)(config)
    assert model_dims(model).position_terms.columns(64) == 256
    held, estimated = _held_and_estimated(model, "grads")
    assert _linear_term(held) <= _linear_term(estimated)
    assert _second_difference(held) <= _second_difference(estimated)


LENGTHS = (64, 128, 192)


def _second_difference(values: list[int]) -> int:
    """The second difference of values at :data:`LENGTHS`: their term in the square of the length."""
    return values[2] - 2 * values[1] + values[0]


def _linear_term(values: list[int]) -> float:
    """The coefficient of the length in the quadratic through values at :data:`LENGTHS`."""
    step = LENGTHS[1] - LENGTHS[0]
    square = _second_difference(values) / (2 * step * step)
    return (values[1] - values[0]) / step - square * (LENGTHS[0] + LENGTHS[1])


def _square_terms(model: torch.nn.Module, method: str) -> tuple[int, int]:
    """The second differences at 64, 128 and 192 tokens of the tensors explaining with ``method`` holds at once
    (counted exactly, LiveTensorPeak) and of the memory estimate: their terms in the square of the length."""
    held, estimated = _held_and_estimated(model, method)
    return _second_difference(held), _second_difference(estimated)


def _held_and_estimated(model: torch.nn.Module, method: str) -> tuple[list[int], list[int]]:
    """The bytes of the tensors explaining with ``method`` holds at once (counted exactly, LiveTensorPeak) at
    :data:`LENGTHS` tokens, and the memory estimate's there."""
    from attnlens.testing.live_tensors import LiveTensorPeak

    tok = make_tokenizer()
    tok.model_max_length = 256
    config = model.config
    if hasattr(config, "max_position_embeddings"):  # room for 192 tokens (GPT-2's n_positions by its alias)
        config.max_position_embeddings = 256
    torch.manual_seed(0)
    ex = Explainer(type(model)(config).eval(), tok, max_length=192)
    cost = engine.pass_cost(ex.runner, [registry.get_method(method)], memory.DEFAULT_BUDGET)
    words = [w for w in tok.get_vocab() if w.isalpha()]
    peaks = []
    for n in LENGTHS:
        text = " ".join(words[i % len(words)] for i in range(n - 2))
        assert len(ex.encode(text)[0].ids) == n
        with LiveTensorPeak() as live:
            ex.explain([text], methods=[method])
        peaks.append(live.peak)
    return peaks, [cost.total(n) for n in LENGTHS]


def test_accelerators_recompute_attention_in_larger_chunks():
    from attnlens.core import row_attention

    assert model_dims(make_model("gpt2")).device == "cpu"
    dims = model_dims(make_model("gpt2").to("meta"))
    assert dims.device == "meta"
    assert row_attention.chunk_elements("cpu") == row_attention.CHUNK_ELEMENTS
    assert row_attention.chunk_elements("cpu", backward=True) == row_attention.BACKWARD_CHUNK_ELEMENTS
    assert row_attention.chunk_elements("cuda") == row_attention.chunk_elements("meta", backward=True) \
        == row_attention.DEVICE_CHUNK_ELEMENTS > row_attention.BACKWARD_CHUNK_ELEMENTS
    n = 4096  # 2 heads x n x n probabilities: more than a chunk on either device
    for storage, copies, cpu_chunk in ((Storage(eager=False, factors=True), memory.CHUNK_COPIES,
                                        row_attention.CHUNK_ELEMENTS),
                                       (Storage(eager=False, backward=True, chunked_rules=True),
                                        memory.RULE_CHUNK_COPIES, row_attention.BACKWARD_CHUNK_ELEMENTS)):
        extra = pass_row_bytes(dims, n, storage) - pass_row_bytes(dataclasses.replace(dims, device="cpu"), n, storage)
        assert extra == copies * (row_attention.DEVICE_CHUNK_ELEMENTS - cpu_chunk) * dims.itemsize
    # received attention (AttCAT) and head means (flow): reduced from recomputed chunks on an accelerator, by one
    # more fused attention on a CPU
    for storage in (Storage(eager=False, received=True), Storage(eager=False, means=True)):
        extra = pass_row_bytes(dims, n, storage) - pass_row_bytes(dataclasses.replace(dims, device="cpu"), n, storage)
        assert extra == memory.REDUCED_CHUNK_COPIES * row_attention.DEVICE_CHUNK_ELEMENTS * dims.itemsize
    # ALTI's hidden-size wide block of vectors on an accelerator (its compiled loop writes none on a CPU)
    from attnlens.methods import get_method

    alti = get_method("alti").own_memory
    assert alti(make_model("gpt2"), "encoder", n) == 0
    assert alti(make_model("gpt2").to("meta"), "encoder", 8) == 8 * 8 * dims.hidden * 4
    assert alti(make_model("gpt2").to("meta"), "encoder", n) == row_attention.DEVICE_CHUNK_ELEMENTS * 4


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
    monkeypatch.setattr(engine, "pass_row_bytes", lambda d, n, s: (64 * 2**20) // 2 if n >= n_long else 1)
    small = ex.explain(texts, methods=["rollout", "attcat"], batch_size=4, memory_budget="64MiB")
    assert sizes == [2, 2]
    for a, b in zip(big, small, strict=True):
        for m in a.scores:
            np.testing.assert_allclose(a.scores[m], b.scores[m], atol=1e-6)


def test_an_input_over_the_budget_is_refused_before_anything_runs(monkeypatch):
    ex = Explainer(make_model("bert"), make_tokenizer())
    n_long = len(ex.encode([LONG])[0].ids)
    ran = _count_batches(monkeypatch)
    # 128 MiB per pass from the long input's length on, 1 byte below it
    monkeypatch.setattr(engine, "pass_row_bytes", lambda d, n, s: 2**27 if n >= n_long else 1)
    with pytest.raises(InputError, match=rf"an input of {n_long} tokens with attcat, rollout needs about 128 MiB, "
                                         rf"more than the memory budget of 64 MiB; within it: attcat up to "
                                         rf"{n_long - 1} tokens; rollout up to {n_long - 1} tokens") as got:
        ex.explain([LONG, SHORT], methods=["attcat", "rollout"], memory_budget="64MiB")
    assert "\n" not in str(got.value) and ran == []  # one line, and nothing ran
    (e,) = ex.explain([SHORT], methods=["attcat"], memory_budget="64MiB")  # what fits runs
    assert "attcat" in e.scores


def test_a_refusal_never_offers_lengths_beyond_what_the_model_takes():
    per_method = {"small": lambda n: n, "big": lambda n: 10 * n, "huge": lambda n: 1000 * n}
    with pytest.raises(InputError) as got:
        memory.refuse_over_budget(600, 5000, 600_000, per_method, model_longest=512)
    assert "within it: small at every length the model takes (up to 512 tokens); big up to 500 tokens; huge up to " \
        "5 tokens" in str(got.value)
    with pytest.raises(InputError, match=r"within it: small up to 5,000 tokens; big up to 500 tokens"):
        memory.refuse_over_budget(600, 5000, 600_000, per_method)


def test_cli_refuses_over_the_budget_with_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(engine, "pass_row_bytes", lambda d, n, s: 2**27 if n >= 4 else 1)
    out = tmp_path / "e.json"
    assert main(["explain", "--methods", "rawatt", "--memory-budget", "64MiB", "--format", "json",
                 "--out", str(out), LONG]) == 2
    err = capsys.readouterr().err
    assert "needs about 128 MiB, more than the memory budget of 64 MiB; within it: rawatt up to 3 tokens" in err
    assert err.count("\n") == 1 and not out.exists()


def _storage_of(ex: Explainer, methods: list[str]) -> memory.Storage:
    return engine.pass_cost(ex, [registry.get_method(m) for m in methods]).shared_storage


def test_the_estimate_follows_what_the_capture_keeps():
    llama = _lm_explainer()
    rows = _storage_of(llama, ["rawatt", "agrad"])  # fused attention, the explained rows and their gradients
    # a next token's logits are computed at the last position only
    assert rows == memory.Storage(eager=False, recorded=True, backward=True, rows=1, row_grads=True, logit_rows=1)
    assert _storage_of(llama, ["attcat"]) == memory.Storage(eager=False, recorded=True, backward=True, rows=1,
                                                           received=True, hidden=True, hidden_grads=True, logit_rows=1)
    assert _storage_of(llama, ["saliency"]) == memory.Storage(eager=False, recorded=True, backward=True,
                                                             embeddings=True, embedding_grads=True, logit_rows=1)
    means = _storage_of(llama, ["flow", "rawatt"])  # flow reads head means: fused attention, N x N per layer
    assert means == memory.Storage(eager=False, recorded=True, rows=1, means=True, logit_rows=1)
    # rollout recomputes the maps from each layer's queries and keys; GAE also keeps values and output gradients
    assert _storage_of(llama, ["rollout"]) == memory.Storage(eager=False, recorded=True, factors=True, logit_rows=1)
    assert _storage_of(llama, ["gae"]) == memory.Storage(eager=False, recorded=True, backward=True, factors=True,
                                                        factor_grads=True, logit_rows=1)
    # attnnorm reads the explained rows and the hidden states: fused attention
    assert _storage_of(llama, ["attnnorm", "rawatt"]) == memory.Storage(eager=False, recorded=True, rows=1,
                                                                        hidden=True, logit_rows=1)
    # decompx recomputes the maps chunk by chunk and rebuilds one layer's linearised graph at a time
    assert _storage_of(llama, ["decompx", "rawatt"]) == memory.Storage(eager=False, recorded=True, rows=1,
                                                                       factors=True, hidden=True, layer_graph=True,
                                                                       logit_rows=1)
    full = memory.Storage(eager=True, maps=True, hidden=True, logit_rows=1)  # every head's whole map kept
    dims = model_dims(llama.model)
    n = 4096
    assert memory.pass_row_bytes(dims, n, rows) * 20 < memory.pass_row_bytes(dims, n, full)
    gae_maps = memory.Storage(eager=True, backward=True, maps=True, map_grads=True, logit_rows=1)
    chunks = memory.pass_row_bytes(dims, n, _storage_of(llama, ["gae"]))  # mostly one chunk's temporaries here
    assert chunks * 8 < memory.pass_row_bytes(dims, n, gae_maps)
    every = dataclasses.replace(rows, logit_rows=0)
    assert (memory.pass_row_bytes(dims, n, every) - memory.pass_row_bytes(dims, n, rows)
            == memory.LOGIT_COPIES * (n - 1) * dims.logits * dims.itemsize)
    # an answer's: at its positions
    answer = engine.pass_cost(llama.runner.with_head(AnswerHead(V, answer_tokens=16)),
                              [registry.get_method("grads")]).shared_storage
    assert answer.logit_rows == 17 and answer.logit_positions(n) == 17 and answer.logit_positions(8) == 8
    assert (answer | rows).logit_rows == 17 and (answer | every).logit_rows == 0
    # an encoder-decoder's streams are read from the whole maps
    bart = Explainer(make_model("bart"), make_tokenizer())
    assert _storage_of(bart, ["rawatt"]).maps


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
    # nothing captured besides; BERT has fused attention, which integrated gradients' passes run
    storage = memory.gradient_pass_storage(dims, n_long, 64 * 2**20, fused=True)
    assert not storage.eager
    assert long_small == rows_that_fit(64 * 2**20, memory.pass_row_bytes(dims, n_long, storage))
    assert long_small > rows_that_fit(64 * 2**20, backward_row_bytes(dims, n_long))  # eager attention's rows
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
    monkeypatch.setattr(engine, "pass_row_bytes", lambda d, n, s: 32 * 2**20)
    monkeypatch.setattr(generation, "step_gradient_bytes", lambda d, n, s: 8 * 2**20)
    small = ex.explain_generation(prompt, methods, target=target, memory_budget="64MiB")
    assert sizes == [5] * (n_steps // 5) + ([n_steps % 5] if n_steps % 5 else [])
    for m in methods:
        np.testing.assert_allclose(small.scores[m], full.scores[m], atol=1e-5, err_msg=m)
    sizes.clear()  # without gradients a forward keeps little: the batch size as asked
    ex.explain_generation(prompt, ["rollout"], target=target, memory_budget="64MiB")
    assert sizes == [n_steps]


def test_lrp_generation_steps_per_batch_follow_the_budget_and_keep_only_the_steps_logits(monkeypatch):
    """An LRP pass over a generation's prefixes takes every step's relevance from one batched backward: each step
    adds its share (``lrp_step_bytes``), so a budget of 64 MiB with 32 MiB (the LRP pass) + 8 MiB per step takes
    5 steps per batch, scores unchanged; each pass projects only the logits its steps read (the
    last ``steps`` positions)."""
    from attnlens.methods import lrp_methods

    ex = _lm_explainer()
    prompt, target = "the movie was", " good but the plot was boring and the actors were bad"
    methods = ["attnlrp", "partiallrp"]
    full = ex.explain_generation(prompt, methods, target=target)
    n_steps = len(full.generated_ids)
    sizes = _count_batches(monkeypatch)
    kept: list[tuple[int, int]] = []  # (steps, logits kept) per LRP pass
    real = lrp_methods.lrp_passes

    def spy(*args, **kwargs):
        kept.append((len(kwargs["rows"]), kwargs["forward_kwargs"]["logits_to_keep"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(lrp_methods, "lrp_passes", spy)
    monkeypatch.setattr(engine, "pass_row_bytes", lambda d, n, s: 32 * 2**20)
    monkeypatch.setattr(generation, "lrp_step_bytes", lambda d, n, steps, attention, fused: 8 * 2**20)
    small = ex.explain_generation(prompt, methods, target=target, memory_budget="64MiB")
    assert sizes == [5] * (n_steps // 5) + ([n_steps % 5] if n_steps % 5 else [])
    assert kept == [(k, k) for k in sizes]
    for m in methods:
        np.testing.assert_allclose(small.scores[m], full.scores[m], atol=1e-5, err_msg=m)


def test_decompx_generation_steps_per_batch_follow_the_budget(monkeypatch):
    """DecompX over a generation's steps carries each step's cotangent through every rebuilt layer: each step adds
    its share (``layer_graph_step_bytes``), so a budget of 64 MiB with 32 MiB (the pass) + 8 MiB per step takes 5
    steps per batch, scores unchanged; with a budget that holds them, one batch."""
    ex = _lm_explainer()
    prompt, target = "the movie was", " good but the plot was boring and the actors were bad"
    full = ex.explain_generation(prompt, ["decompx"], target=target)
    n_steps = len(full.generated_ids)
    assert n_steps >= 8
    sizes = _count_batches(monkeypatch)
    monkeypatch.setattr(engine, "pass_row_bytes", lambda d, n, s: 32 * 2**20)
    monkeypatch.setattr(generation, "layer_graph_step_bytes", lambda d, n: 8 * 2**20)
    small = ex.explain_generation(prompt, ["decompx"], target=target, memory_budget="64MiB")
    assert sizes == [5] * (n_steps // 5) + ([n_steps % 5] if n_steps % 5 else [])
    np.testing.assert_allclose(small.scores["decompx"], full.scores["decompx"], atol=1e-5)
    sizes.clear()
    ex.explain_generation(prompt, ["decompx"], target=target, memory_budget="4GiB")
    assert sizes == [n_steps]


def test_layer_graph_step_bytes_bound_what_each_decompx_step_holds():
    """Measured in a fresh process: DecompX over 32 steps of a generation after a ~900-token prompt, within a
    96 MiB budget that holds a few steps per batch, grows the peak RSS by at most the budget's promise (a batch
    of every step held several times the budget)."""
    from conftest import growth_in_fresh_processes

    grown, budget = growth_in_fresh_processes(_decompx_generation_growth, lambda b: 1.1 * b + 16 * 2**20)
    assert grown <= 1.1 * budget + 16 * 2**20, (grown, budget)


def _decompx_generation_growth() -> tuple[int, int]:
    """DecompX's peak-RSS growth over a 32-step generation (see the test above), and the budget, in this
    process."""
    from conftest import long_llama, peak_rss_growth

    ex = long_llama(128, 4)
    prompt = " ".join(["not very bad , i really didn ' t like this film"] * 70)
    target = " good but bad the" * 8
    ex.explain_generation("the movie was", methods=["decompx"], target=" good but")  # warm-up
    budget = memory.parse_budget("96MiB")
    grown = peak_rss_growth(lambda: ex.explain_generation(prompt, methods=["decompx"], target=target,
                                                          batch_size=32, memory_budget=budget))
    return grown, budget


def test_integrated_gradients_over_a_generation_counts_each_steps_sums():
    """Integrated gradients over a generation's steps holds each step's ``(N, D)`` gradient sums beside its
    passes: the first step's are in the refusal's estimate, and each further step's ``step_vectors`` hidden-size
    vectors per token decide how many steps a batch takes."""
    from attnlens.core.generation_engine import _steps_per_batch

    ex = _lm_explainer()
    dims = model_dims(ex.model)
    spec = registry.get_method("integratedgradients")
    assert spec.step_vectors >= 2
    n = 120
    per_step = spec.step_vectors * n * dims.hidden * dims.itemsize
    budget = memory.parse_budget("4GiB")
    one, many = (engine.pass_cost(ex.runner, [spec], budget, prefixes=True, steps=k).total(n) for k in (1, 16))
    assert many == one  # the refusal counts one step: a sequence is refused only when a single step does not fit
    bare = dataclasses.replace(spec, step_vectors=0)
    assert one - engine.pass_cost(ex.runner, [bare], budget, prefixes=True, steps=1).total(n) == per_step
    for extra in (0, 3, 7):
        fits = one + extra * per_step + per_step // 2
        assert _steps_per_batch(ex.runner, [spec], n, 16, fits, False, one_pass=True) == 1 + extra
    assert _steps_per_batch(ex.runner, [spec], n, 16, budget, False, one_pass=True) == 16


def test_lrp_rows_must_reach_the_kept_logits():
    from attnlens.lrp import lrp_pass
    from attnlens.models.heads import LMHead

    model = _lm_explainer().model
    ids = torch.tensor([[CLS, 5, 6, 7, 8]])
    rows = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    kwargs = {"head": LMHead(V), "rows": rows, "inputs_relevance": True}
    with pytest.raises(InputError, match="a row ends before them"):
        lrp_pass(model, {"input_ids": ids}, torch.tensor([3, 4]), forward_kwargs={"logits_to_keep": 2}, **kwargs)
    reference = lrp_pass(model, {"input_ids": ids}, torch.tensor([3, 4]), **kwargs)
    cut = lrp_pass(model, {"input_ids": ids}, torch.tensor([3, 4]), forward_kwargs={"logits_to_keep": 3}, **kwargs)
    torch.testing.assert_close(cut.input_relevance, reference.input_relevance, rtol=1e-5, atol=1e-6)
    assert cut.logits.shape[1] == 3


def test_a_generation_over_the_budget_is_refused_before_it_runs(monkeypatch):
    ex = _lm_explainer()
    sizes = _count_batches(monkeypatch)
    monkeypatch.setattr(engine, "pass_row_bytes", lambda d, n, s: 2**27)  # 128 MiB at any length
    with pytest.raises(InputError, match=r"a generation of \d+ tokens with attcat needs about 128 MiB, more than the "
                                         r"memory budget of 64 MiB; within it: attcat not even 1 token"):
        ex.explain_generation("the movie was", ["attcat"], target=" good but bad", memory_budget="64MiB")
    assert sizes == []


def test_a_generation_over_the_budget_is_refused_before_the_model_generates(monkeypatch):
    from attnlens.core import generation_engine

    ex = _lm_explainer()
    generated: list[int] = []
    real = generation_engine.greedy
    monkeypatch.setattr(generation_engine, "greedy", lambda *a, **k: generated.append(1) or real(*a, **k))
    monkeypatch.setattr(engine, "pass_row_bytes", lambda d, n, s: 2**27)
    with pytest.raises(InputError, match=r"a generation of \d+ tokens with attcat needs about 128 MiB"):
        ex.explain_generation("the movie was", ["attcat"], max_new_tokens=4, memory_budget="64MiB")
    assert generated == []
    monkeypatch.undo()
    ex.explain_generation("the movie was", ["attcat"], max_new_tokens=2)  # within the budget it generates


def _spy_lrp(monkeypatch) -> list[bool]:
    from attnlens.methods import lrp_methods

    seen: list[bool] = []
    real = lrp_methods.lrp_pass

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fused", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(lrp_methods, "lrp_pass", spy)
    return seen


def test_attnlrp_runs_fused_where_the_eager_pass_would_not_fit(monkeypatch):
    """The estimate and the method take the same decision: the eager LRP pass while it fits, the fused one
    (no maps kept, layers recomputed) beyond, with the same scores."""
    from attnlens.methods import lrp_methods

    ex = _lm_explainer()
    texts = ["the movie was good but boring and far too long " * 3, "fun"]
    with monkeypatch.context() as unfused:  # AttnLRP's own pass runs fused wherever the model allows
        unfused.setattr(lrp_methods, "runs_fused", lambda model: False)
        eager = ex.explain(texts, ["attnlrp", "rawatt"])
    prompt, target = "the movie was good but boring and", " far too long for a film"
    eager_steps = ex.explain_generation(prompt, ["attnlrp", "partiallrp"], target=target)
    eager_transatt = ex.explain_generation(prompt, ["transatt"], target=target)
    seen = _spy_lrp(monkeypatch)
    always = lambda dims, n, budget, fusable, rows=0, **_: (memory.FUSED_LRP_STORAGE if fusable  # noqa: E731
                                                            else memory.LRP_STORAGE)
    monkeypatch.setattr(lrp_methods, "lrp_storage", always)
    fused = ex.explain(texts, ["attnlrp", "rawatt"])
    assert seen == [True]
    for a, b in zip(fused, eager, strict=True):
        np.testing.assert_allclose(a.scores["attnlrp"], b.scores["attnlrp"], rtol=0,
                                   atol=1e-5 * np.abs(b.scores["attnlrp"]).max())
    seen.clear()
    # PartialLRP reading the attnlrp pass: only the chefer pass keeps what recomputes the attention relevance
    opts = {"partiallrp": {"rules": "attnlrp"}}
    for a, b in zip(ex.explain(texts, ["attnlrp", "partiallrp"], options=opts), eager, strict=True):
        np.testing.assert_allclose(a.scores["attnlrp"], b.scores["attnlrp"], rtol=0,
                                   atol=1e-5 * np.abs(b.scores["attnlrp"]).max())
    ex.explain(texts, ["attnlrp"], options={"attnlrp": {"rules": "cp"}})
    assert not any(seen)
    seen.clear()
    # a generation's prefixes: AttnLRP's pass alone runs fused, one backward per step; beside PartialLRP their
    # joint pass runs eager where it fits, and each its own pass, fused, where it does not
    reports: list[float] = []
    monkeypatch.setattr(lrp_methods, "lrp_step_bytes", lambda *args: 2**40)  # the steps' batched products: too big
    steps = ex.explain_generation(prompt, ["attnlrp"], target=target, progress=lambda done, _: reports.append(done))
    assert seen == [True]
    # the bar moves with every step's backward
    n_steps = len(steps.generated_ids)
    assert len(reports) > n_steps and reports == sorted(reports) and reports[-1] == pytest.approx(1.0)
    np.testing.assert_allclose(steps.scores["attnlrp"], eager_steps.scores["attnlrp"], rtol=0,
                               atol=1e-5 * np.abs(eager_steps.scores["attnlrp"]).max())
    seen.clear()
    both = ex.explain_generation(prompt, ["attnlrp", "partiallrp"], target=target)
    assert seen == [True, True]  # no joint pass: each method's own, fused
    for m in ("attnlrp", "partiallrp"):
        np.testing.assert_allclose(both.scores[m], eager_steps.scores[m], rtol=0,
                                   atol=1e-5 * np.abs(eager_steps.scores[m]).max())
    seen.clear()  # beside TransAtt, whose pass over the steps stays eager: AttnLRP's own runs fused
    with_transatt = ex.explain_generation(prompt, ["attnlrp", "transatt"], target=target)
    assert sorted(seen) == [False, True]
    np.testing.assert_allclose(with_transatt.scores["attnlrp"], eager_steps.scores["attnlrp"], rtol=0,
                               atol=1e-5 * np.abs(eager_steps.scores["attnlrp"]).max())
    np.testing.assert_allclose(with_transatt.scores["transatt"], eager_transatt.scores["transatt"], rtol=0,
                               atol=1e-5 * np.abs(eager_transatt.scores["transatt"]).max())
    joint: list[bool] = []
    real_joint = lrp_methods.lrp_passes
    monkeypatch.undo()  # the eager pass fits again: the joint pass serves both
    monkeypatch.setattr(lrp_methods, "lrp_passes", lambda *a, **k: joint.append(k["fused"]) or real_joint(*a, **k))
    seen = _spy_lrp(monkeypatch)
    both = ex.explain_generation(prompt, ["attnlrp", "partiallrp"], target=target)
    assert joint == [False] and seen == []
    for m in ("attnlrp", "partiallrp"):
        np.testing.assert_allclose(both.scores[m], eager_steps.scores[m], atol=1e-6)


def test_attnlrp_keeps_the_layers_activations_while_they_fit_the_budget(monkeypatch):
    """AttnLRP's own pass runs fused (no maps) and keeps every layer's activations (what its rules save) while
    they fit the budget (the default one too), and recomputes each layer in its backward beyond that; the estimate
    takes the same decision, and both give the eager pass's scores."""
    import transformers

    from attnlens.lrp import relevance
    from attnlens.methods import lrp_methods

    torch.manual_seed(0)  # long enough that the budget's 64 MiB minimum decides between the passes
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                      max_position_embeddings=1024, pad_token_id=PAD, bos_token_id=CLS,
                                      eos_token_id=SEP)
    tokenizer = make_tokenizer()
    tokenizer.model_max_length = 1024
    ex = Explainer(transformers.LlamaForCausalLM(config).eval(), tokenizer, max_length=1024)
    text = " ".join(["the movie was good but boring and far too long"] * 90)
    n = len(ex.tokenizer(text)["input_ids"])
    dims = kept_pass_dims(ex.model, model_dims(ex.model))  # what the kept pass's rules save, counted
    need = {name: memory.pass_row_bytes(dims, n, dataclasses.replace(storage, logit_rows=1)) for name, storage in
            [("eager", memory.LRP_STORAGE), ("recompute", memory.FUSED_LRP_STORAGE),
             ("kept", memory.KEPT_LRP_STORAGE)]}
    assert need["recompute"] < need["kept"] < need["eager"]
    with monkeypatch.context() as unfused:
        unfused.setattr(lrp_methods, "runs_fused", lambda model: False)
        eager = ex.explain([text], ["attnlrp"])[0].scores["attnlrp"]
    calls: list[tuple[bool, bool]] = []
    real_pass, real_recomputing = lrp_methods.lrp_pass, relevance.recomputing
    monkeypatch.setattr(lrp_methods, "lrp_pass", lambda *a, **k: calls.append((k["fused"], k["recompute"]))
                        or real_pass(*a, **k))
    recomputed: list[int] = []
    monkeypatch.setattr(relevance, "recomputing", lambda *a: recomputed.append(1) or real_recomputing(*a))
    spec = [registry.get_method("attnlrp")]
    for budget, recompute in [(None, False), (need["kept"], False), (need["kept"] - 1, True)]:
        calls.clear()
        recomputed.clear()
        cost = engine.pass_cost(ex.runner, spec, memory.parse_budget(budget))
        assert cost.own_storage("attnlrp", n).recompute == recompute
        scores = ex.explain([text], ["attnlrp"], memory_budget=budget)[0].scores["attnlrp"]
        assert calls == [(True, recompute)] and len(recomputed) == recompute
        np.testing.assert_allclose(scores, eager, rtol=0, atol=1e-5 * np.abs(eager).max())
    # beside Chefer et al.'s rules (one forward serves both) the joint pass recomputes its layers
    both = engine.pass_cost(ex.runner, [*spec, registry.get_method("transatt")], need["kept"])
    assert both.own_storage("attnlrp", n).recompute


def test_partiallrp_over_a_generation_runs_fused_where_the_eager_pass_would_not_fit(monkeypatch):
    """PartialLRP over a generation's steps, as a pass of its own, runs its last-layer pass fused (no maps, one
    backward per step through the top of the last layer) where the eager one would not fit, with the eager pass's
    scores; beside TransAtt (the same pass, read at every layer) or with its per-layer view it stays eager."""
    from attnlens.methods import lrp_methods

    ex = _lm_explainer()
    prompt, target = "the movie was good but boring and", " far too long for a film"
    eager = ex.explain_generation(prompt, ["partiallrp", "rawatt"], target=target)
    eager_lrp = ex.explain_generation(prompt, ["partiallrp"], target=target,
                                      options={"partiallrp": {"rules": "chefer-lrp"}})
    seen = _spy_lrp(monkeypatch)
    monkeypatch.setattr(lrp_methods, "lrp_step_bytes", lambda *args: 2**40)  # the steps' batched products: too big
    reports: list[float] = []
    fused = ex.explain_generation(prompt, ["partiallrp", "rawatt"], target=target,
                                  progress=lambda done, _: reports.append(done))
    assert seen == [True]
    assert reports == sorted(reports) and reports[-1] == pytest.approx(1.0)
    scale = np.abs(eager.scores["partiallrp"]).max()
    np.testing.assert_allclose(fused.scores["partiallrp"], eager.scores["partiallrp"], rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(fused.scores["rawatt"], eager.scores["rawatt"], atol=1e-6)
    seen.clear()
    got = ex.explain_generation(prompt, ["partiallrp"], target=target, options={"partiallrp": {"rules": "chefer-lrp"}})
    assert seen == [True]
    np.testing.assert_allclose(got.scores["partiallrp"], eager_lrp.scores["partiallrp"], rtol=0,
                               atol=1e-5 * np.abs(eager_lrp.scores["partiallrp"]).max())
    seen.clear()
    ex.explain_generation(prompt, ["partiallrp", "transatt"], target=target)
    ex.explain_generation(prompt, ["partiallrp"], target=target, options={"partiallrp": {"layers": True}})
    assert not any(seen)


def test_partiallrp_over_a_long_generation_fits_the_default_budget(smollm2_sized):
    """The estimate of PartialLRP over a generation's steps counts its fused pass: a 16-token answer after a
    2,000-token prompt fits the default budget on SmolLM2's dimensions; its per-layer view, eager, does not."""
    spec = [registry.get_method("partiallrp")]
    cost = engine.pass_cost(smollm2_sized.runner, spec, memory.DEFAULT_BUDGET, prefixes=True, steps=16)
    assert "partiallrp" in cost.fusable
    assert cost.total(2016) <= memory.DEFAULT_BUDGET
    layers = engine.pass_cost(smollm2_sized.runner, spec, memory.DEFAULT_BUDGET, {"partiallrp": {"layers": True}},
                              prefixes=True, steps=16)
    assert not layers.fusable and layers.total(2016) > memory.DEFAULT_BUDGET


def test_a_fused_pass_stopping_at_the_last_layer_keeps_that_layers_factors_alone(monkeypatch, smollm2_sized):
    """The fused chefer pass that stops at the last layer lets each layer's factors go once the next layer records
    its own, and the estimate counts one layer's: PartialLRP alone, not beside AttnLRP (the joint pass keeps every
    layer's for AttnLRP's backward) nor with its per-layer view."""
    from attnlens.lrp import lrp_pass, relevance

    model = build_tiny("llama", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP)
    held = []
    real = relevance._last_layer_backward

    def spy(state, *args, **kwargs):
        held.append([f is not None for f in state.factors.values()])
        return real(state, *args, **kwargs)

    monkeypatch.setattr(relevance, "_last_layer_backward", spy)
    inputs = {"input_ids": torch.tensor([[CLS, 10, 11, 12, 13, SEP]])}
    last = lrp_pass(model, inputs, 0, rules="chefer", fused=True, inputs_relevance=False, last_layer_only=True)
    whole = lrp_pass(model, inputs, 0, rules="chefer", fused=True, inputs_relevance=False)
    assert held == [[False, True]] and last.first_layer == 1
    rows = torch.arange(6)
    torch.testing.assert_close(last.relevance_rows(1, rows), whole.relevance_rows(1, rows))
    spec = [registry.get_method("partiallrp")]
    budget, n = memory.DEFAULT_BUDGET, 8192
    alone = engine.pass_cost(smollm2_sized.runner, spec, budget)
    assert alone.last_layer == {"partiallrp"}
    own = alone.own_storage("partiallrp", n)
    assert own == dataclasses.replace(memory.FUSED_LAST_LAYER_STORAGE, logit_rows=own.logit_rows)
    joint = engine.pass_cost(smollm2_sized.runner, spec + [registry.get_method("attnlrp")], budget)
    layers = engine.pass_cost(smollm2_sized.runner, spec, budget, {"partiallrp": {"layers": True}})
    assert not joint.last_layer and not layers.last_layer
    assert alone.total(n) < layers.total(n)


@pytest.mark.parametrize("task", ["causal-lm", "classification"])
def test_lrp_methods_reading_attention_relevance_run_fused_where_the_eager_pass_would_not_fit(monkeypatch, task):
    """PartialLRP and TransAtt, and AttnLRP beside them from the same forward, give the eager pass's scores and
    per-layer rows from the fused one (no maps kept: the relevance and the maps recomputed a few query rows at a
    time), a padded batch and TransAtt's start layer included."""
    from attnlens.core import row_attention
    from attnlens.methods import lrp_methods

    model = build_tiny("llama", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, task=task)
    ex = Explainer(model, make_tokenizer())
    texts = ["the movie was good but boring and far too long " * 3, "fun"]
    methods = ["partiallrp", "transatt", "attnlrp", "rawatt"]
    eager = ex.explain(texts, methods)
    eager_from_two = ex.explain(texts, ["transatt"], options={"transatt": {"start_layer": 1}})
    seen = []
    real = lrp_methods.lrp_passes
    monkeypatch.setattr(lrp_methods, "lrp_passes", lambda *a, **k: seen.append(k["fused"]) or real(*a, **k))
    always = lambda dims, n, budget, fusable, rows=0, attention=False, **_: (  # noqa: E731
        memory.lrp_storage(dims, n, 0, fusable, rows, attention))
    monkeypatch.setattr(lrp_methods, "lrp_storage", always)
    monkeypatch.setattr(row_attention, "CHUNK_ELEMENTS", 64)
    monkeypatch.setattr("attnlens.core.row_attention.BACKWARD_CHUNK_ELEMENTS", 64)
    # TransAtt's rows are carried down during the fused pass's backward, from the chunks it recomputes anyway:
    # no second pass over the maps
    second = []
    real_carried = lrp_methods.carried_rows
    monkeypatch.setattr(lrp_methods, "carried_rows", lambda *a, **k: second.append(1) or real_carried(*a, **k))
    fused = ex.explain(texts, methods)
    assert seen == [True]
    from_two = ex.explain(texts, ["transatt"], options={"transatt": {"start_layer": 1}})
    assert not second
    # layers arriving out of order (here: the top layer's chunks withheld) are noticed, and TransAtt carries its
    # rows over the recomputed maps instead
    real_read = lrp_methods._CarriedInPass.__call__
    top = model.config.num_hidden_layers - 1
    monkeypatch.setattr(lrp_methods._CarriedInPass, "__call__",
                        lambda self, layer, *a: None if layer == top else real_read(self, layer, *a))
    (fallback, *_) = ex.explain(texts, ["transatt"])
    assert second
    np.testing.assert_allclose(fallback.scores["transatt"], eager[0].scores["transatt"], rtol=0,
                               atol=1e-5 * np.abs(eager[0].scores["transatt"]).max())
    for a, b in zip([*fused, *from_two], [*eager, *eager_from_two], strict=True):
        for m in b.scores:
            top = np.abs(b.scores[m]).max()
            np.testing.assert_allclose(a.scores[m], b.scores[m], rtol=0, atol=1e-5 * top, err_msg=m)
            if m in b.layers:
                np.testing.assert_allclose(a.layers[m], b.layers[m], rtol=0, atol=1e-5 * top, err_msg=m)


@contextmanager
def _saving(model: torch.nn.Module) -> Iterator[dict[int, int]]:
    """Within the block, the bytes of every distinct storage autograd saves, by address, ``model``'s parameters
    aside (the tensors stay with the graph, as in a real pass)."""
    from torch.autograd.graph import saved_tensors_hooks

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


@pytest.mark.parametrize("family", ["bert", "modernbert", "gpt2", "llama", "qwen3", "mixtral", "phi"])
def test_the_kept_attnlrp_pass_is_estimated_from_what_its_forward_saves(family):
    """What AttnLRP's fused pass keeps per token and layer is counted on the model's own layers: the estimate of
    the pass that keeps them covers every byte autograd saves in a real pass over a longer input (parameters
    aside), its per-layer part within 10% of them (the classifier's head saves a little more, masks grow), and the
    count is less than a plain backward's floor."""
    from attnlens.lrp import lrp_pass

    model = make_model(family)
    dims = model_dims(model)
    counted = kept_pass_dims(model, dims)
    assert 0 < counted.lrp_vectors < dims.activation_vectors
    n = 48
    ids = torch.randint(5, V, (2, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a padded batch: its attention runs with a mask, as the count's probe does
    with _saving(model) as saved:
        lrp_pass(model, {"input_ids": ids, "attention_mask": mask}, 1, fused=True, recompute=False)
    per_row = sum(saved.values()) / 2
    layers = counted.layers * counted.lrp_vectors * n * counted.hidden * counted.itemsize
    assert 0.9 * per_row <= layers <= 1.1 * per_row
    assert memory.pass_row_bytes(counted, n, memory.KEPT_LRP_STORAGE) >= per_row


def _left_as_it_was(model: torch.nn.Module, count: Callable[[], Any]) -> Any:
    """``count()``, checked to leave ``model`` (in training mode) as it was: its modules' mode, its attention
    implementation and hooks, no parameter's gradient, and the global random state."""
    implementation = model.config._attn_implementation
    hooks = len(model._forward_hooks) + len(model._forward_pre_hooks)
    state = torch.get_rng_state()
    got = count()
    assert model.training and all(m.training for m in model.modules())
    assert model.config._attn_implementation == implementation
    assert len(model._forward_hooks) + len(model._forward_pre_hooks) == hooks
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), state)
    return got


def test_counting_what_attnlrp_keeps_leaves_the_model_as_it_was(monkeypatch):
    """The count runs the LRP forward on two probes once per model: the model keeps its mode, attention
    implementation and hooks, no parameter gets a gradient, the global random state is untouched; where a probe
    fails the estimate takes a plain backward's count."""
    from attnlens.lrp import kept

    model = make_model("llama").train()
    dims = model_dims(model)
    first = _left_as_it_was(model, lambda: kept_pass_dims(model, dims))
    assert 0 < first.lrp_vectors < dims.activation_vectors
    monkeypatch.setattr(kept, "_count", lambda *a: pytest.fail("counted again"))
    assert kept_pass_dims(model, dims) == first  # once per model
    other = make_model("llama", seed=1)
    monkeypatch.setattr(kept, "_count", lambda *a: None)
    assert kept_pass_dims(other, dims) == dims  # not counted: the plain backward's count stays


@pytest.mark.parametrize("method", ["attcat", "saliency"])
@pytest.mark.parametrize("family", ["bert", "albert", "modernbert", "gpt2", "gpt_neox", "llama", "qwen3", "mixtral",
                                    "phi", "opt"])
def test_the_kept_shared_pass_is_estimated_from_what_its_forward_saves(family, method):
    """What the gradient methods' shared pass with fused attention keeps per token and layer is counted on the
    model's own layers, for what the pass keeps (rows, received attention, embeddings): over a padded batch, the
    per-layer part of the estimate lies within 10% of every byte autograd saves in the real pass (parameters
    aside), and the whole estimate covers them."""
    model = make_model(family)
    ex = Explainer(model, make_tokenizer())
    cost = engine.pass_cost(ex.runner, [registry.get_method(method)])
    dims = cost.dims
    assert cost.shared_storage.recorded and dims.capture_vectors > 0
    with _saving(model) as saved:  # a padded batch: the attention runs with a mask
        got = ex.explain(["good " * 40, "bad " * 37], methods=[method])
    n = max(len(e.tokens) for e in got)
    per_row = sum(saved.values()) / 2
    layers = dims.layers * dims.capture_vectors * n * dims.hidden * dims.itemsize
    assert 0.9 * per_row <= layers <= 1.1 * per_row
    assert not cost.storage(n).recompute and memory.pass_row_bytes(dims, n, cost.storage(n)) >= per_row


def test_counting_what_the_shared_pass_keeps_leaves_the_model_as_it_was(monkeypatch):
    """The count runs the shared pass's forward on two probes once per model and kept tensors: the model keeps
    its mode, attention implementation and hooks, no parameter gets a gradient, the global random state is
    untouched; where a probe fails the estimate takes a plain backward's floor."""
    from attnlens.core import capture_kept

    model = make_model("llama").train()
    ex = Explainer(model, make_tokenizer())
    specs = [registry.get_method("attcat")]
    first = _left_as_it_was(model, lambda: engine.pass_cost(ex.runner, specs).dims)
    assert 0 < first.capture_vectors < first.activation_vectors
    monkeypatch.setattr(capture_kept, "_count", lambda *a: pytest.fail("counted again"))
    assert engine.pass_cost(ex.runner, specs).dims == first  # once per model and kept tensors
    monkeypatch.setattr(capture_kept, "_count", lambda *a: None)
    saliency = engine.pass_cost(ex.runner, [registry.get_method("saliency")])  # other kept tensors: counted anew
    assert saliency.dims == dataclasses.replace(first, capture_vectors=0.0)
    assert memory.pass_row_bytes(saliency.dims, 64, saliency.storage(64)) == memory.pass_row_bytes(
        first, 64, dataclasses.replace(saliency.storage(64), recorded=False))  # the floor's estimate


def test_the_estimate_of_attnlrp_follows_the_fused_pass():
    ex = _lm_explainer()
    budget = memory.parse_budget("64MiB")
    dims = model_dims(ex.model)
    n = next(n for n in range(64, 1 << 16, 64)
             if memory.pass_row_bytes(dims, n, memory.LRP_STORAGE) > budget)  # the eager pass stops fitting
    spec = [registry.get_method("attnlrp")]
    cost = engine.pass_cost(ex.runner, spec, budget)
    logits = ex.runner.head.logit_positions_per_input  # the next token's position only
    assert logits == 1
    # AttnLRP's own pass runs fused, short inputs too: every layer's activations kept while they fit (less than
    # the eager pass would keep), each layer recomputed beyond
    kept = dataclasses.replace(memory.KEPT_LRP_STORAGE, logit_rows=logits)
    assert memory.pass_row_bytes(dims, 64, kept) < memory.pass_row_bytes(dims, 64, memory.LRP_STORAGE)
    assert cost.own_storage("attnlrp", 64) == cost.own_storage("attnlrp", n) == kept
    counted = kept_pass_dims(ex.model, dims)  # what the kept pass's rules save, counted on the model
    assert 0 < counted.lrp_vectors < dims.activation_vectors
    m = next(m for m in range(n, 1 << 16, 64) if memory.pass_row_bytes(counted, m, kept) > budget)
    assert cost.own_storage("attnlrp", m - 64) == kept
    assert cost.own_storage("attnlrp", m) == dataclasses.replace(memory.FUSED_LRP_STORAGE, logit_rows=logits)
    assert cost.own(m) < memory.pass_row_bytes(dims, m, memory.LRP_STORAGE) // 4
    other = engine.pass_cost(ex.runner, spec, budget, {"attnlrp": {"epsilon": 1e-3}})
    assert other.own_storage("attnlrp", n) == dataclasses.replace(memory.LRP_STORAGE, logit_rows=logits)
    # beside PartialLRP under AttnLRP's rules, which reads the pass's maps: the eager pass while it fits
    maps = engine.pass_cost(ex.runner, [*spec, registry.get_method("partiallrp")], budget,
                            {"partiallrp": {"rules": "attnlrp"}})
    assert maps.own_storage("attnlrp", 64) == dataclasses.replace(memory.LRP_STORAGE, logit_rows=logits)
    # beside a method reading the attention relevance, that one keeps what recomputes it
    both = engine.pass_cost(ex.runner, [*spec, registry.get_method("transatt")], budget)
    assert both.own_storage("attnlrp", n) == dataclasses.replace(memory.FUSED_LRP_STORAGE, logit_rows=logits)
    assert both.own_storage("transatt", n) == dataclasses.replace(memory.FUSED_RELEVANCE_STORAGE, logit_rows=logits)
    # shorter, the eager pass where it fits in what the budget leaves beside the shared pass
    eager = dataclasses.replace(memory.LRP_STORAGE, logit_rows=logits)
    k = max(k for k in range(64, n, 8)
            if both.shared(k) + memory.pass_row_bytes(dims, k, eager) <= budget)
    assert both.own_storage("transatt", k) == eager
    assert both.own_storage("transatt", k + 8) == dataclasses.replace(memory.FUSED_RELEVANCE_STORAGE,
                                                                      logit_rows=logits)
    # a generation's prefixes: the logits from the first step's last token on; fused beyond the eager pass too
    prefixes = engine.pass_cost(ex.runner, spec, budget, prefixes=True, steps=7)
    assert prefixes.own_storage("attnlrp", n - 64) == dataclasses.replace(memory.LRP_STORAGE, logit_rows=8)
    assert prefixes.own_storage("attnlrp", n) == dataclasses.replace(memory.FUSED_LRP_STORAGE, logit_rows=8)
    # beside PartialLRP: their joint pass, eager, where it fits; beyond, each its own fused pass, PartialLRP's
    # keeping the last layer's factors (every position's logits without a step count)
    joint = engine.pass_cost(ex.runner, [*spec, registry.get_method("partiallrp")], budget, prefixes=True)
    assert joint.own_storage("attnlrp", n - 64) == joint.own_storage("partiallrp", n - 64) == memory.LRP_STORAGE
    assert joint.own_storage("attnlrp", n) == memory.FUSED_LRP_STORAGE
    assert joint.own_storage("partiallrp", n) == memory.FUSED_LAST_LAYER_STORAGE


def test_the_estimate_of_integrated_gradients_follows_its_fused_passes():
    ex = Explainer(make_model("bert"), make_tokenizer())
    budget = memory.parse_budget("64MiB")
    cost = engine.pass_cost(ex.runner, [registry.get_method("integratedgradients")], budget)
    assert cost.own_storage("integratedgradients", 16) == memory.Storage(eager=False, backward=True)
    dims = model_dims(ex.model)
    n = next(n for n in range(64, 1 << 20, 64)
             if memory.pass_row_bytes(dims, n, memory.Storage(eager=False, backward=True)) > budget)
    assert cost.own_storage("integratedgradients", n).recompute  # the runtime's choice too
    assert memory.gradient_pass_storage(dims, n, budget, fused=True).recompute
    prefixes = engine.pass_cost(ex.runner, [registry.get_method("integratedgradients")], budget, prefixes=True)
    assert prefixes.own_storage("integratedgradients", 16).eager


def test_long_inputs_set_the_allocator_once(monkeypatch):
    """From LONG_INPUT_TOKENS padded tokens on, the mmap threshold is fixed, once per process; short inputs and
    ATTNLENS_KEEP_MALLOC leave the allocator alone."""
    from attnlens.core import allocator, batching

    calls = []
    monkeypatch.setattr(allocator, "set_mmap_threshold", lambda threshold=allocator.MMAP_THRESHOLD: calls.append(
        threshold) or True)
    monkeypatch.setattr(allocator, "_threshold", None)
    batching.pad_batch([[1] * 10], 0, torch.device("cpu"))
    assert calls == []
    monkeypatch.setenv("ATTNLENS_KEEP_MALLOC", "1")
    batching.pad_batch([[1] * allocator.LONG_INPUT_TOKENS], 0, torch.device("cpu"))
    assert calls == []
    monkeypatch.delenv("ATTNLENS_KEEP_MALLOC")
    for _ in range(2):
        batching.pad_batch([[1] * 3, [1] * allocator.LONG_INPUT_TOKENS], 0, torch.device("cpu"))
    assert calls == [allocator.MMAP_THRESHOLD]


def test_a_pass_planned_at_half_the_budget_or_more_sets_the_allocator(monkeypatch):
    """Whatever the length, a batch (or a method's own batch) planned at half the budget or more fixes the mmap
    threshold before it runs; smaller ones leave the allocator alone."""
    from attnlens.core import allocator

    calls = []
    monkeypatch.setattr(allocator, "set_mmap_threshold", lambda threshold=allocator.MMAP_THRESHOLD: calls.append(
        threshold) or True)
    monkeypatch.setattr(allocator, "_threshold", None)
    assert list(memory.budget_chunks([10, 10], 2, 1000, lambda n: 200)) == [[0, 1]]  # 400 of 1,000
    assert rows_that_fit(1000, 300, cap=1) == 1
    memory.refuse_over_budget(10, 1000, 499, {})
    assert calls == []
    assert list(memory.budget_chunks([10, 10, 10], 2, 1000, lambda n: 300)) == [[0, 1], [2]]  # 600 of 1,000
    assert rows_that_fit(1000, 300) == 3
    memory.refuse_over_budget(10, 1000, 500, {})
    assert calls == [allocator.MMAP_THRESHOLD]  # once per process
    monkeypatch.setattr(allocator, "_threshold", None)
    monkeypatch.setenv("ATTNLENS_KEEP_MALLOC", "1")
    assert rows_that_fit(1000, 300) == 3
    assert calls == [allocator.MMAP_THRESHOLD]


def test_a_batch_filling_its_budget_maps_blocks_of_a_quarter_of_its_hidden_states_while_it_runs(monkeypatch):
    """Given the size of one row's hidden states, a batch planned at half the budget or more runs with the blocks of
    a quarter of its hidden states mapped on their own (blocks just below a fixed threshold left the heaps holding
    freed blocks past the budget); the threshold before is back when the next batch is asked for."""
    from attnlens.core import allocator

    calls = []
    monkeypatch.setattr(allocator, "set_mmap_threshold", lambda threshold=allocator.MMAP_THRESHOLD: calls.append(
        threshold) or True)
    monkeypatch.setattr(allocator, "_threshold", None)
    hidden = 2**20  # one row's hidden states
    chunks = memory.budget_chunks([10, 1, 10, 1], 2, 1000, lambda n: 300 if n == 10 else 10, lambda n: hidden)
    assert next(chunks) == [1, 3]  # 20 of 1,000: the allocator is left alone
    assert calls == []
    assert next(chunks) == [0, 2]  # 600 of 1,000
    assert calls == [2 * hidden // 4]
    with pytest.raises(StopIteration):
        next(chunks)
    assert calls == [2 * hidden // 4, allocator.MMAP_THRESHOLD]


def test_a_recomputed_pass_maps_blocks_of_a_quarter_of_a_layers_hidden_states(monkeypatch):
    """Within a pass that recomputes its layers, every block of a quarter of a layer's hidden states or more is
    mapped on its own (between MIN_THRESHOLD and MMAP_THRESHOLD); the threshold in force before is restored after."""
    from attnlens.core import allocator

    calls = []
    monkeypatch.setattr(allocator, "set_mmap_threshold", lambda threshold=allocator.MMAP_THRESHOLD: calls.append(
        threshold) or True)
    monkeypatch.setattr(allocator, "_threshold", None)
    with allocator.for_layer_blocks(6 * 2**20):
        assert calls == [3 * 2**19]
        with allocator.for_layer_blocks(2**16):
            assert calls[-1] == allocator.MIN_THRESHOLD
        assert calls[-1] == 3 * 2**19
    assert calls[-1] == allocator.MMAP_THRESHOLD  # none was set before: the fixed threshold for long inputs
    del calls[:]
    with allocator.for_layer_blocks(64 * 2**20):  # never above the threshold for long inputs
        pass
    assert calls == []
    monkeypatch.setenv("ATTNLENS_KEEP_MALLOC", "1")
    with allocator.for_layer_blocks(6 * 2**20):
        pass
    assert calls == []
    monkeypatch.delenv("ATTNLENS_KEEP_MALLOC")
    monkeypatch.setattr(allocator, "set_mmap_threshold", lambda threshold=0: calls.append(threshold) and False)
    with allocator.for_layer_blocks(6 * 2**20):  # off glibc: tried once, then left alone
        pass
    with allocator.for_layer_blocks(6 * 2**20):
        pass
    assert calls == [3 * 2**19]


def test_recomputing_sizes_the_allocator_by_the_models_hidden_states(monkeypatch):
    """A BERT-base-sized pass over 2,048 tokens recomputing its layers maps blocks from 1.5 MiB on (a quarter of
    2,048 × 768 float32 values), and its layers are switched to recompute only within the block."""
    import transformers

    from attnlens.core import allocator
    from attnlens.core.recomputing import recomputing

    calls = []
    monkeypatch.setattr(allocator, "set_mmap_threshold", lambda threshold=allocator.MMAP_THRESHOLD: calls.append(
        threshold) or True)
    monkeypatch.setattr(allocator, "_threshold", None)
    with torch.device("meta"):
        model = transformers.BertModel(transformers.BertConfig())
    with recomputing(model, 2048) as switched:
        assert switched == 12 and calls == [3 * 2**19]
        assert all("forward" in vars(layer) for layer in model.encoder.layer)  # each layer's forward wrapped
    assert not any("forward" in vars(layer) for layer in model.encoder.layer)
    assert calls == [3 * 2**19, allocator.MMAP_THRESHOLD]


def test_the_mmap_threshold_is_set_on_glibc():
    import platform

    from attnlens.core import allocator

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's mallopt only")
    assert allocator.set_mmap_threshold(allocator.MMAP_THRESHOLD)


def test_free_heap_memory_is_released_between_a_benchmarks_explaining_and_scoring(monkeypatch, tmp_path):
    import platform

    from test_benchmark import METRICS, FakeExplainer, dataset, linear_predict

    from attnlens.core import allocator
    from attnlens.evaluation import runner

    if platform.libc_ver()[0] == "glibc":
        assert allocator.release_free_memory()
    monkeypatch.setenv("ATTNLENS_KEEP_MALLOC", "1")
    assert not allocator.release_free_memory()  # the allocator left as it is
    calls = []
    for name in ("_explain_chunk", "release_free_memory", "score_examples"):
        real = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    runner.run_benchmark(FakeExplainer(), dataset(4), tmp_path, methods="rawatt", metrics=METRICS,
                         predict=linear_predict, progress=False, chunk_size=2)
    assert calls == ["_explain_chunk", "release_free_memory", "score_examples"] * 2


@pytest.fixture(scope="module")
def smollm2_sized() -> Explainer:
    """A causal LM with SmolLM2-135M's layers, heads and widths (and a small vocabulary), its weights on the meta
    device: the estimates read only its dimensions."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=V,
                                      max_position_embeddings=8192, pad_token_id=PAD)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return Explainer(model, make_tokenizer())


@pytest.mark.parametrize("method", list_methods())
def test_the_lengths_that_fit_a_budget_are_every_length_up_to_the_longest(method, smollm2_sized):
    """The estimate never refuses a length shorter than one it accepts (the refusal names the longest that fits,
    so a shorter one must fit too): a method's own pass is planned in what the budget leaves beside the shared
    pass, fused where the eager pass would not fit there, and the shared pass recomputes its layers where keeping
    them would leave the own pass too little."""
    spec = [registry.get_method(method)]
    cut = []  # the budgets under which some lengths fit and longer ones do not: the check has a boundary to test
    for budget in ("64MiB", "256MiB", "1GiB", "2GiB", "4GiB"):
        cost = engine.pass_cost(smollm2_sized.runner, spec, memory.parse_budget(budget))
        fits = [cost.total(n) <= cost.budget for n in range(64, 8192, 64)]
        assert fits == sorted(fits, reverse=True), (budget, 64 + 64 * fits.index(False))
        if any(fits) and not all(fits):
            cut.append(budget)
    assert cut, "no budget both accepts and refuses some of these lengths"


def test_value_zeroing_is_estimated_with_one_layer_of_maps():
    """Value zeroing holds one layer's maps at a time (and every layer's input): its estimate counts one layer's
    ``H·N²`` probabilities, not ``L`` of them."""
    ex = _lm_explainer()
    dims = model_dims(ex.model)
    cost = engine.pass_cost(ex.runner, [registry.get_method("valuezeroing")], memory.parse_budget("4GiB"))
    n = 96
    storage = cost.own_storage("valuezeroing", n)
    assert storage.maps and storage.map_layers == 1 and storage.hidden
    every_layer = dataclasses.replace(storage, map_layers=0)
    saved = memory.pass_row_bytes(dims, n, every_layer) - memory.pass_row_bytes(dims, n, storage)
    assert dims.layers > 1 and saved == (dims.layers - 1) * dims.heads * n * n * dims.itemsize


@pytest.mark.parametrize("family", sorted(TINY))
def test_every_architecture_runs_the_pass_its_estimate_planned(family, monkeypatch):
    """The shared pass runs in the mode the memory estimate planned it in (fused rows or eager whole maps): a pass
    planned fused that falls back to eager at run time would hold every layer's maps outside the estimate."""
    from attnlens.core import capture

    model = make_model(family)
    ex = Explainer(model, make_tokenizer())
    stream = "encoder" if getattr(model.config, "is_encoder_decoder", False) else "self"
    keep = registry.get_method("grads").needs & {registry.ATTENTION_ROWS, registry.ATTENTION}
    planned = capture.capture_mode(model, ex.runner.adapter, stream, keep)
    modes = []
    run = capture._run
    signature = inspect.signature(run)

    def recorded(*args, **kwargs):
        modes.append(signature.bind(*args, **kwargs).arguments["mode"])
        return run(*args, **kwargs)

    monkeypatch.setattr(capture, "_run", recorded)
    ex.explain(["a good movie"], methods=["grads"])
    assert modes == [planned]


def test_live_tensor_peak_counts_what_is_alive_at_once():
    """LiveTensorPeak's count against sizes known by construction: new storages count until freed, views and
    in-place results of earlier tensors (weights) do not, and what autograd saves for the backward does."""
    from attnlens.testing.live_tensors import LiveTensorPeak

    weight = torch.ones(100, 100)  # 40,000 bytes, made before the block
    with LiveTensorPeak() as live:
        a = torch.ones(1000)  # 4,000
        b = a * 2  # 8,000 alive
        del a
        c = b + 1  # 8,000 alive: a was freed
        _ = weight.t()
        weight.mul_(2)
    assert (live.peak, live.bytes) == (8000, 8000)
    del b, c

    x = torch.ones(1000, requires_grad=True)
    with LiveTensorPeak() as live:
        y = x.exp()  # saved by exp's backward
        z = y.sum()
        del y
        held = live.bytes
        z.backward()
    assert held == 4000 + 4  # exp's result (kept for the backward) and the sum
    assert live.peak >= held


@pytest.mark.parametrize("family", ["gpt2", "opt", "t5", "albert"])
def test_the_feed_forward_probe_leaves_nothing_alive(family):
    """Counting what a feed-forward saves runs a probe with gradients; its activation functions save their own
    outputs (tanh, ReLU), and nothing of the probe may outlive the count (a cycle through autograd would keep it,
    the first layer's weights with it, for as long as the process runs)."""
    import gc

    from attnlens.models.feed_forward import feed_forward_saved_vectors

    def graph_tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.grad_fn is not None)

    before = graph_tensors()
    model = make_model(family)
    hidden = getattr(model.config, "hidden_size", None) or model.config.d_model
    assert feed_forward_saved_vectors(model, hidden, torch.float32) > 0
    assert graph_tensors() == before


@pytest.mark.parametrize(("family", "recomputes"), [("albert", False), ("llama", True), ("bert", True)])
def test_a_pass_recomputes_its_layers_only_where_the_model_can(family, recomputes):
    """ALBERT's one shared layer is none of transformers' checkpointing layers: a backward over it keeps every
    layer's activations whatever the budget, so the estimate must count them, not a recomputation that would not
    happen."""
    from attnlens.core.memory import fitting
    from attnlens.models.recompute import recomputable

    model = make_model(family)
    dims = model_dims(model)
    assert dims.recomputable is recomputable(model) is recomputes
    fused = Storage(eager=False, backward=True)
    planned = fitting(dims, 512, fused, budget=1)
    assert planned.recompute is recomputes
    assert pass_row_bytes(dims, 512, planned) == pass_row_bytes(dims, 512, dataclasses.replace(fused,
                                                                                                recompute=recomputes))
