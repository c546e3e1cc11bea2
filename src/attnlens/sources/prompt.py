"""The prompt a context is asked about: a template around the context and the query, optionally through the
tokenizer's chat template, tokenized with each token's character span, so that tokens map back to sources.

The default template is ContextCite's, ``"Context: {context}\\n\\nQuery: {query}"``; the context must appear
verbatim in the prompt (its character offset there is :attr:`Prompt.context_start`).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from .segment import Source

__all__ = ["DEFAULT_TEMPLATE", "Prompt", "build_prompt", "token_sources", "with_context"]

DEFAULT_TEMPLATE = "Context: {context}\n\nQuery: {query}"


@dataclass(frozen=True)
class Prompt:
    """A tokenized prompt.

    Attributes:
        text: the prompt as the model reads it (after the chat template, if any).
        ids: its token ids.
        offsets: each token's character span ``[start, end)`` in ``text`` (``(0, 0)`` for tokens without text).
        context_start: where the context starts in ``text``.
        context_length: the context's length in characters.
        prefix: ``text`` before the context; ``suffix``: after it (template, query, chat markup).
        chat: whether the chat template was applied.
    """

    text: str
    ids: list[int]
    offsets: list[tuple[int, int]]
    context_start: int
    context_length: int
    prefix: str
    suffix: str
    chat: bool


def _render(tokenizer: Any, message: str, chat: bool) -> str:
    if not chat:
        return message
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         tokenize=False)
    return str(text)


def _tokenize(tokenizer: Any, text: str, chat: bool) -> tuple[list[int], list[tuple[int, int]]]:
    # the chat template's text already holds its special tokens; a plain prompt gets the tokenizer's (BOS)
    enc = tokenizer(text, add_special_tokens=not chat, return_offsets_mapping=True)
    return [int(i) for i in enc["input_ids"]], [(int(a), int(b)) for a, b in enc["offset_mapping"]]


def build_prompt(tokenizer: Any, context: str, query: str, template: str | None = None,
                 chat: bool = True) -> Prompt:
    """The prompt for ``context`` and ``query``: ``template`` (with ``{context}`` and ``{query}``) as one user
    message, through the chat template when ``chat``. :class:`InputError` for an empty query, a template without
    both fields, or a chat template that does not keep the context verbatim."""
    template = DEFAULT_TEMPLATE if template is None else template
    if not isinstance(template, str):
        raise InputError(f"the template must be a string with {{context}} and {{query}} once each, got "
                         f"{type(template).__name__}")
    if not isinstance(query, str) or not query.strip():
        raise InputError("the query is empty: give the question the answer responds to")
    if template.count("{context}") != 1 or template.count("{query}") != 1:
        raise InputError("the template must contain {context} and {query} once each, e.g. "
                         f"{DEFAULT_TEMPLATE!r}")
    if chat and not getattr(tokenizer, "chat_template", None):
        raise InputError("the tokenizer has no chat template: use chat=False (--no-chat) for this model")
    if not getattr(tokenizer, "is_fast", False):
        raise InputError("source attribution maps tokens to characters: it needs a fast tokenizer")
    marker = "\x00CONTEXT\x00"
    # one pass over the template: a query that holds the text "{context}" stays as it is
    fields = {"{context}": marker, "{query}": query}
    message = re.sub(r"\{context\}|\{query\}", lambda m: fields[m.group(0)], template)
    rendered = _render(tokenizer, message, chat)
    if rendered.count(marker) != 1:
        raise InputError("the chat template does not keep the context verbatim; use chat=False (--no-chat)")
    prefix, suffix = rendered.split(marker)
    return with_context(tokenizer, prefix, context, suffix, chat)


def with_context(tokenizer: Any, prefix: str, context: str, suffix: str, chat: bool) -> Prompt:
    """The prompt ``prefix + context + suffix``, tokenized (also the ablated prompts: another context)."""
    text = prefix + context + suffix
    ids, offsets = _tokenize(tokenizer, text, chat)
    return Prompt(text, ids, offsets, len(prefix), len(context), prefix, suffix, chat)


def token_sources(prompt: Prompt, sources: Sequence[Source]) -> list[int]:
    """For each prompt token, the index of the source it belongs to, or ``-1`` (template, query, special
    tokens): the source holding the token's first non-space character."""
    order = sorted(range(len(sources)), key=lambda i: sources[i].start)
    starts = [sources[i].start for i in order]
    out = []
    for a, b in prompt.offsets:
        c = a
        while c < b and prompt.text[c].isspace():
            c += 1
        k = -1
        if c < b:
            pos = c - prompt.context_start
            if 0 <= pos < prompt.context_length:
                i = bisect.bisect_right(starts, pos) - 1
                if i >= 0 and pos < sources[order[i]].end:
                    k = order[i]
        out.append(k)
    return out
