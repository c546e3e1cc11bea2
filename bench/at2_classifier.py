"""AT2 for a sentence classifier: per-head [CLS]-row attention weighted by ridge-fitted head weights, and its AOPC.

Features of token ``j``: for every layer ``l`` and head ``h``, the attention from the explained row ([CLS],
position 0) to ``j``, ``A[l, h, 0, j]`` (``--features att``), or that attention times the norm of ``j``'s value
vector in the head, ``A[l, h, 0, j] · ‖v_j^{l,h}‖`` (``--features att_vnorm``). Score:
``score_j = Σ_lh w_lh F[lh, j]``.

Weights are fitted on SST-2 *train* sentences to single-token deletion effects: for every non-special token the
drop of the predicted class's logit (``--target logit``; ``margin``: of its logit minus the best other logit;
``prob``: of its probability) when the token is deleted from the ids, which is the perturbation attnlens's AOPC
applies (:func:`attnlens.evaluation.perturb.perturb`, mode ``"delete"``). Features and targets are centred per
sentence (only the ranking within a sentence matters), columns are standardised, and the ridge penalty is chosen by
cross-validation over whole sentences (scikit-learn ``GroupKFold``); the fit reports that cross-validated R² and
the R² on the dev sentences' own deletion effects.

On a seeded subset of SST-2 *dev* the fitted scores are put into each :class:`~attnlens.Explanation` as
``scores["at2cls"]`` (and a seeded uniform ``scores["random"]``) beside attnlens's methods, and every method goes
through :func:`attnlens.evaluation.metrics.score_examples` (AOPC and LOdds, protocol ``paper``) in the same run.
Means come with 95% intervals (normal approximation over examples) and paired differences against ``at2cls``.

Run: ``python bench/at2_classifier.py --train 300 --dev 200 --out runs/at2cls``; writes ``at2_classifier.json``
into ``--out`` and prints a Markdown table.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP runtime

import argparse  # noqa: E402
import gzip  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from attnlens import Explainer  # noqa: E402
from attnlens.core.batching import predict_batches  # noqa: E402
from attnlens.core.modelstate import EAGER, explaining  # noqa: E402
from attnlens.evaluation.metrics import EvalConfig, Item, score_examples  # noqa: E402
from attnlens.evaluation.perturb import ModelPredictor, Variant, perturb  # noqa: E402
from attnlens.results.explanation import Explanation  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "models" / "minilm-sst2"
DATA = Path(os.environ.get("ATTNLENS_DATA", ROOT.parent / "shared" / "data")) / "sst2"
FEATURES = ("att", "att_vnorm")
TARGETS = ("logit", "margin", "prob")
METHODS = ("integratedgradients", "attnlrp", "rawatt")
ALPHAS = tuple(float(a) for a in np.logspace(-3, 5, 17))
METRICS = ("aopc", "lodds")


# ---------------------------------------------------------------- data
def read_sst2(split: str, n: int, seed: int, min_tokens: int = 0, tokenizer: Any = None) -> list[dict[str, Any]]:
    """A seeded random subset of ``n`` SST-2 rows of ``split`` (``train`` or ``dev``), in file order; with
    ``min_tokens``, only rows whose text has at least that many tokens (special tokens not counted)."""
    path = DATA / ("train.jsonl.gz" if split == "train" else "dev.jsonl")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if min_tokens:
        rows = [r for r in rows if len(tokenizer.tokenize(r["text"])) >= min_tokens]
    rng = np.random.default_rng(seed)
    pick = sorted(rng.choice(len(rows), size=min(n, len(rows)), replace=False).tolist())
    return [rows[i] for i in pick]


# ------------------------------------------------------------ features
def _value_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The value projection of every self-attention layer, in order (BERT-style encoders: ``...self.value``)."""
    found = [m for name, m in model.named_modules() if name.endswith("attention.self.value")]
    if not found:
        raise ValueError(f"no value projections ('attention.self.value') found in {type(model).__name__}")
    return found


@torch.no_grad()
def cls_features(model: torch.nn.Module, exp: Explanation, features: str = "att", row: int = 0) -> np.ndarray:
    """``(layers × heads, n_tokens)``: per layer and head, the attention from position ``row`` to every token of
    ``exp``'s ids (``att``), or that attention times the norm of each token's value vector in the head
    (``att_vnorm``). One eager forward."""
    if features not in FEATURES:
        raise ValueError(f"features must be one of {FEATURES}, got {features!r}")
    device = next(model.parameters()).device
    inputs = {"input_ids": torch.tensor([exp.input_ids], device=device)}
    if exp.token_type_ids is not None and "token_type_ids" in inspect.signature(model.forward).parameters:
        inputs["token_type_ids"] = torch.tensor([exp.token_type_ids], device=device)
    heads = int(model.config.num_attention_heads)
    values: list[torch.Tensor] = []
    with explaining(model, EAGER):
        handles = []
        if features == "att_vnorm":
            def keep(_m: torch.nn.Module, _i: Any, out: torch.Tensor) -> None:
                n = out.shape[1]
                values.append(out[0].float().reshape(n, heads, -1).norm(dim=-1).T.cpu())  # (H, n)

            handles = [m.register_forward_hook(keep) for m in _value_modules(model)]
        try:
            out = model(**inputs, output_attentions=True)
        finally:
            for h in handles:
                h.remove()
    att = torch.stack([a[0, :, row, :].float().cpu() for a in out.attentions])  # (L, H, n)
    if features == "att_vnorm":
        att = att * torch.stack(values)
    return att.reshape(-1, att.shape[-1]).double().numpy()


# ------------------------------------------------------------- targets
def logits_of(explainer: Explainer, variants: Sequence[Variant], batch_size: int = 64) -> np.ndarray:
    """Raw logits ``(len(variants), C)``, scored as the metrics' :class:`ModelPredictor` scores them."""
    predictor = ModelPredictor(explainer.model, explainer.pad_id, batch_size)
    return predict_batches(
        explainer.model, [v.input_ids for v in variants], predictor.pad_token_id, predictor.batch_size,
        type_ids=[v.token_type_ids for v in variants], masks=[v.attention_mask for v in variants],
        with_types=None if predictor.takes_token_types else False, probabilities=lambda logits, _mask: logits,
    )


@dataclass
class Deletions:
    """One sentence's logits, unperturbed (``base``, ``(C,)``) and with each real token deleted (``deleted``,
    ``(n_positions, C)``, row ``k`` for token ``positions[k]``)."""

    positions: list[int]
    base: np.ndarray
    deleted: np.ndarray

    def target(self, kind: str = "logit") -> np.ndarray:
        """The effect of deleting each token on the predicted class ŷ: its logit's drop (``logit``), the drop of
        its logit minus the best other logit (``margin``) or of its probability (``prob``)."""
        c = int(np.argmax(self.base))
        if kind == "logit":
            return self.base[c] - self.deleted[:, c]
        if kind == "margin":
            def margin(z: np.ndarray) -> np.ndarray:
                return z[..., c] - np.delete(z, c, axis=-1).max(-1)

            return margin(self.base) - margin(self.deleted)
        if kind == "prob":
            def prob(z: np.ndarray) -> np.ndarray:
                e = np.exp(z - z.max(-1, keepdims=True))
                return (e / e.sum(-1, keepdims=True))[..., c]

            return prob(self.base) - prob(self.deleted)
        raise ValueError(f"target must be one of {TARGETS}, got {kind!r}")


def deletion_effects(explainer: Explainer, exps: Sequence[Explanation], batch_size: int = 64) -> list[Deletions]:
    """For each explanation, the logits with each non-special token deleted from its ids (AOPC's perturbation)."""
    variants: list[Variant] = []
    spans = []
    for e in exps:
        base = Variant.of(e.input_ids or [], e.token_type_ids)
        pos = [i for i, s in enumerate(e.special) if not s]
        spans.append((len(variants), pos))
        variants.append(base)
        variants.extend(perturb(base, [p], "delete") for p in pos)
    logits = logits_of(explainer, variants, batch_size)
    return [Deletions(pos, logits[s], logits[s + 1 : s + 1 + len(pos)]) for s, pos in spans]


# ------------------------------------------------------------------ fit
def design(feats: Sequence[np.ndarray], dels: Sequence[Deletions], target: str = "logit"
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows = real tokens: features ``X`` and targets ``y`` centred per sentence, and the sentence of each row."""
    xs, ys, groups = [], [], []
    for k, (f, d) in enumerate(zip(feats, dels)):
        x = f[:, d.positions].T
        y = d.target(target)
        xs.append(x - x.mean(0))
        ys.append(y - y.mean())
        groups.append(np.full(len(y), k))
    return np.vstack(xs), np.concatenate(ys), np.concatenate(groups)


def r2(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """``1 - SSE/SST`` of the per-sentence centred targets (no intercept)."""
    r = y - x @ w
    return float(1 - r @ r / (y @ y))


def fit_weights(x: np.ndarray, y: np.ndarray, groups: np.ndarray, alphas: Sequence[float] = ALPHAS,
                folds: int = 5) -> dict[str, Any]:
    """Ridge weights (no intercept, standardised columns) with the penalty of the best pooled out-of-fold R² over
    ``GroupKFold`` folds of whole sentences. Returns ``weights`` (in the features' own units), ``alpha``,
    ``cv_r2`` (at that penalty) and the in-sample ``r2``."""
    from sklearn.linear_model import Ridge
    from sklearn.model_selection import GroupKFold

    scale = x.std(0) + 1e-12
    xs = x / scale
    splits = list(GroupKFold(n_splits=min(folds, len(np.unique(groups)))).split(xs, y, groups))
    best = (-math.inf, alphas[0])
    for alpha in alphas:
        sse = 0.0
        for train, test in splits:
            model = Ridge(alpha=alpha, fit_intercept=False).fit(xs[train], y[train])
            res = y[test] - model.predict(xs[test])
            sse += float(res @ res)
        best = max(best, (1 - sse / float(y @ y), alpha))
    cv_r2, alpha = best
    w = Ridge(alpha=alpha, fit_intercept=False).fit(xs, y).coef_ / scale
    return {"weights": w, "alpha": alpha, "cv_r2": cv_r2, "r2": r2(x, y, w), "rows": len(y),
            "sentences": int(len(np.unique(groups)))}


# ------------------------------------------------------------ evaluate
def interval(values: Sequence[float]) -> dict[str, float]:
    """Mean and 95% half-width (normal approximation) of per-example values."""
    a = np.asarray([v for v in values if v is not None], dtype=np.float64)
    half = 1.96 * a.std(ddof=1) / math.sqrt(len(a)) if len(a) > 1 else math.nan
    return {"mean": float(a.mean()), "ci95": float(half), "n": len(a)}


def add_scores(exps: Sequence[Explanation], name: str, scores: Sequence[np.ndarray]) -> None:
    """Put one score vector per explanation into ``exp.scores[name]``."""
    for e, s in zip(exps, scores):
        e.scores[name] = np.asarray(s, dtype=np.float64)


def random_scores(exps: Sequence[Explanation], seed: int) -> list[np.ndarray]:
    """Uniform random scores, seeded per example."""
    return [np.random.default_rng([seed, k]).random(len(e.tokens)) for k, e in enumerate(exps)]


def faithfulness(explainer: Explainer, exps: Sequence[Explanation], methods: Sequence[str],
                 metrics: Sequence[str] = METRICS, batch_size: int = 64) -> dict[str, dict[str, list[float]]]:
    """Per method and metric, the per-example values of attnlens's metrics (protocol ``paper``), all methods scored
    in one call so that shared perturbations are scored once."""
    config = EvalConfig(pad_token_id=explainer.pad_id)
    items = [Item(e, None, k) for k, e in enumerate(exps)]
    predictor = ModelPredictor(explainer.model, explainer.pad_id, batch_size)
    res = score_examples(items, list(methods), list(metrics), predictor, config)
    return {m: {k: [r.methods[m][k].value for r in res] for k in metrics} for m in methods}


def summarise(values: dict[str, dict[str, list[float]]], reference: str) -> dict[str, dict[str, Any]]:
    """Mean ± 95% per method and metric, and the paired difference ``reference − method``."""
    out: dict[str, dict[str, Any]] = {}
    for m, per in values.items():
        out[m] = {}
        for k, vs in per.items():
            out[m][k] = interval(vs)
            if m != reference:
                ref = values[reference][k]
                diffs = [a - b for a, b in zip(ref, vs) if a is not None and b is not None]
                out[m][k][f"{reference}_minus"] = interval(diffs)
    return out


def markdown(table: dict[str, dict[str, Any]], reference: str) -> str:
    """Methods by descending AOPC: AOPC ↑ and LOdds ↓ with 95% intervals, and the paired AOPC difference."""
    lines = [f"| method | AOPC ↑ | LOdds ↓ | {reference} − method (AOPC) |", "|---|---:|---:|---:|"]
    for m in sorted(table, key=lambda k: -table[k]["aopc"]["mean"]):
        a, lo = table[m]["aopc"], table[m]["lodds"]
        d = a.get(f"{reference}_minus")
        diff = "—" if d is None else f"{d['mean']:+.3f} ± {d['ci95']:.3f}"
        lines.append(f"| {m} | {a['mean']:.3f} ± {a['ci95']:.3f} | {lo['mean']:.3f} ± {lo['ci95']:.3f} | {diff} |")
    return "\n".join(lines)


# ----------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(MODEL), help="a BERT-style sequence classifier (HF directory)")
    p.add_argument("--train", type=int, default=300, help="SST-2 train sentences to fit the head weights on")
    p.add_argument("--dev", type=int, default=200, help="SST-2 dev sentences to evaluate on")
    p.add_argument("--seed", type=int, default=0, help="seed of the subsets and of the random baseline")
    p.add_argument("--out", default="runs/at2cls", help="directory for at2_classifier.json")
    p.add_argument("--features", default="att", help=f"comma-separated feature sets: {', '.join(FEATURES)}")
    p.add_argument("--targets", default="logit", help=f"comma-separated fit targets: {', '.join(TARGETS)}")
    p.add_argument("--methods", default=",".join(METHODS), help="attnlens methods measured beside AT2")
    p.add_argument("--train-min-tokens", type=int, default=5,
                   help="train sentences shorter than this many tokens are not drawn (SST-2 train holds phrases)")
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args(argv)
    feature_sets = [f.strip() for f in args.features.split(",") if f.strip()]
    target_kinds = [t.strip() for t in args.targets.split(",") if t.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    torch.manual_seed(args.seed)
    explainer = Explainer.from_pretrained(args.model)
    timing: dict[str, float] = {}

    t0 = time.perf_counter()
    train = read_sst2("train", args.train, args.seed, args.train_min_tokens, explainer.tokenizer)
    train_exps = explainer.explain([r["text"] for r in train], "rawatt", batch_size=32)
    train_dels = deletion_effects(explainer, train_exps, args.batch_size)
    timing["train_deletions_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    dev = read_sst2("dev", args.dev, args.seed)
    dev_exps = explainer.explain([r["text"] for r in dev], methods, batch_size=16)
    timing["dev_explain_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dev_dels = deletion_effects(explainer, dev_exps, args.batch_size)
    timing["dev_deletions_s"] = time.perf_counter() - t0

    fits: dict[str, Any] = {}
    variants = []
    for feat in feature_sets:
        t0 = time.perf_counter()
        train_f = [cls_features(explainer.model, e, feat) for e in train_exps]
        dev_f = [cls_features(explainer.model, e, feat) for e in dev_exps]
        timing[f"features_{feat}_s"] = time.perf_counter() - t0
        for kind in target_kinds:
            name = "at2cls" if (feat, kind) == (feature_sets[0], target_kinds[0]) else f"at2cls[{feat},{kind}]"
            t0 = time.perf_counter()
            fit = fit_weights(*design(train_f, train_dels, kind))
            xd, yd, _ = design(dev_f, dev_dels, kind)
            layers = int(explainer.model.config.num_hidden_layers)
            fits[name] = {"features": feat, "target": kind, "alpha": fit["alpha"], "cv_r2": fit["cv_r2"],
                          "train_r2": fit["r2"], "dev_r2": r2(xd, yd, fit["weights"]), "rows": fit["rows"],
                          "sentences": fit["sentences"], "fit_s": round(time.perf_counter() - t0, 2),
                          "weights": fit["weights"].reshape(layers, -1).tolist()}
            add_scores(dev_exps, name, [fit["weights"] @ f for f in dev_f])
            variants.append(name)
    add_scores(dev_exps, "random", random_scores(dev_exps, args.seed))

    t0 = time.perf_counter()
    values = faithfulness(explainer, dev_exps, [*variants, *methods, "random"], METRICS, args.batch_size)
    timing["evaluate_s"] = time.perf_counter() - t0
    table = summarise(values, "at2cls")
    text = markdown(table, "at2cls")
    record = {
        "model": args.model, "train": len(train), "dev": len(dev), "seed": args.seed,
        "train_min_tokens": args.train_min_tokens, "protocol": "paper",
        "train_tokens": sum(len(d.positions) for d in train_dels),
        "dev_accuracy": float(np.mean([e.predicted == r["label"] for e, r in zip(dev_exps, dev)])),
        "fits": fits, "results": table, "timing_s": {k: round(v, 1) for k, v in timing.items()},
        "per_example": values, "markdown": text,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "at2_classifier.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    for name, f in fits.items():
        print(f"{name}: features {f['features']}, target {f['target']}: alpha {f['alpha']:g}, "
              f"grouped-CV R² {f['cv_r2']:.3f}, train R² {f['train_r2']:.3f}, dev R² {f['dev_r2']:.3f} "
              f"({f['rows']} tokens of {f['sentences']} sentences)")
    print(f"dev accuracy {record['dev_accuracy']:.3f} on {len(dev)} sentences; timings {record['timing_s']}")
    print(text)
    return record


if __name__ == "__main__":
    main()
