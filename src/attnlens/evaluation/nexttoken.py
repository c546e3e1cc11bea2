"""Faithfulness of explanations of a language model's next token: the classifier metrics (AOPC, LOdds, ...) with
a token's probability as the tracked score.

Each example is a prompt built from a template (``"Review: {text}\\nSentiment (positive or negative):"``) whose
``{text}`` part is perturbed; the template's own tokens are never taken out (deleting "Sentiment" would test
the template, not the explanation). Two kinds of targets:

- **choices** (zero-shot classification): the model's choice among a few continuations (``" negative"``,
  ``" positive"``) at the unperturbed prompt is explained; with two choices as the contrast target − other
  (the logit difference, i.e. the log-odds of the two-way choice). The tracked probability is the chosen token's
  probability renormalised over the choices, so p(ŷ) is exactly a zero-shot classifier's.
- **answer** (factual prompts): the first token of a given answer (``" Paris"``) is explained (its logit) and
  its probability over the whole vocabulary is tracked, whether or not the model ranks it first.

Explanations come from :meth:`Explainer.explain` (the language model's head reads the last position, so an
example is the first generation step), perturbations and metrics from :mod:`.perturb` / :mod:`.metrics`
unchanged: each distinct perturbed prompt is scored once, in length-sorted batches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core.batching import predict_batches
from ..core.encoding import continuation_encoding
from ..core.memory import DEFAULT_BUDGET
from ..errors import InputError, ModelError
from ..results.explanation import Explanation
from .metrics import EvalConfig, Item, mean_or_none, resolve_metrics, score_examples
from .perturb import Variant

TEXT = "{text}"
NORMALIZE = ("vocab", "choices")


@dataclass(frozen=True)
class PromptExample:
    """One prompt: ``text`` fills the template's ``{text}``; ``answer`` is the continuation whose first token is
    explained (``None`` for a choices task, where the model's choice is); ``label``: the gold choice's index, for
    the accuracy of a choices task."""

    id: str
    text: str
    answer: str | None = None
    label: int | None = None


class NextTokenPredictor:
    """Probabilities of ``tokens`` as the next token after each variant (a :data:`~.perturb.Predict`).

    The prediction is read at each variant's last attended position (variants are right-padded; only those
    positions are projected onto the vocabulary where the model allows). ``normalize``:
    ``"vocab"`` the softmax over the whole vocabulary, ``"choices"`` the softmax over ``tokens`` only (a
    zero-shot classifier's probabilities). No gradients; SDPA attention while scoring; batches of at most
    ``batch_size`` within ``memory_budget`` bytes.
    """

    def __init__(self, model: torch.nn.Module, pad_token_id: int, tokens: Sequence[int], normalize: str = "vocab",
                 batch_size: int = 32, memory_budget: int = DEFAULT_BUDGET) -> None:
        if normalize not in NORMALIZE:
            raise InputError(f"normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
        self.model, self.pad_token_id, self.batch_size = model, int(pad_token_id), int(batch_size)
        self.memory_budget = memory_budget
        self.tokens = torch.as_tensor([int(t) for t in tokens], dtype=torch.long)
        self.normalize = normalize

    def _probabilities(self, logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rows = logits.float()  # (B, V): each variant's last real position (predict_batches' last_only)
        tokens = self.tokens.to(rows.device)
        if self.normalize == "choices":
            return rows[:, tokens].softmax(-1)
        return rows.softmax(-1)[:, tokens]

    def __call__(self, variants: Sequence[Variant]) -> np.ndarray:
        """``(len(variants), len(tokens))`` probabilities in input order."""
        if any(len(v) == 0 for v in variants):
            raise InputError("a perturbed prompt is empty: the template must keep at least one token")
        return predict_batches(self.model, [v.input_ids for v in variants], self.pad_token_id, self.batch_size,
                               masks=[v.attention_mask for v in variants], probabilities=self._probabilities,
                               last_only=True, memory_budget=self.memory_budget)


def first_token(tokenizer: Any, text: str) -> int:
    """The id of the first token of ``text`` tokenized as a continuation (no special tokens)."""
    ids = continuation_encoding(tokenizer, text)[0]
    if not ids:
        raise InputError(f"{text!r} tokenizes to nothing; give a continuation with at least one token")
    return int(ids[0])


def fill(template: str, text: str) -> tuple[str, tuple[int, int]]:
    """The prompt and the character span of ``text`` in it."""
    if template.count(TEXT) != 1:
        raise InputError(f"the template must contain {TEXT} exactly once, got {template!r}")
    start = template.index(TEXT)
    return template[:start] + text + template[start + len(TEXT):], (start, start + len(text))


def frame_only(exp: Explanation, span: tuple[int, int]) -> Explanation:
    """``exp`` with every token outside ``span`` (the template's) flagged special, so never ranked or perturbed."""
    if exp.offsets is None:
        raise ModelError("the next-token benchmark needs a fast tokenizer (token offsets) to find the template")
    lo, hi = span
    inside = [s < hi and e > lo for s, e in exp.offsets]
    return dataclasses.replace(exp, special=[sp or not ins for sp, ins in zip(exp.special, inside)])


def _for_methods(explain: dict[str, Any], methods: list[str]) -> dict[str, Any]:
    """``explain``'s arguments for a call with only ``methods`` (and only their options)."""
    options = {m: o for m, o in (explain.get("options") or {}).items() if m in methods}
    return {**explain, "methods": methods, "options": options or None}


def run_next_token_benchmark(
    explainer: Any,
    examples: Sequence[PromptExample],
    *,
    template: str = TEXT,
    choices: Sequence[str] | None = None,
    methods: str | Sequence[str] = "all",
    metrics: str | Sequence[str] = ("aopc", "lodds"),
    config: EvalConfig | None = None,
    batch_size: int = 8,
    eval_batch_size: int = 32,
    options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """AOPC / LOdds (or other level metrics) of each method on a language model's next token.

    Args:
        explainer: an :class:`~attnlens.Explainer` of a causal language model.
        examples: the prompts (each with an ``answer`` unless ``choices`` are given).
        template: the prompt around each example's text, with ``{text}`` once; its tokens are never perturbed.
        choices: continuations of a zero-shot classifier (e.g. ``[" negative", " positive"]``): the model's
            choice is explained (contrast: the other choice when there are two).
        methods, metrics: as for :func:`~attnlens.evaluation.run_benchmark` (``kendall``, ``consistency`` and
            ``precision_at_k`` do not apply).
        config: metric settings; ``pad_token_id`` defaults to the explainer's (LOdds replaces tokens by it).
        batch_size: prompts per explanation batch. eval_batch_size: perturbed prompts per forward pass.
        options: per-method options (e.g. ``{"integratedgradients": {"n_steps": 20}}``).

    Returns:
        ``{"n", "methods": {method: {metric: mean}}, "examples": [{"id", "target", "p", "correct", method:
        {metric: value}}], "accuracy", "template", "choices"}``; ``correct``: the model's choice is the gold label
        (choices) or the answer's first token is the model's top next token (answers).
    """
    from ..methods.registry import get_method, resolve_methods
    from .runner import _applicable_methods

    if getattr(getattr(explainer, "head", None), "task", None) != "causal-lm":
        raise InputError("the next-token benchmark needs a causal language model (…ForCausalLM)")
    if not examples:
        raise InputError("no examples to benchmark")
    metric_ids = resolve_metrics(metrics)
    bad = [m for m in metric_ids if m in ("kendall", "consistency", "precision_at_k")]
    if bad:
        raise InputError(f"{', '.join(bad)} do not apply to next-token targets; use aopc, lodds, comprehensiveness "
                         "or sufficiency")
    method_ids = _applicable_methods(methods, explainer, resolve_methods)  # "all": those that apply to LMs
    if config is None or config.pad_token_id is None:
        config = dataclasses.replace(config or EvalConfig(), pad_token_id=int(explainer.pad_id))
    tokenizer, model = explainer.tokenizer, explainer.model
    prompts = [fill(template, e.text) for e in examples]
    texts = [p for p, _ in prompts]
    explain = dict(methods=method_ids, batch_size=batch_size, options=options)

    if choices is not None:
        choice_ids = [first_token(tokenizer, c) for c in choices]
        if len(set(choice_ids)) != len(choice_ids) or len(choice_ids) < 2:
            raise InputError(f"choices must start with at least two different tokens, got {list(choices)!r}")
        predictor = NextTokenPredictor(model, config.pad_token_id, choice_ids, "choices", eval_batch_size)
        base = predictor([Variant.of(explainer.encode([t])[0].ids) for t in texts])
        chosen = base.argmax(1)
        exps: list[Explanation | None] = [None] * len(texts)
        for c, token in enumerate(choice_ids):  # one explain call per chosen class (contrast: the other one)
            idx = [i for i in range(len(texts)) if chosen[i] == c]
            if not idx:
                continue
            contrast = choice_ids[1 - c] if len(choice_ids) == 2 else None
            chosen_texts = [texts[i] for i in idx]
            # target-free methods (raw attention, rollout, flow, value zeroing) give the same scores whatever
            # is explained: they run without the contrast, which does not apply to them, and join the others
            free = [m for m in method_ids if contrast is not None and not get_method(m).class_specific]
            specific = [m for m in method_ids if m not in free]
            parts = explainer.explain(chosen_texts, target=[token] * len(idx), contrast=contrast,
                                      **_for_methods(explain, specific)) if specific else [None] * len(idx)
            plain = explainer.explain(chosen_texts, target=[token] * len(idx), **_for_methods(explain, free)) \
                if free else [None] * len(idx)
            for i, e, f in zip(idx, parts, plain, strict=True):
                if e is None:
                    e = f
                elif f is not None:
                    e.scores.update(f.scores)
                    e.layers.update(f.layers)
                exps[i] = e
        groups = [(predictor, list(range(len(texts))))]
        targets = [choice_ids[c] for c in chosen]
        correct = [e.label is not None and int(c) == e.label for e, c in zip(examples, chosen)]
    else:
        if any(e.answer is None for e in examples):
            raise InputError("every example needs an answer (or give choices)")
        targets = [first_token(tokenizer, e.answer) for e in examples]
        exps = list(explainer.explain(texts, target=targets, **explain))
        # one predictor per answer token: a variant's probabilities are of that example's answer
        groups = [(NextTokenPredictor(model, config.pad_token_id, [t], "vocab", eval_batch_size),
                   [i for i in range(len(texts)) if targets[i] == t]) for t in dict.fromkeys(targets)]
        correct = [int(e.predicted) == t for e, t in zip(exps, targets)]

    rows: list[dict[str, Any]] = [{} for _ in examples]
    for predictor, idx in groups:
        items = [Item(frame_only(exps[i], prompts[i][1]), None, i) for i in idx]
        cache: dict[Variant, np.ndarray] = {}
        scored = score_examples(items, method_ids, metric_ids, predictor, config, cache=cache)
        for i, it, res in zip(idx, items, scored):
            p = cache[it.base]
            rows[i] = {"id": examples[i].id, "target": tokenizer.decode([targets[i]]),
                       "p": float(p.max() if choices is not None else p[0]), "correct": correct[i],
                       **{m: {k: r.value for k, r in res.methods[m].items()} for m in method_ids}}
    summary = {m: {k: mean_or_none([r[m][k] for r in rows]) for k in metric_ids} for m in method_ids}
    return {"n": len(examples), "methods": summary, "examples": rows, "accuracy": float(np.mean(correct)),
            "template": template, "choices": list(choices) if choices is not None else None}


__all__ = ["NextTokenPredictor", "PromptExample", "run_next_token_benchmark"]
