"""Does fine-tuning stay within its memory budget? Peak memory and time of training steps, per model and budget.

Each case trains ``--steps`` steps (AdamW, the loop of ``attnlens train``) over batches of one length in a fresh
process: load, warm up on a short input, reset the peak (Linux ``VmHWM`` through ``/proc/self/clear_refs``),
train. Models: MiniLM-L6 (the offline reference classifier) and random classifiers of BERT-base's, GPT-2's, a
12 × 768 Llama's, BART-base's and T5-base's sizes (memory does not depend on the weights), each with its default
attention. Every model runs once with a budget too large to matter (``unbounded``: the batch in one piece) and then
within the budgets given: reported are the rows per micro-batch, the estimate of the largest micro-batch's step, the
peak resident memory beyond what the process held before training (so the weights are outside both), its ratio to
the budget (the promise is at most 1.1) and the time as a ratio to the unbounded run's.

Run: ``python bench/training_memory.py [--steps 2] [--out bench/data/training_memory.md]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from peak import ROOT, process_status, write_records  # noqa: E402

MINILM = ROOT.parent / "shared" / "models" / "minilm-sst2"
UNBOUNDED = "64GiB"
# (model, examples per batch, tokens, budgets)
CASES = (
    ("minilm", 32, 256, ("4GiB", "2GiB", "1GiB")),
    ("minilm", 8, 16, ("512MiB",)),  # the states and the update alone: the word embeddings' copies set the peak
    ("bert-base", 8, 512, ("3GiB",)),
    ("gpt2", 8, 512, ("3GiB",)),
    ("llama", 8, 1024, ("3GiB",)),
    ("bart-base", 8, 512, ("2GiB",)),
    ("t5-base", 4, 512, ("6GiB",)),  # its states alone (3 × 0.83 GiB) need much of the budget
)


def one(kind: str, batch: int, tokens: int, budget_text: str, steps: int) -> dict:
    """The case, in this process."""
    import time
    import warnings

    import torch

    from attnlens.core.memory import parse_budget
    from attnlens.core.training_memory import TrainingMemory
    from attnlens.train import TrainConfig, optimise

    warnings.simplefilter("ignore")
    if kind == "minilm":
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(MINILM)
    else:
        from budget_promise import build

        model, _ = build(kind, 30522)
        model.config._attn_implementation = "sdpa"  # what from_pretrained gives these types
    with torch.no_grad():  # the weights paged in
        model.eval()(input_ids=torch.tensor([[1000] * 7 + [getattr(model.config, "eos_token_id", None) or 1000]]))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch * steps, tokens), generator=generator)
    eos = getattr(model.config, "eos_token_id", None)
    if eos is not None:  # an encoder-decoder classifier reads the last end-of-sequence token
        ids[:, -1] = eos
    labels = torch.randint(0, 2, (batch * steps,), generator=generator)
    cfg = TrainConfig(model=kind, out="unused", data_file="unused", batch_size=batch, progress=False,
                      memory_budget=budget_text)
    plan = TrainingMemory.of(model, parse_budget(budget_text))
    rows = plan.rows(tokens, batch)

    def make_batch(idx: list[int]) -> dict:
        return {"input_ids": ids[idx], "attention_mask": torch.ones_like(ids[idx]), "labels": labels[idx]}

    Path("/proc/self/clear_refs").write_text("5")
    before = process_status("VmRSS")
    start = time.perf_counter()
    optimise(model, [tokens] * (batch * steps), make_batch, cfg, torch.device("cpu"), log=lambda _: None)
    seconds = time.perf_counter() - start
    peak = process_status("VmHWM") - before
    return {"model": kind, "batch": batch, "tokens": tokens, "budget": budget_text, "rows": rows,
            "estimate_gib": plan.need(rows, tokens) / 2**30, "peak_gib": peak / 2**30,
            "ratio": peak / plan.budget, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--models", help="comma-separated models of the cases to run (default: every case)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(ROOT / "bench" / "data" / "training_memory.md"),
                        help="the Markdown table; the records go beside it as .jsonl")
    parser.add_argument("--one", nargs=4, help=argparse.SUPPRESS)  # internal: MODEL BATCH TOKENS BUDGET
    args = parser.parse_args()
    if args.one:
        kind, batch, tokens, budget = args.one
        print(json.dumps(one(kind, int(batch), int(tokens), budget, args.steps)))
        return
    from peak import measured

    rows = []
    chosen = set(args.models.split(",")) if args.models else None
    for kind, batch, tokens, budgets in CASES:
        if chosen is not None and kind not in chosen:
            continue
        base = None
        for budget in (UNBOUNDED, *budgets):
            out = measured(__file__, ["--one", kind, str(batch), str(tokens), budget, "--steps", str(args.steps)],
                           args.timeout, {"model": kind, "budget": budget})
            base = out if budget == UNBOUNDED else base
            if "seconds" in out and base is not None and "seconds" in base:
                out["time_ratio"] = out["seconds"] / base["seconds"]
            rows.append(out)
            print(json.dumps(out), file=sys.stderr, flush=True)
    out_path = Path(args.out)
    write_records(out_path, rows)
    lines = [f"{args.steps} training steps per case; peak = resident memory beyond the process's before training "
             f"(weights outside); `{UNBOUNDED}` is the batch in one piece; time as a ratio to it.", "",
             "| model | batch × tokens | budget | rows per micro-batch | estimate GiB | peak GiB | peak / budget | "
             "seconds | time ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | | {r['budget']} | error: {r['error'][:80]} | | | | | |")
            continue
        ratio = "—" if r["budget"] == UNBOUNDED else f"{r['ratio']:.2f}{' **over**' if r['ratio'] > 1.1 else ''}"
        lines.append(f"| {r['model']} | {r['batch']} × {r['tokens']:,} | {r['budget']} | {r['rows']} | "
                     f"{r['estimate_gib']:.2f} | {r['peak_gib']:.2f} | {ratio} | {r['seconds']:.1f} | "
                     f"{r.get('time_ratio', 1.0):.2f} |")
    out_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
