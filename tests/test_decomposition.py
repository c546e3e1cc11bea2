"""attnnorm, globenc, alti, decompx against per-example loop re-computations from the module weights (tiny BERT
with random biases and LayerNorm parameters), DecompX's decomposition identity, an analytic one-layer case,
batch and padding invariance, model safety and the cases they do not apply to."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_model, missing, randomise_biases_and_norms

from attnlens import Explainer, InputError
from attnlens.errors import ModelError
from attnlens.methods import registry
from attnlens.methods.decomposition import decompx_logits
from attnlens.methods.decomposition.layers import head_maps
from attnlens.models.architectures import ARCHITECTURES, register_architecture

NORM = ["attnnorm", "globenc", "alti", "decompx"]
TEXTS = ["i really didn't like this movie .", "a charming journey", "the plot was boring but the actors were great !"]
ANATOMY_FAMILIES = ["bert", "roberta", "distilbert", "electra", "albert", "mpnet", "deberta-v2", "xlm-roberta-xl",
                    "modernbert"]


def randomised(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model whose biases and LayerNorm parameters are random too (HF initialises them to 0 and 1, which
    would hide every bias term and the LayerNorm scales)."""
    model = make_model(family, seed=seed)
    return randomise_biases_and_norms(model, seed)


def by_source(propagate, x0: torch.Tensor) -> tuple[np.ndarray, float]:
    """DecompX written out: each token's input vector propagated alone (``propagate(e, k)`` with only row k of
    ``e`` set), then the biases alone (``propagate(0, None)``): ``(scores, bias term)``."""
    n, d = x0.shape
    scores = []
    for k in range(n):
        e = torch.zeros(n, d)
        e[k] = x0[k]
        scores.append(propagate(e, k))
    return np.array(scores), propagate(torch.zeros(n, d), None)


# --------------------------------------------------------------------------- an independent per-example pass
@dataclasses.dataclass(frozen=True)
class Pieces:
    """Where a post-LN encoder's pieces are, written out per family for the reference (no architecture entry
    read): the layers, and within a layer the value projection, the attention's output projection and LN1;
    the FFN (``intermediate.dense``, ``intermediate`` after its activation, ``output.dense``, ``output.LayerNorm``)
    is named alike in every family here. The head: its dense layer, activation and classifier."""

    layers: Callable[[torch.nn.Module], Any]
    value: Callable[[torch.nn.Module], torch.nn.Linear]
    output: Callable[[torch.nn.Module], torch.nn.Linear]
    ln1: Callable[[torch.nn.Module], torch.nn.LayerNorm]
    pooler: Callable[[torch.nn.Module], torch.nn.Linear]
    act: Callable[[torch.Tensor], torch.Tensor]
    classifier: Callable[[torch.nn.Module], torch.nn.Linear]


def _deberta_value(layer: torch.nn.Module) -> torch.nn.Linear:
    """DeBERTa's value projection written out: each head's slice of ``in_proj`` holds its query, key and value
    rows, in that order, and ``v_bias`` is added after the projection."""
    sa = layer.attention.self
    w, heads = sa.in_proj.weight.detach(), sa.num_attention_heads
    d = w.shape[0] // (3 * heads)
    rows = torch.cat([torch.arange(i * 3 * d + 2 * d, (i + 1) * 3 * d) for i in range(heads)])
    value = torch.nn.Linear(w.shape[1], heads * d, dtype=w.dtype)
    value.weight.data, value.bias.data = w[rows].clone(), sa.v_bias.detach().clone()
    return value


PIECES = {
    "bert": Pieces(lambda m: m.bert.encoder.layer, lambda l: l.attention.self.value, lambda l: l.attention.output.dense,
                   lambda l: l.attention.output.LayerNorm, lambda m: m.bert.pooler.dense, torch.tanh,
                   lambda m: m.classifier),
    "mpnet": Pieces(lambda m: m.mpnet.encoder.layer, lambda l: l.attention.attn.v, lambda l: l.attention.attn.o,
                    lambda l: l.attention.LayerNorm, lambda m: m.classifier.dense, torch.tanh,
                    lambda m: m.classifier.out_proj),
    "deberta": Pieces(lambda m: m.deberta.encoder.layer, _deberta_value, lambda l: l.attention.output.dense,
                      lambda l: l.attention.output.LayerNorm, lambda m: m.pooler.dense, torch.nn.functional.gelu,
                      lambda m: m.classifier),
    "deberta-v2": Pieces(lambda m: m.deberta.encoder.layer, lambda l: l.attention.self.value_proj,
                         lambda l: l.attention.output.dense, lambda l: l.attention.output.LayerNorm,
                         lambda m: m.pooler.dense, torch.nn.functional.gelu, lambda m: m.classifier),
}


class Reference:
    """One example through a tiny post-LN encoder (BERT, MPNet, DeBERTa, DeBERTa-v2) without padding, with each layer's
    pieces read by hooks, and the formulas of the papers written out with loops over tokens and heads."""

    def __init__(self, model: torch.nn.Module, ids: list[int], token_type_ids: list[int] | None = None) -> None:
        """``token_type_ids``: the segments of a text pair (a QA model's question and context); default all 0."""
        self.model = model
        self.pieces = pieces = PIECES[model.config.model_type]
        store: dict[tuple[str, int], torch.Tensor] = {}
        hooks = []

        def keep(name: str, layer: int, inputs: bool):
            def hook(_m, args, out):
                store[(name, layer)] = (args[0] if inputs else out)[0].detach()
            return hook

        for l, layer in enumerate(pieces.layers(model)):
            hooks += [
                pieces.ln1(layer).register_forward_hook(keep("pre1", l, True)),
                pieces.ln1(layer).register_forward_hook(keep("y1", l, False)),
                layer.intermediate.dense.register_forward_hook(keep("u", l, False)),
                layer.intermediate.register_forward_hook(keep("a", l, False)),
                layer.output.LayerNorm.register_forward_hook(keep("pre2", l, True)),
            ]
        if type(model).__name__.endswith("ForSequenceClassification"):  # token and QA heads read every token
            hooks.append(pieces.pooler(model).register_forward_hook(keep("pool", 0, False)))
        try:
            with torch.no_grad():
                types = {} if token_type_ids is None else {"token_type_ids": torch.tensor([token_type_ids])}
                out = model(torch.tensor([ids]), **types, output_attentions=True, output_hidden_states=True)
        finally:
            for h in hooks:
                h.remove()
        self.store = store
        self.hidden = [h[0] for h in out.hidden_states]
        self.attn = [a[0] for a in out.attentions]
        qa = not hasattr(out, "logits")  # a QA model's start and end logits
        self.logits = (torch.stack([out.start_logits, out.end_logits], -1) if qa else out.logits)[0]
        self.n = len(ids)
        self.heads = model.config.num_attention_heads

    def layer(self, l: int):
        return self.pieces.layers(self.model)[l]

    def f(self, l: int, h: int, j: int) -> torch.Tensor:
        """f^h(x_j) = (x_j W_V^h + b_V^h) W_O^h."""
        layer, x = self.layer(l), self.hidden[l][j]
        dh = x.shape[0] // self.heads
        rows = slice(h * dh, (h + 1) * dh)
        value = self.pieces.value(layer)
        v = x @ value.weight[rows].T + value.bias[rows]
        return v @ self.pieces.output(layer).weight[:, rows].T

    def z(self, l: int, i: int, j: int, residual: bool = True) -> torch.Tensor:
        out = sum(self.attn[l][h, i, j] * self.f(l, h, j) for h in range(self.heads))
        return out + self.hidden[l][i] if residual and i == j else out

    def ln(self, v: torch.Tensor, module: torch.nn.LayerNorm, pre: torch.Tensor) -> torch.Tensor:
        eps = module.eps if hasattr(module, "eps") else module.variance_epsilon  # DebertaLayerNorm's name
        return (v - v.mean()) * module.weight / torch.sqrt(pre.var(unbiased=False) + eps)

    def ln1(self, l: int, i: int, v: torch.Tensor) -> torch.Tensor:
        return self.ln(v, self.pieces.ln1(self.layer(l)), self.store[("pre1", l)][i])

    def ln2(self, l: int, i: int, v: torch.Tensor) -> torch.Tensor:
        return self.ln(v, self.layer(l).output.LayerNorm, self.store[("pre2", l)][i])

    def matrix(self, entry) -> torch.Tensor:
        return torch.tensor([[float(entry(i, j)) for j in range(self.n)] for i in range(self.n)],
                            dtype=torch.float64)

    def query_weights(self, w: np.ndarray | None) -> np.ndarray:
        """The explained query rows' weights ``(n,)``: ``w``, or one-hot on row 0 ([CLS], which a sequence
        classifier's head reads)."""
        return np.eye(self.n)[0] if w is None else np.asarray(w, dtype=np.float64)

    def rollout_row(self, mats: list[torch.Tensor], w: np.ndarray | None = None) -> np.ndarray:
        """``w @ (M^L···M^1)``."""
        joint = mats[0]
        for m in mats[1:]:
            joint = m @ joint
        return self.query_weights(w) @ joint.double().numpy()

    # the methods at the rows ``w`` weighs (default row 0, [CLS]): ``w @ (each row's result)``
    @torch.no_grad()
    def attnnorm(self, variant: str, w: np.ndarray | None = None) -> np.ndarray:
        l, weights = len(self.attn) - 1, self.query_weights(w)
        out = np.zeros(self.n)
        for i in np.flatnonzero(weights):
            vecs = [self.z(l, i, j, residual=variant != "attn") for j in range(self.n)]
            if variant == "attn_res_ln":
                vecs = [self.ln1(l, i, v) for v in vecs]
            out += weights[i] * np.array([float(v.detach().norm()) for v in vecs])
        return out

    @torch.no_grad()
    def globenc(self, normalize: bool = False, w: np.ndarray | None = None) -> np.ndarray:
        mats = []
        for l in range(len(self.attn)):
            m = self.matrix(lambda i, j, l=l: self.ln2(l, i, self.ln1(l, i, self.z(l, i, j))).norm())
            mats.append(m / m.sum(1, keepdim=True) if normalize else m)
        return self.rollout_row(mats, w)

    @torch.no_grad()
    def alti(self, w: np.ndarray | None = None) -> np.ndarray:
        mats = []
        for l in range(len(self.attn)):
            def c(i: int, j: int, l: int = l) -> float:
                y = self.store[("y1", l)][i]
                return max(0.0, float(y.abs().sum() - (y - self.ln1(l, i, self.z(l, i, j))).abs().sum()))
            m = self.matrix(c)
            mats.append(m / m.sum(1, keepdim=True))
        return self.rollout_row(mats, w)

    @torch.no_grad()
    def decompx_token(self, target: int, reads: list[tuple[int, int]] | None = None) -> tuple[np.ndarray, float]:
        """Each source's vectors propagated alone (no biases), and the biases propagated alone: (scores, bias).
        ``reads``: a token or QA head's ``(position, column)`` logits, summed, instead of class ``target`` of the
        pooled state."""
        n, d = self.hidden[0].shape

        def propagate(e: torch.Tensor, source: int | None) -> float:
            for l in range(len(self.attn)):
                layer = self.layer(l)
                value, out = self.pieces.value(layer), self.pieces.output(layer)
                biases = source is None
                v = e @ value.weight.T
                if l == 0 and source is not None:  # layer 1: the value bias goes with the token's value
                    v[source] += value.bias
                dh = d // self.heads
                att = torch.zeros(n, d)
                for h in range(self.heads):
                    rows = slice(h * dh, (h + 1) * dh)
                    att += (self.attn[l][h] @ v[:, rows]) @ out.weight[:, rows].T
                r = att + e
                if biases:
                    r = r + out.bias + (out.weight @ value.bias if l > 0 else 0)
                ln1, ln2 = self.pieces.ln1(layer), layer.output.LayerNorm
                r = torch.stack([self.ln1(l, i, r[i]) for i in range(n)]) + (ln1.bias if biases else 0)
                u = r @ layer.intermediate.dense.weight.T + (layer.intermediate.dense.bias if biases else 0)
                u = u * self.store[("a", l)] / self.store[("u", l)]
                r = r + u @ layer.output.dense.weight.T + (layer.output.dense.bias if biases else 0)
                e = torch.stack([self.ln2(l, i, r[i]) for i in range(n)]) + (ln2.bias if biases else 0)
            if reads is not None:  # the head's one linear layer on each token's state
                head = getattr(self.model, "qa_outputs", None) or self.model.classifier
                return float(sum((e[i] @ head.weight.T + (head.bias if biases else 0))[c] for i, c in reads))
            pooler, classifier = self.pieces.pooler(self.model), self.pieces.classifier(self.model)
            pre = self.store[("pool", 0)]
            p = e[0] @ pooler.weight.T + (pooler.bias if biases else 0)
            p = p * self.pieces.act(pre) / pre
            return float((p @ classifier.weight.T + (classifier.bias if biases else 0))[target])

        return by_source(propagate, self.hidden[0])


@pytest.fixture(scope="module", params=list(PIECES))
def bert_case(request, tokenizer):
    model = randomised(request.param)
    ex = Explainer(model, tokenizer)
    with torch.no_grad():
        (e,) = ex.explain([TEXTS[0]], methods=["attnnorm"])
    return model, ex, Reference(model, e.input_ids), e.input_ids


@pytest.mark.parametrize("variant", ["attn", "attn_res", "attn_res_ln"])
def test_attnnorm_matches_loop(bert_case, variant):
    _, ex, ref, _ = bert_case
    (e,) = ex.explain([TEXTS[0]], methods=["attnnorm"], options={"attnnorm": {"variant": variant}})
    np.testing.assert_allclose(e.scores["attnnorm"], ref.attnnorm(variant), rtol=1e-4, atol=1e-5)
    assert e.layers["attnnorm"].shape == (2, ref.n)


@pytest.mark.parametrize("normalize", [False, True])
def test_globenc_matches_loop(bert_case, normalize):
    _, ex, ref, _ = bert_case
    (e,) = ex.explain([TEXTS[0]], methods=["globenc"], options={"globenc": {"normalize": normalize}})
    np.testing.assert_allclose(e.scores["globenc"], ref.globenc(normalize), rtol=1e-4, atol=1e-5)


def test_alti_matches_loop(bert_case):
    _, ex, ref, _ = bert_case
    (e,) = ex.explain([TEXTS[0]], methods=["alti"])
    want = ref.alti()
    np.testing.assert_allclose(e.scores["alti"], want, rtol=1e-4, atol=1e-6)
    assert abs(want.sum() - 1) < 1e-5  # row-normalised contributions rolled out stay a distribution


@pytest.mark.parametrize("blocks", [1, 2, 3, 20])
def test_quadratic_forms_batched_per_key_match_the_elementwise_products_and_each_pair(blocks):
    """Σ_hk a^h_ij a^k_ij G_j[h, k] as batched products per key, in any number of blocks of keys (more blocks than
    keys too), equals the elementwise products and the pair-by-pair ‖Σ_h a^h_ij g^h_j‖² in float64."""
    from attnlens.methods.decomposition import pair_norms

    gen = torch.Generator().manual_seed(2)
    b, h, r, n, d = 2, 4, 3, 7, 6
    a = torch.rand(b, h, r, n, generator=gen)  # float32, as the chunks come
    g = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    want = torch.zeros(b, r, n, dtype=torch.float64)
    for e in range(b):
        for i in range(r):
            for j in range(n):
                want[e, i, j] = sum(float(a[e, k, i, j]) * g[e, k, j] for k in range(h)).pow(2).sum()
    gram = pair_norms.gram_matrices(g)
    batched = pair_norms._quadratic_batched(a, gram, blocks=blocks)
    assert batched.dtype == torch.float64
    torch.testing.assert_close(batched, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pair_norms._quadratic_elementwise(a.double(), gram), want, rtol=1e-12, atol=1e-12)
    assert pair_norms.quadratic_kernel.applies(a, gram)  # the CPU's compiled loop
    torch.testing.assert_close(pair_norms.quadratic_rows(a, gram), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pair_norms.quadratic_rows(a.double(), gram), want, rtol=1e-12, atol=1e-12)


@pytest.mark.usefixtures("_triton_kernel_rebuilt")
@pytest.mark.parametrize(("heads", "rows", "keys"), [(9, 37, 50), (32, 9, 20), (1, 1, 1)])
def test_quadratic_forms_in_the_triton_kernel_match_each_pair(monkeypatch, heads, rows, keys):
    """The Triton kernel's Σ_hk a^h_ij a^k_ij G_j[h, k] over several tiles of keys and rows (SmolLM2's 9 heads, the
    1B Llama's 32, one of each) equals the pair-by-pair ‖Σ_h a^h_ij g^h_j‖² in float64, and the norms route to it
    where it applies."""
    from attnlens.methods.decomposition import pair_norms, triton_kernels

    _interpreted_triton(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    a = torch.rand(2, heads, rows, keys, generator=gen)  # float32, as the chunks come
    g = torch.randn(2, heads, keys, 5, generator=gen, dtype=torch.float64)
    want = torch.einsum("bhrk,bhkd->brkd", a.double(), g).pow(2).sum(-1)
    gram = pair_norms.gram_matrices(g)
    got = triton_kernels.quadratic_rows(a, gram)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    calls = []
    monkeypatch.setattr(triton_kernels, "quadratic_rows", _spy(triton_kernels.quadratic_rows, calls))
    assert torch.equal(pair_norms.quadratic_rows(a, gram), got) and calls


def test_norm_rows_with_the_residual_terms_of_every_position_match_each_pair():
    """‖Σ_h a^h_ij g^h_j + δ_ij m_i‖² at rows placed anywhere in the sequence, from the residual at the rows or
    from its terms computed once for every position (:class:`ResidualTerms`), equals the pair-by-pair norm."""
    from attnlens.methods.decomposition import pair_norms

    gen = torch.Generator().manual_seed(3)
    b, h, n, d = 2, 3, 8, 5
    at = torch.tensor([6, 1, 3])
    a = torch.rand(b, h, len(at), n, generator=gen, dtype=torch.float64)
    g = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    m_all = torch.randn(b, n, d, generator=gen, dtype=torch.float64)
    want = torch.zeros(b, len(at), n, dtype=torch.float64)
    for e in range(b):
        for r, i in enumerate(at.tolist()):
            for j in range(n):
                z = sum(a[e, k, r, j] * g[e, k, j] for k in range(h)) + (m_all[e, i] if j == i else 0)
                want[e, r, j] = (z * z).sum()
    gram = pair_norms.gram_matrices(g)
    terms = pair_norms.ResidualTerms.of(g, m_all)
    torch.testing.assert_close(pair_norms.norm_rows(a, g, gram, terms, at), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pair_norms.norm_rows(a, g, gram, m_all[:, at], at), want, rtol=1e-12, atol=1e-12)


@pytest.mark.usefixtures("_triton_kernel_rebuilt")
@pytest.mark.parametrize(("method", "path"), [("globenc", "batched"), ("attnnorm", "batched"), ("globenc", "triton"),
                                              ("attnnorm", "triton"), ("alti", "triton")])
def test_norms_on_the_accelerator_path_equal_the_cpu_path(monkeypatch, tokenizer, method, path):
    """GlobEnc, attention norm and ALTI as accelerators compute them (the quadratic forms batched per key over
    every key; CUDA's Triton kernels) give the scores of the CPU's paths (the elementwise products over the keys
    in use; ALTI's compiled loop), on a causal LM (whose chunks' later keys are zero) and an encoder."""
    from attnlens.methods.decomposition import alti_hinge, pair_norms

    for family in ("llama", "bert"):
        ex = Explainer(make_model(family), tokenizer)
        text = [TEXTS[0]]
        want = ex.explain(text, methods=[method])[0]
        with monkeypatch.context() as m:
            m.setattr(alti_hinge, "applies", lambda *t: False)  # on the CPU only: the vectors' factors unread
            if path == "triton":
                calls = _interpreted_triton(m)
                m.setattr(pair_norms.triton_kernels, "quadratic_rows",
                          _spy(pair_norms.triton_kernels.quadratic_rows, calls))
            else:
                m.setattr(pair_norms, "quadratic_rows", lambda a, gram: pair_norms._quadratic_batched(a, gram, 3))
            m.setattr(pair_norms, "_keys_to_compute", lambda a, at: a.shape[-1])
            got = ex.explain(text, methods=[method])[0]
            assert path != "triton" or calls
        # ALTI's distances summed in another order: float32 rounding, to 1e-6 of the largest score
        atol = 1e-6 * np.abs(want.scores[method]).max() if method == "alti" else 1e-7
        np.testing.assert_allclose(got.scores[method], want.scores[method], rtol=1e-6, atol=atol)
        np.testing.assert_allclose(got.layers[method], want.layers[method], rtol=1e-6, atol=atol)


def test_alti_from_the_vectors_factors_keeps_float32_precision_beside_a_large_output():
    """With a row output of a large L1 norm (a decoder's massive activation channels) and small contributions,
    float32 ALTI from the factors stays within 1e-6 of the largest contribution of the float64 result, where the
    difference of the two L1 norms loses digits at the norms' scale."""
    from attnlens.methods.decomposition import alti_hinge, pair_norms

    gen = torch.Generator().manual_seed(4)
    b, h, r, n, d = 1, 3, 6, 40, 64
    a = torch.softmax(4 * torch.randn(b, h, r, n, generator=gen, dtype=torch.float64), -1)
    v = torch.randn(b, h, n, 8, generator=gen, dtype=torch.float64)
    maps = 0.1 * torch.randn(h, 8, d, generator=gen, dtype=torch.float64)
    g = torch.einsum("bhje,hed->bjhd", v, maps).contiguous()
    y = torch.randn(b, r, d, generator=gen, dtype=torch.float64)
    y[..., :2] = 3e3  # two massive channels
    m = torch.randn(b, r, d, generator=gen, dtype=torch.float64)
    at = torch.arange(30, 36)
    want = pair_norms.alti_rows(a, g, m, y, at)
    f32 = [x.float() for x in (a, v, maps, g, m, y)]
    got = pair_norms.alti_rows(f32[0], None, f32[4], f32[5], at, alti_hinge.LowRank.of(f32[1], f32[2], f32[3]))
    vectors = pair_norms.alti_rows(f32[0], f32[3], f32[4], f32[5], at)
    scale = want.abs().max()
    assert (got.double() - want).abs().max() < 1e-6 * scale
    assert (vectors.double() - want).abs().max() > 1e-5 * scale  # what the norms' difference loses


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_alti_from_the_vectors_factors_gives_no_finite_score_where_the_output_is_not_finite(bad):
    """A row whose output y holds a NaN or an infinity gets NaN contributions from the factors, as from the vectors
    (not the zeros a comparison with NaN would leave); the other rows are unchanged."""
    from attnlens.methods.decomposition import alti_hinge, pair_norms

    gen = torch.Generator().manual_seed(3)
    b, h, r, n, d = 1, 2, 3, 5, 4
    a = torch.rand(b, h, r, n, generator=gen, dtype=torch.float64)
    v = torch.randn(b, h, n, 2, generator=gen, dtype=torch.float64)
    maps = torch.randn(h, 2, d, generator=gen, dtype=torch.float64)
    g = torch.einsum("bhje,hed->bjhd", v, maps).contiguous()
    y = torch.randn(b, r, d, generator=gen, dtype=torch.float64)
    m = torch.randn(b, r, d, generator=gen, dtype=torch.float64)
    at = torch.tensor([2, 3, 4])
    fine = pair_norms.alti_rows(a, None, m, y, at, alti_hinge.LowRank.of(v, maps, g))
    y[0, 1, 2] = bad
    got = pair_norms.alti_rows(a, None, m, y, at, alti_hinge.LowRank.of(v, maps, g))
    old = pair_norms.alti_rows(a, g, m, y, at)
    assert torch.isnan(got[0, 1]).all() and not torch.isfinite(old[0, 1]).all()
    torch.testing.assert_close(got[0, [0, 2]], fine[0, [0, 2]], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["bert", "llama", "gemma2", "gpt2", "phi"])
def test_alti_from_each_heads_value_vectors_and_map_equals_alti_from_the_vectors(monkeypatch, tokenizer, family):
    """ALTI computed from each head's value vectors and map (a product of matrices and the hinge correction)
    gives the scores of ALTI computed from the vectors themselves, on a post-LN encoder, pre-LN decoders (a norm
    after the attention branch: Gemma 2; a fused projection with biases: GPT-2; a parallel block: Phi), biases
    and norm scales random; where the factors do not give the vectors, the vectors are read as they are."""
    from attnlens.methods.decomposition import alti_hinge, norm_based

    ex = Explainer(randomise_biases_and_norms(make_model(family)), tokenizer)
    calls = []
    monkeypatch.setattr(alti_hinge, "contributions", _spy(alti_hinge.contributions, calls))
    got = ex.explain([TEXTS[0]], methods=["alti"])[0]
    assert calls  # every layer's factors matched its vectors
    with monkeypatch.context() as m:
        m.setattr(norm_based._AltiRows, "_low_rank", lambda self, maps, g: None)
        calls.clear()
        want = ex.explain([TEXTS[0]], methods=["alti"])[0]
        assert not calls
    with monkeypatch.context() as m:  # maps that are not the heads': refused by the check, the vectors read
        m.setattr(norm_based, "head_maps", lambda mods, heads, like: 2 * head_maps(mods, heads, like))
        calls.clear()
        wrong = ex.explain([TEXTS[0]], methods=["alti"])[0]
        assert not calls
    atol = 1e-6 * np.abs(want.layers["alti"]).max()
    np.testing.assert_allclose(got.layers["alti"], want.layers["alti"], rtol=1e-5, atol=atol)
    np.testing.assert_allclose(wrong.layers["alti"], want.layers["alti"], rtol=0, atol=0)


def _interpreted_triton(monkeypatch):
    """Route ALTI's distances through the Triton kernel, run by Triton's interpreter on the CPU."""
    from attnlens.methods.decomposition import triton_kernels

    if importlib.util.find_spec("triton") is None:
        missing("triton (a development dependency on Linux x86-64) is not installed")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest before Triton's import
    triton_kernels._kernels.cache_clear()
    monkeypatch.setattr(triton_kernels, "applies", lambda *t: True)
    calls = []
    monkeypatch.setattr(triton_kernels, "alti_distances", _spy(triton_kernels.alti_distances, calls))
    return calls


@pytest.fixture
def _triton_kernel_rebuilt():
    from attnlens.methods.decomposition import triton_kernels

    yield
    triton_kernels._kernels.cache_clear()


@pytest.mark.usefixtures("_triton_kernel_rebuilt")
@pytest.mark.parametrize("path", ["compiled", "blocks", "triton", "low rank", "low rank, few sorted"])
@pytest.mark.parametrize("layout", ["encoder", "causal", "unordered"])
def test_alti_rows_in_blocks_of_keys_match_each_pair_computed_alone(monkeypatch, layout, path):
    """ALTI's c_ij = max(0, ‖y_i‖₁ − ‖y_i − Σ_h a^h_ij g^h_j − δ_ij m_i‖₁) from its blocks of keys (two keys
    each, so the rows' own keys fall in different blocks, keys after the last attended one skipped, and in a
    block the rows before the first that attends to or sits on one of its keys skipped), or from the vectors'
    factors as a product of matrices and a hinge correction (over each row's channels sorted by |y|, or, past
    the sorted ones, over every channel), equals the pair-by-pair formula in float64."""
    from attnlens.methods.decomposition import alti_hinge, pair_norms

    gen = torch.Generator().manual_seed(0)
    b, h, r, n, d = 2, 3, 4, 9, 5
    a = torch.rand(b, h, r, n, generator=gen, dtype=torch.float64)
    at = {"encoder": torch.tensor([7, 0, 3, 5]), "causal": torch.tensor([2, 3, 4, 5]),
          "unordered": torch.tensor([5, 1, 2, 6])}[layout]
    if layout != "encoder":  # no row sees a key after its own position, the last keys unseen by every row
        a = a * (torch.arange(n)[None, :] <= at[:, None])
    else:  # keys no row attends to, one of them a row's own (its residual still counts there)
        a[..., 6:] = 0
    v = torch.randn(b, h, n, 2, generator=gen, dtype=torch.float64)  # each head's vectors of rank 2
    maps = torch.randn(h, 2, d, generator=gen, dtype=torch.float64)
    g = torch.einsum("bhje,hed->bhjd", v, maps)
    y = 2 * torch.randn(b, r, d, generator=gen, dtype=torch.float64)
    y[0, 1, 2] = 0.0  # a channel at 0, where sign(y) is taken as +1
    m = 0.5 * y + 0.1 * torch.randn(b, r, d, generator=gen, dtype=torch.float64)  # a row's own key contributes
    want = torch.zeros(b, r, n, dtype=torch.float64)
    for e in range(b):
        for i in range(r):
            for j in range(n):
                t = sum(a[e, k, i, j] * g[e, k, j] for k in range(h)) + (m[e, i] if j == at[i] else 0)
                want[e, i, j] = max(0.0, float(y[e, i].abs().sum() - (y[e, i] - t).abs().sum()))
    monkeypatch.setattr(pair_norms, "_ALTI_BLOCK", 2 * r * d)
    calls = []
    if path == "blocks":  # the batched products accelerators without Triton use, here on the CPU
        monkeypatch.setattr(pair_norms.alti_kernel, "applies", lambda *t: False)
    elif path == "triton":  # the kernel CUDA GPUs run
        calls = _interpreted_triton(monkeypatch)
    elif path.startswith("low rank"):
        monkeypatch.setattr(pair_norms.alti_kernel, "distances", None)  # never reached
        monkeypatch.setattr(alti_hinge, "contributions", _spy(alti_hinge.contributions, calls))
        if path.endswith("few sorted"):
            monkeypatch.setattr(alti_hinge, "_SORTED", 2)
    else:
        monkeypatch.setattr(pair_norms.alti_kernel, "distances", _spy(pair_norms.alti_kernel.distances, calls))

    def computed(*tensors: torch.Tensor) -> torch.Tensor:
        a_, g_, m_, y_, v_, maps_ = tensors
        key_major = g_.transpose(1, 2).contiguous()
        if path.startswith("low rank"):  # the vectors in their factors alone
            return pair_norms.alti_rows(a_, None, m_, y_, at, alti_hinge.LowRank.of(v_, maps_, key_major))
        return pair_norms.alti_rows(a_, key_major, m_, y_, at)

    got = computed(a, g, m, y, v, maps)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(calls) == (path != "blocks")
    # in float32, the precision the models run in, to float32's rounding
    got32 = computed(*(x.float() for x in (a, g, m, y, v, maps)))
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-5)
    assert (want > 0).float().mean() > 0.15 and (want == 0).any()  # both sides of the clamp occur


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_compiled_loops_threads_take_every_item_once(monkeypatch, threads):
    """The items of a compiled loop are shared between the threads torch uses, interleaved: each is computed
    exactly once, with more threads than items too, and the threads are started once for every call."""
    import threading

    from attnlens.methods.decomposition import compiled

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    seen: list[tuple[int, threading.Thread]] = []

    def loop(out: list, start: int, stop: int, step: int) -> None:
        assert step == min(threads, stop)
        out.extend((item, threading.current_thread()) for item in range(start, stop, step))

    for items in (1, 2, 5, 64, 2, 64):
        before = len(seen)
        compiled.split_between_threads(loop, [seen], items)
        assert sorted(item for item, _ in seen[before:]) == list(range(items))
    pool = {thread for _, thread in seen} - {threading.main_thread()}  # one item alone runs where it is called
    assert not pool if threads == 1 else 0 < len(pool) <= threads


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX-only")
def test_the_compiled_loops_start_their_threads_afresh_in_a_forked_child(monkeypatch):
    """A process forked after the loops' threads were started (they do not come along) runs its loops on threads
    of its own: every item computed, nothing waiting on the parent's threads."""
    import signal
    import time

    from attnlens.methods.decomposition import compiled

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)

    def loop(out: list, start: int, stop: int, step: int) -> None:
        out.extend(range(start, stop, step))

    def slow(out: list, start: int, stop: int, step: int) -> None:
        time.sleep(0.05)  # both threads started, and both idle once done

    compiled.split_between_threads(slow, [[]], 8)
    pid = os.fork()
    if pid == 0:  # the child: its exit status tells the parent what happened
        signal.alarm(20)  # a loop waiting forever on threads that are not there
        try:
            seen: list[int] = []
            compiled.split_between_threads(loop, [seen], 8)
            os._exit(0 if sorted(seen) == list(range(8)) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.usefixtures("_triton_kernel_rebuilt")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_alti_triton_kernel_over_several_tiles_matches_each_pair(monkeypatch, dtype):
    """The Triton kernel over more keys, rows and channels than one tile holds (two examples, a key-major ``g``
    with extra keys, ``dist`` with extra keys): every pair at or after its key's first row gets
    ‖Σ_h a^h_ij g^h_j + δ_ij m_i − y_i‖₁ (float64 reference from the same inputs; half-precision inputs summed in
    float32), and the pairs before it, including whole tiles of rows the kernel skips, keep what ``dist`` held."""
    from attnlens.methods.decomposition import triton_kernels

    _interpreted_triton(monkeypatch)
    monkeypatch.setattr(triton_kernels, "_KEYS", 8)
    monkeypatch.setattr(triton_kernels, "_ROWS", 16)
    monkeypatch.setattr(triton_kernels, "_CHANNELS", 32)
    gen = torch.Generator().manual_seed(2)
    b, h, r, n, d = 2, 3, 37, 50, 70
    a = torch.rand(b, h, r, n, generator=gen, dtype=torch.float64).to(dtype).double()  # representable in dtype
    g = torch.randn(b, n + 3, h, d, generator=gen, dtype=torch.float64).to(dtype).double()
    y, m = (torch.randn(b, r, d, generator=gen, dtype=torch.float64).to(dtype).double() for _ in range(2))
    at = torch.randint(0, n, (r,), generator=gen)
    first = torch.cat([torch.zeros(10, dtype=torch.int64), torch.full((20,), 17), torch.full((20,), r)])
    t = torch.einsum("bhrk,bkhd->bkrd", a, g[:, :n]).clone()
    t[:, at, torch.arange(r)] += m
    full = (t - y[:, None]).abs().sum(-1)  # (B, N, R)
    dist = torch.full((b, n + 2, r), -7.0, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
    triton_kernels.alti_distances(*(x.to(dtype) for x in (a, g, y, m)), at, first, dist)
    want = torch.full((b, n + 2, r), -7.0, dtype=torch.float64)
    for k in range(n):
        want[:, k, first[k]:] = full[:, k, first[k]:]
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(dist.double(), want, rtol=tol, atol=tol * float(full.max()))


def test_a_triton_kernel_that_cannot_run_warns_once_and_the_norms_are_computed_otherwise(monkeypatch):
    """A GPU or Triton release the kernels do not support (a compile or launch error) is one warning; ALTI's
    distances and the quadratic forms are then computed as elsewhere, with the same values, and the kernels are
    not tried again."""
    from types import SimpleNamespace

    from attnlens.methods.decomposition import pair_norms, triton_kernels

    class Unsupported:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                raise RuntimeError("PassManager::run failed\nmore detail")
            return run

    monkeypatch.setattr(triton_kernels, "_failure", None)
    unsupported = SimpleNamespace(alti=Unsupported(), quadratic=Unsupported())
    monkeypatch.setattr(triton_kernels, "_kernels", lambda: unsupported)
    monkeypatch.setattr(triton_kernels, "applies", lambda *t: triton_kernels._failure is None)
    gen = torch.Generator().manual_seed(4)
    a = torch.rand(1, 3, 4, 6, generator=gen, dtype=torch.float64)
    g = torch.randn(1, 6, 3, 5, generator=gen, dtype=torch.float64)
    m, y = (torch.randn(1, 4, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    at = torch.tensor([2, 3, 4, 5])
    monkeypatch.setattr(triton_kernels, "applies", lambda *t: False)
    want = pair_norms.alti_rows(a, g, m, y, at)
    monkeypatch.setattr(triton_kernels, "applies", lambda *t: triton_kernels._failure is None)
    with pytest.warns(UserWarning, match=r"Triton kernels cannot run here \(RuntimeError: PassManager::run failed\)"):
        got = pair_norms.alti_rows(a, g, m, y, at)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    gram = pair_norms.gram_matrices(g.transpose(1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not tried again: no second warning
        pair_norms.quadratic_rows(a.float(), gram)
        pair_norms.alti_rows(a, g, m, y, at)


@pytest.mark.usefixtures("_triton_kernel_rebuilt")
@pytest.mark.parametrize("path", ["compiled", "blocks", "triton"])
def test_alti_rows_with_a_single_key(monkeypatch, path):
    """One row and one key (a one-token sequence, a decoder's first position alone): the distance is written
    beside ‖y‖₁, not over it (an aliased buffer gave 0)."""
    from attnlens.methods.decomposition import pair_norms

    if path == "blocks":
        monkeypatch.setattr(pair_norms.alti_kernel, "applies", lambda *t: False)
    elif path == "triton":
        _interpreted_triton(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    a = torch.rand(2, 3, 1, 1, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 1, 3, 4, generator=gen, dtype=torch.float64)
    m = torch.randn(2, 1, 4, generator=gen, dtype=torch.float64)
    t = (a[:, :, 0, 0, None] * g[:, 0]).sum(1) + m[:, 0]
    y = 1.5 * t[:, None] + 0.1 * torch.randn(2, 1, 4, generator=gen, dtype=torch.float64)
    want = (y[:, 0].abs().sum(-1) - (y[:, 0] - t).abs().sum(-1)).clamp_min(0)
    got = pair_norms.alti_rows(a, g, m, y, torch.tensor([0]))
    torch.testing.assert_close(got[:, 0, 0], want, rtol=1e-12, atol=1e-12)
    assert (want > 0).all()


def _spy(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapped


def test_alti_blocks_are_larger_on_an_accelerator():
    from attnlens.core import row_attention
    from attnlens.methods.decomposition import pair_norms

    assert pair_norms.alti_block("cpu") == pair_norms._ALTI_BLOCK
    assert pair_norms.alti_block("cuda") == pair_norms.alti_block("meta") == row_attention.DEVICE_CHUNK_ELEMENTS


@pytest.mark.parametrize("target", [0, 1])
def test_decompx_matches_loop_and_sums_to_the_logit(bert_case, target):
    _, ex, ref, _ = bert_case
    scores, bias = ref.decompx_token(target)
    # the identity, from the independent loop: token shares + propagated biases = the model's logit
    assert abs(scores.sum() + bias - float(ref.logits[target])) < 1e-4
    assert abs(bias) > 1e-2  # the random biases matter, so the test can tell a bias term from none
    (e,) = ex.explain([TEXTS[0]], methods=["decompx"], target=target)
    np.testing.assert_allclose(e.scores["decompx"], scores, rtol=1e-4, atol=1e-5)
    # bias="absdot" shares every bias among the tokens: its scores alone sum to the logit
    (a,) = ex.explain([TEXTS[0]], methods=["decompx"], target=target, options={"decompx": {"bias": "absdot"}})
    assert abs(a.scores["decompx"].sum() - float(ref.logits[target])) < 1e-4
    assert np.abs(a.scores["decompx"] - scores).max() > 1e-3
    # contrast=True decomposes z_t − Σ_c p_c z_c: the loop's per-class shares combined
    p = torch.softmax(ref.logits, -1).numpy()
    per_class = [ref.decompx_token(c)[0] for c in range(len(p))]
    want = per_class[target] - sum(p[c] * per_class[c] for c in range(len(p)))
    for bias in ("token", "absdot"):
        (c,) = ex.explain([TEXTS[0]], methods=["decompx"], target=target,
                          options={"decompx": {"contrast": True, "bias": bias}})
        if bias == "token":
            np.testing.assert_allclose(c.scores["decompx"], want, rtol=1e-4, atol=1e-5)
        else:  # the shares of the contrast sum to it
            assert abs(c.scores["decompx"].sum() - float(ref.logits[target] - (p * ref.logits.numpy()).sum())) < 1e-4


@pytest.mark.parametrize("suffix", ["ForTokenClassification", "ForQuestionAnswering"])
def test_decompx_of_token_and_qa_heads_matches_the_loop(suffix, tokenizer):
    """A token classifier's label at one token, an extractive QA model's start logit at one token plus its end
    logit at another: each read at its own position through the head's linear layer; the shares plus the bias
    term are that logit (sum)."""
    model = randomise_biases_and_norms(make_model("bert", num_labels=2 if suffix.endswith("Answering") else 3,
                                                  model_suffix=suffix), 0)
    ex = Explainer(model, tokenizer)
    (e,) = ex.explain([TEXTS[0]], methods=["attnnorm"], target=2 if suffix == "ForTokenClassification" else (2, 4))
    ref = Reference(model, e.input_ids)
    qa = suffix == "ForQuestionAnswering"
    for target, reads in ([((2, 4), [(2, 0), (4, 1)]), ((3, 3), [(3, 0), (3, 1)])] if qa else
                          [((2, 0), [(2, 0)]), ((4, 2), [(4, 2)])]):
        scores, bias = ref.decompx_token(0, reads)
        (d,) = ex.explain([TEXTS[0]], methods=["decompx"], target=target)
        np.testing.assert_allclose(d.scores["decompx"], scores, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(float(d.meta["decompx"]["bias"]), bias, rtol=1e-4, atol=1e-5)
        assert abs(bias) > 1e-2 and np.abs(scores).max() > 1e-2
    with pytest.raises(InputError, match="bias='token'"):
        ex.explain([TEXTS[0]], methods=["decompx"], target=(2, 4) if qa else 2, options={"decompx": {"bias": "absdot"}})
    with pytest.raises(InputError, match="decompx decomposes the logits"):
        ex.explain([TEXTS[0]], methods=["decompx"], target=(2, 4) if qa else 2, target_kind="loss")


def test_decompx_refuses_a_head_it_does_not_reproduce(tokenizer):
    model = randomise_biases_and_norms(make_model("bert", num_labels=3, model_suffix="ForTokenClassification"), 0)
    ex = Explainer(model, tokenizer)

    def shifted(_m, _args, out):  # logits the model's classifier alone does not give
        out.logits = out.logits + 1.0
        return out

    handle = model.register_forward_hook(shifted)
    try:
        with pytest.raises(ModelError, match="does not reproduce its logits"):
            ex.explain([TEXTS[0]], methods=["decompx"], target=2)
    finally:
        handle.remove()
    model.classifier = torch.nn.Sequential(model.classifier)
    with pytest.raises(ModelError, match="does not know the output layer"):
        ex.explain([TEXTS[0]], methods=["decompx"], target=2)


def test_decompx_logits_identity_every_class_both_modes(tokenizer):
    ex = Explainer(randomised("bert", seed=3), tokenizer)
    encoded = ex.encode(TEXTS)
    ctx, _ = ex.compute_batch(encoded, [-1] * len(TEXTS), [registry.get_method("decompx")], {"decompx": {}})
    for mode in ("absdot", "token"):
        d = decompx_logits(ctx, mode)  # (B, N + 1, C), the last row the bias term
        np.testing.assert_allclose(d.sum(1), ctx.capture.logits, atol=1e-4)
        pad = ~ctx.token_mask.bool()
        assert torch.all(d[:, :-1][pad] == 0)
        if mode == "absdot":
            assert torch.all(d[:, -1] == 0)
    # the one-backward token path equals the forward decomposition of the target logit
    t = ctx.targets
    fwd = decompx_logits(ctx, "token")[torch.arange(len(t)), :-1, t]
    (out,) = ex.compute_batch(encoded, [-1] * len(TEXTS), [registry.get_method("decompx")], {"decompx": {}})[1].values()
    np.testing.assert_allclose(out[0], fwd * ctx.token_mask, atol=1e-5)


def test_analytic_one_layer_one_head(tokenizer):
    """Identity value/output projections, uniform attention: ‖Σ α f(x_j)‖ = ‖x_j‖ / N, and with the residual
    the [CLS] entry is ‖x_0 + x_0 / N‖; ALTI's row of a one-token input is [1]."""
    model = make_model("bert")
    layer = model.bert.encoder.layer[0]
    d = model.config.hidden_size
    with torch.no_grad():
        for lin in (layer.attention.self.query, layer.attention.self.key):
            lin.weight.zero_()
            lin.bias.zero_()
        for lin in (layer.attention.self.value, layer.attention.output.dense):
            lin.weight.copy_(torch.eye(d))
            lin.bias.zero_()
    ex = Explainer(model, tokenizer)
    text = "a charming journey"
    (e,) = ex.explain([text], methods=["attnnorm"], options={"attnnorm": {"variant": "attn"}})
    with torch.no_grad():
        out = model(torch.tensor([e.input_ids]), output_hidden_states=True, output_attentions=True)
    x = out.hidden_states[0][0]
    n = x.shape[0]
    assert torch.allclose(out.attentions[0][0], torch.full_like(out.attentions[0][0], 1 / n))
    np.testing.assert_allclose(e.layers["attnnorm"][0], (x.norm(dim=-1) / n).numpy(), rtol=1e-5)
    (r,) = ex.explain([text], methods=["attnnorm"], options={"attnnorm": {"variant": "attn_res"}})
    first = r.layers["attnnorm"][0]
    np.testing.assert_allclose(first[0], float((x[0] * (1 + 1 / n)).norm()), rtol=1e-5)
    np.testing.assert_allclose(first[1:], (x[1:].norm(dim=-1) / n).numpy(), rtol=1e-5)


@pytest.mark.parametrize("family", ANATOMY_FAMILIES)
def test_batch_and_padding_invariance(family, tokenizer):
    model = randomised(family)
    ex = Explainer(model, tokenizer)
    # bias="absdot" shares biases in post-LN encoders only (a pre-LN one, XLM-RoBERTa-XL's, refuses it)
    absdot = not ARCHITECTURES[family].anatomy_for(model.config).pre_ln
    options = {"decompx": {"bias": "absdot"}}
    batch = ex.explain(TEXTS, methods=NORM, batch_size=len(TEXTS))
    batch_absdot = ex.explain(TEXTS, methods=["decompx"], batch_size=len(TEXTS), options=options) if absdot else batch
    for text, e, a in zip(TEXTS, batch, batch_absdot):
        (alone,) = ex.explain([text], methods=NORM)
        for m in NORM:
            np.testing.assert_allclose(e.scores[m], alone.scores[m], rtol=1e-4, atol=1e-5, err_msg=f"{family} {m}")
            assert np.isfinite(e.scores[m]).all() and np.abs(e.scores[m]).max() > 0
        if absdot:
            (alone_absdot,) = ex.explain([text], methods=["decompx"], options=options)
            np.testing.assert_allclose(a.scores["decompx"], alone_absdot.scores["decompx"], rtol=1e-4, atol=1e-5)
    encoded = ex.encode(TEXTS)
    specs = [registry.get_method(m) for m in NORM]
    ctx, out = ex.compute_batch(encoded, [-1] * len(TEXTS), specs, {m: {} for m in NORM})
    pad = ~ctx.token_mask.bool()
    assert pad.any()
    for m, (scores, layers) in out.items():
        assert torch.all(scores[pad] == 0), m
        if layers is not None:
            assert torch.all(layers.permute(0, 2, 1)[pad] == 0), m


def test_model_untouched_and_no_graph_left(tokenizer):
    model = randomised("bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Explainer(model, tokenizer).explain(TEXTS, methods=NORM)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_unsupported_models_are_skipped_or_refused(tokenizer, entry_without_layers):
    ex = Explainer(make_model("deberta"), tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (e,) = ex.explain("the movie was great", methods="all", options={"integratedgradients": {"n_steps": 2}})
    assert not set(NORM) & set(e.scores)
    assert any("attnnorm" in str(w.message) for w in caught)
    for m in NORM:
        with pytest.raises(InputError, match="norm-based and decomposition methods need a layer anatomy"):
            ex.explain("the movie was great", methods=[m])
    bert = Explainer(randomised("bert"), tokenizer)
    with pytest.raises(InputError, match="decompx decomposes the logits"):
        bert.explain("good", methods=["decompx"], target_kind="probability")
    with pytest.raises(InputError, match="bias='nope'"):
        bert.explain("good", methods=["decompx"], options={"decompx": {"bias": "nope"}})
    with pytest.raises(InputError, match="variant='x'"):
        bert.explain("good", methods=["attnnorm"], options={"attnnorm": {"variant": "x"}})


def test_deberta_with_talking_heads_has_no_anatomy(tokenizer):
    """DeBERTa's talking heads mix the heads' scores and probabilities by learned projections, which the per-head
    decompositions do not read: the norm-based methods say so; value zeroing, which reruns whole layers, applies."""
    model = make_model("deberta")
    model.config.talking_head = True
    ex = Explainer(model, tokenizer)
    for m in NORM:
        with pytest.raises(InputError, match="need a layer anatomy"):
            ex.explain("the movie was great", methods=[m])
    (e,) = ex.explain("the movie was great", methods=["valuezeroing"])
    assert np.isfinite(e.scores["valuezeroing"]).all()


def test_deberta_v2_with_a_convolution_layer_has_no_anatomy(tokenizer):
    """The convolution beside DeBERTa-v2's first layer adds to that layer's output, which the anatomy does not
    describe: the norm-based methods say so (value zeroing, which reruns whole layers, still applies: against the
    whole-model recomputation)."""
    import transformers
    from test_valuezeroing import naive_scores

    cfg = transformers.DebertaV2Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=24, max_position_embeddings=64, relative_attention=True,
                                       pos_att_type=["p2c", "c2p"], conv_kernel_size=3, conv_act="tanh",
                                       attn_implementation="eager")
    torch.manual_seed(0)
    ex = Explainer(transformers.DebertaV2ForSequenceClassification(cfg).eval(), tokenizer)
    for m in NORM:
        with pytest.raises(InputError, match="need a layer anatomy attnlens knows.*this 'deberta-v2' model has none"):
            ex.explain("a charming journey", methods=[m])
    (e,) = ex.explain("a charming journey", methods=["valuezeroing"])
    want, _, _ = naive_scores(ex.model, tokenizer, "a charming journey")
    np.testing.assert_allclose(e.layers["valuezeroing"], want, atol=5e-5, rtol=1e-3)


@pytest.mark.parametrize("family", ["bert", "llama"])  # a post-LN encoder, a pre-LN decoder
def test_a_wrong_anatomy_is_an_error_not_a_wrong_score(family, tokenizer):
    old = ARCHITECTURES[family]
    swapped = dataclasses.replace(old.anatomy, ln1=old.anatomy.ln2, ln2=old.anatomy.ln1)
    register_architecture(dataclasses.replace(old, anatomy=swapped))
    try:
        ex = Explainer(randomised(family), tokenizer)
        for m in NORM:
            with pytest.raises(ModelError, match="anatomy does not describe it"):
                ex.explain("a charming journey", methods=[m])
    finally:
        register_architecture(old)


@pytest.mark.slow
def test_reference_model_decompx_identity(minilm_sst2):
    ex = minilm_sst2
    encoded = ex.encode(["a charming and often affecting journey .", "the plot is boring and the actors bad ."])
    ctx, out = ex.compute_batch(encoded, [-1, -1], [registry.get_method("decompx")], {"decompx": {}})
    for mode in ("absdot", "token"):
        np.testing.assert_allclose(decompx_logits(ctx, mode).sum(1), ctx.capture.logits, atol=1e-3)
    scores = out["decompx"][0]
    fwd = decompx_logits(ctx, "token")[torch.arange(2), :-1, ctx.targets]
    np.testing.assert_allclose(scores, fwd * ctx.token_mask, atol=1e-4)


@pytest.mark.parametrize("bias", ["token", "absdot"])
def test_decompx_of_a_contrast_is_the_difference_of_the_two_classes(bias, tokenizer):
    """A contrastive target (explain(target=t, contrast=c)) decomposes z_t − z_c: DecompX is linear in the logits."""
    ex = Explainer(make_model("bert", num_labels=3), tokenizer)
    texts, opts = ["a charming journey", "the plot was boring and thin"], {"decompx": {"bias": bias}}
    both = ex.explain(texts, methods="decompx", target=1, contrast=2, options=opts)
    one = ex.explain(texts, methods="decompx", target=1, options=opts)
    other = ex.explain(texts, methods="decompx", target=2, options=opts)
    for b, o, t in zip(both, one, other):
        np.testing.assert_allclose(b.scores["decompx"], o.scores["decompx"] - t.scores["decompx"], atol=1e-5)
        assert np.abs(b.scores["decompx"]).max() > 1e-3


@pytest.mark.parametrize("contrast", [False, True])
def test_decompx_reports_its_bias_term_so_scores_plus_bias_is_the_logit(bert_case, contrast):
    """meta["decompx"]["bias"] is the independent loop's propagated biases (bias="token"), 0 for "absdot"; with
    the token scores it adds up to the explained logit (contrast: z_t − Σ_c p_c z_c), read from the model."""
    _, ex, ref, _ = bert_case
    texts = [TEXTS[0], TEXTS[1]]  # a padded batch: the shorter input's bias term ignores its padding
    logits = [ex.model(**ex.tokenizer(t, return_tensors="pt")).logits[0].detach().double() for t in texts]
    opts = {"decompx": {"contrast": contrast}}
    for bias in ("token", "absdot"):
        exps = ex.explain(texts, methods=["decompx"], target=1, options={"decompx": {**opts["decompx"], "bias": bias}})
        for e, z in zip(exps, logits, strict=True):
            explained = float(z[1] - (z.softmax(-1) * z).sum()) if contrast else float(z[1])
            term = e.meta["decompx"]["bias"]
            assert abs(e.scores["decompx"].sum() + term - explained) < 1e-4
            if bias == "absdot":
                assert abs(term) < 1e-6
    if not contrast:
        (e,) = ex.explain([TEXTS[0]], methods=["decompx"], target=1)
        assert abs(e.meta["decompx"]["bias"] - ref.decompx_token(1)[1]) < 1e-4


@pytest.mark.slow
def test_reference_model_decompx_bias_term_closes_the_logit(minilm_sst2):
    """On real SST-2 sentences the default bias term is far from 0 (so leaving it out of the output would hide
    part of the logit); scores + meta bias = the model's logit of the explained class."""
    import json

    from conftest import DATA

    with (DATA / "sst2" / "dev.jsonl").open(encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(6))]
    exps = minilm_sst2.explain(texts, methods=["decompx"])
    terms = []
    for text, e in zip(texts, exps, strict=True):
        with torch.no_grad():
            z = minilm_sst2.model(**minilm_sst2.tokenizer(text, return_tensors="pt")).logits[0]
        terms.append(e.meta["decompx"]["bias"])
        assert abs(e.scores["decompx"].sum() + terms[-1] - float(z[e.target])) < 1e-3
    assert max(abs(t) for t in terms) > 0.1
