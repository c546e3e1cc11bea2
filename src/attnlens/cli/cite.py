"""``attnlens cite``: which sources of a context an LLM's answer came from, by each method.

Example::

    attnlens cite --model smollm2 --context-file report.txt --query "Who founded the company?" \\
        --sources sentence --methods attngate,attnlrp,loo --format html --out cite.html
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from ..errors import InputError
from . import (
    add_placement_options,
    check_at_least,
    method_options,
    placement,
    read_text_file,
    say_written,
    write_output,
)

FORMATS = ("terminal", "html", "json")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cite",
        help="which part of the context an LLM's answer came from",
        description=(
            "Attribute a language model's answer to the sources of its context (sentences, passages, lines): "
            "token-level methods summed per source, ablations (loo, contextcite), learned attention (at2, at2lrp) "
            "and attention gates (attngate). The answer is generated greedily unless --answer gives it."
        ),
    )
    p.add_argument("--model", default="smollm2",
                   help="a causal language model: directory, hub id or shorthand (default: smollm2)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--context", help="the context as text")
    src.add_argument("--context-file", help="a UTF-8 text file holding the context")
    p.add_argument("--query", required=True, help="the question asked about the context")
    p.add_argument("--answer", help="the answer to attribute (default: the model's greedy answer)")
    p.add_argument("--answer-span", metavar="START:END",
                   help="explain only this character span of the answer (e.g. 0:12)")
    p.add_argument("--sources", default="sentence", choices=["sentence", "passage", "line"],
                   help="what a source is (default: sentence; passage = blank-line-separated blocks)")
    p.add_argument("--methods", default=None,
                   help="comma-separated methods: token-level ones (see `attnlens explain --help`) and loo, "
                        "contextcite, at2, at2lrp, attngate; 'all' (default: attngate,attnlrp,loo, leaving out with a "
                        "warning those over --memory-budget at the prompt's length or that cannot run on the model)")
    p.add_argument("--template", help="the user message around {context} and {query}, each once (filled in as "
                                      "they are; other text, braces included, stays as written, but \\n, \\t "
                                      "and \\\\ are read as a newline, a tab and a backslash; default: "
                                      "'Context: {context}\\n\\nQuery: {query}')")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="use the tokenizer's chat template (default when it has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="no chat template: the plain prompt")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="longest generated answer (default: 64); not with --answer")
    p.add_argument("--ablation", default=None, choices=["remove", "mask"],
                   help="how loo and contextcite take a source out: remove its characters and re-tokenize (default), "
                        "or mask its tokens from attention")
    p.add_argument("--n-ablations", type=int, default=None, help="contextcite: random ablations (default: 64)")
    p.add_argument("--at2-weights", default=None,
                   help="at2 or at2lrp: a weights file from `attnlens fit-at2` (default: the weights shipped for "
                        "the model)")
    p.add_argument("--options", default=None,
                   help='method options as JSON, e.g. \'{"attngate": {"queries": "all"}, "contextcite": '
                        '{"n_ablations": 32}}\'')
    p.add_argument("--format", default="terminal", choices=FORMATS, help="output format (default: terminal)")
    p.add_argument("--out", help="output file, '-' for standard output (html default: cite.html; json default: "
                                    "standard output); refused with --format terminal")
    p.add_argument("--top", type=int, default=5, help="terminal: sources shown per method (default: 5)")
    p.add_argument("--memory-budget", default=None, help="memory the passes may plan for, e.g. 4GB (default 4GiB)")
    p.add_argument("--per-token", action="store_true",
                   help="also attribute each answer token on its own (JSON token_rows; terminal and HTML: each "
                        "token's top source per method); one more attribution per token")
    p.add_argument("--progress", action="store_true",
                   help="show a progress bar also where stderr is not a terminal (default: at a terminal)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, warnings or notices on stderr (errors "
                   "still print, one line)")
    add_placement_options(p)
    return p


def _answer_span(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", value)
    if not m:
        raise InputError(f"--answer-span {value!r}: give START:END character offsets, e.g. 0:12")
    return int(m.group(1)), int(m.group(2))


def run(args: argparse.Namespace) -> int:
    from .. import Explainer
    from ..core.memory import parse_budget
    from ..paths import STDOUT, check_not_an_input, check_output_path
    from ..sources.attribute import check_options, split_methods
    from ..sources.methods import SOURCE_METHODS

    token_methods, source_methods = split_methods(args.methods)  # a typo fails before anything loads
    budget = parse_budget(args.memory_budget)
    span = _answer_span(args.answer_span)
    if args.template is not None:
        args.template = unescape(args.template)
    if args.max_new_tokens is not None:
        check_at_least("--max-new-tokens", args.max_new_tokens, 1)
        if args.answer is not None:
            raise InputError("--max-new-tokens bounds a generated answer: leave it out with --answer")
    else:
        args.max_new_tokens = 64
    if args.ablation is not None and not any(SOURCE_METHODS[m].ablates for m in source_methods):
        raise InputError("--ablation sets how loo and contextcite take a source out: add one of them to --methods")
    args.ablation = args.ablation or "remove"
    if args.progress and args.quiet:
        raise InputError("--progress shows a bar that --quiet turns off: give one of them")
    if args.top < 1:
        raise InputError(f"--top must be at least 1, got {args.top}")
    if args.format == "terminal" and args.out is not None:
        raise InputError("--out writes the html or json format: add --format html or --format json")
    options = method_options(args.options)
    flags = {}
    if args.n_ablations is not None:
        if "contextcite" not in source_methods:
            raise InputError("--n-ablations is an option of contextcite: add it to --methods")
        flags[("contextcite", "n_ablations", "--n-ablations")] = args.n_ablations
    if args.at2_weights is not None:
        learned = [m for m in ("at2", "at2lrp") if m in source_methods]
        if len(learned) != 1:
            raise InputError("--at2-weights is the weights file of at2 or at2lrp: name exactly one of them in "
                             "--methods")
        flags[(learned[0], "weights", "--at2-weights")] = args.at2_weights
    for (method, name, flag), value in flags.items():
        if name in options.get(method, {}):
            raise InputError(f"{flag} and --options both set {method}'s {name}: give it once")
        options.setdefault(method, {})[name] = value
    if options:  # names and the values no model is needed to judge
        check_options(args.methods, options)
    if args.format == "html" and args.out is None:
        args.out = "cite.html"
    out = None if args.out in (None, STDOUT) else check_output_path(args.out, "--out", directory=False)
    check_not_an_input(args.out, "--out", {"--context-file": args.context_file})
    context = args.context if args.context_file is None else read_text_file(args.context_file, "--context-file")
    if not context or not context.strip():
        raise InputError("the context is empty: give the text the answer should be attributed to")
    if not args.query.strip():
        raise InputError("the query is empty: give the question the answer responds to")
    if args.answer is not None and not args.answer.strip():
        raise InputError("--answer is empty: leave it out to let the model answer")
    if not args.model.strip():
        raise InputError("--model is empty: give a model directory, hub id or shorthand")
    device, dtype = placement(args)

    explainer = Explainer.from_pretrained(args.model, device=device, dtype=dtype)
    result = explainer.attribute_context(
        context, args.query, answer=args.answer, sources=args.sources, methods=args.methods, template=args.template,
        chat=args.chat, answer_span=span, max_new_tokens=args.max_new_tokens, ablation=args.ablation,
        options=options, memory_budget=budget, progress=not args.quiet and (args.progress or sys.stderr.isatty()),
        per_token=args.per_token,
    )
    if args.format in ("json", "html"):
        write_output(out, json.dumps(result.to_dict(), ensure_ascii=False, indent=1) + "\n"
                     if args.format == "json" else result.to_html())
        say_written(args, out)
        return 0
    result.show(k=args.top)
    return 0


ESCAPES = {"\\n": "\n", "\\t": "\t", "\\\\": "\\"}


def unescape(text: str) -> str:
    """``text`` with ``\\n``, ``\\t`` and ``\\\\`` read as a newline, a tab and a backslash (a template typed on
    one command line); any other backslash stays as written."""
    return re.sub(r"\\[nt\\]", lambda m: ESCAPES[m.group(0)], text)
