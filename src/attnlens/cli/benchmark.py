"""``attnlens benchmark``: score explanation methods on a data set and write a results directory.

Example::

    attnlens benchmark --model ../shared/models/minilm-sst2 --dataset sst2 --split dev \\
        --methods all --metrics aopc,lodds,kendall --limit 200 --out results/sst2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..safetext import terminal_safe
from . import add_placement_options, placement


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "benchmark",
        help="measure faithfulness / confidence / consistency of methods on a data set",
        description="Explain every example once, perturb it on token ids and score the methods. Results are "
        "written as they come (examples.jsonl); run the same command again to resume an interrupted run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True, help="model directory (or hub id when online)")
    p.add_argument("--dataset", required=True,
                   help="sst2, imdb, yelp_polarity, amazon_polarity, mnli, qqp, squad, squad_v2, or a file of the "
                   "same shape")
    p.add_argument("--split", default=None, help="split (default: the data set's evaluation split)")
    p.add_argument("--data-root", default=None, help="local data folder (default: $ATTNLENS_DATA or ../shared/data)")
    p.add_argument("--methods", default="all", help="'all' or comma-separated method ids")
    p.add_argument("--no-lrp", action="store_true", help="leave out LRP-based methods when --methods all")
    p.add_argument("--metrics", default=None,
                   help="comma-separated: aopc, lodds, comprehensiveness, sufficiency, occlusion, kendall, "
                   "consistency; or 'all' (default aopc,lodds,kendall; on squad/squad_v2: precision_at_k)")
    p.add_argument("--protocol", choices=["paper", "attcat-code"], default="paper",
                   help="'paper' follows the published equations; 'attcat-code' reproduces the AttCAT code")
    p.add_argument("--limit", type=int, default=None, help="evaluate a seeded random subset of N examples")
    p.add_argument("--seed", type=int, default=0, help="seed of --limit and of random occlusion")
    p.add_argument("--occlusion-max", type=int, default=40, help="occlusion curves drop 0, step, ..., max tokens")
    p.add_argument("--occlusion-step", type=int, default=2, help="step of the occlusion curves")
    p.add_argument("--occlusion-drop", choices=["mask", "delete"], default="mask",
                   help="drop tokens by attention mask 0 (seed 000) or by deleting them")
    p.add_argument("--target", choices=["predicted", "gold"], default="predicted",
                   help="explain the predicted class or the gold label (seed 000 explains the gold label)")
    p.add_argument("--target-kind", choices=["logit", "probability", "loss"], default="logit",
                   help="explain the logit, the probability, or the loss (log-probability) of the target")
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
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_placement_options(p)
    return p


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from ..data import load_dataset
    from ..evaluation.metrics import EvalConfig
    from ..evaluation.runner import run_benchmark
    from ..explainer import Explainer
    from ..methods.registry import list_methods
    from ..paths import check_output_path

    for name in ("threads", "batch_size", "eval_batch_size", "chunk_size", "k"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if args.occlusion_step < 1 or args.occlusion_max < 0:
        raise InputError("--occlusion-step must be >= 1 and --occlusion-max >= 0")
    check_output_path(args.out, "--out", directory=True)
    device, dtype = placement(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    options = None
    if args.options:
        try:
            options = json.loads(args.options)
        except json.JSONDecodeError as exc:
            raise InputError(f"--options is not valid JSON: {exc.msg}") from None
        if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
            raise InputError('--options must map method ids to option objects, e.g. {"attcat": {"alpha": "cls"}}')
    dataset = load_dataset(args.dataset, args.split, limit=args.limit, seed=args.seed, root=args.data_root)
    explainer = Explainer.from_pretrained(args.model, attention=args.attention, max_length=args.max_length,
                                          task="qa" if dataset.task == "qa" else None, device=device, dtype=dtype)
    methods: Any = args.methods
    if args.no_lrp and methods == "all":
        methods = list_methods(include_lrp=False)
    occlusion_max = args.occlusion_max
    if occlusion_max > explainer.max_length:  # a count above an input's length drops all of it: stop there
        occlusion_max = explainer.max_length
        print(f"attnlens: --occlusion-max {args.occlusion_max} is more than the model's {occlusion_max}-token inputs; "
              f"using {occlusion_max}", file=sys.stderr)
    config = EvalConfig(
        precision_k=args.k,
        protocol=args.protocol,
        pad_token_id=explainer.pad_id,
        occlusion_counts=tuple(range(0, occlusion_max + 1, args.occlusion_step)),
        occlusion_drop=args.occlusion_drop,
        seed=args.seed,
    )
    out = Path(args.out)
    summary = run_benchmark(
        explainer, dataset, out, methods=methods, metrics=args.metrics, config=config,
        batch_size=args.batch_size, eval_batch_size=args.eval_batch_size, chunk_size=args.chunk_size,
        resume=not args.overwrite,
        progress=not args.quiet, explain_options=options, model_name=args.model, target=args.target,
        target_kind=args.target_kind,
    )
    print(terminal_safe((out / "table.md").read_text(encoding="utf-8")))
    t = summary["timing"]
    print(terminal_safe(f"{summary['n_examples']} examples in {t.get('seconds', 0):.1f} s; results in {out}/",
                        one_line=True))
    return 0

