"""Value zeroing's two ways of computing its matrices, timed in one process on SmolLM2 with a forced answer: each
layer recomputed from its pieces (the post-attention part at every changed sum, as it runs wherever the layer's
anatomy is known) and each layer rerun once per zeroed token (as it runs on the other types), beside a plain
forward + backward, with the largest difference between the two paths' scores.

``--dtype bfloat16`` (or ``float16``): both paths in that precision, each compared with float32's scores (the
recomputed path in float32, run first in the same process): how far from float32 each one's per-layer rows are.

Run: ``python bench/valuezeroing_paths.py [--tokens 256] [--answer 16] [--dtype float32]``; writes
``bench/data/valuezeroing_paths.{json,md}`` (``--tag T``: ``valuezeroing_paths_T``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from long_context import _ids, _one_run  # noqa: E402
from peak import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="prompt tokens (IMDB test reviews)")
    parser.add_argument("--answer", type=int, default=16, help="tokens of the forced answer")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the precision both paths run in (others than float32: compared with float32's scores)")
    parser.add_argument("--tag", default="", help="suffix of the output files")
    args = parser.parse_args()

    import numpy as np

    from attnlens import Explainer
    from attnlens.methods.decomposition import ValueZeroedLayer

    reference = None
    if args.dtype != "float32":
        ex = Explainer.from_pretrained("smollm2")
        prompt, answer = _ids(ex, args.tokens, args.answer)
        reference = np.asarray(ex.explain_answer(prompt, answer, ["valuezeroing"]).layers["valuezeroing"], float)
    ex = Explainer.from_pretrained("smollm2", dtype=args.dtype)
    prompt, answer = _ids(ex, args.tokens, args.answer)
    _one_run(ex, "plain", args.tokens, prompt, answer, "answer", None, None)  # warm-up
    start = time.perf_counter()
    _one_run(ex, "plain", args.tokens, prompt, answer, "answer", None, None)
    plain = time.perf_counter() - start

    def run() -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        exp = ex.explain_answer(prompt, answer, ["valuezeroing"])
        return time.perf_counter() - start, np.asarray(exp.layers["valuezeroing"], float)

    recomputed, layers = run()
    applies = ValueZeroedLayer.applies
    ValueZeroedLayer.applies = staticmethod(lambda model: False)  # every layer rerun once per zeroed token
    try:
        rerun, rerun_layers = run()
    finally:
        ValueZeroedLayer.applies = applies
    largest = float(np.abs(rerun_layers).max())
    diff = float(np.abs(layers - rerun_layers).max())
    result = {"prompt_tokens": args.tokens, "answer_tokens": args.answer, "plain_seconds": plain,
              "recomputed_seconds": recomputed, "rerun_seconds": rerun, "max_score_difference": diff,
              "largest_score": largest, "same_top_token": bool(layers[-1].argmax() == rerun_layers[-1].argmax()),
              "dtype": args.dtype, "machine": machine()}
    if reference is not None:  # each path's largest distance from float32, per layer's largest float32 score
        scale = np.abs(reference).max(-1, keepdims=True)
        result["recomputed_from_float32"] = float((np.abs(layers - reference) / scale).max())
        result["rerun_from_float32"] = float((np.abs(rerun_layers - reference) / scale).max())
    name = "valuezeroing_paths" + (f"_{args.tag}" if args.tag else "")
    (ROOT / "bench" / "data" / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    against = [] if reference is None else [
        "",
        f"Largest difference from float32's per-layer rows (each layer's largest float32 score = 1): recomputed "
        f"{result['recomputed_from_float32']:.4f}, rerun {result['rerun_from_float32']:.4f}."]
    text = "\n".join([
        f"SmolLM2 in {args.dtype}, a {args.tokens}-token prompt and a {args.answer}-token answer (one explanation of "
        "the answer).",
        "",
        "| path | seconds | × plain forward + backward |",
        "|---|---|---|",
        f"| plain forward + backward | {plain:.2f} | 1.0 |",
        f"| each layer recomputed from its pieces | {recomputed:.1f} | {recomputed / plain:.1f} |",
        f"| each layer rerun once per zeroed token | {rerun:.1f} | {rerun / plain:.1f} |",
        "",
        f"Largest difference between the two paths' scores (every layer's row): {diff:.1e} (largest score "
        f"{largest:.3f}); the same top token: {'yes' if result['same_top_token'] else 'no'}.",
        *against,
        "",
        f"Measured on {result['machine']}.",
        "",
    ])
    (ROOT / "bench" / "data" / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
