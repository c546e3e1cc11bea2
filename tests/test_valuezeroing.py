"""Value zeroing (Mohebbi et al. 2023) against a naive re-computation that reruns the whole model once per
(layer, token) with a forward hook zeroing one value vector."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch
import transformers
from conftest import PAD, V, make_model, randomise_biases_and_norms

from attnlens import Explainer, InputError, get_method
from attnlens.methods.valuezeroing import value_zeroing_matrices
from attnlens.models.architectures import ARCHITECTURES, architecture_for, register_architecture

DECODERS = ("llama", "gpt2", "gpt_neo", "qwen3", "gemma", "gemma2", "mixtral", "gpt_neox", "gptj", "phi", "phi3", "opt",
            "falcon", "bloom", "falcon-alibi")
SEQ2SEQ = ("bart", "mbart", "t5")
TYPES = ["bert", "distilbert", "roberta", "albert", "mpnet", "deberta", "deberta-v2", "xlm-roberta-xl", "modernbert",
         *DECODERS, *SEQ2SEQ]


def build(model_type: str):
    """The tiny model of ``model_type``; "falcon-alibi": Falcon with ALiBi (sequential blocks, a per-head fused
    projection), whose layers, as BLOOM's, take the ALiBi biases as (batch × heads) rows."""
    if model_type == "deberta":  # a value bias added after the projection: random, so zeroing must remove it too
        return randomise_biases_and_norms(make_model(model_type))
    if model_type != "falcon-alibi":
        return make_model(model_type)
    torch.manual_seed(0)
    config = transformers.FalconConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       alibi=True, parallel_attn=False, multi_query=False, bias=True,
                                       pad_token_id=PAD, attn_implementation="eager")
    return transformers.FalconForSequenceClassification(config).eval()
TEXTS = ["the movie was good", "not very bad , i really didn ' t like this film", "awful !"]


def _module(root, path):
    for name in path.split("."):
        root = getattr(root, name)
    return root


def naive_scores(model, tokenizer, text: str, stream: str = "self") -> tuple[np.ndarray, np.ndarray]:
    """The method's definition, one full forward per (layer, zeroed token), in float64 numpy: per-layer
    row-normalised cosine distances C^l, rolled out as the authors' ``compute_joint_attention(res=False)``;
    returns (the explained row of the rollout up to each layer (L, N), the raw C (L, N, N))."""
    spec = architecture_for(model.config).layers
    layers = list({id(m): m for m in spec.modules(model, stream)}.values())  # a shared layer once
    ids = tokenizer(text, return_tensors="pt")
    takes = inspect.signature(model.forward).parameters
    ids = {k: v for k, v in ids.items() if k in takes}
    n = ids["input_ids"].shape[1]

    def layer_outputs(zero_call=None, zero_token=None):
        """Every layer call's output, in call order; the value vector of ``zero_token`` zeroed in call
        ``zero_call`` only (a shared layer, as ALBERT's, is called once per depth)."""
        outs, state = [], {"call": -1}
        handles = []
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(lambda m, a: state.__setitem__("call", state["call"] + 1)))
            handles.append(layer.register_forward_hook(
                lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o)[0].double().numpy())))

            def zero(m, a, o, layer=layer):
                if state["call"] != zero_call:
                    return o
                o = o.clone()
                if model.config.model_type == "deberta":  # (heads, q/k/v, head_dim); v_bias is added after
                    sa = layer.attention.self
                    o.view(*o.shape[:2], sa.num_attention_heads, 3, -1)[:, zero_token, :, 2] = -sa.v_bias.view(
                        sa.num_attention_heads, -1)
                    return o
                if model.config.model_type in ("gpt_neox", "bloom"):  # (heads, q/k/v, head_dim) per position
                    o.view(*o.shape[:2], model.config.num_attention_heads, 3, -1)[:, zero_token, :, 2] = 0
                    return o
                cfg = model.config
                if cfg.model_type == "falcon":  # (groups, queries per group + 2, head_dim): each group's last part
                    dh = cfg.hidden_size // cfg.num_attention_heads
                    groups = (o.shape[-1] // dh - cfg.num_attention_heads) // 2
                    o.view(*o.shape[:2], groups, -1, dh)[:, zero_token, :, -1] = 0
                    return o
                fused = cfg.model_type in ("gpt2", "modernbert")  # query, key, value: the values the last third
                part = o.shape[-1] // 3 if fused else o.shape[-1]
                if cfg.model_type == "phi3":  # query, key, value fused: the values kv heads wide
                    part = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
                o[:, zero_token, -part:] = 0
                return o
            handles.append(_module(layer, spec.value).register_forward_hook(zero))
        with torch.no_grad():
            model(**ids)
        for h in handles:
            h.remove()
        return outs

    original = layer_outputs()
    n_layers = len(original)
    c = np.zeros((n_layers, n, n))
    for layer in range(n_layers):
        for j in range(n):
            changed = layer_outputs(layer, j)[layer]
            h = original[layer]
            cos = (changed * h).sum(-1) / np.linalg.norm(changed, axis=-1) / np.linalg.norm(h, axis=-1)
            c[layer, :, j] = 1 - cos
    c = np.clip(c, 0, None)
    normalised = c / c.sum(-1, keepdims=True)
    joint = [normalised[0]]
    for layer in range(1, n_layers):
        joint.append(normalised[layer] @ joint[-1])
    weights = np.zeros(n)
    if model.config.model_type in SEQ2SEQ:  # the encoder stream is explained by the mean over its rows
        weights[:] = 1 / n
    else:
        weights[0 if architecture_for(model.config).family == "encoder" else n - 1] = 1
    return np.stack([weights @ j for j in joint]), c, weights


@pytest.mark.parametrize("model_type", TYPES)
def test_matches_naive_whole_model_recomputation(model_type, tokenizer):
    model = build(model_type)
    ex = Explainer(model, tokenizer)
    tolerance = {"atol": 5e-5, "rtol": 1e-3}  # float32 cosine distances of nearly parallel vectors
    for text in TEXTS[:2]:
        (e,) = ex.explain(text, "valuezeroing")
        layers, c, weights = naive_scores(model, tokenizer, text, "encoder" if model_type in SEQ2SEQ else "self")
        np.testing.assert_allclose(e.layers["valuezeroing"], layers, **tolerance)
        np.testing.assert_allclose(e.scores["valuezeroing"], layers[-1], **tolerance)
        (last,) = ex.explain(text, "valuezeroing", options={"valuezeroing": {"rollout": False}})
        np.testing.assert_allclose(last.scores["valuezeroing"], weights @ (c[-1] / c[-1].sum(-1, keepdims=True)),
                                   **tolerance)
        assert "valuezeroing" not in last.layers  # the last layer alone is rerun


@pytest.mark.parametrize("model_type,attention", [("bert", None), ("llama", None), ("gpt2", None), ("falcon", None),
                                                  ("bloom", None), ("falcon-alibi", None),
                                                  ("bart", "decoder"), ("t5", "decoder"), ("t5", "encoder"),
                                                  ("mbart", "decoder")])
def test_batch_equals_one_by_one_and_padding_scores_zero(model_type, attention, tokenizer):
    ex = Explainer(build(model_type), tokenizer, attention=attention)
    batch = ex.explain(TEXTS, "valuezeroing", batch_size=3)
    for text, b in zip(TEXTS, batch, strict=True):
        (alone,) = ex.explain(text, "valuezeroing")
        np.testing.assert_allclose(b.scores["valuezeroing"], alone.scores["valuezeroing"], atol=1e-5)
        np.testing.assert_allclose(b.layers["valuezeroing"], alone.layers["valuezeroing"], atol=1e-5)
    encoded = ex.encode(TEXTS)
    ctx, out = ex.compute_batch(encoded, [-1] * 3, [get_method("valuezeroing")], {"valuezeroing": {"rollout": True}})
    scores = out["valuezeroing"][0]
    assert torch.all(scores[~ctx.token_mask.bool()] == 0)
    if attention is None:  # rows of a rollout of row-stochastic matrices sum to 1 (BART's decoder stream drops
        # the start token's share when its keys are mapped to input tokens)
        assert torch.allclose(scores.sum(1), torch.ones(3, dtype=scores.dtype), atol=1e-5)


@pytest.mark.parametrize("model_type", ["bert", "llama", "gptj"])
def test_layers_with_a_known_anatomy_are_not_rerun_per_token(model_type, tokenizer, monkeypatch):
    """Zeroing a value vector only removes its share of the attention-block sum, so a layer with a known anatomy
    runs its FFN part at the changed sums instead of being rerun once per token: each layer is called for its
    output and one check, whatever the length; the scores are those of the reruns."""
    from attnlens.methods import decomposition, valuezeroing

    model = build(model_type)
    ex = Explainer(model, tokenizer)
    spec = architecture_for(model.config).layers
    rows = []  # the token rows every layer call runs

    def count(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        rows.append(hidden.shape[0] * hidden.shape[1])

    n_layers = len(spec.modules(model, "self"))
    handles = [layer.register_forward_pre_hook(count, with_kwargs=True) for layer in spec.modules(model, "self")]
    fast = ex.explain(TEXTS, "valuezeroing", batch_size=3)
    b, n = len(TEXTS), max(len(e.ids) for e in ex.encode(TEXTS))  # one padded batch
    # per layer: the shared pass, value zeroing's recorded forward, the layer's output and the check
    assert sum(rows) == 4 * n_layers * b * n
    rows.clear()
    monkeypatch.setattr(decomposition.ValueZeroedLayer, "applies", staticmethod(lambda model: False))
    rerun = ex.explain(TEXTS, "valuezeroing", batch_size=3)
    for h in handles:
        h.remove()
    assert sum(rows) > n_layers * b * n * 3  # the reruns: a copy of the layer per (example, zeroed token)
    for a, b in zip(fast, rerun, strict=True):
        np.testing.assert_allclose(a.layers["valuezeroing"], b.layers["valuezeroing"], atol=1e-5, rtol=1e-3)
    monkeypatch.undo()
    # the last layer's explained rows alone: one row per example without the rollout
    asked = []
    real_zeroed = decomposition.ValueZeroedLayer.zeroed
    monkeypatch.setattr(decomposition.ValueZeroedLayer, "zeroed",
                        lambda self, e, rows, *keys, **kw: asked.append(self.attn[e][:, rows].shape[1]) or
                        real_zeroed(self, e, rows, *keys, **kw))
    ex.explain(TEXTS, "valuezeroing", batch_size=3, options={"valuezeroing": {"rollout": False}})
    assert asked == [n] * len(TEXTS) + [1] * len(TEXTS)  # every row of the check's one zeroing, then each explained row
    monkeypatch.undo()
    # a recomputation that does not zero as the model does is caught by the check, and the layer is rerun
    real = decomposition.ValueZeroedLayer.zeroed
    monkeypatch.setattr(decomposition.ValueZeroedLayer, "zeroed", lambda self, *a, **kw: real(self, *a, **kw) + 0.1)
    caught = []
    trusted = valuezeroing._trusted
    monkeypatch.setattr(valuezeroing, "_trusted", lambda *a: caught.append(trusted(*a)) or caught[-1])
    for a, b in zip(ex.explain(TEXTS, "valuezeroing", batch_size=3), rerun, strict=True):
        np.testing.assert_allclose(a.layers["valuezeroing"], b.layers["valuezeroing"], atol=1e-6)
    assert caught == [False] * n_layers


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_one_layer_of_maps_is_held_at_a_time(model_type, tokenizer, monkeypatch):
    """The recorded forward keeps no maps, and each layer's maps are freed before the next layer's are read: the
    memory of one layer, not of every layer, whatever the depth."""
    import gc
    import weakref

    from attnlens.methods import decomposition

    model = build(model_type)
    asked_maps = []
    real_forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: asked_maps.append(k.get("output_attentions"))
                        or real_forward(*a, **k))
    held, alive = [], []
    real_of = decomposition.ValueZeroedLayer.of

    def of(model, block, x, attn):
        gc.collect()
        alive.append(sum(r() is not None for r in held))  # earlier layers' maps still referenced
        held.append(weakref.ref(attn))
        return real_of(model, block, x, attn)

    monkeypatch.setattr(decomposition.ValueZeroedLayer, "of", staticmethod(of))
    ex = Explainer(model, tokenizer)
    (e,) = ex.explain(TEXTS[0], "valuezeroing")
    n_layers = len(architecture_for(model.config).layers.modules(model, "self"))
    assert len(held) == n_layers and alive == [0] * n_layers
    assert asked_maps and not any(asked_maps)  # neither the shared pass nor value zeroing's forward returns maps
    monkeypatch.undo()
    layers, _, _ = naive_scores(model, tokenizer, TEXTS[0], "self")
    np.testing.assert_allclose(e.layers["valuezeroing"], layers, atol=5e-5, rtol=1e-3)


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


def test_reruns_are_batched_within_the_memory_budget_with_the_same_scores(tokenizer, monkeypatch):
    from attnlens.methods import valuezeroing as vz

    model = make_model("llama")
    assert vz.rows_within(model, 4 << 30, 1, 20) == vz.MAX_ROWS  # the cap where the budget is generous
    few = vz.rows_within(model, 1 << 20, 2, 20)
    assert 1 <= few < vz.MAX_ROWS and vz.rows_within(model, 1 << 10, 2, 20) == 1  # never none
    seen = []
    layer_matrices = vz.layer_matrices

    def spy(*args, **kwargs):
        seen.append(kwargs["max_rows"])
        return layer_matrices(*args, **kwargs)

    monkeypatch.setattr(vz, "layer_matrices", spy)
    ex = Explainer(model, tokenizer)
    wide = ex.explain(TEXTS, methods="valuezeroing")
    dims = vz.model_dims(model)  # as if its rows were wide: the budget then holds a few rows at a time
    monkeypatch.setattr(vz, "model_dims", lambda m: dataclasses.replace(dims, forward_vectors=10 ** 6))
    tight = ex.explain(TEXTS, methods="valuezeroing")
    assert seen[0] == vz.MAX_ROWS and 1 <= seen[1] < 64  # a few rows per rerun
    for a, b in zip(wide, tight, strict=True):
        np.testing.assert_allclose(a.scores["valuezeroing"], b.scores["valuezeroing"], rtol=1e-5, atol=1e-7)


def test_model_unchanged_and_no_hooks_left(tokenizer):
    model = make_model("bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Explainer(model, tokenizer).explain(TEXTS, "valuezeroing")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_types_without_layers_and_cross_streams_are_refused_or_skipped(tokenizer, entry_without_layers):
    ex = Explainer(make_model("deberta"), tokenizer)
    with pytest.raises(InputError, match="valuezeroing does not know where the layers of model type 'deberta'"):
        ex.explain("the movie", "valuezeroing")
    with pytest.warns(UserWarning, match="skipping.*valuezeroing"):
        (e,) = ex.explain("the movie", "all", options={"integratedgradients": {"n_steps": 2}})
    assert "valuezeroing" not in e.scores
    bart = Explainer(make_model("bart"), tokenizer, attention="cross")
    with pytest.raises(InputError, match="valuezeroing needs self-attention"):
        bart.explain("the movie", "valuezeroing")


def test_all_on_long_inputs_says_value_zeroing_dominates(tokenizer, monkeypatch):
    """Under "all", value zeroing on a long input (one pass per token) gets a notice; named, or on short
    inputs, it runs quietly. (The tiny model takes 48 tokens: "long" is lowered to 12.)"""
    import warnings

    from attnlens.core import engine

    monkeypatch.setattr(engine, "LONG_INPUT", 12)
    ex = Explainer(make_model("bert"), tokenizer)
    long_text = " ".join(["good movie"] * 8)
    quick = ["rawatt", "valuezeroing"]
    with pytest.warns(UserWarning, match=r"valuezeroing reruns every layer once per input token.*name the methods"):
        ex.explain(long_text, methods="all", options={"integratedgradients": {"n_steps": 2}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex.explain(long_text, methods=quick)
        ex.explain(TEXTS[0], methods=quick)


def test_an_entry_whose_layers_cannot_be_rerun_on_some_rows_is_refused(tokenizer):
    """``Layers.no_rerun`` (a string, or a function of the config) is quoted in the refusal."""
    old = ARCHITECTURES["gpt2"]

    def why(config) -> str | None:
        return "its layers keep state across rows" if config.n_layer == 2 else None

    register_architecture(dataclasses.replace(old, layers=dataclasses.replace(old.layers, no_rerun=why)))
    try:
        with pytest.raises(InputError, match="valuezeroing reruns one layer on some of the rows, and its layers keep"):
            Explainer(make_model("gpt2"), tokenizer).explain("the movie", "valuezeroing")
        with pytest.warns(UserWarning, match="skipping.*valuezeroing"):
            Explainer(make_model("gpt2"), tokenizer).explain("the movie", "all",
                                                             options={"integratedgradients": {"n_steps": 2}})
    finally:
        register_architecture(old)


@pytest.mark.slow
def test_float32_scores_match_the_model_in_float64_on_real_sentences(minilm_sst2):
    """On the real classifier, lower layers barely change a token's output when one value vector is zeroed; the
    cosine distance of such near-parallel vectors must survive float32 (and the rollout that carries it up)."""
    import copy
    import json

    from conftest import DATA

    with (DATA / "sst2" / "dev.jsonl").open(encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(4))]
    ex64 = Explainer(copy.deepcopy(minilm_sst2.model).double(), minilm_sst2.tokenizer)
    single = minilm_sst2.explain(texts, methods=["valuezeroing"])
    double = ex64.explain(texts, methods=["valuezeroing"])
    for a, b in zip(single, double, strict=True):
        np.testing.assert_allclose(a.layers["valuezeroing"], b.layers["valuezeroing"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(a.scores["valuezeroing"], b.scores["valuezeroing"], rtol=0, atol=1e-5)


def _generation_growth() -> tuple[int, int]:
    """Value zeroing over a 24-step generation after a ~900-token prompt (one batch of steps), in this process:
    its peak-RSS growth and the estimate for one row of that length. Run in a fresh process (the peak only
    grows)."""
    from conftest import long_llama, peak_rss_growth

    from attnlens.core.memory import VALUE_ZEROING_STORAGE, model_dims, pass_row_bytes

    ex = long_llama(32, 2)
    prompt = " ".join([TEXTS[1]] * 70)
    target = " good but bad" * 8
    ex.explain_generation(TEXTS[0], methods=["valuezeroing"], target=" good but")  # warm-up
    n = len(ex.encode([prompt])[0].ids) + 24
    assert 800 < n < 1100
    grown = peak_rss_growth(lambda: ex.explain_generation(prompt, methods=["valuezeroing"], target=target,
                                                          batch_size=24, memory_budget="4GiB"))
    return grown, pass_row_bytes(model_dims(ex.model), n, VALUE_ZEROING_STORAGE)


def test_value_zeroing_over_a_generation_holds_one_rollout_whatever_the_number_of_steps():
    """Measured in a fresh process: the steps of a generation read their rows from one ``N x N`` rollout of the
    sequence, so a batch of 24 steps stays within the estimate for one row (a rollout per step would hold 24
    times the square matrices)."""
    from conftest import growth_in_fresh_processes

    grown, estimate = growth_in_fresh_processes(_generation_growth, lambda e: e * 1.1 + 32 * 2**20)
    assert grown <= estimate * 1.1 + 32 * 2**20, (grown, estimate)


def test_generation_steps_whose_keys_are_not_a_prefix_are_refused_in_one_line():
    """The steps' rows are read from the sequence's rollout only where each step's keys are the sequence's real
    positions up to its own: keys with a hole (or beyond the sequence's real ones) are refused, not misread."""
    from attnlens.errors import ModelError
    from attnlens.methods.valuezeroing import _check_prefixes

    sequence = torch.tensor([[1, 1, 1, 1, 1]])
    _check_prefixes(torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]), sequence)
    _check_prefixes(torch.tensor([[0, 1, 1, 0, 0]]), torch.tensor([[0, 1, 1, 1, 1]]))  # a padded first position
    for keys in ([[1, 0, 1, 0, 0]], [[0, 1, 1, 0, 0]]):
        with pytest.raises(ModelError, match="not a prefix") as err:
            _check_prefixes(torch.tensor(keys), sequence)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("model_type", ["llama", "modernbert", "gptj", "bert", "gpt2"])
def test_inputs_longer_than_a_key_block_match_the_reruns_in_float64(model_type, tokenizer, monkeypatch):
    """The zeroed outputs of an input of several blocks of keys, a group of rows at a time (one row at a time with
    few rows per batch), equal the whole model rerun once per (layer, zeroed token), in float64: a gated
    feed-forward's projections read through their RMSNorm (llama) or LayerNorm (modernbert), a parallel layer's
    output minus the zeroed share (gptj) and the feed-forward run at each changed sum (bert, gpt2) are exact."""
    from attnlens.methods import valuezeroing as vz
    from attnlens.methods.decomposition import value_zeroed

    monkeypatch.setattr(vz, "KEY_BLOCK", 8)
    monkeypatch.setattr(value_zeroed, "SHARING_ROWS_PER_HEAD", 1)  # the tiny models' few rows use projections too
    finished = []
    finish = value_zeroed.NormedProjection.finish
    monkeypatch.setattr(value_zeroed.NormedProjection, "finish", lambda s, *a: finished.append(1) or finish(s, *a))
    model = build(model_type).double()
    text = " ".join(["the movie was good , not very bad"] * 3)
    _, want, _ = naive_scores(model, tokenizer, text)
    assert want.shape[-1] > 3 * vz.KEY_BLOCK
    enc = tokenizer(text, return_tensors="pt")
    inputs = {k: v for k, v in enc.items() if k in inspect.signature(model.forward).parameters}
    mask = enc["attention_mask"].bool()
    # Llama's RMSNorm takes its statistics in float32 even in a float64 model, and so does the reference
    rounding = {"rtol": 1e-5, "atol": 1e-9} if model_type == "llama" else {"rtol": 1e-9, "atol": 1e-14}
    for max_rows in (vz.MAX_ROWS, vz.KEY_BLOCK + 3, 5):
        with torch.no_grad():
            got = np.stack([c[0].numpy() for c in value_zeroing_matrices(model, inputs, mask, max_rows=max_rows)])
        np.testing.assert_allclose(got, want, **rounding)
    assert bool(finished) == (model_type in ("llama", "modernbert"))  # the gated feed-forwards took the projections


@pytest.mark.parametrize("model_type", ["llama", "bert"])
def test_half_precision_layers_are_recomputed_within_their_rounding(model_type, tokenizer, monkeypatch):
    """In bfloat16 a recomputed layer's zeroing differs from a rerun's by the rounding of that precision, which the
    check allows: the layers are recomputed, not rerun per token, and the scores are as close to float32's as the
    reruns' are. A zeroing that is off by more than rounding (one that removes twice the token's share) is still
    caught."""
    from attnlens.methods import decomposition, valuezeroing

    want = Explainer(build(model_type), tokenizer).explain(TEXTS, "valuezeroing")
    ex = Explainer(build(model_type).to(torch.bfloat16), tokenizer)
    checks = []
    trusted = valuezeroing._trusted
    monkeypatch.setattr(valuezeroing, "_trusted", lambda *a: checks.append(trusted(*a)) or checks[-1])
    recomputed = ex.explain(TEXTS, "valuezeroing")
    n_layers = len(architecture_for(ex.model.config).layers.modules(ex.model, "self"))
    assert checks == [True] * n_layers
    monkeypatch.setattr(decomposition.ValueZeroedLayer, "applies", staticmethod(lambda model: False))
    rerun = ex.explain(TEXTS, "valuezeroing")
    monkeypatch.undo()

    def gap(got):
        return max(float(np.abs(g.scores["valuezeroing"] - w.scores["valuezeroing"]).max()
                         / np.abs(w.scores["valuezeroing"]).max()) for g, w in zip(got, want, strict=True))

    assert gap(recomputed) <= max(2 * gap(rerun), 0.02)
    checks.clear()
    real = decomposition.ValueZeroedLayer.zeroed
    monkeypatch.setattr(valuezeroing, "_trusted", lambda *a: checks.append(trusted(*a)) or checks[-1])

    def twice(self, e, rows, *a, **kw):
        return 2 * real(self, e, rows, *a, **kw) - self.output[e][rows][:, None]

    monkeypatch.setattr(decomposition.ValueZeroedLayer, "zeroed", twice)
    ex.explain(TEXTS, "valuezeroing")
    assert checks == [False] * n_layers


@pytest.mark.parametrize("rollout", [True, False])
def test_progress_moves_as_each_layer_is_computed(tokenizer, rollout):
    """A long value zeroing shows its progress layer by layer, not only when the whole input is done."""
    model = build("llama")
    ex = Explainer(model, tokenizer)
    n_layers = len(architecture_for(model.config).layers.modules(model, "self"))
    fractions: list[float] = []
    ex.explain(TEXTS[:1], methods=["valuezeroing"], options={"valuezeroing": {"rollout": rollout}},
               progress=lambda fraction, _done: fractions.append(fraction))
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    # the shared pass, then each layer value zeroing computes (the last one alone without the rollout)
    assert len(set(fractions)) == 1 + (n_layers if rollout else 1)
