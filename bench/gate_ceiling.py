"""How well can attention gates on the question and answer rank real source removals? Their exact ceiling.

``attngate`` (default ``queries="after"``) differentiates the answer's log-probability with respect to gates on
the attention that the positions after the context pay to each source. Its exact, non-linearised counterpart is
to *hide* the removed sources from those positions (the context's own keys and values cached from the full
prompt) and read the answer's log-probability. This script measures, per SQuAD example (gold paragraph + 2
distractor paragraphs, sentence sources, the gold answer forced, SmolLM2-135M-Instruct):

- ``hidden``: the hidden-source log-probabilities themselves, ranked against the real removals (``"remove"``
  ablations: the sources' characters deleted, the prompt tokenized again) over the benchmark's 32 random
  ablations. No linear score reaches this exactly; it bounds what gates on those positions can tell;
- ``hidden_fit_M``: a Lasso surrogate fitted to M hidden-source variants of the prompt (masks of their own), as
  ContextCite fits removals; its coefficients as scores (the best linear reading of hiding);
- ``attngate`` (its derivative at half-open gates) and ``contextcite32`` (Lasso on 32 real removals of their
  own), against the same 32 ablations.

``--queries all`` measures the same for gates on every query, the context's own positions included
(``attngate``'s ``queries="all"``): its exact counterpart hides the dropped sources from every position (the
``"mask"`` ablation: every token kept, positions kept, the sources' keys masked out), and its derivative is taken
with every query gated.

Writes ``bench/data/gate_ceiling.jsonl`` (``gate_ceiling_all.jsonl`` with ``--queries all``; one record per
example, resumed on a rerun) and the table beside it (``.md``).

Run: ``python bench/gate_ceiling.py [--split fit] [--limit 24] [--queries after|all] [--fits 32,64,128]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench" / "data"
OWN_SEED = 12345  # the masks the surrogates are fitted on (the LDS masks are the benchmark's)
FITS = (32, 64, 128)


def hidden_logprobs(job, masks: np.ndarray) -> np.ndarray:
    """The answer's log-probability with the sources a mask drops hidden from the attention of every position
    after the context (keys and values of the context from the full prompt, computed once)."""
    from attnlens.core.modelstate import explaining
    from attnlens.sources import gates

    model = job.runner.model
    ids = job.prompt.ids + job.prefix_ids + job.answer_ids
    owner = torch.as_tensor(job.token_source + [-1] * (len(ids) - len(job.token_source)))
    inside = owner >= 0
    k, cut = len(job.answer_ids), gates.after_context(job)
    inputs, answer = torch.tensor([ids]), torch.tensor(job.answer_ids)
    out = []
    with torch.no_grad():
        with explaining(model, "sdpa"):
            past = model(input_ids=inputs[:, :cut], use_cache=True, logits_to_keep=1).past_key_values
        for keep in masks:
            log_gates = torch.zeros(len(ids))
            hidden = inside.clone()
            hidden[inside] = torch.as_tensor(~np.asarray(keep, dtype=bool))[owner[inside]]
            log_gates[hidden] = -1e4
            with explaining(model, gates.registered()), gates.gating(log_gates):
                logits = model(input_ids=inputs[:, cut:], past_key_values=past, use_cache=True,
                               logits_to_keep=k + 1).logits[0]
            past.crop(-(len(ids) - cut))  # back to the context's keys and values
            logprobs = torch.log_softmax(logits[:-1].float(), -1)
            out.append(float(logprobs[torch.arange(k), answer].sum()))
    return np.array(out)


def masked_logprobs(job, masks: np.ndarray) -> np.ndarray:
    """The answer's log-probability with the sources a mask drops hidden from the attention of every position (the
    ``"mask"`` ablation)."""
    import dataclasses

    from attnlens.sources.ablation import ablation_logprobs

    return ablation_logprobs(dataclasses.replace(job, ablation="mask"), masks)


def run_example(runner, e, queries: str = "after", fits: tuple[int, ...] = FITS) -> dict:
    from sklearn.linear_model import Lasso

    from attnlens.sources import gates
    from attnlens.sources.ablation import ablation_logprobs, random_masks, rank_agreement
    from attnlens.sources.attribute import prepare_job

    job = prepare_job(runner, e.context, e.query, answer=e.answer, sources=[(s.start, s.end) for s in e.sources],
                      memory_budget="12GiB")
    n = len(e.sources)
    masks = random_masks(32, n, 0.5, zlib.crc32(e.id.encode()))  # the benchmark's LDS ablations (seed 0)
    actual = ablation_logprobs(job, masks)
    own = random_masks(max(fits), n, 0.5, OWN_SEED)
    hide = hidden_logprobs if queries == "after" else masked_logprobs
    hidden_eval, hidden_own = hide(job, masks), hide(job, own)
    removed_own = ablation_logprobs(job, own[:32])
    gate, _ = gates.source_gate_gradients(job, 0.5, queries)

    def lasso(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return Lasso(alpha=0.01).fit(x.astype(np.float64), y).coef_

    lds = {"hidden": rank_agreement(hidden_eval, actual),
           "contextcite32": rank_agreement(masks @ lasso(own[:32], removed_own), actual),
           "attngate": rank_agreement(masks @ gate, actual)}
    for m in fits:
        lds[f"hidden_fit_{m}"] = rank_agreement(masks @ lasso(own[:m], hidden_own[:m]), actual)
    return {"id": e.id, "n_sources": n, "lds": lds}


def summary(records: list[dict], queries: str = "after") -> str:
    keys = list(records[0]["lds"])
    hiding = ("hidden from the positions after the context" if queries == "after"
              else "hidden from every position (the mask ablation), gates on every query")
    lines = [f"Examples: {len(records)} (sentence sources, gold paragraph + 2 distractors); sources {hiding}. LDS "
             "against 32 real removals per example; the difference to ContextCite-32 paired over the examples "
             "(mean ± 95% interval):", "", "| scores | mean LDS | median LDS | − contextcite32 |", "|---|---|---|---|"]
    for key in keys:
        v = np.array([r["lds"][key] for r in records])
        d = v - np.array([r["lds"]["contextcite32"] for r in records])
        half = 1.96 * d.std(ddof=1) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        paired = "" if key == "contextcite32" else f"{d.mean():+.3f} ± {half:.3f}"
        lines.append(f"| {key} | {v.mean():.3f} | {np.median(v):.3f} | {paired} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", default="fit", choices=["fit", "eval"])
    p.add_argument("--limit", type=int, default=24)
    p.add_argument("--queries", default="after", choices=["after", "all"],
                   help="the positions the sources are hidden from and gated for")
    p.add_argument("--fits", default=",".join(map(str, FITS)),
                   help="how many hidden-source variants each surrogate is fitted to (at least 32)")
    args = p.parse_args()
    stem = "gate_ceiling" if args.queries == "after" else "gate_ceiling_all"
    out_jsonl, out_md = DATA / f"{stem}.jsonl", DATA / f"{stem}.md"
    from attnlens import Explainer
    from attnlens.sources.squad import squad_context

    torch.set_num_threads(min(2, torch.get_num_threads()))
    records = [json.loads(x) for x in out_jsonl.read_text().splitlines()] if out_jsonl.exists() else []
    done = {r["id"] for r in records}
    runner = Explainer.from_pretrained("smollm2").runner
    for e in squad_context(args.split, args.limit, distractors=2, sources="sentence"):
        if e.id in done:
            continue
        rec = run_example(runner, e, args.queries, tuple(int(m) for m in args.fits.split(",")))
        print(json.dumps(rec), flush=True)
        records.append(rec)
        with out_jsonl.open("a") as f:
            f.write(json.dumps(rec) + "\n")
    out_md.write_text(summary(records, args.queries))
    print(summary(records, args.queries))


if __name__ == "__main__":
    main()
