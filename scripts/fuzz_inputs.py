"""Fuzz attnlens with bad and unusual inputs through the real CLI and the Python API, and count the outcomes.

Every case says what must happen:

- ``error``: the CLI exits 2 and its last stderr line is the one ``attnlens: error: ...`` line (or argparse's
  ``attnlens CMD: error: ...``); the API raises an :class:`attnlens.errors.AttnLensError` subclass with a one-line
  message (for file paths ``FileNotFoundError``/``IsADirectoryError`` too, as the CLI does);
- ``ok``: exit 0 / a return value, and an oracle checks that the result is right (the model's probabilities equal a
  direct call, the explained target is the one asked, padding scores 0, output files load back, ...);
- ``either``: a clear error, or a result the oracle accepts.

Each run is classified as ``clear-error``, ``correct``, ``traceback``, ``silent-wrong`` or ``other`` (a refusal of a
valid input, a timeout, an exit code that is neither 0 nor 2, an error message that is not one line).

How it runs: the parent process imports torch, transformers and attnlens once and never computes; every case
runs in a forked child (``attnlens.cli.main(argv)`` exactly as ``python -m attnlens.cli`` runs it, or an API
call), with a timeout. A few cases also start the real ``python -m attnlens.cli`` as a subprocess. Cases run one
at a time (the machine may have 2 cores). Tiny random models of every family are built once into a temporary
folder; the reference models of ``../shared/models`` are used where a case needs a real one. Cases of unreadable
files are skipped when run as root (root reads them anyway); cases of a missing reference model are skipped.

Usage::

    PYTHONPATH=src python scripts/fuzz_inputs.py [--quick] [--json PATH] [-k SUBSTRING] [--list]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import inspect
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["HF_HUB_OFFLINE"] = "1"  # a hub id must fail fast, not wait for the network
os.environ["TRANSFORMERS_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MODELS = SHARED / "models"
SRC = Path(os.environ.get("ATTNLENS_FUZZ_SRC", REPO / "src"))  # another checkout's src/ to measure it
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(REPO / "tests"))  # conftest: make_model, make_tokenizer

CLASSES = ("correct", "clear-error", "traceback", "silent-wrong", "other")
ERROR_LINE = re.compile(r"^attnlens( [a-z]+)?: error: ")
Oracle = Callable[..., "str | None"]  # returns None when the result is right, else what is wrong


@dataclass
class Case:
    """One input and the outcome it must have."""

    id: str
    kind: str  # "cli" (forked attnlens.cli.main), "sub" (real subprocess), "api" (in a forked child)
    expect: str  # "error", "ok", "either" (or "traceback": only for --debug)
    argv: list[str] | None = None
    fn: Callable[[Env], Any] | None = None
    oracle: Oracle | None = None
    owner: str = "fuzz"  # the helper slice that owns a failure: load, lrp, qa, bench, viz, cli, fuzz
    quick: bool = False
    timeout: float = 120.0
    pre: list[list[str]] = field(default_factory=list)  # CLI runs before the checked one (results ignored)
    needs: tuple[str, ...] = ()  # paths of env that must exist (e.g. reference models)
    expect_in: str | None = None  # a word the error message must contain


@dataclass
class Env:
    """Paths of the tiny models and files built once; ``tmp`` is a fresh folder per case."""

    root: Path
    tmp: Path = Path()

    def fmt(self, s: str) -> str:
        """``s`` with ``{name}`` placeholders of :meth:`paths` filled in (other braces are left alone)."""
        paths = self.paths()
        return re.sub(r"\{([A-Za-z0-9_.]+)\}", lambda m: paths.get(m.group(1), m.group(0)), s)

    def paths(self) -> dict[str, str]:
        r = self.root
        d = {name: str(r / "models" / name) for name in TINY_MODELS}
        d.update({name: str(r / "data" / name) for name in DATA_FILES})
        d.update(
            tmp=str(self.tmp), root=str(r), afile=str(r / "data" / "afile.txt"),
            under_file=str(r / "data" / "afile.txt" / "x"), adir=str(r / "data" / "adir"),
            results=str(r / "results" / "bert"), minilm=str(MODELS / "minilm-sst2"),
            imdbref=str(MODELS / "minilm-imdb"), gpt2ref=str(MODELS / "gpt2-scratch-sst2"),
            bartref=str(MODELS / "bart-scratch-sst2"), shared_data=str(SHARED / "data"),
        )
        return d

    def __getitem__(self, key: str) -> str:
        return self.paths()[key]


# --------------------------------------------------------------------------------------------- fixtures
TINY_MODELS = [
    "bert", "distilbert", "roberta", "albert", "electra", "gpt2", "gpt2nopad", "llama", "bart", "bartquirk", "bert3",
    "qa", "evillabels", "bigvocab",
    "multilabel", "basemodel", "mlm", "lmhead", "notok", "corrupt", "emptyst", "configonly", "emptydir",
]
GOOD = ["the movie was very good", "i really didn ' t like this film", "a charming journey", "boring plot !"]
DATA_FILES = [
    "sst.jsonl", "labels7.jsonl", "pairs.jsonl", "three.jsonl", "oneclass.jsonl", "strlabel.jsonl", "nolabel.jsonl",
    "notext.jsonl", "numtext.jsonl", "emptytext.jsonl", "badjson.jsonl", "empty.txt", "blank.txt", "binary.bin",
    "latin1.txt", "hugeline.txt", "nul.txt", "nulltext.jsonl", "nulllabel.jsonl",
    "floatlabel.jsonl", "texts.txt", "crlf.txt", "bom.txt", "brace.txt", "pairs_in.jsonl",
    "squad.json", "squad_bad.json", "sst.jsonl.gz", "bad.jsonl.gz", "big.txt", "unreadable.txt",
]


def build_fixtures(root: Path) -> None:
    """Tiny models and data files (runs in a child: the parent never computes)."""
    import torch
    from conftest import make_model, make_tokenizer
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertModel,
        GPT2Config,
        GPT2LMHeadModel,
    )

    tok = make_tokenizer()
    models = root / "models"

    def save(name: str, model: torch.nn.Module, with_tok: bool = True) -> Path:
        path = models / name
        model.save_pretrained(path)
        if with_tok:
            tok.save_pretrained(path)
        return path

    for fam in ["bert", "distilbert", "roberta", "albert", "electra", "gpt2", "llama", "bart"]:
        model = make_model(fam)
        if fam == "bart":  # without explicit labels, transformers reloads a 2-label BART config with 3 labels
            save("bartquirk", make_model(fam))
            model.config.id2label, model.config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
        save(fam, model)
    nopad = make_model("gpt2")
    nopad.config.pad_token_id = None
    save("gpt2nopad", nopad)
    save("bert3", make_model("bert", num_labels=3))
    bert_cfg = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                    max_position_embeddings=64, initializer_range=0.3, pad_token_id=0)
    torch.manual_seed(0)
    save("qa", BertForQuestionAnswering(BertConfig(**bert_cfg)))
    save("multilabel", BertForSequenceClassification(BertConfig(
        **bert_cfg, num_labels=3, problem_type="multi_label_classification",
        id2label={0: "joy", 1: "anger", 2: "fear"}, label2id={"joy": 0, "anger": 1, "fear": 2})))
    save("basemodel", BertModel(BertConfig(**bert_cfg)))
    save("mlm", BertForMaskedLM(BertConfig(**bert_cfg)))
    save("lmhead", GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=64)))
    save("notok", make_model("bert"), with_tok=False)
    evil = make_model("bert")  # label names that would drive the terminal
    evil.config.id2label = {0: "neg\x1b]0;pwned\x07", 1: "pos\x1b[2J"}
    evil.config.label2id = {v: k for k, v in evil.config.id2label.items()}
    save("evillabels", evil)
    torch.manual_seed(0)
    save("bigvocab", BertForSequenceClassification(BertConfig(**{**bert_cfg, "vocab_size": 5000})))
    for name in ("corrupt", "emptyst"):
        path = save(name, make_model("bert"))
        (path / "model.safetensors").write_bytes(b"" if name == "emptyst" else b"\x00garbage" * 100)
    cfg_only = models / "configonly"
    cfg_only.mkdir(parents=True)
    (cfg_only / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (models / "emptydir").mkdir()
    (models / "evil\x1b]0;pwned\x07name").symlink_to(models / "bert")

    data = root / "data"
    data.mkdir()

    def jsonl(name: str, rows: list[Any]) -> None:
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    jsonl("sst.jsonl", [{"text": t, "label": i % 2} for i, t in enumerate(GOOD + ["great story", "dull actors"])])
    jsonl("labels7.jsonl", [{"text": t, "label": 7 if i == 1 else i % 2} for i, t in enumerate(GOOD)])
    jsonl("pairs.jsonl", [{"text_a": t, "text_b": GOOD[-1 - i], "label": i % 3} for i, t in enumerate(GOOD)])
    jsonl("three.jsonl", [{"text": t, "label": i % 3} for i, t in enumerate(GOOD * 2)])
    jsonl("oneclass.jsonl", [{"text": t, "label": 1} for t in GOOD * 2])
    jsonl("strlabel.jsonl", [{"text": t, "label": "x"} for t in GOOD])
    jsonl("nolabel.jsonl", [{"text": t} for t in GOOD])
    jsonl("notext.jsonl", [{"label": 1}, {"label": 0}])
    jsonl("numtext.jsonl", [{"text": 5, "label": 1}])
    jsonl("nulltext.jsonl", [{"text": t, "label": i % 2} for i, t in enumerate(GOOD)] + [{"text": None, "label": 1}])
    jsonl("nulllabel.jsonl", [{"text": t, "label": i % 2} for i, t in enumerate(GOOD * 2)]
          + [{"text": "x", "label": None}])
    jsonl("floatlabel.jsonl", [{"text": t, "label": 0.7 + i % 2} for i, t in enumerate(GOOD)])
    jsonl("emptytext.jsonl", [{"text": "", "label": 1}, {"text": "good", "label": 1}])
    (data / "badjson.jsonl").write_text('{"text": "good", "label": 1}\n{"text": oops\n', encoding="utf-8")
    (data / "empty.txt").write_bytes(b"")
    (data / "blank.txt").write_text("\n   \n\t\n", encoding="utf-8")
    (data / "binary.bin").write_bytes(bytes(range(256)) * 8)
    (data / "latin1.txt").write_bytes("caf\xe9 tr\xe8s bon\n".encode("latin-1"))
    (data / "hugeline.txt").write_text("good movie " * 40_000 + "\n", encoding="utf-8")
    (data / "nul.txt").write_text("good\x00movie\n", encoding="utf-8")
    (data / "texts.txt").write_text("\n".join(GOOD) + "\n", encoding="utf-8")
    (data / "crlf.txt").write_bytes(("\r\n".join(GOOD) + "\r\n").encode())
    (data / "bom.txt").write_text("\ufeffgood movie\nbad film\n", encoding="utf-8")
    (data / "brace.txt").write_text("{ a good movie } said nobody\nbad film\n", encoding="utf-8")
    jsonl("pairs_in.jsonl", [{"text_a": "good movie", "text_b": "bad film"}, {"text": "a charming journey"}])
    ctx = "the movie was very good and the plot was great"
    squad = {"data": [{"title": "t", "paragraphs": [{"context": ctx, "qas": [
        {"id": str(i), "question": q, "answers": [{"text": "very good", "answer_start": ctx.index("very good")}]}
        for i, q in enumerate(["was the movie good", "how was the plot", "the movie was"])]}]}]}
    (data / "squad.json").write_text(json.dumps(squad), encoding="utf-8")
    (data / "squad_bad.json").write_text(json.dumps({"data": [{"nothing": 1}]}), encoding="utf-8")
    with gzip.open(data / "sst.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write((data / "sst.jsonl").read_text(encoding="utf-8"))
    (data / "bad.jsonl.gz").write_bytes(b"not gzip at all\n")
    (data / "big.txt").write_text("\n".join(GOOD * 30) + "\n", encoding="utf-8")
    (data / "afile.txt").write_text("a plain file\n", encoding="utf-8")
    (data / "adir").mkdir()
    (data / "unreadable.txt").write_text("good movie\n", encoding="utf-8")
    (data / "unreadable.txt").chmod(0)  # still readable for root: those cases are skipped then

    # a finished benchmark run for the report cases
    from attnlens.cli import main

    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(devnull):
        rc = main(["benchmark", "--model", str(models / "bert"), "--dataset", str(data / "sst.jsonl"),
                   "--methods", "rawatt,attcat", "--metrics", "aopc,lodds", "--occlusion-max", "4", "--quiet",
                   "--out", str(root / "results" / "bert")])
    if rc != 0:
        raise RuntimeError("fixture benchmark failed")


# ----------------------------------------------------------------------------------------------- oracles
def _direct_probs(model_dir: str, exp: Any) -> list[float] | None:
    """The model's own probabilities for the explanation's input ids (an independent forward pass)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_dir)
    if any(a.endswith("ForQuestionAnswering") for a in config.architectures or []):
        return None
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    inputs = {"input_ids": torch.tensor([exp.input_ids])}
    if exp.token_type_ids is not None and "token_type_ids" in inspect.signature(model.forward).parameters:
        inputs["token_type_ids"] = torch.tensor([exp.token_type_ids])
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    if getattr(config, "problem_type", None) == "multi_label_classification":
        return logits.sigmoid().tolist()
    return logits.softmax(-1).tolist()


def check_exps(exps: list[Any], model_dir: str | None = None, target: Any = None, n: int | None = None,
               max_unk: float = 0.5, max_tokens: int | None = None) -> str | None:
    """Common checks of explanations: shapes, finiteness, target, probabilities equal a direct model call."""
    if n is not None and len(exps) != n:
        return f"{len(exps)} explanations for {n} inputs"
    for i, e in enumerate(exps):
        if not e.scores:
            return f"explanation {i} has no method scores"
        for m, s in e.scores.items():
            if len(s) != len(e.tokens):
                return f"{m}: {len(s)} scores for {len(e.tokens)} tokens"
            if not all(math.isfinite(float(x)) for x in s):
                return f"{m}: non-finite scores"
            # GlobEnc's default is the authors' plain product of unnormalised norms: large by design
            if m != "globenc" and any(abs(float(x)) > 1e4 for x in s):
                return f"{m}: scores of magnitude {max(abs(float(x)) for x in s):.3g}"
        if target is not None and e.target != target:
            return f"explained target {e.target}, asked {target}"
        if isinstance(e.target, list) and len(e.target) == 2 and e.target[1] < e.target[0]:
            return f"QA span {e.target} ends before it starts"
        if e.tokens and max_unk < 1:
            unk = sum(t == "[UNK]" for t in e.tokens) / len(e.tokens)
            if unk > max_unk:
                return f"{unk:.0%} of the tokens are [UNK]"
        if max_tokens is not None and len(e.tokens) > max_tokens:
            return f"{len(e.tokens)} tokens, more than {max_tokens}"
        if model_dir is not None and e.input_ids:
            probs = _direct_probs(model_dir, e)
            if probs is not None:
                diff = max(abs(a - b) for a, b in zip(probs, e.probabilities, strict=False))
                if len(probs) != len(e.probabilities) or diff > 1e-4:
                    return f"probabilities {e.probabilities} differ from the model's own {probs}"
    return None


def out_file(name: str, model: str | None = "bert", **kw: Any) -> Oracle:
    """Oracle: the output file ``tmp/name`` loads back with load_explanations and passes check_exps."""

    def oracle(run: Run, env: Env) -> str | None:
        from attnlens import load_explanations

        path = env.tmp / name
        if not path.is_file():
            return f"{name} was not written"
        try:
            exps = load_explanations(path)
        except Exception as exc:  # noqa: BLE001 - any failure to load back is the finding
            return f"{name} does not load back: {type(exc).__name__}: {str(exc)[:100]}"
        return check_exps(exps, env[model] if model else None, **kw)

    return oracle


def json_stdout(model: str | None = "bert", **kw: Any) -> Oracle:
    """Oracle: stdout is JSON (a list) or JSON Lines of explanations that pass check_exps."""

    def oracle(run: Run, env: Env) -> str | None:
        from attnlens import Explanation

        text = run.stdout.strip()
        try:
            rows = json.loads(text) if text.startswith("[") else [json.loads(x) for x in text.splitlines() if x]
            exps = [Explanation.from_dict(r) for r in rows]
        except Exception as exc:  # noqa: BLE001
            return f"stdout is not JSON explanations: {type(exc).__name__}: {str(exc)[:100]}"
        return check_exps(exps, env[model] if model else None, **kw)

    return oracle


def stdout_has(*needles: str, absent: tuple[str, ...] = ()) -> Oracle:
    def oracle(run: Run, env: Env) -> str | None:
        for s in needles:
            if s not in run.stdout:
                return f"stdout lacks {s!r}"
        for s in absent:
            if s in run.stdout:
                return f"stdout contains {s!r}"
        return None

    return oracle


def files_exist(*names: str, min_bytes: int = 1) -> Oracle:
    def oracle(run: Run, env: Env) -> str | None:
        for name in names:
            p = Path(env.fmt(name))
            if not p.is_file() or p.stat().st_size < min_bytes:
                return f"{p.name} was not written"
        return None

    return oracle


def all_of(*oracles: Oracle) -> Oracle:
    def oracle(run: Run, env: Env) -> str | None:
        for o in oracles:
            bad = o(run, env)
            if bad:
                return bad
        return None

    return oracle


def summary_ok(n: int | None = None, methods: tuple[str, ...] = ()) -> Oracle:
    """Oracle: the benchmark wrote summary.json with n examples and finite results for every method."""

    def oracle(run: Run, env: Env) -> str | None:
        path = env.tmp / "out" / "summary.json"
        if not path.is_file():
            return "no summary.json"
        s = json.loads(path.read_text())
        if n is not None and s.get("n_examples") != n:
            return f"summary says {s.get('n_examples')} examples, expected {n}"
        lines = (env.tmp / "out" / "examples.jsonl").read_text().splitlines()
        indices = {json.loads(line)["index"] for line in lines if line.strip()}
        if n is not None and len(indices) != n:
            return f"examples.jsonl has {len(indices)} examples, expected {n}"
        for m in methods:
            if m not in json.dumps(s.get("results", s)):
                return f"no results for {m}"
        return None

    return oracle


def trained_ok(num_labels: int = 2) -> Oracle:
    def oracle(run: Run, env: Env) -> str | None:
        import torch
        from transformers import AutoModelForSequenceClassification

        out = env.tmp / "out"
        if not (out / "metrics.json").is_file():
            return "no metrics.json"
        metrics = json.loads((out / "metrics.json").read_text())
        model = AutoModelForSequenceClassification.from_pretrained(out)
        if model.config.num_labels != num_labels:
            return f"saved model has {model.config.num_labels} labels, expected {num_labels}"
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            return "saved weights are not finite"
        if not any(isinstance(v, float) and math.isfinite(v) for v in _flat(metrics)):
            return "metrics.json has no finite metric"
        return None

    return oracle


def _flat(d: Any) -> list[Any]:
    if isinstance(d, dict):
        return [x for v in d.values() for x in _flat(v)]
    if isinstance(d, list):
        return [x for v in d for x in _flat(v)]
    return [d]


NO_ESCAPES = ("\x1b]", "\x1b[2J", "\x07", "\x1bc")


def clean_terminal(run: Run, env: Env) -> str | None:
    """Oracle: no escape sequence from the input reaches the terminal (colour codes of the renderer are fine)."""
    for s in NO_ESCAPES:
        if s in run.stdout or s in run.stderr:
            return f"raw control sequence {s!r} printed"
    return None


# ----------------------------------------------------------------------------------------------- running
@dataclass
class Run:
    rc: int | None
    stdout: str
    stderr: str


@dataclass
class Result:
    id: str
    kind: str
    owner: str
    expect: str
    outcome: str
    detail: str
    seconds: float


def _child_cli(argv: list[str], out_path: Path, err_path: Path) -> None:
    """In a forked child: run attnlens.cli.main like ``python -m attnlens.cli`` would, then exit with its code."""
    fd_out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    fd_err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd_out, 1)
    os.dup2(fd_err, 2)
    sys.stdout = open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.argv = ["attnlens", *argv]
    rc = 1
    try:
        from attnlens.cli import main

        rc = main(argv)
    except SystemExit as exc:
        code = exc.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
        rc = code if isinstance(code, int) else (0 if code is None else 1)
    except BaseException:  # noqa: BLE001 - exactly what the interpreter would print
        traceback.print_exc()
        rc = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(int(rc) & 0xFF)


def _fork(target: Callable[[], None], timeout: float) -> tuple[int | None, bool]:
    """Run ``target`` in a forked child; (exit code, timed out)."""
    pid = os.fork()
    if pid == 0:
        try:
            target()
        finally:
            os._exit(99)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return (os.waitstatus_to_exitcode(status), False)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return (None, True)
        time.sleep(0.02)


def classify_cli(case: Case, run: Run | None, env: Env, timed_out: bool) -> tuple[str, str]:
    if timed_out or run is None:
        return "other", f"timed out after {case.timeout:.0f} s"
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    if "Traceback (most recent call last)" in run.stderr:
        last = lines[-1] if lines else ""
        if case.expect == "traceback":  # --debug must keep it
            return "correct", ""
        return "traceback", last[:200]
    if case.expect == "traceback":
        return "other", f"exit {run.rc} without the traceback --debug asks for"
    if run.rc == 2:
        errors = [x for x in lines if ERROR_LINE.match(x)]
        if len(errors) != 1 or lines[-1] != errors[0]:
            return "other", f"exit 2 without one final error line: {' | '.join(lines[-3:])[:200]}"
        msg = errors[0]
        if case.expect == "ok":
            return "other", f"refused a valid input: {msg[:200]}"
        if case.expect_in and case.expect_in.lower() not in msg.lower():
            return "other", f"error does not mention {case.expect_in!r}: {msg[:200]}"
        return "clear-error", msg[:200]
    if run.rc == 0:
        if case.expect == "error":
            return "silent-wrong", f"exit 0 on a bad input; stdout: {run.stdout.strip()[-120:]!r}"
        return "oracle", ""
    return "other", f"exit {run.rc}: {' | '.join(lines[-2:])[:200]}"


def run_cli_case(case: Case, env: Env, workdir: Path) -> tuple[str, str]:
    for pre in case.pre:
        argv = [env.fmt(a) for a in pre]
        _fork(lambda argv=argv: _child_cli(argv, workdir / "pre.out", workdir / "pre.err"), case.timeout)
    argv = [env.fmt(a) for a in case.argv or []]
    out_path, err_path = workdir / "stdout", workdir / "stderr"
    if case.kind == "sub":
        try:
            proc = subprocess.run([sys.executable, "-m", "attnlens.cli", *argv], capture_output=True, text=True,
                                  errors="backslashreplace", timeout=case.timeout, cwd=REPO,
                                  env={**os.environ, "PYTHONPATH": str(SRC)})
            run, timed_out = Run(proc.returncode, proc.stdout, proc.stderr), False
        except subprocess.TimeoutExpired:
            run, timed_out = None, True
    else:
        rc, timed_out = _fork(lambda: _child_cli(argv, out_path, err_path), case.timeout)
        read = lambda p: p.read_text(encoding="utf-8", errors="backslashreplace") if p.exists() else ""  # noqa: E731
        run = None if timed_out else Run(rc, read(out_path), read(err_path))
    outcome, detail = classify_cli(case, run, env, timed_out)
    if outcome != "oracle":
        return outcome, detail
    if case.oracle is None:
        return "correct", ""
    return _in_child(lambda: case.oracle(run, env), case.timeout, oracle=True)


def run_api_case(case: Case, env: Env) -> tuple[str, str]:
    def body() -> tuple[str, str]:
        from attnlens.errors import AttnLensError

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                value = case.fn(env)
            except (AttnLensError, FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
                msg = f"{type(exc).__name__}: {exc}"
                if "\n" in str(exc).strip():
                    return "other", f"multi-line error: {msg[:200]}"
                if case.expect == "ok":
                    return "other", f"refused a valid input: {msg[:200]}"
                if case.expect_in and case.expect_in.lower() not in str(exc).lower():
                    return "other", f"error does not mention {case.expect_in!r}: {msg[:200]}"
                return "clear-error", msg[:200]
            except Exception as exc:  # noqa: BLE001 - the finding
                tb = traceback.extract_tb(exc.__traceback__)[-1]
                return "traceback", f"{type(exc).__name__}: {str(exc)[:150]} ({Path(tb.filename).name}:{tb.lineno})"
        if case.expect == "error":
            return "silent-wrong", f"returned {str(value)[:120]!r} on a bad input"
        bad = case.oracle(value, env) if case.oracle else None
        return ("silent-wrong", bad) if bad else ("correct", "")

    return _in_child(body, case.timeout)


def _in_child(body: Callable[[], Any], timeout: float, oracle: bool = False) -> tuple[str, str]:
    """Run ``body`` (an API case, or an oracle returning None/str) in a forked child; its verdict comes back."""
    fd, name = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    path = Path(name)

    def target() -> None:
        try:
            verdict = body()
            if oracle:
                verdict = ("silent-wrong", verdict) if verdict else ("correct", "")
        except Exception as exc:  # noqa: BLE001
            verdict = ("other", f"{'oracle' if oracle else 'harness'} failed: {type(exc).__name__}: {exc}"[:200])
        path.write_text(json.dumps(list(verdict)))
        os._exit(0)

    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(devnull, 1)  # the child's prints (progress bars, shows) must not reach the table
    os.dup2(devnull, 2)
    try:
        _, timed_out = _fork(target, timeout)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(devnull)
        os.close(saved[0])
        os.close(saved[1])
    try:
        if timed_out:
            return "other", f"timed out after {timeout:.0f} s"
        text = path.read_text()
        return tuple(json.loads(text)) if text else ("other", "child died without a verdict")  # type: ignore
    finally:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------- cases
def cli(id: str, argv: list[str], expect: str, oracle: Oracle | None = None, **kw: Any) -> Case:
    return Case(id=id, kind="cli", expect=expect, argv=argv, oracle=oracle, **kw)


def api(id: str, fn: Callable[[Env], Any], expect: str, oracle: Oracle | None = None, **kw: Any) -> Case:
    return Case(id=id, kind="api", expect=expect, fn=fn, oracle=oracle, **kw)


X = ["explain", "--model", "{bert}", "--methods", "rawatt,attcat"]  # fast explain on the tiny BERT
XJ = [*X, "--format", "jsonl", "--out", "{tmp}/o.jsonl"]
B = ["benchmark", "--model", "{bert}", "--dataset", "{sst.jsonl}", "--methods", "rawatt", "--metrics", "aopc",
     "--occlusion-max", "4", "--quiet", "--out", "{tmp}/out"]
T = ["train", "--model", "{bert}", "--data-file", "{three.jsonl}", "--limit", "6", "--eval-limit", "3",
     "--max-length", "16", "--batch-size", "4", "--no-progress", "--reinit-head", "--out", "{tmp}/out"]
TD = ["train", "--model", "{bert}", "--data-file", "{sst.jsonl}", "--max-length", "16", "--batch-size", "4",
      "--no-progress"]  # + --out


def explain_cases() -> list[Case]:
    c: list[Case] = []
    ok_file = out_file("o.jsonl")
    # ---- texts
    for name, text in [("empty", ""), ("spaces", "   "), ("tab-newline", "\t\n")]:
        c.append(cli(f"explain/text-{name}", [*X, text], "error", quick=name == "empty"))
    for name, text, kw in [
        ("emoji", "😀😀 good movie 🎬", {}), ("rtl", "שלום good עולם movie", {"max_unk": 0.6}),
        ("newline-inside", "good\nmovie", {}), ("punctuation", "!!! ,,, ...", {}), ("numbers", "1234 5678", {}),
        ("long-word", "a" * 5000, {"max_unk": 1}), ("combining", "goode\u0301 movie", {}),
        ("dash-text", "-good", {}), ("zero-width", "good\u200b\u200bmovie", {}),
        ("special-strings", "[CLS] [SEP]", {"max_unk": 1}), ("pad-string", "good [PAD] [PAD] movie", {}),
        ("mask-string", "good [MASK] movie", {}), ("surrogate", "good \udcff movie", {"max_unk": 1}),
        ("nbsp", "good\u00a0movie", {}), ("fullwidth", "ｇｏｏｄ movie", {"max_unk": 1}),
    ]:
        c.append(cli(f"explain/text-{name}", [*XJ, "--", text], "either", out_file("o.jsonl", n=1, **kw),
                     quick=name in ("emoji", "special-strings")))
    c.append(cli("explain/text-only-zero-width", [*XJ, "\u200b\u200b"], "either", ok_file))
    c.append(cli("explain/text-control-chars-terminal", [*X, "\x1b[2J\x1b]0;pwned\x07 good movie \x1bc"], "ok",
                 clean_terminal, owner="viz", quick=True))
    c.append(cli("explain/text-control-chars-html", [*X, "--format", "html", "--out", "{tmp}/o.html",
                                                       "<script>alert(1)</script> good"], "ok",
                 lambda r, e: "unescaped <script>" if "<script>alert" in (e.tmp / "o.html").read_text() else None,
                 owner="viz"))
    c.append(cli("explain/text-10k-tokens", [*XJ, "good " * 10_000], "ok", out_file("o.jsonl", max_tokens=48),
                 quick=True))
    c.append(cli("explain/text-10k-no-truncation", [*X, "--no-truncation", "good " * 10_000], "error"))
    c.append(cli("explain/text-10k-minilm", ["explain", "--model", "{minilm}", "--methods", "attcat", "--format",
                                             "jsonl", "--out", "{tmp}/o.jsonl", "good " * 10_000], "ok",
                 out_file("o.jsonl", "minilm", max_tokens=512), needs=("minilm",)))
    c.append(cli("explain/many-texts-batch7", [*XJ, "--batch-size", "7", *(GOOD * 10)], "ok",
                 out_file("o.jsonl", n=40)))
    c.append(cli("explain/no-texts", [*X], "error", quick=True))
    c.append(cli("explain/no-args-at-all", [], "error"))
    c.append(cli("explain/unknown-command", ["explian", "good"], "error"))
    # ---- methods
    for name, m, exp in [("empty", "", "error"), ("comma", ",", "error"), ("unknown", "bogus", "error"),
                         ("one-unknown", "rawatt,bogus", "error"), ("upper", "RAWATT", "either"),
                         ("dup", "rawatt,rawatt", "ok"), ("spaces", " rawatt , attcat ", "ok"),
                         ("all-plus", "all,rawatt", "ok")]:
        c.append(cli(f"explain/methods-{name}", ["explain", "--model", "{bert}", "--methods", m, "--format", "jsonl",
                                                 "--out", "{tmp}/o.jsonl", "good movie"], exp,
                     ok_file if exp != "error" else None, quick=name in ("empty", "unknown")))
    # ---- targets
    for name, t, exp, kw in [("5", "5", "error", {}), ("-1", "-1", "error", {}), ("2", "2", "error", {}),
                             ("label-unknown", "nosuchlabel", "error", {}), ("float", "1.5", "error", {}),
                             ("empty", "", "error", {}), ("1", "1", "ok", {"target": 1}),
                             ("label-name", "LABEL_1", "ok", {"target": 1}), ("huge", "9" * 30, "error", {})]:
        c.append(cli(f"explain/target-{name}", [*XJ, "--target", t, "good movie"], exp,
                     out_file("o.jsonl", **kw) if exp != "error" else None, quick=name == "5"))
    c.append(cli("explain/target-name-minilm", ["explain", "--model", "{minilm}", "--methods", "attcat",
                                                "--target", "negative", "--format", "jsonl", "--out", "{tmp}/o.jsonl",
                                                "a great movie"], "ok", out_file("o.jsonl", "minilm", target=0),
                 needs=("minilm",)))
    c.append(cli("explain/target-kind-loss-no-target", [*X, "--target-kind", "loss", "good"], "error"))
    c.append(cli("explain/target-kind-loss", [*XJ, "--target-kind", "loss", "--target", "0", "good"], "ok",
                 out_file("o.jsonl", target=0)))
    c.append(cli("explain/target-kind-bogus", [*X, "--target-kind", "bogus", "good"], "error"))
    # ---- attention streams
    c.append(cli("explain/attention-cross-on-bert", [*X, "--attention", "cross", "good"], "error"))
    c.append(cli("explain/attention-bogus", ["explain", "--model", "{bart}", "--methods", "rawatt", "--attention",
                                             "bogus", "good"], "error"))
    for stream in ("encoder", "decoder", "cross"):
        c.append(cli(f"explain/bart-{stream}-all-methods", ["explain", "--model", "{bart}", "--attention", stream,
                                                            "--format", "jsonl", "--out", "{tmp}/o.jsonl",
                                                            "good movie"],
                     "ok", out_file("o.jsonl", "bart"), owner="cli", quick=stream == "cross"))
    # ---- formats and outputs
    c.append(cli("explain/format-bogus", [*X, "--format", "xml", "good"], "error"))
    c.append(cli("explain/format-json-out-loads", [*X, "--format", "json", "--out", "{tmp}/o.json", "good", "bad"],
                 "ok", out_file("o.json", n=2), owner="cli", quick=True))
    c.append(cli("explain/format-json-stdout", [*X, "--format", "json", "good", "bad"], "ok", json_stdout(n=2)))
    c.append(cli("explain/format-jsonl-stdout", [*X, "--format", "jsonl", "good", "bad"], "ok", json_stdout(n=2)))
    c.append(cli("explain/format-jsonl-out", [*XJ, "good", "bad"], "ok", out_file("o.jsonl", n=2)))
    c.append(cli("explain/format-html-out", [*X, "--format", "html", "--out", "{tmp}/o.html", "good"], "ok",
                 files_exist("{tmp}/o.html")))
    c.append(cli("explain/out-is-dir", [*XJ[:-1], "{adir}", "good"], "error", quick=True))
    c.append(cli("explain/out-under-file", [*XJ[:-1], "{under_file}", "good"], "error", owner="cli", quick=True))
    c.append(cli("explain/out-missing-parent", [*XJ[:-1], "{tmp}/no/such/o.jsonl", "good"], "either",
                 files_exist("{tmp}/no/such/o.jsonl")))
    c.append(cli("explain/out-with-terminal", [*X, "--out", "{tmp}/o.txt", "good"], "either",
                 files_exist("{tmp}/o.txt"), owner="cli", quick=True))
    c.append(cli("explain/html-under-file", [*X, "--html", "{under_file}", "good"], "error", owner="cli"))
    c.append(cli("explain/html-is-dir", [*X, "--html", "{adir}", "good"], "error"))
    c.append(cli("explain/plot-bad-extension", [*X, "--plot", "{tmp}/p.txt", "good"], "error"))
    c.append(cli("explain/plot-under-file", [*X, "--plot", "{under_file}", "good"], "error", owner="cli"))
    c.append(cli("explain/plot-png", [*X, "--plot", "{tmp}/p.png", "good"], "ok", files_exist("{tmp}/p.png")))
    c.append(cli("explain/head-view-under-file", [*X, "--head-view", "{under_file}", "good"], "error", owner="cli"))
    c.append(cli("explain/head-view-ok", [*X, "--head-view", "{tmp}/h.html", "good movie"], "ok",
                 files_exist("{tmp}/h.html")))
    c.append(cli("explain/head-view-minilm-512", ["explain", "--model", "{minilm}", "--methods", "rawatt",
                                                  "--head-view", "{tmp}/h.html", "good movie " * 300], "ok",
                 lambda r, e: (None if (e.tmp / "h.html").stat().st_size < 30e6 else
                               f"head view weighs {(e.tmp / 'h.html').stat().st_size / 1e6:.0f} MB"),
                 owner="viz", needs=("minilm",), timeout=180))
    # ---- numeric options
    for opt, val, exp in [("--batch-size", "0", "error"), ("--batch-size", "-1", "error"),
                          ("--batch-size", "abc", "error"), ("--batch-size", "100000", "ok"),
                          ("--max-length", "0", "error"), ("--max-length", "1", "error"),
                          ("--max-length", "-5", "error"), ("--max-length", "100000", "ok"),
                          ("--max-length", "3", "ok"), ("--top-k", "abc", "error"), ("--top-k", "1000", "error")]:
        c.append(cli(f"explain/{opt[2:]}={val}", [*XJ, opt, val, "good movie"], exp,
                     out_file("o.jsonl", max_tokens=3 if val == "3" else None) if exp == "ok" else None,
                     quick=val in ("0", "abc")))
    c.append(cli("explain/top-k=1000-terminal", [*X, "--top-k", "1000", "good movie"], "ok",
                 stdout_has("attcat"), owner="cli"))  # a table beyond the tokens there are (json: refused above)
    c.append(cli("explain/top-k=-1", [*X, "--top-k", "-1", "good movie"], "either",
                 stdout_has(absent=("top -1",)), owner="cli", quick=True))
    c.append(cli("explain/top-k=0", [*X, "--top-k", "0", "good movie"], "either", stdout_has(absent=("top 0",)),
                 owner="cli"))
    c.append(cli("explain/words", [*XJ, "--words", "i really didn ' t like this"], "ok",
                 out_file("o.jsonl", model=None)))
    # ---- --file
    for name, f, exp, oracle, owner in [
        ("missing", "{tmp}/nope.txt", "error", None, "fuzz"), ("dir", "{adir}", "error", None, "fuzz"),
        ("under-file", "{under_file}", "error", None, "fuzz"), ("empty", "{empty.txt}", "error", None, "fuzz"),
        ("blank-lines", "{blank.txt}", "error", None, "fuzz"), ("binary", "{binary.bin}", "error", None, "fuzz"),
        ("latin1", "{latin1.txt}", "error", None, "fuzz"),
        ("huge-line", "{hugeline.txt}", "ok", out_file("o.jsonl", n=1, max_tokens=48), "fuzz"),
        ("nul-byte", "{nul.txt}", "either", out_file("o.jsonl", n=1), "fuzz"),
        ("texts", "{texts.txt}", "ok", out_file("o.jsonl", n=4), "fuzz"),
        ("crlf", "{crlf.txt}", "ok", out_file("o.jsonl", n=4), "fuzz"),
        ("bom", "{bom.txt}", "ok", all_of(out_file("o.jsonl", n=2),
                                         lambda r, e: "BOM kept as a token" if "\ufeff" in
                                         (e.tmp / "o.jsonl").read_text(encoding="utf-8") else None), "fuzz"),
        ("first-line-brace", "{brace.txt}", "either", out_file("o.jsonl", n=2), "cli"),
        ("jsonl-no-text", "{notext.jsonl}", "error", None, "fuzz"),
        ("jsonl-number-text", "{numtext.jsonl}", "error", None, "fuzz"),
        ("jsonl-empty-text", "{emptytext.jsonl}", "error", None, "fuzz"),
        ("jsonl-bad-json", "{badjson.jsonl}", "error", None, "fuzz"),
        ("jsonl-pairs", "{pairs_in.jsonl}", "ok", all_of(
            out_file("o.jsonl", n=2),
            lambda r, e: None if 1 in (json.loads((e.tmp / "o.jsonl").read_text().splitlines()[0])
                                       ["token_type_ids"] or []) else "pair got no token type 1"), "fuzz"),
        ("gz", "{sst.jsonl.gz}", "either", out_file("o.jsonl", n=6), "fuzz"),
    ]:
        c.append(cli(f"explain/file-{name}", [*XJ, "--file", f], exp, oracle, owner=owner,
                     quick=name in ("missing", "binary", "first-line-brace")))
    c.append(cli("explain/file-unreadable", [*XJ, "--file", "{unreadable.txt}"], "error", needs=("nonroot",)))
    c.append(cli("explain/file-and-texts", [*XJ, "--file", "{texts.txt}", "extra text"], "ok",
                 out_file("o.jsonl", n=5)))
    # ---- models
    for name in ["missing", "afile", "under_file", "emptydir", "configonly", "adir"]:
        path = {"missing": "{tmp}/nomodel", "afile": "{afile}", "under_file": "{under_file}",
                "emptydir": "{emptydir}", "configonly": "{configonly}", "adir": "{adir}"}[name]
        c.append(cli(f"explain/model-{name}", ["explain", "--model", path, "good"], "error",
                     quick=name == "missing"))
    c.append(cli("explain/model-empty-string", ["explain", "--model", "", "good"], "error"))
    c.append(cli("explain/file-empty-string", [*X, "--file", ""], "error"))
    c.append(cli("explain/max-length-2-no-real-token", [*XJ, "--max-length", "2", "good movie"], "either",
                 out_file("o.jsonl", max_tokens=2)))
    c.append(cli("explain/max-length-3-pair", [*XJ, "--max-length", "3", "--file", "{pairs_in.jsonl}"], "either",
                 out_file("o.jsonl", max_tokens=3)))
    c.append(cli("explain/model-hub-id-offline", ["explain", "--model", "nosuch-org/nosuch-model", "good"], "error",
                 timeout=60))
    for fam in ["bert", "distilbert", "roberta", "albert", "electra", "llama", "gpt2", "bert3"]:
        c.append(cli(f"explain/model-{fam}-all", ["explain", "--model", f"{{{fam}}}", "--format", "jsonl", "--out",
                                                  "{tmp}/o.jsonl", "good movie", "bad film !"], "ok",
                     out_file("o.jsonl", fam, n=2), owner="cli" if fam in ("gpt2", "llama") else "fuzz",
                     quick=fam in ("bert", "gpt2")))
    c.append(cli("explain/model-gpt2-no-pad-all", ["explain", "--model", "{gpt2nopad}", "--format", "jsonl", "--out",
                                                   "{tmp}/o.jsonl", "good movie", "bad film !"], "ok",
                 out_file("o.jsonl", "gpt2nopad", n=2), owner="load", quick=True))
    c.append(cli("explain/model-gpt2-no-pad-ig", ["explain", "--model", "{gpt2nopad}", "--methods",
                                                  "integratedgradients", "--format", "jsonl", "--out", "{tmp}/o.jsonl",
                                                  "good movie"], "ok", out_file("o.jsonl", "gpt2nopad"), owner="load"))
    c.append(cli("explain/model-qa-all", ["explain", "--model", "{qa}", "--format", "jsonl", "--out",
                                          "{tmp}/o.jsonl", "--file", "{pairs_in.jsonl}"], "either",
                 out_file("o.jsonl", "qa"), owner="cli"))
    c.append(cli("explain/model-qa-terminal", ["explain", "--model", "{qa}", "--methods", "rawatt,attcat",
                                               "--file", "{pairs_in.jsonl}"], "either", None, owner="qa", quick=True))
    c.append(cli("explain/model-qa-html", ["explain", "--model", "{qa}", "--methods", "rawatt", "--format", "html",
                                           "--out", "{tmp}/o.html", "--file", "{pairs_in.jsonl}"], "either",
                 files_exist("{tmp}/o.html"), owner="qa"))
    c.append(cli("explain/model-qa-json-span", ["explain", "--model", "{qa}", "--methods", "rawatt", "--format",
                                                "jsonl", "--out", "{tmp}/o.jsonl", "--file", "{pairs_in.jsonl}"],
                 "either", out_file("o.jsonl", "qa"), owner="qa"))
    c.append(cli("explain/model-bart-reloads-3-labels", ["explain", "--model", "{bartquirk}", "--methods", "rawatt",
                                                         "--format", "jsonl", "--out", "{tmp}/o.jsonl", "good"],
                 "either", out_file("o.jsonl", "bartquirk"), owner="load"))
    c.append(cli("explain/label-names-control-chars", ["explain", "--model", "{evillabels}", "--methods", "rawatt",
                                                       "good movie"], "ok", clean_terminal, owner="viz"))
    c.append(cli("explain/model-path-control-chars", ["explain", "--model", "{root}/models/evil\x1b]0;pwned\x07name",
                                                      "--methods", "rawatt", "good movie"], "ok", clean_terminal,
                 owner="viz"))
    c.append(cli("explain/tokenizer-far-smaller-than-embedding", ["explain", "--model", "{bigvocab}", "--methods",
                                                                  "rawatt", "good movie"], "error", owner="load"))
    c.append(cli("explain/mostly-unk-warns", ["explain", "--model", "{minilm}", "--methods", "rawatt",
                                              "☃☃☃ ☂☂☂ ☄☄☄ ok"], "ok",
                 lambda r, e: None if "unk" in r.stderr.lower() else "no warning about [UNK] tokens",
                 owner="load", needs=("minilm",)))
    c.append(cli("explain/qa-plot", ["explain", "--model", "{qa}", "--methods", "rawatt,attcat", "--plot",
                                     "{tmp}/p.png", "--format", "jsonl", "--file", "{pairs_in.jsonl}"], "ok",
                 files_exist("{tmp}/p.png"), owner="qa"))
    c.append(cli("explain/html-truncation-notice", ["explain", "--model", "{minilm}", "--methods", "rawatt",
                                                    "--format", "html", "--out", "{tmp}/o.html", "good " * 1000],
                 "ok", lambda r, e: None if "trunc" in (e.tmp / "o.html").read_text().lower()
                 else "the page does not say the input was truncated", owner="viz", needs=("minilm",)))
    c.append(cli("explain/model-multilabel", ["explain", "--model", "{multilabel}", "--methods", "rawatt,attcat",
                                              "--format", "jsonl", "--out", "{tmp}/o.jsonl", "good movie"], "ok",
                 out_file("o.jsonl", "multilabel"), owner="qa", quick=True))
    # a causal LM is explained by explain() too (its next token): see explain/model-lmhead-next-token
    for name, owner in [("basemodel", "load"), ("mlm", "load"), ("notok", "load"),
                        ("corrupt", "load"), ("emptyst", "load")]:
        c.append(cli(f"explain/model-{name}", ["explain", "--model", f"{{{name}}}", "--methods", "rawatt",
                                               "good movie"], "error", owner=owner,
                     quick=name in ("basemodel", "notok", "corrupt")))
    c.append(cli("explain/model-lmhead-next-token", ["explain", "--model", "{lmhead}", "--methods", "rawatt",
                                                      "good movie"], "ok", stdout_has("next token"), owner="load"))
    for ref in ["minilm", "gpt2ref", "bartref", "imdbref"]:
        c.append(cli(f"explain/ref-{ref}-all", ["explain", "--model", f"{{{ref}}}", "--format", "jsonl", "--out",
                                                "{tmp}/o.jsonl", "a charming and often affecting journey ."], "ok",
                     out_file("o.jsonl", ref), owner="cli" if ref in ("gpt2ref", "bartref") else "fuzz",
                     needs=(ref,), quick=ref in ("minilm", "gpt2ref"), timeout=240))
    c.append(cli("explain/ref-minilm-terminal", ["explain", "--model", "{minilm}", "--methods", "attcat,rollout",
                                                 "a charming journey"], "ok", stdout_has("charming"),
                 needs=("minilm",)))
    c.append(cli("explain/debug-keeps-traceback", ["--debug", *X, ""], "traceback"))
    c.append(cli("explain/version", ["--version"], "ok", lambda r, e: None if "0." in r.stdout + r.stderr
                 else "no version printed", owner="cli", quick=True))
    return c


def benchmark_cases() -> list[Case]:
    c: list[Case] = []
    c.append(cli("benchmark/ok", B, "ok", summary_ok(6, ("rawatt",)), quick=True))
    c.append(cli("benchmark/resume-same", B, "ok", summary_ok(6), pre=[B]))
    c.append(cli("benchmark/gz-dataset", [*B[:4], "{sst.jsonl.gz}", *B[5:]], "ok", summary_ok(6)))
    for name, ds in [("unknown", "nosuchset"), ("missing-file", "{tmp}/nope.jsonl"), ("empty", "{empty.txt}"),
                     ("binary", "{binary.bin}"), ("latin1", "{latin1.txt}"), ("dir", "{adir}"),
                     ("no-text", "{notext.jsonl}"), ("str-label", "{strlabel.jsonl}"), ("bad-json", "{badjson.jsonl}"),
                     ("bad-gz", "{bad.jsonl.gz}"), ("under-file", "{under_file}"), ("squad-bad", "{squad_bad.json}")]:
        c.append(cli(f"benchmark/dataset-{name}", [*B[:4], ds, *B[5:]], "error", quick=name in ("unknown", "binary")))
    c.append(cli("benchmark/dataset-empty-string", [*B[:4], "", *B[5:]], "error"))
    c.append(cli("benchmark/dataset-unreadable", [*B[:4], "{unreadable.txt}", *B[5:]], "error", needs=("nonroot",)))
    for name in ("nulltext", "floatlabel"):
        c.append(cli(f"benchmark/dataset-{name}", [*B[:4], f"{{{name}.jsonl}}", *B[5:]], "error"))
    c.append(cli("benchmark/limit-1", [*B, "--limit", "1"], "ok", summary_ok(1)))
    c.append(cli("benchmark/gold-label-7", [*B[:4], "{labels7.jsonl}", *B[5:], "--target", "gold"], "error",
                 owner="bench", quick=True))
    c.append(cli("benchmark/gold-label-7-predicted", [*B[:4], "{labels7.jsonl}", *B[5:]], "error", owner="bench"))
    c.append(cli("benchmark/pairs-on-2-class", [*B[:4], "{pairs.jsonl}", *B[5:]], "error", owner="bench"))
    c.append(cli("benchmark/pairs-3-class", ["benchmark", "--model", "{bert3}", "--dataset", "{pairs.jsonl}",
                                             *B[5:]], "ok", summary_ok(4)))
    c.append(cli("benchmark/no-label", [*B[:4], "{nolabel.jsonl}", *B[5:]], "either", summary_ok(4)))
    c.append(cli("benchmark/no-label-gold", [*B[:4], "{nolabel.jsonl}", *B[5:], "--target", "gold"], "error",
                 owner="bench"))
    for opt, val in [("--limit", "0"), ("--limit", "-1"), ("--occlusion-step", "0"), ("--occlusion-max", "-1"),
                     ("--batch-size", "0"), ("--batch-size", "-3"), ("--eval-batch-size", "0"),
                     ("--eval-batch-size", "-1"), ("--max-length", "1"), ("--max-length", "0"),
                     ("--threads", "-1"), ("--limit", "abc"), ("--k", "0"), ("--k", "-2")]:
        owner = "bench" if opt in ("--threads", "--limit", "--eval-batch-size", "--k") else "fuzz"
        base = B if opt != "--k" else ["benchmark", "--model", "{qa}", "--dataset", "{squad.json}", "--methods",
                                        "rawatt", "--quiet", "--out", "{tmp}/out"]
        c.append(cli(f"benchmark/{opt[2:]}={val}", [*base, opt, val], "error", owner=owner,
                     quick=val in ("0", "-1") and opt in ("--limit", "--threads")))
    c.append(cli("benchmark/limit-huge", [*B, "--limit", "1000000000"], "ok", summary_ok(6)))
    c.append(cli("benchmark/threads-0", [*B, "--threads", "0"], "either", summary_ok(6), owner="bench"))
    c.append(cli("benchmark/seed-negative", [*B, "--limit", "3", "--seed", "-1"], "either", summary_ok(3)))
    c.append(cli("benchmark/occlusion-max-huge", [*B, "--occlusion-max", "100000", "--occlusion-step", "1"],
                 "either", summary_ok(6), timeout=90))
    for name, opts, exp in [("bad-json", "{bad", "error"), ("list", "[]", "error"),
                            ("unknown-option", '{"rawatt": {"nope": 1}}', "error"),
                            ("unrequested-method", '{"attcat": {"alpha": "cls"}}', "error"),
                            ("non-dict-value", '{"rawatt": 5}', "error"), ("empty", "{}", "ok")]:
        c.append(cli(f"benchmark/options-{name}", [*B, "--options", opts], exp,
                     summary_ok(6) if exp == "ok" else None, quick=name == "unknown-option",
                     owner="bench" if name == "unrequested-method" else "fuzz"))
    c.append(cli("benchmark/options-typo-then-fixed", [*B[:6], "attcat", *B[7:], "--options",
                                                        '{"attcat": {"alpha": "cls"}}'], "ok", summary_ok(6),
                 pre=[[*B[:6], "attcat", *B[7:], "--options", '{"attcat": {"alpah": "cls"}}']], owner="bench",
                 quick=True))
    c.append(cli("benchmark/settings-changed-no-overwrite", [*B[:6], "attcat", *B[7:]], "either", summary_ok(6),
                 pre=[B]))
    c.append(cli("benchmark/overwrite", [*B, "--overwrite"], "ok", summary_ok(6), pre=[B]))
    for name, m in [("metrics-bogus", ["--metrics", "bogus"]), ("metrics-empty", ["--metrics", ""]),
                    ("methods-bogus", ["--methods", "bogus"]), ("protocol-bogus", ["--protocol", "bogus"]),
                    ("target-bogus", ["--target", "bogus"]),
                    ("attention-cross-bert", ["--attention", "cross"]),
                    ("precision-on-classification", ["--metrics", "precision_at_k"])]:
        c.append(cli(f"benchmark/{name}", [*B, *m], "error"))
    c.append(cli("benchmark/split-on-file", [*B, "--split", "nosuch"], "either", summary_ok(6)))
    c.append(cli("benchmark/split-on-named", ["benchmark", "--model", "{bert}", "--dataset", "sst2", "--split",
                                              "nosuch", "--out", "{tmp}/out"], "error"))
    c.append(cli("benchmark/data-root-missing", ["benchmark", "--model", "{bert}", "--dataset", "sst2",
                                                 "--data-root", "{tmp}/nodata", "--limit", "2", "--out",
                                                 "{tmp}/out"], "error", timeout=60))
    c.append(cli("benchmark/metrics-all", [*B[:8], "all", *B[9:]], "ok", summary_ok(6)))
    c.append(cli("benchmark/target-kind-loss-gold", [*B, "--target", "gold", "--target-kind", "loss"], "ok",
                 summary_ok(6)))
    c.append(cli("benchmark/out-is-file", [*B[:-1], "{afile}"], "error", owner="bench", quick=True))
    c.append(cli("benchmark/out-under-file", [*B[:-1], "{under_file}"], "error", owner="bench"))
    for name, owner in [("corrupt", "load"), ("emptyst", "load"), ("basemodel", "load"), ("notok", "load"),
                        ("configonly", "load")]:
        c.append(cli(f"benchmark/model-{name}", ["benchmark", "--model", f"{{{name}}}", *B[3:]], "error",
                     owner=owner, quick=name == "corrupt"))
    c.append(cli("benchmark/model-missing", ["benchmark", "--model", "{tmp}/nomodel", *B[3:]], "error"))
    c.append(cli("benchmark/classifier-on-squad", ["benchmark", "--model", "{bert}", "--dataset", "{squad.json}",
                                                   "--methods", "rawatt", "--quiet", "--out", "{tmp}/out"], "error",
                 owner="load", quick=True))
    c.append(cli("benchmark/qa-on-sst", ["benchmark", "--model", "{qa}", *B[3:]], "error"))
    c.append(cli("benchmark/qa-squad", ["benchmark", "--model", "{qa}", "--dataset", "{squad.json}", "--methods",
                                        "rawatt,attcat", "--quiet", "--out", "{tmp}/out"], "ok", summary_ok(3),
                 owner="qa"))
    c.append(cli("benchmark/gpt2-no-pad", ["benchmark", "--model", "{gpt2nopad}", *B[3:]], "ok", summary_ok(6),
                 owner="load"))
    c.append(cli("benchmark/bart-all-no-lrp", ["benchmark", "--model", "{bart}", "--dataset", "{sst.jsonl}",
                                               "--no-lrp", "--metrics", "aopc", "--occlusion-max", "4", "--quiet",
                                               "--out", "{tmp}/out"], "ok", summary_ok(6), timeout=180))
    c.append(cli("benchmark/missing-required", ["benchmark", "--model", "{bert}"], "error"))
    c.append(cli("benchmark/ref-minilm", ["benchmark", "--model", "{minilm}", "--dataset", "sst2", "--limit", "3",
                                          "--methods", "attcat,rawatt", "--metrics", "aopc,kendall",
                                          "--occlusion-max", "4", "--quiet", "--out", "{tmp}/out"], "ok",
                 summary_ok(3, ("attcat",)), needs=("minilm",), timeout=180))
    return c


def train_cases() -> list[Case]:
    c: list[Case] = []
    c.append(cli("train/ok-reinit-3-labels", T, "ok", trained_ok(3), quick=True, timeout=180))
    c.append(cli("train/3-labels-without-reinit", [x for x in T if x != "--reinit-head"], "error"))
    for opt, val, owner in [("--epochs", "0", "fuzz"), ("--epochs", "-1", "fuzz"), ("--epochs", "nan", "fuzz"),
                            ("--epochs", "inf", "fuzz"), ("--lr", "0", "fuzz"), ("--lr", "-1", "fuzz"),
                            ("--lr", "nan", "fuzz"), ("--lr", "inf", "fuzz"), ("--warmup", "1", "fuzz"),
                            ("--warmup", "nan", "fuzz"), ("--warmup", "-0.1", "fuzz"),
                            ("--weight-decay", "nan", "fuzz"), ("--weight-decay", "-1", "fuzz"),
                            ("--weight-decay", "inf", "fuzz"),
                            ("--eval-fraction", "0", "fuzz"), ("--eval-fraction", "1", "fuzz"),
                            ("--eval-fraction", "nan", "fuzz"), ("--max-length", "1", "fuzz"),
                            ("--max-length", "0", "fuzz"), ("--batch-size", "0", "fuzz"), ("--limit", "0", "fuzz"),
                            ("--eval-limit", "0", "fuzz"), ("--epochs", "abc", "fuzz"),
                            ("--device", "bogus", "fuzz"), ("--device", "cuda:7", "fuzz")]:
        c.append(cli(f"train/{opt[2:]}={val}", [*T, opt, val], "error", owner=owner, timeout=120,
                     quick=(opt, val) in (("--lr", "inf"), ("--device", "bogus"), ("--epochs", "inf"))))
    c.append(cli("train/seed-negative", [*T, "--seed", "-1"], "either", trained_ok(3), timeout=180))
    c.append(cli("train/max-length-huge", [*T, "--max-length", "100000"], "either", trained_ok(3), timeout=180))
    for name, f in [("missing", "{tmp}/nope.jsonl"), ("dir", "{adir}"), ("empty", "{empty.txt}"),
                    ("binary", "{binary.bin}"), ("latin1", "{latin1.txt}"), ("no-text", "{notext.jsonl}"),
                    ("bad-json", "{badjson.jsonl}"), ("no-label", "{nolabel.jsonl}"), ("under-file", "{under_file}"),
                    ("bad-gz", "{bad.jsonl.gz}")]:
        c.append(cli(f"train/data-file-{name}", [*TD, "--data-file", f, "--out", "{tmp}/out"], "error",
                     quick=name == "binary"))
    c.append(cli("train/data-file-empty-string", [*TD[:4], "", *TD[5:], "--out", "{tmp}/out"], "error"))
    c.append(cli("train/eval-fraction-0.99", [*TD, "--eval-fraction", "0.99", "--out", "{tmp}/out"], "either",
                 trained_ok(2)))
    c.append(cli("train/data-file-unreadable", [*TD[:4], "{unreadable.txt}", *TD[5:], "--out", "{tmp}/out"],
                 "error", needs=("nonroot",)))
    for name in ("nulltext", "nulllabel", "floatlabel"):
        c.append(cli(f"train/data-file-{name}", [*TD[:4], f"{{{name}.jsonl}}", *TD[5:], "--out", "{tmp}/out"],
                     "error"))
    c.append(cli("train/one-class", [*TD[:4], "{oneclass.jsonl}", *TD[5:], "--out", "{tmp}/out"], "either",
                 trained_ok(2)))
    c.append(cli("train/label-field-missing", [*TD, "--label-field", "nosuch", "--out", "{tmp}/out"], "error"))
    c.append(cli("train/text-field-missing", [*TD, "--text-field", "nosuch", "--out", "{tmp}/out"], "error"))
    c.append(cli("train/pair-field-missing", [*TD, "--text-pair-field", "nosuch", "--out", "{tmp}/out"], "error"))
    c.append(cli("train/eval-file-missing", [*TD, "--eval-file", "{tmp}/nope.jsonl", "--out", "{tmp}/out"], "error"))
    c.append(cli("train/dataset-unknown", ["train", "--model", "{bert}", "--dataset", "nosuch", "--out",
                                           "{tmp}/out"], "error"))
    c.append(cli("train/dataset-split-unknown", ["train", "--model", "{bert}", "--dataset", "sst2", "--split",
                                                 "nosuch", "--out", "{tmp}/out"], "error"))
    c.append(cli("train/dataset-and-file", ["train", "--model", "{bert}", "--dataset", "sst2", "--data-file",
                                            "{sst.jsonl}", "--out", "{tmp}/out"], "error"))
    c.append(cli("train/no-data", ["train", "--model", "{bert}", "--out", "{tmp}/out"], "error"))
    for name, path, owner in [("missing", "{tmp}/nomodel", "fuzz"), ("afile", "{afile}", "fuzz"),
                              ("not-a-model-dir", "{adir}", "load"), ("configonly", "{configonly}", "load"),
                              ("corrupt", "{corrupt}", "load"), ("emptyst", "{emptyst}", "load"),
                              ("notok", "{notok}", "load"), ("hub-offline", "nosuch-org/nosuch", "fuzz")]:
        c.append(cli(f"train/model-{name}", ["train", "--model", path, *TD[3:], "--out", "{tmp}/out"], "error",
                     owner=owner, quick=name in ("not-a-model-dir", "corrupt"), timeout=60))
    c.append(cli("train/out-is-file", [*TD, "--out", "{afile}"], "error", owner="fuzz", quick=True))
    c.append(cli("train/out-under-file", [*TD, "--out", "{under_file}"], "error", owner="fuzz"))
    c.append(cli("train/basemodel-new-head", ["train", "--model", "{basemodel}", *TD[3:], "--limit", "4",
                                              "--out", "{tmp}/out"], "either", trained_ok(2), timeout=180))
    return c


def report_cases() -> list[Case]:
    c: list[Case] = []
    c.append(cli("report/ok", ["report", "{results}", "--out", "{tmp}/r.html"], "ok",
                 files_exist("{tmp}/r.html", min_bytes=1000), quick=True))
    c.append(cli("report/examples-0", ["report", "{results}", "--out", "{tmp}/r.html", "--examples", "0"], "ok",
                 files_exist("{tmp}/r.html")))
    c.append(cli("report/examples-huge", ["report", "{results}", "--out", "{tmp}/r.html", "--examples", "100000"],
                 "ok", files_exist("{tmp}/r.html")))
    c.append(cli("report/examples-negative", ["report", "{results}", "--out", "{tmp}/r.html", "--examples", "-1"],
                 "error", quick=True))
    c.append(cli("report/examples-abc", ["report", "{results}", "--examples", "abc"], "error"))
    for name, path in [("missing", "{tmp}/nope"), ("file", "{afile}"), ("empty-dir", "{adir}"),
                       ("under-file", "{under_file}")]:
        c.append(cli(f"report/dir-{name}", ["report", path], "error", quick=name == "file"))
    for name, content in [("corrupt-summary", "{not json"), ("empty-summary", ""), ("list-summary", "[1, 2]"),
                          ("empty-object", "{}"), ("binary-summary", "\x00\x01\xff")]:
        c.append(cli(f"report/{name}", ["report", "{tmp}/res", "--out", "{tmp}/r.html"], "error",
                     pre=[["__copy_results__", content]], quick=name == "list-summary"))
    c.append(cli("report/corrupt-examples", ["report", "{tmp}/res", "--out", "{tmp}/r.html"], "either",
                 files_exist("{tmp}/r.html"), pre=[["__copy_results__", None, "{oops\n"]]))
    c.append(cli("report/out-is-dir", ["report", "{results}", "--out", "{adir}"], "error"))
    c.append(cli("report/out-under-file", ["report", "{results}", "--out", "{under_file}"], "error", quick=True))
    c.append(cli("report/out-missing-parent", ["report", "{results}", "--out", "{tmp}/no/such/r.html"], "either",
                 files_exist("{tmp}/no/such/r.html")))
    c.append(cli("report/default-out", ["report", "{tmp}/res"], "ok", files_exist("{tmp}/res/report.html"),
                 pre=[["__copy_results__", None]]))
    c.append(cli("report/qa-results", ["report", "{tmp}/out", "--out", "{tmp}/r.html"], "ok",
                 files_exist("{tmp}/r.html"), owner="qa",
                 pre=[["benchmark", "--model", "{qa}", "--dataset", "{squad.json}", "--methods", "rawatt,attcat",
                       "--quiet", "--out", "{tmp}/out"]]))
    return c


def sub_cases() -> list[Case]:
    """The real ``python -m attnlens.cli`` entry point (a fresh interpreter each: slow, so few)."""
    return [
        Case("sub/explain-missing-model", "sub", "error", argv=["explain", "--model", "{tmp}/nomodel", "good"],
             quick=True, owner="cli"),
        Case("sub/explain-bert", "sub", "ok", argv=[*XJ, "good movie"], oracle=out_file("o.jsonl"), owner="cli"),
    ]


# ---- API cases
def _tiny(env: Env, name: str = "bert", **kw: Any) -> Any:
    from attnlens import Explainer

    return Explainer.from_pretrained(env[name], **kw)


def _ex(env: Env, texts: Any = "good movie", model: str = "bert", **kw: Any) -> Any:
    kw.setdefault("methods", "rawatt,attcat")
    return _tiny(env, model).explain(texts, **kw)


def _load_dataset(env: Env, *args: str, **kw: Any) -> Any:
    from attnlens.data import load_dataset

    return load_dataset(*[env.fmt(x) for x in args], **kw)


def exps_ok(model: str | None = "bert", **kw: Any) -> Oracle:
    return lambda value, env: check_exps(value, env[model] if model else None, **kw)


def api_cases() -> list[Case]:
    import numpy as np

    c: list[Case] = []
    # texts
    for name, texts in [("none", None), ("empty-list", []), ("int", 5), ("list-with-none", ["good", None]),
                        ("one-tuple", [("good",)]), ("bytes", b"good movie"),
                        ("empty-str", ""), ("list-with-empty", ["good", ""]), ("dict", {"text": "good"}),
                        ("nested-list", [["a", ["b"]]]), ("pair-with-empty", [("good", " ")])]:
        c.append(api(f"api/texts-{name}", lambda env, t=texts: _ex(env, t), "error", quick=name in ("none", "bytes")))
    c.append(api("api/texts-tuple-of-3", lambda env: _ex(env, ("good", "bad", "dull")), "either", exps_ok(n=3)))
    c.append(api("api/texts-generator", lambda env: _ex(env, (t for t in GOOD)), "either", exps_ok(n=4)))
    c.append(api("api/texts-numpy", lambda env: _ex(env, np.array(GOOD)), "either", exps_ok(n=4)))
    c.append(api("api/texts-pair-list", lambda env: _ex(env, [["good movie", "bad film"]]), "ok", exps_ok(n=1)))
    c.append(api("api/texts-emoji-rtl", lambda env: _ex(env, ["😀 good", "שלום movie"]), "ok", exps_ok(max_unk=0.7)))
    c.append(api("api/texts-10k", lambda env: _ex(env, "good " * 10_000), "ok", exps_ok(max_tokens=48)))
    # methods
    for name, m, exp in [("empty-str", "", "error"), ("empty-list", [], "error"), ("int", 5, "error"),
                         ("list-with-int", ["rawatt", 5], "error"), ("list-with-none", [None], "error"),
                         ("upper", ["RAWATT"], "error"), ("dict", {"rawatt": 1}, "either"),
                         ("set", {"rawatt"}, "either"), ("tuple", ("rawatt",), "ok"), ("none", None, "ok"),
                         ("bytes", b"rawatt", "error"), ("nested", [["rawatt"]], "error")]:
        c.append(api(f"api/methods-{name}", lambda env, m=m: _ex(env, methods=m), exp,
                     exps_ok() if exp != "error" else None, quick=name in ("int", "empty-list", "nested")))
    # targets
    for name, t, exp, want in [("5", 5, "error", None), ("-1", -1, "error", None), ("2", 2, "error", None),
                               ("bool", True, "error", None), ("float", 1.0, "error", None),
                               ("nan", float("nan"), "error", None), ("wrong-length", [0, 1, 0], "error", None),
                               ("label-case", "label_1", "ok", 1), ("unknown-label", "nope", "error", None),
                               ("str-digit", "1", "ok", 1), ("str-negative", "-1", "error", None),
                               ("np-int", np.int64(1), "ok", 1), ("dict", {"a": 1}, "error", None),
                               ("list-of-bool", [True, False], "error", None),
                               ("np-array", np.array([1, 0]), "either", None),
                               ("tensor-0d", "tensor0", "either", 1), ("list-of-str-bad", ["x"], "error", None)]:
        def fn(env: Env, t: Any = t) -> Any:
            texts = ["good movie", "bad film"]
            if isinstance(t, str) and t == "tensor0":
                import torch

                t, texts = torch.tensor(1), ["good movie"]
            return _ex(env, texts, target=t)

        c.append(api(f"api/target-{name}", fn, exp, exps_ok(target=want) if exp != "error" else None,
                     quick=name in ("bool", "5")))
    c.append(api("api/target-per-input", lambda env: _ex(env, ["good", "bad"], target=[0, 1]), "ok",
                 lambda v, env: None if [e.target for e in v] == [0, 1] else f"targets {[e.target for e in v]}"))
    c.append(api("api/target-none-in-list", lambda env: _ex(env, ["good", "bad"], target=[None, 1]), "ok",
                 lambda v, env: None if v[1].target == 1 and v[0].target == v[0].predicted else "wrong targets"))
    c.append(api("api/target-kind-bogus", lambda env: _ex(env, target_kind="bogus"), "error"))
    c.append(api("api/target-kind-none", lambda env: _ex(env, target_kind=None), "error"))
    # batch sizes
    for name, bs, exp in [("0", 0, "error"), ("-1", -1, "error"), ("float", 1.5, "error"), ("str", "8", "error"),
                          ("none", None, "error"), ("huge", 10**9, "ok"), ("bool", True, "either")]:
        c.append(api(f"api/batch-size-{name}", lambda env, bs=bs: _ex(env, GOOD, batch_size=bs), exp,
                     exps_ok(n=4) if exp != "error" else None, quick=name in ("0", "str")))
    # options
    for name, opts, methods, exp in [
        ("unknown-option", {"rawatt": {"x": 1}}, "rawatt", "error"),
        ("unrequested", {"attcat": {"alpha": "cls"}}, "rawatt", "error"),
        ("str", "attcat", "attcat", "error"), ("list", [("attcat", {})], "attcat", "either"),
        ("value-int", {"attcat": 5}, "attcat", "error"), ("value-none", {"attcat": None}, "attcat", "either"),
        ("alpha-bogus", {"attcat": {"alpha": "bogus"}}, "attcat", "error"),
        ("hidden-bogus", {"attcat": {"hidden": 3}}, "attcat", "error"),
        ("transatt-start-11", {"transatt": {"start_layer": 11}}, "transatt", "error"),
        ("transatt-start-neg", {"transatt": {"start_layer": -5}}, "transatt", "error"),
        ("transatt-start-str", {"transatt": {"start_layer": "1"}}, "transatt", "error"),
        ("ig-steps-0", {"integratedgradients": {"n_steps": 0}}, "integratedgradients", "error"),
        ("ig-steps-neg", {"integratedgradients": {"n_steps": -5}}, "integratedgradients", "error"),
        ("ig-steps-str", {"integratedgradients": {"n_steps": "a"}}, "integratedgradients", "error"),
        ("ig-steps-float", {"integratedgradients": {"n_steps": 2.5}}, "integratedgradients", "error"),
        ("ig-internal-0", {"integratedgradients": {"internal_batch_size": 0}}, "integratedgradients", "error"),
        ("ig-baseline-bogus", {"integratedgradients": {"baseline": "bogus"}}, "integratedgradients", "error"),
        ("saliency-engine-bogus", {"saliency": {"engine": "bogus"}}, "saliency", "error"),
        ("lrp-rules-bogus", {"attnlrp": {"rules": "bogus"}}, "attnlrp", "error"),
        ("lrp-epsilon-neg", {"partiallrp": {"epsilon": -1}}, "partiallrp", "error"),
        ("lrp-epsilon-str", {"partiallrp": {"epsilon": "x"}}, "partiallrp", "error"),
        ("attnlrp-input-bogus", {"attnlrp": {"input": "bogus"}}, "attnlrp", "error"),
        ("option-key-int", {5: {}}, "rawatt", "error"),
        ("ig-steps-ok", {"integratedgradients": {"n_steps": 3}}, "integratedgradients", "ok"),
    ]:
        owner = "lrp" if "lrp" in name else "fuzz"
        c.append(api(f"api/options-{name}", lambda env, o=opts, m=methods: _ex(env, methods=m, options=o), exp,
                     exps_ok() if exp != "error" else None, owner=owner,
                     quick=name in ("str", "value-int", "ig-steps-0")))
    # explainer construction
    def built(env: Env, which: str) -> Any:
        from conftest import make_model, make_tokenizer
        from transformers import BertConfig, BertModel

        from attnlens import Explainer

        tok = make_tokenizer()
        if which == "model-none":
            return Explainer(None, tok)
        if which == "tokenizer-none":
            return Explainer(make_model("bert"), None).explain("good", methods="rawatt")
        if which == "tokenizer-str":
            return Explainer(make_model("bert"), "tok").explain("good", methods="rawatt")
        if which == "basemodel":
            return Explainer(BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=8)), tok)
        if which == "max-length-str":
            return Explainer(make_model("bert"), tok, max_length="10").explain("good", methods="rawatt")
        if which == "max-length-0":
            return Explainer(make_model("bert"), tok, max_length=0)
        if which == "attention-bogus":
            return Explainer(make_model("bart"), tok, attention="bogus")
        if which == "attention-cross-bert":
            return Explainer(make_model("bert"), tok, attention="cross")
        if which == "sdpa-model":
            model = make_model("bert", attn="sdpa")
            out = Explainer(model, tok).explain("good movie", methods="rawatt,attcat")
            if model.config._attn_implementation != "sdpa":
                return "attention implementation not restored"
            return out
        raise AssertionError(which)

    for which in ["model-none", "tokenizer-none", "tokenizer-str", "basemodel", "max-length-str", "max-length-0",
                  "attention-bogus", "attention-cross-bert"]:
        c.append(api(f"api/explainer-{which}", lambda env, w=which: built(env, w), "error",
                     quick=which in ("tokenizer-none", "max-length-str")))
    c.append(api("api/explainer-sdpa-restored", lambda env: built(env, "sdpa-model"), "ok",
                 lambda v, env: v if isinstance(v, str) else check_exps(v)))
    for name, kw in [("task-bogus", {"task": "bogus"}), ("device-bogus", {"device": "bogus"}),
                     ("max-length-neg", {"max_length": -1}), ("attention-cross-bert", {"attention": "cross"})]:
        c.append(api(f"api/from-pretrained-{name}", lambda env, kw=kw: _tiny(env, **kw), "error",
                     quick=name == "device-bogus"))
    for name, path in [("int", 5), ("empty-str", ""), ("none", None), ("file", "{afile}"), ("missing", "{tmp}/no")]:
        c.append(api(f"api/from-pretrained-path-{name}",
                     lambda env, p=path: __import__("attnlens").Explainer.from_pretrained(
                         env.fmt(p) if isinstance(p, str) else p), "error", quick=name == "none"))
    c.append(api("api/from-pretrained-qa-as-classification", lambda env: _tiny(env, "qa", task="classification"),
                 "error", owner="load"))
    c.append(api("api/from-pretrained-classifier-as-qa", lambda env: _tiny(env, "bert", task="qa"), "error",
                 owner="load", quick=True))
    # QA targets
    for name, t in [("end-before-start", (5, 2)), ("beyond", (0, 1000)), ("negative", (-1, -1)), ("str", "x"),
                    ("float", (1.0, 2.0))]:
        c.append(api(f"api/qa-target-{name}", lambda env, t=t: _ex(env, ("was it good", "the movie was very good"),
                                                                     model="qa", target=t), "error", owner="qa"))
    c.append(api("api/qa-default-span", lambda env: _ex(env, ("was it good", "the movie was very good"), model="qa",
                                                          methods="all"), "ok", exps_ok("qa"), owner="qa", quick=True))
    # families, correctness oracles
    for fam in ["bert", "distilbert", "roberta", "albert", "electra", "gpt2", "llama", "bart"]:
        c.append(api(f"api/family-{fam}-all", lambda env, f=fam: _ex(env, GOOD, model=f, methods="all"), "ok",
                     exps_ok(fam, n=4), quick=fam in ("bart",)))
    c.append(api("api/gpt2-no-pad-all", lambda env: _ex(env, GOOD, model="gpt2nopad", methods="all"), "ok",
                 exps_ok("gpt2nopad", n=4), owner="load", quick=True))
    for rules in ("chefer-orig", "chefer", "cp", "attnlrp"):
        c.append(api(f"api/lrp-{rules}-magnitude", lambda env, r=rules: _ex(
            env, "a charming and often affecting journey .", model="minilm", methods="partiallrp,transatt,attnlrp",
            options={m: {"rules": r} for m in ("partiallrp", "transatt", "attnlrp")}), "either", exps_ok("minilm"),
            owner="lrp", needs=("minilm",), quick=rules == "chefer-orig"))
    c.append(api("api/multilabel-probabilities", lambda env: _ex(env, GOOD, model="multilabel"), "ok",
                 exps_ok("multilabel"), owner="qa", quick=True))

    def invariance(env: Env) -> str | None:
        ex = _tiny(env)
        batched = ex.explain(GOOD * 2, methods="all", batch_size=3)
        alone = [ex.explain(t, methods="all")[0] for t in GOOD * 2]
        for a, b in zip(batched, alone, strict=True):
            for m in a.scores:
                if not np.allclose(a.scores[m], b.scores[m], atol=1e-5):
                    return f"{m}: batched scores differ from one at a time"
        return None

    c.append(api("api/batch-invariance", invariance, "ok", lambda v, env: v, quick=True))

    def padding_zero(env: Env) -> str | None:
        from attnlens.methods.registry import get_method, list_methods

        ex = _tiny(env)
        enc = ex.encode(["good", "the movie was very good and i really like this film"])
        specs = [get_method(m) for m in list_methods()]
        _, out = ex.compute_batch(enc, [-1, -1], specs, {s.name: s.check_options({}) for s in specs})
        n = len(enc[0].ids)
        for m, (scores, layers) in out.items():
            if scores[0, n:].abs().max() != 0 or (layers is not None and layers[0, :, n:].abs().max() != 0):
                return f"{m}: padding has non-zero scores"
        return None

    c.append(api("api/padding-scores-zero", padding_zero, "ok", lambda v, env: v))

    def state_kept(env: Env) -> str | None:
        import torch

        ex = _tiny(env)
        ex.model.train()
        before = {k: v.clone() for k, v in ex.model.state_dict().items()}
        ex.explain(GOOD, methods="all")
        if not ex.model.training:
            return "training flag not restored"
        if any(not torch.equal(before[k], v) for k, v in ex.model.state_dict().items()):
            return "weights changed"
        if any(p.grad is not None for p in ex.model.parameters()):
            return "gradients left on the weights"
        return None

    c.append(api("api/model-state-kept", state_kept, "ok", lambda v, env: v))

    def roundtrip(env: Env) -> str | None:
        from attnlens import Explanation, load_explanations, save_explanations

        exps = _ex(env, GOOD, methods="all")
        exps[0].save(env.tmp / "e.json")
        save_explanations(exps, env.tmp / "e.jsonl")
        if Explanation.load(env.tmp / "e.json") != exps[0]:
            return "Explanation.load differs"
        if load_explanations(env.tmp / "e.jsonl") != exps:
            return "load_explanations differs"
        return None

    c.append(api("api/save-load-roundtrip", roundtrip, "ok", lambda v, env: v))

    def words_sum(env: Env) -> str | None:
        e = _ex(env, "i really didn ' t like this", methods="attcat")[0]
        w = e.to_words()
        if not np.isclose(w.scores["attcat"].sum(), e.scores["attcat"].sum()):
            return "word scores do not sum to the token scores"
        return None

    c.append(api("api/to-words-sum", words_sum, "ok", lambda v, env: v))
    # Explanation misuse
    for name, fn in [
        ("top-k-unknown-method", lambda env: _ex(env)[0].top_k("nope")),
        ("top-k-negative", lambda env: _ex(env)[0].top_k("attcat", -1)),
        ("top-k-str", lambda env: _ex(env)[0].top_k("attcat", "3")),
        ("to-words-bogus", lambda env: _ex(env)[0].to_words("bogus")),
        ("show-unknown-method", lambda env: _ex(env)[0].show(methods=["nope"])),
        ("html-unknown-method", lambda env: _ex(env)[0].to_html(methods=["nope"])),
        ("load-missing", lambda env: __import__("attnlens").Explanation.load(env.tmp / "no.json")),
        ("load-corrupt", lambda env: __import__("attnlens").Explanation.load(env["badjson.jsonl"])),
        ("load-empty", lambda env: __import__("attnlens").Explanation.load(env["empty.txt"])),
        ("load-binary", lambda env: __import__("attnlens").Explanation.load(env["binary.bin"])),
        ("load-explanations-corrupt", lambda env: __import__("attnlens").load_explanations(env["badjson.jsonl"])),
        ("load-explanations-list", lambda env: __import__("attnlens").load_explanations(env["sst.jsonl"])),
        ("from-dict-list", lambda env: __import__("attnlens").Explanation.from_dict([1, 2])),
        ("attention-maps-empty", lambda env: _tiny(env).attention_maps("")),
        ("attention-maps-none", lambda env: _tiny(env).attention_maps(None)),
        ("predict-proba-empty-seq", lambda env: _tiny(env).predict_proba([[]])),
        ("predict-proba-bad-id", lambda env: _tiny(env).predict_proba([[2, 99999, 3]])),
        ("predict-proba-negative-id", lambda env: _tiny(env).predict_proba([[2, -4, 3]])),
        ("predict-proba-batch-0", lambda env: _tiny(env).predict_proba([[2, 3]], batch_size=0)),
        ("save-under-file", lambda env: _ex(env)[0].save(env["under_file"])),
    ]:
        c.append(api(f"api/{name}", fn, "error", quick=name in ("top-k-unknown-method", "predict-proba-bad-id")))
    c.append(api("api/attention-maps-pair", lambda env: _tiny(env).attention_maps(("good", "bad")), "ok",
                 lambda v, env: None if len(v[0]) == v[2].shape[-1] else "shape mismatch"))
    c.append(api("api/predict-proba-ok", lambda env: _tiny(env).predict_proba([[2, 10, 3], [2, 3]]), "ok",
                 lambda v, env: None if np.allclose(v.sum(1), 1) else "rows do not sum to 1"))
    # evaluation API
    def bench_api(env: Env, **kw: Any) -> Any:
        from attnlens.data import load_dataset
        from attnlens.evaluation import run_benchmark

        kw = {"metrics": "aopc", **kw}
        return run_benchmark(_tiny(env), load_dataset(env["sst.jsonl"]), env.tmp / "out", methods="rawatt",
                             progress=False, **kw)

    for name, kw in [("metrics-bogus", {"metrics": "bogus"}), ("batch-0", {"batch_size": 0}),
                     ("eval-batch-0", {"eval_batch_size": 0}), ("chunk-0", {"chunk_size": 0}),
                     ("target-bogus", {"target": "bogus"}), ("target-kind-bogus", {"target_kind": "bogus"}),
                     ("options-unknown", {"explain_options": {"rawatt": {"x": 1}}})]:
        c.append(api(f"api/run-benchmark-{name}", lambda env, kw=kw: bench_api(env, **kw), "error", owner="bench"))
    for name, args, kw in [("unknown", ("nosuch",), {}), ("split", ("sst2", "nosuch"), {}),
                           ("limit-0", ("sst2",), {"limit": 0}), ("limit-neg", ("sst2",), {"limit": -3}),
                           ("dir", ("{adir}",), {}), ("binary", ("{binary.bin}",), {})]:
        c.append(api(f"api/load-dataset-{name}", lambda env, a=args, kw=kw: _load_dataset(env, *a, **kw), "error"))
    return c


def all_cases() -> list[Case]:
    return [*explain_cases(), *benchmark_cases(), *train_cases(), *report_cases(), *sub_cases(), *api_cases()]


# ----------------------------------------------------------------------------------------------- driver
def _prepare(case: Case, env: Env) -> None:
    """Special ``pre`` steps that are not CLI runs (copies of the fixture results folder)."""
    keep = []
    for pre in case.pre:
        if pre and pre[0] == "__copy_results__":
            dest = env.tmp / "res"
            shutil.copytree(env["results"], dest)
            if pre[1] is not None:
                (dest / "summary.json").write_text(pre[1], encoding="utf-8", errors="surrogateescape")
            if len(pre) > 2:
                with (dest / "explanations.jsonl").open("a") as f:
                    f.write(pre[2])
        else:
            keep.append(pre)
    case.pre = keep


def _warm_imports() -> None:
    """Import (not run) what the cases will use, so each forked child does not import it again."""
    import importlib

    for name in ["tokenizers", "transformers.tokenization_utils_tokenizers", "transformers.convert_slow_tokenizer",
                 "transformers.models.bert.modeling_bert", "transformers.models.bert.tokenization_bert_fast",
                 "transformers.models.gpt2.modeling_gpt2", "transformers.models.bart.modeling_bart",
                 "transformers.models.distilbert.modeling_distilbert", "transformers.models.roberta.modeling_roberta",
                 "transformers.models.albert.modeling_albert", "transformers.models.electra.modeling_electra",
                 "transformers.models.llama.modeling_llama", "captum.attr", "scipy.stats",
                 "safetensors.torch", "attnlens.methods", "attnlens.viz.plots", "attnlens.viz.html",
                 "attnlens.viz.terminal", "attnlens.viz.headview", "attnlens.train", "attnlens.data", "conftest"]:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def run_case(case: Case, env: Env) -> Result:
    env.tmp = Path(tempfile.mkdtemp(prefix="case-", dir=env.root / "cases"))
    start = time.monotonic()
    if "nonroot" in case.needs and os.geteuid() == 0:
        return Result(case.id, case.kind, case.owner, case.expect, "skipped", "root reads unreadable files", 0.0)
    missing = [n for n in case.needs if n != "nonroot" and not Path(env[n]).exists()]
    if missing:
        return Result(case.id, case.kind, case.owner, case.expect, "skipped", f"missing {missing}", 0.0)
    try:
        _prepare(case, env)
        if case.kind == "api":
            outcome, detail = run_api_case(case, env)
        else:
            outcome, detail = run_cli_case(case, env, env.tmp)
    except Exception as exc:  # noqa: BLE001 - a harness bug must not stop the run
        outcome, detail = "other", f"harness failed: {type(exc).__name__}: {exc}"[:200]
    finally:
        shutil.rmtree(env.tmp, ignore_errors=True)
    return Result(case.id, case.kind, case.owner, case.expect, outcome, detail, time.monotonic() - start)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="only the cases marked quick (a few minutes)")
    p.add_argument("--json", metavar="PATH", help="save every case's outcome as JSON")
    p.add_argument("-k", metavar="SUBSTRING", help="only cases whose id contains this")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = p.parse_args(argv)

    cases = all_cases()
    if args.quick:
        cases = [c for c in cases if c.quick]
    if args.k:
        cases = [c for c in cases if args.k in c.id]
    if args.list:
        for c in cases:
            print(f"{c.id:50s} {c.kind:4s} {c.expect:7s} {c.owner}")
        print(f"{len(cases)} cases")
        return 0

    # Imported once here so that every forked child starts warm; nothing is computed in this process.
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import attnlens.cli  # noqa: F401
    import attnlens.evaluation.runner  # noqa: F401
    import attnlens.viz.report  # noqa: F401
    from attnlens.cli import build_parser

    build_parser()  # imports every subcommand module
    _warm_imports()

    root = Path(tempfile.mkdtemp(prefix="attnlens-fuzz-"))
    (root / "cases").mkdir()
    env = Env(root)
    t0 = time.monotonic()
    setup = _in_child(lambda: (build_fixtures(root), ("correct", ""))[1], 600)
    if setup[0] != "correct":
        print(f"fixture setup failed: {setup}", file=sys.stderr)
        return 1
    print(f"fixtures in {time.monotonic() - t0:.0f} s; {len(cases)} cases", flush=True)

    results: list[Result] = []
    try:
        for i, case in enumerate(cases, 1):
            r = run_case(case, env)
            results.append(r)
            bad = r.outcome not in ("correct", "clear-error", "skipped")
            print(f"[{i:3d}/{len(cases)}] {r.outcome:12s} {r.seconds:5.1f}s {r.id}"
                  + (f"  <- {r.detail}" if bad else ""), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    counts = Counter(r.outcome for r in results)
    failures = [r for r in results if r.outcome not in ("correct", "clear-error", "skipped")]
    print("\nfailures (owner, outcome, case, detail):")
    for r in sorted(failures, key=lambda r: (r.owner, r.outcome, r.id)):
        print(f"  {r.owner:6s} {r.outcome:12s} {r.id:45s} {r.detail}")
    tried = len(results) - counts["skipped"]
    print(f"\ninputs tried: {tried}  (CLI {sum(r.kind != 'api' for r in results)}, API "
          f"{sum(r.kind == 'api' for r in results)}; skipped {counts['skipped']})")
    for name in CLASSES:
        print(f"  {name:13s} {counts[name]}")
    print(f"total {time.monotonic() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "counts": {k: counts[k] for k in (*CLASSES, "skipped")}, "tried": tried,
            "cases": [r.__dict__ for r in results]}, indent=1), encoding="utf-8")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
