"""The bodies of the API's requests, checked into records; every mistake is one :class:`InputError` line that the
routes answer with status 400 (nothing is computed)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import InputError

TARGET_KINDS = ("logit", "probability", "loss")
FAITHFULNESS_METRICS = ("aopc", "comprehensiveness", "sufficiency")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (``attnlens serve --max-chars/--max-texts``)."""

    max_chars: int = 20_000  # characters per text (a pair: both parts together)
    max_texts: int = 32
    max_new_tokens: int = 64
    max_body: int = 2_000_000  # bytes of a request body


@dataclass(frozen=True)
class ExplainRequest:
    """``POST /api/explain``: what ``attnlens explain --format json`` takes, as JSON."""

    model: str
    texts: tuple[Any, ...]
    methods: Any = "all"
    target: Any = None
    token: Any = None
    target_kind: str = "logit"
    contrast: Any = None
    words: bool = False
    options: Any = None

    def key(self, kind: str = "explain") -> str:
        """The cache key: the same request, whatever the order of its JSON keys, computes once."""
        return kind + ":" + json.dumps(asdict(self), sort_keys=True, default=list)


@dataclass(frozen=True)
class GenerateRequest:
    """``POST /api/generate``: the options of ``attnlens explain --generate``."""

    model: str
    prompt: str
    methods: Any = "all"
    max_new_tokens: int = 8
    target: str | None = None
    contrast: str | None = None
    chat: bool = False
    target_kind: str = "logit"
    options: Any = None

    def key(self) -> str:
        return "generate:" + json.dumps(asdict(self), sort_keys=True, default=list)


@dataclass(frozen=True)
class AttributeRequest:
    """``POST /api/attribute``: the options of ``attnlens cite`` (which sources of a context an answer came from)."""

    model: str
    context: str
    query: str
    answer: str | None = None
    sources: str = "sentence"
    methods: Any = None
    max_new_tokens: int = 64
    tokens: bool = False
    options: Any = None

    def key(self) -> str:
        return "attribute:" + json.dumps(asdict(self), sort_keys=True, default=list)


@dataclass(frozen=True)
class AnswerRequest:
    """``POST /api/answer``: :meth:`Explainer.explain_answer` on token ids (a stretch of a generation as one
    answer)."""

    model: str
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    methods: Any = "all"
    target_kind: str = "logit"
    options: Any = None

    def key(self) -> str:
        return "answer:" + json.dumps(asdict(self), sort_keys=True, default=list)


SOURCE_KINDS = ("sentence", "passage", "line")


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InputError("the request body must be a JSON object")
    return body


def _known(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InputError(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(sorted(allowed))}")


def model_name(body: dict[str, Any], served: list[str]) -> str:
    """The requested model among those served; optional when one is served."""
    name = body.get("model")
    if name is None:
        if len(served) == 1:
            return served[0]
        raise InputError(f"several models are served: name one as \"model\" ({', '.join(served)})")
    if name not in served:  # never a path: only the names given on the command line
        raise InputError(f"model {str(name)[:80]!r} is not served here; choose one of {', '.join(served)}")
    return str(name)


def _text(value: Any, where: str, limits: Limits, pair: bool = True) -> Any:
    """``value`` checked as one text, or (``pair``) a ``[text_a, text_b]`` pair, within the server's limits."""
    if isinstance(value, str):
        parts: tuple[str, ...] = (value,)
    elif pair and isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        parts = tuple(value)
    elif pair:
        raise InputError(f"{where} must be a text or a pair [text_a, text_b] of texts")
    else:
        raise InputError(f"{where} must be one text" + (" (it is missing)" if value is None else ""))
    if not any(p.strip() for p in parts):
        raise InputError(f"{where} is empty")
    size = sum(len(p) for p in parts)
    if size > limits.max_chars:
        raise InputError(f"{where} has {size} characters; this server takes at most {limits.max_chars} per text")
    return parts[0] if len(parts) == 1 else parts


def _methods(value: Any) -> Any:
    if value is None or value == "all":
        return "all"
    if isinstance(value, str):
        value = [m.strip() for m in value.split(",") if m.strip()]
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise InputError('"methods" must be "all" or a non-empty list of method ids')
    return tuple(value)


def _hashable(value: Any) -> Any:
    """JSON lists as tuples (a QA span, a (token, label) pair); anything else as it is."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if value is not None and not isinstance(value, (str, int, float)):
        raise InputError(f"a target must be a class index, a label, or a list of them, got {json.dumps(value)[:60]}")
    return value


def _options(value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise InputError('"options" must map method ids to their options, e.g. {"transatt": {"start_layer": 2}}')
    return json.dumps(value, sort_keys=True)  # a hashable canonical form; read back by the computations


def _kind(value: Any) -> str:
    if value not in TARGET_KINDS:
        raise InputError(f'"target_kind" must be one of {", ".join(TARGET_KINDS)}')
    return str(value)


def explain_request(body: Any, served: list[str], limits: Limits) -> ExplainRequest:
    """Check an explain (or faithfulness) body."""
    body = _object(body)
    _known(body, {"model", "texts", "methods", "target", "token", "target_kind", "contrast", "words", "options",
                  "metrics"})
    texts = body.get("texts")
    if not isinstance(texts, list) or not texts:
        raise InputError('"texts" must be a non-empty list of texts (or [text_a, text_b] pairs)')
    if len(texts) > limits.max_texts:
        raise InputError(f'"texts" has {len(texts)} texts; this server takes at most {limits.max_texts} per request')
    words = body.get("words", False)
    if not isinstance(words, bool):
        raise InputError('"words" must be true or false')
    token = body.get("token")
    if token is not None and (isinstance(token, bool) or not isinstance(token, (int, str))):
        raise InputError('"token" must be a token position or a word of the input')
    contrast = body.get("contrast")
    if contrast is not None and (isinstance(contrast, bool) or not isinstance(contrast, (int, str))):
        raise InputError('"contrast" must be a class index or a label name')
    return ExplainRequest(
        model=model_name(body, served), texts=tuple(_text(t, f"texts[{i}]", limits) for i, t in enumerate(texts)),
        methods=_methods(body.get("methods")), target=_hashable(body.get("target")), token=token,
        target_kind=_kind(body.get("target_kind", "logit")), contrast=contrast, words=words,
        options=_options(body.get("options")),
    )


def faithfulness_metrics(body: Any) -> tuple[str, ...]:
    """The metrics a faithfulness body asks for (default: all three)."""
    metrics = body.get("metrics", list(FAITHFULNESS_METRICS)) if isinstance(body, dict) else None
    if (not isinstance(metrics, list) or not metrics
            or not all(isinstance(m, str) and m in FAITHFULNESS_METRICS for m in metrics)):
        raise InputError(f'"metrics" must be a non-empty list among {", ".join(FAITHFULNESS_METRICS)}')
    return tuple(dict.fromkeys(metrics))


def generate_request(body: Any, served: list[str], limits: Limits) -> GenerateRequest:
    """Check a generation body."""
    body = _object(body)
    _known(body, {"model", "prompt", "methods", "max_new_tokens", "target", "contrast", "chat", "target_kind",
                  "options"})
    prompt = _text(body.get("prompt"), '"prompt"', limits, pair=False)
    n = body.get("max_new_tokens", 8)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.max_new_tokens:
        raise InputError(f'"max_new_tokens" must be a whole number from 1 to {limits.max_new_tokens}')
    for name in ("target", "contrast"):
        value = body.get(name)
        if value is not None and (not isinstance(value, str) or not value or len(value) > limits.max_chars):
            raise InputError(f'"{name}" must be a non-empty text (the continuation to force / to contrast with)')
    chat = body.get("chat", False)
    if not isinstance(chat, bool):
        raise InputError('"chat" must be true or false')
    return GenerateRequest(
        model=model_name(body, served), prompt=prompt, methods=_methods(body.get("methods")), max_new_tokens=n,
        target=body.get("target"), contrast=body.get("contrast"), chat=chat,
        target_kind=_kind(body.get("target_kind", "logit")), options=_options(body.get("options")),
    )


def _ids(value: Any, name: str, most: int) -> tuple[int, ...]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)):
        raise InputError(f'"{name}" must be a non-empty list of token ids (whole numbers from 0)')
    if len(value) > most:
        raise InputError(f'"{name}" has {len(value)} token ids; this server takes at most {most}')
    return tuple(value)


def answer_request(body: Any, served: list[str], limits: Limits) -> AnswerRequest:
    """Check an answer body: the prompt's token ids at most ``max_chars`` (a token spells at least one
    character), the answer's at most ``max_new_tokens`` (what a generation here can hold)."""
    body = _object(body)
    _known(body, {"model", "prompt_ids", "answer_ids", "methods", "target_kind", "options"})
    return AnswerRequest(
        model=model_name(body, served), prompt_ids=_ids(body.get("prompt_ids"), "prompt_ids", limits.max_chars),
        answer_ids=_ids(body.get("answer_ids"), "answer_ids", limits.max_new_tokens),
        methods=_methods(body.get("methods")), target_kind=_kind(body.get("target_kind", "logit")),
        options=_options(body.get("options")),
    )


def attention_request(body: Any, served: list[str], limits: Limits) -> tuple[str, Any]:
    """``POST /api/attention``: ``(model, text)``."""
    body = _object(body)
    _known(body, {"model", "text"})
    return model_name(body, served), _text(body.get("text"), '"text"', limits)


def attribute_request(body: Any, served: list[str], limits: Limits) -> AttributeRequest:
    """Check a context-attribution body."""
    body = _object(body)
    _known(body, {"model", "context", "query", "answer", "sources", "methods", "max_new_tokens", "tokens",
                  "options"})
    context = _text(body.get("context"), '"context"', limits, pair=False)
    query = _text(body.get("query"), '"query"', limits, pair=False)
    answer = body.get("answer")
    if answer is not None:
        answer = _text(answer, '"answer"', limits, pair=False)
    sources = body.get("sources", "sentence")
    if sources not in SOURCE_KINDS:
        raise InputError(f'"sources" must be one of {", ".join(SOURCE_KINDS)}')
    n = body.get("max_new_tokens", 64)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.max_new_tokens:
        raise InputError(f'"max_new_tokens" must be a whole number from 1 to {limits.max_new_tokens}')
    tokens = body.get("tokens", False)
    if not isinstance(tokens, bool):
        raise InputError('"tokens" must be true or false')
    methods = body.get("methods")
    return AttributeRequest(model=model_name(body, served), context=context, query=query, answer=answer,
                            sources=sources, methods=None if methods is None else _methods(methods),
                            max_new_tokens=n, tokens=tokens, options=_options(body.get("options")))
