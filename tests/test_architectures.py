"""One entry per model type (attnlens.models.architectures): every type the README claims is built tiny from its entry
and explained; the entries' facts (pooling, position offset, LRP support) reach the engine and the LRP patch."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from conftest import CLS, PAD, SEP, V, make_model, make_tokenizer

from attnlens import Explainer, register_adapter
from attnlens.errors import ModelError
from attnlens.lrp import SUPPORTED, supports
from attnlens.methods import registry
from attnlens.models.adapters import DECODER, ENCODER, FIRST, LAST, MEAN
from attnlens.models.architectures import (
    ARCHITECTURES,
    LRP_SUPPORTED,
    Anatomy,
    Architecture,
    Layers,
    adapter_for,
    architecture_for,
    finds_last_token_by_padding,
    register_architecture,
)
from attnlens.testing.tiny_models import TINY, Tiny, register_tiny

# The model types README.md claims, plus the ones added since (T5, XLM-RoBERTa-XL).
README_TYPES = [
    "bert", "distilbert", "roberta", "xlm-roberta", "camembert", "albert", "electra", "deberta", "deberta-v2",
    "mpnet", "ernie", "modernbert", "gpt2", "gpt_neo", "gpt_neox", "gptj", "llama", "mistral", "mixtral", "qwen2",
    "qwen3", "gemma", "gemma2", "phi", "phi3", "opt", "bloom", "falcon", "bart", "mbart",
]
ZOO = README_TYPES + ["t5", "xlm-roberta-xl"]
TEXTS = ["i didn ' t like this boring film", "good"]  # the second is padded in the batch
CAPTURE_METHODS = ["rawatt", "rollout", "attgrads", "gae", "attcat", "saliency"]
IG = {"integratedgradients": {"n_steps": 4}}


@pytest.fixture
def restore_registry():
    """Undo registrations made by a test (the tables are module-level)."""
    from attnlens.models.architectures import _UNLISTED

    tables = (ARCHITECTURES, LRP_SUPPORTED, TINY, _UNLISTED)
    saved = [dict(t) for t in tables]
    yield
    for table, old in zip(tables, saved):
        table.clear()
        table.update(old)


def test_every_claimed_type_has_an_entry_with_a_tiny_recipe():
    missing = [t for t in ZOO if t not in ARCHITECTURES or t not in TINY]
    assert missing == [] and set(TINY) == set(ARCHITECTURES)


@pytest.mark.parametrize("model_type", ZOO)
def test_every_type_is_built_and_explained(model_type, tokenizer):
    model = make_model(model_type)
    assert model.config.model_type == model_type
    ex = Explainer(model, tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # methods="all" warns when it skips LRP on types without LRP support
        batch = ex.explain(TEXTS, methods="all", options=IG)
        alone = [ex.explain([t], methods="all", options=IG)[0] for t in TEXTS]
    # every method that says it applies runs (and on LRP-supported types, the LRP methods are among them)
    expected = {m for m in registry.resolve_methods("all")
                if registry.get_method(m).unsupported(model, ex.stream, "classification") is None}
    if supports(model):  # an encoder-decoder's attention relevance mixes three streams: AttnLRP alone
        seq2seq = architecture_for(model.config).family == "encoder-decoder"
        assert ({"attnlrp"} if seq2seq else {"partiallrp", "transatt", "attnlrp"}) <= expected
    for text, b, a in zip(TEXTS, batch, alone):
        assert b.input_ids == tokenizer(text)["input_ids"]
        assert b.scores.keys() == a.scores.keys()
        assert set(b.scores) == expected
        assert {"rawatt", "rollout", "gae", "attcat", "integratedgradients"} <= set(b.scores)
        for m in b.scores:  # padding (in the batch) changes no score
            assert np.isfinite(b.scores[m]).all(), m
            np.testing.assert_allclose(b.scores[m], a.scores[m], atol=2e-4, rtol=1e-3, err_msg=m)
        np.testing.assert_allclose(b.probabilities, a.probabilities, atol=1e-5)
    # padded positions of the raw batch tensors are exactly zero
    ctx, out = ex.compute_batch(ex.encode(TEXTS), [-1] * len(TEXTS),
                                [registry.get_method(m) for m in CAPTURE_METHODS], {})
    pad = ~ctx.token_mask.bool()
    assert pad.any()
    for m, (scores, _layers) in out.items():
        assert torch.all(scores[pad] == 0), m


@pytest.mark.parametrize("pooling, rows", [("cls", "first"), ("mean", "real")])
def test_modernbert_is_explained_from_the_rows_its_head_reads(pooling, rows, tokenizer):
    # classifier_pooling="mean" feeds the head the mean over the real tokens, so rawatt is the mean over the real
    # query rows of the last layer's attention (not the [CLS] row, which the head never reads alone)
    model = make_model("modernbert")
    model.config.classifier_pooling = pooling
    assert adapter_for(model).pooling == (MEAN if pooling == "mean" else FIRST)
    ex = Explainer(model, tokenizer)
    exps = ex.explain(TEXTS, methods=["rawatt"])
    for text, e in zip(TEXTS, exps):
        enc = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            att = model(**enc, output_attentions=True).attentions[-1][0].mean(0)  # (Q, K) of one unpadded input
        want = att.mean(0) if rows == "real" else att[0]
        np.testing.assert_allclose(e.scores["rawatt"], want.numpy(), atol=1e-6)


def test_t5_head_reads_the_decoder_at_the_last_eos(tokenizer):
    model = make_model("t5")
    ex = Explainer(model, tokenizer)
    assert ex.adapter.family == "encoder-decoder" and ex.stream == "encoder"
    enc = tokenizer(TEXTS[0], return_tensors="pt")
    ids = enc["input_ids"]
    assert int(ex.adapter.classification_index(ids, enc["attention_mask"], model.config)) == ids.shape[1] - 1
    # the cross stream's scores are the last-EOS row of the last cross-attention layer (mean over heads)
    (e,) = Explainer(model, tokenizer, attention="cross").explain([TEXTS[0]], methods=["rawatt"])
    with torch.no_grad():
        cross = model(**enc, output_attentions=True).cross_attentions[-1][0].mean(0)
    np.testing.assert_allclose(e.scores["rawatt"], cross[ids.shape[1] - 1].numpy(), atol=1e-6)


def test_position_offset_comes_from_the_entry():
    # RoBERTa-like positions start after the padding index: 70 - (pad_token_id + 1) usable, where the rule reads
    # a pad id of 0 as 1 (conservative: 68)
    assert architecture_for(make_model("roberta").config).position_offset
    tok = make_tokenizer()
    tok.model_max_length = 10_000  # so the model's limit decides
    for model_type, usable in [("roberta", 68), ("xlm-roberta-xl", 68), ("mpnet", 70), ("bert", 64)]:
        assert Explainer(make_model(model_type), tok).max_length == usable, model_type


def test_lrp_support_and_residual_sites_come_from_the_entries():
    from attnlens.lrp.patch import residual_sites

    assert list(SUPPORTED.values()) == ["BERT", "RoBERTa", "DistilBERT", "ALBERT", "ELECTRA", "XLM-RoBERTa",
                                        "CamemBERT", "DeBERTa", "DeBERTa-v2", "MPNet", "ERNIE", "ModernBERT",
                                        "XLM-RoBERTa-XL", "GPT-2", "GPT-Neo",
                                        "GPT-NeoX", "GPT-J", "Llama", "Mistral", "Mixtral", "Qwen2", "Qwen3",
                                        "Gemma", "Gemma 2", "Phi", "Phi-3", "OPT", "BLOOM", "Falcon", "BART", "mBART",
                                        "T5"]
    assert SUPPORTED is LRP_SUPPORTED
    sites = {t: residual_sites(make_model(t)) for t in ["bert", "distilbert", "albert", "mpnet"]}
    assert len(sites["bert"]) == 4  # attention and feed-forward output of 2 layers
    assert len(sites["mpnet"]) == 4
    assert len(sites["distilbert"]) == 4
    assert len(sites["albert"]) == 2  # one layer shared by both layers: attention and feed-forward sums
    model = make_model("albert")
    model.albert.encoder.albert_layer_groups[0].albert_layers[0].chunk_size_feed_forward = 2
    with pytest.raises(ModelError, match="ALBERT with chunked feed-forward"):
        residual_sites(model)


def test_a_new_model_type_is_one_entry(tokenizer, restore_registry):
    # RoFormer is not in the table: one entry (its adapter) makes it explainable; a tiny recipe, buildable here
    assert "roformer" not in ARCHITECTURES
    register_architecture(Architecture("roformer", ENCODER))
    register_tiny("roformer", Tiny("RoFormerConfig", "RoFormerForSequenceClassification",
                                   dict(hidden_size=16, embedding_size=16, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=24, max_position_embeddings=64)))
    model = make_model("roformer")
    ex = Explainer(model, tokenizer)
    batch = ex.explain(TEXTS, methods=["rawatt", "gae", "attcat"])
    for text, b in zip(TEXTS, batch):
        (a,) = ex.explain([text], methods=["rawatt", "gae", "attcat"])
        for m in b.scores:
            np.testing.assert_allclose(b.scores[m], a.scores[m], atol=1e-5, err_msg=m)
    assert not supports(model)  # no LRP facts declared


def test_register_adapter_is_kept_as_an_alias(restore_registry):
    model = make_model("bert")
    register_adapter("bert", DECODER)
    assert adapter_for(model).family == "decoder" and adapter_for(model).pooling == LAST
    assert architecture_for(model.config).lrp is not None  # the entry's other facts are kept
    assert finds_last_token_by_padding(model) is False  # it has a pad id
    model.config.pad_token_id = None
    assert finds_last_token_by_padding(model) is True
    assert list(SUPPORTED)[0] == "bert"  # re-registering keeps the LRP list's order


def test_unknown_types_fall_back_by_config_flags_and_bad_entries_are_refused(restore_registry):
    bert = make_model("bert")
    bert.config.model_type = "not-a-type"
    assert adapter_for(bert).family == "encoder"
    bert.config.is_decoder = True
    assert adapter_for(bert).family == "decoder"
    bert.config.is_encoder_decoder = True
    with pytest.raises(ModelError, match="has no adapter; supported: bart, mbart, t5"):
        adapter_for(bert)
    with pytest.raises(ModelError, match="unknown pooling"):
        register_architecture(Architecture("x", ENCODER, pooling="middle"))
    with pytest.raises(ModelError, match="cannot explain a head with pooling 'mean'"):
        register_architecture(Architecture("x", adapter_for(make_model("bart")), pooling=MEAN))
    layers = Layers("layers", "self_attn.v_proj")
    with pytest.raises(ModelError, match="either as one module .ffn., as a mixture of experts .moe. or by its pieces"):
        register_architecture(Architecture("x", DECODER, layers=layers, anatomy=Anatomy((), pre_ln=True, ffn="mlp")))
    with pytest.raises(ModelError, match="a fused gate/up projection .gate_up. replaces gate and ffn_in"):
        register_architecture(Architecture("x", DECODER, layers=layers,
                                           anatomy=Anatomy((), pre_ln=True, gate_up="mlp.gate_up_proj")))
    with pytest.raises(ModelError, match="a parallel anatomy is a pre-LN one"):
        register_architecture(Architecture("x", DECODER, layers=layers, anatomy=Anatomy((), parallel=True)))
    assert "x" not in ARCHITECTURES


def _unlisted(name: str, **extra) -> torch.nn.Module:
    """A tiny sequence classifier of a transformers type attnlens has no entry for."""
    import transformers
    from conftest import PAD, V

    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
    config = getattr(transformers, f"{name}Config")(vocab_size=V, num_labels=3, pad_token_id=PAD, **sizes, **extra,
                                                    attn_implementation="eager")
    return getattr(transformers, f"{name}ForSequenceClassification")(config).eval()


@pytest.mark.parametrize(("name", "family", "row"), [("Starcoder2", "decoder", -1), ("BioGpt", "decoder", -1),
                                                     ("RoFormer", "encoder", 0)])
def test_a_type_without_an_entry_is_explained_where_a_test_pass_finds_its_head_reads(name, family, row, tokenizer,
                                                                                      restore_registry):
    """Causal language models do not say so in their config: a test pass finds a decoder's causal attention, and
    its classifier is explained at the last token, an encoder's at the first, with one warning."""
    model = _unlisted(name, **({"embedding_size": 32} if name == "RoFormer" else {}))
    model.requires_grad_(False)  # frozen weights, as in an inference script: the test pass still takes gradients
    assert model.config.model_type not in ARCHITECTURES
    with pytest.warns(UserWarning, match=f"has no attnlens entry: a test pass found a .*{family}"):
        ex = Explainer(model, tokenizer)
    assert ex.adapter.family == family
    (e,) = ex.explain([TEXTS[0]], methods=["rawatt", "grads"])
    inputs = tokenizer(TEXTS[0], return_tensors="pt")
    inputs = {k: v for k, v in inputs.items() if k != "token_type_ids" or ex._takes_token_types}
    model.requires_grad_(True)  # the reference differentiates through the weights
    out = model(**inputs, output_attentions=True)
    last = out.attentions[-1]
    (grad,) = torch.autograd.grad(out.logits[0, e.target], last)
    np.testing.assert_allclose(e.scores["rawatt"], last[0].mean(0)[row].detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(e.scores["grads"], grad[0].mean(0)[row].numpy(), atol=1e-6)


@pytest.mark.parametrize(("name", "message"), [
    ("XLNet", "a bidirectional encoder, whose classification head does not read"),
    ("Funnel", r"its attention is not one 6 × 6 map per layer"),
])
def test_a_type_without_an_entry_that_no_generic_entry_explains_is_refused_in_one_line(name, message, tokenizer,
                                                                                       restore_registry):
    import transformers
    from conftest import PAD, V

    if name == "XLNet":
        config = transformers.XLNetConfig(vocab_size=V, d_model=32, n_layer=2, n_head=4, d_inner=48, num_labels=3,
                                          pad_token_id=PAD)
        model = transformers.XLNetForSequenceClassification(config).eval()
    else:
        config = transformers.FunnelConfig(vocab_size=V, d_model=32, n_head=4, d_head=8, d_inner=48,
                                           block_sizes=[1, 1], num_labels=3, pad_token_id=PAD)
        model = transformers.FunnelForSequenceClassification(config).eval()
    with pytest.raises(ModelError, match=message) as err:
        Explainer(model, tokenizer)
    assert "\n" not in str(err.value)


def test_tiny_models_use_the_shared_token_ids():
    for model_type in ["bart", "t5", "gpt2"]:
        c = make_model(model_type).config
        assert c.vocab_size == V and c.pad_token_id == PAD
    assert make_model("bart").config.eos_token_id == SEP and make_model("gpt2").config.bos_token_id == CLS


def test_a_model_that_cannot_switch_to_eager_attention_is_refused(tokenizer):
    # Falcon keeps the attention implementation it was built with: explaining it with SDPA gave padded-batch
    # scores different from the single-input ones (silently wrong); now a one-line ModelError
    model = make_model("falcon", attn="sdpa")
    assert model.config._attn_implementation == "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ModelError, match="cannot switch to eager attention.*attn_implementation='eager'"):
            Explainer(model, tokenizer).explain(TEXTS, methods=["rawatt"])
    assert model.config._attn_implementation == "sdpa"  # left as it was


def test_an_albert_of_several_layers_per_group_skips_only_the_methods_that_take_its_layers_one_by_one(tokenizer):
    from transformers import AlbertForSequenceClassification

    from attnlens import InputError

    config = make_model("albert").config
    config.inner_group_num = 2
    torch.manual_seed(0)
    model = AlbertForSequenceClassification(config).eval()
    ex = Explainer(model, tokenizer)
    with pytest.warns(UserWarning):
        (e,) = ex.explain([TEXTS[0]], methods="all")
    assert {"rawatt", "rollout", "grads", "attnlrp"} <= set(e.scores)
    assert not {"valuezeroing", "decompx", "alti"} & set(e.scores)
    with pytest.raises(InputError, match="inner_group_num"):
        ex.explain([TEXTS[0]], methods=["valuezeroing"])


def test_an_entry_with_a_field_of_the_wrong_kind_is_refused_at_registration():
    with pytest.raises(ModelError, match=r"Architecture 'roformer': adapter is a str, not Adapter"):
        register_architecture(Architecture("roformer", "encoder"))
    assert "roformer" not in ARCHITECTURES


def test_an_entry_naming_modules_the_model_lacks_is_one_line(tokenizer, monkeypatch):
    bert = ARCHITECTURES["bert"]
    monkeypatch.setitem(ARCHITECTURES, "bert", dataclasses.replace(
        bert, layers=dataclasses.replace(bert.layers, layers="encoder.layers")))
    ex = Explainer(make_model("bert"), tokenizer)
    with pytest.raises(ModelError, match=r"no module at 'encoder.layers', which the 'bert' entry's layers name"):
        ex.explain("the movie was great", methods=["valuezeroing"])
    anatomy = dataclasses.replace(bert.anatomy, output="attention.output.dens")
    monkeypatch.setitem(ARCHITECTURES, "bert", dataclasses.replace(bert, anatomy=anatomy))
    with pytest.raises(ModelError, match=r"no module at .attention.output.dens., which its architecture entry names"):
        ex.explain("the movie was great", methods=["globenc"])


def test_an_entry_of_ones_own_of_the_wrong_family_is_refused(tokenizer, monkeypatch):
    """An entry registered outside attnlens is trusted in all but its family, which a test pass checks: a causal
    decoder read as an encoder would be explained at its first token."""
    monkeypatch.setitem(ARCHITECTURES, "gpt2", Architecture("gpt2", ENCODER))
    with pytest.raises(ModelError, match=r"'gpt2' entry .* is an encoder entry, but a test pass found causal "
                                         r"attention: register it with attnlens.models.adapters.DECODER"):
        Explainer(make_model("gpt2"), tokenizer)
    monkeypatch.setitem(ARCHITECTURES, "bert", Architecture("bert", DECODER))
    with pytest.raises(ModelError, match=r"found bidirectional attention: register it with .*ENCODER"):
        Explainer(make_model("bert"), tokenizer)
    monkeypatch.setitem(ARCHITECTURES, "gpt2", Architecture("gpt2", DECODER))
    (e,) = Explainer(make_model("gpt2"), tokenizer).explain("the movie was great", methods=["rawatt"])
    assert e.scores["rawatt"][-1] != 0


@pytest.mark.parametrize("model_type, variant", [(t, "tiny") for t in ZOO if t != "mixtral"]  # its experts: float32
                         + [("deberta-v2", "released")])
def test_a_type_is_said_to_normalise_its_word_embeddings_exactly_where_its_output_forgets_their_length(model_type,
                                                                                                   variant):
    """Scaling the word embeddings (as the gradient methods hook them) leaves the logits unchanged exactly where the
    architecture entry says the embeddings go straight into a normalisation; there input × gradient is refused in
    one line (it sums to 0), and under "all" left out with a warning. ``released``: DeBERTa-v2 as DeBERTa-v3 ships
    (no positions or token types added to the word embeddings)."""
    model = make_model(model_type)
    if variant == "released":
        model.config.position_biased_input, model.config.type_vocab_size = False, 0
        model = type(model)(model.config).eval()
    model = model.double()
    tok = make_tokenizer()
    ex = Explainer(model, tok)
    ids = torch.tensor([tok("the movie was good and i loved it")["input_ids"]])
    kwargs = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
    scale = {"by": 1.0}
    hook = ex.adapter.embedding_module(model).register_forward_hook(lambda m, a, out: out * scale["by"])
    with torch.no_grad():
        plain = model(input_ids=ids, **kwargs).logits
        scale["by"] = 1.7
        scaled = model(input_ids=ids, **kwargs).logits
    hook.remove()
    forgets = float((plain - scaled).abs().max() / plain.abs().max()) < 1e-3
    assert architecture_for(model.config).normalises_embeddings(model.config) == forgets
    if forgets:
        from attnlens.errors import InputError

        with pytest.raises(InputError, match=r"^inputxgradient sums to 0 on model type .*use saliency"):
            ex.explain(TEXTS[0], methods=["inputxgradient"])
        with pytest.warns(UserWarning, match="inputxgradient"):
            (e,) = ex.explain(TEXTS[0], methods="all", options=IG)
        assert "inputxgradient" not in e.scores and "saliency" in e.scores
    else:
        (e,) = ex.explain(TEXTS[0], methods=["inputxgradient"])
        assert np.abs(e.scores["inputxgradient"]).max() > 1e-6
