"""DecompX on encoder-decoders (BART's post-LN layers, mBART's pre-LN ones, T5's RMS-normed blocks, T5 v1.1's gated
feed-forward), for classifiers, extractive QA and each token a language model generates.

Against an explicit per-source propagation written from the weights (float64, no autograd): every encoder token's
vectors, every decoder input's and the biases, each propagated alone through the encoder and the decoder's self-
and cross-attention with attention weights, norm scales and activation ratios held at the real pass's (read from
the model's own modules by hooks). Also: bias-free, the scores equal CP-LRP's (an independent implementation of the
same linearisation); scores, decoder share and bias term sum to the logit; a padded batch equals its examples
alone; each generated token; and the options that do not apply refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tokenizer
from test_lrp_seq2seq import FAMILIES, TEXTS, _qa_model, seq2seq
from torch import nn

from attnlens import Explainer
from attnlens.errors import InputError


def _norm_linear(norm: nn.Module, v: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The norm's linear part at the scale of its real input ``real``: LayerNorm (v − mean v) γ / std, RMS norm
    v g / rms."""
    if isinstance(norm, nn.LayerNorm):
        std = (real.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
        return (v - v.mean(-1, keepdim=True)) * norm.weight / std
    rms = (real.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
    return v * norm.weight / rms


def _beta(norm: nn.Module) -> torch.Tensor | float:
    return norm.bias if isinstance(norm, nn.LayerNorm) and norm.bias is not None else 0.0


def _mix(attn: torch.Tensor, values: torch.Tensor, out: nn.Linear) -> torch.Tensor:
    """Σ_h A^h (values^h) W_O^h: ``attn`` (H, Q, K), ``values`` (K, H·d_h)."""
    heads = attn.shape[0]
    dh = values.shape[1] // heads
    w = out.weight
    return sum(attn[h] @ values[:, h * dh:(h + 1) * dh] @ w[:, h * dh:(h + 1) * dh].T for h in range(heads))


class Pieces:
    """One layer's modules by role, for BART/mBART layers and T5 blocks."""

    def __init__(self, block: nn.Module, t5: bool) -> None:
        if t5:
            sa, ca = block.layer[0].SelfAttention, getattr(block.layer[1], "EncDecAttention", None)
            self.v, self.o, self.ln1 = sa.v, sa.o, block.layer[0].layer_norm
            self.cv = self.co = self.lnc = None
            if ca is not None:
                self.cv, self.co, self.lnc = ca.v, ca.o, block.layer[1].layer_norm
            ffn = block.layer[-1].DenseReluDense
            self.ln2, self.act, self.out = block.layer[-1].layer_norm, ffn.act, ffn.wo
            self.gate, self.up = (ffn.wi_0, ffn.wi_1) if hasattr(ffn, "wi_0") else (None, ffn.wi)
        else:
            self.v, self.o, self.ln1 = block.self_attn.v_proj, block.self_attn.out_proj, block.self_attn_layer_norm
            ca = getattr(block, "encoder_attn", None)
            self.cv, self.co = (ca.v_proj, ca.out_proj) if ca is not None else (None, None)
            self.lnc = getattr(block, "encoder_attn_layer_norm", None)
            self.ln2, self.act, self.out = block.final_layer_norm, block.activation_fn, block.fc2
            self.gate, self.up = None, block.fc1


def _bias(layer: nn.Linear) -> torch.Tensor | float:
    return layer.bias if layer.bias is not None else 0.0


class Reference:
    """DecompX of one unpadded example, each source propagated alone (see the module docstring)."""

    def __init__(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
        self.model, self.t5 = model, model.config.model_type == "t5"
        self.pre_ln = model.config.model_type != "bart"
        self.seen: dict[nn.Module, list[torch.Tensor]] = {}
        hooks = []
        for m in model.modules():  # the real inputs of every norm and the FFN's pre-activations, in call order
            if isinstance(m, nn.LayerNorm) or type(m).__name__ == "T5LayerNorm":
                hooks.append(m.register_forward_pre_hook(lambda mod, a: self.seen.setdefault(mod, []).append(a[0])))
        base = model.base_model
        self.enc_blocks = list(base.encoder.block if self.t5 else base.encoder.layers)
        self.dec_blocks = list(base.decoder.block if self.t5 else base.decoder.layers)
        for block in self.enc_blocks + self.dec_blocks:
            p = Pieces(block, self.t5)
            for lin in (p.gate, p.up):
                if lin is not None:
                    hooks.append(lin.register_forward_hook(lambda mod, a, o: self.seen.setdefault(mod, []).append(o)))
        model.set_attn_implementation("eager")  # the attention weights
        with torch.no_grad():
            self.out = model(**inputs, output_attentions=True, output_hidden_states=True, use_cache=False)
        for h in hooks:
            h.remove()
        self.inputs = inputs
        out = self.out
        self.x0, self.d0 = out.encoder_hidden_states[0][0], out.decoder_hidden_states[0][0]
        self.enc_attn = [a[0] for a in out.encoder_attentions]
        self.dec_attn = [a[0] for a in out.decoder_attentions]
        self.cross_attn = [a[0] for a in out.cross_attentions]
        self.final = None
        if self.pre_ln:
            self.final = ((base.encoder.final_layer_norm, base.decoder.final_layer_norm) if self.t5 else
                          (base.encoder.layer_norm, base.decoder.layer_norm))

    def real(self, module: nn.Module) -> torch.Tensor:
        return self.seen[module][-1][0]

    def _layer(self, p: Pieces, l: int, e: torch.Tensor, attn: torch.Tensor, own: int | None, biases: bool,
               memory: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """One layer on the source's decomposition ``e`` (N, D); ``own``: the source's position when this is the
        first layer of its stream (its value vector, value bias included, goes with it)."""
        a = _norm_linear(p.ln1, e, self.real(p.ln1)) if self.pre_ln else e
        v = a @ p.v.weight.T
        value_bias = (_beta(p.ln1) @ p.v.weight.T if self.pre_ln and isinstance(_beta(p.ln1), torch.Tensor)
                      else 0.0) + _bias(p.v)
        if own is not None:
            v[own] = v[own] + value_bias
        if l > 0 and biases:
            v = v + value_bias
        att = _mix(attn, v, p.o) + (_bias(p.o) if biases else 0.0)
        cross = None
        if memory is not None:
            mem, cattn = memory
            cross = _mix(cattn, mem @ p.cv.weight.T + (_bias(p.cv) if biases else 0.0), p.co)
            cross = cross + (_bias(p.co) if biases else 0.0)
        if self.pre_ln:
            r = e + att + (0.0 if cross is None else cross)
        else:
            r = _norm_linear(p.ln1, e + att, self.real(p.ln1)) + (_beta(p.ln1) if biases else 0.0)
            if cross is not None:
                r = _norm_linear(p.lnc, r + cross, self.real(p.lnc)) + (_beta(p.lnc) if biases else 0.0)
        m = (_norm_linear(p.ln2, r, self.real(p.ln2)) + (_beta(p.ln2) if biases else 0.0)) if self.pre_ln else r
        u = m @ p.up.weight.T + (_bias(p.up) if biases else 0.0)
        if p.gate is None:
            u_real = self.real(p.up)
            hidden = u * torch.where(u_real != 0, p.act(u_real) / u_real, 0.0)
        else:
            g_real, u_real = self.real(p.gate), self.real(p.up)
            g = (m @ p.gate.weight.T) * p.act(g_real) / g_real
            hidden = 0.5 * (g * u_real + p.act(g_real) * u)
        f = hidden @ p.out.weight.T + (_bias(p.out) if biases else 0.0)
        if self.pre_ln:
            return r + f
        return _norm_linear(p.ln2, r + f, self.real(p.ln2)) + (_beta(p.ln2) if biases else 0.0)

    def _stream(self, blocks, e, maps, own, biases, memory=None, final=None):
        for l, block in enumerate(blocks):
            cross = None if memory is None else (memory, self.cross_attn[l])
            e = self._layer(Pieces(block, self.t5), l, e, maps[l], own if l == 0 else None, biases, cross)
        if final is not None:
            e = _norm_linear(final, e, self.real(final)) + (_beta(final) if biases else 0.0)
        return e

    @torch.no_grad()
    def propagate(self, source: tuple[str, int] | None, read, weights: torch.Tensor) -> float:
        """The explained value's share of ``source`` (``("enc", j)``, ``("dec", t)``, ``None``: the biases);
        ``read(state (T, D), biases)`` gives the logits read from the decoder's output decomposition."""
        biases = source is None
        e = torch.zeros_like(self.x0)
        if source and source[0] == "enc":
            e[source[1]] = self.x0[source[1]]
        memory = self._stream(self.enc_blocks, e, self.enc_attn, source[1] if source and source[0] == "enc" else None,
                              biases, final=self.final and self.final[0])
        d = torch.zeros_like(self.d0)
        if source and source[0] == "dec":
            d[source[1]] = self.d0[source[1]]
        d = self._stream(self.dec_blocks, d, self.dec_attn, source[1] if source and source[0] == "dec" else None,
                         biases, memory=memory, final=self.final and self.final[1])
        return float((read(d, biases) * weights).sum())

    def decompx(self, read, weights: torch.Tensor) -> tuple[np.ndarray, float, float]:
        """``(encoder tokens' scores, decoder inputs' share, bias term)``."""
        scores = np.array([self.propagate(("enc", j), read, weights) for j in range(self.x0.shape[0])])
        decoder = sum(self.propagate(("dec", t), read, weights) for t in range(self.d0.shape[0]))
        return scores, decoder, self.propagate(None, read, weights)

    # ------------------------------------------------------------------ heads
    def classifier(self, position: int):
        head = self.model.classification_head
        real = head.dense(self.out.decoder_hidden_states[-1][0, position])

        def read(d: torch.Tensor, biases: bool) -> torch.Tensor:
            z = d[position] @ head.dense.weight.T + (head.dense.bias if biases else 0.0)
            z = z * torch.tanh(real) / real
            return z @ head.out_proj.weight.T + (head.out_proj.bias if biases else 0.0)
        return read

    def language_model(self, position: int):
        cfg = self.model.config
        scale = cfg.d_model ** -0.5 if self.t5 and getattr(cfg, "scale_decoder_outputs", cfg.tie_word_embeddings) \
            else 1.0
        bias = getattr(self.model, "final_logits_bias", None)

        def read(d: torch.Tensor, biases: bool) -> torch.Tensor:
            z = (d[position] * scale) @ self.model.get_output_embeddings().weight.T
            return z + (bias[0] if biases and bias is not None else 0.0)
        return read

    def span(self, positions: tuple[int, int]):
        def read(d: torch.Tensor, biases: bool) -> torch.Tensor:
            out = self.model.qa_outputs
            z = d[list(positions)] @ out.weight.T + (out.bias if biases else 0.0)
            return torch.stack([z[0, 0], z[1, 1]])
        return read


def _tol(family: str) -> dict[str, float]:
    """T5's stock RMS norm computes its statistics in float32 (the rest runs in float64)."""
    return dict(rtol=1e-5, atol=1e-7) if family.startswith("t5") else dict(rtol=1e-7, atol=1e-9)


def _approx(value: float, family: str):
    tol = _tol(family)
    return pytest.approx(value, rel=tol["rtol"], abs=tol["atol"])


def _eos(ids: list[int], eos: int) -> int:
    return max(i for i, t in enumerate(ids) if t == eos)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("family", FAMILIES)
def test_classifier_matches_the_explicit_propagation(family):
    model = seq2seq(family)
    ex = Explainer(model, make_tokenizer())
    (e,) = ex.explain(TEXTS[:1], methods=["decompx"], target=2)
    ids = torch.tensor([e.input_ids])
    ref = Reference(model, {"input_ids": ids})
    scores, decoder, bias = ref.decompx(ref.classifier(_eos(e.input_ids, model.config.eos_token_id)),
                                        torch.eye(3, dtype=torch.float64)[2])
    np.testing.assert_allclose(e.scores["decompx"], scores, **_tol(family))
    meta = e.meta["decompx"]
    assert float(meta["decoder_inputs"]) == _approx(decoder, family)
    assert float(meta["bias"]) == _approx(bias, family)
    logit = float(ref.out.logits[0, 2])
    assert scores.sum() + decoder + bias == _approx(logit, family)  # the reference accounts for the whole logit
    assert np.abs(scores).max() > 1e-2 and abs(decoder) > 1e-3 and abs(bias) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_each_generated_token_matches_the_explicit_propagation(family):
    model = seq2seq(family, "seq2seq-lm")
    gen = Explainer(model, make_tokenizer()).explain_generation(TEXTS[0], max_new_tokens=3, methods=["decompx"])
    ids = torch.tensor([gen.prompt_ids])
    start = model.config.decoder_start_token_id
    decoder_ids = torch.tensor([[start, *gen.generated_ids[:-1]]])
    ref = Reference(model, {"input_ids": ids, "decoder_input_ids": decoder_ids})
    n = len(gen.prompt_ids)
    for t, token in enumerate(gen.generated_ids):
        weights = torch.nn.functional.one_hot(torch.tensor(token), model.config.vocab_size).double()
        scores, decoder, bias = ref.decompx(ref.language_model(t), weights)
        np.testing.assert_allclose(gen.scores["decompx"][t][:n], scores, **_tol(family))
        assert gen.meta["decompx"]["decoder_inputs"][t] == _approx(decoder, family)
        assert gen.meta["decompx"]["bias"][t] == _approx(bias, family)
        assert scores.sum() + decoder + bias == _approx(float(ref.out.logits[0, t, token]), family)
    assert (gen.scores["decompx"][:, n:] == 0).all()  # the generated columns: the encoder never reads them


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_question_answering_span_matches_the_explicit_propagation(family):
    model = _qa_model(family)
    ex = Explainer(model, make_tokenizer())
    (e,) = ex.explain([("what movie", "the movie was really good")], methods=["decompx"])
    start, end = e.target
    ref = Reference(model, {"input_ids": torch.tensor([e.input_ids])})
    scores, decoder, bias = ref.decompx(ref.span((start, end)), torch.ones(2, dtype=torch.float64))
    np.testing.assert_allclose(e.scores["decompx"], scores, **_tol(family))
    assert float(e.meta["decompx"]["decoder_inputs"]) == _approx(decoder, family)
    assert float(e.meta["decompx"]["bias"]) == _approx(bias, family)


@pytest.mark.parametrize("family", ["bart", "mbart", "t5"])
def test_bias_free_decompx_equals_cp_lrp(family):
    # with no biases, DecompX's linearisation and CP-LRP's rules (attention held, identity rule on norms and
    # activations) are the same map, computed by two implementations (on a gated feed-forward they differ: CP-LRP
    # holds the gate constant, DecompX splits the product half and half)
    model = seq2seq(family, biases=False)
    ex = Explainer(model, make_tokenizer())
    for a, b in zip(ex.explain(TEXTS, methods=["decompx"], target=1),
                    ex.explain(TEXTS, methods=["attnlrp"], target=1, options={"attnlrp": {"rules": "cp"}})):
        np.testing.assert_allclose(a.scores["decompx"], b.scores["attnlrp"], **_tol(family))
        assert float(a.meta["decompx"]["decoder_inputs"]) == _approx(float(b.meta["attnlrp"]["decoder_inputs"]),
                                                                     family)
        assert abs(float(a.meta["decompx"]["bias"])) < 1e-6


@pytest.mark.parametrize("family", ["bart", "t5-gated"])
def test_a_padded_batch_equals_each_example_alone(family):
    ex = Explainer(seq2seq(family), make_tokenizer())
    batch = ex.explain(TEXTS, methods=["decompx"], target=0, batch_size=3)
    for text, e in zip(TEXTS, batch):
        (alone,) = ex.explain([text], methods=["decompx"], target=0)
        np.testing.assert_allclose(e.scores["decompx"], alone.scores["decompx"], rtol=1e-9, atol=1e-12)
        for key in ("bias", "decoder_inputs"):
            assert float(e.meta["decompx"][key]) == pytest.approx(float(alone.meta["decompx"][key]), rel=1e-9)


def test_a_pass_over_budget_runs_in_chunks_and_changes_nothing(monkeypatch):
    from attnlens.methods.decomposition import decompx_seq2seq

    ex = Explainer(seq2seq("mbart"), make_tokenizer())
    whole = ex.explain(TEXTS, methods=["decompx"], target=1, batch_size=3)
    sizes = []
    real_chunk = decompx_seq2seq._seq2seq_decompx_chunk
    monkeypatch.setattr(decompx_seq2seq, "_seq2seq_decompx_row_bytes", lambda model, inputs: 600 * 2**20)
    monkeypatch.setattr(decompx_seq2seq, "_seq2seq_decompx_chunk", lambda ctx, inputs, targets, contrast: sizes.append(
        len(targets)) or real_chunk(ctx, inputs, targets, contrast))
    tight = ex.explain(TEXTS, methods=["decompx"], target=1, batch_size=3, memory_budget="1GiB")
    assert sizes == [1, 1, 1]
    for a, b in zip(whole, tight):
        np.testing.assert_allclose(a.scores["decompx"], b.scores["decompx"], rtol=1e-9, atol=1e-12)


def test_what_does_not_apply_is_refused_in_one_line():
    model = seq2seq("bart")
    ex = Explainer(model, make_tokenizer())
    with pytest.raises(InputError, match="bias='absdot'.*encoder-decoder use bias='token'"):
        ex.explain(TEXTS[:1], methods=["decompx"], options={"decompx": {"bias": "absdot"}})
    with pytest.raises(InputError, match="target_kind='probability' is not supported"):
        ex.explain(TEXTS[:1], methods=["decompx"], target_kind="probability")
    with pytest.raises(InputError, match="encoder's input tokens.*attention='encoder'.*cross streams use alti"):
        Explainer(model, make_tokenizer(), attention="cross").explain(TEXTS[:1], methods=["decompx"])


def test_an_input_whose_pass_exceeds_the_budget_is_refused_in_one_line(monkeypatch):
    from attnlens.methods.decomposition import decompx_seq2seq

    ex = Explainer(seq2seq("t5"), make_tokenizer())
    monkeypatch.setattr(decompx_seq2seq, "_seq2seq_decompx_row_bytes", lambda model, inputs: 8 * 2**30)
    with pytest.raises(InputError, match=r"decompx keeps every stream's attention maps.*about 8\.0 GiB.*raise the"):
        ex.explain(TEXTS[:1], methods=["decompx"])


@pytest.mark.parametrize(("method", "stream", "module", "name"), [
    ("decompx", "encoder", "decompx", "seq2seq_decompx_bytes"),
    ("alti", "cross", "norm_based", "stream_pass_bytes"),
    ("alti", "decoder", "norm_based", "stream_pass_bytes"),
])
def test_a_pass_over_every_stream_that_exceeds_the_budget_is_refused_before_any_forward(method, stream, module,
                                                                                         name, monkeypatch):
    """DecompX's pass over every stream of an encoder-decoder (and ALTI+'s, on the decoder and cross streams)
    counts in the budget with the shared pass: an input it does not fit is refused with what fits, before the
    model runs."""
    import importlib

    where = importlib.import_module(f"attnlens.methods.decomposition.{module}")
    model = seq2seq("bart")
    ex = Explainer(model, make_tokenizer(), attention=stream)
    monkeypatch.setattr(where, name, lambda model, source, target: 8 * 2**30 * source // 10)
    forwards = []
    hook = model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        with pytest.raises(InputError, match=rf"with {method} needs about .* GiB.*{method} up to \d+ tokens"):
            ex.explain(TEXTS[:1], methods=[method])
        assert forwards == []
        ex.explain(["good"], methods=[method], memory_budget="16GiB")  # what fits runs
        assert forwards
    finally:
        hook.remove()


def test_an_entry_without_the_cross_attention_norm_is_refused_and_a_wrong_one_is_an_error():
    import dataclasses

    from attnlens.errors import ModelError
    from attnlens.models.architectures import ARCHITECTURES, register_architecture

    old = ARCHITECTURES["bart"]
    model = seq2seq("bart")
    try:
        register_architecture(dataclasses.replace(old, anatomy=dataclasses.replace(old.anatomy, cross_norm=None)))
        ex = Explainer(model, make_tokenizer())
        with pytest.raises(InputError, match="decompx needs the cross-attention's projections and norm"):
            ex.explain(TEXTS[:1], methods=["decompx"])
        (e,) = Explainer(model, make_tokenizer(), attention="cross").explain(TEXTS[:1], methods=["attnnorm"])
        assert np.abs(e.scores["attnnorm"]).max() > 0  # reading one attention needs no norm
        # the cross-attention block read with the layer's last norm in place of its own: no scores
        register_architecture(dataclasses.replace(old, anatomy=dataclasses.replace(
            old.anatomy, cross_norm="final_layer_norm")))
        with pytest.raises(ModelError, match="anatomy does not describe it"):
            Explainer(model, make_tokenizer()).explain(TEXTS[:1], methods=["decompx"])
    finally:
        register_architecture(old)
