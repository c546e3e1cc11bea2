"""What the server computes, as plain functions of a loaded :class:`~attnlens.Explainer` and a checked request:
the JSON they return is the library's own (``explanations_json``, ``Generation.to_dict``, the head view's
``encode_attentions``), so a script gets what ``attnlens explain --format json`` writes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InputError
from ..evaluation.metrics import EvalConfig, Item, score_examples
from ..evaluation.perturb import ModelPredictor
from ..methods.registry import get_method, list_methods
from ..results.explanation import Explanation, explanations_json
from ..results.tokentext import encoding_meta, token_texts
from ..sources.attribute import defaults_for
from ..sources.methods import SOURCE_METHODS
from ..viz.headview import encode_attentions, page_bytes
from .benchmarks import model_source
from .requests import AnswerRequest, AttributeRequest, ExplainRequest, GenerateRequest

Report = Callable[[float], None]
THUMBNAIL = 48  # cells per side of a model-view thumbnail (block maxima of the attention matrix)
LANGUAGE_MODELS = ("causal-lm", "seq2seq-lm")


def model_facts(name: str, ex: Any) -> dict[str, Any]:
    """What the page needs to offer a model: its task, labels, and which methods apply (with the reason when not)."""
    methods = []
    for m in list_methods():
        spec = get_method(m)
        methods.append({"id": m, "summary": spec.summary, "class_specific": spec.class_specific,
                        "unsupported": spec.unsupported(ex.model, ex.stream, ex.head.task)})
    return {"name": name, "source": model_source(str(ex.name)), "task": ex.head.task, "kind": ex.head.kind,
            "labels": ex.labels,
            "language_model": ex.head.task in LANGUAGE_MODELS, "max_length": ex.max_length,
            "token_encoding": encoding_meta(ex.tokenizer).get("token_encoding"), "methods": methods,
            "source_methods": list(SOURCE_METHODS), "source_defaults": defaults_for(ex.model),
            "source_summaries": {m: spec.summary for m, spec in SOURCE_METHODS.items()}}


def _options(req: Any) -> dict[str, Any] | None:
    return None if req.options is None else json.loads(req.options)


def _target(ex: Any, req: ExplainRequest) -> Any:
    """The ``target=`` of :meth:`Explainer.explain`, as ``attnlens explain`` builds it from --target/--token."""
    if ex.head.task == "token":
        if req.token is None:
            raise InputError('this is a token classifier: give the explained token as "token" (a position or a word)')
        return (req.token, req.target)
    if req.token is not None:
        raise InputError(f'"token" is for token classifiers; this model is {ex.head.kind}')
    return req.target


def explanations(ex: Any, req: ExplainRequest, report: Report, budget: int) -> list[Explanation]:
    """The explanations of a request (before any word aggregation), planned within ``budget`` bytes."""
    return ex.explain(list(req.texts), methods=req.methods if isinstance(req.methods, str) else list(req.methods),
                      target=_target(ex, req), target_kind=req.target_kind, contrast=req.contrast,
                      options=_options(req), progress=lambda fraction, _done: report(fraction),
                      memory_budget=budget)


def explain(exps: list[Explanation], req: ExplainRequest) -> list[dict[str, Any]]:
    """The answer of ``POST /api/explain``: what ``attnlens explain --format json`` writes."""
    return explanations_json([e.to_words() for e in exps] if req.words else exps)


def faithfulness(ex: Any, exps: list[Explanation], metrics: tuple[str, ...], report: Report,
                 budget: int) -> list[dict[str, Any]]:
    """Per input, each method's AOPC / comprehensiveness / sufficiency on this input and the curves they average
    (the benchmark's metrics of :mod:`attnlens.evaluation.metrics`, scoring the predicted class; the perturbed
    inputs batched within ``budget`` bytes)."""
    if ex.head.task != "classification" or any(e.is_multi_label for e in exps):
        raise InputError(f"faithfulness is measured on sequence classifiers; this model is {ex.head.kind}")
    if any(e.meta.get("contrast") is not None for e in exps):
        raise InputError("faithfulness scores one class's probability: explain without a contrast to measure it")
    config = EvalConfig(pad_token_id=ex.pad_id)
    predict = ModelPredictor(ex.model, config.pad_token_id, memory_budget=budget)
    cache: dict[Any, np.ndarray] = {}
    out = []
    steps = max(1, len(exps) * len(exps[0].methods if exps else []))
    done = 0
    for e in exps:
        item = Item(exp=e, label=None)
        per_method: dict[str, Any] = {}
        for m in e.methods:  # one method at a time: progress, and a cancelled job stops between methods
            (scores,) = score_examples([item], [m], list(metrics), predict, config, cache=cache)
            results = scores.methods[m]
            per_method[m] = {name: {"value": results[name].value, "levels": results[name].detail} for name in metrics}
            done += 1
            report(done / steps)
        out.append({"fractions": {"aopc": [k / 10 for k in range(11)],
                                  "comprehensiveness": [k / 10 for k in range(1, 11)],
                                  "sufficiency": [k / 10 for k in range(1, 11)]},
                    "methods": per_method})
    return out


def thumbnails(att: np.ndarray, size: int = THUMBNAIL) -> dict[str, Any]:
    """``(L, H, T, T)`` block maxima of each attention matrix (``T = min(N, size)``), each head scaled to its own
    maximum and quantised to 8 bits: the model view's small multiples, cheap at 512 tokens."""
    n_layers, n_heads, n, _ = att.shape
    t = min(n, size)
    edges = np.linspace(0, n, t + 1).astype(int)
    rows = np.maximum.reduceat(att, edges[:-1], axis=2)
    blocks = np.maximum.reduceat(rows, edges[:-1], axis=3)
    peak = blocks.max(axis=(2, 3), keepdims=True)
    q = np.rint(blocks / np.where(peak > 0, peak, 1.0) * 255).astype(np.uint8)
    return {"size": t, "values": q.reshape(-1).tolist()}


def attention(ex: Any, text: Any, budget: int, report: Report = lambda _fraction: None) -> dict[str, Any]:
    """The head and model views' data: tokens, the compact attention of every layer and head, thumbnails; refused
    in one line where the maps, their encoding and the answer's text would not fit ``budget`` bytes. ``report``
    hears the progress after the forward and after the encoding (a cancelled job stops there)."""
    tokens, special, att = ex.attention_maps(text, memory_budget=budget, beside=_answer_bytes)
    report(0.6)
    encoded = encode_attentions(att)
    report(0.9)
    meta = encoding_meta(ex.tokenizer)
    return {"tokens": tokens, "token_text": token_texts(tokens, meta), "special": special, "meta": meta,
            "stream": ex.stream, "attention": encoded, "thumbnails": thumbnails(att)}


def _answer_bytes(layers: int, heads: int, n: int) -> int:
    """What the attention answer holds beside the maps: their encoding and text (as a page's), and the JSON
    response's text and bytes (the text twice more)."""
    return 2 * page_bytes(layers, heads, n)


def generate(ex: Any, req: GenerateRequest, report: Report, budget: int) -> list[dict[str, Any]]:
    """What ``attnlens explain --generate --format json`` writes for one prompt (a list of one)."""
    if ex.head.task not in LANGUAGE_MODELS:
        raise InputError(f"generation needs a language model; this model is {ex.head.kind}")
    report(0.0)
    g = ex.explain_generation(req.prompt, methods=req.methods if isinstance(req.methods, str) else list(req.methods),
                              max_new_tokens=req.max_new_tokens, target=req.target, contrast=req.contrast,
                              chat=req.chat, target_kind=req.target_kind, options=_options(req),
                              memory_budget=budget, progress=lambda fraction, _done: report(fraction))
    return [g.to_dict()]


def answer(ex: Any, req: AnswerRequest, report: Report, budget: int) -> list[dict[str, Any]]:
    """``Explainer.explain_answer`` on the request's token ids: what ``attnlens explain --format json`` writes for
    one explanation (a list of one) over prompt + answer tokens, ``target`` the answer's span ``[start, end)``."""
    if ex.head.task != "causal-lm":
        raise InputError(f"explaining an answer needs a causal language model; this model is {ex.head.kind}")
    rows = ex.model.get_input_embeddings().num_embeddings
    for name, ids in (("prompt_ids", req.prompt_ids), ("answer_ids", req.answer_ids)):
        outside = next((i for i in ids if i >= rows), None)
        if outside is not None:
            raise InputError(f'"{name}" holds {outside}, which is not a token id of this model (0 to {rows - 1})')
    exp = ex.explain_answer(list(req.prompt_ids), list(req.answer_ids),
                            methods=req.methods if isinstance(req.methods, str) else list(req.methods),
                            target_kind=req.target_kind, options=_options(req),
                            progress=lambda fraction, _done: report(fraction), memory_budget=budget)
    return explanations_json([exp])


def attribute(ex: Any, req: AttributeRequest, report: Report, budget: int) -> dict[str, Any]:
    """What ``attnlens cite --format json`` writes (with ``tokens``: also the token-level scores and spans)."""
    if ex.head.task != "causal-lm":
        raise InputError(f"context attribution needs a causal language model; this model is {ex.head.kind}")
    methods = req.methods if req.methods is None or isinstance(req.methods, str) else list(req.methods)
    result = ex.attribute_context(req.context, req.query, answer=req.answer, sources=req.sources, methods=methods,
                                  max_new_tokens=req.max_new_tokens, options=_options(req), memory_budget=budget,
                                  progress=lambda fraction, _done: report(fraction))
    return result.to_dict(tokens=req.tokens)
