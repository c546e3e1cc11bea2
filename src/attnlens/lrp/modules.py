"""LRP forwards of the modules the generic patches do not reach, named by architecture entries.

An :class:`attnlens.models.architectures.LRPSupport` maps a module class to one of :data:`FORWARDS`; during an LRP
pass that forward replaces the instance's own (``fn(module, state, *args, **kwargs)``). Each computes the
stock module's values, with the LRP rules on its inline operations: nonlinearities that are not modules, gated
products, RMSNorm, an attention that does not call transformers' attention interface (DeBERTa-v2), and the
pre-LN residual sums that ``rules="chefer"`` rescales (:func:`prenorm_block`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..errors import ModelError
from ..models.architectures import PreNorm
from . import rules
from .state import CHEFER, PassState, attend, score_product


def pooled_tanh_head(head: nn.Module, state: PassState, pooled: torch.Tensor) -> torch.Tensor:
    """A classification head ``out_proj(tanh(dense(pooled)))`` given the pooled state (BART's, mBART's and T5's:
    the last EOS): identity rule on its inline tanh."""
    x = rules.identity_rule(torch.tanh, head.dense(head.dropout(pooled)))
    return head.out_proj(head.dropout(x))


def tanh_head(head: nn.Module, state: PassState, features: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``RobertaClassificationHead``: :func:`pooled_tanh_head` of the first token."""
    return pooled_tanh_head(head, state, features[:, 0, :])


def deberta_pooler(pooler: nn.Module, state: PassState, hidden_states: torch.Tensor) -> torch.Tensor:
    """DeBERTa's ``ContextPooler``: identity rule on its activation (looked up inline, not a submodule)."""
    x = pooler.dense(pooler.dropout(hidden_states[:, 0]))
    return rules.identity_rule(ACT2FN[pooler.config.pooler_hidden_act], x)


def rms_norm(norm: nn.Module, state: PassState, x: torch.Tensor) -> torch.Tensor:
    """Llama-family RMSNorm: constant root mean square (:func:`rules.rms_norm`); under the chefer rule sets the
    module passes relevance through unchanged, as their LayerNorm does (the same values: :func:`rules.rms_norm`
    computes the stock module's, and keeps a float64 input float64)."""
    if state.rules in CHEFER:
        return rules.pass_through(partial(rules.rms_norm, norm), x, rules.rms_norm_backward(norm), state)
    return rules.rms_norm(norm, x)


def gated_mlp(mlp: nn.Module, state: PassState, x: torch.Tensor) -> torch.Tensor:
    """Llama-family MLP ``down(act(gate(x)) * up(x))``: identity rule on ``act`` (a patched module), uniform
    rule on the gating product (CP-LRP: the gate is a constant, :func:`rules.gated`)."""
    return mlp.down_proj(rules.gated(mlp.act_fn(mlp.gate_proj(x)), mlp.up_proj(x), state.rules == "cp"))


def t5_gated_ffn(ffn: nn.Module, state: PassState, hidden_states: torch.Tensor) -> torch.Tensor:
    """T5 v1.1's (and Flan-T5's) feed-forward ``wo(act(wi_0(x)) * wi_1(x))``: as :func:`gated_mlp`."""
    gated = rules.gated(ffn.act(ffn.wi_0(hidden_states)), ffn.wi_1(hidden_states), state.rules == "cp")
    return ffn.wo(ffn.dropout(gated).to(ffn.wo.weight.dtype))


def fused_gated_mlp(mlp: nn.Module, state: PassState, hidden_states: torch.Tensor) -> torch.Tensor:
    """Phi-3's MLP ``down(up * act(gate))`` with gate and up from one fused projection: as :func:`gated_mlp`."""
    gate, up = mlp.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return mlp.down_proj(rules.gated(mlp.activation_fn(gate), up, state.rules == "cp"))


def sparse_moe(block: nn.Module, state: PassState, hidden_states: torch.Tensor) -> torch.Tensor:
    """Mixtral's mixture of experts ``sum_e w_e(x) E_e(x)`` over each token's top-k experts, with the LRP rules:
    the router logits a weighted sum (:func:`rules.weighted_sum`); the routing weights -- transformers'
    top-k probabilities renormalised, i.e. a softmax over the selected logits -- under the softmax rule as
    attention's (its true gradient; the chefer sets: identity); each expert a gated MLP (:func:`gated_mlp`'s
    rule, its weights as weighted sums); each expert's output times its weight a gated product (uniform rule;
    CP-LRP: the weight a constant); the sum over experts proportional."""
    batch, n, dim = hidden_states.shape
    x = hidden_states.reshape(-1, dim)
    router, experts = block.gate, block.experts
    logits = rules.weighted_sum(state.rules, x, router.weight, state.epsilon, state)
    with torch.no_grad():  # the selection itself (which experts) is discrete
        top = torch.topk(logits.float().softmax(-1), router.top_k, dim=-1).indices
    selected = logits.gather(-1, top).float().view(batch, n, -1)
    if state.rules in CHEFER:
        weights = rules.pass_through(partial(torch.softmax, dim=-1), selected, rules.softmax_backward, state)
    else:
        weights = selected.softmax(-1)
        if state.track_softmax and state.rules != "cp":  # the relevance this softmax absorbs
            state.other_softmaxes.append((weights, selected))
    weights = weights.reshape(batch * n, -1)
    out = torch.zeros_like(x)
    for e in range(experts.num_experts):
        token, slot = torch.where(top == e)
        if token.numel() == 0:
            continue
        gate, up = rules.weighted_sum(state.rules, x[token], experts.gate_up_proj[e], state.epsilon,
                                      state).chunk(2, -1)
        y = rules.weighted_sum(state.rules, rules.gated(experts.act_fn(gate), up, state.rules == "cp"),
                               experts.down_proj[e], state.epsilon, state)
        y = rules.gated(weights[token, slot, None], y, state.rules == "cp")
        out = out.index_add(0, token, y.to(out.dtype))
    return out.reshape(batch, n, dim)


def glu_mlp(mlp: nn.Module, state: PassState, hidden_states: torch.Tensor) -> torch.Tensor:
    """ModernBERT's GeGLU MLP ``Wo(act(input) * gate)`` with ``input, gate = Wi(x)``: as :func:`gated_mlp`, the
    activated half being the gate."""
    inp, up = mlp.Wi(hidden_states).chunk(2, dim=-1)
    return mlp.Wo(mlp.drop(rules.gated(mlp.act(inp), up, state.rules == "cp")))


def prenorm_block(spec: PreNorm, block: nn.Module, state: PassState, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A pre-LN block ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))`` with Chefer et al.'s normalised
    residual rule on both sums (``rules="chefer"`` only); a parallel block's one sum ``x + attn + mlp`` with the
    two branches as one operand. The block's own arguments are passed on to its
    attention, as its forward does."""
    bound = inspect.signature(type(block).forward).bind(block, *args, **kwargs)
    named = dict(bound.arguments)
    named.pop("self")
    extra = named.pop("kwargs", {})
    x = named.pop("hidden_states")
    if named.get("encoder_hidden_states") is not None:
        raise ModelError("LRP rules='chefer' does not support blocks with cross-attention")
    attn_out = getattr(block, spec.attn)(getattr(block, spec.norm1)(x), **named, **extra)
    branch = attn_out[0] if isinstance(attn_out, tuple) else attn_out
    if spec.post1:  # a sandwich norm on the branch (Gemma 2)
        branch = getattr(block, spec.post1)(branch)
    if spec.is_parallel(block):  # x + attn(norm1(x)) + mlp(norm2(x)): one sum, the two branches one operand
        mlp = getattr(block, spec.mlp)(getattr(block, spec.norm2)(x))
        both = branch + (mlp[0] if isinstance(mlp, tuple) else mlp)
        out = rules.normalized_residual(x + both, both, state)
    else:
        h = rules.normalized_residual(x + branch, branch, state)
        branch = getattr(block, spec.mlp)(getattr(block, spec.norm2)(h))
        branch = branch[0] if isinstance(branch, tuple) else branch
        if spec.post2:
            branch = getattr(block, spec.post2)(branch)
        out = rules.normalized_residual(h + branch, branch, state)
    return (out, attn_out[1] if isinstance(attn_out, tuple) else None) if spec.returns_weights(block) else out


def deberta_attention(
    attn: nn.Module, state: PassState, hidden_states: torch.Tensor, attention_mask: torch.Tensor,
    output_attentions: bool = False, query_states: torch.Tensor | None = None,
    relative_pos: torch.Tensor | None = None, rel_embeddings: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeBERTa-v2's ``DisentangledSelfAttention`` with the LRP rules: the content-content ``Q K^T`` and the
    content-position / position-content products are each a :func:`score_product`; masked softmax and ``A V``
    as every attention (:func:`attend`). The relative-position embeddings enter as per-example leaves
    (:meth:`PassState.position_leaf`): the relevance they take is absorbed by these parameters."""
    hf = sys.modules[type(attn).__module__]  # the model's own helpers (relative positions, scales)
    heads = attn.num_attention_heads
    split: Callable[[torch.Tensor], torch.Tensor] = partial(attn.transpose_for_scores, attention_heads=heads)
    q_in = hidden_states if query_states is None else query_states
    q, k, v = split(attn.query_proj(q_in)), split(attn.key_proj(hidden_states)), split(attn.value_proj(hidden_states))
    factor = 1 + ("c2p" in attn.pos_att_type) + ("p2c" in attn.pos_att_type)
    scores = score_product(state, torch.bmm(q, k.transpose(-1, -2))) / hf.scaled_size_sqrt(q, factor).to(q.dtype)
    if attn.relative_attention:
        scores = scores + _deberta_position_scores(hf, attn, state, split, q, k, relative_pos, rel_embeddings, factor)
    batch = hidden_states.shape[0]
    scores = scores.view(batch, heads, scores.size(-2), scores.size(-1))
    scores = scores.masked_fill(~attention_mask.bool(), torch.finfo(q.dtype).min)
    out, probs = attend(state, scores, v.view(batch, heads, v.size(-2), v.size(-1)))
    context = out.permute(0, 2, 1, 3).reshape(batch, out.size(2), -1)
    return context, (probs if output_attentions else None)


def deberta_v1_attention(
    attn: nn.Module, state: PassState, hidden_states: torch.Tensor, attention_mask: torch.Tensor,
    output_attentions: bool = False, query_states: torch.Tensor | None = None,
    relative_pos: torch.Tensor | None = None, rel_embeddings: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeBERTa's (v1) ``DisentangledSelfAttention`` with the LRP rules: one projection gives each head's query,
    key and value, the query and value biases added after it (the projection and those biases one weighted sum,
    :func:`rules.weighted_sum`); the query scaled by 1/√(d · factor) before every product; the content-content
    ``Q K^T`` and the content-position / position-content products each a :func:`score_product`, the
    relative-position embeddings per-example leaves (their relevance is ``position_relevance``); masked softmax
    and ``A V`` as every attention (:func:`attend`)."""
    if query_states is not None or attn.talking_head:
        raise ModelError("LRP supports DeBERTa's self-attention, not separate query states or talking heads")
    hf = sys.modules[type(attn).__module__]  # the model's own helpers (relative positions, scales)
    heads, width = attn.num_attention_heads, attn.all_head_size
    split = attn.transpose_for_scores
    bias = torch.zeros(3 * width, dtype=hidden_states.dtype, device=hidden_states.device)
    layout = bias.view(heads, 3, -1)  # each head's slice: query, key, value
    layout[:, 0] = attn.q_bias.view(heads, -1).to(bias.dtype)
    layout[:, 2] = attn.v_bias.view(heads, -1).to(bias.dtype)
    projected = rules.weighted_sum(state.rules, hidden_states, attn.in_proj.weight, state.epsilon, state, bias)
    q, k, v = split(projected).chunk(3, dim=-1)
    factor = 1 + len(attn.pos_att_type)
    q = q / hf.scaled_size_sqrt(q, factor).to(q.dtype)
    scores = score_product(state, torch.matmul(q, k.transpose(-1, -2)))
    if attn.relative_attention and rel_embeddings is not None and relative_pos is not None:
        scores = scores + _deberta_v1_position_scores(hf, attn, state, split, q, k, relative_pos, rel_embeddings,
                                                      factor)
    scores = scores.masked_fill(~attention_mask.bool(), torch.finfo(q.dtype).min)
    out, probs = attend(state, scores, v)
    context = out.permute(0, 2, 1, 3).reshape(out.size(0), out.size(2), -1)
    return context, (probs if output_attentions else None)


def _four_dims(relative_pos: torch.Tensor) -> torch.Tensor:
    """DeBERTa's relative positions ``(N, N)``, ``(B, N, N)`` or ``(B, H, N, N)`` as 4-D, as its attention reads
    them."""
    if relative_pos.dim() == 2:
        return relative_pos.unsqueeze(0).unsqueeze(0)
    if relative_pos.dim() == 3:
        return relative_pos.unsqueeze(1)
    if relative_pos.dim() != 4:
        raise ModelError(f"DeBERTa relative positions must have 2, 3 or 4 dims, got {relative_pos.dim()}")
    return relative_pos


def _deberta_v1_position_scores(hf, attn, state, split, q, k, relative_pos, rel_embeddings, factor) -> torch.Tensor:
    # DisentangledSelfAttention.disentangled_att_bias (v1), with per-example position leaves and score rules
    relative_pos = _four_dims(relative_pos).long()
    span = hf.compute_attention_span(q, k, attn.max_relative_positions)
    table = attn.pos_dropout(rel_embeddings)[attn.max_relative_positions - span: attn.max_relative_positions + span]
    rel = state.position_leaf(table, q.size(0))
    score = torch.zeros((), dtype=q.dtype, device=q.device)
    if "c2p" in attn.pos_att_type:
        c2p = score_product(state, torch.matmul(q, split(attn.pos_proj(rel)).transpose(-1, -2)))
        c2p_pos = torch.clamp(relative_pos + span, 0, span * 2 - 1)
        score = score + torch.gather(c2p, -1, hf.c2p_dynamic_expand(c2p_pos, q, relative_pos))
    if "p2c" in attn.pos_att_type:
        pos_q = split(attn.pos_q_proj(rel))
        pos_q = pos_q / hf.scaled_size_sqrt(pos_q, factor).to(pos_q.dtype)
        p2c_pos = torch.clamp(-hf.build_rpos(q, k, relative_pos) + span, 0, span * 2 - 1)
        p2c = score_product(state, torch.matmul(k, pos_q.transpose(-1, -2)))
        p2c = torch.gather(p2c, -1, hf.p2c_dynamic_expand(p2c_pos, q, k)).transpose(-1, -2)
        score = score + hf.uneven_size_corrected(p2c, q, k, relative_pos)
    return score


def own_attention(attn: nn.Module, state: PassState, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-Neo's and GPT-J's ``_attn`` (their attention does not call transformers' attention interface; GPT-J's
    does since transformers 5.24, and has no ``_attn``) with the LRP rules: the scores in float32 as theirs,
    GPT-J's ``1 / sqrt(d)`` scaling (GPT-Neo has none), GPT-Neo's causal or local-window mask from its ``bias``
    buffer, then the padding/causal mask, softmax and ``A V`` as every attention (:func:`attend`). Returns
    ``(A V (B, H, Q, d), A)`` as ``_attn`` does."""
    scores = score_product(state, torch.matmul(query.to(torch.float32), key.to(torch.float32).transpose(-1, -2)))
    if getattr(attn, "scale_attn", None) is not None:
        scores = scores / attn.scale_attn
    window = getattr(attn, "bias", None)
    if window is not None:
        q_len, k_len = query.size(-2), key.size(-2)
        allowed = window[:, :, k_len - q_len : k_len, :k_len]
        scores = torch.where(allowed, scores, torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype,
                                                           device=scores.device))
    if attention_mask is not None:
        scores = scores + attention_mask
    return attend(state, scores, value)


def mpnet_attention(attn: nn.Module, state: PassState, hidden_states: torch.Tensor,
                    attention_mask: torch.Tensor | None = None, position_bias: torch.Tensor | None = None,
                    output_attentions: bool = False, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """MPNet's ``MPNetSelfAttention`` (its own code) with the LRP rules: scores ``Q K^T / sqrt(d)`` plus the
    encoder's relative-position bias (a constant per example, as BLOOM's ALiBi: the share of the scores'
    relevance it takes is measured as ``position_relevance``, :meth:`PassState.position_bias`), softmax and
    ``A V`` as every attention (:func:`attend`), the output projection ``o``."""
    batch, n, _ = hidden_states.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, n, -1, attn.attention_head_size).transpose(1, 2)

    q, k, v = split(attn.q(hidden_states)), split(attn.k(hidden_states)), split(attn.v(hidden_states))
    scores = score_product(state, torch.matmul(q, k.transpose(-1, -2))) / attn.attention_head_size ** 0.5
    if position_bias is not None:
        scores = scores + state.position_bias(position_bias)
    if attention_mask is not None:
        scores = scores + attention_mask
    out, probs = attend(state, scores, v)
    o = attn.o(out.transpose(1, 2).reshape(batch, n, attn.all_head_size))
    return (o, probs) if output_attentions else (o,)


def dense_residual(module: nn.Module, state: PassState, hidden_states: torch.Tensor, input_tensor: torch.Tensor
                   ) -> torch.Tensor:
    """A pre-LN encoder's output module that adds the residual itself, ``dropout(dense(h)) + input`` (XLM-RoBERTa-XL's
    ``SelfOutput`` and ``Output``): the sum under :func:`_residual_add`."""
    branch = module.dense(hidden_states)
    dropout = getattr(module, "dropout", None)
    return _residual_add(state, input_tensor, dropout(branch) if dropout is not None else branch)


def _residual_add(state: PassState, skip: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """``skip + branch``, under ``rules="chefer"`` with the normalised residual rule (layers that add their own
    residuals: OPT, BLOOM; ``LRPSupport.own_sums``)."""
    return rules.normalized_residual(skip + branch, branch, state) if state.rules == "chefer" else skip + branch


def activation(module: nn.Module, state: PassState, x: torch.Tensor) -> torch.Tensor:
    """An element-wise activation module of a model's own (BLOOM's ``BloomGelu``): the identity rule."""
    return rules.identity_rule(partial(type(module).forward, module), x)


def bloom_attention(attn: nn.Module, state: PassState, hidden_states: torch.Tensor, residual: torch.Tensor,
                    alibi: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """BLOOM's attention (its own code, which also adds the residual) with the LRP rules: the fused per-head
    query/key/value, scores ``Q K^T / sqrt(d) + ALiBi`` (the ALiBi bias a constant: the share of the scores'
    relevance it takes is measured as ``position_relevance``, :meth:`PassState.position_bias`), softmax and
    ``A V`` as every attention (:func:`attend`), the output projection, and the residual sum
    (:func:`_residual_add`). ``pretraining_tp`` slicing of the projection (``slow_but_exact``) changes only the
    summation order and is not replicated."""
    batch, n, _ = hidden_states.shape
    q, k, v = attn._reshape(attn.query_key_value(hidden_states))
    if kwargs.get("layer_past") is not None:  # the model's (empty) cache: keep it as the stock forward does
        k, v = kwargs["layer_past"].update(k, v, attn.layer_idx)
    scores = score_product(state, torch.matmul(q, k.transpose(-1, -2))) * attn.inv_norm_factor
    scores = scores + attn.beta * state.position_bias(alibi.view(batch, attn.num_heads, -1)).unsqueeze(2)
    if attention_mask is not None:
        scores = scores + attention_mask
    out, probs = attend(state, scores, v)
    context = attn._merge_heads(out.reshape(batch * attn.num_heads, n, attn.head_dim))
    return _residual_add(state, residual, attn.dense(context)), probs


def bloom_mlp(mlp: nn.Module, state: PassState, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """BLOOM's MLP (which adds the residual itself): ``dense_4h_to_h(gelu(dense_h_to_4h(x)))`` + residual."""
    return _residual_add(state, residual, mlp.dense_4h_to_h(mlp.gelu_impl(mlp.dense_h_to_4h(hidden_states))))


def falcon_attention(attn: nn.Module, state: PassState, hidden_states: torch.Tensor, alibi: torch.Tensor | None,
                     attention_mask: torch.Tensor | None, position_embeddings: tuple | None = None,
                     layer_past: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Falcon's attention (its own code) with the LRP rules: the fused query/key/value of its three layouts
    (``_split_heads``: per head, multi-query, grouped), rotary query and key (linear) or ALiBi (a per-example
    leaf, as BLOOM's: ``(Q K^T + ALiBi) / sqrt(d)``, plus the mask into which ``FalconModel`` folds ALiBi again,
    also a leaf), one key/value head shared by all query heads under
    multi-query (broadcast, as Falcon's), softmax and ``A V`` as every attention (:func:`attend`)."""
    q, k, v = attn._split_heads(attn.query_key_value(hidden_states))  # (B, N, heads, d)
    batch, n = q.shape[:2]
    kv_heads = attn.num_heads if attn.new_decoder_architecture else attn.num_kv_heads
    q = q.transpose(1, 2).reshape(batch, attn.num_heads, n, attn.head_dim)
    k = k.transpose(1, 2).reshape(batch, kv_heads, n, attn.head_dim)
    v = v.transpose(1, 2).reshape(batch, kv_heads, n, attn.head_dim)
    if alibi is None:
        cos, sin = position_embeddings
        q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    if layer_past is not None:  # the model's (empty) cache: keep it as the stock forward does
        k, v = layer_past.update(k, v, attn.layer_idx)
    if kv_heads != attn.num_heads:
        k, v = k.expand(-1, attn.num_heads, -1, -1), v.expand(-1, attn.num_heads, -1, -1)
    scores = score_product(state, torch.matmul(q, k.transpose(-1, -2)))
    if alibi is None:
        scores = scores / attn.head_dim ** 0.5
    else:
        bias = state.position_bias(alibi.view(batch, attn.num_heads, -1)).unsqueeze(2)
        scores = (scores + bias) * attn.inv_norm_factor
        if attention_mask is not None:  # FalconModel folds ALiBi / sqrt(d) into the mask too: its share measured
            attention_mask = state.position_bias(attention_mask)
    if attention_mask is not None:
        scores = scores + attention_mask
    out, probs = attend(state, scores, v)
    return attn.dense(out.transpose(1, 2).reshape(batch, n, attn.num_heads * attn.head_dim)), probs


def falcon_layer(layer: nn.Module, state: PassState, hidden_states: torch.Tensor, alibi: torch.Tensor | None,
                 attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Falcon's decoder layer in its three layouts: sequential ``h = x + attn(LN1(x)); h + mlp(LN2(h))``;
    parallel with one LayerNorm (Falcon-7B) or two (``new_decoder_architecture``, Falcon-40B),
    ``x + attn(LN(x)) + mlp(LN'(x))``; the residual sums under :func:`_residual_add`."""
    cfg = layer.config
    x = hidden_states
    two_norms = cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn == 2
    attn_in = layer.ln_attn(x) if two_norms else layer.input_layernorm(x)
    attn_out, weights = layer.self_attention(attn_in, alibi=alibi, attention_mask=attention_mask, **kwargs)
    if cfg.new_decoder_architecture or cfg.parallel_attn:  # one sum, the two branches one operand
        both = layer.mlp(layer.ln_mlp(x) if two_norms else attn_in) + attn_out
        return _residual_add(state, x, both), weights
    h = _residual_add(state, x, attn_out)
    return _residual_add(state, h, layer.mlp(layer.post_attention_layernorm(h))), weights


def opt_layer(layer: nn.Module, state: PassState, hidden_states: torch.Tensor,
              attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """OPT's decoder layer, pre-LN (``do_layer_norm_before``) or post-LN (OPT-350m), its feed-forward inline
    (``fc2(act(fc1(.)))``, no module of its own): the stock values, with Chefer et al.'s normalised residual rule
    on both residual sums under ``rules="chefer"`` (plain sums otherwise)."""
    pre = layer.do_layer_norm_before
    x = hidden_states
    attn, _ = layer.self_attn(hidden_states=layer.self_attn_layer_norm(x) if pre else x,
                              attention_mask=attention_mask, **kwargs)
    h = _residual_add(state, x, attn)
    h = h if pre else layer.self_attn_layer_norm(h)
    branch = layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(h) if pre else h)))
    out = _residual_add(state, h, branch)
    return out if pre else layer.final_layer_norm(out)


def deberta_conv(layer: nn.Module, state: PassState, hidden_states: torch.Tensor, residual_states: torch.Tensor,
                 input_mask: torch.Tensor) -> torch.Tensor:
    """DeBERTa-v2's ``ConvLayer`` (``conv_kernel_size > 0``): ``LN(residual + act(conv(h)))`` with the identity
    rule on its inline activation; under ``rules="chefer"`` the normalised residual rule on the sum (the
    convolution itself gets the z+ / epsilon rule of every ``nn.Conv1d``)."""
    out = layer.conv(hidden_states.permute(0, 2, 1).contiguous()).permute(0, 2, 1).contiguous()
    out = out.masked_fill((1 - input_mask).bool().unsqueeze(-1).expand(out.size()), 0)
    out = rules.identity_rule(ACT2FN[layer.conv_act], layer.dropout(out))
    total = _residual_add(state, residual_states, out)
    output = layer.LayerNorm(total)
    if input_mask.dim() != total.dim():
        if input_mask.dim() == 4:
            input_mask = input_mask.squeeze(1).squeeze(1)
        input_mask = input_mask.unsqueeze(2)
    return output * input_mask.to(output.dtype)


def _deberta_position_scores(hf, attn, state, split, q, k, relative_pos, rel_embeddings, factor) -> torch.Tensor:
    # DisentangledSelfAttention.disentangled_attention_bias, with per-example position leaves and score rules
    if relative_pos is None:
        relative_pos = hf.build_relative_position(q, k, bucket_size=attn.position_buckets,
                                                  max_position=attn.max_relative_positions)
    relative_pos = _four_dims(relative_pos)
    span = attn.pos_ebd_size
    relative_pos = relative_pos.to(device=q.device, dtype=torch.long)
    rel = state.position_leaf(attn.pos_dropout(rel_embeddings)[: span * 2], q.size(0) // attn.num_attention_heads)
    if attn.share_att_key:
        pos_q, pos_k = split(attn.query_proj(rel)), split(attn.key_proj(rel))
    else:
        pos_k = split(attn.pos_key_proj(rel)) if "c2p" in attn.pos_att_type else None
        pos_q = split(attn.pos_query_proj(rel)) if "p2c" in attn.pos_att_type else None
    score = torch.zeros((), dtype=q.dtype, device=q.device)
    if "c2p" in attn.pos_att_type:
        c2p = score_product(state, torch.bmm(q, pos_k.transpose(-1, -2)))
        c2p_pos = torch.clamp(relative_pos + span, 0, span * 2 - 1)
        c2p = torch.gather(c2p, -1, c2p_pos.squeeze(0).expand([q.size(0), q.size(1), relative_pos.size(-1)]))
        score = score + c2p / hf.scaled_size_sqrt(pos_k, factor).to(c2p.dtype)
    if "p2c" in attn.pos_att_type:
        # the argument order of the model's own call (max_relative_positions before position_buckets)
        r_pos = hf.build_rpos(q, k, relative_pos, attn.max_relative_positions, attn.position_buckets)
        p2c_pos = torch.clamp(-r_pos + span, 0, span * 2 - 1)
        p2c = score_product(state, torch.bmm(k, pos_q.transpose(-1, -2)))
        p2c = torch.gather(p2c, -1, p2c_pos.squeeze(0).expand([q.size(0), k.size(-2), k.size(-2)])).transpose(-1, -2)
        score = score + p2c / hf.scaled_size_sqrt(pos_q, factor).to(p2c.dtype)
    return score


FORWARDS: dict[str, Callable[..., Any]] = {
    "tanh_head": tanh_head,
    "pooled_tanh_head": pooled_tanh_head,
    "t5_gated_ffn": t5_gated_ffn,
    "deberta_pooler": deberta_pooler,
    "deberta_attention": deberta_attention,
    "deberta_v1_attention": deberta_v1_attention,
    "deberta_conv": deberta_conv,
    "own_attention": own_attention,
    "opt_layer": opt_layer,
    "activation": activation,
    "bloom_attention": bloom_attention,
    "bloom_mlp": bloom_mlp,
    "falcon_attention": falcon_attention,
    "falcon_layer": falcon_layer,
    "mpnet_attention": mpnet_attention,
    "dense_residual": dense_residual,
    "rms_norm": rms_norm,
    "gated_mlp": gated_mlp,
    "glu_mlp": glu_mlp,
    "fused_gated_mlp": fused_gated_mlp,
    "sparse_moe": sparse_moe,
}
