"""How far value zeroing's float32 scores are from the same model in float64, on ``../shared/models/minilm-sst2``
and SST-2 dev sentences (default: the first 20), with the cosine distance computed as ``½‖a/‖a‖ − b/‖b‖‖²``
(attnlens) and as ``1 − cos`` (the textbook form, which cancels on the near-parallel outputs of lower layers).

Run: ``python bench/valuezeroing_precision.py [--limit 20]``.

Measured (2026-11-25, the first 20 dev sentences, CPU): ½‖a/‖a‖ − b/‖b‖‖² 1.98e-07 on the final scores, 9.95e-07 on
the per-layer rows; 1 − cos 1.20e-02 and 8.32e-02.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import copy  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import MODEL, read_texts  # noqa: E402

from attnlens import Explainer  # noqa: E402
from attnlens.methods import valuezeroing  # noqa: E402


def one_minus_cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 1.0 - torch.nn.functional.cosine_similarity(a, b, dim=-1)


def max_error(ex: Explainer, reference: list, texts: list[str]) -> tuple[float, float]:
    """Largest |float32 − float64| over the final scores and over every layer's rolled-out row."""
    got = ex.explain(texts, methods=["valuezeroing"])
    scores = max(float(np.abs(a.scores["valuezeroing"] - b.scores["valuezeroing"]).max())
                 for a, b in zip(got, reference, strict=True))
    layers = max(float(np.abs(a.layers["valuezeroing"] - b.layers["valuezeroing"]).max())
                 for a, b in zip(got, reference, strict=True))
    return scores, layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=20, help="use only the first N dev sentences")
    args = parser.parse_args()
    texts = read_texts(limit=args.limit)
    ex = Explainer.from_pretrained(MODEL)
    reference = Explainer(copy.deepcopy(ex.model).double(), ex.tokenizer).explain(texts, methods=["valuezeroing"])
    print(f"{len(texts)} SST-2 dev sentences, max |float32 - float64| (final scores, per-layer rows):")
    print("  ½‖a/‖a‖ − b/‖b‖‖²  {:.2e}  {:.2e}".format(*max_error(ex, reference, texts)))
    with mock.patch.object(valuezeroing, "cosine_distance", one_minus_cos):
        print("  1 − cos            {:.2e}  {:.2e}".format(*max_error(ex, reference, texts)))


if __name__ == "__main__":
    main()
