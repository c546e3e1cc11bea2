"""Shared by the serve tests: the served models (the real MiniLM SST-2 classifier and a tiny random language model
over its vocabulary, saved to a folder), a small benchmark results folder, and a server on a free local port."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

from attnlens import Explainer
from attnlens.testing.tiny_models import build_tiny

MINILM = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "minilm-sst2"
FAST = ["rawatt", "rollout", "agrad", "gae", "attcat", "inputxgradient"]


def _save_tiny(family: str, task: str, path: Path) -> Path:
    """A 2-layer random ``task`` model of ``family`` over MiniLM's WordPiece vocabulary (its tokens read as words)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    model = build_tiny(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id, task=task)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_lm(path: Path) -> Path:
    """A random GPT-2 language model over MiniLM's vocabulary."""
    return _save_tiny("gpt2", "causal-lm", path)


def save_tiny_seq2seq(path: Path) -> Path:
    """A random BART over MiniLM's vocabulary."""
    return _save_tiny("bart", "seq2seq-lm", path)


def make_results(explainer: Explainer, out: Path, n: int = 6) -> Path:
    """A benchmark results folder: ``n`` SST-2 dev sentences, two methods, AOPC and comprehensiveness."""
    from attnlens.data import load_dataset
    from attnlens.evaluation import run_benchmark

    run_benchmark(explainer, load_dataset("sst2", "dev", limit=n), out, methods=["rawatt", "attcat"],
                  metrics="aopc,comprehensiveness", progress=False, model_name="minilm-sst2")
    return out


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 in a thread of this process (for the browser and the overhead bench)."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
