"""The one result type: token scores of every method for one explained input.

An :class:`Explanation` holds plain Python / NumPy data only (no tensors, no model references), so it can be
saved, loaded, compared and rendered anywhere. Its JSON form (:meth:`Explanation.to_dict`) is a contract that
the CLI and other tools rely on: the keys ``text, tokens, special, target, predicted, probabilities, scores,
layers`` never change meaning.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..data import iter_jsonl
from ..errors import InputError
from ..paths import atomic_output, atomic_write_text, read_utf8
from .tokentext import BYTE_LEVEL, SENTENCEPIECE, readable, readable_tokens, token_text, token_texts

WORD_AGGREGATIONS = ("sum", "mean", "max", "absmax")
_SUBWORD_MARKS = ("##", "Ġ", "▁")


@dataclass
class Explanation:
    """Token impact scores of one input, for every method that was asked for.

    Attributes:
        text: the explained text, or ``[text_a, text_b]`` for a sentence pair.
        tokens: the model's tokens (padding removed), special tokens included.
        special: ``True`` where a token is a special token ([CLS], [SEP], <s>, ...); never ranked.
        target: the class whose score was explained (QA models: the ``[start, end]`` token positions, inclusive).
        predicted: the class the model predicted (QA: the best ``[start, end]`` span, decoded as SQuAD does;
            multi-label models: the list of labels with p > 0.5, possibly empty).
        probabilities: softmax probabilities of every class (multi-label: each label's independent sigmoid
            probability; QA: the probabilities of the explained start and end positions).
        scores: method id -> one float per token; positive supports ``target`` where the method is signed.
        layers: method id -> ``(n_layers, n_tokens)`` per-layer scores for layered methods.
        labels: class names (``id2label``), if the model has them.
        word_ids, sequence_ids, offsets: the tokenizer's alignment of tokens to words and characters (fast
            tokenizers only); used by :meth:`to_words`.
        input_ids, token_type_ids: the token ids that were explained (evaluation perturbs these, never text).
        meta: how the explanation was made (model, target kind, attention stream, method options, ...).
    """

    text: str | list[str]
    tokens: list[str]
    special: list[bool]
    target: int | list[int]
    predicted: int | list[int]
    probabilities: list[float]
    scores: dict[str, np.ndarray] = field(default_factory=dict)
    layers: dict[str, np.ndarray] = field(default_factory=dict)
    labels: list[str] | None = None
    word_ids: list[int | None] | None = None
    sequence_ids: list[int | None] | None = None
    offsets: list[tuple[int, int]] | None = None
    input_ids: list[int] | None = None
    token_type_ids: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ queries
    @property
    def methods(self) -> list[str]:
        """Ids of the methods whose scores this explanation holds."""
        return list(self.scores)

    @property
    def target_label(self) -> str | None:
        """Name of the explained class, if the model names its classes."""
        return self.labels[self.target] if self.labels and isinstance(self.target, int) else None

    @property
    def predicted_label(self) -> str | None:
        """Name of the predicted class, if the model names its classes."""
        return self.labels[self.predicted] if self.labels and isinstance(self.predicted, int) else None

    @property
    def is_qa(self) -> bool:
        """Whether this explains an extractive QA model (its target is a ``[start, end]`` token span)."""
        return self.meta.get("task") == "qa" or (isinstance(self.target, list) and not self.is_multi_label
                                                  and not self.is_answer)

    @property
    def is_answer(self) -> bool:
        """Whether this explains a language model's answer as a whole (:meth:`Explainer.explain_answer`: its
        target is the answer's token span ``[start, end)``, its end excluded)."""
        return str(self.meta.get("task", "")).endswith("-lm") and isinstance(self.target, list)

    @property
    def is_multi_label(self) -> bool:
        """Whether the model is a multi-label classifier (independent sigmoid probabilities per label)."""
        return self.meta.get("problem_type") == "multi_label_classification"

    def label_name(self, index: int) -> str:
        """Name of class ``index`` (its ``id2label`` entry, else the index)."""
        return self.labels[index] if self.labels and 0 <= index < len(self.labels) else str(index)

    def span_text(self, span: Sequence[int] | None = None) -> str:
        """QA: the text of the token span ``[start, end]`` (default: the explained one), cut from the original
        text by the token offsets where the span lies in one sequence, else its tokens joined."""
        start, end = (self.target if span is None else span)  # type: ignore[misc]
        start, end = int(start), int(end)
        if not 0 <= start <= end < len(self.tokens):
            return ""
        group = list(range(start, end + 1))
        seqs = {None if self.sequence_ids is None else self.sequence_ids[i] for i in group}
        if self.offsets is not None and len(seqs) == 1 and not any(self.special[i] for i in group):
            seq = seqs.pop()
            source = self._sequence_text(seq)
            lo, hi = self.offsets[start][0], max(self.offsets[i][1] for i in group)
            if hi > lo:
                return source[lo:_past_marks(source, hi)]
        words = [_strip_mark(self.tokens[i], first=True) if _is_continuation(self.tokens[i]) else " " + self.tokens[i]
                 for i in group]
        return "".join(words).strip()

    def _method_scores(self, method: str) -> np.ndarray:
        if method not in self.scores:
            raise InputError(
                f"this explanation has no scores for method {method!r}; it has: {', '.join(self.scores) or 'none'}"
            )
        return self.scores[method]

    def ranking(self, method: str, reverse: bool = False) -> list[int]:
        """Positions of the non-special tokens, highest score first (``reverse``: lowest first; NaN scores last
        either way); ties keep token order. The one ranking of attnlens: top-k, the metrics and the benchmark all
        use it."""
        s = self._method_scores(method)
        candidates = [i for i, sp in enumerate(self.special) if not sp]
        sign = 1.0 if reverse else -1.0
        def key(i: int) -> tuple[bool, float]:
            # a score that is not a number (NaN: the engine warns of them) ranks last either way; sorting by NaN
            # keys would leave the order arbitrary
            value = float(s[i])
            return (True, 0.0) if math.isnan(value) else (False, sign * value)

        return sorted(candidates, key=key)

    @property
    def token_text(self) -> list[str]:
        """The text of each token (byte-level BPE and SentencePiece decoded, word-start spaces kept: ``" Paris"``,
        ``"\\n"``, ``"café"``; WordPiece tokens as they are), the JSON output's twin of ``tokens``."""
        return token_texts(self.tokens, self.meta)

    def top_k(self, method: str, k: int = 5) -> list[tuple[str, float]]:
        """The ``k`` highest-scoring non-special tokens as ``(token, score)`` pairs, highest first; each token as a
        reader sees it (byte-level BPE and SentencePiece decoded, without the word-start space: ``"Paris"``;
        ``ranking`` gives the positions).

        Special and padding tokens are never ranked. Use ``exp.to_words().top_k(...)`` for words.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise InputError(f"k must be an integer >= 0, got {k!r}")
        s = self._method_scores(method)
        shown = readable_tokens(list(self.tokens), self.meta)
        return [(shown[i], float(s[i])) for i in self.ranking(method)[:k]]

    # ------------------------------------------------------------- aggregation
    def word_groups(self) -> list[list[int]]:
        """Token positions grouped into words; every special token forms a group of its own."""
        groups: list[list[int]] = []
        last_key: tuple[Any, Any] | None = None
        encoding = self.meta.get("token_encoding")
        text = self.token_text
        for i, tok in enumerate(self.tokens):
            if self.special[i]:
                groups.append([i])
                last_key = None
                continue
            if self.word_ids is not None:
                seq = self.sequence_ids[i] if self.sequence_ids is not None else 0
                key = (seq, self.word_ids[i])
                joins = (last_key is not None and (key == last_key and self.word_ids[i] is not None
                                                   or last_key[0] == seq and self._across_mark(i, seq))
                         and not self._space_before(i, seq))
            elif encoding in (BYTE_LEVEL, SENTENCEPIECE):  # no alignment (a generation's tokens): words are what
                # whitespace separates, read from the text each token spells; a token of whitespace alone (a space
                # or newline before a word the vocabulary spells without its space) goes with the word after it.
                # A new sequence (an encoder-decoder's output after its input) starts a new word.
                key = (None if self.sequence_ids is None else self.sequence_ids[i], None)
                before = text[i - 1] if i else ""
                joins = (bool(groups) and last_key == key and not text[i][:1].isspace()
                         and (not before[-1:].isspace() or not before.strip()))
            else:  # slow tokenizer: fall back on subword markers
                key = (None if self.sequence_ids is None else self.sequence_ids[i], None)
                joins = bool(groups) and last_key == key and _is_continuation(tok)
            if joins:
                groups[-1].append(i)
            else:
                groups.append([i])
            last_key = key
        return groups

    def _sequence_text(self, seq: Any) -> str:
        """The input text that tokens of sequence ``seq`` (a pair's 0 or 1; ``None`` alone) are located in."""
        return self.text[seq or 0] if isinstance(self.text, list) else self.text

    def _space_before(self, i: int, seq: Any) -> bool:
        """Whether whitespace of the input separates token ``i`` from the token before it (in its own span's start
        or between the two spans): a word boundary, also where the tokenizer's word ids run on across it (a
        SentencePiece tokenizer that does not pre-split, e.g. transformers 5's Llama and Gemma tokenizers, gives
        every token word id 0)."""
        if self.offsets is None or i == 0:
            return False
        source = self._sequence_text(seq)
        (_, end), (start, stop) = self.offsets[i - 1], self.offsets[i]
        gap = source[min(end, start):start]  # between the two spans
        lead = source[start:start + 1] if stop > start else ""  # the token's first character
        return any(c.isspace() for c in gap) or lead.isspace()

    def _across_mark(self, i: int, seq: Any) -> bool:
        """Whether token ``i`` continues the word before it across a combining mark, where the tokenizer's word ids
        part them: it starts with the mark (a decomposed accent that a byte-level pre-tokenizer splits off its
        letter: ``"e"``, ``"\u0301"``), or comes right after one (``"t\u00e9"`` after it)."""
        if self.offsets is None or i == 0:
            return False
        source = self._sequence_text(seq)
        (_, end), (start, stop) = self.offsets[i - 1], self.offsets[i]
        starts = stop > start and start < len(source) and unicodedata.combining(source[start]) > 0
        follows = 0 < end == start <= len(source) and unicodedata.combining(source[end - 1]) > 0
        return starts or follows

    def _group_word_ids(self, groups: list[list[int]]) -> list[int | None]:
        """Each word's index: the tokenizer's word id of its first token where the tokenizer aligned them (one
        word id per word), else its position among the words of its sequence; ``None`` for special tokens."""
        out: list[int | None] = []
        count, seq = 0, None
        firsts = [(None if self.sequence_ids is None else self.sequence_ids[g[0]], self.word_ids[g[0]])
                  for g in groups if not self.special[g[0]]] if self.word_ids is not None else []
        aligned = self.word_ids is not None and len(set(firsts)) == len(firsts)
        for g in groups:
            if self.special[g[0]]:
                out.append(None)
                continue
            if aligned:
                out.append(self.word_ids[g[0]])  # type: ignore[index]
                continue
            here = None if self.sequence_ids is None else self.sequence_ids[g[0]]
            if here != seq:
                count, seq = 0, here
            out.append(count)
            count += 1
        return out

    def _word_span(self, group: list[int]) -> tuple[int, int]:
        """A word's character span: its tokens' spans joined, with the combining marks after it (a tokenizer that
        strips accents leaves them out of every token) and without the whitespace around it (byte-level
        tokenizers' spans take in the space before a word), as for WordPiece words; a word of whitespace alone
        keeps it."""
        start, end = min(self.offsets[i][0] for i in group), max(self.offsets[i][1] for i in group)
        if self.special[group[0]]:
            return start, end
        source = self._sequence_text(self.sequence_ids[group[0]] if self.sequence_ids is not None else 0)
        end = _past_marks(source, end)
        text = source[start:end]
        if text.strip():
            start, end = start + len(text) - len(text.lstrip()), end - (len(text) - len(text.rstrip()))
        return start, end

    def _word_text(self, group: list[int]) -> str:
        if self.offsets is not None and not self.special[group[0]]:
            start, end = self._word_span(group)
            if end > start:
                return self._sequence_text(self.sequence_ids[group[0]] if self.sequence_ids is not None
                                           else 0)[start:end]
        encoding = self.meta.get("token_encoding")
        if encoding in (BYTE_LEVEL, SENTENCEPIECE):  # the word's pieces (and bytes), read as text
            pieces = "".join(self.tokens[i] for i in group)
            word = readable(pieces, encoding)
            # without the whitespace token it may start with; a word of whitespace only is shown whole (a newline
            # and the spaces after it: "\n␣", whose newline a strip would drop)
            return word.strip() if token_text(pieces, encoding).strip() else word
        return "".join(_strip_mark(self.tokens[i], first=(j == 0)) for j, i in enumerate(group))

    def to_words(self, aggregation: str = "sum") -> Explanation:
        """Aggregate subword scores to words: ``sum`` (default, keeps totals), ``mean``, ``max`` or ``absmax``.

        Returns a new Explanation whose tokens are words; special tokens stay as they are.
        """
        if aggregation not in WORD_AGGREGATIONS:
            raise InputError(f"unknown aggregation {aggregation!r}; choose one of {', '.join(WORD_AGGREGATIONS)}")
        if self.meta.get("granularity") == "word":  # already words: their scores cannot be aggregated otherwise
            done = self.meta.get("word_aggregation", "sum")
            if aggregation != done:
                raise InputError(f"these are words already, their scores aggregated by {done}: aggregate the "
                                 f"token-level explanation by {aggregation} instead")
            return self
        groups = self.word_groups()

        def agg(values: np.ndarray) -> np.ndarray:  # values: (..., n_tokens)
            cols = []
            for g in groups:
                v = values[..., g]
                if aggregation == "sum":
                    cols.append(v.sum(-1))
                elif aggregation == "mean":
                    cols.append(v.mean(-1))
                elif aggregation == "max":
                    cols.append(v.max(-1))
                else:
                    idx = np.abs(v).argmax(-1)
                    cols.append(np.take_along_axis(v, np.expand_dims(idx, -1), -1)[..., 0])
            return np.stack(cols, -1).astype(np.float64)

        offsets = None if self.offsets is None else [self._word_span(g) for g in groups]
        target, predicted = self.target, self.predicted
        word_of = {i: k for k, g in enumerate(groups) for i in g}
        if self.is_qa:  # spans are token positions: map them to word positions
            target, predicted = ([word_of.get(int(i), int(i)) for i in span]  # type: ignore[union-attr]
                                 for span in (self.target, self.predicted))
        elif self.is_answer:  # [start, end): the words of its first and last tokens
            start, end = (int(i) for i in self.target)  # type: ignore[union-attr]
            target = [word_of.get(start, start), word_of.get(end - 1, end - 1) + 1]
        meta = {**self.meta, "granularity": "word", "word_aggregation": aggregation}
        meta.pop("token_encoding", None)  # words are text
        meta.pop("text_tokens", None)
        if "position" in meta:  # token classification: the explained token's word
            meta["position"] = word_of.get(int(meta["position"]), int(meta["position"]))
            if "token" in meta and 0 <= meta["position"] < len(groups):
                meta["token"] = self._word_text(groups[meta["position"]])
        labels_by_token = meta.get("predicted_labels")
        if isinstance(labels_by_token, list) and len(labels_by_token) == len(self.tokens):
            meta["predicted_labels"] = [labels_by_token[g[0]] for g in groups]  # a word's label: its first token's
        return Explanation(
            text=self.text,
            tokens=[self._word_text(g) for g in groups],
            special=[self.special[g[0]] for g in groups],
            target=target,
            predicted=predicted,
            probabilities=list(self.probabilities),
            scores={m: agg(s) for m, s in self.scores.items()},
            layers={m: agg(s) for m, s in self.layers.items()},
            labels=self.labels,
            word_ids=self._group_word_ids(groups),
            sequence_ids=None if self.sequence_ids is None else [self.sequence_ids[g[0]] for g in groups],
            offsets=offsets,
            meta=meta,
        )

    # ----------------------------------------------------------- serialization
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; the keys ``text, tokens, special, target, predicted, probabilities, scores, layers`` are
        the stable contract of ``attnlens explain --format json``; ``token_text`` is each token's text (read-only:
        :meth:`from_dict` derives it again)."""
        return {
            "text": self.text,
            "tokens": list(self.tokens),
            "token_text": self.token_text,
            "special": [bool(x) for x in self.special],
            "target": _ints(self.target),
            "predicted": _ints(self.predicted),
            "probabilities": [float(p) for p in self.probabilities],
            "scores": {m: [float(x) for x in s] for m, s in self.scores.items()},
            "layers": {m: [[float(x) for x in row] for row in s] for m, s in self.layers.items()},
            "labels": self.labels,
            "word_ids": self.word_ids,
            "sequence_ids": self.sequence_ids,
            "offsets": None if self.offsets is None else [list(o) for o in self.offsets],
            "input_ids": self.input_ids,
            "token_type_ids": self.token_type_ids,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Explanation:
        """Inverse of :meth:`to_dict`."""
        if not isinstance(d, dict):
            raise InputError(f"not an attnlens explanation: expected a JSON object, got {type(d).__name__}")
        missing = [k for k in ("text", "tokens", "special", "target", "predicted", "probabilities") if k not in d]
        if missing:
            raise InputError(f"not an attnlens explanation: missing keys {', '.join(missing)}")
        try:
            return cls._checked(d)
        except (TypeError, ValueError, AttributeError) as err:
            raise InputError(f"not an attnlens explanation: {err}") from None

    @classmethod
    def _checked(cls, d: dict[str, Any]) -> Explanation:
        """:meth:`from_dict`'s work: every per-token array as long as ``tokens`` and of its type, else a
        ``ValueError`` naming the key (a shorter ``special`` would leave tokens out of every ranking)."""
        tokens = d["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ValueError("'tokens' must be a list of strings")
        n = len(tokens)

        def per_token(key: str, value: Any, check: Callable[[Any], bool], what: str) -> list[Any] | None:
            if value is None:
                return None
            if not isinstance(value, list) or len(value) != n or not all(map(check, value)):
                raise ValueError(f"{key!r} must be a list of {n} {what} (one per token)")
            return value

        special = [bool(x) for x in per_token("special", d["special"] if d["special"] is not None else False,
                                               lambda x: x in (True, False) and not
                                               isinstance(x, float), "booleans") or []]
        number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
        optional_int = lambda x: x is None or (isinstance(x, int) and not isinstance(x, bool))  # noqa: E731
        word_ids = per_token("word_ids", d.get("word_ids"), optional_int, "word ids or nulls")
        sequence_ids = per_token("sequence_ids", d.get("sequence_ids"), optional_int, "sequence ids or nulls")
        offsets = per_token("offsets", d.get("offsets"),
                            lambda o: isinstance(o, list) and len(o) == 2 and all(map(number, o)), "[start, end] pairs")
        input_ids = per_token("input_ids", d.get("input_ids"), optional_int, "token ids")
        token_type_ids = per_token("token_type_ids", d.get("token_type_ids"), optional_int, "token type ids")
        text = d["text"]
        if not (isinstance(text, str) or isinstance(text, list) and len(text) == 2
                and all(isinstance(t, str) for t in text)):
            raise ValueError("'text' must be a string, or a pair of strings")
        if isinstance(text, list) and offsets is not None and sequence_ids is None:
            sequence_ids = _pair_sequence_ids(special)  # offsets index each side's own text
            if 1 not in sequence_ids:  # no separator to tell the sides apart: the offsets cannot be placed
                sequence_ids, offsets = None, None
        probabilities = d["probabilities"]
        if not isinstance(probabilities, list) or not all(map(number, probabilities)):
            raise ValueError("'probabilities' must be a list of numbers")
        scores, layers = d.get("scores", {}), d.get("layers", {})
        if not isinstance(scores, dict) or not isinstance(layers, dict):
            raise ValueError("'scores' and 'layers' must map methods to their values")
        arrays = {m: np.asarray(v, dtype=np.float64) for m, v in scores.items()}
        for m, a in arrays.items():
            if a.shape != (n,):
                raise ValueError(f"scores[{m!r}] has shape {a.shape}, not one value per token ({n})")
        layered = {m: np.asarray(v, dtype=np.float64) for m, v in layers.items()}
        for m, a in layered.items():
            if a.ndim != 2 or a.shape[1] != n:
                raise ValueError(f"layers[{m!r}] has shape {a.shape}, not one row of {n} values per layer")
        meta = d.get("meta") or {}
        if not isinstance(meta, dict):
            raise ValueError("'meta' must be an object")
        return cls(
            text=text, tokens=list(tokens), special=list(special), target=_ints(d["target"]),
            predicted=_ints(d["predicted"]), probabilities=[float(p) for p in probabilities], scores=arrays,
            layers=layered, labels=d.get("labels"), word_ids=word_ids, sequence_ids=sequence_ids,
            offsets=None if offsets is None else [(int(a), int(b)) for a, b in offsets], input_ids=input_ids,
            token_type_ids=token_type_ids, meta=dict(meta),
        )

    def save(self, path: str | Path) -> None:
        """Write this explanation as one JSON document (atomically: an interrupted write leaves no partial file)."""
        atomic_write_text(path, json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> Explanation:
        """Read an explanation written by :meth:`save`, or the first one of a file that holds several (a JSON
        array as written by ``attnlens explain --format json``, or JSON Lines); :func:`load_explanations` reads
        them all."""
        return cls.from_dict(_read_dicts(path)[0])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Explanation):
            return NotImplemented
        return json.dumps(self.to_dict(), sort_keys=True) == json.dumps(other.to_dict(), sort_keys=True)  # NaN == NaN

    # -------------------------------------------------------------- rendering
    def show(self, methods: Sequence[str] | None = None, *, words: bool = False, console: Any = None,
             k: int | None = None) -> None:
        """Print a coloured token heatmap to the terminal (positive green, negative red): one row per method
        (default: all) and its ``k`` top tokens (default 5); ``words`` merges sub-word tokens into words;
        ``console``: a ``rich.console.Console`` to print to (default: standard output)."""
        from ..viz.terminal import print_explanations

        print_explanations([self], methods=methods, words=words, console=console, **_top(k))

    def to_html(self, methods: Sequence[str] | None = None, *, title: str | None = None, words: bool = False,
                k: int | None = None) -> str:
        """A self-contained HTML page with this explanation's token heatmaps: one row per method (default: all)
        and its ``k`` top tokens (default 5); ``words`` merges sub-word tokens into words; ``title`` heads the
        page."""
        from ..viz.html import explanations_html

        return explanations_html([self], methods=methods, title=title, words=words, **_top(k))


def _top(k: int | None) -> dict[str, int]:
    """``k`` as the views' keyword, where given (each view has its default)."""
    return {} if k is None else {"k": k}


def _ints(value: Any) -> int | list[int]:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else int(value)


def _is_continuation(token: str) -> bool:
    if token.startswith("##"):
        return True
    if token.startswith(("Ġ", "▁")):
        return False
    return False


def _strip_mark(token: str, first: bool) -> str:
    for mark in _SUBWORD_MARKS:
        if token.startswith(mark):
            return token[len(mark) :]
    return token


def explanations_json(explanations: Iterable[Explanation]) -> list[dict[str, Any]]:
    """The JSON document of ``attnlens explain --format json``: one :meth:`Explanation.to_dict` per input (the
    ``attnlens serve`` API answers with the same list)."""
    return [e.to_dict() for e in explanations]


def save_explanations(explanations: Iterable[Explanation], path: str | Path) -> None:
    """Write explanations as JSON Lines, one explanation per line (atomically: the file appears when all are
    written)."""
    with atomic_output(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for e in explanations:
            f.write(json.dumps(e.to_dict()) + "\n")


def load_explanations(path: str | Path) -> list[Explanation]:
    """Read every explanation of a file: JSON Lines (:func:`save_explanations`, ``--format jsonl``), a JSON array
    (``attnlens explain --format json``) or a single :meth:`Explanation.save` document."""
    return [Explanation.from_dict(d) for d in _read_dicts(path)]


def _read_dicts(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a file holding one object, an array of objects, or JSON Lines (at least one)."""
    text = _read_text(path)
    try:
        doc = json.loads(text)
        rows = doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:  # several documents: JSON Lines
        rows = [row for _, row in iter_jsonl(path)]
    if not rows:
        raise InputError(f"{path} holds no explanations")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InputError(f"{path}: item {i + 1} is not an attnlens explanation (a JSON object)")
    return rows


def _read_text(path: str | Path) -> str:
    return read_utf8(path, "attnlens results")


def _pair_sequence_ids(special: Sequence[bool]) -> list[int | None]:
    """A sentence pair's sequence ids read from its special tokens, for a file that does not give them: the
    tokens after the first run of special tokens that follows text belong to the second text (``[CLS] a [SEP] b
    [SEP]``, ``<s> a </s></s> b </s>``); special tokens belong to none."""
    out: list[int | None] = []
    seq, seen_text = 0, False
    for i, sp in enumerate(special):
        if sp:
            out.append(None)
            if seen_text and seq == 0 and (i + 1 == len(special) or not special[i + 1]):
                seq = 1
            continue
        seen_text = True
        out.append(seq)
    return out


def _past_marks(text: str, end: int) -> int:
    """``end`` moved past the combining marks that follow it: a tokenizer that strips accents (BERT uncased) leaves
    a decomposed accent (``"e\\u0301"``) out of every token's span, though it belongs to the letter before it."""
    while end < len(text) and unicodedata.combining(text[end]):
        end += 1
    return end
