"""The capture that keeps only what the methods read (explained rows, received attention, fused attention):
every method's scores equal those of the whole-maps capture, on tiny models of every type; the memory it
holds is what the estimate says; recomputed layers give the same gradients."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import CLS, PAD, SEP, V, make_model, make_tokenizer, peak_rss_growth
from test_architectures import ZOO
from transformers.models.gptj.modeling_gptj import GPTJAttention

from attnlens import Explainer, InputError
from attnlens.core import capture, memory, row_attention
from attnlens.core import engine as engine_module
from attnlens.errors import ModelError
from attnlens.methods import registry
from attnlens.testing.tiny_models import build_tiny

TEXTS = ["i didn ' t like this boring film", "good", "the plot was boring but the actors were great !"]
# every method that reads the shared pass without whole maps, with the options that change what it reads
LEAN = ["rawatt", "grads", "agrad", "cat", "attcat", "saliency", "inputxgradient", "rollout", "flow", "attnnorm",
        "gae", "attgrads", "globenc", "alti", "decompx"]
OPTIONS = {"attcat": {"alpha": "mean"}}
# of the largest per-layer term: fused and eager attention round differently (a few float32 ulps in a layer's
# output; some types' eager attention takes its softmax in float32 whatever the model's dtype)
TOLERANCE = 1e-5
# rounding differences in the seventh digit partly cancel in signed sums (AttCAT over layers, CAT and input ×
# gradient over dimensions), up to 1.5e-5 of the largest term on these types, and up to 4.5e-5 on CPUs whose
# matrix kernels use AVX-512 (ERNIE's CAT)
LOOSER = {"gptj": 5e-5, "qwen2": 5e-5, "ernie": 5e-5}


def _spy_modes(mp: pytest.MonkeyPatch) -> list[str]:
    """The capture modes of the passes run while ``mp`` is active, in order."""
    modes = []
    run = capture._run

    def spy(*args, **kwargs):
        out = run(*args, **kwargs)
        modes.append(args[15])
        return out

    mp.setattr(capture, "_run", spy)
    return modes


def _explain_both(ex: Explainer, texts, methods, options=None, **kw):
    """(explanations with the planned capture, with the whole maps forced), and the modes the first used."""
    with pytest.MonkeyPatch.context() as mp:
        modes = _spy_modes(mp)
        lean = ex.explain(texts, methods=methods, options=options, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capture, "capture_mode", lambda *a, **k: capture.FULL_MAPS)
        full = ex.explain(texts, methods=methods, options=options, **kw)
    return lean, full, set(modes)


def _assert_same(lean, full, methods, tolerance=TOLERANCE):
    for a, b in zip(lean, full, strict=True):
        for m in methods:
            scale = max(np.abs(b.layers[m]).max() if m in b.layers else 0, np.abs(b.scores[m]).max(), 1e-12)
            np.testing.assert_allclose(a.scores[m], b.scores[m], rtol=0, atol=tolerance * scale, err_msg=m)
            if m in b.layers:
                np.testing.assert_allclose(a.layers[m], b.layers[m], rtol=0, atol=tolerance * scale, err_msg=m)


# types whose attention the fused path cannot stand in for: their own attention code (DeBERTa, MPNet, GPT-Neo,
# BLOOM, Falcon), softcapping (Gemma 2) and encoder-decoders (three streams)
WHOLE_MAPS = {"deberta", "deberta-v2", "mpnet", "gpt_neo", "bloom", "falcon", "gemma2", "bart", "mbart", "t5"}
# GPT-J's attention has its own code (``_attn``) before transformers 5.24 and calls the attention interface since
if hasattr(GPTJAttention, "_attn"):
    WHOLE_MAPS.add("gptj")


def _applies(method: str, ex: Explainer) -> bool:
    why = registry.get_method(method).applies
    return why is None or why(ex.model, ex.stream, "classification") is None


@pytest.mark.parametrize("model_type", ZOO)
def test_every_method_scores_as_with_the_whole_maps(model_type, tokenizer):
    ex = Explainer(make_model(model_type), tokenizer)
    methods = [m for m in LEAN if _applies(m, ex)]
    assert "attnnorm" in methods
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lean, full, modes = _explain_both(ex, TEXTS, methods, OPTIONS, batch_size=3)
        cls_lean, cls_full, _ = _explain_both(ex, TEXTS[:2], ["attcat"], {"attcat": {"alpha": "cls"}})
    assert modes == {capture.FULL_MAPS if model_type in WHOLE_MAPS else capture.ROWS}
    tolerance = LOOSER.get(model_type, TOLERANCE)
    _assert_same(lean, full, methods, tolerance)
    _assert_same(cls_lean, cls_full, ["attcat"], tolerance)


@pytest.mark.parametrize("model_type", ["bert", "gpt2"])
def test_a_float64_model_keeps_float64_precision_without_the_whole_maps(model_type, tokenizer):
    """These types' eager attention takes its softmax in the model's dtype: rows recomputed from the queries and
    keys, and the received attention, agree with it to float64 rounding."""
    ex = Explainer(make_model(model_type).double(), tokenizer)
    methods = [m for m in LEAN if _applies(m, ex)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lean, full, modes = _explain_both(ex, TEXTS, methods, OPTIONS, batch_size=3)
    assert modes == {capture.ROWS}
    _assert_same(lean, full, methods, 1e-11)


def _lm() -> Explainer:
    model = build_tiny("llama", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                       task="causal-lm")
    return Explainer(model, make_tokenizer())


def _rows_and_maps_agree(explain) -> None:
    """``explain(methods)`` with the planned capture, which keeps rows, and with the whole maps forced: the LEAN
    methods score alike in both."""
    outs = {}
    for mode in (None, capture.FULL_MAPS):
        with pytest.MonkeyPatch.context() as mp:
            modes = _spy_modes(mp)
            if mode:
                mp.setattr(capture, "capture_mode", lambda *a, **k: capture.FULL_MAPS)
            outs[mode] = explain(LEAN)
        assert set(modes) == {mode or capture.ROWS}, modes
    for m in LEAN:
        ref = outs[capture.FULL_MAPS].scores[m]
        np.testing.assert_allclose(outs[None].scores[m], ref, rtol=0, atol=TOLERANCE * np.abs(ref).max(), err_msg=m)


def test_generation_steps_score_as_with_the_whole_maps():
    """A generation's steps share one forward: the kept rows are each step's last position."""
    ex = _lm()
    _rows_and_maps_agree(lambda methods: ex.explain_generation("the movie was", methods, target=" good but boring"))


def test_an_answer_scores_as_with_the_whole_maps():
    """An answer of several tokens: the kept rows are every row that predicts one of its tokens, weighed equally,
    as the whole maps read them."""
    ex = _lm()
    _rows_and_maps_agree(lambda methods: ex.explain_answer("the movie was", " good but boring", methods))


def test_the_rows_are_the_maps_rows_and_received_their_column_means():
    """Against the eager maps directly: each kept row is the explained row of every layer's map, the received
    attention the head-mean map averaged over the real query rows (float64 reference), and the head means the
    maps' mean over heads."""
    ex = Explainer(make_model("llama"), make_tokenizer())
    specs = [registry.get_method(m) for m in ("agrad", "attcat", "flow")]
    batch = ex.encode(TEXTS)
    ctx, _ = ex.compute_batch(batch, [-1] * len(TEXTS), specs, {})
    cap = ctx.capture
    assert cap.attentions is None and cap.attention_rows[0].shape[2] == len({len(e.ids) for e in batch})
    with pytest.MonkeyPatch.context() as mp:  # the eager maps
        mp.setattr(capture, "capture_mode", lambda *a, **k: capture.FULL_MAPS)
        full, _ = ex.compute_batch(batch, [-1] * len(TEXTS), [registry.get_method("globenc")], {})
    mask = full.token_mask.double()
    chunks = full.capture.map_chunks()
    whole = [next(chunks.chunks(i))[1] for i in range(chunks.n_layers)]  # one chunk: the whole map
    for rows, received, means, maps in zip(cap.attention_rows, cap.attention_received, cap.attention_means, whole,
                                           strict=True):
        np.testing.assert_allclose(means.double(), maps.double().mean(1), atol=1e-6)
        explained = torch.einsum("br,bhrk->bhk", cap.row_weights.double(), rows.double())
        np.testing.assert_allclose(explained, full.capture.row(maps.double()), atol=1e-6)
        mean = torch.einsum("bq,bqk->bk", mask, maps.double().mean(1)) / mask.sum(1, keepdim=True)
        np.testing.assert_allclose(received.double(), mean, atol=1e-6)


@pytest.mark.parametrize("multiple", [1, 8])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "rows"), [(1, 1), (1, 11), (3, 3)])
def test_received_attention_from_the_fused_kernel_is_the_column_sum(monkeypatch, causal, dtype, batch, rows,
                                                                     multiple):
    """The received attention taken from one more fused attention (the keys attending over the queries) equals
    the weighted column sums of the probabilities, in float64: for one row, a generation's prefixes (more
    weight columns than the head size) and a batch of sequences; with the head size as it is (the CPU's kernel)
    and padded to a multiple of 8 (CUDA's)."""
    monkeypatch.setattr(row_attention, "_head_size_multiple", lambda device: multiple)  # 8: what CUDA runs
    g = torch.Generator().manual_seed(0)
    b, h, n, d = batch, 3, 40, 4
    query, key, value = (torch.randn(b, h, n, d, generator=g, dtype=dtype) * 2 for _ in range(3))
    lengths = torch.randint(1, n + 1, (rows,), generator=g)
    weights = (torch.arange(n)[None] < lengths[:, None]).to(dtype)
    weights = weights / weights.sum(1, keepdim=True)
    op = row_attention._fused_with_normalisers(query, key, value, None, 0.0)
    _, lse = op(query, key, value, causal, 0.5)
    widths = []

    def spied(q, k, v, *args):
        widths.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return op(q, k, v, *args)

    got = row_attention._received_fused(spied, weights, query, key, lse, causal, 0.5)
    assert widths and all(w[0] % multiple == 0 and len(set(w)) == 1 for w in widths)
    scores = torch.matmul(query.double(), key.double().transpose(2, 3)) * 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    mean = scores.softmax(-1).mean(1)  # (B, Q, K)
    want = torch.einsum("bq,bqk->bk", weights.double(), mean.expand(rows, -1, -1))
    assert got.shape == (rows, n) and got.dtype == dtype
    np.testing.assert_allclose(got.double(), want, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=0)


def test_the_fused_kernel_stands_in_only_where_it_computes_the_same_attention():
    x = torch.zeros(1, 2, 5, 4)
    assert row_attention._fused_with_normalisers(x, x, x, None, 0.0) is not None
    assert row_attention._fused_with_normalisers(x, x, x, torch.ones(1, 1, 5, 5, dtype=torch.bool), 0.0) is None
    assert row_attention._fused_with_normalisers(x, x, x, None, 0.1) is None
    assert row_attention._fused_with_normalisers(x, x, torch.zeros(1, 2, 5, 3), None, 0.0) is None
    assert row_attention._fused_with_normalisers(x, torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4), None, 0.0) is None
    assert row_attention._fused_with_normalisers(x.half(), x.half(), x.half(), None, 0.0) is None
    one = torch.zeros(1, 1, 5, 4)  # a key head serving both query heads: the CPU's kernel reads it as it is
    assert row_attention._fused_with_normalisers(x, one, one, None, 0.0) is not None
    assert row_attention._fused_with_normalisers(torch.zeros(1, 3, 5, 4), x, x, None, 0.0) is None


def test_received_attention_of_one_unpadded_sequence_is_its_column_mean(monkeypatch):
    """One sequence without padding runs the fused kernel (no mask): AttCAT scores as with the whole maps."""
    ex = Explainer(make_model("llama"), make_tokenizer())
    calls = []
    fused = row_attention._received_fused
    monkeypatch.setattr(row_attention, "_received_fused", lambda *a: calls.append(1) or fused(*a))
    lean, full, modes = _explain_both(ex, TEXTS[2:], ["attcat"], OPTIONS)
    assert modes == {capture.ROWS} and calls
    _assert_same(lean, full, ["attcat"])


@pytest.mark.parametrize("padded", [False, True])
def test_grouped_key_heads_are_read_as_they_are_with_the_scores_of_repeated_heads(monkeypatch, padded):
    """A grouped-query model's rows pass gives each attention kernel its key heads as they are (no copy per query
    head for the backward to keep) where the kernel takes them, with the scores of the pass that repeats them and
    of the whole maps; with a padded batch (a mask) and without (the kernel returning the normalisers)."""
    model = build_tiny("qwen2", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                       task="causal-lm")
    ex = Explainer(model, make_tokenizer())
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    texts = TEXTS if padded else TEXTS[2:]
    methods = ["grads", "agrad", "attcat", "saliency"]
    heads: list[int] = []  # the key heads each layer's attention kernel took in the rows pass
    layer: list[bool] = []  # within a layer's row attention, outside its received attention's kernel calls
    sdpa, fused = torch.nn.functional.scaled_dot_product_attention, row_attention._fused_with_normalisers
    rows, received = row_attention.row_attention, row_attention._received_fused

    def within(function, inside):
        def run(*a, **kw):
            layer.append(inside)
            try:
                return function(*a, **kw)
            finally:
                layer.pop()
        return run

    def spy(function):
        return lambda q, k, *a, **kw: (layer[-1:] == [True] and heads.append(k.shape[1])) or function(q, k, *a, **kw)

    def spied_normalisers(*a):
        op = fused(*a)
        return None if op is None else spy(op)

    monkeypatch.setattr(row_attention, "row_attention", within(rows, True))
    monkeypatch.setattr(row_attention, "_received_fused", within(received, False))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy(sdpa))
    monkeypatch.setattr(row_attention, "_fused_with_normalisers", spied_normalisers)
    lean, full, modes = _explain_both(ex, texts, methods, OPTIONS)
    assert modes == {capture.ROWS}
    assert heads and set(heads) == {model.config.num_key_value_heads}
    _assert_same(lean, full, methods, LOOSER["qwen2"])
    monkeypatch.setattr(row_attention, "fused_kernel", lambda *a, **k: False)
    heads.clear()
    repeated = ex.explain(texts, methods=methods, options=OPTIONS)
    assert heads and set(heads) == {model.config.num_attention_heads}
    _assert_same(lean, repeated, methods, LOOSER["qwen2"])


def test_recomputed_layers_give_the_same_gradients(monkeypatch):
    """Under a budget the activations would not fit, the backward recomputes each layer (one more call of each
    layer's attention) and the scores are unchanged."""
    ex = _lm()
    texts = TEXTS[:2]
    methods = ["agrad", "attcat", "saliency"]
    ex.explain(texts, methods=methods)  # what the pass keeps is counted on the model once, before the counted runs
    calls = []
    attention = row_attention.row_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return attention(*args, **kwargs)

    monkeypatch.setattr(row_attention, "row_attention", counted)
    kept = ex.explain(texts, methods=methods)
    kept_calls = len(calls)
    calls.clear()
    # the activations of one row "need" 1 GiB, recomputation a byte: only recomputation fits the budget
    real = memory.pass_row_bytes
    monkeypatch.setattr(engine_module, "pass_row_bytes",
                        lambda d, n, s: 1 if s.recompute else (2**30 if s.backward else real(d, n, s)))
    monkeypatch.setattr(memory, "pass_row_bytes",
                        lambda d, n, s: 1 if s.recompute else (2**30 if s.backward else real(d, n, s)))
    recomputed = ex.explain(texts, methods=methods, memory_budget="256MiB")
    layers = ex.model.config.num_hidden_layers
    assert kept_calls == layers and len(calls) == 2 * layers  # one batch: each layer once, then once again
    assert all(not m.training for m in ex.model.modules())  # the layers' flags are back
    _assert_same(recomputed, kept, methods)


def test_a_recomputed_pass_lets_go_of_what_its_recorder_kept(monkeypatch):
    """A recomputed layer runs in a copy of its forward's context, which holds the pass's recorder: once the pass
    is done the recorder holds none of its tensors (kept rows, value vectors), or they and the graph would hold
    each other beyond the pass."""
    ex = _lm()
    recorders = []

    class Recorder(row_attention.RowRecorder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            recorders.append(self)

    monkeypatch.setattr(capture, "RowRecorder", Recorder)
    real = memory.pass_row_bytes
    monkeypatch.setattr(engine_module, "pass_row_bytes",
                        lambda d, n, s: 1 if s.recompute else (2**30 if s.backward else real(d, n, s)))
    monkeypatch.setattr(memory, "pass_row_bytes",
                        lambda d, n, s: 1 if s.recompute else (2**30 if s.backward else real(d, n, s)))
    (e,) = ex.explain(TEXTS[:1], methods=["grads", "decompx"], memory_budget="256MiB")
    assert recorders and np.abs(e.scores["grads"]).max() > 0
    for r in recorders:
        assert (r.kept_rows, r.received, r.mean_maps, r.layer_factors) == ([], [], [], [])


def _live_graph_tensors() -> int:
    """How many tensors that belong to an autograd graph Python's collector still finds alive."""
    import gc

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.grad_fn is not None)


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_a_recomputed_pass_keeps_no_graph_alive_when_hidden_states_are_read(monkeypatch, kind):
    """DecompX reads every layer's hidden states, which transformers collects in a context variable during the
    forward: a recomputation carries attnlens' own variables only, or the collected states, their graph and its
    checkpoints would hold each other after the pass, one pass's activations for every text explained."""
    ex = Explainer(make_model(kind), make_tokenizer())
    real = memory.pass_row_bytes
    monkeypatch.setattr(engine_module, "pass_row_bytes",
                        lambda d, n, s: 1 if s.recompute else (2**30 if s.backward else real(d, n, s)))
    monkeypatch.setattr(memory, "pass_row_bytes",
                        lambda d, n, s: 1 if s.recompute else (2**30 if s.backward else real(d, n, s)))
    before = _live_graph_tensors()
    for text in TEXTS:
        (e,) = ex.explain([text], methods=["gae", "decompx"], memory_budget="256MiB")
        assert np.abs(e.scores["gae"]).max() > 0
    assert _live_graph_tensors() == before


def test_every_attnlens_context_variable_is_carried_into_recomputed_layers():
    """A recomputation carries the context variables whose names start with the project's prefix, and only them:
    a variable named otherwise would be missing when a layer is recomputed in the backward."""
    import ast
    from pathlib import Path

    import attnlens
    from attnlens.models import recompute

    names = []
    for path in Path(attnlens.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ContextVar":
                names.append(node.args[0].value)
    assert len(names) >= 3 and all(n.startswith(recompute.OWN_PREFIX) for n in names), names


def test_the_estimate_bounds_what_the_kept_tensors_take():
    """What the capture holds (its tensors' bytes) stays within the estimate of the storage it planned, for the
    rows capture and the whole-maps one, on a sequence long enough for the maps to dominate."""
    ex = _lm()
    text = " ".join(["the plot was boring but the actors were great"] * 20)
    (e,) = ex.encode([text])
    n = len(e.ids)
    dims = memory.model_dims(ex.model)
    for methods in (["rawatt", "agrad", "attcat"], ["rollout", "agrad"], ["rollout", "flow"], ["gae", "rollout"],
                    ["attgrads"], ["rawatt", "partiallrp"]):
        specs = [registry.get_method(m) for m in methods]
        storage = engine_module.pass_cost(ex, specs).storage(n)
        ctx, _ = ex.compute_batch([e], [-1], specs, {})
        held = ctx.capture.kept_bytes()
        kept_estimate = memory.pass_row_bytes(dims, n, storage) - memory.pass_row_bytes(
            dims, n, memory.Storage(eager=storage.eager, backward=storage.backward, logit_rows=storage.logit_rows))
        # the chunks of maps recomputed while the methods read them are working memory, not kept tensors
        kept_estimate -= (memory.CHUNK_COPIES * min(row_attention.CHUNK_ELEMENTS, dims.heads * n * n) * storage.factors
                          * dims.itemsize)
        assert held <= kept_estimate, methods
        assert held >= kept_estimate / 4, methods  # and not a gross overestimate


def test_what_the_budget_leaves_beside_the_shared_pass_counts_every_kept_tensor_once():
    """The own passes plan in the budget less every tensor the shared pass keeps, head-mean maps included; a
    tensor held twice counts once."""
    ex = _lm()
    (e,) = ex.encode([" ".join(["the plot was boring but the actors were great"] * 4)])
    ctx, _ = ex.compute_batch([e], [-1], [registry.get_method("rawatt")], {})
    rows = sum(r.numel() * r.element_size() for r in ctx.capture.attention_rows)
    assert ctx.capture.kept_bytes() == rows
    ctx.capture.attention_rows = ctx.capture.attention_rows + ctx.capture.attention_rows  # the same storage twice
    assert ctx.capture.kept_bytes() == rows
    means = [torch.ones(1, len(e.ids), len(e.ids)) for _ in range(2)]  # head-mean maps, as flow's pass keeps them
    ctx.capture.attention_means = means
    held = rows + sum(m.numel() * m.element_size() for m in means)
    assert ctx.capture.kept_bytes() == held
    ctx.memory_budget = 10 * held
    assert ctx.budget_left() == 9 * held
    ctx.memory_budget = held
    assert ctx.budget_left() == held // 4


def _rows_and_maps_growth() -> tuple[dict[str, int], dict[str, int]]:
    """The peak-RSS growth of the rows capture and of the whole-maps capture on a 1,200-token input, and their
    estimates; run in a fresh process, whose peak starts low (the rows capture runs first: the peak only grows)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096,
                         pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, attn_implementation="eager")
    tokenizer = make_tokenizer()
    tokenizer.model_max_length = 4096
    ex = Explainer(LlamaForCausalLM(config).eval(), tokenizer, max_length=2048)
    (e,) = ex.encode([" ".join([TEXTS[2]] * 100)], truncation=True)
    n = len(e.ids)
    assert n > 1000
    dims = memory.model_dims(ex.model)
    ex.compute_batch([ex.encode(["good"])[0]], [-1], [registry.get_method("agrad")], {})  # warm-up
    grown, estimates = {}, {}
    planned = capture.capture_mode
    # chunks of 2^18 probabilities (1 MiB): what a chunk's temporaries take is the same at any length, and at
    # this one the default chunks' would be as large as the maps themselves
    row_attention.CHUNK_ELEMENTS = 2**18
    # the maps and their gradients: rows (agrad), recomputed chunks (gae), every layer's whole maps (gae, eager)
    for name, method in (("rows", "agrad"), ("chunks", "gae"), ("maps", "gae")):
        specs = [registry.get_method(method)]
        if name == "maps":
            capture.capture_mode = lambda *a, **k: capture.FULL_MAPS
        grown[name] = peak_rss_growth(lambda s=specs: ex.compute_batch([e], [-1], s, {}))
        estimates[name] = memory.pass_row_bytes(dims, n, engine_module.pass_cost(ex, specs).storage(n))
        capture.capture_mode = planned
    return grown, estimates


def test_rows_capture_holds_far_less_than_the_maps():
    """Measured in a fresh process: on a 1,200-token input the whole-maps capture of a small LM with 8 heads grows
    the peak RSS by far more than the rows capture and the recomputed chunks, and each stays within its
    estimate."""
    import multiprocessing

    # resident memory depends on how the allocator's heaps happened to be reused: the lower of two fresh processes
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        grown, estimates = pool.apply(_rows_and_maps_growth)
    if any(grown[name] > estimates[name] * 1.1 + 32 * 2**20 for name in grown):
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            again, _ = pool.apply(_rows_and_maps_growth)
        grown = {name: min(grown[name], again[name]) for name in grown}
    for name in grown:
        assert grown[name] <= estimates[name] * 1.1 + 32 * 2**20, (name, grown[name], estimates[name])
    assert grown["maps"] > 4 * max(grown["rows"], grown["chunks"]), grown


@pytest.mark.parametrize("narrow", [False, True])
def test_rows_carried_down_equal_the_matrix_products(narrow):
    """Row c of every layer's rollout and GAE relevance, carried down layer by layer in chunks of query rows,
    equals the row of the matrix products (float64, random causal attention and gradients), with chunks as wide
    as the maps or (``narrow``) stopping after the last key their rows see."""
    from attnlens.core.attention_chunks import WholeMaps
    from attnlens.methods.attention import carried_rows, propagate, rollout_matrices

    gen = torch.Generator().manual_seed(0)
    later = torch.ones(7, 7, dtype=torch.bool).triu(1)
    maps = [torch.rand(2, 3, 7, 7, generator=gen, dtype=torch.float64).masked_fill(later, -torch.inf).softmax(-1)
            for _ in range(4)]
    grads = [torch.randn(2, 3, 7, 7, generator=gen, dtype=torch.float64).masked_fill(later, 0) for _ in range(4)]
    weights = torch.zeros(2, 7, dtype=torch.float64)
    weights[0, 6], weights[1, 2:5] = 1.0, 1 / 3
    widths = []

    class Chunked(WholeMaps):  # three query rows at a time
        def chunks(self, layer, gradients=False, narrow=False):
            for start in range(0, 7, 3):
                keys = min(7, start + 3) if narrow else 7
                widths.append(keys)
                yield (start, self.maps[layer][:, :, start: start + 3, :keys],
                       self.grads[layer][:, :, start: start + 3, :keys])

    def rows_of(products):
        return torch.stack([torch.einsum("bq,bqk->bk", weights, p) for p in products], 1)

    got = carried_rows(weights, Chunked(maps, grads), lambda j, s, a, g: a.mean(1), mix=0.5, keep=0.5,
                       narrow=narrow)
    torch.testing.assert_close(got, rows_of(propagate(rollout_matrices(maps))), rtol=1e-12, atol=1e-12)
    bars = [(g * a).clamp_min(0).mean(1) for a, g in zip(maps, grads, strict=True)]
    got = carried_rows(weights, Chunked(maps, grads), lambda j, s, a, g: (g * a).clamp_min(0).mean(1), mix=1.0,
                       keep=1.0, gradients=True, narrow=narrow)
    torch.testing.assert_close(got, rows_of(propagate(bars, residual=True)), rtol=1e-12, atol=1e-12)
    assert (min(widths) < 7) == narrow


def test_recomputed_chunks_are_the_maps_and_their_gradients():
    """The maps recomputed chunk by chunk from the kept queries and keys equal the eager maps, and their gradients
    (from the attention outputs' gradients and the values) equal the eager maps' gradients (float64 model)."""
    ex = Explainer(make_model("llama").double(), make_tokenizer())
    batch = ex.encode(TEXTS)
    lean, _ = ex.compute_batch(batch, [-1] * len(TEXTS), [registry.get_method("gae")], {})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capture, "capture_mode", lambda *a, **k: capture.FULL_MAPS)
        full, _ = ex.compute_batch(batch, [-1] * len(TEXTS), [registry.get_method("gae")], {})
    chunks, whole = lean.capture.attention_chunks, full.capture.attention_chunks
    assert chunks.__class__.__name__ == "RecomputedChunks" and lean.capture.attentions is None
    chunks.chunk_elements = 40  # a few query rows per chunk
    for layer, (maps, grads) in enumerate(zip(whole.maps, whole.grads, strict=True)):
        parts = list(chunks.chunks(layer, gradients=True))
        assert len(parts) > 1
        # the padded batch's mask: every chunk as wide as the maps, narrow or not
        assert all(p[1].shape[-1] == q[1].shape[-1] == maps.shape[-1]
                   for p, q in zip(parts, chunks.chunks(layer, gradients=True, narrow=True), strict=True))
        a = torch.cat([p[1] for p in parts], 2)
        g = torch.cat([p[2] for p in parts], 2)
        # Llama's eager attention rounds its softmax to float32 even here, where the recomputed chunks (as fused
        # attention) keep float64: the maps differ in the 7th digit, and the gradients with them
        torch.testing.assert_close(a, maps, rtol=0, atol=1e-6)
        torch.testing.assert_close(g, grads, rtol=0, atol=1e-5 * grads.abs().max().item())


@pytest.mark.parametrize("family", ["llama", "bert"])  # a pre-LN decoder, a post-LN encoder
def test_decomposition_rows_chunk_by_chunk_equal_the_rows_at_once(family, monkeypatch):
    """GlobEnc and ALTI built from chunks of a few query rows (a pre-LN layer's FFN recomputed and checked on its
    first chunk with a real row only) equal the same methods built from one chunk per layer, padding included."""
    ex = Explainer(make_model(family), make_tokenizer())
    methods = ["globenc", "alti"]
    whole = ex.explain(TEXTS, methods=methods)
    monkeypatch.setattr(row_attention, "CHUNK_ELEMENTS", 64)  # one or two query rows per chunk
    chunked = ex.explain(TEXTS, methods=methods)
    for a, b in zip(whole, chunked, strict=True):
        for m in methods:
            # float32 sums of another shape: rounding of a few 1e-7 on scores that add up to 1
            np.testing.assert_allclose(b.scores[m], a.scores[m], rtol=1e-5, atol=1e-6, err_msg=m)


def test_chunks_of_an_unpadded_causal_input_skip_the_keys_no_row_sees(monkeypatch):
    """Under causality alone (one unpadded sequence) a chunk's rows are computed on the keys up to its last query
    and zero after: rollout, GAE, Grad-SAM, and PartialLRP and TransAtt from a fused LRP pass, score as from the
    eager whole maps."""
    from attnlens.core import attention_chunks
    from attnlens.methods import lrp_methods

    trimmed = []
    real = attention_chunks.keys_seen

    def seen(stop: int, keys: int, causal: bool, mask: torch.Tensor | None) -> int:
        trimmed.append(real(stop, keys, causal, mask) < keys)
        return real(stop, keys, causal, mask)

    monkeypatch.setattr(attention_chunks, "keys_seen", seen)
    ex, text = _lm(), "the movie was good but boring and far too long"
    methods = ["rollout", "gae", "attgrads", "transatt", "partiallrp"]
    every_layer = {"partiallrp": {"layers": True}}
    with pytest.MonkeyPatch.context() as mp:  # the eager whole maps
        mp.setattr(capture, "capture_mode", lambda *a, **k: capture.FULL_MAPS)
        eager = ex.explain([text], methods, options=every_layer)[0]
    assert not trimmed
    monkeypatch.setattr(row_attention, "CHUNK_ELEMENTS", 64)  # chunks of a few rows
    monkeypatch.setattr("attnlens.core.row_attention.BACKWARD_CHUNK_ELEMENTS", 64)
    monkeypatch.setattr(lrp_methods, "lrp_storage", lambda dims, n, budget, fusable, rows=0, attention=False, **_:
                        memory.lrp_storage(dims, n, 0, fusable, rows, attention))  # the fused LRP pass
    (chunked,) = ex.explain([text], methods, options=every_layer)
    assert any(trimmed) and not all(trimmed)
    for m in methods:
        top = np.abs(eager.scores[m]).max()
        np.testing.assert_allclose(chunked.scores[m], eager.scores[m], rtol=0, atol=1e-5 * top, err_msg=m)
        np.testing.assert_allclose(chunked.layers[m], eager.layers[m], rtol=0, atol=1e-5 * top, err_msg=m)


@pytest.mark.parametrize("padded", [False, True])
def test_decompx_holds_the_attention_through_fused_attention_or_chunks_as_the_whole_maps(padded, monkeypatch):
    """DecompX's held attention: by SDPA on the kept queries and keys where a layer has no mask beyond causality
    (one unpadded sequence), a chunk of query rows at a time where it has one (a padded batch); the scores and the
    bias term equal those from the whole maps."""
    from attnlens.methods.decomposition import linearised

    fused = []
    made = linearised.HeldAttention.__init__

    def spy(self, *args):
        made(self, *args)
        fused.append(self.fused is not None)

    monkeypatch.setattr(linearised.HeldAttention, "__init__", spy)
    monkeypatch.setattr(row_attention, "CHUNK_ELEMENTS", 64)  # chunks of a few rows
    ex = Explainer(make_model("llama"), make_tokenizer())
    texts = TEXTS if padded else TEXTS[:1]
    lean, full, modes = _explain_both(ex, texts, ["decompx"], batch_size=3)
    assert modes == {capture.ROWS} and fused and set(fused[: len(fused) // 2]) == {not padded}
    _assert_same(lean, full, ["decompx"])
    for a, b in zip(lean, full, strict=True):
        assert float(a.meta["decompx"]["bias"]) == pytest.approx(float(b.meta["decompx"]["bias"]), abs=1e-5)


def test_no_method_keeps_its_pass_alive_after_explaining(monkeypatch):
    """Every method, with its passes recomputing their layers (the long-input paths), leaves no tensor of an
    autograd graph and no LRP pass state alive once it returned, however often it runs: a cycle through autograd's
    nodes would keep each call's activations, and a series of explanations would outgrow any budget."""
    import gc

    from attnlens.lrp.state import PassState

    def alive() -> tuple[int, int]:
        gc.collect()
        objects = gc.get_objects()
        return (sum(isinstance(o, PassState) for o in objects),
                sum(1 for o in objects if type(o) is torch.Tensor and o.grad_fn is not None))

    ex = Explainer(make_model("llama"), make_tokenizer())
    real = memory.pass_row_bytes
    for module in (engine_module, memory):
        monkeypatch.setattr(module, "pass_row_bytes",
                            lambda d, n, s: 1 if s.recompute else (2**30 if s.backward else real(d, n, s)))
    ex.explain(TEXTS[:1], methods=["partiallrp"], memory_budget="256MiB")  # one-off allocations of a first pass
    before = alive()
    ran = []
    for method in registry.list_methods():
        for _ in range(2):
            try:
                ex.explain(TEXTS[:1], methods=[method], memory_budget="256MiB")
            except (InputError, ModelError):  # not for this model
                break
        else:
            ran.append(method)
        assert alive() == before, method
    assert {"partiallrp", "attnlrp", "transatt", "attcat", "grads", "gae", "globenc", "integratedgradients"} <= set(ran)


@pytest.mark.parametrize("family", ["bart", "mbart", "opt", "llama"])
def test_recomputed_layers_run_in_eval_mode(family):
    """transformers checkpoints a layer only while its own training flag is set, and BART's, mBART's and OPT's
    layers apply dropout by that flag: under recomputation their outputs and gradients are those of the model in
    eval mode, with a graph and without, and the flags are back afterwards."""
    from attnlens.models.recompute import recomputed_layers

    model = build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP).double()
    assert any(getattr(m, "dropout", 0) for m in model.modules()) or family == "llama"
    ids = torch.tensor([[CLS, *range(5, 30), SEP]])

    def run() -> tuple[torch.Tensor, torch.Tensor]:  # the logits and their gradient at the embedding table
        with torch.enable_grad():
            logits = model(input_ids=ids, use_cache=False).logits
            (grad,) = torch.autograd.grad(logits.sum(), model.get_input_embeddings().weight)
        return logits.detach(), grad

    want, want_grad = run()
    with recomputed_layers(model) as switched:
        assert switched > 0
        for _ in range(2):
            got, got_grad = run()
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits, want, rtol=1e-12, atol=1e-12)
    assert all(not m.training for m in model.modules())


def test_integrated_gradients_with_recomputed_layers_of_a_model_with_dropout(monkeypatch):
    """Integrated gradients on BART, its layers recomputed in the backward (a budget only that fits), equals the run
    that keeps the activations: no dropout in the recomputed layers."""
    ex = Explainer(make_model("bart").double(), make_tokenizer())
    options = {"integratedgradients": {"n_steps": 8}}
    want = ex.explain(TEXTS[:1], methods=["integratedgradients"], options=options)[0]
    real = memory.pass_row_bytes
    for module in (engine_module, memory):
        monkeypatch.setattr(module, "pass_row_bytes",
                            lambda d, n, s: 1 if s.recompute else (2**30 if s.backward else real(d, n, s)))
    got = ex.explain(TEXTS[:1], methods=["integratedgradients"], options=options, memory_budget="256MiB")[0]
    np.testing.assert_allclose(got.scores["integratedgradients"], want.scores["integratedgradients"],
                               rtol=1e-9, atol=1e-12)
