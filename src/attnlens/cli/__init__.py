"""The ``attnlens`` command line: one module per subcommand, each with ``add_parser`` and ``run``.

User mistakes (:class:`~attnlens.errors.AttnLensError`, missing files, bad options) print one line and exit with
status 2; warnings print one line each (a subcommand's ``--quiet``: none); ``--debug`` shows tracebacks and full
warnings instead. Ctrl-C stops with status 130; the files a command writes appear whole or not at all
(:func:`attnlens.paths.atomic_output`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import IO, Any, NoReturn

from .. import __version__
from ..errors import AttnLensError, InputError, exception_line
from ..viz.safetext import terminal_safe

# Subcommand modules under attnlens.cli; each defines add_parser(subparsers) and run(args) -> int.
SUBCOMMANDS = ["explain", "cite", "benchmark", "fit-at2", "train", "report", "serve"]
PLUGINS = "ATTNLENS_PLUGINS"  # modules or .py files every command imports first: methods and architectures of one's own


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (subcommand parsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``attnlens`` argument parser with every subcommand."""
    parser = _Parser(
        prog="attnlens",
        description="Explain Transformer predictions through their attention, and measure faithfulness.",
    )
    parser.add_argument("--version", action="version", version=f"attnlens {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnlens`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return int(exc.code or 0)
    args.argv = argv  # as given: a command that starts copies of itself (benchmark --processes) passes it on
    format_warning = warnings.formatwarning
    # warnings quote texts, labels and paths: print them with control characters escaped (also under --debug)
    warnings.formatwarning = lambda *a, **k: terminal_safe(format_warning(*a, **k))
    try:
        with warnings.catch_warnings():
            if not args.debug:
                warnings.showwarning = _show_warning
            if getattr(args, "quiet", False):
                warnings.simplefilter("ignore")
            load_plugins()
            return int(args._run(args) or 0)
    except (AttnLensError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        if args.debug:
            raise
        print(f"attnlens: error: {terminal_safe(exc, one_line=True)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        from ..evaluation.parallel import QUIET_TABLE

        if not os.environ.get(QUIET_TABLE):  # a process `benchmark --processes` started: the command says it once
            print("attnlens: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = format_warning


def load_plugins() -> None:
    """Import what ``$ATTNLENS_PLUGINS`` names (comma-separated module names, or paths of ``.py`` files), once per
    process: modules that register methods (:func:`attnlens.register`) or architectures of one's own, so that
    every command can name them. :class:`InputError` (one line) for one that does not import."""
    for entry in filter(None, (e.strip() for e in os.environ.get(PLUGINS, "").split(","))):
        try:
            if entry.endswith(".py"):
                _import_file(entry)
            else:
                importlib.import_module(entry)
        except Exception as exc:
            raise InputError(f"${PLUGINS} names {entry}, which does not import ({exception_line(exc)})") from exc


def _import_file(path: str) -> None:
    """Run the module file ``path`` once per process (a second call finds it in ``sys.modules``)."""
    import importlib.util
    from pathlib import Path

    file = Path(path).expanduser().resolve()
    name = f"attnlens_plugin_{abs(hash(str(file))):x}"
    if name in sys.modules:
        return
    if not file.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def add_placement_options(p: argparse.ArgumentParser, *, dtype: bool = True) -> None:
    """``--device`` and ``--dtype``: where a command runs its model and in which precision."""
    p.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:N, mps or auto (the first of cuda, mps, cpu this machine has); default cpu")
    if dtype:
        p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="precision the model runs in (default: the checkpoint's)")


def placement(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(device, dtype)`` of ``--device``/``--dtype``, checked before anything loads (``None``: not given)."""
    from ..models.loading import resolve_device, resolve_dtype

    return resolve_device(args.device, "--device"), resolve_dtype(getattr(args, "dtype", None), "--dtype")


def method_options(text: str | None, flag: str = "--options") -> dict[str, dict[str, Any]]:
    """The method options a command's ``--options`` JSON gives (``{}`` when not given); :class:`InputError` for
    text that is not JSON or not an object of method ids to option objects."""
    import json

    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{flag} is not valid JSON: {exc.msg}") from None
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise InputError(f'{flag} must map method ids to option objects, e.g. {{"attcat": {{"alpha": "cls"}}}}')
    return options


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that gives an option's default where its text does not already say it, and where there is one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default in (None, False, [], argparse.SUPPRESS) or "default" in text
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def check_at_least(flag: str, value: int | None, least: int) -> None:
    """:class:`InputError` in one line when the integer option ``flag`` was given below ``least``."""
    if value is not None and value < least:
        raise InputError(f"{flag} must be >= {least}, got {value}")


def check_seed(seed: int, flag: str = "--seed") -> None:
    """:class:`InputError` in one line for a seed NumPy's generators refuse."""
    if not 0 <= seed < 2**32:
        raise InputError(f"{flag} must be in 0..2**32-1, got {seed}")


def read_text_file(path: str, flag: str) -> str:
    """The UTF-8 text of the file a command's ``flag`` names, verbatim (Windows line endings kept, so character
    offsets into it are offsets into the file's text; a leading byte-order mark is not part of the text);
    :class:`InputError` in one line when it is missing, a folder, unreadable or not UTF-8."""
    from pathlib import Path

    p = Path(path)
    if not p.exists():
        raise InputError(f"{flag} {path}: no such file")
    if p.is_dir():
        raise InputError(f"{flag} {path}: is a directory")
    try:
        with p.open(encoding="utf-8-sig", newline="") as f:
            return f.read()
    except UnicodeDecodeError:
        raise InputError(f"{flag} {path}: not UTF-8 text") from None
    except OSError as exc:
        raise InputError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: IO[str] | None = None, line: str | None = None) -> None:
    """A warning as one line (no source location), e.g. which methods "all" skipped and why."""
    print(f"attnlens: warning: {terminal_safe(message, one_line=True)}", file=file or sys.stderr)


def write_output(path: str | None, text: str) -> None:
    """``text`` to the file ``path`` (atomically: Ctrl-C leaves no half-written file), else (``None`` or ``-``) to
    standard output."""
    from ..paths import STDOUT, atomic_write_text

    if path and path != STDOUT:
        atomic_write_text(path, text)
    else:
        sys.stdout.write(text)


def say_written(args: argparse.Namespace, path: str | None) -> None:
    """Say on stderr that the file ``path`` was written (stdout may carry the output), unless ``--quiet`` or the
    output went to standard output."""
    from ..paths import STDOUT

    if not args.quiet and path and path != STDOUT:
        print(f"wrote {terminal_safe(path, one_line=True)}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
