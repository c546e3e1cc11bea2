"""The sanity metric (cascading model-parameter randomisation) in the benchmark, its plot and its report section."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import make_model
from scipy.stats import spearmanr

from attnlens import Explainer
from attnlens.data import Dataset, Example
from attnlens.errors import InputError
from attnlens.evaluation.metrics import resolve_metrics
from attnlens.evaluation.runner import run_benchmark
from attnlens.evaluation.sanity import randomisation_blocks, rank_correlation

TEXTS = ["i really didn't like this movie .", "a charming journey",
         "the plot was boring but the actors were great !", "the movie was good", "a boring plot"]
METHODS = ["rawatt", "rollout", "saliency", "occlusion"]


def _dataset() -> Dataset:
    return Dataset("toy", "dev", "classification", [Example(str(i), t, i % 2) for i, t in enumerate(TEXTS)],
                   ["negative", "positive"])


def _run(tmp_path, family="bert", methods=METHODS):
    model = make_model(family)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ex = Explainer(model, _tokenizer())
    summary = run_benchmark(ex, _dataset(), tmp_path / "out", methods=methods, metrics="sanity,aopc",
                            progress=False)
    return model, before, ex, summary


def _tokenizer():
    from conftest import make_tokenizer

    return make_tokenizer()


def test_cascade_goes_from_the_head_down(tmp_path):
    model, before, ex, summary = _run(tmp_path)
    sanity = summary["sanity"]
    assert sanity["depths"] == ["head", "layer 2", "layer 1"]
    # the model is its trained self again
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    curves = sanity["methods"]
    # the head does not touch attention: raw attention and rollout are exactly unchanged there (independent
    # ground truth), while a gradient method and occlusion, which read the head, change
    assert curves["rawatt"]["spearman"][0] == pytest.approx(1.0)
    assert curves["rollout"]["spearman"][0] == pytest.approx(1.0)
    assert curves["saliency"]["spearman"][0] < 0.999
    assert curves["occlusion"]["spearman"][0] < 0.999
    # randomising the top layer changes the last layer's attention
    assert curves["rawatt"]["spearman"][1] < 0.999
    for m, c in curves.items():
        assert summary["results"][m]["sanity"] == pytest.approx(np.mean(c["spearman"])), m
        assert len(c["spearman"]) == len(c["spearman_abs"]) == 3
    assert summary["metrics"]["sanity"]["toward_best"] is True and summary["metrics"]["sanity"]["best"] == 0.0
    assert "sanity" in (tmp_path / "out" / "table.md").read_text()


def test_sanity_values_are_the_rank_correlations_of_re_explanations(tmp_path):
    """The head step recomputed by hand: randomise the weights of the classifier and of the pooler it reads (the
    head's modules in the model's order) as documented, explain again for the same targets, average Spearman's ρ
    over the examples."""
    model, _, ex, summary = _run(tmp_path, methods=["saliency"])
    original = ex.explain(TEXTS, ["saliency"])
    std = model.config.initializer_range
    gen = torch.Generator().manual_seed(0)  # EvalConfig's default seed
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in [*model.classifier.parameters(), *model.bert.pooler.parameters()]:
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    try:
        redone = ex.explain(TEXTS, ["saliency"], target=[e.target for e in original])
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
    rhos = []
    for a, b in zip(original, redone, strict=True):
        keep = ~np.array(a.special)
        rhos.append(spearmanr(a.scores["saliency"][keep], b.scores["saliency"][keep]).statistic)
    assert summary["sanity"]["methods"]["saliency"]["spearman"][0] == pytest.approx(np.mean(rhos), abs=1e-6)


def test_rank_correlation_is_undefined_for_constant_scores():
    assert rank_correlation(np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    assert rank_correlation(np.array([1.0, 1.0]), np.array([0.0, 2.0])) is None
    assert rank_correlation(np.array([1.0]), np.array([2.0])) is None


def test_blocks_are_found_for_decoders_and_encoder_decoders():
    assert [n for n, _ in randomisation_blocks(make_model("gpt2"))] == ["head", "layer 2", "layer 1"]
    assert [n for n, _ in randomisation_blocks(make_model("bart"), "encoder")] == ["head", "layer 2", "layer 1"]


@pytest.mark.parametrize("family, between", [("bert", "bert.pooler.dense"), ("albert", "albert.pooler")])
def test_the_head_step_redraws_what_lies_between_the_last_layer_and_the_classifier(family, between):
    model = make_model(family)
    named = dict(model.named_modules())
    head = randomisation_blocks(model)[0]
    assert head[0] == "head" and any(m is named[between] for m in head[1])  # the pooler the classifier reads
    every = [m for _, modules in randomisation_blocks(model) for m in modules]
    redrawn = {id(p) for m in every for p in m.parameters()}
    kept = [n for n, p in model.named_parameters() if p.dim() >= 2 and id(p) not in redrawn]
    assert kept and all("embedding" in n for n in kept), kept  # only the embeddings stay trained


def test_a_type_without_known_layers_is_refused_before_writing(tmp_path, entry_without_layers):
    ex = Explainer(make_model("deberta"), _tokenizer())  # its architecture entry has no layers here
    with pytest.raises(InputError, match="sanity"):
        run_benchmark(ex, _dataset(), tmp_path / "out", methods=["rawatt"], metrics="sanity", progress=False)
    assert not (tmp_path / "out").exists()


def test_all_metrics_leave_sanity_out_and_it_can_be_named():
    assert "sanity" not in resolve_metrics("all")
    assert resolve_metrics("sanity") == ["sanity"]


def test_plot_and_report_show_the_curves(tmp_path):
    from attnlens.viz import plots
    from attnlens.viz.report import write_report

    _, _, _, summary = _run(tmp_path, methods=["rawatt", "saliency"])
    fig = plots.plot_sanity(summary, tmp_path / "sanity.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["none", "head", "layer 2", "layer 1"]
    lines = {line.get_label(): line.get_ydata() for line in ax.get_lines() if not line.get_label().startswith("_")}
    np.testing.assert_allclose(lines["saliency"], [1.0, *summary["sanity"]["methods"]["saliency"]["spearman"]])
    assert (tmp_path / "sanity.png").stat().st_size > 0
    page = write_report(tmp_path / "out").read_text(encoding="utf-8")
    assert "Sanity: explanations of ever more randomised models" in page


def test_an_interrupted_sanity_run_explains_only_the_depths_it_lacks(tmp_path):
    """Each randomised depth is kept as it is finished; a resumed run re-explains only the missing ones and finds
    the same correlations as the uninterrupted run (the later depths still see the earlier depths' weights)."""
    _, _, ex, full = _run(tmp_path)
    depths_file = tmp_path / "out" / "sanity.jsonl"
    rows = depths_file.read_text().splitlines()
    assert [json.loads(r)["depth"] for r in rows] == ["head", "layer 2", "layer 1"]
    depths_file.write_text(rows[0] + "\n" + rows[1][: len(rows[1]) // 2])  # the second depth's line torn
    (tmp_path / "out" / "summary.json").unlink()
    calls = []
    explain = ex.explain

    def counting(texts, *args, **kwargs):
        calls.append(len(texts))
        return explain(texts, *args, **kwargs)

    ex.explain = counting
    again = run_benchmark(ex, _dataset(), tmp_path / "out", methods=METHODS, metrics="sanity,aopc", progress=False)
    assert calls == [len(TEXTS), len(TEXTS)]  # layer 2 and layer 1; the head's depth was kept
    for m in METHODS:
        for key in ("spearman", "spearman_abs"):
            assert again["sanity"]["methods"][m][key] == pytest.approx(full["sanity"]["methods"][m][key]), (m, key)
    assert len(depths_file.read_text().splitlines()) == 3
    restarted = run_benchmark(ex, _dataset(), tmp_path / "out", methods=METHODS, metrics="sanity,aopc",
                              progress=False, resume=False)
    assert restarted["sanity"] == full["sanity"]


@pytest.mark.parametrize("metrics", ["sanity", "consistency", "sanity,consistency"])
def test_data_set_metrics_alone_measure_every_example_and_resume_as_complete(tmp_path, metrics):
    """A run of data-set metrics alone writes each method's row with no per-example metric: those rows are results,
    not lines to repair, so the run is complete and a second run finds every example done."""
    import warnings

    ex = Explainer(make_model("bert"), _tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no line is taken out as "not a results row"
        summary = run_benchmark(ex, _dataset(), tmp_path / "out", methods=["rawatt", "saliency"], metrics=metrics,
                                progress=False)
    assert summary["n_examples"] == len(TEXTS) and summary["timing"]["complete"]
    for name in metrics.split(","):
        assert set(summary[name]["methods"] if name == "sanity" else summary[name]) >= {"rawatt", "saliency"}
    again = run_benchmark(ex, _dataset(), tmp_path / "out", methods=["rawatt", "saliency"], metrics=metrics,
                          progress=False)
    assert again["n_examples"] == len(TEXTS) and again["timing"]["complete"]
