"""The query rows that extractive QA models and token classifiers explain: a span's start and end rows, half each
(a one-token span: its row), and the labelled token's row. attnnorm, globenc, alti, transatt, value zeroing and
attention flow at those rows against independent computations (per-token loops, autograd, whole-model reruns,
networkx max-flows) on tiny BERTs with random biases and LayerNorm parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_model, make_tokenizer, randomise_biases_and_norms
from test_decomposition import Reference
from test_flow import networkx_flows
from test_valuezeroing import naive_scores

from attnlens import Explainer
from attnlens.lrp import lrp_pass
from attnlens.models.heads import QAHead, TokenHead

QUESTION, CONTEXT = "what was the movie ?", "the movie was great but the plot was boring ."
TEXT = "the plot was boring but the actors were great !"
# (task, target): a span with start < end, a one-token span, the predicted span; a token (its predicted label),
# a (token, label) pair
CASES = [("qa", (8, 12)), ("qa", (13, 13)), ("qa", None), ("token", 4), ("token", (9, 1))]
IDS = ["qa-span", "qa-one-token", "qa-predicted", "token", "token-label"]


@dataclass
class Case:
    """One explained input: the explainer, its model inputs and the explained rows' weights ``w`` ``(n,)``."""

    ex: Explainer
    task: str
    target: Any
    inputs: dict[str, torch.Tensor]
    w: np.ndarray | None = None
    read: list[tuple[int, int]] | None = None  # the logits the target sums: (position, column or label)

    def explain(self, method: str, options: dict[str, Any] | None = None) -> np.ndarray:
        """The method's scores; sets ``w`` (and ``read``) from the explanation's resolved target."""
        (e,) = self.ex.explain([(QUESTION, CONTEXT) if self.task == "qa" else TEXT], methods=[method],
                               target=self.target, options={method: options or {}})
        assert e.input_ids == self.inputs["input_ids"][0].tolist()
        n = len(e.input_ids)
        w = np.zeros(n)
        if self.task == "qa":
            s, t = e.target  # the span, resolved where it is the predicted one
            if self.target is not None:
                assert (s, t) == self.target
            w[s] += 0.5
            w[t] += 0.5
            self.read = [(s, 0), (t, 1)]
        else:
            position = self.target if isinstance(self.target, int) else self.target[0]
            w[position] = 1.0
            self.read = [(position, int(e.target))]
        self.w = w
        return e.scores[method]

    def reference(self) -> Reference:
        """The per-token loops of the papers' formulas over this input (with its segments)."""
        return Reference(self.ex.model, self.inputs["input_ids"][0].tolist(),
                         self.inputs["token_type_ids"][0].tolist())


@pytest.fixture(scope="module")
def explainers() -> dict[str, Explainer]:
    """A tiny extractive QA model and a tiny token classifier (3 labels), biases and norms random."""
    tokenizer = make_tokenizer()
    qa = make_model("bert", num_labels=2, model_suffix="ForQuestionAnswering")
    token = make_model("bert", num_labels=3, model_suffix="ForTokenClassification")
    return {task: Explainer(randomise_biases_and_norms(m, 0), tokenizer) for task, m in (("qa", qa), ("token", token))}


@pytest.fixture(params=CASES, ids=IDS)
def case(request: pytest.FixtureRequest, explainers: dict[str, Explainer]) -> Case:
    task, target = request.param
    ex = explainers[task]
    inputs = dict(ex.tokenizer(*((QUESTION, CONTEXT) if task == "qa" else (TEXT,)), return_tensors="pt"))
    return Case(ex, task, target, inputs)


def assert_matches(got: np.ndarray, want: np.ndarray, name: str, atol: float = 1e-5) -> None:
    """``got`` equals the reference ``want``, which is not ~0 (the rows read carry something)."""
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=atol, err_msg=name)
    assert np.abs(want).max() > 1e-3, name


NORM_CHECKS = [("attnnorm", {"variant": "attn"}), ("attnnorm", {"variant": "attn_res"}),
               ("attnnorm", {"variant": "attn_res_ln"}), ("globenc", {"normalize": False}),
               ("globenc", {"normalize": True}), ("alti", {})]
NORM_IDS = ["attnnorm-attn", "attnnorm-attn_res", "attnnorm-attn_res_ln", "globenc", "globenc-normalize", "alti"]


@pytest.mark.parametrize("method,options", NORM_CHECKS, ids=NORM_IDS)
def test_norm_based_methods_read_the_explained_rows(case: Case, method: str, options: dict[str, Any]) -> None:
    """attnnorm (each variant), globenc (both normalisations) and alti: w @ the per-row results of the papers'
    formulas written out per token (the rolled-out methods: w @ C^L···C^1)."""
    got = case.explain(method, options)
    want = getattr(case.reference(), method)(*options.values(), w=case.w)
    assert_matches(got, want, f"{method} {options}", atol=1e-6 if method == "alti" else 1e-5)
    if method == "alti":  # row-normalised contributions rolled out stay a distribution
        assert abs(want.sum() - 1) < 1e-5


@pytest.mark.parametrize("start_layer", [0, 1])
def test_transatt_reads_the_explained_rows(case: Case, start_layer: int) -> None:
    """TransAtt: w @ M^L···M^{start}, M^l = (E_h max(∇A^l ⊙ R(A^l), 0) + I) with rows normalised to 1; ∇A the
    gradient of the explained logits (start + end logit; the label's logit at the token) from an eager forward, R(A)
    from the chefer LRP pass of the same target."""
    got = case.explain("transatt", {"start_layer": start_layer})
    model = case.ex.model
    out = model(**case.inputs, output_attentions=True)
    if case.task == "qa":
        logits = torch.stack([out.start_logits[0], out.end_logits[0]], -1)
        targets, head = torch.tensor([[case.read[0][0], case.read[1][0]]]), QAHead()
    else:
        logits = out.logits[0]
        targets, head = torch.tensor([list(case.read[0])]), TokenHead()
        if isinstance(case.target, int):  # the predicted label
            assert case.read[0][1] == int(logits[case.target].argmax())
    explained = sum(logits[position, column] for position, column in case.read)
    grads = torch.autograd.grad(explained, out.attentions)
    relevance = lrp_pass(model, case.inputs, targets, head=head, rules="chefer").attention_relevance
    n = len(case.w)
    joint = np.eye(n)
    for g, r in list(zip(grads, relevance, strict=True))[start_layer:]:
        m = np.maximum(g[0].double().numpy() * r[0].double().numpy(), 0).mean(0) + np.eye(n)
        joint = (m / m.sum(1, keepdims=True)) @ joint
    assert_matches(got, case.w @ joint, f"transatt start_layer={start_layer}", atol=1e-6)


@pytest.mark.parametrize("rollout", [True, False])
def test_value_zeroing_reads_the_explained_rows(case: Case, rollout: bool) -> None:
    """Value zeroing: each layer's cosine distances C^l from whole-model reruns with one value vector zeroed, rows
    normalised; w @ C^L···C^1 (``rollout=False``: w @ C^L)."""
    got = case.explain("valuezeroing", {"rollout": rollout})
    pair = (QUESTION, CONTEXT) if case.task == "qa" else (TEXT,)
    _, c, _ = naive_scores(case.ex.model, lambda _text, **kw: case.ex.tokenizer(*pair, **kw), "")
    c = c / c.sum(-1, keepdims=True)
    joint = c[-1]
    if rollout:
        for layer in reversed(c[:-1]):
            joint = joint @ layer
    assert_matches(got, case.w @ joint, f"valuezeroing rollout={rollout}", atol=1e-5)


def test_flow_averages_the_normalised_flows_from_the_explained_rows(case: Case) -> None:
    """Attention flow: per explained row q, the max-flows from q in the top layer to each input token through the
    graph of capacities Â^l = 0.5·E_h A^l + 0.5·I (networkx), divided by their sum, then weighed by w_q."""
    got = case.explain("flow")
    with torch.no_grad():
        out = case.ex.model(**case.inputs, output_attentions=True)
    n = len(case.w)
    mats = np.stack([0.5 * a[0].double().mean(0).numpy() + 0.5 * np.eye(n) for a in out.attentions])
    want = np.zeros(n)
    for q in np.flatnonzero(case.w):
        flows = networkx_flows(mats, int(q))
        want += case.w[q] * flows / flows.sum()
    assert_matches(got, want, "flow")
    assert abs(got.sum() - 1) < 1e-5


@pytest.mark.parametrize("family", ["bart", "t5"])
@pytest.mark.parametrize("stream", ["encoder", "decoder"])
def test_an_encoder_decoder_qa_model_reads_the_span_rows_in_the_decoder_and_every_row_in_the_encoder(family, stream):
    """An encoder-decoder QA head reads the decoder's states at the span's start and end: the decoder stream
    explains those rows (half each), the encoder stream the mean over its real queries, as for classification
    (no encoder position feeds the head)."""
    tokenizer = make_tokenizer()
    model = make_model(family, model_suffix="ForQuestionAnswering")
    (e,) = Explainer(model, tokenizer, attention=stream).explain([(QUESTION, CONTEXT)], methods=["rawatt"],
                                                                   target=(8, 12))
    inputs = tokenizer(QUESTION, CONTEXT, return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    maps = (out.encoder_attentions if stream == "encoder" else out.decoder_attentions)[-1][0].mean(0).double()
    if stream == "encoder":
        want = maps.mean(0)
    else:  # decoder position i holds input token i - 1: the head reads rows 8 and 12, key k is token k - 1
        rows = 0.5 * (maps[8] + maps[12])
        want = torch.cat([rows[1:], rows.new_zeros(1)])
    np.testing.assert_allclose(e.scores["rawatt"], want.numpy(), atol=1e-6)
