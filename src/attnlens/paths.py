"""Checks of output paths, done before any work so that a run never fails at its very end."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import InputError


def check_output_path(path: str | os.PathLike[str], option: str, *, directory: bool) -> Path:
    """``path`` if it can be written as a file (``directory=False``) or a folder; else an :class:`InputError`.

    Refuses a path whose nearest existing ancestor is a file ("out.txt/x"), a file where a folder is wanted and a
    folder where a file is wanted. Missing parent folders are fine (callers create them).
    """
    p = Path(path)
    if p.exists():
        if directory and not p.is_dir():
            raise InputError(f"{option} {path} is a file; give a directory (it is created if missing)")
        if not directory and p.is_dir():
            raise InputError(f"{option} {path} is a directory; give a file name")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{option} {path}: {parent} is a file, not a directory")
            break
    return p
