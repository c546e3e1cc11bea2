"""``attnlens serve``'s JSON API through Starlette's ASGI test client: every route; answers equal to what the CLI
writes and to independent computations; bad input is a 4xx with one line and the server goes on; the job queue's
order, cancellation and cache; the security headers; the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import make_model, make_tokenizer, missing
from scipy import stats
from serve_support import FAST, MINILM, make_results
from starlette.testclient import TestClient

from attnlens import Explainer, InputError
from attnlens.cli import main
from attnlens.evaluation.results import read_rows
from attnlens.serve import Limits, create_app
from attnlens.serve.jobs import CANCELLED, DONE, QUEUED, RUNNING, JobQueue
from attnlens.testing.tiny_models import build_tiny
from attnlens.viz.headview import decode_attentions

pytestmark = pytest.mark.slow  # the real MiniLM SST-2 classifier

XSS = "<script>alert(1)</script>"
TEXTS = ["the plot is thin, but the actors are wonderful .", "a dull , lifeless film"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Three models (the real classifier, a tiny LM, a tiny classifier whose labels hold markup) and a results
    folder; the app is built once."""
    if not MINILM.is_dir():
        missing(f"reference model not found at {MINILM}")
    tmp = tmp_path_factory.mktemp("serve")
    minilm = Explainer.from_pretrained(MINILM)
    tokenizer = make_tokenizer()
    lm_dir = tmp / "lm"
    build_tiny("gpt2", vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=2, eos_token_id=3,
               task="causal-lm").save_pretrained(lm_dir)
    tokenizer.save_pretrained(lm_dir)
    labelled = make_model("bert")
    labelled.config.id2label = {0: XSS, 1: "fine"}
    labelled.config.label2id = {XSS: 0, "fine": 1}
    results = make_results(minilm, tmp / "results" / "sst2-run", n=5)
    app = create_app({"minilm": minilm, "lm": Explainer.from_pretrained(lm_dir), "xss": Explainer(labelled, tokenizer)},
                     results=[tmp / "results"], limits=Limits(max_chars=500, max_texts=4, max_body=20_000))
    with TestClient(app) as client:
        yield {"client": client, "minilm": minilm, "lm_dir": lm_dir, "results": results, "tmp": tmp}


def _cli_json(argv: list[str], out: Path) -> list:
    assert main(["explain", *argv, "--format", "json", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _one_line_error(response, status: int) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]
    assert message and "\n" not in message and "Traceback" not in message
    return message


# ------------------------------------------------------------------------------ explain = the CLI's JSON
@pytest.mark.parametrize("cli, body", [
    ([], {}),
    (["--target", "0", "--words"], {"target": 0, "words": True}),
    (["--target", "positive", "--contrast", "negative", "--target-kind", "probability"],
     {"target": "positive", "contrast": "negative", "target_kind": "probability"}),
])
def test_explain_answers_exactly_what_explain_format_json_writes(served, tmp_path, cli, body):
    agnostic = ("rawatt", "rollout")  # no target, so no contrast
    methods = [m for m in FAST if m not in agnostic or "contrast" not in body]
    expected = _cli_json(["--model", str(MINILM), "--methods", ",".join(methods), *cli, *TEXTS], tmp_path / "o.json")
    r = served["client"].post("/api/explain", json={"model": "minilm", "texts": TEXTS, "methods": methods, **body})
    assert r.status_code == 200, r.text
    assert r.json() == expected
    assert isinstance(r.json(), list) and len(r.json()) == len(TEXTS)


def test_sentence_pairs_and_method_options_match_the_python_api(served):
    pair = ["a premise about films", "a hypothesis"]
    options = {"attcat": {"hidden": "output", "alpha": "cls"}}
    r = served["client"].post("/api/explain", json={"model": "minilm", "texts": [pair], "methods": ["attcat"],
                                                    "options": options})
    (direct,) = served["minilm"].explain([tuple(pair)], methods=["attcat"], options=options)
    assert r.status_code == 200 and r.json() == [direct.to_dict()]
    assert 1 in r.json()[0]["token_type_ids"]


def test_a_model_name_is_needed_only_when_several_are_served(served):
    client = served["client"]
    message = _one_line_error(client.post("/api/explain", json={"texts": ["good"]}), 400)
    assert "several models" in message and "minilm" in message
    for name in (str(MINILM), "../minilm", "nope"):  # never a path: only the names given on the command line
        assert "not served" in _one_line_error(client.post("/api/explain", json={"model": name, "texts": ["x"]}), 400)
    one = create_app({"only": served["minilm"]})
    with TestClient(one) as c:
        r = c.post("/api/explain", json={"texts": ["good"], "methods": ["rawatt"]})
        assert r.status_code == 200 and r.json()[0]["scores"].keys() == {"rawatt"}


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("body, status, pattern", [
    ("{not json", 400, "not valid JSON"),
    ([1, 2], 400, "JSON object"),
    ({"model": "minilm"}, 400, '"texts" must be'),
    ({"model": "minilm", "texts": []}, 400, '"texts" must be'),
    ({"model": "minilm", "texts": ["a"] * 5}, 400, "at most 4"),
    ({"model": "minilm", "texts": ["x" * 501]}, 400, "at most 500"),
    ({"model": "minilm", "texts": ["  "]}, 400, "empty"),
    ({"model": "minilm", "texts": [["a", "b", "c"]]}, 400, "pair"),
    ({"model": "minilm", "texts": ["a"], "methods": ["nope"]}, 400, "unknown method 'nope'"),
    ({"model": "minilm", "texts": ["a"], "methods": []}, 400, "non-empty list"),
    ({"model": "minilm", "texts": ["a"], "target": 7}, 400, "target"),
    ({"model": "minilm", "texts": ["a"], "target": {"x": 1}}, 400, "target"),
    ({"model": "minilm", "texts": ["a"], "target_kind": "odds"}, 400, "target_kind"),
    ({"model": "minilm", "texts": ["a"], "words": "yes"}, 400, "words"),
    ({"model": "minilm", "texts": ["a"], "options": {"attcat": 3}}, 400, "options"),
    ({"model": "minilm", "texts": ["a"], "methods": ["rawatt"], "options": {"attcat": {}}}, 400, "not among"),
    ({"model": "minilm", "texts": ["a"], "methods": ["attcat"], "options": {"attcat": {"bad": 1}}}, 400, "no option"),
    ({"model": "minilm", "texts": ["a"], "token": 1}, 400, "token classifiers"),
    ({"model": "minilm", "texts": ["a"], "shell": "rm"}, 400, "unknown field"),
])
def test_bad_explain_requests_are_a_4xx_with_one_line(served, body, status, pattern):
    client = served["client"]
    content = body if isinstance(body, str) else json.dumps(body)
    message = _one_line_error(client.post("/api/explain", content=content), status)
    assert re.search(pattern, message), message
    assert client.post("/api/explain", json={"model": "minilm", "texts": ["fine"], "methods": ["rawatt"]}).status_code \
        == 200  # the server goes on


def test_size_limits_unknown_routes_and_jobs(served):
    client = served["client"]
    assert "larger than" in _one_line_error(client.post("/api/explain", content=b"x" * 30_000), 413)
    assert "larger than" in _one_line_error(
        client.post("/api/explain", content=iter([b"{" + b" " * 15_000, b" " * 15_000 + b"}"])), 413)  # no length
    _one_line_error(client.get("/api/nothing"), 404)
    _one_line_error(client.get("/api/jobs/999999"), 404)
    _one_line_error(client.delete("/api/jobs/999999"), 404)
    _one_line_error(client.get("/api/explain"), 405)
    assert "kind" in _one_line_error(client.post("/api/jobs", json={"kind": "rm", "request": {}}), 400)
    assert "kind" in _one_line_error(client.post("/api/jobs", json={"kind": "explain"}), 400)
    lm = {"model": "lm", "prompt": "the movie"}
    assert "language model" in _one_line_error(client.post("/api/generate", json={**lm, "model": "minilm"}), 400)
    assert "max_new_tokens" in _one_line_error(client.post("/api/generate", json={**lm, "max_new_tokens": 0}), 400)
    assert "max_new_tokens" in _one_line_error(client.post("/api/generate", json={**lm, "max_new_tokens": 65}), 400)
    assert "sequence classifiers" in _one_line_error(
        client.post("/api/faithfulness", json={"model": "lm", "texts": ["the movie"], "methods": ["rawatt"]}), 400)
    assert "metrics" in _one_line_error(client.post("/api/faithfulness", json={
        "model": "minilm", "texts": ["good"], "methods": ["rawatt"], "metrics": ["lodds"]}), 400)
    assert "contrast" in _one_line_error(client.post("/api/faithfulness", json={
        "model": "minilm", "texts": ["good"], "methods": ["agrad"], "contrast": 0, "target": 1}), 400)
    assert client.get("/api/models").status_code == 200


# ------------------------------------------------------------------------------ faithfulness, attention, generation
def _hand_aopc_and_sufficiency(ex: Explainer, exp) -> tuple[float, float]:
    """AOPC and sufficiency from the model's probabilities of hand-made deletions (no evaluation code)."""
    ids, real = exp.input_ids, [i for i, s in enumerate(exp.special) if not s]
    scores = np.asarray(exp.scores["attcat"], dtype=np.float64)
    order = sorted(real, key=lambda i: (-scores[i], i))
    n = len(real)
    p = ex.predict_proba([ids])[0]
    c = int(np.argmax(p))

    def without(drop):
        return float(ex.predict_proba([[t for i, t in enumerate(ids) if i not in set(drop)]])[0][c])

    aopc = np.mean([p[c] - without(order[:int(np.round(k / 10 * n))]) for k in range(11)])
    suff = np.mean([p[c] - without(order[int(np.round(k / 10 * n)):]) for k in range(1, 11)])
    return float(aopc), float(suff)


def test_faithfulness_equals_deletions_computed_by_hand(served):
    body = {"model": "minilm", "texts": [TEXTS[0]], "methods": ["rawatt", "attcat"]}
    r = served["client"].post("/api/faithfulness", json=body)
    assert r.status_code == 200, r.text
    (result,) = r.json()
    (exp,) = served["minilm"].explain([TEXTS[0]], methods=["attcat"])
    aopc, suff = _hand_aopc_and_sufficiency(served["minilm"], exp)
    got = result["methods"]["attcat"]
    assert got["aopc"]["value"] == pytest.approx(aopc, abs=1e-5)
    assert got["sufficiency"]["value"] == pytest.approx(suff, abs=1e-5)
    assert len(got["aopc"]["levels"]) == len(result["fractions"]["aopc"]) == 11
    assert np.mean(got["aopc"]["levels"]) == pytest.approx(got["aopc"]["value"])
    assert set(result["methods"]) == {"rawatt", "attcat"}


def test_attention_route_decodes_to_the_models_attention_and_thumbnails_are_block_maxima(served):
    text = " ".join(["the plot is thin but the actors are wonderful"] * 7)  # > 48 tokens: blocks of 2 or 1
    r = served["client"].post("/api/attention", json={"model": "minilm", "text": text})
    assert r.status_code == 200
    data = r.json()
    tokens, special, att = served["minilm"].attention_maps(text)
    assert data["tokens"] == tokens and data["special"] == special
    np.testing.assert_allclose(decode_attentions(data["attention"]), att, atol=2e-3)
    n, t = att.shape[-1], data["thumbnails"]["size"]
    assert n > 48 and t == 48
    thumbs = np.array(data["thumbnails"]["values"]).reshape(*att.shape[:2], t, t)
    edges = np.linspace(0, n, t + 1).astype(int)
    layer, head = 3, 5
    blocks = np.array([[att[layer, head, edges[a]:edges[a + 1], edges[b]:edges[b + 1]].max() for b in range(t)]
                       for a in range(t)])
    np.testing.assert_array_equal(thumbs[layer, head], np.rint(blocks / blocks.max() * 255))


def test_generate_answers_what_explain_generate_writes(served, tmp_path):
    expected = _cli_json(["--model", str(served["lm_dir"]), "--generate", "--max-new-tokens", "3", "--methods",
                          "rawatt,agrad", "the movie was"], tmp_path / "g.json")
    r = served["client"].post("/api/generate", json={"model": "lm", "prompt": "the movie was", "max_new_tokens": 3,
                                                     "methods": ["rawatt", "agrad"]})
    assert r.status_code == 200, r.text
    assert r.json() == expected
    forced = served["client"].post("/api/generate", json={
        "model": "lm", "prompt": "the movie was", "methods": ["agrad"], "target": "good fun", "contrast": "bad fun"})
    assert forced.status_code == 200 and forced.json()[0]["forced"] is True
    assert len(forced.json()[0]["generated_ids"]) == 2 and forced.json()[0]["contrast_ids"] is not None


def test_answer_explains_a_stretch_of_a_generation_as_one_answer(served):
    methods = ["inputxgradient", "cat", "agrad", "rawatt"]
    client = served["client"]
    g = client.post("/api/generate", json={"model": "lm", "prompt": "the movie was", "max_new_tokens": 4,
                                           "methods": methods}).json()[0]
    t0, t1 = 1, 3
    prompt_ids, answer_ids = g["prompt_ids"] + g["generated_ids"][:t0], g["generated_ids"][t0:t1 + 1]
    body = {"model": "lm", "prompt_ids": prompt_ids, "answer_ids": answer_ids, "methods": methods,
            "target_kind": "logit"}
    r = client.post("/api/answer", json=body)
    assert r.status_code == 200, r.text
    direct = Explainer.from_pretrained(served["lm_dir"]).explain_answer(prompt_ids, answer_ids, methods,
                                                                       target_kind="logit")
    assert r.json() == [direct.to_dict()]
    (exp,) = r.json()
    n_prompt = len(g["prompt_ids"])
    n = n_prompt + t1  # the tokens before the stretch's last token
    assert exp["input_ids"] == g["prompt_ids"] + g["generated_ids"][:t1 + 1]
    assert exp["target"] == [n_prompt + t0, n_prompt + t1 + 1]
    for m in ("inputxgradient", "cat"):  # linear in the explained logit: the sum of the steps' rows
        summed = np.sum([g["scores"][m][t][:n] for t in range(t0, t1 + 1)], axis=0)
        scale = np.abs(summed).max()
        assert scale > 0
        np.testing.assert_allclose(exp["scores"][m][:n], summed, rtol=1e-4, atol=1e-5 * scale)
        assert abs(exp["scores"][m][n]) <= 1e-6 * scale  # the last answer token explains nothing after it
    for m in ("agrad", "rawatt"):  # read the attention rows of the steps: the stretch's own explanation differs
        summed = np.sum([g["scores"][m][t][:n] for t in range(t0, t1 + 1)], axis=0)
        assert not np.allclose(exp["scores"][m][:n], summed, rtol=1e-2), m
    job = client.post("/api/jobs", json={"kind": "answer", "request": body}).json()
    assert job["cached"] is True and job["result"] == r.json()


@pytest.mark.parametrize("change, pattern", [
    ({"prompt_ids": []}, '"prompt_ids" must be a non-empty list'),
    ({"answer_ids": None}, '"answer_ids" must be a non-empty list'),
    ({"prompt_ids": [5, 1.5]}, '"prompt_ids" must be'),
    ({"answer_ids": [True]}, '"answer_ids" must be'),
    ({"answer_ids": [-1]}, '"answer_ids" must be'),
    ({"answer_ids": [10 ** 9]}, r'"answer_ids" holds 1000000000, which is not a token id of this model \(0 to \d+\)'),
    ({"answer_ids": [5] * 65}, "at most 64"),
    ({"prompt_ids": [5] * 501}, "at most 500"),
    ({"model": "minilm"}, "causal language model"),
    ({"target_kind": "odds"}, "target_kind"),
    ({"methods": ["nope"]}, "unknown method 'nope'"),
    ({"text": "the movie"}, "unknown field"),
])
def test_bad_answer_requests_are_a_400_with_one_line(served, change, pattern):
    body = {"model": "lm", "prompt_ids": [5, 6, 7], "answer_ids": [8, 9], "methods": ["agrad"], **change}
    message = _one_line_error(served["client"].post("/api/answer", json=body), 400)
    assert re.search(pattern, message), message



@pytest.mark.parametrize("route, body, pattern", [
    ("/api/generate", {"model": "lm", "prompt": ["the", "movie"]}, '"prompt" must be one text'),
    ("/api/attribute", {"model": "lm", "context": "the movie ."}, r'"query" must be one text \(it is missing\)'),
    ("/api/attribute", {"model": "lm", "context": ["a", "b"], "query": "q"}, '"context" must be one text'),
])
def test_fields_that_take_one_text_say_so(served, route, body, pattern):
    message = _one_line_error(served["client"].post(route, json=body), 400)
    assert re.search(pattern, message), message

def test_labels_with_markup_travel_as_data(served):
    r = served["client"].post("/api/explain", json={"model": "xss", "texts": ["the movie"], "methods": ["rawatt"]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json()[0]["labels"][0] == XSS
    models = served["client"].get("/api/models").json()["models"]
    assert [m["name"] for m in models] == ["minilm", "lm", "xss"]
    assert models[2]["labels"] == [XSS, "fine"] and models[1]["language_model"] is True


# ------------------------------------------------------------------------------ jobs
def test_jobs_follow_progress_and_a_repeated_request_is_answered_from_the_cache(served):
    client = served["client"]
    request = {"model": "minilm", "texts": ["an utterly charming film"], "methods": ["rawatt", "gae"]}
    job = client.post("/api/jobs", json={"kind": "explain", "request": request}).json()
    for _ in range(200):
        if job["state"] in (DONE, "error", CANCELLED):
            break
        time.sleep(0.05)
        job = client.get(f"/api/jobs/{job['id']}").json()
    assert job["state"] == DONE and job["progress"] == 1.0 and not job["cached"]
    again = client.post("/api/jobs", json={"kind": "explain", "request": dict(reversed(list(request.items())))})
    assert again.status_code == 200 and again.json()["cached"] is True
    assert again.json()["result"] == job["result"] == client.post("/api/explain", json=request).json()


def test_queue_runs_one_job_at_a_time_whatever_its_model_in_order_and_cancels():
    queue = JobQueue()
    gate, ran = threading.Event(), []

    def blocking(name):
        def compute(job):
            ran.append(name)
            while not gate.is_set():
                job.report(0.5)  # a cancelled job stops here
                time.sleep(0.01)
            return name
        return compute

    assert not queue.running()
    first = queue.submit("a", "explain", "k1", blocking("first"))
    second = queue.submit("a", "explain", "k2", blocking("second"))
    other = queue.submit("b", "explain", "k4", lambda job: ran.append("other") or "other")  # another model waits too
    third = queue.submit("a", "explain", "k3", blocking("third"))
    time.sleep(0.1)
    assert ran == ["first"] and second.state == other.state == QUEUED and queue.running()
    # ahead of each: the running job and those waiting before it
    assert queue.position(second) == 1 and queue.position(other) == 2 and queue.position(third) == 3
    queue.cancel(second)  # waiting: never starts
    assert second.state == CANCELLED and queue.position(other) == 1 and queue.position(third) == 2
    queue.cancel(first)  # running: stops at its next report
    assert first.future.result(timeout=10).state == CANCELLED
    assert other.future.result(timeout=10).result == "other"
    gate.set()
    assert third.future.result(timeout=10).result == "third"
    assert ran == ["first", "other", "third"] and not queue.running()
    assert queue.submit("a", "explain", "k3", blocking("again")).cached  # same key: not computed again
    assert ran == ["first", "other", "third"]


def test_the_cache_of_results_is_bounded_in_bytes_and_a_dropped_result_says_so():
    from attnlens.serve.jobs import FAILED, approximate_bytes

    big = ["x" * 10_000] * 10  # about 100 kB
    queue = JobQueue(cache_bytes=3 * approximate_bytes(big))
    jobs = [queue.submit("m", "attention", f"k{i}", lambda job: list(big)) for i in range(5)]
    for job in jobs:
        job.future.result(timeout=10)
    assert [queue.cached(f"k{i}") is not None for i in range(5)] == [False, False, True, True, True]
    for job in jobs[:2]:  # nothing holds a dropped result: its job answers with one line, ask again
        assert job.state == FAILED and job.result is None and job.status == 410
        assert "dropped from the server's cache" in job.to_dict()["error"]
    assert jobs[4].state == DONE and jobs[4].result == big
    alone = JobQueue(cache_bytes=10)  # the newest result is kept whatever its size
    job = alone.submit("m", "attention", "k", lambda job: list(big))
    assert job.future.result(timeout=10).state == DONE and alone.cached("k") == big


def test_jobs_and_the_cache_keep_a_digest_of_each_request_not_its_texts():
    """A request's key holds every text it sent; the queue keeps hundreds of jobs and the cache's bound counts
    results only, so what both keep of a key is a fixed-size digest, and equal requests still meet."""
    queue = JobQueue()
    long_key = "explain:" + "a review of twenty thousand characters " * 500
    first = queue.submit("m", "attention", long_key, lambda job: [1, 2, 3])
    assert first.future.result(timeout=10).state == DONE
    again = queue.submit("m", "attention", long_key, lambda job: [4])
    assert again.cached and again.result == [1, 2, 3] and queue.cached(long_key) == [1, 2, 3]
    assert queue.cached(long_key + " ") is None
    assert all(len(job.key) == 64 for job in (first, again))


def test_the_memory_budget_bounds_every_computation_of_the_server(served):
    """Within 64 MiB the attention view of a long text and its explanation by attention flow are refused in one
    line before the model runs; a short text is explained."""
    minilm = served["minilm"]
    app = create_app({"m": minilm}, memory_budget="64MiB", limits=Limits(max_chars=20_000))
    text = " ".join(["the plot is thin but the actors are wonderful"] * 50)  # 452 tokens
    with TestClient(app) as client:
        r = client.post("/api/attention", json={"model": "m", "text": text})
        assert r.status_code == 400
        assert re.fullmatch(r"the attention view keeps every layer's and head's whole maps: 452 tokens need about "
                            r"\d+ MiB, more than the memory budget of 64 MiB; it fits up to [\d,]+ tokens .*",
                            r.json()["error"])
        r = client.post("/api/explain", json={"model": "m", "texts": [text], "methods": ["flow"]})
        assert r.status_code == 400
        assert re.match(r"an input of 452 tokens with flow needs about \d+ MiB, more than the memory budget of "
                        r"64 MiB; within it: flow up to [\d,]+ tokens", r.json()["error"])
        r = client.post("/api/explain", json={"model": "m", "texts": ["a charming journey"], "methods": ["flow"]})
        assert r.status_code == 200


LONG = " ".join(["a long and winding review of a film"] * 12)  # within the 500 characters


@pytest.mark.parametrize(("kind", "request_"), [
    ("explain", {"model": "minilm", "texts": [LONG, LONG + " !", LONG + " ?"], "methods": ["integratedgradients"],
                 "options": {"integratedgradients": {"n_steps": 200}}}),
    ("explain", {"model": "minilm", "texts": [LONG], "methods": ["kernelshap"],
                 "options": {"kernelshap": {"n_samples": 200_000, "perturbations_per_eval": 8}}}),
    # each batch of 8 samples reports: the cancel lands within one batch, whatever the machine's speed
    ("generate", {"model": "lm", "prompt": "the movie was", "max_new_tokens": 4, "methods": ["kernelshap"],
                  "options": {"kernelshap": {"n_samples": 200_000, "perturbations_per_eval": 8}}}),
    ("attribute", {"model": "lm", "context": "the movie was great . the actors were bad . the end .",
                   "query": "was it good", "answer": " yes", "methods": ["contextcite"],
                   "options": {"contextcite": {"n_ablations": 200_000}}}),
])
def test_cancelling_a_running_computation_through_the_api(served, kind, request_):
    client = served["client"]
    job = client.post("/api/jobs", json={"kind": kind, "request": request_}).json()
    assert "id" in job, job
    while job["state"] == QUEUED:
        job = client.get(f"/api/jobs/{job['id']}").json()
    client.delete(f"/api/jobs/{job['id']}")
    for _ in range(600):
        job = client.get(f"/api/jobs/{job['id']}").json()
        if job["state"] != "running":
            break
        time.sleep(0.05)
    assert job["state"] == CANCELLED, job
    assert client.post("/api/explain", json={"model": "minilm", "texts": ["ok"], "methods": ["rawatt"]}).status_code \
        == 200


# ------------------------------------------------------------------------------ benchmarks
def test_benchmark_table_intervals_and_examples_from_the_files(served):
    client = served["client"]
    listed = client.get("/api/benchmarks").json()["results"]
    assert [r["name"] for r in listed] == ["results/sst2-run"] and listed[0]["n_examples"] == 5
    data = client.get("/api/benchmarks/results/sst2-run").json()
    rows = [r for r in read_rows(served["results"] / "examples.jsonl") if r.get("method") == "attcat"]
    values = [r["metrics"]["aopc"] for r in rows]
    cell = data["table"]["attcat"]["aopc"]
    low, high = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert cell["mean"] == pytest.approx(np.mean(values)) and cell["n"] == 5
    assert (cell["low"], cell["high"]) == pytest.approx((low, high))
    assert [e["value"] for e in cell["best"]] == sorted(values, reverse=True)[:3]
    assert [e["value"] for e in cell["worst"]] == sorted(values)[:3]
    texts = {r["index"]: r for r in rows}
    assert all(isinstance(e["text"], str) and e["index"] in texts for e in cell["best"])
    assert data["curves"]["aopc"]["attcat"]["fractions"][-1] == 1.0
    for name in ("nope", "../results/sst2-run", str(served["results"]), "%2e%2e/etc"):
        assert client.get(f"/api/benchmarks/{name}").status_code == 404


# ------------------------------------------------------------------------------ page and headers
def test_page_static_files_and_security_headers(served):
    client = served["client"]
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert re.findall(r"<script[^>]*>", page.text) == ['<script src="/static/app.js" defer>']  # no inline script
    assert "http" not in re.sub(r'(href|src)="/[^"]*"', "", page.text)  # nothing from elsewhere (no CDN)
    for path in ("/static/app.js", "/static/app.css"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["x-content-type-options"] == "nosniff"
    assert "innerHTML" not in client.get("/static/app.js").text  # texts reach the page as text only
    assert client.get("/api/models").headers["content-security-policy"] == csp


def test_only_local_host_names_are_answered_when_bound_locally(served):
    app = create_app({"m": served["minilm"]}, allowed_hosts=["127.0.0.1", "localhost"])
    with TestClient(app, base_url="http://127.0.0.1") as c:
        assert c.get("/api/models").status_code == 200
        refused = c.get("/api/models", headers={"host": "evil.example:8000"})  # DNS rebinding
        assert refused.status_code == 400 and "evil.example:8000" in refused.json()["error"]
        assert refused.headers["x-content-type-options"] == "nosniff"
        assert c.get("/api/models", headers={"host": "localhost:8000"}).status_code == 200
    app = create_app({"m": served["minilm"]}, allowed_hosts=["127.0.0.1", "localhost", "[::1]"])
    with TestClient(app, base_url="http://127.0.0.1") as c:
        assert c.get("/api/models", headers={"host": "[::1]:8000"}).status_code == 200


# ------------------------------------------------------------------------------ command line
@pytest.mark.parametrize("argv, pattern", [
    (["--host", "0.0.0.0"], "--allow-remote"),
    (["--results", "/nonexistent/folder"], "no such folder"),
    (["--port", "70000"], "--port"),
    (["--max-chars", "0"], "--max-chars"),
    (["--memory-budget", "lots"], "memory budget"),
    (["--memory-budget", "1MiB"], "memory budget"),
    (["--model", "a=x", "--model", "a=y"], "two models are named 'a'"),
])
def test_serve_refuses_mistakes_in_one_line(argv, pattern, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err) and err.count("\n") == 1


def test_serve_command_serves_and_warns_when_remote(tmp_path):
    labelled = make_model("bert")
    labelled.config.id2label, labelled.config.label2id = {0: "negative", 1: "positive"}, {"negative": 0, "positive": 1}
    labelled.save_pretrained(tmp_path / "tiny")
    make_tokenizer().save_pretrained(tmp_path / "tiny")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src"), "OMP_WAIT_POLICY": "PASSIVE"}
    argv = ["serve", "--model", f"sst={tmp_path / 'tiny'}", "--port", "0", "--host", "0.0.0.0", "--allow-remote"]
    proc = subprocess.Popen([sys.executable, "-m", "attnlens.cli", *argv], stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        while not any("attnlens serve: http" in line for line in lines):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        assert any("warning: serving on 0.0.0.0" in line for line in lines)
        port = int(re.search(r":(\d+)/", lines[-1]).group(1))
        models = httpx.get(f"http://127.0.0.1:{port}/api/models", timeout=30).json()["models"]
        assert [m["name"] for m in models] == ["sst"] and models[0]["labels"] == ["negative", "positive"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ------------------------------------------------------------------------------ other tasks
def test_token_classifier_and_qa_targets_are_the_python_apis():
    import torch
    from transformers import BertConfig, BertForQuestionAnswering

    tokenizer = make_tokenizer()
    ner = build_tiny("bert", vocab_size=len(tokenizer), pad_token_id=0, bos_token_id=2, eos_token_id=3, num_labels=3,
                     model_suffix="ForTokenClassification")
    ner.config.id2label, ner.config.label2id = {0: "O", 1: "B-LOC", 2: "I-LOC"}, {"O": 0, "B-LOC": 1, "I-LOC": 2}
    torch.manual_seed(0)
    qa = BertForQuestionAnswering(BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=24, max_position_embeddings=64,
                                             initializer_range=0.3, pad_token_id=0)).eval()
    qa.set_attn_implementation("eager")
    ners, qas = Explainer(ner, tokenizer), Explainer(qa, tokenizer)
    methods = ["rawatt", "agrad", "attcat"]
    with TestClient(create_app({"ner": ners, "qa": qas})) as client:
        body = {"model": "ner", "texts": ["the movie was great"], "methods": methods}
        r = client.post("/api/explain", json={**body, "token": "movie", "target": "B-LOC"})
        assert r.json() == [e.to_dict() for e in ners.explain(["the movie was great"], methods,
                                                              target=("movie", "B-LOC"))]
        assert (r.json()[0]["target"], r.json()[0]["meta"]["position"], r.json()[0]["meta"]["token"]) == (1, 2, "movie")
        assert "token classifier" in _one_line_error(client.post("/api/explain", json=body), 400)
        assert "sequence classifiers" in _one_line_error(client.post("/api/faithfulness", json={**body, "token": 1}),
                                                         400)
        pair = ["what movie", "the movie was great"]
        for target in (None, [5, 6]):
            r = client.post("/api/explain", json={"model": "qa", "texts": [pair], "methods": methods, "target": target})
            expected = qas.explain([tuple(pair)], methods, target=None if target is None else tuple(target))
            assert r.status_code == 200 and r.json() == [e.to_dict() for e in expected]
        assert r.json()[0]["target"] == [5, 6]
        assert "end" in _one_line_error(client.post("/api/explain", json={
            "model": "qa", "texts": [pair], "methods": methods, "target": [6, 5]}), 400)


# ------------------------------------------------------------------------------ sources of an answer
def test_attribute_answers_what_cite_writes(served, tmp_path):
    context, query = "the movie was great . the actors were bad .", "was the movie good"
    out = tmp_path / "cite.json"
    assert main(["cite", "--model", str(served["lm_dir"]), "--context", context, "--query", query, "--methods",
                 "agrad,loo", "--max-new-tokens", "3", "--format", "json", "--out", str(out)]) == 0
    body = {"model": "lm", "context": context, "query": query, "methods": ["agrad", "loo"], "max_new_tokens": 3}
    r = served["client"].post("/api/attribute", json=body)
    assert r.status_code == 200, r.text
    expected, answered = json.loads(out.read_text()), r.json()
    for answer in (answered, expected):
        assert set(answer["meta"].pop("seconds")) == {"agrad", "loo"}  # wall-clock times differ between two runs
    assert answered == expected
    assert [s["text"] for s in answered["sources"]] == ["the movie was great .", "the actors were bad ."]
    with_tokens = served["client"].post("/api/attribute", json={**body, "tokens": True}).json()
    assert set(with_tokens["tokens"]["scores"]) == {"agrad"}
    client = served["client"]
    assert "causal language model" in _one_line_error(client.post("/api/attribute", json={**body, "model": "minilm"}),
                                                      400)
    assert "sources" in _one_line_error(client.post("/api/attribute", json={**body, "sources": "word"}), 400)
    assert '"query"' in _one_line_error(client.post("/api/attribute", json={**body, "query": " "}), 400)


@pytest.mark.parametrize("route", ["/api/explain", "/api/faithfulness", "/api/attention", "/api/generate",
                                   "/api/answer", "/api/attribute", "/api/jobs"])
@pytest.mark.parametrize("body", [None, 3, "x", [], {}, {"model": 1}, {"model": "minilm", "texts": "abc"},
                                  {"model": "lm", "prompt": ["a"]}, {"kind": None, "request": None},
                                  {"\u0000": "\ud800"}])
def test_no_body_crashes_a_route(served, route, body):
    r = served["client"].post(route, content=json.dumps(body).encode())
    assert 400 <= r.status_code < 500, (route, body, r.text)
    assert r.json()["error"]


def test_serve_without_a_model_names_both_ways_to_give_one(monkeypatch):
    """No --model and no $ATTNLENS_MODEL: one line naming the option and the variable, as explain says it."""
    from attnlens.cli.serve import model_specs
    from attnlens.errors import ModelError

    monkeypatch.delenv("ATTNLENS_MODEL", raising=False)
    with pytest.raises(ModelError, match=r"^no model: pass --model M or set \$ATTNLENS_MODEL$"):
        model_specs(None)


def test_context_benchmarks_are_not_listed_and_errors_name_folders_not_paths(tmp_path):
    """The explorer's benchmark tables read token-level runs: a context benchmark's folder is not listed, and a
    folder that cannot be read is named as the page names it, never by the server's path."""
    from attnlens.serve.benchmarks import find_results, read_results

    root = tmp_path / "results"
    context, bad = root / "context", root / "bad"
    context.mkdir(parents=True)
    bad.mkdir()
    (context / "summary.json").write_text(json.dumps({"n_lds": 32, "metrics": {}}))
    (context / "records.jsonl").write_text("")
    (bad / "summary.json").write_text("{not json")
    assert list(find_results([root])) == ["results/bad"]
    for name, folder in (("results/bad", bad), ("results/context", context)):
        with pytest.raises(InputError) as err:
            read_results(name, folder)
        assert str(tmp_path) not in str(err.value) and name in str(err.value)


def test_a_job_shared_by_identical_requests_stops_only_when_every_request_gives_it_up():
    queue = JobQueue()
    gate, ran = threading.Event(), []

    def compute(job):
        ran.append(1)
        while not gate.is_set():
            job.report(0.5)
            time.sleep(0.01)
        return "done"

    first = queue.submit("a", "explain", "k", compute)
    time.sleep(0.05)
    assert queue.submit("a", "explain", "k", compute) is first  # an identical request shares the job
    queue.cancel(first)  # one of the two gives it up: the other's answer still comes
    time.sleep(0.05)
    assert first.state == RUNNING
    queue.cancel(first)  # the other too: it stops
    assert first.future.result(timeout=10).state == CANCELLED
    again = queue.submit("a", "explain", "k", compute)  # asked anew after the cancel: computed, not the dead job
    assert again is not first
    gate.set()
    assert again.future.result(timeout=10).result == "done" and len(ran) == 2


def test_the_attention_view_reports_after_its_forward_so_a_cancel_stops_it_there(served, monkeypatch):
    from attnlens.serve import compute
    from attnlens.serve.jobs import Cancelled

    heard = []
    data = compute.attention(served["minilm"], "a fine film", 2**30, heard.append)
    assert heard == [0.6, 0.9] and data["tokens"]

    def cancelled(fraction):
        raise Cancelled()

    monkeypatch.setattr(compute, "encode_attentions", lambda att: pytest.fail("encoded after the cancel"))
    with pytest.raises(Cancelled):
        compute.attention(served["minilm"], "a fine film", 2**30, cancelled)


def test_numbers_json_cannot_write_travel_marked_and_the_rest_as_plain_json():
    """A result with a NaN or infinite score is answered (not a 500), each such number as ``{"$float": ...}``;
    a finite result is written exactly as plain JSON."""
    from attnlens.serve.routes import ResultResponse

    body = {"scores": {"m": [0.5, float("nan"), float("inf"), -float("inf")]}, "tokens": ["NaN", "a"]}
    text = ResultResponse(body).body.decode()
    parsed = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert parsed["scores"]["m"] == [0.5, {"$float": "NaN"}, {"$float": "Infinity"}, {"$float": "-Infinity"}]
    assert parsed["tokens"] == ["NaN", "a"]  # a token that reads NaN stays a string
    finite = {"scores": {"m": [0.5, 1e-30]}, "text": "é"}
    assert json.loads(ResultResponse(finite).body) == finite
