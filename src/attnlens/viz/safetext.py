"""Make user-supplied text safe to print on a terminal or to put in an HTML page.

Input texts, tokens, label names, model paths and file names reach the terminal in the renderer, in the CLI's
``wrote PATH`` lines, in warnings and in error lines. A control character in any of them is a terminal command:
``ESC [ 2 J`` clears the screen, ``ESC ] 0 ; … BEL`` sets the window title, ``CR`` overwrites the line, and the
Unicode bidi overrides reorder what the reader sees. :func:`terminal_safe` replaces each such character by its
visible Python escape (``\\x1b``, ``\\x9b``, ``\\u202e``), so nothing is executed and nothing is lost silently.
"""

from __future__ import annotations

import html

# Unicode bidi embeddings, overrides and isolates ("Trojan Source", CVE-2021-42574): they reorder displayed text.
_BIDI = [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
# C0 controls (but tab and newline), DEL, C1 controls, bidi controls -> their visible escape.
_UNSAFE = [c for c in range(0x20) if c not in (0x09, 0x0A)] + [0x7F, *range(0x80, 0xA0), *_BIDI]
_TABLE = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNSAFE}
_ONE_LINE_TABLE = {**_TABLE, 0x09: "\\t", 0x0A: "\\n"}
# zero-width joiners, non-joiners, spaces and marks: a terminal and rich's cell widths disagree over the text around
# them (an emoji family joined by U+200D), so a table of tokens loses its end; shown as escapes there (not in HTML)
_ZERO_WIDTH = {c: f"\\u{c:04x}" for c in (0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF)}
_TERMINAL = ({**_TABLE, **_ZERO_WIDTH}, {**_ONE_LINE_TABLE, **_ZERO_WIDTH})
# an HTML page reads a carriage return as the line break it is (a lone CR, or CR LF as one); on a terminal it
# would overwrite the line
_HTML = {c: v for c, v in _TABLE.items() if c != 0x0D}
_ONE_LINE_HTML = _ONE_LINE_TABLE


def terminal_safe(text: object, one_line: bool = False) -> str:
    """``str(text)`` with every terminal control character replaced by its visible escape (``ESC`` -> ``\\x1b``),
    and the zero-width joiners and spaces too (``\\u200d``).

    Tab and newline are kept unless ``one_line`` (then they become ``\\t`` and ``\\n`` too, for one-line
    messages such as an error line or a table cell).
    """
    return str(text).translate(_TERMINAL[1] if one_line else _TERMINAL[0])


def html_safe(text: object, one_line: bool = False) -> str:
    """``text`` for an HTML page: control and bidi characters as their visible escapes, as :func:`terminal_safe`
    gives them (a bidi override would make the page show other text than the tokens explained), then
    HTML-escaped, quotes included; zero-width characters are kept (a browser joins an emoji family as the text
    means), and so is a carriage return (a line break there, as a file with Windows line endings means it).
    ``one_line``: tab, newline and carriage return too (a token of its own: ``\\n``)."""
    return html.escape(str(text).translate(_ONE_LINE_HTML if one_line else _HTML), quote=True)
