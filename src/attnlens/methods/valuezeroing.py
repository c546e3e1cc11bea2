"""Value zeroing (Mohebbi, Zuidema, Chrupała & Alishahi, EACL 2023): how much each token's value vector changes
every token's layer output.

For layer l and token j, the value vector of j is set to zero in every head of layer l, the layer is rerun on
its original input, and token i's output ĥ_i is compared with the original h_i by cosine distance:
C^l[i, j] = 1 - cos(h_i, ĥ_i^{¬j}). Each row is normalised to sum to 1 and the layers are rolled out without an
added identity (the residual is already inside the layer): R = C^L ··· C^1, s_j = R[c, j] (the authors'
``compute_joint_attention(..., res=False)``).

Zeroing v_j leaves every attention weight as it is, so it removes exactly Σ_h A^h_ij f^h_j from row i's
attention-block sum: where the layer's anatomy is known (:class:`~attnlens.methods.decomposition.ValueZeroedLayer`),
its output with v_j zeroed is its post-attention part at that changed sum, evaluated for every (row, attended
token) pair and no other (half of them under causal masking), at most ``MAX_ROWS`` vectors at once. Each such layer
is checked first: its recomputed output against the model's, and the zeroing of each example's first token
against a rerun. Otherwise (unknown anatomy, a failed check): L·N reruns of one layer per example (about N
forward passes), batched: the copies of one layer (one per example and zeroed real token) run in batches of at
most ``MAX_ROWS`` token rows on the layer's captured input and arguments, never the whole model. The
architecture entry says where the layers and their value projections are
(:class:`attnlens.models.architectures.Layers`); types without one are skipped. Defined for self-attention streams:
encoders, decoders (causally masked, so C^l[i, j] = 0 for j > i), and the encoder and decoder self-attention of
encoder-decoders (BART: the decoder layers are rerun with their cross-attention inputs unchanged); not for
cross-attention, whose queries and keys are different positions (no square matrices to roll out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..core.batch_state import BatchContext
from ..core.memory import VALUE_ZEROING_STORAGE, model_dims, pass_row_bytes
from ..core.modelstate import without_cache
from ..errors import ModelError
from ..models.architectures import Layers, architecture_for
from .decomposition.value_zeroed import ValueZeroedLayer
from .registry import OWN_PASS, MethodOutput, check_flag, register

MAX_ROWS = 2 ** 14  # token rows per batched layer rerun at most (fewer where the budget says: rows_within)
# keys zeroed per block of a recomputed layer: the rows attending to them share each head's projected values (a
# block's worth), and under causal masking a block on the diagonal computes about KEY_BLOCK² / 2 pairs in vain
KEY_BLOCK = 64
# (row, key) pairs recomputed at once at most: each pair's feed-forward vectors pass through several elementwise
# steps, which run from the cache when a batch's are a few MiB (on SmolLM2's layers 2,048 pairs took about half
# the time per pair of 16,384)
PAIRS_AT_ONCE = 2048
# a recomputed layer's zeroing may differ from a rerun's by this many times the rounding of its precision (_trusted)
ROUNDINGS = 8


def _layers_of(model: nn.Module) -> Layers | None:
    return architecture_for(model.config).layers


def _applies(model: nn.Module, stream: str, task: str) -> str | None:
    spec = _layers_of(model)
    if spec is None:
        return (f"valuezeroing does not know where the layers of model type {model.config.model_type!r} are "
                "(no 'layers' in its architecture entry)")
    if spec.path(stream) is None:
        return f"valuezeroing is defined for self-attention streams, not attention={stream!r}"
    why = spec.why_no_rerun(model.config)
    if why:
        return f"valuezeroing reruns one layer on some of the rows, and {why}"
    return None


def _module(root: nn.Module, path: str) -> Any:
    for name in path.split("."):
        root = getattr(root, name)
    return root


def _take(value: Any, batch: int, index: torch.Tensor, head_rows: bool = False) -> Any:
    """Rows ``index`` of a layer argument (tensors whose first axis is the batch; tuples and lists element-wise;
    ``head_rows``: a tensor of (batch × heads) rows, each example's block of rows); caches are dropped (the reruns
    must not extend them). A shared tensor whose first axis merely equals the batch size would be cut wrongly:
    each type's ``layers`` entry is checked against a naive re-computation on a tiny model before it is added
    (DeBERTa's relative positions and embeddings are such tensors: its entry names them ``shared``)."""
    if head_rows and isinstance(value, torch.Tensor):
        return value.view(batch, -1, *value.shape[1:]).index_select(0, index).flatten(0, 1)
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index) if value.dim() > 0 and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_take(v, batch, index) for v in value)
    if type(value).__name__.endswith("Cache"):
        return None
    return value


@contextmanager
def _zeroing(value_module: nn.Module, keep: torch.Tensor, spec: Layers, heads: int, head_dim: int,
             value_bias: torch.Tensor | None = None) -> Iterator[None]:
    """Multiply the value vectors in the value projection's output ``(R, N, width)`` (the features ``spec``
    says hold them) by ``keep`` ``(R, N)`` (0 = zeroed value vector). ``value_bias``: added to the value vectors
    after the projection (DeBERTa's), so a zeroed one is set to minus it there."""
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        scale = keep[..., None].to(output.dtype)
        if spec.fused == 1 and value_bias is None:
            return output * scale
        values = spec.value_features(output.shape[-1], heads, head_dim).to(output.device)
        out = output * scale
        if value_bias is not None:
            bias = torch.zeros(output.shape[-1], dtype=output.dtype, device=output.device)
            bias[values] = value_bias.to(output.dtype)
            out = out + (scale - 1) * bias
        return torch.where(values, out, output)

    handle = value_module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _layer_calls(model: nn.Module, layers: list[nn.Module], inputs: dict[str, torch.Tensor]) -> list[tuple]:
    """One forward pass recording every call of the layers, in order: ``(layer, args, kwargs)`` (a layer shared
    across depths, as ALBERT's, once per call). No attention maps are kept: each layer's are read when it is
    rerun alone (:func:`_recording_maps`), so at most one layer's are held."""
    calls: list[tuple] = []

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append((module, args, kwargs))

    handles = [layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in layers]
    try:
        model(**inputs, **without_cache(model))
    finally:
        for h in handles:
            h.remove()
    return calls


@contextmanager
def _recording_maps(attention: nn.Module | None, into: list[Any]) -> Iterator[None]:
    """Append the attention probabilities each call of ``attention`` returns (the second item of its output under
    eager attention; ``None`` where it returns none) to ``into``."""
    if attention is None:
        yield
        return

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        found = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        into.append(found.detach() if isinstance(found, torch.Tensor) else None)

    handle = attention.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _joined_maps(found: list[Any], b: int, n: int) -> torch.Tensor | None:
    """The recorded calls' probabilities as one ``(B, H, N, N)`` tensor, or ``None`` where they are not that."""
    if not found or any(f is None or f.dim() != 4 for f in found):
        return None
    maps = torch.cat(found)
    return maps if maps.shape[0] == b and maps.shape[-2:] == (n, n) else None


def _zeroed_distances(layer: ValueZeroedLayer, max_rows: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, N, N)``: the cosine distance between each row's recomputed output and its output with each key's value
    vector zeroed (:class:`~attnlens.methods.decomposition.ValueZeroedLayer`), 0 where no head of the row attends
    to the key; at most ``max_rows`` (and :data:`PAIRS_AT_ONCE`) (row, key) vectors at once: blocks of
    :data:`KEY_BLOCK` keys, each with the rows that attend to any of them in groups. ``rows`` ``(B, N)``: only
    these rows (the others 0)."""
    b, _, n, _ = layer.attn.shape
    y = layer.output.to(torch.promote_types(layer.output.dtype, torch.float32))
    attends = layer.attn.ne(0).any(1)  # (B, N, N): the pairs a zeroing changes
    if rows is not None:
        attends = attends & rows[:, :, None]
    out = torch.zeros(b, n, n, dtype=y.dtype, device=y.device)
    width = max(1, min(KEY_BLOCK, max_rows))
    for e in range(b):
        read = torch.nonzero(attends[e].any(0)).flatten().tolist()  # the keys any row attends to (not padding)
        if not read:
            continue
        for start in range(read[0], read[-1] + 1, width):
            stop = min(read[-1] + 1, start + width)
            needed = torch.nonzero(attends[e, :, start:stop].any(-1)).flatten()  # under causal masking: i ≥ start
            for group in needed.split(max(1, min(max_rows, PAIRS_AT_ONCE) // (stop - start))):
                zeroed = layer.zeroed(e, group, stop, start, sharing=len(needed)).to(y.dtype)
                out[e, group, start:stop] = cosine_distance(zeroed, y[e, group, None])
    return out * attends.to(out.dtype)


def value_zeroing_matrices(model: nn.Module, inputs: dict[str, torch.Tensor], token_mask: torch.Tensor,
                           stream: str = "self", max_rows: int = MAX_ROWS, last_only: bool = False,
                           last_rows: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Every layer's matrix of :func:`layer_matrices` (bottom layer first), as a list."""
    return list(layer_matrices(model, inputs, token_mask, stream, max_rows, last_only, last_rows))


def layer_matrices(model: nn.Module, inputs: dict[str, torch.Tensor], token_mask: torch.Tensor,
                   stream: str = "self", max_rows: int = MAX_ROWS, last_only: bool = False,
                   last_rows: torch.Tensor | None = None,
                   progress: Callable[[float], None] | None = None) -> Iterator[torch.Tensor]:
    """C^l ``(B, N, N)`` per layer of attention stream ``stream``, bottom layer first, each computed when the
    iterator reaches it (a layer's maps are dropped before the next layer's are read): ``C[b, i, j]`` = cosine
    distance between position i's output of layer l and its output with the value vector of position j zeroed
    (``token_mask``: the stream's real positions; rows and columns of padding are 0; not normalised).
    ``last_only``: the last layer's alone (one matrix; only that layer is rerun). ``last_rows`` ``(B, N)``: the
    last layer's rows that are read (the explained ones: every other layer's rows feed the rollout, that layer's
    only through them); its other rows are 0.

    The (example, zeroed position) copies of one layer run as batches of at most ``max_rows`` token rows.
    ``progress``: called with the share of the work done (1 / the layers computed) as each layer's matrix is."""
    spec = _layers_of(model)
    # read only for fused projections: where the values are among the queries and keys
    heads = getattr(model.config, "num_attention_heads", 1)
    head_dim = getattr(model.config, "head_dim", None) or getattr(model.config, "hidden_size", heads) // heads
    layers = list({id(m): m for m in spec.modules(model, stream)}.values())  # a shared layer is hooked once
    calls = _layer_calls(model, layers, inputs)
    # where the layer's anatomy is known, its maps are read while it is rerun (the value projection's parent
    # module is the attention, which returns them)
    fast = stream == "self" and ValueZeroedLayer.applies(model)
    attention_path = spec.value.rpartition(".")[0]
    b, n = token_mask.shape
    device = token_mask.device
    real = token_mask.bool()
    pairs = real.nonzero()  # (P, 2): the (example, position) pairs whose value vector is zeroed
    per_chunk = max(1, max_rows // n)
    depths = list(enumerate(calls))
    for depth, (layer, args, kwargs) in depths[-1:] if last_only else depths:
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[:2] != (b, n):
            raise ModelError(f"valuezeroing: the layers at {spec.path(stream)!r} do not take ({b}, {n}, D) hidden "
                             f"states (got {tuple(hidden.shape)}); check the architecture entry's 'layers'")
        rest = args[1:]
        kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}

        def run(index: torch.Tensor, zeroed: torch.Tensor | None, layer: nn.Module = layer, hidden: Any = hidden,
                rest: tuple = rest, kwargs: dict = kwargs) -> torch.Tensor:
            keep = torch.ones(len(index), n, device=device)
            if zeroed is not None:
                keep[torch.arange(len(index), device=device), zeroed] = 0.0
            bias = None if spec.value_bias is None else _module(layer, spec.value_bias).detach()
            with _zeroing(_module(layer, spec.value), keep, spec, heads, head_dim, bias):
                y = layer(_take(hidden, b, index), *_take(rest, b, index),
                          **{k: v if k in spec.shared else _take(v, b, index, k in spec.head_rows)
                             for k, v in kwargs.items()})
            y = y[0] if isinstance(y, tuple) else y
            return y.to(torch.promote_types(y.dtype, torch.float32))  # half precision compared in float32

        found: list[Any] = []
        with _recording_maps(_module(layer, attention_path) if fast and attention_path else None, found):
            original = torch.cat([run(i, None) for i in torch.arange(b, device=device).split(per_chunk)])
        maps = _joined_maps(found, b, n)
        found.clear()
        recomputed = None if maps is None else ValueZeroedLayer.of(model, layer, hidden, maps)
        del maps
        top = last_rows if depth == len(calls) - 1 else None
        if recomputed is not None and _trusted(recomputed, original, run, real):
            c = _zeroed_distances(recomputed, max_rows, top)  # no rerun per token: the FFN part at each changed sum
        else:
            c = torch.zeros(b, n, n, device=device, dtype=original.dtype)
            for chunk in pairs.split(per_chunk):
                examples, positions = chunk[:, 0], chunk[:, 1]
                changed = run(examples, positions)
                dist = cosine_distance(changed, original[examples])  # (P, N(i))
                c[examples, :, positions] = dist
        recomputed = None  # this layer's maps go before the next layer's are read
        m = real.to(c.dtype)
        rows = m if top is None else m * top.to(c.dtype)
        if progress is not None:
            progress(1 / (1 if last_only else len(depths)))
        yield c.clamp_min_(0.0).mul_(rows[:, :, None]).mul_(m[:, None, :])


def _trusted(layer: ValueZeroedLayer, original: torch.Tensor, run: Any, real: torch.Tensor) -> bool:
    """Whether the layer recomputed from its pieces is the model's: its output equals the model's ``original`` at
    the real rows, and zeroing each example's first real position (which every later row may attend to) changes
    the rows' outputs as rerunning the layer does (``run``), up to the rounding of the layer's precision: two
    computations of outputs rounded to ε give a distance d that differs by about √(2d)·ε + ε²/4 (on SmolLM2 in
    bfloat16 and float16 by at most twice that), so :data:`ROUNDINGS` of it are allowed."""
    if not layer.reproduces(original, real):
        return False
    examples = torch.arange(real.shape[0], device=real.device)
    first = real.long().argmax(1)  # each example's first real position
    slow = cosine_distance(run(examples, first), original)  # (B, N)
    y = layer.output.to(slow.dtype)
    fast = torch.stack([cosine_distance(layer.zeroed(e, slice(None), int(p) + 1)[:, int(p)].to(slow.dtype), y[e])
                        * layer.attn[e, :, :, int(p)].ne(0).any(0) for e, p in enumerate(first.tolist())])
    eps = torch.finfo(layer.output.dtype).eps
    rounding = ROUNDINGS * ((2 * slow.clamp_min(0)).sqrt() * eps + eps * eps / 4)
    return bool(((fast - slow).abs() * real <= 1e-3 * float((slow * real).abs().max()) + rounding + 1e-9).all())


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 − cos(a, b) over the last axis, computed as ½‖a/‖a‖ − b/‖b‖‖²: the same value, without the cancellation
    of ``1 − cos`` when a and b are nearly parallel (in float32, 1 − cos loses ~1e-2 relative precision on lower
    layers' near-identical outputs, which the rollout then carries upward). A zero vector (never a layer's output
    in practice) is taken as unit vector 0."""
    unit_a = a / a.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
    unit_b = b / b.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(b.dtype).tiny)
    return 0.5 * (unit_a - unit_b).square().sum(-1)


def planned_passes(model: nn.Module, n: int, options: Any) -> float:
    """Value zeroing's work on an input of ``n`` tokens in forward+backward passes over it (the progress bar's
    plan): per layer every pair of a row and a zeroed position goes through the feed-forward's output projection
    (``F·D`` multiply-adds, ``F`` its width, ``D`` the hidden size, and ``2·H·F`` to mix the heads' shares),
    where one pass takes about ``3·(4D² + 3DF)`` per token and layer; the pairs' other work about doubles it
    (calibrated on a Llama-type model at 512 and 1,024 tokens). Without rollout, one layer of them."""
    dims = model_dims(model)
    cfg = getattr(model, "config", None)
    width = next((int(v) for k in ("intermediate_size", "n_inner", "encoder_ffn_dim", "ffn_dim", "d_ff")
                  if isinstance(v := getattr(cfg, k, None), int)), 4 * dims.hidden)
    d = dims.hidden
    per_layer = n * width * (d + 2 * dims.heads) / (3 * d * (4 * d + 3 * width))
    return per_layer if options.get("rollout", True) else per_layer / max(1, dims.layers)


def _check_valuezeroing(rollout: bool = True) -> None:
    """Value zeroing's option values."""
    check_flag("valuezeroing", "rollout", rollout)


def _check_prefixes(key_mask: torch.Tensor, sequence_mask: torch.Tensor) -> None:
    """Raise a :class:`ModelError` unless every step's keys ``key_mask`` ``(B, N)`` are the sequence's real positions
    ``sequence_mask`` ``(1, N)`` up to some position: the steps' matrices are then blocks of the sequence's."""
    positions = torch.arange(key_mask.shape[1], device=key_mask.device)
    ends = torch.where(key_mask.bool(), positions, -1).amax(1, keepdim=True)  # each step's last key
    if not torch.equal(key_mask.bool(), sequence_mask.bool() & (positions <= ends)):
        raise ModelError("valuezeroing: a generation step's keys are not a prefix of the generated sequence's "
                         "positions, so its matrices are not blocks of the sequence's")


def _prefix_rows(query_weights: torch.Tensor, key_mask: torch.Tensor) -> Any:
    """The explained rows ``(B, N)`` of each step read from the sequence's rollout ``(1, N, N)``. Under causal
    masking row i of every layer's matrix is 0 beyond i, so the rollout of a prefix is the top-left block of the
    sequence's and a step's row is the sequence's row at its position (its keys' entries; the others are 0): one
    ``N x N`` rollout serves every step, where one per step would hold the batch's steps times as much."""
    def read(joint: torch.Tensor) -> torch.Tensor:
        return (query_weights.to(joint.dtype) @ joint[0]) * key_mask.to(joint.dtype)
    return read


def rows_within(model: nn.Module, budget: int, rows: int, n: int) -> int:
    """Token rows one batched layer rerun may take (at most :data:`MAX_ROWS`, at least one) so that its
    activations fit what ``budget`` bytes leave beside what value zeroing keeps for ``rows`` inputs of ``n``
    tokens (every layer's input, one layer's maps: the estimate its refusal reads,
    :data:`~attnlens.core.memory.VALUE_ZEROING_STORAGE`).
    A rerun token row holds a forward's vectors (the feed-forward's included) and, rerun whole, its attention row
    in every head."""
    dims = model_dims(model)
    kept = rows * pass_row_bytes(dims, n, VALUE_ZEROING_STORAGE)
    # twice a row's vectors: the batch's outputs and cosine distances beside its activations, and the allocator's
    # slack (a 118-token SmolLM2 prompt within 128 MiB peaked at 1.15 times the budget with once)
    per_row = 2 * (dims.forward_vectors * dims.hidden + dims.heads * n) * max(dims.itemsize, 4)
    return max(1, min(MAX_ROWS, (budget - kept) // max(1, per_row)))


@register(
    "valuezeroing",
    needs={OWN_PASS},
    class_specific=False,
    self_attention_only=True,
    applies=_applies,
    per_token_passes=True,
    summary="Value zeroing: C^l[i,j] = cosine distance of token i's layer-l output when j's value vector is zeroed; "
            "rows normalised, rolled out over layers; s_j = R[c, j].",
    citation="Mohebbi et al. 2023 (EACL), authors' code hmohebbi/ValueZeroing",
    check=_check_valuezeroing,
    passes=planned_passes,
)
def valuezeroing(ctx: BatchContext, rollout: bool = True) -> MethodOutput:
    """``rollout=False``: the last layer's normalised row alone (no propagation through the layers below): only
    that layer is rerun, and there is no per-layer view."""
    _check_valuezeroing(rollout)
    cap = ctx.capture
    last_only = not rollout
    read = cap.query_weights.ne(0)  # the last layer's rows the scores read
    with torch.no_grad():
        if ctx.sequence is None:
            top = read if read.shape == cap.key_mask.shape else None
            max_rows = rows_within(ctx.model, ctx.budget_left(), *cap.key_mask.shape)
            matrices = layer_matrices(ctx.model, ctx.inputs, cap.key_mask, ctx.stream, max_rows=max_rows,
                                      last_only=last_only, last_rows=top, progress=ctx.progress)
            read_rows = cap.row
        else:  # a generation's steps: the sequence's matrices hold every prefix's as their top-left block
            ids = ctx.sequence["input_ids"]
            sequence_mask = ctx.sequence.get("attention_mask", torch.ones_like(ids))
            _check_prefixes(cap.key_mask, sequence_mask)
            top = read.any(0, keepdim=True) if read.shape[1] == ids.shape[1] else None
            max_rows = rows_within(ctx.model, ctx.budget_left(), 1, ids.shape[1])
            matrices = layer_matrices(ctx.model, ctx.sequence, sequence_mask, ctx.stream, max_rows=max_rows,
                                      last_only=last_only, last_rows=top, progress=ctx.progress)
            read_rows = _prefix_rows(cap.query_weights, cap.key_mask)
        # rolled out as the layers come (P^l = C^l P^{l-1}, rows normalised): two products held, not every layer's
        rows, joint = [], None
        for c in matrices:
            c = c.div_(c.sum(-1, keepdim=True).clamp_min(torch.finfo(c.dtype).tiny))
            joint = c if joint is None or not rollout else c @ joint
            rows.append(read_rows(joint.to(cap.query_weights.dtype)))
            del c
    if not rollout:
        return MethodOutput(rows[-1])
    layers = torch.stack(rows, 1)
    return MethodOutput(layers[:, -1], layers)
