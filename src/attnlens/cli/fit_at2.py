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
    from ..data import squad_file
    from ..errors import InputError
    from ..explainer import Explainer
    from ..paths import check_not_an_input, check_output_path, file_sha256
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
    if cache.expanduser().resolve() == out.expanduser().resolve():
        raise InputError(f"--cache {args.cache} is the --out file: give the cache its own folder")
    budget = parse_budget(args.memory_budget)
    data = squad_file(args.data_root)
    check_not_an_input(args.out, "--out", {"SQuAD": data})
    modes = ["passage", "sentence"] if args.sources == "both" else [args.sources]
    if args.prompts < 2 * len(modes):  # each kind's prompts come from squad_context, which builds at least one
        raise InputError(f"--prompts {args.prompts}: the ridge penalty is chosen on held-out questions: give at least "
                         f"{2 * len(modes)} prompts" + (" (half with passage, half with sentence sources)"
                                                        if len(modes) > 1 else ""))
    examples = []
    for i, mode in enumerate(modes):
        n = args.prompts // len(modes) + (1 if i < args.prompts % len(modes) else 0)
        built = squad_context("fit", n, distractors=args.distractors, sources=mode, seed=args.seed,
                              root=args.data_root)
        if len(built) < n:  # the fit articles hold fewer prompts of this kind
            if not built:
                raise InputError(f"--distractors {args.distractors}: no prompt of the fit articles can hold that many "
                                 "distractor paragraphs")
            raise InputError(f"--prompts {args.prompts}: the fit articles give {len(built):,} prompts with {mode} "
                             f"sources{' (half of --prompts each)' if len(modes) > 1 else ''}; ask for fewer")
        examples += built
    if len({(e.query, e.answer) for e in examples}) < 2:
        raise InputError(f"--prompts {args.prompts}: these prompts ask {'one question' if examples else 'nothing'}; "
                         "the ridge penalty is chosen on held-out questions: give at least "
                         f"{2 * len(modes)} prompts")
    device, dtype = placement(args)
    ex = Explainer.from_pretrained(args.model, device=device, dtype=dtype)
    jobs = [prepare_job(ex.runner, e.context, e.query, answer=e.answer, sources=[(s.start, s.end) for s in e.sources],
                        memory_budget=budget) for e in examples]
    with tqdm(total=len(jobs), desc="fitting prompts", unit="prompt") as bar:
        record = fit_at2(ex.runner, jobs, n_ablations=args.n_ablations, seed=args.seed, progress=bar.update,
                         cache=cache, methods=extra)
    record["fit"].update({"data": "SQuAD v1.1 dev, articles at even positions", "sources": args.sources,
                          "distractors": args.distractors, "data_file": data.name,
                          "data_sha256": file_sha256(data), "examples": [e.id for e in examples]})
    save_weights(record, out)
    if args.cache is None:  # the default folder served this run only
        shutil.rmtree(cache, ignore_errors=True)
    fit = record["fit"]
    def num(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    print(f"wrote {terminal_safe(out, one_line=True)} ({len(jobs)} prompts, ridge alpha {fit['alpha']:.3g}; on "
          f"held-out prompts: LDS {num(fit['cv_lds'])}, R² {num(fit['cv_r2'])}; R² in sample {num(fit['r2'])})")
    return 0
