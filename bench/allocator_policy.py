"""What the C allocator's policy does to peak memory and time: each case under several policies, side by side.

attnlens fixes glibc's mmap threshold for long inputs and for passes that fill their budget
(``attnlens.core.allocator``; a recomputing pass lowers it to a quarter of a layer's hidden states). This script
runs the cases the docs quote (docs/long-context.md, "The allocator on long inputs") under each policy, every
case in a fresh process:

- ``glibc``: the allocator as it is (``ATTNLENS_KEEP_MALLOC=1``: attnlens leaves it alone; glibc raises its
  threshold as large blocks are freed);
- ``attnlens``: attnlens's policy (the default);
- ``fixed_512KiB`` / ``fixed_1MiB`` / ``fixed_4MiB`` / ``fixed_8MiB``: glibc's threshold fixed by its
  environment variable (``MALLOC_MMAP_THRESHOLD_``) and attnlens's policy off;
- ``attnlens_thp``: attnlens's policy, glibc asked to back its blocks with transparent huge pages
  (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, glibc 2.35 and later; where the kernel grants them, a mapped
  block is faulted in 2 MiB at a time instead of 4 KiB).

The cases: AGrad on SmolLM2 explaining a 16-token answer after 4,096 prompt tokens, AttnLRP and AttCAT after 2,048
(the median of three runs in the process; AttnLRP within 2 GiB and AttCAT within 2.5 GiB too, where each layer is
recomputed in the backward) (``bench/long_context.py``, peak resident memory of the process); raw
attention on a T5-base-sized classifier, ``grads`` on a ModernBERT-base-sized one and a Flan-T5-base-sized one
within 1 GiB, and ``grads`` on a 12 × 768 Llama-sized one within 256 MiB, each at the longest input its budget
admits (``bench/budget_promise.py``, resident memory beyond the process's before the call, random weights).
Seconds are the call's alone (the model loaded before).

Writes ``bench/data/allocator_policy.md`` and its records (``.jsonl``).

Run: ``python bench/allocator_policy.py [--cases agrad_smollm2_4k,...] [--policies glibc,attnlens,...]``
(``--policies``: these instead of each case's own).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from peak import ROOT, machine, measured, write_records  # noqa: E402

BENCH = Path(__file__).resolve().parent
OUT = ROOT / "bench" / "data" / "allocator_policy.md"
POLICIES = {
    "glibc": {"ATTNLENS_KEEP_MALLOC": "1"},
    "attnlens": {},
    "fixed_1MiB": {"ATTNLENS_KEEP_MALLOC": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20)},
    "fixed_512KiB": {"ATTNLENS_KEEP_MALLOC": "1", "MALLOC_MMAP_THRESHOLD_": str(2**19)},
    "fixed_4MiB": {"ATTNLENS_KEEP_MALLOC": "1", "MALLOC_MMAP_THRESHOLD_": str(2**22)},
    "fixed_8MiB": {"ATTNLENS_KEEP_MALLOC": "1", "MALLOC_MMAP_THRESHOLD_": str(2**23)},
    "attnlens_thp": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
}
# name: (script, its arguments, the policies to compare, what the peak means)
CASES = {
    "agrad_smollm2_4k": ("long_context.py", ["--mode", "answer", "--one", "agrad", "4096", "16"],
                         ("glibc", "attnlens", "fixed_1MiB"), "process"),
    "attnlrp_smollm2_2k": ("long_context.py", ["--mode", "answer", "--repeat", "3", "--one", "attnlrp", "2048",
                                               "16"], ("glibc", "attnlens", "fixed_1MiB"), "process"),
    # within 2 GiB its activations do not fit: each layer recomputed in the backward
    "attnlrp_smollm2_2k_recomputed": ("long_context.py", ["--mode", "answer", "--repeat", "3", "--memory-budget",
                                                          "2GiB", "--one", "attnlrp", "2048", "16"],
                                      ("glibc", "attnlens", "fixed_1MiB", "attnlens_thp"), "process"),
    "attnlrp_smollm2_1k": ("long_context.py", ["--mode", "answer", "--repeat", "3", "--one", "attnlrp", "1024",
                                               "16"], ("glibc", "attnlens", "attnlens_thp"), "process"),
    "attcat_smollm2_2k": ("long_context.py", ["--mode", "answer", "--repeat", "3", "--one", "attcat", "2048",
                                              "16"], ("glibc", "attnlens"), "process"),
    # within 2.5 GiB its activations do not fit: each layer recomputed in the backward
    "attcat_smollm2_2k_recomputed": ("long_context.py", ["--mode", "answer", "--repeat", "3", "--memory-budget",
                                                         "2.5GiB", "--one", "attcat", "2048", "16"],
                                     ("glibc", "attnlens"), "process"),
    "rawatt_t5_base_1GiB": ("budget_promise.py", ["--one", "t5-base", "rawatt", "--budget", "1GiB"],
                            ("glibc", "attnlens"), "growth"),
    "grads_modernbert_base_1GiB": ("budget_promise.py", ["--one", "modernbert-base", "grads", "--budget", "1GiB",
                                                         "--max-tokens", "2048"], ("glibc", "attnlens"), "growth"),
    "grads_llama_256MiB": ("budget_promise.py", ["--one", "llama", "grads", "--budget", "256MiB", "--max-tokens",
                                                 "2048"], ("glibc", "attnlens"), "growth"),
    "grads_flan_t5_base_1GiB": ("budget_promise.py", ["--one", "flan-t5-base", "grads", "--budget", "1GiB"],
                                ("attnlens", "fixed_512KiB"), "growth"),
}


def run(case: str, policy: str, timeout: float) -> dict:
    """One case under one policy, in a fresh process."""
    script, args, _, _ = CASES[case]
    if script == "budget_promise.py":
        args = [*args, "--out", os.devnull]  # its records are this script's
    saved = {k: os.environ.get(k) for k in POLICIES[policy]}
    os.environ.update(POLICIES[policy])
    try:
        out = measured(str(BENCH / script), args, timeout, {"case": case, "policy": policy})
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def table(rows: list[dict]) -> str:
    lines = ["Peak: for the SmolLM2 cases the process's peak resident memory (model and all, GiB); for the others "
             "the resident memory beyond the process's before the call (GiB) and its ratio to the budget. "
             "Seconds: the call's; `time × first`: against the case's first policy.", "",
             "| case | policy | tokens | peak GiB | peak / budget | seconds | time × first |",
             "|---|---|---|---|---|---|---|"]
    first: dict[str, float] = {}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['policy']} | error: {r['error'][:80]} | | | | |")
            continue
        tokens = r.get("tokens", r.get("prompt_tokens", 0))
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "—"
        first.setdefault(r["case"], r["seconds"])
        lines.append(f"| {r['case']} | {r['policy']} | {tokens:,} | {r['peak_gib']:.2f} | {ratio} | "
                     f"{r['seconds']:.1f} | {r['seconds'] / first[r['case']]:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--policies", default=None, help="comma-separated policies instead of each case's own")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; one of {', '.join(CASES)}")
        for policy in args.policies.split(",") if args.policies else CASES[case][2]:
            if policy not in POLICIES:
                raise SystemExit(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
            rows.append(run(case, policy, args.timeout))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = Path(args.out)
    write_records(out, rows)
    text = table(rows) + f"\nMeasured on {machine()}.\n"
    out.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
