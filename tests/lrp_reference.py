"""An independent, plain re-computation of Chefer et al.'s BERT relevance propagation, for tests only.

It follows the relprop rules of the authors' code (``hila-chefer/Transformer-Explainability``,
``BERT_explainability/modules/layers_ours.py`` and ``layers_lrp.py``, run by ``modules/BERT/BERT.py`` and
``ExplanationGenerator.py``; AttCAT vendors the same files) module by module, on a stock HF
``BertForSequenceClassification``, one example at a time (batch size 1, no padding), with explicit matrices and
no autograd tricks. Written from the reference rules, not copied:

* ``Linear``: z+ rule (alpha = 1, beta = 0), bias ignored; ``layers_ours``: one denominator
  ``Z = W+ x+ + W- x-``; ``layers_lrp``: ``x+`` divided by ``W+ x+`` and ``x-`` by ``W- x-`` separately.
* ``Add``: proportional split ``R_a = a R / (a + b)``; ``layers_ours`` then rescales each operand's map so that
  its total is ``|sum R_a| / (|sum R_a| + |sum R_b|) * sum R`` (sums over the whole tensor).
* ``MatMul`` (``Q K^T``, ``A V``): proportional split to both factors (``x * grad`` of ``<Z, R / Z>``), each
  halved by ``BertSelfAttention.relprop``; R(A) is the relevance of the probabilities after that halving.
* ``Clone``: ``x * sum_i R_i / x``. ``IndexSelect`` (pooler): ``x * R / x`` at the selected row.
* ``LayerNorm``, ``Softmax``, ``GELU``, ``Tanh``, ``Dropout``: relevance passes unchanged.
* Division is their ``safe_divide``: ``a / (b + 1e-9)``, and 0 where ``b == 0`` (``exact()``: no 1e-9).
* Start: a one-hot relevance 1 at the target logit; ``∇A`` is the plain gradient of the target logit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

EPS = [1e-9]  # their safe_divide stabiliser; set EPS[0] = 0 (see ``exact``) for exact division


def safe_divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    eps = EPS[0]
    den = b.clamp(min=eps) + b.clamp(max=eps) if eps else b
    den = den + (den == 0).to(den.dtype) * (eps or 1.0)
    return a / den * (b != 0).to(b.dtype)


@contextmanager
def exact() -> Iterator[None]:
    """``with exact():`` divisions without the 1e-9 stabiliser (to compare rules, not rounding)."""
    old, EPS[0] = EPS[0], 0.0
    try:
        yield
    finally:
        EPS[0] = old


def linear_relprop(x: torch.Tensor, lin: nn.Linear, r: torch.Tensor, shared: bool) -> torch.Tensor:
    """z+ rule of their ``Linear.relprop`` with alpha = 1 (the beta = 0 inhibitor term vanishes)."""
    w_pos, w_neg = lin.weight.clamp(min=0), lin.weight.clamp(max=0)
    x_pos, x_neg = x.clamp(min=0), x.clamp(max=0)
    z_pos, z_neg = x_pos @ w_pos.T, x_neg @ w_neg.T
    if shared:  # layers_ours.py
        s_pos = s_neg = safe_divide(r, z_pos + z_neg)
    else:  # layers_lrp.py
        s_pos, s_neg = safe_divide(r, z_pos), safe_divide(r, z_neg)
    return x_pos * (s_pos @ w_pos) + x_neg * (s_neg @ w_neg)


def add_relprop(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor, normalized: bool):
    s = safe_divide(r, a + b)
    ra, rb = a * s, b * s
    if not normalized:  # layers_lrp.py: Add is RelPropSimple
        return ra, rb
    a_sum, b_sum = ra.sum(), rb.sum()
    a_fact = safe_divide(a_sum.abs(), a_sum.abs() + b_sum.abs()) * r.sum()
    b_fact = safe_divide(b_sum.abs(), a_sum.abs() + b_sum.abs()) * r.sum()
    return ra * safe_divide(a_fact, ra.sum()), rb * safe_divide(b_fact, rb.sum())


def matmul_relprop(x0: torch.Tensor, x1: torch.Tensor, r: torch.Tensor):
    """Both factors' relevance of ``x0 @ x1`` (batched over leading dims), halved as in BertSelfAttention."""
    s = safe_divide(r, x0 @ x1)
    return x0 * (s @ x1.transpose(-1, -2)) / 2, x1 * (x0.transpose(-1, -2) @ s) / 2


def clone_relprop(x: torch.Tensor, *rs: torch.Tensor) -> torch.Tensor:
    return x * sum(safe_divide(r, x) for r in rs)


def chefer_relprop(model, ids: torch.Tensor, target: int, rules: str = "chefer"):
    """Forward a stock HF BERT classifier on one unpadded example ``ids`` (N,) and propagate relevance back.

    Returns ``(logits (C,), R(A) per layer (H, N, N), ∇A per layer (H, N, N))``; ``rules`` is ``"chefer"``
    (``layers_ours.py``) or ``"chefer-lrp"`` (``layers_lrp.py``).
    """
    shared = normalized = rules == "chefer"
    bert, n = model.bert, ids.shape[0]
    emb = bert.embeddings
    n_heads = model.config.num_attention_heads
    heads = lambda t: t.view(n, n_heads, -1).transpose(0, 1)  # noqa: E731  (N, D) -> (H, N, d)
    flat = lambda t: t.transpose(0, 1).reshape(n, -1)  # noqa: E731  (H, N, d) -> (N, D)
    act = nn.functional.gelu if model.config.hidden_act == "gelu" else None
    assert act is not None, "the reference covers GELU BERTs"

    with torch.enable_grad():
        h = emb.LayerNorm(emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[:n]
                          + emb.token_type_embeddings.weight[0])
        saved, probs = [], []
        for layer in bert.encoder.layer:
            sa, so = layer.attention.self, layer.attention.output
            q, k, v = heads(sa.query(h)), heads(sa.key(h)), heads(sa.value(h))
            scores = q @ k.transpose(-1, -2)
            a = (scores / sa.attention_head_size ** 0.5).softmax(-1)
            probs.append(a)
            ctx = flat(a @ v)
            ao = so.dense(ctx)
            h1 = so.LayerNorm(ao + h)
            inter = layer.intermediate.dense(h1)
            hid = act(inter)
            out = layer.output.dense(hid)
            h2 = layer.output.LayerNorm(out + h1)
            saved.append(dict(h=h, q=q, k=k, v=v, a=a, ctx=ctx, ao=ao, h1=h1, hid=hid, out=out))
            h = h2
        pooled = torch.tanh(bert.pooler.dense(h[0]))
        logits = model.classifier(pooled)
        grads = torch.autograd.grad(logits[target], probs)

    with torch.no_grad():
        r = torch.zeros_like(logits)
        r[target] = 1.0
        r = linear_relprop(pooled, model.classifier, r, shared)  # classifier; dropout, tanh: identity
        r0 = linear_relprop(h[0], bert.pooler.dense, r, shared)
        r = torch.zeros_like(h)
        r[0] = h[0] * safe_divide(r0, h[0])  # IndexSelect of the [CLS] row
        att_rel = []
        for layer, s in reversed(list(zip(bert.encoder.layer, saved))):
            sa, so = layer.attention.self, layer.attention.output
            # BertOutput: LayerNorm (identity), Add, dense; BertIntermediate: GELU (identity), dense; Clone
            r_out, r_skip = add_relprop(s["out"], s["h1"], r, normalized)
            r_inter = linear_relprop(s["hid"], layer.output.dense, r_out, shared)
            r_h1 = clone_relprop(s["h1"], linear_relprop(s["h1"], layer.intermediate.dense, r_inter, shared), r_skip)
            # BertSelfOutput
            r_ao, r_skip = add_relprop(s["ao"], s["h"], r_h1, normalized)
            r_ctx = heads(linear_relprop(s["ctx"], so.dense, r_ao, shared))
            # BertSelfAttention: A V, softmax (identity), mask add (zero mask: identity), Q K^T
            r_a, r_v = matmul_relprop(s["a"], s["v"], r_ctx)
            att_rel.append(r_a)
            r_q, r_kt = matmul_relprop(s["q"], s["k"].transpose(-1, -2), r_a)
            r_hq = linear_relprop(s["h"], sa.query, flat(r_q), shared)
            r_hk = linear_relprop(s["h"], sa.key, flat(r_kt.transpose(-1, -2)), shared)
            r_hv = linear_relprop(s["h"], sa.value, flat(r_v), shared)
            r = clone_relprop(s["h"], clone_relprop(s["h"], r_hq, r_hk, r_hv), r_skip)
    return logits.detach(), att_rel[::-1], [g.detach() for g in grads]


def rollout_row(grads, rels, start_layer: int = 0) -> torch.Tensor:
    """``generate_LRP``: rollout of mean_h clamp(∇A ⊙ R(A), 0) + I, row-normalised, from ``start_layer``; row 0
    (without their in-place overwrite of the [0, 0] entry)."""
    joint = None
    for g, r in list(zip(grads, rels))[start_layer:]:
        m = (g * r).clamp(min=0).mean(0)
        m = m + torch.eye(m.shape[-1], dtype=m.dtype)
        m = m / m.sum(-1, keepdim=True)
        joint = m if joint is None else m @ joint
    return joint[0]


def last_layer_row(rels) -> torch.Tensor:
    """``generate_LRP_last_layer``: mean_h clamp(R(A^L), 0), row 0 (without the [0, 0] overwrite)."""
    return rels[-1].clamp(min=0).mean(0)[0]
