"""Fine-tune an extractive question-answering model (start and end logits over the tokens) on SQuAD v1.1 dev.

SQuAD's train file is not among the offline data, so the dev file is split by article: the model trains on the
articles at even positions of the file's ``data`` list and is evaluated on those at odd positions (the ``fit`` and
``eval`` parts of :func:`attnlens.data.squad_part`), never the other way round and never on both. The recipe is
HuggingFace's: question + context pairs cut into windows of ``max_length`` tokens (only the context is cut,
consecutive windows share ``doc_stride`` tokens), the start and end tokens of the first gold answer as labels (the
CLS token where the answer is not inside a window), AdamW with linear warmup and decay as for classification, and
exact match / F1 of the best span (at most 30 tokens) over each question's windows.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .core.batching import scoring_chunks
from .core.memory import DEFAULT_BUDGET
from .core.modelstate import without_cache
from .data import ALIASES, Example, squad_articles, squad_examples, squad_file, squad_part
from .errors import InputError, ModelError
from .evaluation.squad import squad_scores
from .models.loading import resolve_device
from .train import (
    TrainConfig,
    check_model_and_out,
    check_training_memory,
    freeze_lower_layers,
    load_config_and_tokenizer,
    load_with_head,
    optimise,
    run_record,
    save_trained,
    seed_everything,
    training_budget,
)

__all__ = [
    "MAX_ANSWER_TOKENS",
    "QA_MAX_LENGTH",
    "QASplit",
    "Windows",
    "answer_tokens",
    "best_span",
    "load_qa_split",
    "make_windows",
    "train_qa",
]

QA_MAX_LENGTH = 384  # default --max-length for QA: the length of one window (question + part of the context)
MAX_ANSWER_TOKENS = 30
OTHER_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForMultipleChoice", "ForMaskedLM",
               "ForCausalLM", "ForConditionalGeneration", "ForPreTraining")


# --------------------------------------------------------------------------------------------- data
@dataclass
class QASplit:
    """The answerable questions of one part of SQuAD dev and the articles they come from."""

    part: str  # "fit" (articles at even positions) or "eval" (odd positions)
    examples: list[Example]
    article: list[int]  # position in the file's ``data`` list of each example's article
    titles: dict[int, str]  # title of every article of the part, by position
    source: str

    def articles_used(self) -> dict[str, Any]:
        """Positions and titles of the articles the examples come from (for ``metrics.json``)."""
        positions = sorted(set(self.article))
        return {"part": self.part, "positions": positions, "titles": [self.titles[p] for p in positions],
                "questions": len(self.examples)}


def load_qa_split(part: str, limit: int | None = None, seed: int = 0, root: str | None = None) -> QASplit:
    """The answerable questions of the articles in ``part`` of the local SQuAD v1.1 dev file; ``limit`` keeps that
    many drawn with ``random.Random(seed)``, in file order."""
    chosen = squad_part(squad_articles(root), part)
    examples: list[Example] = []
    article: list[int] = []
    for position, doc in chosen:
        found = [e for e in squad_examples({"data": [doc]}) if e.answers]
        examples += found
        article += [position] * len(found)
    if not examples:
        raise InputError(f"the {part} articles of SQuAD dev hold no answerable questions")
    keep = range(len(examples))
    if limit is not None and limit < len(examples):
        keep = sorted(random.Random(seed).sample(range(len(examples)), limit))
    titles = {p: str(doc.get("title", "")) for p, doc in chosen}
    return QASplit(part, [examples[i] for i in keep], [article[i] for i in keep], titles, str(squad_file(root)))


def answer_span(example: Example) -> tuple[int, int]:
    """Character span ``[start, end)`` of the first gold answer in the example's context."""
    context = example.text[1]
    answer = example.answers[0]
    text = answer["text"]
    start = int(answer.get("answer_start", -1))
    if context[start : start + len(text)] != text:  # an offset that does not point at the text: its first copy
        start = context.find(text)
        if start < 0:
            raise InputError(f"question {example.id}: the answer {text!r} is not in its context")
    return start, start + len(text)


def answer_tokens(offsets: Sequence[tuple[int, int] | None], start: int, end: int, cls_index: int) -> tuple[int, int]:
    """Start and end token of the characters ``[start, end)`` among the context tokens of one window
    (``offsets[k]`` is token ``k``'s character span in the context, ``None`` for tokens outside it); both are
    ``cls_index`` when the window does not hold the whole answer."""
    context = [k for k, o in enumerate(offsets) if o is not None]
    if not context or offsets[context[0]][0] > start or offsets[context[-1]][1] < end:
        return cls_index, cls_index
    first = max(k for k in context if offsets[k][0] <= start)
    last = min(k for k in context if offsets[k][1] >= end)
    return first, last


@dataclass
class Windows:
    """Question + context windows of a list of examples, as the model reads them."""

    features: list[dict[str, list[int]]]  # input_ids (and token_type_ids) of each window
    example: list[int]  # the example each window comes from
    offsets: list[list[tuple[int, int] | None]]  # character span in the context of each token; None outside
    starts: list[int]  # label: start token of the answer (cls index where the window does not hold it)
    ends: list[int]


def make_windows(tokenizer: Any, examples: Sequence[Example], max_length: int, doc_stride: int) -> Windows:
    """Cut each question + context into windows of at most ``max_length`` tokens (only the context is cut;
    consecutive windows share ``doc_stride`` tokens of it) and label each with :func:`answer_tokens`."""
    if not getattr(tokenizer, "is_fast", False):
        raise ModelError("QA training needs a fast tokenizer (it maps tokens to characters with offsets); "
                         f"{type(tokenizer).__name__} is not one")
    questions = [e.text[0].lstrip() for e in examples]
    # a window holds what the longest question and the special tokens leave of max_length, and must hold more
    # context than the stride it shares with the next (the tokenizer's Rust side panics otherwise)
    longest = max((len(ids) for ids in tokenizer(questions, add_special_tokens=False)["input_ids"]), default=0)
    room = max_length - longest - tokenizer.num_special_tokens_to_add(pair=True)
    if room <= doc_stride:
        raise InputError(f"with --max-length {max_length}, a window leaves {max(room, 0)} tokens of context after the "
                         f"longest question ({longest} tokens) and the special tokens: more than --doc-stride "
                         f"{doc_stride} are needed; raise --max-length or lower --doc-stride")
    try:
        enc = tokenizer(
            questions, [e.text[1] for e in examples], truncation="only_second",
            max_length=max_length, stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
        )
    except Exception as exc:  # the tokenizer's own error: a question longer than a window, a stride too long
        raise InputError(f"cannot cut the questions and contexts into windows of --max-length {max_length} tokens "
                         f"with --doc-stride {doc_stride} ({str(exc).splitlines()[0]}); raise --max-length or "
                         "lower --doc-stride") from None
    keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
    windows = Windows([], [], [], [], [])
    for w, j in enumerate(enc["overflow_to_sample_mapping"]):
        ids = enc["input_ids"][w]
        sequence = enc.sequence_ids(w)
        offsets = [tuple(o) if s == 1 else None for o, s in zip(enc["offset_mapping"][w], sequence, strict=True)]
        cls_index = ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in ids else 0
        start, end = answer_tokens(offsets, *answer_span(examples[j]), cls_index)
        windows.features.append({k: enc[k][w] for k in keys})
        windows.example.append(int(j))
        windows.offsets.append(offsets)
        windows.starts.append(start)
        windows.ends.append(end)
    return windows


def pad_batch(features: Sequence[dict[str, list[int]]], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded tensors of ``features`` with their attention mask (labels index the unpadded positions)."""
    n = max(len(f["input_ids"]) for f in features)
    batch = {key: torch.tensor([f[key] + [pad_id if key == "input_ids" else 0] * (n - len(f[key]))
                                for f in features], device=device) for key in features[0]}
    batch["attention_mask"] = torch.tensor([[1] * len(f["input_ids"]) + [0] * (n - len(f["input_ids"]))
                                            for f in features], device=device)
    return batch


# ----------------------------------------------------------------------------------------- predict
def best_span(
    start_logits: np.ndarray, end_logits: np.ndarray, offsets: Sequence[tuple[int, int] | None],
    max_answer_tokens: int = MAX_ANSWER_TOKENS,
) -> tuple[float, int, int] | None:
    """``(score, start, end)`` of the context span with the largest start + end logit among those of at most
    ``max_answer_tokens`` tokens (``end >= start``); ``None`` when the window holds no context token."""
    inside = np.array([o is not None for o in offsets])
    if not inside.any():
        return None
    n = len(offsets)
    scores = start_logits[:n, None].astype(np.float64) + end_logits[None, :n]
    i, j = np.indices((n, n))
    ok = inside[:, None] & inside[None, :] & (j >= i) & (j - i < max_answer_tokens)
    k = int(np.argmax(np.where(ok, scores, -np.inf)))
    return float(scores.flat[k]), k // n, k % n


@torch.no_grad()
def predict_answers(
    model: torch.nn.Module, examples: Sequence[Example], windows: Windows, pad_id: int, device: torch.device,
    batch_size: int = 64, max_answer_tokens: int = MAX_ANSWER_TOKENS, memory_budget: int = DEFAULT_BUDGET,
) -> list[str]:
    """The predicted answer text of every example: its best span over all of its windows (length-sorted batches
    of at most ``batch_size`` windows within ``memory_budget`` bytes)."""
    model.eval()
    best: list[tuple[float, str] | None] = [None] * len(examples)
    lengths = [len(f["input_ids"]) for f in windows.features]
    for idx in scoring_chunks(model, lengths, batch_size, memory_budget, attention=None):  # as the model is set
        out = model(**pad_batch([windows.features[w] for w in idx], pad_id, device), **without_cache(model))
        starts, ends = out.start_logits.float().cpu().numpy(), out.end_logits.float().cpu().numpy()
        for b, w in enumerate(idx):
            span = best_span(starts[b], ends[b], windows.offsets[w], max_answer_tokens)
            j = windows.example[w]
            if span is not None and (best[j] is None or span[0] > best[j][0]):
                context = examples[j].text[1]
                best[j] = (span[0], context[windows.offsets[w][span[1]][0] : windows.offsets[w][span[2]][1]])
    return [b[1] if b is not None else "" for b in best]


# -------------------------------------------------------------------------------------------- model
def load_qa_model(name: str, reinit_head: bool = False, log: Callable[[str], None] = print) -> tuple[Any, Any]:
    """Tokenizer and ``AutoModelForQuestionAnswering`` of ``name``. A model without a task head gets a new
    (random) QA head; a checkpoint with another task's head is refused unless ``reinit_head``."""
    from transformers import AutoModelForQuestionAnswering

    source, config, tokenizer = load_config_and_tokenizer(name)
    architectures = list(config.architectures or [])
    qa = any(a.endswith("ForQuestionAnswering") for a in architectures)
    other = next((a for a in architectures if a.endswith(OTHER_HEADS)), None)
    if (qa and config.num_labels != 2) or (other and not qa):
        what = f"a {config.num_labels}-output QA head" if qa else f"the head of a {other}"
        if not reinit_head:
            raise ModelError(f"{name} has {what}, not an extractive-QA head (start and end logits); pass "
                             "--reinit-head to replace it with a new, untrained QA head")
        log(f"replacing {what} of {name} by a new extractive-QA head")
    elif not qa:
        log(f"{name} has no QA head; a new one is trained from scratch")
    config.num_labels = 2
    return load_with_head(AutoModelForQuestionAnswering, "question answering", name, source, config, tokenizer,
                          reinit_head)


# TrainConfig's fields of classification data: a QA run refuses any of them set away from its default
CLASSIFICATION_OPTIONS = ("split", "eval_split", "eval_file", "text_field", "text_pair_field", "label_field",
                          "eval_fraction")


def _check_options(cfg: TrainConfig) -> None:
    """Options of classification data that would change what a QA run trains or evaluates on are refused."""
    defaults = {f.name: f.default for f in fields(TrainConfig)}
    given = ["--" + name.replace("_", "-") for name in CLASSIFICATION_OPTIONS
             if getattr(cfg, name) != defaults[name]]
    if given:
        raise InputError(f"{', '.join(given)}: --dataset {cfg.dataset} trains on the articles at even positions of "
                         "SQuAD v1.1 dev and evaluates on those at odd positions; leave out these options")
    if ALIASES.get(cfg.dataset.lower(), cfg.dataset.lower()) != "squad":
        raise InputError(f"--dataset {cfg.dataset}: attnlens train fine-tunes QA models on squad (SQuAD v1.1) only")
    if cfg.doc_stride >= cfg.max_length:
        raise InputError(f"--doc-stride {cfg.doc_stride} must be less than --max-length {cfg.max_length}")


# -------------------------------------------------------------------------------------------- train
def train_qa(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fine-tune ``cfg.model`` for extractive QA on the even articles of SQuAD v1.1 dev, evaluate exact match
    and F1 on the odd ones, save model, tokenizer and ``metrics.json`` to ``cfg.out``; return the metrics."""
    cfg.validate()
    given_length = cfg.max_length
    cfg = replace(cfg, max_length=cfg.max_length or QA_MAX_LENGTH)
    _check_options(cfg)
    check_model_and_out(cfg)
    started = time.time()
    seed_everything(cfg.seed)
    train_split = load_qa_split("fit", cfg.limit, cfg.seed, root=cfg.data_root)
    eval_split = load_qa_split("eval", cfg.eval_limit, cfg.seed, root=cfg.data_root)

    device = resolve_device(cfg.device or "auto")
    tokenizer, model = load_qa_model(cfg.model, cfg.reinit_head, log)
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and cfg.max_length > positions:
        if given_length is not None:
            raise InputError(f"--max-length {cfg.max_length} is more than the {positions} positions of {cfg.model}")
        # the default window, on a model that takes fewer tokens (and the default stride, a third of it)
        stride = positions // 3 if cfg.doc_stride == TrainConfig.doc_stride else cfg.doc_stride
        cfg = replace(cfg, max_length=positions, doc_stride=stride)
        _check_options(cfg)
    seed_everything(cfg.seed)  # the new head's initialisation does not depend on what was loaded before
    if cfg.freeze_layers:
        trainable = freeze_lower_layers(model, cfg.freeze_layers)
        log(f"froze the embeddings and the lowest {cfg.freeze_layers} layers: {trainable:,} parameters train")
    model.to(device)
    train_windows = make_windows(tokenizer, train_split.examples, cfg.max_length, cfg.doc_stride)
    lengths = [len(f["input_ids"]) for f in train_windows.features]
    check_training_memory(model, cfg, lengths)  # before the evaluation windows are made
    eval_windows = make_windows(tokenizer, eval_split.examples, cfg.max_length, cfg.doc_stride)
    log(
        f"training {cfg.model} for extractive QA on {len(train_split.examples)} questions "
        f"({len(train_windows.features)} windows) of {len(set(train_split.article))} even SQuAD articles, "
        f"evaluating on {len(eval_split.examples)} questions of {len(set(eval_split.article))} odd ones, "
        f"device {device}"
    )

    starts, ends = torch.tensor(train_windows.starts), torch.tensor(train_windows.ends)
    pad_id = tokenizer.pad_token_id

    def make_batch(idx: list[int]) -> dict[str, torch.Tensor]:
        batch = pad_batch([train_windows.features[i] for i in idx], pad_id, device)
        return {**batch, "start_positions": starts[idx].to(device), "end_positions": ends[idx].to(device)}

    losses, total_steps = optimise(model, lengths, make_batch, cfg, device, log)
    train_seconds = time.time() - started

    predictions = predict_answers(model, eval_split.examples, eval_windows, pad_id, device, cfg.eval_batch_size,
                                  memory_budget=training_budget(cfg))
    scores = squad_scores(predictions, [[a["text"] for a in e.answers] for e in eval_split.examples])
    log(f"eval (odd articles): exact match {scores['exact_match']:.4f}  F1 {scores['f1']:.4f}  (n={scores['n']})")

    out = Path(cfg.out)
    metrics = {
        "eval": scores,
        "eval_split": "eval",
        "task": "qa",
        "base": cfg.model,
        "dataset": "squad",
        "source": train_split.source,
        "articles": {"train": train_split.articles_used(), "eval": eval_split.articles_used(),
                     "rule": "train: articles at even positions of the file's data list (0, 2, ...); "
                             "eval: odd positions (1, 3, ...)"},
        "train_examples": len(train_split.examples),
        "train_windows": len(train_windows.features),
        "eval_windows": len(eval_windows.features),
        "doc_stride": cfg.doc_stride,
        "max_answer_tokens": MAX_ANSWER_TOKENS,
        **run_record(cfg, total_steps, started, train_seconds, losses),
    }
    return save_trained(model, tokenizer, metrics, out, log)
