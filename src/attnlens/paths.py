"""Output paths: the one check, done before any work so that a run never fails at its very end, and the one way
of writing a file (atomically, so that an interrupted run leaves nothing half-written)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import InputError

STDOUT = "-"  # an output path that means standard output, where a command takes it (explain and cite --out)


def check_output_path(path: str | os.PathLike[str], option: str, *, directory: bool) -> Path:
    """``path`` if it can be written as a file (``directory=False``) or a folder; else an :class:`InputError`.

    Refuses an empty path, a path whose nearest existing ancestor is a file ("out.txt/x"), a file where a folder
    is wanted, a folder where a file is wanted, and a place where no file can be created (no write permission, a
    read-only file system; a nameless temporary file is created there and removed to find out). Missing parent
    folders are fine (callers create them). ``option`` names the path in the message (``"--out"``, ``"results
    directory"``).
    """
    if not str(path).strip():
        raise InputError(f"{option}: the path is empty")
    if str(path) == STDOUT:
        raise InputError(f"{option} -: give a {'directory' if directory else 'file'} name; standard output is not "
                         "one here")
    p = Path(path).expanduser()
    if p.exists():
        if directory and not p.is_dir():
            raise InputError(f"{option} {path} is an existing file; give a directory (it is created if missing)")
        if not directory and p.is_dir():
            raise InputError(f"{option} {path} is a directory; give a file name")
    existing = next(q for q in (p, *p.parents) if q.exists())  # the first part that exists
    if existing != p and not existing.is_dir():
        raise InputError(f"{option} {path} cannot be created: {existing} is a file, not a directory")
    folder = existing if existing.is_dir() else existing.parent
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{option} {path} cannot be written: no write permission in {existing}")
    try:  # permissions do not tell everything (root, read-only file systems, /proc): a file must be creatable there
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(f"{option} {path} cannot be written: no file can be created in {folder} "
                         f"({exc.strerror or exc})") from None
    return p


def check_not_an_input(output: str | os.PathLike[str] | None, option: str,
                       inputs: dict[str, str | os.PathLike[str] | None]) -> None:
    """:class:`InputError` where the output ``output`` (named ``option``) is one of the command's input files
    (``{option: path}``): writing it would destroy what the command reads."""
    if output is None or str(output) == STDOUT:
        return
    target = Path(output).expanduser().resolve()
    for name, path in inputs.items():
        if path is not None and str(path) != "-" and Path(path).expanduser().resolve() == target:
            raise InputError(f"{option} {output} is the {name} file this command reads; give another output file")


def _make_parents(target: Path) -> None:
    """``target``'s missing parent folders, created; :class:`InputError` in one line where a part of the way is a
    file."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = next((q for q in target.parents if q.exists() and not q.is_dir()), target.parent)
        raise InputError(f"{target} cannot be written: {blocking} is a file, not a directory") from None


@contextmanager
def atomic_output(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary file beside ``path`` (its missing parent folders created) for the block to write; when the block
    ends it replaces ``path`` in one step (:func:`os.replace`), and when it raises (Ctrl-C included) it is removed:
    ``path`` is never half-written, and a file already there stays as it was."""
    target = Path(path).expanduser()
    _make_parents(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; a written file gets the usual mode
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_directory(path: str | os.PathLike[str], last: str | None = None,
                     replaces: Callable[[str], bool] | None = None) -> Iterator[Path]:
    """A temporary folder beside ``path`` for the block to fill; when the block ends its entries are moved into
    ``path`` (created if missing), each in one step, the file named ``last`` at the end (and removed from ``path``
    before the others move, so that a folder holding it is a finished save); when the block raises (Ctrl-C
    included) the temporary folder is removed and ``path`` is left as it was.

    ``replaces(name)``: whether an entry already in ``path`` belongs to what the block writes (an earlier save),
    so that it is removed when the new entries move in, even where the new save has no file of that name; other
    entries stay. Moved files get the usual mode (``0o666`` less the umask), whatever the writer gave them."""
    target = Path(path).expanduser()
    _make_parents(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent))
    try:
        yield staging
        target.mkdir(exist_ok=True)
        if last is not None:
            (target / last).unlink(missing_ok=True)
        if replaces is not None:
            for old in target.iterdir():
                if not replaces(old.name) or (staging / old.name).exists():
                    continue
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old)
                else:
                    old.unlink()
        mode = 0o666 & ~_umask()
        for item in sorted(staging.iterdir(), key=lambda f: f.name == last):
            if item.is_file():
                os.chmod(item, mode)
            if item.is_dir() and (target / item.name).is_dir():
                shutil.rmtree(target / item.name)
            os.replace(item, target / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_output`, so an interrupted run never leaves a
    half-written file; missing parent folders are created."""
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path).expanduser()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 digest of a file's bytes (hex), read in blocks: what a record names its input file by."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_utf8(path: str | os.PathLike[str], what: str) -> str:
    """The text of a UTF-8 file of ``what`` (e.g. ``"attnlens results"``), a leading byte-order mark left out (an
    editor wrote it, it is not text); :class:`InputError` in one line for a missing file, a folder, or bytes that
    are not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"cannot read {path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"cannot read {path}: it is a folder") from None
    except UnicodeDecodeError:
        raise InputError(f"{path} is not a UTF-8 text file of {what}") from None
