"""``attnlens benchmark`` never loses or mixes results and answers a mistake in one line.

Covers the results-folder lock (two processes), validation before anything is written, cumulative
``timing.seconds`` across a SIGKILL, per-chunk writing, and the bad inputs of ``benchmark`` and ``report``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_model, make_tokenizer
from test_benchmark import CONFIG, METRICS, FakeExplainer, bench, dataset, linear_predict

from attnlens.cli import main
from attnlens.errors import InputError
from attnlens.evaluation.results import LOCK_FILE, read_rows, results_lock
from attnlens.evaluation.runner import run_benchmark

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
ROWS = [{"text": "the movie was good", "label": 1}, {"text": "boring plot and bad actors", "label": 0},
        {"text": "i loved this film", "label": 1}]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny BERT classifier saved with save_pretrained, and a 3-example JSONL data file."""
    root = tmp_path_factory.mktemp("tiny")
    make_model("bert").save_pretrained(root / "model")
    make_tokenizer().save_pretrained(root / "model")
    return root / "model", _jsonl(root / "data.jsonl", ROWS)


def _bench(tiny, out, *extra: str) -> int:
    model, data = tiny
    return main(["benchmark", "--model", str(model), "--dataset", str(data), "--methods", "grads,attcat",
                 "--metrics", "aopc", "--quiet", "--threads", "1", "--out", str(out), *extra])


def _holder(out: Path) -> subprocess.Popen:
    """Another process that holds the lock of ``out`` until killed (prints 'locked' once it holds it)."""
    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from attnlens.evaluation.results import results_lock
        with results_lock(Path({str(out)!r})):
            print("locked", flush=True)
            time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


# ----------------------------------------------------------------------------- lock
def test_second_writer_gets_one_line_naming_the_pid_and_a_killed_holders_lock_is_taken_over(tiny, tmp_path, capsys):
    out = tmp_path / "res"
    out.mkdir()
    proc = _holder(out)
    try:
        assert _bench(tiny, out) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"being written by another benchmark (pid {proc.pid})" in err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]  # nothing written, nothing mixed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert (out / LOCK_FILE).read_text().strip() == str(proc.pid)  # stale lock file of a dead process
    assert _bench(tiny, out) == 0  # taken over
    assert not (out / LOCK_FILE).exists()  # released (and removed) at the end
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_examples"] == 3
    assert len((out / "examples.jsonl").read_text().splitlines()) == 3 * 3


def test_lock_is_held_during_the_run_and_released_on_errors(tmp_path):
    seen = []

    def predict(variants):
        seen.append((tmp_path / LOCK_FILE).read_text().strip())
        with pytest.raises(InputError, match=f"pid {os.getpid()}"), results_lock(tmp_path):
            pass  # a second writer, in the same process, is refused too (flock is per open file)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_benchmark(FakeExplainer(), dataset(), tmp_path, methods="grads", metrics="aopc", predict=predict,
                      progress=False)
    assert seen == [str(os.getpid())] and not (tmp_path / LOCK_FILE).exists()
    with results_lock(tmp_path):  # free again
        assert (tmp_path / LOCK_FILE).read_text().strip() == str(os.getpid())


# ------------------------------------------------------------ validate, then write
@pytest.mark.parametrize("options, message", [
    ('{"attcat": {"alpah": "cls"}}', "method 'attcat' has no option alpah"),
    ('{"attcat": {"alpha": "clss"}}', "alpha='clss'; choose one of mean, cls"),
    ('{"atcat": {"alpha": "cls"}}', "options given for 'atcat', which is not among the benchmarked methods"),
    ('{"attcat": "cls"}', "must map method ids to option objects"),
])
def test_option_typo_writes_nothing_and_the_corrected_command_runs(tiny, tmp_path, capsys, options, message):
    out = tmp_path / "res"
    assert _bench(tiny, out, "--options", options) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err
    assert not (out / "run.json").exists() and not out.exists()
    assert _bench(tiny, out, "--options", '{"attcat": {"alpha": "cls"}}') == 0
    run = json.loads((out / "run.json").read_text())
    assert run["settings"]["explain_options"] == {"attcat": {"alpha": "cls"}}
    exp = json.loads((out / "explanations.jsonl").read_text().splitlines()[0])
    assert exp["meta"]["options"]["attcat"]["alpha"] == "cls"  # and the option was used


# ------------------------------------------------------------ kill, resume, chunks
KILLED_RUN = """
import os, signal, sys, time
sys.path[:0] = [{tests!r}, {src!r}]
from test_benchmark import CONFIG, METRICS, FakeExplainer, dataset, linear_predict
from attnlens.evaluation.runner import run_benchmark
calls = 0
def predict(variants):
    global calls
    calls += 1
    if calls == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    return linear_predict(variants)
run_benchmark(FakeExplainer(), dataset(), {out!r}, methods="rawatt,grads,attcat", metrics=METRICS, config=CONFIG,
              predict=predict, progress=False, chunk_size=3)
"""


def test_seconds_stay_cumulative_and_results_equal_across_a_sigkill(tmp_path):
    full, _ = bench(tmp_path / "full")
    out = tmp_path / "killed"
    code = KILLED_RUN.format(tests=str(TESTS), src=str(SRC), out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == -signal.SIGKILL
    first = json.loads((out / "run.json").read_text())["seconds"]
    assert first >= 0.4  # the two finished chunks' scoring (0.2 s each) was recorded before the kill
    rows = [json.loads(x) for x in (out / "examples.jsonl").read_text().splitlines()]
    assert len({r["index"] for r in rows}) == 6  # two chunks of 3 kept: a kill loses one chunk at most
    t0 = time.perf_counter()
    resumed, ex = bench(out)
    assert resumed["timing"]["seconds"] >= first
    assert resumed["timing"]["seconds"] <= first + (time.perf_counter() - t0) + 1e-6
    assert ex.explained == 22 - 2 * 9  # the killed third chunk's explanations were on disk too: reused
    assert resumed["results"] == full["results"] and resumed["curves"] == full["curves"]
    assert resumed["n_examples"] == full["n_examples"] == 11


def test_default_chunk_writes_every_16_examples_and_progress_moves(tmp_path, capsys):
    calls = []

    def predict(variants):
        calls.append(len(variants))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return linear_predict(variants)

    with pytest.raises(KeyboardInterrupt):
        run_benchmark(FakeExplainer(), dataset(20), tmp_path, methods="grads", metrics="aopc", predict=predict,
                      progress=True)
    rows = [json.loads(x) for x in (tmp_path / "examples.jsonl").read_text().splitlines()]
    assert sorted({r["index"] for r in rows}) == list(range(16))  # written before the interruption
    assert "16/20" in capsys.readouterr().err  # the bar advanced with the written chunk
    assert json.loads((tmp_path / "run.json").read_text())["seconds"] > 0
    summary = run_benchmark(FakeExplainer(), dataset(20), tmp_path, methods="grads", metrics="aopc",
                            predict=linear_predict, progress=False)
    assert summary["n_examples"] == 20


def test_chunk_size_option(tiny, tmp_path):
    assert _bench(tiny, tmp_path / "res", "--chunk-size", "1") == 0
    assert json.loads((tmp_path / "res" / "summary.json").read_text())["n_examples"] == 3
    with pytest.raises(InputError, match="chunk_size must be a positive number"):
        run_benchmark(FakeExplainer(), dataset(), tmp_path / "x", methods="grads", predict=linear_predict,
                      chunk_size=0)
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------- bad inputs
def test_bad_benchmark_inputs_give_one_line_and_write_nothing(tiny, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    data = {
        "label7": _jsonl(tmp_path / "label7.jsonl", [*ROWS, {"text": "good", "label": 7}]),
        "empty": _jsonl(tmp_path / "empty.jsonl", []),
        "fields": _jsonl(tmp_path / "fields.jsonl", [{"txt": "good", "label": 1}]),
        "unlabelled": _jsonl(tmp_path / "unlabelled.jsonl", [{"text": "good"}]),
    }
    out = str(tmp_path / "res")
    cases = [
        (["--dataset", str(data["label7"])], "example '3' has label 7, but the model has 2 classes (0..1)"),
        (["--out", str(tmp_path / "afile")], "is an existing file"),
        (["--out", str(tmp_path / "afile" / "sub")], f"cannot be created: {tmp_path / 'afile'} is a file"),
        (["--out", ""], "path is empty"),
        (["--threads", "-1"], "--threads must be a positive number, got -1"),
        (["--threads", "0"], "--threads must be a positive number, got 0"),
        (["--limit", "0"], "--limit must be a positive number"),
        (["--limit", "-1"], "--limit must be a positive number"),
        (["--k", "0"], "--k must be a positive number"),
        (["--batch-size", "0"], "--batch-size must be a positive number"),
        (["--eval-batch-size", "0"], "--eval-batch-size must be a positive number"),
        (["--chunk-size", "-2"], "--chunk-size must be a positive number"),
        (["--seed", "-1"], "seed must be >= 0"),
        (["--occlusion-step", "0"], "--occlusion-step must be >= 1"),
        (["--dataset", str(data["empty"])], "holds no examples"),
        (["--dataset", str(data["fields"])], "a row needs 'text'"),
        (["--dataset", str(data["unlabelled"]), "--target", "gold"], "example '0' has no label"),
        (["--target-kind", "loss"], "(--target gold)"),
    ]
    model, default_data = tiny
    for extra, message in cases:
        argv = ["benchmark", "--model", str(model), "--dataset", str(default_data), "--methods", "grads",
                "--metrics", "aopc", "--quiet", "--out", out, *extra]  # later options win
        assert main(argv) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("attnlens: error: ") and message in err, (extra, err)
        assert not Path(out).exists(), extra
    assert (tmp_path / "afile").read_text() == "x"


def test_huge_occlusion_max_stops_at_the_longest_input(tiny, tmp_path, capsys):
    out = tmp_path / "res"
    assert _bench(tiny, out, "--metrics", "occlusion", "--occlusion-max", "1000000000") == 0
    assert "using 48" not in capsys.readouterr().err  # --quiet: no notice
    summary = json.loads((out / "summary.json").read_text())
    assert summary["curves"]["occlusion"]["k"] == list(range(0, 49, 2))
    # counts above every input's length drop all real tokens: the curve is flat at its end
    top = summary["curves"]["occlusion"]["series"]["grads:top"]["accuracy"]
    assert len(set(top[-10:])) == 1
    model, data = tiny
    for metrics, said in (("occlusion", True), ("aopc", False)):  # a run that measures occlusion hears of it
        assert main(["benchmark", "--model", str(model), "--dataset", str(data), "--methods", "grads",
                     "--metrics", metrics, "--limit", "1", "--threads", "1", "--seed",
                     "0", "--occlusion-max", "1000", "--out", str(tmp_path / metrics)]) == 0
        assert ("--occlusion-max 1000 is more than the model's 48-token inputs; using 48" in capsys.readouterr().err
                ) is said


def test_api_refuses_bad_labels_and_options_before_writing(tmp_path):
    ds = dataset()
    ds.examples[4].label = -1
    with pytest.raises(InputError, match="example '4' has label -1"):
        run_benchmark(FakeExplainer(), ds, tmp_path / "a", methods="grads", predict=linear_predict)
    with pytest.raises(InputError, match="not among the benchmarked methods"):
        run_benchmark(FakeExplainer(), dataset(), tmp_path / "b", methods="grads", predict=linear_predict,
                      explain_options={"attcat": {}})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    summary = run_benchmark(FakeExplainer(), dataset(), tmp_path / "c", methods="grads", metrics=METRICS,
                            config=CONFIG, predict=linear_predict, progress=False)
    assert summary["n_examples"] == 11
    (tmp_path / "c" / "run.json").write_text('{"format": 1, "sett')  # torn by hand
    with pytest.raises(InputError, match="not a readable run file; use --overwrite"):
        run_benchmark(FakeExplainer(), dataset(), tmp_path / "c", methods="grads", metrics=METRICS,
                      config=CONFIG, predict=linear_predict, progress=False)


def test_bad_report_inputs_give_one_line(tiny, tmp_path, capsys):
    res = tmp_path / "res"
    assert _bench(tiny, res) == 0
    (tmp_path / "afile").write_text("x")
    empty, corrupt, binary, shape = (tmp_path / n for n in ("empty", "corrupt", "binary", "shape"))
    for d in (empty, corrupt, binary, shape):
        d.mkdir()
    (corrupt / "summary.json").write_text('{"results": {')
    (binary / "summary.json").write_bytes(b"\xff\xfe\x00")
    (shape / "summary.json").write_text('{"results": {"grads": 3}}')
    cases = [
        ([str(tmp_path / "missing")], "does not exist"),
        ([str(tmp_path / "afile")], "is a file"),
        ([str(empty)], "no summary.json in"),
        ([str(corrupt)], "is not valid JSON"),
        ([str(binary)], "is not a UTF-8 text file"),
        ([str(shape)], "'results' must map methods to metric values"),
        ([str(res), "--out", str(tmp_path / "afile" / "r.html")], "afile is a file, not a directory"),
        ([str(res), "--out", str(tmp_path)], "is a directory"),
        ([str(res), "--examples", "-1"], "--examples must be an integer >= 0"),
    ]
    for argv, message in cases:
        assert main(["report", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, (argv, err)
    assert main(["report", str(res), "--out", str(tmp_path / "new" / "r.html")]) == 0
    assert "<html" in (tmp_path / "new" / "r.html").read_text().lower()



def test_a_data_file_may_give_labels_by_the_models_class_names(tmp_path, capsys):
    """Rows that give ``"positive"`` / ``"negative"`` are read by the model's ``id2label``; a name the model does
    not have, and names against a model that only numbers its classes, are one line each."""
    model = make_model("bert")
    model.config.id2label, model.config.label2id = {0: "negative", 1: "positive"}, {"negative": 0, "positive": 1}
    model.save_pretrained(tmp_path / "named")
    make_tokenizer().save_pretrained(tmp_path / "named")
    named = [{"text": r["text"], "label": ["negative", "positive"][r["label"]]} for r in ROWS]
    data = _jsonl(tmp_path / "named.jsonl", named)
    base = ["benchmark", "--dataset", str(data), "--methods", "rawatt", "--metrics", "aopc", "--quiet",
            "--threads", "1"]
    assert main([*base, "--model", str(tmp_path / "named"), "--out", str(tmp_path / "a")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "a" / "examples.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows if r["method"] == "rawatt"] == [r["label"] for r in ROWS]
    _jsonl(data, [*named, {"text": "so so", "label": "neutral"}])
    assert main([*base, "--model", str(tmp_path / "named"), "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "label must be an integer class id or one of negative, positive, got 'neutral'")
    make_model("bert").save_pretrained(tmp_path / "numbered")
    make_tokenizer().save_pretrained(tmp_path / "numbered")
    capsys.readouterr()
    assert main([*base, "--model", str(tmp_path / "numbered"), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"got {named[0]['label']!r}: the model names its classes LABEL_0, LABEL_1, so give class ids" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def _snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK_FILE}


def test_starting_over_in_processes_never_clears_a_folder_another_run_is_writing(tiny, tmp_path, capsys):
    """``--overwrite --processes 2`` on a folder another benchmark holds is refused in one line before anything is
    cleared, and so is each launched process's clearing (rank 0 takes the lock, every rank hears the refusal and
    ends: none waits for the others)."""
    from attnlens.evaluation import parallel

    out = tmp_path / "res"
    assert _bench(tiny, out) == 0
    before = _snapshot(out)
    capsys.readouterr()
    proc = _holder(out)
    try:
        assert _bench(tiny, out, "--overwrite", "--processes", "2") == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"being written by another benchmark (pid {proc.pid})" in err
        model, data = tiny
        argv = ["benchmark", "--model", str(model), "--dataset", str(data), "--methods", "grads,attcat", "--metrics",
                "aopc", "--quiet", "--out", str(out), "--overwrite", "--processes", "1", "--threads", "1"]
        start = time.perf_counter()
        with pytest.raises(InputError, match="2 of 2 benchmark processes failed"):
            parallel.launch(argv, 2, 1)  # the processes --processes 2 starts, each told to start over
        assert time.perf_counter() - start < 120
        assert _snapshot(out) == before
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_row_written_twice_is_kept_once_with_a_warning(tiny, tmp_path):
    """Rows of an example and method already in ``examples.jsonl`` (the file changed outside attnlens) are left
    out when the run is resumed: the means count each example once."""
    out = tmp_path / "res"
    assert _bench(tiny, out) == 0
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "examples.jsonl").read_text().splitlines(keepends=True)
    with (out / "examples.jsonl").open("a") as f:
        f.writelines(lines[:3])
    copy = tmp_path / "copy.jsonl"
    copy.write_text((out / "examples.jsonl").read_text())
    with pytest.warns(UserWarning, match=r"3 rows of an example and method already there .* the first of each is kept"):
        assert read_rows(copy) == [json.loads(x) for x in lines]
    assert copy.read_text().splitlines(keepends=True) == lines  # repaired
    assert _bench(tiny, out) == 0
    assert (out / "examples.jsonl").read_text().splitlines(keepends=True) == lines
    again = json.loads((out / "summary.json").read_text())
    assert again["results"] == summary["results"] and again["n_examples"] == summary["n_examples"]


def test_ctrl_c_on_a_run_in_processes_merges_and_summarises_what_they_finished(tiny, tmp_path):
    """Ctrl-C (SIGINT to the process group) on ``--processes 2``: each process merges the examples it finished,
    ``summary.json`` covers every merged example (``interrupted``), the command says so once, and the same command
    finishes the run."""
    model, _ = tiny
    data = _jsonl(tmp_path / "many.jsonl", ROWS * 80)
    out = tmp_path / "res"
    argv = [sys.executable, "-m", "attnlens.cli", "benchmark", "--model", str(model), "--dataset", str(data),
            "--methods", "grads,integratedgradients", "--metrics", "aopc", "--chunk-size", "1", "--threads", "1",
            "--out", str(out), "--processes", "2",  # each example slow enough that the run is under way when stopped
            "--options", json.dumps({"integratedgradients": {"n_steps": 400, "tolerance": None}})]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    # a job started in the background has SIGINT ignored, and Python then never turns it into KeyboardInterrupt:
    # the command gets it as a terminal's Ctrl-C would deliver it
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    deadline = time.time() + 120
    while time.time() < deadline and sum(
            len((d / "examples.jsonl").read_text().splitlines()) for d in (out / "shards").glob("*")
            if (d / "examples.jsonl").is_file()) < 6:
        time.sleep(0.1)
    assert proc.poll() is None, "the run ended before it could be stopped"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["timing"]["interrupted"] is True and 0 < summary["n_examples"] < len(ROWS) * 80
    rows = [json.loads(x) for x in (out / "examples.jsonl").read_text().splitlines()]
    assert summary["n_examples"] == len({r["index"] for r in rows})
    lines = [x for x in err.splitlines() if "interrupted" in x]
    assert len([x for x in lines if "wrote" in x]) == 1 and len(lines) == 2, err
    assert subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600).returncode == 0
    assert json.loads((out / "summary.json").read_text())["n_examples"] == len(ROWS) * 80


def test_non_finite_scores_stop_the_run_in_one_line_naming_the_method_and_example(tmp_path):
    """A NaN has no place in the order the deletion metrics remove tokens by: the run stops before anything of
    the chunk is written, naming the method and the example."""
    from attnlens.errors import MethodError

    class NaNExplainer(FakeExplainer):
        def explain(self, texts, methods, **kw):
            out = super().explain(texts, methods, **kw)
            for e in out:
                if "grads" in e.scores:
                    e.scores["grads"] = np.where(np.arange(len(e.tokens)) == 1, np.nan, e.scores["grads"])
            return out

    with pytest.raises(MethodError, match=r"method 'grads' gave example .* non-finite scores"):
        bench(tmp_path, explainer=NaNExplainer())
    assert not (tmp_path / "examples.jsonl").is_file() or not (tmp_path / "examples.jsonl").read_text().strip()


@pytest.mark.parametrize("line", ['{"note": "checked by hand"}', '{"index": 1, "method": "attcat", "metrics": {}}',
                                  '{"index": true, "method": null}'])
def test_a_line_that_is_no_example_row_is_taken_out_with_a_warning_and_the_results_stay(tmp_path, line):
    summary, _ = bench(tmp_path)
    path = tmp_path / "examples.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([line, *lines]) + "\n")
    with pytest.warns(UserWarning, match="not a results row"):
        again, _ = bench(tmp_path)
    assert again["metrics"] == summary["metrics"] and path.read_text().splitlines() == lines
