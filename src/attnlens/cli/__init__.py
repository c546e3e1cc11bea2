"""The ``attnlens`` command line: one module per subcommand, each with ``add_parser`` and ``run``.

User mistakes (:class:`~attnlens.errors.AttnLensError`, missing files) print one line and exit with status 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Sequence

from ..errors import AttnLensError
from ..safetext import terminal_safe

# Subcommand modules under attnlens.cli; each defines add_parser(subparsers) and run(args) -> int.
SUBCOMMANDS = ["explain", "benchmark", "train", "report"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlens",
        description="Explain Transformer predictions through their attention, and measure faithfulness.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"{__name__}.{name}")
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnlens`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    format_warning = warnings.formatwarning
    # warnings quote texts, labels and paths: print them with control characters escaped
    warnings.formatwarning = lambda *a, **k: terminal_safe(format_warning(*a, **k))
    try:
        return int(args._run(args) or 0)
    except (AttnLensError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        if args.debug:
            raise
        print(f"attnlens: error: {terminal_safe(exc, one_line=True)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnlens: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = format_warning


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
