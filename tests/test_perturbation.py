"""Occlusion, LIME and KernelSHAP (Captum on token features): values against hand-computed token replacements,
batch = single, padding, the number of forwards, and faithfulness against random orderings on the real model."""

from __future__ import annotations

import inspect
import math
import random

import numpy as np
import pytest
import torch
from conftest import FAMILIES, make_model

from attnlens import Explainer

TEXTS = ["i really didn't like this movie .", "a charming journey",
         "the plot was boring but the actors were great !", "good"]
PERTURBATION = ["occlusion", "lime", "kernelshap"]
SMALL = {"lime": {"n_samples": 40}, "kernelshap": {"n_samples": 40}}


def _scalar(model: torch.nn.Module, ids: list[int], target: int, original: list[int] | None = None) -> float:
    """The target logit on ``ids``; an encoder-decoder's decoder reads the ``original`` (unreplaced) input."""
    kw = {}
    if model.config.is_encoder_decoder:
        from transformers.models.bart.modeling_bart import shift_tokens_right

        kw["decoder_input_ids"] = shift_tokens_right(torch.tensor([original or ids]), model.config.pad_token_id,
                                                     model.config.decoder_start_token_id)
    if "token_type_ids" in inspect.signature(model.forward).parameters:  # as the tokenizer gives them
        kw["token_type_ids"] = torch.zeros(1, len(ids), dtype=torch.long)
    if model.config.model_type == "roberta":  # its positions skip padding ids: keep the unreplaced input's
        kw["position_ids"] = torch.arange(len(ids))[None] + model.config.pad_token_id + 1
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids]), **kw).logits[0, target])


@pytest.mark.parametrize("family", FAMILIES)
def test_occlusion_equals_a_loop_of_single_token_replacements(family, tokenizer):
    model = make_model(family)
    ex = Explainer(model, tokenizer)
    decoder = family in ("gpt2", "llama")
    baseline = tokenizer.unk_token_id if decoder else tokenizer.pad_token_id  # the documented "auto" baseline
    for e in ex.explain(TEXTS, methods=["occlusion"], batch_size=4):
        full = _scalar(model, e.input_ids, e.target)
        expected = np.zeros(len(e.input_ids))
        for j, special in enumerate(e.special):
            if not special:
                ids = list(e.input_ids)
                ids[j] = baseline
                expected[j] = full - _scalar(model, ids, e.target, e.input_ids)
        np.testing.assert_allclose(e.scores["occlusion"], expected, atol=2e-5, err_msg=family)


def test_mask_baseline_option_replaces_with_the_mask_token(tokenizer):
    model = make_model("bert")
    (e,) = Explainer(model, tokenizer).explain([TEXTS[0]], methods=["occlusion"],
                                                options={"occlusion": {"baseline": "mask"}})
    full = _scalar(model, e.input_ids, e.target)
    ids = list(e.input_ids)
    ids[3] = tokenizer.mask_token_id
    assert e.scores["occlusion"][3] == pytest.approx(full - _scalar(model, ids, e.target), abs=2e-5)


@pytest.mark.parametrize("family", ["bert", "gpt2", "bart"])
def test_batch_equals_single_and_padding_and_specials_score_zero(family, tokenizer):
    ex = Explainer(make_model(family), tokenizer)
    batch = ex.explain(TEXTS, methods=PERTURBATION, batch_size=4, options=SMALL)
    for text, e in zip(TEXTS, batch, strict=True):
        (alone,) = ex.explain([text], methods=PERTURBATION, options=SMALL)
        for m in PERTURBATION:
            np.testing.assert_allclose(e.scores[m], alone.scores[m], atol=1e-4, err_msg=m)
            assert np.all(e.scores[m][np.array(e.special)] == 0), m
    encoded = ex.encode(TEXTS)
    from attnlens.methods import get_method

    ctx, out = ex.compute_batch(encoded, [-1] * len(TEXTS), [get_method(m) for m in PERTURBATION], SMALL)
    pad = ~ctx.token_mask.bool()
    assert pad.any()
    for m, (scores, _) in out.items():
        assert torch.all(scores[pad] == 0), m


def test_one_token_kernelshap_is_its_exact_shapley_value(tokenizer):
    """With one player the Shapley value is F(x) - F(baseline): KernelSHAP must give the occlusion drop."""
    (e,) = Explainer(make_model("bert"), tokenizer).explain(["good"], methods=["occlusion", "kernelshap"])
    assert e.scores["occlusion"][1] != 0
    assert e.scores["kernelshap"][1] == pytest.approx(e.scores["occlusion"][1], abs=1e-6)


def test_samples_are_seeded_per_input(tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)
    a = ex.explain([TEXTS[2]], methods=["lime", "kernelshap"], options=SMALL)[0]
    b = ex.explain([TEXTS[2]], methods=["lime", "kernelshap"], options=SMALL)[0]
    other = {m: {**SMALL[m], "seed": 1} for m in SMALL}
    c = ex.explain([TEXTS[2]], methods=["lime", "kernelshap"], options=other)[0]
    for m in ("lime", "kernelshap"):
        np.testing.assert_array_equal(a.scores[m], b.scores[m])
        assert not np.array_equal(a.scores[m], c.scores[m]), m


class _RowCounter:
    """Counts forwards of a model and the rows they carry."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards, self.rows = 0, 0
        self.handle = model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.forwards += 1
        self.rows += len(ids)


@pytest.mark.parametrize(("method", "per_eval"), [("occlusion", 4), ("lime", 16), ("kernelshap", 16), ("lime", None)])
def test_forwards_are_batched_within_the_number_of_samples(tokenizer, method, per_eval):
    model = make_model("bert")
    ex = Explainer(model, tokenizer)
    n_samples = 40
    opts = {"perturbations_per_eval": per_eval} | ({} if method == "occlusion" else {"n_samples": n_samples})
    text = TEXTS[2]
    n_tokens = len(tokenizer(text)["input_ids"]) - 2  # real non-special tokens = the features
    counter = _RowCounter(model)
    try:
        ex.explain([text], methods=[method], options={method: opts})
    finally:
        counter.handle.remove()
    samples = n_tokens + 1 if method == "occlusion" else n_samples  # occlusion: each token + the unperturbed input
    per_eval = per_eval or 256  # the budget allows the cap at this length
    # one pass of the engine's own (the predicted class) + the perturbation forwards, each of <= per_eval rows
    assert counter.rows - 1 <= samples
    if method == "occlusion":  # Captum evaluates the unperturbed input alone, then the replacements in batches
        assert counter.forwards - 1 <= 1 + math.ceil(n_tokens / per_eval)
    else:
        assert counter.forwards - 1 <= math.ceil(samples / per_eval)


@pytest.mark.parametrize("method", PERTURBATION)
def test_progress_moves_with_every_forward_and_a_raising_listener_stops_the_samples(tokenizer, method):
    model = make_model("bert")
    ex = Explainer(model, tokenizer)
    opts = {"perturbations_per_eval": 4} | ({} if method == "occlusion" else {"n_samples": 40})
    fractions: list[float] = []
    ex.explain(TEXTS[:2], methods=[method], options={method: opts},
               progress=lambda fraction, _done: fractions.append(fraction))
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)
    assert len(set(fractions)) >= 6  # a report per forward of 4 points, not one per input

    class Stop(Exception):
        pass

    reports: list[float] = []

    def stop_early(fraction: float, _done: int) -> None:
        reports.append(fraction)
        if len(reports) == 2:  # the first reports the engine's own pass, the second the method's first forward
            raise Stop

    counter = _RowCounter(model)
    try:
        with pytest.raises(Stop):
            ex.explain(TEXTS[:1], methods=[method], options={method: opts}, progress=stop_early)
    finally:
        counter.handle.remove()
    assert counter.forwards == 2  # the predicted class, then one forward of 4 points: the rest never ran


@pytest.mark.parametrize("option", [{"n_samples": 1}, {"n_samples": 2.5}, {"perturbations_per_eval": 0},
                                    {"seed": "x"}, {"baseline": "nothing"}])
def test_bad_options_are_one_line_errors(tokenizer, option):
    from attnlens.errors import InputError

    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.raises(InputError):
        ex.explain([TEXTS[0]], methods=["lime"], options={"lime": option})


def _mean_prob_drop(model, tokenizer, exps, orders) -> float:
    """AOPC by deletion: the predicted class's probability drop after deleting the top 10 %, 20 %, ... 50 % of the
    real tokens in each given order, averaged over levels and examples (levels rounded up)."""
    drops = []
    for e, order in zip(exps, orders, strict=True):
        real = [j for j, s in enumerate(e.special) if not s]
        ids = torch.tensor([e.input_ids])
        with torch.no_grad():
            p0 = model(input_ids=ids).logits.softmax(-1)[0, e.target]
            levels = []
            for frac in (0.1, 0.2, 0.3, 0.4, 0.5):
                k = max(1, math.ceil(frac * len(real)))
                drop = set(order[:k])
                kept = [t for j, t in enumerate(e.input_ids) if j not in drop]
                p = model(input_ids=torch.tensor([kept])).logits.softmax(-1)[0, e.target]
                levels.append(float(p0 - p))
        drops.append(np.mean(levels))
    return float(np.mean(drops))


@pytest.mark.slow
def test_perturbation_methods_beat_random_orderings_on_the_reference_model(minilm_sst2):
    from attnlens.data import load_dataset

    data = load_dataset("sst2", split="dev")
    texts = [data[i].text for i in range(0, 160, 10)]  # 16 sentences
    exps = minilm_sst2.explain(texts, methods=PERTURBATION, options={"lime": {"n_samples": 60},
                                                                     "kernelshap": {"n_samples": 60}})
    model, tok = minilm_sst2.model, minilm_sst2.tokenizer
    rng = np.random.default_rng(0)
    random_aopc = np.mean([
        _mean_prob_drop(model, tok, exps, [list(rng.permutation([j for j, s in enumerate(e.special) if not s]))
                                           for e in exps]) for _ in range(5)])
    for m in PERTURBATION:
        orders = [list(np.argsort(-np.where(e.special, -np.inf, e.scores[m]), kind="stable")) for e in exps]
        aopc = _mean_prob_drop(model, tok, exps, orders)
        assert aopc > random_aopc + 0.1, (m, aopc, random_aopc)


def test_sampling_methods_leave_the_global_random_streams_alone(tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)
    methods = ["lime", "kernelshap"]
    options = {m: {"n_samples": 20} for m in methods}
    first = ex.explain(TEXTS[0], methods=methods, options=options)[0]  # scikit-learn's first import draws too
    np.random.seed(0)
    random.seed(0)
    torch.manual_seed(0)
    numpy_state, python_state, torch_state = np.random.get_state()[1].copy(), random.getstate(), torch.get_rng_state()
    again = ex.explain(TEXTS[0], methods=methods, options=options)[0]
    np.testing.assert_array_equal(np.random.get_state()[1], numpy_state)
    assert random.getstate() == python_state
    assert torch.equal(torch.get_rng_state(), torch_state)
    for m in methods:
        np.testing.assert_array_equal(first.scores[m], again.scores[m])
