"""What does the attention each key receives cost on a long prompt: the fused kernel's normalisers against a
softmax over every chunk of probabilities?

AttCAT and CAT read, per layer, the attention each key receives from the explained rows' queries (a weighted
column sum of the head-mean map). Where the layer's attention runs PyTorch's fused CPU kernel, attnlens asks
that kernel for each query's log-normaliser as well and sums the columns with one more fused attention, from the
keys over the queries (``attnlens.core.row_attention._received_fused``); elsewhere it recomputes the
probabilities a chunk of query rows at a time and sums them (``_received``). This times both on one layer of
SmolLM2-135M-Instruct's shape (9 heads of 64, causal) at ``--tokens`` tokens, each including the layer's own
attention (which the fused path runs anyway, with the normalisers): random queries and keys (the time does not
depend on their values), weights spread over the last ``--rows`` queries. Medians of ``--repeat`` runs, one
thread count, and the largest difference between the two sums relative to the largest sum.

Run: ``python bench/received_attention.py [--tokens 8176] [--repeat 3] [--out bench/data/received_attention.md]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak import ROOT, machine  # noqa: E402

HEADS, HEAD_SIZE = 9, 64


def measure(tokens: int, rows: int, repeat: int) -> dict:
    """Both paths' seconds (medians) on one layer of ``tokens`` tokens and their largest relative difference."""
    import torch

    from attnlens.core import row_attention as ra

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, tokens, HEAD_SIZE) for _ in range(3))
    scale = HEAD_SIZE ** -0.5
    weights = torch.zeros(1, tokens)
    weights[:, tokens - rows:] = 1 / rows
    op = ra._fused_with_normalisers(q, k, v, None, 0.0)
    if op is None:
        raise SystemExit("no fused kernel with normalisers on this machine")

    def fused() -> torch.Tensor:
        _, lse = op(q, k, v, True, scale)
        return ra._received_fused(op, weights, q, k, lse, True, scale)

    def chunks() -> torch.Tensor:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return ra._received(ra.RowRecorder(received_weights=weights), q, k, None, True, scale)

    times: dict[str, list[float]] = {"fused": [], "chunks": []}
    sums = {}
    for _ in range(repeat):
        for name, run in (("fused", fused), ("chunks", chunks)):
            start = time.perf_counter()
            sums[name] = run()
            times[name].append(time.perf_counter() - start)
    diff = (sums["fused"] - sums["chunks"]).abs().max() / sums["chunks"].abs().max()
    return {"tokens": tokens, "rows": rows, "fused_seconds": statistics.median(times["fused"]),
            "chunk_seconds": statistics.median(times["chunks"]), "runs": times, "relative_difference": float(diff),
            "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8176)
    p.add_argument("--rows", type=int, default=16, help="queries the weights spread over (the answer's rows)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "data" / "received_attention.md")
    args = p.parse_args()
    found = measure(args.tokens, args.rows, args.repeat)
    text = (f"One causal attention layer of {HEADS} heads of {HEAD_SIZE} over {found['tokens']:,} tokens, the "
            f"attention each key receives from the last {found['rows']} queries, medians of {args.repeat} runs "
            f"({found['threads']} threads), each with the layer's own attention:\n\n"
            "| path | seconds |\n|---|---|\n"
            f"| fused kernel's normalisers + one more fused attention | {found['fused_seconds']:.2f} |\n"
            f"| softmax over every chunk of probabilities | {found['chunk_seconds']:.2f} |\n\n"
            f"Largest difference between the two sums: {found['relative_difference']:.1e} of the largest.\n\n"
            f"Measured on {machine()}.\n")
    args.out.write_text(text, encoding="utf-8")
    args.out.with_suffix(".json").write_text(json.dumps(found, indent=1) + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
