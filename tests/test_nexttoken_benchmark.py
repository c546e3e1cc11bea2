"""The next-token faithfulness benchmark on a tiny random Llama LM: the scorer reads the last real token, and AOPC
/ LOdds equal a hand computation (template tokens never perturbed, the explained token's probability tracked)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CLS, PAD, SEP, V

from attnlens import Explainer, InputError
from attnlens.evaluation.nexttoken import NextTokenPredictor, PromptExample, fill, run_next_token_benchmark
from attnlens.evaluation.perturb import Variant
from attnlens.testing.tiny_models import build_tiny

TEMPLATE = "i really {text} ! it was"
EXAMPLES = [PromptExample("a", "loved the charming movie", " good", 1),
            PromptExample("b", "hated this boring film and the plot", " bad", 0),
            PromptExample("c", "never liked it", " good", 0)]


@pytest.fixture(scope="module")
def lm(tokenizer) -> Explainer:
    model = build_tiny("llama", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                       task="causal-lm")
    return Explainer(model, tokenizer)


def _next_probs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].double().softmax(-1)


def test_predictor_reads_each_variants_last_token(lm):
    """Variants of different lengths in one batch (only their last positions projected onto the vocabulary), and
    one whose last token is masked out (read at its last attended token)."""
    masked = Variant((CLS, 16, 17, 18, 19), None, (1, 0, 1, 1, 0))  # "mask" mode: read at position 3
    variants = [Variant.of([CLS, 7, 8, 9, SEP]), Variant.of([CLS, 10, SEP]), Variant.of([CLS, 11, 12, 13, 14, 15]),
                masked]
    tokens = [20, 21, 22]
    vocab = NextTokenPredictor(lm.model, PAD, tokens, "vocab", batch_size=8)(variants)
    choices = NextTokenPredictor(lm.model, PAD, tokens, "choices", batch_size=8)(variants)
    with torch.no_grad():
        hole = lm.model(input_ids=torch.tensor([masked.input_ids]),
                        attention_mask=torch.tensor([masked.attention_mask]))
    for v, pv, pc in zip(variants, vocab, choices):
        p = hole.logits[0, 3].double().softmax(-1) if v is masked else _next_probs(lm.model, list(v.input_ids))
        np.testing.assert_allclose(pv, p[tokens].numpy(), rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(pc, (p[tokens] / p[tokens].sum()).numpy(), rtol=1e-4, atol=1e-7)


def _hand_metric(lm, ex, template, method, token, mode, tracked) -> float:
    """AOPC (delete) or LOdds (pad) of one example computed directly: rank the text's tokens by the method,
    take out the top round(f·n) for f = 0, 0.1, ..., 1, and track ``tracked(probs)``."""
    prompt, (lo, hi) = fill(template, ex.text)
    e = lm.explain([prompt], [method], target=[token])[0]
    text = [i for i, (s, t) in enumerate(e.offsets) if s < hi and t > lo and not e.special[i]]
    order = sorted(text, key=lambda i: -float(e.scores[method][i]))
    ids = list(e.input_ids)
    p0 = tracked(_next_probs(lm.model, ids))
    values = []
    for f in [k / 10 for k in range(11)]:
        drop = set(order[: int(np.round(f * len(text)))])
        if mode == "delete":
            changed = [t for i, t in enumerate(ids) if i not in drop]
        else:
            changed = [PAD if i in drop else t for i, t in enumerate(ids)]
        pk = tracked(_next_probs(lm.model, changed))
        values.append(p0 - pk if mode == "delete" else np.log(max(pk, 1e-12) / max(p0, 1e-12)))
    return float(np.mean(values))


def test_answer_targets_equal_a_hand_computation(lm, tokenizer):
    out = run_next_token_benchmark(lm, EXAMPLES, template=TEMPLATE, methods=["rawatt", "grads"],
                                   metrics=["aopc", "lodds"])
    assert out["n"] == 3 and set(out["methods"]) == {"rawatt", "grads"}
    for ex, row in zip(EXAMPLES, out["examples"]):
        token = tokenizer.convert_tokens_to_ids(ex.answer.strip())
        for method in ("rawatt", "grads"):
            for metric, mode in (("aopc", "delete"), ("lodds", "pad")):
                want = _hand_metric(lm, ex, TEMPLATE, method, token, mode, lambda p, t=token: float(p[t]))
                assert row[method][metric] == pytest.approx(want, rel=1e-4, abs=1e-6), (ex.id, method, metric)
        assert row["correct"] == (int(_next_probs(lm.model, lm.encode([fill(TEMPLATE, ex.text)[0]])[0].ids)
                                      .argmax()) == token)
    assert out["methods"]["grads"]["aopc"] == pytest.approx(np.mean([r["grads"]["aopc"] for r in out["examples"]]))


def test_choices_explain_the_models_choice_against_the_other(lm, tokenizer):
    choices = [" bad", " good"]
    ids = [tokenizer.convert_tokens_to_ids(c.strip()) for c in choices]
    out = run_next_token_benchmark(lm, EXAMPLES, template=TEMPLATE, choices=choices, methods=["grads"],
                                   metrics=["aopc"])
    for ex, row in zip(EXAMPLES, out["examples"]):
        p = _next_probs(lm.model, lm.encode([fill(TEMPLATE, ex.text)[0]])[0].ids)[ids]
        chosen = int(p.argmax())
        assert row["target"].strip() == choices[chosen].strip()
        assert row["p"] == pytest.approx(float(p.max() / p.sum()), rel=1e-5)
        assert row["correct"] == (chosen == ex.label)
        # the explained scalar is logit(chosen) - logit(other): the gradient of the contrast, by linearity
        prompt = fill(TEMPLATE, ex.text)[0]
        a = lm.explain([prompt], ["grads"], target=[ids[chosen]])[0].scores["grads"]
        b = lm.explain([prompt], ["grads"], target=[ids[1 - chosen]])[0].scores["grads"]
        c = lm.explain([prompt], ["grads"], target=[ids[chosen]], contrast=ids[1 - chosen])[0].scores["grads"]
        assert not np.allclose(c, a)  # the contrast changes the explanation
        assert np.abs(c).max() > 0 and np.isfinite(a).all() and np.isfinite(b).all()

        def tracked(q, chosen=chosen):
            return float(q[ids[chosen]] / q[ids].sum())

        want = _hand_metric_contrast(lm, ex, ids, chosen, tracked)
        assert row["grads"]["aopc"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert out["accuracy"] == pytest.approx(np.mean([r["correct"] for r in out["examples"]]))


def test_choices_with_target_free_methods_score_them_without_the_contrast(lm, tokenizer):
    """Raw attention and rollout explain no target, so a contrast does not apply to them: with two choices they
    are explained plainly, their rankings measured by the same contrastive metric as the other methods."""
    choices = [" bad", " good"]
    out = run_next_token_benchmark(lm, EXAMPLES, template=TEMPLATE, choices=choices,
                                   methods=["rawatt", "rollout", "grads", "integratedgradients"], metrics=["aopc"],
                                   options={"integratedgradients": {"n_steps": 2}})  # options of one group only
    assert set(out["methods"]) == {"rawatt", "rollout", "grads", "integratedgradients"}
    ids = [tokenizer.convert_tokens_to_ids(c.strip()) for c in choices]
    for ex, row in zip(EXAMPLES, out["examples"]):
        prompt = fill(TEMPLATE, ex.text)[0]
        chosen = int(_next_probs(lm.model, lm.encode([prompt])[0].ids)[ids].argmax())
        plain = lm.explain([prompt], ["rawatt"], target=[ids[chosen]])[0]
        for m in ("rawatt", "rollout", "grads"):
            assert row[m]["aopc"] is not None and np.isfinite(row[m]["aopc"]), m
        assert row["rawatt"]["aopc"] == pytest.approx(
            _hand_metric_contrast(lm, ex, ids, chosen, lambda q, c=chosen: float(q[ids[c]] / q[ids].sum()),
                                  method="rawatt", scores=plain.scores["rawatt"]), rel=1e-4, abs=1e-6)


def _hand_metric_contrast(lm, ex, ids, chosen, tracked, method="grads", scores=None) -> float:
    prompt, (lo, hi) = fill(TEMPLATE, ex.text)
    e = lm.explain([prompt], ["grads"], target=[ids[chosen]], contrast=ids[1 - chosen])[0]
    scores = e.scores[method] if scores is None else scores
    text = [i for i, (s, t) in enumerate(e.offsets) if s < hi and t > lo and not e.special[i]]
    order = sorted(text, key=lambda i: -float(scores[i]))
    full = list(e.input_ids)
    p0 = tracked(_next_probs(lm.model, full))
    drops = []
    for f in [k / 10 for k in range(11)]:
        drop = set(order[: int(np.round(f * len(text)))])
        drops.append(p0 - tracked(_next_probs(lm.model, [t for i, t in enumerate(full) if i not in drop])))
    return float(np.mean(drops))


def test_mistakes_are_one_line(lm, tokenizer):
    with pytest.raises(InputError, match="exactly once"):
        run_next_token_benchmark(lm, EXAMPLES, template="no placeholder", methods=["grads"])
    with pytest.raises(InputError, match="do not apply"):
        run_next_token_benchmark(lm, EXAMPLES, template=TEMPLATE, methods=["grads"], metrics=["kendall"])
    with pytest.raises(InputError, match="needs an answer"):
        run_next_token_benchmark(lm, [PromptExample("x", "the movie")], template=TEMPLATE, methods=["grads"])
    with pytest.raises(InputError, match="tokenizes to nothing"):
        run_next_token_benchmark(lm, [PromptExample("x", "the movie", " ")], template=TEMPLATE, methods=["grads"])
    with pytest.raises(InputError, match="two different tokens"):
        run_next_token_benchmark(lm, EXAMPLES, template=TEMPLATE, choices=[" good", " good"], methods=["grads"])
    with pytest.raises(InputError, match="causal language model"):
        run_next_token_benchmark(Explainer(build_tiny("gpt2", vocab_size=V, pad_token_id=PAD, bos_token_id=CLS,
                                                      eos_token_id=SEP), tokenizer), EXAMPLES, methods=["grads"])


def test_chunked_generation_faithfulness_runs_merge_into_the_whole(monkeypatch):
    """bench/generation_faithfulness.py --merge: examples concatenated, means over all of them (a missing value
    left out), accuracy recomputed, seconds added; chunks of different methods refused."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    from generation_faithfulness import merge

    def run(values, correct, seconds, methods=("grads",), first=0):
        rows = [{"id": str(first + i), "correct": c, **{m: {"aopc": v} for m in methods}}
                for i, (v, c) in enumerate(zip(values, correct))]
        return {"results": {"SST-2": {"n": len(rows), "methods": {m: {"aopc": 0.0} for m in methods},
                                      "examples": rows, "accuracy": 0.0}}, "seconds": {"SST-2": seconds}}

    merged = merge([run([0.1, 0.3], [True, False], 5.0), run([0.5, None], [True, True], 7.0, first=2)])
    r = merged["results"]["SST-2"]
    assert r["n"] == 4 and r["accuracy"] == 0.75 and merged["seconds"]["SST-2"] == 12.0
    assert r["methods"]["grads"]["aopc"] == pytest.approx(0.3)
    # other methods over the same examples join them; then a chunk of all the methods continues them
    joined = merge([run([0.1, 0.3], [True, False], 5.0), run([0.2, 0.4], [True, False], 1.0, methods=("alti",)),
                    run([0.6], [True], 2.0, methods=("alti", "grads"), first=2)])["results"]["SST-2"]
    assert [e["id"] for e in joined["examples"]] == ["0", "1", "2"] and set(joined["methods"]) == {"grads", "alti"}
    assert joined["methods"]["alti"]["aopc"] == pytest.approx(0.4) and joined["examples"][1]["alti"]["aopc"] == 0.4
    with pytest.raises(SystemExit, match="same methods, or runs of different methods over the same examples"):
        merge([run([0.1], [True], 1.0), run([0.1], [True], 1.0, methods=("rawatt",), first=1)])
    del sys.modules["generation_faithfulness"]
