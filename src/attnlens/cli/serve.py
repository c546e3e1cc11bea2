"""``attnlens serve``: explore explanations in the browser (a local web app; docs/serve.md)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import webbrowser
from pathlib import Path
from typing import Any

from ..errors import InputError, ModelError
from ..viz.safetext import terminal_safe
from . import add_placement_options, placement
from .explain import MODEL_ENV, default_model

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
STOP_GRACE_SECONDS = 2.0  # how long Ctrl+C waits for a cancelled computation to reach its next progress report


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="explore explanations in the browser (a local web app)",
        description="Serve an interactive explorer: explanations of several methods side by side with their "
                    "faithfulness, the layer and head views, generation step by step, the sources of an answer, "
                    "and benchmark results.",
    )
    p.add_argument("--model", action="append", metavar="[NAME=]MODEL",
                   help="a model directory or hub id to serve, loaded once (repeat for several; the page names it "
                        "NAME, default the folder's name); default $ATTNLENS_MODEL")
    p.add_argument("--results", action="append", default=[], metavar="DIR",
                   help="a folder of `attnlens benchmark` results (or a folder of such folders) the page may open")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--allow-remote", action="store_true",
                   help="needed to bind a --host other than this machine: anyone who reaches it can run the models")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    p.add_argument("--max-chars", type=int, default=20_000,
                   help="longest text a request may send, in characters (default: 20000)")
    p.add_argument("--max-texts", type=int, default=32, help="most texts one request may explain (default: 32)")
    p.add_argument("--attention", help="BART-like models: encoder (default), decoder or cross")
    p.add_argument("--max-length", type=int, help="truncate inputs to this many tokens")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="memory each computation plans for, e.g. 4GB or 512MiB (default 4GiB); the server runs one "
                        "computation at a time, whatever its model, and caches at most as much again in results "
                        "(1 GiB at most)")
    add_placement_options(p)
    return p


def model_specs(given: list[str] | None) -> dict[str, str]:
    """``NAME=MODEL`` / ``MODEL`` options as name -> model, names unique."""
    if not given:
        default = default_model()
        if default is None:
            raise ModelError(f"no model: pass --model M or set ${MODEL_ENV}")
        given = [default]
    specs: dict[str, str] = {}
    for item in given:
        name, sep, model = item.partition("=")
        if not sep or not name.strip() or Path(item).exists():
            name, model = Path(item.rstrip("/")).name or item, item
        if not model.strip():
            raise ModelError(f"--model {item}: give a model directory or hub id")
        if name in specs:
            raise InputError(f"two models are named {name!r}: name them apart as --model NAME=MODEL")
        specs[name.strip()] = model
    return specs


def check_args(args: argparse.Namespace) -> int:
    """The memory budget, after checking every option (a mistake is one line, before any model loads)."""
    from ..core.memory import parse_budget

    budget = parse_budget(args.memory_budget)
    if args.host not in LOCAL_HOSTS and not args.allow_remote:
        raise InputError(f"--host {args.host} would let other machines run the models: add --allow-remote to mean it")
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be 0..65535, got {args.port}")
    for name in ("max_chars", "max_texts"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1")
    return budget


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .. import Explainer
    from ..serve import Limits, create_app
    from ..serve.benchmarks import check_roots

    budget = check_args(args)
    specs = model_specs(args.model)
    roots = check_roots(args.results)
    device, dtype = placement(args)
    explainers = {}
    for name, model in specs.items():
        print(f"loading {terminal_safe(name, one_line=True)} ...", file=sys.stderr)
        explainers[name] = Explainer.from_pretrained(model, attention=args.attention, max_length=args.max_length,
                                                     device=device, dtype=dtype)
    local = args.host in LOCAL_HOSTS
    if not local:
        print(f"attnlens: warning: serving on {terminal_safe(args.host, one_line=True)}: anyone who can reach this "
              "address can run the models and read the --results folders (no authentication)", file=sys.stderr)
    app = create_app(explainers, results=roots, limits=Limits(max_chars=args.max_chars, max_texts=args.max_texts),
                     allowed_hosts=[*LOCAL_HOSTS, "[::1]"] if local else None, memory_budget=budget)
    sock = _bind(args.host, args.port)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{sock.getsockname()[1]}/"
    print(f"attnlens serve: {url} (Ctrl+C stops)", file=sys.stderr, flush=True)
    if args.open:
        webbrowser.open(url)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    jobs = app.state.serve.jobs
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while jobs.running() and time.monotonic() < deadline:  # a cancelled job stops at its next progress report
        time.sleep(0.1)
    if jobs.running():  # a computation between two progress reports (a long perturbation method): leave it
        print("attnlens serve: stopped; the computation under way was abandoned", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (``port`` 0: a free one), refused in one line when it cannot be had."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
    except OSError as exc:
        raise InputError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return sock
