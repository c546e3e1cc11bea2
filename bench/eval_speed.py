"""How fast attnlens evaluates: all non-LRP methods × AOPC + LOdds + Kendall τ on the SST-2 dev set, against a
batch-1, one-method-at-a-time loop (the reference implementations' way) over a few examples, scaled up.

Run: ``python bench/eval_speed.py [--limit N] [--threads 2] [--loop-examples 50] [--out DIR]``
on ``../shared/models/minilm-sst2`` and SST-2 dev (872 sentences). Target: the full run in <= 10 minutes
on 2 CPU cores. Integrated gradients (50 steps × 2 classes per example) is timed on its own and added as an
estimate unless ``--with-ig`` runs it in full.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from attnlens.data import load_dataset
from attnlens.evaluation.metrics import AOPC as AOPCMetric
from attnlens.evaluation.metrics import EvalConfig, Item, Kendall, kendall_other_classes
from attnlens.evaluation.metrics import LOdds as LOddsMetric
from attnlens.evaluation.runner import run_benchmark
from attnlens.explainer import Explainer
from attnlens.methods.registry import get_method, list_methods

MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "minilm-sst2"
DATA = MODEL.parents[1] / "data"
SLOW = "integratedgradients"


def baseline_loop(ex: Explainer, texts: list[str], labels: list[int], methods: list[str]) -> float:
    """Seconds for batch-1 explanations, one method at a time, and one batch-1 forward per perturbed input."""
    cfg = EvalConfig(pad_token_id=ex.pad_id)
    metrics = [AOPCMetric(cfg), LOddsMetric(cfg)]
    t0 = time.perf_counter()
    for text, label in zip(texts, labels):
        for m in methods:
            (exp,) = ex.explain([text], [m], batch_size=1)
            others = {}
            if get_method(m).class_specific:
                for c in kendall_other_classes(exp.target, len(exp.probabilities)):
                    others[c] = ex.explain([text], [m], target=[c], batch_size=1)[0]
            item = Item(exp, label, 0, others)
            for metric in metrics:
                probs = {}
                for v in metric.requests(item, m):  # every request scored on its own, no sharing
                    mask = list(v.attention_mask) if v.attention_mask else [1] * len(v)
                    probs[v] = ex.predict_proba([list(v.input_ids)], [list(v.token_type_ids or [])] if
                                                v.token_type_ids else None, [mask], batch_size=1)[0]
                metric.compute(item, m, probs)
            if others:
                Kendall(cfg).compute(item, m, {})
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--limit", type=int, default=None, help="evaluate a seeded subset of N dev sentences")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loop-examples", type=int, default=50, help="examples timed in the batch-1 loop")
    parser.add_argument("--with-ig", action="store_true", help="run integrated gradients in the full run too")
    parser.add_argument("--out", default=None, help="results directory to keep (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file "
                        "(scripts/reproduce.py reads results/eval_speed.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    ds = load_dataset("sst2", "dev", limit=args.limit, root=DATA)
    ex = Explainer.from_pretrained(args.model)
    methods = list_methods(include_lrp=False)
    fast = [m for m in methods if args.with_ig or m != SLOW]
    print(f"model {Path(args.model).name}, sst2/dev {len(ds)} sentences, methods {', '.join(fast)}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="attnlens-eval-speed-"))
    t0 = time.perf_counter()
    summary = run_benchmark(ex, ds, out, methods=fast, metrics="aopc,lodds,kendall", resume=False, progress=True,
                            model_name=str(Path(args.model).resolve()))
    full = time.perf_counter() - t0
    t = summary["timing"]
    print(f"attnlens benchmark ({len(fast)} methods): {full:.1f} s = explain {t['explain_seconds']:.1f} s + "
          f"evaluate {t['evaluate_seconds']:.1f} s  ({len(ds) / full:.2f} examples/s)")

    total = full
    if SLOW in methods and SLOW not in fast:
        sub = ds.texts[: args.loop_examples]
        t1 = time.perf_counter()
        exps = ex.explain(sub, [SLOW])
        ex.explain(sub, [SLOW], target=[1 - e.predicted for e in exps])
        ig = (time.perf_counter() - t1) / len(sub) * len(ds)
        total += ig
        print(f"{SLOW}: explanations for 2 classes on {len(sub)} examples scaled to {len(ds)}: {ig:.1f} s "
              "(its perturbations are extra too)")
        print(f"estimated total with {SLOW}: {total:.1f} s")

    n = min(args.loop_examples, len(ds))
    loop = baseline_loop(ex, ds.texts[:n], [e.label for e in ds][:n], methods) / n * len(ds)
    print(f"batch-1, one-method-at-a-time loop over {n} examples ({len(methods)} methods), scaled to {len(ds)}: "
          f"{loop:.1f} s")
    print(f"speed-up of attnlens over the loop: {loop / total:.1f}x; target <= 600 s: "
          f"{'met' if total <= 600 else 'NOT met'} ({total:.0f} s)")
    figures = {"full_seconds": round(full, 1), "explain_seconds": round(t["explain_seconds"], 1),
               "evaluate_seconds": round(t["evaluate_seconds"], 1), "estimated_total_seconds": round(total, 1),
               "loop_scaled_seconds": round(loop, 1), "loop_examples": n, "n_examples": len(ds), "methods": fast,
               "threads": torch.get_num_threads()}
    print(json.dumps(figures))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
