"""Check that the peers scored the given answer on the given sources: correlate their scores with leave-one-out.

Leave-one-out is computed here with plain transformers, independently of ContextCite and AT2: for each source,
its characters are cut out of the context, the prompt is rebuilt and re-tokenized, and the drop in the answer's
total log-probability (float64 log-softmax over the answer's tokens) is the source's effect. A peer that really
forced the answer and used the spans correlates with it; one that explained its own generation or its own
sentence split would not.

    /work/peers-venv/bin/python bench/peers/loo_check.py --examples EX.jsonl --model DIR --peers OUT.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np
from peer_common import Example, chat_prompt, load_model, read_examples


def answer_logprob(model, tokenizer, context: str, query: str, answer: str) -> float:
    """log p(answer | chat prompt of context and query), summed over the answer's tokens."""
    import torch

    prompt = chat_prompt(tokenizer, context, query)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
    if ids[: len(prompt_ids)] != prompt_ids or tokenizer.decode(ids[len(prompt_ids) :]) != answer:
        raise ValueError("the answer does not tokenize apart from the prompt")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1 : -1].double()
    targets = torch.tensor(ids[len(prompt_ids) :])
    return float(logits.log_softmax(-1).gather(1, targets[:, None]).sum())


def leave_one_out(model, tokenizer, ex: Example) -> np.ndarray:
    """The drop in the answer's log-probability when each source's characters are cut out of the context."""
    full = answer_logprob(model, tokenizer, ex.context, ex.query, ex.answer)
    drops = []
    for s in ex.sources:
        cut = ex.context[: s.start] + ex.context[s.end :]
        drops.append(full - answer_logprob(model, tokenizer, cut, ex.query, ex.answer))
    return np.array(drops)


def _short(values: np.ndarray) -> str:
    return "[" + " ".join(f"{v:.3g}" for v in values) + "]"


def main() -> None:
    from scipy.stats import pearsonr, spearmanr

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--peers", required=True, help="context_peers.py output JSONL")
    parser.add_argument("--limit", type=int, default=5)
    args = parser.parse_args()

    examples = read_examples(args.examples, args.limit)
    peers: dict[str, dict[str, np.ndarray]] = defaultdict(dict)
    with open(args.peers, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            peers[row["method"]][row["id"]] = np.array(row["scores"])
    model, tokenizer = load_model(args.model)
    loo = {ex.id: leave_one_out(model, tokenizer, ex) for ex in examples}
    print(f"{'id':>26} {'method':>16} {'pearson':>8} {'spearman':>8}  LOO drops | peer scores")
    for method, by_id in peers.items():
        rs, rhos = [], []
        for ex in examples:
            if ex.id not in by_id:
                continue
            scores, drops = by_id[ex.id], loo[ex.id]
            r, rho = pearsonr(scores, drops).statistic, spearmanr(scores, drops).statistic
            rs.append(r)
            rhos.append(rho)
            print(f"{ex.id:>26} {method:>16} {r:8.3f} {rho:8.3f}  {_short(drops)} | {_short(scores)}")
        if rs:
            print(f"{'mean':>26} {method:>16} {np.nanmean(rs):8.3f} {np.nanmean(rhos):8.3f}  ({len(rs)} examples)")


if __name__ == "__main__":
    main()
