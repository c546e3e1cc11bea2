"""Memory of the shared pass on ``../shared/models/minilm-sst2``: one batch of 32 inputs x 128 tokens.

For each request (attention only, AttCAT, the ten shared-pass methods) a fresh process explains the batch once
(``Explainer.compute_batch``) and reports
- the bytes of the tensors the capture keeps (attention, hidden states, embeddings and their gradients), and
- the peak resident memory during the call above the resident memory before it (Linux ``VmHWM``, reset through
  ``/proc/self/clear_refs``).

Run: ``python bench/capture_memory.py [--batch-size 32] [--tokens 128]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REQUESTS = {
    "attention only (rawatt)": ["rawatt"],
    "attcat": ["attcat"],
    "10 shared-pass methods": ["rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat",
                               "saliency", "inputxgradient"],
}
FIELDS = ("attentions", "attention_grads", "hidden", "hidden_grads", "embeddings", "embedding_grads")


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(methods: list[str], batch_size: int, tokens: int) -> dict[str, float]:
    """Capture bytes and peak RSS increase (MiB) of one ``compute_batch`` call, in this process."""
    from common import MODEL, SHARED

    from attnlens import Explainer
    from attnlens.methods import get_method

    ex = Explainer.from_pretrained(MODEL, max_length=tokens)
    rows = (SHARED / "data" / "sst2" / "dev.jsonl").read_text(encoding="utf-8").splitlines()
    text = " ".join(json.loads(r)["text"] for r in rows[:40])  # long enough to fill `tokens` after truncation
    encoded = ex.encode([text] * batch_size, truncation=True)
    assert all(len(e.ids) == tokens for e in encoded)
    specs = [get_method(m) for m in methods]
    ex.compute_batch(encoded, [-1] * batch_size, specs, {})  # warm-up: lazy imports, thread pools
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak to the current resident size
    before = _status("VmRSS")
    ctx, _ = ex.compute_batch(encoded, [-1] * batch_size, specs, {})
    peak = _status("VmHWM") - before
    kept = 0
    for name in FIELDS:
        value = getattr(ctx.capture, name)
        for t in [] if value is None else (value if isinstance(value, list) else [value]):
            kept += t.numel() * t.element_size()
    return {"capture_mib": kept / 2**20, "peak_rss_mib": peak / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one request in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(REQUESTS[args.one], args.batch_size, args.tokens)))
        return
    print(f"minilm-sst2, {args.batch_size} inputs x {args.tokens} tokens, one compute_batch per fresh process")
    print(f"{'request':<28} {'capture (MiB)':>14} {'peak RSS increase (MiB)':>24}")
    for name in REQUESTS:
        # A fixed mmap threshold makes glibc return every large freed block at once, so RSS follows live memory.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run([sys.executable, __file__, "--one", name, "--batch-size", str(args.batch_size),
                              "--tokens", str(args.tokens)], check=True, capture_output=True, text=True, env=env)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:<28} {r['capture_mib']:>14.1f} {r['peak_rss_mib']:>24.1f}")


if __name__ == "__main__":
    main()
