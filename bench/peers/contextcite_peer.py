"""ContextCite (Cohen-Wang et al., 2024; PyPI ``context-cite``) on given sources and a given answer.

ContextCite normally splits the context into sentences with NLTK and generates the response itself. Two
subclasses of its own extension points replace both:

- ``SpanPartitioner`` (a ``BaseContextPartitioner``) makes the examples file's spans the sources. An ablated
  context keeps the kept spans with the text between consecutive kept spans, as ContextCite's own
  ``SimpleContextPartitioner`` keeps each kept sentence's preceding separator; text outside every span (before
  the first, after the last) always stays.
- ``ForcedContextCiter`` answers ContextCite's ``_output`` (prompt + response, the text it otherwise gets from
  ``model.generate``) with the prompt + the given answer, so the ablations score that answer's tokens.
"""

from __future__ import annotations

import numpy as np
from context_cite import ContextCiter
from context_cite.context_partitioner import BaseContextPartitioner
from peer_common import Example


class SpanPartitioner(BaseContextPartitioner):
    """The examples file's character spans as ContextCite's sources."""

    def __init__(self, context: str, spans: list[tuple[int, int]]) -> None:
        super().__init__(context)
        self.spans = spans

    @property
    def num_sources(self) -> int:
        return len(self.spans)

    def split_context(self) -> None:
        """The spans are given; nothing to split."""

    def get_source(self, index: int) -> str:
        start, end = self.spans[index]
        return self.context[start:end]

    def get_context(self, mask=None) -> str:
        if mask is None:
            mask = np.ones(self.num_sources, dtype=bool)
        pieces = [self.context[: self.spans[0][0]]]
        kept_before = False
        for i, (start, end) in enumerate(self.spans):
            if not mask[i]:
                continue
            if kept_before:
                pieces.append(self.context[self.spans[i - 1][1] : start])  # the separator before this span
            pieces.append(self.context[start:end])
            kept_before = True
        pieces.append(self.context[self.spans[-1][1] :])
        return "".join(pieces)


class ForcedContextCiter(ContextCiter):
    """A ContextCiter whose response is a given answer instead of a generation."""

    def __init__(self, *args, answer: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._answer = answer

    @property
    def _output(self) -> str:
        if self._cache.get("output") is None:
            _, prompt = self._get_prompt_ids(return_prompt=True)
            self._cache["output"] = prompt + self._answer
        return self._cache["output"]

    def check_forced(self, example_id: str) -> None:
        """The tokens ContextCite scores must be the prompt's followed by the answer's (no merge at the seam)."""
        prompt_ids = self._get_prompt_ids()
        if self._output_tokens["input_ids"][: len(prompt_ids)] != prompt_ids:
            raise ValueError(f"{example_id}: the answer merges with the prompt's last token; cannot force it")
        decoded = self.tokenizer.decode(self._response_ids)
        if decoded != self._answer:
            raise ValueError(f"{example_id}: the scored response tokens decode to {decoded!r}, not the answer")


def contextcite_scores(model, tokenizer, ex: Example, num_ablations: int, batch_size: int = 8) -> np.ndarray:
    """ContextCite's scores for ``ex.answer``, one per source of ``ex`` (its LASSO weights; higher = more used)."""
    partitioner = SpanPartitioner(ex.context, [(s.start, s.end) for s in ex.sources])
    citer = ForcedContextCiter(model, tokenizer, ex.context, ex.query, answer=ex.answer, partitioner=partitioner,
                               num_ablations=num_ablations, batch_size=batch_size)
    citer.check_forced(ex.id)
    return np.asarray(citer.get_attributions(verbose=False), dtype=np.float64)

