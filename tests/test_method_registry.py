"""Methods and the shared pass: options written once, one rollout, the capture keeps what is asked."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from conftest import make_model

from attnlens import Explainer, InputError, MethodError
from attnlens.methods import get_method, list_methods, registry
from attnlens.methods.registry import ATTENTION, MethodOutput, register


def test_options_are_the_compute_signature_defaults():
    for name in list_methods():
        spec = get_method(name)
        params = list(inspect.signature(spec.compute).parameters.values())[1:]
        assert spec.options == {p.name: p.default for p in params}, name
    assert get_method("attcat").options == {"hidden": "input", "alpha": "mean"}
    assert get_method("transatt").options == {"start_layer": 0, "rules": "chefer", "epsilon": 0.0}


def test_option_without_default_is_refused_at_registration(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    def bad(ctx, alpha) -> MethodOutput:  # no default: the option would have no value
        raise AssertionError

    with pytest.raises(ValueError, match="option 'alpha' needs a default"):
        register("bad", needs={ATTENTION}, summary="", citation="")(bad)
    assert "bad" not in registry._REGISTRY


def test_gradients_without_a_tensor_to_differentiate_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    with pytest.raises(ValueError, match="GRADIENTS of what"):
        register("bad", needs={registry.GRADIENTS}, summary="", citation="")(lambda ctx: None)


TEXTS = ["i really didn't like this movie .", "a charming journey", "the plot was boring but the actors were great !"]
CAPTURE_METHODS = ["rawatt", "rollout", "grads", "attgrads", "agrad", "gae", "cat", "attcat", "saliency",
                   "inputxgradient"]


def _capture(ex: Explainer, methods: list[str]):
    specs = [get_method(m) for m in methods]
    ctx, out = ex.compute_batch(ex.encode(TEXTS), [-1] * len(TEXTS), specs, {})
    return ctx.capture, out


@pytest.mark.parametrize(
    "methods,kept",
    [
        (["rawatt"], {"attention_rows"}),  # the explained rows only (fused attention)
        (["flow"], {"attention_means"}),  # the head-mean maps only
        (["rollout"], {"attention_chunks"}),  # the maps recomputed from queries and keys
        (["gae"], {"attention_chunks"}),  # ... and their gradients from the values and the outputs' gradients
        (["globenc"], {"attention_chunks", "hidden"}),  # the maps recomputed, and the hidden states
        (["alti"], {"attention_chunks", "hidden"}),
        (["decompx"], {"attention_chunks", "hidden"}),  # the maps recomputed, and the hidden states
        (["grads"], {"attention_rows", "attention_row_grads"}),
        (["cat"], {"hidden", "hidden_grads"}),
        (["attcat"], {"attention_rows", "attention_received", "hidden", "hidden_grads"}),  # no attention gradient
        (["saliency"], {"embeddings", "embedding_grads"}),
        (["rawatt", "saliency"], {"attention_rows", "embeddings", "embedding_grads"}),
        (["integratedgradients"], set()),
        (CAPTURE_METHODS, {"attention_rows", "attention_row_grads", "attention_received", "attention_chunks",
                           "hidden", "hidden_grads", "embeddings", "embedding_grads"}),  # still fused attention
        (CAPTURE_METHODS + ["flow", "decompx"], {"attention_rows", "attention_row_grads", "attention_received",
                                                 "attention_means", "attention_chunks", "hidden", "hidden_grads",
                                                 "embeddings", "embedding_grads"}),  # still no N x N map per head
    ],
)
def test_capture_keeps_what_the_methods_declare(methods, kept, tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)
    capture, _ = _capture(ex, methods)
    fields = {"attentions", "attention_grads", "attention_rows", "attention_row_grads", "attention_received",
              "attention_means", "attention_chunks", "hidden", "hidden_grads", "embeddings", "embedding_grads"}
    assert {f for f in fields if getattr(capture, f) is not None} == kept
    assert capture.logits.shape == (len(TEXTS), 2)
    assert capture.n_layers == (2 if kept - {"embeddings", "embedding_grads"} else 0)


def test_attention_only_pass_asks_for_no_hidden_states_and_builds_no_graph(tokenizer, monkeypatch):
    ex = Explainer(make_model("bert"), tokenizer)
    calls = []
    forward = ex.model.forward

    def spy(*args, **kwargs):
        calls.append((kwargs.get("output_hidden_states"), torch.is_grad_enabled()))
        return forward(*args, **kwargs)

    monkeypatch.setattr(ex.model, "forward", spy)
    capture, _ = _capture(ex, ["rawatt"])
    assert calls == [(False, False)]
    assert not capture.attention_rows[0].requires_grad


@pytest.mark.parametrize("family,attention", [("bert", None), ("gpt2", None), ("bart", "encoder"),
                                              ("bart", "decoder"), ("bart", "cross")])
def test_each_method_alone_equals_it_among_all(family, attention, tokenizer):
    """A smaller capture changes no value: each method requested alone gives bit-identical scores where both
    passes keep whole maps; where alone it runs fused attention (the rows capture), equal to 1e-5 of its largest
    term (tests/test_row_capture.py)."""
    ex = Explainer(make_model(family), tokenizer, attention=attention)
    methods = [m for m in CAPTURE_METHODS if not (attention == "cross" and m in ("rollout", "gae"))]
    _, together = _capture(ex, methods)
    for m in methods:
        _, alone = _capture(ex, [m])
        fused = family != "bart" and ATTENTION not in get_method(m).needs
        for got, want in zip(alone[m], together[m], strict=True):
            if want is not None:
                atol = 1e-5 * float(want.abs().max()) if fused else 0
                torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=m)


def test_a_logit_only_method_under_all_is_skipped_for_other_target_kinds(tokenizer):
    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.warns(UserWarning, match="skipping decompx: decompx decomposes the logits; target_kind='loss'"):
        (exp,) = ex.explain(["a good movie"], methods="all", target=1, target_kind="loss",
                            options={"integratedgradients": {"n_steps": 2}})
    assert "decompx" not in exp.scores and "attcat" in exp.scores
    with pytest.raises(InputError, match="target_kind='probability' is not supported"):
        ex.explain(["a good movie"], methods=["decompx"], target=1, target_kind="probability")
    (exp,) = ex.explain(["a good movie"], methods=["decompx"], target=1)
    assert exp.scores["decompx"].any()


@pytest.mark.parametrize(("family", "suffix", "method", "options", "match"), [
    ("gpt2", "LMHeadModel", "decompx", {"bias": "absdot"}, "bias='absdot'.*'gpt2' model is pre-LN"),
    ("gpt2", "LMHeadModel", "attnnorm", {"variant": "attn_res_ln"}, "attn_res_ln.*pre-LN"),
    ("bert", "ForTokenClassification", "decompx", {"bias": "absdot"}, "first token; for a token model"),
    ("bart", "ForSequenceClassification", "decompx", {"bias": "absdot"}, "encoder-decoder use bias='token'"),
    ("bert", "ForSequenceClassification", "transatt", {"start_layer": -3}, r"start_layer=-3 .* 2 layers"),
])
def test_option_values_the_model_cannot_take_are_refused_before_any_pass(family, suffix, method, options, match,
                                                                          tokenizer):
    model = make_model(family, model_suffix=suffix)
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    ex = Explainer(model, tokenizer)
    with pytest.raises(InputError, match=match):
        ex.explain("good movie", methods=[method], options={method: options})
    assert calls == []  # judged from the model and the options alone
    assert get_method(method).unsupported_options(model, "encoder" if family == "bart" else "self",
                                                  ex.head.task, get_method(method).options) is None


def test_the_methods_that_run_many_passes_are_marked_and_bring_the_cli_progress_bar():
    from attnlens.cli.explain import _runs_long
    from attnlens.methods import get_method, list_methods

    many = [m for m in list_methods() if get_method(m).many_passes]
    assert many == ["integratedgradients", "valuezeroing", "occlusion", "lime", "kernelshap"]
    assert _runs_long("all") and _runs_long("grads, integratedgradients")
    assert not _runs_long("rawatt,attnlrp") and not _runs_long(None) and not _runs_long("nope")


# ------------------------------------------------------------------------------------------ methods of one's own
@pytest.fixture
def own_methods(monkeypatch):
    """A registry a test may add to, as it was afterwards."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return registry


def _hidden(ctx) -> torch.Tensor:
    return ctx.capture.hidden[-1][..., 0]


@pytest.mark.parametrize(("returns", "match"), [
    (lambda ctx: MethodOutput(_hidden(ctx)[:, :1]), r"scores of shape \(2, 1\); expected \(2, \d+\)"),
    (lambda ctx: MethodOutput(_hidden(ctx).T), r"scores of shape \(\d+, 2\); expected \(2, \d+\)"),
    (lambda ctx: MethodOutput(_hidden(ctx), layers=_hidden(ctx)), r"layers of shape \(2, \d+\); expected \(2, layers"),
    (lambda ctx: MethodOutput(_hidden(ctx), space="key"), r"space='key'; it is one of 'keys', 'tokens'"),
    (lambda ctx: MethodOutput(_hidden(ctx), meta={"gap": 1.5}), r"meta\['gap'\] of float; each meta value"),
    (lambda ctx: MethodOutput(_hidden(ctx).bool()), r"scores as a torch.bool tensor"),
    (lambda ctx: _hidden(ctx), r"a Tensor; a method returns a MethodOutput"),
    (lambda ctx: MethodOutput(_hidden(ctx).numpy()), r"scores as a ndarray"),
])
def test_a_registered_methods_output_that_does_not_fit_the_batch_is_one_error(own_methods, tokenizer, returns, match):
    own_methods.register("mine", needs={registry.HIDDEN}, summary="mine", citation="-")(returns)
    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.raises(MethodError, match=r"^method 'mine' returned " + match):
        ex.explain(["the movie was great", "bad"], methods=["mine"], batch_size=2)


def test_a_registered_method_that_raises_is_named(own_methods, tokenizer):
    def broken(ctx):
        return 1 / 0

    own_methods.register("broken", needs={registry.HIDDEN}, summary="-", citation="-")(broken)
    with pytest.raises(MethodError, match=r"^method 'broken' failed: ZeroDivisionError: division by zero$"):
        Explainer(make_model("bert"), tokenizer).explain("the movie was great", methods=["broken"])


@pytest.mark.parametrize("name", [3, "", "a,b", "all", "my method"])
def test_a_method_name_that_cannot_be_requested_is_refused(own_methods, name):
    with pytest.raises(ValueError, match="a method's name is a non-empty string"):
        own_methods.register(name, needs={registry.HIDDEN}, summary="-", citation="-")(lambda ctx: None)


def test_a_method_function_without_the_batch_context_is_refused(own_methods):
    with pytest.raises(ValueError, match=r"takes the batch context first"):
        own_methods.register("mine", needs={registry.HIDDEN}, summary="-", citation="-")(lambda: None)


def test_a_method_that_leaves_nan_on_padding_gives_zeros_there_and_no_warning(own_methods, tokenizer):
    def padded_nan(ctx):
        return MethodOutput(torch.where(ctx.token_mask.bool(), _hidden(ctx), torch.nan), space="tokens")

    own_methods.register("padnan", needs={registry.HIDDEN}, summary="-", citation="-")(padded_nan)
    ex = Explainer(make_model("bert"), tokenizer)
    batch = ex.encode(["the movie was great", "bad"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, out = ex.compute_batch(batch, [-1, -1], [get_method("padnan")], {})
    scores, _ = out["padnan"]
    assert bool(torch.isfinite(scores).all()) and bool((scores[1, len(batch[1].ids):] == 0).all())


def test_a_method_that_is_nan_on_tokens_is_said_to_be_at_fault_in_a_float32_model(own_methods, tokenizer):
    own_methods.register("nan", needs={registry.HIDDEN}, summary="-", citation="-")(
        lambda ctx: MethodOutput(_hidden(ctx) * torch.nan))
    with pytest.warns(UserWarning, match=r"nan: \d+ of its scores are not finite \(inf or nan\) \(the method's own"):
        Explainer(make_model("bert"), tokenizer).explain("the movie was great", methods=["nan"])


def test_the_same_function_registered_again_replaces_itself_and_another_is_refused(own_methods):
    def mine(ctx):
        return MethodOutput(_hidden(ctx))

    for _ in range(2):  # a notebook cell run twice
        own_methods.register("mine", needs={registry.HIDDEN}, summary="-", citation="-")(mine)
    with pytest.raises(ValueError, match="method 'mine' is registered twice"):
        own_methods.register("mine", needs={registry.HIDDEN}, summary="-", citation="-")(lambda ctx: None)
    with pytest.raises(ValueError, match="method 'rawatt' is registered twice"):
        own_methods.register("rawatt", needs={registry.HIDDEN}, summary="-", citation="-")(mine)


def test_what_the_progress_callback_raises_through_a_method_of_ones_own_comes_out_as_it_is(own_methods, tokenizer):
    """A caller stops a run by raising from its progress callback (serve cancels a job so): the exception reaches
    it unchanged, not as the method's failure."""
    class Stop(Exception):
        pass

    reports, inside = [], []

    def slow(ctx):
        for _ in range(3):
            inside.append(True)
            ctx.progress(0.1)
        return MethodOutput(_hidden(ctx))

    def stop(*_report):
        reports.append(True)
        if inside:  # the method's own report
            raise Stop

    own_methods.register("slow", needs={registry.HIDDEN}, summary="-", citation="-", many_passes=True)(slow)
    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.raises(Stop):
        ex.explain("the movie was great", methods=["slow"], progress=stop)
    assert len(inside) == 1
