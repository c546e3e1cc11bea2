"""Gradient baselines on encoder-decoders: the encoder tokens' scores and the decoder inputs' share.

An encoder-decoder reads its input twice, through the encoder's embeddings and through the decoder's inputs (a
classifier's and an extractive QA model's decoder reads the same tokens shifted; a language model's, the start
token and the answer so far). Saliency and input × gradient score the encoder's tokens and report the decoder
inputs' share in ``meta[method]["decoder_inputs"]``. Against autograd through hooks of the test's own on the two
embedding calls (BART and mBART embed the decoder inputs with a module of their own; T5 with the encoder's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_model, make_tokenizer
from test_lrp_seq2seq import FAMILIES, TEXTS, _qa_model, seq2seq

from attnlens import Explainer


def _embedding_gradients(model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                         scalar) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The encoder's and the decoder's input embeddings and their gradients of ``scalar(outputs)``."""
    encoder_module = model.get_encoder().get_input_embeddings()
    decoder_module = model.get_decoder().get_input_embeddings()
    calls: list[torch.Tensor] = []

    def keep(_module, _args, output):
        output = output.detach().requires_grad_(True)
        calls.append(output)
        return output

    handles = [encoder_module.register_forward_hook(keep)]
    if decoder_module is not encoder_module:
        handles.append(decoder_module.register_forward_hook(keep))
    try:
        with torch.enable_grad():
            y = scalar(model(**inputs))
            enc, dec = calls  # the encoder runs first
            g_enc, g_dec = torch.autograd.grad(y, [enc, dec])
    finally:
        for h in handles:
            h.remove()
    return enc.detach(), g_enc, dec.detach(), g_dec


def _check(meta_share: float, scores: np.ndarray, method: str, enc, g_enc, dec, g_dec) -> None:
    if method == "inputxgradient":
        want_tokens, want_share = (enc * g_enc).sum(-1)[0], (dec * g_dec).sum()
    else:
        want_tokens, want_share = g_enc.abs().sum(-1)[0], g_dec.abs().sum()
    np.testing.assert_allclose(scores, want_tokens.numpy(), rtol=1e-9, atol=1e-12)
    assert meta_share == pytest.approx(float(want_share), rel=1e-9, abs=1e-12)
    assert abs(float(want_share)) > 1e-4  # the decoder inputs do carry a share here


@pytest.mark.parametrize("method", ["inputxgradient", "saliency"])
@pytest.mark.parametrize("family", FAMILIES)
def test_classifier_reports_the_decoder_inputs_share(family, method):
    model = seq2seq(family)
    (e,) = Explainer(model, make_tokenizer()).explain(TEXTS[:1], methods=[method], target=2)
    ids = torch.tensor([e.input_ids])
    refs = _embedding_gradients(model, {"input_ids": ids}, lambda out: out.logits[0, 2])
    _check(float(e.meta[method]["decoder_inputs"]), e.scores[method], method, *refs)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_question_answering_span_reports_the_decoder_inputs_share(family):
    model = _qa_model(family)
    (e,) = Explainer(model, make_tokenizer()).explain([("what movie", "the movie was really good")],
                                                      methods=["inputxgradient"])
    start, end = e.target
    ids = torch.tensor([e.input_ids])
    refs = _embedding_gradients(model, {"input_ids": ids},
                                lambda out: out.start_logits[0, start] + out.end_logits[0, end])
    _check(float(e.meta["inputxgradient"]["decoder_inputs"]), e.scores["inputxgradient"], "inputxgradient", *refs)


@pytest.mark.parametrize("family", ["bart", "t5"])
def test_each_generated_token_reports_the_decoder_inputs_share(family):
    model = seq2seq(family, "seq2seq-lm")
    gen = Explainer(model, make_tokenizer()).explain_generation(TEXTS[0], max_new_tokens=3,
                                                               methods=["inputxgradient"])
    n = len(gen.prompt_ids)
    start = model.config.decoder_start_token_id
    for t, token in enumerate(gen.generated_ids):
        inputs = {"input_ids": torch.tensor([gen.prompt_ids]),
                  "decoder_input_ids": torch.tensor([[start, *gen.generated_ids[:t]]])}
        refs = _embedding_gradients(model, inputs, lambda out, t=t, token=token: out.logits[0, t, token])
        _check(gen.meta["inputxgradient"]["decoder_inputs"][t], gen.scores["inputxgradient"][t][:n],
               "inputxgradient", *refs)


def test_a_padded_batch_equals_each_example_alone():
    ex = Explainer(seq2seq("bart"), make_tokenizer())
    batch = ex.explain(TEXTS, methods=["inputxgradient", "saliency"], target=0, batch_size=3)
    for text, e in zip(TEXTS, batch, strict=True):
        (alone,) = ex.explain([text], methods=["inputxgradient", "saliency"], target=0)
        for m in ("inputxgradient", "saliency"):
            np.testing.assert_allclose(e.scores[m], alone.scores[m], rtol=1e-9, atol=1e-12)
            assert float(e.meta[m]["decoder_inputs"]) == pytest.approx(float(alone.meta[m]["decoder_inputs"]),
                                                                       rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_single_stream_models_report_no_decoder_share(family):
    (e,) = Explainer(make_model(family), make_tokenizer()).explain(TEXTS[:1], methods=["inputxgradient", "saliency"])
    assert "inputxgradient" not in e.meta and "saliency" not in e.meta
