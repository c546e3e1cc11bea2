"""``attnlens benchmark --task context``: the context-attribution benchmark (its options are in
:mod:`attnlens.cli.benchmark`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..data import text_lines
from ..errors import InputError
from ..viz.safetext import terminal_safe
from . import check_at_least, check_seed, method_options, placement


def load_examples(args: argparse.Namespace) -> list:
    """The examples of ``--dataset``: ``squad-context`` built from SQuAD v1.1 dev, or a JSON Lines file."""
    from ..sources.squad import SQUAD_CONTEXT, ContextExample, squad_context

    if args.dataset in SQUAD_CONTEXT:
        split = args.split or "eval"
        return squad_context(split, args.limit or 100, distractors=args.distractors, hard=args.hard,
                             sources=args.sources, seed=args.seed, root=args.data_root)
    path = Path(args.dataset)
    if not path.is_file():
        raise InputError(f"--dataset {args.dataset}: with --task context give squad-context or an examples file")
    examples = []
    for n, line in enumerate(text_lines(path.read_text(encoding="utf-8-sig")), 1):
        if line.strip():
            try:
                examples.append(ContextExample.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError) as err:
                raise InputError(f"{path} line {n}: not a context example ({err})") from None
    return examples[: args.limit] if args.limit else examples


def run_context(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from ..core.memory import parse_budget
    from ..evaluation.context_benchmark import (
        ContextBenchmarkConfig,
        markdown_table,
        read_external,
        run_context_benchmark,
    )
    from ..evaluation.results import results_lock
    from ..explainer import Explainer
    from ..paths import atomic_write_text, check_not_an_input, check_output_path
    from ..sources.attribute import split_methods

    check_at_least("--limit", args.limit, 1)
    check_at_least("--distractors", args.distractors, 0)
    check_seed(args.seed)
    token, source = split_methods(args.methods)
    check_at_least("--lds-ablations", args.lds_ablations, 4)
    options = method_options(args.options)
    out = check_output_path(args.out, "--out", directory=True)
    if (out / "run.json").exists():
        raise InputError(f"--out {args.out} holds the results of another benchmark task (run.json); give the context "
                         "benchmark a folder of its own")
    if not args.overwrite and (out / "summary.json").exists() and not (out / "records.jsonl").exists():
        raise InputError(f"--out {args.out} holds a summary.json but no records.jsonl: not a context benchmark to "
                         "resume; use another --out or --overwrite")
    if args.write_examples:
        check_output_path(args.write_examples, "--write-examples", directory=False)
        inputs = {f"--external {e}": e for e in args.external}
        if Path(args.dataset).expanduser().exists():
            inputs["--dataset"] = args.dataset
        check_not_an_input(args.write_examples, "--write-examples", inputs)
    external = read_external(args.external)
    examples = load_examples(args)
    config = ContextBenchmarkConfig(methods=[*token, *source], options=options, n_lds=args.lds_ablations,
                                    ablation=args.ablation, seed=args.seed,
                                    memory_budget=None if args.memory_budget is None else
                                    parse_budget(args.memory_budget))
    device, dtype = placement(args)
    ex = Explainer.from_pretrained(args.model, device=device, dtype=dtype)  # before anything is written
    out.mkdir(parents=True, exist_ok=True)
    with results_lock(out):  # one run writes a folder at a time
        if args.write_examples:
            atomic_write_text(args.write_examples, "".join(json.dumps(e.to_dict()) + "\n" for e in examples))
        if args.overwrite and (out / "records.jsonl").exists():
            (out / "records.jsonl").unlink()
        with tqdm(total=len(examples), desc="examples", disable=args.quiet, unit="ex") as bar:
            summary = run_context_benchmark(ex, examples, config, out, external=external, progress=bar.update)
    print(markdown_table(summary["metrics"]))
    print(f"wrote {terminal_safe(out / 'summary.json', one_line=True)}")
    return 0
