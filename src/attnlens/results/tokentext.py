"""How a token reads: the byte-level BPE alphabet and SentencePiece's word marks decoded for display.

GPT-2's, RoBERTa's, BART's and most LLMs' tokenizers (SmolLM2, Llama 3, Qwen2) spell every byte as a printable
character: a space is ``Ġ``, a newline ``Ċ``, and "café" is ``cafÃ©`` (the two UTF-8 bytes of "é"). Explanations
keep the tokenizer's tokens as they are (the JSON contract, lossless) and give their :func:`token_text` beside
them; renderers and ``top_k`` show :func:`readable` tokens.
SentencePiece tokenizers (T5, Llama 2, ALBERT, XLNet) mark a word's start with ``▁`` and spell a character their
vocabulary lacks as byte tokens (``<0x0A>``); they are shown the same way.

Whether a tokenizer is byte-level is asked of the tokenizer itself, once, when an explanation is made
(:func:`token_encoding`, recorded as ``meta["token_encoding"]``), never guessed from the tokens: "Ġ" is also a
Maltese letter, and a WordPiece token containing it must stay as it is.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

BYTE_LEVEL = "byte-level"
SENTENCEPIECE = "sentencepiece"
WORDPIECE = "wordpiece"  # "##" marks a piece that continues a word; a token without it starts one
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BYTE_RUN = re.compile(r"(?:<0x[0-9A-Fa-f]{2}>)+")


@lru_cache(maxsize=1)
def _byte_of() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: printable Latin-1 bytes are themselves, the other 68 bytes
    are U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def token_encoding(tokenizer: Any) -> str | None:
    """``"byte-level"`` when the tokenizer spells bytes as GPT-2's printable alphabet (its ``Ġa`` reads ``" a"``),
    ``"sentencepiece"`` when ``▁`` marks a word's start (its ``▁a`` reads ``a``), ``"wordpiece"`` when ``##``
    marks a word's continuation (``a ##b`` reads ``ab``: its tokens are shown as they are, and a generation's
    words are spaced), else ``None`` (tokens shown and joined as they are)."""
    try:
        if tokenizer.convert_tokens_to_string(["Ġa"]) == " a":
            return BYTE_LEVEL
        if tokenizer.convert_tokens_to_string(["▁a"]).strip() == "a":
            return SENTENCEPIECE
        return WORDPIECE if tokenizer.convert_tokens_to_string(["a", "##b"]) == "ab" else None
    except Exception:  # noqa: BLE001 (a tokenizer that cannot say is shown as its tokens are)
        return None


def encoding_meta(tokenizer: Any) -> dict[str, Any]:
    """The explanation metadata entries recording the tokenizer's encoding (``{}`` where it is none of the three):
    ``token_encoding``, and for a byte-level vocabulary with tokens added as text that its byte alphabet would
    misread (``"naïve"``: ``ï`` is a byte there), those tokens (``text_tokens``)."""
    encoding = token_encoding(tokenizer)
    if not encoding:
        return {}
    out: dict[str, Any] = {"token_encoding": encoding}
    if encoding == BYTE_LEVEL:
        spelled = {t: _alphabet_bytes(t) for t in _added_tokens(tokenizer)}
        misread = sorted(t for t, b in spelled.items() if b is not None and b != t.encode("utf-8"))
        if misread:
            out["text_tokens"] = misread
    return out


def _added_tokens(tokenizer: Any) -> list[str]:
    try:
        return [str(t) for t in tokenizer.get_added_vocab()]
    except Exception:  # noqa: BLE001 (a tokenizer that cannot list them adds none we know of)
        return []


def _alphabet_bytes(token: str) -> bytes | None:
    """The bytes a token spells in GPT-2's byte alphabet, or ``None`` when a character lies outside it."""
    byte_of = _byte_of()
    if not all(c in byte_of for c in token):
        return None
    return bytes(byte_of[c] for c in token)


def decode_byte_level(token: str) -> str:
    """The text of a byte-level token; a character outside the alphabet is kept, bytes that are not whole UTF-8
    characters (a character split over two tokens) become their ``\\xNN`` escapes."""
    byte_of = _byte_of()
    if any(c not in byte_of for c in token):
        return token
    return bytes(byte_of[c] for c in token).decode("utf-8", errors="backslashreplace")


def decode_sentencepiece(token: str) -> str:
    """The text of a SentencePiece token (or of tokens joined): ``▁`` a space, byte tokens (``<0x0A>``) their
    bytes read as UTF-8 (``\\xNN`` escapes for bytes that are not whole characters)."""
    return _BYTE_RUN.sub(
        lambda run: bytes(int(h, 16) for h in _BYTE_TOKEN.findall(run.group(0))).decode(
            "utf-8", errors="backslashreplace"),
        token.replace("▁", " "))


def token_text(token: str, encoding: str | None) -> str:
    """The text ``token`` stands for, as the tokenizer's decoder would give it: byte-level and SentencePiece tokens
    decoded with their word-start space kept (``ĠParis`` → ``" Paris"``, ``Ċ`` → ``"\\n"``, ``cafÃ©`` → ``"café"``);
    other tokens (WordPiece) as they are. The JSON output's ``token_text`` (concatenated, a byte-level input's
    tokens give back its text)."""
    if encoding == BYTE_LEVEL:
        return decode_byte_level(token)
    if encoding == SENTENCEPIECE:
        return decode_sentencepiece(token)
    return token


def token_texts(tokens: list[str], meta: dict[str, Any] | None) -> list[str]:
    """The text of each of ``tokens`` (a sequence, in order), by the encoding recorded in ``meta``: as
    :func:`token_text`, except that a character whose bytes are split over several tokens (an emoji, an accented
    letter of a byte-level vocabulary that lacks it) is given whole to the token that completes it, and ``""`` to
    the tokens before, so that the texts put together are the text the tokens spell. Bytes that never complete a
    character are ``\\xNN`` escapes."""
    encoding = (meta or {}).get("token_encoding")
    if encoding not in (BYTE_LEVEL, SENTENCEPIECE):
        return list(tokens)
    return _spelled(tokens, encoding, (meta or {}).get("text_tokens", ()))[0]


def byte_spans(tokens: list[str], meta: dict[str, Any] | None) -> list[tuple[int, int]] | None:
    """For byte-level and SentencePiece tokens (a sequence, in order): the span of the joined
    :func:`token_texts` that each token's bytes take part in, the characters it only begins included (so the
    spans of a character's tokens overlap); ``None`` for other vocabularies."""
    encoding = (meta or {}).get("token_encoding")
    if encoding not in (BYTE_LEVEL, SENTENCEPIECE):
        return None
    return _spelled(tokens, encoding, (meta or {}).get("text_tokens", ()))[1]


def _spelled(tokens: list[str], encoding: str,
             text_tokens: Any = ()) -> tuple[list[str], list[tuple[int, int]]]:
    """Each token's text (a character whole to the token holding its last byte; bytes that never complete one
    escaped on their own token) and the span of the joined text its bytes take part in. ``text_tokens``: tokens
    added to a byte-level vocabulary as text (their UTF-8, not alphabet bytes)."""
    as_text = set(text_tokens or ())
    pieces = [t.encode("utf-8") if t in as_text else _token_bytes(t, encoding) for t in tokens]
    data = b"".join(pieces)
    owner = [k for k, piece in enumerate(pieces) for _ in piece]  # the token each byte comes from
    texts = [""] * len(tokens)
    at = 0  # characters of the joined text so far
    spans: list[list[int]] = [[-1, -1] for _ in tokens]

    def touch(k: int, start: int, end: int) -> None:
        spans[k] = [start if spans[k][0] < 0 else spans[k][0], end]

    i = 0
    while i < len(data):
        size = _sequence_length(data[i])
        chunk = data[i:i + size]
        try:
            char = chunk.decode("utf-8") if size else None
        except UnicodeDecodeError:
            char = None
        if char is not None and len(chunk) == size:
            texts[owner[i + size - 1]] += char  # whole, to the token holding its last byte
            for k in sorted({owner[j] for j in range(i, i + size)}):
                touch(k, at, at + 1)
            at += 1
            i += size
        else:  # a byte that never completes a character stays, escaped, on the token that holds it
            escape = f"\\x{data[i]:02x}"
            texts[owner[i]] += escape
            touch(owner[i], at, at + len(escape))
            at += len(escape)
            i += 1
    done = 0
    out = []
    for start, end in spans:  # a token without bytes: an empty span where the text stands
        out.append((start, end) if start >= 0 else (done, done))
        done = max(done, end)
    return texts, out


def _sequence_length(lead: int) -> int:
    """The length of the UTF-8 sequence a byte begins (0: a byte that begins none)."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def _token_bytes(token: str, encoding: str) -> bytes:
    """The bytes a byte-level or SentencePiece token spells (a character outside the byte alphabet: its UTF-8)."""
    if encoding == BYTE_LEVEL:
        byte_of = _byte_of()
        if all(c in byte_of for c in token):
            return bytes(byte_of[c] for c in token)
        return token.encode("utf-8")
    parts = []
    end = 0
    for match in _BYTE_TOKEN.finditer(token):
        parts.append(token[end:match.start()].replace("▁", " ").encode("utf-8"))
        parts.append(bytes([int(match.group(1), 16)]))
        end = match.end()
    parts.append(token[end:].replace("▁", " ").encode("utf-8"))
    return b"".join(parts)


def readable(token: str, encoding: str | None) -> str:
    """``token`` as shown to a reader: byte-level and SentencePiece tokens decoded, with the word-start space
    dropped (renderers separate tokens); a token of whitespace only shows it (``␣``, newline and tab as the
    terminal escapes them)."""
    if encoding not in (BYTE_LEVEL, SENTENCEPIECE):
        return token
    return _shown(token_text(token, encoding))


def _shown(text: str) -> str:
    """A token's text as shown: whitespace only made visible, else without the word-start space."""
    if not text.strip():
        return text.replace(" ", "␣")
    return text[1:] if text.startswith(" ") else text


def readable_tokens(tokens: list[str], meta: dict[str, Any] | None) -> list[str]:
    """Each of ``tokens`` (a sequence, in order) as :func:`readable` shows it, by the encoding recorded in
    ``meta``; a character whose bytes are split over several tokens is shown whole on each of them (one token
    alone would show ``\\xNN`` escapes)."""
    encoding = (meta or {}).get("token_encoding")
    if encoding not in (BYTE_LEVEL, SENTENCEPIECE):
        return list(tokens)
    return [_shown(text) for text in whole_on_each(token_texts(tokens, meta))]


def whole_on_each(texts: list[str]) -> list[str]:
    """:func:`token_texts` with a character split over several tokens shown whole on each of them: the tokens
    holding only its first bytes (``""``) take the character the next token completes."""
    texts = list(texts)
    for i in range(len(texts) - 2, -1, -1):
        if texts[i] == "" and texts[i + 1]:  # the first bytes of the character the next token completes
            texts[i] = texts[i + 1][0]
    return texts
