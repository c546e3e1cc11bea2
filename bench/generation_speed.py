"""How fast attnlens explains what an LLM generates: SmolLM2-135M-Instruct, a 40-token prompt, 16 generated tokens.

``Explainer.explain_generation(prompt, target=continuation, methods=FAST)`` with the ten fast methods (rawatt,
rollout, grads, attgrads, agrad, gae, cat, attcat, saliency, inputxgradient), timed against

- **16 plain passes**: for each generated token, one forward over the prompt + the tokens before it and one
  backward of that token's logit to the input embeddings (what a per-step gradient explanation needs at least).
  Target: attnlens / 16 plain passes <= 1.3.
- **1 batched pass**: the same 16 forward+backward passes as one right-padded batch (a stricter floor).

and against attnlens itself with ``generation.ONE_PASS = False`` (each step its own padded row, forward and
backward, instead of one forward over the sequence and batched vector-Jacobian products).

The continuation is generated once (greedy, 16 tokens) and then forced, so no variant times the generation.
Rounds interleave the variants, so the drifting load of a shared machine biases no ratio; the medians are shown.
Run: ``python bench/generation_speed.py [--rounds 5] [--new-tokens 16] [--prompt-tokens 40]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from common import embedding_leaf  # noqa: E402

from attnlens import Explainer  # noqa: E402
from attnlens.core import generation_engine as generation  # noqa: E402

FAST = ["rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat", "saliency", "inputxgradient"]
TEXT = ("The old lighthouse keeper climbed the narrow stairs every evening to light the lamp. Ships passing the "
        "rocky coast relied on its beam, and for forty years he had never missed a single night, not even during "
        "the great storm that flooded the village below.")


def prompt_and_continuation(ex: Explainer, prompt_tokens: int, new_tokens: int) -> tuple[list[int], list[int]]:
    """The first ``prompt_tokens`` tokens of :data:`TEXT` and the model's greedy ``new_tokens`` continuation."""
    ids = ex.tokenizer(TEXT, add_special_tokens=False)["input_ids"][:prompt_tokens]
    if len(ids) < prompt_tokens:
        raise SystemExit(f"the text has only {len(ids)} tokens")
    with torch.no_grad():
        out = ex.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=ex.pad_id)
    return ids, out[0, len(ids):].tolist()


def plain_steps(model: torch.nn.Module, ids: list[int], continuation: list[int], batched: bool) -> float:
    """Seconds for a forward + backward (to the input embeddings) of each step's target logit: one pass per step,
    or all steps as one right-padded batch (``batched``)."""
    leaf, handle = embedding_leaf(model)
    full = ids + continuation
    n = len(ids)
    try:
        start = time.perf_counter()
        if batched:
            steps = len(continuation)
            x = torch.tensor([full[:-1]] * steps)
            mask = torch.tensor([[1] * (n + t) + [0] * (steps - 1 - t) for t in range(steps)])
            logits = model(input_ids=x, attention_mask=mask).logits
            rows = torch.arange(steps)
            target = logits[rows, n - 1 + rows, torch.tensor(continuation)].sum()
            torch.autograd.grad(target, leaf["x"])
        else:
            for t, token in enumerate(continuation):
                logits = model(input_ids=torch.tensor([full[: n + t]])).logits
                torch.autograd.grad(logits[0, -1, token], leaf["x"])
        return time.perf_counter() - start
    finally:
        handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    args = parser.parse_args()

    ex = Explainer.from_pretrained("smollm2")  # eager attention, as every attention method needs
    model = ex.model.eval()
    ids, continuation = prompt_and_continuation(ex, args.prompt_tokens, args.new_tokens)
    prompt = ex.tokenizer.decode(ids)
    print(f"SmolLM2-135M-Instruct; prompt {len(ids)} tokens, {len(continuation)} generated: "
          f"{ex.tokenizer.decode(continuation)!r}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.machine()}")

    def explain(one_pass: bool = True) -> float:
        generation.ONE_PASS = one_pass
        try:
            start = time.perf_counter()
            g = ex.explain_generation(prompt, FAST, target=continuation)
            assert g.generated_ids == continuation and g.prompt_ids == ids, "the prompt did not round-trip"
            return time.perf_counter() - start
        finally:
            generation.ONE_PASS = True

    runs: dict[str, list[float]] = {"plain": [], "batched": [], "attnlens": [], "rows": []}
    for r in range(args.rounds + 1):  # the first round is a warm-up
        times = {"plain": plain_steps(model, ids, continuation, batched=False),
                 "batched": plain_steps(model, ids, continuation, batched=True), "attnlens": explain(),
                 "rows": explain(one_pass=False)}
        if r:
            for k, v in times.items():
                runs[k].append(v)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"medians of {args.rounds} interleaved rounds:")
    print(f"  {len(continuation)} plain forward+backward passes: {med['plain']:.3f} s")
    print(f"  the same as one batched pass:        {med['batched']:.3f} s")
    print(f"  attnlens, ten fast methods:          {med['attnlens']:.3f} s")
    print(f"  the same, a padded row per step:     {med['rows']:.3f} s  (generation.ONE_PASS = False)")
    print(f"  ratio attnlens / {len(continuation)} plain passes: {med['attnlens'] / med['plain']:.2f} (target <= 1.3)")
    print(f"  ratio attnlens / one batched pass:   {med['attnlens'] / med['batched']:.2f}")


if __name__ == "__main__":
    main()
