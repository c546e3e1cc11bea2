"""``attnlens fit-at2``: fit AT2's per-head weights for a language model on SQuAD-context training prompts.

Example::

    attnlens fit-at2 --model smollm2 --prompts 48 --out smollm2-at2.json
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from ..viz.safetext import terminal_safe
from . import add_placement_options, check_at_least, check_seed, placement


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "fit-at2",
        help="fit AT2's attention weights for a language model",
        description=(
            "Fit the per-head weights of the at2 context-attribution method to ablation effects on training "
            "prompts built from SQuAD v1.1 dev articles at even positions (the benchmark evaluates on the odd "
            "ones). Writes a small JSON file; use it with cite --at2-weights or options {'at2': {'weights': F}}."
        ),
    )
    p.add_argument("--model", default="smollm2", help="a causal language model (default: smollm2)")
    p.add_argument("--out", required=True, help="the weights file to write (.json)")
    p.add_argument("--prompts", type=int, default=48, help="training prompts (default: 48)")
    p.add_argument("--n-ablations", type=int, default=32, help="random ablations per prompt (default: 32)")
    p.add_argument("--sources", choices=["passage", "sentence", "both"], default="both",
                   help="what a source is in the training prompts (default: both, half each)")
    p.add_argument("--distractors", type=int, default=3, help="distractor paragraphs per prompt (default: 3)")
    p.add_argument("--with-methods", default="",
                   help="token-level methods whose per-source scores join the attention features, comma-separated "
                        "(attnlrp: the weights of the at2lrp method; default: none, the weights of at2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and ablations")
    p.add_argument("--data-root", default=None, help="local data folder holding squad_v1.1/ (default: $ATTNLENS_DATA)")
    p.add_argument("--memory-budget", default=None, help="memory the forwards may plan for (default 4GiB)")
    p.add_argument("--cache", default=None,
                   help="folder keeping each finished prompt (default: OUT.parts beside --out, removed once the "
                        "weights are written): run the same command again to resume an interrupted fit")
    add_placement_options(p)
    return p


def run(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from ..core.memory import parse_budget
    from ..explainer import Explainer
    from ..paths import check_output_path
    from ..sources.at2 import fit_at2, save_weights
    from ..sources.attribute import prepare_job
    from ..sources.squad import squad_context

    check_at_least("--prompts", args.prompts, 1)
    check_at_least("--n-ablations", args.n_ablations, 4)
    check_at_least("--distractors", args.distractors, 0)
    check_seed(args.seed)
    from ..methods import resolve_methods

    extra = resolve_methods(args.with_methods) if args.with_methods.strip(" ,") else []
    out = check_output_path(args.out, "--out", directory=False)
    cache = Path(args.cache) if args.cache else out.with_name(out.name + ".parts")
    check_output_path(cache, "--cache", directory=True)
    budget = parse_budget(args.memory_budget)
    modes = ["passage", "sentence"] if args.sources == "both" else [args.sources]
    examples = []
    for i, mode in enumerate(modes):
        n = args.prompts // len(modes) + (1 if i < args.prompts % len(modes) else 0)
        examples += squad_context("fit", n, distractors=args.distractors, sources=mode, seed=args.seed,
                                  root=args.data_root)
    device, dtype = placement(args)
    ex = Explainer.from_pretrained(args.model, device=device, dtype=dtype)
    jobs = [prepare_job(ex.runner, e.context, e.query, answer=e.answer, sources=[(s.start, s.end) for s in e.sources],
                        memory_budget=budget) for e in examples]
    with tqdm(total=len(jobs), desc="fitting prompts", unit="prompt") as bar:
        record = fit_at2(ex.runner, jobs, n_ablations=args.n_ablations, seed=args.seed, progress=bar.update,
                         cache=cache, methods=extra)
    record["fit"].update({"data": "SQuAD v1.1 dev, articles at even positions", "sources": args.sources,
                          "distractors": args.distractors})
    save_weights(record, out)
    if args.cache is None:  # the default folder served this run only
        shutil.rmtree(cache, ignore_errors=True)
    fit = record["fit"]
    print(f"wrote {terminal_safe(out, one_line=True)} ({len(jobs)} prompts, ridge alpha {fit['alpha']:.3g}; on "
          f"held-out prompts: LDS {fit['cv_lds']:.3f}, R² {fit['cv_r2']:.3f}; R² in sample {fit['r2']:.3f})")
    return 0
