"""attnnorm, globenc and alti on the encoder stream of encoder-decoders (BART: post-LN; mBART: pre-LN; T5: pre-LN
RMS norms, plain and gated feed-forward) against a per-token, per-head loop from the weights, for classifiers and
each generation step; what does not apply is refused with its reason."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from conftest import CLS, PAD, SEP, V, randomise_biases_and_norms
from test_decomposition_decoders import Reference

from attnlens import Explainer, InputError
from attnlens.errors import ModelError
from attnlens.models.architectures import ARCHITECTURES, register_architecture
from attnlens.testing.tiny_models import build_tiny

TEXT = "the movie was really good"
FAMILIES = ["bart", "mbart", "t5", "t5-gated"]
TASKS = ["classification", "seq2seq-lm"]
METHODS = ["attnnorm", "globenc", "alti"]


def randomised(family: str, task: str, seed: int = 0) -> torch.nn.Module:
    """A tiny encoder-decoder with random biases and norm scales (HF initialises them to 0 and 1)."""
    if family == "t5-gated":  # T5 v1.1 / Flan-T5: gelu(wi_0 x) ⊙ wi_1 x
        torch.manual_seed(seed)
        config = transformers.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                                       feed_forward_proj="gated-gelu", pad_token_id=PAD, eos_token_id=SEP,
                                       decoder_start_token_id=PAD, initializer_factor=8.0,
                                       attn_implementation="eager")
        cls = transformers.T5ForConditionalGeneration if task == "seq2seq-lm" else \
            transformers.T5ForSequenceClassification
        model = cls(config)
    else:
        model = build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, seed=seed,
                           task=task)
    return randomise_biases_and_norms(model, seed)


class EncoderReference(Reference):
    """One unpadded example through the encoder, the papers' formulas written out per token and head from the
    weights (z and the residual stream y as for the decoders' loop; BART's post-LN layers take x_j without LN1);
    the encoder stream is read as the mean over its query rows (as for every method there)."""

    def __init__(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
        if type(model).__name__.endswith("ForConditionalGeneration"):  # a decoder start (the encoder ignores it)
            inputs = {"decoder_input_ids": torch.tensor([[model.config.decoder_start_token_id]]), **inputs}
        with torch.no_grad():
            out = model(**inputs, output_attentions=True, output_hidden_states=True)
        self.hidden = [h[0] for h in out.encoder_hidden_states]
        self.attn = [a[0] for a in out.encoder_attentions]
        self.n, self.heads = self.attn[0].shape[-1], self.attn[0].shape[0]
        self.t5 = model.config.model_type == "t5"
        self.pre_ln = model.config.model_type != "bart"
        self.blocks = model.get_encoder().block if self.t5 else model.get_encoder().layers

    def pieces(self, l: int) -> dict:
        b = self.blocks[l]
        if self.t5:
            a = b.layer[0].SelfAttention
            zero = torch.zeros(a.o.weight.shape[0])
            return dict(ln1=b.layer[0].layer_norm, wv=a.v.weight.T, bv=torch.zeros(a.v.weight.shape[0]),
                        wo=a.o.weight.T, bo=zero)
        a = b.self_attn
        return dict(ln1=b.self_attn_layer_norm, ln2=b.final_layer_norm, wv=a.v_proj.weight.T, bv=a.v_proj.bias,
                    wo=a.out_proj.weight.T, bo=a.out_proj.bias, fc1=b.fc1, fc2=b.fc2, act=b.activation_fn)

    def f(self, l: int, h: int, j: int) -> torch.Tensor:
        """f^h(x_j) = (x_j W_V^h + b_V^h) W_O^h; pre-LN layers take LN1(x_j), as the decoders' loop does."""
        if self.pre_ln:
            return super().f(l, h, j)
        p = self.pieces(l)
        v = self.hidden[l][j] @ p["wv"] + p["bv"]
        dh = p["wo"].shape[0] // self.heads
        return v[h * dh:(h + 1) * dh] @ p["wo"][h * dh:(h + 1) * dh]

    def post_ln_parts(self, l: int, i: int) -> tuple:
        """Post-LN: LN1's and LN2's linear parts at token i, and LN1's output y1_i = LN1(y_i)."""
        p, pre1 = self.pieces(l), self.y(l, i)
        y1 = p["ln1"](pre1)
        pre2 = y1 + p["fc2"](p["act"](p["fc1"](y1)))
        return (lambda v: self.norm_linear(p["ln1"], v, pre1)), (lambda v: self.norm_linear(p["ln2"], v, pre2)), y1

    def matrix(self, entry, l: int) -> torch.Tensor:
        return torch.tensor([[float(entry(l, i, j)) for j in range(self.n)] for i in range(self.n)])

    def rollout(self, entry) -> torch.Tensor:
        """The layers' matrices of ``entry(l, i, j)`` multiplied out, C^L ⋯ C^1."""
        joint = None
        for l in range(len(self.attn)):
            m = self.matrix(entry, l)
            joint = m if joint is None else m @ joint
        return joint

    def mean_row_of_rollout(self, entry) -> np.ndarray:
        return self.rollout(entry).mean(0).numpy()

    @torch.no_grad()
    def attnnorm(self) -> np.ndarray:
        l = len(self.attn) - 1
        return self.matrix(lambda l, i, j: self.z(l, i, j, residual=False).norm(), l).mean(0).numpy()

    @torch.no_grad()
    def globenc(self) -> np.ndarray:
        def entry(l: int, i: int, j: int) -> float:
            if self.pre_ln:  # rows normalised (the default on pre-LN models)
                norms = [float(self.z(l, i, k).norm()) for k in range(self.n)]
                return norms[j] / sum(norms)
            ln1, ln2, _ = self.post_ln_parts(l, i)
            return float(ln2(ln1(self.z(l, i, j))).norm())
        return self.mean_row_of_rollout(entry)

    def alti_entry(self, l: int, i: int, j: int) -> float:
        """ALTI's C^l_ij, row i normalised to 1."""
        if self.pre_ln:
            y, t = self.y(l, i), (lambda v: v)
        else:
            t, _, y = self.post_ln_parts(l, i)
        row = [max(0.0, float(y.abs().sum() - (y - t(self.z(l, i, k))).abs().sum())) for k in range(self.n)]
        return row[j] / sum(row)

    @torch.no_grad()
    def alti(self) -> np.ndarray:
        return self.mean_row_of_rollout(self.alti_entry)


@pytest.fixture(scope="module", params=[(f, t) for f in FAMILIES for t in TASKS], ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tokenizer):
    family, task = request.param
    ex = Explainer(randomised(family, task), tokenizer)
    if task == "classification":  # the inputs the explainer passes (BART's decoder reads the shifted input)
        inputs = ex.compute_batch(ex.encode([TEXT]), [0], [], {})[0].inputs
    else:
        inputs = {"input_ids": torch.tensor([ex.encode([TEXT])[0].ids])}
    return ex, EncoderReference(ex.model, inputs), task


def test_norm_methods_on_the_encoder_match_the_loop(case):
    ex, ref, task = case
    expected = {"attnnorm": ref.attnnorm(), "globenc": ref.globenc(), "alti": ref.alti()}
    if task == "classification":
        (e,) = ex.explain([TEXT], methods=METHODS)
        got = e.scores
    else:  # every step reads the same encoder: each row over the prompt is the encoder's
        g = ex.explain_generation(TEXT, max_new_tokens=2, methods=METHODS)
        n = len(g.prompt_ids)
        assert g.prompt_ids == ex.encode([TEXT])[0].ids and n == ref.n
        for m in METHODS:
            assert np.abs(g.scores[m][:, n:]).max() == 0
        got = {m: g.scores[m][-1, :n] for m in METHODS}
        for m in METHODS:
            np.testing.assert_allclose(g.scores[m][0, :n], got[m], rtol=1e-5, atol=1e-7)
    for m in METHODS:
        np.testing.assert_allclose(got[m], expected[m], rtol=1e-4, atol=1e-6, err_msg=m)
        assert np.abs(expected[m]).max() > 0
    assert abs(expected["alti"].sum() - 1) < 1e-5


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_batch_and_padding_invariance_on_the_encoder(family, tokenizer):
    ex = Explainer(randomised(family, "classification"), tokenizer)
    texts = [TEXT, "bad", "a charming journey but the plot was boring"]
    batch = ex.explain(texts, methods=METHODS, batch_size=3)
    for text, e in zip(texts, batch):
        (alone,) = ex.explain([text], methods=METHODS)
        for m in METHODS:
            np.testing.assert_allclose(e.scores[m], alone.scores[m], rtol=1e-4, atol=1e-6, err_msg=f"{family} {m}")


def test_other_streams_are_refused_with_their_reason(tokenizer):
    model = randomised("bart", "seq2seq-lm")
    for stream in ("decoder", "cross"):
        for m in ("globenc",):
            with pytest.raises(InputError, match="encoder layers.*use alti|needs self-attention"):
                Explainer(model, tokenizer, attention=stream).explain_generation(TEXT, max_new_tokens=1, methods=[m])
    cross = Explainer(model, tokenizer, attention="cross")
    with pytest.raises(InputError, match="variant='attn_res' is not defined on attention='cross'"):
        cross.explain_generation(TEXT, max_new_tokens=1, methods=["attnnorm"],
                                 options={"attnnorm": {"variant": "attn_res"}})
    with pytest.raises(InputError, match="variant='attn_res_ln' is not defined on attention='decoder'"):
        Explainer(model, tokenizer, attention="decoder").explain_generation(
            TEXT, max_new_tokens=1, methods=["attnnorm"], options={"attnnorm": {"variant": "attn_res_ln"}})


class AltiPlusReference(EncoderReference):
    """ALTI+ written out per token and head from the weights: the encoder's ALTI matrices (the encoder loop's),
    then per decoder layer ALTI of its self-attention block and of its cross-attention block (over the encoder's
    outputs and the block's residual), composed over the whole token set [encoder outputs; decoder positions]:
    each layer maps the decoder rows to [c_cross, c_res · C_self] and keeps the encoder rows, starting from
    [[R_enc, 0], [0, I]]."""

    def __init__(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
        super().__init__(model, inputs)
        with torch.no_grad():
            out = model(**inputs, output_attentions=True, output_hidden_states=True)
        self.dec_hidden = [h[0] for h in out.decoder_hidden_states]
        self.dec_attn = [a[0] for a in out.decoder_attentions]
        self.cross_attn = [a[0] for a in out.cross_attentions]
        self.memory = out.encoder_last_hidden_state[0]
        decoder = model.get_decoder()
        self.dec_blocks = decoder.block if self.t5 else decoder.layers

    def dec_pieces(self, l: int) -> dict:
        b = self.dec_blocks[l]
        if self.t5:
            s, c = b.layer[0].SelfAttention, b.layer[1].EncDecAttention
            return dict(ln=b.layer[0].layer_norm, sv=s.v, so=s.o, cln=b.layer[1].layer_norm, cv=c.v, co=c.o)
        return dict(ln=b.self_attn_layer_norm, sv=b.self_attn.v_proj, so=b.self_attn.out_proj,
                    cln=b.encoder_attn_layer_norm, cv=b.encoder_attn.v_proj, co=b.encoder_attn.out_proj)

    def head_value(self, v_lin, o_lin, key: torch.Tensor, h: int) -> torch.Tensor:
        v = key @ v_lin.weight.T + (0 if v_lin.bias is None else v_lin.bias)
        dh = o_lin.weight.shape[1] // self.heads
        return v[h * dh:(h + 1) * dh] @ o_lin.weight.T[h * dh:(h + 1) * dh]

    @staticmethod
    def l1_share(y: torch.Tensor, t: torch.Tensor) -> float:
        return max(0.0, float(y.abs().sum() - (y - t).abs().sum()))

    def dec_layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(C_self (T, T), C_cross (T, S + 1))`` of decoder layer l, rows normalised; the last column: the
        cross block's residual."""
        p, x = self.dec_pieces(l), self.dec_hidden[l]
        a, ac = self.dec_attn[l], self.cross_attn[l]
        t, s = x.shape[0], self.memory.shape[0]
        keys = torch.stack([p["ln"](v) for v in x]) if self.pre_ln else x
        bo = 0 if p["so"].bias is None else p["so"].bias
        bco = 0 if p["co"].bias is None else p["co"].bias
        c_self, c_cross = torch.zeros(t, t), torch.zeros(t, s + 1)
        for i in range(t):
            z = [sum(a[h, i, j] * self.head_value(p["sv"], p["so"], keys[j], h) for h in range(self.heads))
                 + (x[i] if i == j else 0) for j in range(t)]
            pre1 = sum(z) + bo
            lin1 = (lambda v: v) if self.pre_ln else (lambda v, pre=pre1: self.norm_linear(p["ln"], v, pre))
            h_i = pre1 if self.pre_ln else p["ln"](pre1)
            c_self[i] = torch.tensor([self.l1_share(h_i, lin1(zj)) for zj in z])
            zc = [sum(ac[h, i, k] * self.head_value(p["cv"], p["co"], self.memory[k], h) for h in range(self.heads))
                  for k in range(s)] + [h_i]
            pre2 = sum(zc) + bco
            lin2 = (lambda v: v) if self.pre_ln else (lambda v, pre=pre2: self.norm_linear(p["cln"], v, pre))
            y2 = pre2 if self.pre_ln else p["cln"](pre2)
            c_cross[i] = torch.tensor([self.l1_share(y2, lin2(zk)) for zk in zc])
        return c_self / c_self.sum(1, keepdim=True), c_cross / c_cross.sum(1, keepdim=True)

    @torch.no_grad()
    def alti_plus(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Per decoder layer, row ``row``'s shares of the source tokens ``(L, S)`` and of the decoder positions
        ``(L, T)``."""
        r_enc = self.rollout(self.alti_entry)  # the encoder loop's ALTI, every row
        s, t = self.n, self.dec_hidden[0].shape[0]
        state = torch.zeros(s + t, s + t)
        state[:s, :s], state[s:, s:] = r_enc, torch.eye(t)
        source, target = [], []
        for l in range(len(self.dec_blocks)):
            c_self, c_cross = self.dec_layer(l)
            step = torch.eye(s + t)
            step[s:] = torch.cat([c_cross[:, :s], c_cross[:, s:] * c_self], 1)
            state = step @ state
            source.append(state[s + row, :s].numpy())
            target.append(state[s + row, s:].numpy())
        return np.stack(source), np.stack(target)


def _stream_reference(model, inputs, stream: str, residual: bool) -> list[torch.Tensor]:
    """attnnorm's matrix per decoder layer, per (query, key) pair and head from the weights: ‖Σ_h α^h_ij f^h(k_j)‖
    (+ x_i on the diagonal), k_j the layer input x_j (through LN1 when pre-LN) for the decoder's self-attention,
    the encoder's output for the cross-attention."""
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    t5, pre_ln = model.config.model_type == "t5", model.config.model_type != "bart"
    blocks = model.get_decoder().block if t5 else model.get_decoder().layers
    mats = []
    for l, block in enumerate(blocks):
        x = out.decoder_hidden_states[l][0]
        if stream == "decoder":
            attn = out.decoder_attentions[l][0]
            a = (block.layer[0].SelfAttention if t5 else block.self_attn)
            ln = block.layer[0].layer_norm if t5 else block.self_attn_layer_norm
            keys = torch.stack([ln(v) for v in x]) if pre_ln else x
            wv, wo = (a.v, a.o) if t5 else (a.v_proj, a.out_proj)
        else:
            attn = out.cross_attentions[l][0]
            a = block.layer[1].EncDecAttention if t5 else block.encoder_attn
            keys = out.encoder_last_hidden_state[0]
            wv, wo = (a.v, a.o) if t5 else (a.v_proj, a.out_proj)
        heads, (nq, nk) = attn.shape[0], attn.shape[1:]
        dh = wo.weight.shape[1] // heads
        m = torch.zeros(nq, nk)
        for i in range(nq):
            for j in range(nk):
                v = keys[j] @ wv.weight.T + (0 if wv.bias is None else wv.bias)
                z = sum(attn[h, i, j] * v[h * dh:(h + 1) * dh] @ wo.weight.T[h * dh:(h + 1) * dh]
                        for h in range(heads))
                m[i, j] = (z + (x[i] if residual and i == j else 0)).norm()
        mats.append(m)
    return mats


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("stream,variant", [("decoder", "attn"), ("decoder", "attn_res"), ("cross", "attn")])
def test_attnnorm_on_the_decoder_and_cross_streams_matches_the_loop(family, stream, variant, tokenizer):
    """Kobayashi et al.'s norms on the other two streams (their 2020 paper read cross-attention norms as word
    alignments), every decoder layer's whole matrix against the loop from the weights."""
    from attnlens import get_method
    from attnlens.methods.decomposition.norm_based import _stream_norms

    ex = Explainer(randomised(family, "classification"), tokenizer, attention=stream)
    ctx, out = ex.compute_batch(ex.encode([TEXT]), [0], [get_method("attnnorm")], {"attnnorm": {"variant": variant}})
    got = _stream_norms(ctx, variant)
    with torch.no_grad():
        want = _stream_reference(ex.model, ctx.inputs, stream, variant == "attn_res")
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        np.testing.assert_allclose(g[0].numpy(), w.numpy(), rtol=1e-4, atol=1e-6)
    assert np.abs(out["attnnorm"][0].numpy()).max() > 0


def _assert_batch_equals_each_alone(stream: str, method: str, tokenizer) -> None:
    """A padded batch of a BART classifier's inputs on ``stream`` scores as each input alone (and not all 0)."""
    ex = Explainer(randomised("bart", "classification"), tokenizer, attention=stream)
    texts = [TEXT, "bad", "a charming journey but the plot was boring"]
    batch = ex.explain(texts, methods=[method], batch_size=3)
    for text, e in zip(texts, batch):
        (alone,) = ex.explain([text], methods=[method])
        np.testing.assert_allclose(e.scores[method], alone.scores[method], rtol=1e-4, atol=1e-6)
        assert np.abs(e.scores[method]).max() > 0


@pytest.mark.parametrize("stream", ["decoder", "cross"])
def test_attnnorm_on_the_other_streams_batch_padding_and_generation(stream, tokenizer):
    _assert_batch_equals_each_alone(stream, "attnnorm", tokenizer)
    lm = Explainer(randomised("t5", "seq2seq-lm"), tokenizer, attention=stream)
    g = lm.explain_generation(TEXT, max_new_tokens=3, methods=["attnnorm"])
    assert np.isfinite(g.scores["attnnorm"]).all() and np.abs(g.scores["attnnorm"]).max() > 0


def test_a_wrong_t5_anatomy_is_an_error(tokenizer):
    """A gated T5 read as a plain one (its wi_1 taken for wi, no gate) must not give scores: the recomputed layers
    do not reproduce the hidden states."""
    old = ARCHITECTURES["t5"]
    plain = old.anatomy_for(transformers.T5Config())
    register_architecture(dataclasses.replace(old, anatomy=dataclasses.replace(
        plain, ffn_in="layer.1.DenseReluDense.wi_1")))
    try:
        ex = Explainer(randomised("t5-gated", "classification"), tokenizer)
        for m in METHODS:
            with pytest.raises(ModelError, match="anatomy does not describe it"):
                ex.explain(TEXT, methods=[m])
    finally:
        register_architecture(old)


@pytest.mark.parametrize("family", FAMILIES)
def test_alti_plus_on_the_cross_and_decoder_streams_matches_the_loop(family, tokenizer):
    """ALTI+ on a classifier (the decoder row at the last EOS, which its head reads): the source tokens' shares
    on attention='cross', the decoder tokens' on 'decoder' (decoder key k is token k - 1: the start token's share
    is the one left out), each decoder layer's, against the loop; the shares add up to 1."""
    model = randomised(family, "classification")
    shares = {}
    for stream in ("cross", "decoder"):
        ex = Explainer(model, tokenizer, attention=stream)
        (e,) = ex.explain([TEXT], methods=["alti"])
        shares[stream] = e
    inputs = ex.compute_batch(ex.encode([TEXT]), [0], [], {})[0].inputs
    ids = inputs["input_ids"][0].tolist()
    row = max(i for i, t in enumerate(ids) if t == model.config.eos_token_id)
    source, target = AltiPlusReference(model, inputs).alti_plus(row)
    np.testing.assert_allclose(source.sum(1) + target.sum(1), 1.0, rtol=1e-5)
    assert source[-1].min() >= 0 and 0.05 < source[-1].sum() < 0.95  # both sides of the sequence count
    np.testing.assert_allclose(shares["cross"].scores["alti"], source[-1], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(shares["cross"].layers["alti"], source, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(shares["decoder"].scores["alti"][:-1], target[-1][1:], rtol=1e-4, atol=1e-6)
    assert shares["decoder"].scores["alti"][-1] == 0
    # what each stream's columns leave out is in meta: together with them, the whole 1
    cross, decoder = shares["cross"].meta["alti"], shares["decoder"].meta["alti"]
    np.testing.assert_allclose(cross["target_share"], target[-1].sum(), rtol=1e-4)
    np.testing.assert_allclose(decoder["source_share"], source[-1].sum(), rtol=1e-4)
    np.testing.assert_allclose(decoder["start_share"], target[-1][0], rtol=1e-4, atol=1e-7)
    total = shares["decoder"].scores["alti"].sum() + decoder["source_share"] + decoder["start_share"]
    np.testing.assert_allclose(total, 1.0, rtol=1e-5)


@pytest.mark.parametrize("stream", ["cross", "decoder"])
def test_alti_plus_batch_padding_and_generation_steps(stream, tokenizer):
    _assert_batch_equals_each_alone(stream, "alti", tokenizer)
    lm_model = randomised("t5", "seq2seq-lm")
    lm = Explainer(lm_model, tokenizer, attention=stream)
    g = lm.explain_generation(TEXT, max_new_tokens=3, methods=["alti"])
    n = len(g.prompt_ids)
    decoder_ids = [lm_model.config.decoder_start_token_id, *g.generated_ids]
    ref = AltiPlusReference(lm_model, {"input_ids": torch.tensor([g.prompt_ids]),
                                       "decoder_input_ids": torch.tensor([decoder_ids[:-1]])})
    for step in range(len(g.generated_ids)):
        source, target = ref.alti_plus(step)
        if stream == "cross":  # the prompt's columns
            np.testing.assert_allclose(g.scores["alti"][step, :n], source[-1], rtol=1e-4, atol=1e-6)
        else:  # the continuation before the step (decoder key k >= 1 is generated token k - 1)
            np.testing.assert_allclose(g.scores["alti"][step, n:n + step], target[-1][1:step + 1], rtol=1e-4,
                                       atol=1e-6)


def test_alti_plus_with_a_wrong_cross_norm_is_an_error(tokenizer):
    """BART's cross-attention block read with the layer's last norm in place of its own: the recomputed decoder
    layers do not reproduce the hidden states, so no scores."""
    old = ARCHITECTURES["bart"]
    register_architecture(dataclasses.replace(old, anatomy=dataclasses.replace(old.anatomy,
                                                                               cross_norm="final_layer_norm")))
    try:
        ex = Explainer(randomised("bart", "classification"), tokenizer, attention="cross")
        with pytest.raises(ModelError, match="anatomy does not describe it"):
            ex.explain([TEXT], methods=["alti"])
    finally:
        register_architecture(old)


def test_alti_plus_runs_its_pass_in_chunks_the_memory_budget_holds(tokenizer, monkeypatch):
    """Where the batch's pass would not fit what the budget leaves, ALTI+ runs it a few examples at a time (here
    one): the same scores."""
    from attnlens.methods.decomposition import alti_plus

    ex = Explainer(randomised("bart", "classification"), tokenizer, attention="cross")
    texts = [TEXT, "bad", "a charming journey but the plot was boring"]
    whole = ex.explain(texts, methods=["alti"], batch_size=3)
    sizes = []
    real_pass = alti_plus._alti_plus_pass
    monkeypatch.setattr(alti_plus, "stream_pass_row_bytes", lambda model, inputs: 600 * 2**20)
    monkeypatch.setattr(alti_plus, "_alti_plus_pass",
                        lambda model, anatomy, inputs, weights: sizes.append(len(weights)) or real_pass(
                            model, anatomy, inputs, weights))
    chunked = ex.explain(texts, methods=["alti"], batch_size=3, memory_budget="1GiB")
    assert sizes == [1, 1, 1]
    for a, b in zip(whole, chunked):
        np.testing.assert_allclose(a.scores["alti"], b.scores["alti"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(a.meta["alti"]["target_share"], b.meta["alti"]["target_share"], rtol=1e-5)
