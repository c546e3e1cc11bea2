"""attnnorm, globenc, alti and decompx on pre-LN decoders (GPT-2: LayerNorm, fused Conv1D projections, GELU;
Llama: RMSNorm, grouped-query attention, gated SiLU MLP; Qwen2: a value bias) against a per-example loop over
tokens and heads from the module weights, DecompX's decomposition identity and contrast, batch and padding
invariance, generation steps, and the variants that do not apply (a wrong anatomy: test_decomposition.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from conftest import CLS, PAD, SEP, V, randomise_biases_and_norms
from test_decomposition import by_source
from test_generation import _assert_steps_equal_their_prefixes

from attnlens import Explainer, InputError
from attnlens.models.architectures import ARCHITECTURES, register_architecture
from attnlens.testing.tiny_models import build_tiny

NORM = ["attnnorm", "globenc", "alti", "decompx"]
# GPT-J, Phi, GPT-NeoX: parallel attention and FFN branches ("gpt_neox-seq": GPT-NeoX made sequential)
# Falcon: Falcon-7B's layout (parallel, one LayerNorm, multi-query), "falcon-40b" (two LayerNorms, 2 key/value groups
# of 2 queries), "falcon-alibi" (sequential, per-head fused projection, ALiBi, biases)
FAMILIES = ["gpt2", "gpt_neo", "llama", "qwen2", "qwen3", "gemma", "gemma2", "gpt_neox", "gpt_neox-seq", "gptj", "phi",
            "phi3", "mixtral", "opt", "bloom", "falcon", "falcon-40b", "falcon-alibi"]
FALCON = {"falcon-40b": dict(num_attention_heads=4, new_decoder_architecture=True, num_kv_heads=2, bias=True),
          "falcon-alibi": dict(num_attention_heads=2, alibi=True, parallel_attn=False, multi_query=False, bias=True)}
TASKS = ["classification", "causal-lm"]
ENCODERS = ("xlm-roberta-xl", "modernbert")  # pre-LN encoders: a classification head of their own
TEXTS = ["the movie was really good", "bad", "a charming journey but the plot was boring"]


def randomised(family: str, task: str, seed: int = 0) -> torch.nn.Module:
    """A tiny decoder whose biases and norm scales are random too (HF initialises them to 0 and 1); Qwen2 with
    4 query heads sharing 2 key/value heads (grouped-query attention, where the head order matters)."""
    if family == "gpt_neox-seq":
        torch.manual_seed(seed)
        config = transformers.GPTNeoXConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                            intermediate_size=24, max_position_embeddings=64, pad_token_id=PAD,
                                            initializer_range=0.3, attn_implementation="eager",
                                            use_parallel_residual=False)
        cls = transformers.GPTNeoXForCausalLM if task == "causal-lm" else transformers.GPTNeoXForSequenceClassification
        return randomise_biases_and_norms(cls(config), seed)
    if family in FALCON:
        torch.manual_seed(seed)
        config = transformers.FalconConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, pad_token_id=PAD,
                                           initializer_range=0.3, attn_implementation="eager", **FALCON[family])
        cls = transformers.FalconForCausalLM if task == "causal-lm" else transformers.FalconForSequenceClassification
        return randomise_biases_and_norms(cls(config), seed)
    if family == "mixtral":  # 3 experts, 2 per token: the routing weights are not all 1
        torch.manual_seed(seed)
        config = transformers.MixtralConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                            num_key_value_heads=2, intermediate_size=24, max_position_embeddings=64,
                                            num_local_experts=3, num_experts_per_tok=2, pad_token_id=PAD,
                                            initializer_range=0.3, attn_implementation="eager")
        cls = transformers.MixtralForCausalLM if task == "causal-lm" else transformers.MixtralForSequenceClassification
        model = cls(config)
    elif family == "qwen2":
        torch.manual_seed(seed)
        config = transformers.Qwen2Config(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=24, max_position_embeddings=64,
                                          pad_token_id=PAD, initializer_range=0.3, attn_implementation="eager")
        cls = transformers.Qwen2ForCausalLM if task == "causal-lm" else transformers.Qwen2ForSequenceClassification
        model = cls(config)
    else:
        model = build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, seed=seed,
                           task=task)
    return randomise_biases_and_norms(model, seed)


def _t(linear) -> tuple[torch.Tensor, torch.Tensor | float]:
    """A linear module's weight in ``(in, out)`` orientation and its bias (0 where it has none)."""
    return linear.weight.T, 0.0 if linear.bias is None else linear.bias


def _pieces(model: torch.nn.Module, l: int) -> dict:
    """Layer l's weights, written out per family (no architecture entry read): ``parallel`` layers feed their
    input to the FFN too."""
    kind, base = model.config.model_type, model.base_model
    if kind == "gpt2":
        b = base.h[l]
        d = b.attn.c_attn.weight.shape[0]
        return dict(ln1=b.ln_1, ln2=b.ln_2, wv=b.attn.c_attn.weight[:, 2 * d:], bv=b.attn.c_attn.bias[2 * d:],
                    wo=b.attn.c_proj.weight, bo=b.attn.c_proj.bias, w_in=b.mlp.c_fc.weight, b_in=b.mlp.c_fc.bias,
                    w_out=b.mlp.c_proj.weight, b_out=b.mlp.c_proj.bias, act=b.mlp.act, w_gate=None, parallel=False)
    if kind in ("gpt_neox", "bloom"):  # fused query/key/value laid out (heads, 3, head_dim): each head's last third
        b = base.layers[l] if kind == "gpt_neox" else base.h[l]
        attn = b.attention if kind == "gpt_neox" else b.self_attention
        qkv = attn.query_key_value
        heads = model.config.num_attention_heads
        dh = qkv.weight.shape[1] // heads
        cols = torch.tensor([h * 3 * dh + 2 * dh + k for h in range(heads) for k in range(dh)])
        wo, bo = _t(attn.dense)
        w_in, b_in = _t(b.mlp.dense_h_to_4h)
        w_out, b_out = _t(b.mlp.dense_4h_to_h)
        return dict(ln1=b.input_layernorm, ln2=b.post_attention_layernorm, wv=qkv.weight.T[:, cols],
                    bv=qkv.bias[cols], wo=wo, bo=bo, w_in=w_in, b_in=b_in, w_out=w_out, b_out=b_out,
                    act=b.mlp.act if kind == "gpt_neox" else b.mlp.gelu_impl, w_gate=None,
                    parallel=kind == "gpt_neox" and model.config.use_parallel_residual)
    if kind == "falcon":  # fused per key/value group, (queries of the group, key, value): each group's last part
        b, cfg = base.h[l], model.config
        qkv = b.self_attention.query_key_value
        heads, dh = cfg.num_attention_heads, b.self_attention.head_dim
        groups = (qkv.weight.shape[0] // dh - heads) // 2
        block = qkv.weight.shape[0] // groups
        cols = torch.tensor([g * block + block - dh + k for g in range(groups) for k in range(dh)])
        parallel = cfg.new_decoder_architecture or cfg.parallel_attn
        two = cfg.new_decoder_architecture and cfg.num_ln_in_parallel_attn == 2
        ln1 = b.ln_attn if two else b.input_layernorm
        (wo, bo), (w_in, b_in), (w_out, b_out) = _t(b.self_attention.dense), _t(b.mlp.dense_h_to_4h), \
            _t(b.mlp.dense_4h_to_h)
        return dict(ln1=ln1, ln2=b.ln_mlp if two else ln1 if parallel else b.post_attention_layernorm,
                    wv=qkv.weight.T[:, cols], bv=torch.zeros(len(cols)) if qkv.bias is None else qkv.bias[cols],
                    wo=wo, bo=bo, w_in=w_in, b_in=b_in, w_out=w_out, b_out=b_out, act=b.mlp.act, w_gate=None,
                    parallel=parallel)
    if kind in ("gptj", "phi", "opt", "gpt_neo"):
        if kind == "gpt_neo":
            b = base.h[l]
            attn, out, ln1, ln2, fc1, fc2, act = b.attn.attention, b.attn.attention.out_proj, b.ln_1, b.ln_2, \
                b.mlp.c_fc, b.mlp.c_proj, b.mlp.act
        elif kind == "gptj":
            b = base.h[l]
            attn, out, ln1, ln2, fc1, fc2, act = b.attn, b.attn.out_proj, b.ln_1, b.ln_1, b.mlp.fc_in, b.mlp.fc_out, \
                b.mlp.act
        elif kind == "phi":
            b = base.layers[l]
            attn, out, ln1, ln2, fc1, fc2, act = b.self_attn, b.self_attn.dense, b.input_layernorm, \
                b.input_layernorm, b.mlp.fc1, b.mlp.fc2, b.mlp.activation_fn
        else:
            b = base.decoder.layers[l]
            attn, out, ln1, ln2, fc1, fc2, act = b.self_attn, b.self_attn.out_proj, b.self_attn_layer_norm, \
                b.final_layer_norm, b.fc1, b.fc2, b.activation_fn
        (wv, bv), (wo, bo), (w_in, b_in), (w_out, b_out) = _t(attn.v_proj), _t(out), _t(fc1), _t(fc2)
        return dict(ln1=ln1, ln2=ln2, wv=wv, bv=bv if torch.is_tensor(bv) else torch.zeros(wv.shape[1]), wo=wo,
                    bo=bo, w_in=w_in, b_in=b_in, w_out=w_out, b_out=b_out, act=act, w_gate=None,
                    parallel=kind in ("gptj", "phi"))
    if kind == "xlm-roberta-xl":  # a pre-LN encoder: BERT's module names, a LayerNorm before each branch
        b = base.encoder.layer[l]
        (wv, bv), (wo, bo), (w_in, b_in), (w_out, b_out) = _t(b.attention.self.value), _t(b.attention.output.dense), \
            _t(b.intermediate.dense), _t(b.output.dense)
        return dict(ln1=b.attention.self_attn_layer_norm, ln2=b.LayerNorm, wv=wv, bv=bv, wo=wo, bo=bo, w_in=w_in,
                    b_in=b_in, w_out=w_out, b_out=b_out, act=b.intermediate.intermediate_act_fn, w_gate=None,
                    parallel=False)
    if kind == "modernbert":  # fused query/key/value (the values the last third), GLU: act(first half) * second
        b, d = base.layers[l], model.config.hidden_size
        first, second = b.mlp.Wi.weight.T.chunk(2, dim=1)
        return dict(ln1=b.attn_norm, ln2=b.mlp_norm, wv=b.attn.Wqkv.weight.T[:, 2 * d:], bv=torch.zeros(d),
                    wo=b.attn.Wo.weight.T, bo=torch.zeros(d), w_in=second, b_in=0.0, w_out=b.mlp.Wo.weight.T,
                    b_out=0.0, act=b.mlp.act, w_gate=first, parallel=False)
    b = base.layers[l]  # the Llama family (Mixtral: its experts, each a gated FFN, and router)
    a, m = b.self_attn, b.mlp
    if kind == "gemma2":  # a norm before and after each branch ("post_attention_layernorm" is after attention)
        return dict(ln1=b.input_layernorm, ln2=b.pre_feedforward_layernorm, post_attn=b.post_attention_layernorm,
                    post_ffn=b.post_feedforward_layernorm, wv=a.v_proj.weight.T,
                    bv=torch.zeros(a.v_proj.weight.shape[0]), wo=a.o_proj.weight.T,
                    bo=torch.zeros(a.o_proj.weight.shape[0]), w_in=m.up_proj.weight.T, b_in=0.0,
                    w_out=m.down_proj.weight.T, b_out=0.0, act=m.act_fn, w_gate=m.gate_proj.weight.T, parallel=False)
    if kind == "phi3":  # query, key, value fused: the values last, num_key_value_heads wide; gate/up fused too
        w = a.qkv_proj.weight.T
        width = model.config.num_key_value_heads * a.head_dim
        gate, up = m.gate_up_proj.weight.T.chunk(2, dim=1)  # the gate's half first
        return dict(ln1=b.input_layernorm, ln2=b.post_attention_layernorm, wv=w[:, -width:], bv=torch.zeros(width),
                    wo=a.o_proj.weight.T, bo=torch.zeros(a.o_proj.weight.shape[0]), w_in=up, b_in=0.0,
                    w_out=m.down_proj.weight.T, b_out=0.0, act=m.activation_fn, w_gate=gate, parallel=False)
    zero = torch.zeros(a.v_proj.weight.shape[0])
    if kind == "mixtral":  # expert e: gate and up the halves of gate_up_proj[e] (gate first), down_proj[e]
        ex = m.experts
        ffn = dict(moe=[(ex.gate_up_proj[e].T.chunk(2, dim=1), ex.down_proj[e].T) for e in range(ex.num_experts)],
                   router=m.gate.weight.T, top_k=m.gate.top_k, act=ex.act_fn, w_gate=None)
    else:
        ffn = dict(w_in=m.up_proj.weight.T, b_in=0.0, w_out=m.down_proj.weight.T, b_out=0.0, act=m.act_fn,
                   w_gate=m.gate_proj.weight.T)
    return dict(ln1=b.input_layernorm, ln2=b.post_attention_layernorm, wv=a.v_proj.weight.T,
                bv=zero if a.v_proj.bias is None else a.v_proj.bias, wo=a.o_proj.weight.T,
                bo=torch.zeros(a.o_proj.weight.shape[0]), parallel=False, **ffn)


def _final_norm(model: torch.nn.Module) -> torch.nn.Module:
    base = model.base_model
    for path in ("ln_f", "final_layer_norm", "final_layernorm", "norm", "decoder.final_layer_norm", "final_norm",
                 "encoder.LayerNorm"):
        root = base
        for name in path.split("."):
            root = getattr(root, name, None)
        if root is not None:
            return root
    raise AssertionError(f"no final norm found in {type(base).__name__}")


class Reference:
    """One unpadded example through a tiny pre-LN model, the formulas written out per token and head from the
    weights (in ``(in, out)`` orientation), read at the last position (decoders) or the first (encoders:
    ``read=0``)."""

    def __init__(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], read: int = -1) -> None:
        self.model, self.gpt2 = model, model.config.model_type == "gpt2"
        with torch.no_grad():  # the inputs the explainer passes (GPT-2 embeds token type ids where given)
            out = model(**inputs, output_attentions=True, output_hidden_states=True)
        self.hidden = [h[0] for h in out.hidden_states]
        self.attn = [a[0] for a in out.attentions]
        logits = out.logits if hasattr(out, "logits") else torch.stack([out.start_logits, out.end_logits], -1)
        self.logits = logits[0, -1] if logits.dim() == 3 else logits[0]
        self.n, self.heads = self.attn[0].shape[-1], self.attn[0].shape[0]
        self.read = read % self.n
        self.final = _final_norm(model)

    def pieces(self, l: int) -> dict:
        return _pieces(self.model, l)

    def encoder_head(self, state: torch.Tensor, real: torch.Tensor, biases: bool) -> torch.Tensor:
        """An encoder classifier's head on a summand ``state`` of the pooled state ``real``: its activation as
        act(u)/u at the real pre-activation, a norm at the real input's scale (written out per family)."""
        def dense(linear, v):
            return v @ linear.weight.T + (linear.bias if biases and linear.bias is not None else 0)

        if self.model.config.model_type == "modernbert":  # dense, GELU, LayerNorm, classifier
            head = self.model.head
            u = head.dense(real)
            a = head.act(u)
            out = dense(head.dense, state) * a / u
            out = self.norm_linear(head.norm, out, a) + (self.norm_bias(head.norm) if biases else 0)
            return dense(self.model.classifier, out)
        head = self.model.classifier  # RoBERTa's: dense, tanh, out_proj
        u = head.dense(real)
        return dense(head.out_proj, dense(head.dense, state) * torch.tanh(u) / u)

    @staticmethod
    def norm_linear(norm, v: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """The norm's linear part on a summand ``v`` of the real input ``real`` (one token), scale of ``real``."""
        if isinstance(norm, torch.nn.Identity):  # ModernBERT's first layer has no norm before its attention
            return v.to(real.dtype)
        if isinstance(norm, torch.nn.LayerNorm):
            out = (v - v.mean()) / torch.sqrt(real.var(unbiased=False) + norm.eps)
            return out if norm.weight is None else out * norm.weight
        gain = 1 + norm.weight if type(norm).__name__.startswith("Gemma") else norm.weight  # Gemma: x̂ (1 + γ)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        return v / torch.sqrt(real.pow(2).mean() + eps) * gain

    def norm_bias(self, norm) -> torch.Tensor:
        if isinstance(norm, torch.nn.Identity):
            return torch.zeros_like(self.hidden[0][0])
        if isinstance(norm, torch.nn.LayerNorm):
            return torch.zeros(norm.normalized_shape, dtype=norm.weight.dtype) if norm.bias is None else norm.bias
        return torch.zeros_like(norm.weight)

    def f(self, l: int, h: int, j: int) -> torch.Tensor:
        """f^h(LN1(x_j)) = (LN1(x_j) W_V^h + b_V^h) W_O^h, the key/value head of query head h for GQA."""
        p = self.pieces(l)
        v = p["ln1"](self.hidden[l][j]) @ p["wv"] + p["bv"]
        dh = p["wo"].shape[0] // self.heads
        kv = h // (self.heads // (v.shape[0] // dh))
        return v[kv * dh:(kv + 1) * dh] @ p["wo"][h * dh:(h + 1) * dh]

    def branch(self, l: int, i: int) -> torch.Tensor:
        """The attention block's output at token i before any norm after it."""
        return sum(self.attn[l][h, i, j] * self.f(l, h, j) for h in range(self.heads) for j in range(self.n)) + \
            self.pieces(l)["bo"]

    def z(self, l: int, i: int, j: int, residual: bool = True) -> torch.Tensor:
        out = sum(self.attn[l][h, i, j] * self.f(l, h, j) for h in range(self.heads))
        post = self.pieces(l).get("post_attn")
        if post is not None:  # Gemma 2: the norm after the branch, at the real branch's scale
            out = self.norm_linear(post, out, self.branch(l, i))
        return out + self.hidden[l][i] if residual and i == j else out

    def y(self, l: int, i: int) -> torch.Tensor:
        """The residual stream after layer l's attention block at token i."""
        post = self.pieces(l).get("post_attn")
        if post is not None:
            return self.hidden[l][i] + post(self.branch(l, i))
        return sum(self.z(l, i, j) for j in range(self.n)) + self.pieces(l)["bo"]

    def rollout_last(self, entry) -> np.ndarray:
        joint = None
        for l in range(len(self.attn)):
            m = torch.tensor([[float(entry(l, i, j)) for j in range(self.n)] for i in range(self.n)])
            joint = m if joint is None else m @ joint
        return joint[self.read].numpy()

    @torch.no_grad()
    def attnnorm(self, residual: bool) -> np.ndarray:
        l, c = len(self.attn) - 1, self.read
        return np.array([float(self.z(l, c, j, residual).norm()) for j in range(self.n)])

    @torch.no_grad()
    def globenc(self, normalize: bool) -> np.ndarray:
        def entry(l: int, i: int, j: int) -> float:
            norms = [float(self.z(l, i, k).norm()) for k in range(self.n)]
            return norms[j] / sum(norms) if normalize else norms[j]
        return self.rollout_last(entry)

    @torch.no_grad()
    def alti(self) -> np.ndarray:
        def c(l: int, i: int, j: int) -> float:
            y = self.y(l, i)
            row = [max(0.0, float(y.abs().sum() - (y - self.z(l, i, k)).abs().sum())) for k in range(self.n)]
            return row[j] / sum(row)
        return self.rollout_last(c)

    @torch.no_grad()
    def decompx_token(self, weights: torch.Tensor) -> tuple[np.ndarray, float]:
        """Each source's vectors propagated alone through the network with attention, norm scales and activation
        ratios frozen (a gated product split half and half), the biases propagated alone; ``weights`` over the
        logits at the last position: (scores, bias)."""
        n, d = self.hidden[0].shape
        real = []  # per layer: the real y (after attention), the FFN pre-activations, the layer output
        for l in range(len(self.attn)):
            p = self.pieces(l)
            y = torch.stack([self.y(l, i) for i in range(n)])
            m = p["ln2"](self.hidden[l] if p["parallel"] else y)
            if "moe" in p:  # per token: its top-k experts by router probability, their probabilities renormalised
                probs = (m @ p["router"]).softmax(-1)
                top = probs.topk(p["top_k"], dim=-1)
                routing = [[(int(e), float(w / top.values[i].sum())) for e, w in zip(top.indices[i], top.values[i])]
                           for i in range(n)]
                g = [[m[i] @ p["moe"][e][0][0] for e, _ in routing[i]] for i in range(n)]  # gate per token, slot
                u = [[m[i] @ p["moe"][e][0][1] for e, _ in routing[i]] for i in range(n)]
                ffn = torch.stack([sum(w * (p["act"](g[i][s]) * u[i][s]) @ p["moe"][e][1]
                                       for s, (e, w) in enumerate(routing[i])) for i in range(n)])
                g, u = (routing, g), u
            else:
                g = None if p["w_gate"] is None else m @ p["w_gate"]
                u = m @ p["w_in"] + p["b_in"]
                act = p["act"](u) if g is None else p["act"](g) * u
                ffn = act @ p["w_out"] + p["b_out"]
            post = p.get("post_ffn")
            branch = torch.stack([self.branch(l, i) for i in range(n)])
            real.append((y, g, u, y + (ffn if post is None else post(ffn)), branch, ffn))

        def propagate(e: torch.Tensor, source: int | None) -> float:
            biases = source is None
            for l in range(len(self.attn)):
                p, (y_real, g_real, u_real, _, branch_real, ffn_real) = self.pieces(l), real[l]
                x_real = self.hidden[l]
                a = torch.stack([self.norm_linear(p["ln1"], e[i], x_real[i]) for i in range(n)])
                v = a @ p["wv"]
                if l == 0 and source is not None:  # layer 1: the token's whole value vector goes with it
                    v[source] += self.norm_bias(p["ln1"]) @ p["wv"] + p["bv"]
                if l > 0 and biases:
                    v = v + self.norm_bias(p["ln1"]) @ p["wv"] + p["bv"]
                dh = p["wo"].shape[0] // self.heads
                rep = self.heads // (v.shape[1] // dh)
                att = torch.zeros(n, d)
                for h in range(self.heads):
                    vh = v[:, (h // rep) * dh:(h // rep + 1) * dh]
                    att += self.attn[l][h] @ vh @ p["wo"][h * dh:(h + 1) * dh]
                att = att + (p["bo"] if biases else 0)
                if p.get("post_attn") is not None:
                    att = torch.stack([self.norm_linear(p["post_attn"], att[i], branch_real[i]) for i in range(n)])
                r = e + att
                into, real_in = (e, x_real) if p["parallel"] else (r, y_real)
                m = torch.stack([self.norm_linear(p["ln2"], into[i], real_in[i]) for i in range(n)])
                m = m + (self.norm_bias(p["ln2"]) if biases else 0)
                if "moe" in p:  # each expert a gated FFN (split half and half), the routing weights constant
                    routing, gates = g_real
                    ffn = torch.zeros(n, d)
                    for i in range(n):
                        for s, (e, w) in enumerate(routing[i]):
                            (w_g, w_u), w_d = p["moe"][e]
                            g0, u0 = gates[i][s], u_real[i][s]
                            g = (m[i] @ w_g) * p["act"](g0) / g0
                            ffn[i] += w * (0.5 * (g * u0 + p["act"](g0) * (m[i] @ w_u))) @ w_d
                else:
                    u = m @ p["w_in"] + (p["b_in"] if biases else 0)
                    if g_real is None:
                        hidden = u * p["act"](u_real) / u_real
                    else:
                        g = (m @ p["w_gate"]) * p["act"](g_real) / g_real
                        hidden = 0.5 * (g * u_real + p["act"](g_real) * u)
                    ffn = hidden @ p["w_out"] + (p["b_out"] if biases else 0)
                if p.get("post_ffn") is not None:
                    ffn = torch.stack([self.norm_linear(p["post_ffn"], ffn[i], ffn_real[i]) for i in range(n)])
                e = r + ffn
            last = real[-1][3][self.read]
            state = self.norm_linear(self.final, e[self.read], last) + (self.norm_bias(self.final) if biases else 0)
            if self.model.config.model_type in ENCODERS:  # an encoder's head, its steps linearised at the real state
                return float((self.encoder_head(state, self.final(last), biases) * weights).sum())
            head = self.model.get_output_embeddings() if self.logits.shape[0] == V else self.model.score
            logits = state @ head.weight.T + (head.bias if biases and head.bias is not None else 0)
            cap = getattr(self.model.config, "final_logit_softcapping", None)
            if cap and head is not getattr(self.model, "score", None):  # Gemma 2's LM: c tanh(z / c), linearised
                z = self.final(last) @ head.weight.T
                logits = logits * torch.where(z != 0, cap * torch.tanh(z / cap) / z, 0.0)  # the padding row: z = 0
            return float((logits * weights).sum())

        return by_source(propagate, self.hidden[0])


@pytest.fixture(scope="module", params=[(f, t) for f in FAMILIES for t in TASKS], ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tokenizer):
    family, task = request.param
    model = randomised(family, task)
    ex = Explainer(model, tokenizer)
    (e,) = ex.explain([TEXTS[0]], methods=["rawatt"])
    ctx, _ = ex.compute_batch(ex.encode([TEXTS[0]]), [-1], [], {})
    assert ctx.inputs["input_ids"][0].tolist() == e.input_ids
    return ex, Reference(model, ctx.inputs), e


def test_norm_methods_match_the_loop(case):
    ex, ref, _ = case
    _assert_norm_methods_match(ex, ref)


def _assert_norm_methods_match(ex: Explainer, ref: Reference) -> None:
    (e,) = ex.explain([TEXTS[0]], methods=["attnnorm", "globenc", "alti"])
    (r,) = ex.explain([TEXTS[0]], methods=["attnnorm"], options={"attnnorm": {"variant": "attn_res"}})
    np.testing.assert_allclose(e.scores["attnnorm"], ref.attnnorm(False), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(r.scores["attnnorm"], ref.attnnorm(True), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(e.scores["globenc"], ref.globenc(normalize=True), rtol=1e-4, atol=1e-6)
    (u,) = ex.explain([TEXTS[0]], methods=["globenc"], options={"globenc": {"normalize": False}})
    product = ref.globenc(normalize=False)  # up to a positive constant per example (kept finite)
    np.testing.assert_allclose(u.scores["globenc"] / u.scores["globenc"].sum(), product / product.sum(), rtol=1e-4,
                               atol=1e-6)
    alti = ref.alti()
    np.testing.assert_allclose(e.scores["alti"], alti, rtol=1e-4, atol=1e-6)
    assert abs(alti.sum() - 1) < 1e-5 and np.abs(alti).max() > 0


@pytest.mark.parametrize("task", TASKS)
def test_an_ffn_read_as_one_module_serves_the_token_mixing_methods_and_decompx_is_refused(task, tokenizer):
    """An entry may name the feed-forward network as one module (``Anatomy.ffn``: here Llama's, registered so):
    the token-mixing readings need only its output (the layer check runs it); DecompX, which linearises it
    through its pieces, says why not."""
    old = ARCHITECTURES["llama"]
    whole = dataclasses.replace(old.anatomy, ffn="mlp", ffn_in=None, gate=None, act=None, ffn_out=None)
    register_architecture(dataclasses.replace(old, anatomy=whole))
    try:
        model = randomised("llama", task)
        ex = Explainer(model, tokenizer)
        ctx, _ = ex.compute_batch(ex.encode([TEXTS[0]]), [-1], [], {})
        _assert_norm_methods_match(ex, Reference(model, ctx.inputs))
        with pytest.raises(InputError, match="decompx linearises each feed-forward.*'llama' reads it as one module"):
            ex.explain(TEXTS[0], methods=["decompx"])
        if task == "causal-lm":
            g = ex.explain_generation("the movie was", ["alti", "globenc"], target=" good but bad")
            _assert_steps_equal_their_prefixes(ex, g, ["alti", "globenc"])
    finally:
        register_architecture(old)


def test_decompx_matches_the_loop_and_sums_to_the_logit(case):
    ex, ref, e = case
    targets = [int(e.predicted), (int(e.predicted) + 1) % len(ref.logits)]
    for target in targets:
        weights = torch.nn.functional.one_hot(torch.tensor(target), len(ref.logits)).float()
        scores, bias = ref.decompx_token(weights)
        # the identity, from the independent loop: token shares + propagated biases = the model's logit
        assert abs(scores.sum() + bias - float(ref.logits[target])) < 1e-4
        (d,) = ex.explain([TEXTS[0]], methods=["decompx"], target=target)
        np.testing.assert_allclose(d.scores["decompx"], scores, rtol=1e-4, atol=1e-5)
    if ref.gpt2:  # random biases: the test can tell a bias term from none
        assert abs(bias) > 1e-2
    # a contrastive target decomposes z_t − z_c (DecompX is linear in the logits)
    t, c = targets
    w = (torch.nn.functional.one_hot(torch.tensor(t), len(ref.logits))
         - torch.nn.functional.one_hot(torch.tensor(c), len(ref.logits))).float()
    (both,) = ex.explain([TEXTS[0]], methods=["decompx"], target=t, contrast=c)
    np.testing.assert_allclose(both.scores["decompx"], ref.decompx_token(w)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_and_padding_invariance(family, task, tokenizer):
    ex = Explainer(randomised(family, task), tokenizer)
    batch = ex.explain(TEXTS, methods=NORM, batch_size=len(TEXTS))
    for text, e in zip(TEXTS, batch):
        (alone,) = ex.explain([text], methods=NORM)
        for m in NORM:
            np.testing.assert_allclose(e.scores[m], alone.scores[m], rtol=1e-4, atol=1e-5, err_msg=f"{family} {m}")
            assert np.isfinite(e.scores[m]).all() and np.abs(e.scores[m]).max() > 0


@pytest.mark.parametrize("batch_size", [16, 3])  # one batch of steps; two, each over its own sequence
@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox", "gemma2", "falcon", "phi3", "mixtral"])
def test_each_generation_step_equals_its_prefix(family, batch_size, tokenizer):
    ex = Explainer(randomised(family, "causal-lm"), tokenizer)
    g = ex.explain_generation("the movie was really", target=" good but the plot was boring", methods=NORM,
                              batch_size=batch_size)
    assert len(g.generated_ids) == 6
    assert all(np.abs(g.scores[m]).max() > 0 for m in NORM)
    _assert_steps_equal_their_prefixes(ex, g, NORM)


@pytest.mark.parametrize("family", ["xlm-roberta-xl", "modernbert"])
def test_pre_ln_encoders_match_the_loop_and_decompx_sums_to_the_logit(family, tokenizer):
    """Pre-LN encoders (XLM-RoBERTa-XL; ModernBERT: no norm before its first attention, fused projections, a GLU,
    a head ending in a LayerNorm) read at the first token, the classification head's: the norm-based methods
    against the loop, and DecompX's token shares plus its bias term equal the model's logit. In float64: ALTI's
    clamped L1 distances differ from a float32 loop by its rounding (7e-6 here)."""
    model = randomised(family, "classification").double()
    ex = Explainer(model, tokenizer)
    ctx, _ = ex.compute_batch(ex.encode([TEXTS[0]]), [-1], [], {})
    ref = Reference(model, ctx.inputs, read=0)
    _assert_norm_methods_match(ex, ref)
    for target in range(len(ref.logits)):
        scores, bias = ref.decompx_token(torch.nn.functional.one_hot(torch.tensor(target), len(ref.logits)).double())
        # the loop's own identity (its per-token inputs are float32 copies)
        assert abs(scores.sum() + bias - float(ref.logits[target])) < 1e-7
        (d,) = ex.explain([TEXTS[0]], methods=["decompx"], target=target)
        np.testing.assert_allclose(d.scores["decompx"], scores, rtol=1e-5, atol=1e-8)
        assert abs(d.scores["decompx"].sum() + float(d.meta["decompx"]["bias"]) - float(ref.logits[target])) < 1e-9
    with pytest.raises(InputError, match="absdot.*post-LN encoders"):
        ex.explain("good", methods=["decompx"], options={"decompx": {"bias": "absdot"}})


@pytest.mark.parametrize(("family", "suffix"), [("modernbert", "ForTokenClassification"),
                                              ("modernbert", "ForQuestionAnswering"),
                                              ("llama", "ForTokenClassification")])
def test_decompx_of_token_and_qa_heads_matches_the_loop(family, suffix, tokenizer):
    """A token classifier's label and an extractive QA span's start + end logits, each decomposed at its own
    position: ModernBERT's head (dense, GELU, LayerNorm, then the output layer), a Llama token classifier's
    ``score`` (at the last token of the text). The QA loop is the sum of its two reads."""
    qa = suffix == "ForQuestionAnswering"
    model = randomise_biases_and_norms(build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS,
                                                  eos_token_id=SEP, num_labels=2 if qa else 3, model_suffix=suffix),
                                       0).double()
    ex = Explainer(model, tokenizer)
    (e,) = ex.explain([TEXTS[0]], methods=["rawatt"], target=(2, 4) if qa else 2)
    inputs = {"input_ids": torch.tensor([e.input_ids]), "attention_mask": torch.ones(1, len(e.input_ids),
                                                                                     dtype=torch.long)}
    reads = [(2, 0), (4, 1)] if qa else [(len(e.input_ids) - 2 if family == "llama" else 2, 1)]
    want = [Reference(model, inputs, read=p).decompx_token(torch.eye(2 if qa else 3, dtype=torch.float64)[c])
            for p, c in reads]
    scores, bias = sum(w[0] for w in want), sum(w[1] for w in want)
    (d,) = ex.explain([TEXTS[0]], methods=["decompx"], target=(2, 4) if qa else reads[0])
    np.testing.assert_allclose(d.scores["decompx"], scores, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(float(d.meta["decompx"]["bias"]), bias, rtol=1e-5, atol=1e-8)
    assert np.abs(scores).max() > 1e-2


def test_decompx_refuses_a_head_that_pools_the_mean(tokenizer):
    model = randomised("modernbert", "classification")
    model.config.classifier_pooling = "mean"
    ex = Explainer(model, tokenizer)
    with pytest.raises(InputError, match="decompx needs a head that reads the first token"):
        ex.explain("good", methods=["decompx"])
    (e,) = ex.explain("good", methods=["alti"])  # the token-mixing methods read every row the head pools
    assert np.isfinite(e.scores["alti"]).all()


def test_what_does_not_apply_to_a_pre_ln_model_is_one_clear_error(tokenizer):
    ex = Explainer(randomised("gpt2", "causal-lm"), tokenizer)
    with pytest.raises(InputError, match="attn_res_ln.*pre-LN"):
        ex.explain("good", methods=["attnnorm"], options={"attnnorm": {"variant": "attn_res_ln"}})
    with pytest.raises(InputError, match="absdot.*post-LN encoders"):
        ex.explain("good", methods=["decompx"], options={"decompx": {"bias": "absdot"}})
    # OPT-350m's layout (post-LN layers, states projected in and out of a narrower width) has no anatomy
    config = transformers.OPTConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                    ffn_dim=24, max_position_embeddings=64, word_embed_proj_dim=8,
                                    do_layer_norm_before=False, pad_token_id=PAD)
    opt = Explainer(transformers.OPTForCausalLM(config).eval(), tokenizer)
    for m in NORM:
        with pytest.raises(InputError, match="need a layer anatomy attnlens knows"):
            opt.explain("good", methods=[m])
