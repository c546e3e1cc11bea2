"""The result of attributing an answer to the sources of its context: :class:`ContextAttribution`.

Its JSON form (``to_dict``) is the contract of ``attnlens cite --format json``::

    {"context", "query", "prompt", "answer",
     "sources": [{"text", "start", "end", "scores": {method: float}}],
     "meta": {...}}

``start``/``end`` are character offsets in ``context``, which appears verbatim in ``prompt`` (at
``meta["context_start"]``); ``answer`` is exactly the continuation after ``prompt`` whose log-probability is
explained (``meta["explained"]`` gives the explained part of it when only a stretch of the answer is).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..data import text_lines
from ..errors import InputError
from ..paths import atomic_write_text, read_utf8

__all__ = ["ContextAttribution", "Source", "load_attributions"]


@dataclass(frozen=True)
class Source:
    """A source of the context: its text and character span ``[start, end)`` in the context."""

    text: str
    start: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "start": self.start, "end": self.end}


@dataclass
class ContextAttribution:
    """Which sources of a context an answer came from, by each method.

    Attributes:
        context: the context, as given.
        query: the query, as given.
        prompt: the prompt the model read (template and chat markup around context and query).
        answer: the continuation after ``prompt`` whose log-probability is explained.
        sources: the sources, in context order for a mode (``"sentence"``, ...), in the caller's order for
            spans or strings.
        scores: per method, one score per source (higher: the answer depends more on that source).
        token_scores: per token-level method, one score per prompt token (``prompt_tokens``).
        prompt_tokens: the prompt's tokens as text.
        token_offsets: each prompt token's character span in ``prompt``.
        token_source: each prompt token's source index, or -1 outside every source.
        answer_tokens: the answer's tokens as text; ``answer_offsets``: their character spans in ``answer``.
        token_rows: with ``per_token=True``, per method one row of source scores per explained answer token
            (``(len(token_row_steps), n_sources)``), each explaining that token's log-probability alone;
            ``token_row_steps``: the index in ``answer_tokens`` of each row's token; ``token_row_spans``: its
            character span of ``answer`` (the JSON's ``token_rows["spans"]``).
        meta: the model, the explained part of the answer (``explained``: a character span of ``answer``), its
            log-probability (``answer_logprob``), per method the share of the token scores outside every source
            (``outside_share``) and the seconds it took (``seconds``), and the options used.
    """

    context: str
    query: str
    prompt: str
    answer: str
    sources: list[Source]
    scores: dict[str, np.ndarray]
    token_scores: dict[str, np.ndarray] = field(default_factory=dict)
    prompt_tokens: list[str] = field(default_factory=list)
    token_offsets: list[tuple[int, int]] = field(default_factory=list)
    token_source: list[int] = field(default_factory=list)
    answer_tokens: list[str] = field(default_factory=list)
    answer_offsets: list[tuple[int, int]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    token_rows: dict[str, np.ndarray] = field(default_factory=dict)
    token_row_steps: list[int] = field(default_factory=list)
    token_row_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def methods(self) -> list[str]:
        return list(self.scores)

    def ranked(self, method: str | None = None) -> list[tuple[int, Source, float]]:
        """``(index, source, score)`` from the highest score down (``method``: default the first)."""
        method = self._method(method)
        s = self.scores[method]
        return [(int(i), self.sources[i], float(s[i])) for i in np.argsort(-s, kind="stable")]

    def top(self, k: int = 3, method: str | None = None) -> list[tuple[int, Source, float]]:
        """The ``k`` highest-scored sources."""
        return self.ranked(method)[:k]

    def _method(self, method: str | None) -> str:
        if not self.scores:
            raise InputError("this attribution holds no method's scores")
        if method is None:
            return next(iter(self.scores))
        if method not in self.scores:
            raise InputError(f"method {method!r} is not in this attribution ({', '.join(self.scores)})")
        return method

    # ------------------------------------------------------------------ output
    def to_dict(self, tokens: bool = False) -> dict[str, Any]:
        """The JSON contract (module docstring); ``tokens``: add the token-level scores and token spans."""
        out: dict[str, Any] = {
            "context": self.context,
            "query": self.query,
            "prompt": self.prompt,
            "answer": self.answer,
            "sources": [{"text": s.text, "start": s.start, "end": s.end,
                         "scores": {m: float(v[i]) for m, v in self.scores.items()}}
                        for i, s in enumerate(self.sources)],
            "meta": self.meta,
        }
        if self.token_rows:
            out["token_rows"] = {"steps": list(self.token_row_steps),
                                 "scores": {m: v.tolist() for m, v in self.token_rows.items()}}
            spans = self.row_spans
            if spans:  # each row's token as a character span of the answer
                out["token_rows"]["spans"] = [list(span) for span in spans]
        if tokens:
            out["tokens"] = {
                "prompt_token_text": self.prompt_tokens,
                "offsets": [list(o) for o in self.token_offsets],
                "source": self.token_source,
                "scores": {m: v.tolist() for m, v in self.token_scores.items()},
                "answer_token_text": self.answer_tokens,
                "answer_offsets": [list(o) for o in self.answer_offsets],
            }
        return out

    @property
    def row_spans(self) -> list[tuple[int, int]]:
        """Each per-token row's token as a character span of ``answer`` (empty without rows, or where neither the
        answer's token spans nor the rows' own are known)."""
        if self.answer_offsets:
            return [tuple(self.answer_offsets[k]) for k in self.token_row_steps]  # type: ignore[misc]
        return list(self.token_row_spans)

    def to_json(self, tokens: bool = False) -> str:
        """:meth:`to_dict` as one line of JSON (non-ASCII characters kept as they are); ``tokens`` as there
        (:meth:`save` writes them by default)."""
        return json.dumps(self.to_dict(tokens), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ContextAttribution:
        """The attribution a :meth:`to_dict` (or ``attnlens cite --format json``) dictionary describes; the
        token-level fields stay empty where it has none. :class:`~attnlens.InputError` (one line) for a
        dictionary of another kind."""
        try:
            sources = [Source(s["text"], int(s["start"]), int(s["end"])) for s in d["sources"]]
            methods = list(d["sources"][0]["scores"]) if d["sources"] else []
            scores = {m: np.array([float(s["scores"][m]) for s in d["sources"]]) for m in methods}
            t = d.get("tokens") or {}
            return cls(
                context=d["context"], query=d["query"], prompt=d["prompt"], answer=d["answer"], sources=sources,
                scores=scores, token_scores={m: np.asarray(v, dtype=float) for m, v in t.get("scores", {}).items()},
                prompt_tokens=list(t.get("prompt_token_text", [])),
                token_offsets=[tuple(o) for o in t.get("offsets", [])], token_source=list(t.get("source", [])),
                answer_tokens=list(t.get("answer_token_text", [])),
                answer_offsets=[tuple(o) for o in t.get("answer_offsets", [])], meta=dict(d.get("meta", {})),
                token_rows={m: np.asarray(v, dtype=float) for m, v in (d.get("token_rows") or {}).get(
                    "scores", {}).items()},
                token_row_steps=[int(k) for k in (d.get("token_rows") or {}).get("steps", [])],
                token_row_spans=[(int(a), int(b)) for a, b in (d.get("token_rows") or {}).get("spans", [])],
            )
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(f"not an attnlens context attribution: {err}") from None

    def save(self, path: str | os.PathLike[str], tokens: bool = True) -> None:
        """Write the JSON form (with the token-level scores unless ``tokens=False``), atomically."""
        save_attributions([self], path, tokens)

    def show(self, k: int | None = None, console: Any = None) -> None:
        """Print the answer and the sources ranked by each method (the terminal view)."""
        from ..viz.sources import print_attribution

        print_attribution(self, k=k, console=console)

    def to_html(self) -> str:
        """A standalone page: the context with its sources shaded by score, every method's score on hover."""
        from ..viz.sources import attribution_html

        return attribution_html([self])


def save_attributions(items: list[ContextAttribution], path: str | os.PathLike[str], tokens: bool = True) -> None:
    """Write attributions as JSON Lines (one per line), atomically (nothing half-written on interruption)."""
    atomic_write_text(path, "".join(a.to_json(tokens) + "\n" for a in items))


def load_attributions(path: str | os.PathLike[str]) -> list[ContextAttribution]:
    """Read attributions written by :meth:`ContextAttribution.save` or ``attnlens cite --format json``
    (a JSON object or a list of them, or JSON Lines)."""
    text = read_utf8(path, "attnlens attributions").strip()
    if not text:
        raise InputError(f"{path} holds no attributions")
    try:
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text_lines(text) if line.strip()]
        except json.JSONDecodeError as err:
            raise InputError(f"{path}: not JSON or JSON Lines ({err})") from None
    return [ContextAttribution.from_dict(d) for d in items]
