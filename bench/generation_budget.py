"""Does explaining a generation step by step stay within its memory budget? Per method, at the longest prompt the
budget admits.

``Explainer.explain_generation`` explains every step of a forced continuation; the steps share one forward over
the sequence and run in batches sized to the budget. For each method: a fresh process finds the longest sequence
the estimate admits (the refusal's own figure for a longer one, at most ``--max-tokens``), then another fresh
process loads the model, warms up on a short generation, resets the peak (Linux ``VmHWM`` through
``/proc/self/clear_refs``) and explains a ``--steps``-token continuation after the longest prompt admitted.
Reported: the prompt's length, the peak resident memory beyond what the process held before the call (the
model's weights are outside it), its ratio to the budget, and whether it keeps the promise: peak ≤ 1.1 × (budget
+ weights) − weights. The model is a Llama of random weights (``--layers`` layers, hidden size 256, 4 heads, 2
key-value heads, a 2,001-word vocabulary): memory does not depend on the weights. The processes start with
glibc's mmap threshold fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``), where attnlens's own policy
(``attnlens.core.allocator``) does not set it: the peaks count the tensors more than how the heaps happened to be
reused, and may read lower than under glibc's default; ``--glibc-default`` leaves glibc's own policy, as a user's
process has it. Attention flow is left out by
default (its maximum flows over the longest sequences take longer than a case's timeout).

``--kept`` takes instead the longest prompt whose shared pass keeps every layer's activations (what its forward
saves, counted on the model), the other limit the estimate draws for the gradient methods.

Run: ``python bench/generation_budget.py [--methods rawatt,...] [--budget 256MiB] [--steps 16]
[--glibc-default] [--kept] [--out bench/data/generation_budget.md]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak import ROOT, machine, process_status, write_records  # noqa: E402

METHODS = ("rawatt", "rollout", "grads", "agrad", "attcat", "gae", "saliency", "inputxgradient", "attnnorm",
           "globenc", "alti", "decompx", "valuezeroing", "integratedgradients", "attnlrp", "partiallrp", "transatt")
VOCAB = 2000


def build(layers: int) -> object:
    """The explainer of a random Llama and a word-level tokenizer (words ``w3`` … ``w1999``)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from attnlens import Explainer

    words = {f"w{i}": i for i in range(3, VOCAB)} | {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": VOCAB}
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<pad>",
                                                     bos_token="<s>", eos_token="</s>", model_max_length=8192)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB + 1, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=8192, tie_word_embeddings=True, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)
    return Explainer(transformers.LlamaForCausalLM(config).eval(), tokenizer, max_length=8192)


def _words(n: int) -> str:
    return " ".join(f"w{5 + (i * 7) % 1900}" for i in range(n))


def _explain(ex: object, method: str, prompt: str, steps: int, budget: object) -> object:
    options = {"integratedgradients": {"n_steps": 8}} if method == "integratedgradients" else None
    return ex.explain_generation(prompt, [method], target=" " + _words(steps), memory_budget=budget, options=options)


def longest(method: str, budget: str, steps: int, layers: int, max_tokens: int, kept: bool = False) -> int:
    """The longest prompt (tokens, at most ``max_tokens``) whose ``steps``-token continuation the estimate
    admits, in this process: the estimate alone decides, as ``explain_generation`` does before any pass runs
    (:func:`attnlens.core.engine.pass_cost` over the steps' prefixes, refused in one line beyond it). ``kept``:
    the longest whose shared pass also keeps every layer's activations (a longer one recomputes them)."""
    from attnlens import InputError
    from attnlens.core import engine
    from attnlens.core.memory import parse_budget
    from attnlens.methods import get_method

    ex = build(layers)
    limit = parse_budget(budget)
    cost = engine.pass_cost(ex.runner, [get_method(method)], limit, prefixes=True, steps=steps)
    lo, hi = 0, max_tokens
    while lo < hi:  # the estimate grows with the length
        mid = (lo + hi + 1) // 2
        try:
            cost.refuse_over(mid + steps, limit, what="a generation")
            storage = cost.storage(mid + steps)
            if kept and (storage is None or not storage.backward or storage.recompute):
                raise InputError("recomputed")
            lo = mid
        except InputError:
            hi = mid - 1
    return lo


def one(method: str, budget_text: str, steps: int, layers: int, prompt_tokens: int) -> dict:
    """The case, in this process."""
    import warnings

    from attnlens import InputError
    from attnlens.core.memory import parse_budget

    warnings.simplefilter("ignore")
    ex = build(layers)
    budget = parse_budget(budget_text)
    weights = sum(p.numel() * p.element_size() for p in ex.model.parameters())
    _explain(ex, method, _words(3), 2, "64GiB")  # warm-up
    Path("/proc/self/clear_refs").write_text("5")
    before = process_status("VmRSS")
    start = time.perf_counter()
    refused = ""
    try:
        _explain(ex, method, _words(prompt_tokens), steps, budget)
    except InputError as err:
        refused = str(err)
    peak = process_status("VmHWM") - before
    promise = 1.1 * (budget + weights) - weights
    return {"method": method, "prompt_tokens": prompt_tokens, "steps": steps, "budget_mib": budget / 2**20,
            "weights_mib": weights / 2**20, "peak_mib": peak / 2**20, "ratio": peak / budget,
            "promise_mib": promise / 2**20, "within": peak <= promise, "seconds": time.perf_counter() - start,
            "refused": refused}


def _child(args: list[str], timeout: float, glibc_default: bool = False) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    if not glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode:
        raise RuntimeError((proc.stderr.strip().splitlines() or ["?"])[-1][:200])
    return proc.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--budget", default="256MiB")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--glibc-default", action="store_true",
                        help="start the processes with glibc's own mmap policy instead of a 64 KiB threshold")
    parser.add_argument("--kept", action="store_true",
                        help="the longest prompt whose shared pass keeps every layer's activations instead")
    parser.add_argument("--out", default=str(ROOT / "bench" / "data" / "generation_budget.md"))
    parser.add_argument("--longest", metavar="METHOD", help=argparse.SUPPRESS)  # internal: the probe
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "PROMPT"), help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.longest:
        print(longest(args.longest, args.budget, args.steps, args.layers, args.max_tokens, args.kept))
        return
    if args.one:
        print(json.dumps(one(args.one[0], args.budget, args.steps, args.layers, int(args.one[1]))))
        return
    common = ["--budget", args.budget, "--steps", str(args.steps), "--layers", str(args.layers), "--max-tokens",
              str(args.max_tokens)]
    rows = []
    for method in args.methods.split(","):
        try:
            prompt = int(_child([*common, "--longest", method, *(["--kept"] if args.kept else [])], args.timeout,
                                args.glibc_default))
            row = json.loads(_child([*common, "--one", method, str(prompt)], args.timeout, args.glibc_default))
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as err:
            row = {"method": method, "error": str(err)[:200]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    out = Path(args.out)
    write_records(out, rows)
    limit = ("whose shared pass keeps every layer's activations" if args.kept else "the estimate admits")
    lines = [f"A {args.layers}-layer Llama (hidden size 256, random weights), budget {args.budget}, a "
             f"{args.steps}-token continuation explained step by step after the longest prompt {limit} "
             f"(at most {args.max_tokens:,} tokens). Peak: resident memory beyond the process's before the "
             "call; the promise: at most 1.1 × (budget + weights) − weights. The processes start with "
             + ("glibc's own mmap policy." if args.glibc_default else "glibc's mmap threshold at 64 KiB."), "",
             "| method | prompt tokens | peak MiB | peak / budget | within the promise | seconds |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | error: {r['error'][:80]} | | | | |")
        elif r["refused"]:
            lines.append(f"| {r['method']} | {r['prompt_tokens']:,} | refused up front | | | |")
        else:
            lines.append(f"| {r['method']} | {r['prompt_tokens']:,} | {r['peak_mib']:.0f} | {r['ratio']:.2f} | "
                         f"{'yes' if r['within'] else '**no**'} | {r['seconds']:.1f} |")
    lines += ["", f"Measured on {machine()}."]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
