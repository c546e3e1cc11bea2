"""A language model's logits projected only where the head reads them: the same explanations, probabilities and
predictions as with every position's logits, for next tokens (padded batches, predicted and given targets, every
target kind, contrast), generations (one forward over the sequence) and whole answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import CLS, PAD, SEP, V

from attnlens import Explainer
from attnlens.core.encoding import Encoded
from attnlens.core.logit_rows import LogitRows
from attnlens.core.memory import model_dims
from attnlens.methods.lrp_methods import kept_pass_dims
from attnlens.methods.registry import get_method
from attnlens.models.heads import CAUSAL_LM, AnswerHead, answer_labels
from attnlens.testing.tiny_models import build_tiny

TEXTS = ["the movie was really", "a film", "i didn ' t like this plot , but the actors were charming"]
IG = {"integratedgradients": {"n_steps": 4}}


def _lm(family: str) -> torch.nn.Module:
    return build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, seed=3,
                      task="causal-lm")


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma2", "bloom", "qwen2"])
def lm(request, tokenizer) -> Explainer:
    return Explainer(_lm(request.param), tokenizer)


@pytest.fixture
def every_position(monkeypatch):
    """Make every pass project all positions onto the vocabulary, as without :class:`LogitRows`."""
    def switch():
        monkeypatch.setattr(LogitRows, "of", classmethod(lambda cls, *a, **k: cls()))
    return switch


def _assert_same(kept, full) -> None:
    for a, b in zip(kept, full, strict=True):
        assert a.target == b.target and a.predicted == b.predicted
        np.testing.assert_allclose(a.probabilities, b.probabilities, rtol=1e-5, atol=1e-7)
        assert set(a.scores) == set(b.scores)
        for m in a.scores:
            # to 1e-5 of the largest score, beside float32 rounding of a probability (the matrix products of
            # some and of all positions round differently)
            scale = np.abs(b.scores[m]).max()
            np.testing.assert_allclose(a.scores[m], b.scores[m], rtol=0, atol=1e-5 * scale + 1e-6, err_msg=m)


@pytest.mark.parametrize("target_kind", ["logit", "loss", "probability"])
@pytest.mark.filterwarnings("ignore:skipping decompx")
def test_next_token_explanations_equal_the_whole_outputs(lm, every_position, target_kind):
    target = None if target_kind == "logit" else [7, 9, 11]
    kept = lm.explain(TEXTS, methods="all", target=target, target_kind=target_kind, options=IG, batch_size=3)
    every_position()
    full = lm.explain(TEXTS, methods="all", target=target, target_kind=target_kind, options=IG, batch_size=3)
    _assert_same(kept, full)


def test_a_batch_mixing_given_and_predicted_targets(lm, every_position):
    kwargs = dict(methods=["grads", "cat", "saliency", "decompx"], target=[None, 12, None], batch_size=3)
    kept = lm.explain(TEXTS, **kwargs)
    every_position()
    _assert_same(kept, lm.explain(TEXTS, **kwargs))


def test_contrast(lm, every_position):
    kwargs = dict(methods=["grads", "attcat", "integratedgradients"], contrast=5, options=IG, batch_size=3)
    kept = lm.explain(TEXTS, **kwargs)
    every_position()
    _assert_same(kept, lm.explain(TEXTS, **kwargs))


def test_generation_steps(lm, every_position):
    kwargs = dict(max_new_tokens=3, methods=["rawatt", "grads", "agrad", "attcat", "saliency",
                                             "integratedgradients", "attnlrp"], options=IG)
    kept = lm.explain_generation(TEXTS[0], **kwargs)
    every_position()
    full = lm.explain_generation(TEXTS[0], **kwargs)
    assert kept.generated_ids == full.generated_ids
    np.testing.assert_allclose(kept.probabilities, full.probabilities, rtol=1e-5)
    for m in full.scores:
        np.testing.assert_allclose(kept.scores[m], full.scores[m], rtol=0,
                                   atol=1e-5 * np.abs(full.scores[m]).max(), err_msg=m)


def test_whole_answer(lm, every_position):
    prompt = lm.tokenizer(TEXTS[2])["input_ids"]
    kwargs = dict(methods=["rawatt", "grads", "cat", "saliency", "decompx", "attnlrp"])
    kept = lm.explain_answer(prompt, [7, 8, 9], **kwargs)
    every_position()
    _assert_same([kept], [lm.explain_answer(prompt, [7, 8, 9], **kwargs)])


def test_the_pass_keeps_only_the_read_positions(lm):
    """Three inputs of different lengths: three rows of logits, not one per token; an answer of three tokens:
    its three predicting positions (the last of them also the input's last)."""
    batch = lm.encode(TEXTS)
    specs = [get_method("grads")]
    ctx, _ = lm.compute_batch(batch, [-1] * 3, specs, {"grads": {}})
    n = ctx.token_mask.shape[1]
    assert ctx.capture.logits.shape == (3, 3, V) and n > 3
    positions = ctx.capture.logit_rows.positions.tolist()
    assert positions == sorted(int(x) - 1 for x in ctx.token_mask.sum(1))


def test_answer_positions_and_targets():
    head = AnswerHead(V)
    labels = torch.tensor([answer_labels(4, [7, 8]), answer_labels(2, [5, 6, 9]) + [-1]], dtype=torch.long)
    mask = torch.tensor([[1] * 6, [1] * 5 + [0]], dtype=torch.long)
    positions = head.logit_positions(mask, labels)
    assert positions.tolist() == [1, 2, 3, 4, 5]
    rows = LogitRows(positions)
    assert rows.targets(head, labels).tolist() == [[-1, -1, 7, 8, -1], [5, 6, 9, -1, -1]]
    assert rows.mask(mask).tolist() == [[1] * 5, [1, 1, 1, 1, 0]]


def test_masks_with_holes_keep_every_position():
    model = _lm("llama")
    mask = torch.tensor([[1, 0, 1, 1]])
    assert LogitRows.of(model, CAUSAL_LM, mask, None).positions is None
    assert LogitRows.of(model, CAUSAL_LM, torch.tensor([[1, 1, 1, 0]]), None).positions.tolist() == [2]


def test_encoded_single(lm):
    """One input alone: one kept row, the last."""
    e: Encoded = lm.encode([TEXTS[0]])[0]
    ctx, _ = lm.compute_batch([e], [-1], [get_method("rawatt")], {"rawatt": {}})
    assert ctx.capture.logits.shape[1] == 1
    assert ctx.capture.logit_rows.positions.tolist() == [len(e.ids) - 1]


def _forwards(model: torch.nn.Module) -> list[int]:
    """A list that grows by one at each forward of ``model`` (the hook stays for the module's life)."""
    calls: list[int] = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize("method", ["attnlrp", "partiallrp"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2", "bloom", "qwen2"])
def test_an_lrp_pass_serves_as_the_shared_forward(family, method, tokenizer):
    """AttnLRP or PartialLRP alone with the targets known: its LRP pass is the batch's only forward, and the
    explanation is the one computed beside a shared pass (a method that needs one runs with it): same scores,
    probabilities, prediction; for a whole answer and for next tokens with given targets."""
    ex = Explainer(_lm(family), tokenizer)
    # what AttnLRP's fused pass keeps is counted once per model, on two short probes: not a pass over the inputs
    kept_pass_dims(ex.model, model_dims(ex.model))
    calls = _forwards(ex.model)
    prompt = ex.tokenizer(TEXTS[2])["input_ids"]
    alone = ex.explain_answer(prompt, [7, 8, 9], [method])
    kept = ex.explain(TEXTS, methods=[method], target=[7, 9, 11], batch_size=3)
    assert len(calls) == 2
    beside = ex.explain_answer(prompt, [7, 8, 9], [method, "rawatt"])
    shared = ex.explain(TEXTS, methods=[method, "rawatt"], target=[7, 9, 11], batch_size=3)
    assert len(calls) >= 6
    for a, b in zip([alone, *kept], [beside, *shared], strict=True):
        assert a.target == b.target and a.predicted == b.predicted
        np.testing.assert_allclose(a.probabilities, b.probabilities, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(a.scores[method], b.scores[method], rtol=1e-6,
                                   atol=1e-7 * np.abs(b.scores[method]).max())
        assert (method in a.layers) == (method in b.layers)
        if method in b.layers:  # PartialLRP's per-layer rows
            np.testing.assert_allclose(a.layers[method], b.layers[method], rtol=1e-6,
                                       atol=1e-7 * np.abs(b.layers[method]).max())
        assert np.abs(a.scores[method]).max() > 0
    calls.clear()
    ex.explain(TEXTS[:1], methods=[method])  # the predicted token is read off the shared pass first
    assert len(calls) >= 2


def test_an_lrp_pass_forms_attention_relevance_only_where_a_method_reads_it(tokenizer):
    """Without attention relevance the input relevance is the same to the last bit and R(A) is not formed; a
    method reading R(A) under AttnLRP's rules beside attnlrp shares its pass and gets it."""
    from attnlens.lrp import lrp_pass
    from attnlens.models.heads import LMHead

    model = _lm("llama").double()
    ids = torch.tensor([[5, 9, 12, 14, 20, 7]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    head = LMHead(V)
    full = lrp_pass(model, inputs, torch.tensor([11]), head=head)
    lean = lrp_pass(model, inputs, torch.tensor([11]), head=head, attention_relevance=False)
    assert lean.attention_relevance == [] and len(full.attention_relevance) == model.config.num_hidden_layers
    assert torch.equal(lean.input_relevance, full.input_relevance)
    assert torch.equal(lean.word_relevance, full.word_relevance)
    ex = Explainer(_lm("llama"), tokenizer)
    options = {"partiallrp": {"rules": "attnlrp"}}
    (both,) = ex.explain(TEXTS[:1], methods=["attnlrp", "partiallrp"], target=7, options=options)
    (alone,) = ex.explain(TEXTS[:1], methods=["partiallrp"], target=7, options=options)
    assert np.abs(alone.scores["partiallrp"]).max() > 0
    np.testing.assert_allclose(both.scores["partiallrp"], alone.scores["partiallrp"], rtol=1e-6, atol=1e-9)
