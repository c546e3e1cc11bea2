"""The benchmark runner: results format, caching, resuming after an interruption, protocols, and the command."""

from __future__ import annotations

import argparse
import json
import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import needs

from attnlens.data import Dataset, Example
from attnlens.errors import InputError
from attnlens.evaluation import EvalConfig, Variant
from attnlens.evaluation.runner import BenchmarkRun, run_benchmark
from attnlens.results.explanation import Explanation

CLS, SEP = 101, 102
WORDS = "good great fine bad awful dull plot film actors story the a".split()
VOCAB = {w: i + 10 for i, w in enumerate(WORDS)}
WEIGHT = {VOCAB["good"]: 2.0, VOCAB["great"]: 2.5, VOCAB["fine"]: 0.7, VOCAB["bad"]: -2.0, VOCAB["awful"]: -3.0,
          VOCAB["dull"]: -1.0, VOCAB["plot"]: 0.1, VOCAB["film"]: -0.1}


def p1(ids):
    z = sum(WEIGHT.get(t, 0.0) for t in ids)
    return 1 / (1 + math.exp(-z))


def linear_predict(variants):
    return np.array([[1 - p1(v.present()), p1(v.present())] for v in variants])


class FakeExplainer:
    """Explains the linear bag-of-words model exactly: grads/attcat = signed weight for the target class."""

    def __init__(self):
        self.model = SimpleNamespace(config=SimpleNamespace(num_labels=2))
        self.name = "linear-bow"
        self.pad_id = 0
        self.explained = 0

    def explain(self, texts, methods, *, target=None, batch_size=32, target_kind="logit", options=None):
        out = []
        for i, text in enumerate(texts):
            self.explained += 1
            words = text.split()
            ids = [CLS, *(VOCAB[w] for w in words), SEP]
            p = p1(ids)
            pred = int(p > 0.5)
            tgt = pred if target is None or target[i] is None else int(target[i])
            sign = 1.0 if tgt == 1 else -1.0
            w = np.array([WEIGHT.get(t, 0.0) for t in ids])
            w[0] = w[-1] = 0.0
            scores = {"rawatt": np.abs(w) + 0.01 * np.arange(len(ids)), "grads": sign * w,
                      "attcat": sign * w + 0.05 * np.cos(np.arange(len(ids)))}
            out.append(Explanation(
                text=text, tokens=["[CLS]", *words, "[SEP]"], special=[True] + [False] * len(words) + [True],
                target=tgt, predicted=pred, probabilities=[1 - p, p],
                scores={m: scores[m] for m in methods}, input_ids=ids, token_type_ids=[0] * len(ids),
            ))
        return out


def dataset(n=11):
    rng = np.random.default_rng(5)
    examples = []
    for i in range(n):
        words = list(rng.choice(WORDS, size=int(rng.integers(4, 14))))
        label = int(p1([VOCAB[w] for w in words]) > 0.5) if i % 4 else 1 - int(p1([VOCAB[w] for w in words]) > 0.5)
        examples.append(Example(str(i), " ".join(words), label))
    return Dataset("toy", "dev", "classification", examples, ["negative", "positive"])


METRICS = "aopc,lodds,comprehensiveness,sufficiency,occlusion,kendall"
CONFIG = EvalConfig(occlusion_counts=(0, 1, 2, 3, 5))


def bench(tmp: Path, **kw):
    ex = kw.pop("explainer", None) or FakeExplainer()
    kw.setdefault("config", CONFIG)
    return run_benchmark(ex, dataset(), tmp, methods="rawatt,grads,attcat", metrics=METRICS, predict=linear_predict,
                         progress=False, chunk_size=3, **kw), ex


def test_results_directory_format(tmp_path):
    summary, ex = bench(tmp_path)
    for name in ("examples.jsonl", "explanations.jsonl", "summary.json", "table.md", "table.csv"):
        assert (tmp_path / name).is_file()
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == summary
    assert summary["n_examples"] == 11 and summary["methods"] == ["rawatt", "grads", "attcat"]
    assert set(summary["metrics"]) == set(METRICS.split(","))
    assert summary["metrics"]["lodds"]["lower_is_better"] is True
    assert summary["results"]["rawatt"]["kendall"] is None  # class-agnostic
    assert summary["results"]["grads"]["kendall"] == pytest.approx(-1.0)  # exact sign flip of a linear model
    occ = summary["curves"]["occlusion"]
    assert occ["k"] == [0, 1, 2, 3, 5] and {"random", "grads:top", "grads:bottom"} <= set(occ["series"])
    assert occ["series"]["grads:top"]["relative"][0] == pytest.approx(1.0)
    assert len(summary["curves"]["aopc"]["grads"]["drop"]) == 11
    # 11 examples x 3 methods + one baseline line each; explanations: 11 main + 11 other-class
    lines = (tmp_path / "examples.jsonl").read_text().splitlines()
    assert len(lines) == 44 and ex.explained == 22
    # per-example AOPC of grads equals a plain recomputation
    rows = [json.loads(x) for x in lines]
    r = next(x for x in rows if x["method"] == "grads" and x["index"] == 2)
    text = dataset()[2].text.split()
    ids = [CLS, *(VOCAB[w] for w in text), SEP]
    pred = int(p1(ids) > 0.5)
    sign = 1 if pred else -1
    order = sorted(range(1, len(ids) - 1), key=lambda i: -sign * WEIGHT.get(ids[i], 0.0))
    n = len(order)
    p = [p1(ids) if pred else 1 - p1(ids)]
    want = []
    for k in range(11):
        c = int(np.round(k / 10 * n))
        kept = [t for i, t in enumerate(ids) if i not in order[:c]]
        want.append(p[0] - (p1(kept) if pred else 1 - p1(kept)))
    assert r["metrics"]["aopc"] == pytest.approx(np.mean(want))
    table = (tmp_path / "table.md").read_text()
    best = max(summary["results"], key=lambda m: summary["results"][m]["aopc"])
    assert f"**{summary['results'][best]['aopc']:.3f}**" in table
    csv_rows = (tmp_path / "table.csv").read_text().splitlines()
    assert csv_rows[0].startswith("method,aopc") and any("aopc" in row.split(",")[-1] for row in csv_rows[1:])


def test_resume_after_interruption_gives_identical_totals(tmp_path):
    full, _ = bench(tmp_path / "full")
    part_dir = tmp_path / "part"
    partial, ex1 = bench(part_dir, stop_after=5)
    assert partial["n_examples"] == 5 and partial["timing"]["complete"] is False
    with (part_dir / "examples.jsonl").open("a") as f:  # a write torn by the interruption
        f.write('{"index": 7, "method": "grads", "metr')
    with (part_dir / "explanations.jsonl").open("a") as f:
        f.write('{"text": "x", "tok')
    resumed, ex2 = bench(part_dir)
    assert ex2.explained == 22 - 10  # the 5 finished examples (and their other-class explanations) are cached
    assert resumed["results"] == full["results"] and resumed["curves"] == full["curves"]
    assert resumed["n_examples"] == 11
    rows = [json.loads(x) for x in (part_dir / "examples.jsonl").read_text().splitlines()]
    assert len(rows) == 44 and len({(r["index"], r["method"]) for r in rows}) == 44


def test_an_interrupted_run_summarises_the_examples_it_finished(tmp_path):
    full, _ = bench(tmp_path / "full")

    class Interrupted(FakeExplainer):
        def explain(self, texts, methods, **kwargs):
            if self.explained >= 12:  # the third chunk (each explains 3 examples and their other class)
                raise KeyboardInterrupt
            return super().explain(texts, methods, **kwargs)

    logged = []
    with pytest.raises(KeyboardInterrupt):
        bench(tmp_path / "part", explainer=Interrupted(), log=logged.append)
    partial = json.loads((tmp_path / "part" / "summary.json").read_text())
    assert partial["timing"]["complete"] is False and partial["timing"]["interrupted"] is True
    assert partial["n_examples"] == 6 and partial["n_planned"] == 11
    assert logged == [f"interrupted: wrote {tmp_path / 'part'}/summary.json (6 of 11 examples); run the same "
                      "command again to finish"]
    assert "(6 of 11 examples, partial: resume to complete, protocol" in (tmp_path / "part" / "table.md").read_text()
    aside = tmp_path / "part" / ".replaced.killed"  # what a run started over and killed set aside
    aside.mkdir()
    (aside / "examples.jsonl").write_text("{}\n")
    resumed, _ = bench(tmp_path / "part")
    assert resumed["results"] == full["results"] and resumed["timing"]["complete"] is True
    assert "(11 examples, protocol" in (tmp_path / "part" / "table.md").read_text() and not aside.exists()


class _RefusesLater(FakeExplainer):
    """Refuses the third chunk's inputs, as an input with no token left after truncation is refused."""

    def explain(self, texts, methods, **kwargs):
        if self.explained >= 12:
            raise InputError("example 7 has no token to explain after truncation")
        return super().explain(texts, methods, **kwargs)


def test_a_refused_run_leaves_the_results_folder_as_it_was(tmp_path):
    full, _ = bench(tmp_path / "full")
    before = {p.name: p.read_bytes() for p in (tmp_path / "full").iterdir() if p.is_file()}
    with pytest.raises(InputError, match="no token to explain"):
        bench(tmp_path / "full", explainer=_RefusesLater(), resume=False)  # --overwrite, then refused
    after = {p.name: p.read_bytes() for p in (tmp_path / "full").iterdir() if p.is_file()}
    assert after == before and not list((tmp_path / "full").glob(".replaced.*"))
    with pytest.raises(InputError, match="no token to explain"):
        bench(tmp_path / "fresh", explainer=_RefusesLater())
    assert not [p.name for p in (tmp_path / "fresh").iterdir() if not p.name.startswith(".")]
    again, _ = bench(tmp_path / "fresh")  # the corrected command is not refused as other settings
    assert again["results"] == full["results"]


def test_resume_takes_a_garbled_row_out_and_computes_it_again(tmp_path):
    full, _ = bench(tmp_path / "full")
    part_dir = tmp_path / "part"
    bench(part_dir, stop_after=5)
    path = part_dir / "examples.jsonl"
    lines = path.read_text().splitlines()
    lines[3] = lines[3][:20] + "#garbled#"  # changed outside attnlens
    path.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match="1 line is not a results row"):
        resumed, _ = bench(part_dir)
    assert resumed["results"] == full["results"] and resumed["curves"] == full["curves"]
    rows = [json.loads(x) for x in path.read_text().splitlines()]  # every line a row again
    assert len(rows) == 44 and len({(r["index"], r["method"]) for r in rows}) == 44


def test_explanations_cached_but_metrics_missing_are_reused(tmp_path):
    bench(tmp_path)
    (tmp_path / "examples.jsonl").unlink()
    _, ex = bench(tmp_path)
    assert ex.explained == 0


def test_other_settings_refuse_to_resume_and_overwrite_starts_over(tmp_path):
    bench(tmp_path)
    with pytest.raises(InputError, match="other settings"):
        bench(tmp_path, config=EvalConfig(occlusion_counts=(0, 2)))
    summary, ex = bench(tmp_path, config=EvalConfig(occlusion_counts=(0, 2)), resume=False)
    assert ex.explained == 22 and summary["curves"]["occlusion"]["k"] == [0, 2]


@pytest.mark.parametrize(("setup", "changed"), [({"max_length": 41}, "max_length None before, 41 now"),
                                                ({"stream": "cross"}, "stream None before, cross now")])
def test_a_model_truncating_or_reading_otherwise_refuses_to_resume(tmp_path, setup, changed):
    bench(tmp_path, stop_after=5)
    other = FakeExplainer()
    for name, value in setup.items():
        setattr(other, name, value)
    with pytest.raises(InputError, match=f"other settings \\({changed}\\)"):
        bench(tmp_path, explainer=other)


def test_the_models_padding_id_replaces_tokens_whatever_config_is_given(tmp_path):
    ex = FakeExplainer()
    ex.pad_id = 7
    bench(tmp_path, explainer=ex, config=EvalConfig(protocol="paper", occlusion_counts=(0, 1)))
    assert json.loads((tmp_path / "run.json").read_text())["settings"]["config"]["pad_token_id"] == 7
    bench(tmp_path / "own", explainer=ex, config=EvalConfig(pad_token_id=3, occlusion_counts=(0, 1)))
    assert json.loads((tmp_path / "own" / "run.json").read_text())["settings"]["config"]["pad_token_id"] == 3



@pytest.mark.parametrize("name", ["examples.jsonl", "summary.json", "records.jsonl"])
def test_results_files_without_their_run_file_are_not_resumed(tmp_path, name):
    """Rows of another run or task (no run.json beside them) would be counted as this run's: refused; a fresh start
    (resume=False) clears the benchmark's own files."""
    (tmp_path / name).write_text('{"index": 0, "method": "grads", "metrics": {"aopc": 0.999}}\n')
    with pytest.raises(InputError, match=f"holds {name} but no run.json"):
        bench(tmp_path)
    if name != "records.jsonl":
        summary, ex = bench(tmp_path, resume=False)
        assert ex.explained == 22 and (tmp_path / "run.json").exists()

def test_attcat_code_protocol_explains_the_gold_class(tmp_path):
    summary, _ = bench(tmp_path, config=EvalConfig(protocol="attcat-code", occlusion_counts=(0, 1)))
    rows = [json.loads(x) for x in (tmp_path / "examples.jsonl").read_text().splitlines()]
    assert all(r["target"] == r["label"] for r in rows)
    assert json.loads((tmp_path / "run.json").read_text())["settings"]["target"] == "gold"  # as it is done
    assert any(r["target"] != r["predicted"] for r in rows)
    assert len(summary["curves"]["aopc"]["grads"]["fractions"]) == 9
    vals = [r["metrics"]["aopc"] for r in rows if r["method"] == "grads"]
    assert all(v is None or v >= 0 for v in vals)  # |p0 - pk|
    assert any(v is None for v in vals)  # inputs under 10 tokens are skipped


def test_bad_requests(tmp_path):
    ds = dataset()
    with pytest.raises(InputError, match="unknown method"):
        run_benchmark(FakeExplainer(), ds, tmp_path, methods="nope", predict=linear_predict, progress=False)
    with pytest.raises(InputError, match="unknown metric"):
        run_benchmark(FakeExplainer(), ds, tmp_path, methods="grads", metrics="aopc,auc", predict=linear_predict)
    three = Dataset("toy3", "dev", "pair", ds.examples, ["a", "b", "c"])
    with pytest.raises(InputError, match="3 classes"):
        run_benchmark(FakeExplainer(), three, tmp_path, methods="grads", predict=linear_predict)
    qa = Dataset("squad", "dev", "qa", [Example("q", ["q?", "ctx"], None, [])])  # with a classifier
    with pytest.raises(InputError, match="QA data set but the model is a sequence classifier"):
        run_benchmark(FakeExplainer(), qa, tmp_path, methods="grads")


def test_a_run_given_as_a_record_equals_the_same_run_given_as_keywords(tmp_path):
    """A :class:`BenchmarkRun` and keyword arguments are two spellings of one run: the same summary; a keyword
    replaces the record's field; a keyword that is no field is refused as Python refuses one."""
    keywords, _ = bench(tmp_path / "kw")
    run = BenchmarkRun(methods="rawatt,grads,attcat", metrics=METRICS, predict=linear_predict, progress=False,
                       chunk_size=3, config=CONFIG)
    record = run_benchmark(FakeExplainer(), dataset(), tmp_path / "run", run)
    assert json.dumps(record["results"], sort_keys=True) == json.dumps(keywords["results"], sort_keys=True)
    assert record["n_examples"] == keywords["n_examples"] == 11
    grads_only = run_benchmark(FakeExplainer(), dataset(), tmp_path / "grads", run, methods="grads")
    assert grads_only["methods"] == ["grads"] and run.methods == "rawatt,grads,attcat"
    assert grads_only["results"]["grads"] == keywords["results"]["grads"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'metric'"):
        run_benchmark(FakeExplainer(), dataset(), tmp_path / "typo", run, metric="aopc")
    assert not (tmp_path / "typo").exists()


# ----------------------------------------------------------- real model (slow)
MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "minilm-sst2"


def _cli(argv):
    from attnlens.cli import benchmark

    parser = argparse.ArgumentParser()
    benchmark.add_parser(parser.add_subparsers())
    return benchmark.run(parser.parse_args(["benchmark", *argv]))


@pytest.mark.slow
@needs(MODEL.is_dir(), "reference model not found")
def test_real_model_command_and_scoring(tmp_path, capsys):
    import torch

    from attnlens.evaluation import ModelPredictor
    from attnlens.explainer import Explainer
    from attnlens.results.explanation import load_explanations

    torch.set_num_threads(1)
    out = tmp_path / "res"
    rc = _cli(["--model", str(MODEL), "--dataset", "sst2", "--limit", "6", "--methods", "rawatt,agrad",
               "--metrics", "all", "--occlusion-max", "4", "--out", str(out), "--quiet", "--threads", "1"])
    assert rc == 0 and "| method |" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_examples"] == 6 and summary["results"]["rawatt"]["kendall"] is None
    for m in ("rawatt", "agrad"):
        c = summary["consistency"][m]
        assert len(c["points"]) == len(c["labels"]) == len(c["tokens"]) == 5 * c["n_examples"]
        assert -1 <= summary["results"][m]["aopc"] <= 1
    # our SDPA scorer agrees with the explainer's eager predict_proba on perturbed ids
    ex = Explainer.from_pretrained(str(MODEL))
    exps = [e for e in load_explanations(out / "explanations.jsonl") if e.meta["benchmark_role"] == "explained"]
    vs = [Variant.of(e.input_ids, e.token_type_ids) for e in exps]
    vs += [Variant(v.input_ids[:-2] + v.input_ids[-1:], v.token_type_ids[:-1], None) for v in vs]
    vs += [Variant(v.input_ids, v.token_type_ids, (1, 0) + (1,) * (len(v) - 2)) for v in vs[:6]]
    ours = ModelPredictor(ex.model, ex.pad_id, batch_size=4)(vs)
    theirs = ex.predict_proba([list(v.input_ids) for v in vs], [list(v.token_type_ids) for v in vs],
                              [list(v.attention_mask or [1] * len(v)) for v in vs])
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
    assert ex.model.config._attn_implementation == "eager"  # restored after scoring
    np.testing.assert_allclose(ours[:6].argmax(1), [e.predicted for e in exps])


def test_model_predictor_on_a_tiny_bert():
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from attnlens.evaluation import ModelPredictor

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                     num_labels=3, attn_implementation="eager")
    model = BertForSequenceClassification(cfg).train()  # training mode must survive scoring
    vs = [Variant.of([1, 5, 6, 7, 2], [0, 0, 0, 1, 1]), Variant.of([1, 9, 2], [0, 0, 0]),
          Variant((1, 5, 6, 7, 2), (0, 0, 0, 1, 1), (1, 0, 1, 1, 1))]
    ours = ModelPredictor(model, 0, batch_size=2)(vs)
    assert model.training and model.config._attn_implementation == "eager"
    model.eval()
    with torch.no_grad():
        for v, row in zip(vs, ours):
            mask = torch.tensor([v.attention_mask or [1] * len(v)])
            want = model(torch.tensor([v.input_ids]), attention_mask=mask,
                         token_type_ids=torch.tensor([v.token_type_ids])).logits.softmax(-1)[0]
            np.testing.assert_allclose(row, want.numpy(), atol=1e-6)
        states = ModelPredictor(model, 0).hidden_states(vs[:2], [[1, 3], [1]])
        full = model(torch.tensor([vs[0].input_ids]), token_type_ids=torch.tensor([vs[0].token_type_ids]),
                     output_hidden_states=True).hidden_states[-1][0]
        np.testing.assert_allclose(states[0], full[[1, 3]].numpy(), atol=1e-5)
        assert states[1].shape == (1, 16)


TOKENIZER = MODEL  # the reference model's WordPiece tokenizer (a fast tokenizer with offsets)


@needs(MODEL.is_dir(), "reference tokenizer not found")
def test_qa_precision_at_k_with_a_tiny_qa_model(tmp_path):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForQuestionAnswering

    from attnlens.explainer import Explainer
    from attnlens.results.explanation import load_explanations

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, attn_implementation="eager")
    ex = Explainer(BertForQuestionAnswering(cfg), tok)
    ctx = "The Normans were a people who in the 10th and 11th centuries gave their name to Normandy in France."
    examples = [
        Example("a", ["In what country is Normandy located?", ctx], None,
                [{"text": "France", "answer_start": ctx.index("France")}]),
        Example("b", ["When were the Normans in Normandy?", ctx], None,
                [{"text": "10th and 11th centuries", "answer_start": ctx.index("10th")}]),
        Example("c", ["Who ruled Mars?", ctx], None, []),  # unanswerable (SQuAD v2)
    ]
    ds = Dataset("squad_v2", "dev", "qa", examples)
    for wrong in ({"target": "gold"}, {"config": EvalConfig(protocol="attcat-code")}):  # it explains its own span
        with pytest.raises(InputError, match="a QA model is benchmarked on the answer span it predicts"):
            run_benchmark(ex, ds, tmp_path / "x", methods="grads", progress=False, **wrong)
    assert not (tmp_path / "x").exists()
    summary = run_benchmark(ex, ds, tmp_path, methods="all", progress=False, config=EvalConfig(precision_k=5))
    assert list(summary["metrics"]) == ["precision_at_k"]
    assert {"partiallrp", "transatt", "decompx", "attcat"} <= set(summary["methods"])  # every method applies
    exps = [e for e in load_explanations(tmp_path / "explanations.jsonl") if e.meta["benchmark_role"] == "explained"]
    rows = [json.loads(x) for x in (tmp_path / "examples.jsonl").read_text().splitlines()]
    sizes = []
    for m in ("attcat", "grads"):
        values = []
        for e, exm in zip(exps, examples):
            row = next(r for r in rows if r["method"] == m and r["id"] == exm.id)
            if not exm.answers:
                assert row["metrics"]["precision_at_k"] is None
                continue
            a = exm.answers[0]
            lo, hi = a["answer_start"], a["answer_start"] + len(a["text"])
            gold = {i for i, (s, t) in enumerate(e.offsets)
                    if e.sequence_ids[i] == 1 and not e.special[i] and s < hi and t > lo}
            answer = " ".join(e.tokens[i] for i in sorted(gold)).replace(" ##", "")
            assert answer in ("france", "10th and 11th centuries")
            scores = e.scores[m]
            top = sorted((i for i in range(len(scores)) if not e.special[i]), key=lambda i: -scores[i])[:5]
            values.append(len(gold & set(top)))
            sizes.append(len(gold))
            assert row["metrics"]["precision_at_k"] == values[-1]
        assert summary["results"][m]["precision_at_k"] == pytest.approx(np.mean(values))
    assert summary["curves"]["precision_at_k"]["answer_tokens"] == pytest.approx(np.mean(sizes))
    short = Explainer(ex.model, tok, max_length=16)  # cuts the context before "France"
    with pytest.warns(UserWarning, match=r"1 question \(id a\) lost its gold answer to truncation"):
        cut = run_benchmark(short, Dataset("squad", "dev", "qa", examples[:1]), tmp_path / "cut", methods="grads",
                            progress=False, config=EvalConfig(precision_k=5))
    assert cut["results"]["grads"]["precision_at_k"] is None  # left out, not counted as 0
    with pytest.raises(InputError, match="precision_at_k only"):
        run_benchmark(ex, ds, tmp_path / "x", methods="grads", metrics="aopc", progress=False)
    with pytest.raises(InputError, match="classification data set but the model is an extractive QA"):
        run_benchmark(ex, dataset(), tmp_path / "y", methods="grads", progress=False)


@needs(MODEL.is_dir(), "reference tokenizer not found")
def test_qa_command(tmp_path, capsys):
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForQuestionAnswering

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32)
    BertForQuestionAnswering(cfg).save_pretrained(tmp_path / "qa")
    tok.save_pretrained(tmp_path / "qa")
    ctx = "Paris is the capital of France."
    (tmp_path / "mini.json").write_text(json.dumps({"data": [{"paragraphs": [{"context": ctx, "qas": [
        {"id": "q1", "question": "Where is Paris?", "answers": [{"text": "France", "answer_start": 24}]}]}]}]}))
    rc = _cli(["--model", str(tmp_path / "qa"), "--dataset", str(tmp_path / "mini.json"), "--methods", "grads,attcat",
               "--k", "3", "--out", str(tmp_path / "res"), "--quiet"])
    assert rc == 0 and "precision_at_k" in capsys.readouterr().out
    summary = json.loads((tmp_path / "res" / "summary.json").read_text())
    assert summary["config"]["precision_k"] == 3 and summary["curves"]["precision_at_k"]["answer_tokens"] == 1


def test_the_predictor_batches_long_variants_within_its_memory_budget():
    """Short variants go in batches of ``batch_size``; long ones in as many rows as the budget holds by the
    estimate of a forward without gradients, with the same probabilities as one large batch."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from attnlens.core.memory import Storage, model_dims, parse_budget, pass_row_bytes
    from attnlens.evaluation import ModelPredictor

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=50, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                     max_position_embeddings=1600, num_labels=2)
    model = BertForSequenceClassification(cfg).eval()
    long = [Variant.of([1] + [5 + i % 40 for i in range(1500 + j)] + [2], [0] * (1502 + j)) for j in range(40)]
    short = [Variant.of([1, 5, 6, 2], [0, 0, 0, 0])] * 8
    rows: list[tuple[int, int]] = []
    model.register_forward_hook(lambda _m, args, kwargs, _out: rows.append(tuple(kwargs["input_ids"].shape)),
                                with_kwargs=True)
    budget = parse_budget("64MiB")
    ours = ModelPredictor(model, 0, batch_size=64, memory_budget=budget)(short + long)
    dims = model_dims(model)
    assert all(b * pass_row_bytes(dims, n, Storage(eager=False)) <= budget for b, n in rows)
    assert len(rows) > 3 and sum(b for b, _ in rows) == 48 and max(b for b, _ in rows) < 48
    rows.clear()
    whole = ModelPredictor(model, 0, batch_size=64, memory_budget=parse_budget("64GiB"))(short + long)
    assert len(rows) == 1 and rows[0][0] == 48
    np.testing.assert_allclose(ours, whole, atol=1e-6)


def test_the_predictors_forwards_build_no_key_value_cache():
    """Scoring perturbed inputs (probabilities and hidden states) reuses no cache: a GPT-2 classifier returns
    none, where its own default builds one for every layer."""
    import torch
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from attnlens.evaluation import ModelPredictor

    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                                     pad_token_id=0, num_labels=2)).eval()
    caches: list[object] = []
    model.transformer.register_forward_hook(lambda _m, _a, out: caches.append(out.past_key_values))
    with torch.no_grad():
        model(torch.tensor([[1, 5, 6, 2]]))
    assert caches.pop() is not None  # the model's default
    vs = [Variant.of([1, 5, 6, 7, 2]), Variant.of([1, 9, 2])]  # no token types, as GPT-2 tokenizers make
    predictor = ModelPredictor(model, 0, batch_size=2)
    probabilities = predictor(vs)
    predictor.hidden_states(vs, [[1], [1]])
    assert caches == [None, None]
    with torch.no_grad():
        want = [model(torch.tensor([v.input_ids])).logits.softmax(-1)[0].numpy() for v in vs]
    np.testing.assert_allclose(probabilities, want, atol=1e-6)


def test_gold_target_explains_the_label_and_tracks_its_probability(tmp_path):
    summary, _ = bench(tmp_path, target="gold")
    rows = [json.loads(x) for x in (tmp_path / "examples.jsonl").read_text().splitlines()]
    assert all(r["target"] == r["label"] for r in rows) and any(r["target"] != r["predicted"] for r in rows)
    # AOPC of grads by hand: delete the gold class's top tokens, track p(gold), where the prediction differs too
    data = dataset()
    for r in rows:
        if r["method"] != "grads" or r["target"] == r["predicted"]:
            continue
        ids = [CLS, *(VOCAB[w] for w in data[r["index"]].text.split()), SEP]
        sign = 1.0 if r["target"] == 1 else -1.0
        w = np.array([sign * WEIGHT.get(t, 0.0) for t in ids])
        order = sorted(range(1, len(ids) - 1), key=lambda i: -w[i])
        n = len(ids) - 2

        def p_target(kept, target=r["target"]):
            p = p1(kept)
            return p if target == 1 else 1 - p

        drops = [p_target(ids) - p_target([t for i, t in enumerate(ids)
                                           if i not in order[:int(np.round(k / 10 * n))]]) for k in range(11)]
        assert r["metrics"]["aopc"] == pytest.approx(np.mean(drops)), r["index"]
    assert json.loads((tmp_path / "run.json").read_text())["settings"]["target"] == "gold"
    with pytest.raises(InputError, match="other settings"):
        bench(tmp_path)  # same directory, other target
    with pytest.raises(InputError, match="'predicted' or 'gold'"):
        bench(tmp_path / "x", target="label")


class _NamedExplainer(FakeExplainer):
    def __init__(self, labels):
        super().__init__()
        self.labels = labels


def test_gold_labels_follow_the_models_class_names_not_the_data_sets_order(tmp_path):
    """A checkpoint that names the data set's classes in another order is given gold labels renumbered by name,
    with a warning; the same names in another case change nothing; other names are read as indices, with a
    warning."""
    data = dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        run_benchmark(_NamedExplainer(["NEGATIVE", "Positive"]), data, tmp_path / "same", methods="rawatt",
                      metrics="aopc", predict=linear_predict, progress=False, target="gold")
    with pytest.warns(UserWarning, match="the model orders its classes positive, negative, dataset toy negative, "
                      "positive: gold labels are renumbered by name"):
        run_benchmark(_NamedExplainer(["positive", "negative"]), data, tmp_path / "swapped", methods="rawatt",
                      metrics="aopc", predict=linear_predict, progress=False, target="gold")
    rows = [json.loads(x) for x in (tmp_path / "swapped" / "examples.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["method"] == "rawatt"]
    assert [r["label"] for r in rows] == [1 - e.label for e in data.examples]
    assert all(r["target"] == r["label"] for r in rows)
    with pytest.warns(UserWarning, match="names its classes negative, positive, the model bad, good: gold labels "
                      "are read as the model's class indices"):
        run_benchmark(_NamedExplainer(["bad", "good"]), data, tmp_path / "other", methods="rawatt",
                      metrics="aopc", predict=linear_predict, progress=False, target="gold")


@pytest.mark.parametrize("blank", ["", "   ", ["a question", " "]])
def test_a_blank_text_is_refused_before_anything_is_written(tmp_path, blank):
    examples = [*dataset(5).examples, Example("seven", blank, 1)]
    data = Dataset("toy", "dev", "classification", examples, ["negative", "positive"])
    which = "'s second text" if isinstance(blank, list) else ""
    with pytest.raises(InputError, match=rf"^dataset toy: example seven{which} is empty or whitespace only$"):
        run_benchmark(FakeExplainer(), data, tmp_path / "out", methods="rawatt", metrics="aopc",
                      predict=linear_predict, progress=False, chunk_size=2)
    assert not (tmp_path / "out").exists()


class _WarningExplainer(FakeExplainer):
    """Warns of the last input of every call by its position in the call, as the encoder does of truncation."""

    def explain(self, texts, methods, **kw):
        warnings.warn(f"1 input(s) were truncated (input {len(texts) - 1}: 3 tokens dropped)", stacklevel=2)
        if any("awful awful" in t for t in texts):
            raise InputError(f"input {len(texts) - 1} is too long")
        return super().explain(texts, methods, **kw)


def test_warnings_and_errors_name_the_example_not_its_place_in_a_chunk(tmp_path):
    data = dataset(5)
    with pytest.warns(UserWarning) as caught:
        run_benchmark(_WarningExplainer(), data, tmp_path, methods="rawatt", metrics="aopc", predict=linear_predict,
                      progress=False, chunk_size=2)
    named = {str(w.message) for w in caught if "truncated" in str(w.message)}
    assert named == {f"1 input(s) were truncated (example {i}: 3 tokens dropped)" for i in ("1", "3", "4")}
    bad = Dataset("toy", "dev", "classification", [*data.examples, Example("x9", "awful awful", 0)],
                  ["negative", "positive"])
    with pytest.raises(InputError, match=r"^example x9 is too long$"):
        run_benchmark(_WarningExplainer(), bad, tmp_path / "bad", methods="rawatt", metrics="aopc",
                      predict=linear_predict, progress=False, chunk_size=2)


def test_starting_over_clears_the_report_of_the_results_it_replaces(tmp_path):
    bench(tmp_path)
    (tmp_path / "report.html").write_text("<p>rollout</p>")  # attnlens report's page of the old results
    bench(tmp_path, resume=False)
    assert not (tmp_path / "report.html").exists() and (tmp_path / "summary.json").exists()
