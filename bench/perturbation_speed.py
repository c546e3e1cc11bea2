"""What the perturbation baselines cost, on ``../shared/models/minilm-sst2`` and SST-2 dev sentences (default:
the first 32).

Each method's time through ``Explainer.explain`` is set against its budget: its number of samples (occlusion:
M + 1 for M tokens; LIME and KernelSHAP: ``n_samples``) times one plain forward of the same sentence, measured by
running every sentence's unperturbed input through the model in the same batches. The script also counts the
model's forward calls and the rows they carry (a forward pre-hook), against the samples.

Run: ``python bench/perturbation_speed.py [--limit 32] [--samples 100]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
from common import batch_inputs, setup, timed  # noqa: E402


class Counter:
    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = self.rows = 0
        self.handle = model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls += 1
        self.rows += len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=32, help="use only the first N dev sentences")
    parser.add_argument("--samples", type=int, default=100, help="n_samples of LIME and KernelSHAP")
    args = parser.parse_args()

    texts, ex, batches = setup(args.limit, 1)  # batches of one: per-sentence forwards at each one's length
    encoded = [b[0] for b in batches]
    features = [sum(1 for s in e.special if not s) for e in encoded]

    def forwards() -> None:
        with torch.no_grad():
            for b in batches:
                ex.model(**batch_inputs(ex, b))

    forwards()  # warm-up
    one = timed(forwards)  # one forward of every sentence
    mean_rows = sum(f + 1 for f in features) / len(features)
    budgets = {"occlusion": mean_rows, "lime": args.samples, "kernelshap": args.samples}
    print(f"{len(texts)} sentences, {sum(features) / len(features):.1f} tokens to perturb on average; one plain "
          f"forward of every sentence: {one:.2f} s")
    for method, samples in budgets.items():
        options = {method: {"n_samples": args.samples}} if method != "occlusion" else None
        counter = Counter(ex.model)
        try:
            seconds = timed(ex.explain, [e.text for e in encoded], methods=[method], options=options, batch_size=32)
        finally:
            counter.handle.remove()
        rows = counter.rows / len(texts)
        print(f"{method:>10}: {seconds:7.2f} s = {seconds / one:6.1f} forwards of each sentence "
              f"(budget: {samples:.1f} samples x one forward = {samples * one:.2f} s, ratio "
              f"{seconds / (samples * one):.2f}); {counter.calls} model calls, {rows:.1f} rows per sentence "
              f"(samples {samples:.1f}, ceil per call: {math.ceil(samples)})")


if __name__ == "__main__":
    main()
