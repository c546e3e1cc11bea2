"""AT2: learned attention attribution (after Cohen-Wang, Chuang & Madry 2025).

Features: for every layer ``l`` and head ``h``, the attention from the explained answer tokens' rows (the
positions that predict them) to each source's tokens, averaged over those rows: ``F[lh, s]``. A source's score is
``Σ_lh w_lh F[lh, s]`` with per-head weights ``w`` fitted once per model to ablation effects: on training
prompts, random keep-masks ``M`` (each source kept with probability 1/2) and the answer's log-probability ``y``
under each, the surrogate ``y ≈ b + Σ_s M_s · score_s`` is linear in ``w`` (``X = M Fᵀ``), fitted by ridge
regression on per-prompt centred data (:func:`fit_at2`). Explaining then costs one forward (eager attention,
maps reduced layer by layer as they are computed, never all kept).

``at2lrp`` adds one feature: AttnLRP's score of each source (its token relevances summed per source, from one
LRP pass for the whole answer), with a weight fitted jointly with the heads' (``fit_at2(..., methods=
("attnlrp",))``). It costs that pass beside the forward, and AttnLRP's memory on long prompts.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.answer_engine import answer_logprob
from ..core.batching import keeps_logits
from ..core.model_runner import ModelRunner
from ..core.modelstate import explaining
from ..core.row_attention import RowAttentionUnsupported, RowRecorder, recording, registered, rows_unsupported
from ..errors import InputError, ModelError
from ..paths import atomic_output, atomic_write_text
from ..version import __version__
from .ablation import CiteJob, ablation_logprobs, random_masks, rank_agreement
from .methods import source_method
from .token_scores import token_source_scores

__all__ = ["WEIGHTS_DIR", "at2_features", "fit_at2", "load_weights", "save_weights"]

WEIGHTS_DIR = Path(__file__).parent / "weights"
# each registered AT2 method and the token-level methods whose source scores join its attention features
VARIANTS: dict[str, tuple[str, ...]] = {"at2": (), "at2lrp": ("attnlrp",)}


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in order (the modules returning attention weights)."""
    found = [m for name, m in model.named_modules()
             if name.split(".")[-1] in ("self_attn", "attn", "attention", "self_attention")
             and sum(p.numel() for p in m.parameters()) > 0]
    if not found:
        raise ModelError("at2 reads each layer's attention weights; no self-attention modules were found in "
                         f"{type(model).__name__}")
    return found


@torch.no_grad()
def at2_features(job: CiteJob) -> np.ndarray:
    """``(layers × heads, n_sources)``: per head, the mean over the explained answer rows of the attention to each
    source's tokens. One forward: fused attention with only the answer rows' probabilities recomputed where the
    model dispatches its attention through transformers' interface, else eager attention with each layer's map
    reduced as soon as it is computed; no vocabulary projection beyond one position where the model allows."""
    runner = job.runner
    ids = job.prompt.ids + job.prefix_ids + job.answer_ids
    first = len(job.prompt.ids) + len(job.prefix_ids) - 1  # the row that predicts the first explained token
    rows = torch.arange(first, first + len(job.answer_ids))
    owner = torch.as_tensor(job.token_source + [-1] * (len(ids) - len(job.token_source)))
    inside = owner >= 0
    found, logits = _answer_rows(runner, ids, rows, answer=len(job.answer_ids))
    if "full" not in job.cache:  # the answer's log-probability of the model as it is, for the result and others
        job.cache["full"] = float(answer_logprob(runner, logits, job.answer_ids)[0])
    per_layer = [layer.float().mean(1).cpu() for layer in found]  # (H, N) each
    feats = torch.zeros(len(per_layer), per_layer[0].shape[0], len(job.sources))
    for layer, mean in enumerate(per_layer):
        feats[layer].index_add_(1, owner[inside], mean[:, inside])
    return feats.reshape(-1, len(job.sources)).double().numpy()


def _answer_rows(runner: ModelRunner, ids: list[int], rows: torch.Tensor, rows_path: bool = True,
                 answer: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per attention layer, the attention rows ``rows`` of every head over all keys: ``(H, R, N)``; and the
    logits of the last ``answer + 1`` positions (at least the last one)."""
    model = runner.model
    inputs = torch.tensor([ids], device=runner.device)
    keep = {"logits_to_keep": answer + 1} if keeps_logits(model) else {}
    if rows_path and not rows_unsupported(model):
        recorder = RowRecorder(rows=rows.to(runner.device))
        try:
            with explaining(model, registered()), recording(recorder):
                logits = model(input_ids=inputs, use_cache=False, **keep).logits
            return [r[0] for r in recorder.kept_rows], logits[:, -(answer + 1):]
        except RowAttentionUnsupported:
            pass  # a feature the fused path does not reproduce: the eager maps below
    found: list[torch.Tensor] = []

    def read(module: torch.nn.Module, args: Any, output: Any) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if not isinstance(weights, torch.Tensor) or weights.dim() != 4:
            raise ModelError("at2 needs the attention weights, but a self-attention module returned none")
        found.append(weights[0][:, rows.to(weights.device), :])  # the map itself is freed with the layer

    modules = _attention_modules(model)
    with explaining(model):  # eager attention: the weights exist
        handles = [m.register_forward_hook(read) for m in modules]
        try:
            logits = model(input_ids=inputs, use_cache=False, **keep).logits
        finally:
            for h in handles:
                h.remove()
    return found, logits[:, -(answer + 1):]


def _fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    c = model.config
    return {k: getattr(c, k, None) for k in ("model_type", "num_hidden_layers", "num_attention_heads",
                                             "hidden_size", "vocab_size")}


# how far (relative L2) the model's parameter sample may lie from the fitted one's before a warning: casting
# SmolLM2 to bf16 moves it by 0.0009; another checkpoint of the same architecture, or another quantisation, more
SAMPLE_TOLERANCE = 0.02


def parameter_sample(model: torch.nn.Module, per_tensor: int = 4) -> list[float]:
    """A few values spread over each of ``model``'s parameters, in registration order: cheap to take, and unlike
    the configuration it tells two checkpoints of one architecture apart."""
    out: list[float] = []
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // per_tensor)
            out += flat[::step][:per_tensor].float().cpu().tolist()
    return [float(f"{v:.6g}") for v in out]


def _check_sample(data: Mapping[str, Any], model: torch.nn.Module, path: str | Path) -> None:
    """Warn when weights fitted on one checkpoint are read on another of the same architecture."""
    fitted = data.get("parameter_sample")
    if fitted is None:
        return
    here = np.asarray(parameter_sample(model), dtype=np.float64)
    fitted = np.asarray(fitted, dtype=np.float64)
    if here.shape != fitted.shape:
        gap = math.inf
    else:
        gap = float(np.linalg.norm(here - fitted) / max(np.linalg.norm(fitted), 1e-12))
    if gap > SAMPLE_TOLERANCE:
        warnings.warn(f"at2 weights {path} were fitted on other parameters of this architecture (a sample of them "
                      f"differs by {gap:.1%}): its per-head weights may not suit this checkpoint; fit its own with "
                      "`attnlens fit-at2`", stacklevel=4)


def load_weights(runner: ModelRunner, path: str | Path | None = None,
                 methods: Sequence[str] = ()) -> dict[str, Any]:
    """AT2 weights for ``runner``'s model whose extra features are the source scores of ``methods`` (none for
    ``at2``, ``("attnlrp",)`` for ``at2lrp``): from ``path``, or the weights shipped with attnlens for this model
    (SmolLM2-135M-Instruct). :class:`InputError` when there are none, or they were fitted on another model or
    with other features."""
    name = "AT2" if not methods else f"AT2 with {', '.join(methods)}"
    method = next((m for m, extra in VARIANTS.items() if list(extra) == list(methods)), "at2")
    if path is None:
        for candidate in sorted(WEIGHTS_DIR.glob("*.json")):
            data = json.loads(candidate.read_text(encoding="utf-8"))
            if (data["fingerprint"] == _fingerprint(runner.model) and runner.name in data.get("names", [])
                    and list(data.get("methods", [])) == list(methods)):
                _check_sample(data, runner.model, candidate.name)
                return data
        with_methods = f" --with-methods {','.join(methods)}" if methods else ""
        raise InputError(f"no {name} weights ship for {runner.name}: fit them with `attnlens fit-at2 --model "
                         f"{runner.name}{with_methods} --out W.json` and pass options {{'{method}': {{'weights': "
                         "'W.json'}}" + ("" if methods else " (cite --at2-weights W.json)"))
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        fingerprint = data["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"at2 weights {path}: not an attnlens AT2 weights file ({err})") from None
    _check_values(data, path)
    if fingerprint != _fingerprint(runner.model):
        raise InputError(f"at2 weights {path} were fitted on another model ({fingerprint}), not on "
                         f"{_fingerprint(runner.model)}")
    if list(data.get("methods", [])) != list(methods):
        fitted = ", ".join(data.get("methods", [])) or "attention alone"
        raise InputError(f"at2 weights {path} were fitted with features {fitted}; {method} reads "
                         f"{', '.join(['attention', *methods])}")
    grid = np.shape(data["weights"])
    want = (fingerprint["num_hidden_layers"], fingerprint["num_attention_heads"])
    known = all(isinstance(v, int) for v in want)  # a configuration naming its layers and heads
    if (known and grid != want) or np.size(data.get("method_weights", [])) != len(methods):
        raise InputError(f"at2 weights {path}: a grid of {grid[0]} × {grid[1]} head weights and "
                         f"{np.size(data.get('method_weights', []))} method weights, where the model's "
                         f"{want[0]} layers × {want[1]} heads and {len(methods)} method(s) need as many")
    _check_sample(data, runner.model, path)
    return data


def _features(job: CiteJob, methods: Sequence[str]) -> np.ndarray:
    """``(layers × heads + len(methods), n_sources)``: the attention features, then each method's source scores."""
    feats = at2_features(job)
    if not methods:
        return feats
    try:
        extra = token_source_scores(job, methods).scores
    except InputError as err:  # e.g. over the memory budget: say which source method needed it
        raise InputError(f"at2 with {', '.join(methods)} reads their scores: {err}") from None
    return np.vstack([feats, *(extra[m][None, :] for m in methods)])


def _check_values(data: Mapping[str, Any], path: str | Path) -> None:
    """:class:`InputError` unless ``data`` holds its weights as finite numbers: a grid of ``weights`` (one row
    per layer) and a list of ``method_weights``."""
    try:
        heads = np.asarray(data["weights"], dtype=np.float64)
        extra = np.asarray(data.get("method_weights", []), dtype=np.float64)
    except (KeyError, ValueError, TypeError) as err:
        raise InputError(f"at2 weights {path}: not an attnlens AT2 weights file (weights: {err})") from None
    if heads.ndim != 2 or extra.ndim != 1 or heads.size == 0:
        raise InputError(f"at2 weights {path}: not an attnlens AT2 weights file (weights of shape {heads.shape}, "
                         f"method_weights of shape {extra.shape}; a layers × heads grid and a list)")
    if not (np.isfinite(heads).all() and np.isfinite(extra).all()):
        raise InputError(f"at2 weights {path}: some weights are not finite numbers (NaN or infinite)")


def _flat_weights(data: Mapping[str, Any]) -> np.ndarray:
    """The head weights, then the extra methods' weights, as one vector matching :func:`_features`'s rows."""
    return np.concatenate([np.asarray(data["weights"], dtype=np.float64).reshape(-1),
                           np.asarray(data.get("method_weights", []), dtype=np.float64)])


def _identity(methods: Sequence[str]) -> Callable[..., dict[str, Any]]:
    def identity(runner: ModelRunner, weights: str | None = None) -> dict[str, Any]:
        """The digest of the weights ``weights`` resolves to on ``runner``'s model (the shipped ones by default)."""
        data = load_weights(runner, weights, methods)
        return {"weights_sha256": hashlib.sha256(json.dumps(_flat_weights(data).tolist()).encode()).hexdigest()[:16]}

    return identity


def _scores(job: CiteJob, weights: str | None, methods: Sequence[str]) -> tuple[np.ndarray, dict[str, Any]]:
    data = load_weights(job.runner, weights, methods)
    w = _flat_weights(data)
    feats = _features(job, methods)
    if feats.shape[0] != w.size:
        raise InputError(f"at2 weights hold {w.size} features; the model gives {feats.shape[0]}")
    return w @ feats, {"weights": data.get("source", "shipped" if weights is None else str(weights))}


@source_method("at2", "AT2: per-head attention from the answer to each source, weighted by per-head weights fitted "
               "once per model to ablation effects; one forward.", "Cohen-Wang, Chuang & Madry 2025",
               forwards=lambda n, **_: 1, identity=_identity(VARIANTS["at2"]), weights=None)
def at2(job: CiteJob, weights: str | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    return _scores(job, weights, VARIANTS["at2"])


@source_method("at2lrp", "AT2 with AttnLRP: AT2's per-head attention features plus AttnLRP's score of each source, "
               "weights fitted jointly to ablation effects; one forward and one AttnLRP pass.",
               "Cohen-Wang, Chuang & Madry 2025; Achtibat et al. 2024", forwards=lambda n, **_: 3,
               identity=_identity(VARIANTS["at2lrp"]), token_methods=VARIANTS["at2lrp"], weights=None)
def at2lrp(job: CiteJob, weights: str | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    return _scores(job, weights, VARIANTS["at2lrp"])


def fit_at2(
    runner: ModelRunner,
    jobs: Sequence[CiteJob],
    *,
    n_ablations: int = 32,
    keep_probability: float = 0.5,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    cache: str | Path | None = None,
    methods: Sequence[str] = (),
) -> dict[str, Any]:
    """Fit AT2's per-head weights on ``jobs`` (training prompts with their answers): features and ``n_ablations``
    random ablations per prompt, ridge regression on per-prompt centred data. Each prompt's ablations are
    weighted by the inverse variance of its log-probabilities, so every prompt counts the same whatever the size of
    its effects (a few prompts with large swings would otherwise set the weights), while the scores stay in
    log-probability units. The penalty is chosen by cross-validation over whole prompts (ablations of one prompt
    are never split between fit and check, nor prompts asking the same question of the same context, such as its
    sentence and passage splits) for the best held-out rank correlation per prompt — the LDS the
    benchmark scores — and the record reports it (``cv_lds``) with the held-out R² (``cv_r2``) beside the
    in-sample one (``r2``); ``seconds`` is this call's time and ``prompts_from_cache`` the prompts it read from
    ``cache`` instead of computing. Returns the weights record that :func:`save_weights` writes.

    ``methods``: token-level methods whose source scores join the attention features, each with a weight of
    its own (``("attnlrp",)`` gives ``at2lrp``'s weights).

    ``cache``: a folder keeping each prompt's features and ablation results as it is done, so an interrupted fit
    started again with the same prompts and settings redoes only the prompts it had not finished (the extra
    methods' scores are kept apart, so adding a method reuses the attention features and ablations)."""
    if len({(job.context, job.query, job.answer) for job in jobs}) < 2:
        raise InputError("fit_at2 needs the prompts of at least two questions: the ridge penalty is chosen on "
                         "held-out questions")
    xs, ys, questions, start, cached = [], [], [], time.perf_counter(), 0
    question_of: dict[tuple[str, str, str], int] = {}
    folder = None if cache is None else Path(cache)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    # the model's parameters and dtype are part of a cached prompt's key: another checkpoint at the same path, or
    # the same one in another precision, computes its prompts again
    weights_key = [parameter_sample(runner.model), str(next(runner.model.parameters()).dtype)]
    for k, job in enumerate(jobs):
        masks = random_masks(n_ablations, len(job.sources), keep_probability, seed + k)
        key = hashlib.sha256(json.dumps([job.runner.name, _fingerprint(job.runner.model), *weights_key,
                                         job.prompt.ids, job.prefix_ids, job.answer_ids, job.token_source,
                                         job.ablation, masks.tolist()]).encode()).hexdigest()[:24]
        path = None if folder is None else folder / f"{key}.npz"
        done = None if path is None else _load_npz(path, "feats", "y")
        if done is not None:
            feats, y = done["feats"], done["y"]
            cached += 1
        else:
            feats = at2_features(job)  # (LH, S)
            y = ablation_logprobs(job, masks)
            if path is not None:
                _save_npz(path, feats=feats, y=y)
        if methods:
            feats = np.vstack([feats, _method_features(job, methods, path)])
        x = masks.astype(np.float64) @ feats.T  # (n, LH + len(methods))
        y = y - y.mean()
        spread = float(y.std())
        if spread > 0:  # a prompt whose ablations change nothing carries no ranking to learn
            xs.append((x - x.mean(0)) / spread)
            ys.append(y / spread)
            questions.append(question_of.setdefault((job.context, job.query, job.answer), len(question_of)))
        if progress is not None:
            progress(1)
    if len(set(questions)) < 2:
        raise InputError("fit_at2: the ablations changed the answer's log-probability in the prompts of fewer than "
                         "two questions, too few to choose the ridge penalty on held-out questions: give more prompts")
    groups = np.concatenate([np.full(len(y), k) for k, y in enumerate(ys)])
    together = np.concatenate([np.full(len(y), q) for q, y in zip(questions, ys)])
    x, y = np.vstack(xs), np.concatenate(ys)
    scale = x.std(0) + 1e-12
    alpha, cv_r2, cv_lds = _grouped_alpha(x / scale, y, groups, together)
    weights = _ridge(x / scale, y, alpha) / scale
    residual = y - x @ weights
    config = runner.model.config
    layers, heads = int(config.num_hidden_layers), int(config.num_attention_heads)
    extra = {"methods": list(methods), "method_weights": weights[layers * heads:].tolist()} if methods else {}
    return {
        "fingerprint": _fingerprint(runner.model),
        "parameter_sample": parameter_sample(runner.model),
        "names": [runner.name],
        "weights": weights[: layers * heads].reshape(layers, heads).tolist(),
        **extra,
        "fit": {"prompts": len(jobs), "n_ablations": n_ablations, "keep_probability": keep_probability,
                "seed": seed, "alpha": alpha, "r2": float(1 - residual @ residual / (y @ y)),
                "cv_r2": cv_r2 if math.isfinite(cv_r2) else None,
                "cv_lds": cv_lds if math.isfinite(cv_lds) else None, "weighting": "inverse variance per prompt",
                "seconds": round(time.perf_counter() - start, 1), "prompts_from_cache": cached},
        "attnlens": __version__,
    }


def _method_features(job: CiteJob, methods: Sequence[str], cached: Path | None) -> np.ndarray:
    """``(len(methods), n_sources)``: the methods' source scores, read from or written beside a prompt's cache."""
    path = None if cached is None else cached.with_name(f"{cached.stem}.{'+'.join(methods)}.npz")
    done = None if path is None else _load_npz(path, "scores")
    if done is not None:
        return done["scores"]
    found = token_source_scores(job, methods).scores
    scores = np.vstack([found[m] for m in methods])
    if path is not None:
        _save_npz(path, scores=scores)
    return scores


def _load_npz(path: Path, *keys: str) -> dict[str, np.ndarray] | None:
    """The arrays ``keys`` of a cached prompt, or ``None`` where there is none; a file that cannot be read (damaged
    or changed outside attnlens) is removed and its prompt computed again."""
    if not path.is_file():
        return None
    try:
        with np.load(path) as done:
            return {k: done[k] for k in keys}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile):
        warnings.warn(f"the fit cache {path} cannot be read: its prompt is computed again", stacklevel=3)
        path.unlink(missing_ok=True)
        return None


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Write ``arrays`` to ``path`` whole or not at all: an interruption never leaves a torn prompt in the cache."""
    with atomic_output(path) as tmp, tmp.open("wb") as f:
        np.savez(f, **arrays)


ALPHAS = tuple(float(a) for a in np.logspace(-3, 5, 17))


def _ridge(x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    """Ridge coefficients without intercept (the data are centred per prompt)."""
    return np.linalg.solve(x.T @ x + alpha * np.eye(x.shape[1]), x.T @ y)


def _grouped_alpha(x: np.ndarray, y: np.ndarray, groups: np.ndarray, together: np.ndarray | None = None
                   ) -> tuple[float, float, float]:
    """The ridge penalty whose predictions on held-out prompts (up to 5 folds of whole prompts) rank each prompt's
    ablations best (mean Spearman per prompt, ties broken by R²), with that mean and the held-out R² (NaN for both
    with a single fold group, where the middle penalty is used). ``groups``: each row's prompt; ``together``: rows
    that share a fold (default: the prompt's), so one question asked with its context split into sentences and
    into passages is held out whole, never seen in training by its other split."""
    from sklearn.model_selection import GroupKFold

    together = groups if together is None else together
    n_groups = len(np.unique(together))
    if n_groups < 2:
        return ALPHAS[len(ALPHAS) // 2], math.nan, math.nan
    folds = list(GroupKFold(n_splits=min(5, n_groups)).split(x, y, together))
    best = (-math.inf, -math.inf, ALPHAS[0])
    for alpha in ALPHAS:
        sse, ranks = 0.0, []
        for train, test in folds:
            predicted = x[test] @ _ridge(x[train], y[train], alpha)
            sse += float((y[test] - predicted) @ (y[test] - predicted))
            for g in np.unique(groups[test]):
                at = groups[test] == g
                ranks.append(rank_agreement(predicted[at], y[test][at]))
        best = max(best, (float(np.mean(ranks)), 1 - sse / float(y @ y), alpha))
    return best[2], best[1], best[0]


def save_weights(record: dict[str, Any], path: str | Path) -> Path:
    """Write an AT2 weights record as JSON (atomically)."""
    return atomic_write_text(path, json.dumps(record, indent=1, allow_nan=False) + "\n")
