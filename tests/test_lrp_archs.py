"""LRP beyond BERT-style encoders: DeBERTa-v2, ModernBERT, MPNet, XLM-RoBERTa-XL, GPT-2, GPT-Neo, GPT-J, GPT-NeoX,
Phi and the Llama family (Llama, Mistral, Qwen2, Qwen3, Gemma).

Each architecture: the whole pass against an explicit rule-by-rule AttnLRP propagation of a 1-layer model
(float64, no autograd), conservation, padding exactly 0, batch vs one by one, the model unchanged afterwards,
and (decoders) an explained scalar given by a task head other than the classifier's (a causal LM token logit,
as generation explains).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import make_model, make_tokenizer, randomise_biases_and_norms
from test_lrp import _assert_unchanged, _snapshot, assert_padding_zero_and_batch_invariant, padded_batch
from torch import nn

from attnlens import Explainer
from attnlens.errors import InputError
from attnlens.lrp import lrp_pass, lrp_passes, supports
from attnlens.models.heads import Head

ARCHS = ["deberta", "deberta-v2", "modernbert", "mpnet", "xlm-roberta-xl", "gpt2", "llama", "mistral", "qwen2", "qwen3",
         "gemma", "gpt_neox", "phi", "gpt_neo", "gptj", "gemma2", "opt", "bloom", "falcon", "phi3", "mixtral"]
RULE_SETS = ["attnlrp", "cp", "chefer", "chefer-lrp"]


def strong(family: str, *, biases: bool = True, seed: int = 0) -> nn.Module:
    """The tiny model with weight matrices redrawn at std 0.3 (the recipes of some types keep HF's 0.02, which
    leaves logits near 0 and every relevance tiny), optionally without biases."""
    return redrawn(make_model(family, num_labels=3, seed=seed), biases=biases, seed=seed)


def redrawn(model: nn.Module, *, biases: bool = True, seed: int = 0) -> nn.Module:
    """``model`` with its weight matrices redrawn at std 0.3, optionally without biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("bias") and not biases:
                p.zero_()
    return model


# ---------------------------------------------------------------- explicit AttnLRP, rule by rule (float64)
def lin(x, weight, z, r):
    """epsilon = 0 rule of ``z = x W^T (+ b)``: ``R_x = x * ((R_z / z) W)``."""
    return x * ((r / z) @ weight)


def ln_rel(x, ln, y, r):
    """LayerNorm with a constant std: ``y = M x (+ beta)``, ``M = diag(gamma) (I - 1/D) / std``."""
    d = x.shape[-1]
    eps = ln.eps if hasattr(ln, "eps") else ln.variance_epsilon  # DeBERTa's LayerNorm class names it so
    std = (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    m = ln.weight[None, :, None] * (torch.eye(d, dtype=x.dtype) - 1.0 / d)[None] / std[:, :, None]
    return x * torch.einsum("nji,nj->ni", m, r / y)


def split(t, n_heads):  # (N, H*d) -> (H, N, d)
    return t.view(t.shape[0], n_heads, -1).transpose(0, 1)


def merge(t):  # (H, N, d) -> (N, H*d)
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def softmax_rule(s, a, r_a, allowed):
    """AttnLRP's softmax rule ``R_s = s (R_a - a sum R_a)`` on the allowed (unmasked) entries."""
    return torch.where(allowed, s * (r_a - a * r_a.sum(-1, keepdim=True)), torch.zeros_like(s))


def av_rule(a, v, r_ctx):
    """Uniform rule on ``ctx = A V``: half of each product term's relevance to ``A``, half to ``V``."""
    ctx = a @ v
    r_a = 0.5 * torch.einsum("hqk,hkd,hqd->hqk", a, v, r_ctx / ctx)
    r_v = 0.5 * torch.einsum("hqk,hkd,hqd->hkd", a, v, r_ctx / ctx)
    return r_a, r_v


def qk_rule(q, k, r_prod):
    """Uniform rule on ``P = Q K^T`` given the relevance ``r_prod`` of each entry of P."""
    prod = q @ k.transpose(-1, -2)
    r_q = 0.5 * torch.einsum("hqd,hkd,hqk->hqd", q, k, r_prod / prod)
    r_k = 0.5 * torch.einsum("hqd,hkd,hqk->hkd", q, k, r_prod / prod)
    return r_q, r_k


def rotation(cos, sin):
    """Per-position matrices ``M_i`` of the rotary map ``x cos + rotate_half(x) sin`` (``(N, d, d)``)."""
    d = cos.shape[-1]
    half = torch.zeros(d, d, dtype=cos.dtype)  # rotate_half(x) = x @ half.T: [-x2, x1]
    half[: d // 2, d // 2 :] = -torch.eye(d // 2)
    half[d // 2 :, : d // 2] = torch.eye(d // 2)
    return torch.diag_embed(cos) + torch.diag_embed(sin) @ half


def rope_rel(x, m, r_y):
    """epsilon = 0 rule of the rotation ``y_i = M_i x_i`` (per head ``(H, N, d)``)."""
    y = torch.einsum("nij,hnj->hni", m, x)
    return x * torch.einsum("nij,hni->hnj", m, r_y / y)


def causal_attention_rel(q, k, v, scale, r_ctx, allowed=None):
    """Explicit AttnLRP through causal attention (or the ``(N, N)`` ``allowed`` entries); returns
    ``(R_q, R_k, R_v, R_A, A)``."""
    n = q.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril() if allowed is None else allowed
    s = (q @ k.transpose(-1, -2)) * scale
    a = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    r_a, r_v = av_rule(a, v, r_ctx)
    r_q, r_k = qk_rule(q, k, softmax_rule(s, a, r_a, allowed))  # scaling: linear, relevance unchanged
    return r_q, r_k, r_v, r_a, a


def capped_attention_rel(q, k, v, scale, r_ctx, cap):
    """:func:`causal_attention_rel` with the scores capped, ``c tanh(s / c)`` (``cap`` ``None``: not capped):
    the softmax rule on the capped scores, the identity rule through the cap."""
    if not cap:
        return causal_attention_rel(q, k, v, scale, r_ctx)
    n = q.shape[1]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    s = torch.tanh(q @ k.transpose(-1, -2) * scale / cap) * cap
    a = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    r_a, r_v = av_rule(a, v, r_ctx)
    r_q, r_k = qk_rule(q, k, softmax_rule(s, a, r_a, allowed))  # cap and scaling: identity
    return r_q, r_k, r_v, r_a, a


def _moe_forward(moe, x):
    """Mixtral's mixture of experts, token by token: ``m_t = sum_j w_tj E_e(x_t)`` over the top-k experts ``e``
    of the router's probabilities, ``w_t`` their renormalised probabilities (= a softmax over the selected
    logits), ``E_e(x) = down_e(silu(gate_e x) * up_e x)``. Returns ``m`` and its explicit AttnLRP: the sum over
    experts proportional, the uniform rule on ``w * E`` and on the gating product, the softmax rule on ``w``."""
    router, experts = moe.gate, moe.experts
    logits = x @ router.weight.T
    top = logits.softmax(-1).topk(router.top_k, -1).indices
    sel = logits.gather(-1, top)
    w = sel.softmax(-1)
    m, parts = torch.zeros_like(x), []
    for t in range(x.shape[0]):
        for j, e in enumerate(top[t].tolist()):
            gu = experts.gate_up_proj[e] @ x[t]
            gate, up = gu.chunk(2)
            p = experts.act_fn(gate) * up
            y = experts.down_proj[e] @ p
            m[t] += w[t, j] * y
            parts.append((t, j, e, gu, p, y))

    def relevance(r_m):
        r_x, r_w = torch.zeros_like(x), torch.zeros_like(w)
        for t, j, e, gu, p, y in parts:
            r_wy = w[t, j] * y / m[t] * r_m[t]  # the sum over experts: proportional
            r_y, r_w[t, j] = r_wy / 2, r_wy.sum() / 2  # uniform rule on w * E
            r_p = p * ((r_y / y) @ experts.down_proj[e])
            r_x[t] += x[t] * ((torch.cat([r_p / 2, r_p / 2]) / gu) @ experts.gate_up_proj[e])  # SiLU: identity
        r_sel = sel * (r_w - w * r_w.sum(-1, keepdim=True))  # softmax rule
        r_logits = torch.zeros_like(logits).scatter(-1, top, r_sel)
        return r_x + x * ((r_logits / logits) @ router.weight)

    return m, relevance


def _explicit_llama(model, ids, target):
    """Llama, Mistral, Qwen2; Qwen3 (an RMSNorm on each head's query and key before the rotation); Gemma
    (embeddings times √d, RMSNorms scaling by 1 + γ computed in float32, a GELU gate); Gemma 2 (Gemma's, plus
    a norm on each branch's output before its residual sum and capped attention scores ``c tanh(s / c)``,
    identity rule); Phi-3 (query/key/value from one fused projection, gate and up from another); Mixtral (each
    token's top-k experts, :func:`_moe_forward`)."""
    base, layer = model.model, model.model.layers[0]
    sa, mlp, cfg = layer.self_attn, layer.mlp, model.config
    n, h, kv = ids.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads
    gemma2 = cfg.model_type == "gemma2"
    gemma = cfg.model_type == "gemma" or gemma2
    cap = cfg.attn_logit_softcapping if gemma2 else None
    phi3 = cfg.model_type == "phi3"
    moe = cfg.model_type == "mixtral"

    def rms(x, norm):
        if gemma:  # (1 + γ) in float32, as GemmaRMSNorm computes it
            return (1 + norm.weight.float()).double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
        return norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)

    x0 = base.embed_tokens.weight[ids] * (cfg.hidden_size ** 0.5 if gemma else 1.0)
    n1 = rms(x0, layer.input_layernorm)
    if phi3:  # each query head, then the key heads, then the value heads
        qkv = sa.qkv_proj(n1)
        q, k, v = qkv.split([h * sa.head_dim, kv * sa.head_dim, kv * sa.head_dim], -1)
    else:
        q, k, v = sa.q_proj(n1), sa.k_proj(n1), sa.v_proj(n1)
    cos, sin = base.rotary_emb(x0, torch.arange(n)[None])
    rot = rotation(cos[0], sin[0])
    qh, kh, vh = split(q, h), split(k, kv), split(v, kv)
    if hasattr(sa, "q_norm"):  # Qwen3: the norms are element-wise linear maps (identity rule): relevance unchanged
        qh, kh = rms(qh, sa.q_norm), rms(kh, sa.k_norm)
    qr, kr = torch.einsum("nij,hnj->hni", rot, qh), torch.einsum("nij,hnj->hni", rot, kh)
    rep = h // kv
    kr2, vh2 = kr.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0)  # grouped-query: heads share K, V
    s = qr @ kr2.transpose(-1, -2) * sa.scaling
    s = torch.tanh(s / cap) * cap if cap else s
    ctx = merge(s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1) @ vh2)
    o = sa.o_proj(ctx)
    o_res = rms(o, layer.post_attention_layernorm) if gemma2 else o  # what the residual sum adds
    h1 = x0 + o_res
    n2 = rms(h1, layer.pre_feedforward_layernorm if gemma2 else layer.post_attention_layernorm)
    if moe:
        m, moe_rel = _moe_forward(mlp, n2)
    elif phi3:
        gate_up = mlp.gate_up_proj(n2)
        gate, up = gate_up.chunk(2, -1)
        p = mlp.activation_fn(gate) * up
    else:
        gate, up = mlp.gate_proj(n2), mlp.up_proj(n2)
        p = mlp.act_fn(gate) * up
    if not moe:
        m = mlp.down_proj(p)
    m_res = rms(m, layer.post_feedforward_layernorm) if gemma2 else m
    h2 = h1 + m_res
    nf = rms(h2, base.norm)
    logits = model.score(nf)
    r_logits = torch.zeros_like(logits)
    r_logits[n - 1, target] = logits[n - 1, target]
    r_h2 = lin(nf, model.score.weight, logits, r_logits)  # RMSNorm: identity (element-wise linear map)
    r_m, r_h1 = m_res * r_h2 / h2, h1 * r_h2 / h2  # Gemma 2's branch norms: identity
    if moe:
        r_h1 = r_h1 + moe_rel(r_m)
    else:
        r_p = lin(p, mlp.down_proj.weight, m, r_m)
        r_gate = r_up = r_p / 2  # uniform rule on the gating product; SiLU: identity
        if phi3:
            r_h1 = r_h1 + lin(n2, mlp.gate_up_proj.weight, gate_up, torch.cat([r_gate, r_up], -1))
        else:
            r_h1 = r_h1 + lin(n2, mlp.gate_proj.weight, gate, r_gate) + lin(n2, mlp.up_proj.weight, up, r_up)
    r_o, r_x0 = o_res * r_h1 / h1, x0 * r_h1 / h1
    r_ctx = split(lin(ctx, sa.o_proj.weight, o, r_o), h)
    r_q, r_k, r_v, r_a, _ = capped_attention_rel(qr, kr2, vh2, sa.scaling, r_ctx, cap)
    r_k = r_k.view(kv, rep, n, -1).sum(1)  # the repeated key/value heads collect their groups' relevance
    r_v = r_v.view(kv, rep, n, -1).sum(1)
    r_qh, r_kh = rope_rel(qh, rot, r_q), rope_rel(kh, rot, r_k)
    if phi3:  # input RMSNorm: identity
        return (r_x0 + lin(n1, sa.qkv_proj.weight, qkv, torch.cat([merge(r_qh), merge(r_kh), merge(r_v)], -1))
                ).sum(-1), r_a
    r_x0 = (r_x0 + lin(n1, sa.q_proj.weight, q, merge(r_qh)) + lin(n1, sa.k_proj.weight, k, merge(r_kh))
            + lin(n1, sa.v_proj.weight, v, merge(r_v)))  # input RMSNorm: identity
    return r_x0.sum(-1), r_a


def _explicit_gpt2(model, ids, target, types=None, parts=False):
    """``types``: token types, looked up in the word table too (as GPT-2 does); ``parts``: return the relevance
    of the word lookup alone and of the types' lookup, each its share ``x · R_x0 / x0`` of the sum's."""
    tr, blk = model.transformer, model.transformer.h[0]
    n, h = ids.shape[0], model.config.n_head
    x0 = tr.wte.weight[ids] + tr.wpe.weight[:n] + (0 if types is None else tr.wte.weight[types])
    n1 = blk.ln_1(x0)
    qkv = blk.attn.c_attn(n1)
    q, k, v = (split(t, h) for t in qkv.split(model.config.n_embd, dim=-1))
    scale = (q.shape[-1]) ** -0.5
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    a = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf")).softmax(-1)
    ctx = merge(a @ v)
    o = blk.attn.c_proj(ctx)
    h1 = x0 + o
    n2 = blk.ln_2(h1)
    fc = blk.mlp.c_fc(n2)
    act = blk.mlp.act(fc)
    m = blk.mlp.c_proj(act)
    h2 = h1 + m
    nf = tr.ln_f(h2)
    logits = model.score(nf)
    r_logits = torch.zeros_like(logits)
    r_logits[n - 1, target] = logits[n - 1, target]
    r_nf = lin(nf, model.score.weight, logits, r_logits)
    r_h2 = ln_rel(h2, tr.ln_f, nf, r_nf)
    r_m, r_h1 = m * r_h2 / h2, h1 * r_h2 / h2
    r_act = lin(act, blk.mlp.c_proj.weight.T, m, r_m)  # Conv1D stores W^T; tanh-GELU: identity
    r_h1 = r_h1 + ln_rel(h1, blk.ln_2, n2, lin(n2, blk.mlp.c_fc.weight.T, fc, r_act))
    r_o, r_x0 = o * r_h1 / h1, x0 * r_h1 / h1
    r_ctx = split(lin(ctx, blk.attn.c_proj.weight.T, o, r_o), h)
    r_q, r_k, r_v, r_a, _ = causal_attention_rel(q, k, v, scale, r_ctx)
    r_qkv = torch.cat([merge(r_q), merge(r_k), merge(r_v)], -1)
    r_x0 = r_x0 + ln_rel(x0, blk.ln_1, n1, lin(n1, blk.attn.c_attn.weight.T, qkv, r_qkv))
    if parts:
        share = r_x0 / x0
        return (tr.wte.weight[ids] * share).sum(-1), (tr.wte.weight[types] * share).sum(-1)
    return r_x0.sum(-1), r_a


def _prenorm_tail(x, o, ln2, fc_in, act, fc_out, final, score, target):
    """The rest of a 1-layer sequential pre-LN model after its attention output ``o`` on input ``x``:
    ``h1 = x + o``, ``h2 = h1 + fc_out(act(fc_in(LN2(h1))))``, logits ``score(final(h2))``; explicit AttnLRP from
    the target logit at the last position back to ``(R_o, R_x)`` (activation: identity rule)."""
    h1 = x + o
    n2 = ln2(h1)
    fc = fc_in(n2)
    a = act(fc)
    m = fc_out(a)
    h2 = h1 + m
    nf = final(h2)
    logits = score(nf)
    r_logits = torch.zeros_like(logits)
    r_logits[-1, target] = logits[-1, target]
    r_h2 = ln_rel(h2, final, nf, lin(nf, score.weight, logits, r_logits))
    r_m, r_h1 = m * r_h2 / h2, h1 * r_h2 / h2
    r_h1 = r_h1 + ln_rel(h1, ln2, n2, lin(n2, fc_in.weight, fc, lin(a, fc_out.weight, m, r_m)))
    return o * r_h1 / h1, x * r_h1 / h1


def _explicit_gpt_neo(model, ids, target):
    """GPT-Neo: GPT-2's block with separate query/key/value projections, no ``1 / sqrt(d)`` scaling, and a local
    layer's window (``window_size`` keys up to the query)."""
    tr, blk = model.transformer, model.transformer.h[0]
    sa, mlp = blk.attn.attention, blk.mlp
    n, h = ids.shape[0], model.config.num_heads
    i = torch.arange(n)
    allowed = (i[None] <= i[:, None]) & (i[None] > i[:, None] - model.config.window_size)
    x0 = tr.wte.weight[ids] + tr.wpe.weight[:n]
    n1 = blk.ln_1(x0)
    q, k, v = sa.q_proj(n1), sa.k_proj(n1), sa.v_proj(n1)
    a = (split(q, h) @ split(k, h).transpose(-1, -2)).masked_fill(~allowed, float("-inf")).softmax(-1)
    ctx = merge(a @ split(v, h))
    o = sa.out_proj(ctx)
    r_o, r_x0 = _prenorm_tail(x0, o, blk.ln_2, mlp.c_fc, mlp.act, mlp.c_proj, tr.ln_f, model.score, target)
    r_ctx = split(lin(ctx, sa.out_proj.weight, o, r_o), h)
    r_q, r_k, r_v, r_a, _ = causal_attention_rel(split(q, h), split(k, h), split(v, h), 1.0, r_ctx, allowed)
    r_n1 = (lin(n1, sa.q_proj.weight, q, merge(r_q)) + lin(n1, sa.k_proj.weight, k, merge(r_k))
            + lin(n1, sa.v_proj.weight, v, merge(r_v)))
    return (r_x0 + ln_rel(x0, blk.ln_1, n1, r_n1)).sum(-1), r_a


def _opt_input(model, ids):
    """A 1-layer OPT's decoder, layer, attention, length, heads, input (word + learned positions, offset 2) and
    first LayerNorm's output."""
    dec = model.model.decoder
    layer = dec.layers[0]
    x0 = dec.embed_tokens.weight[ids] + dec.embed_positions.weight[torch.arange(ids.shape[0]) + 2]
    return (dec, layer, layer.self_attn, ids.shape[0], model.config.num_attention_heads, x0,
            layer.self_attn_layer_norm(x0))


def _explicit_opt(model, ids, target):
    """OPT (pre-LN): GPT-2's block with separate biased query/key/value projections (the query scaled by
    ``1 / sqrt(d)`` after its projection), a ReLU feed-forward inline in the layer, learned positions (offset 2)
    added to the word embeddings before the first layer."""
    dec, layer, sa, n, h, x0, n1 = _opt_input(model, ids)
    q, k, v = sa.q_proj(n1), sa.k_proj(n1), sa.v_proj(n1)
    scale = (q.shape[-1] // h) ** -0.5
    a = (split(q, h) @ split(k, h).transpose(-1, -2) * scale).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    ctx = merge(a @ split(v, h))
    o = sa.out_proj(ctx)
    r_o, r_x0 = _prenorm_tail(x0, o, layer.final_layer_norm, layer.fc1, torch.relu, layer.fc2, dec.final_layer_norm,
                              model.score, target)
    r_ctx = split(lin(ctx, sa.out_proj.weight, o, r_o), h)
    r_q, r_k, r_v, r_a, _ = causal_attention_rel(split(q, h), split(k, h), split(v, h), scale, r_ctx)
    r_n1 = (lin(n1, sa.q_proj.weight, q, merge(r_q)) + lin(n1, sa.k_proj.weight, k, merge(r_k))
            + lin(n1, sa.v_proj.weight, v, merge(r_v)))
    return (r_x0 + ln_rel(x0, layer.self_attn_layer_norm, n1, r_n1)).sum(-1), r_a


def _explicit_bloom(model, ids, target):
    """BLOOM: a LayerNorm on the word embeddings; pre-LN blocks whose attention and MLP add their residuals;
    fused per-head query/key/value; scores ``Q K^T / sqrt(d)`` plus ALiBi, ``slope_h * j`` for key j (slopes
    1/16, 1/256 for two heads), which takes its proportional share of the scores' relevance; tanh-GELU."""
    tr, blk = model.transformer, model.transformer.h[0]
    sa, mlp = blk.self_attention, blk.mlp
    n, h = ids.shape[0], model.config.n_head
    x0 = tr.word_embeddings.weight[ids]
    e = tr.word_embeddings_layernorm(x0)
    n1 = blk.input_layernorm(e)
    qkv = sa.query_key_value(n1)
    q, k, v = qkv.view(n, h, 3, -1).permute(2, 1, 0, 3)  # each (H, N, d)
    alibi = torch.tensor([1 / 16, 1 / 256], dtype=x0.dtype)[:, None, None] * torch.arange(n, dtype=x0.dtype)
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    qk = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = qk + alibi
    a = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    ctx = merge(a @ v)
    o = sa.dense(ctx)
    r_o, r_e = _prenorm_tail(e, o, blk.post_attention_layernorm, mlp.dense_h_to_4h, mlp.gelu_impl, mlp.dense_4h_to_h,
                             tr.ln_f, model.score, target)
    r_ctx = split(lin(ctx, sa.dense.weight, o, r_o), h)
    r_a, r_v = av_rule(a, v, r_ctx)
    r_s = softmax_rule(s, a, r_a, allowed)
    r_q, r_k = qk_rule(q, k, torch.where(allowed, qk / s * r_s, torch.zeros_like(s)))  # ALiBi keeps the rest
    r_qkv = torch.stack([r_q, r_k, r_v]).permute(2, 1, 0, 3).reshape(n, -1)
    r_e = r_e + ln_rel(e, blk.input_layernorm, n1, lin(n1, sa.query_key_value.weight, qkv, r_qkv))
    r_alibi = torch.where(allowed, alibi / s * r_s, torch.zeros_like(s)).sum()
    return ln_rel(x0, tr.word_embeddings_layernorm, e, r_e).sum(-1), r_a, r_alibi


def _explicit_falcon(model, ids, target):
    """Falcon-7B's layout: one LayerNorm feeding a parallel attention and MLP, multi-query attention (the fused
    projection gives each head's query, then one key and one value all heads share), rotary on whole heads."""
    base = model.transformer
    layer = base.h[0]
    sa, mlp = layer.self_attention, layer.mlp
    n, h = ids.shape[0], model.config.num_attention_heads
    x0 = base.word_embeddings.weight[ids]
    n1 = layer.input_layernorm(x0)
    qkv = sa.query_key_value(n1)  # (N, (H + 2) d)
    d = qkv.shape[-1] // (h + 2)
    q = qkv[:, : h * d].reshape(n, h, d).transpose(0, 1)
    k, v = qkv[None, :, h * d : (h + 1) * d], qkv[None, :, (h + 1) * d :]  # (1, N, d): one head
    cos, sin = base.rotary_emb(x0, torch.arange(n)[None])
    rot = rotation(cos[0], sin[0])
    qr, kr = torch.einsum("nij,hnj->hni", rot, q), torch.einsum("nij,hnj->hni", rot, k)
    scale = d ** -0.5
    a = (qr @ kr.transpose(-1, -2) * scale).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    ctx = merge(a @ v)
    o = sa.dense(ctx)
    fc = mlp.dense_h_to_4h(n1)
    act = mlp.act(fc)
    m = mlp.dense_4h_to_h(act)
    hidden = x0 + o + m
    nf = base.ln_f(hidden)
    logits = model.score(nf)
    r_logits = torch.zeros_like(logits)
    r_logits[n - 1, target] = logits[n - 1, target]
    r_h = ln_rel(hidden, base.ln_f, nf, lin(nf, model.score.weight, logits, r_logits))
    r_o, r_m, r_x0 = o * r_h / hidden, m * r_h / hidden, x0 * r_h / hidden
    r_n1 = lin(n1, mlp.dense_h_to_4h.weight, fc, lin(act, mlp.dense_4h_to_h.weight, m, r_m))  # GELU: identity
    r_ctx = split(lin(ctx, sa.dense.weight, o, r_o), h)
    r_q, r_k, r_v, r_a, _ = causal_attention_rel(qr, kr.expand(h, -1, -1), v.expand(h, -1, -1), scale, r_ctx)
    r_k, r_v = r_k.sum(0, keepdim=True), r_v.sum(0, keepdim=True)  # the shared head collects all heads' relevance
    r_qkv = torch.cat([merge(rope_rel(q, rot, r_q)), rope_rel(k, rot, r_k)[0], r_v[0]], -1)
    r_n1 = r_n1 + lin(n1, sa.query_key_value.weight, qkv, r_qkv)
    return (r_x0 + ln_rel(x0, layer.input_layernorm, n1, r_n1)).sum(-1), r_a


def _gptj_rotation(n, head_dim, rotary_dim):
    """GPT-J's rotary map on the first ``rotary_dim`` dims of a head, pairs of *adjacent* dims rotated together
    (``rotate_every_two``), from its sinusoid definition: ``(N, d, d)``."""
    rot = torch.eye(head_dim, dtype=torch.float64).repeat(n, 1, 1)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq
    for j in range(rotary_dim // 2):
        c, s = angle[:, j].cos(), angle[:, j].sin()
        rot[:, 2 * j, 2 * j], rot[:, 2 * j, 2 * j + 1] = c, -s
        rot[:, 2 * j + 1, 2 * j], rot[:, 2 * j + 1, 2 * j + 1] = s, c
    return rot


def _explicit_parallel(model, ids, target):
    """GPT-NeoX, Phi and GPT-J: ``h = x + attn(LN1(x)) + mlp(LN2(x))`` (Phi, GPT-J: one LayerNorm), rotary on the
    first dims of each head's query and key (GPT-J: adjacent pairs), GELU MLP, final LayerNorm; GPT-NeoX's
    query/key/value fused per head."""
    neox, gptj = model.config.model_type == "gpt_neox", model.config.model_type == "gptj"
    base = model.base_model
    layer = base.h[0] if gptj else base.layers[0]
    sa = layer.attention if neox else layer.attn if gptj else layer.self_attn
    ln1 = layer.ln_1 if gptj else layer.input_layernorm
    ln2 = layer.post_attention_layernorm if neox else ln1
    fc_in, fc_out = ((layer.mlp.dense_h_to_4h, layer.mlp.dense_4h_to_h) if neox else
                     (layer.mlp.fc_in, layer.mlp.fc_out) if gptj else (layer.mlp.fc1, layer.mlp.fc2))
    act_fn = layer.mlp.act if neox or gptj else layer.mlp.activation_fn
    out_proj = sa.out_proj if gptj else sa.dense
    final = base.final_layer_norm if neox else base.ln_f if gptj else base.final_layernorm
    n, h = ids.shape[0], model.config.num_attention_heads
    x0 = (base.embed_in if neox else base.wte if gptj else base.embed_tokens).weight[ids]
    n1, n2 = ln1(x0), ln2(x0)
    if neox:  # (N, H, 3 d): each head's query, key, value
        qkv = sa.query_key_value(n1)
        q, k, v = qkv.view(n, h, -1).transpose(0, 1).chunk(3, -1)
    else:
        q, k, v = split(sa.q_proj(n1), h), split(sa.k_proj(n1), h), split(sa.v_proj(n1), h)
    d = q.shape[-1]
    if gptj:
        rot = _gptj_rotation(n, d, model.config.rotary_dim)
    else:
        cos, sin = base.rotary_emb(x0, torch.arange(n)[None])
        rot = torch.eye(d, dtype=x0.dtype).repeat(n, 1, 1)  # the rotation on the first dims, identity on the rest
        rot[:, : cos.shape[-1], : cos.shape[-1]] = rotation(cos[0], sin[0])
    qr, kr = torch.einsum("nij,hnj->hni", rot, q), torch.einsum("nij,hnj->hni", rot, k)
    scale = d ** -0.5
    ctx = merge((qr @ kr.transpose(-1, -2) * scale).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1) @ v)
    o = out_proj(ctx)
    fc = fc_in(n2)
    act = act_fn(fc)
    m = fc_out(act)
    hidden = x0 + o + m
    nf = final(hidden)
    logits = model.score(nf)
    r_logits = torch.zeros_like(logits)
    r_logits[n - 1, target] = logits[n - 1, target]
    r_h = ln_rel(hidden, final, nf, lin(nf, model.score.weight, logits, r_logits))
    r_o, r_m, r_x0 = o * r_h / hidden, m * r_h / hidden, x0 * r_h / hidden  # one sum of three
    r_n2 = lin(n2, fc_in.weight, fc, lin(act, fc_out.weight, m, r_m))  # GELU: identity
    r_ctx = split(lin(ctx, out_proj.weight, o, r_o), h)
    r_q, r_k, r_v, r_a, _ = causal_attention_rel(qr, kr, v, scale, r_ctx)
    r_q, r_k = rope_rel(q, rot, r_q), rope_rel(k, rot, r_k)
    if neox:
        r_qkv = torch.cat([r_q, r_k, r_v], -1).transpose(0, 1).reshape(n, -1)
        r_n1 = lin(n1, sa.query_key_value.weight, qkv, r_qkv)
    else:
        r_n1 = (lin(n1, sa.q_proj.weight, sa.q_proj(n1), merge(r_q)) + lin(n1, sa.k_proj.weight, sa.k_proj(n1),
                merge(r_k)) + lin(n1, sa.v_proj.weight, sa.v_proj(n1), merge(r_v)))
    if neox:
        r_x0 = r_x0 + ln_rel(x0, ln1, n1, r_n1) + ln_rel(x0, ln2, n2, r_n2)
    else:  # one LayerNorm feeds both branches
        r_x0 = r_x0 + ln_rel(x0, ln1, n1, r_n1 + r_n2)
    return r_x0.sum(-1), r_a


def _explicit_modernbert(model, ids, target):
    base, layer = model.model, model.model.layers[0]
    attn, mlp, cfg = layer.attn, layer.mlp, model.config
    n, h = ids.shape[0], cfg.num_attention_heads
    x0 = base.embeddings.tok_embeddings.weight[ids]
    h0 = base.embeddings.norm(x0)  # layer 0: attn_norm is the identity
    qkv = attn.Wqkv(h0)
    q, k, v = (split(t, h) for t in qkv.view(n, 3, -1).unbind(1))
    cos, sin = base.rotary_emb(x0, torch.arange(n)[None], layer.attention_type)
    rot = rotation(cos[0], sin[0])
    qr, kr = torch.einsum("nij,hnj->hni", rot, q), torch.einsum("nij,hnj->hni", rot, k)
    scale = attn.head_dim ** -0.5
    s = qr @ kr.transpose(-1, -2) * scale
    a = s.softmax(-1)
    ctx = merge(a @ v)
    o = attn.Wo(ctx)
    h1 = h0 + o
    n2 = layer.mlp_norm(h1)
    wi = mlp.Wi(n2)
    inp, gate = wi.chunk(2, dim=-1)
    act = mlp.act(inp)
    p = act * gate
    m = mlp.Wo(p)
    h2 = h1 + m
    hf = base.final_norm(h2)
    dense = model.head.dense(hf[:1])  # [CLS] pooling
    hact = model.head.act(dense)
    pooled = model.head.norm(hact)
    logits = model.classifier(pooled)
    r_logits = torch.zeros_like(logits)
    r_logits[0, target] = logits[0, target]
    r_pooled = lin(pooled, model.classifier.weight, logits, r_logits)
    r_dense = ln_rel(hact, model.head.norm, pooled, r_pooled)  # head activation: identity
    r_hf = torch.zeros_like(hf)
    r_hf[:1] = lin(hf[:1], model.head.dense.weight, dense, r_dense)
    r_h2 = ln_rel(h2, base.final_norm, hf, r_hf)
    r_m, r_h1 = m * r_h2 / h2, h1 * r_h2 / h2
    r_p = lin(p, mlp.Wo.weight, m, r_m)
    r_wi = torch.cat([r_p / 2, r_p / 2], -1)  # uniform rule on act(input) * gate; GELU: identity
    r_h1 = r_h1 + ln_rel(h1, layer.mlp_norm, n2, lin(n2, mlp.Wi.weight, wi, r_wi))
    r_o, r_h0 = o * r_h1 / h1, h0 * r_h1 / h1
    r_ctx = split(lin(ctx, attn.Wo.weight, o, r_o), h)
    r_a, r_v = av_rule(a, v, r_ctx)
    r_q, r_k = qk_rule(qr, kr, softmax_rule(s, a, r_a, torch.ones_like(s, dtype=torch.bool)))
    r_qkv = torch.stack([merge(rope_rel(q, rot, r_q)), merge(rope_rel(k, rot, r_k)), merge(r_v)], 1).reshape(n, -1)
    r_h0 = r_h0 + lin(h0, attn.Wqkv.weight, qkv, r_qkv)
    r_x0 = ln_rel(x0, base.embeddings.norm, h0, r_h0)
    return r_x0.sum(-1), r_a


def _post_ln_rest(ctx, h0, layer, attn_out, head, target, h):
    """A 1-layer post-LN encoder after its attention's context ``ctx`` (heads merged) on input ``h0``:
    ``h1 = LN1(dense(ctx) + h0)``, ``h2 = LN2(FFN(h1) + h1)`` (``attn_out``: ``dense`` and ``LayerNorm``; the FFN
    BERT's ``intermediate.dense`` and ``output``, GELU), the head ``(pool, act, classifier)`` at the first token;
    explicit AttnLRP from the target logit back: ``(R_ctx per head (H, N, d), R_h0 through the residual)``."""
    pool, head_act, classifier = head
    ao = attn_out.dense(ctx)
    h1 = attn_out.LayerNorm(ao + h0)
    inter = layer.intermediate.dense(h1)
    act = nn.functional.gelu(inter)
    out = layer.output.dense(act)
    h2 = layer.output.LayerNorm(out + h1)
    pre = pool(h2[:1])
    pooled = head_act(pre)
    logits = classifier(pooled)
    r_logits = torch.zeros_like(logits)
    r_logits[0, target] = logits[0, target]
    r_pre = lin(pooled, classifier.weight, logits, r_logits)  # the head's activation: identity
    r_h2 = torch.zeros_like(h2)
    r_h2[:1] = lin(h2[:1], pool.weight, pre, r_pre)
    r2 = out + h1
    r_r2 = ln_rel(r2, layer.output.LayerNorm, h2, r_h2)
    r_act = lin(act, layer.output.dense.weight, out, out * r_r2 / r2)
    r_h1 = h1 * r_r2 / r2 + lin(h1, layer.intermediate.dense.weight, inter, r_act)
    r1 = ao + h0
    r_r1 = ln_rel(r1, attn_out.LayerNorm, h1, r_h1)
    return split(lin(ctx, attn_out.dense.weight, ao, ao * r_r1 / r1), h), h0 * r_r1 / r1


def _explicit_deberta(model, ids, target):
    """DeBERTa-v3 style: shared attention keys, LayerNorm on the relative embeddings, no absolute positions."""
    deb, layer = model.deberta, model.deberta.encoder.layer[0]
    sa, so = layer.attention.self, layer.attention.output
    hf = sys.modules[type(sa).__module__]
    n, h = ids.shape[0], model.config.num_attention_heads
    x0 = deb.embeddings.word_embeddings.weight[ids]
    h0 = deb.embeddings.LayerNorm(x0)
    q, k, v = sa.query_proj(h0), sa.key_proj(h0), sa.value_proj(h0)
    qh, kh, vh = split(q, h), split(k, h), split(v, h)
    span = sa.pos_ebd_size
    rel = deb.encoder.get_rel_embedding()[: 2 * span]
    pq, pk = sa.query_proj(rel), sa.key_proj(rel)  # share_att_key
    pqh, pkh = split(pq, h), split(pk, h)
    rp = hf.build_relative_position(qh, kh, bucket_size=sa.position_buckets, max_position=sa.max_relative_positions)
    rp = rp.reshape(n, n)
    c_idx = torch.clamp(rp + span, 0, 2 * span - 1)  # c2p[i, j] = q_i . pk[c_idx[i, j]]
    p_idx = torch.clamp(-rp + span, 0, 2 * span - 1)  # p2c[i, j] = k_j . pq[p_idx[j, i]]
    scale = hf.scaled_size_sqrt(qh, 3).to(qh.dtype)  # sqrt(3 d), computed in float32 as the model does
    qk = qh @ kh.transpose(-1, -2)
    c2p_full, p2c_full = qh @ pkh.transpose(-1, -2), kh @ pqh.transpose(-1, -2)  # (H, N, 2 span)
    c2p = torch.gather(c2p_full, -1, c_idx.expand(h, n, n))
    p2c = torch.gather(p2c_full, -1, p_idx.expand(h, n, n)).transpose(-1, -2)
    s = (qk + c2p + p2c) / scale
    a = s.softmax(-1)
    r_ctx, r_skip = _post_ln_rest(merge(a @ vh), h0, layer, so, (model.pooler.dense, nn.functional.gelu,
                                                                 model.classifier), target, h)
    r_a, r_v = av_rule(a, vh, r_ctx)
    r_s = softmax_rule(s, a, r_a, torch.ones_like(s, dtype=torch.bool))
    # the sum of three score terms: proportional; then the uniform rule on each product
    r_qh, r_kh = qk_rule(qh, kh, qk / scale * r_s / s)
    r_c2p, r_p2c = c2p / scale * r_s / s, p2c / scale * r_s / s
    r_c2p_full = torch.zeros_like(c2p_full).scatter_add_(-1, c_idx.expand(h, n, n), r_c2p)
    r_p2c_full = torch.zeros_like(p2c_full).scatter_add_(-1, p_idx.expand(h, n, n), r_p2c.transpose(-1, -2))
    r_q2, r_pk = qk_rule(qh, pkh, r_c2p_full)
    r_k2, r_pq = qk_rule(kh, pqh, r_p2c_full)
    r_h0 = (r_skip + lin(h0, sa.query_proj.weight, q, merge(r_qh + r_q2))
            + lin(h0, sa.key_proj.weight, k, merge(r_kh + r_k2)) + lin(h0, sa.value_proj.weight, v, merge(r_v)))
    r_x0 = ln_rel(x0, deb.embeddings.LayerNorm, h0, r_h0)
    r_rel = lin(rel, sa.query_proj.weight, pq, merge(r_pq)) + lin(rel, sa.key_proj.weight, pk, merge(r_pk))
    return r_x0.sum(-1), r_a, r_rel.sum()


def _explicit_deberta_v1(model, ids, target):
    """DeBERTa (v1): one projection holding each head's query, key and value rows, the query and value biases
    added after it; the query scaled by 1/√(3d) before the content and content-position products; relative
    positions i − j unbucketed; the position relevance is the third return value."""
    deb, layer = model.deberta, model.deberta.encoder.layer[0]
    sa, so, n, h = layer.attention.self, layer.attention.output, ids.shape[0], model.config.num_attention_heads
    x0 = deb.embeddings.word_embeddings.weight[ids]  # no absolute positions, no token types
    h0 = deb.embeddings.LayerNorm(x0)
    w = sa.in_proj.weight
    d = w.shape[0] // (3 * h)

    def rows(part):
        return torch.cat([torch.arange(i * 3 * d + part * d, i * 3 * d + (part + 1) * d) for i in range(h)])

    q, k, v = h0 @ w[rows(0)].T + sa.q_bias, h0 @ w[rows(1)].T, h0 @ w[rows(2)].T + sa.v_bias
    scale = (3.0 * d) ** 0.5
    qh, kh, vh = split(q, h) / scale, split(k, h), split(v, h)
    span = min(n, sa.max_relative_positions)
    rel = deb.encoder.rel_embeddings.weight[sa.max_relative_positions - span: sa.max_relative_positions + span]
    pk_lin, pq_lin = sa.pos_proj(rel), sa.pos_q_proj(rel)
    pkh, pqh = split(pk_lin, h), split(pq_lin, h) / scale
    rp = torch.arange(n)[:, None] - torch.arange(n)[None, :]  # i − j
    c_idx = torch.clamp(rp + span, 0, 2 * span - 1)  # c2p[i, j] = q_i . pk[c_idx[i, j]]
    p_idx = torch.clamp(-rp + span, 0, 2 * span - 1)  # p2c[i, j] = k_j . pq[p_idx[j, i]]
    qk = qh @ kh.transpose(-1, -2)
    c2p_full, p2c_full = qh @ pkh.transpose(-1, -2), kh @ pqh.transpose(-1, -2)
    c2p = torch.gather(c2p_full, -1, c_idx.expand(h, n, n))
    p2c = torch.gather(p2c_full, -1, p_idx.expand(h, n, n)).transpose(-1, -2)
    s = qk + c2p + p2c
    a = s.softmax(-1)
    r_ctx, r_skip = _post_ln_rest(merge(a @ vh), h0, layer, so, (model.pooler.dense, nn.functional.gelu,
                                                                 model.classifier), target, h)
    r_a, r_v = av_rule(a, vh, r_ctx)
    r_s = softmax_rule(s, a, r_a, torch.ones_like(s, dtype=torch.bool))
    r_q, r_k = qk_rule(qh, kh, qk * r_s / s)  # the sum of three score terms: proportional
    r_c2p_full = torch.zeros_like(c2p_full).scatter_add_(-1, c_idx.expand(h, n, n), c2p * r_s / s)
    r_p2c_full = torch.zeros_like(p2c_full).scatter_add_(-1, p_idx.expand(h, n, n), (p2c * r_s / s).transpose(-1, -2))
    r_q2, r_pk = qk_rule(qh, pkh, r_c2p_full)
    r_k2, r_pq = qk_rule(kh, pqh, r_p2c_full)
    r_h0 = (r_skip + lin(h0, w[rows(0)], q, merge(r_q + r_q2)) + lin(h0, w[rows(1)], k, merge(r_k + r_k2))
            + lin(h0, w[rows(2)], v, merge(r_v)))
    r_x0 = ln_rel(x0, deb.embeddings.LayerNorm, h0, r_h0)
    r_rel = lin(rel, sa.pos_proj.weight, pk_lin, merge(r_pk)) + lin(rel, sa.pos_q_proj.weight, pq_lin, merge(r_pq))
    return r_x0.sum(-1), r_a, r_rel.sum()


def _explicit_mpnet(model, ids, target):
    """Post-LN MPNet: BERT's layer with the encoder's relative-position bias added to the scores (its relevance
    is the third return value) and RoBERTa's tanh head."""
    base, layer = model.mpnet, model.mpnet.encoder.layer[0]
    sa, n, h = layer.attention.attn, ids.shape[0], model.config.num_attention_heads
    emb = base.embeddings
    x0 = emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[torch.arange(n) + emb.padding_idx + 1]
    h0 = emb.LayerNorm(x0)
    q, k, v = sa.q(h0), sa.k(h0), sa.v(h0)
    qh, kh, vh = split(q, h), split(k, h), split(v, h)
    scale = sa.attention_head_size ** -0.5
    qk = qh @ kh.transpose(-1, -2) * scale
    bias = base.encoder.compute_position_bias(h0[None])[0]  # (H, N, N)
    s = qk + bias
    a = s.softmax(-1)
    attn_out = SimpleNamespace(dense=sa.o, LayerNorm=layer.attention.LayerNorm)
    head = model.classifier
    r_ctx, r_skip = _post_ln_rest(merge(a @ vh), h0, layer, attn_out, (head.dense, torch.tanh, head.out_proj),
                                  target, h)
    r_a, r_v = av_rule(a, vh, r_ctx)
    r_s = softmax_rule(s, a, r_a, torch.ones_like(s, dtype=torch.bool))
    r_q, r_k = qk_rule(qh, kh, qk * r_s / s)  # the sum qk + bias: proportional
    r_h0 = (r_skip + lin(h0, sa.q.weight, q, merge(r_q)) + lin(h0, sa.k.weight, k, merge(r_k))
            + lin(h0, sa.v.weight, v, merge(r_v)))
    r_x0 = ln_rel(x0, emb.LayerNorm, h0, r_h0)
    return r_x0.sum(-1), r_a, (bias * r_s / s).sum()


def _xlmr_xl_embeddings(emb, ids):
    """XLM-RoBERTa-XL's input: word + token type 0 + position (after the padding index) embeddings, no norm."""
    n = ids.shape[0]
    return (emb.word_embeddings.weight[ids] + emb.token_type_embeddings.weight[0]
            + emb.position_embeddings.weight[torch.arange(n) + emb.padding_idx + 1])


def _explicit_xlmr_xl(model, ids, target):
    """Pre-LN XLM-RoBERTa-XL: ``h = x + Attn(LN1(x))``, ``h + FFN(LN2(h))``, the encoder's final LayerNorm and
    RoBERTa's tanh head at the first token; embeddings word + type + position without a norm."""
    base, layer = model.roberta, model.roberta.encoder.layer[0]
    sa, h = layer.attention.self, model.config.num_attention_heads
    x0 = _xlmr_xl_embeddings(base.embeddings, ids)
    n1 = layer.attention.self_attn_layer_norm(x0)
    q, k, v = sa.query(n1), sa.key(n1), sa.value(n1)
    qh, kh, vh = split(q, h), split(k, h), split(v, h)
    s = qh @ kh.transpose(-1, -2) * sa.attention_head_size ** -0.5
    a = s.softmax(-1)
    ctx = merge(a @ vh)
    ao = layer.attention.output.dense(ctx)
    h1 = x0 + ao
    n2 = layer.LayerNorm(h1)
    inter = layer.intermediate.dense(n2)
    act = nn.functional.gelu(inter)
    out = layer.output.dense(act)
    h2 = h1 + out
    nf = base.encoder.LayerNorm(h2)
    head = model.classifier
    pre = head.dense(nf[:1])
    logits = head.out_proj(torch.tanh(pre))
    r_logits = torch.zeros_like(logits)
    r_logits[0, target] = logits[0, target]
    r_pre = lin(torch.tanh(pre), head.out_proj.weight, logits, r_logits)  # tanh: identity
    r_nf = torch.zeros_like(nf)
    r_nf[:1] = lin(nf[:1], head.dense.weight, pre, r_pre)
    r_h2 = ln_rel(h2, base.encoder.LayerNorm, nf, r_nf)
    r_out, r_h1 = out * r_h2 / h2, h1 * r_h2 / h2
    r_act = lin(act, layer.output.dense.weight, out, r_out)  # GELU: identity
    r_h1 = r_h1 + ln_rel(h1, layer.LayerNorm, n2, lin(n2, layer.intermediate.dense.weight, inter, r_act))
    r_ao, r_x0 = ao * r_h1 / h1, x0 * r_h1 / h1
    r_ctx = split(lin(ctx, layer.attention.output.dense.weight, ao, r_ao), h)
    r_a, r_v = av_rule(a, vh, r_ctx)
    r_q, r_k = qk_rule(qh, kh, softmax_rule(s, a, r_a, torch.ones_like(s, dtype=torch.bool)))
    r_n1 = lin(n1, sa.query.weight, q, merge(r_q)) + lin(n1, sa.key.weight, k, merge(r_k)) + lin(
        n1, sa.value.weight, v, merge(r_v))
    r_x0 = r_x0 + ln_rel(x0, layer.attention.self_attn_layer_norm, n1, r_n1)
    return r_x0.sum(-1), r_a


LLAMA_FAMILY = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
                "gemma2": "Gemma2", "phi3": "Phi3", "mixtral": "Mixtral"}


def _one_layer(family: str) -> nn.Module:
    import transformers

    common = dict(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
                  max_position_embeddings=32, num_labels=3, pad_token_id=0, attn_implementation="eager")
    if family in LLAMA_FAMILY:  # grouped-query attention: 2 query heads share 1 key/value head
        prefix = LLAMA_FAMILY[family]  # Qwen2: q, k, v biases
        head_dim = {"head_dim": 4} if family in ("qwen3", "gemma", "gemma2") else {}
        if family == "gemma2":  # a cap the random scores reach (its nonlinearity must get the identity rule)
            head_dim.update(attn_logit_softcapping=0.8, query_pre_attn_scalar=2)
        if family == "mixtral":  # 2 of 3 experts per token; the experts' plain loop, which runs in float64
            head_dim.update(num_local_experts=3, num_experts_per_tok=2, experts_implementation="eager")
        cfg = getattr(transformers, f"{prefix}Config")(**common, num_key_value_heads=1, **head_dim)
        cls = getattr(transformers, f"{prefix}ForSequenceClassification")
    elif family in ("gpt_neox", "phi"):  # rotary on half of each head (GPT-NeoX: rotary_pct)
        prefix = {"gpt_neox": "GPTNeoX", "phi": "Phi"}[family]
        cfg = getattr(transformers, f"{prefix}Config")(**common, **({"rotary_pct": 0.5} if family == "gpt_neox"
                                                                      else {}))
        cls = getattr(transformers, f"{prefix}ForSequenceClassification")
    elif family == "gpt_neo":  # a local layer whose window (3) is shorter than the text
        cfg = transformers.GPTNeoConfig(vocab_size=40, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=12,
                                        attention_types=[[["local"], 1]], window_size=3, max_position_embeddings=32,
                                        num_labels=3, pad_token_id=0, attn_implementation="eager")
        cls = transformers.GPTNeoForSequenceClassification
    elif family == "gptj":  # rotary on 2 of each head's 4 dims
        cfg = transformers.GPTJConfig(vocab_size=40, n_embd=8, n_layer=1, n_head=2, n_inner=12, rotary_dim=2,
                                      n_positions=32, num_labels=3, pad_token_id=0, attn_implementation="eager")
        cls = transformers.GPTJForSequenceClassification
    elif family == "falcon":  # Falcon-7B's layout (the config's defaults): parallel, multi-query, rotary
        cfg = transformers.FalconConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                        num_labels=3, pad_token_id=0, attn_implementation="eager")
        cls = transformers.FalconForSequenceClassification
    elif family == "bloom":
        cfg = transformers.BloomConfig(vocab_size=40, hidden_size=8, n_layer=1, n_head=2, num_labels=3,
                                       pad_token_id=0, attn_implementation="eager")
        cls = transformers.BloomForSequenceClassification
    elif family == "opt":
        cfg = transformers.OPTConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     ffn_dim=12, word_embed_proj_dim=8, max_position_embeddings=32, num_labels=3,
                                     pad_token_id=0, attn_implementation="eager")
        cls = transformers.OPTForSequenceClassification
    elif family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=40, n_embd=8, n_layer=1, n_head=2, n_positions=32, num_labels=3,
                                      pad_token_id=0, bos_token_id=2, eos_token_id=3, attn_implementation="eager")
        cls = transformers.GPT2ForSequenceClassification
    elif family == "deberta":
        cfg = transformers.DebertaConfig(**common, relative_attention=True, pos_att_type=["c2p", "p2c"],
                                         position_biased_input=False, max_relative_positions=4)
        cls = transformers.DebertaForSequenceClassification
    elif family == "mpnet":
        cfg = transformers.MPNetConfig(**common)
        cls = transformers.MPNetForSequenceClassification
    elif family == "xlm-roberta-xl":
        cfg = transformers.XLMRobertaXLConfig(**common)
        cls = transformers.XLMRobertaXLForSequenceClassification
    elif family == "modernbert":
        cfg = transformers.ModernBertConfig(**common, global_attn_every_n_layers=1, cls_token_id=2, sep_token_id=3,
                                            bos_token_id=2, eos_token_id=3)
        cls = transformers.ModernBertForSequenceClassification
    else:
        cfg = transformers.DebertaV2Config(**common, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                           position_buckets=4, max_relative_positions=8, share_att_key=True,
                                           norm_rel_ebd="layer_norm", position_biased_input=False)
        cls = transformers.DebertaV2ForSequenceClassification
    torch.manual_seed(3)
    model = cls(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.4 if p.dim() >= 2 else 0.2) + (1.0 if "norm" in name.lower()
                                                                              and p.dim() == 1
                                                                              and name.endswith("weight") else 0))
    return model


EXPLICIT = {**dict.fromkeys(LLAMA_FAMILY, _explicit_llama), "gpt2": _explicit_gpt2, "gpt_neox": _explicit_parallel,
            "phi": _explicit_parallel, "gptj": _explicit_parallel, "gpt_neo": _explicit_gpt_neo,
            "opt": _explicit_opt, "bloom": _explicit_bloom, "falcon": _explicit_falcon,
            "modernbert": _explicit_modernbert, "deberta-v2": _explicit_deberta, "mpnet": _explicit_mpnet,
            "deberta": _explicit_deberta_v1,
            "xlm-roberta-xl": _explicit_xlmr_xl}


@pytest.mark.parametrize("family", list(EXPLICIT))
def test_whole_pass_equals_explicit_rule_by_rule_propagation(family):
    model = _one_layer(family)
    ids = torch.tensor([2, 7, 13, 21, 5, 3])
    inputs = {"input_ids": ids[None], "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    with torch.no_grad():
        expected = EXPLICIT[family](model, ids, 1)
    res = lrp_pass(model, inputs, 1)
    # ModernBERT's stock rotary map rounds q and k to float32 even in a float64 model (and so does its gradient);
    # Gemma's RMSNorm computes in float32 too, and DeBERTa's LayerNorm, GPT-Neo's and GPT-J's attention scores
    float32 = ("modernbert", "gemma", "gemma2", "gpt_neo", "gptj", "mixtral", "deberta")
    tol = dict(rtol=1e-5, atol=1e-7) if family in float32 else dict(rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(res.input_relevance[0], expected[0], **tol)
    torch.testing.assert_close(res.attention_relevance[0][0], expected[1], **tol)
    if family in ("deberta", "deberta-v2", "bloom", "mpnet"):
        torch.testing.assert_close(res.position_relevance[0], expected[2], **(tol if family == "deberta" else dict(
            rtol=1e-8, atol=1e-10)))
        # the relative positions do take relevance (ALiBi's slopes, 1/16 and 1/256 per position, take little)
        assert abs(float(expected[2])) > (1e-5 if family == "bloom" else 1e-3)
    assert res.input_relevance.abs().max() > 1e-3


def test_word_relevance_is_the_tokens_lookup_where_token_types_use_the_same_table():
    """GPT-2 (and GPT-Neo) look token types up in the word table, after the tokens: ``input="word"`` is the
    relevance of the tokens' lookup, not of the types'."""
    model = _one_layer("gpt2")
    ids, types = torch.tensor([2, 7, 13, 21, 5, 3]), torch.tensor([0, 0, 0, 1, 1, 1])
    inputs = {"input_ids": ids[None], "token_type_ids": types[None],
              "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    with torch.no_grad():
        word, typed = _explicit_gpt2(model, ids, 1, types, parts=True)
    res = lrp_pass(model, inputs, 1)
    torch.testing.assert_close(res.word_relevance[0], word, rtol=1e-8, atol=1e-10)
    assert (word - typed).abs().max() > 1e-3


# ---------------------------------------------------------------- conservation
@pytest.mark.parametrize("family", ARCHS)
def test_conservation(family):
    # Bias-free, epsilon = 0: CP-LRP conserves exactly; AttnLRP up to what the softmaxes absorb and, in
    # DeBERTa, what its relative-position embeddings take (parameters, like biases). Tolerance 1e-4 relative.
    model = strong(family, biases=False)
    inputs, targets = padded_batch(), [0, 1, 2]
    cp = lrp_pass(model, inputs, targets, rules="cp")
    torch.testing.assert_close(cp.input_relevance.sum(1), cp.target, rtol=1e-4, atol=1e-5)
    assert cp.target.abs().min() > 1e-3 and (cp.position_relevance == 0).all()
    res = lrp_pass(model, inputs, targets, track_softmax=True)
    total = res.input_relevance.sum(1) + res.softmax_absorbed + res.position_relevance
    torch.testing.assert_close(total, res.target, rtol=1e-4, atol=1e-5)
    assert res.softmax_absorbed.abs().max() > 1e-4
    assert (res.position_relevance.abs().max() > 1e-4) == (family in ("deberta", "deberta-v2", "bloom", "mpnet"))


@pytest.mark.parametrize("family", ARCHS)
def test_chefer_rules_conserve_relevance_one_with_biases(family):
    # z+ ignores biases and every chefer rule is conservative: relevance 1 at the logit reaches the input
    # (and DeBERTa's relative positions) whole, biases included.
    model = strong(family)
    if family == "opt":  # its ReLU's exact zeros: z+ drops the relevance of an output whose positive-weight inputs
        for layer in model.model.decoder.layers:  # are all 0 (the rule, not a leak: with GELU it conserves)
            layer.activation_fn = nn.GELU()
    res = lrp_pass(model, padded_batch(), [0, 1, 2], rules="chefer")
    torch.testing.assert_close(res.input_relevance.sum(1) + res.position_relevance, torch.ones(3),
                               rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- padding, batching, model state
@pytest.mark.parametrize("family", ARCHS)
@pytest.mark.parametrize("rule_set", RULE_SETS)
def test_padding_is_exactly_zero_and_batch_invariance(family, rule_set):
    model = strong(family).double()  # float64: the chefer rules divide by activations
    # GPT-Neo and GPT-J compute their attention scores in float32 whatever the model's dtype, Gemma 2 its four
    # norms per layer: float32 rounding, which the chefer rules' divisions by activations amplify (GPT-Neo's
    # attention relevance: 1.5e-5 relative on CPUs whose matrix kernels use AVX-512)
    tol = dict(rtol=1e-4, atol=1e-6) if family in ("gpt_neo", "gptj", "gemma2") else dict(rtol=1e-8, atol=1e-9)
    assert_padding_zero_and_batch_invariant(model, rule_set, position=True, **tol)


@pytest.mark.parametrize("family", ARCHS)
@pytest.mark.parametrize("rule_set", ["attnlrp", "chefer"])
def test_model_left_unchanged_and_forward_values_kept(family, rule_set):
    eager_only = ("deberta", "deberta-v2", "gpt_neo", "gptj", "gemma2", "bloom", "mpnet")
    model = make_model(family, attn="eager" if family in eager_only else "sdpa").train()
    next(model.parameters()).requires_grad_(False)
    before = _snapshot(model)
    res = lrp_pass(model, padded_batch(), 1, rules=rule_set, epsilon=0.0 if rule_set == "chefer" else 1e-3)
    _assert_unchanged(model, before)
    assert len(res.attentions) == model.config.num_hidden_layers
    with torch.no_grad():  # the LRP forward computes the model's own logits (in eval mode), to float32 rounding
        model.eval()
        torch.testing.assert_close(res.logits, model(**padded_batch()).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt_neo", "gptj"])
def test_attention_scores_in_float32_as_the_models_own(family):
    # GPT-Neo and GPT-J compute their attention scores in float32 whatever the model's dtype (against overflow in
    # half precision), in their own attention code or, GPT-J since transformers 5.24, through the attention
    # interface: the LRP forward does the same, so a float64 model's LRP logits are its own to float64 precision
    # (float64 scores would move them by ~1e-7)
    model = make_model(family).double()
    res = lrp_pass(model, padded_batch(), 1)
    with torch.no_grad():
        torch.testing.assert_close(res.logits, model(**padded_batch()).logits, rtol=1e-12, atol=1e-13)


# ---------------------------------------------------------------- a head other than the classifier's
class TokenLogitHead(Head):
    """A causal LM's logit of token ``t`` at position ``p`` (targets ``(B, 2)`` rows ``(p, t)``), minus that
    of a contrast token ``c`` when targets have a third column, as a generation head explains."""

    task = "generation"

    def scalar(self, logits, targets, kind, token_mask):
        rows = torch.arange(logits.shape[0])
        value = logits[rows, targets[:, 0], targets[:, 1]]
        if targets.shape[1] > 2:
            value = value - logits[rows, targets[:, 0], targets[:, 2]]
        return value


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "qwen3", "gemma", "gpt_neox", "phi", "gpt_neo", "gptj",
                                    "bloom", "gemma2", "opt", "falcon", "phi3", "mixtral"])
def test_lrp_explains_the_scalar_the_head_gives(family):
    import transformers

    cls = make_model(family)
    lm_class = type(cls).__name__.replace("SequenceClassification", "CausalLM")
    lm_class = "GPT2LMHeadModel" if family == "gpt2" else lm_class
    lm = getattr(transformers, lm_class)(cls.config).eval()
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    ids = torch.randint(5, 60, (2, 7), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    head = TokenLogitHead()
    both = torch.tensor([[3, 11, 40], [5, 9, 12]])
    res = lrp_pass(lm, inputs, both, head=head, track_softmax=True)
    logits = lm(**inputs).logits
    torch.testing.assert_close(res.target, logits[[0, 1], [3, 5], [11, 9]] - logits[[0, 1], [3, 5], [40, 12]])
    total = res.input_relevance.sum(1) + res.softmax_absorbed + res.position_relevance  # BLOOM: ALiBi's share
    torch.testing.assert_close(total, res.target, rtol=1e-4, atol=1e-5)
    assert (res.input_relevance[0, 4:] == 0).all() and (res.input_relevance[1, 6:] == 0).all()  # causal
    # every AttnLRP rule is linear in the relevance it starts from: a contrast is the difference of two passes
    first = lrp_pass(lm, inputs, both[:, :2], head=head)
    second = lrp_pass(lm, inputs, both[:, [0, 2]], head=head)
    torch.testing.assert_close(res.input_relevance, first.input_relevance - second.input_relevance,
                               rtol=1e-4, atol=1e-5)
    assert supports(lm)


def test_chefer_refused_where_no_residual_sums_are_declared(restore_lrp_entry):
    from dataclasses import replace

    from attnlens.models.architectures import ARCHITECTURES, register_architecture

    arch = ARCHITECTURES["gpt2"]
    register_architecture(replace(arch, lrp=replace(arch.lrp, blocks=())))
    with pytest.raises(InputError, match="rules='chefer' needs the residual sums of GPT-2"):
        lrp_pass(make_model("gpt2"), padded_batch(), 0, rules="chefer")
    # through the engine, with the one forward for both rule sets planned: attnlrp still runs, the chefer
    # methods say why not
    model = make_model("gpt2")
    ex = Explainer(model, make_tokenizer())
    (alone,) = ex.explain("the movie was great", methods=["attnlrp"])
    with pytest.raises(InputError, match="rules='chefer' needs the residual sums of GPT-2"):
        ex.explain("the movie was great", methods=["partiallrp", "attnlrp"])
    (other,) = ex.explain("the movie was great", methods=["attnlrp", "partiallrp"],
                          options={"partiallrp": {"rules": "attnlrp"}})
    torch.testing.assert_close(torch.tensor(other.scores["attnlrp"]), torch.tensor(alone.scores["attnlrp"]))


@pytest.fixture
def restore_lrp_entry():
    from attnlens.models.architectures import ARCHITECTURES, register_architecture

    saved = ARCHITECTURES["gpt2"]
    yield
    register_architecture(saved)


@pytest.mark.parametrize("constant_gate", [False, True])
def test_gated_product_rule(constant_gate):
    from attnlens.lrp import rules

    torch.manual_seed(0)
    gate, up = torch.randn(2, 5, requires_grad=True), torch.randn(2, 5, requires_grad=True)
    y = rules.gated(gate, up, constant_gate)
    torch.testing.assert_close(y, gate * up)
    r_y = torch.randn(2, 5)
    g_gate, g_up = torch.autograd.grad(y, [gate, up], r_y / y.detach(), allow_unused=True)
    if constant_gate:  # CP-LRP (LXT's cp_gated_mlp_forward): the gate is a constant, up takes everything
        assert g_gate is None
        torch.testing.assert_close((up * g_up).detach(), r_y)
    else:  # uniform rule: half to each factor
        torch.testing.assert_close((gate * g_gate).detach(), r_y / 2)
        torch.testing.assert_close((up * g_up).detach(), r_y / 2)


def test_modernbert_local_attention_layers():
    # ModernBERT alternates global and sliding-window layers; the sliding mask comes from the same mask interface
    import transformers

    cfg = transformers.ModernBertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                        intermediate_size=24, max_position_embeddings=64, pad_token_id=0,
                                        global_attn_every_n_layers=3, local_attention=4, num_labels=3,
                                        attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.ModernBertForSequenceClassification(cfg).eval()
    inputs = padded_batch(2)
    inputs["input_ids"] = torch.cat([inputs["input_ids"]] * 2, 1)
    inputs["attention_mask"] = torch.cat([inputs["attention_mask"], torch.zeros_like(inputs["attention_mask"])], 1)
    res = lrp_pass(model, inputs, [0, 1, 2], rules="cp")
    with torch.no_grad():
        torch.testing.assert_close(res.logits, model(**inputs).logits, rtol=1e-5, atol=1e-6)
    far = res.attentions[1][0, :, 0, 3:]  # a local layer (window 4): [CLS] sees 2 tokens on each side
    assert (far == 0).all() and (res.attentions[0][0, :, 0, 1:6] > 0).all()


@pytest.mark.parametrize("shared", [True, False])
def test_zplus_rule_of_a_convolution_equals_the_linear_one(shared):
    # a kernel-1 convolution is a Linear layer over channels: the generic z+ (vector-Jacobian products of the
    # operation) must give the relevance of the explicit-matrix z+ rule
    from attnlens.lrp import rules

    torch.manual_seed(1)
    conv = nn.Conv1d(6, 4, 1).double()
    lin = nn.Linear(6, 4).double()
    with torch.no_grad():
        lin.weight.copy_(conv.weight[:, :, 0])
        lin.bias.copy_(conv.bias)
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    r_out = torch.randn(2, 5, 4, dtype=torch.float64)
    y_lin = rules.zplus_linear(lin, x, shared)
    y_conv = rules.zplus_conv(conv, x.transpose(1, 2), shared).transpose(1, 2)
    torch.testing.assert_close(y_conv, y_lin)
    (g_lin,) = torch.autograd.grad(y_lin, x, r_out / y_lin.detach())
    (g_conv,) = torch.autograd.grad(y_conv, x, r_out / y_conv.detach())
    torch.testing.assert_close(x * g_conv, x * g_lin)


def test_deberta_v2_with_a_convolution_layer():
    import transformers

    cfg = transformers.DebertaV2Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=24, max_position_embeddings=64, num_labels=3,
                                       relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
                                       max_relative_positions=16, conv_kernel_size=3, conv_act="tanh",
                                       attn_implementation="eager")
    torch.manual_seed(2)
    model = transformers.DebertaV2ForSequenceClassification(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    inputs, targets = padded_batch(4), [0, 1, 2]
    with torch.no_grad():
        plain = model(**inputs).logits
    chefer = lrp_pass(model, inputs, targets, rules="chefer")
    torch.testing.assert_close(chefer.logits, plain)
    total = chefer.input_relevance.sum(1) + chefer.position_relevance  # z+ on the convolution too: biases ignored
    torch.testing.assert_close(total, torch.ones(3, dtype=plain.dtype))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    for rule_set in ("attnlrp", "chefer"):
        res = lrp_pass(model, inputs, targets, rules=rule_set, track_softmax=True)
        if rule_set == "attnlrp":
            total = res.input_relevance.sum(1) + res.softmax_absorbed + res.position_relevance
            torch.testing.assert_close(total, res.target)
        assert (res.input_relevance[inputs["attention_mask"] == 0] == 0).all()
        for b in range(3):
            n = int(inputs["attention_mask"][b].sum())
            one = lrp_pass(model, {k: v[b : b + 1, :n] for k, v in inputs.items()}, targets[b], rules=rule_set)
            torch.testing.assert_close(res.input_relevance[b, :n], one.input_relevance[0], rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------- the chefer rules on a pre-LN block
def _chefer_gpt2(model, ids, target, rule_set):
    """Chefer et al.'s relprop rules (``tests/lrp_reference.py`` primitives, batch of one) through a 1-layer
    GPT-2: z+ on every Conv1D / Linear, LayerNorm, softmax and GELU pass relevance unchanged, both attention
    products proportional and halved, and each pre-LN residual sum an ``Add`` (normalised for ``"chefer"``);
    the residual stream feeding both a sum and a LayerNorm is a ``Clone``. Relevance 1 at the target logit."""
    from lrp_reference import add_relprop, clone_relprop, linear_relprop, matmul_relprop

    shared = normalized = rule_set == "chefer"
    tr, blk = model.transformer, model.transformer.h[0]
    n, h = ids.shape[0], model.config.n_head

    def as_linear(conv1d):  # Conv1D(x) = x W + b: a Linear with weight W^T
        lin = nn.Linear(conv1d.weight.shape[0], conv1d.weight.shape[1]).double()
        lin.weight.data, lin.bias.data = conv1d.weight.T.clone(), conv1d.bias.clone()
        return lin

    c_attn, a_proj, c_fc, m_proj = (as_linear(c) for c in (blk.attn.c_attn, blk.attn.c_proj, blk.mlp.c_fc,
                                                           blk.mlp.c_proj))
    x0 = tr.wte.weight[ids] + tr.wpe.weight[:n]
    n1 = blk.ln_1(x0)
    qkv = c_attn(n1)
    q, k, v = (split(t, h) for t in qkv.split(model.config.n_embd, dim=-1))
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    a = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~allowed, float("-inf")).softmax(-1)
    ctx = merge(a @ v)
    o = a_proj(ctx)
    h1 = x0 + o
    n2 = blk.ln_2(h1)
    act = blk.mlp.act(c_fc(n2))
    m = m_proj(act)
    h2 = h1 + m
    nf = tr.ln_f(h2)
    logits = model.score(nf)
    r = torch.zeros_like(logits)
    r[n - 1, target] = 1.0
    r_h2 = linear_relprop(nf, model.score, r, shared)  # ln_f: unchanged
    r_m, r_skip = add_relprop(m, h1, r_h2, normalized)
    r_n2 = linear_relprop(n2, c_fc, linear_relprop(act, m_proj, r_m, shared), shared)  # GELU: unchanged
    r_h1 = clone_relprop(h1, r_skip, r_n2)  # ln_2: unchanged
    r_o, r_skip = add_relprop(o, x0, r_h1, normalized)
    r_ctx = split(linear_relprop(ctx, a_proj, r_o, shared), h)
    r_a, r_v = matmul_relprop(a, v, r_ctx)  # softmax and the causal mask: unchanged
    r_q, r_kt = matmul_relprop(q, k.transpose(-1, -2), r_a)
    r_qkv = torch.cat([merge(r_q), merge(r_kt.transpose(-1, -2)), merge(r_v)], -1)
    r_x0 = clone_relprop(x0, r_skip, linear_relprop(n1, c_attn, r_qkv, shared))
    return r_x0.sum(-1), r_a


def _chefer_xlmr_xl(model, ids, target, rule_set):
    """The chefer rules through a 1-layer XLM-RoBERTa-XL (a pre-LN encoder whose output modules add the residual
    themselves): each residual sum an ``Add`` (normalised for ``"chefer"``), the residual stream a ``Clone`` into
    the sum and the next LayerNorm, the normed input a ``Clone`` into query, key and value; the head's tanh and
    every LayerNorm pass relevance unchanged."""
    from lrp_reference import add_relprop, clone_relprop, linear_relprop, matmul_relprop

    shared = normalized = rule_set == "chefer"
    base, layer = model.roberta, model.roberta.encoder.layer[0]
    sa, h = layer.attention.self, model.config.num_attention_heads
    x0 = _xlmr_xl_embeddings(base.embeddings, ids)
    n1 = layer.attention.self_attn_layer_norm(x0)
    q, k, v = split(sa.query(n1), h), split(sa.key(n1), h), split(sa.value(n1), h)
    a = (q @ k.transpose(-1, -2) * sa.attention_head_size ** -0.5).softmax(-1)
    ctx = merge(a @ v)
    ao = layer.attention.output.dense(ctx)
    h1 = x0 + ao
    n2 = layer.LayerNorm(h1)
    act = nn.functional.gelu(layer.intermediate.dense(n2))
    out = layer.output.dense(act)
    h2 = h1 + out
    nf = base.encoder.LayerNorm(h2)
    pooled = torch.tanh(model.classifier.dense(nf[:1]))
    logits = model.classifier.out_proj(pooled)
    r = torch.zeros_like(logits)
    r[0, target] = 1.0
    r_h2 = torch.zeros_like(h2)  # the final LayerNorm: unchanged
    r_h2[:1] = linear_relprop(nf[:1], model.classifier.dense,
                              linear_relprop(pooled, model.classifier.out_proj, r, shared), shared)
    r_out, r_skip = add_relprop(out, h1, r_h2, normalized)
    r_n2 = linear_relprop(n2, layer.intermediate.dense, linear_relprop(act, layer.output.dense, r_out, shared),
                          shared)
    r_h1 = clone_relprop(h1, r_skip, r_n2)
    r_ao, r_skip = add_relprop(ao, x0, r_h1, normalized)
    r_ctx = split(linear_relprop(ctx, layer.attention.output.dense, r_ao, shared), h)
    r_a, r_v = matmul_relprop(a, v, r_ctx)
    r_q, r_kt = matmul_relprop(q, k.transpose(-1, -2), r_a)
    r_n1 = clone_relprop(n1, linear_relprop(n1, sa.query, merge(r_q), shared),
                         linear_relprop(n1, sa.key, merge(r_kt.transpose(-1, -2)), shared),
                         linear_relprop(n1, sa.value, merge(r_v), shared))
    return clone_relprop(x0, r_skip, r_n1).sum(-1), r_a


def _chefer_gpt_neox(model, ids, target, rule_set):
    """The chefer rules through a 1-layer GPT-NeoX whose block is parallel, ``x + attn(LN1(x)) + mlp(LN2(x))``:
    one residual ``Add`` (normalised for ``"chefer"``) of x and the branches' sum, the branches split
    proportionally (a plain sum); the rotary map of query and key a linear map (gradient × input, as every
    linear operation the rules leave alone); x a ``Clone`` into the sum and both LayerNorms."""
    from lrp_reference import add_relprop, clone_relprop, linear_relprop, matmul_relprop

    shared = normalized = rule_set == "chefer"
    base = model.base_model
    layer = base.layers[0]
    sa, mlp = layer.attention, layer.mlp
    n, h = ids.shape[0], model.config.num_attention_heads
    x0 = base.embed_in.weight[ids]
    n1, n2 = layer.input_layernorm(x0), layer.post_attention_layernorm(x0)
    qkv = sa.query_key_value(n1)
    q, k, v = qkv.view(n, h, -1).transpose(0, 1).chunk(3, -1)
    d = q.shape[-1]
    cos, sin = base.rotary_emb(x0, torch.arange(n)[None])
    rot = torch.eye(d, dtype=x0.dtype).repeat(n, 1, 1)
    rot[:, : cos.shape[-1], : cos.shape[-1]] = rotation(cos[0], sin[0])
    qr, kr = torch.einsum("nij,hnj->hni", rot, q), torch.einsum("nij,hnj->hni", rot, k)
    a = (qr @ kr.transpose(-1, -2) * d ** -0.5).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    ctx = merge(a @ v)
    o = sa.dense(ctx)
    act = mlp.act(mlp.dense_h_to_4h(n2))
    m = mlp.dense_4h_to_h(act)
    nf = base.final_layer_norm(x0 + o + m)
    r = torch.zeros_like(model.score(nf))
    r[n - 1, target] = 1.0
    r_h = linear_relprop(nf, model.score, r, shared)  # final LayerNorm: unchanged
    r_both, r_skip = add_relprop(o + m, x0, r_h, normalized)
    r_o, r_m = add_relprop(o, m, r_both, False)
    r_n2 = linear_relprop(n2, mlp.dense_h_to_4h, linear_relprop(act, mlp.dense_4h_to_h, r_m, shared), shared)
    r_a, r_v = matmul_relprop(a, v, split(linear_relprop(ctx, sa.dense, r_o, shared), h))
    r_qr, r_kt = matmul_relprop(qr, kr.transpose(-1, -2), r_a)
    r_q, r_k = rope_rel(q, rot, r_qr), rope_rel(k, rot, r_kt.transpose(-1, -2))
    r_qkv = torch.cat([r_q, r_k, r_v], -1).transpose(0, 1).reshape(n, -1)
    r_n1 = linear_relprop(n1, sa.query_key_value, r_qkv, shared)
    r_x0 = clone_relprop(x0, r_skip, r_n1, r_n2)  # both LayerNorms: unchanged
    return r_x0.sum(-1), r_a


def _chefer_opt(model, ids, target, rule_set):
    """The chefer rules through a 1-layer pre-LN OPT: as GPT-2's block (:func:`_chefer_gpt2`) with separate
    query/key/value Linears (the LayerNorm's output a ``Clone`` into the three), the query's scaling after its
    projection a constant factor (relevance unchanged), an inline ReLU (unchanged), positions in the input."""
    from lrp_reference import add_relprop, clone_relprop, linear_relprop, matmul_relprop

    shared = normalized = rule_set == "chefer"
    dec, layer, sa, n, h, x0, n1 = _opt_input(model, ids)
    q, k, v = split(sa.q_proj(n1) * sa.scaling, h), split(sa.k_proj(n1), h), split(sa.v_proj(n1), h)
    a = (q @ k.transpose(-1, -2)).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    ctx = merge(a @ v)
    o = sa.out_proj(ctx)
    h1 = x0 + o
    n2 = layer.final_layer_norm(h1)
    act = layer.fc1(n2).relu()
    m = layer.fc2(act)
    nf = dec.final_layer_norm(h1 + m)
    r = torch.zeros_like(model.score(nf))
    r[n - 1, target] = 1.0
    r_h2 = linear_relprop(nf, model.score, r, shared)  # final LayerNorm: unchanged
    r_m, r_skip = add_relprop(m, h1, r_h2, normalized)
    r_n2 = linear_relprop(n2, layer.fc1, linear_relprop(act, layer.fc2, r_m, shared), shared)  # ReLU: unchanged
    r_h1 = clone_relprop(h1, r_skip, r_n2)
    r_o, r_skip = add_relprop(o, x0, r_h1, normalized)
    r_a, r_v = matmul_relprop(a, v, split(linear_relprop(ctx, sa.out_proj, r_o, shared), h))
    r_q, r_kt = matmul_relprop(q, k.transpose(-1, -2), r_a)
    r_n1 = clone_relprop(n1, linear_relprop(n1, sa.q_proj, merge(r_q), shared),
                         linear_relprop(n1, sa.k_proj, merge(r_kt.transpose(-1, -2)), shared),
                         linear_relprop(n1, sa.v_proj, merge(r_v), shared))
    r_x0 = clone_relprop(x0, r_skip, r_n1)
    return r_x0.sum(-1), r_a


# pre-LN blocks: sequential, parallel, OPT's; XLM-RoBERTa-XL's sums inside its output modules
@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "opt", "xlm-roberta-xl"])
@pytest.mark.parametrize("rule_set", ["chefer", "chefer-lrp"])
def test_chefer_rules_on_a_pre_ln_block_equal_the_reference_relprop(rule_set, family):
    from lrp_reference import exact

    model = _one_layer(family)
    # ids where the normalised residual rule changes the result (it does only where a sum's parts take
    # relevance of opposite signs), and (XLM-RoBERTa-XL) no z+ denominator is 0, which would drop relevance
    ids = torch.tensor({"opt": [30, 16, 15, 4, 26, 31], "xlm-roberta-xl": [2, 11, 19, 11, 23, 3]}.get(
        family, [2, 7, 13, 21, 5, 3]))
    inputs = {"input_ids": ids[None], "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    with torch.no_grad(), exact():
        expected_input, expected_att = {"gpt2": _chefer_gpt2, "gpt_neox": _chefer_gpt_neox, "opt": _chefer_opt,
                                        "xlm-roberta-xl": _chefer_xlmr_xl}[family](model, ids, 2, rule_set)
    res = lrp_pass(model, inputs, 2, rules=rule_set)
    torch.testing.assert_close(res.input_relevance[0], expected_input, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(res.attention_relevance[0][0], expected_att, rtol=1e-9, atol=1e-10)
    assert expected_input.abs().max() > 1e-3
    if rule_set == "chefer":
        assert abs(float(expected_input.sum()) - 1) < 1e-9


def test_gemma2_capped_lm_logits_get_the_identity_rule():
    # Gemma 2's causal LM caps its logits inline, c tanh(z / c): the pass caps the raw logits itself under the
    # identity rule, so the relevance of the capped logit (not its gradient through tanh) reaches the input; the
    # config is restored; its sequence classifier (which applies no cap) is left alone
    import transformers

    cfg = make_model("gemma2").config
    cfg.final_logit_softcapping, cfg.attn_logit_softcapping = 0.5, 0.8
    torch.manual_seed(0)
    lm = transformers.Gemma2ForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    ids = torch.randint(5, 60, (2, 7), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    targets = torch.tensor([[6, 11], [6, 9]])
    res = lrp_pass(lm, inputs, targets, head=TokenLogitHead(), track_softmax=True)
    assert lm.config.final_logit_softcapping == 0.5
    with torch.no_grad():
        logits = lm(**inputs).logits
    torch.testing.assert_close(res.target, logits[[0, 1], [6, 6], [11, 9]])
    assert res.target.abs().max() > 0.25  # the cap bends these logits
    torch.testing.assert_close(res.input_relevance.sum(1) + res.softmax_absorbed, res.target, rtol=1e-6, atol=1e-8)
    chefer = lrp_pass(lm, inputs, targets, head=TokenLogitHead(), rules="chefer")
    torch.testing.assert_close(chefer.input_relevance.sum(1), torch.ones(2, dtype=torch.float64))
    cls = transformers.Gemma2ForSequenceClassification(cfg).eval()
    res = lrp_pass(cls, padded_batch(), [0, 1, 0])
    with torch.no_grad():
        torch.testing.assert_close(res.logits, cls(**padded_batch()).logits)


@pytest.mark.parametrize("rule_set", RULE_SETS)
def test_opt_350m_layout_post_ln_with_projections(rule_set):
    # OPT-350m: post-LN layers (do_layer_norm_before=False), word embeddings narrower than the hidden states
    # (project_in / project_out), no final LayerNorm: the stock values, conservation, padding and batch
    import transformers

    cfg = transformers.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=24,
                                 word_embed_proj_dim=8, do_layer_norm_before=False, max_position_embeddings=64,
                                 num_labels=3, pad_token_id=0, activation_function="gelu", attn_implementation="eager")
    torch.manual_seed(4)
    model = transformers.OPTForSequenceClassification(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
            elif name.endswith("bias"):
                p.zero_()
    assert model.model.decoder.project_in is not None and model.model.decoder.final_layer_norm is None
    inputs, targets = padded_batch(), [0, 1, 2]
    res = lrp_pass(model, inputs, targets, rules=rule_set, track_softmax=rule_set != "chefer")
    with torch.no_grad():
        torch.testing.assert_close(res.logits, model(**inputs).logits)
    if rule_set == "chefer":
        torch.testing.assert_close(res.input_relevance.sum(1), torch.ones(3, dtype=torch.float64))
    elif rule_set != "chefer-lrp":  # bias-free: CP exact, AttnLRP up to its softmaxes
        torch.testing.assert_close(res.input_relevance.sum(1) + res.softmax_absorbed, res.target)
    assert_padding_zero_and_batch_invariant(model, rule_set, rtol=1e-8, atol=1e-9, position=True)


FALCON_LAYOUTS = {  # beside the default Falcon-7B layout (parallel, one LayerNorm, multi-query, rotary)
    "falcon-40b": dict(new_decoder_architecture=True, num_kv_heads=1),  # two LayerNorms, grouped key/value
    "new-one-norm": dict(new_decoder_architecture=True, num_ln_in_parallel_attn=1, num_kv_heads=2),
    "sequential": dict(parallel_attn=False, multi_query=False, bias=True),
    "alibi": dict(alibi=True, parallel_attn=False, multi_query=False),  # ALiBi instead of rotary
}


@pytest.mark.parametrize("layout", list(FALCON_LAYOUTS))
@pytest.mark.parametrize("rule_set", RULE_SETS)
def test_falcon_layouts(layout, rule_set):
    # Falcon's layer and attention are its own code in three block layouts, three projection layouts and two
    # position schemes: the stock values, conservation (ALiBi's share -- which FalconModel also folds into the
    # mask -- measured as position relevance), chefer relevance 1, padding and batch
    import transformers

    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                    num_labels=3, pad_token_id=0, attn_implementation="eager",
                                    **FALCON_LAYOUTS[layout])
    torch.manual_seed(5)
    model = transformers.FalconForSequenceClassification(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
            elif name.endswith("bias") and "ln" not in name and "layernorm" not in name:
                p.zero_()
    inputs, targets = padded_batch(), [0, 1, 2]
    res = lrp_pass(model, inputs, targets, rules=rule_set, track_softmax=rule_set != "chefer")
    with torch.no_grad():
        torch.testing.assert_close(res.logits, model(**inputs).logits)
    total = res.input_relevance.sum(1) + res.position_relevance
    if rule_set == "chefer":
        torch.testing.assert_close(total, torch.ones(3, dtype=torch.float64))
    elif rule_set != "chefer-lrp":
        torch.testing.assert_close(total + res.softmax_absorbed, res.target)
    assert (res.position_relevance.abs().max() > 1e-6) == (layout == "alibi" and rule_set != "cp")
    assert_padding_zero_and_batch_invariant(model, rule_set, rtol=1e-8, atol=1e-9, position=True)


# ---------------------------------------------------------------- one forward, two rule sets
def _assert_same(joint, alone, inputs: bool, rtol: float = 1e-9, atol: float = 1e-12):
    for a, b in zip(joint.attention_relevance, alone.attention_relevance, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    torch.testing.assert_close(joint.position_relevance, alone.position_relevance, rtol=rtol, atol=atol)
    torch.testing.assert_close(joint.target, alone.target)
    if inputs:
        torch.testing.assert_close(joint.input_relevance, alone.input_relevance, rtol=rtol, atol=atol)
        torch.testing.assert_close(joint.word_relevance, alone.word_relevance, rtol=rtol, atol=atol)
    else:
        assert joint.input_relevance is None and joint.word_relevance is None


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "albert", "electra", "ernie", *ARCHS])
def test_one_forward_serves_the_chefer_and_attnlrp_rule_sets(family):
    """lrp_passes: the chefer-layout forward whose rules switch to AttnLRP's for the second backward gives
    both rule sets' own passes (float64, random biases and norm scales, padding)."""
    model = randomise_biases_and_norms(strong(family).double())
    ids = torch.tensor([[2, 7, 9, 11, 13, 3], [2, 8, 10, 3, 0, 0]])
    inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    chefer, attnlrp = lrp_passes(model, inputs, [0, 2])
    # DeBERTa's LayerNorm class computes in float32 whatever the model's dtype: the chefer-layout forward runs it
    tol = dict(rtol=1e-5, atol=1e-8) if family == "deberta" else {}
    _assert_same(chefer, lrp_pass(model, inputs, [0, 2], rules="chefer", inputs_relevance=False), False, **tol)
    _assert_same(attnlrp, lrp_pass(model, inputs, [0, 2], rules="attnlrp"), True, **tol)
    assert attnlrp.input_relevance.abs().max() > 1e-3


def _prefix_case(family: str, seed: int) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A float64 causal LM of ``family`` (the strong classifier's config), a 7-token sequence, its prefixes of 4 to
    7 tokens as rows, and a target token per row."""
    import transformers

    cls = strong(family)
    lm_class = "GPT2LMHeadModel" if family == "gpt2" else type(cls).__name__.replace("SequenceClassification",
                                                                                      "CausalLM")
    lm = randomise_biases_and_norms(getattr(transformers, lm_class)(cls.config).double())
    ids = torch.randint(5, 60, (1, 7), generator=torch.Generator().manual_seed(seed))
    rows = torch.tril(torch.ones(7, 7, dtype=torch.long))[3:]  # the prefixes of 4 ... 7 tokens
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return lm, inputs, rows, torch.tensor([11, 9, 40, 12])


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2", "falcon", "mixtral"])
def test_one_forward_serves_both_rule_sets_for_every_prefix(family):
    """The same through a generation's one pass over the sequence, each row a prefix (batched products)."""

    from attnlens.models.heads import LMHead

    lm, inputs, rows, targets = _prefix_case(family, seed=2)
    chefer, attnlrp = lrp_passes(lm, inputs, targets, head=LMHead(64), rows=rows)
    _assert_same(chefer, lrp_pass(lm, inputs, targets, head=LMHead(64), rules="chefer", rows=rows,
                                  inputs_relevance=False), False)
    _assert_same(attnlrp, lrp_pass(lm, inputs, targets, head=LMHead(64), rules="attnlrp", rows=rows), True)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mixtral", "qwen2", "gpt_neox", "phi3"])
def test_a_fused_pass_over_the_prefixes_equals_the_eager_one(family):
    """AttnLRP's fused pass over a generation's sequence (one backward per row, each recomputing the layers) gives
    every prefix the relevances of the eager pass's batched products, and keeps only the rows' logits."""

    from attnlens.lrp import runs_fused
    from attnlens.models.heads import LMHead

    lm, inputs, rows, targets = _prefix_case(family, seed=3)
    assert runs_fused(lm)
    eager = lrp_pass(lm, inputs, targets, head=LMHead(64), rows=rows)
    fused = lrp_pass(lm, inputs, targets, head=LMHead(64), rows=rows, fused=True, attention_relevance=False,
                     forward_kwargs={"logits_to_keep": 4})
    torch.testing.assert_close(fused.input_relevance, eager.input_relevance, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(fused.target, eager.target)
    assert fused.logits.shape[1] == 4 and not fused.attentions
    with pytest.raises(InputError, match="over a batch of inputs"):
        lrp_pass(lm, inputs, targets, head=LMHead(64), rules="chefer", rows=rows, fused=True)


# ---------------------------------------------------------------- fused attention (long inputs)
ALL_LRP = ["bert", "distilbert", "roberta", "electra", *ARCHS]
# attention computed by an LRP forward of the architecture's own (or a score cap), so never fused
UNFUSED = ("deberta", "deberta-v2", "mpnet", "gpt_neo", "gptj", "gemma2", "bloom", "falcon")


@pytest.mark.parametrize("family", ALL_LRP)
def test_fused_attnlrp_equals_the_eager_pass(family):
    """AttnLRP (ε = 0) through fused attention, each layer recomputed in the backward or its activations kept,
    gives the eager pass's input relevances, padded batch included; the probabilities are kept only where the
    model's attention cannot be fused (its own attention code, float32 scores, a score cap)."""
    from attnlens.lrp import runs_fused

    model = strong(family, biases=True)
    inputs, targets = padded_batch(), [0, 1, 2]
    eager = lrp_pass(model, inputs, targets)
    fused = lrp_pass(model, inputs, targets, fused=True)
    scale = eager.input_relevance.abs().max()
    torch.testing.assert_close(fused.input_relevance, eager.input_relevance, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(fused.word_relevance, eager.word_relevance, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(fused.target, eager.target, rtol=1e-5, atol=1e-6)
    kept = lrp_pass(model, inputs, targets, fused=True, recompute=False)
    torch.testing.assert_close(kept.input_relevance, fused.input_relevance, rtol=0, atol=1e-6 * scale)
    torch.testing.assert_close(kept.word_relevance, fused.word_relevance, rtol=0, atol=1e-6 * scale)
    assert (len(fused.attentions) == 0) == runs_fused(model)
    assert runs_fused(model) == (family not in UNFUSED)
    one = {k: v[:1] for k, v in inputs.items()}  # no padding: causality alone masks a decoder's attention
    torch.testing.assert_close(lrp_pass(model, one, 0, fused=True).input_relevance,
                               lrp_pass(model, one, 0).input_relevance, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_fused_attnlrp_takes_the_kernels_own_backward_where_it_has_one(monkeypatch, family):
    """Where PyTorch runs a fused attention kernel, AttnLRP's fused pass takes that kernel's backward (its
    gradients scaled): each layer's attention runs twice (the forward and the layer's recomputation), not a third
    time in its backward; where the kernel would fall back to the math path the attention is recomputed in the
    backward instead, with the same relevances. With grouped key heads (Mistral's) the kernel reads them as they
    are, and the pass keeps no copy per query head."""
    from attnlens.lrp import state

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(a[1].shape[1]) or real(*a, **k))  # key heads
    model = strong(family, biases=True).double()
    layers = model.config.num_hidden_layers
    inputs, targets = padded_batch(), [0, 1, 2]
    kernel = lrp_pass(model, inputs, targets, fused=True)
    assert len(calls) == 2 * layers
    assert set(calls) == {model.config.num_key_value_heads}
    calls.clear()
    monkeypatch.setattr(state, "fused_kernel", lambda *a, **k: False)
    recomputed = lrp_pass(model, inputs, targets, fused=True)
    assert len(calls) == 3 * layers
    torch.testing.assert_close(kernel.input_relevance, recomputed.input_relevance, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kernel.input_relevance, lrp_pass(model, inputs, targets).input_relevance,
                               rtol=1e-9, atol=1e-12)


def _fused_relevance(res, layer: int) -> torch.Tensor:
    n = res.output_grads[layer].shape[2]
    return res.relevance_rows(layer, torch.arange(n))


FUSABLE = [f for f in ALL_LRP if f not in UNFUSED]


@pytest.mark.parametrize("family", FUSABLE)
def test_fused_chefer_pass_gives_the_eager_attention_relevance(family):
    """Chefer et al.'s rules through fused attention (each layer recomputed, its probabilities recomputed a chunk of
    query rows at a time in the backward) give every layer's attention relevance of the eager pass, read back row
    by row, padded batch included; so do both rule sets of the joint pass."""
    from attnlens.core import row_attention

    model = strong(family, biases=True).double()  # float64: the comparison shows the rules, not the rounding
    inputs, targets = padded_batch(), [0, 1, 2]
    for rules in ("chefer", "chefer-lrp"):
        eager = lrp_pass(model, inputs, targets, rules=rules, inputs_relevance=False)
        with pytest.MonkeyPatch.context() as mp:  # several chunks of rows per layer
            mp.setattr(row_attention, "CHUNK_ELEMENTS", 40)
            mp.setattr("attnlens.core.row_attention.BACKWARD_CHUNK_ELEMENTS", 40)
            fused = lrp_pass(model, inputs, targets, rules=rules, inputs_relevance=False, fused=True)
        assert fused.attention_relevance == [] and fused.n_layers == eager.n_layers
        for layer in range(eager.n_layers):
            want = eager.attention_relevance[layer]
            got = _fused_relevance(fused, layer)
            mask = inputs["attention_mask"].bool()
            real = (mask[:, None, :, None] & mask[:, None, None, :]).expand_as(want)  # padding rows are not read
            torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-9 * want.abs().max())
        torch.testing.assert_close(fused.target, eager.target, rtol=1e-5, atol=1e-6)
    one = {k: v[:1] for k, v in inputs.items()}  # no padding: causality alone masks a decoder's attention
    eager = lrp_pass(model, one, 0, rules="chefer", inputs_relevance=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("attnlens.core.row_attention.BACKWARD_CHUNK_ELEMENTS", 40)
        fused = lrp_pass(model, one, 0, rules="chefer", inputs_relevance=False, fused=True)
    for layer in range(eager.n_layers):
        want = eager.attention_relevance[layer]
        torch.testing.assert_close(_fused_relevance(fused, layer), want, rtol=0, atol=1e-9 * want.abs().max())
    chefer, attnlrp = lrp_passes(model, inputs, targets, fused=True)
    eager_chefer, eager_attnlrp = lrp_passes(model, inputs, targets)
    scale = eager_attnlrp.input_relevance.abs().max()
    torch.testing.assert_close(attnlrp.input_relevance, eager_attnlrp.input_relevance, rtol=0, atol=1e-9 * scale)
    last = eager_chefer.n_layers - 1
    want = eager_chefer.attention_relevance[last]
    torch.testing.assert_close(_fused_relevance(chefer, last)[:, :, -1], want[:, :, -1], rtol=0,
                               atol=1e-9 * want.abs().max())


def test_fused_chefer_pass_recomputes_its_own_block_forwards(monkeypatch):
    """A pre-LN block under the chefer rules runs the rule's own forward (the instance's, not the class's), which
    the fused pass recomputes in the backward too: each block runs twice there, once in the eager pass."""
    from attnlens.lrp import modules

    calls = []
    real = modules.prenorm_block
    monkeypatch.setattr(modules, "prenorm_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = strong("llama")
    layers = model.config.num_hidden_layers
    lrp_pass(model, padded_batch(), [0, 1, 2], rules="chefer", inputs_relevance=False)
    assert len(calls) == layers
    calls.clear()
    lrp_pass(model, padded_batch(), [0, 1, 2], rules="chefer", inputs_relevance=False, fused=True)
    assert len(calls) == 2 * layers


def test_fused_pass_is_attnlrp_with_epsilon_zero_or_chefer_only():
    model = make_model("llama", num_labels=3)
    for kwargs in ({"rules": "cp"}, {"epsilon": 1e-3}, {"track_softmax": True}):
        with pytest.raises(InputError, match="fused LRP pass"):
            lrp_pass(model, padded_batch(), 0, fused=True, **kwargs)


@pytest.mark.parametrize("last_layer_only", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_a_pass_leaves_nothing_alive_behind(fused, last_layer_only):
    """After each rule set's pass (and the joint one) no pass state and no tensor of its graph survives, so its
    maps and activations are freed, also when the backward stops at the last layer and leaves the recomputed
    layers below it unrun (their checkpoints hold the patched forwards, which hold the state: a cycle through
    autograd's C++ nodes is beyond Python's collector, and every explanation would keep its pass's memory)."""
    import gc

    from attnlens.lrp.state import PassState

    def alive() -> tuple[int, int]:
        gc.collect()
        objects = gc.get_objects()
        return (sum(isinstance(o, PassState) for o in objects),
                sum(1 for o in objects if type(o) is torch.Tensor and o.grad_fn is not None))

    model = strong("llama")
    lrp_pass(model, padded_batch(), [0, 1, 2], fused=fused)  # a fused pass leaves a few tensors until the next one
    before = alive()
    assert before[0] == 0
    for rules in ("chefer", "chefer-lrp", "attnlrp", "cp"):
        for _ in range(2):  # nothing accumulates from one pass to the next
            # a fused AttnLRP pass keeps no probabilities, so it has no last layer's to stop at
            fusable = ("chefer",) if last_layer_only else ("chefer", "attnlrp")
            lrp_pass(model, padded_batch(), [0, 1, 2], rules=rules, fused=fused and rules in fusable,
                     inputs_relevance=rules not in ("chefer", "chefer-lrp") and not last_layer_only,
                     last_layer_only=last_layer_only)
            assert alive() == before, rules
    if fused and not last_layer_only:  # the fused AttnLRP pass keeping every layer's activations
        for _ in range(2):
            lrp_pass(model, padded_batch(), [0, 1, 2], fused=True, recompute=False)
            assert alive() == before
    lrp_passes(model, padded_batch(), [0, 1, 2], fused=fused, last_layer_only=last_layer_only)
    assert alive() == before


# ---------------------------------------------------------------- a pass that stops at the last layer
@pytest.mark.parametrize("family", ARCHS)
def test_a_pass_stopped_at_the_last_layer_gives_that_layers_attention_relevance(family):
    """``last_layer_only``: the backward stops at the last layer's attention, and its R(A) equals the whole pass's
    there, under every rule set, eager and (where the model fuses) fused, and for the chefer pass of the joint
    forward."""
    model = strong(family, biases=True).double()
    inputs, targets = padded_batch(), [0, 1, 2]
    mask = inputs["attention_mask"].bool()
    for rules in RULE_SETS:
        eps = 1e-3 if rules in ("attnlrp", "cp") else 0.0
        full = lrp_pass(model, inputs, targets, rules=rules, epsilon=eps, inputs_relevance=False)
        last = lrp_pass(model, inputs, targets, rules=rules, epsilon=eps, inputs_relevance=False,
                        last_layer_only=True)
        top = full.n_layers - 1
        assert last.first_layer == top and last.n_layers == full.n_layers and len(last.attention_relevance) == 1
        want = full.relevance_rows(top, torch.arange(mask.shape[1]))
        torch.testing.assert_close(last.relevance_rows(top, torch.arange(mask.shape[1])), want, rtol=0,
                                   atol=1e-12 * want.abs().max())
        torch.testing.assert_close(last.target, full.target)
        with pytest.raises(ValueError, match=f"layers {top} to {top}, not of layer 0"):
            last.relevance_rows(0, torch.arange(2))
    chefer, _ = lrp_passes(model, inputs, targets, last_layer_only=True)
    want = lrp_pass(model, inputs, targets, rules="chefer", inputs_relevance=False).attention_relevance[-1]
    torch.testing.assert_close(chefer.attention_relevance[0], want, rtol=0, atol=1e-12 * want.abs().max())
    if family in FUSABLE:
        fused = lrp_pass(model, inputs, targets, rules="chefer", inputs_relevance=False, fused=True,
                         last_layer_only=True)
        assert fused.first_layer == top and len(fused.output_grads) == 1
        got = fused.relevance_rows(top, torch.arange(mask.shape[1]))
        real = (mask[:, None, :, None] & mask[:, None, None, :]).expand_as(got)  # padding rows are not read
        full = lrp_pass(model, inputs, targets, rules="chefer", inputs_relevance=False).attention_relevance[-1]
        torch.testing.assert_close(got[real], full[real], rtol=0, atol=1e-9 * full.abs().max())


def test_a_pass_stopped_at_the_last_layer_runs_no_layer_below_it(monkeypatch):
    """The fused pass that stops at the last layer recomputes that layer alone in its backward (a whole pass
    recomputes every layer), and the eager one sends no gradient below it."""
    from attnlens.lrp import modules

    calls = []
    real = modules.prenorm_block
    monkeypatch.setattr(modules, "prenorm_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = strong("llama")
    layers = model.config.num_hidden_layers
    lrp_pass(model, padded_batch(), [0, 1, 2], rules="chefer", inputs_relevance=False, fused=True,
             last_layer_only=True)
    assert len(calls) == layers + 1
    seen = []
    hook = model.model.layers[0].mlp.register_full_backward_hook(lambda *a: seen.append(1))
    lrp_pass(model, padded_batch(), [0, 1, 2], rules="chefer", inputs_relevance=False)
    assert seen
    seen.clear()
    lrp_pass(model, padded_batch(), [0, 1, 2], rules="chefer", inputs_relevance=False, last_layer_only=True)
    hook.remove()
    assert not seen
    with pytest.raises(InputError, match="stops at the last layer"):
        lrp_pass(model, padded_batch(), 0, rules="attnlrp", last_layer_only=True)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_pass_stopped_at_the_last_layer_over_prefixes(family):
    """The same over a generation's prefixes (batched products through the one pass)."""

    from attnlens.models.heads import LMHead

    lm, inputs, rows, targets = _prefix_case(family, seed=2)
    full = lrp_pass(lm, inputs, targets, head=LMHead(64), rules="chefer", rows=rows, inputs_relevance=False)
    last = lrp_pass(lm, inputs, targets, head=LMHead(64), rules="chefer", rows=rows, inputs_relevance=False,
                    last_layer_only=True)
    want = full.attention_relevance[-1]
    assert last.attention_relevance[0].shape == want.shape
    torch.testing.assert_close(last.attention_relevance[0], want, rtol=0, atol=1e-12 * want.abs().max())
