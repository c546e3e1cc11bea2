"""Memory budgets: parse ``"4GB"``, estimate what a pass over a padded batch holds, and size batches to fit.

The estimates are per *row* (one padded sequence of ``n`` tokens) of a Transformer: a forward + backward keeps, per
layer, about ``ACTIVATION_VECTORS`` vectors of the hidden size per token (inputs of the linear layers, layer norms,
the feed-forward's wide activations; more where the layer's feed-forward, counted on the model by
:func:`~attnlens.models.feed_forward.feed_forward_saved_vectors`, saves more) and, with eager attention,
``HELD_MAPS`` ``n × n`` map per head and attention (its probabilities) plus the ``WORKING_MAPS`` of the one layer
whose backward runs; fused attention (SDPA) keeps none. A language model's head adds its logits over the vocabulary
(and their gradient). What the shared pass keeps for the methods (:class:`Storage`: whole maps, explained rows,
received attention, hidden states, embeddings, their gradients) comes on top, and so do the score biases and whole
masks some architectures hold through a pass (``Architecture.bias_maps``, ``mask_maps``: T5's, DeBERTa's,
ModernBERT's, ...). The constants were fitted to peak RSS measured with ``bench/memory.py`` on minilm-sst2 (32–512
tokens) and ``bench/long_context.py`` on SmolLM2 (1k–8k tokens) and round up, so a budget is an upper bound in
practice rather than an exact one. A run whose estimate exceeds the budget is refused before it starts
(:func:`refuse_over_budget`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import InputError, ModelError
from ..models.architectures import PositionTerms, architecture_for
from ..models.feed_forward import feed_forward_saved_vectors
from ..models.recompute import recomputable
from . import row_attention
from .allocator import BUDGET_SHARE, for_budget_share, for_layer_blocks

DEFAULT_BUDGET = 4 * 2**30  # bytes: what explain() plans for when no memory_budget is given
ACTIVATION_VECTORS = 30  # hidden-size vectors per token and layer held for a backward pass (24 fitted on MiniLM;
# SmolLM2's wider gated FFN holds more: 2.5 MB per token measured at 1k-2k tokens, weights aside): the least the
# estimates count; more where the layer's feed-forward saves more (LAYER_VECTORS + its own count)
# a layer's vectors per token beside its feed-forward's (attention projections, norms, residuals, a decoder layer's
# cross-attention): 8.5-12.8 measured on BERT-, GPT-2-, Llama-, BART- and T5-base-sized models
LAYER_VECTORS = 15
LOGIT_COPIES = 3  # a language model's (n, vocabulary) logits, their gradient and one temporary
# eager attention in a backward pass: the n x n maps per head each attention keeps (its probabilities, which the
# softmax's and the values' products' gradients both read: 1.0 per head and attention measured on BART-base, 1.06
# with T5-base's biases), and those alive in the one layer whose backward runs (the probabilities' and the scores'
# gradients and the softmax backward's temporary)
HELD_MAPS = 1
WORKING_MAPS = 3
# a half-precision model's attention may run its softmax in float32 (Llama's, T5's), keeping the float32
# probabilities beside their half copy: three maps of the model's element size for one
HALF_SOFTMAX_MAPS = 3
# hidden-size vectors per token alive at once in a forward without a graph (12.4-13.0 measured on Llama-, BART- and
# T5-base-sized models): the least counted; FORWARD_LAYER_VECTORS + what the feed-forward saves in a backward where
# that is more (GPT-2's activation function runs as several operations: 23.2 measured)
FORWARD_VECTORS = 16
FORWARD_LAYER_VECTORS = 4
# chunks of recomputed probabilities alive at once while a method reads every layer's maps chunk by chunk
# (scores, probabilities, their gradient and the reduction's temporaries; attention_chunks.py)
CHUNK_COPIES = 8
# chunks alive at once while received attention or head means are reduced from recomputed probabilities (the
# scores, the probabilities and their mean over heads; row_attention._received / _head_means)
REDUCED_CHUNK_COPIES = 3
# the same in the backward of a fused LRP pass under Chefer et al.'s rules (scores, probabilities, their gradient,
# the softmax's ratio, the scores' gradient and a temporary; lrp/state.py)
RULE_CHUNK_COPIES = 6
# hidden-size vectors per token beside one layer's saved activations while a recomputing pass runs its backward:
# the embeddings and the layer's gradients (a GPT-2-sized model's grads at 1,806 tokens held 50 vectors per token
# at once, the estimate counted 48 without these)
RECOMPUTE_WORKING_VECTORS = 6
VALUE_VECTOR_COPIES = 4  # float32 copies' worth of one layer's per-head value vectors (GlobEnc, ALTI; below)
MAX_TOKENS = 2**20  # the longest input the "what fits" search considers
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_budget(value: str | int | float | None) -> int:
    """Bytes of a memory budget: an int/float of bytes or a string such as ``"4GB"``, ``"512 MiB"``, ``"1.5g"``.

    ``None`` is :data:`DEFAULT_BUDGET`. Anything else, or less than 64 MiB, is an :class:`InputError`.
    """
    if value is None:
        return DEFAULT_BUDGET
    if isinstance(value, bool):
        raise InputError(f"memory budget must be a size such as '4GB', got {value!r}")
    if isinstance(value, (int, float)):
        size = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise InputError(f"memory budget {value!r}: give a size such as '4GB', '512MiB' or a number of bytes")
        size = float(m.group(1)) * _UNITS[unit]
    else:
        raise InputError(f"memory budget must be a size such as '4GB', got {value!r:.60}")
    if not size >= 64 * 2**20:
        raise InputError(f"memory budget {value!r} is below 64 MiB; attnlens needs at least that for one input")
    return int(size)


@dataclass(frozen=True)
class Dims:
    """What the estimates read from a model: layers (encoder + decoder), the attentions they compute (an
    encoder-decoder's decoder layers two each: self and cross), heads, hidden size, bytes per value, the device
    type of its parameters (the chunks of recomputed attention are larger on an accelerator)."""

    layers: int
    heads: int
    hidden: int
    itemsize: int = 4
    logits: int = 0  # values per token of the head's output (a language model's vocabulary; 0: one per input)
    device: str = "cpu"
    attentions: int = 0  # attention computations, each with its maps (0: one per layer)
    bias_maps: int = 0  # H x N x N score-bias maps held through a pass (Architecture.bias_maps: T5's)
    mask_maps: int = 0  # N x N masks and indices held through a pass (Architecture.mask_maps: ModernBERT's)
    layer_mask_maps: int = 0  # N x N masks per layer a backward keeps (Architecture.layer_mask_maps: ModernBERT's)
    position_terms: PositionTerms = PositionTerms()  # H x N x columns score terms per layer (DeBERTa's)
    # hidden-size vectors per token a layer keeps for a backward, and alive at once in a forward without a graph
    activation_vectors: int = ACTIVATION_VECTORS
    forward_vectors: int = FORWARD_VECTORS
    # H x N x N maps per attention an eager backward keeps beside the probabilities (soft-capped scores, Gemma 2's:
    # the tanh keeps its output)
    score_maps: int = 0
    # whether a backward can recompute the model's layers instead of keeping their activations (transformers'
    # checkpointing layers: models.recompute.recomputable; ALBERT's shared layer is none)
    recomputable: bool = True
    # hidden-size vectors per token and layer AttnLRP's fused forward keeps for a backward that does not recompute
    # the layers, counted on the model (attnlens.lrp.kept.kept_vectors; 0: not counted, activation_vectors taken)
    lrp_vectors: float = 0.0
    # the same for the shared pass's fused forward (the rows-capture attention), counted on the model
    # (attnlens.core.capture_kept.capture_vectors; 0: not counted, activation_vectors taken)
    capture_vectors: float = 0.0

    @property
    def maps(self) -> int:
        """The attention computations whose ``H × N²`` maps a pass holds: one per layer, two per decoder layer of an
        encoder-decoder."""
        return self.attentions or self.layers

    @property
    def input_streams(self) -> int:
        """The embedded inputs a pass reads: an encoder-decoder's encoder tokens and decoder inputs (two), else
        one."""
        return 2 if self.attentions > self.layers else 1

    def hidden_bytes(self, tokens: int) -> int:
        """Bytes of one layer's hidden states over ``tokens`` tokens (a batch's: rows × padded length), the block
        size the allocator's policy follows (:func:`~attnlens.core.allocator.for_layer_blocks`)."""
        return tokens * self.hidden * self.itemsize


def model_dims(model: Any) -> Dims:
    """Layers, heads and hidden size from the model's config (HF attribute maps cover GPT-2's and BART's names);
    parameters' element size for the dtype. Unknown configs get BERT-base sizes (an overestimate for small
    models)."""
    cfg = getattr(model, "config", None)

    def get(*names: str) -> int:
        return next((int(getattr(cfg, n)) for n in names if isinstance(getattr(cfg, n, None), int)), 0)

    layers = get("num_hidden_layers", "n_layer", "num_layers") or 12
    decoder = get("decoder_layers", "num_decoder_layers") if getattr(cfg, "is_encoder_decoder", False) else 0
    heads = get("num_attention_heads", "n_head") or 12
    hidden = get("hidden_size", "d_model", "n_embd", "dim") or 768
    try:
        first = next(model.parameters())
        itemsize, device, dtype = first.element_size(), first.device.type, first.dtype
    except (AttributeError, StopIteration, TypeError):
        itemsize, device, dtype = 4, "cpu", None
    try:  # a language model projects every position onto the vocabulary
        out = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        out = None
    logits = get("vocab_size") if out is not None else 0
    # a decoder layer of an encoder-decoder computes two attentions (self and cross), each with its maps
    capped = 1 if getattr(cfg, "attn_logit_softcapping", None) else 0
    ffn = feed_forward_saved_vectors(model, hidden, dtype) if cfg is not None else None
    activation, forward = ACTIVATION_VECTORS, FORWARD_VECTORS
    if ffn is not None:  # what the feed-forward saves beyond what the floors count
        activation = max(activation, math.ceil(LAYER_VECTORS + ffn))
        forward = max(forward, math.ceil(FORWARD_LAYER_VECTORS + ffn))
    return Dims(layers + decoder, heads, hidden, itemsize, logits, device, layers + 2 * decoder,
                *_extra_maps(cfg), score_maps=capped, activation_vectors=activation, forward_vectors=forward,
                recomputable=isinstance(model, nn.Module) and recomputable(model))


def _extra_maps(config: Any) -> tuple[int, int, int, PositionTerms]:
    """The score-bias maps, the masks and the relative-position terms ``config``'s model type holds through a pass
    (``Architecture.bias_maps``, ``mask_maps``, ``layer_mask_maps``, ``position_terms``); none for a type attnlens
    has no entry for."""
    try:
        arch = architecture_for(config) if config is not None else None
    except ModelError:
        arch = None
    if arch is None:
        return 0, 0, 0, PositionTerms()
    return arch.bias_maps, arch.mask_maps, arch.layer_mask_maps, arch.position_terms_for(config)


@dataclass(frozen=True)
class Storage:
    """What one pass keeps per row, as :mod:`attnlens.core.capture` plans it; the estimates follow it.

    ``eager``: the layers compute ``n × n`` probabilities (eager attention) rather than fused attention;
    ``backward``: a backward pass runs (the forward keeps its activations); ``maps``: every layer's whole maps
    are kept; ``rows``: attention rows kept per layer (fused attention: the explained ones); ``received``: the
    attention each key receives, per layer; ``means``: every layer's whole map, mean over heads; ``factors``:
    every layer's queries and keys, to recompute its maps from (``factor_grads``: and its values, attention output
    and that output's gradient);
    ``hidden``/``embeddings``: hidden states / input embeddings kept;
    ``*_grads``: their gradients kept; ``recompute``: the backward recomputes each layer from its input rather
    than keeping its activations (fused attention only); ``chunked_rules``: the backward recomputes each layer's
    probabilities a chunk of query rows at a time to apply LRP rules there; ``logit_rows``: positions of each row a
    language model projects onto the vocabulary (0: all of them; :class:`~attnlens.core.logit_rows.LogitRows`);
    ``factor_layers``: the layers whose factors are kept (0: every layer; 1: a pass stopping at the last layer);
    ``map_layers``: likewise the layers whose whole maps are held at once (1: a layer's maps read and dropped
    before the next layer's, as value zeroing reads them);
    ``rule_vectors``: hidden-size vectors per token an LRP pass's rules hold beside that (measured);
    ``held_vectors``: hidden-size vectors per token a method holds beside its passes (integrated gradients over
    a generation's steps: the first step's sums, :attr:`attnlens.methods.registry.Method.step_vectors`; each
    further step's: :func:`held_step_bytes`);
    ``square_matrices``: ``n × n`` matrices a method holds per row beside the pass (value zeroing: the layer's
    matrix as it is filled, its masked and normalised copies, the rollout so far, the new product and the
    allocator's slack between them: seven. Six measured 0.92–0.98 of a 256 MiB budget in live tensors at the
    longest length it admits on a 4-layer Llama (four left it at 1.04, none at 1.12–1.19), but resident memory
    under glibc's default heap policy reached 1.07–1.11 there, at the edge of the promise; the seventh is that
    slack).
    """

    eager: bool = True
    backward: bool = False
    maps: bool = False
    map_grads: bool = False
    rows: int = 0
    row_grads: bool = False
    received: bool = False
    means: bool = False
    factors: bool = False
    factor_grads: bool = False
    hidden: bool = False
    hidden_grads: bool = False
    embeddings: bool = False
    embedding_grads: bool = False
    recompute: bool = False
    chunked_rules: bool = False
    logit_rows: int = 0
    factor_layers: int = 0
    map_layers: int = 0
    rule_vectors: int = 0
    held_vectors: int = 0
    square_matrices: int = 0
    layer_graph: bool = False  # one layer's backward activations beside what is kept (registry.LAYER_GRAPH)
    # the backward keeps what an LRP forward's rules save (Dims.lrp_vectors per token and layer, where counted)
    rule_activations: bool = False
    # the pass runs the rows-capture attention (attnlens.core.capture's rows mode): its backward keeps what that
    # forward saves (Dims.capture_vectors per token and layer, where counted)
    recorded: bool = False
    chunked: bool = False  # a method reads the kept whole maps a chunk of query rows at a time (eager passes)

    def __or__(self, other: Storage) -> Storage:
        """What one pass serving both keeps (eager if either needs it)."""
        def union(f: str, a: Any, b: Any) -> Any:
            if f in ("rows", "rule_vectors", "held_vectors", "square_matrices"):
                return max(a, b)
            if f in ("logit_rows", "factor_layers", "map_layers"):  # 0 is every position / layer
                return 0 if 0 in (a, b) else max(a, b)
            return a or b
        return Storage(**{f: union(f, getattr(self, f), getattr(other, f)) for f in self.__dataclass_fields__})

    def logit_positions(self, n: int) -> int:
        """Positions of a row of ``n`` tokens whose logits the pass computes."""
        return min(n, self.logit_rows) if self.logit_rows else n


FULL_STORAGE = Storage(eager=True, backward=True, maps=True, map_grads=True, hidden=True, hidden_grads=True)
# an LRP pass: eager, every layer's maps and their gradients (the attention relevance) kept; fused (AttnLRP with
# epsilon 0, :func:`attnlens.lrp.lrp_pass` ``fused=True``): each layer recomputed in the backward (or, where they
# fit, its activations kept: ``recompute=False``, lrp_storage), no maps, the input embeddings and their gradient
LRP_STORAGE = FULL_STORAGE
# value zeroing's passes: eager forwards, one layer's maps at a time, and every layer's input (the layers are rerun
# from them)
VALUE_ZEROING_STORAGE = Storage(eager=True, maps=True, map_layers=1, hidden=True, square_matrices=7)
FUSED_LRP_STORAGE = Storage(eager=False, backward=True, recompute=True, embeddings=True, embedding_grads=True)
# the same keeping every layer's activations, what its rules save (AttnLRP's own pass where they fit: lrp_storage)
KEPT_LRP_STORAGE = dataclasses.replace(FUSED_LRP_STORAGE, recompute=False, rule_activations=True)
# the fused pass of a method reading the attention relevance (Chefer et al.'s rules): per layer the queries, keys
# and values, and the modified gradient at the attention output, the relevance recomputed from them
FUSED_RELEVANCE_STORAGE = FUSED_LRP_STORAGE | Storage(factors=True, factor_grads=True, chunked_rules=True)
# the same stopping at the last layer's attention (PartialLRP's score, TransAtt from its last layer): that layer's
# factors alone, its gradient taken at the attention output (no rule applied below it, no input embeddings). Its
# peak RSS beyond the model on SmolLM2 (1.11 GiB at 6,144 tokens, 1.62-1.72 GiB at 8,176) is about 95 hidden-size
# vectors per token, where the terms above count 65: 40 more cover the rules' products in the recomputed layer
FUSED_LAST_LAYER_STORAGE = Storage(eager=False, backward=True, recompute=True, factors=True, factor_grads=True,
                                   factor_layers=1, rule_vectors=40)


def lrp_storage(dims: Dims, n: int, budget: int, fusable: bool, logit_rows: int = 0,
                attention: bool = False, last_layer: bool = False, keep_activations: bool = False) -> Storage:
    """What an LRP pass over one row of ``n`` tokens holds, a language model's logits at ``logit_rows``
    positions (0: all): the eager pass where it fits ``budget``, else the fused one when the pass can run fused
    (``fusable``; each layer recomputed in its backward, about one more forward), keeping what recomputes the
    attention relevance when the method reads it (``attention``): the last layer's alone where the pass stops
    there (``last_layer``).

    With ``keep_activations`` (AttnLRP's own pass over a batch of inputs,
    :func:`attnlens.methods.lrp_methods.kept_activation_passes`) a fusable pass always runs fused: it keeps every
    layer's activations (no maps, so less than the eager pass in memory and, from a few hundred tokens, in time)
    where they fit ``budget`` or the model's layers cannot be recomputed, and recomputes each layer beyond. What
    it keeps is what the rules save, counted on the model where ``dims.lrp_vectors`` holds the count
    (:func:`attnlens.methods.lrp_methods.kept_pass_dims`), else a plain backward's activations."""
    eager = dataclasses.replace(LRP_STORAGE, logit_rows=logit_rows)
    if fusable and keep_activations:
        kept = dataclasses.replace(KEPT_LRP_STORAGE, logit_rows=logit_rows)
        if not dims.recomputable or pass_row_bytes(dims, n, kept) <= budget:
            return kept
        return dataclasses.replace(FUSED_LRP_STORAGE, logit_rows=logit_rows)
    if fusable and pass_row_bytes(dims, n, eager) > budget:
        fused = FUSED_RELEVANCE_STORAGE if attention else FUSED_LRP_STORAGE
        return dataclasses.replace(FUSED_LAST_LAYER_STORAGE if attention and last_layer else fused,
                                   logit_rows=logit_rows)
    return eager


def pass_row_bytes(dims: Dims, n: int, storage: Storage) -> int:
    """Bytes one pass holds at its peak for one row of ``n`` tokens keeping ``storage``."""
    d, heads, layers, attentions = dims.hidden, dims.heads, dims.layers, dims.maps
    maps = heads * n * n  # one attention's n x n probabilities, every head
    if storage.backward:
        if storage.recompute:  # each layer's input, and one layer's activations at a time with its gradients
            work = layers * n * d + (dims.activation_vectors + RECOMPUTE_WORKING_VECTORS) * n * d
            work += _position_values(dims, n)
        else:
            # the whole maps a pass keeps are the probabilities the backward reads: counted once, with what is kept
            kept_all = storage.maps and not storage.map_layers
            # what the LRP rules or the rows-capture forward save, counted on the model, and beside it one layer's
            # working set: the LRP pass's forward's (its budget promise held at 0.59-0.85 of the budget); the rows
            # pass's backward's, a plain layer's activations' gradients (or those of what the layer keeps, where
            # more) and the working vectors of a recomputing pass (a 4-layer Llama's generation steps after 2,650
            # tokens, saliency's, held 12 more vectors than a forward's working set)
            if storage.rule_activations and dims.lrp_vectors:
                work = math.ceil((layers * dims.lrp_vectors + dims.forward_vectors) * n * d)
            elif storage.recorded and dims.capture_vectors:
                working = max(dims.activation_vectors, dims.capture_vectors) + RECOMPUTE_WORKING_VECTORS
                work = math.ceil((layers * dims.capture_vectors + working) * n * d)
            else:
                work = layers * dims.activation_vectors * n * d
            work += _eager_backward_maps(dims, n, kept_all) if storage.eager else 0
            work += layers * (dims.layer_mask_maps * n * n + _position_values(dims, n))
        work += LOGIT_COPIES * storage.logit_positions(n) * dims.logits
        rule_chunk = row_attention.chunk_elements(dims.device, backward=True)
        work += RULE_CHUNK_COPIES * min(rule_chunk, heads * n * n) * storage.chunked_rules * _widening(dims)
    else:  # one layer at a time
        eager_maps = 2 * maps * _softmax_copies(dims) if storage.eager else 0  # scores and probabilities
        work = dims.forward_vectors * n * d + eager_maps + storage.logit_positions(n) * dims.logits
        work += _position_values(dims, n)
    kept = (storage.map_layers or attentions) * maps * storage.maps
    kept += attentions * (maps * storage.map_grads
                          + heads * storage.rows * n * (1 + storage.row_grads)
                          + n * storage.received + n * n * storage.means)
    kept += (storage.factor_layers or attentions) * n * d * (2 * storage.factors + 3 * storage.factor_grads)
    kept += (storage.rule_vectors + storage.held_vectors) * n * d
    kept += storage.square_matrices * n * n
    kept += dims.activation_vectors * n * d * storage.layer_graph
    chunk = min(row_attention.chunk_elements(dims.device), heads * n * n) * _widening(dims)  # one chunk's values
    chunks = storage.factors or storage.chunked
    # received attention and head means recomputed chunk by chunk in the forward: on a CPU mostly by one more fused
    # attention (a chunk of 2^20 where a mask rules it out), on an accelerator always, in chunks of 2^24
    reduced = (storage.received or storage.means) and not chunks and dims.device != "cpu"
    kept += (CHUNK_COPIES * chunks + REDUCED_CHUNK_COPIES * reduced) * chunk
    # the decomposition methods that read chunks (GlobEnc, ALTI) or rows (attention norm) hold one layer's per-head
    # value vectors at a time: two float32 copies and one in float64, four float32s' worth (GlobEnc on BERT-base at
    # 1,024 tokens; attention norm on MiniLM, 14 rows of 256 tokens: 20.8 MiB a row, 8.7 without them)
    values = (chunks or storage.rows) and storage.hidden
    kept += VALUE_VECTOR_COPIES * heads * n * d * values * _widening(dims)
    kept += (layers + 1) * n * d * (storage.hidden + storage.hidden_grads)
    kept += dims.input_streams * n * d * (storage.embeddings + storage.embedding_grads)
    return (work + kept + _held_biases(dims, n)) * dims.itemsize


def backward_row_bytes(dims: Dims, n: int) -> int:
    """Bytes a forward + backward holds for one row of ``n`` tokens (integrated gradients' unit of work)."""
    held = dims.layers * dims.activation_vectors * n * dims.hidden + _eager_backward_maps(dims, n)
    held += dims.layers * (dims.layer_mask_maps * n * n + _position_values(dims, n))
    return (held + _held_biases(dims, n)) * dims.itemsize


def _eager_backward_maps(dims: Dims, n: int, probabilities_kept: bool = False) -> int:
    """Values of the ``heads × n × n`` maps an eager forward + backward holds at its peak: each attention's
    probabilities (unless the pass keeps them anyway: ``probabilities_kept``) and soft-capped scores, and the
    working maps of the layer whose backward runs (each counted three times in half precision, whose softmax may run
    in float32)."""
    held = dims.maps * (dims.score_maps + (0 if probabilities_kept else HELD_MAPS))
    return (held + WORKING_MAPS) * _softmax_copies(dims) * dims.heads * n * n


def _softmax_copies(dims: Dims) -> int:
    """Maps of the model's element size one attention map takes: a half-precision model's softmax may run in
    float32 (Llama's, T5's), beside the half copy the model goes on with."""
    return 1 if dims.itemsize >= 4 else HALF_SOFTMAX_MAPS


def _widening(dims: Dims) -> int:
    """Values of the model's element size one float32 value takes: attnlens recomputes attention chunk by chunk
    with a float32 softmax (:mod:`attnlens.core.row_attention`), whatever the model's dtype."""
    return max(1, 4 // dims.itemsize)


def _position_values(dims: Dims, n: int) -> int:
    """Values of one layer's relative-position score terms over ``n`` tokens before their gather
    (``Architecture.position_terms``: DeBERTa's)."""
    terms = dims.position_terms
    return terms.count * dims.heads * n * terms.columns(n)


def _held_biases(dims: Dims, n: int) -> int:
    """Values a pass over ``n`` tokens holds throughout in its architecture's score biases (``heads × n × n``
    each) and whole masks (``n × n`` each): ``Architecture.bias_maps``, ``mask_maps``."""
    return (dims.bias_maps * dims.heads + dims.mask_maps) * n * n


def forward_row_bytes(dims: Dims, n: int) -> int:
    """Bytes a forward without gradients holds for one row of ``n`` tokens (perturbation methods' unit of
    work): each layer's activations are freed once the next layer has read them, so about two layers' worth."""
    return 2 * backward_row_bytes(dims, n) // max(1, dims.layers)


def fitting(dims: Dims, n: int, storage: Storage, budget: int) -> Storage:
    """``storage``, recomputing layers in the backward when that is possible (fused attention, a model whose layers
    can be recomputed) and keeping their activations would not fit ``budget`` for one row of ``n`` tokens
    (recomputation costs about one more forward)."""
    if storage.backward and not storage.eager and dims.recomputable and pass_row_bytes(dims, n, storage) > budget:
        return dataclasses.replace(storage, recompute=True)
    return storage


def gradient_pass_storage(dims: Dims, n: int, budget: int, fused: bool, logit_rows: int = 0) -> Storage:
    """What a forward + backward to the input embeddings holds for one row of ``n`` tokens (integrated
    gradients' unit of work): fused attention where the model has it (``fused``), each layer recomputed in the
    backward where keeping the activations would not fit ``budget``; eager attention otherwise."""
    return fitting(dims, n, Storage(eager=not fused, backward=True, logit_rows=logit_rows), budget)


def shared_pass_row_bytes(dims: Dims, n: int, storage: Storage = FULL_STORAGE) -> int:
    """Bytes the shared pass holds for one row keeping ``storage`` (default: eager attention with every layer's
    maps and hidden states and their gradients, the most it keeps), until the methods have read it."""
    return pass_row_bytes(dims, n, storage)


def step_gradient_bytes(dims: Dims, n: int, storage: Storage = FULL_STORAGE) -> int:
    """Bytes each further step adds to a batch of generation steps that share one forward over their ``n``-token
    sequence: its own gradients of what ``storage`` differentiates, and its share of the batched backward (the
    vector-Jacobian products of all steps run at once: each holds its logits' gradient and a layer's activation
    gradients). With :func:`shared_pass_row_bytes` for the first step this matched peak RSS on SmolLM2 (408
    tokens, 1, 4 and 8 steps per batch, whole maps: estimates 1.8, 2.4, 3.3 GB; measured 1.7, 2.7, 3.3 GB); at
    1,040 tokens 16 steps of AGrad in one batch peaked at 12.7 GB, which the batched backward's share bounds."""
    kept = dims.maps * dims.heads * n * (n * storage.map_grads + storage.rows * storage.row_grads)
    kept += dims.layers * n * dims.hidden * storage.hidden_grads + dims.maps * n * dims.hidden * storage.factor_grads
    kept += n * dims.hidden * storage.embedding_grads
    backward = storage.logit_positions(n) * dims.logits + dims.activation_vectors * n * dims.hidden
    return (kept + backward) * dims.itemsize


def layer_graph_step_bytes(dims: Dims, n: int) -> int:
    """Bytes each further step adds to a batch of generation steps whose method takes its backward one rebuilt
    layer at a time (``registry.LAYER_GRAPH``: DecompX) over their one ``n``-token sequence: every step carries its
    own cotangent through the layer, so the layer's vector-Jacobian product holds each step's activation
    gradients, and the step keeps its gradients at the layer's input, at its first layer's value vectors and at
    the input (four hidden-size vectors per token)."""
    return (dims.activation_vectors + 4) * n * dims.hidden * dims.itemsize


def held_step_bytes(dims: Dims, n: int, vectors: int) -> int:
    """Bytes a method holds beside its passes for each step of a generation over an ``n``-token sequence:
    ``vectors`` hidden-size vectors per token (:attr:`attnlens.methods.registry.Method.step_vectors`; integrated
    gradients' running sums)."""
    return vectors * n * dims.hidden * dims.itemsize


def lrp_step_bytes(dims: Dims, n: int, steps: int, attention_relevance: bool, fused: bool = False) -> int:
    """Bytes each further step adds to an eager LRP pass over the ``n``-token sequence of a generation's ``steps``
    prefixes, whose rows' relevances come from one batched backward (:func:`attnlens.models.prefixes.row_gradients`):
    its share of that backward (a layer's activation gradients and attention-map gradients at a time, the kept
    logits' gradient: the sequence's last ``steps`` + 1 positions), its input-embedding gradients and relevances,
    and, where a method reads it (``attention_relevance``), its own ``R(A)`` of every layer. A fused pass
    (``fused``) runs one backward per step instead, so a step keeps only its input gradients and relevances."""
    if fused:
        return 4 * n * dims.hidden * dims.itemsize
    maps = dims.heads * n * n
    held = dims.activation_vectors * n * dims.hidden + 3 * maps + LOGIT_COPIES * (steps + 1) * dims.logits
    held += 4 * n * dims.hidden  # two input leaves: their gradients and relevances
    held += 2 * dims.maps * maps * attention_relevance  # the gradient at each layer's probabilities and R(A)
    return held * dims.itemsize


def longest_that_fits(budget: int, row_bytes: Callable[[int], int]) -> int:
    """The most tokens ``n`` (up to :data:`MAX_TOKENS`) with ``row_bytes(n) <= budget``; 0 if not even one."""
    lo, hi = 0, MAX_TOKENS
    while lo < hi:  # row_bytes grows with n
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if row_bytes(mid) <= budget else (lo, mid - 1)
    return lo


def readable_size(size: float) -> str:
    """``size`` bytes as the errors say it: GiB with one decimal from 1 GiB on, whole MiB below."""
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"


def refuse_over_budget(n: int, budget: int, need: int, per_method: Mapping[str, Callable[[int], int]],
                       what: str = "an input", model_longest: int | None = None) -> None:
    """Raise an :class:`InputError` (one line, before anything runs) when ``what`` of ``n`` tokens needs ``need``
    bytes, more than ``budget``: what it needs, and how long an input each method (``per_method``: its bytes as
    a function of the length, run alone) could explain within the budget (``model_longest``: the most tokens
    the model takes; a method that fits them is said to fit every input)."""
    if need <= budget:
        for_budget_share(need, budget)
        return
    fits, every = [], []
    for name, row_bytes in per_method.items():
        longest = longest_that_fits(budget, row_bytes)
        if model_longest is not None and longest >= model_longest:
            every.append(name)
        else:
            fits.append(f"{name} up to {longest:,} tokens" if longest else f"{name} not even 1 token")
    if every:
        fits.insert(0, f"{', '.join(every)} at every length the model takes (up to {model_longest:,} tokens)")
    raise InputError(f"{what} of {n:,} tokens with {', '.join(per_method)} needs about {readable_size(need)}, more "
                     f"than the memory budget of {readable_size(budget)}; within it: {'; '.join(fits)} (name fewer "
                     "methods, shorten the input or raise --memory-budget / memory_budget=)")


def rows_that_fit(budget: int, row_bytes: int, cap: int | None = None) -> int:
    """How many rows of ``row_bytes`` fit in ``budget`` (at least 1, at most ``cap``)."""
    rows = max(1, budget // max(1, row_bytes))
    rows = min(rows, cap) if cap is not None else rows
    for_budget_share(rows * row_bytes, budget)
    return rows


def budget_chunks(
    lengths: Sequence[int], batch_size: int, budget: int, row_bytes: Callable[[int], int],
    block_bytes: Callable[[int], int] | None = None, groups: Sequence[Any] | None = None,
) -> Iterator[list[int]]:
    """Indices shortest first, in batches of at most ``batch_size`` whose padded rows fit ``budget``; with
    ``groups``, no batch mixes two groups (group by group, each shortest first).

    Short inputs keep the full ``batch_size``; long ones go in smaller batches (one at least), so memory follows
    the sequence length instead of a fixed count. ``block_bytes(n)``: one row's hidden states at ``n`` tokens;
    while the caller runs a batch planned at :data:`~attnlens.core.allocator.BUDGET_SHARE` of the budget or more,
    blocks of a quarter of the batch's hidden states are mapped on their own
    (:func:`~attnlens.core.allocator.for_layer_blocks`): MiniLM's scoring forwards, 21 rows of 256 tokens within
    128 MiB (88 MiB of tensors alive at most), left 130 MiB of freed blocks resident in the heaps with the fixed
    8 MiB threshold, which the batch's 7.9 MiB hidden states stayed just below, and none with it.
    """
    group = (lambda i: groups[i]) if groups is not None else (lambda i: 0)
    order = sorted(range(len(lengths)), key=lambda i: (group(i), lengths[i]))
    chunk: list[int] = []
    for i in order:
        # sorted: the newcomer is the longest of its group, so it sets the padded length of the chunk
        if chunk and (len(chunk) >= batch_size or (len(chunk) + 1) * row_bytes(lengths[i]) > budget
                      or group(i) != group(chunk[-1])):
            yield from _planned(chunk, lengths[chunk[-1]], budget, row_bytes, block_bytes)
            chunk = []
        chunk.append(i)
    if chunk:
        yield from _planned(chunk, lengths[chunk[-1]], budget, row_bytes, block_bytes)


def _planned(chunk: list[int], n: int, budget: int, row_bytes: Callable[[int], int],
             block_bytes: Callable[[int], int] | None) -> Iterator[list[int]]:
    """``chunk`` (padded to ``n`` tokens) under the allocator's policy for its share of the budget, in force until
    the caller asks for the next batch."""
    need = len(chunk) * row_bytes(n)
    if block_bytes is None or need < BUDGET_SHARE * budget:
        for_budget_share(need, budget)
        yield chunk
        return
    with for_layer_blocks(len(chunk) * block_bytes(n)):
        yield chunk
