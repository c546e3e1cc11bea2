"""Token classification (NER): explaining one token's label, on tiny random token classifiers (no real NER model is
available offline)."""

from __future__ import annotations

import inspect
import json
import re
import warnings

import numpy as np
import pytest
import torch
from conftest import CLS, PAD, SEP, V

from attnlens import Explainer, InputError, ModelError, get_method
from attnlens.cli import main as cli_main
from attnlens.results.explanation import Explanation
from attnlens.testing.tiny_models import build_tiny
from attnlens.viz.colors import prediction_line
from attnlens.viz.html import explanations_html

TYPES = ["bert", "roberta", "distilbert", "deberta-v2"]
TEXTS = ["the movie was good", "not very bad , i really didn ' t like this film", "awful plot !"]
LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
ATTENTION_METHODS = ["rawatt", "rollout", "grads", "agrad", "gae", "cat"]


def token_model(model_type: str = "bert", seed: int = 0) -> torch.nn.Module:
    model = build_tiny(model_type, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                       num_labels=len(LABELS), seed=seed, model_suffix="ForTokenClassification")
    model.config.id2label = dict(enumerate(LABELS))
    model.config.label2id = {k: i for i, k in enumerate(LABELS)}
    return model


def reference(model, tokenizer, text: str, position: int, label: int | None) -> dict[str, np.ndarray]:
    """The methods' formulas at query row ``position`` from an independent pass (the model called directly,
    autograd of ``logits[position, label]``), in float64 loops."""
    enc = tokenizer(text, return_tensors="pt")
    takes = inspect.signature(model.forward).parameters
    enc = {k: v for k, v in enc.items() if k in takes}
    store = {}

    def keep(m, a, out):
        out.requires_grad_(True)
        store["e"] = out
        return out

    handle = model.get_input_embeddings().register_forward_hook(keep)
    out = model(**enc, output_attentions=True, output_hidden_states=True)
    handle.remove()
    logits = out.logits[0]
    label = int(logits[position].argmax()) if label is None else label
    tensors = list(out.attentions) + list(out.hidden_states) + [store["e"]]
    grads = torch.autograd.grad(logits[position, label], tensors, allow_unused=True)
    L = len(out.attentions)
    A = [a[0].detach().double().numpy() for a in out.attentions]
    G = [g[0].double().numpy() for g in grads[:L]]
    Hs = [h[0].detach().double().numpy() for h in out.hidden_states]
    HG = [(g if g is not None else torch.zeros_like(h))[0].double().numpy()
          for g, h in zip(grads[L:2 * L + 1], out.hidden_states, strict=True)]
    emb, emb_grad = store["e"][0].detach().double().numpy(), grads[-1][0].double().numpy()
    n = A[0].shape[-1]
    eye = np.eye(n)
    ref = {"rawatt": A[-1].mean(0)[position], "grads": G[-1].mean(0)[position],
           "agrad": (A[-1] * G[-1]).mean(0)[position]}
    roll, gae = eye.copy(), eye.copy()
    for a, g in zip(A, G, strict=True):
        roll = (0.5 * a.mean(0) + 0.5 * eye) @ roll
        gae = gae + np.maximum(g * a, 0).mean(0) @ gae
    ref["rollout"], ref["gae"] = roll[position], gae[position]
    ref["cat"] = sum((HG[layer] * Hs[layer]).sum(-1) for layer in range(L))
    ref["saliency"] = np.abs(emb_grad).sum(-1)
    ref["inputxgradient"] = (emb * emb_grad).sum(-1)
    ref["label"] = label
    return ref


@pytest.mark.parametrize("model_type", TYPES)
def test_methods_equal_a_recomputation_at_the_explained_token(model_type, tokenizer):
    model = token_model(model_type)
    ex = Explainer(model, tokenizer)
    positions = [2, 6, 1]
    methods = ATTENTION_METHODS + ["saliency", "inputxgradient"]
    for label in (None, 3):
        targets = [(p, label) for p in positions]
        exps = ex.explain(TEXTS, methods, target=targets, batch_size=3)
        for text, p, e in zip(TEXTS, positions, exps, strict=True):
            ref = reference(model, tokenizer, text, p, label)
            assert e.target == ref["label"] and e.meta["position"] == p
            for m in methods:
                np.testing.assert_allclose(e.scores[m], ref[m], atol=1e-5, rtol=1e-4, err_msg=f"{model_type} {m}")


def test_batch_with_different_positions_equals_one_by_one_and_padding_is_zero(tokenizer):
    ex = Explainer(token_model("bert"), tokenizer)
    methods = ATTENTION_METHODS + ["attgrads", "attcat", "flow", "saliency", "integratedgradients", "valuezeroing"]
    options = {"integratedgradients": {"n_steps": 4}}
    positions = [3, 1, 2]
    batch = ex.explain(TEXTS, methods, target=positions, batch_size=3, options=options)
    for text, p, b in zip(TEXTS, positions, batch, strict=True):
        (alone,) = ex.explain(text, methods, target=p, options=options)
        ig_b, ig_a = b.meta.pop("integratedgradients"), alone.meta.pop("integratedgradients")  # per-input gap
        assert ig_b["n_steps"] == ig_a["n_steps"] and ig_b["delta"] == pytest.approx(ig_a["delta"], abs=1e-5)
        assert (b.target, b.predicted, b.meta) == (alone.target, alone.predicted, alone.meta)
        for m in methods:
            np.testing.assert_allclose(b.scores[m], alone.scores[m], atol=1e-5, rtol=1e-4, err_msg=m)
    specs = [get_method(m) for m in ATTENTION_METHODS]
    ctx, out = ex.compute_batch(ex.encode(TEXTS), [(p, -1) for p in positions], specs, {})
    assert ctx.targets[:, 0].tolist() == positions
    for m, (scores, _) in out.items():
        assert torch.all(scores[~ctx.token_mask.bool()] == 0), m
    # another position explains another row: the explanation depends on the chosen token
    (other,) = ex.explain(TEXTS[0], ["rawatt"], target=1)
    assert not np.allclose(other.scores["rawatt"], batch[0].scores["rawatt"])


def test_targets_words_labels_and_display(tokenizer):
    ex = Explainer(token_model("bert"), tokenizer)
    (e,) = ex.explain("the movie was good", ["rawatt"], target=("Movie", "b-loc"))
    assert e.meta["position"] == 2 and e.meta["token"] == "movie" and e.target == LABELS.index("B-LOC")
    assert e.target_label == "B-LOC"
    assert len(e.meta["predicted_labels"]) == len(e.tokens) and set(e.meta["predicted_labels"]) <= set(LABELS)
    assert e.predicted_label == e.meta["predicted_labels"][2]
    assert len(e.probabilities) == len(LABELS) and abs(sum(e.probabilities) - 1) < 1e-5
    (same,) = ex.explain("the movie was good", ["rawatt"], target=(2, 3))
    np.testing.assert_array_equal(same.scores["rawatt"], e.scores["rawatt"])
    back = Explanation.from_dict(json.loads(json.dumps(e.to_dict())))
    assert back == e and back.meta["position"] == 2
    line = prediction_line(e)
    assert line.startswith("token 2 'movie': predicted") and "explaining B-LOC" in line
    page = explanations_html([e])
    assert page.count('class="tok answer"') == len(e.scores) and "(explained token)" in page
    assert "explained label of the outlined token" in page
    (number,) = ex.explain("the movie 2 was good", ["rawatt"], target="2")  # a number is a word, not a position
    assert number.meta["position"] == 3
    (multi,) = ex.explain("the movies loved it", ["rawatt"], target="loved")
    words = multi.to_words()
    assert multi.tokens[multi.meta["position"]] == "loved" and words.tokens[words.meta["position"]] == "loved"
    assert words.meta["token"] == "loved" and len(words.meta["predicted_labels"]) == len(words.tokens)
    movies = words.tokens.index("movies")  # its first token's label, as NER reads a word
    assert words.meta["predicted_labels"][movies] == multi.meta["predicted_labels"][multi.tokens.index("movie")]
    assert not e.is_qa
    with pytest.warns(UserWarning, match=r"input 0: the word 'The' occurs 2 times \(tokens 1, 4\); explaining the "
                                         r"first, token 1"):
        (twice,) = ex.explain("the movie was the best", ["rawatt"], target="The")
    assert twice.meta["position"] == 1


@pytest.mark.parametrize("target,message", [
    (None, "a token classifier explains one token's label: pass the token as target="),
    (9, "token position 9 is beyond input 0's 6 tokens"),
    (0, "token 0 of input 0 is the special token '[CLS]'"),
    (5, "token 5 of input 0 is the special token '[SEP]'"),
    ((2, "B-ORG"), "unknown label 'B-ORG'; the model's labels are: O, B-PER"),
    ((2, 7), "target 7 is out of range: the model has 5 classes"),
    ("film", "input 0 has no word 'film'; its words: the movie was good"),
    (-1, "the explained token is a position"),
    ([1, 2], "one per input (1 inputs)"),
])
def test_user_mistakes_are_one_line_errors(target, message, tokenizer):
    ex = Explainer(token_model("bert"), tokenizer)
    with pytest.raises(InputError, match=re.escape(message)):
        ex.explain("the movie was good", ["rawatt"], target=target)


def test_not_applicable_parts_are_clear(tokenizer):
    ex = Explainer(token_model("bert"), tokenizer)
    with pytest.raises(ModelError, match="predict_proba is for sequence classifiers; this is a token classifier"):
        ex.predict_proba([[CLS, 5, SEP]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every method applies to a BERT token classifier
        (e,) = ex.explain("the movie", "all", target=1, options={"integratedgradients": {"n_steps": 2}})
    assert {"valuezeroing", "attnlrp", "decompx"} <= set(e.scores)
    with torch.no_grad():  # DecompX's shares and bias term: the explained token's logit
        logit = ex.model(torch.tensor([e.input_ids])).logits[0, 1, e.target]
    assert abs(e.scores["decompx"].sum() + float(e.meta["decompx"]["bias"]) - float(logit)) < 1e-4
    with pytest.raises(InputError, match="contrast applies to sequence classifiers and language models, not to "
                                         "extractive QA spans or token classifiers"):
        ex.explain("the movie", "grads", target=1, contrast=0)


def test_model_unchanged(tokenizer):
    model = token_model("roberta")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Explainer(model, tokenizer).explain(TEXTS, "all", target=1, options={"integratedgradients": {"n_steps": 2}})
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not model.training


def test_from_pretrained_detects_the_task_and_cli_explains_a_token(tokenizer, tmp_path, capsys):
    model = token_model("bert")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ex = Explainer.from_pretrained(tmp_path)
    assert ex.head.task == "token"
    with pytest.raises(ModelError, match="load it with task='token'"):
        Explainer.from_pretrained(tmp_path, task="classification")
    out = tmp_path / "out.json"
    code = cli_main(["explain", "--model", str(tmp_path), "--methods", "rawatt,grads", "--token", "movie",
                     "--target", "I-PER", "--format", "json", "--out", str(out), "the movie was good"])
    assert code == 0
    (d,) = json.loads(out.read_text()) if out.read_text().lstrip().startswith("[") else [
        json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    assert d["meta"]["position"] == 2 and d["target"] == LABELS.index("I-PER") and d["meta"]["task"] == "token"
    assert cli_main(["explain", "--model", str(tmp_path), "--methods", "rawatt", "the movie"]) == 2
    assert "pass the explained token as --token" in capsys.readouterr().err


@pytest.mark.parametrize(("token", "position"), [("word:2024", 3), ("1", 1), ("movie", 2)])
def test_cli_token_reads_digits_as_a_position_and_word_prefix_as_a_word(tokenizer, tmp_path, token, position):
    model = token_model("bert")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    out = tmp_path / "out.json"
    code = cli_main(["explain", "--model", str(tmp_path), "--methods", "rawatt", "--token", token, "--format",
                     "json", "--out", str(out), "the movie 2024 was good"])
    assert code == 0
    (d,) = json.loads(out.read_text())
    assert d["meta"]["position"] == position


def test_cli_token_word_prefix_without_a_word_is_refused(tokenizer, tmp_path, capsys):
    model = token_model("bert")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert cli_main(["explain", "--model", str(tmp_path), "--methods", "rawatt", "--token", "word:", "the movie"]) == 2
    assert "names no word" in capsys.readouterr().err


def test_cli_token_refuses_a_negative_position(tokenizer, tmp_path, capsys):
    model = token_model("bert")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert cli_main(["explain", "--model", str(tmp_path), "--methods", "rawatt", "--token=-1", "the movie"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "--token -1: a position counts the tokens from 0 (use word:-1 for the word)")


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_grads_scores_no_key_a_causal_row_cannot_see(model_type, tokenizer):
    """Under causal masking row p attends to no later key: the attention entry there has a gradient (the value the
    row would read) but no effect the model can have, so Grads scores those tokens 0, and the others as the
    gradient at row p. AGrad and GAE multiply by the attention, 0 there."""
    model = token_model(model_type)
    model.config._attn_implementation = "eager"  # the reference's maps
    ex = Explainer(model, tokenizer)
    text, position = TEXTS[1], 4
    (e,) = ex.explain(text, ["grads", "agrad", "gae"], target=position)
    ref = reference(model, tokenizer, text, position, None)
    for m in ("grads", "agrad", "gae"):
        assert np.all(e.scores[m][position + 1:] == 0), m
        np.testing.assert_allclose(e.scores[m][: position + 1], ref[m][: position + 1], atol=1e-5, rtol=1e-4,
                                   err_msg=m)
    assert np.abs(ref["grads"][position + 1:]).max() > 1e-3  # the gradient there is not 0 by itself


@pytest.mark.parametrize("trim_offsets", [False, True])
def test_a_word_is_found_where_the_tokenizer_counts_the_space_before_it_in_its_offsets(trim_offsets):
    """A byte-level tokenizer that keeps offsets untrimmed (GPT-2's) spans " lives" for the token "Ġlives": the
    word is still "lives"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["john lives in paris , the capital of france ."] * 5, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]))
    tok.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    model = build_tiny("gpt2", vocab_size=len(fast), pad_token_id=fast.pad_token_id, bos_token_id=0,
                       eos_token_id=0, num_labels=len(LABELS), model_suffix="ForTokenClassification")
    ex = Explainer(model, fast)
    text = "john lives in paris"
    tokens = fast.convert_ids_to_tokens(fast(text)["input_ids"])
    for word in ("john", "lives", "in", "paris", "Paris"):
        (e,) = ex.explain(text, ["rawatt"], target=word)
        assert fast.convert_tokens_to_string([e.meta["token"]]).strip() == word.lower()
        assert tokens[e.meta["position"]] == e.meta["token"]
    with pytest.raises(InputError, match="has no word 'rome'; its words: john lives in paris$"):
        ex.explain(text, ["rawatt"], target="rome")
