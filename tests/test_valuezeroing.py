"""Value zeroing (Mohebbi et al. 2023) against a naive re-computation that reruns the whole model once per
(layer, token) with a forward hook zeroing one value vector."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from conftest import make_model

from attnlens import Explainer, InputError, get_method
from attnlens.architectures import architecture_for
from attnlens.methods.valuezeroing import value_zeroing_matrices

TYPES = ["bert", "distilbert", "roberta", "llama"]
TEXTS = ["the movie was good", "not very bad , i really didn ' t like this film", "awful !"]


def _module(root, path):
    for name in path.split("."):
        root = getattr(root, name)
    return root


def naive_scores(model, tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """The method's definition, one full forward per (layer, zeroed token), in float64 numpy: per-layer
    row-normalised cosine distances C^l, rolled out as the authors' ``compute_joint_attention(res=False)``;
    returns (rollout row of the explained position per layer (L, N), the raw C (L, N, N))."""
    spec = architecture_for(model.config).layers
    layers = _module(model.base_model, spec.layers)
    ids = tokenizer(text, return_tensors="pt")
    takes = inspect.signature(model.forward).parameters
    ids = {k: v for k, v in ids.items() if k in takes}
    n = ids["input_ids"].shape[1]

    def layer_outputs(zero_layer=None, zero_token=None):
        outs = {}
        handles = [layer.register_forward_hook(
            lambda m, a, o, i=i: outs.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].double().numpy()))
            for i, layer in enumerate(layers)]
        if zero_layer is not None:
            def zero(m, a, o):
                o = o.clone()
                o[:, zero_token] = 0
                return o
            handles.append(_module(layers[zero_layer], spec.value).register_forward_hook(zero))
        with torch.no_grad():
            model(**ids, use_cache=False) if model.config.model_type == "llama" else model(**ids)
        for h in handles:
            h.remove()
        return outs

    original = layer_outputs()
    c = np.zeros((len(layers), n, n))
    for layer in range(len(layers)):
        for j in range(n):
            changed = layer_outputs(layer, j)[layer]
            h = original[layer]
            cos = (changed * h).sum(-1) / np.linalg.norm(changed, axis=-1) / np.linalg.norm(h, axis=-1)
            c[layer, :, j] = 1 - cos
    c = np.clip(c, 0, None)
    normalised = c / c.sum(-1, keepdims=True)
    joint = [normalised[0]]
    for layer in range(1, len(layers)):
        joint.append(normalised[layer] @ joint[-1])
    row = n - 1 if model.config.model_type == "llama" else 0
    return np.stack([j[row] for j in joint]), c


@pytest.mark.parametrize("model_type", TYPES)
def test_matches_naive_whole_model_recomputation(model_type, tokenizer):
    model = make_model(model_type)
    ex = Explainer(model, tokenizer)
    for text in TEXTS[:2]:
        (e,) = ex.explain(text, "valuezeroing")
        layers, _ = naive_scores(model, tokenizer, text)
        np.testing.assert_allclose(e.layers["valuezeroing"], layers, atol=2e-5)
        np.testing.assert_allclose(e.scores["valuezeroing"], layers[-1], atol=2e-5)
        (last,) = ex.explain(text, "valuezeroing", options={"valuezeroing": {"rollout": False}})
        _, c = naive_scores(model, tokenizer, text)
        row = len(e.tokens) - 1 if model_type == "llama" else 0
        np.testing.assert_allclose(last.scores["valuezeroing"], c[-1, row] / c[-1, row].sum(), atol=2e-5)


@pytest.mark.parametrize("model_type", ["bert", "llama"])
def test_batch_equals_one_by_one_and_padding_scores_zero(model_type, tokenizer):
    ex = Explainer(make_model(model_type), tokenizer)
    batch = ex.explain(TEXTS, "valuezeroing", batch_size=3)
    for text, b in zip(TEXTS, batch, strict=True):
        (alone,) = ex.explain(text, "valuezeroing")
        np.testing.assert_allclose(b.scores["valuezeroing"], alone.scores["valuezeroing"], atol=1e-5)
        np.testing.assert_allclose(b.layers["valuezeroing"], alone.layers["valuezeroing"], atol=1e-5)
    encoded = ex.encode(TEXTS)
    ctx, out = ex.compute_batch(encoded, [-1] * 3, [get_method("valuezeroing")], {"valuezeroing": {"rollout": True}})
    scores = out["valuezeroing"][0]
    assert torch.all(scores[~ctx.token_mask.bool()] == 0)
    assert torch.allclose(scores.sum(1), torch.ones(3, dtype=scores.dtype), atol=1e-5)  # rows of a rollout of
    # row-stochastic matrices sum to 1


def test_chunked_reruns_equal_one_call(tokenizer):
    model = make_model("bert")
    enc = tokenizer(TEXTS, return_tensors="pt", padding=True)
    mask = enc["attention_mask"].bool()
    with torch.no_grad():
        whole = value_zeroing_matrices(model, dict(enc), mask)
        chunked = value_zeroing_matrices(model, dict(enc), mask, max_rows=1)  # one example per chunk
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert torch.all(a[~mask] == 0) and torch.all(a.transpose(1, 2)[~mask] == 0)


def test_model_unchanged_and_no_hooks_left(tokenizer):
    model = make_model("bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Explainer(model, tokenizer).explain(TEXTS, "valuezeroing")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_types_without_layers_and_cross_streams_are_refused_or_skipped(tokenizer):
    ex = Explainer(make_model("gpt2"), tokenizer)
    with pytest.raises(InputError, match="valuezeroing does not know where the layers of model type 'gpt2'"):
        ex.explain("the movie", "valuezeroing")
    with pytest.warns(UserWarning, match="skipping.*valuezeroing"):
        (e,) = ex.explain("the movie", "all")
    assert "valuezeroing" not in e.scores
    bart = Explainer(make_model("bart"), tokenizer, attention="cross")
    with pytest.raises(InputError, match="valuezeroing"):
        bart.explain("the movie", "valuezeroing")
