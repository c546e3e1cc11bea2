"""Long prompts on SmolLM2: peak memory and time per method and prompt length, against a plain pass.

Each case (method × prompt length) runs in a fresh process under ``/usr/bin/time -f %M`` (peak resident memory,
the model's weights included), which explains a forced answer of ``--answer`` tokens after a prompt of the given
length (IMDB reviews, ``Explainer.explain_generation`` with the default 4 GiB budget). The ``plain`` case is the
yardstick of the targets: one forward + backward of the same sequence with fused attention (SDPA), the loss on the
answer's tokens (their logits only). A run the budget refuses is recorded with the one line it printed.

Writes ``bench/data/long_context.json``, the markdown table ``bench/data/long_context.md`` and the log–log plot
``docs/images/long_context.png`` (memory and time vs prompt length, one line per method).

Run: ``python bench/long_context.py [--lengths 1024 2048 4096] [--methods rawatt agrad ...] [--answer 16]
[--mode generation|answer] [--options JSON] [--memory-budget 8GiB] [--tag NAME] [--repeat 5]``; ``--mode answer``
explains the answer's summed log-probability once, as ``attnlens cite`` does, and writes ``*_answer`` files;
``--repeat R`` times R runs of each case in its process and reports their median (a prompt of a few hundred tokens
takes seconds, and one cold run of it varies by a third on a shared CPU); ``--paired`` times the plain pass R
times more in each method's process and takes the ratio to that (processes differ in speed by up to a quarter).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from peak import machine, measured  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMDB = ROOT.parent / "shared" / "data" / "imdb" / "test.jsonl.gz"
METHODS = ["plain", "rawatt", "attnnorm", "grads", "agrad", "cat", "attcat", "saliency", "inputxgradient", "rollout",
           "gae", "attgrads", "attnlrp"]
LENGTHS = [1024, 2048, 4096]
OUT_JSON, OUT_MD = ROOT / "bench" / "data" / "long_context.json", ROOT / "bench" / "data" / "long_context.md"
OUT_PNG = ROOT / "docs" / "images" / "long_context.png"


def _ids(ex: object, n: int, answer: int) -> tuple[list[int], list[int]]:
    """``n`` prompt ids and the ``answer`` ids that follow them, from IMDB test reviews."""
    with gzip.open(IMDB, "rt", encoding="utf-8") as f:
        text = ""
        for line in f:
            text += json.loads(line)["text"] + "\n"
            if len(text) > 6 * (n + answer):
                break
    ids = ex.tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[attr-defined]
    return ids[:n], ids[n: n + answer]


def run_case(method: str, n: int, answer: int, mode: str = "generation", options: dict | None = None,
             budget: str | None = None, repeat: int = 1, paired: bool = False) -> dict:
    """One case in this process: the seconds it took (the model loaded before; with ``repeat`` > 1 the median of
    that many runs, each in ``runs``), or the refusal's line. ``paired``: then the plain pass as many times in
    the same process (``plain_seconds``, their median), the peak memory read before it.

    ``mode="generation"``: ``explain_generation`` (one explanation per answer token); ``"answer"``:
    ``explain_answer`` (the answer's summed log-probability, one explanation for the whole answer). ``options``:
    per method, as ``Explainer.explain`` takes them; integrated gradients' step count is recorded (``steps``).
    ``budget``: the memory budget (default: the library's)."""
    import numpy as np
    import torch

    from attnlens import Explainer

    torch.manual_seed(0)
    ex = Explainer.from_pretrained("smollm2")
    prompt_ids, answer_ids = _ids(ex, n, answer)
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        found = _one_run(ex, method, n, prompt_ids, answer_ids, mode, options, budget)
        if "refused" in found:
            return found
        runs.append(time.perf_counter() - start)
    found["seconds"] = float(np.median(runs))
    if repeat > 1:
        found["runs"] = runs
    if paired and method != "plain":  # the yardstick in this process too, after the method's peak is read
        found["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB, as /usr/bin/time
        plain = []
        for _ in range(repeat):
            start = time.perf_counter()
            _one_run(ex, "plain", n, prompt_ids, answer_ids, mode, None, None)
            plain.append(time.perf_counter() - start)
        found["plain_seconds"] = float(np.median(plain))
    return found


def _one_run(ex: object, method: str, n: int, prompt_ids: list[int], answer_ids: list[int], mode: str,
             options: dict | None, budget: str | None) -> dict:
    """One explanation (or the plain pass) of the case: its figures but the time, or the refusal's line."""
    import numpy as np
    import torch

    from attnlens import InputError
    from attnlens.core.modelstate import explaining

    limit = {"memory_budget": budget} if budget else {}
    if method == "plain":  # forward + backward to the input embeddings with fused attention, loss on the answer
        # (logits only at the positions that predict the answer, as the methods compute them)
        ids = torch.tensor([prompt_ids + answer_ids])
        with explaining(ex.model, "sdpa"):
            embeddings = ex.model.get_input_embeddings()(ids).detach().requires_grad_(True)
            logits = ex.model(inputs_embeds=embeddings, use_cache=False,
                              logits_to_keep=len(answer_ids) + 1).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, ids[0, n:])
            torch.autograd.grad(loss, embeddings)
        return {}
    if mode == "answer":
        try:
            exp = ex.explain_answer(prompt_ids, answer_ids, [method], options=options, **limit)
        except InputError as exc:
            return {"refused": str(exc)}
        found = {"prompt_tokens": n, "answer_tokens": len(answer_ids),
                 "finite": bool(all(np.isfinite(v).all() for v in exp.scores.values()))}
        if "n_steps" in exp.meta.get(method, {}):
            found["steps"] = int(np.max(exp.meta[method]["n_steps"]))
        return found
    prompt = ex.tokenizer.decode(prompt_ids)
    target = ex.tokenizer.decode(answer_ids)
    try:
        gen = ex.explain_generation(prompt, [method], target=target, options=options, **limit)
    except InputError as exc:
        return {"refused": str(exc)}
    return {"prompt_tokens": len(gen.prompt_ids), "answer_tokens": len(gen.generated_ids)}


def measure(method: str, n: int, answer: int, timeout: float, mode: str = "generation",
            options: dict | None = None, budget: str | None = None, repeat: int = 1, paired: bool = False) -> dict:
    """A case in a fresh process under ``/usr/bin/time``: its result with ``peak_gib`` (peak RSS)."""
    extra = ["--options", json.dumps(options)] if options else []
    extra += ["--memory-budget", budget] if budget else []
    extra += ["--repeat", str(repeat)] if repeat > 1 else []
    extra += ["--paired"] if paired else []
    return measured(__file__, ["--one", method, str(n), str(answer), "--mode", mode, *extra], timeout,
                    {"method": method, "tokens": n})


def table(results: list[dict]) -> str:
    """Markdown: peak GiB and seconds per method (rows) and length (columns), and the time ratio to ``plain`` (to
    the plain pass of the method's own process where the run was paired)."""
    lengths = sorted({r["tokens"] for r in results})
    plain = {r["tokens"]: r.get("seconds") for r in results if r["method"] == "plain"}
    lines = ["| method | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for method in dict.fromkeys(r["method"] for r in results):
        cells = []
        for n in lengths:
            r = next((r for r in results if r["method"] == method and r["tokens"] == n), None)
            if r is None:
                cells.append("—")
            elif "refused" in r:
                cells.append(f"refused ({r['peak_gib']:.1f} GiB)")
            elif "error" in r:
                cells.append(f"failed: {r['error'][:60]}")
            else:
                yardstick = r.get("plain_seconds", plain.get(n))  # the same process's plain pass where paired
                ratio = f", {r['seconds'] / yardstick:.1f}×" if yardstick and method != "plain" else ""
                ratio += f" (plain {yardstick:.1f} s)" if "plain_seconds" in r else ""
                ratio += f" ({r['steps']} steps)" if "steps" in r else ""
                cells.append(f"{r['peak_gib']:.2f} GiB, {r['seconds']:.1f} s{ratio}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    """Peak memory and time vs prompt length, log–log, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, sec) = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r["method"] for r in results):
        done = [r for r in results if r["method"] == method and "seconds" in r]
        if not done:
            continue
        x = [r["tokens"] for r in done]
        mem.plot(x, [r["peak_gib"] for r in done], marker="o", label=method)
        sec.plot(x, [r["seconds"] for r in done], marker="o", label=method)
    for ax, label in ((mem, "peak RSS (GiB, weights included)"), (sec, "seconds")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    sec.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M, long prompts (2 shared CPU cores)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    p.add_argument("--methods", nargs="+", default=METHODS)
    p.add_argument("--answer", type=int, default=16, help="tokens of the forced answer (default 16)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per case before it is given up")
    p.add_argument("--mode", choices=["generation", "answer"], default="generation",
                   help="explain every answer token (explain_generation) or the answer's summed log-probability "
                        "once (explain_answer, as attnlens cite does); answer mode writes *_answer files")
    p.add_argument("--from-log", metavar="FILE", help="write the table and plot from the JSON lines a run printed")
    p.add_argument("--options", type=json.loads, default=None,
                   help='per-method options as JSON, e.g. \'{"integratedgradients": {"n_steps": 8}}\'')
    p.add_argument("--memory-budget", default=None, help="the explainer's memory budget (default: the library's)")
    p.add_argument("--tag", default="", help="suffix of the output files (a run of some methods beside the main one)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per case in its process, the median reported (short prompts: less noise)")
    p.add_argument("--paired", action="store_true",
                   help="time the plain pass again in each method's process and take the ratio to that")
    p.add_argument("--one", nargs=3, metavar=("METHOD", "TOKENS", "ANSWER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_case(args.one[0], int(args.one[1]), int(args.one[2]), args.mode, args.options,
                                  args.memory_budget, args.repeat, args.paired)))
        return
    out_json, out_md, out_png = OUT_JSON, OUT_MD, OUT_PNG
    if args.mode == "answer":
        out_json, out_md, out_png = (p.with_name(p.stem + "_answer" + p.suffix) for p in (OUT_JSON, OUT_MD, OUT_PNG))
    if args.tag:
        out_json, out_md, out_png = (p.with_name(f"{p.stem}_{args.tag}{p.suffix}") for p in (out_json, out_md, out_png))
    results = []
    if args.from_log:  # an interrupted run: its cases as printed
        lines = Path(args.from_log).read_text(encoding="utf-8").splitlines()
        results = [json.loads(line) for line in lines if line.startswith("{")]
    for n in [] if args.from_log else args.lengths:
        for method in args.methods:
            results.append(measure(method, n, args.answer, args.timeout, args.mode,
                                   {k: v for k, v in (args.options or {}).items() if k == method} or None,
                                   args.memory_budget if method != "plain" else None, args.repeat, args.paired))
            print(json.dumps(results[-1]), flush=True)
    cpu = None if args.from_log else machine()  # a log's cases may come from another machine
    out_json.write_text(json.dumps({"answer_tokens": args.answer, "mode": args.mode, "machine": cpu,
                                    "memory_budget": args.memory_budget, "results": results}, indent=1) + "\n")
    out_md.write_text(table(results) + (f"\nMeasured on {cpu}.\n" if cpu else ""))
    plot(results, out_png)
    print(table(results))


if __name__ == "__main__":
    main()
