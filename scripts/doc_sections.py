"""A section of a markdown document, written by a reproduction script: the section starting at its heading is
replaced up to the next ``## `` heading, or appended when the document has none."""

from __future__ import annotations

from pathlib import Path


def replace_section(doc: Path, heading: str, lines: list[str]) -> None:
    """Write ``lines`` (starting with ``heading``) into ``doc`` in place of its section under ``heading``."""
    text = doc.read_text(encoding="utf-8")
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    else:
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + "\n".join(lines) + ("" if nxt < 0 else text[nxt:])
    doc.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
