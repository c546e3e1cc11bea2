"""Model-parameter randomisation test (Adebayo et al., "Sanity Checks for Saliency Maps", NeurIPS 2018).

Cascading randomisation: the classifier head's weights are re-drawn first (with what lies between the last layer
and it, such as BERT's pooler), then those of the top layer, the layer below, ... down to the first layer (each
step keeps the earlier ones randomised); the embeddings stay trained. After each step the same
examples are explained again, for the same target classes, and each method's scores are compared with its
scores on the trained model by Spearman's rank correlation over the real non-special tokens (signed scores, and
their absolute values as Adebayo et al. also report). A method whose explanation stays the same as the model is
destroyed does not explain the model: lower is better.

Re-drawn are the weight matrices (every parameter with two or more dimensions) of the randomised blocks, from
N(0, σ²) with σ the config's ``initializer_range`` (0.02 where it has none), seeded; biases and norm scales
are kept. The model is restored to its trained weights afterwards, also on errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from scipy.stats import spearmanr

from ..errors import InputError
from ..models.architectures import architecture_for
from ..results.explanation import Explanation
from .metrics import SANITY


def randomisation_blocks(model: torch.nn.Module, stream: str = "self") -> list[tuple[str, list[torch.nn.Module]]]:
    """The cascade's steps, top first: ``("head", modules)`` then ``("layer L", [layer]) … ("layer 1", …)``.

    The head is every module holding parameters outside the base model (the classifier) and every module of the
    base model after its last layer that holds a weight matrix (BERT's pooler, which the classifier reads); the
    layers are those of the model's architecture entry (``layers``). Raises :class:`InputError` for a type without
    that entry."""
    spec = architecture_for(model.config).layers
    if spec is None or spec.path(stream) is None:
        raise InputError(f"the sanity metric randomises layer by layer and does not know where the layers of model "
                         f"type {model.config.model_type!r} are (attention={stream!r})")
    layers = spec.modules(model, stream)
    base = model.base_model
    head = [m for name, m in model.named_children() if m is not base and any(True for _ in m.parameters())]
    head += _after_the_layers(model, spec)
    blocks: list[tuple[str, list[torch.nn.Module]]] = [("head", head)] if head else []
    blocks += [(f"layer {i + 1}", [layers[i]]) for i in reversed(range(len(layers)))]
    return blocks


def _after_the_layers(model: torch.nn.Module, spec: Any) -> list[torch.nn.Module]:
    """The base model's modules after its last layer (of every attention stream) that hold a weight matrix of their
    own, embeddings excepted: transformers registers a model's modules in the order its forward runs them, so
    these lie between the layers and the head (a pooler)."""
    inside = {id(m) for s in spec.streams for layer in spec.modules(model, s) for m in layer.modules()}
    modules = [m for _, m in model.base_model.named_modules()]
    last = max((i for i, m in enumerate(modules) if id(m) in inside), default=len(modules))
    return [m for m in modules[last + 1:] if id(m) not in inside and not isinstance(m, torch.nn.Embedding)
            and any(p.dim() >= 2 for p in m.parameters(recurse=False))]


@contextmanager
def restored(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the model's parameters may change; afterwards they are its own again."""
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(saved[name])


def randomise(modules: Sequence[torch.nn.Module], std: float, generator: torch.Generator) -> None:
    """Re-draw every weight matrix of ``modules`` from N(0, std²) (biases and norm scales kept)."""
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p) * std)


def rank_correlation(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's ρ of two score vectors; ``None`` where it is undefined (fewer than 2 tokens, constant scores)."""
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return float(spearmanr(a, b).statistic)


def _tokens(e: Explanation) -> np.ndarray:
    return ~np.asarray(e.special, dtype=bool)


def cascading_randomisation(
    explain: Callable[[list[str], list[Any]], list[Explanation]],
    model: torch.nn.Module,
    originals: Mapping[int, Explanation],
    texts: Mapping[int, str],
    methods: Sequence[str],
    *,
    stream: str = "self",
    seed: int = 0,
    done: Mapping[str, Mapping[str, Any]] | None = None,
    record: Callable[[dict[str, Any]], None] | None = None,
    step: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The sanity metric of ``methods`` on the examples ``originals`` (explanations on the trained model).

    ``explain(texts, targets)`` explains with every method on the model as it is at that moment. Returns
    ``{"depths": [step names], "methods": {method: {"value", "spearman", "spearman_abs"}}}``: per depth the mean ρ
    over the examples (``None`` where no example has one), and ``value`` the mean over depths of ``spearman``.

    Each depth costs one explanation of every example, so a long run keeps its finished depths: ``record`` is
    called with each depth's row (``{"depth", "examples", "methods": {method: {"spearman", "spearman_abs"}}}``) as
    soon as it is measured, and ``done`` (depth name → such a row, from an earlier run with the same settings)
    gives the depths not to explain again. The weights are re-drawn for every depth either way, so the depths
    after a skipped one see the same randomised model as in an uninterrupted run. ``step`` is called with each
    depth's name when it is finished (a progress bar).
    """
    blocks = randomisation_blocks(model, stream)
    std = float(getattr(model.config, "initializer_range", None) or 0.02)
    generator = torch.Generator().manual_seed(seed)
    order = sorted(originals)
    curves: dict[str, dict[str, list[float | None]]] = {m: {"spearman": [], "spearman_abs": []} for m in methods}
    with restored(model):
        for name, modules in blocks:
            randomise(modules, std, generator)  # also for a finished depth: the next ones build on it
            row = (done or {}).get(name)
            if row is None or not _covers(row, methods, len(order)):
                targets = [tuple(t) if isinstance(t, list) else t for t in (originals[i].target for i in order)]
                row = _depth_row(name, originals, order, explain([texts[i] for i in order], targets), methods)
                if record is not None:
                    record(row)
            for m in methods:
                curves[m]["spearman"].append(row["methods"][m]["spearman"])
                curves[m]["spearman_abs"].append(row["methods"][m]["spearman_abs"])
            if step is not None:
                step(name)
    return {
        "depths": [name for name, _ in blocks],
        "methods": {m: {"value": _mean(c["spearman"]), **c} for m, c in curves.items()},
    }


def _depth_row(name: str, originals: Mapping[int, Explanation], order: Sequence[int], redone: Sequence[Explanation],
               methods: Sequence[str]) -> dict[str, Any]:
    """One depth's mean ρ per method, signed and of absolute scores, over the examples ``order``."""
    found: dict[str, dict[str, float | None]] = {}
    for m in methods:
        signed, absolute = [], []
        for i, e in zip(order, redone, strict=True):
            keep = _tokens(originals[i])
            before, after = originals[i].scores[m][keep], e.scores[m][keep]
            signed.append(rank_correlation(before, after))
            absolute.append(rank_correlation(np.abs(before), np.abs(after)))
        found[m] = {"spearman": _mean(signed), "spearman_abs": _mean(absolute)}
    return {"depth": name, "examples": len(order), "methods": found}


def _covers(row: Mapping[str, Any], methods: Sequence[str], examples: int) -> bool:
    """Whether an earlier depth row holds every method's correlations over the same number of examples."""
    return (row.get("examples") == examples and isinstance(row.get("methods"), Mapping)
            and all(isinstance(row["methods"].get(m), Mapping) for m in methods))


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.mean(vals)) if vals else None


__all__ = ["SANITY", "cascading_randomisation", "randomisation_blocks", "rank_correlation"]
