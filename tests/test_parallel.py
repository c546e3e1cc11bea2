"""The data-parallel benchmark: shards of chunks, their merge, resuming after a process dies, and two real
processes (gloo) through ``attnlens benchmark --processes 2``; the merged results must equal a one-process run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import WORDS, make_model, make_tokenizer

from attnlens import Explainer
from attnlens.data import Dataset, Example
from attnlens.errors import InputError
from attnlens.evaluation import EvalConfig, run_benchmark
from attnlens.evaluation.parallel import Shard, chunks

METHODS = "rawatt,grads,attcat"
METRICS = "aopc,lodds,kendall,consistency"
CONFIG = EvalConfig(occlusion_counts=(0, 1, 2, 4))
N, CHUNK = 14, 3
SRC = Path(__file__).resolve().parents[1] / "src"


def toy_dataset(n: int = N) -> Dataset:
    rng = np.random.default_rng(3)
    examples = [Example(str(i), " ".join(rng.choice(WORDS, size=int(rng.integers(3, 12)))), i % 2) for i in range(n)]
    return Dataset("toy", "dev", "classification", examples, ["negative", "positive"])


class Counting(Explainer):
    """An explainer that counts the inputs it explains."""

    explained = 0

    def explain(self, texts, *args, **kwargs):
        self.explained += len(texts)
        return super().explain(texts, *args, **kwargs)


@pytest.fixture
def explainer(tokenizer):
    return Counting(make_model("bert", seed=4), tokenizer)


def bench(explainer, out: Path, **kw):
    return run_benchmark(explainer, toy_dataset(), out, methods=METHODS, metrics=METRICS, config=CONFIG,
                         chunk_size=CHUNK, batch_size=2, eval_batch_size=8, progress=False, **kw)


def files(out: Path) -> dict[str, str]:
    return {name: (out / name).read_text() for name in ("examples.jsonl", "explanations.jsonl", "table.md",
                                                          "table.csv")}


def same_results(a: dict, b: dict) -> None:
    for key in ("results", "curves", "consistency", "n_examples", "accuracy", "methods", "metrics"):
        assert a[key] == b[key], key


@pytest.fixture
def single(tokenizer, tmp_path):
    summary = bench(Counting(make_model("bert", seed=4), tokenizer), tmp_path / "single")
    return summary, files(tmp_path / "single")


# ------------------------------------------------------------------ shards
def test_every_example_in_exactly_one_shard():
    for n, size, count in ((14, 3, 2), (14, 3, 4), (5, 16, 3), (1, 1, 2)):
        shards = [chunks(n, size, Shard(r, count)) for r in range(count)]
        flat = [i for shard in shards for chunk in shard for i in chunk]
        assert sorted(flat) == list(range(n))
        for r, shard in enumerate(shards):  # chunk c (examples c*size ..) goes to process c % count
            assert all(chunk[0] // size % count == r and chunk == list(range(chunk[0], chunk[0] + len(chunk)))
                       for chunk in shard)
    assert chunks(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize("text", ["2/2", "-1/2", "a/b", "1", "1/0", ""])
def test_bad_shards(text):
    with pytest.raises(InputError, match="RANK/COUNT"):
        Shard.parse(text)


def test_shards_merge_to_the_single_process_run(explainer, tmp_path, single):
    out = tmp_path / "par"
    first = bench(explainer, out, shard=Shard(1, 2))
    assert first["timing"]["complete"] is False and first["n_examples"] == 6  # chunks 1, 3: examples 3-5, 9-11
    assert not (out / "shards").exists()  # merged and removed
    merged = bench(explainer, out, shard=Shard(0, 2))
    assert merged["timing"]["complete"] is True
    same_results(merged, single[0])
    assert files(out) == single[1]  # bit for bit: every chunk explained and scored as in one process


def test_a_shard_that_died_resumes_and_only_missing_examples_are_computed(explainer, tmp_path, single,
                                                                          monkeypatch):
    import attnlens.evaluation.runner as runner

    out = tmp_path / "par"
    finish = runner._finish
    monkeypatch.setattr(runner, "_finish", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # killed after its first chunk, before merging
        bench(explainer, out, shard=Shard(0, 2), stop_after=3)
    monkeypatch.setattr(runner, "_finish", finish)
    with (out / "shards" / "0-of-2" / "examples.jsonl").open("a") as f:
        f.write('{"index": 6, "method": "grads", "metr')  # a line torn by the kill
    partial = bench(explainer, out, shard=Shard(1, 2))  # merges its own and what the dead one finished
    assert partial["n_examples"] == 3 + 6 and not (out / "shards").exists()
    before = explainer.explained
    done = bench(explainer, out, shard=Shard(0, 2))  # the rerun of the dead one
    # examples 6-8 and 12-13, each explained for its predicted class and once more for the other class (kendall)
    assert explainer.explained - before == 2 * 5
    same_results(done, single[0])
    assert files(out) == single[1]


def test_one_process_finishes_a_parallel_run(explainer, tmp_path, single):
    out = tmp_path / "par"
    bench(explainer, out, shard=Shard(2, 3))  # chunk 2: examples 6-8
    before = explainer.explained
    bench(explainer, out, shard=Shard(0, 3), stop_after=2)  # stopped mid-chunk: examples 0, 1
    assert explainer.explained - before == 2 * 2
    before = explainer.explained
    summary = bench(explainer, out)  # one process, resuming
    assert explainer.explained - before == 2 * (N - 3 - 2)
    assert not (out / "shards").exists()
    # chunk 0 was finished in two parts (other batches), so only up to float rounding here
    assert summary["n_examples"] == N and summary["results"].keys() == single[0]["results"].keys()
    for m, values in summary["results"].items():
        for k, v in values.items():
            want = single[0]["results"][m][k]
            assert v is want is None or v == pytest.approx(want, rel=1e-5, abs=1e-9), (m, k)


def test_a_merge_writes_the_runs_settings_before_any_results_file(explainer, tmp_path, monkeypatch):
    """Another process of the run starting while a shard merges finds out/run.json beside the results files (it
    refuses results files without one: the two processes raced)."""
    from attnlens.evaluation import runner

    out, seen = tmp_path / "run", []
    original = runner.rewrite_rows

    def rewrite(path, rows):
        seen.append((path.name, (out / "run.json").exists()))
        return original(path, rows)

    monkeypatch.setattr(runner, "rewrite_rows", rewrite)
    bench(explainer, out, shard=Shard(1, 2))
    merged = [w for w in seen if w[0] in ("examples.jsonl", "explanations.jsonl")]
    assert merged and all(exists for _, exists in merged)


def test_a_shard_of_another_run_is_refused(explainer, tmp_path):
    out = tmp_path / "par"
    bench(explainer, out, shard=Shard(0, 2), stop_after=3)
    with pytest.raises(InputError, match="other settings"):
        run_benchmark(explainer, toy_dataset(), out, methods="rawatt", metrics=METRICS, config=CONFIG,
                      chunk_size=CHUNK, progress=False, shard=Shard(1, 2))
    with pytest.raises(InputError, match="other settings"):
        run_benchmark(explainer, toy_dataset(), out, methods="rawatt", metrics=METRICS, config=CONFIG,
                      chunk_size=CHUNK, progress=False, check_only=True)


def test_shards_of_another_chunk_size_are_refused_and_one_process_completes_any_shards_work(explainer, tmp_path,
                                                                                            single):
    """Shards share out chunks: one cut into other chunks would leave examples in no shard's plan. A run of one
    process may complete the run whatever its chunks."""
    out = tmp_path / "par"
    bench(explainer, out, shard=Shard(0, 2))
    with pytest.raises(InputError, match=r"other settings \(chunk_size\)"):
        run_benchmark(explainer, toy_dataset(), out, methods=METHODS, metrics=METRICS, config=CONFIG,
                      chunk_size=CHUNK + 1, batch_size=2, eval_batch_size=8, progress=False, shard=Shard(1, 2))
    done = run_benchmark(
        explainer, toy_dataset(), out, methods=METHODS, metrics=METRICS, config=CONFIG, chunk_size=CHUNK + 1,
        batch_size=2, eval_batch_size=8, progress=False)
    assert done["timing"]["complete"] is True and done["n_examples"] == single[0]["n_examples"]


def test_check_only_writes_nothing(explainer, tmp_path):
    assert bench(explainer, tmp_path / "x", check_only=True) is None
    assert not (tmp_path / "x").exists() and explainer.explained == 0


# ------------------------------------------------------------------ two processes
def test_two_processes_equal_one(tmp_path, monkeypatch, capsys):
    """``--processes 2``: two worker processes (accelerate's PartialState, gloo) and one merge."""
    from attnlens.cli import main

    model = tmp_path / "model"
    make_model("bert", seed=4).save_pretrained(model)
    make_tokenizer().save_pretrained(model)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": e.text, "label": e.label}) + "\n" for e in toy_dataset()))
    common = ["benchmark", "--model", str(model), "--dataset", str(data), "--methods", METHODS, "--metrics",
              "aopc,lodds,kendall", "--chunk-size", str(CHUNK), "--batch-size", "2", "--quiet", "--threads", "1"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    assert main([*common, "--out", str(tmp_path / "shard"), "--shard", "0/2"]) == 0
    assert "shard" not in capsys.readouterr().err  # --quiet: no notices
    monkeypatch.setenv("PYTHONPATH", str(SRC))  # the workers import this checkout
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert main([*common, "--out", str(tmp_path / "two"), "--processes", "2"]) == 0
    captured = capsys.readouterr()
    assert "with 2 processes" in captured.out and captured.out.count("| attcat |") == 1  # one table
    assert files(tmp_path / "two") == files(tmp_path / "one")
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    same_results(a, b)
    assert not (tmp_path / "two" / "shards").exists()
    assert main([*common, "--out", str(tmp_path / "two"), "--processes", "2", "--shard", "0/2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "attnlens: error: --processes, --shard and accelerate launch each split the run: use one of them")


def test_a_failed_process_is_one_line(tmp_path, monkeypatch):
    import attnlens.evaluation.parallel as parallel

    monkeypatch.setattr(parallel.sys, "executable", "false")  # every worker exits with status 1
    with pytest.raises(InputError, match=r"^2 of 2 benchmark processes failed \(rank 0, 1; exit status 1, 1\); "
                                         "the finished examples are saved: run the same command again to resume$"):
        parallel.launch(["benchmark"], 2, 1)


def test_a_shard_removed_by_a_merge_is_made_again(tmp_path, monkeypatch):
    import attnlens.evaluation.parallel as parallel

    directory = tmp_path / "out" / "shards" / "0-of-2"
    real = parallel.results_lock
    calls = []

    def vanishing(path, wait=False):  # the first time, a merge removes the directory between mkdir and lock
        calls.append(path)
        if len(calls) == 1:
            path.rmdir()
        return real(path, wait=wait)

    monkeypatch.setattr(parallel, "results_lock", vanishing)
    with parallel.shard_lock(directory):
        assert (directory / ".lock").is_file()
    assert len(calls) == 2 and not (directory / ".lock").exists()


def test_a_shard_appended_after_the_merge_read_it_is_not_removed(tmp_path):
    """A process appends a chunk between its chunks without the shard's lock: a merge that read the shard before
    that append must not remove it (the new chunk would be lost); it is merged and removed by a later merge."""
    from attnlens.evaluation.parallel import Shard, merge_sources

    out = tmp_path / "out"
    shard = Shard.parse("1/2").directory(out)
    shard.mkdir(parents=True)
    for name in ("examples.jsonl", "explanations.jsonl"):
        (shard / name).write_text("")
    merged = merge_sources(out, {}, [], chunk_size=2)
    assert merged.shards == [shard] and merged.unchanged(shard)
    with (shard / "examples.jsonl").open("a") as f:
        f.write(json.dumps({"index": 2}) + "\n")
    assert not merged.unchanged(shard)
    assert merge_sources(out, {}, [], chunk_size=2).unchanged(shard)
