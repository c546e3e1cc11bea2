"""Train AT2's score estimator for SmolLM2 on SQuAD v1.1 dev articles at even positions, with AT2's trainer.

AT2's documented procedure (its scripts/train_context_at2.py): per training example, the whole context's
tokens are the sources (``source_type="token"``); 32 random ablations keep each token with probability 1/2
(by the attention mask) and record the answer's logit-probability; the features are the answer's attention
weights to each token, one per layer and head; a linear estimator is fitted by maximising the Pearson
correlation between its predicted and the actual ablation effects (Adam, lr 1e-3, cosine schedule, 1000 steps).
What differs here, for a CPU and this benchmark:

- the answer is SQuAD's gold answer, forced (the benchmark explains given answers), not the model's generation,
  and it is one target (``split_target_by=None``: AT2 splits generations into sentences with NLTK's punkt);
- a few dozen examples instead of 4,000 Dolly examples, within ``--minutes``; the batch holds them all (AT2's
  512 draws without replacement).

    /work/peers-venv/bin/python bench/peers/train_at2.py --model DIR --examples 40 --minutes 40 \\
        --out bench/peers/at2_smollm2_squad.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from peer_common import load_model, offline_nltk
from squad_examples import squad_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HuggingFace directory of SmolLM2")
    parser.add_argument("--out", required=True, help="estimator JSON")
    parser.add_argument("--examples", type=int, default=40, help="training examples (even-position articles)")
    parser.add_argument("--minutes", type=float, default=40.0, help="stop computing ablations after this long")
    parser.add_argument("--num-masks", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--work", default=None, help="AT2 trainer's directory (default: a temporary one)")
    args = parser.parse_args()

    offline_nltk()
    import torch
    from at2 import AT2Trainer
    from at2.tasks import SimpleContextAttributionTask
    from at2_peer import new_feature_extractor, save_estimator
    from datasets import Dataset

    rows = squad_examples("even", args.examples)
    dataset = Dataset.from_list([{"context": r["context"], "query": r["query"], "answer": r["answer"]} for r in rows])
    model, tokenizer = load_model(args.model)
    work = Path(args.work or tempfile.mkdtemp(prefix="at2-train-"))

    def task_from_example(example, model, tokenizer):
        return SimpleContextAttributionTask(context=example["context"], query=example["query"], model=model,
                                            tokenizer=tokenizer, source_type="token")

    trainer = AT2Trainer(save_path=work, dataset=dataset, model=model, tokenizer=tokenizer,
                         task_from_example=task_from_example, feature_extractor=new_feature_extractor(model),
                         split_target_by=None, num_masks=args.num_masks)
    # The gold answers stand in for generations: written where AT2's generate step keeps its own, so that
    # generate() only records each task's source and target counts.
    trainer.generations_save_path.mkdir(parents=True, exist_ok=True)
    (trainer.generations_save_path / "0_of_1.json").write_text(json.dumps({i: r["answer"] for i, r in enumerate(rows)}))
    trainer.generate()

    t0 = time.perf_counter()
    done = 0
    with torch.no_grad():
        for i in range(len(dataset)):  # one job per example, so the time budget can stop between examples
            if time.perf_counter() - t0 > args.minutes * 60:
                break
            trainer.compute_features_and_outputs(job_index=i, num_jobs=len(dataset), batch_size=8)
            done += 1
            print(f"ablations {done}/{len(dataset)}: {time.perf_counter() - t0:.0f} s", flush=True)
    ablation_seconds = time.perf_counter() - t0
    for i in range(done, len(dataset)):  # empty stores for the rest, so that AT2 finds every job's files
        trainer.get_store_for_job(job_index=i, num_jobs=len(dataset))

    t1 = time.perf_counter()
    torch.manual_seed(0)
    import numpy as np

    np.random.seed(0)
    estimator = trainer.train(num_iterations=args.iterations, batch_size=done, device="cpu",
                              print_every=max(args.iterations // 5, 1))
    train_seconds = time.perf_counter() - t1
    about = {"model": "SmolLM2-135M-Instruct", "data": "SQuAD v1.1 dev, articles at even positions, gold answers",
             "examples": done, "num_masks": args.num_masks, "iterations": args.iterations,
             "ablation_seconds": round(ablation_seconds, 1), "train_seconds": round(train_seconds, 1),
             "ids": [rows[i].get("id") for i in range(done)]}
    save_estimator(estimator, args.out, about)
    print(f"{done} examples: ablations {ablation_seconds:.0f} s, fit {train_seconds:.0f} s -> {args.out}")


if __name__ == "__main__":
    main()
