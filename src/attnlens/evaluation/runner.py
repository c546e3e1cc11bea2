"""The benchmark runner: explain once, perturb on token ids, score in batches, write results as it goes.

Work is done in chunks of examples (in data-set order). For each chunk the runner

1. explains the examples not yet in ``explanations.jsonl`` (one call for all methods; for Kendall τ one more call
   per other class, class-specific methods only) and appends them there;
2. collects every perturbed input that any metric of any method needs, scores each distinct one once
   (length-sorted batches, ``torch.no_grad``), computes the per-example metrics and appends them to
   ``examples.jsonl``.

Chunks are fixed: chunk ``c`` holds examples ``c·chunk_size ..``, whichever process does it and whatever was done
before. An interrupted run started again with the same settings skips what is on disk and continues; the summary is
always computed from the files, so a resumed run gives the same totals as an uninterrupted one. With ``shard=``
the run is one process of a data-parallel run (:mod:`.parallel`): it does every ``count``-th chunk in its own
directory and merges what is complete into ``out_dir`` at its end. See ``docs/benchmark-format.md`` for the files
and ``docs/scaling.md`` for several processes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.allocator import release_free_memory
from ..core.encoding import normalize_texts
from ..core.fused_attention import weights_dtype
from ..core.memory import DEFAULT_BUDGET, parse_budget
from ..data import Dataset, class_order, names_classes
from ..errors import InputError, MethodError
from ..models.architectures import adapter_for
from ..paths import check_output_path
from ..results.explanation import Explanation
from .metrics import (
    EvalConfig,
    Item,
    answer_token_positions,
    consistency_of,
    kendall_other_classes,
    resolve_metrics,
    score_examples,
)
from .parallel import Shard, chunks, merge_sources, shard_lock
from .perturb import ModelPredictor, Predict
from .results import (
    FILES,
    FORMAT_VERSION,
    SHARDS_DIR,
    BenchmarkSettings,
    append_rows,
    clear_results,
    complete_examples,
    differing_settings,
    example_row_of,
    example_rows,
    explanation_cache,
    read_rows,
    read_run,
    replacing_results,
    results_lock,
    rewrite_rows,
    shard_dirs,
    target_key,
    write_json,
)
from .sanity import cascading_randomisation, randomisation_blocks
from .summary import summarize


# ------------------------------------------------------------------ helpers
def _class_specific(methods: Sequence[str]) -> dict[str, bool]:
    from ..methods import get_method

    out = {}
    for m in methods:
        try:
            out[m] = bool(get_method(m).class_specific)
        except Exception:  # a method this registry does not know (e.g. loaded results): assume class-specific
            out[m] = True
    return out


class _ExplainWith:
    """The explainer, with extra keyword arguments for every ``explain`` call (memory budget, progress callback);
    everything else is the explainer's."""

    def __init__(self, explainer: Any, kwargs: dict[str, Any]) -> None:
        self._explainer = explainer
        self.kwargs = kwargs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._explainer, name)

    def takes(self, name: str) -> bool:
        """Whether the explainer's ``explain`` takes the keyword ``name`` (duck-typed explainers may not)."""
        import inspect

        return name in inspect.signature(self._explainer.explain).parameters

    def explain(self, *args: Any, **kwargs: Any) -> Any:
        return self._explainer.explain(*args, **self.kwargs, **kwargs)


# --------------------------------------------------------------------- runner
@dataclass(frozen=True)
class BenchmarkRun:
    """How :func:`run_benchmark` runs: what it measures, in which batches, and how it writes and reports.

    Attributes:
        methods: method ids, ``"all"`` or a comma-separated string.
        metrics: metric names (default ``aopc, lodds, kendall``; ``"all"`` for every classification metric).
        config: protocol and metric settings (:class:`EvalConfig`); its ``pad_token_id`` defaults to the model's.
        batch_size: inputs per explanation batch.
        eval_batch_size: perturbed inputs per forward pass.
        chunk_size: examples per unit of work: explained, scored, written to disk and shown as progress together
            (an interruption loses at most one chunk).
        resume: continue a previous run in ``out_dir`` (it must have the same settings); ``False`` starts over.
        progress: show a progress bar with an ETA.
        explain_options: per-method options passed to ``explainer.explain``.
        target_kind: what the explanations are of: ``"logit"``, ``"probability"`` or ``"loss"`` (log-probability
            of the explained class; Karpekov & Miller 2023 explain AGrad for the loss of the gold label).
        target: explain the ``"predicted"`` class (default) or the ``"gold"`` label (Karpekov & Miller 2023, and
            always under ``protocol="attcat-code"``). Metrics that track a class still track ŷ under
            ``protocol="paper"``.
        model_name: how the model is named in the results (default: the explainer's name).
        predict: scorer of perturbed inputs (default: :class:`ModelPredictor` on ``explainer.model``, SDPA
            attention, no gradients).
        stop_after: stop after this many newly processed examples (simulates an interruption; for tests).
        log: called with a line when the summary is written.
        memory_budget: passed to ``explainer.explain`` (e.g. ``"4GB"``; default: the explainer's); the perturbed
            inputs' forwards are batched within it too (default 4 GiB).
        shard: this process's :class:`~attnlens.evaluation.parallel.Shard` of a data-parallel run: it does chunks
            ``index, index + count, ...`` in ``out_dir/shards/INDEX-of-COUNT/`` (``resume=False`` starts that
            directory over; clear ``out_dir`` first to start a whole run over), then merges everything complete
            into ``out_dir``, waiting for the lock of ``out_dir`` while another process merges.
        check_only: check everything (explaining one example when ``explain_options`` are given) and return
            ``None`` without writing: what a launcher does before it starts the processes.
    """

    methods: str | Sequence[str] = "all"
    metrics: str | Sequence[str] | None = None
    config: EvalConfig | None = None
    batch_size: int = 32
    eval_batch_size: int = 64
    chunk_size: int = 16
    resume: bool = True
    progress: bool = True
    explain_options: dict[str, dict[str, Any]] | None = None
    target_kind: str = "logit"
    target: str = "predicted"
    model_name: str | None = None
    predict: Predict | None = None
    stop_after: int | None = None
    log: Callable[[str], None] | None = None
    memory_budget: str | int | None = None
    shard: Shard | None = None
    check_only: bool = False


def run_benchmark(
    explainer: Any, dataset: Dataset, out_dir: str | Path, run: BenchmarkRun | None = None, **overrides: Any,
) -> dict[str, Any] | None:
    """Benchmark ``methods`` × ``metrics`` on ``dataset`` and write the results directory ``out_dir``.

    Args:
        explainer: an :class:`attnlens.Explainer` (anything with ``explain``, ``predict_proba`` and ``model``).
        dataset: from :func:`attnlens.data.load_dataset`.
        out_dir: results directory (created; see ``docs/benchmark-format.md``). Locked while the run writes it:
            a second run on the same directory raises :class:`InputError`.
        run: how to run (:class:`BenchmarkRun`; default: its defaults).
        **overrides: fields of :class:`BenchmarkRun` that replace ``run``'s, e.g. ``methods="attcat,grads"``.

    Returns:
        The summary (also written to ``summary.json``): of every example that is complete so far, in all shards.
    """
    from ..methods import resolve_methods

    unknown = [name for name in overrides if name not in _RUN_FIELDS]
    if unknown:
        raise TypeError(f"run_benchmark() got an unexpected keyword argument {unknown[0]!r}")
    run = dataclasses.replace(run or BenchmarkRun(), **overrides)
    methods, metrics, config, target, target_kind = run.methods, run.metrics, run.config, run.target, run.target_kind
    batch_size, eval_batch_size, chunk_size = run.batch_size, run.eval_batch_size, run.chunk_size
    head = getattr(explainer, "head", None)
    model_task = getattr(head, "task", "classification")
    kind = getattr(head, "kind", "a sequence classifier")
    if model_task not in ("classification", "qa"):
        raise InputError(f"the benchmark scores sequence classifiers and extractive QA models; this model is {kind}")
    qa = dataset.task == "qa"
    if qa != (model_task == "qa"):
        raise InputError(f"dataset {dataset.name} is {'a QA' if qa else 'a classification'} data set but the model "
                         f"is {kind}")
    if getattr(getattr(explainer, "head", None), "multi_label", False):
        raise InputError("the benchmark scores single-label classifiers; this model is multi-label "
                         "(config.problem_type='multi_label_classification')")
    if target not in ("predicted", "gold"):
        raise InputError(f"target must be 'predicted' or 'gold', got {target!r}")
    method_ids = _applicable_methods(methods, explainer, resolve_methods)
    metric_ids = resolve_metrics(("precision_at_k" if qa else None) if metrics is None else metrics)
    if qa and metric_ids != ["precision_at_k"]:
        raise InputError("on QA data sets the benchmark measures precision_at_k only (--metrics precision_at_k)")
    if not qa and "precision_at_k" in metric_ids:
        raise InputError("precision_at_k needs a QA data set and an extractive QA model")
    if "sanity" in metric_ids:  # a type whose layers attnlens cannot find is refused before anything is written
        randomisation_blocks(explainer.model, getattr(explainer, "stream", "self"))
    n_classes = int(explainer.model.config.num_labels)
    if not qa and dataset.labels and len(dataset.labels) != n_classes:
        raise InputError(
            f"dataset {dataset.name} has {len(dataset.labels)} classes ({', '.join(dataset.labels)}) but the model "
            f"has {n_classes}"
        )
    if config is None or config.pad_token_id is None:
        config = dataclasses.replace(config or EvalConfig(), pad_token_id=_pad_id(explainer))
    if qa and (target == "gold" or config.protocol == "attcat-code"):  # its explained span is the predicted one
        raise InputError("a QA model is benchmarked on the answer span it predicts: target 'gold' (--target gold) "
                         "and protocol 'attcat-code' are for classifiers")
    if config.protocol == "attcat-code":  # the AttCAT code explains the gold label: recorded as it is done
        target = "gold"
    for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size),
                        ("chunk_size", chunk_size)):
        if not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be a positive number, got {value}")
    if not len(dataset):
        raise InputError(f"dataset {dataset.name} has no examples")
    try:  # the encoder's own checks, now, before anything is written (explaining would stop at its chunk)
        normalize_texts([e.text for e in dataset])
    except InputError as exc:
        raise InputError(f"dataset {dataset.name}: {_by_example(str(exc), [e.id for e in dataset])}") from None
    if not qa:
        dataset = _in_model_order(dataset, list(getattr(explainer, "labels", None) or []))
        _check_labels(dataset, n_classes, need=target == "gold" or config.protocol == "attcat-code")
    if target_kind == "loss" and target != "gold" and config.protocol != "attcat-code":
        raise InputError("target kind 'loss' is the loss of the gold label: use it with target 'gold' (--target gold)")
    model_setup = _model_setup(explainer)
    explainer = _ExplainWith(explainer, {} if run.memory_budget is None else {"memory_budget": run.memory_budget})
    explain_options = _checked_options(explainer, dataset, methods, method_ids, run.explain_options, target,
                                       target_kind, config)
    out = check_output_path(out_dir, "results directory", directory=True)
    settings = BenchmarkSettings(
        model=run.model_name or str(getattr(explainer, "name", type(explainer.model).__name__)),
        dataset=dataset.name, split=dataset.split, example_ids=[e.id for e in dataset],
        methods=method_ids, metrics=metric_ids, config=dataclasses.asdict(config),
        explain_options=dict(explain_options or {}), target_kind=target_kind, target=target,
        model_setup=model_setup,
        chunk_size=chunk_size if run.shard is not None and run.shard.count > 1 else None,
    )
    if run.resume:  # the run to resume, and every process's part of it, must have been made with these settings
        _check_resumable(out)
        for d in [out, *shard_dirs(out)]:
            _check_settings(d / "run.json", settings, d)
    if run.check_only:
        return None
    # Everything is checked: from here on we write, holding the directory's lock until the last file is written.
    out.mkdir(parents=True, exist_ok=True)
    scoring_budget = parse_budget(run.memory_budget)  # the perturbed inputs' forwards plan within it too
    predict = run.predict or ModelPredictor(explainer.model, config.pad_token_id, eval_batch_size,
                                            memory_budget=scoring_budget)
    work = dict(settings=settings, config=config, method_ids=method_ids, metric_ids=metric_ids, n_classes=n_classes,
                batch_size=batch_size, explain_options=explain_options, target_kind=target_kind, target=target,
                predict=predict, stop_after=run.stop_after)
    finish = dict(settings=settings, config=config, method_ids=method_ids, metric_ids=metric_ids,
                  batch_size=batch_size, chunk_size=chunk_size, log=run.log, explain_options=explain_options,
                  target_kind=target_kind, progress=run.progress, scoring_budget=scoring_budget)
    shard = run.shard
    if shard is None or shard.count == 1:
        with results_lock(out):
            try:
                with replacing_results(out, run.resume):
                    timing, cached = _work(explainer, dataset, out, shard_dirs(out), chunks(len(dataset), chunk_size),
                                           progress=run.progress, **work)
            except KeyboardInterrupt:
                _summarize_interrupted(out, settings, run.log)
                raise
            return _finish(explainer, dataset, out, timing, cached, **finish)
    _check_settings(out / "run.json", settings, out)  # a merge into out must not mix runs
    mine = shard.directory(out)
    try:
        with shard_lock(mine):
            if not run.resume:
                clear_results(mine)
            others = [out, *(d for d in shard_dirs(out) if d != mine)]
            timing, _ = _work(explainer, dataset, mine, others, chunks(len(dataset), chunk_size, shard),
                              progress=run.progress, **work)
    except KeyboardInterrupt:  # merge what this process finished; the last one to get here summarises it all
        with results_lock(out, wait=True):
            if shard_dirs(out):
                _merge_shards(out, settings, method_ids, chunk_size)
            _summarize_interrupted(out, settings, run.log)
        raise
    with results_lock(out, wait=True):  # one merge at a time; each one takes in everything complete so far
        return _finish(explainer, dataset, out, timing, None, **finish)


_RUN_FIELDS = frozenset(f.name for f in dataclasses.fields(BenchmarkRun))


def _in_model_order(dataset: Dataset, model_names: list[str]) -> Dataset:
    """``dataset`` with its gold labels numbered as the model numbers its classes, matched by name (a checkpoint
    may order them otherwise than the data set: ``positive`` first, MNLI's ``contradiction`` first), with a
    warning when it renumbers them; a warning too when both name their classes, but not the same ones."""
    if not dataset.labels or len(dataset.labels) != len(model_names):
        return dataset
    order = class_order(dataset.labels, model_names)
    if order is None:
        if names_classes(dataset.labels) and names_classes(model_names):
            warnings.warn(f"dataset {dataset.name} names its classes {', '.join(dataset.labels)}, the model "
                          f"{', '.join(model_names)}: gold labels are read as the model's class indices",
                          stacklevel=3)
        return dataset
    if order == list(range(len(order))):
        return dataset
    warnings.warn(f"the model orders its classes {', '.join(model_names)}, dataset {dataset.name} "
                  f"{', '.join(dataset.labels)}: gold labels are renumbered by name to the model's order",
                  stacklevel=3)
    examples = [e if e.label is None or not 0 <= e.label < len(order) else dataclasses.replace(e, label=order[e.label])
                for e in dataset.examples]
    names = [""] * len(order)
    for i, name in enumerate(dataset.labels):
        names[order[i]] = name
    return dataclasses.replace(dataset, examples=examples, labels=names)


def _check_labels(dataset: Dataset, n_classes: int, need: bool) -> None:
    """Every gold label is a class of the model; with ``need`` (gold targets) every example has one."""
    for e in dataset:
        if e.label is None:
            if need:
                raise InputError(f"example {e.id!r} has no label; explaining the gold label needs one per example")
        elif not 0 <= e.label < n_classes:
            raise InputError(
                f"example {e.id!r} has label {e.label}, but the model has {n_classes} classes (0..{n_classes - 1})"
            )


def check_benchmark_options(methods: Any, options: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """``options`` checked without a model: each names a benchmarked method, and only options it has, with
    values it accepts as far as they can be judged without one."""
    from ..methods import check_option_owners, get_method, resolve_methods

    options = dict(options or {})
    check_option_owners(options, resolve_methods(methods), "the benchmarked methods")
    for name, opts in options.items():
        if not isinstance(opts, dict):
            raise InputError(f"options of {name!r} must be an object of option names and values, got {opts!r}")
        get_method(name).check_options(dict(opts))
    return options


def _checked_options(
    explainer: Any, dataset: Dataset, methods: Any, method_ids: Sequence[str],
    options: dict[str, dict[str, Any]] | None, target: str, target_kind: str, config: EvalConfig,
) -> dict[str, dict[str, Any]]:
    """``options`` checked by name, then by value on one example, so that a typo is refused before any write."""
    options = check_benchmark_options(methods, options)
    used = [m for m in method_ids if options.get(m)]
    if used:  # option values are checked by the methods themselves: explain one example with them
        first = dataset[0]
        gold = target == "gold" or config.protocol == "attcat-code"
        explainer.explain([first.text], used, target=[first.label] if gold else None, target_kind=target_kind,
                          options={m: options[m] for m in used})
    return options


def _check_settings(run_file: Path, settings: BenchmarkSettings, out: Path) -> float:
    """The seconds recorded in ``run_file`` (0 when there is none); :class:`InputError` when it was made with
    other settings than ``settings``."""
    if not run_file.exists():
        return 0.0
    prev = read_run(run_file)
    now = json.loads(json.dumps(settings.key()))
    diff = differing_settings(prev["settings"], now)
    if diff:
        before = prev["settings"]
        if "model_setup" in diff and isinstance(before.get("model_setup"), dict):  # name what changed within it
            was = before["model_setup"]
            diff[diff.index("model_setup")] = ", ".join(
                f"{k} {was.get(k)} before, {v} now" for k, v in now["model_setup"].items() if was.get(k) != v)
        raise InputError(
            f"{out} holds results made with other settings ({', '.join(diff)}); use another --out or --overwrite"
        )
    return float(prev.get("seconds", 0.0))


def _check_resumable(out: Path) -> None:
    """:class:`InputError` when ``out`` holds results files but no ``run.json``: they were not written by a
    benchmark run of this kind (a context benchmark's ``records.jsonl``, files of another tool), and resuming would
    mix them into this run's results."""
    if (out / "run.json").exists() or not out.is_dir():
        return
    found = [name for name in (*FILES, "records.jsonl") if (out / name).exists()]
    if found:
        raise InputError(f"{out} holds {', '.join(found)} but no run.json: not a run of this benchmark to resume; "
                         "use another --out or --overwrite")


def _merge_shards(out: Path, settings: BenchmarkSettings, method_ids: list[str], chunk_size: int
                  ) -> tuple[dict[tuple[int, str, Any], Explanation], float]:
    """Merge every complete example of ``out``'s shards into its files (we hold ``out``'s lock) and remove the
    shards no process is writing. Returns the explanations of the merged examples and the compute seconds of the
    shards left (still being written; merged again later)."""
    run_file = out / "run.json"
    remaining = 0.0
    seconds = _check_settings(run_file, settings, out)
    # the settings before any results file: a process of the run that starts now finds a run to resume in out,
    # not results files without their run.json (which it refuses)
    _save_run(run_file, settings, seconds)
    merged = merge_sources(out, json.loads(json.dumps(settings.key())), method_ids, chunk_size)
    rewrite_rows(out / "examples.jsonl", merged.examples)
    rewrite_rows(out / "explanations.jsonl", merged.explanations)
    for d in merged.shards:  # everything in them is merged: remove the shards no process is writing
        spent = _check_settings(d / "run.json", settings, d)
        try:
            with results_lock(d):
                spent = _check_settings(d / "run.json", settings, d)
                if not merged.unchanged(d):  # its process appended a chunk after we read it: merged later
                    raise InputError(f"{d} changed while merging")
                shutil.rmtree(d)
            seconds += spent
        except InputError:  # its process is still at work
            remaining += spent
    _save_run(run_file, settings, seconds)
    if not shard_dirs(out):
        shutil.rmtree(out / SHARDS_DIR, ignore_errors=True)
    return explanation_cache(merged.explanations), remaining


def _summarize_interrupted(out: Path, settings: BenchmarkSettings, log: Callable[[str], None] | None) -> None:
    """An interrupted run summarises the examples it finished (``complete: false``; no data-set metrics), so
    ``summary.json`` and the report show them; running the same command again finishes the run."""
    if not (out / "run.json").is_file():  # stopped before the run began
        return
    seconds = read_run(out / "run.json")["seconds"]
    summary = summarize(out, settings, timing={"seconds": seconds, "complete": False, "interrupted": True})
    if log is not None:
        log(f"interrupted: wrote {out}/summary.json ({summary['n_examples']} of {summary['n_planned']} examples); "
            "run the same command again to finish")


def _save_run(run_file: Path, settings: BenchmarkSettings, seconds: float) -> float:
    write_json(run_file, {"format": FORMAT_VERSION, "settings": settings.key(), "seconds": seconds})
    return seconds


def _work(
    explainer: Any, dataset: Dataset, work_dir: Path, sources: Sequence[Path], plan: list[list[int]], *,
    settings: BenchmarkSettings, config: EvalConfig, method_ids: list[str], metric_ids: list[str], n_classes: int,
    batch_size: int, progress: bool, explain_options: dict[str, dict[str, Any]], target_kind: str, target: str,
    predict: Predict, stop_after: int | None,
) -> tuple[dict[str, float], dict[tuple[int, str, Any], Explanation]]:
    """Explain and score the examples of the ``plan`` chunks that neither ``work_dir`` (whose lock we hold) nor the
    other results directories ``sources`` hold yet, appending them to ``work_dir``'s files.

    Returns the seconds spent and the explanations of the plan's examples (cached and new)."""
    run_file = work_dir / "run.json"
    previous_seconds = _check_settings(run_file, settings, work_dir)
    t_start = time.perf_counter()

    def save_run() -> float:
        """Record the settings and the cumulative compute time (after every chunk: a kill loses one chunk's)."""
        return _save_run(run_file, settings, previous_seconds + time.perf_counter() - t_start)

    save_run()
    class_specific = _class_specific(method_ids)
    kendall_methods = [m for m in method_ids if class_specific[m]] if "kendall" in metric_ids else []

    ex_path, exp_path = work_dir / "examples.jsonl", work_dir / "explanations.jsonl"
    example_row = example_row_of(settings.metrics)
    rows = read_rows(ex_path, row=example_row)
    done = complete_examples(rows, method_ids)
    if len(done) * (len(method_ids) + 1) != len(rows):  # drop lines of half-written examples
        rows = [r for r in rows if r["index"] in done]
        rewrite_rows(ex_path, rows)
    wanted = {i for chunk in plan for i in chunk}
    exp_rows = read_rows(exp_path)
    for src in sources:  # other processes may be appending to these: read complete lines, repair nothing
        done |= complete_examples(read_rows(src / "examples.jsonl", repair=False, row=example_row), method_ids)
        exp_rows += read_rows(src / "explanations.jsonl", repair=False)
    cached = explanation_cache([r for r in exp_rows if (r.get("meta") or {}).get("example_index") in wanted])

    todo = [c for c in ([i for i in chunk if i not in done] for chunk in plan) if c]
    timing = {"explain_seconds": 0.0, "evaluate_seconds": 0.0}
    from tqdm.auto import tqdm

    bar = tqdm(total=len(wanted), initial=len(wanted & done), disable=not progress, desc="benchmark",
               unit="example", dynamic_ncols=True)
    if progress and isinstance(explainer, _ExplainWith) and explainer.takes("progress"):
        # the bar moves per chunk; inside one, the postfix follows the explanation's progress (long inputs, IG)
        explainer.kwargs["progress"] = lambda done, _n: bar.set_postfix_str(f"explaining {done:.0%}")
    processed = 0
    try:
        for chunk in todo:
            if stop_after is not None and processed >= stop_after:
                break
            if stop_after is not None:
                chunk = chunk[: stop_after - processed]
            t0 = time.perf_counter()
            bar.set_postfix_str("explaining", refresh=True)
            items = _explain_chunk(explainer, dataset, chunk, method_ids, kendall_methods, cached, exp_path,
                                   config, n_classes, batch_size, explain_options, target_kind,
                                   gold=target == "gold")
            release_free_memory()  # explaining and scoring each plan within the budget: not the one beside the other
            t1 = time.perf_counter()
            bar.set_postfix_str("scoring", refresh=True)
            scores = score_examples(items, method_ids, metric_ids, predict, config, class_specific)
            append_rows(ex_path, example_rows(dataset, items, scores, method_ids))
            timing["explain_seconds"] += t1 - t0
            timing["evaluate_seconds"] += time.perf_counter() - t1
            processed += len(chunk)
            save_run()
            bar.update(len(chunk))
    finally:
        bar.close()
        save_run()
    return timing, cached


def _finish(
    explainer: Any, dataset: Dataset, out: Path, timing: dict[str, float],
    cached: dict[tuple[int, str, Any], Explanation] | None, *, settings: BenchmarkSettings, config: EvalConfig,
    method_ids: list[str], metric_ids: list[str], batch_size: int, chunk_size: int,
    log: Callable[[str], None] | None, explain_options: dict[str, dict[str, Any]] | None = None,
    target_kind: str = "logit", progress: bool = False, scoring_budget: int = DEFAULT_BUDGET,
) -> dict[str, Any]:
    """Merge the shards of ``out`` (whose lock we hold) into its files, then the data-set metrics and the summary.

    ``cached``: the explanations of every example when they are all in ``out`` already (a single-process run)."""
    run_file = out / "run.json"
    remaining = 0.0  # compute seconds of shards still being written (kept, merged again later)
    if shard_dirs(out):
        cached, remaining = _merge_shards(out, settings, method_ids, chunk_size)
    rows = read_rows(out / "examples.jsonl", row=example_row_of(settings.metrics))
    complete = len(complete_examples(rows, method_ids)) == len(dataset)
    t2 = time.perf_counter()
    consist = None
    if "consistency" in metric_ids and complete:
        if cached is None:
            cached = explanation_cache(read_rows(out / "explanations.jsonl"))
        consist = _consistency(explainer, dataset, method_ids, cached, config, batch_size, scoring_budget)
    timing = {**timing, "consistency_seconds": time.perf_counter() - t2}
    t3 = time.perf_counter()
    sanity = None
    if "sanity" in metric_ids and complete:
        if cached is None:
            cached = explanation_cache(read_rows(out / "explanations.jsonl"))
        sanity = _sanity(explainer, dataset, method_ids, cached, config, batch_size, explain_options, target_kind,
                         out / "sanity.jsonl", progress)
    timing["sanity_seconds"] = time.perf_counter() - t3
    seconds = _save_run(run_file, settings, _check_settings(run_file, settings, out) + timing["consistency_seconds"]
                        + timing["sanity_seconds"])
    summary = summarize(out, settings, consist, {"seconds": seconds + remaining, **timing, "complete": complete},
                        sanity=sanity)
    if log is not None:
        log(f"wrote {out}/summary.json ({'complete' if complete else 'partial'})")
    return summary


def _applicable_methods(methods: Any, explainer: Any, resolve: Callable[[Any], list[str]]) -> list[str]:
    """Checked method ids; ``"all"`` keeps only the methods that apply to this model (with a warning)."""
    from ..methods import get_method

    ids = resolve(methods)
    words = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else list(methods)
    if "all" not in words:
        return ids
    task = getattr(getattr(explainer, "head", None), "task", "classification")
    stream = getattr(explainer, "stream", "self")
    skipped = {}
    for m in ids:
        check = getattr(get_method(m), "unsupported", None)
        reason = check(explainer.model, stream, task) if check is not None else None
        if reason:
            skipped[m] = reason
    if skipped:
        warnings.warn(f"skipping {', '.join(skipped)}: " + "; ".join(dict.fromkeys(skipped.values())), stacklevel=3)
    return [m for m in ids if m not in skipped]


def _model_setup(explainer: Any) -> dict[str, Any]:
    """What else decides the scores of a model beside its name: the longest input (truncation), the weights'
    dtype and the explained attention stream. A resumed run must match them."""
    weights = callable(getattr(explainer.model, "parameters", None))  # a duck-typed explainer's model may have none
    return {"max_length": getattr(explainer, "max_length", None), "stream": getattr(explainer, "stream", None),
            "dtype": weights_dtype(explainer.model) if weights else None}


def _pad_id(explainer: Any) -> int:
    """The id the explainer pads with (scoring pads the same way); the architecture's rule for duck-typed ones."""
    pad = getattr(explainer, "pad_id", None)
    if pad is not None:
        return int(pad)
    return adapter_for(explainer.model).pad_token_id(getattr(explainer, "tokenizer", None), explainer.model.config)


_INPUT = re.compile(r"\binput (\d+)\b")


def _by_example(message: str, ids: Sequence[str]) -> str:
    """``message`` with each "input K" (a position among the texts ``ids`` name) as "example ID"."""
    return _INPUT.sub(lambda m: f"example {ids[int(m.group(1))]}" if int(m.group(1)) < len(ids) else m.group(0),
                      message)


def _explain_examples(explainer: Any, ids: Sequence[str], texts: list[Any], methods: list[str],
                      **kwargs: Any) -> list[Explanation]:
    """``explainer.explain(texts, methods, **kwargs)`` for the examples ``ids``: its warnings and one-line errors
    name an input by its position in this call ("input 3"), which is the example's position in its chunk; they
    name the example instead ("example 1042")."""
    def named(message: str) -> str:
        return _by_example(message, ids)

    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            return explainer.explain(texts, methods, **kwargs)
    except InputError as exc:
        raise InputError(named(str(exc))) from None
    finally:
        for w in caught:  # after the recording block: shown as any other warning is
            warnings.warn_explicit(named(str(w.message)), w.category, w.filename, w.lineno)


def _check_finite(exps: Sequence[Explanation], ids: Sequence[Any]) -> None:
    """:class:`MethodError` where a method gave an example non-finite scores: the deletion metrics rank tokens by
    them, and a NaN has no place in that order (nothing is written for the chunk)."""
    for e, example in zip(exps, ids, strict=True):
        for method, scores in e.scores.items():
            if not np.isfinite(np.asarray(scores, dtype=float)).all():
                raise MethodError(f"method {method!r} gave example {example!r} non-finite scores (NaN or inf), which "
                                  "a benchmark cannot rank: leave the method out, or run it in float32 if the "
                                  "model runs in half precision")


def _explain_chunk(
    explainer: Any,
    dataset: Dataset,
    chunk: Sequence[int],
    methods: Sequence[str],
    kendall_methods: Sequence[str],
    cached: dict[tuple[int, str, int], Explanation],
    exp_path: Path,
    config: EvalConfig,
    n_classes: int,
    batch_size: int,
    options: dict[str, dict[str, Any]] | None,
    target_kind: str,
    gold: bool = False,
) -> list[Item]:
    """Explanations of the chunk (from the cache or computed and appended to it) as metric items."""
    gold_target = gold or config.protocol == "attcat-code"

    def wanted_target(i: int) -> int | None:
        return dataset[i].label if gold_target else None

    main: dict[int, Explanation] = {}
    for (i, role, _t), e in cached.items():
        if role == "explained" and i in chunk and (wanted_target(i) is None or e.target == wanted_target(i)):
            main[i] = e
    missing = [i for i in chunk if i not in main]
    if missing:
        targets = [wanted_target(i) for i in missing]
        exps = _explain_examples(
            explainer, [dataset[i].id for i in missing], [dataset[i].text for i in missing], list(methods),
            batch_size=batch_size,
            target=None if not gold_target else targets, target_kind=target_kind,
            options={k: v for k, v in (options or {}).items() if k in methods} or None,
        )
        _check_finite(exps, [dataset[i].id for i in missing])
        rows = []
        for i, e in zip(missing, exps):
            e.meta = {**e.meta, "example_index": i, "example_id": dataset[i].id, "benchmark_role": "explained"}
            main[i] = e
            cached[(i, "explained", target_key(e.target))] = e
            rows.append(e.to_dict())
        append_rows(exp_path, rows)
    others: dict[int, dict[int, Explanation]] = {i: {} for i in chunk}
    if kendall_methods:
        needed = {i: kendall_other_classes(main[i].target, n_classes, config.protocol) for i in chunk}
        todo: list[tuple[int, int]] = []
        for i, classes in needed.items():
            for c in classes:
                e = cached.get((i, "other", c))
                if e is not None and all(m in e.scores for m in kendall_methods):
                    others[i][c] = e
                else:
                    todo.append((i, c))
        if todo:
            exps = _explain_examples(
                explainer, [dataset[i].id for i, _ in todo], [dataset[i].text for i, _ in todo],
                list(kendall_methods), batch_size=batch_size,
                target=[c for _, c in todo], target_kind=target_kind,
                options={k: v for k, v in (options or {}).items() if k in kendall_methods} or None,
            )
            _check_finite(exps, [dataset[i].id for i, _ in todo])
            rows = []
            for (i, c), e in zip(todo, exps):
                e.meta = {**e.meta, "example_index": i, "example_id": dataset[i].id, "benchmark_role": "other"}
                others[i][c] = e
                cached[(i, "other", c)] = e
                rows.append(e.to_dict())
            append_rows(exp_path, rows)
    items, lost = [], []
    for i in chunk:
        answers = dataset[i].answers
        spans = answer_token_positions(main[i], answers) if answers else None  # unanswerable: no value
        if spans == []:  # the answer was in the part of the context truncation cut off: no value either
            lost.append(dataset[i].id)
            spans = None
        # --target gold: the deletion metrics track the class explained (a QA target is a span: no class)
        scored = int(main[i].target) if gold and not isinstance(main[i].target, (list, tuple)) else None
        items.append(Item(main[i], dataset[i].label, i, others[i], spans, scored))
    if lost:
        warnings.warn(f"{len(lost)} question{'s' * (len(lost) > 1)} (id {', '.join(map(str, lost[:3]))}"
                      f"{', …' * (len(lost) > 3)}) lost {'their' if len(lost) > 1 else 'its'} gold answer to "
                      "truncation (the context was cut before it): precision_at_k leaves them out, as it does "
                      "unanswerable questions", stacklevel=2)
    return items


def _consistency(
    explainer: Any,
    dataset: Dataset,
    methods: Sequence[str],
    cached: dict[tuple[int, str, int], Explanation],
    config: EvalConfig,
    batch_size: int,
    budget: int,
) -> dict[str, Any]:
    """The data-set metric consistency, from the cached explanations of the explained classes (their hidden
    states' forwards within ``budget`` bytes)."""
    main = {i: e for (i, role, _t), e in cached.items() if role == "explained"}
    return consistency_of(main, {i: dataset[i].label for i in main}, methods,
                          ModelPredictor(explainer.model, config.pad_token_id, batch_size, memory_budget=budget),
                          config)


def _sanity(
    explainer: Any, dataset: Dataset, methods: Sequence[str], cached: dict[tuple[int, str, int], Explanation],
    config: EvalConfig, batch_size: int, options: dict[str, dict[str, Any]] | None, target_kind: str,
    depths_file: Path, progress: bool,
) -> dict[str, Any]:
    """The data-set metric sanity (cascading randomisation), from the cached explanations of the explained
    classes: the same examples and targets explained again on ever more randomised copies of the weights. Each
    finished depth is appended to ``depths_file``; a resumed run (same settings: ``run.json`` was checked) explains
    only the depths that file lacks."""
    main = {i: e for (i, role, _t), e in cached.items() if role == "explained"}
    from tqdm.auto import tqdm

    done = {row["depth"]: row for row in read_rows(depths_file) if isinstance(row.get("depth"), str)}
    blocks = randomisation_blocks(explainer.model, getattr(explainer, "stream", "self"))
    bar = tqdm(total=len(blocks), disable=not progress, desc="sanity", unit="depth", dynamic_ncols=True)

    def explain(texts: list[str], targets: list[Any]) -> list[Explanation]:
        return explainer.explain(texts, list(methods), batch_size=batch_size, target=targets,
                                 target_kind=target_kind,
                                 options={k: v for k, v in (options or {}).items() if k in methods} or None)

    try:
        return cascading_randomisation(explain, explainer.model, main, {i: dataset[i].text for i in main}, methods,
                                       stream=getattr(explainer, "stream", "self"), seed=config.seed, done=done,
                                       record=lambda row: append_rows(depths_file, [row]),
                                       step=lambda _name: bar.update())
    finally:
        bar.close()


__all__ = ["BenchmarkRun", "Shard", "run_benchmark"]
