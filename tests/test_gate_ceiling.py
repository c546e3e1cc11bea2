"""The hidden-source ablation of bench/gate_ceiling.py on a tiny random Llama, against an eager forward of the
whole prompt in float64 whose additive mask hides the sources from the positions after the context."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_sources import ANSWER, CONTEXT, QUERY, lm_tokenizer, make_lm

from attnlens import Explainer
from attnlens.core.modelstate import explaining
from attnlens.sources.ablation import full_logprob
from attnlens.sources.attribute import prepare_job
from attnlens.sources.gates import after_context

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gate_ceiling  # noqa: E402


@pytest.fixture(scope="module")
def job():
    ex = Explainer(make_lm("llama", seed=2), lm_tokenizer(), max_length=64)
    return prepare_job(ex.runner, CONTEXT, QUERY, answer=ANSWER, chat=False)


def _hidden_by_hand(job, keep: np.ndarray) -> float:
    """The answer's log-probability from one eager float64 forward of prompt + answer, the keys of the sources
    ``keep`` drops masked (-inf) for every query from the first position after the context on."""
    model = copy.deepcopy(job.runner.model).double()
    ids = job.prompt.ids + job.answer_ids
    n, cut = len(ids), after_context(job)
    owner = np.asarray(job.token_source + [-1] * len(job.answer_ids))
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    hidden = [i for i in range(n) if owner[i] >= 0 and not keep[owner[i]]]
    mask[cut:, hidden] = float("-inf")
    with torch.no_grad(), explaining(model):
        logits = model(input_ids=torch.tensor([ids]), attention_mask=mask[None, None]).logits[0]
    logp = logits.log_softmax(-1)
    first = len(job.prompt.ids) - 1
    return sum(float(logp[first + i, t]) for i, t in enumerate(job.answer_ids))


def test_hiding_no_source_gives_the_answers_log_probability(job):
    kept = np.ones((1, len(job.sources)), dtype=bool)
    assert gate_ceiling.hidden_logprobs(job, kept)[0] == pytest.approx(full_logprob(job), abs=1e-4)


def test_hidden_sources_match_an_eager_forward_masking_them_after_the_context(job):
    n = len(job.sources)
    assert n >= 3
    masks = np.array([[k % 2 == 0 for k in range(n)], [k != 1 for k in range(n)], [False] * n])
    got = gate_ceiling.hidden_logprobs(job, masks)
    expected = [_hidden_by_hand(job, m) for m in masks]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    # the cache of the context is cropped back after each variant: the same answers in another order
    np.testing.assert_allclose(gate_ceiling.hidden_logprobs(job, masks[::-1]), expected[::-1], rtol=1e-5, atol=1e-5)
    assert len({round(v, 3) for v in expected}) > 1  # hiding changes the answer's log-probability
