"""Sources of a context: the units an answer is attributed to, as character spans of the context.

``"sentence"`` splits with pysbd (rule-based sentence boundary detection, no model download) inside each
blank-line-separated block, so a sentence never crosses a paragraph; ``"passage"`` is the blank-line-separated
blocks; ``"line"`` the non-empty lines; or the caller gives the sources, as ``(start, end)`` spans or as strings
found in the context in order. Spans exclude surrounding whitespace and never overlap.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from ..data import LINE_BREAK
from ..errors import InputError
from ..results.context_attribution import Source

__all__ = ["MODES", "Source", "split_sources"]

MODES = ("sentence", "passage", "line")
# a passage ends at a line that holds only whitespace
_PASSAGE = rf"{LINE_BREAK}\s*{LINE_BREAK}"


def _trimmed(context: str, start: int, end: int) -> Source | None:
    while start < end and context[start].isspace():
        start += 1
    while end > start and context[end - 1].isspace():
        end -= 1
    return Source(context[start:end], start, end) if end > start else None


def _blocks(context: str, pattern: str) -> list[Source]:
    found, start = [], 0
    for m in re.finditer(pattern, context):
        found.append(_trimmed(context, start, m.start()))
        start = m.end()
    found.append(_trimmed(context, start, len(context)))
    return [s for s in found if s is not None]


@lru_cache(maxsize=1)
def _segmenter() -> Any:
    import pysbd

    return pysbd.Segmenter(language="en", clean=False, char_span=True)


# punctuation that closes what precedes it: terminal marks, closing brackets and quotes (not opening ones)
_CLOSING = ("Po", "Pe", "Pf")


def _past_closing_punctuation(text: str, start: int) -> int:
    """``start`` moved past the closing punctuation written right after the sentence before it (no space
    between): pysbd ends ``"He said no.?!"`` after ``"no."`` and begins the next sentence at ``"?!"``."""
    while 0 < start < len(text) and not text[start - 1].isspace() and unicodedata.category(text[start]) in _CLOSING:
        start += 1
    return start


def _sentences(context: str) -> list[Source]:
    """pysbd's sentences of each block, each running to where the next begins (the last to the block's end), so
    every character of the context but whitespace is in one; closing punctuation that pysbd leaves out of a
    sentence (``"He said no.?!"``: ``"?!"``) stays in it, instead of beginning the next one."""
    out: list[Source] = []
    for block in _blocks(context, _PASSAGE):
        found = {_past_closing_punctuation(block.text, span.start) for span in _segmenter().segment(block.text)}
        starts = sorted({start for start in found if start < len(block.text)} | {0})
        for start, end in zip(starts, [*starts[1:], len(block.text)]):
            s = _trimmed(context, block.start + start, block.start + end)
            if s is not None:
                out.append(s)
    return out


def split_sources(context: str, sources: str | Sequence[Any] = "sentence") -> list[Source]:
    """The sources of ``context``: a mode (``"sentence"``, ``"passage"``, ``"line"``) or the caller's own list of
    ``(start, end)`` character spans or of strings (each found in the context after the previous one).

    Raises :class:`InputError` for an empty context, an unknown mode, spans outside the context, empty or
    overlapping spans, and strings not found in order."""
    if not isinstance(context, str) or not context.strip():
        raise InputError("the context is empty: give the text the answer should be attributed to")
    if isinstance(sources, str):
        if sources == "sentence":
            found = _sentences(context)
        elif sources == "passage":
            found = _blocks(context, _PASSAGE)
        elif sources == "line":
            found = _blocks(context, LINE_BREAK)
        else:
            raise InputError(f"sources={sources!r}; choose one of {', '.join(MODES)}, or give a list of spans or "
                             "strings")
        return found
    if hasattr(sources, "tolist") and not isinstance(sources, Sequence):  # a NumPy array (or tensor) of spans
        sources = sources.tolist()
    if not isinstance(sources, Sequence) or not sources:
        raise InputError("sources must be a mode or a non-empty list of (start, end) spans or strings")
    if all(isinstance(s, str) for s in sources):
        out, at = [], 0
        for i, text in enumerate(sources):
            if not text.strip():
                raise InputError(f"source {i} is empty")
            where = context.find(text, at)
            if where < 0:
                raise InputError(f"source {i} ({text[:40]!r}) is not in the context (after source {i - 1})"
                                 if i else f"source 0 ({text[:40]!r}) is not in the context")
            out.append(Source(text, where, where + len(text)))
            at = where + len(text)
        return out
    spans = []
    for i, s in enumerate(sources):
        if (not isinstance(s, Sequence | np.ndarray) or isinstance(s, str) or len(s) != 2
                or not all(isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) for v in s)):
            raise InputError(f"source {i} must be a (start, end) pair of character offsets, got {s!r:.60}")
        start, end = int(s[0]), int(s[1])
        if not 0 <= start < end <= len(context):
            raise InputError(f"source {i} ({start}, {end}) is outside the context (0..{len(context)}) or empty")
        if not context[start:end].strip():
            raise InputError(f"source {i} ({start}, {end}) is whitespace only")
        spans.append((start, end, i))
    spans.sort()
    for (_, end_a, i), (start_b, _, j) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise InputError(f"sources {i} and {j} overlap")
    spans.sort(key=lambda span: span[2])  # the caller's order
    return [Source(context[start:end], start, end) for start, end, _ in spans]
