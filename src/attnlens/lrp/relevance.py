"""The relevance pass: one forward in LRP mode and one ``autograd.grad`` give every relevance we need."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.modelstate import without_cache
from ..core.recomputing import recomputing
from ..core.row_attention import LayerFactors, keys_seen, masked_scores, repeat_kv, zero_padded
from ..errors import InputError, ModelError
from ..models.heads import CLASSIFICATION, MULTI_LABEL, TARGET_KINDS, Head
from ..models.prefixes import last_positions, last_token_rows, row_gradients
from .patch import check_rules, lrp_mode, runs_fused
from .state import CHEFER, PassState


@dataclass
class LRPResult:
    """Relevances of one batch; every tensor is detached. B examples, L layers, H heads, N tokens.

    Attributes:
        logits: ``(B, C)`` logits (the LRP forward computes the same values as the plain one).
        target: ``(B,)`` the explained scalar per example (logit, probability or log-probability of the target).
        attentions: L tensors ``(B, H, N, N)``, the attention probabilities.
        attention_relevance: L tensors ``(B, H, N, N)``: ``R(A^l) = A^l * (modified gradient)``.
        input_relevance: ``(B, N)`` relevance of the summed input embeddings (word + position + segment where
            the model adds them: the input of the module ``LRPSupport.embedding_input`` names, else the word
            embeddings), summed over the hidden dimension; ``None`` from a pass run with ``inputs=False``.
        word_relevance: ``(B, N)`` relevance of the word embeddings alone (LXT's convention); ``None`` likewise.
        decoder_relevance: an encoder-decoder's: ``(B, M)`` relevance of the decoder's summed input embeddings
            (its ``M`` input positions; ``input_relevance`` is the encoder's), so that the two together account
            for the explained scalar; ``None`` for other models and passes without the input relevance.
        position_relevance: ``(B,)`` relevance taken by relative-position embeddings (DeBERTa-v2's, absorbed by
            those parameters like a bias) or relative-position score biases (BLOOM's and Falcon's ALiBi); zeros
            for other models.
        softmax_absorbed: ``(B,)`` relevance the attention softmaxes (and Mixtral's routing softmaxes) did not
            pass on (``sum R(A) - sum R(softmax input)`` over all layers), only with ``track_softmax=True``.
        factors, output_grads: a fused pass under Chefer et al.'s rules keeps no maps (``attentions`` and
            ``attention_relevance`` are empty) but, per layer, what its maps are recomputed from and half the
            modified gradient at its attention output ``(B, H, N, d)``: :meth:`relevance_rows` reads R(A^l) from
            them a few query rows at a time.
        first_layer: the layer of ``attention_relevance[0]`` (and of ``factors[0]``, ``output_grads[0]``): 0, or
            the last layer's index after a pass that stopped there (``last_layer_only``).
        outputs: the forward's model outputs (their tensors, detached: the logits, or a QA model's start and end
            logits; no cache, hidden states or maps), as a plain forward of the same inputs returns them.
    """

    logits: torch.Tensor
    target: torch.Tensor
    attentions: list[torch.Tensor]
    attention_relevance: list[torch.Tensor]
    input_relevance: torch.Tensor | None
    word_relevance: torch.Tensor | None
    position_relevance: torch.Tensor
    softmax_absorbed: torch.Tensor | None = None
    decoder_relevance: torch.Tensor | None = None
    factors: list[LayerFactors] = field(default_factory=list)
    output_grads: list[torch.Tensor] = field(default_factory=list)
    first_layer: int = 0
    outputs: Any = None
    _values: tuple[int, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def n_layers(self) -> int:
        """L: the model's layers, as far as the pass holds their attention relevance (kept or to recompute):
        the layers held are ``first_layer`` to ``n_layers - 1``."""
        return self.first_layer + (len(self.attention_relevance) or len(self.output_grads))

    def relevance_rows(self, layer: int, queries: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, H, q, N)``: R(A^layer) at the query positions ``queries`` ``(q,)``, from the kept maps or, after
        a fused pass, recomputed: ``A ⊙ (½ ∂O) Vᵀ``, the probabilities ``A`` from the layer's queries and keys
        unless given (``probs``: the same rows of the same model's attention, e.g. a shared pass's)."""
        if not self.first_layer <= layer < self.n_layers:
            raise ValueError(f"the pass holds the attention relevance of layers {self.first_layer} to "
                             f"{self.n_layers - 1}, not of layer {layer}")
        held = layer - self.first_layer
        if self.attention_relevance:
            return self.attention_relevance[held][:, :, queries]
        f = self.factors[held]
        if self._values is None or self._values[0] != held:  # keys and values per query head, once per layer
            self._values = (held, repeat_kv(f.key, f.groups), repeat_kv(f.value, f.groups))
        _, key, value = self._values
        keys = key.shape[2]
        seen = keys_seen(int(queries.max()) + 1, keys, f.causal, f.mask) if len(queries) else keys
        if probs is None:  # as attend() computes them
            probs = torch.softmax(masked_scores(f.query, key[:, :, :seen], f.mask, queries, f.causal, f.scale), dim=-1)
        grad = torch.matmul(self.output_grads[held][:, :, queries], value[:, :, :seen].transpose(2, 3))
        out = probs[..., :seen] * grad
        return zero_padded(out, keys)


def check_settings(rules: object, epsilon: object) -> None:
    """:class:`InputError` unless ``rules`` names a rule set and ``epsilon`` is a finite number >= 0 it can use (an
    infinite one would divide every relevance away)."""
    check_rules(rules)
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 <= epsilon < math.inf:
        raise InputError(f"LRP epsilon must be a finite number >= 0, got {epsilon!r}")
    if epsilon and rules in CHEFER:
        raise InputError(f"LRP epsilon applies to rules 'attnlrp' and 'cp', not {rules!r} (whose z+ rule has none)")


def lrp_pass(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    targets: torch.Tensor | Sequence[int] | int,
    target_kind: str = "logit",
    *,
    head: Head | None = None,
    rules: str = "attnlrp",
    epsilon: float = 0.0,
    track_softmax: bool = False,
    rows: torch.Tensor | None = None,
    inputs_relevance: bool = True,
    fused: bool = False,
    forward_kwargs: Mapping[str, Any] | None = None,
    logit_mask: torch.Tensor | None = None,
    attention_relevance: bool = True,
    progress: Callable[[float], None] | None = None,
    last_layer_only: bool = False,
    chunk_reader: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None,
    recompute: bool = True,
) -> LRPResult:
    """Run one LRP pass over a padded batch of a stock HF model whose architecture entry declares LRP support.

    Args:
        model: a supported model (``attnlens.lrp.SUPPORTED``: BERT-style encoders, DeBERTa-v2, ModernBERT,
            GPT-2, GPT-Neo, GPT-J, GPT-NeoX, Phi, Phi-3, the Llama family, Mixtral, Gemma 2, OPT, BLOOM, Falcon), left
            unchanged.
        inputs: model inputs (``input_ids``, ``attention_mask``, ...).
        targets: explained target per example, as ``head.scalar`` takes them; for the default classification
            head a class per example (``(B,)``, a list, or one int for all).
        target_kind: ``"logit"`` (relevance starts as the target logit), ``"probability"`` or ``"loss"``
            (log-probability); for the last two the output softmax gets the same gradient x input rule as the
            attention softmax.
        head: the task head (:mod:`attnlens.models.heads`) that reads the model output (``head.logits``) and forms the
            explained scalar per example (``head.scalar``); default: the (multi-label) sequence classification
            head. Any head works whose scalar is a differentiable function of the logits and keeps the examples
            independent (e.g. one token's logit, or a difference of two logits, in a causal LM).
        rules: ``"chefer"`` (Chefer et al.'s modified rules, ``layers_ours.py``: z+ Linear, identity LayerNorm
            and softmax, normalised residuals, relevance 1 at the explained scalar whatever ``target_kind``),
            ``"chefer-lrp"`` (the LRP-baseline rules of their code, ``layers_lrp.py``: z+ with two denominators,
            which doubles relevance at most Linear layers, and plain residual splits), ``"attnlrp"`` (Achtibat
            et al. 2024) or ``"cp"`` (Ali et al. 2022: attention treated as constant). See ``docs/lrp.md``.
        epsilon: stabiliser of the epsilon rule on Linear layers and attention matmuls (0: LRP-0); only for
            ``"attnlrp"`` and ``"cp"``.
        track_softmax: also return the relevance absorbed by the attention softmaxes (for conservation checks).
        rows: ``(B, N)`` masks of prefixes of the one sequence in ``inputs`` (a batch of one), explained at their
            last token by a language-model head (a generation's steps, :attr:`BatchContext.sequence`): the pass
            runs once over the sequence and each row's relevances come from its own batched vector-Jacobian
            product; the result has ``B`` rows. With ``logits_to_keep`` in ``forward_kwargs`` the rows read
            the kept (last) positions, which must reach back to the shortest row's last token.
        inputs_relevance: also propagate to the input embeddings (``input_relevance``, ``word_relevance``);
            without it the backward stops at the first layer's attention probabilities, which is all that
            PartialLRP and TransAtt read (the first layer's query/key/value projections are not run backward).
        fused: compute the attention with PyTorch's fused attention (:func:`~attnlens.lrp.state.attend_fused`),
            by default recomputing each layer in the backward instead of keeping its activations: no ``N × N``
            probabilities are kept, so the memory grows linearly with the length; the input relevances are those
            of the eager pass (to rounding), ``attentions`` and ``attention_relevance`` are empty. AttnLRP with
            ``epsilon=0`` (over ``rows``: one backward per row), or Chefer et al.'s rules (``"chefer"``,
            ``"chefer-lrp"``; over ``rows`` only with ``last_layer_only``), without ``track_softmax``; a model
            :func:`runs_fused` does not cover gets the eager pass. Under Chefer et al.'s rules the attention
            relevance is kept as what recomputes it (:meth:`LRPResult.relevance_rows`), and the backward
            recomputes each layer's probabilities a chunk of query rows at a time.
        forward_kwargs: more arguments of the model's forward, e.g. ``logits_to_keep`` (a language model
            projecting only the positions its head reads); ``targets`` and ``logit_mask`` are then in the kept
            positions' coordinates, and so are the result's ``logits``.
        logit_mask: ``(B, K)`` the real positions among the logits, as the head reads them (default: the inputs'
            attention mask).
        attention_relevance: also form every layer's ``R(A^l)`` (``attention_relevance``, or what recomputes it
            after a fused pass); without it (for AttnLRP's input relevance alone) the backward takes no gradient
            at the probabilities and the result's ``attention_relevance`` is empty, which saves an ``N × N``
            product and its storage per layer. ``track_softmax`` forms them whatever this says.
        progress: called with the share of the pass done since the last call, where the pass runs one backward per
            row (a fused pass over a generation's steps); ``None``: nobody listens.
        last_layer_only: form R(A) at the last layer alone (``first_layer`` of the result): the backward stops at
            that layer's attention and runs through nothing below it, which is all PartialLRP's score reads. Not
            with ``inputs_relevance`` or ``track_softmax``; ``position_relevance`` is then zeros.
        chunk_reader: a fused pass under Chefer et al.'s rules calls it with each chunk of query rows its backward
            recomputes, top layer first: ``(layer, first query row, A (B, H, q, K), R(A) there)``, ``K`` the keys
            the chunk's rows see (:attr:`~attnlens.lrp.state.PassState.chunk_reader`).

    Examples are independent: no rule normalises across the batch, so a batch gives the same relevances as
    its examples one by one.
    """
    if fused and (rules not in ("attnlrp", *CHEFER) or epsilon or track_softmax
                  or (rows is not None and rules != "attnlrp" and not last_layer_only)):
        raise InputError("the fused LRP pass computes AttnLRP with epsilon=0 or Chefer et al.'s rules over a batch "
                         "of inputs (AttnLRP, and Chefer's rules stopping at the last layer, also over a sequence's "
                         "rows), without track_softmax")
    if last_layer_only and (inputs_relevance or track_softmax or not attention_relevance):
        raise InputError("a pass that stops at the last layer's attention forms that layer's attention relevance "
                         "alone: with attention_relevance, without inputs_relevance or track_softmax")
    (result,) = _run(model, inputs, targets, target_kind, head, (rules,), epsilon, track_softmax, rows,
                     inputs_relevance, fused and runs_fused(model), forward_kwargs, logit_mask, attention_relevance,
                     progress, last_layer_only, chunk_reader, recompute)
    return result


JOINT = ("chefer", "attnlrp")  # the rule sets one forward serves (lrp_passes)


def lrp_passes(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    targets: torch.Tensor | Sequence[int] | int,
    target_kind: str = "logit",
    *,
    head: Head | None = None,
    rows: torch.Tensor | None = None,
    fused: bool = False,
    forward_kwargs: Mapping[str, Any] | None = None,
    logit_mask: torch.Tensor | None = None,
    last_layer_only: bool = False,
    chunk_reader: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None,
) -> tuple[LRPResult, LRPResult]:
    """The ``"chefer"`` and ``"attnlrp"`` passes (ε = 0) of :func:`lrp_pass` from one forward: (chefer without
    the input relevance, as PartialLRP and TransAtt read it; attnlrp with it).

    The forward runs in the chefer layout (normalised residual sums); every chefer rule there also knows its
    AttnLRP counterpart (``rules``' ``switch``) and runs it during the second backward, so both results equal
    their own passes' (to rounding) at the cost of one forward less. ``fused``: as :func:`lrp_pass`'s (not with
    ``rows``); ``last_layer_only``, ``chunk_reader``: as :func:`lrp_pass`'s, for the chefer pass.
    """
    if fused and rows is not None:
        raise InputError("the fused LRP passes run over a batch of inputs, without rows")
    chefer, attnlrp = _run(model, inputs, targets, target_kind, head, JOINT, 0.0, False, rows, False,
                           fused and runs_fused(model), forward_kwargs, logit_mask, last_layer_only=last_layer_only,
                           chunk_reader=chunk_reader)
    return chefer, attnlrp


def _run(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    targets: torch.Tensor | Sequence[int] | int,
    target_kind: str,
    head: Head | None,
    rule_sets: tuple[str, ...],
    epsilon: float,
    track_softmax: bool,
    rows: torch.Tensor | None,
    inputs_relevance: bool,
    fused: bool = False,
    forward_kwargs: Mapping[str, Any] | None = None,
    logit_mask: torch.Tensor | None = None,
    attention_relevance: bool = True,
    progress: Callable[[float], None] | None = None,
    last_layer_only: bool = False,
    chunk_reader: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None,
    recompute: bool = True,
) -> list[LRPResult]:
    """One forward (in the first rule set's layout) and one backward per rule set; see :func:`lrp_pass`. Only
    the attnlrp backward of a joint pass reads the input relevance whatever ``inputs_relevance``, and a backward
    that reads it never stops at the last layer (``last_layer_only``)."""
    if target_kind not in TARGET_KINDS:
        raise InputError(f"unknown target kind {target_kind!r}; choose one of {', '.join(TARGET_KINDS)}")
    for r in rule_sets:
        check_settings(r, epsilon)
    if head is None:  # multi-label: a sigmoid per label
        multi_label = getattr(model.config, "problem_type", None) == "multi_label_classification"
        head = MULTI_LABEL if multi_label else CLASSIFICATION
    token_mask = inputs.get("attention_mask")
    joint = len(rule_sets) > 1
    state = PassState(rules=rule_sets[0], epsilon=float(epsilon), track_softmax=track_softmax, fused=fused,
                      last_factors_only=last_layer_only and not joint, chunk_reader=chunk_reader)
    results = []
    with contextlib.ExitStack() as stack:
        stack.callback(state.release)  # last out: after the model is restored
        stack.enter_context(torch.enable_grad())
        stack.enter_context(lrp_mode(model, state))
        extra = dict(forward_kwargs or {})
        if fused:  # after lrp_mode, which puts every module in eval mode
            if recompute:
                tokens = max((t.shape[1] for t in inputs.values() if torch.is_tensor(t) and t.dim() >= 2), default=0)
                stack.enter_context(recomputing(model, tokens))
            extra.update(without_cache(model))
        outputs = state.logits(model(**inputs, **extra))
        logits = head.logits(outputs)
        # the outputs as a plain forward returns them, without the cache or the graph (the shared pass reads them)
        plain = type(outputs)(**{k: v.detach() for k, v in outputs.items() if isinstance(v, torch.Tensor)})
        if not state.attention_calls:
            raise ModelError("LRP: the model computed no attention through the patched attention function")
        tgt = _class_targets(targets, logits) if head.task == "classification" else targets
        # the rows read their last tokens among the kept logits (``logits_to_keep``: the sequence's last ones)
        if rows is not None and bool((last_positions(rows) < rows.shape[1] - logits.shape[1]).any()):
            raise InputError(f"the model kept the logits of the last {logits.shape[1]} positions; a row ends before "
                             "them (keep at least the positions from the shortest row's last token on)")
        read, read_mask = ((logits, token_mask if logit_mask is None else logit_mask) if rows is None
                           else last_token_rows(logits, rows[:, rows.shape[1] - logits.shape[1]:]))
        for k, rules in enumerate(rule_sets):
            state.mode = rules if joint else None
            with_inputs = inputs_relevance or (joint and rules not in CHEFER)
            results.append(_backward(state, head, read, tgt, target_kind, read_mask, logits, rules, rows,
                                     with_inputs, retain=k + 1 < len(rule_sets),
                                     attention_relevance=attention_relevance or track_softmax,
                                     progress=progress,
                                     last_layer_only=last_layer_only and not with_inputs))
            results[-1].outputs = plain
    return results


def _backward(state: PassState, head: Head, read: torch.Tensor, tgt, target_kind: str,
              read_mask: torch.Tensor | None, logits: torch.Tensor, rules: str, rows: torch.Tensor | None,
              inputs_relevance: bool, retain: bool, attention_relevance: bool = True,
              progress: Callable[[float], None] | None = None, last_layer_only: bool = False) -> LRPResult:
    """The relevances of one rule set from the recorded forward (``retain``: another backward follows;
    ``attention_relevance``: form R(A) at every layer's probabilities; ``last_layer_only``: at the last layer's
    alone, the backward stopping there)."""
    track_softmax = state.track_softmax
    # the gradient each example's relevance starts from (chefer: relevance 1 at the explained logit, so
    # gradient 1 / logit; otherwise 1 at the explained scalar)
    if rules in CHEFER:
        value = head.scalar(read, tgt, "logit", read_mask)
        start = (1.0 / torch.where(value == 0, torch.ones_like(value), value)).detach()
    else:
        value = head.scalar(read, tgt, target_kind, read_mask)
        start = torch.ones_like(value).detach()
    if last_layer_only:
        return _last_layer_backward(state, value, start, logits, rows, retain, progress)
    emb_sum = state.word_embeddings if state.embedding_sum is None else state.embedding_sum
    others = [t for pair in state.other_softmaxes for t in pair]
    leaves = [state.word_embeddings, emb_sum, state.decoder_sum] if inputs_relevance else [None, None, None]
    fused_chefer = state.fused and rules in CHEFER
    if fused_chefer and not inputs_relevance:  # no probabilities to stop at: down to the embeddings
        leaves = [state.word_embeddings, None, None]
    probs = state.probs if attention_relevance else [None] * len(state.probs)
    wrt = [*leaves, *probs, *state.softmax_inputs, *state.position_inputs, *others]
    live = [i for i, t in enumerate(wrt) if t is not None and t.requires_grad]
    if rows is None:
        found = torch.autograd.grad(value, [wrt[i] for i in live], start, allow_unused=True, retain_graph=retain)
    elif state.fused:  # one backward per row (each recomputes the layers), so only one row's gradients live at once
        found = _one_row_at_a_time(value, [wrt[i] for i in live], start, retain, progress)
    else:  # one product per row through the sequence's pass, batched
        found = row_gradients(value, [wrt[i] for i in live], start, retain_graph=retain)
    grads: list[torch.Tensor | None] = [None] * len(wrt)
    for i, g in zip(live, found):
        grads[i] = g
    n_layers, n_soft = len(state.probs), len(state.softmax_inputs)
    g_word, g_sum, g_decoder = grads[:3]
    first = len(leaves)
    g_probs = grads[first : first + n_layers]
    g_soft = grads[first + n_layers : first + n_layers + n_soft]
    n_pos = len(state.position_inputs)
    g_pos = grads[first + n_layers + n_soft : first + n_layers + n_soft + n_pos]
    g_others = grads[first + n_layers + n_soft + n_pos :]

    n_rows = len(value)

    def rows_of(x: torch.Tensor) -> torch.Tensor:
        return _per_row(x, rows, n_rows)

    def rel(x: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros_like(rows_of(x)) if g is None else (x * g).detach()

    att_rel = [rel(p, g) for p, g in zip(state.probs, g_probs)] if attention_relevance else []
    recomputes = fused_chefer and attention_relevance  # R(A) kept as what recomputes it (no maps to keep)
    absorbed = None
    if track_softmax and rules == "cp":  # the softmax is outside the relevance path
        absorbed = torch.zeros_like(value).detach()
    elif track_softmax:
        soft_rel = [rel(torch.nan_to_num(s, neginf=0.0), g) for s, g in zip(state.softmax_inputs, g_soft)]
        absorbed = sum(a.sum((1, 2, 3)) - s.sum((1, 2, 3)) for a, s in zip(att_rel, soft_rel))
        for k, (out, inp) in enumerate(state.other_softmaxes):
            absorbed = (absorbed + rel(out, g_others[2 * k]).flatten(1).sum(1)
                        - rel(inp, g_others[2 * k + 1]).flatten(1).sum(1))
    position = torch.zeros_like(value).detach()
    for leaf, g in zip(state.position_inputs, g_pos):
        position = position + rel(leaf, g).flatten(1).sum(1)
    return LRPResult(
        logits=rows_of(logits),
        target=value.detach(),
        attentions=[rows_of(p) for p in state.probs],
        attention_relevance=att_rel,
        input_relevance=rel(emb_sum, g_sum).sum(-1) if inputs_relevance else None,
        word_relevance=rel(state.word_embeddings, g_word).sum(-1) if inputs_relevance else None,
        position_relevance=position,
        softmax_absorbed=absorbed,
        decoder_relevance=(rel(state.decoder_sum, g_decoder).sum(-1)
                           if inputs_relevance and state.decoder_sum is not None else None),
        factors=[state.factors[i] for i in range(len(state.factors))] if recomputes else [],
        output_grads=[state.output_grads[i] for i in range(len(state.output_grads))] if recomputes else [],
    )


def _per_row(x: torch.Tensor, rows: torch.Tensor | None, n_rows: int) -> torch.Tensor:
    """``x`` detached, as each of ``n_rows`` rows sees it: itself over a batch, the sequence's tensor expanded to
    every row (a view) over a generation's prefixes (``rows``)."""
    return x.detach() if rows is None else x.detach().expand(n_rows, *x.shape[1:])


def _last_layer_backward(state: PassState, value: torch.Tensor, start: torch.Tensor, logits: torch.Tensor,
                         rows: torch.Tensor | None, retain: bool,
                         progress: Callable[[float], None] | None = None) -> LRPResult:
    """R(A) of the last layer alone (``first_layer`` = L - 1): the gradient taken at that layer's probabilities
    (eager) or at its attention output (fused, where R(A) is recomputed from half of it), so the backward runs
    through the layers above that point and nothing below."""
    fused = state.fused and state.rules in CHEFER
    layers = len(state.factors) if fused else len(state.probs)
    at = state.last_output if fused else state.probs[-1]
    if at is None or not at.requires_grad:
        raise ModelError("LRP: the model's last attention layer is not on the explained output's graph")
    if rows is None:
        (grad,) = torch.autograd.grad(value, [at], start, retain_graph=retain)
    elif fused:  # one backward per row, each recomputing the last layer (held at the checkpoint, not kept)
        (grad,) = _one_row_at_a_time(value, [at], start, retain, progress)
    else:  # one product per row through the sequence's pass, batched
        (grad,) = row_gradients(value, [at], start, retain_graph=retain)
    n_rows = len(value)

    def rows_of(x: torch.Tensor) -> torch.Tensor:
        return _per_row(x, rows, n_rows)

    return LRPResult(
        logits=rows_of(logits),
        target=value.detach(),
        attentions=[rows_of(p) for p in state.probs],
        attention_relevance=[] if fused else [(rows_of(at) * grad).detach()],
        input_relevance=None,
        word_relevance=None,
        position_relevance=torch.zeros_like(value).detach(),
        factors=[state.factors[layers - 1]] if fused else [],
        output_grads=[(0.5 * grad).detach()] if fused else [],
        first_layer=layers - 1,
    )


def _one_row_at_a_time(values: torch.Tensor, wrt: list[torch.Tensor], scale: torch.Tensor, retain: bool,
                       progress: Callable[[float], None] | None = None) -> tuple[torch.Tensor | None, ...]:
    """:func:`~attnlens.models.prefixes.row_gradients` by one backward per row: ``(B, ...)`` per tensor of ``wrt``
    (``None`` where unused); ``progress`` is told ``1 / B`` after each row."""
    rows: list[tuple[torch.Tensor | None, ...]] = []
    for b in range(len(values)):
        rows.append(torch.autograd.grad(values[b], wrt, scale[b], allow_unused=True,
                                        retain_graph=retain or b + 1 < len(values)))
        if progress is not None:
            progress(1 / len(values))
    return tuple(None if found[0] is None else torch.cat(found) for found in zip(*rows, strict=True))


def _class_targets(targets: torch.Tensor | Sequence[int] | int, logits: torch.Tensor) -> torch.Tensor:
    """``(B,)`` checked class indices for ``(B, C)`` logits (one int: the same class for every example), or
    ``(B, 2)`` (target, contrast) pairs of a contrastive head."""
    if logits.dim() != 2:
        raise ModelError(f"LRP explains sequence classifiers with (batch, classes) logits, got {tuple(logits.shape)}")
    tgt = torch.as_tensor(targets, device=logits.device).long()
    if tgt.dim() == 2 and tgt.shape[1] == 2:  # (target, contrast) pairs of a contrastive head
        if tgt.shape[0] != logits.shape[0] or bool(((tgt < 0) | (tgt >= logits.shape[1])).any()):
            raise InputError(f"targets {tgt.tolist()} do not fit logits of shape {tuple(logits.shape)}")
        return tgt
    tgt = tgt.reshape(-1)
    if tgt.numel() == 1:
        tgt = tgt.expand(logits.shape[0])
    if tgt.shape[0] != logits.shape[0] or bool(((tgt < 0) | (tgt >= logits.shape[1])).any()):
        raise InputError(f"targets {tgt.tolist()} do not fit logits of shape {tuple(logits.shape)}")
    return tgt
