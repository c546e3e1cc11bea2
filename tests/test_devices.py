"""Devices and dtypes: ``--device``/``--dtype`` and ``from_pretrained(device=, dtype=)``; CPU only (no test needs a
GPU: the CUDA and MPS cases check the refusals a machine without them gives)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from conftest import make_model

from attnlens import Explainer
from attnlens.cli import main
from attnlens.errors import InputError
from attnlens.models.loading import resolve_device, resolve_dtype

TEXTS = ["the movie was not very good", "i really loved this charming film !", "boring plot , bad actors"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def _cli_error(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # one line, no traceback
    return err


# ------------------------------------------------------------------ resolving
@pytest.mark.skipif(torch.cuda.is_available() or torch.backends.mps.is_available(), reason="a CPU-only machine")
def test_auto_picks_the_cpu_here():
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(" AUTO ") == torch.device("cpu")


def test_devices_and_dtypes_by_name():
    assert resolve_device(None) is None and resolve_dtype(None) is None
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    for names, dtype in ((("float32", "fp32"), torch.float32), (("bfloat16", "bf16", "BF16"), torch.bfloat16),
                         (("float16", "fp16", "half"), torch.float16)):
        for name in names:
            assert resolve_dtype(name) is dtype
        assert resolve_dtype(dtype) is dtype


@pytest.mark.parametrize("spec,message", [
    ("gpu", "--device 'gpu' is not a torch device (cpu, cuda, cuda:N, mps or auto)"),
    ("cuda:x", "--device 'cuda:x' is not a torch device"),
])
def test_unknown_device_is_one_line(spec, message):
    with pytest.raises(InputError) as info:
        resolve_device(spec, "--device")
    assert str(info.value).startswith(message)


@NO_CUDA
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_asked_without_cuda(spec):
    with pytest.raises(InputError, match=rf"^--device {spec}: no such CUDA device on this machine \(.+\); "
                                         "use cpu or auto$"):
        resolve_device(spec, "--device")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the refusal off a Mac")
def test_mps_asked_off_a_mac():
    with pytest.raises(InputError, match="this machine has no MPS device"):
        resolve_device("mps")


@pytest.mark.parametrize("spec", ["float64", "int8", torch.int64, "fp8"])
def test_unknown_dtype(spec):
    with pytest.raises(InputError, match="is not a dtype attnlens runs models in; choose float32, bfloat16 or float16"):
        resolve_dtype(spec)


# ------------------------------------------------------------------ from_pretrained
def test_from_pretrained_places_the_model(model_dir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explainer = Explainer.from_pretrained(model_dir, device="auto", dtype="bfloat16")
    assert explainer.device.type in ("cpu", "cuda", "mps")
    on_cpu = [str(w.message) for w in caught if "on the CPU" in str(w.message)]
    assert on_cpu == (["bfloat16 on the CPU: explaining may be far slower than in float32 (about 25x for minilm-sst2 "
                       "on attnlens' test machine); half precision is for GPUs"] if explainer.device.type == "cpu"
                      else [])
    assert not any("on the CPU" in str(w.message) for w in _caught(model_dir, "float32"))
    assert {p.dtype for p in explainer.model.parameters()} == {torch.bfloat16}
    exp = explainer.explain(TEXTS[0], methods="rawatt,grads")[0]
    assert all(s.dtype == np.float64 and np.isfinite(s).all() for s in exp.scores.values())


def _caught(model_dir: str, dtype: str) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Explainer.from_pretrained(model_dir, dtype=dtype)
    return caught


def test_from_pretrained_refuses_dtype_twice(model_dir):
    with pytest.raises(InputError, match="give the dtype once"):
        Explainer.from_pretrained(model_dir, dtype="bfloat16", torch_dtype=torch.float16)


@NO_CUDA
def test_from_pretrained_without_cuda_fails_before_loading(model_dir, monkeypatch):
    import attnlens.models.loading as loading

    monkeypatch.setattr(loading, "load_weights", lambda *a, **k: pytest.fail("loaded a model it cannot place"))
    with pytest.raises(InputError, match="no such CUDA device"):
        Explainer.from_pretrained(model_dir, device="cuda")


# ------------------------------------------------------------------ numerics
# Tolerance of a half-precision explanation, per method and input: max |s16 - s32| <= TOL * max |s32|. Measured on
# the tiny models here (bert, gpt2, bart; every method): bfloat16 (8-bit mantissa) differs by at most 0.12 of the
# scale (ALTI on BERT; 0.07 for most others), float16 (11-bit mantissa) by at most 0.02. Partial LRP in bfloat16
# (the z+ rule divides by sums of a few 3-digit terms) by 0.16 on BERT: 0.12 while the LRP pass's LayerNorm and
# softmax returned x * (y / x), which rounds the model's own bfloat16 values; now it returns them exactly.
# Occlusion, LIME and KernelSHAP score differences of two model outputs (the input and its perturbation), each
# rounded to bfloat16: about one unit in the last place of the logit (2^-7 of it), 0.154 of the scale on GPT-2.
TOL = {torch.bfloat16: 0.15, torch.float16: 0.03}
HALF_LRP_TOL = {torch.bfloat16: 0.2, torch.float16: 0.03}
HALF_PERTURBATION_TOL = {torch.bfloat16: 0.25, torch.float16: 0.03}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["bert", "gpt2", "bart"])
@pytest.mark.filterwarnings("ignore:skipping")  # LRP methods off BERT-like models
def test_half_precision_explanations_are_close_to_float32(family, dtype, tokenizer):
    ig = {"integratedgradients": {"n_steps": 16}}  # the same steps in both (an adaptive count may differ)
    full = Explainer(make_model(family), tokenizer).explain(TEXTS, methods="all", options=ig)
    half = Explainer(make_model(family).to(dtype), tokenizer).explain(TEXTS, methods="all", options=ig)
    for a, b in zip(full, half, strict=True):
        assert a.tokens == b.tokens and a.predicted == b.predicted and a.target == b.target
        assert np.allclose(a.probabilities, b.probabilities, atol=0.02)
        assert set(a.scores) == set(b.scores)
        for m in a.scores:
            assert b.scores[m].dtype == np.float64
            scale = np.abs(a.scores[m]).max()
            perturbation = m in ("occlusion", "lime", "kernelshap")
            tol = (HALF_LRP_TOL if m == "partiallrp" else HALF_PERTURBATION_TOL if perturbation else TOL)[dtype]
            assert np.abs(a.scores[m] - b.scores[m]).max() <= tol * scale, (family, m)
            assert (b.scores[m][~np.asarray(b.special)] != 0).any(), (family, m)  # not a zeroed-out result


def test_model_keeps_its_dtype_and_device(tokenizer):
    model = make_model("bert").to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    Explainer(model, tokenizer).explain(TEXTS, methods="all")
    after = model.state_dict()
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(after[k], v) for k, v in before.items())


# ------------------------------------------------------------------ command line
def test_explain_cli_device_and_dtype(model_dir, capsys):
    assert main(["explain", "--model", model_dir, "--methods", "rawatt,attcat", "--format", "json",
                 "--device", "cpu", "--dtype", "bfloat16", TEXTS[0]]) == 0
    half = json.loads(capsys.readouterr().out)[0]
    assert main(["explain", "--model", model_dir, "--methods", "rawatt,attcat", "--format", "json", TEXTS[0]]) == 0
    full = json.loads(capsys.readouterr().out)[0]
    for m in ("rawatt", "attcat"):
        a, b = np.array(full["scores"][m]), np.array(half["scores"][m])
        assert np.abs(a - b).max() <= TOL[torch.bfloat16] * np.abs(a).max()
        assert not np.array_equal(a, b)  # it did run in bfloat16


@pytest.mark.parametrize("command", ["explain", "benchmark"])
def test_cli_refuses_bad_device_and_dtype(command, model_dir, tmp_path, capsys):
    base = ["explain", "--model", model_dir, "good movie"] if command == "explain" else [
        "benchmark", "--model", model_dir, "--dataset", "sst2", "--out", str(tmp_path / "out")]
    assert "--device 'tpu' is not a torch device" in _cli_error([*base, "--device", "tpu"], capsys)
    if not torch.cuda.is_available():
        line = _cli_error([*base, "--device", "cuda:1"], capsys)
        assert line.startswith("attnlens: error: --device cuda:1: no such CUDA device on this machine")
    assert main([*base, "--dtype", "float64"]) == 2  # argparse choices: one usage line
    assert "invalid choice: 'float64'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_train_accepts_auto(model_dir, tmp_path):
    from attnlens.train import TrainConfig

    TrainConfig(model=model_dir, out=str(tmp_path / "o"), dataset="sst2", device="auto").validate()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_train_in_mixed_precision(dtype, model_dir, tmp_path):
    """--dtype trains under autocast (float16 with loss scaling): the loss falls and the weights stay float32."""
    from attnlens.train import TrainConfig, train

    rows = [{"text": f"{w} movie", "label": int(w in ("good", "great", "best"))}
            for w in ("good", "bad", "great", "awful", "best", "worst", "boring", "dull") * 6]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    metrics = train(TrainConfig(model=model_dir, out=str(out), data_file=str(data), epochs=8, lr=5e-3, batch_size=8,
                                max_length=8, progress=False, dtype=dtype, device="cpu"), log=lambda _: None)
    assert metrics["loss"]["last_10"] < 0.5 * metrics["loss"]["first_10"]
    saved = Explainer.from_pretrained(out)
    assert {p.dtype for p in saved.model.parameters()} == {torch.float32}
    with pytest.raises(InputError, match="--dtype int8 is not a dtype"):
        TrainConfig(model=model_dir, out=str(out), data_file=str(data), dtype="int8").validate()
