"""Fused attention for grouped-query models, and passes whose backward runs in autograd's own thread.

On a GPU two things differ from the CPU these tests run on: SDPA in float32 cannot take grouped key/value heads
memory-efficiently (attnlens repeats them first), and autograd runs the backward, and every layer recomputed in
it, in a thread of its own. Both are reproduced here: the placement check is patched to say CUDA, and the
backward is sent to another thread."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import make_tokenizer

from attnlens import Explainer
from attnlens.core import capture, engine, fused_attention
from attnlens.core.fused_attention import FUSED, FUSED_REPEATED_HEADS, fused_implementation, sdpa_repeated_heads
from attnlens.core.modelstate import attention_implementation, explaining
from attnlens.lrp import lrp_pass

PAD, CLS, SEP = 0, 2, 3


def grouped_llama(seed: int = 0, classifier: bool = False) -> torch.nn.Module:
    """A tiny Llama language model (or sequence classifier) with two query heads per key/value head."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, max_position_embeddings=128,
                         pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, attn_implementation="eager")
    torch.manual_seed(seed)
    model = (LlamaForSequenceClassification if classifier else LlamaForCausalLM)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model


class _Layer(torch.nn.Module):
    def __init__(self, groups: int, causal: bool = True) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = causal


@pytest.mark.parametrize("masked", [False, True])
def test_repeated_heads_give_the_grouped_attention_of_sdpa(masked):
    """The same outputs as transformers' SDPA attention of the grouped heads, causal or under a padding mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = None
    if masked:
        mask = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
        mask[1, :, :, 5:] = False
    want, _ = sdpa_attention_forward(_Layer(2), q, k, v, mask, scaling=0.3)
    got, _ = sdpa_repeated_heads(_Layer(2), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got.shape == (2, 7, 4, 8)


def test_repeated_heads_are_chosen_for_grouped_float32_models_on_cuda_only(monkeypatch):
    model = grouped_llama()
    assert fused_implementation(model) == FUSED  # on the CPU
    monkeypatch.setattr(fused_attention, "placement", lambda m: ("cuda", torch.float32))
    assert fused_implementation(model) == FUSED_REPEATED_HEADS
    with explaining(model, "sdpa"):
        assert attention_implementation(model) == FUSED_REPEATED_HEADS
    assert attention_implementation(model) == "eager"
    monkeypatch.setattr(fused_attention, "placement", lambda m: ("cuda", torch.bfloat16))
    assert fused_implementation(model) == FUSED  # flash takes grouped heads in half precision
    monkeypatch.setattr(fused_attention, "placement", lambda m: ("cuda", torch.float32))
    one_group = grouped_llama()
    for layer in one_group.modules():
        if hasattr(layer, "num_key_value_groups"):
            layer.num_key_value_groups = 1
    assert fused_implementation(one_group) == FUSED


def test_explanations_under_repeated_heads_equal_those_under_sdpa(monkeypatch):
    """Every method's scores of an answer are unchanged when the fused passes repeat the key/value heads."""
    ex = Explainer(grouped_llama(), make_tokenizer())
    prompt, answer = [CLS, 10, 11, 12, 13, 14, 15, 16], [17, 18]
    methods = ["integratedgradients", "grads", "attnlrp", "partiallrp"]
    options = {"integratedgradients": {"n_steps": 8}}
    want = ex.explain_answer(prompt, answer, methods, options=options)
    seen = []
    real = sdpa_repeated_heads

    def counting(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_attention, "placement", lambda m: ("cuda", torch.float32))
    monkeypatch.setattr(fused_attention, "sdpa_repeated_heads", counting)
    from transformers import AttentionInterface

    AttentionInterface.register(FUSED_REPEATED_HEADS, counting)
    try:
        got = ex.explain_answer(prompt, answer, methods, options=options)
    finally:
        AttentionInterface.register(FUSED_REPEATED_HEADS, real)
    assert seen  # integrated gradients ran its passes through it
    for m in methods:
        np.testing.assert_allclose(got.scores[m], want.scores[m], rtol=1e-5, atol=1e-7 * np.abs(want.scores[m]).max())


def backward_elsewhere(monkeypatch) -> list[int]:
    """From now on ``torch.autograd.grad`` called in this thread runs in a worker thread, as autograd runs a GPU's
    backward: context variables set around the forward are not set there. Returns a list that counts the calls."""
    real = torch.autograd.grad
    main = threading.get_ident()
    calls: list[int] = []

    def grad(*args, **kwargs):
        if threading.get_ident() != main:  # a gradient taken inside the backward
            return real(*args, **kwargs)
        calls.append(1)
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(real, *args, **kwargs).result()

    monkeypatch.setattr(torch.autograd, "grad", grad)
    return calls


@pytest.mark.parametrize("rules", ["attnlrp", "chefer"])
def test_fused_lrp_pass_recomputes_its_layers_in_the_backwards_thread(rules, monkeypatch):
    """The fused LRP pass recomputes each layer in the backward, under the pass's rules, whichever thread runs the
    backward: the same relevance as when it runs in the forward's thread."""
    model = grouped_llama(classifier=True).double()
    inputs = {"input_ids": torch.tensor([[CLS, 10, 11, 12, 13, 14, 15]])}
    want = lrp_pass(model, inputs, 0, rules=rules, fused=True)
    calls = backward_elsewhere(monkeypatch)
    got = lrp_pass(model, inputs, 0, rules=rules, fused=True)
    assert calls
    if rules == "attnlrp":
        torch.testing.assert_close(got.input_relevance, want.input_relevance, rtol=0, atol=1e-12)
    else:
        rows = torch.arange(inputs["input_ids"].shape[1])
        for layer in range(want.n_layers):
            torch.testing.assert_close(got.relevance_rows(layer, rows), want.relevance_rows(layer, rows), rtol=0,
                                       atol=1e-12)


def test_shared_pass_recomputes_its_layers_in_the_backwards_thread(monkeypatch):
    """The shared pass under fused attention, its layers recomputed in the backward, keeps the explained rows and
    never falls back to whole attention maps when the backward runs in another thread."""
    ex = Explainer(grouped_llama(), make_tokenizer())
    prompt, answer = [CLS, 10, 11, 12, 13, 14, 15, 16], [17, 18]
    methods = ["grads", "agrad", "attcat"]
    want = ex.explain_answer(prompt, answer, methods)
    modes, recomputed = [], []
    real_run, real_recomputing, real_fitting = capture._run, capture.recomputing, engine.fitting

    def run(*args, **kwargs):
        modes.append(args[15])
        return real_run(*args, **kwargs)

    def recomputing(model, tokens):
        recomputed.append(tokens)
        return real_recomputing(model, tokens)

    def recompute_always(dims, n, storage, budget):
        found = real_fitting(dims, n, storage, budget)
        return dataclasses.replace(found, recompute=found.backward and not found.eager)

    monkeypatch.setattr(engine, "fitting", recompute_always)
    monkeypatch.setattr(capture, "_run", run)
    monkeypatch.setattr(capture, "recomputing", recomputing)
    calls = backward_elsewhere(monkeypatch)
    got = ex.explain_answer(prompt, answer, methods)
    assert calls and recomputed == [len(prompt) + len(answer)] and set(modes) == {capture.ROWS}
    for m in methods:
        np.testing.assert_allclose(got.scores[m], want.scores[m], rtol=1e-5, atol=1e-7 * np.abs(want.scores[m]).max())
