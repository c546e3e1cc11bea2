"""The one check of output paths, done before any work so that a run never fails at its very end."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import InputError


def check_output_path(path: str | os.PathLike[str], option: str, *, directory: bool) -> Path:
    """``path`` if it can be written as a file (``directory=False``) or a folder; else an :class:`InputError`.

    Refuses an empty path, a path whose nearest existing ancestor is a file ("out.txt/x"), a file where a folder
    is wanted, a folder where a file is wanted, and a place without write permission. Missing parent folders are
    fine (callers create them). ``option`` names the path in the message (``"--out"``, ``"results directory"``).
    """
    if not str(path).strip():
        raise InputError(f"{option}: the path is empty")
    p = Path(path).expanduser()
    if p.exists():
        if directory and not p.is_dir():
            raise InputError(f"{option} {path} is an existing file; give a directory (it is created if missing)")
        if not directory and p.is_dir():
            raise InputError(f"{option} {path} is a directory; give a file name")
    existing = next(q for q in (p, *p.parents) if q.exists())  # the first part that exists
    if existing != p and not existing.is_dir():
        raise InputError(f"{option} {path} cannot be created: {existing} is a file, not a directory")
    if not os.access(existing if existing.is_dir() else existing.parent, os.W_OK | os.X_OK):
        raise InputError(f"{option} {path} cannot be written: no write permission in {existing}")
    return p


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` (UTF-8) through a temporary file in the same folder, renamed into place, so
    an interrupted run never leaves a half-written file; missing parent folders are created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".attnlens-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
