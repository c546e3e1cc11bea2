"""attnlens against inseq on the same LLM, prompt and continuation, with the methods both have.

SmolLM2-135M-Instruct, the 40-token prompt of ``generation_speed.py`` and its 16-token greedy continuation
(forced in both tools, so neither times the generation). Methods (inseq name = attnlens id): attention = rawatt,
saliency = saliency, input_x_gradient = inputxgradient, integrated_gradients = integratedgradients (same
``--ig-steps``). Each is timed alone in each tool; then attnlens explains all four in one call (one shared pass
serves the first three) against the sum of inseq's four. Target: attnlens >= 5x faster.

inseq is not a dependency: install it beside attnlens without its CUDA wheels, e.g.
``pip install --no-deps --target DIR inseq jaxtyping wadler_lindig "typeguard<=2.13.3" treescope`` and put DIR
on ``PYTHONPATH`` (a plain ``pip install inseq`` also pulls ~2.5 GB of ``nvidia-*-cu11`` wheels on Linux).
Run: ``python bench/inseq_compare.py [--rounds 1] [--ig-steps 20]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from generation_speed import prompt_and_continuation  # noqa: E402

from attnlens import Explainer  # noqa: E402

PAIRS = {"attention": "rawatt", "saliency": "saliency", "input_x_gradient": "inputxgradient",
         "integrated_gradients": "integratedgradients"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--ig-steps", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    args = parser.parse_args()
    try:
        import inseq
    except ImportError as exc:
        raise SystemExit(f"inseq does not import ({exc}); see this file's docstring to install it") from None
    warnings.simplefilter("ignore")

    ex = Explainer.from_pretrained("smollm2")
    ids, continuation = prompt_and_continuation(ex, args.prompt_tokens, args.new_tokens)
    prompt = ex.tokenizer.decode(ids)
    full = ex.tokenizer.decode(ids + continuation)
    steps = {"integrated_gradients": {"n_steps": args.ig_steps}}
    models = {name: inseq.load_model(ex.model, name, tokenizer=ex.tokenizer) for name in PAIRS}

    def run_inseq(name: str) -> float:
        start = time.perf_counter()
        out = models[name].attribute(prompt, generated_texts=full, show_progress=False, **steps.get(name, {}))
        n = len(out.sequence_attributions[0].target) - len(ids)
        assert n == len(continuation), f"inseq explained {n} tokens, not {len(continuation)}"
        return time.perf_counter() - start

    def run_attnlens(methods: list[str]) -> float:
        start = time.perf_counter()
        g = ex.explain_generation(prompt, methods, target=continuation,
                                  options={"integratedgradients": {"n_steps": args.ig_steps}}
                                  if "integratedgradients" in methods else None)
        assert g.generated_ids == continuation
        return time.perf_counter() - start

    print(f"SmolLM2-135M-Instruct; prompt {len(ids)} tokens, {len(continuation)} forced tokens; IG {args.ig_steps} "
          f"steps; torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} round(s) after a "
          f"warm-up", flush=True)
    times: dict[str, list[float]] = {}
    for r in range(args.rounds + 1):
        for name, method in PAIRS.items():
            if not r and name == "integrated_gradients":  # no warm-up of the slow IG
                continue
            a, b = run_inseq(name), run_attnlens([method])
            if r:
                times.setdefault(f"inseq {name}", []).append(a)
                times.setdefault(f"attnlens {method}", []).append(b)
        t = run_attnlens(list(PAIRS.values()))
        if r:
            times.setdefault("attnlens all four", []).append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'method':<22}{'inseq s':>10}{'attnlens s':>12}{'speed-up':>10}")
    for name, method in PAIRS.items():
        a, b = med[f"inseq {name}"], med[f"attnlens {method}"]
        print(f"{name:<22}{a:>10.2f}{b:>12.2f}{a / b:>9.1f}x")
    total = sum(med[f"inseq {n}"] for n in PAIRS)
    print(f"{'all four':<22}{total:>10.2f}{med['attnlens all four']:>12.2f}{total / med['attnlens all four']:>9.1f}x"
          "  (inseq: the sum of four runs; attnlens: one call)")


if __name__ == "__main__":
    main()
