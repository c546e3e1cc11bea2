"""``squad-context``: context-attribution examples built deterministically from SQuAD v1.1 dev.

Each example is one SQuAD question with its gold paragraph and ``k`` distractor paragraphs (from other articles,
or with ``hard=True`` from the same article), in a shuffled order, joined by blank lines; the answer is the
question's first gold answer, forced; the gold source is the gold paragraph (``sources="passage"``) or the
sentence holding the answer (``"sentence"``). Articles at even positions of the file's ``data`` list form the
``fit`` split (for fitting AT2's weights), those at odd positions the ``eval`` split: a method is never fitted
on the articles it is evaluated on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..data import SQUAD_PARTS, squad_articles, squad_part
from ..errors import InputError
from ..results.context_attribution import Source
from .segment import split_sources

__all__ = ["SPLITS", "ContextExample", "squad_context"]

SPLITS = tuple(SQUAD_PARTS)


SQUAD_CONTEXT = ("squad-context", "squad_context")  # the names of the examples built here from SQuAD v1.1 dev


@dataclass
class ContextExample:
    """One context-attribution example (the JSON Lines record of ``--examples`` files)."""

    id: str
    context: str
    query: str
    answer: str
    sources: list[Source]
    gold: int
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "context": self.context, "query": self.query, "answer": self.answer,
                "sources": [s.to_dict() for s in self.sources], "gold": self.gold, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ContextExample:
        return cls(str(d["id"]), d["context"], d["query"], d["answer"],
                   [Source(s["text"], int(s["start"]), int(s["end"])) for s in d["sources"]], int(d["gold"]),
                   dict(d.get("meta", {})))


def squad_context(
    split: str = "eval",
    n: int = 100,
    *,
    distractors: int = 3,
    hard: bool = False,
    sources: str = "passage",
    seed: int = 0,
    root: str | Path | None = None,
) -> list[ContextExample]:
    """``n`` examples of ``split`` (``"fit"``: articles at even positions; ``"eval"``: odd), the same for the
    same arguments. ``hard``: distractors from the question's own article (same topic) instead of others."""
    if split not in SPLITS:
        raise InputError(f"split={split!r}; choose one of {', '.join(SPLITS)} (fit: even articles, eval: odd)")
    if sources not in ("passage", "sentence"):
        raise InputError(f"sources={sources!r}; choose passage or sentence")
    if n < 1 or distractors < 0:
        raise InputError("n must be >= 1 and distractors >= 0")
    articles = [article for _, article in squad_part(squad_articles(root), split)]
    rng = np.random.default_rng(seed)
    pool = [(a, p) for a, art in enumerate(articles) for p in range(len(art["paragraphs"]))]
    out: list[ContextExample] = []
    for k in rng.permutation(len(pool)):
        if len(out) == n:
            break
        a, p = pool[k]
        paragraph = articles[a]["paragraphs"][p]
        qa = paragraph["qas"][int(rng.integers(len(paragraph["qas"])))]
        if hard:
            others = [(a, q) for q in range(len(articles[a]["paragraphs"])) if q != p]
        else:
            others = [(b, q) for b, q in pool if b != a]
        if len(others) < distractors:
            continue
        chosen = [others[i] for i in rng.choice(len(others), distractors, replace=False)]
        order = rng.permutation(distractors + 1)
        blocks = [(a, p), *chosen]
        texts = [articles[b]["paragraphs"][q]["context"].strip() for b, q in (blocks[i] for i in order)]
        gold_passage = int(np.nonzero(order == 0)[0][0])
        context = "\n\n".join(texts)
        starts = np.cumsum([0] + [len(t) + 2 for t in texts])
        answer = qa["answers"][0]
        offset = int(answer.get("answer_start", -1))  # where SQuAD marks it: a text may occur more than once
        if paragraph["context"][offset:offset + len(answer["text"])] != answer["text"]:
            offset = paragraph["context"].find(answer["text"])  # a copy whose offsets do not fit its text
        lead = len(paragraph["context"]) - len(paragraph["context"].lstrip())
        at = int(starts[gold_passage]) + offset - lead
        found = split_sources(context, sources)
        if sources == "passage":
            gold = gold_passage
        else:
            hits = [i for i, s in enumerate(found) if s.start <= at < s.end]
            if not hits:
                continue
            gold = hits[0]
        out.append(ContextExample(
            id=f"{qa['id']}-{split}-{'hard' if hard else 'easy'}-{sources}", context=context,
            query=qa["question"].strip(), answer=answer["text"], sources=found, gold=gold,
            meta={"title": articles[a]["title"], "passages": [articles[b]["title"] for b, _ in
                                                               (blocks[i] for i in order)], "split": split},
        ))
    return out
