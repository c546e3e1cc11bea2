"""Shared fixtures: a tiny WordPiece tokenizer and tiny random models of every supported family (offline)."""

from __future__ import annotations

import os

# Triton kernels (what CUDA GPUs run) run in Triton's interpreter on the CPU. It is chosen when Triton is
# imported, which importing transformers' models does, so it is set before any import below.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, NoReturn  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import BertTokenizerFast  # noqa: E402

from attnlens.testing.tiny_models import build_tiny  # noqa: E402

if TYPE_CHECKING:
    from attnlens import Explainer

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch.set_num_threads(1)

# CI (.ci/run) provides every model, data set and tool the tests read: there a missing one fails its tests
# instead of skipping them.
IN_CI = os.environ.get("CI", "").strip().lower() in {"true", "1", "yes"}


def missing(reason: str) -> NoReturn:
    """Skip the calling test because ``reason`` (a model, data set or tool) is missing here; fail it under CI."""
    if IN_CI:
        pytest.fail(f"{reason}: CI provides it, so the test must run there")
    pytest.skip(reason)


def needs(present: bool, reason: str) -> pytest.MarkDecorator:
    """``skipif`` for a missing model, data set or tool, except under CI, where the test runs (and fails)."""
    return pytest.mark.skipif(not present and not IN_CI, reason=reason)


SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MODELS = SHARED / "models"
DATA = SHARED / "data"

# The library has no default model or data folder: the tests use the offline ones beside this checkout, as
# `make test` does, unless the environment names others.
if DATA.is_dir():
    os.environ.setdefault("ATTNLENS_DATA", str(DATA))
if (MODELS / "minilm-sst2").is_dir():
    os.environ.setdefault("ATTNLENS_MODEL", str(MODELS / "minilm-sst2"))

WORDS = (
    "the a movie film was is not very good bad great awful i really didn ' t like this it and but "
    "charming journey boring plot actors story , . ! funny dull loved hated never ever best worst"
).split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = SPECIALS + WORDS + ["##s", "##ly", "##ing", "##ed"]
PAD, UNK, CLS, SEP, MASK = range(5)
V = 64  # embedding rows (>= len(VOCAB))

FAMILIES = ["bert", "distilbert", "roberta", "albert", "electra", "gpt2", "llama", "bart"]
ENCODERS = ["bert", "distilbert", "roberta", "albert", "electra"]


def make_tokenizer() -> BertTokenizerFast:
    """A fast WordPiece tokenizer over the tiny vocabulary (``[PAD]`` = 0, ``[CLS]`` = 2, ``[SEP]`` = 3)."""
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)}, do_lower_case=True, model_max_length=48)
    assert len(tok) == len(VOCAB) and tok.convert_tokens_to_ids("movie") == VOCAB.index("movie")
    return tok


@pytest.fixture(scope="session")
def tokenizer() -> BertTokenizerFast:
    return make_tokenizer()


def make_model(family: str, num_labels: int = 2, seed: int = 0, attn: str = "eager",
               model_suffix: str = "ForSequenceClassification") -> torch.nn.Module:
    """A tiny random classifier of model type ``family`` (2 layers, 2 heads, hidden 16) over the tiny vocabulary,
    built from its recipe in :mod:`attnlens.testing.tiny_models` (``model_suffix``: another task's model)."""
    return build_tiny(family, vocab_size=V, pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP,
                      num_labels=num_labels, seed=seed, attn=attn, model_suffix=model_suffix)


def randomise_biases_and_norms(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``model`` with random biases and norm scales too (HF initialises them to 0 and 1, which would hide every
    bias term and norm scale from a test), in eval mode."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif ("norm" in name.lower() or "ln_" in name) and name.endswith("weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture
def entry_without_layers():
    """DeBERTa's architecture entry replaced, for one test, by an entry that names no layers (a new type's first
    entry): the methods that rerun or decompose layers do not apply to a ``make_model("deberta")``."""
    from attnlens.models.architectures import ARCHITECTURES, ENCODER, LRP_SUPPORTED, Architecture, register_architecture

    saved = dict(ARCHITECTURES), dict(LRP_SUPPORTED)  # restored as they were, in their order
    register_architecture(Architecture("deberta", ENCODER))
    try:
        yield
    finally:
        for table, old in zip((ARCHITECTURES, LRP_SUPPORTED), saved, strict=True):
            table.clear()
            table.update(old)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny BERT classifier and its tokenizer saved to disk (a module may define its own, e.g. with labels)."""
    path = tmp_path_factory.mktemp("tiny-bert")
    make_model("bert").save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def minilm_sst2():
    """The real reference classifier (BERT MiniLM-L6 fine-tuned on SST-2), loaded once."""
    from attnlens import Explainer

    path = MODELS / "minilm-sst2"
    if not path.is_dir():
        missing(f"reference model not found at {path}")
    return Explainer.from_pretrained(path)


def peak_rss_growth(fn: Callable[[], object]) -> int:
    """Bytes the process's peak resident size grew by while ``fn`` ran: the peak (``VmHWM``) is first reset to the
    current size (``/proc/self/clear_refs``; the ``ru_maxrss`` of a process keeps its parent's peak across exec)."""

    def hwm() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = hwm()
    fn()
    return hwm() - before


def growth_in_fresh_processes(measure: Callable[[], tuple[int, int]], limit: Callable[[int], float]
                               ) -> tuple[int, int]:
    """``measure()`` (a module-level function returning ``(peak-RSS growth, a figure)``) run in a fresh process;
    where the growth exceeds ``limit(figure)``, the lower growth of that and a second fresh process (resident
    memory depends on how the allocator's heaps happened to be reused). Returns ``(growth, figure)``."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        grown, figure = pool.apply(measure)
    if grown > limit(figure):
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            grown = min(grown, pool.apply(measure)[0])
    return grown, figure


def long_llama(hidden: int, heads: int) -> Explainer:
    """An explainer of a 2-layer random Llama causal LM of ``hidden`` channels and ``heads`` heads (feed-forward
    twice as wide, two key-value heads) that takes 4,096 positions, with the test tokenizer: inputs long enough
    for memory to be measured, in one thread."""
    import transformers

    from attnlens import Explainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=2,
                                      max_position_embeddings=4096, pad_token_id=PAD, bos_token_id=CLS,
                                      eos_token_id=SEP)
    tokenizer = make_tokenizer()
    tokenizer.model_max_length = 4096
    return Explainer(transformers.LlamaForCausalLM(config).eval(), tokenizer, max_length=4096)
