"""What the peer runners share: the examples file, the prompt, the model, the offline guard.

Runs in the peers virtualenv (bench/peers/setup.sh), which holds ContextCite and AT2 but not attnlens, so
nothing here imports attnlens.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its thread pool
os.environ.setdefault("TQDM_DISABLE", "1")  # ContextCite shows a bar per example
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT_TEMPLATE = "Context: {context}\n\nQuery: {query}"  # ContextCite's and AT2's default user message


def offline_nltk() -> None:
    """Keep ContextCite and AT2 from downloading NLTK's punkt at import.

    Both call ``nltk.download("punkt_tab")`` when imported; offline that tries the network and prints an error.
    punkt only serves their own sentence splitting, which we replace with the examples file's spans.
    """
    import nltk

    nltk.download = lambda *args, **kwargs: False
    warnings.filterwarnings("ignore", message=".*autocast.*")  # ContextCite asks for CUDA autocast on CPU


@dataclass(frozen=True)
class Span:
    """One source: the characters ``context[start:end]``."""

    start: int
    end: int
    text: str


@dataclass(frozen=True)
class Example:
    """One line of the examples file."""

    id: str
    context: str
    query: str
    answer: str
    sources: tuple[Span, ...]
    gold: int


def read_examples(path: str | Path, limit: int | None = None) -> list[Example]:
    """The examples of a JSON Lines file, checked: spans ordered, disjoint and equal to their text."""
    examples = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        spans = tuple(Span(int(s["start"]), int(s["end"]), s["text"]) for s in row["sources"])
        ex = Example(str(row["id"]), row["context"], row["query"], row["answer"], spans, int(row["gold"]))
        _check(ex, f"{path}:{n}")
        examples.append(ex)
        if limit is not None and len(examples) >= limit:
            break
    return examples


def _check(ex: Example, where: str) -> None:
    if not ex.sources:
        raise ValueError(f"{where}: no sources")
    previous_end = 0
    for i, s in enumerate(ex.sources):
        if not previous_end <= s.start < s.end <= len(ex.context):
            raise ValueError(f"{where}: source {i} ({s.start}, {s.end}) is empty, overlaps or lies outside the context")
        if ex.context[s.start : s.end] != s.text:
            raise ValueError(f"{where}: source {i}'s text differs from context[{s.start}:{s.end}]")
        previous_end = s.end
    if not 0 <= ex.gold < len(ex.sources):
        raise ValueError(f"{where}: gold {ex.gold} is not a source index")
    if not ex.answer:
        raise ValueError(f"{where}: empty answer")


def load_model(model_dir: str | Path):
    """The causal LM (float32, eval, CPU) and its tokenizer, padding on the left as ContextCite and AT2 expect."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model, tokenizer


def chat_prompt(tokenizer, context: str, query: str) -> str:
    """The chat template applied to one user message, with the generation prompt: the text the answer follows."""
    messages = [{"role": "user", "content": PROMPT_TEMPLATE.format(context=context, query=query)}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
