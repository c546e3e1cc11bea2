"""``attnlens serve`` end to end in headless Chromium (Playwright driving the system's /usr/bin/chromium): type a
sentence and read the heatmaps, switch methods, target and words, measure faithfulness, open the layer, model and
head views, generate with a small LM and click or select answer tokens, open a benchmark folder and one of its
examples; texts with markup stay text; 512 tokens x 20 methods render in one short task. Each view is also
screenshot; ``make doc-images`` writes those screenshots over docs/images/serve-*.png (``ATTNLENS_DOC_IMAGES=1``),
so the docs show the page as it is; otherwise they go to a temporary folder and the checkout is left as it was.

Skipped when Chromium is missing, except under ``CI=true`` (where .ci/run installs it): there they fail.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from conftest import IN_CI, make_model, make_tokenizer, missing
from serve_support import FAST, MINILM, ServerThread, make_results, save_tiny_lm, save_tiny_seq2seq

from attnlens import Explainer

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and not IN_CI:
    pytest.skip("headless chromium not installed", allow_module_level=True)
DOC_IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"
WRITE_DOC_IMAGES = os.environ.get("ATTNLENS_DOC_IMAGES") == "1"
XSS = "<script>window.pwned = 1</script>"
FOLDER = "<img src=x onerror=window.pwned=2>"
SENTENCE = "the plot is thin, but the actors are wonderful ."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not MINILM.is_dir():
        missing(f"reference model not found at {MINILM}")
    if CHROMIUM is None:
        pytest.fail("CI=true but chromium is not installed (.ci/run installs it): the browser tests must run in CI")
    tmp = tmp_path_factory.mktemp("serve-browser")
    minilm = Explainer.from_pretrained(MINILM)
    labelled = make_model("bert")
    labelled.config.id2label, labelled.config.label2id = {0: XSS, 1: "fine"}, {XSS: 0, "fine": 1}
    shutil.copytree(make_results(minilm, tmp / "results" / "sst2-dev", n=4), tmp / "results" / FOLDER)
    from attnlens.serve import create_app

    app = create_app({"minilm-sst2": minilm, "tiny-lm": Explainer.from_pretrained(save_tiny_lm(tmp / "lm")),
                      "markup": Explainer(labelled, make_tokenizer()),
                      "tiny-s2s": Explainer.from_pretrained(save_tiny_seq2seq(tmp / "s2s"), attention="decoder")},
                     results=[tmp / "results"])
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: errors.append("dialog: " + d.message))
    page.goto(server.url)
    page.wait_for_selector("body[data-ready]")
    yield page
    assert not errors, errors
    assert page.evaluate("window.pwned") is None  # no text ever ran as markup
    context.close()


def expect(locator):
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(locator)


def _api(server, path, body):
    import httpx

    r = httpx.post(server.url + path.lstrip("/"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _rows(page, table="#heatmap"):
    return page.eval_on_selector_all(f"{table} tr", "rows => rows.map(r => r.dataset.method)")


def _titles(page, method, table="#heatmap"):
    """The value of every cell of a method's row, as the page shows it on hover."""
    return page.eval_on_selector_all(f"{table} tr[data-method='{method}'] td.cell",
                                     "cells => cells.map(c => c.title)")


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    """Where the views' screenshots go: docs/images under ``ATTNLENS_DOC_IMAGES=1``, else a temporary folder."""
    return DOC_IMAGES if WRITE_DOC_IMAGES else tmp_path_factory.mktemp("screenshots")


def _shoot(page, folder: Path, name: str) -> None:
    """A full-page screenshot of the view, from the top (the sticky header stays where it belongs)."""
    page.mouse.move(1200, 790)
    page.evaluate("window.scrollTo(0, 0)")
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0


def _explain(page, text=SENTENCE):
    page.fill("#text-a", text)
    page.evaluate("document.body.removeAttribute('data-explained')")
    page.click("#explain")
    page.wait_for_selector("body[data-explained]")


def test_explain_switch_methods_target_words_and_measure_faithfulness(page, server, screenshots):
    _explain(page)
    assert _rows(page) == FAST
    api = _api(server, "/api/explain", {"model": "minilm-sst2", "texts": [SENTENCE], "methods": FAST})[0]
    titles = _titles(page, "attcat")
    assert [t.rsplit(": ", 1)[0] for t in titles] == api["tokens"]
    assert float(titles[3].rsplit(": ", 1)[1]) == pytest.approx(api["scores"]["attcat"][3], rel=1e-3)
    assert "predicted positive" in page.inner_text("#prediction")

    page.uncheck("#methods input[value=rollout]")
    page.check("#methods input[value=saliency]")
    _explain(page)
    assert _rows(page) == ["rawatt", "agrad", "gae", "attcat", "saliency", "inputxgradient"]

    page.evaluate("document.body.removeAttribute('data-explained')")
    page.select_option("#target", "0")  # the other class: explained again at once
    page.wait_for_selector("body[data-explained]")
    assert "explained negative" in page.inner_text("#prediction")
    methods = ["rawatt", "agrad", "gae", "attcat", "saliency", "inputxgradient"]
    negative = _api(server, "/api/explain", {"model": "minilm-sst2", "texts": [SENTENCE], "methods": methods,
                                             "target": 0})[0]
    assert float(_titles(page, "agrad")[3].rsplit(": ", 1)[1]) == pytest.approx(negative["scores"]["agrad"][3],
                                                                                 rel=1e-3)
    page.select_option("#target", "")
    expect(page.locator("#prediction")).to_contain_text("explained positive")

    page.evaluate("document.body.removeAttribute('data-explained')")
    page.check("#words")
    page.wait_for_selector("body[data-explained]")
    words = _api(server, "/api/explain", {"model": "minilm-sst2", "texts": [SENTENCE], "methods": methods,
                                          "words": True})[0]
    assert [t.rsplit(": ", 1)[0] for t in _titles(page, "attcat")] == words["tokens"]
    page.uncheck("#words")

    page.click("#faithfulness")
    page.wait_for_selector("#heatmap td.faith svg")
    faith = _api(server, "/api/faithfulness", {"model": "minilm-sst2", "texts": [SENTENCE], "methods": methods})[0]
    shown = page.inner_text("#heatmap tr[data-method=attcat] td.faith")
    assert f"AOPC {faith['methods']['attcat']['aopc']['value']:.3f}" in shown
    assert page.locator("#heatmap td.faith svg").count() == len(methods)
    _shoot(page, screenshots, "serve-explain")


def test_layer_model_and_head_views(page, screenshots):
    _explain(page)
    page.click("nav button[data-tab=inside]")
    page.wait_for_selector("body[data-head-view='5:-1']")  # the last layer, mean over heads
    assert page.locator("#model-view canvas").count() == 6 * 12
    page.select_option("#layer-method", "attcat")
    assert _rows(page, "#layer-heatmap") == [f"layer {layer}" for layer in range(6)]
    page.click("#model-view canvas[data-layer='2'][data-head='3']")
    page.wait_for_selector("body[data-head-view='2:3']")
    n = page.locator("#head-view .col.left span").count()
    lines = page.locator("#head-view svg line").count()
    assert n == 13 and 0 < lines <= min(300, n * n)
    page.hover("#head-view .col.left span:nth-child(5)")
    visible = page.eval_on_selector_all("#head-view svg line", "ls => ls.filter(l => l.style.display !== 'none')"
                                        ".map(l => +l.dataset.q)")
    assert visible and set(visible) == {4}  # pointing at a token shows its own links
    _shoot(page, screenshots, "serve-inside")


def test_generate_click_and_select_answer_tokens(page, server, screenshots):
    page.click("nav button[data-tab=generate]")  # switches to the served language model
    assert page.input_value("#model") == "tiny-lm"
    page.fill("#prompt", "the capital of france is")
    page.click("#generate")
    page.wait_for_selector("body[data-step='0-0']")
    g = _api(server, "/api/generate", {"model": "tiny-lm", "prompt": "the capital of france is",
                                       "methods": FAST, "max_new_tokens": 8, "chat": False})[0]
    chips = page.locator("#answer span.gen")
    assert chips.all_inner_texts() == g["generated"]
    chips.nth(2).click()
    page.wait_for_selector("body[data-step='2-2']")
    n_prompt = len(g["prompt_tokens"])
    titles = _titles(page, "agrad", "#gen-heatmap")
    assert len(titles) == n_prompt + 2
    shown = [float(t.rsplit(": ", 1)[1]) for t in titles]
    assert shown == pytest.approx(g["scores"]["agrad"][2][:n_prompt + 2], rel=1e-3, abs=1e-9)
    chips.nth(1).hover()  # drag across answer tokens 1..3
    page.mouse.down()
    chips.nth(3).hover()
    page.mouse.up()
    page.wait_for_selector("body[data-step='1-3']")
    summed = [float(t.rsplit(": ", 1)[1]) for t in _titles(page, "agrad", "#gen-heatmap")]
    expected = [sum(g["scores"]["agrad"][t][j] for t in (1, 2, 3)) for j in range(n_prompt + 3)]
    assert summed == pytest.approx(expected, rel=1e-3, abs=1e-9)
    assert "steps 1–3" in page.inner_text("#step-caption")
    _shoot(page, screenshots, "serve-generate")

    summed_att = [float(t.rsplit(": ", 1)[1]) for t in _titles(page, "rawatt", "#gen-heatmap")]
    page.click("#stretch-answer")  # the stretch's own explanation replaces the summed rows
    page.wait_for_selector("body[data-stretch='1-3']")
    assert "the stretch explained as one answer" in page.inner_text("#step-caption")
    expect(page.locator("#stretch-answer")).to_be_hidden()
    (one,) = _api(server, "/api/answer", {"model": "tiny-lm", "prompt_ids": g["prompt_ids"] + g["generated_ids"][:1],
                                          "answer_ids": g["generated_ids"][1:4], "methods": FAST})
    own_att = [float(t.rsplit(": ", 1)[1]) for t in _titles(page, "rawatt", "#gen-heatmap")]
    assert own_att == pytest.approx(one["scores"]["rawatt"][:n_prompt + 3], rel=1e-3, abs=1e-9)
    assert own_att != pytest.approx(summed_att, rel=1e-2)  # rawatt is not linear in the explained value
    chips.nth(2).click()
    page.wait_for_selector("body[data-step='2-2']")
    expect(page.locator("#stretch-answer")).to_be_hidden()  # one step: nothing to explain as a stretch

    page.fill("#force", "paris [SEP] .")  # a special token inside the continuation is shown as one, not shaded
    page.click("#generate")
    expect(page.locator("#answer span.gen")).to_have_count(3)
    page.locator("#answer span.gen").nth(2).click()
    page.wait_for_selector("body[data-step='2-2']")
    classes = page.eval_on_selector_all("#gen-heatmap tr[data-method='agrad'] td.cell",
                                        "cs => cs.map(c => c.className)")
    assert classes[-1] == "cell special" and classes[-2] == "cell"  # [SEP] after "paris"
    page.fill("#force", "paris .")
    page.click("#generate")
    expect(page.locator("#answer span.gen")).to_have_count(2)
    assert "forced" in page.inner_text("#step-caption")
    for agnostic in ("rawatt", "rollout"):  # a contrast needs methods that depend on the explained token
        page.uncheck(f"#gen-methods input[value={agnostic}]")
    page.fill("#gen-contrast", "london .")
    page.click("#generate")
    expect(page.locator("#step-caption")).to_contain_text("minus \"london\"")  # the first step's contrast token
    chips.nth(1).click(modifiers=["Shift"])
    page.wait_for_selector("body[data-step='0-1']")
    expect(page.locator("#stretch-answer")).to_be_hidden()  # a contrast: no single answer to explain


def test_an_encoder_decoders_generation_shades_only_the_sequence_its_stream_scores(page, server):
    """Served with its decoder's own attention, an encoder-decoder scores the continuation before each step: the
    prompt's tokens are shown without a shade, as special tokens are, and left out of each row's colour scale."""
    page.click("nav button[data-tab=generate]")
    page.select_option("#model", "tiny-s2s")
    page.fill("#prompt", "the capital of france is")
    page.fill("#force", "paris is big")
    page.click("#generate")
    expect(page.locator("#answer span.gen")).to_have_count(3)
    page.locator("#answer span.gen").nth(2).click()
    page.wait_for_selector("body[data-step='2-2']")
    g = _api(server, "/api/generate", {"model": "tiny-s2s", "prompt": "the capital of france is",
                                       "target": "paris is big", "methods": ["agrad"], "chat": False})[0]
    n_prompt = len(g["prompt_tokens"])
    classes = page.eval_on_selector_all("#gen-heatmap tr[data-method='agrad'] td.cell",
                                        "cs => cs.map(c => c.className)")
    assert classes == ["cell special"] * n_prompt + ["cell", "cell"]  # the prompt: no score at any step
    shown = [float(t.rsplit(": ", 1)[1]) for t in _titles(page, "agrad", "#gen-heatmap")[n_prompt:]]
    assert shown == pytest.approx(g["scores"]["agrad"][2][n_prompt:n_prompt + 2], rel=1e-3, abs=1e-9)


def test_benchmark_folder_sort_and_open_an_example(page, screenshots):
    page.click("nav button[data-tab=bench]")
    page.wait_for_selector("#bench-table tr td")
    options = page.eval_on_selector_all("#bench-select option", "os => os.map(o => o.textContent)")
    assert options[0].startswith("results/" + FOLDER) and options[1].startswith("results/sst2-dev")  # as text
    page.select_option("#bench-select", "results/sst2-dev")
    expect(page.locator("#bench-facts")).to_contain_text("4 examples")
    page.wait_for_load_state("networkidle")  # no reply still on its way to draw the table again
    assert page.eval_on_selector_all("#bench-table tr td:first-child", "c => c.map(x => x.textContent)") == \
        ["rawatt", "attcat"]
    aopc = "#bench-table tr td:nth-child(2)"
    values = page.eval_on_selector_all(aopc, "c => c.map(x => parseFloat(x.textContent))")
    assert len(set(values)) == 2  # two different scores: each order is visible
    for reverse in (True, False):  # best (highest) first, then the other way round
        page.click("#bench-table th:nth-child(2)")
        page.wait_for_function(  # the table drawn again in the chosen order
            "([cells, want]) => JSON.stringify([...document.querySelectorAll(cells)]"
            ".map(x => parseFloat(x.textContent))) === JSON.stringify(want)",
            arg=[aopc, sorted(values, reverse=reverse)], timeout=5000)
        shown = page.eval_on_selector_all(aopc, "c => c.map(x => parseFloat(x.textContent))")
        assert shown == sorted(values, reverse=reverse)
    # the shown folder opened again (a repeated or late reply) keeps the order chosen on it
    page.evaluate("openBenchmark()")
    assert page.evaluate("state.benchSort") is not None
    assert page.eval_on_selector_all(aopc, "c => c.map(x => parseFloat(x.textContent))") == shown
    assert page.locator("#bench-curves svg").count() >= 1
    _shoot(page, screenshots, "serve-benchmark")
    page.evaluate("() => { document.getElementById('model').value = 'markup'; onModel(); }")
    first = page.locator("#bench-examples button").first
    text = first.inner_text().split(" ", 4)[-1]
    first.click()
    page.wait_for_selector("body[data-explained]")
    assert page.get_attribute("body", "data-tab") == "explain"
    assert page.input_value("#text-a").strip() == text.strip()
    assert page.input_value("#model") == "minilm-sst2"  # the benchmark's model, whichever was selected


def test_the_open_tab_is_in_the_address_and_a_reload_opens_it_again(page, server):
    page.click("nav button[data-tab=bench]")
    page.wait_for_selector("#bench-table tr td")
    assert page.evaluate("location.hash") == "#bench"
    page.reload()
    page.wait_for_selector("body[data-ready]")
    page.wait_for_selector("#bench-table tr td")  # opened as a click on it opens it: the folders are listed
    assert page.get_attribute("body", "data-tab") == "bench" and page.is_hidden("#tab-explain")
    page.evaluate("location.hash = '#sources'")  # an address edited by hand (or Back) switches the tab
    page.wait_for_selector("body[data-tab=sources]")
    assert page.input_value("#model") == "tiny-lm"  # switched to the served language model, as a click does
    page.evaluate("location.hash = '#no-such-tab'")  # names no tab: the page stays as it is
    assert page.get_attribute("body", "data-tab") == "sources"
    page.reload()  # and opens on the first tab
    page.wait_for_selector("body[data-ready]")
    assert page.is_visible("#tab-explain") and page.is_hidden("#tab-sources")


def test_labels_with_markup_are_shown_as_text(page):
    page.select_option("#model", "markup")
    assert XSS in page.inner_text("#target")
    page.fill("#text-a", "the movie was good")
    page.click("#explain")
    page.wait_for_selector("body[data-explained]")
    assert XSS in page.inner_text("#prediction")
    page.select_option("#model", "minilm-sst2")
    _explain(page, "<img src=x onerror=window.pwned=3> <script>window.pwned=4</script> a fine film")
    tokens = [t.rsplit(": ", 1)[0] for t in _titles(page, "rawatt")]
    assert "<" in tokens and "script" in tokens and ">" in tokens  # shown as the tokens they are
    assert page.evaluate("document.querySelectorAll('script').length") == 1
    assert page.evaluate("document.querySelectorAll('img').length") == 0


def test_512_tokens_and_20_methods_render_in_one_short_task(page, record_property):
    """The page's own renderer on a synthetic explanation; the time is reported (docs/serve.md), not asserted."""
    times = page.evaluate("""() => {
        const n = 512, methods = Array.from({length: 20}, (_, k) => "method" + k), scores = {};
        methods.forEach((m, k) => { scores[m] = Array.from({length: n}, (_, j) => Math.sin(j * (k + 1))); });
        const exp = {text: "x", tokens: Array.from({length: n}, (_, j) => "tok" + j),
                     special: Array.from({length: n}, (_, j) => j === 0 || j === n - 1), target: 1, predicted: 1,
                     probabilities: [0.2, 0.8], labels: ["negative", "positive"], scores, layers: {}, meta: {}};
        return [0, 1, 2].map(() => window.attnlens.renderExplanation(exp));  // the first one includes warm-up
    }""")
    assert page.locator("#heatmap tr[data-method]").count() == 20
    widths = page.eval_on_selector_all("#heatmap td.strip canvas", "cs => cs.map(c => c.width)")
    assert widths == [512 * 10] * 21  # a strip of token labels, then one strip per method, a column per token
    strip = page.locator("#heatmap tr[data-method=method3] canvas")
    strip.hover(position={"x": 7 * 10 + 5, "y": 8})
    assert strip.get_attribute("title") == f"tok7: {math.sin(7 * 4):.4g}".replace("e-0", "e-")
    record_property("render_512x20_ms", times)
    print(f"\nrendering 512 tokens x 20 methods (DOM + layout): first {times[0]:.0f} ms, then "
          f"{times[1]:.0f} and {times[2]:.0f} ms")


def test_views_of_a_512_token_input_stay_usable(page):
    _explain_long = " ".join(["the plot is thin, but the actors are wonderful ."] * 50)  # cut to 512 tokens
    page.uncheck("#methods input[value=rollout]")
    for m in ("agrad", "gae", "attcat", "inputxgradient"):
        page.uncheck(f"#methods input[value={m}]")
    _explain(page, _explain_long)
    assert page.locator("#heatmap canvas").count() == 2  # the token labels and rawatt's strip
    assert page.eval_on_selector("#heatmap tr[data-method=rawatt] canvas", "c => c.width") == 512 * 10
    page.click("nav button[data-tab=inside]")
    page.wait_for_selector("body[data-head-view='5:-1']", timeout=120_000)
    sizes = page.eval_on_selector_all("#model-view canvas", "cs => cs.map(c => c.width)")
    assert sizes == [48] * 72  # thumbnails of block maxima, not 512 x 512 images
    assert page.locator("#head-view .col.left span").count() == 512
    assert page.locator("#head-view svg line").count() == 300  # the strongest links, not 262,144 lines


def test_sources_of_an_answer(page, server, screenshots):
    page.click("nav button[data-tab=sources]")  # switches to the served language model
    assert page.input_value("#model") == "tiny-lm"
    context, query = "the movie was great . the actors were bad . the plot was thin .", "was the movie good"
    page.fill("#src-context", context)
    page.fill("#src-query", query)
    page.fill("#src-max-new", "4")
    page.click("#attribute")
    page.wait_for_selector("body[data-attributed='3']")
    result = _api(server, "/api/attribute", {"model": "tiny-lm", "context": context, "query": query,
                                             "methods": ["attngate", "attnlrp", "loo"], "max_new_tokens": 4,
                                             "sources": "sentence"})
    cells = page.eval_on_selector_all("#src-table tr", "rows => rows.map(r => Array.from(r.children, c => "
                                      "c.textContent))")
    methods = list(result["sources"][0]["scores"])
    assert cells[0][:2] == ["#", "source"] and sorted(cells[0][2:]) == sorted(methods) == ["attngate", "attnlrp", "loo"]
    assert [row[1] for row in cells[1:]] == [s["text"] for s in result["sources"]]
    loo = [s["scores"]["loo"] for s in result["sources"]]
    assert [float(row[cells[0].index("loo")]) for row in cells[1:]] == pytest.approx(loo, rel=1e-3, abs=1e-12)
    assert result["answer"] in page.inner_text("#src-answer-line")
    _shoot(page, screenshots, "serve-sources")


def test_a_language_models_next_token_is_named_with_its_probability(page, server):
    page.select_option("#model", "tiny-lm")
    page.fill("#text-a", "the capital of france is")
    page.evaluate("document.body.removeAttribute('data-explained')")
    page.click("#explain")
    page.wait_for_selector("body[data-explained]")
    (api,) = _api(server, "/api/explain", {"model": "tiny-lm", "texts": ["the capital of france is"],
                                           "methods": ["rawatt"]})
    shown = page.inner_text("#prediction")
    assert shown.startswith("explaining next token " + json.dumps(api["meta"]["target_token"]))
    assert f"(p = {api['probabilities'][0]:.3f})" in shown and "the greedy choice" in shown


def _hold(page, marker):
    """Hold the page's request that queues a job whose request holds ``marker``; returns the list the held route
    lands in (release it with ``held[0].continue_()``)."""
    held = []

    def route(r):
        if marker in (r.request.post_data or "") and not held:
            held.append(r)
        else:
            r.continue_()

    page.route("**/api/jobs", route)
    return held


def _wait_until(page, done, what):
    for _ in range(600):
        if done():
            return
        page.wait_for_timeout(50)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_late_reply_never_draws_over_a_newer_request(page, server):
    late = "a text whose explanation answers late"
    held = _hold(page, late)
    page.fill("#text-a", late)
    page.click("#explain")
    _wait_until(page, lambda: held, "the held request")
    _explain(page, SENTENCE)  # the newer request: drawn
    shown = _titles(page, "rawatt")
    assert [t.rsplit(": ", 1)[0] for t in shown][1:3] == ["the", "plot"]
    held[0].continue_()
    page.wait_for_selector("body[data-dropped='1']")  # the late reply arrived, and was dropped
    assert _titles(page, "rawatt") == shown

    page.unroute("**/api/jobs")  # faithfulness measured for SENTENCE, answered after another text is explained
    held = _hold(page, '"kind":"faithfulness"')
    page.evaluate("document.body.removeAttribute('data-dropped')")
    page.click("#faithfulness")
    _wait_until(page, lambda: held, "the held measurement")
    _explain(page, "another text entirely")
    held[0].continue_()
    page.wait_for_selector("body[data-dropped='1']")
    assert page.locator("#heatmap td.faith svg").count() == 0  # no AOPC of SENTENCE under another text


def test_a_note_of_a_computation_that_succeeded_is_not_shown_as_an_error(page):
    _explain(page, "the movie " * 300)  # truncated at the model's window: a note, and the heatmap
    expect(page.locator("#note")).to_contain_text("truncated")
    assert page.locator("#error").is_hidden()
    assert page.locator("#heatmap tr[data-method]").count() > 0


def test_a_failed_explanation_hides_the_earlier_inputs_heatmap(page):
    _explain(page)
    page.fill("#text-a", "x" * 20_001)  # beyond the server's longest text
    page.click("#explain")
    expect(page.locator("#error")).to_contain_text("at most 20000 per text")
    assert page.locator("#explain-out").is_hidden()  # the heatmap shown was the earlier input's


def _explain_with_rawatt_scores(page, text, edit):
    """Explain ``text`` on the page with the server's raw-attention scores of it changed by ``edit`` (the list of
    the reply's scores, edited in place) on their way to the page."""
    def route(r):
        response = r.fetch()
        body = response.json()
        result = body.get("result") if isinstance(body, dict) else None
        if result and text in json.dumps(result):
            edit(result[0]["scores"]["rawatt"])
        r.fulfill(response=response, json=body)

    page.route("**/api/jobs**", route)
    try:
        _explain(page, text)
    finally:
        page.unroute("**/api/jobs**")


def test_a_word_that_stands_twice_is_listed_with_its_occurrence(page):
    """Two tokens of one text in a method's top list read ``best#1`` and ``best#2``, as in the terminal and HTML
    views, never the same string twice."""
    def edit(scores):  # [CLS] the best of the best [SEP]
        scores[:] = [0.0, 0.1, 0.3, 0.05, 0.1, 0.2, 0.0]

    _explain_with_rawatt_scores(page, "the best of the best", edit)
    listed = page.eval_on_selector_all("#top-tokens div", "boxes => boxes.map(b => b.innerText)")
    shown = next(b for b in listed if b.startswith("rawatt")).split("\n")[1:]
    assert [line.split()[0] for line in shown] == ["best#1", "best#2", "the#1", "the#2", "of"]


def test_scores_that_are_not_finite_are_shown_as_such(page):
    """A NaN score is grey and reads NaN (not a white 0.000), an infinite one is drawn full, and the other tokens
    keep their shades relative to the largest finite score: the server writes such numbers as
    ``{"$float": ...}``, which the page reads back as numbers."""
    def edit(scores):
        scores[1], scores[2] = {"$float": "NaN"}, {"$float": "Infinity"}

    _explain_with_rawatt_scores(page, "a text whose scores are not all finite", edit)
    titles = _titles(page, "rawatt")
    assert titles[1].endswith(": NaN") and titles[2].endswith(": Infinity")
    colours = page.eval_on_selector_all("#heatmap tr[data-method='rawatt'] td.cell",
                                        "cells => cells.map(c => getComputedStyle(c).backgroundColor)")
    assert colours[1] == "rgb(156, 163, 175)" and colours[2] == "rgba(22, 163, 74, 0.85)"
    finite = colours[3:-1]  # the other words ([SEP] last): the largest finite score full, the others lighter
    assert "rgba(22, 163, 74, 0.85)" in finite and len(set(finite)) > 1
