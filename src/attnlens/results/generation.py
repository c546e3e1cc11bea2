"""The result of explaining a generation: :class:`Generation` (step x token scores, tokens, probabilities) and
its JSONL reader. The engine that computes it is :mod:`attnlens.core.generation_engine`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..paths import atomic_write_text
from .explanation import Explanation, _read_dicts
from .tokentext import BYTE_LEVEL, SENTENCEPIECE, WORDPIECE, byte_spans, token_texts, whole_on_each

__all__ = ["Generation", "load_generations"]


@dataclass
class Generation:
    """Token scores of every generated token, for every method that was asked for.

    Step ``t`` explains generated token ``t`` (its logit, probability or log-probability; minus the contrast
    token's where a contrast was given) over the ``n_prompt + t`` tokens before it; its row of a score matrix is
    zero from column ``n_prompt + t`` on (a token cannot explain itself or what follows it).

    Attributes:
        prompt: the prompt as given (before any chat template).
        prompt_tokens, prompt_ids, prompt_special: the encoded prompt (chat template and special tokens
            included), special tokens flagged.
        generated_tokens, generated_ids: the explained continuation, one entry per step (greedy or forced).
        generated: each generated token decoded as text (``" Paris"``), as the tokenizer decodes it alone.
        prompt_offsets: each prompt token's character span ``(start, end)`` in ``prompt`` (``None`` for special and
            chat-template tokens), or ``None`` where the tokenizer gives no offsets; ``generated_offsets`` gives
            the spans of the generated tokens in :attr:`text`. In both, a character whose bytes are split over
            several tokens is spanned by the token that completes it; the tokens before it have empty spans.

    The JSON form (:meth:`to_dict`) also gives ``prompt_token_text`` and ``generated_token_text``: the text of each
    token of ``prompt_tokens`` and ``generated_tokens`` (:func:`attnlens.results.tokentext.token_text`).
        scores: method id -> ``(n_generated, n_prompt + n_generated)`` matrix; row ``t`` explains step ``t``.
        probabilities: the probability of each generated token at its step (given the tokens before it).
        predicted_ids: the model's greedy choice at each step (equal to ``generated_ids`` unless forced).
        predicted: each greedy choice decoded as text (as ``generated``; a token holding only some bytes of a
            character as their ``\\xNN`` escapes), or ``None`` (a Generation built with ids alone).
        contrast_ids, contrast_probabilities: the contrast token of each step and its probability, or ``None``.
        contrast: each contrast token decoded as text (as ``predicted``), or ``None``.
        forced: whether the continuation was given (teacher forcing) rather than generated greedily.
        meta: how it was made (model, target kind, chat template, method options, ...).
    """

    prompt: str
    prompt_tokens: list[str]
    prompt_ids: list[int]
    prompt_special: list[bool]
    generated_tokens: list[str]
    generated_ids: list[int]
    generated: list[str]
    scores: dict[str, np.ndarray] = field(default_factory=dict)
    probabilities: list[float] = field(default_factory=list)
    predicted_ids: list[int] = field(default_factory=list)
    contrast_ids: list[int] | None = None
    contrast_probabilities: list[float] | None = None
    contrast: list[str] | None = None
    predicted: list[str] | None = None
    forced: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    prompt_offsets: list[tuple[int, int] | None] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def methods(self) -> list[str]:
        return list(self.scores)

    @property
    def tokens(self) -> list[str]:
        """Prompt tokens followed by the generated ones: the columns of every score matrix."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def special(self) -> list[bool]:
        """Special-token flags of :attr:`tokens` (never ranked, shown greyed)."""
        return self.prompt_special + list(self.meta.get("generated_special", [False] * len(self.generated_ids)))

    @property
    def unscored(self) -> list[bool]:
        """Flags of :attr:`tokens` that no step scores: the special tokens and, of an encoder-decoder, the sequence
        its attention stream does not read (the prompt for ``attention="decoder"``, the continuation for
        ``"encoder"`` and ``"cross"``). The views draw them blank, as they draw a step's later tokens."""
        if self.meta.get("task") != "seq2seq-lm":
            return self.special
        decoder = self.meta.get("attention") == "decoder"
        return [sp or (i < self.n_prompt) == decoder for i, sp in enumerate(self.special)]

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    def _pieces(self) -> list[str]:
        """The text each generated token adds to the continuation: for byte-level and SentencePiece vocabularies
        the text it spells (a character split over tokens whole at the token completing it, where decoding each
        token alone gives U+FFFD for every part); for WordPiece vocabularies a word's pieces joined (``##`` marks
        dropped) and a space before each word; else each token decoded."""
        if self.meta.get("token_encoding") in (BYTE_LEVEL, SENTENCEPIECE):
            return token_texts(self.generated_tokens, self.meta)
        pieces = self._wordpiece_continues()
        if pieces is not None:  # WordPiece: "un", "##bel" spell " unbel"
            return [t[2:] if piece else " " + text
                    for t, text, piece in zip(self.generated_tokens, self.generated, pieces, strict=True)]
        return list(self.generated)

    def _wordpiece_continues(self) -> list[bool] | None:
        """For a WordPiece vocabulary (recorded, or seen in a file written without the record: a ``##`` piece),
        whether each generated token continues a word; ``None`` for other vocabularies."""
        pieces = [isinstance(t, str) and t.startswith("##") for t in self.generated_tokens]
        encoding = self.meta.get("token_encoding")
        return pieces if encoding == WORDPIECE or (encoding is None and any(pieces)) else None

    @property
    def step_labels(self) -> list[str]:
        """Each generated token as its step is labelled (views, ``step(t).meta["target_token"]``): the text it
        spells, a character split over tokens shown whole on each of them (decoded alone, each part reads
        U+FFFD), else each token decoded."""
        return whole_on_each(self._pieces())

    @property
    def text(self) -> str:
        """The generated continuation as text (``"".join`` of ``generated_token_text`` where the tokens spell
        bytes or SentencePiece pieces, else of :attr:`generated`)."""
        return "".join(self._pieces())

    @property
    def generated_offsets(self) -> list[tuple[int, int]]:
        """Each generated token's character span ``(start, end)`` in :attr:`text`: select a stretch of the answer
        by characters, and :meth:`tokens_in` gives its steps (a token that holds only the first bytes of a
        character has an empty span; the token completing it spans the character)."""
        continues = self._wordpiece_continues()
        spans, at = [], 0
        for i, piece in enumerate(self._pieces()):
            space = continues is not None and not continues[i]  # the space put before a WordPiece word
            spans.append((at + int(space), at + len(piece)))
            at += len(piece)
        return spans

    def tokens_in(self, start: int, end: int) -> list[int]:
        """The steps whose generated token overlaps characters ``[start, end)`` of :attr:`text`, with the tokens
        holding the first bytes of a selected character (empty spans just before the token completing it)."""
        spans = self.generated_offsets
        length = spans[-1][1] if spans else 0  # of :attr:`text`
        if not 0 <= start < end <= length:
            raise InputError(f"characters [{start}, {end}) are not a non-empty range of the {length}-character "
                             "continuation")
        chosen = {t for t, (a, b) in enumerate(spans) if a < end and b > start}
        held = byte_spans(self.generated_tokens, self.meta)
        if held is not None:  # every token holding a byte of a selected character (" 🇫": a space and two bytes)
            chosen |= {t for t, (a, b) in enumerate(held) if a < end and b > start}
        for t in range(len(spans) - 2, -1, -1):
            a, b = spans[t]
            if a == b and t + 1 in chosen and spans[t + 1][0] == a:
                chosen.add(t)
        return sorted(chosen)

    def step(self, t: int) -> Explanation:
        """Step ``t`` as an :class:`Explanation` of its ``n_prompt + t`` input tokens (any renderer takes it).

        An encoder-decoder's scores cover one of its two sequences: the prompt (``attention="encoder"`` or
        ``"cross"``) or the continuation before the step (``"decoder"``). The step flags the other sequence's
        tokens as ``special``: they are shown, but never ranked (``top_k``, ``ranking``, the views' top-token
        lists), since no method scored them."""
        if not -len(self.generated_ids) <= t < len(self.generated_ids):
            raise InputError(f"step {t} is out of range: {len(self.generated_ids)} tokens were generated")
        t %= len(self.generated_ids)
        n = self.n_prompt + t
        meta = {**self.meta, "step": t, "target_token": self.step_labels[t]}
        steps = len(self.generated_ids)
        for m in self.scores:  # a method's figures per step (integrated gradients' delta, ...): this step's
            figures = meta.get(m)
            if isinstance(figures, dict):
                meta[m] = {k: v[t] if isinstance(v, list) and len(v) == steps else v for k, v in figures.items()}
        if self.predicted is not None and t < len(self.predicted):
            meta["predicted_token"] = self.predicted[t]
        if self.contrast_ids is not None:
            meta["contrast"] = self.contrast_ids[t]
            if self.contrast is not None:
                meta["contrast_token"] = self.contrast[t]
        # an encoder-decoder's output is a text of its own after its input (sequence 1): no word runs across them
        seq2seq = self.meta.get("task") == "seq2seq-lm"
        special = self.unscored[:n]  # the sequence an encoder-decoder's stream does not score is never ranked
        return Explanation(
            text=self.prompt, tokens=self.tokens[:n], special=special,
            target=self.generated_ids[t], predicted=self.predicted_ids[t],
            probabilities=[self.probabilities[t]],
            scores={m: s[t, :n].copy() for m, s in self.scores.items()},
            input_ids=(self.prompt_ids + self.generated_ids)[:n], meta=meta,
            sequence_ids=[0] * self.n_prompt + [1] * t if seq2seq else None,
        )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """The JSON contract (docs/generation-format.md)."""
        return {
            "prompt": self.prompt,
            "prompt_tokens": self.prompt_tokens,
            "prompt_token_text": token_texts(self.prompt_tokens, self.meta),
            "prompt_ids": self.prompt_ids,
            "prompt_special": self.prompt_special,
            "generated_tokens": self.generated_tokens,
            "generated_token_text": token_texts(self.generated_tokens, self.meta),
            "generated_ids": self.generated_ids,
            "generated": self.generated,
            "prompt_offsets": None if self.prompt_offsets is None else [None if o is None else list(o)
                                                                        for o in self.prompt_offsets],
            "generated_offsets": [list(o) for o in self.generated_offsets],
            "target_ids": self.generated_ids,
            "contrast_ids": self.contrast_ids,
            "contrast": self.contrast,
            "probabilities": self.probabilities,
            "contrast_probabilities": self.contrast_probabilities,
            "predicted_ids": self.predicted_ids,
            "predicted": self.predicted,
            "forced": self.forced,
            "scores": {m: s.tolist() for m, s in self.scores.items()},
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Generation:
        if not isinstance(d, Mapping) or "prompt" not in d:
            raise InputError("not an attnlens generation explanation: no 'prompt' (an explanation of a classifier "
                             "is read by load_explanations)")
        try:
            steps, n_prompt = len(d["generated_ids"]), len(d["prompt_ids"])
            lengths = {"prompt_tokens": n_prompt, "prompt_special": n_prompt, "generated_tokens": steps,
                       "generated": steps, "probabilities": steps, "predicted_ids": steps, "contrast_ids": steps,
                       "contrast_probabilities": steps, "prompt_offsets": n_prompt}
            for key, n in lengths.items():
                if d.get(key) is not None and len(d[key]) != n:
                    raise ValueError(f"{key!r} holds {len(d[key])} entries, not {n}")
            scores = {m: np.asarray(s, dtype=float) for m, s in d["scores"].items()}
            for m, a in scores.items():
                if a.shape != (steps, n_prompt + steps):
                    raise ValueError(f"scores[{m!r}] has shape {a.shape}, not one row of the {n_prompt + steps} "
                                     f"tokens per step ({steps})")
            return cls(
                prompt=d["prompt"], prompt_tokens=list(d["prompt_tokens"]), prompt_ids=list(d["prompt_ids"]),
                prompt_special=[bool(x) for x in d["prompt_special"]],
                generated_tokens=list(d["generated_tokens"]), generated_ids=list(d["generated_ids"]),
                generated=list(d["generated"]), scores=scores,
                probabilities=list(d["probabilities"]), predicted_ids=_predicted_ids(d),
                contrast_ids=d.get("contrast_ids"), contrast_probabilities=d.get("contrast_probabilities"),
                contrast=d.get("contrast"), predicted=d.get("predicted"),
                forced=bool(d.get("forced", False)), meta=dict(d.get("meta") or {}),
                prompt_offsets=None if d.get("prompt_offsets") is None else [
                    None if o is None else (int(o[0]), int(o[1])) for o in d["prompt_offsets"]],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"not an attnlens generation explanation: {type(exc).__name__}: {exc}") from None

    def save(self, path: str | Path) -> None:
        """Write the JSON form (:meth:`to_dict`) to ``path`` (atomically: an interrupted write leaves no partial
        file)."""
        atomic_write_text(path, json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> Generation:
        """Read a :meth:`save` document (several: :func:`load_generations`)."""
        (g, *more) = load_generations(path)
        if more:
            raise InputError(f"{path} holds {1 + len(more)} generations: read them with load_generations")
        return g

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Generation):
            return NotImplemented
        mine, theirs = self.to_dict(), other.to_dict()
        return mine == theirs

    # ------------------------------------------------------------------ display
    def show(self, methods: Sequence[str] | None = None, *, console: Any = None) -> None:
        """Step × token heatmaps in the terminal (one per method; default: all); ``console``: a
        ``rich.console.Console`` to print to (default: standard output)."""
        from ..viz.generation import show_generation

        show_generation(self, methods, console)

    def to_html(self, methods: Sequence[str] | None = None, *, title: str | None = None) -> str:
        """A standalone HTML page: the continuation, and hovering a generated token shows its step's scores (one
        section per method; default: all); ``title`` heads the page."""
        from ..viz.generation import generation_html

        return generation_html(self, methods, title)


    def plot(self, method: str | None = None, path: str | Path | None = None) -> Any:
        """Step × token heatmap of ``method`` (default: the first) as a matplotlib figure; PNG/SVG to ``path``."""
        from ..viz.generation import plot_generation

        return plot_generation(self, method, path)


def _predicted_ids(d: Mapping[str, Any]) -> list[int]:
    """The greedy choice of each step; a file without them that generated greedily (not ``forced``) chose each
    token it holds, and one that was forced cannot tell."""
    if d.get("predicted_ids") is not None:
        return list(d["predicted_ids"])
    if d.get("forced"):
        raise ValueError("'predicted_ids' is missing: a forced continuation does not say the model's own choices")
    return list(d["generated_ids"])


def load_generations(path: str | Path) -> list[Generation]:
    """Every generation of a file: one :meth:`Generation.save` document, a JSON array (``attnlens explain
    --generate --format json``) or JSON Lines (``--format jsonl``)."""
    if not Path(path).is_file():
        raise InputError(f"cannot read {path}: no such file")
    return [Generation.from_dict(d) for d in _read_dicts(path)]


# ---------------------------------------------------------------------------------------------------- engine
