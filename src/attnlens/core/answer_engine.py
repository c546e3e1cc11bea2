"""Explaining a language model's answer as a whole: one explained scalar, the sum of the answer tokens'
log-probabilities given the prompt (:class:`~attnlens.models.heads.AnswerHead`), so every gradient, LRP and
decomposition method costs one pass per answer instead of one per token (a generation's steps,
:mod:`attnlens.core.generation_engine`, explain each token on its own). For methods linear in the explained
scalar the result equals the sum of the per-token explanations (the tests compare the two).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import InputError, ModelError
from ..models.heads import AnswerHead, LMHead, Seq2SeqLMHead, answer_labels, decode_token
from ..results.explanation import Explanation
from . import engine
from .batching import keeps_logits
from .encoding import Encoded, special_ids
from .memory import Storage, model_dims, parse_budget, pass_row_bytes, shared_pass_row_bytes
from .model_runner import ModelRunner
from .modelstate import explaining

__all__ = ["answer_logprobs", "check_lm", "explain_answer"]


def check_lm(runner: ModelRunner, what: str = "explaining an answer") -> None:
    """:class:`ModelError` unless the model is a decoder-only language model (answers are its continuations);
    ``what`` names the work in the message."""
    if not isinstance(runner.head, LMHead) or isinstance(runner.head, Seq2SeqLMHead):
        raise ModelError(f"{what} needs a decoder-only language model (…ForCausalLM); {runner.name} "
                         f"is {runner.head.kind}")


def explain_answer(
    runner: ModelRunner,
    prompt_ids: Sequence[int],
    answer_ids: Sequence[int],
    methods: str | Sequence[str] | None = "all",
    *,
    text: str = "",
    offsets: Sequence[tuple[int, int]] | None = None,
    target_kind: str = "loss",
    options: Mapping[str, Mapping[str, Any]] | None = None,
    memory_budget: str | int | None = None,
    progress: Any = False,
) -> Explanation:
    """Explain ``answer_ids`` after ``prompt_ids`` as one scalar with each method: an :class:`Explanation` over
    the tokens prompt + answer (``target`` = the answer's token span ``[start, end)``; ``probabilities`` = each
    answer token's probability; ``meta["answer_logprob"]`` their summed log-probability). ``text``/``offsets``:
    the input's text and each token's character span in it, kept in the explanation."""
    check_lm(runner)
    prompt_ids, answer_ids = [int(i) for i in prompt_ids], [int(i) for i in answer_ids]
    if not prompt_ids:
        raise InputError("the prompt is empty")
    if not answer_ids:
        raise InputError("the answer is empty: give at least one token to explain")
    n = len(prompt_ids) + len(answer_ids)
    if n > runner.max_length:
        raise InputError(f"prompt ({len(prompt_ids)} tokens) + answer ({len(answer_ids)}) is longer than the "
                         f"model's maximum of {runner.max_length} tokens")
    answer_runner = _answer_runner(runner, len(answer_ids))
    specs, method_options = engine.select_methods(answer_runner, methods, engine.ANSWER, target_kind, options)
    ids = prompt_ids + answer_ids
    specials = special_ids(runner.tokenizer)
    encoded = Encoded(text=text, ids=ids, type_ids=None, special=[i in specials for i in ids],
                      tokens=runner.tokenizer.convert_ids_to_tokens(ids), word_ids=None, sequence_ids=None,
                      offsets=None if offsets is None else [tuple(o) for o in offsets])
    (exp,) = engine.explain_all(answer_runner, [encoded], [answer_labels(len(prompt_ids), answer_ids)], specs,
                                method_options, target_kind, 1, progress, parse_budget(memory_budget))
    return exp


def _answer_runner(runner: ModelRunner, answer_tokens: int) -> ModelRunner:
    """``runner`` with the head that explains an answer of ``answer_tokens`` tokens as one scalar (0: unknown)."""
    decode = runner.head.decode or (lambda i: decode_token(runner.tokenizer, i))
    return runner.with_head(AnswerHead(runner.head.vocab_size, decode, answer_tokens))


def refuse_answer_over_budget(runner: ModelRunner, n_tokens: int, answer_tokens: int,
                              methods: str | Sequence[str] | None,
                              options: Mapping[str, Mapping[str, Any]] | None = None,
                              memory_budget: str | int | None = None) -> None:
    """The one-line :class:`InputError` that :func:`explain_answer` would raise for ``methods`` over ``n_tokens``
    tokens (``answer_tokens`` of them explained) beyond ``memory_budget``, without a model pass: for a check
    before the answer is known (its shortest length bounds the need from below)."""
    check_lm(runner)
    answer_runner = _answer_runner(runner, answer_tokens)
    specs, method_options = engine.select_methods(answer_runner, methods, engine.ANSWER, "loss", options)
    budget = parse_budget(memory_budget)
    engine.pass_cost(answer_runner, specs, budget, method_options).refuse_over(n_tokens, budget)


def methods_within_budget(runner: ModelRunner, methods: Sequence[str], n_tokens: int,
                          memory_budget: str | int | None = None,
                          answer_tokens: int = 0) -> tuple[list[str], dict[str, int]]:
    """Of ``methods`` (token-level, in order), those that explain an answer (of ``answer_tokens`` tokens; 0:
    unknown) over ``n_tokens`` tokens together within ``memory_budget``, adding them one by one; and for each one
    left out the bytes it needs alone."""
    check_lm(runner)
    budget = parse_budget(memory_budget)
    answer_runner = _answer_runner(runner, answer_tokens)
    specs, _ = engine.select_methods(answer_runner, list(methods), engine.ANSWER, "loss", None)
    kept: list[Any] = []
    left: dict[str, int] = {}
    for spec in specs:
        if engine.pass_cost(answer_runner, [*kept, spec], budget).total(n_tokens) <= budget:
            kept.append(spec)
        else:
            left[spec.name] = engine.pass_cost(answer_runner, [spec], budget).total(n_tokens)
    return [s.name for s in kept], left


@torch.no_grad()
def answer_logprobs(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    answer_ids: Sequence[int],
    *,
    masks: Sequence[Sequence[int] | None] | None = None,
    memory_budget: str | int | None = None,
    batch_size: int = 64,
    progress: Any = None,
    reference: Sequence[int] | None = None,
) -> np.ndarray:
    """The answer's total log-probability after each prompt (token ids; ``masks``: 0/1 per prompt token hides
    tokens from attention without removing them), ``(len(prompts),)`` float64: the forwards of the ablation
    methods, in length-sorted batches that fit ``memory_budget`` (fused attention, no gradients).
    ``progress(k)`` hears of every ``k`` prompts done.

    Batches are left-padded with explicit positions, so every row's answer ends the batch and only the answer's
    positions are projected onto the vocabulary (``logits_to_keep``) where the model allows it.

    ``reference``: a prompt the others mostly begin with (the whole context, where each prompt leaves a source
    out). Where the prompts share enough of their beginnings with it, the reference's beginning runs once and each
    prompt runs only from where it departs from it, on the model's key/value cache of the part they share
    (:func:`_shared_prefix_logprobs`): leaving one of many passages out then costs half the forwards."""
    check_lm(runner)
    answer = [int(i) for i in answer_ids]
    budget = parse_budget(memory_budget)
    with explaining(runner.model, "sdpa"):
        if reference is not None and masks is None:
            shared = _shared_prefix_logprobs(runner, prompts, answer, reference, budget, batch_size, progress)
            if shared is not None:
                return shared
        return _batched_logprobs(runner, prompts, answer, masks, budget, batch_size, progress)


REUSE_SHARE = 0.25  # the share of the prompts' tokens a shared beginning must spare for the cache to be used
FUSED_FORWARD = Storage(eager=False, logit_rows=1)  # what a forward without a graph holds (no maps, one logit row)


def answer_logprob(runner: ModelRunner, logits: torch.Tensor, answer: Sequence[int]) -> torch.Tensor:
    """``(B,)``: the log-probability of ``answer`` (its tokens' log-probabilities summed) read from ``logits``
    ``(B, P, V)`` whose last ``len(answer) + 1`` positions are those of the prompt's last token and the answer's
    (the last predicts nothing): as every forward of attnlens that explains or ablates an answer reads it."""
    k = len(answer)
    labels = torch.tensor([[*answer, -1]], device=logits.device).expand(len(logits), -1)
    return AnswerHead(runner.head.vocab_size).scalar(logits[:, -(k + 1):], labels, "loss", labels >= 0)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` begin with in common."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def _shared_prefix_logprobs(runner: ModelRunner, prompts: Sequence[Sequence[int]], answer: list[int],
                            reference: Sequence[int], budget: int, batch_size: int,
                            progress: Any) -> np.ndarray | None:
    """:func:`answer_logprobs` of ``prompts`` from the key/value caches of the beginnings they share.

    The prompts run in lexicographic order of their tokens, so that each shares as long a beginning as any with
    the one before it, in groups of :func:`_prompts_per_cached_forward` (one on a CPU). A group runs the rest of
    each of its prompts and the answer in one forward, on a cache of the keys and values of what all of them
    share with ``reference`` (one forward over the longest such beginning) or with the last prompt of the group
    before (kept from that forward), whichever is longer. ``None`` where that spares too little
    (:data:`REUSE_SHARE`), where the model projects every position onto the vocabulary or its cache would not
    keep every position (a sliding window shorter than the prompts), or where the keys and values do not fit
    ``budget``: the batched forwards then run."""
    model, k = runner.model, len(answer)
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    # each prompt keeps at least its last token, whose logits predict the answer's first
    from_reference = [min(_common_prefix(p, reference), len(p) - 1) for p in prompts]
    link = [0] * len(prompts)  # what each prompt shares with the one before it in that order
    for before, i in zip(order, order[1:]):
        link[i] = min(_common_prefix(prompts[before], prompts[i]), len(prompts[i]) - 1)
    if (sum(max(r, p) for r, p in zip(from_reference, link, strict=True)) < REUSE_SHARE * sum(map(len, prompts))
            or not keeps_logits(model)):
        return None
    dims = model_dims(model)
    config = model.config
    heads = int(getattr(config, "num_attention_heads", 0) or dims.heads)
    kv_row = 2 * dims.layers * dims.hidden * int(getattr(config, "num_key_value_heads", None) or heads) // heads
    length = max(len(p) for p in prompts) + k  # the most positions a cache holds
    # every layer's keys and values per position, beside a forward with fused attention and no graph per prompt
    per_prompt = kv_row * length * dims.itemsize + pass_row_bytes(dims, length, FUSED_FORWARD)
    held_bytes = kv_row * (len(reference) + length) * dims.itemsize  # the reference's beginning, the last group's
    size = _prompts_per_cached_forward(runner.device, max(0, budget - held_bytes) // per_prompt, batch_size)
    probe = _plain_cache(model, length)  # None where the model's cache would drop positions
    if size < 1 or probe is None:
        return None
    # in sorted order, what a group's prompts all share with the last prompt before the group is the least of
    # their links (the longest common beginning of sorted sequences is the least of their neighbours')
    groups = [order[g:g + size] for g in range(0, len(order), size)]
    plans = []
    for g, group in enumerate(groups):
        ref_start = min(from_reference[i] for i in group)
        prev_start = min(link[i] for i in group) if g else 0
        plans.append((ref_start, True) if ref_start >= prev_start else (prev_start, False))
    top = max((start for start, from_ref in plans if from_ref), default=0)
    device = runner.device
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    if top:  # the reference's beginning, on the cache already built
        model(input_ids=torch.as_tensor([list(reference[:top])], device=device),
              position_ids=torch.arange(top, device=device)[None], past_key_values=probe, use_cache=True,
              logits_to_keep=1)
        held = [(layer.keys, layer.values) for layer in probe.layers]  # (1, heads, top, head size) each
    out = np.zeros(len(prompts), dtype=np.float64)
    previous: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group, (start, from_ref) in zip(groups, plans, strict=True):
        rests = [[*prompts[i][start:], *answer] for i in group]
        width = max(map(len, rests))
        # left-padded after the shared beginning, so every row's answer ends the forward
        ids = torch.full((len(group), width), int(runner.pad_id), dtype=torch.long)
        seen = torch.ones((len(group), start + width), dtype=torch.long)
        positions = torch.full((len(group), width), start, dtype=torch.long)
        for b, rest in enumerate(rests):
            pad = width - len(rest)
            ids[b, pad:] = torch.as_tensor(rest)
            seen[b, start:start + pad] = 0
            positions[b, pad:] = torch.arange(start, start + len(rest))
        cache = _plain_cache(model, length)
        for index, (keys, values) in enumerate((held if from_ref else previous) if start else ()):
            cache.update(keys[:, :, :start].expand(len(group), -1, -1, -1),
                         values[:, :, :start].expand(len(group), -1, -1, -1), index)
        logits = model(input_ids=ids.to(device), position_ids=positions.to(device),
                       attention_mask=seen.to(device), past_key_values=cache, use_cache=True,
                       logits_to_keep=k + 1).logits
        out[group] = answer_logprob(runner, logits, answer).double().cpu().numpy()
        last = len(group) - 1
        keep = torch.cat([torch.arange(start), torch.arange(start + width - len(rests[last]), start + width)])
        keep = keep.to(device)  # the last prompt's own positions, then the answer's
        previous = [(layer.keys[last:].index_select(2, keep), layer.values[last:].index_select(2, keep))
                    for layer in cache.layers]
        if progress is not None:
            progress(len(group))
    return out


def _prompts_per_cached_forward(device: torch.device, fit: int, batch_size: int) -> int:
    """How many prompts run in one forward on a shared cache. One on a CPU, whose few cores one prompt's tokens
    already keep busy: a larger group would also run the tokens between the beginning its prompts all share and
    each one's own. On an accelerator as many as ``fit`` (the budget's) up to ``batch_size``: the group's
    forward then launches as many kernels as the batched forwards do, on fewer tokens."""
    return min(1, fit) if device.type == "cpu" else min(fit, batch_size)


def _plain_cache(model: nn.Module, length: int) -> Any:
    """An empty key/value cache for ``model`` whose layers keep every one of ``length`` positions
    (``transformers.DynamicCache`` of ``DynamicLayer`` s, or of sliding-window layers whose window is longer), or
    ``None`` where they would not (a sliding window drops early positions, so a cache cannot be cut back to a
    beginning) or the cache is of another kind."""
    try:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    except (ImportError, TypeError, ValueError):
        return None

    def keeps_all(layer: Any) -> bool:
        kind = type(layer).__name__
        return kind == "DynamicLayer" or (kind == "DynamicSlidingWindowLayer"
                                          and int(getattr(layer, "sliding_window", 0) or 0) > length + 1)

    layers = getattr(cache, "layers", None)
    return cache if layers and all(keeps_all(layer) for layer in layers) else None


def _batched_logprobs(runner: ModelRunner, prompts: Sequence[Sequence[int]], answer: list[int],
                      masks: Sequence[Sequence[int] | None] | None, budget: int, batch_size: int,
                      progress: Any) -> np.ndarray:
    """:func:`answer_logprobs` in left-padded, length-sorted batches that fit ``budget``."""
    k = len(answer)
    dims = model_dims(runner.model)
    keeps = keeps_logits(runner.model)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = np.zeros(len(prompts), dtype=np.float64)
    first = 0
    while first < len(order):
        n = len(prompts[order[min(first + batch_size, len(order)) - 1]]) + k
        # a forward without attention maps or gradients holds about a third of what a shared pass does
        fit = max(1, int(budget // max(1, shared_pass_row_bytes(dims, n) // 3)))
        idx = order[first: first + min(batch_size, fit)]
        width = max(len(prompts[i]) for i in idx) + k
        ids = torch.full((len(idx), width), int(runner.pad_id), dtype=torch.long)
        attention = torch.zeros((len(idx), width), dtype=torch.long)
        for b, i in enumerate(idx):
            seq = list(prompts[i]) + answer
            ids[b, width - len(seq):] = torch.as_tensor(seq)
            hidden = [1] * len(seq) if masks is None or masks[i] is None else list(masks[i]) + [1] * k
            attention[b, width - len(seq):] = torch.as_tensor(hidden)
        real = torch.zeros_like(attention)
        for b, i in enumerate(idx):
            real[b, width - len(prompts[i]) - k:] = 1
        positions = (torch.cumsum(real, 1) - 1).clamp_min(0)  # a hidden token keeps its position
        logits = runner.model(input_ids=ids.to(runner.device), attention_mask=attention.to(runner.device),
                              position_ids=positions.to(runner.device),
                              **({"logits_to_keep": k + 1} if keeps else {})).logits
        out[idx] = answer_logprob(runner, logits, answer).double().cpu().numpy()
        first += len(idx)
        if progress is not None:
            progress(len(idx))
    return out
