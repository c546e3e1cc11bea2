"""AttnLRP and CP-LRP on encoder-decoders (BART's post-LN layers, mBART's pre-LN ones, T5's RMS-normed blocks with
relative-position biases, T5 v1.1's gated feed-forward).

The whole pass against an explicit rule-by-rule AttnLRP propagation through the encoder, the decoder's causal
self-attention and its cross-attention (float64, no autograd), for a classifier and for a language model's token;
conservation over the encoder's and the decoder's inputs together; padding exactly 0 and a padded batch equal to
its examples alone; the model left unchanged; and, through the Explainer, the scores, the decoder's share in the
meta, a generation's steps, and the methods that read attention relevance refused with one line.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import CLS, PAD, SEP, V, make_tokenizer, randomise_biases_and_norms
from test_lrp import _assert_unchanged, _snapshot
from test_lrp_archs import av_rule, lin, ln_rel, merge, qk_rule, redrawn, softmax_rule, split
from transformers.models.bart.modeling_bart import shift_tokens_right

from attnlens import Explainer
from attnlens.errors import InputError, ModelError
from attnlens.lrp import lrp_pass
from attnlens.models.heads import Head
from attnlens.testing.tiny_models import build_tiny

FAMILIES = ["bart", "mbart", "t5", "t5-gated"]
TEXTS = ["the movie was really good", "bad", "a charming and often affecting journey"]


def seq2seq(family: str, task: str = "classification", *, biases: bool = True, seed: int = 0) -> torch.nn.Module:
    """The tiny encoder-decoder in float64, weight matrices redrawn at std 0.3 (so relevances are not tiny), with
    random biases and norm scales (or no biases); ``"t5-gated"``: T5 v1.1's gated feed-forward."""
    if family == "t5-gated":
        config = transformers.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                                       feed_forward_proj="gated-gelu", pad_token_id=PAD, eos_token_id=SEP,
                                       decoder_start_token_id=PAD, num_labels=3, attn_implementation="eager")
        cls = transformers.T5ForConditionalGeneration if task == "seq2seq-lm" else \
            transformers.T5ForSequenceClassification
        torch.manual_seed(seed)
        model = randomise_biases_and_norms(cls(config), seed)
    else:
        model = randomise_biases_and_norms(build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS,
                                                      eos_token_id=SEP, num_labels=3, seed=seed, task=task), seed)
    return redrawn(model, biases=biases, seed=seed + 7).double().eval()


# ---------------------------------------------------------------- explicit AttnLRP, rule by rule (float64)
def _attention(attn, xq, xkv, allowed, cross_relevance: list):
    """``out_proj(softmax(q kᵀ · scale) v)`` of queries from ``xq``, keys and values from ``xkv``; returns the
    output and its rule: ``R_out -> R_xq`` (``R_xkv`` too for self-attention; for cross-attention it is appended to
    ``cross_relevance``)."""
    h = attn.num_heads
    q, k, v = attn.q_proj(xq), attn.k_proj(xkv), attn.v_proj(xkv)
    qh, kh, vh = split(q, h), split(k, h), split(v, h)
    s = qh @ kh.transpose(-1, -2) * attn.scaling
    a = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    ctx = merge(a @ vh)
    out = attn.out_proj(ctx)

    def rule(r_out):
        r_a, r_v = av_rule(a, vh, split(lin(ctx, attn.out_proj.weight, out, r_out), h))
        r_q, r_k = qk_rule(qh, kh, softmax_rule(s, a, r_a, allowed))  # the scaling: relevance unchanged
        r_kv = lin(xkv, attn.k_proj.weight, k, merge(r_k)) + lin(xkv, attn.v_proj.weight, v, merge(r_v))
        r_q = lin(xq, attn.q_proj.weight, q, merge(r_q))
        if xkv is xq:
            return r_q + r_kv
        cross_relevance.append(r_kv)
        return r_q

    return out, rule


def _ffn(layer, x):
    """``fc2(act(fc1(x)))`` and its rule (the activation: identity rule)."""
    up = layer.fc1(x)
    act = layer.activation_fn(up)
    out = layer.fc2(act)
    return out, lambda r_out: lin(x, layer.fc1.weight, up, lin(act, layer.fc2.weight, out, r_out))


def _residual(x, norm, pre: bool, branch):
    """``x + f(N(x))`` (pre-LN) or ``N(x + f(x))`` (post-LN), ``branch(input) -> (f, rule)``; returns the output
    and its rule ``R_out -> R_x`` (the sum: proportional; the norm: LayerNorm with a constant std)."""
    if pre:
        n = norm(x)
        f, rule = branch(n)
        y = x + f
        return y, lambda r: x * r / y + ln_rel(x, norm, n, rule(f * r / y))
    f, rule = branch(x)
    s = x + f
    y = norm(s)

    def post(r):
        r_s = ln_rel(s, norm, y, r)
        return x * r_s / s + rule(f * r_s / s)

    return y, post


def explicit(model, ids: torch.Tensor, decoder_ids: torch.Tensor, read) -> tuple[torch.Tensor, torch.Tensor]:
    """AttnLRP of one unpadded example by the rules written out: the encoder's and the decoder's input relevance
    (their summed embeddings', per position). ``read(states) -> (scalar, R_states)`` starts the relevance at the
    decoder's output states."""
    if model.config.model_type == "t5":
        return _explicit_t5(model, ids, decoder_ids, read)[:2]
    return _explicit_bart(model, ids, decoder_ids, read)


def _t5_attention(attn, xq, xkv, allowed, bias, out: dict):
    """T5's attention (no scaling) with its relative-position bias added to the scores; its rule appends the
    bias's relevance to ``out["position"]`` and, for cross-attention, the keys' and values' to ``out["cross"]``."""
    h = attn.n_heads
    q, k, v = attn.q(xq), attn.k(xkv), attn.v(xkv)
    qh, kh, vh = split(q, h), split(k, h), split(v, h)
    qk = qh @ kh.transpose(-1, -2) * attn.scaling
    s = qk + bias
    a = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    ctx = merge(a @ vh)
    o = attn.o(ctx)

    def rule(r_out):
        r_a, r_v = av_rule(a, vh, split(lin(ctx, attn.o.weight, o, r_out), h))
        r_s = softmax_rule(s, a, r_a, allowed)
        out["position"].append((bias * r_s / s).sum())  # the sum: proportional
        r_q, r_k = qk_rule(qh, kh, qk * r_s / s)
        r_kv = lin(xkv, attn.k.weight, k, merge(r_k)) + lin(xkv, attn.v.weight, v, merge(r_v))
        r_q = lin(xq, attn.q.weight, q, merge(r_q))
        if xkv is xq:
            return r_q + r_kv
        out["cross"].append(r_kv)
        return r_q

    return o, rule


def _t5_ffn(ffn, x):
    """T5's feed-forward, plain ``wo(act(wi x))`` or gated ``wo(act(wi_0 x) * wi_1 x)`` (uniform on the product),
    and its rule (the activation: identity)."""
    if hasattr(ffn, "wi"):
        up = ffn.wi(x)
        act = ffn.act(up)
        out = ffn.wo(act)
        return out, lambda r: lin(x, ffn.wi.weight, up, lin(act, ffn.wo.weight, out, r))
    gate, up = ffn.wi_0(x), ffn.wi_1(x)
    act = ffn.act(gate)
    prod = act * up
    out = ffn.wo(prod)

    def rule(r):
        r_prod = lin(prod, ffn.wo.weight, out, r)
        return lin(x, ffn.wi_0.weight, gate, 0.5 * r_prod) + lin(x, ffn.wi_1.weight, up, 0.5 * r_prod)

    return out, rule


def _rms(norm, x):
    """T5's RMS norm in float64 (the stock module computes its statistics in float32)."""
    return norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)


def _pre_rms(x, norm, branch):
    """``x + f(N(x))`` with an RMS norm (root mean square constant: relevance passes element-wise unchanged)."""
    f, rule = branch(_rms(norm, x))
    y = x + f
    return y, lambda r: x * r / y + rule(f * r / y)


def _explicit_t5(model, ids, decoder_ids, read):
    """T5: pre-RMS-norm blocks, relative-position biases (computed by the first block of each stack and shared),
    no absolute positions; also returns the relevance the biases take."""
    base = getattr(model, "transformer", model)
    enc, dec = base.encoder, base.decoder
    n, m = len(ids), len(decoder_ids)
    out = {"position": [], "cross": []}
    x0 = enc.embed_tokens(ids)
    h, rules = x0, []
    bias = enc.block[0].layer[0].SelfAttention.compute_bias(n, n)[0]
    for block in enc.block:
        attn = block.layer[0]
        h, r1 = _pre_rms(h, attn.layer_norm, lambda x, attn=attn: _t5_attention(
            attn.SelfAttention, x, x, torch.ones(n, n, dtype=torch.bool), bias, out))
        h, r2 = _pre_rms(h, block.layer[1].layer_norm, lambda x, ff=block.layer[1]: _t5_ffn(ff.DenseReluDense, x))
        rules += [r1, r2]
    memory = _rms(enc.final_layer_norm, h)
    y0 = dec.embed_tokens(decoder_ids)
    g, dec_rules = y0, []
    self_bias = dec.block[0].layer[0].SelfAttention.compute_bias(m, m)[0]
    causal = torch.ones(m, m, dtype=torch.bool).tril()
    for block in dec.block:
        attn, cross = block.layer[0], block.layer[1]
        g, r1 = _pre_rms(g, attn.layer_norm, lambda x, attn=attn: _t5_attention(
            attn.SelfAttention, x, x, causal, self_bias, out))
        g, r2 = _pre_rms(g, cross.layer_norm, lambda x, cross=cross: _t5_attention(
            cross.EncDecAttention, x, memory, torch.ones(m, n, dtype=torch.bool), torch.zeros(1, m, n), out))
        g, r3 = _pre_rms(g, block.layer[2].layer_norm, lambda x, ff=block.layer[2]: _t5_ffn(ff.DenseReluDense, x))
        dec_rules += [r1, r2, r3]
    _, r = read(_rms(dec.final_layer_norm, g))  # the final norm: relevance unchanged
    for rule in reversed(dec_rules):
        r = rule(r)
    r_mem = sum(out["cross"])
    for rule in reversed(rules):
        r_mem = rule(r_mem)
    return r_mem.sum(-1), r.sum(-1), sum(out["position"])


def _explicit_bart(model, ids: torch.Tensor, decoder_ids: torch.Tensor, read) -> tuple[torch.Tensor, torch.Tensor]:
    """BART (post-LN) and mBART (pre-LN, a final norm on each stack)."""
    base = model.model
    pre = model.config.model_type == "mbart"
    enc, dec = base.encoder, base.decoder
    n, m = len(ids), len(decoder_ids)
    x0 = enc.embed_tokens(ids) + enc.embed_positions(ids[None])[0]
    h = enc.layernorm_embedding(x0)
    rules = []
    for layer in enc.layers:
        h, r1 = _residual(h, layer.self_attn_layer_norm, pre,
                          lambda x, layer=layer: _attention(layer.self_attn, x, x, torch.ones(n, n, dtype=torch.bool),
                                                            []))
        h, r2 = _residual(h, layer.final_layer_norm, pre, lambda x, layer=layer: _ffn(layer, x))
        rules += [r1, r2]
    memory = h
    if pre:
        memory = enc.layer_norm(h)
    y0 = dec.embed_tokens(decoder_ids) + dec.embed_positions(decoder_ids[None])[0]
    g = dec.layernorm_embedding(y0)
    crossed: list[torch.Tensor] = []
    causal = torch.ones(m, m, dtype=torch.bool).tril()
    dec_rules = []
    for layer in dec.layers:
        g, r1 = _residual(g, layer.self_attn_layer_norm, pre,
                          lambda x, layer=layer: _attention(layer.self_attn, x, x, causal, []))
        g, r2 = _residual(g, layer.encoder_attn_layer_norm, pre,
                          lambda x, layer=layer: _attention(layer.encoder_attn, x, memory,
                                                            torch.ones(m, n, dtype=torch.bool), crossed))
        g, r3 = _residual(g, layer.final_layer_norm, pre, lambda x, layer=layer: _ffn(layer, x))
        dec_rules += [r1, r2, r3]
    out = dec.layer_norm(g) if pre else g
    _, r = read(out)
    if pre:
        r = ln_rel(g, dec.layer_norm, out, r)
    for rule in reversed(dec_rules):
        r = rule(r)
    r_y0 = ln_rel(y0, dec.layernorm_embedding, dec.layernorm_embedding(y0), r)
    r_mem = sum(crossed)
    if pre:
        r_mem = ln_rel(h, enc.layer_norm, memory, r_mem)
    for rule in reversed(rules):
        r_mem = rule(r_mem)
    r_x0 = ln_rel(x0, enc.layernorm_embedding, enc.layernorm_embedding(x0), r_mem)
    return r_x0.sum(-1), r_y0.sum(-1)


def classifier_reader(model, ids: torch.Tensor, target: int):
    """The classification head at the last EOS (dense, tanh: identity rule, out_proj), relevance = the logit."""
    head = model.classification_head
    pos = int(torch.nonzero(ids == model.config.eos_token_id).flatten()[-1])

    def read(states):
        pre = head.dense(states[pos])
        post = torch.tanh(pre)
        logits = head.out_proj(post)
        r_logits = torch.zeros_like(logits)
        r_logits[target] = logits[target]
        r = torch.zeros_like(states)
        r[pos] = lin(states[pos], head.dense.weight, pre, lin(post, head.out_proj.weight, logits, r_logits))
        return logits[target], r

    return read


def token_reader(model, position: int, token: int):
    """A language model's logit of ``token`` at decoder position ``position`` (lm_head + final_logits_bias)."""

    def read(states):
        if model.config.model_type == "t5":  # T5 scales the states by 1/sqrt(d) before its tied head: linear
            logits = model.lm_head(states[position] * model.model_dim ** -0.5)
            r_logits = torch.zeros_like(logits)
            r_logits[token] = logits[token]
            r = torch.zeros_like(states)
            r[position] = lin(states[position], model.lm_head.weight * model.model_dim ** -0.5, logits, r_logits)
            return logits[token], r
        logits = model.lm_head(states[position]) + model.final_logits_bias[0]
        r_logits = torch.zeros_like(logits)
        r_logits[token] = logits[token]
        r = torch.zeros_like(states)
        r[position] = lin(states[position], model.lm_head.weight, logits, r_logits)
        return logits[token], r

    return read


def _decoder_ids(model, ids: torch.Tensor) -> torch.Tensor:
    start = model.config.decoder_start_token_id
    return shift_tokens_right(ids[None], PAD, PAD if start is None else start)[0]


IDS = torch.tensor([CLS, 7, 13, 21, 5, 9, SEP])


@pytest.mark.parametrize("family", FAMILIES)
def test_classifier_pass_equals_explicit_rule_by_rule_propagation(family):
    model = seq2seq(family)
    with torch.no_grad():
        enc, dec = explicit(model, IDS, _decoder_ids(model, IDS), classifier_reader(model, IDS, 1))
    res = lrp_pass(model, {"input_ids": IDS[None], "attention_mask": torch.ones(1, len(IDS), dtype=torch.long)}, 1)
    torch.testing.assert_close(res.input_relevance[0], enc, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(res.decoder_relevance[0], dec, rtol=1e-8, atol=1e-10)
    assert enc.abs().max() > 1e-2 and dec.abs().max() > 1e-2  # both sides take relevance
    if model.config.model_type == "t5":  # the relative-position biases' share
        with torch.no_grad():
            position = _explicit_t5(model, IDS, _decoder_ids(model, IDS), classifier_reader(model, IDS, 1))[2]
        torch.testing.assert_close(res.position_relevance[0], position, rtol=1e-8, atol=1e-10)
        assert abs(float(position)) > 1e-4


class DecoderTokenHead(Head):
    """A seq2seq LM's logit of token ``t`` at decoder position ``p`` (targets ``(B, 2)`` rows ``(p, t)``)."""

    task = "seq2seq-lm"

    def scalar(self, logits, targets, kind, token_mask):
        return logits[torch.arange(logits.shape[0]), targets[:, 0], targets[:, 1]]


@pytest.mark.parametrize("family", FAMILIES)
def test_language_model_token_equals_explicit_rule_by_rule_propagation(family):
    model = seq2seq(family, "seq2seq-lm")
    decoder_ids = torch.tensor([model.config.decoder_start_token_id, 11, 17, 4])
    inputs = {"input_ids": IDS[None], "attention_mask": torch.ones(1, len(IDS), dtype=torch.long),
              "decoder_input_ids": decoder_ids[None]}
    res = lrp_pass(model, inputs, torch.tensor([[2, 19]]), head=DecoderTokenHead(), logit_mask=torch.ones(1, 4))
    with torch.no_grad():
        enc, dec = explicit(model, IDS, decoder_ids, token_reader(model, 2, 19))
    torch.testing.assert_close(res.input_relevance[0], enc, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(res.decoder_relevance[0], dec, rtol=1e-8, atol=1e-10)
    assert (dec[3:] == 0).all() and dec[:3].abs().min() > 0  # a causal decoder: nothing after the position


@pytest.mark.parametrize("family", FAMILIES)
def test_relevance_is_conserved_over_the_encoder_and_decoder_inputs(family):
    # Bias-free, epsilon = 0: CP-LRP conserves exactly; AttnLRP up to what the softmaxes absorb and, in T5, what
    # its relative-position biases take (parameters, like biases).
    model = seq2seq(family, biases=False)
    inputs = _padded(model)
    with torch.no_grad():
        targets = model(**inputs).logits.abs().argmax(1)  # logits far from 0, so the check is not vacuous
    cp = lrp_pass(model, inputs, targets, rules="cp")
    torch.testing.assert_close(cp.input_relevance.sum(1) + cp.decoder_relevance.sum(1), cp.target, rtol=1e-8,
                               atol=1e-10)
    assert cp.target.abs().min() > 1e-2
    res = lrp_pass(model, inputs, targets, track_softmax=True)
    total = res.input_relevance.sum(1) + res.decoder_relevance.sum(1) + res.softmax_absorbed + res.position_relevance
    torch.testing.assert_close(total, res.target, rtol=1e-8, atol=1e-10)
    assert res.softmax_absorbed.abs().max() > 1e-3
    assert (res.position_relevance.abs().max() > 1e-4) == family.startswith("t5")


def _padded(model) -> dict[str, torch.Tensor]:
    """Three examples of different lengths, each ending in EOS, right-padded."""
    rows = [[CLS, 7, 13, 21, 5, 9, SEP], [CLS, 12, SEP], [CLS, 30, 8, 14, SEP]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    return {"input_ids": ids, "attention_mask": (ids != PAD).long()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rule_set", ["attnlrp", "cp"])
def test_padding_is_exactly_zero_and_a_batch_equals_its_examples_alone(family, rule_set):
    model = seq2seq(family)
    inputs = _padded(model)
    res = lrp_pass(model, inputs, [1, 2, 0], rules=rule_set)
    pad = inputs["attention_mask"] == 0
    assert (res.input_relevance[pad] == 0).all() and (res.word_relevance[pad] == 0).all()
    for b in range(3):
        n = int(inputs["attention_mask"][b].sum())
        one = lrp_pass(model, {k: v[b: b + 1, :n] for k, v in inputs.items()}, [1, 2, 0][b], rules=rule_set)
        torch.testing.assert_close(res.input_relevance[b, :n], one.input_relevance[0], rtol=1e-9, atol=1e-12)
        # the decoder reads the input shifted right: its real positions are the first n
        torch.testing.assert_close(res.decoder_relevance[b, :n], one.decoder_relevance[0], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_model_left_unchanged_and_the_forward_values_kept(family):
    model = seq2seq(family)
    before = _snapshot(model)
    inputs = _padded(model)
    res = lrp_pass(model, inputs, 1)
    _assert_unchanged(model, before)
    # T5's stock norm computes its statistics in float32 (the pass keeps float64)
    tol = dict(rtol=1e-5, atol=1e-6) if family.startswith("t5") else dict(rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(res.logits, model(**inputs).logits, **tol)


# ---------------------------------------------------------------- through the Explainer
@pytest.mark.parametrize("family", FAMILIES)
def test_explainer_scores_are_the_encoder_inputs_and_the_decoder_share_is_reported(family):
    model = seq2seq(family)
    tok = make_tokenizer()
    (exp,) = Explainer(model, tok).explain(TEXTS[:1], methods=["attnlrp"], target=2)
    enc = tok(TEXTS[:1], return_tensors="pt")
    ref = lrp_pass(model, dict(enc), 2)
    assert exp.tokens == tok.convert_ids_to_tokens(enc["input_ids"][0])
    torch.testing.assert_close(torch.as_tensor(exp.scores["attnlrp"]), ref.input_relevance[0], rtol=1e-9, atol=1e-12)
    assert exp.meta["attnlrp"]["decoder_inputs"] == pytest.approx(float(ref.decoder_relevance.sum()), rel=1e-9)


def test_methods_reading_attention_relevance_are_refused_on_encoder_decoders():
    ex = Explainer(seq2seq("bart"), make_tokenizer())
    for name in ("partiallrp", "transatt"):
        with pytest.raises(InputError, match="one self-attention stream.*use attnlrp"):
            ex.explain(TEXTS[:1], methods=[name])
    with pytest.warns(UserWarning, match="partiallrp"):
        (exp,) = ex.explain(TEXTS[:1], methods="all")
    assert "attnlrp" in exp.scores and "partiallrp" not in exp.scores and "transatt" not in exp.scores


@pytest.mark.parametrize("family", FAMILIES)
def test_each_generated_token_equals_its_own_pass(family):
    model = seq2seq(family, "seq2seq-lm")
    gen = Explainer(model, make_tokenizer()).explain_generation(TEXTS[0], max_new_tokens=3, methods=["attnlrp"])
    ids = torch.tensor(gen.prompt_ids)
    start = model.config.decoder_start_token_id
    for t, token in enumerate(gen.generated_ids):
        decoder_ids = torch.tensor([start, *gen.generated_ids[:t]])
        with torch.no_grad():
            enc, dec = explicit(model, ids, decoder_ids, token_reader(model, t, token))
        torch.testing.assert_close(torch.as_tensor(gen.scores["attnlrp"][t][: len(ids)]), enc, rtol=1e-7,
                                   atol=1e-9)
        assert gen.meta["attnlrp"]["decoder_inputs"][t] == pytest.approx(float(dec.sum()), rel=1e-7, abs=1e-9)
    assert (gen.scores["attnlrp"][:, len(ids):] == 0).all()  # the generated columns: the encoder never reads them


@pytest.mark.parametrize("family", FAMILIES)
def test_a_generation_explained_on_the_cross_stream_by_attnlrp_alone_is_the_encoders(family):
    """Alone, AttnLRP's pass serves the batch without attention maps: the decoder's length is read from its other
    outputs, and the scores are the encoder's, as on the encoder stream."""
    model = seq2seq(family, "seq2seq-lm")
    encoder = Explainer(model, make_tokenizer()).explain_generation(TEXTS[0], max_new_tokens=3, methods=["attnlrp"])
    cross = Explainer(model, make_tokenizer(), attention="cross").explain_generation(
        TEXTS[0], max_new_tokens=3, methods=["attnlrp"])
    torch.testing.assert_close(torch.as_tensor(cross.scores["attnlrp"]), torch.as_tensor(encoder.scores["attnlrp"]))


def _qa_model(family: str) -> torch.nn.Module:
    """A bias-free extractive QA encoder-decoder in float64 (the span head's bias zeroed too)."""
    torch.manual_seed(0)
    if family == "bart":
        config = transformers.BartConfig(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
                                         decoder_ffn_dim=24, max_position_embeddings=64, pad_token_id=PAD,
                                         bos_token_id=CLS, eos_token_id=SEP, decoder_start_token_id=SEP)
        model = transformers.BartForQuestionAnswering(config)
    else:
        config = transformers.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                                       pad_token_id=PAD, eos_token_id=SEP, decoder_start_token_id=PAD)
        model = transformers.T5ForQuestionAnswering(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 if p.dim() >= 2 else
                    torch.zeros_like(p) if name.endswith("bias") else 1 + 0.3 * torch.randn(p.shape, generator=g))
    return model.double().eval()


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_question_answering_span_relevance_is_conserved(family):
    # CP-LRP, bias-free: the encoder tokens' scores and the decoder inputs' share add up to the span's start logit
    # at its start plus its end logit at its end, which the pass explains
    model = _qa_model(family)
    (exp,) = Explainer(model, make_tokenizer()).explain([("what movie", "the movie was really good")],
                                                        methods=["attnlrp"], options={"attnlrp": {"rules": "cp"}})
    start, end = exp.target
    with torch.no_grad():
        out = model(input_ids=torch.tensor([exp.input_ids]))
    logit = float(out.start_logits[0, start] + out.end_logits[0, end])
    total = float(sum(exp.scores["attnlrp"])) + exp.meta["attnlrp"]["decoder_inputs"]
    assert total == pytest.approx(logit, rel=1e-6, abs=1e-8) and abs(logit) > 1e-2


def test_an_encoder_only_class_of_an_encoder_decoder_type_is_refused_in_one_line():
    config = transformers.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2,
                                   pad_token_id=PAD, eos_token_id=SEP, decoder_start_token_id=PAD, num_labels=3)
    with pytest.raises(ModelError, match="runs only the encoder of a t5 model"):
        Explainer(transformers.T5ForTokenClassification(config), make_tokenizer())
