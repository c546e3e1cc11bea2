"""Temporarily switch a stock HF model into "LRP mode", and switch it back exactly.

Patches are per module instance (an instance attribute ``forward`` that shadows the class method) plus the
config's attention implementation, which is pointed at :func:`lrp_attention` (registered with transformers'
``AttentionInterface`` under :data:`ATTN_NAME`). Everything is undone in ``finally``: forward attributes, the
attention implementation, the training flags of every module and any hook this module added.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from transformers import activations as hf_activations
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.pytorch_utils import Conv1D

from ..core.modelstate import model_lock
from ..errors import InputError, ModelError
from ..models.architectures import LRP_SUPPORTED, LRPSupport, architecture_for
from ..models.norms import as_layer_norm, is_layer_norm
from ..models.recompute import recomputable
from . import modules, rules
from .state import (
    ATTN_NAME,
    CHEFER,
    FUSED_ATTN_NAME,
    PassState,
    active_state,
    attend,
    attend_fused,
    attend_fused_chefer,
    running_state,
    score_product,
    set_running_state,
)

RULE_SETS = ("chefer", "chefer-lrp", "attnlrp", "cp")
_RENAMED = {"chefer-orig": "chefer-lrp"}

# model_type -> display name of the architectures whose entry (attnlens.models.architectures) declares LRP support: the
# families whose stock modules the rules below cover. A live view: register_architecture updates it.
SUPPORTED = LRP_SUPPORTED

# Element-wise activations with f(0) = 0, which get the identity rule.
_TORCH_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.Tanh, nn.SiLU, nn.Mish, nn.LeakyReLU, nn.ELU, nn.Hardtanh)
_ACTIVATIONS: tuple[type, ...] = _TORCH_ACTIVATIONS + tuple(
    cls
    for name, cls in vars(hf_activations).items()
    if isinstance(cls, type) and issubclass(cls, nn.Module) and name.endswith(("Activation", "GELUTanh"))
    and name not in ("SqrtSoftplusActivation", "LaplaceActivation")
)
_LINEAR = (nn.Linear, Conv1D)  # weighted sums: z+ (chefer) or epsilon rule


def lrp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Eager attention with the LRP rules (:func:`score_product`, :func:`attend`), same signature and outputs as
    HF's eager one. Grouped-query attention (Llama-family ``num_key_value_groups``) repeats K and V per group, as
    HF's ``repeat_kv``; rotary embeddings were applied before (a rotation: linear, relevance passes as gradient
    x input); Gemma 2's score cap ``softcap * tanh(s / softcap)`` gets the identity rule, as an element-wise
    activation; a model whose attention computes its scores in float32 (GPT-J's, ``LRPSupport.float32_scores``)
    gets them in float32 here too; T5's relative-position score bias (``position_bias``) is added to the scores as
    a per-example leaf, whose share is ``position_relevance``. Dropout is off (eval mode)."""
    state = active_state()
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    bias = kwargs.get("position_bias")  # T5's relative-position score bias, through the interface
    if state.fused:  # runs_fused(model) held: no score cap, scores in the model's dtype; SDPA's masks
        if bias is not None:
            raise ModelError("LRP: the fused pass has no relative-position score bias (T5's); run it eager")
        state.attention_calls += 1
        groups = getattr(module, "num_key_value_groups", 1)
        causal = attention_mask is None and getattr(module, "is_causal", False) and query.shape[2] > 1
        if state.rules in CHEFER:
            out = attend_fused_chefer(state, module, query, key, value, groups, attention_mask, scaling, causal)
            return out.transpose(1, 2).contiguous(), None
        out = attend_fused(query, key, value, attention_mask, scaling, causal, groups)
        return out.transpose(1, 2).contiguous(), None
    if state.float32_scores:  # attend casts the probabilities back to the values' dtype
        query, key = query.to(torch.float32), key.to(torch.float32)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = score_product(state, torch.matmul(query, key.transpose(2, 3))) * scaling
    if bias is not None:  # a constant per example: the share of the scores' relevance it takes is measured
        scores = scores + state.position_bias(bias.expand(scores.shape[0], *bias.shape[1:]))
    if softcap is not None:
        scores = rules.capped(scores, softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    out, probs = attend(state, scores, value)
    return out.transpose(1, 2).contiguous(), probs


ALL_ATTENTION_FUNCTIONS.register(ATTN_NAME, lrp_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, eager_mask)
ALL_ATTENTION_FUNCTIONS.register(FUSED_ATTN_NAME, lrp_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(FUSED_ATTN_NAME, sdpa_mask)


# LRP forwards of an architecture that compute the attention themselves (not through lrp_attention)
_OWN_ATTENTION = frozenset({"deberta_attention", "deberta_v1_attention", "own_attention", "bloom_attention",
                            "falcon_attention", "falcon_layer", "mpnet_attention"})


def runs_fused(model: nn.Module) -> bool:
    """Whether an LRP pass with ``PassState.fused`` computes every attention of ``model`` fused (no probabilities
    kept) and can recompute its layers in the backward: the attention goes through transformers' interface to
    :func:`lrp_attention` (no LRP forward of its own, scores in the model's dtype, no score cap) and the layers
    support gradient checkpointing."""
    support = architecture_for(model.config).lrp
    if support is None or support.float32_scores or not getattr(type(model), "_supports_attention_backend", False):
        return False
    if any(fn in _OWN_ATTENTION for _target, fn in support.forwards):
        return False
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return False
    return recomputable(model)


def check_rules(rules: object) -> str:
    """``rules`` if it names a rule set; otherwise :class:`InputError` listing them (and any renamed one)."""
    if rules in RULE_SETS:
        return rules  # type: ignore[return-value]
    hint = f" ({rules!r} is now called {_RENAMED[rules]!r})" if isinstance(rules, str) and rules in _RENAMED else ""
    raise InputError(f"unknown LRP rules {rules!r}{hint}; choose one of {', '.join(RULE_SETS)}")


def supports(model: nn.Module) -> bool:
    """Whether the LRP methods can explain ``model`` (so that ``methods="all"`` can skip them otherwise)."""
    try:
        check_supported(model)
    except ModelError:
        return False
    return True


def check_supported(model: nn.Module) -> str:
    """The model's ``model_type`` if LRP supports it; otherwise :class:`ModelError` naming the supported ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED:
        names = ", ".join(SUPPORTED.values())
        raise ModelError(
            f"LRP methods (partiallrp, transatt, attnlrp) support {names}; "
            f"this model is {model_type or type(model).__name__!r}"
        )
    support = _support(model)
    for path in (support.embedding_input, support.word_embeddings):
        _submodule(model, support, path)
    return model_type


def _submodule(model: nn.Module, support: LRPSupport, path: str | None, required: bool = True) -> nn.Module | None:
    """The module at ``path`` below the base model (``None`` for no path); a model without it is refused, or
    (``required=False``) gets ``None``."""
    if path is None:
        return None
    base = getattr(model, "base_model", model)
    try:
        return base.get_submodule(path)
    except AttributeError:
        if not required:
            return None
        raise ModelError(f"LRP: {type(model).__name__} has no {path}; expected a stock HF {support.name} "
                         "model") from None


def _ln_forward(module: nn.Module, state: PassState, x: torch.Tensor) -> torch.Tensor:
    ln = as_layer_norm(module)  # a model's own LayerNorm class (DeBERTa's) read as nn.LayerNorm
    if state.rules not in CHEFER:
        return rules.layer_norm(ln, x)
    branch = state.branches.pop(id(module), None)  # recorded for rules="chefer" only
    if branch is not None:  # x = skip + branch: the authors' normalised residual rule, per example
        if branch.shape != x.shape:
            raise ModelError(f"LRP rules='chefer': unexpected residual branch shape {tuple(branch.shape)}")
        x = rules.normalized_residual(x, branch, state)
    # the class forward (unpatched); AttnLRP's LayerNorm for a backward in its mode
    forward = nn.LayerNorm.forward if isinstance(module, nn.LayerNorm) else type(module).forward
    return rules.pass_through(partial(forward, module), x, rules.layer_norm_backward(ln), state)


def _support(model: nn.Module) -> LRPSupport:
    support = architecture_for(model.config).lrp
    if support is None:
        raise ModelError(f"LRP: no LRP support declared for model type {model.config.model_type!r}")
    return support


def residual_sites(model: nn.Module) -> list[tuple[nn.LayerNorm, nn.Module]]:
    """(LayerNorm, module whose output is the residual branch) for every post-LN residual sum ``LN(x + f(x))``,
    as the architecture's entry declares them (:class:`attnlens.models.architectures.Residual`)."""
    support = _support(model)
    sites = []
    for m in model.modules():
        name = type(m).__name__
        for site in support.residuals:
            if not (name.endswith(site.module) and hasattr(m, site.norm) and hasattr(m, site.branch)):
                continue
            if getattr(m, "chunk_size_feed_forward", 0):  # the branch would be computed in chunks
                raise ModelError(f"LRP rules='chefer' does not support {support.name} with chunked feed-forward")
            sites.append((getattr(m, site.norm), getattr(m, site.branch)))
    return sites


@contextmanager
def lrp_mode(model: nn.Module, state: PassState) -> Iterator[None]:
    """Within the block, ``model(...)`` runs the LRP forward and records into ``state``; afterwards the model is
    exactly as before (also when the block raises). The block holds the model's
    :func:`~attnlens.core.modelstate.model_lock`."""
    with model_lock(model), _lrp_mode(model, state):
        yield


@contextmanager
def _lrp_mode(model: nn.Module, state: PassState) -> Iterator[None]:
    check_supported(model)
    check_rules(state.rules)
    if running_state() is not None:
        raise RuntimeError("an LRP pass is already running in this thread")
    support = _support(model)
    if state.rules == "chefer" and not (support.residuals or support.blocks or support.own_sums):
        raise InputError(f"LRP rules='chefer' needs the residual sums of {support.name}, which its architecture "
                         "entry does not declare; use rules='chefer-lrp', 'attnlrp' or 'cp'")
    forwards: dict[str, list[tuple[str, str]]] = {}  # class name -> [(method, LRP forward name)]
    for target, fn_name in support.forwards:
        cls_name, _, method = target.partition(".")
        forwards.setdefault(cls_name, []).append((method or "forward", fn_name))
    blocks = {b.module: b for b in support.blocks} if state.rules == "chefer" else {}
    emb_input = _submodule(model, support, support.embedding_input)  # None: the sum is the word embeddings
    word = _submodule(model, support, support.word_embeddings)
    word = model.get_input_embeddings() if word is None else word
    # an encoder-decoder type's encoder-only classes (T5ForTokenClassification) have no decoder: nothing to read
    decoder_input = _submodule(model, support, support.decoder_input, required=False)
    training = [(m, m.training) for m in model.modules()]
    patched: list[tuple[nn.Module, str, Callable | None]] = []
    configs = {id(c): c for c in [model.config] + [getattr(m, "config", None) for m in model.modules()]
               if c is not None and hasattr(c, "_attn_implementation")}
    old_impl = {k: c._attn_implementation for k, c in configs.items()}
    handles = []
    cap_cls, cap_attr = support.logit_softcap or ("", "")
    cap = getattr(model.config, cap_attr, None) if type(model).__name__ == cap_cls else None

    def patch(module: nn.Module, fn: Callable, method: str = "forward") -> None:
        patched.append((module, method, module.__dict__.get(method)))
        setattr(module, method, fn)

    def grab_branch(ln: nn.LayerNorm):
        def hook(_m, _inp, out):
            state.branches[id(ln)] = out[0] if isinstance(out, tuple) else out

        return hook

    def grab_word(_m, _inp, out: torch.Tensor) -> torch.Tensor | None:
        # a leaf for the word embeddings, so relevance reaches them even if the weights are frozen; the pass's
        # first lookup is the tokens' (GPT-2 and GPT-Neo look their token types up in the same table after it)
        if state.word_embeddings is not None:
            return None
        leaf = out.detach().requires_grad_(True)
        state.word_embeddings = leaf
        return leaf

    def grab_sum(_m, args: tuple) -> None:  # the input of the embeddings' norm: word + position (+ segment)
        state.embedding_sum = args[0]

    def grab_decoder(_m, args: tuple) -> tuple | None:  # the decoder's inputs: its word (+ position) embeddings
        if state.decoder_sum is not None:  # T5's dropout runs again after the last layer
            return None
        # a leaf of its own, so relevance reaches it even where the embeddings' weights are frozen
        state.decoder_sum = args[0].detach().requires_grad_(True)
        return (state.decoder_sum, *args[1:])

    try:
        model.eval()
        for module in model.modules():
            name = type(module).__name__
            if name in forwards:
                for method, fn_name in forwards[name]:
                    if hasattr(type(module), method):  # not GPT-J's _attn since transformers 5.24 (LRPSupport)
                        patch(module, partial(modules.FORWARDS[fn_name], module, state), method)
            elif name in blocks:
                patch(module, partial(modules.prenorm_block, blocks[name], module, state))
            elif is_layer_norm(module):
                patch(module, partial(_ln_forward, module, state))
            elif isinstance(module, _LINEAR) and state.rules in CHEFER:
                patch(module, partial(rules.zplus_linear, module, shared=state.rules == "chefer", switch=state))
            elif isinstance(module, _LINEAR) and state.epsilon > 0:
                patch(module, partial(rules.linear, module, eps=state.epsilon))
            elif isinstance(module, nn.Conv1d) and state.rules in CHEFER:
                patch(module, partial(rules.zplus_conv, module, shared=state.rules == "chefer", switch=state))
            elif isinstance(module, nn.Conv1d) and state.epsilon > 0:
                patch(module, partial(rules.conv, module, eps=state.epsilon))
            elif isinstance(module, _ACTIVATIONS):
                patch(module, partial(rules.identity_rule, module.forward))
        handles.append(word.register_forward_hook(grab_word))
        if emb_input is not None:
            handles.append(emb_input.register_forward_pre_hook(grab_sum))
        if decoder_input is not None:
            handles.append(decoder_input.register_forward_pre_hook(grab_decoder))
        if state.rules == "chefer":
            for ln, branch in residual_sites(model):
                handles.append(branch.register_forward_hook(grab_branch(ln)))
        for c in configs.values():
            c._attn_implementation = FUSED_ATTN_NAME if state.fused else ATTN_NAME
        state.float32_scores = support.float32_scores
        if cap is not None:  # the model returns its raw logits; the pass caps them (PassState.logits)
            state.logit_cap = float(cap)
            setattr(model.config, cap_attr, None)
        set_running_state(state)
        yield
    finally:
        set_running_state(None)
        if cap is not None:
            setattr(model.config, cap_attr, cap)
        for k, c in configs.items():
            c._attn_implementation = old_impl[k]
        for h in handles:
            h.remove()
        for module, method, old in reversed(patched):
            if old is None:
                delattr(module, method)
            else:
                setattr(module, method, old)
        for m, flag in training:
            m.training = flag
