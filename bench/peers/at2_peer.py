"""AT2 (Cohen-Wang et al., 2025; PyPI ``at2``) on given sources and a given answer.

AT2 scores a source by a learned linear map of the attention weights from the answer's tokens to the source's
tokens (one weight per layer and head), summed over the source's tokens and averaged over the answer's. Its
published estimators are for Phi-4-mini, Llama-3.1-8B, Qwen2.5-7B, ...: one weight per head of *that* model, so
none fits SmolLM2 (30 layers x 9 heads); ``train_at2.py`` trains one. The estimator is stored as JSON (its 270
weights and the feature extractor's settings) so that it can be read and diffed.

``SpanContextTask`` is AT2's ``ContextAttributionTask`` with the examples file's spans as its sources (AT2's
own tasks take sentences or tokens of the whole context); ``set_generation`` gives it the answer, so AT2 never
generates.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from at2 import AT2Attributor, AT2FeatureExtractor, AT2ScoreEstimator
from at2.tasks import ContextAttributionTask
from peer_common import PROMPT_TEMPLATE, Example

MODEL_TYPE = "llama"  # AT2 guesses the architecture from the model's path; SmolLM2 is a Llama


class SpanContextTask(ContextAttributionTask):
    """AT2's context attribution task with given character spans of the context as its sources."""

    def __init__(self, ex: Example, model, tokenizer) -> None:
        super().__init__(model, tokenizer, source_type="document")
        self.example = ex

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(context=self.example.context, query=self.example.query)

    def _get_document_ranges(self) -> list[tuple[int, int]]:
        start = len(PROMPT_TEMPLATE.split("{context}")[0])
        return [(start + s.start, start + s.end) for s in self.example.sources]

    def _get_source_token_ranges(self) -> list[tuple[int, int]]:
        # A token belongs to the span holding its last character, so a word's leading space (between spans)
        # never makes a token start a span early, and spans that touch still get disjoint token ranges.
        chat = self.input_text
        base = chat.index(self.prompt)
        offsets = self.tokenizer(chat, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        ranges = []
        for i, (start, end) in enumerate(self._get_document_ranges()):
            inside = [t for t, (a, b) in enumerate(offsets) if b > a and base + start <= b - 1 < base + end]
            if not inside:
                raise ValueError(f"{self.example.id}: source {i} holds no whole token")
            ranges.append((inside[0], inside[-1] + 1))
        return ranges

    def check_forced(self) -> None:
        """The target tokens must be exactly the answer's, after the prompt's (no merge at the seam)."""
        _, prompt_tokens = self.get_input_text_and_tokens()
        ids = self.get_tokens()["input_ids"]
        n = len(prompt_tokens["input_ids"])
        if ids[:n] != prompt_tokens["input_ids"]:
            raise ValueError(f"{self.example.id}: the answer merges with the prompt's last token; cannot force it")
        start, end = self.target_token_range
        decoded = self.tokenizer.decode(ids[start:end])
        if (start, end) != (n, len(ids)) or decoded != self.example.answer:
            raise ValueError(f"{self.example.id}: AT2's target tokens decode to {decoded!r}, not the answer")


def at2_scores(model, tokenizer, ex: Example, estimator: AT2ScoreEstimator) -> np.ndarray:
    """AT2's scores for ``ex.answer``, one per source of ``ex`` (higher = more used)."""
    task = SpanContextTask(ex, model, tokenizer)
    task.set_generation(ex.answer)
    task.check_forced()
    return np.asarray(AT2Attributor(task, estimator).get_attribution_scores(), dtype=np.float64)


def new_feature_extractor(model) -> AT2FeatureExtractor:
    """AT2's attention features (one per layer and head) for ``model``, a Llama-family causal LM."""
    return AT2FeatureExtractor(model.config.num_hidden_layers, model.config.num_attention_heads, MODEL_TYPE)


def save_estimator(estimator: AT2ScoreEstimator, path: str | Path, about: dict) -> None:
    """Write a linear AT2 estimator as JSON: its weights, the feature extractor's settings, ``about``."""
    fe = estimator.feature_extractor
    if estimator.linear.bias is not None:
        raise ValueError("only estimators without bias are stored")
    record = {"num_layers": fe.num_layers, "num_heads": fe.num_heads, "model_type": fe.model_type,
              "normalize": estimator.normalize, "non_negative": estimator.non_negative,
              "weights": estimator.linear.weight.detach().double().flatten().tolist(), "about": about}
    Path(path).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def load_estimator(path: str | Path) -> AT2ScoreEstimator:
    """An estimator written by :func:`save_estimator`."""
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    fe = AT2FeatureExtractor(record["num_layers"], record["num_heads"], record["model_type"])
    estimator = AT2ScoreEstimator(fe, normalize=record["normalize"], non_negative=record["non_negative"])
    weights = torch.tensor(record["weights"], dtype=torch.float32)
    if weights.numel() != fe.num_features:
        raise ValueError(f"{path}: {weights.numel()} weights for {fe.num_features} features")
    with torch.no_grad():
        estimator.linear.weight.copy_(weights.view(1, -1))
    return estimator
