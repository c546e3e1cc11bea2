"""GlobEnc's paths on a GPU: its quadratic forms as batched products per key over every key (what an accelerator
runs), over the keys in use, and as the CPU's elementwise products over the keys in use, each timed beside a plain
forward + backward (``bench/long_context_gpu.py``'s) on SmolLM2's architecture; GlobEnc, attention norm and ALTI on
the GPU against the CPU on a short prompt; ALTI's time; a ``torch.profiler`` table of GlobEnc's default path.

Run: ``python bench/globenc_gpu_paths.py --model-dir DIR --text FILE --out OUT.jsonl [--device cuda] [--lengths
4096 8176]``, ``DIR`` and ``FILE`` as for ``bench/long_context_gpu.py``."""
import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context_gpu import build, plain_pass, prompt_ids  # noqa: E402

from attnlens import Explainer  # noqa: E402
from attnlens.methods.decomposition import pair_norms  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model-dir", type=Path, required=True)
parser.add_argument("--text", type=Path, required=True)
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--device", default="cuda")
parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8176])
args = parser.parse_args()
device, lengths = args.device, args.lengths
log = args.out.open("w")


def rec(row):
    print(json.dumps(row), flush=True)
    log.write(json.dumps(row) + "\n")
    log.flush()


sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
text = args.text.read_text()
ex = build(args.model_dir, device, torch.float32)
rec({"gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "torch": torch.__version__})
ELEM, BATCH, KEYS = pair_norms._quadratic_elementwise, pair_norms._quadratic_batched, pair_norms._keys_to_compute
VARIANTS = {
    "batched, every key (default)": (pair_norms.quadratic_rows, KEYS),
    "batched, keys in use": (lambda a, g: BATCH(a, g), pair_norms.keys_used),
    "elementwise, keys in use (before)": (lambda a, g: ELEM(a.double(), g), pair_norms.keys_used),
}


def once(fn):
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


def timed(fn, reps=3):
    """A warm-up, then the median of ``reps`` runs (one where the warm-up took a second or more)."""
    warm, result = once(fn)
    runs = []
    for _ in range(reps if warm < 1 else 1):
        seconds, result = once(fn)
        runs.append(seconds)
    return statistics.median(runs), result


# GPU against CPU on a short prompt, same weights
import copy  # noqa: E402

cpu = Explainer(copy.deepcopy(ex.model).cpu(), ex.tokenizer, max_length=ex.max_length)
prompt, answer = prompt_ids(ex, text, 96, 4)
for method in ("globenc", "attnnorm", "alti"):
    want = cpu.explain_answer(prompt, answer, [method]).scores[method]
    got = ex.explain_answer(prompt, answer, [method]).scores[method]
    rec({"check": "gpu vs cpu", "method": method, "max_rel_diff": float(abs(want - got).max() / abs(want).max())})
del cpu
for n in lengths:
    prompt, answer = prompt_ids(ex, text, n, 16)
    t, _ = timed(functools.partial(plain_pass, ex, prompt, answer))
    rec({"n": n, "method": "plain", "seconds": t})
    ref = None
    for name, (quad, keys) in VARIANTS.items():
        pair_norms.quadratic_rows, pair_norms._keys_to_compute = quad, keys
        torch.cuda.reset_peak_memory_stats() if device.startswith("cuda") else None
        t, e = timed(functools.partial(ex.explain_answer, prompt, answer, ["globenc"]))
        s = e.scores["globenc"]
        ref = s if ref is None else ref
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
        rec({"n": n, "method": "globenc", "variant": name, "seconds": t, "peak_gib": peak,
             "max_rel_diff_to_default": float(abs(s - ref).max() / abs(ref).max())})
    pair_norms.quadratic_rows, pair_norms._keys_to_compute = VARIANTS["batched, every key (default)"]
    t, _ = timed(functools.partial(ex.explain_answer, prompt, answer, ["alti"]))
    rec({"n": n, "method": "alti", "seconds": t})
# where the default path's time goes at the first length
prompt, answer = prompt_ids(ex, text, lengths[0], 16)
acts = [torch.profiler.ProfilerActivity.CPU]
acts += [torch.profiler.ProfilerActivity.CUDA] if device.startswith("cuda") else []
with torch.profiler.profile(activities=acts) as p:
    ex.explain_answer(prompt, answer, ["globenc"])
    sync()
ev = p.key_averages()
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
launches = sum(e.count for e in ev if e.key in LAUNCHES)
rec({"profile": lengths[0], "launches": launches, "syncs": sum(e.count for e in ev if "Synchronize" in e.key)})
key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
print(ev.table(sort_by=key, row_limit=15), flush=True)
print(ev.table(sort_by="self_cpu_time_total", row_limit=10), flush=True)
