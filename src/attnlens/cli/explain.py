"""``attnlens explain``: explain texts with any methods; terminal, HTML, JSON or JSON Lines output."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..data import iter_jsonl
from ..errors import InputError, ModelError

FORMATS = ("terminal", "html", "json", "jsonl")
DEFAULT_MODEL_NAME = "minilm-sst2"


def default_model() -> str | None:
    """``$ATTNLENS_MODEL``, else the offline reference model ``../shared/models/minilm-sst2`` found next to the
    working directory or next to this checkout."""
    env = os.environ.get("ATTNLENS_MODEL")
    if env:
        return env
    repo = Path(__file__).resolve().parents[3]
    for base in (Path.cwd(), repo):
        candidate = base.parent / "shared" / "models" / DEFAULT_MODEL_NAME
        if candidate.is_dir():
            return str(candidate)
    return None


def read_texts(path: str) -> list[Any]:
    """Texts from a file: one per line, or JSON Lines with ``text`` or ``text_a`` + ``text_b`` per line."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"--file {path}: no such file")
    if p.is_dir():
        raise InputError(f"--file {path}: is a directory")
    try:
        lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--file {path}: cannot read it ({exc})") from None
    if not lines:
        raise InputError(f"--file {path}: the file holds no texts")
    if not lines[0].lstrip().startswith("{"):
        return [line.strip() for line in lines]
    texts: list[Any] = []
    for number, row in iter_jsonl(p, what=f"--file {path}"):
        if isinstance(row.get("text"), str):
            texts.append(row["text"])
        elif isinstance(row.get("text_a"), str) and isinstance(row.get("text_b"), str):
            texts.append((row["text_a"], row["text_b"]))
        else:
            raise InputError(f"--file {path}, line {number}: no \"text\" (or \"text_a\" and \"text_b\") field")
    return texts


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "explain",
        help="explain texts with attention-based methods",
        description="Explain a sequence classifier's predictions with attention-based (and gradient) methods.",
    )
    p.add_argument("texts", nargs="*", help="texts to explain (or use --file)")
    p.add_argument("--file", help="one text per line, or JSON Lines with text / text_a + text_b")
    p.add_argument("--model", help="HF model directory or hub id (default: ../shared/models/minilm-sst2)")
    p.add_argument("--methods", default="all", help="comma-separated method ids, or 'all' (default)")
    p.add_argument("--target", help="class index or label name to explain (default: the predicted class)")
    p.add_argument("--target-kind", default="logit", choices=["logit", "probability", "loss"])
    p.add_argument("--attention", help="BART-like models: encoder (default), decoder or cross")
    p.add_argument("--format", default="terminal", choices=FORMATS)
    p.add_argument("--out", help="output file (json/jsonl/html; default: stdout, or explanations.html for html)")
    p.add_argument("--html", metavar="PATH", help="also write an HTML page (with --format terminal)")
    p.add_argument("--plot", metavar="PATH", help="also save a token heatmap of the first input (.png or .svg)")
    p.add_argument("--head-view", metavar="PATH", help="also write an interactive attention view (layer x head) of "
                   "the first input as HTML")
    p.add_argument("--words", action="store_true", help="aggregate subword scores to words (sum)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, help="truncate inputs to this many tokens")
    p.add_argument("--no-truncation", action="store_true", help="fail on over-long inputs instead of cutting them")
    p.add_argument("--top-k", type=int, default=5, help="tokens per method in the terminal table")
    return p


def run(args: argparse.Namespace) -> int:
    from .. import Explainer
    from ..explanation import save_explanations
    from ..methods import resolve_methods

    methods = resolve_methods(args.methods)  # fail on a typo before loading anything

    texts: list[Any] = list(args.texts)
    if args.file:
        texts += read_texts(args.file)
    if not texts:
        raise InputError("nothing to explain: give texts as arguments or --file FILE")
    if args.model is not None and not args.model.strip():  # not silently the default model
        raise ModelError("--model is empty: give a model directory or hub id")
    model = args.model or default_model()
    if model is None:
        raise ModelError("no --model given and the default ../shared/models/minilm-sst2 was not found")
    target: Any = args.target
    if target is not None and target.lstrip("-").isdigit():
        target = int(target)
    explainer = Explainer.from_pretrained(model, attention=args.attention, max_length=args.max_length)
    exps = explainer.explain(
        texts,
        methods=methods,
        target=target,
        target_kind=args.target_kind,
        batch_size=args.batch_size,
        truncation=not args.no_truncation,
        progress=len(texts) > args.batch_size,
    )
    if args.words:
        exps = [e.to_words() for e in exps]

    if args.format == "terminal":
        from ..viz.terminal import print_explanations

        print_explanations(exps, k=args.top_k)
    elif args.format in ("json", "jsonl"):
        if args.format == "json":
            payload = json.dumps([e.to_dict() for e in exps], indent=1)
            _write(args.out, payload + "\n")
        elif args.out:
            save_explanations(exps, args.out)
        else:
            for e in exps:
                sys.stdout.write(json.dumps(e.to_dict()) + "\n")
    if args.plot:
        from ..viz.plots import plot_token_heatmap

        plot_token_heatmap(exps[0], path=args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.head_view:
        from ..viz.headview import attention_view_html

        tokens, special, attentions = explainer.attention_maps(texts[0])
        Path(args.head_view).write_text(
            attention_view_html(tokens, attentions, special, title=f"attention of {model} ({explainer.stream})"),
            encoding="utf-8",
        )
        print(f"wrote {args.head_view}", file=sys.stderr)
    html_path = args.out if args.format == "html" else args.html
    if args.format == "html" and html_path is None:
        html_path = "explanations.html"
    if html_path:
        from ..viz.html import explanations_html

        Path(html_path).write_text(explanations_html(exps, title=f"attnlens: {model}"), encoding="utf-8")
        print(f"wrote {html_path}", file=sys.stderr)
    return 0


def _write(path: str | None, text: str) -> None:
    if path:
        Path(path).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
