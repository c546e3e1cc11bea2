"""One description per model type: everything attnlens needs to know about an architecture, in one entry.

An :class:`Architecture` says, for one ``config.model_type``:

- ``adapter``: the family's adapter (:mod:`attnlens.models.adapters`: which attention streams, hidden states and query
  rows are explained); its ``family`` is ``encoder``, ``decoder`` or ``encoder-decoder``;
- ``pooling``: where the classification head reads the final states (``first`` token, ``last`` real token, the
  decoder's ``eos``, or the ``mean`` over real tokens), or a function of the config choosing one;
- ``position_offset``: whether position ids start after the padding index (RoBERTa-style), which shortens the
  usable length by ``pad_token_id + 1``;
- ``lrp``: what the LRP methods need (:class:`LRPSupport`), or ``None`` where they are not supported;
- ``layers``: where the layers and their value projections are (:class:`Layers`), for methods that rerun one
  layer (value zeroing), or ``None`` where such methods are skipped;
- ``anatomy``: where a layer's pieces (post-LN encoders, pre-LN decoders) and the classification head are
  (:class:`Anatomy`), for the norm-based and decomposition methods (``attnnorm``, ``globenc``, ``alti``,
  ``decompx``); ``None``: not supported.

Adding a model type is one :func:`register_architecture` call (or one entry in ``_ENTRIES``), plus a recipe for a
tiny random model of the type in :mod:`attnlens.testing.tiny_models`, which the tests use to build and explain
every type: see docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from .adapters import (
    DECODER,
    ENCODER,
    ENCODER_DECODER,
    FIRST,
    MEAN,
    POOLINGS,
    Adapter,
)


@dataclass(frozen=True)
class Residual:
    """A post-LN residual sum ``norm(x + branch(x))`` inside modules whose class name ends with ``module``:
    ``norm`` and ``branch`` are attribute names of that module (LRP rules="chefer" rescales the sum)."""

    module: str
    norm: str
    branch: str


@dataclass(frozen=True)
class PreNorm:
    """A pre-LN block ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))`` of class ``module`` (exact class name);
    the other fields are attribute names. LRP rules="chefer" runs such blocks with its normalised residual sums.
    ``parallel``: the block is ``x + attn(norm1(x)) + mlp(norm2(x))`` (one residual sum, the two branches as one
    operand), or the name of the block's attribute that says whether it is (GPT-NeoX's ``use_parallel_residual``).
    ``weights``: the block returns ``(hidden states, attention weights)`` (GPT-Neo), not the states alone; or a
    function of the block saying whether it does (GPT-J's, by the installed transformers).
    ``post1``, ``post2``: norms applied to each branch's output before its residual sum (Gemma 2's sandwich)."""

    module: str
    norm1: str
    attn: str
    norm2: str
    mlp: str
    parallel: bool | str = False
    weights: bool | Callable[[nn.Module], bool] = False
    post1: str | None = None
    post2: str | None = None

    def is_parallel(self, block: nn.Module) -> bool:
        """Whether ``block`` (of this spec's class) adds both branches to its input."""
        return bool(getattr(block, self.parallel)) if isinstance(self.parallel, str) else self.parallel

    def returns_weights(self, block: nn.Module) -> bool:
        """Whether ``block`` (of this spec's class) returns ``(hidden states, attention weights)``."""
        return self.weights(block) if callable(self.weights) else self.weights


@dataclass(frozen=True)
class LRPSupport:
    """The facts the LRP patch (:mod:`attnlens.lrp.patch`) needs about one architecture.

    ``forwards`` maps exact module class names to the LRP forward that replaces theirs during the pass (names of
    :data:`attnlens.lrp.modules.FORWARDS`): for what the generic patches (``nn.Linear``, ``Conv1D``,
    ``nn.LayerNorm``, activation modules, the attention interface) do not reach, such as inline nonlinearities,
    gated products, RMSNorm, or an attention that does not go through transformers' attention interface.
    ``"Class.method"`` replaces that method instead of ``forward`` (GPT-Neo's and GPT-J's ``_attn``) where the
    installed class has it (GPT-J's attention has none since transformers 5.24: it calls the attention interface)."""

    name: str  # display name, listed in the "LRP supports ..." error
    residuals: tuple[Residual, ...] = ()  # post-LN residual sums the chefer rules rescale
    blocks: tuple[PreNorm, ...] = ()  # pre-LN blocks whose residual sums the chefer rules rescale
    forwards: tuple[tuple[str, str], ...] = ()  # (module class name, LRP forward name)
    own_sums: bool = False  # forwards of ``forwards`` rescale the residual sums themselves (OPT's layer, BLOOM's)
    # the module (path below the base model) whose input is the summed input embeddings (word + position +
    # segment); None: the word embeddings themselves (models without absolute position embeddings)
    embedding_input: str | None = "embeddings.LayerNorm"
    # the word-embedding module (path below the base model) whose output is the leaf the word relevance is read
    # at; None: the model's input embeddings (an encoder-decoder's encoder embeds with a module of its own)
    word_embeddings: str | None = None
    # an encoder-decoder's decoder: the module whose input at its first call is the decoder's summed input
    # embeddings, so the pass reports the relevance the decoder's inputs take (``LRPResult.decoder_relevance``);
    # None: no decoder
    decoder_input: str | None = None
    # (model class, config attribute) of a cap c * tanh(z / c) that class applies inline to its logits (Gemma 2's
    # causal LM): during the pass the model returns the raw logits and the pass caps them under the identity rule
    logit_softcap: tuple[str, str] | None = None
    # the model's attention computes its scores in float32 whatever its dtype (GPT-J: against overflow in half
    # precision); the LRP attention of the attention interface does the same
    float32_scores: bool = False


@dataclass(frozen=True)
class Anatomy:
    """Where the pieces of a transformer layer and of the classification head are, as dotted module paths (read
    by :mod:`attnlens.methods.decomposition`; the layers themselves and their value projections are the entry's
    :class:`Layers`). A post-LN encoder layer is ``LN2(h + FFN(h))``, ``h = LN1(x + Attn(x))``; a pre-LN
    (``pre_ln``) decoder layer is ``h + FFN(LN2(h))``, ``h = x + Attn(LN1(x))``, and ``final_norm`` (a path under
    the base model) normalises the last layer's output. A ``parallel`` pre-LN layer feeds its input to both
    branches, ``x + Attn(LN1(x)) + FFN(LN2(x))`` (GPT-J, GPT-NeoX, Phi; ``ln2`` may name ``ln1``'s module).

    ``output`` ... ``ln2`` are relative to one layer (``act`` is the FFN's activation, a module or function
    attribute; ``gate``: a gated FFN ``ffn_out(act(gate(y)) ⊙ ffn_in(y))``, Llama's; ``gate_up``: such an FFN
    whose gate and ``ffn_in`` are one fused projection, the gate's rows first, Phi-3's). ``head`` lists the
    classification head's ``(linear, activation)`` steps from the pooled state to the logits, the activation a
    path from the model root, a name in ``HEAD_ACTIVATIONS`` (for heads that apply it inline) or ``None``; a
    language model's head is its output embeddings; a step may be a norm instead of a linear layer
    (ModernBERT's head: dense, activation, LayerNorm), read by DecompX with its scale held.
    """

    head: tuple[tuple[str, str | None], ...]
    output: str = "attention.output.dense"
    ln1: str = "attention.output.LayerNorm"
    ffn_in: str | None = "intermediate.dense"
    act: str | None = "intermediate.intermediate_act_fn"
    ffn_out: str | None = "output.dense"
    ln2: str = "output.LayerNorm"
    pre_ln: bool = False
    gate: str | None = None
    final_norm: str | None = None
    parallel: bool = False
    # the whole FFN as one module (ffn_in, act, ffn_out None): attnnorm, GlobEnc and ALTI need only its output,
    # DecompX (which linearises the FFN through its pieces) is refused
    ffn: str | None = None
    gate_up: str | None = None
    # a routed mixture of gated experts in Mixtral's layout (router ``gate``, expert tensors ``experts.gate_up_proj``
    # and ``experts.down_proj``, activation ``experts.act_fn``), in place of the FFN's pieces
    moe: str | None = None
    # pre-LN "sandwich" norms on each branch's output before its residual sum (Gemma 2: x + N(Attn(LN1(x))))
    post_attn_norm: str | None = None
    post_ffn_norm: str | None = None
    # an encoder-decoder's cross-attention value and output projections, within a decoder layer (attnnorm on the
    # cross stream); the decoder's self-attention is read with ``output``, ``ln1`` and the entry's value path
    cross_value: str | None = None
    cross_output: str | None = None
    # the norm of the cross-attention block: after its residual sum (post-LN, BART's) or before it on the decoder
    # state (pre-LN, mBART's and T5's); read by ALTI on the decoder and cross streams
    cross_norm: str | None = None
    # an encoder-decoder's decoder layers where they differ from the encoder's (the FFN's and final norm's paths:
    # T5's decoder blocks hold the FFN third, after the cross-attention); None: as the encoder's
    decoder: Anatomy | None = None
    # a sequence-to-sequence language model's factor on the decoder's output before the output embeddings, a
    # function of the config (T5 scales by d_model^-1/2 where its embeddings are tied), or None (no factor)
    lm_scale: Callable[[Any], float] | None = None


HEAD_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh, "relu": torch.relu, "gelu": nn.functional.gelu}


@dataclass(frozen=True)
class Layers:
    """Where the transformer layers and their value projections are: for the methods that rerun one layer with
    some value vectors changed (value zeroing) or recompute each layer from its modules (the norm-based and
    decomposition methods, with the entry's :class:`Anatomy`).

    ``layers`` is the attribute path of the layers' ``ModuleList`` under ``model.base_model`` (encoder-decoders:
    one path per attention stream, e.g. ``{"encoder": "encoder.layers", "decoder": "decoder.layers"}``), or a
    function of the model giving one module per layer application (a layer shared across depths, as ALBERT's,
    repeats); ``value`` the path, within one layer, of the module whose output ``(B, N, fused * heads *
    head_dim)`` holds every head's value vectors: alone (``fused=1``), as the last of ``fused`` equal parts
    (GPT-2's query/key/value projection: ``fused=3``), or, with ``per_head``, as the last of ``fused`` parts
    within each head's slice (GPT-NeoX's and BLOOM's ``(heads, 3, head_dim)`` layout); the parts after the
    queries may be narrower (Phi-3's grouped-query keys and values); ``grouped``: key/value groups laid out
    ``(groups, queries per group + 2, head_dim)``, each group's value last (Falcon: per head, multi-query and
    grouped are its cases). ``head_rows`` names the layers' keyword arguments laid out as (batch × heads) rows
    (BLOOM's and Falcon's ALiBi biases): a rerun on some examples takes each one's block of rows. ``no_rerun``
    says why a layer cannot be rerun on some of the batch's rows, where it cannot (value zeroing is then refused);
    a function of the config where that depends on it."""

    layers: str | dict[str, str] | Callable[[nn.Module], list[nn.Module]]
    value: str
    fused: int = 1
    per_head: bool = False
    grouped: bool = False
    head_rows: tuple[str, ...] = ()
    # keyword arguments of the layers that every example shares (no batch axis; DeBERTa's relative positions and
    # embeddings): a rerun on some examples passes them unchanged
    shared: tuple[str, ...] = ()
    # why one layer cannot be rerun on some rows of the batch (value zeroing), or None: it can
    no_rerun: str | Callable[[Any], str | None] | None = None
    # a parameter (path within one layer) the attention adds to the value vectors after the projection
    # (DeBERTa's v_bias): part of each value vector, so zeroing a value vector zeroes it too
    value_bias: str | None = None

    def why_no_rerun(self, config: Any) -> str | None:
        """Why this model's layers cannot be rerun on some rows of the batch, or ``None``."""
        return self.no_rerun(config) if callable(self.no_rerun) else self.no_rerun

    def value_features(self, width: int, heads: int, head_dim: int) -> torch.Tensor:
        """``(width,)`` bool: which features of the value module's output (``width`` wide; ``heads`` query heads
        of ``head_dim``) are value vectors, in head order. Fused after the queries, the other parts are equal
        (GPT-2's keys and values; Phi-3's grouped-query keys and values are narrower than its queries)."""
        mask = torch.zeros(width, dtype=torch.bool)
        if self.fused == 1:
            mask[:] = True
        elif self.grouped:  # width = groups * (queries per group + 2) * head_dim, queries = heads * head_dim
            mask.view((width // head_dim - heads) // 2, -1, head_dim)[:, -1] = True
        elif self.per_head:
            mask.view(heads, self.fused, -1)[:, -1] = True
        else:
            mask[-((width - heads * head_dim) // (self.fused - 1)):] = True
        return mask

    def path(self, stream: str) -> str | None:
        """The layers' path for attention stream ``stream`` (``"self"`` for single-stream models), or ``None``
        (no such stream; a function of the model: ``"<function>"`` for ``"self"``)."""
        if callable(self.layers):
            return getattr(self.layers, "__name__", "<function>") if stream == "self" else None
        return self.layers.get(stream) if isinstance(self.layers, dict) else (
            self.layers if stream == "self" else None)

    @property
    def streams(self) -> tuple[str, ...]:
        """The attention streams whose layers this entry locates (``("self",)`` for single-stream models)."""
        return tuple(self.layers) if isinstance(self.layers, dict) else ("self",)

    def modules(self, model: nn.Module, stream: str = "self") -> list[nn.Module]:
        """One module per layer application of stream ``stream``, in depth order."""
        if callable(self.layers):
            return list(self.layers(model))
        path = self.path(stream)
        if path is None:
            raise ModelError(f"{model.config.model_type!r} has no {stream!r} attention stream")
        root: Any = model.base_model
        for name in path.split("."):
            if not hasattr(root, name):
                raise ModelError(f"{type(model.base_model).__name__} has no module at {path!r}, which the "
                                 f"{model.config.model_type!r} entry's layers name (attnlens.register_architecture)")
            root = getattr(root, name)
        return list(root)


@dataclass(frozen=True)
class PositionTerms:
    """Relative-position score terms an attention layer builds as ``heads × N × columns`` values before gathering
    them into its ``N × N`` scores (DeBERTa's content-to-position and position-to-content); each gather keeps its
    input for the backward, so a backward holds every layer's. ``count``: the terms per layer; ``span``: the
    relative distances each side; ``grows``: the span is ``min(N, span)`` (DeBERTa's) rather than fixed
    (DeBERTa-v2's, its position buckets: the terms are linear in the length)."""

    count: int = 0
    span: int = 0
    grows: bool = False

    def columns(self, n: int) -> int:
        """Values per head and token of one term over ``n`` tokens."""
        return 2 * (min(n, self.span) if self.grows else self.span)


@dataclass(frozen=True)
class Architecture:
    """Everything attnlens knows about one ``config.model_type`` (see the module docstring)."""

    model_type: str
    adapter: Adapter
    pooling: str | Callable[[Any], str] | None = None  # None: the adapter's default
    position_offset: bool = False
    lrp: LRPSupport | None = None
    layers: Layers | None = None  # None: methods that rerun a layer (value zeroing) are skipped for this type
    # None: the norm-based and decomposition methods are skipped for this type; a function of the config for
    # types whose layers differ by config (T5's gated feed-forward)
    anatomy: Anatomy | Callable[[Any], Anatomy] | None = None
    # what a forward holds at its peak beside its layers' probabilities, both counted by the memory estimates
    # (measured with attnlens.testing.live_tensors; tests/test_memory.py checks them):
    # H x N x N maps: score biases built once and shared between layers (T5's relative-position bias: the
    # encoder's, the decoder's and the cross-attention's, and the temporaries it is built through), the score
    # terms an attention layer builds beside its probabilities (DeBERTa's content-to-position and back)
    bias_maps: int = 0
    # N x N arrays (one value per pair of tokens, all heads): masks built whole (ModernBERT's global and
    # sliding-window masks, Gemma 2's, BLOOM's and Falcon's), relative-position indices (DeBERTa's)
    mask_maps: int = 0
    # N x N arrays each layer builds for itself, which a backward keeps with the layer's activations (ModernBERT's
    # sliding-window layers each build their windowed mask, and fused attention saves it for the backward;
    # DeBERTa's layers each clamp the relative positions into two int64 gather indices: 4 float32s' worth)
    layer_mask_maps: int = 0
    # the content-to-position score terms each attention layer builds before gathering them into N x N (DeBERTa's),
    # a function of the config; None: the type builds none
    position_terms: Callable[[Any], PositionTerms] | None = None
    # whether the word embeddings go straight into a normalisation, which forgets their scale (BLOOM's and
    # ModernBERT's embedding LayerNorm; DeBERTa's where it adds no positions or token types): the model's output
    # does not change with the embeddings' length, so input x gradient sums to 0 there; a function of the config
    # for types where it depends on the config
    normalised_embeddings: bool | Callable[[Any], bool] = False

    @property
    def family(self) -> str:
        return self.adapter.family

    def normalises_embeddings(self, config: Any) -> bool:
        """Whether this model's word embeddings reach nothing but a normalisation (see ``normalised_embeddings``)."""
        value = self.normalised_embeddings
        return bool(value(config) if callable(value) else value)

    def pooling_for(self, config: Any) -> str:
        """Where this model's head reads (:data:`attnlens.models.adapters.POOLINGS`)."""
        pooling = self.pooling(config) if callable(self.pooling) else self.pooling
        return pooling or self.adapter.pooling

    def anatomy_for(self, config: Any) -> Anatomy | None:
        """The layer anatomy of this model (encoder-decoders: of its encoder), or ``None``."""
        return self.anatomy(config) if callable(self.anatomy) else self.anatomy

    def position_terms_for(self, config: Any) -> PositionTerms:
        """The relative-position score terms this model's attention layers build (none for most types)."""
        return self.position_terms(config) if self.position_terms is not None else PositionTerms()

    def adapter_for(self, config: Any) -> Adapter:
        """The family adapter, set to this model's pooling."""
        return self.adapter.with_pooling(self.pooling_for(config))


def _modernbert_pooling(config: Any) -> str:
    # ModernBERT's head reads [CLS] or, with classifier_pooling="mean", the mean over the real tokens
    return MEAN if getattr(config, "classifier_pooling", "cls") == "mean" else FIRST


_BERT_LAYERS = Layers("encoder.layer", "attention.self.value")
_LLAMA_LAYERS = Layers("layers", "self_attn.v_proj")

# --- LRP facts -------------------------------------------------------------------------------------------------
_BERT_RESIDUALS = (Residual("Output", "LayerNorm", "dropout"),)  # XSelfOutput, XOutput: LN(dropout(dense(h)) + x)


def _roberta_lrp(name: str) -> LRPSupport:
    """RoBERTa and its copies (XLM-R, CamemBERT: the same modules under their own class names): BERT's residual
    sums, the identity rule on the classification head's inline tanh."""
    prefix = {"RoBERTa": "Roberta", "XLM-RoBERTa": "XLMRoberta", "CamemBERT": "Camembert"}[name]
    return LRPSupport(name, _BERT_RESIDUALS, forwards=((f"{prefix}ClassificationHead", "tanh_head"),))


def _seq2seq_lrp(name: str) -> LRPSupport:
    """BART and mBART: the encoder's and the decoder's summed embeddings (word × scale + position) are the inputs
    of their ``layernorm_embedding``; the classification head (given the pooled EOS state) applies tanh inline.
    Their residual sums are inline, so only AttnLRP's and CP-LRP's rules apply (no chefer layout)."""
    prefix = {"BART": "Bart", "mBART": "MBart"}[name]
    return LRPSupport(name, forwards=((f"{prefix}ClassificationHead", "pooled_tanh_head"),),
                      embedding_input="encoder.layernorm_embedding", word_embeddings="encoder.embed_tokens",
                      decoder_input="decoder.layernorm_embedding")


# T5 (and T5 v1.1 / Flan-T5, whose feed-forward is gated): RMS norms, relative-position score biases passed through
# the attention interface, no absolute positions (the inputs are the stacks' word embeddings, the decoder's the input
# of its first dropout), the classification head's inline tanh on the pooled EOS state
_T5_LRP = LRPSupport("T5", forwards=(("T5LayerNorm", "rms_norm"), ("T5DenseGatedActDense", "t5_gated_ffn"),
                                     ("T5ClassificationHead", "pooled_tanh_head")),
                     embedding_input=None, word_embeddings="encoder.embed_tokens", decoder_input="decoder.dropout")


def _llama_lrp(prefix: str, mlp: tuple[str, str] | None = None) -> LRPSupport:
    """Llama-family decoders (class names ``<prefix>...``): pre-RMSNorm blocks, gated MLP (or ``mlp``: another
    (class, LRP forward) for the block's ``mlp``), rotary attention through the attention interface, no absolute
    position embeddings."""
    return LRPSupport(
        prefix, blocks=(PreNorm(f"{prefix}DecoderLayer", "input_layernorm", "self_attn", "post_attention_layernorm",
                              "mlp"),),
        forwards=((f"{prefix}RMSNorm", "rms_norm"), mlp or (f"{prefix}MLP", "gated_mlp")), embedding_input=None)


# --- anatomy of the BERT-style encoders (norm-based and decomposition methods) -----------------------------
def _bert_like(prefix: str, head: tuple[tuple[str, str | None], ...] | None = None) -> Anatomy:
    """BertLayer module names (the layers are ``_BERT_LAYERS``); the head is BERT's pooler + classifier unless
    given."""
    pooler = ((f"{prefix}.pooler.dense", f"{prefix}.pooler.activation"), ("classifier", None))
    return Anatomy(head or pooler)


def _albert_layers(model: nn.Module) -> list[nn.Module]:
    """ALBERT's shared layers, one entry per layer applied (groups of one layer, as in every released model)."""
    config = model.config
    why = _albert_no_rerun(config)
    if why:
        raise ModelError(why)
    groups = model.albert.encoder.albert_layer_groups
    n, g = config.num_hidden_layers, config.num_hidden_groups
    return [groups[int(i / (n / g))].albert_layers[0] for i in range(n)]


def _albert_no_rerun(config: Any) -> str | None:
    """Why an ALBERT's layers cannot be taken one by one: groups of several layers (``inner_group_num`` > 1)."""
    if config.inner_group_num != 1:
        return (f"this ALBERT applies {config.inner_group_num} layers per group (inner_group_num), and attnlens "
                "takes its layers one per group, as in every released ALBERT")
    return None


_ALBERT_ANATOMY = Anatomy((("albert.pooler", "albert.pooler_activation"), ("classifier", None)),
                          output="attention.dense", ln1="attention.LayerNorm", ffn_in="ffn", act="activation",
                          ffn_out="ffn_output", ln2="full_layer_layer_norm")


def _albert_anatomy(config: Any) -> Anatomy | None:
    """ALBERT's anatomy where its layers can be taken one by one (:func:`_albert_no_rerun`), else none."""
    return None if _albert_no_rerun(config) else _ALBERT_ANATOMY


_ROBERTA_ANATOMY = _bert_like("roberta", (("classifier.dense", "tanh"), ("classifier.out_proj", None)))

_MPNET_ANATOMY = Anatomy((("classifier.dense", "tanh"), ("classifier.out_proj", None)), output="attention.attn.o",
                         ln1="attention.LayerNorm")
# XLM-RoBERTa-XL: a pre-LN encoder (LayerNorm before the attention and before the FFN, one after the last layer)
_XLMR_XL_ANATOMY = Anatomy(_ROBERTA_ANATOMY.head, ln1="attention.self_attn_layer_norm", ln2="LayerNorm", pre_ln=True,
                           final_norm="encoder.LayerNorm")


def _deberta_v2_anatomy(config: Any) -> Anatomy | None:
    """DeBERTa-v2/v3: BERT's layer names (relative positions enter the attention weights only); the pooler's
    activation is the config's. None with the convolution beside the first layer (``conv_kernel_size``), which
    adds to that layer's output, or an activation the head steps do not know."""
    act = getattr(config, "pooler_hidden_act", "gelu")
    if getattr(config, "conv_kernel_size", 0) or act not in HEAD_ACTIVATIONS:
        return None
    return Anatomy((("pooler.dense", act), ("classifier", None)))


def _deberta_position_terms(config: Any) -> PositionTerms:
    """DeBERTa's and DeBERTa-v2's content-to-position terms (``pos_att_type``), when relative attention is on:
    v1 spans the length up to ``max_relative_positions``; v2 a fixed span, its position buckets where it has
    them."""
    if not getattr(config, "relative_attention", False):
        return PositionTerms()
    types = getattr(config, "pos_att_type", None) or ()
    if isinstance(types, str):
        types = [t.strip() for t in types.lower().split("|")]
    count = sum(t in types for t in ("c2p", "p2c"))
    span = getattr(config, "max_relative_positions", -1)
    if span < 1:
        span = config.max_position_embeddings
    if config.model_type == "deberta":
        return PositionTerms(count, span, grows=True)
    buckets = getattr(config, "position_buckets", -1)
    return PositionTerms(count, buckets if buckets > 0 else span)


def _deberta_normalised(config: Any) -> bool:
    """DeBERTa's embeddings add positions and token types only where the config says so; without either, the
    word embeddings go straight into its LayerNorm (the released DeBERTa and DeBERTa-v3 checkpoints)."""
    return not getattr(config, "position_biased_input", True) and not getattr(config, "type_vocab_size", 0)


def _deberta_anatomy(config: Any) -> Anatomy | None:
    """DeBERTa (v1): BERT's layer names and DeBERTa-v2's head; its query, key and value come from one projection
    (each head's slice: query, key, value) and the value bias is added after it (the entry's :class:`Layers`).
    None with talking heads (``talking_head``: the heads' scores and probabilities mixed by learned projections)."""
    if getattr(config, "talking_head", False):
        return None
    return _deberta_v2_anatomy(config)


# ModernBERT: pre-LN (no norm before the first layer's attention: an identity), one fused query/key/value projection,
# a GLU feed-forward (activation on the first half), a head of dense, activation and LayerNorm
_MODERNBERT_ANATOMY = Anatomy((("head.dense", "head.act"), ("head.norm", None), ("classifier", None)),
                              output="attn.Wo", ln1="attn_norm", ffn_in=None, gate_up="mlp.Wi", act="mlp.act",
                              ffn_out="mlp.Wo", ln2="mlp_norm", pre_ln=True, final_norm="final_norm")

# pre-LN decoders: GPT-2 (fused Conv1D projections, GELU MLP) and the Llama family (RMSNorm, gated SiLU MLP)
_GPT2_ANATOMY = Anatomy((("score", None),), output="attn.c_proj", ln1="ln_1", ffn_in="mlp.c_fc", act="mlp.act",
                        ffn_out="mlp.c_proj", ln2="ln_2", pre_ln=True, final_norm="ln_f")
_LLAMA_ANATOMY = Anatomy((("score", None),), output="self_attn.o_proj", ln1="input_layernorm", ffn_in="mlp.up_proj",
                         gate="mlp.gate_proj", act="mlp.act_fn", ffn_out="mlp.down_proj",
                         ln2="post_attention_layernorm", pre_ln=True, final_norm="norm")

_GPT_NEO_ANATOMY = replace(_GPT2_ANATOMY, output="attn.attention.out_proj")


def _gptj_block_returns_weights(block: nn.Module) -> bool:
    """Whether a GPT-J block returns ``(hidden states, attention weights)``: it does while its attention has its
    own ``_attn`` (transformers before 5.24); since, its attention calls the attention interface and the block
    returns the states alone."""
    return hasattr(type(block.attn), "_attn")


def _bloom_anatomy(config: Any) -> Anatomy | None:
    """BLOOM's pre-LN layers (ALiBi lives in the attention maps); none where the residual is the normalised state
    (``apply_residual_connection_post_layernorm``)."""
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        return None
    return Anatomy((("score", None),), output="self_attention.dense", ln1="input_layernorm",
                   ffn_in="mlp.dense_h_to_4h", act="mlp.gelu_impl", ffn_out="mlp.dense_4h_to_h",
                   ln2="post_attention_layernorm", pre_ln=True, final_norm="ln_f")


# Llama's layers with the FFN read as one module: Mixtral's routed mixture of experts, Phi-3's fused gate/up
_LLAMA_MOE = replace(_LLAMA_ANATOMY, moe="mlp", ffn_in=None, gate=None, act=None, ffn_out=None)
_PHI3_ANATOMY = replace(_LLAMA_ANATOMY, ffn_in=None, gate=None, gate_up="mlp.gate_up_proj", act="mlp.activation_fn")

# Gemma 2: Llama's names, a norm before and after each branch (its "post_attention_layernorm" is the latter)
_GEMMA2_ANATOMY = replace(_LLAMA_ANATOMY, ln2="pre_feedforward_layernorm", post_attn_norm="post_attention_layernorm",
                          post_ffn_norm="post_feedforward_layernorm")

# parallel pre-LN decoders: both branches read the layer input (GPT-J and Phi through one LayerNorm)
_GPTJ_ANATOMY = Anatomy((("score", None),), output="attn.out_proj", ln1="ln_1", ffn_in="mlp.fc_in", act="mlp.act",
                        ffn_out="mlp.fc_out", ln2="ln_1", pre_ln=True, final_norm="ln_f", parallel=True)
_PHI_ANATOMY = Anatomy((("score", None),), output="self_attn.dense", ln1="input_layernorm", ffn_in="mlp.fc1",
                       act="mlp.activation_fn", ffn_out="mlp.fc2", ln2="input_layernorm", pre_ln=True,
                       final_norm="final_layernorm", parallel=True)


def _gpt_neox_anatomy(config: Any) -> Anatomy:
    """GPT-NeoX (Pythia): two LayerNorms, parallel unless ``use_parallel_residual`` is off."""
    return Anatomy((("score", None),), output="attention.dense", ln1="input_layernorm", ffn_in="mlp.dense_h_to_4h",
                   act="mlp.act", ffn_out="mlp.dense_4h_to_h", ln2="post_attention_layernorm", pre_ln=True,
                   final_norm="final_layer_norm", parallel=getattr(config, "use_parallel_residual", True))


def _falcon_anatomy(config: Any) -> Anatomy:
    """Falcon's three layouts: sequential (two LayerNorms), parallel with one LayerNorm (Falcon-7B), parallel with
    two (``new_decoder_architecture``, Falcon-40B: ``ln_attn``, ``ln_mlp``)."""
    parallel = bool(config.new_decoder_architecture or config.parallel_attn)
    two = config.new_decoder_architecture and config.num_ln_in_parallel_attn in (None, 2)  # None: 2 at init
    ln1, ln2 = (("ln_attn", "ln_mlp") if two else ("input_layernorm", "input_layernorm") if parallel
                else ("input_layernorm", "post_attention_layernorm"))
    return Anatomy((("score", None),), output="self_attention.dense", ln1=ln1, ffn_in="mlp.dense_h_to_4h",
                   act="mlp.act", ffn_out="mlp.dense_4h_to_h", ln2=ln2, pre_ln=True, final_norm="ln_f",
                   parallel=parallel)


def _opt_anatomy(config: Any) -> Anatomy | None:
    """OPT's pre-LN layers; OPT-350m (post-LN, its states projected in and out of a narrower width) has none."""
    if not getattr(config, "do_layer_norm_before", True) or config.word_embed_proj_dim != config.hidden_size:
        return None
    return Anatomy((("score", None),), output="self_attn.out_proj", ln1="self_attn_layer_norm", ffn_in="fc1",
                   act="activation_fn", ffn_out="fc2", ln2="final_layer_norm", pre_ln=True,
                   final_norm="decoder.final_layer_norm")


# encoder-decoders: the anatomy of the encoder's layers (the stream the norm-based methods read there); their
# classification heads read the decoder's state at the last EOS
_SEQ2SEQ_HEAD = (("classification_head.dense", "tanh"), ("classification_head.out_proj", None))
_BART_ANATOMY = Anatomy(_SEQ2SEQ_HEAD, output="self_attn.out_proj", ln1="self_attn_layer_norm", ffn_in="fc1",
                        act="activation_fn", ffn_out="fc2", ln2="final_layer_norm", cross_value="encoder_attn.v_proj",
                        cross_output="encoder_attn.out_proj", cross_norm="encoder_attn_layer_norm")
_MBART_ANATOMY = replace(_BART_ANATOMY, pre_ln=True, final_norm="encoder.layer_norm",
                         decoder=replace(_BART_ANATOMY, pre_ln=True, final_norm="decoder.layer_norm"))
_SEQ2SEQ_LAYERS = Layers({"encoder": "encoder.layers", "decoder": "decoder.layers"}, "self_attn.v_proj")


def _t5_anatomy(config: Any) -> Anatomy:
    """T5's pre-LN (RMS) blocks; T5 v1.1 / Flan-T5 gate their feed-forward (``wi_0`` gated by ``wi_1``)."""
    def ffn(block: int) -> dict[str, str]:  # the feed-forward of the encoder's blocks (1) or the decoder's (2)
        at = f"layer.{block}.DenseReluDense."
        gated = dict(gate=at + "wi_0", ffn_in=at + "wi_1") if getattr(config, "is_gated_act", False) else dict(
            ffn_in=at + "wi")
        return dict(act=at + "act", ffn_out=at + "wo", ln2=f"layer.{block}.layer_norm", **gated)

    cross = dict(cross_value="layer.1.EncDecAttention.v", cross_output="layer.1.EncDecAttention.o",
                 cross_norm="layer.1.layer_norm")
    decoder = Anatomy((), output="layer.0.SelfAttention.o", ln1="layer.0.layer_norm", pre_ln=True,
                      final_norm="decoder.final_layer_norm", **ffn(2), **cross)
    return Anatomy(_SEQ2SEQ_HEAD, output="layer.0.SelfAttention.o", ln1="layer.0.layer_norm", pre_ln=True,
                   final_norm="encoder.final_layer_norm", decoder=decoder, lm_scale=_t5_lm_scale, **ffn(1), **cross)


def _t5_lm_scale(config: Any) -> float:
    """T5 scales its decoder's output by d_model^-1/2 before the output embeddings where they are tied to the input
    embeddings (``scale_decoder_outputs`` in recent transformers, ``tie_word_embeddings`` before)."""
    scaled = getattr(config, "scale_decoder_outputs", getattr(config, "tie_word_embeddings", True))
    return float(config.d_model) ** -0.5 if scaled else 1.0


_ENTRIES: list[Architecture] = [
    # encoders (the first five in the order the LRP error lists them)
    Architecture("bert", ENCODER, lrp=LRPSupport("BERT", _BERT_RESIDUALS), anatomy=_bert_like("bert"),
                 layers=_BERT_LAYERS),
    Architecture("roberta", ENCODER, position_offset=True, anatomy=_ROBERTA_ANATOMY, lrp=_roberta_lrp("RoBERTa"),
                 layers=_BERT_LAYERS),
    Architecture("distilbert", ENCODER,
                 anatomy=Anatomy((("pre_classifier", "relu"), ("classifier", None)), output="attention.out_lin",
                                 ln1="sa_layer_norm", ffn_in="ffn.lin1", act="ffn.activation", ffn_out="ffn.lin2",
                                 ln2="output_layer_norm"),
                 lrp=LRPSupport("DistilBERT", (Residual("TransformerBlock", "sa_layer_norm", "attention"),
                                               Residual("TransformerBlock", "output_layer_norm", "ffn"))),
                 layers=Layers("transformer.layer", "attention.v_lin")),
    Architecture("albert", ENCODER, anatomy=_albert_anatomy,
                 lrp=LRPSupport("ALBERT", (Residual("AlbertAttention", "LayerNorm", "output_dropout"),
                                           Residual("AlbertLayer", "full_layer_layer_norm", "ffn_output"))),
                 layers=Layers(_albert_layers, "attention.value", no_rerun=_albert_no_rerun)),
    Architecture("electra", ENCODER, lrp=LRPSupport("ELECTRA", _BERT_RESIDUALS),
                 anatomy=_bert_like("electra", (("classifier.dense", "classifier.activation"),
                                                ("classifier.out_proj", None))),
                 layers=_BERT_LAYERS),
    Architecture("xlm-roberta", ENCODER, position_offset=True, anatomy=_ROBERTA_ANATOMY,
                 lrp=_roberta_lrp("XLM-RoBERTa"), layers=_BERT_LAYERS),
    Architecture("camembert", ENCODER, position_offset=True, anatomy=_ROBERTA_ANATOMY, lrp=_roberta_lrp("CamemBERT"),
                 layers=_BERT_LAYERS),
    Architecture("deberta", ENCODER, anatomy=_deberta_anatomy, normalised_embeddings=_deberta_normalised,
                 layers=Layers("encoder.layer", "attention.self.in_proj", fused=3, per_head=True,
                               value_bias="attention.self.v_bias", shared=("relative_pos", "rel_embeddings")),
                 lrp=LRPSupport("DeBERTa", _BERT_RESIDUALS, forwards=(
                     ("DisentangledSelfAttention", "deberta_v1_attention"), ("ContextPooler", "deberta_pooler"))),
                 bias_maps=4, mask_maps=11, layer_mask_maps=4, position_terms=_deberta_position_terms),
    Architecture("deberta-v2", ENCODER, anatomy=_deberta_v2_anatomy, normalised_embeddings=_deberta_normalised,
                 layers=Layers("encoder.layer", "attention.self.value_proj", shared=("relative_pos", "rel_embeddings")),
                 lrp=LRPSupport("DeBERTa-v2", _BERT_RESIDUALS, forwards=(
                     ("DisentangledSelfAttention", "deberta_attention"), ("ContextPooler", "deberta_pooler"),
                     ("ConvLayer", "deberta_conv"))), bias_maps=2, mask_maps=13, layer_mask_maps=4,
                 position_terms=_deberta_position_terms),
    Architecture("mpnet", ENCODER, anatomy=_MPNET_ANATOMY, layers=Layers("encoder.layer", "attention.attn.v"),
                 lrp=LRPSupport("MPNet", (Residual("MPNetAttention", "LayerNorm", "dropout"), *_BERT_RESIDUALS),
                                forwards=(("MPNetSelfAttention", "mpnet_attention"),
                                          ("MPNetClassificationHead", "tanh_head")))),
    Architecture("ernie", ENCODER, anatomy=_bert_like("ernie"), lrp=LRPSupport("ERNIE", _BERT_RESIDUALS),
                 layers=_BERT_LAYERS),
    Architecture("modernbert", ENCODER, pooling=_modernbert_pooling, anatomy=_MODERNBERT_ANATOMY,
                 normalised_embeddings=True,
                 layers=Layers("layers", "attn.Wqkv", fused=3),
                 lrp=LRPSupport("ModernBERT", blocks=(PreNorm("ModernBertEncoderLayer", "attn_norm", "attn", "mlp_norm",
                                                              "mlp"),),
                                forwards=(("ModernBertMLP", "glu_mlp"),), embedding_input="embeddings.norm"),
                 mask_maps=4, layer_mask_maps=1),
    Architecture("xlm-roberta-xl", ENCODER, position_offset=True, anatomy=_XLMR_XL_ANATOMY, layers=_BERT_LAYERS,
                 lrp=LRPSupport("XLM-RoBERTa-XL", forwards=(
                     ("XLMRobertaXLSelfOutput", "dense_residual"), ("XLMRobertaXLOutput", "dense_residual"),
                     ("XLMRobertaXLClassificationHead", "tanh_head")),
                     own_sums=True, embedding_input="embeddings.dropout")),  # word + type + position, no norm
    # decoders
    Architecture("gpt2", DECODER,
                 lrp=LRPSupport("GPT-2", blocks=(PreNorm("GPT2Block", "ln_1", "attn", "ln_2", "mlp"),),
                                embedding_input="drop"),  # GPT2Model.drop(wte + wpe)
                 layers=Layers("h", "attn.c_attn", fused=3), anatomy=_GPT2_ANATOMY),
    Architecture("gpt_neo", DECODER,
                 lrp=LRPSupport("GPT-Neo", blocks=(PreNorm("GPTNeoBlock", "ln_1", "attn", "ln_2", "mlp",
                                                           weights=True),),
                                forwards=(("GPTNeoSelfAttention._attn", "own_attention"),),
                                embedding_input="drop"),  # GPTNeoModel.drop(wte + wpe)
                 layers=Layers("h", "attn.attention.v_proj"), anatomy=_GPT_NEO_ANATOMY),
    Architecture("gpt_neox", DECODER,
                 lrp=LRPSupport("GPT-NeoX", blocks=(PreNorm("GPTNeoXLayer", "input_layernorm", "attention",
                                                            "post_attention_layernorm", "mlp",
                                                            parallel="use_parallel_residual"),),
                                embedding_input=None),
                 layers=Layers("layers", "attention.query_key_value", fused=3, per_head=True),
                 anatomy=_gpt_neox_anatomy),
    Architecture("gptj", DECODER,
                 lrp=LRPSupport("GPT-J", blocks=(PreNorm("GPTJBlock", "ln_1", "attn", "ln_1", "mlp", parallel=True,
                                                         weights=_gptj_block_returns_weights),),
                                forwards=(("GPTJAttention._attn", "own_attention"),), embedding_input=None,
                                float32_scores=True),
                 layers=Layers("h", "attn.v_proj"), anatomy=_GPTJ_ANATOMY),
    Architecture("llama", DECODER, lrp=_llama_lrp("Llama"),
                 layers=_LLAMA_LAYERS, anatomy=_LLAMA_ANATOMY),
    Architecture("mistral", DECODER, lrp=_llama_lrp("Mistral"), layers=_LLAMA_LAYERS,
                 anatomy=_LLAMA_ANATOMY),
    Architecture("mixtral", DECODER, lrp=_llama_lrp("Mixtral", ("MixtralSparseMoeBlock", "sparse_moe")),
                 layers=_LLAMA_LAYERS, anatomy=_LLAMA_MOE),
    Architecture("qwen2", DECODER, lrp=_llama_lrp("Qwen2"), layers=_LLAMA_LAYERS, anatomy=_LLAMA_ANATOMY),
    Architecture("qwen3", DECODER, lrp=_llama_lrp("Qwen3"),
                 layers=_LLAMA_LAYERS, anatomy=_LLAMA_ANATOMY),  # its query/key RMSNorms: the same LRP rule
    Architecture("gemma", DECODER, lrp=_llama_lrp("Gemma"),
                 layers=_LLAMA_LAYERS, anatomy=_LLAMA_ANATOMY),  # its RMSNorm scales by 1 + weight (norms.py)
    Architecture("gemma2", DECODER,
                 lrp=LRPSupport("Gemma 2", blocks=(PreNorm("Gemma2DecoderLayer", "input_layernorm", "self_attn",
                                                           "pre_feedforward_layernorm", "mlp",
                                                           post1="post_attention_layernorm",
                                                           post2="post_feedforward_layernorm"),),
                                forwards=(("Gemma2RMSNorm", "rms_norm"), ("Gemma2MLP", "gated_mlp")),
                                embedding_input=None, logit_softcap=("Gemma2ForCausalLM", "final_logit_softcapping")),
                 layers=_LLAMA_LAYERS, anatomy=_GEMMA2_ANATOMY, mask_maps=2),
    Architecture("phi", DECODER,
                 lrp=LRPSupport("Phi", blocks=(PreNorm("PhiDecoderLayer", "input_layernorm", "self_attn",
                                                       "input_layernorm", "mlp", parallel=True),),
                                embedding_input=None),
                 layers=_LLAMA_LAYERS, anatomy=_PHI_ANATOMY),
    Architecture("phi3", DECODER,
                 lrp=LRPSupport("Phi-3", blocks=(PreNorm("Phi3DecoderLayer", "input_layernorm", "self_attn",
                                                         "post_attention_layernorm", "mlp"),),
                                forwards=(("Phi3RMSNorm", "rms_norm"), ("Phi3MLP", "fused_gated_mlp")),
                                embedding_input=None),
                 layers=Layers("layers", "self_attn.qkv_proj", fused=3), anatomy=_PHI3_ANATOMY),
    Architecture("opt", DECODER,
                 lrp=LRPSupport("OPT", forwards=(("OPTDecoderLayer", "opt_layer"),), own_sums=True,
                                embedding_input="decoder.layers.0"),  # positions are added inline before it
                 layers=Layers("decoder.layers", "self_attn.v_proj"), anatomy=_opt_anatomy),
    Architecture("bloom", DECODER, normalised_embeddings=True,
                 lrp=LRPSupport("BLOOM", forwards=(("BloomAttention", "bloom_attention"), ("BloomMLP", "bloom_mlp"),
                                                   ("BloomGelu", "activation")),
                                own_sums=True, embedding_input=None),  # word embeddings, then their LayerNorm
                 layers=Layers("h", "self_attention.query_key_value", fused=3, per_head=True, head_rows=("alibi",)),
                 anatomy=_bloom_anatomy, mask_maps=4),
    Architecture("falcon", DECODER,
                 lrp=LRPSupport("Falcon", forwards=(("FalconAttention", "falcon_attention"),
                                                    ("FalconDecoderLayer", "falcon_layer")),
                                own_sums=True, embedding_input=None),
                 layers=Layers("h", "self_attention.query_key_value", fused=3, grouped=True, head_rows=("alibi",)),
                 anatomy=_falcon_anatomy, mask_maps=1),
    # encoder-decoders: the head reads the decoder state at the last EOS
    Architecture("bart", ENCODER_DECODER, layers=_SEQ2SEQ_LAYERS, anatomy=_BART_ANATOMY, lrp=_seq2seq_lrp("BART")),
    Architecture("mbart", ENCODER_DECODER, layers=_SEQ2SEQ_LAYERS, anatomy=_MBART_ANATOMY, lrp=_seq2seq_lrp("mBART")),
    Architecture("t5", ENCODER_DECODER,
                 layers=Layers({"encoder": "encoder.block", "decoder": "decoder.block"}, "layer.0.SelfAttention.v"),
                 anatomy=_t5_anatomy, lrp=_T5_LRP, bias_maps=5, mask_maps=1),
]

ARCHITECTURES: dict[str, Architecture] = {}
# model_type -> display name of every architecture the LRP methods support (read by attnlens.lrp)
LRP_SUPPORTED: dict[str, str] = {}


def register_architecture(arch: Architecture) -> None:
    """Describe ``arch.model_type`` (replacing any earlier entry of that type).

    An entry of one's own is trusted in all but its family: before a model of its type is explained, a test pass
    over a few tokens checks that a ``DECODER`` entry's model attends causally and an ``ENCODER`` entry's
    bidirectionally (:mod:`attnlens.core.unlisted`; a causal decoder read as an encoder would be explained at its
    first token, which sees nothing else). Fields of the wrong kind are refused here; module paths that the model
    lacks, when a method reads them."""
    fields = (("model_type", arch.model_type, str), ("adapter", arch.adapter, Adapter),
              ("layers", arch.layers, (Layers, type(None))), ("lrp", arch.lrp, (LRPSupport, type(None))))
    for field_name, value, kind in fields:
        if not isinstance(value, kind):
            expected = kind.__name__ if isinstance(kind, type) else f"{kind[0].__name__} or None"
            raise ModelError(f"Architecture {arch.model_type!r}: {field_name} is a {type(value).__name__}, not "
                             f"{expected} (e.g. attnlens.models.adapters.ENCODER)")
    if not isinstance(arch.anatomy, Anatomy) and arch.anatomy is not None and not callable(arch.anatomy):
        raise ModelError(f"Architecture {arch.model_type!r}: anatomy is a {type(arch.anatomy).__name__}, not an "
                         "Anatomy, a function of the config giving one, or None")
    pooling = arch.pooling
    if isinstance(pooling, str) and pooling not in POOLINGS:
        raise ModelError(f"unknown pooling {pooling!r}; choose one of {', '.join(POOLINGS)}")
    if isinstance(pooling, str):
        arch.adapter.with_pooling(pooling)  # refuses a pooling the adapter cannot explain
    if arch.anatomy is not None and arch.layers is None:
        raise ModelError(f"{arch.model_type}: an anatomy needs the entry's layers (where the value projections are)")
    if (isinstance(arch.anatomy, Anatomy) and arch.layers.fused != 1 and not arch.anatomy.pre_ln
            and arch.layers.value_bias is None):
        raise ModelError(f"{arch.model_type}: a post-LN anatomy needs an unfused value projection")
    ffn_readings = None if not isinstance(arch.anatomy, Anatomy) else (
        arch.anatomy.ffn, arch.anatomy.moe, arch.anatomy.ffn_in or arch.anatomy.gate_up)
    if ffn_readings is not None and sum(r is not None for r in ffn_readings) != 1:
        raise ModelError(f"{arch.model_type}: an anatomy names its FFN either as one module (ffn), as a mixture of "
                         "experts (moe) or by its pieces (ffn_in, act, ffn_out)")
    if isinstance(arch.anatomy, Anatomy) and arch.anatomy.gate_up and (arch.anatomy.gate or arch.anatomy.ffn_in):
        raise ModelError(f"{arch.model_type}: a fused gate/up projection (gate_up) replaces gate and ffn_in")
    if isinstance(arch.anatomy, Anatomy) and not arch.anatomy.pre_ln and (
            arch.anatomy.post_attn_norm or arch.anatomy.post_ffn_norm):
        raise ModelError(f"{arch.model_type}: norms after the branches are read in pre-LN anatomies only")
    if isinstance(arch.anatomy, Anatomy) and arch.anatomy.parallel and not arch.anatomy.pre_ln:
        raise ModelError(f"{arch.model_type}: a parallel anatomy is a pre-LN one (set pre_ln=True)")
    ARCHITECTURES[arch.model_type] = arch
    if arch.lrp is None:
        LRP_SUPPORTED.pop(arch.model_type, None)
    else:  # a replaced entry keeps its place in the list
        LRP_SUPPORTED[arch.model_type] = arch.lrp.name


def register_adapter(model_type: str, adapter: Adapter) -> None:
    """Use ``adapter`` for models whose ``config.model_type`` is ``model_type`` (the other facts of an existing
    entry are kept; a new type gets the defaults)."""
    old = ARCHITECTURES.get(model_type)
    register_architecture(replace(old, adapter=adapter) if old else Architecture(model_type, adapter))


for _arch in _ENTRIES:
    register_architecture(_arch)


def is_built_in(arch: Architecture) -> bool:
    """Whether ``arch`` is attnlens's own entry of its type (tested with the library), not one registered since."""
    return any(arch is entry for entry in _ENTRIES)


# generic entries of types without one, as a test pass found them (attnlens.core.unlisted.check_unlisted)
_UNLISTED: dict[str, Architecture] = {}


def remember_unlisted(arch: Architecture) -> None:
    """The generic entry a test pass found for ``arch.model_type``, a type without an entry of its own."""
    _UNLISTED[arch.model_type] = arch


def architecture_for(config: Any) -> Architecture:
    """The entry of ``config.model_type``; an unknown type gets the generic one a test pass found for it
    (:func:`attnlens.core.unlisted.check_unlisted`, which every explainer runs), else one from its config flags
    (encoder, or decoder when ``config.is_decoder``); an unknown encoder-decoder type is refused."""
    model_type = getattr(config, "model_type", "")
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    if model_type in _UNLISTED:
        return _UNLISTED[model_type]
    if getattr(config, "is_encoder_decoder", False):
        raise ModelError(
            f"encoder-decoder model type {model_type!r} has no adapter; supported: "
            f"{', '.join(k for k, a in ARCHITECTURES.items() if a.family == 'encoder-decoder')} "
            "(see attnlens.models.architectures.register_architecture)"
        )
    return Architecture(model_type, DECODER if getattr(config, "is_decoder", False) else ENCODER)


def _config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise ModelError(f"{type(model).__name__} is not a HuggingFace model (it has no config)")
    return config


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of ``model``'s architecture family, set to where its head reads."""
    config = _config(model)
    return architecture_for(config).adapter_for(config)


def finds_last_token_by_padding(model: nn.Module) -> bool:
    """Whether ``model``'s head cannot read a padded batch: a decoder-only classifier (GPT-2, Llama, ...) finds
    each row's last real token by ``config.pad_token_id``, and without one refuses batches of more than one row.
    Such models get one input per forward pass."""
    classifier = type(model).__name__.endswith("ForSequenceClassification")  # a language model's head reads all
    return classifier and adapter_for(model).head_reads_pad_id and getattr(model.config, "pad_token_id", None) is None
