"""``attnlens explain``: explain texts with any methods; terminal, HTML, JSON or JSON Lines output."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from ..data import PAIR_KEYS, row_text, text_lines
from ..errors import InputError, ModelError
from ..paths import STDOUT, check_not_an_input, check_output_path
from . import add_placement_options, method_options, placement, read_text_file, say_written, write_output

FORMATS = ("terminal", "html", "json", "jsonl")
MODEL_ENV = "ATTNLENS_MODEL"


def default_model() -> str | None:
    """The model of ``$ATTNLENS_MODEL`` (a directory, hub id or shorthand), ``None`` when it is not set."""
    return os.environ.get(MODEL_ENV) or None


def read_texts(path: str) -> list[Any]:
    """Texts from a file: one per line, or JSON Lines with ``text`` or a sentence pair per line (``text_a`` +
    ``text_b``, or the other field names :data:`attnlens.data.PAIR_KEYS` lists, as ``load_dataset`` reads).

    The file is JSON Lines when its first non-blank line is a JSON object, plain text lines otherwise (so a
    text such as ``{braces} are fun`` is a text); a file that mixes both, or holds one multi-line JSON
    document, is refused with the line to fix.
    """
    content = read_text_file(path, "--file")
    lines = [(n, line) for n, line in enumerate(text_lines(content), 1) if line.strip()]
    if not lines:
        raise InputError(f"--file {path}: the file holds no texts")
    rows = [_json_object(line) for _, line in lines]
    jsonl = rows[0] is not None
    if not jsonl and len(lines) > 1 and _is_json_document(content):
        raise InputError(
            f"--file {path}: holds one JSON document; give one text per line, or JSON Lines (one object per line)"
        )
    texts: list[Any] = []
    for (number, line), row in zip(lines, rows, strict=True):
        if (row is not None) != jsonl:
            kind = "not a JSON object, but line {} is one" if jsonl else "a JSON object, but line {} is plain text"
            raise InputError(
                f"--file {path}, line {number}: {kind.format(lines[0][0])}; a file holds JSON Lines throughout "
                "or plain text lines throughout"
            )
        where = f"--file {path}, line {number}"
        if row is None:
            texts.append(line.strip())
            continue
        named = [k for keys in PAIR_KEYS for k in keys if k in row]
        pairs = [keys for keys in PAIR_KEYS if all(k in row for k in keys)]
        if "text" in row and named:
            raise InputError(f'{where}: holds both "text" and "{named[0]}"; give one text or one pair')
        if len(pairs) > 1:
            raise InputError(f'{where}: holds two pairs ({" and ".join("/".join(p) for p in pairs)}); give one')
        half = next(((a, b) for a, b in PAIR_KEYS if (a in row) != (b in row)), None)
        if half is not None:
            there, missing = half if half[0] in row else half[::-1]
            raise InputError(f'{where}: "{there}" without "{missing}"; a pair needs both')
        if "text" not in row and not pairs:
            raise InputError(f'{where}: no "text" field (or a pair: {", ".join("/".join(p) for p in PAIR_KEYS)})')
        parts = [row_text(row, key, where) for key in (pairs[0] if pairs else ("text",))]
        if any(not p.strip() for p in parts):
            raise InputError(f"{where}: the text is empty or whitespace only")
        texts.append(parts[0] if len(parts) == 1 else tuple(parts))
    return texts



WORD_PREFIX = "word:"


def _token_choice(token: str) -> int | str:
    """``--token``: digits are a position among the tokens, ``word:W`` the word ``W`` (digits too), any other text
    a word of the input."""
    if token.startswith(WORD_PREFIX):
        word = token[len(WORD_PREFIX):]
        if not word.strip():
            raise InputError(f"--token {token!r} names no word; pass --token word:W with the word after the colon")
        return word
    if re.fullmatch(r"\s*-\d+\s*", token):
        raise InputError(f"--token {token}: a position counts the tokens from 0 (use word:{token.strip()} for the "
                         "word)")
    return int(token) if token.strip().isdigit() else token


def _runs_long(methods: str | None) -> bool:
    """Whether the methods asked for include one that runs many passes per input (the registry's
    ``many_passes``: integrated gradients, value zeroing, the perturbation baselines; "all" includes them): a
    progress bar even when stderr is not a terminal. Unknown names are left to the explainer to refuse."""
    from ..methods import get_method, list_methods

    names = {m.strip() for m in str(methods or "").split(",")}
    names = set(list_methods()) if "all" in names else names & set(list_methods())
    return any(get_method(m).many_passes for m in names)


def _json_object(line: str) -> dict[str, Any] | None:
    """The JSON object a line holds, or None when the line is not one."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _is_json_document(content: str) -> bool:
    """Whether the whole file is one JSON array or object (e.g. pretty-printed ``--format json`` output)."""
    try:
        return isinstance(json.loads(content), (list, dict))
    except ValueError:
        return False


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "explain",
        help="explain texts with attention-based methods",
        description="Explain a sequence classifier's predictions (or, with --generate, what a language model "
                    "generates) with attention-based (and gradient) methods.",
    )
    p.add_argument("texts", nargs="*", help="texts to explain (or use --file)")
    p.add_argument("--file", help="JSON Lines with text (or a pair: text_a + text_b, premise + hypothesis, "
                   "question1 + question2, sentence1 + sentence2) per line when the first non-blank line "
                   "is a JSON object, else one text per line; a file mixing both is refused")
    p.add_argument("--model", help="HF model directory, hub id or shorthand (default: $ATTNLENS_MODEL)")
    p.add_argument("--methods", default="all", help="comma-separated method ids, or 'all' (default: every method "
                   "that applies to the model; the others are skipped with a notice)")
    p.add_argument("--target", help="class index or label name to explain (default: the predicted class); QA models: "
                   "START,END token positions of the answer span")
    p.add_argument("--token", help="token classifiers (NER): the token whose label is explained, as a position among "
                   "the tokens or a word of the input (word:W for a word made of digits, e.g. word:2024); --target "
                   "then names the label (default: the predicted one)")
    p.add_argument("--target-kind", default="logit", choices=["logit", "probability", "loss"])
    p.add_argument("--attention", help="BART-like models: encoder (default), decoder or cross")
    p.add_argument("--format", default="terminal", choices=FORMATS)
    p.add_argument("--out", help="output file of --format html/json/jsonl, '-' for standard output (default: "
                   "standard output, or explanations.html for html); refused with --format terminal, where --html "
                   "PATH writes a page beside the view")
    p.add_argument("--html", metavar="PATH", help="also write an HTML page (with --format terminal/json/jsonl)")
    p.add_argument("--plot", metavar="PATH", help="also save a token heatmap of the first input (.png or .svg): "
                   "a row per method; with --generate, the step x token heatmap of the first method")
    p.add_argument("--head-view", metavar="PATH", help="also write an interactive attention view (layer x head) of "
                   "the first input as HTML")
    p.add_argument("--words", action="store_true", help="aggregate subword scores to words (sum)")
    p.add_argument("--batch-size", type=int, default=32, help="inputs per batch (default 32)")
    p.add_argument("--max-length", type=int, help="truncate inputs to this many tokens (at least 2)")
    p.add_argument("--no-truncation", action="store_true", help="fail on over-long inputs instead of cutting them")
    p.add_argument("--top-k", type=int, default=None,
                   help="tokens per method in the table of top tokens (terminal and HTML; default 5; a text that "
                        "stands twice is listed with its occurrence: best#1, best#2)")
    p.add_argument("--contrast", help="explain target - contrast: a class index or label name; with --generate, "
                   "the contrast continuation as text (one token per explained token)")
    gen = p.add_argument_group("generation (language models)")
    gen.add_argument("--generate", action="store_true", help="explain every token a language model generates after "
                     "each text (greedy); --target TEXT forces the continuation instead")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (default 8)")
    gen.add_argument("--chat", action="store_true", help="put each prompt through the tokenizer's chat template")
    p.add_argument("--quiet", action="store_true", help="no progress bars, warnings or notices on stderr (errors "
                   "still print, one line)")
    add_memory_options(p)
    p.add_argument("--options", default=None,
                   help='method options as JSON, e.g. \'{"attcat": {"alpha": "cls"}, "globenc": {"normalize": true}}\' '
                        "(an unknown option name is refused with the method's options listed)")
    # integrated gradients' options, also as flags
    p.add_argument("--ig-steps", type=int, help="integratedgradients: a fixed count of points of the path "
                   "integral (with --ig-tolerance: the first count of the adaptive schedule, default 4)")
    p.add_argument("--ig-tolerance", type=float, help="integratedgradients: double the steps per input until the "
                   "relative completeness gap |sum of attributions - (F(x) - F(baseline))| / |F(x) - F(baseline)| "
                   "is at most this (default 0.01 unless --ig-steps is given; the gap is in the JSON output's meta)")
    p.add_argument("--ig-method", metavar="RULE", help="integratedgradients: quadrature rule, riemann_trapezoid "
                   "(default), gausslegendre, riemann_middle, riemann_left or riemann_right")
    add_placement_options(p)
    return p


def add_memory_options(p: argparse.ArgumentParser) -> None:
    """``--memory-budget`` (explain and benchmark)."""
    p.add_argument("--memory-budget", metavar="SIZE", help="memory the passes plan for, e.g. 4GB or 512MiB "
                   "(default 4GiB): long inputs go in smaller batches, integrated gradients' internal batches fit it")


def explain_options(args: argparse.Namespace, methods: list[str]) -> dict[str, dict[str, Any]] | None:
    """The method options of ``--options`` and the ``--ig-*`` flags (``None`` when none is given), each naming a
    method of ``methods``, only known option names of it, and values it accepts (as far as they can be judged
    without a model)."""
    from ..methods import get_method

    options = method_options(args.options)
    for name in options:
        if name not in methods:
            raise InputError(f"--options sets {name}, which --methods leaves out")
    given = [(key, flag, value) for key, flag, value in (("n_steps", "--ig-steps", args.ig_steps),
                                                          ("tolerance", "--ig-tolerance", args.ig_tolerance),
                                                          ("method", "--ig-method", args.ig_method))
             if value is not None]
    if given and "integratedgradients" not in methods:
        raise InputError("--ig-steps/--ig-tolerance/--ig-method set integratedgradients, which --methods leaves out")
    for key, flag, value in given:
        if key in options.get("integratedgradients", {}):
            raise InputError(f"{flag} and --options both set integratedgradients' {key}: give it once")
        options.setdefault("integratedgradients", {})[key] = value
    for name, opts in options.items():  # names and the values no model is needed to judge
        get_method(name).check_options(opts)
    return options or None


OUTPUTS = ("out", "html", "plot", "head_view")  # the options that name a file to write


def check_args(args: argparse.Namespace) -> None:
    """Refuse every option mistake with one line, before the model loads and before anything is written."""
    if args.top_k is not None:
        if args.top_k < 1:
            raise InputError(f"--top-k must be at least 1, got {args.top_k}")
        if args.generate or (args.format not in ("terminal", "html") and not args.html):
            raise InputError("--top-k sets the tables of top tokens, which --format terminal and html and the --html "
                             "page print (not --generate)")
    else:
        args.top_k = 5
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_length is not None and args.max_length < 2:
        raise InputError(f"--max-length must be at least 2 tokens, got {args.max_length}")
    if not args.generate and (args.chat or args.max_new_tokens is not None):
        raise InputError("--chat and --max-new-tokens are for --generate")
    if args.max_new_tokens is None:
        args.max_new_tokens = 8
    if args.generate and args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.generate and args.token is not None:
        raise InputError("--token names the explained token of a token classifier; --generate explains each "
                         "generated token")
    if args.generate and args.words:
        raise InputError("--words is not available with --generate (scores are per token)")
    if args.target_kind == "loss" and args.target is None and not args.generate:
        raise InputError("--target-kind loss explains the loss against a given label: pass it as --target")
    if args.out is not None and args.format == "terminal":
        raise InputError("--out is for --format html/json/jsonl; use --html PATH for a page beside the terminal view")
    if args.html is not None and args.format == "html":
        raise InputError("--html is for the other formats; with --format html, --out PATH names the page")
    seen: dict[Path, str] = {}
    for name in OUTPUTS:
        value = getattr(args, name)
        if value is None or (name == "out" and value == STDOUT):  # --out -: the document to standard output
            continue
        option = "--" + name.replace("_", "-")
        path = check_output_path(value, option, directory=False).resolve()
        check_not_an_input(value, option, {"--file": args.file})
        if path in seen:
            raise InputError(f"{seen[path]} and {option} both name {value}; give each its own file")
        seen[path] = option
    if args.plot is not None:
        from ..viz.plots import FORMATS as PLOT_FORMATS

        if Path(args.plot).suffix.lower() not in PLOT_FORMATS:
            raise InputError(f"--plot {args.plot}: give a .png or .svg file name")


def run(args: argparse.Namespace) -> int:
    from .. import Explainer
    from ..core.memory import parse_budget
    from ..methods import resolve_methods
    from ..results.explanation import explanations_json, save_explanations

    options = explain_options(args, resolve_methods(args.methods))  # fail on a typo before loading anything
    budget = parse_budget(args.memory_budget)
    if args.format == "html" and args.out is None:
        args.out = "explanations.html"
    check_args(args)
    device, dtype = placement(args)

    texts: list[Any] = list(args.texts)
    if args.file:
        texts += read_texts(args.file)
    if not texts:
        raise InputError("nothing to explain: give texts as arguments or --file FILE")
    if args.model is not None and not args.model.strip():  # not silently the default model
        raise ModelError("--model is empty: give a model directory or hub id")
    model = args.model or default_model()
    if model is None:
        raise ModelError(f"no model: pass --model M or set ${MODEL_ENV}")
    if args.generate:
        return _run_generation(args, texts, model, device=device, dtype=dtype, options=options, budget=budget)
    target: Any = args.target
    if target is not None and target.lstrip("-").isdigit():
        target = int(target)
    elif target is not None and re.fullmatch(r"\s*\d+\s*,\s*\d+\s*", target):  # a QA span START,END
        target = tuple(int(x) for x in target.split(","))
    explainer = Explainer.from_pretrained(model, attention=args.attention, max_length=args.max_length,
                                          device=device, dtype=dtype)
    if explainer.head.task == "token":
        if args.token is None:
            raise InputError("this is a token classifier: pass the explained token as --token POSITION or --token WORD "
                             "(and its label as --target, default: the predicted label)")
        target = (_token_choice(args.token), target)
    elif args.token is not None:
        raise InputError(f"--token is for token classifiers; this model is {explainer.head.kind}")
    if explainer.head.task == "qa" and target is not None and not isinstance(target, tuple):
        raise InputError(f"--target {args.target}: a QA model's target is the answer span as START,END, two token "
                         "positions from 0 (e.g. --target 5,7)")
    # the view first: an input whose maps the budget cannot hold is refused before the explanations run
    head_page = _head_view_page(explainer, texts[0], model, budget) if args.head_view else None
    exps = explainer.explain(
        texts,
        methods=args.methods,  # as given: "all" skips the methods that do not apply to this model, with a notice
        target=target,
        target_kind=args.target_kind,
        batch_size=args.batch_size,
        truncation=not args.no_truncation,
        progress=not args.quiet and (len(texts) > args.batch_size or options is not None or sys.stderr.isatty()
                                     or _runs_long(args.methods)),
        contrast=int(args.contrast) if args.contrast and args.contrast.lstrip("-").isdigit() else args.contrast,
        options=options,
        memory_budget=budget,
    )
    if args.words:
        exps = [e.to_words() for e in exps]

    if args.format == "terminal":
        from ..viz.terminal import print_explanations

        print_explanations(exps, k=args.top_k)
    elif args.format in ("json", "jsonl"):
        if args.format == "json":
            payload = json.dumps(explanations_json(exps), indent=1)
            write_output(args.out, payload + "\n")
        elif args.out and args.out != STDOUT:
            save_explanations(exps, args.out)
        else:
            for e in exps:
                sys.stdout.write(json.dumps(e.to_dict()) + "\n")
        if args.out:
            say_written(args, args.out)
    if args.plot:
        from ..viz.plots import plot_token_heatmap

        plot_token_heatmap(exps[0], path=args.plot)
        say_written(args, args.plot)
    if head_page is not None:
        write_output(args.head_view, head_page)
        say_written(args, args.head_view)
    html_path = args.out if args.format == "html" else args.html
    if html_path:
        from ..viz.html import explanations_html

        write_output(html_path, explanations_html(exps, title=f"attnlens: {model}", k=args.top_k))
        say_written(args, html_path)
    return 0


def _head_view_page(explainer: Any, text: Any, model: str, budget: int) -> str:
    """The ``--head-view`` page of ``text`` (its maps dropped once encoded into the page)."""
    from ..results.tokentext import encoding_meta, readable_tokens
    from ..viz.headview import attention_view_html, page_bytes

    tokens, special, attentions = explainer.attention_maps(text, memory_budget=budget, beside=page_bytes)
    return attention_view_html(readable_tokens(tokens, encoding_meta(explainer.tokenizer)), attentions, special,
                               title=f"attention of {model} ({explainer.stream})")


def _run_generation(args: argparse.Namespace, prompts: list[Any], model: str, *, device: Any, dtype: Any,
                    options: dict[str, dict[str, Any]] | None, budget: int) -> int:
    """``--generate``: explain what the model generates after each prompt."""
    from .. import Explainer

    if not all(isinstance(p, str) for p in prompts):
        raise InputError("--generate continues single texts, not sentence pairs")
    explainer = Explainer.from_pretrained(model, attention=args.attention, max_length=args.max_length,
                                          device=device, dtype=dtype)
    from ..models.heads import LMHead

    if not isinstance(explainer.head, LMHead):
        raise InputError(f"--generate needs a language model (…ForCausalLM, …ForConditionalGeneration); {model} is "
                         f"{explainer.head.kind}: leave --generate out to explain its predictions")
    if args.head_view:  # its maps cover prompt + continuation: refused up front where the longest cannot fit
        from ..core.attention_view import check_attention_view
        from ..core.generation_engine import check_generation_view, encode_prompt, token_ids_of
        from ..viz.headview import page_bytes

        check_generation_view(explainer.runner)
        continuation = args.max_new_tokens if args.target is None else len(
            token_ids_of(explainer.runner, args.target, "--target"))
        longest = len(encode_prompt(explainer.runner, prompts[0], args.chat)[0]) + continuation
        check_attention_view(explainer.model, longest, budget, page_bytes)
    gens = [explainer.explain_generation(p, methods=args.methods, max_new_tokens=args.max_new_tokens,
                                         target=args.target, contrast=args.contrast, chat=args.chat,
                                         target_kind=args.target_kind, batch_size=min(args.batch_size, 16),
                                         options=options, memory_budget=budget, progress=not args.quiet)
            for p in prompts]
    head_page = None
    if args.head_view:  # before anything is written
        from ..core.generation_engine import attention_maps
        from ..results.tokentext import readable_tokens
        from ..viz.headview import attention_view_html, page_bytes

        attentions = attention_maps(explainer.runner, gens[0], memory_budget=budget, beside=page_bytes)
        head_page = attention_view_html(readable_tokens(gens[0].tokens, gens[0].meta), attentions, gens[0].special,
                                        title=f"attention of {model}: prompt + continuation")
        del attentions
    if args.format == "terminal":
        for g in gens:
            g.show()
    elif args.format == "json":
        write_output(args.out, json.dumps([g.to_dict() for g in gens], indent=1) + "\n")
    elif args.format == "jsonl":
        write_output(args.out, "".join(json.dumps(g.to_dict()) + "\n" for g in gens))
    if args.format in ("json", "jsonl") and args.out:
        say_written(args, args.out)
    if args.plot:
        from ..viz.generation import plot_generation

        plot_generation(gens[0], path=args.plot)
        say_written(args, args.plot)
    if head_page is not None:
        write_output(args.head_view, head_page)
        say_written(args, args.head_view)
    html_path = args.out if args.format == "html" else args.html
    if html_path:
        from ..viz.generation import generation_html

        write_output(html_path, generation_html(gens, title=f"attnlens: {model}"))
        say_written(args, html_path)
    return 0


