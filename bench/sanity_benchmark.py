"""The sanity metric (cascading model-parameter randomisation) of every method on SST-2 dev with
``../shared/models/minilm-sst2``: what each method's mean Spearman ρ is, and what the metric costs.

Runs ``run_benchmark(..., metrics="sanity")`` (the code behind ``attnlens benchmark --metrics sanity``) into
``--out`` (a temporary directory by default) and prints each method's ρ per randomised depth and the seconds the
metric took (it explains the sentences once on the trained model and once per depth: head + 6 layers). With
``--out``, an interrupted run started again resumes: the explanations and every finished depth are kept.

Run: ``python bench/sanity_benchmark.py [--limit 200] [--methods all] [--samples 100] [--out DIR] [--plot PNG]
[--table MD]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from attnlens import Explainer  # noqa: E402
from attnlens.data import load_dataset  # noqa: E402
from attnlens.evaluation.runner import run_benchmark  # noqa: E402
from attnlens.viz.plots import plot_sanity  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "minilm-sst2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=200, help="SST-2 dev sentences (drawn with seed 0)")
    parser.add_argument("--methods", default="all")
    parser.add_argument("--samples", type=int, default=100, help="n_samples of LIME and KernelSHAP")
    parser.add_argument("--out", default=None, help="results directory to keep and resume (default: a temporary one)")
    parser.add_argument("--progress", action="store_true", help="show progress bars")
    parser.add_argument("--plot", default=None, help="write the correlation-vs-depth plot here (PNG)")
    parser.add_argument("--table", default=None, help="write the table here (Markdown)")
    args = parser.parse_args()
    ex = Explainer.from_pretrained(str(MODEL))
    data = load_dataset("sst2", "dev", limit=args.limit, seed=0)
    methods = args.methods if args.methods == "all" else args.methods.split(",")
    options = {m: {"n_samples": args.samples} for m in ("lime", "kernelshap") if methods == "all" or m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        s = run_benchmark(ex, data, args.out or tmp, methods=methods, metrics="sanity",
                          explain_options=options or None, progress=args.progress)
    depths = s["sanity"]["depths"]
    print(f"{s['n_examples']} sentences; explain {s['timing'].get('explain_seconds', 0):.0f} s, sanity "
          f"{s['timing']['sanity_seconds']:.0f} s ({len(depths)} depths)")
    print(f"{'method':>20} {'mean ρ':>7}  " + " ".join(f"{d:>8}" for d in depths))
    ranked = sorted(s["sanity"]["methods"].items(), key=lambda kv: -(kv[1]["value"] or -9))
    for m, c in ranked:
        row = " ".join("     n/a" if v is None else f"{v:8.3f}" for v in c["spearman"])
        print(f"{m:>20} {c['value'] if c['value'] is not None else float('nan'):7.3f}  {row}")
    if args.table:
        lines = ["| method | mean ρ ↓ | " + " | ".join(depths) + " |", "|---|---:|" + "---:|" * len(depths)]
        for m, c in ranked:
            cells = ["n/a" if v is None else f"{v:.2f}" for v in c["spearman"]]
            value = "n/a" if c["value"] is None else f"{c['value']:.2f}"
            lines.append(f"| {m} | {value} | " + " | ".join(cells) + " |")
        Path(args.table).write_text("\n".join(lines) + "\n", encoding="utf-8")
    if args.plot:
        plot_sanity(s, args.plot, title=f"minilm-sst2, {s['n_examples']} SST-2 dev sentences: model randomisation")


if __name__ == "__main__":
    main()
