"""Encoding: inputs (strings and text pairs) checked and tokenized into :class:`Encoded` token lists, and the
longest input a model takes."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import tokenizers.models
from torch import nn

from ..errors import InputError, ModelError
from ..models.architectures import architecture_for

TextInput = Union[str, tuple[str, str], list[str]]  # noqa: UP007 (a runtime alias on Python 3.10)
UNKNOWN_WARNING_FRACTION = 0.5  # warn when more of the inputs' (non-special) tokens are the unknown token

@dataclass
class Encoded:
    """One tokenized input."""

    text: str | list[str]
    ids: list[int]
    type_ids: list[int] | None
    special: list[bool]
    tokens: list[str]
    word_ids: list[int | None] | None
    sequence_ids: list[int | None] | None
    offsets: list[tuple[int, int]] | None
    dropped: int = 0


def model_max_length(model: nn.Module, tokenizer: Any, requested: int | None) -> int:
    """The longest input in tokens: ``requested`` (checked), at most what the model's positions and the
    tokenizer allow."""
    config = model.config
    limits = []
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            if architecture_for(config).position_offset:  # positions start after the padding index
                value -= int(getattr(config, "pad_token_id", 1) or 1) + 1
            limits.append(value)
            break
    tok_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < 1_000_000:
        limits.append(tok_limit)
    model_limit = min(limits) if limits else 512
    if requested is None:
        return model_limit
    if isinstance(requested, bool) or not isinstance(requested, (int, np.integer)):
        raise InputError(f"max_length must be an integer, got {requested!r}")
    if requested < 2:
        raise InputError(f"max_length must be at least 2, got {requested}")
    if requested > model_limit:
        warnings.warn(
            f"max_length={requested} exceeds what the model supports; using {model_limit}", stacklevel=3
        )
        return model_limit
    return requested


def normalize_texts(texts: TextInput | Sequence[TextInput]) -> list[str | list[str]]:
    """Inputs as a list of strings and ``[text_a, text_b]`` pairs; malformed ones are an :class:`InputError`."""
    is_pair = isinstance(texts, tuple) and len(texts) == 2 and all(isinstance(t, str) for t in texts)
    if isinstance(texts, str) or is_pair:
        texts = [texts]
    if not isinstance(texts, Sequence) and isinstance(texts, Iterable) and not isinstance(texts, (bytes, Mapping)):
        texts = list(texts)  # a numpy array of strings, a generator
    if not isinstance(texts, Sequence) or isinstance(texts, bytes):
        raise InputError(f"texts must be a string, a (text_a, text_b) pair or a list of them, got "
                         f"{type(texts).__name__}")
    if len(texts) == 0:
        raise InputError("no texts to explain: pass a string, a (text_a, text_b) pair or a list of them")
    out: list[str | list[str]] = []
    for i, t in enumerate(texts):
        if isinstance(t, str):
            parts = [t]
        elif isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t):
            parts = list(t)
        else:
            raise InputError(f"input {i} is neither a string nor a pair of strings: {t!r:.80}")
        for k, p in enumerate(parts):
            if not p.strip():
                which = "" if len(parts) == 1 else f"'s {('first', 'second')[k]} text"
                raise InputError(f"input {i}{which} is empty or whitespace only")
            try:
                p.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates, e.g. undecodable bytes from a non-UTF-8 terminal
                raise InputError(
                    f"input {i} holds characters that are not valid Unicode (undecodable bytes?): {p!r:.80}"
                ) from None
        out.append(parts[0] if len(parts) == 1 else parts)
    return out


def _pair_runs(text: Any, special: Sequence[int]) -> list[int | None] | None:
    """A slow tokenizer's sequence ids of a pair, where its special tokens split it into exactly two stretches of
    text (``[CLS] a [SEP] b [SEP]``, ``<s> a </s></s> b </s>``); ``None`` for a single text or where they do not
    (GPT-2 joins the two texts with nothing between them)."""
    if isinstance(text, str):
        return None
    out: list[int | None] = []
    runs, inside = 0, False
    for flag in special:
        if flag:
            inside = False
            out.append(None)
        else:
            if not inside:
                runs, inside = runs + 1, True
            out.append(runs - 1)
    return out if runs == 2 else None


def encode(
    tokenizer: Any, model: nn.Module, texts: TextInput | Sequence[TextInput], max_length: int, truncation: bool = True,
) -> list[Encoded]:
    """Tokenize inputs (no padding); over-long inputs are truncated with a warning or rejected."""
    items = normalize_texts(texts)
    fast = bool(getattr(tokenizer, "is_fast", False))
    encoded: list[Encoded] = []
    too_long: list[tuple[int, int]] = []
    for i, text in enumerate(items):
        args = (text,) if isinstance(text, str) else (text[0], text[1])
        kwargs = dict(add_special_tokens=True, return_special_tokens_mask=True, return_offsets_mapping=fast,
                      verbose=False)
        enc = tokenizer(*args, truncation=False, **kwargs)
        n = len(enc["input_ids"])
        dropped = 0
        if n > max_length:
            if not truncation:
                raise InputError(
                    f"input {i} has {n} tokens, more than the model's maximum of {max_length} "
                    "(truncation=True cuts it; on the command line, leave out --no-truncation)"
                )
            enc = tokenizer(*args, truncation=True, max_length=max_length, **kwargs)
            dropped = n - len(enc["input_ids"])
            too_long.append((i, dropped))
        ids = [int(x) for x in enc["input_ids"]]
        if len(ids) > max_length:  # a tokenizer cannot cut a pair below its special tokens
            raise InputError(f"input {i}: max_length={max_length} is too short for its special tokens")
        if all(enc["special_tokens_mask"]):  # nothing but [CLS]/[SEP]: there is nothing to explain
            cut = f" after truncation to {max_length} tokens" if dropped else ""
            raise InputError(f"input {i} has no token to explain{cut} (only special tokens): {text!r:.80}")
        if dropped and not isinstance(text, str) and fast:  # a pair: truncation may have emptied one of its texts
            kept = set(enc.sequence_ids()) - {None}
            lost = [k for k in (0, 1) if k not in kept and text[k].strip()]
            if lost:
                which = "first" if lost[0] == 0 else "second"
                raise InputError(f"input {i}: truncation to {max_length} tokens leaves nothing of its {which} text "
                                 "(of a QA pair, the question or the context); shorten the other text or allow "
                                 "longer inputs")
        encoded.append(
            Encoded(
                text=text,
                ids=ids,
                type_ids=[int(x) for x in enc["token_type_ids"]] if "token_type_ids" in enc else None,
                special=[bool(x) for x in enc["special_tokens_mask"]],
                tokens=tokenizer.convert_ids_to_tokens(ids),
                word_ids=enc.word_ids() if fast else None,
                sequence_ids=enc.sequence_ids() if fast else _pair_runs(text, enc["special_tokens_mask"]),
                offsets=[tuple(o) for o in enc["offset_mapping"]] if fast else None,
                dropped=dropped,
            )
        )
    if too_long:
        detail = ", ".join(f"input {i}: {d} token{'' if d == 1 else 's'}" for i, d in too_long[:5])
        more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
        warnings.warn(
            f"{len(too_long)} input(s) longer than {max_length} tokens were truncated ({detail}{more} "
            "dropped)",
            stacklevel=4,
        )
    warn_unknown(tokenizer, encoded)
    rows = model.get_input_embeddings().num_embeddings
    worst = max(max(e.ids) for e in encoded)
    if worst >= rows:
        raise ModelError(
            f"the tokenizer produced token id {worst} but the model has only {rows} embeddings: "
            "tokenizer and model do not belong together"
        )
    return encoded


def warn_unknown(tokenizer: Any, encoded: list[Encoded]) -> None:
    """Warn when most tokens of the inputs are the unknown token: the tokenizer is likely not the model's."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    words = [i for e in encoded for i, s in zip(e.ids, e.special, strict=True) if not s]
    unknown = sum(i == unk for i in words)
    if words and unknown > UNKNOWN_WARNING_FRACTION * len(words):
        warnings.warn(
            f"{unknown} of the {len(words)} tokens of the inputs are unknown to the tokenizer "
            f"({tokenizer.unk_token}): the explanation is of {tokenizer.unk_token} tokens; "
            "is this the tokenizer the model was trained with?",
            stacklevel=5,
        )


def spans_in(tokenizer: Any, rendered: str, ids: Sequence[int], start: int, end: int,
             add_special_tokens: bool) -> list[tuple[int, int] | None] | None:
    """Each token's character span in ``rendered[start:end]`` (offsets relative to ``start``; ``None`` for a token
    without text there, such as a special or chat-template token), for ``ids``, the encoding of ``rendered``.

    ``None`` when the tokenizer gives no offsets (a slow tokenizer) or tokenizing ``rendered`` again does not give
    ``ids`` as one contiguous run, so offsets are never guessed."""
    try:
        enc = tokenizer(rendered, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):
        return None
    again, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    ids = list(ids)
    shift = next((k for k in range(len(ids) - len(again) + 1) if ids[k: k + len(again)] == again), None)
    if shift is None:
        return None
    spans: list[tuple[int, int] | None] = [None] * len(ids)
    for k, (a, b) in enumerate(offsets):
        a, b = max(int(a), start), min(int(b), end)
        if b > a:
            spans[shift + k] = (a - start, b - start)
    return spans


def completing_spans(offsets: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """A tokenizer's character spans (``offset_mapping``) with each character whose bytes are split over several
    tokens given whole to the token that completes it, and empty spans (at the character) to the tokens before
    it, as a generated continuation's are (:attr:`attnlens.Generation.generated_offsets`): the spans then never
    overlap. (A byte-level tokenizer gives each of an emoji's byte tokens the emoji's span, ``(k, k + 1)`` three or
    four times.) Tokens without text keep their ``(0, 0)``."""
    n = len(offsets)
    later: list[int | None] = [None] * n  # the first character any later token with text starts at
    first: int | None = None
    for k in range(n - 1, -1, -1):
        later[k] = first
        a, b = offsets[k]
        if b > a:
            first = a if first is None else min(first, a)
    out: list[tuple[int, int]] = []
    done = 0
    for k, (a, b) in enumerate(offsets):
        if b <= a:
            out.append((a, b))
            continue
        start = max(a, done)
        end = max(start, b if later[k] is None else min(b, later[k]))  # a later token completes what it starts
        out.append((start, end))
        done = end
    return out


WORD_MARK = "\u2581"  # SentencePiece's word-start mark


def continuation_encoding(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """``text`` tokenized as it continues a prompt (no special tokens): ids and character spans.

    A SentencePiece tokenizer that marks the start of every text as a word start (Llama's and Mistral's
    ``prepend_scheme="first"``, or a normalizer prepending ``▁``) would read ``"Paris"`` as ``"▁Paris"``, i.e.
    ``" Paris"``: where ``text`` does not begin with whitespace, it is tokenized without that mark, as the
    tokenizer reads it after a prompt. Tokenizers that mark every word (T5's ``prepend_scheme="always"``) and
    those without the mark are used as they are."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = [int(i) for i in enc["input_ids"]]
    offsets = [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    if not ids or text[:1].isspace() or not getattr(tokenizer, "is_fast", False):
        return ids, offsets
    if not str(tokenizer.convert_ids_to_tokens(ids[0])).startswith(WORD_MARK):
        return ids, offsets
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if not _drop_start_mark(spec):
        return ids, offsets
    glued = Tokenizer.from_str(json.dumps(spec)).encode(text, add_special_tokens=False)
    if not glued.ids:
        return ids, offsets
    return [int(i) for i in glued.ids], [(int(a), int(b)) for a, b in glued.offsets]


def _drop_start_mark(spec: dict[str, Any]) -> bool:
    """Remove, in a tokenizer's JSON ``spec``, the ``▁`` it prepends to the start of a text (a Metaspace
    pre-tokenizer's ``prepend_scheme="first"``, a ``Prepend("▁")`` normalizer); whether anything changed."""
    changed = False

    def visit(node: Any) -> Any:
        nonlocal changed
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
                changed = True
            if node.get("type") == "Prepend" and node.get("prepend") == WORD_MARK:
                changed = True
                return None
            for key in ("normalizers", "pretokenizers"):
                if isinstance(node.get(key), list):
                    node[key] = [n for n in (visit(x) for x in node[key]) if n is not None]
        return node

    for key in ("normalizer", "pre_tokenizer"):
        if spec.get(key) is not None:
            spec[key] = visit(spec[key])
    return changed


def special_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens, as ``return_special_tokens_mask`` marks them in an encoded text:
    not the unknown token, which stands for text of the input (a word the vocabulary lacks) and is ranked, unless
    the tokenizer never writes it for text (a byte-level BPE without an unknown token, whose ``unk_token`` is a
    control token such as SmolLM2's ``<|endoftext|>``)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    unk = getattr(tokenizer, "unk_token_id", None)
    backend = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    if unk is None or (isinstance(backend, tokenizers.models.BPE) and backend.unk_token is None):
        return ids
    return ids - {int(unk)}
