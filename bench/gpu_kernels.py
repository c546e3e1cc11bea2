"""The CUDA kernels against the paths they replace, on long prompts: ALTI's L1 distances in one Triton kernel
(against the batched products written to memory) and AttCAT's received attention from the memory-efficient
kernel's log-normalisers (against the sum over chunks of recomputed probabilities). Per model, length and method:
the scores' largest difference between the two paths (relative to the largest score), the time and the peak GPU
memory of each, beside one plain forward + backward of the same sequence with fused attention.

    python bench/gpu_kernels.py --model-dir gpu/smollm2 --text gpu/imdb.txt --out results/gpu_kernels.jsonl

Models are Llamas built from ``--model-dir``'s config with random weights (time and memory do not depend on the
weights): SmolLM2-135M's in float32, and with ``--big-lengths`` a 1.07B-parameter one in bfloat16.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from long_context_gpu import BIG_1B, build, plain_pass, prompt_ids  # noqa: E402

from attnlens.core import row_attention  # noqa: E402
from attnlens.methods.decomposition import triton_kernels  # noqa: E402


@contextlib.contextmanager
def replaced(method: str) -> Iterator[None]:
    """The path ``method`` took before its kernel: ALTI's batched products, GlobEnc's and attention norm's batched
    quadratic forms, AttCAT's chunk sums."""
    if method != "attcat":
        saved, triton_kernels.applies = triton_kernels.applies, lambda *t: False
        try:
            yield
        finally:
            triton_kernels.applies = saved
    else:
        saved, row_attention._fused_with_normalisers = row_attention._fused_with_normalisers, lambda *a: None
        try:
            yield
        finally:
            row_attention._fused_with_normalisers = saved


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, run: Any, reps: int) -> tuple[float, float, Any]:
    """Median seconds over ``reps`` runs after a warm-up, peak GiB of the last, the last result."""
    run()
    times, result = [], None
    for _ in range(reps):
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        sync(device)
        start = time.perf_counter()
        result = run()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")
    return statistics.median(times), peak, result


def difference(new: Any, old: Any, method: str) -> float:
    """The largest difference of scores and per-layer scores, relative to the largest score."""
    worst = 0.0
    for field in ("scores", "layers"):
        a, b = getattr(new, field).get(method), getattr(old, field).get(method)
        if a is None or b is None:
            continue
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--text", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", type=int, nargs="*", default=[96, 2048, 8176])
    parser.add_argument("--big-lengths", type=int, nargs="*", default=[96, 8192])
    parser.add_argument("--methods", nargs="+", default=["alti", "globenc", "attcat"])
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--tune", action="store_true",
                        help="time the kernels' tile sizes on one chunk first and run with the fastest")
    parser.add_argument("--old-up-to", type=int, default=8192, help="longest prompt the replaced paths run at")
    args = parser.parse_args()
    text = args.text.read_text()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.open("w")

    def record(row: dict) -> None:
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    record({"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "triton": _version("triton")})
    if args.tune and args.device.startswith("cuda"):
        for row in tune():
            record(row)
    models = [("smollm2", torch.float32, None, "4GiB", args.lengths)]
    if args.big_lengths:
        models.append(("llama-1b", torch.bfloat16, BIG_1B, "48GiB", args.big_lengths))
    for name, dtype, overrides, budget, lengths in models:
        ex = build(args.model_dir, args.device, dtype, overrides)
        for n in lengths:
            for row in measure(ex, args, text, n, budget):
                record({"model": name, **row})
        del ex
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def measure(ex: Any, args: argparse.Namespace, text: str, n: int, budget: str) -> Iterator[dict]:
    """The plain pass's row, then each method's at ``n`` prompt tokens."""
    prompt, answer = prompt_ids(ex, text, n, args.answer)
    plain, plain_peak, _ = timed(args.device, lambda: plain_pass(ex, prompt, answer), args.reps)
    yield {"tokens": n, "method": "plain", "seconds": plain, "peak_gib": plain_peak}
    for method in args.methods:
        row: dict[str, Any] = {"tokens": n, "method": method}

        def run(m: str = method) -> Any:
            return ex.explain_answer(prompt, answer, [m], memory_budget=budget)

        try:
            row["seconds"], row["peak_gib"], new = timed(args.device, run, args.reps)
            row["x_plain"] = row["seconds"] / plain
            if n <= args.old_up_to:
                with replaced(method):
                    row["old_seconds"], row["old_peak_gib"], old = timed(args.device, run, args.reps)
                row["old_x_plain"] = row["old_seconds"] / plain
                row["max_rel_diff"] = difference(new, old, method)
                row["same_top"] = int(np.argmax(new.scores[method])) == int(np.argmax(old.scores[method]))
        except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the others still run
            row["error"] = f"{type(exc).__name__}: {exc}"[:600]
        yield row


def tune(device: str = "cuda", h: int = 9, r: int = 228, n: int = 8176, d: int = 576) -> Iterator[dict]:
    """Each kernel's tile sizes timed on one chunk of SmolLM2 at 8,176 tokens (9 heads, 228 rows, D = 576); the
    fastest is set for the rest of the run."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.rand(1, h, r, n, device=device, generator=gen).tril(n - r)  # causal: row i sees keys <= n - r + i
    a = a / a.sum(-1, keepdim=True)
    g = torch.randn(1, n, h, d, device=device, generator=gen)
    y, m = (torch.randn(1, r, d, device=device, generator=gen) for _ in range(2))
    at = torch.arange(n - r, n, device=device)
    first = torch.zeros(n, dtype=torch.int64, device=device)
    first[n - r:] = torch.arange(r, device=device)
    gram = torch.randn(1, n, h, h, device=device, generator=gen, dtype=torch.float64)

    def clock(fn: Any) -> float:
        fn()
        sync(device)
        start = time.perf_counter()
        for _ in range(3):
            fn()
        sync(device)
        return (time.perf_counter() - start) / 3

    dist = torch.empty(1, n, r, device=device)
    exact = torch.empty(1, n, r, device=device, dtype=torch.float64)
    triton_kernels.alti_distances(*(x.double() for x in (a, g, y, m)), at, first, exact)
    scale = float(exact.abs().max())
    valid = torch.arange(r, device=device)[None, :] >= first[:, None]
    best = None
    for config in [(16, 16, 32, 4), (16, 16, 32, 8), (32, 16, 16, 4), (16, 32, 16, 4), (32, 32, 8, 4),
                   (32, 32, 16, 8), (64, 16, 8, 4), (16, 64, 8, 4)]:
        triton_kernels._KEYS, triton_kernels._ROWS, triton_kernels._CHANNELS, triton_kernels._WARPS = config
        row = {"tune": "alti", "tile": list(config)}
        try:
            dist.zero_()
            row["seconds"] = clock(lambda: triton_kernels.alti_distances(a, g, y, m, at, first, dist))
            row["max_rel_diff_float64"] = float(((dist.double() - exact).abs() * valid).max()) / scale
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is reported
            row["error"] = str(exc)[:300]
        yield row
        if "seconds" in row and (best is None or row["seconds"] < best[0]):
            best = (row["seconds"], config)
    if best:
        triton_kernels._KEYS, triton_kernels._ROWS, triton_kernels._CHANNELS, triton_kernels._WARPS = best[1]
        yield {"tune": "alti", "chosen": list(best[1])}
    best = None
    for keys, tile in [(16, 4096), (32, 4096), (16, 2048), (64, 8192), (32, 8192)]:
        triton_kernels._QUAD_KEYS, triton_kernels._QUAD_TILE = keys, tile
        try:
            seconds = clock(lambda: triton_kernels.quadratic_rows(a, gram))
        except Exception as exc:  # noqa: BLE001
            yield {"tune": "quadratic", "tile": [keys, tile], "error": str(exc)[:300]}
            continue
        yield {"tune": "quadratic", "tile": [keys, tile], "seconds": seconds}
        if best is None or seconds < best[0]:
            best = (seconds, (keys, tile))
    if best:
        triton_kernels._QUAD_KEYS, triton_kernels._QUAD_TILE = best[1]
        yield {"tune": "quadratic", "chosen": list(best[1])}
    from attnlens.methods.decomposition import pair_norms

    batched = clock(lambda: pair_norms._quadratic_batched(a, gram))
    yield {"tune": "quadratic", "batched_seconds": batched}
    with replaced("alti"):
        pairs = clock(lambda: pair_norms.alti_rows(a, g, m, y, at))
    yield {"tune": "alti", "batched_alti_rows_seconds": pairs,
           "kernel_alti_rows_seconds": clock(lambda: pair_norms.alti_rows(a, g, m, y, at))}


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
