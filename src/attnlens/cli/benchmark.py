"""``attnlens benchmark``: score explanation methods on a data set and write a results directory.

Example::

    attnlens benchmark --model path/to/sst2-classifier --dataset sst2 --split dev \\
        --methods all --metrics aopc,lodds,kendall --limit 200 --out results/sst2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..viz.safetext import terminal_safe
from . import DefaultsHelpFormatter, add_placement_options, method_options, placement
from .explain import add_memory_options


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "benchmark",
        help="measure faithfulness / confidence / consistency of methods on a data set",
        description="Explain every example once, perturb it on token ids and score the methods. Results are "
        "written as they come (examples.jsonl); run the same command again to resume an interrupted run.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model directory (or hub id when online)")
    p.add_argument("--task", choices=["classification", "context"], default="classification",
                   help="'context': attribute a language model's answers to the sources of their context "
                   "(--dataset squad-context; see docs/context-attribution.md)")
    p.add_argument("--dataset", required=True,
                   help="sst2, imdb, yelp_polarity, amazon_polarity, mnli, qqp, squad, squad_v2, or a file of the "
                   "same shape; with --task context: squad-context or an examples file (JSON Lines)")
    p.add_argument("--split", default=None, help="split (default: the data set's evaluation split; squad also "
                   "has eval and fit, the questions of the articles at odd / even positions of the dev file)")
    p.add_argument("--data-root", default=None, help="local data folder (default: $ATTNLENS_DATA)")
    p.add_argument("--methods", default="all", help="'all' or comma-separated method ids")
    p.add_argument("--no-lrp", action="store_true", help="leave out LRP-based methods when --methods all")
    p.add_argument("--metrics", default=None,
                   help="comma-separated: aopc, lodds, comprehensiveness, sufficiency, occlusion, kendall, "
                   "consistency, sanity (model randomisation, layer by layer); or 'all' (all but sanity; default "
                   "aopc,lodds,kendall; on squad/squad_v2: precision_at_k)")
    p.add_argument("--protocol", choices=["paper", "attcat-code"], default="paper",
                   help="'paper' follows the published equations; 'attcat-code' reproduces the AttCAT code")
    p.add_argument("--limit", type=int, default=None, help="evaluate a seeded random subset of N examples")
    p.add_argument("--seed", type=int, default=0, help="seed of --limit and of random occlusion")
    p.add_argument("--occlusion-max", type=int, default=40, help="occlusion curves drop 0, step, ..., max tokens")
    p.add_argument("--occlusion-step", type=int, default=2, help="step of the occlusion curves")
    p.add_argument("--occlusion-drop", choices=["mask", "delete"], default="mask",
                   help="drop tokens by attention mask 0 (as Karpekov & Miller, 'Is Attention Truly All We Need?', "
                   "2023) or by deleting them")
    p.add_argument("--target", choices=["predicted", "gold"],
                   help="explain the predicted class (default) or the gold label (Karpekov & Miller 2023 explain the "
                   "gold label; --protocol attcat-code always does)")
    p.add_argument("--target-kind", choices=["logit", "probability", "loss"], default="logit",
                   help="explain the logit, the probability, or the loss (log-probability) of the target; the loss "
                   "is against the gold label: with --target gold")
    p.add_argument("--k", type=int, default=20,
                   help="K of precision@K (QA): the count of gold-answer tokens among the top K")
    p.add_argument("--attention", default=None, help="BART-like models: encoder, decoder or cross")
    p.add_argument("--max-length", type=int, default=None, help="truncate inputs to this many tokens")
    p.add_argument("--batch-size", type=int, default=32, help="inputs per explanation batch")
    p.add_argument("--eval-batch-size", type=int, default=64, help="perturbed inputs per forward pass")
    p.add_argument("--chunk-size", type=int, default=16,
                   help="examples explained, scored and written together (progress moves and an interruption "
                   "loses work per chunk)")
    p.add_argument("--options", default=None, help='method options as JSON, e.g. \'{"attcat": {"alpha": "cls"}}\'')
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", required=True, help="results directory")
    p.add_argument("--overwrite", action="store_true", help="start over instead of resuming a run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar, warnings or notices on stderr (errors "
                   "still print, one line)")
    add_memory_options(p)
    add_placement_options(p)
    # data-parallel runs (docs/scaling.md); `accelerate launch -m attnlens.cli benchmark ...` needs neither option
    p.add_argument("--processes", type=int, default=1,
                   help="run in N processes on this machine, each on its share of the examples (one per GPU with "
                   "--device cuda); the merged results equal a one-process run's")
    ctx = p.add_argument_group("context attribution (--task context)")
    ctx.add_argument("--sources", choices=["passage", "sentence"], default="passage", help="what a source is")
    ctx.add_argument("--distractors", type=int, default=3, help="distractor paragraphs beside the gold one")
    ctx.add_argument("--hard", action="store_true", help="distractors from the question's own article")
    ctx.add_argument("--lds-ablations", type=int, default=32, help="random ablations per example for LDS")
    ctx.add_argument("--ablation", choices=["remove", "mask"], default="remove",
                     help="how a source is taken out: its characters removed, or its tokens masked")
    ctx.add_argument("--external", action="append", default=[],
                     help="JSON Lines of scores computed elsewhere ({id, method, scores, seconds}), scored beside "
                     "attnlens's methods (repeatable)")
    ctx.add_argument("--write-examples", default=None,
                     help="also write the examples as JSON Lines (the input of the peers' runner)")
    p.add_argument("--shard", metavar="RANK/COUNT", default=None,
                   help="run one share of a data-parallel run whose processes a scheduler starts (e.g. a Slurm "
                   "array: $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT); the last one to end merges the results")
    return p


# the options of --task context, with their defaults: refused when set for another task, where they do nothing
BUILD_OPTIONS = ("sources", "distractors", "hard")  # how squad-context builds its examples
CONTEXT_OPTIONS = {"sources": "passage", "distractors": 3, "hard": False, "lds_ablations": 32, "ablation": "remove",
                   "external": [], "write_examples": None}
# the options of the classification and QA benchmark, with their defaults: --task context reads none of them
CLASSIFICATION_OPTIONS = {"no_lrp": False, "metrics": None, "protocol": "paper", "occlusion_max": 40,
                          "occlusion_step": 2, "occlusion_drop": "mask", "target": None, "target_kind": "logit",
                          "k": 20, "attention": None, "max_length": None, "batch_size": 32, "eval_batch_size": 64,
                          "chunk_size": 16, "threads": None, "processes": 1, "shard": None}


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.task != "context":
        for name, default in CONTEXT_OPTIONS.items():
            if getattr(args, name) != default:
                raise InputError(f"--{name.replace('_', '-')} is an option of --task context; this is --task "
                                 f"{args.task}")
    if args.task == "context":
        from ..sources.squad import SQUAD_CONTEXT

        given = [name for name, default in CLASSIFICATION_OPTIONS.items() if getattr(args, name) != default]
        if given:
            raise InputError(f"--{given[0].replace('_', '-')} is an option of the classification and QA benchmark; "
                             "--task context does not read it: leave it out")

        if args.dataset not in SQUAD_CONTEXT:  # an examples file: its prompts and sources are built already
            built = ["--split"] * (args.split is not None) + [
                f"--{name}" for name in BUILD_OPTIONS if getattr(args, name) != CONTEXT_OPTIONS[name]]
            if built:
                raise InputError(f"{built[0]} chooses how squad-context builds its examples; those of "
                                 f"{args.dataset} are read as they are: leave it out")
        from .benchmark_context import run_context

        return run_context(args)
    import torch

    from ..data import LabelNamesWithoutClasses, load_dataset, names_a_file
    from ..evaluation import parallel
    from ..evaluation.metrics import EvalConfig, resolve_metrics
    from ..evaluation.results import clear_results, results_lock
    from ..evaluation.runner import BenchmarkRun, check_benchmark_options, run_benchmark
    from ..explainer import Explainer
    from ..methods import list_methods
    from ..paths import check_output_path

    for name in ("threads", "batch_size", "eval_batch_size", "chunk_size", "k", "processes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.occlusion_step < 1 or args.occlusion_max < 0:
        raise InputError("--occlusion-step must be >= 1 and --occlusion-max >= 0")
    if 0 < args.occlusion_max < args.occlusion_step:
        raise InputError(f"--occlusion-max {args.occlusion_max} is below --occlusion-step {args.occlusion_step}: the "
                         "occlusion curves would drop no token (give a larger --occlusion-max, or 0 for none)")
    target = _target(args)  # before the model loads
    check_output_path(args.out, "--out", directory=True)
    from ..core.memory import parse_budget

    budget = None if args.memory_budget is None else parse_budget(args.memory_budget)
    device, dtype = placement(args)
    shard = parallel.Shard.parse(args.shard) if args.shard else None
    launched = parallel.launched_world_size() > 1
    if (args.processes > 1) + (shard is not None) + launched > 1:
        raise InputError("--processes, --shard and accelerate launch each split the run: use one of them")
    if shard is not None and args.overwrite:
        raise InputError("--overwrite with --shard would clear the other shards' work: delete --out before "
                         "starting the shards instead")
    if args.processes > 1 and device is not None and device.type == "cuda" and (
            args.processes > torch.cuda.device_count() or device.index is not None):
        raise InputError(f"--processes {args.processes} --device {args.device}: give --device cuda (one process "
                             f"per GPU), with at most {torch.cuda.device_count()} processes")
    threads = args.threads
    if args.processes > 1 and threads is None:  # the cores are shared: one process per core share
        threads = max(1, (os.cpu_count() or 1) // args.processes)
    if threads:
        torch.set_num_threads(threads)
    options = method_options(args.options) or None
    check_benchmark_options(args.methods, options)  # before the data and the model load
    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit must be a positive number of examples, got {args.limit}")
    if args.split is not None and names_a_file(args.dataset):
        raise InputError(f"--split names a split of a known data set; --dataset {args.dataset} is a file, read "
                         "whole: leave --split out")
    try:
        dataset = load_dataset(args.dataset, args.split, limit=args.limit, seed=args.seed, root=args.data_root)
    except LabelNamesWithoutClasses as exc:  # rows name their classes: read them by the model's names, below
        dataset, names_error = None, exc
    out = Path(args.out)
    if launched:  # one of the processes `accelerate launch` (or --processes) started: its rank is its shard
        cpu = device.type == "cpu" if device is not None else not torch.cuda.is_available()
        shard, own_device = parallel.join_launched(cpu=cpu)
        if shard.count != parallel.launched_world_size():  # each process would do the whole run
            raise InputError(f"the launcher started {parallel.launched_world_size()} processes but accelerate sees "
                             f"{shard.count} (--device {args.device or 'not given'}); give --device cpu or cuda")
        if device is None or device.type != "cpu":
            device = own_device  # the launcher's: cuda:LOCAL_RANK on GPUs
        if args.overwrite:  # rank 0 clears the run, the others wait for it before anything is read
            refusal = None
            if shard.index == 0:
                out.mkdir(parents=True, exist_ok=True)
                try:
                    with results_lock(out):  # never under a run writing it
                        clear_results(out)
                except InputError as exc:
                    refusal = str(exc)
            refusal = parallel.from_first(refusal)  # every process hears whether rank 0 cleared it
            if refusal:
                raise InputError(refusal)
            args.overwrite = False
    explainer = Explainer.from_pretrained(
        args.model, attention=args.attention, max_length=args.max_length,
        task="qa" if dataset is not None and dataset.task == "qa" else None,
        device=None if args.processes > 1 else device, dtype=dtype,
    )
    if dataset is None:
        dataset = _by_class_names(args, list(getattr(explainer, "labels", None) or []), names_error)
    methods: Any = args.methods
    if args.no_lrp and methods == "all":
        methods = list_methods(include_lrp=False)
    occlusion_max = args.occlusion_max
    if occlusion_max > explainer.max_length:  # a count above an input's length drops all of it: stop there
        occlusion_max = explainer.max_length
        said = not args.quiet and (shard is None or shard.index == 0)
        if said and "occlusion" in resolve_metrics(args.metrics):  # only a run that measures it hears of it
            print(f"attnlens: --occlusion-max {args.occlusion_max} is more than the model's {occlusion_max}-token "
                  f"inputs; using {occlusion_max}", file=sys.stderr)
    config = EvalConfig(
        precision_k=args.k,
        protocol=args.protocol,
        pad_token_id=explainer.pad_id,
        occlusion_counts=tuple(range(0, occlusion_max + 1, args.occlusion_step)),
        occlusion_drop=args.occlusion_drop,
        seed=args.seed,
    )
    run = BenchmarkRun(
        methods=methods, metrics=args.metrics, config=config,
        batch_size=args.batch_size, eval_batch_size=args.eval_batch_size, chunk_size=args.chunk_size,
        resume=not args.overwrite, progress=not args.quiet and (shard is None or shard.index == 0),
        explain_options=options, model_name=args.model, target=target, target_kind=args.target_kind,
        # the run's own lines: only an interruption's (the table and the results folder are printed below)
        memory_budget=budget, log=None if args.quiet or os.environ.get(parallel.QUIET_TABLE) else _interrupted,
    )
    if args.processes > 1:  # check everything here, once, then start the processes (they each load the model)
        run_benchmark(explainer, dataset, out, dataclasses.replace(run, check_only=True))
        out.mkdir(parents=True, exist_ok=True)
        with results_lock(out):  # a run writing out now is refused here, before the processes start
            pass
        del explainer
        # the workers run the same command (the last value of an option wins), on the CPU unless --device says
        argv = [*args.argv, "--processes", "1", "--threads", str(threads), "--device", args.device or "cpu"]
        started = time.time()
        try:
            wall = parallel.launch(argv, args.processes, threads)
        except KeyboardInterrupt:  # each process merged what it finished; the last one summarised it all
            summary_file = out / "summary.json"
            if summary_file.is_file() and summary_file.stat().st_mtime >= started:  # not an earlier run's
                done = json.loads(summary_file.read_text(encoding="utf-8"))
                _notice(f"interrupted: wrote {out}/summary.json ({done['n_examples']} of {done['n_planned']} "
                        "examples); run the same command again to finish")
            raise
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
        print(terminal_safe((out / "table.md").read_text(encoding="utf-8")))
        print(terminal_safe(f"{summary['n_examples']} examples in {wall:.1f} s with {args.processes} processes "
                            f"({summary['timing'].get('seconds', 0):.1f} s of compute); results in {out}/",
                            one_line=True))
        return 0
    try:
        summary = run_benchmark(explainer, dataset, out, dataclasses.replace(run, shard=shard))
    finally:
        if launched:
            parallel.leave_group()
    assert summary is not None
    if shard is not None:
        state = "complete" if summary["timing"].get("complete") else "partial: the other shards merge when they end"
        if not args.quiet:  # a notice
            print(terminal_safe(f"attnlens: shard {shard.index}/{shard.count} done; {summary['n_examples']} of "
                                f"{summary['n_planned']} examples merged into {out}/ ({state})", one_line=True),
                  file=sys.stderr)
        if not summary["timing"].get("complete") or os.environ.get(parallel.QUIET_TABLE):
            return 0
    print(terminal_safe((out / "table.md").read_text(encoding="utf-8")))
    t = summary["timing"]
    print(terminal_safe(f"{summary['n_examples']} examples in {t.get('seconds', 0):.1f} s; results in {out}/",
                        one_line=True))
    return 0


def _target(args: argparse.Namespace) -> str:
    """What the benchmark explains: ``--target``, the predicted class by default; the gold label under the
    AttCAT code's protocol, which explains it (an explicit ``--target predicted`` is refused there)."""
    if args.protocol == "attcat-code":
        if args.target == "predicted":
            raise InputError("--protocol attcat-code explains the gold label, as the AttCAT code does: leave out "
                             "--target or give --target gold")
        return "gold"
    return args.target or "predicted"


def _by_class_names(args: argparse.Namespace, names: list[str], error: InputError) -> Any:
    """The data file read with its rows' labels given by the model's class names; ``error`` (the row that gave
    a name) where the model only numbers its classes."""
    from ..data import load_dataset, names_classes

    if not names_classes(names):
        raise InputError(f"{error}: the model names its classes {', '.join(names) or 'not at all'}, so give "
                         "class ids") from None
    return load_dataset(args.dataset, args.split, limit=args.limit, seed=args.seed, root=args.data_root,
                        labels=names)


def _notice(message: str) -> None:
    """A line of the run's progress on standard error (an interrupted run's summary)."""
    print(terminal_safe(f"attnlens: {message}", one_line=True), file=sys.stderr)


def _interrupted(message: str) -> None:
    if message.startswith("interrupted"):
        _notice(message)
