"""Long prompts on a GPU: peak GPU memory and time per method and prompt length, against a plain pass, for
SmolLM2-135M and a 1B-parameter Llama built from configs (random weights: speed and memory do not depend on them).

On ``--device`` (default ``cuda``):

1. **agreement**: on a short prompt, every method's scores on the GPU against the same model's on the CPU
   (float32; the largest difference relative to the largest CPU score); on a longer one under small budgets, the
   passes that run fused or recompute their layers (``paths``); and ``attribute_context`` end to end;
2. **SmolLM2 table**: ``explain_answer`` of a 16-token answer after prompts of ``--lengths`` tokens (IMDB text),
   float32, the default memory budget, beside ``plain``: one forward + backward of the same sequence with fused
   attention (SDPA), the loss on the answer's tokens, as ``bench/long_context.py`` defines it;
3. **value zeroing and integrated gradients** at ``--slow-length`` tokens;
4. **1B table**: a Llama of 1.07B parameters (hidden 2048, 16 layers, 32 heads, 8 key/value heads, MLP 8192, the
   SmolLM2 tokenizer's vocabulary) in bfloat16 at ``--big-lengths`` tokens, with ``--big-budget``.

Each case of the tables runs in a fresh process, so that its peak holds nothing of another case's (``--in-process``:
each model's cases one after another in one process, each row with the memory allocated when it started,
``start_gib``, beside the weights' ``weights_gib``; much cheaper where a process takes seconds to start): once to warm
up, then timed (the median of three where the warm-up took under two seconds; the first run itself where it took
over ten). ``peak_gib`` is ``torch.cuda.max_memory_allocated`` over all its runs, the weights included
(``weights_gib``); ``within_promise`` says whether it stayed within the memory budget and the weights, plus 10%.
A run the budget refuses is recorded with its one line; a run out of GPU memory with ``out of memory``. Cases
stop being started once ``--deadline`` seconds have passed (recorded as skipped). Results go to
``OUT/long_context_gpu.jsonl`` as they come and a markdown table to ``OUT/long_context_gpu.md``.
``--no-math-sdp`` switches SDPA's math kernel off in each case (a call that would take it fails and names itself
in ``trace``); ``--snapshot`` writes each case's CUDA memory snapshot and, beside it, a summary of the blocks alive
at the traced peak grouped by their Python stacks (``.peak.txt``, small enough to come back from a remote machine
where the snapshot does not).

Run: ``python bench/long_context_gpu.py --model-dir DIR --text FILE --out OUT [--device cuda]`` where ``DIR``
holds SmolLM2's ``config.json`` and tokenizer files and ``FILE`` is plain text long enough for the longest prompt
(``bench/gpu_inputs.py OUT`` writes both, offline).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAST = ["rawatt", "attnnorm", "grads", "agrad", "cat", "attcat", "saliency", "inputxgradient"]
HEAVY = ["rollout", "gae", "globenc", "alti", "transatt", "attnlrp", "partiallrp"]
SLOW = ["valuezeroing", "integratedgradients"]
AGREE = FAST + HEAVY + ["attgrads", "decompx", "flow"] + SLOW
# a longer prompt under small budgets, so that the passes run fused and recompute their layers
SMALL_BUDGET_TOKENS = 384
SMALL_BUDGETS = {"grads": "256MiB", "attcat": "256MiB", "saliency": "256MiB", "attnlrp": "256MiB",
                 "partiallrp": "256MiB", "gae": "256MiB", "transatt": "640MiB"}
AT2_WEIGHTS = Path(__file__).resolve().parents[1] / "src" / "attnlens" / "sources" / "weights" / \
    "smollm2-135m-instruct.json"
BIG_1B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
          "intermediate_size": 8192, "head_dim": 64}


class Bench:
    """The run's state: where results go, when it started, the device."""

    def __init__(self, out: Path, device: str, quiet: bool = False) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.quiet = quiet
        self.log = (out / "long_context_gpu.jsonl").open("a" if quiet else "w", encoding="utf-8")
        self.out = out
        self.device = device
        self.start = time.perf_counter()
        self.results: list[dict] = []

    def record(self, row: dict) -> None:
        row["at_s"] = round(time.perf_counter() - self.start, 1)
        self.results.append(row)
        self.log.write(json.dumps(row) + "\n")
        self.log.flush()
        if not self.quiet:
            print(json.dumps(row), flush=True)


def build(model_dir: Path, device: str, dtype: Any, overrides: dict | None = None, seed: int = 0) -> Any:
    """An Explainer over a Llama built from SmolLM2's config (with ``overrides``), random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from attnlens import Explainer

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: a 1B model's random init is slow on the CPU
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return Explainer(model, tokenizer, max_length=config.max_position_embeddings)


def prompt_ids(ex: Any, text: str, n: int, answer: int) -> tuple[list[int], list[int]]:
    ids = ex.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < n + answer:
        raise SystemExit(f"--text holds {len(ids)} tokens; {n + answer} are needed")
    return ids[:n], ids[n: n + answer]


def plain_pass(ex: Any, prompt: list[int], answer: list[int]) -> None:
    """Forward + backward to the input embeddings with fused attention, the loss on the answer's logits."""
    import torch

    from attnlens.core.modelstate import explaining

    ids = torch.tensor([prompt + answer], device=ex.device)
    with explaining(ex.model, "sdpa"):
        embeddings = ex.model.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = ex.model(inputs_embeds=embeddings, use_cache=False, logits_to_keep=len(answer) + 1).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits.float(), ids[0, len(prompt):])
        torch.autograd.grad(loss, embeddings)


def one_run(ex: Any, method: str, prompt: list[int], answer: list[int], budget: str | None,
            options: dict | None) -> dict:
    from attnlens import InputError

    if method == "plain":
        plain_pass(ex, prompt, answer)
        return {}
    limit = {"memory_budget": budget} if budget else {}
    try:
        exp = ex.explain_answer(prompt, answer, [method], options=options, **limit)
    except InputError as exc:
        return {"refused": str(exc)}
    import numpy as np

    found: dict = {"finite": bool(all(np.isfinite(v).all() for v in exp.scores.values()))}
    if "n_steps" in exp.meta.get(method, {}):
        found["steps"] = int(np.max(exp.meta[method]["n_steps"]))
    return found


def timed_case(bench: Bench, ex: Any, model: str, method: str, prompt: list[int], answer: list[int],
               budget: str | None = None, options: dict | None = None,
               finish: Callable[[dict], None] | None = None) -> None:
    """Warm-up, then timed runs; one row recorded (``finish`` adds to it first)."""
    import torch

    row: dict = {"model": model, "method": method, "tokens": len(prompt), "answer_tokens": len(answer)}
    sync = torch.cuda.synchronize if bench.device.startswith("cuda") else (lambda: None)
    try:
        if bench.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        sync()
        start = time.perf_counter()
        found = one_run(ex, method, prompt, answer, budget, options)
        sync()
        warm = time.perf_counter() - start
        if "refused" in found:
            row.update(found)
            if finish is not None:
                finish(row)
            bench.record(row)
            return
        runs = []
        if warm > 10:  # long enough that start-up costs do not matter: the first run is the timing
            row["timed"] = "first run"
            runs.append(warm)
        for _ in range(0 if warm > 10 else 3 if warm < 2 else 1):
            sync()
            start = time.perf_counter()
            found = one_run(ex, method, prompt, answer, budget, options)
            sync()
            runs.append(time.perf_counter() - start)
        row.update(found, seconds=statistics.median(runs), warmup_seconds=warm, runs=runs)
        if bench.device.startswith("cuda"):
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError as exc:
        row["error"] = "out of memory: " + str(exc).splitlines()[0][:160]
    except Exception as exc:  # noqa: BLE001 - a failing case is a result too
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        row["trace"] = traceback.format_exc()[-1500:]
    finally:
        if bench.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if finish is not None:
        finish(row)
    bench.record(row)


@contextlib.contextmanager
def _paths() -> Any:
    """Within the block, which paths the passes took: ``fused_lrp`` (an LRP pass ran fused) and ``recomputed``
    (the shared pass recomputed its layers in the backward), counted over both devices."""
    from attnlens.core import recomputing
    from attnlens.methods import lrp_methods

    found = {"fused_lrp": 0, "recomputed": 0}
    real_pass, real_recomputed = lrp_methods.lrp_pass, recomputing.recomputed_layers

    def lrp_pass(*args: Any, **kwargs: Any) -> Any:
        found["fused_lrp"] += bool(kwargs.get("fused"))
        return real_pass(*args, **kwargs)

    def recomputed(model: Any) -> Any:
        found["recomputed"] += 1
        return real_recomputed(model)

    lrp_methods.lrp_pass, recomputing.recomputed_layers = lrp_pass, recomputed
    try:
        yield found
    finally:
        lrp_methods.lrp_pass, recomputing.recomputed_layers = real_pass, real_recomputed


def agreement(bench: Bench, model_dir: Path, text: str, n: int) -> None:
    """Every method on the GPU against the CPU (same weights, float32), and attribute_context end to end."""
    import copy

    import numpy as np
    import torch

    cpu = build(model_dir, "cpu", torch.float32)
    gpu_model = copy.deepcopy(cpu.model).to(bench.device)
    from attnlens import Explainer

    gpu = Explainer(gpu_model, cpu.tokenizer, max_length=cpu.max_length)
    options = {"integratedgradients": {"n_steps": 16}, "flow": {"workers": 4}}
    # short: every method's default path; long under a small budget: the fused LRP passes and the shared pass
    # recomputing its layers in the backward (which a GPU runs in autograd's own thread)
    cases = [(n, method, None) for method in AGREE]
    cases += [(SMALL_BUDGET_TOKENS, method, budget) for method, budget in SMALL_BUDGETS.items()]
    for tokens, method, budget in cases:
        prompt, answer = prompt_ids(cpu, text, tokens, 4)
        row: dict = {"model": "smollm2", "case": "agreement", "method": method, "tokens": tokens}
        if budget:
            row["budget"] = budget
        try:
            opts = {k: v for k, v in options.items() if k == method} or None
            limit = {"memory_budget": budget} if budget else {}
            with _paths() as paths:
                start = time.perf_counter()
                want = cpu.explain_answer(prompt, answer, [method], options=opts, **limit).scores[method]
                row["cpu_seconds"] = time.perf_counter() - start
                start = time.perf_counter()
                got = gpu.explain_answer(prompt, answer, [method], options=opts, **limit).scores[method]
                row["gpu_seconds"] = time.perf_counter() - start
            row.update(paths)
            want, got = np.asarray(want, dtype=np.float64), np.asarray(got, dtype=np.float64)
            row["shape_equal"] = want.shape == got.shape
            scale = float(np.abs(want).max()) or 1.0
            row["max_rel_diff"] = float(np.abs(want - got).max() / scale) if want.shape == got.shape else None
            row["top1_equal"] = bool(np.argmax(want.reshape(-1)) == np.argmax(got.reshape(-1)))
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            row["trace"] = traceback.format_exc()[-1500:]
        bench.record(row)
    context = text[:1500].replace("\n", "\n\n")
    for where, ex in (("cpu", cpu), ("gpu", gpu)):
        row = {"model": "smollm2", "case": "attribute_context", "device": where}
        try:
            start = time.perf_counter()
            res = ex.attribute_context(context, "What did the reviewer think?", answer=" It was bad.",
                                       sources="sentence", methods=["at2", "attnlrp", "loo"],
                                       options={"at2": {"weights": str(AT2_WEIGHTS)}})
            row["seconds"] = time.perf_counter() - start
            row["scores"] = {m: [round(float(s), 6) for s in res.scores[m][:5]] for m in res.scores}
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            row["trace"] = traceback.format_exc()[-1500:]
        bench.record(row)
    del cpu, gpu, gpu_model


def run_one(args: argparse.Namespace, case: dict) -> None:
    """One case in a fresh process, so that its peak holds nothing of another case's: its row on the last line of
    stdout."""
    bench = Bench(args.out / "cases", args.device, quiet=True)
    run_cases(bench, args, case["model"], [case])
    print(json.dumps(bench.results[-1]), flush=True)


def run_cases(bench: Bench, args: argparse.Namespace, model: str, cases: list[dict]) -> None:
    """``cases`` of one model, one after another in this process on one model built once. Each row records the
    memory allocated when it started (``start_gib``): where that is the weights' (``weights_gib``), nothing of an
    earlier case was left and its peak is its own."""
    import torch

    text = args.text.read_text(encoding="utf-8")
    if model == "smollm2":
        ex = build(args.model_dir, args.device, torch.float32)
    else:
        longest = max(args.big_lengths) + args.answer
        ex = build(args.model_dir, args.device, torch.bfloat16,
                   {**args.big_overrides, "max_position_embeddings": longest})
    cuda = args.device.startswith("cuda")
    if cuda and args.no_math_sdp:  # a call that would fall back to the math kernel fails, naming itself
        torch.backends.cuda.enable_math_sdp(False)
    weights = torch.cuda.memory_allocated() / 2**30 if cuda else None
    for case in cases:
        if time.perf_counter() - bench.start > args.deadline:
            bench.record({**case, "answer_tokens": args.answer, "skipped": "deadline"})
            continue
        prompt, answer = prompt_ids(ex, text, case["tokens"], args.answer)
        gc.collect()
        if cuda and args.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        start = torch.cuda.memory_allocated() / 2**30 if cuda else None

        def finish(row: dict, case: dict = case, start: float | None = start) -> None:
            if start is not None:
                row["weights_gib"], row["start_gib"] = weights, start
            if weights is not None and "peak_gib" in row and case["method"] != "plain":
                from attnlens.core.memory import DEFAULT_BUDGET, parse_budget

                budget = (parse_budget(case["budget"]) if case["budget"] else DEFAULT_BUDGET) / 2**30
                # the promise: a run's peak stays within the budget and the weights, plus 10%
                row["within_promise"] = row["peak_gib"] <= 1.1 * (budget + weights)
            if cuda and args.snapshot:
                name = f"snapshot_{model}_{case['method']}_{case['tokens']}.pickle"
                torch.cuda.memory._dump_snapshot(str(args.out / name))
                torch.cuda.memory._record_memory_history(enabled=None)
                row["snapshot"] = name
                summary = args.out / name.replace(".pickle", ".peak.txt")
                summary.write_text(snapshot_peak(args.out / name), encoding="utf-8")

        timed_case(bench, ex, model, case["method"], prompt, answer, budget=case["budget"], finish=finish)
    del ex
    if cuda:
        torch.cuda.empty_cache()


def _stack(frames: list[dict], depth: int = 7) -> str:
    """The Python frames of an allocation that are attnlens's, transformers', the bench's or autograd's, inner
    first (``file:line:function``)."""
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    ours = [f for f in py if any(k in f["filename"] for k in ("attnlens", "transformers", "bench", "autograd",
                                                               "checkpoint"))]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in (ours or py)[:depth])


def snapshot_peak(path: Path, groups: int = 14) -> str:
    """What a CUDA memory snapshot holds at the peak of its trace: the blocks alive then, grouped by their stacks,
    largest first, and the allocation that made the peak (blocks allocated before the trace started, the
    weights, are not in it)."""
    import pickle

    with open(path, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    alive: dict[int, dict] = {}
    current = peak = peak_at = 0
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            alive[e["addr"]] = e
            current += e["size"]
            if current > peak:
                peak, peak_at = current, i
        elif e["action"] == "free_completed" and e["addr"] in alive:
            current -= alive.pop(e["addr"])["size"]
    alive = {}
    for e in trace[: peak_at + 1]:  # the blocks alive at the peak
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    grouped: dict[str, list[int]] = {}
    for e in alive.values():
        g = grouped.setdefault(_stack(e.get("frames", [])), [0, 0])
        g[0] += e["size"]
        g[1] += 1
    lines = [f"{path.name}: {len(trace)} events; traced peak {peak / 2**30:.3f} GiB at event {peak_at}"]
    for stack, (size, count) in sorted(grouped.items(), key=lambda kv: -kv[1][0])[:groups]:
        lines.append(f"  {size / 2**20:9.1f} MiB in {count:4d} blocks: {stack}")
    if trace:
        e = trace[peak_at]
        lines.append(f"  the peak's allocation, {e['size'] / 2**20:.1f} MiB: {_stack(e.get('frames', []), 12)}")
    return "\n".join(lines) + "\n"


def table(results: list[dict]) -> str:
    """Markdown, one table per model: peak GiB, seconds and the ratio to ``plain`` per method and length."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in results if "case" not in r):
        rows = [r for r in results if r["model"] == model and "case" not in r]
        lengths = sorted({r["tokens"] for r in rows})
        # each case's ratio is to the plain pass timed last before it at its length (a group of cases run later,
        # value zeroing and integrated gradients, has a plain pass of its own)
        plain_of: dict[int, float] = {}
        last: dict[int, float] = {}
        for i, r in enumerate(rows):
            if r["method"] == "plain" and r.get("seconds"):
                last[r["tokens"]] = r["seconds"]
            elif r["tokens"] in last:
                plain_of[i] = last[r["tokens"]]
        lines += [f"\n{model}\n", "| method | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for method in dict.fromkeys(r["method"] for r in rows):
            cells = []
            for n in lengths:
                found = [(i, r) for i, r in enumerate(rows) if r["method"] == method and r["tokens"] == n]
                i, r = found[0] if found else (None, None)
                if r is None:
                    cells.append("—")
                elif "refused" in r:
                    cells.append("refused")
                elif "skipped" in r:
                    cells.append("not run (time)")
                elif "error" in r:
                    cells.append(f"failed: {r['error'][:50]}")
                elif method == "plain":  # every plain pass at this length, in the order they ran
                    cells.append(f"{r.get('peak_gib', float('nan')):.2f} GiB, "
                                 + " / ".join(f"{q['seconds']:.3f} s" for _, q in found if q.get("seconds")))
                else:
                    ratio = f", {r['seconds'] / plain_of[i]:.1f}×" if i in plain_of else ""
                    ratio += f" ({r['steps']} steps)" if "steps" in r else ""
                    cells.append(f"{r.get('peak_gib', float('nan')):.2f} GiB, {r['seconds']:.3f} s{ratio}")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    agree = [r for r in results if r.get("case") == "agreement"]
    if agree:
        lines += ["\nGPU against CPU (float32)\n",
                  "| method | tokens, budget | max relative difference | top-1 equal | paths | cpu s | gpu s |",
                  "|---|---|---|---|---|---|---|"]
        for r in agree:
            case = f"{r['tokens']}, {r.get('budget', 'default')}"
            if "error" in r:
                lines.append(f"| {r['method']} | {case} | failed: {r['error'][:60]} | | | | |")
            else:
                paths = ", ".join(k for k in ("fused_lrp", "recomputed") if r.get(k)) or "—"
                lines.append(f"| {r['method']} | {case} | {r['max_rel_diff']:.1e} | {r['top1_equal']} | {paths} | "
                             f"{r['cpu_seconds']:.2f} | {r['gpu_seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, required=True, help="SmolLM2's config.json and tokenizer files")
    p.add_argument("--text", type=Path, required=True, help="plain text for the prompts")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096, 8176])
    p.add_argument("--methods", nargs="+", default=["plain", *FAST, *HEAVY])
    p.add_argument("--agree-length", type=int, default=96, help="prompt tokens of the GPU-against-CPU check (0: skip)")
    p.add_argument("--slow-length", type=int, default=2048)
    p.add_argument("--big-lengths", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--big-methods", nargs="+",
                   default=["plain", "rawatt", "grads", "inputxgradient", "attcat", "attnlrp", "partiallrp",
                            "rollout", "gae", "globenc", "transatt", "alti"])
    p.add_argument("--big-budget", default="48GiB")
    p.add_argument("--big-overrides", type=json.loads, default=BIG_1B,
                   help="config fields of the large model (JSON; default: 1.07B parameters)")
    p.add_argument("--answer", type=int, default=16)
    p.add_argument("--deadline", type=float, default=480, help="seconds after which no case is started")
    p.add_argument("--no-math-sdp", action="store_true",
                   help="switch off SDPA's math kernel in each case (a call that would take it fails, naming itself)")
    p.add_argument("--snapshot", action="store_true",
                   help="write each case's CUDA memory snapshot (torch.cuda.memory._dump_snapshot) to OUT, and a "
                        "summary of what is alive at its peak")
    p.add_argument("--in-process", action="store_true",
                   help="run each model's cases one after another in one process (each row's start_gib says whether "
                        "an earlier case left memory behind)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch
    import transformers

    if args.one:  # one case in this process: its row on the last line of stdout
        run_one(args, json.loads(args.one))
        return

    bench = Bench(args.out, args.device)
    info = {"case": "info", "model": "-", "torch": torch.__version__, "transformers": transformers.__version__}
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    bench.record(info)
    text = args.text.read_text(encoding="utf-8")
    try:
        if args.agree_length:
            agreement(bench, args.model_dir, text, args.agree_length)
        cases = [("smollm2", m, n, None) for n in args.lengths for m in args.methods]
        if args.slow_length:
            cases += [("smollm2", m, args.slow_length, None) for m in ["plain", *SLOW]]
        cases += [("llama-1b", m, n, args.big_budget) for n in args.big_lengths for m in args.big_methods]
        if args.in_process:  # each model's cases in one process (no start-up per case: cheaper on a lent machine)
            for model in dict.fromkeys(c[0] for c in cases):
                mine = [{"model": m, "method": method, "tokens": n, "budget": budget}
                        for m, method, n, budget in cases if m == model]
                run_cases(bench, args, model, mine)
            return
        for model, method, n, budget in cases:
            row = {"model": model, "method": method, "tokens": n, "answer_tokens": args.answer}
            left = args.deadline - (time.perf_counter() - bench.start)
            if left <= 0:
                bench.record({**row, "skipped": "deadline"})
                continue
            one = json.dumps({"model": model, "method": method, "tokens": n, "budget": budget})
            cmd = [sys.executable, __file__, "--one", one, "--model-dir", str(args.model_dir), "--text",
                   str(args.text), "--out", str(args.out), "--device", args.device, "--answer", str(args.answer),
                   "--big-overrides", json.dumps(args.big_overrides),
                   *(["--no-math-sdp"] if args.no_math_sdp else []), *(["--snapshot"] if args.snapshot else []),
                   "--big-lengths", *map(str, args.big_lengths)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30.0, left + 60))
                found = json.loads(proc.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                found = {**row, "error": "over the deadline"}
            except (ValueError, IndexError):
                found = {**row, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
            bench.record(found)
    finally:
        (args.out / "long_context_gpu.md").write_text(table(bench.results), encoding="utf-8")
        print(table(bench.results), flush=True)


if __name__ == "__main__":
    main()
