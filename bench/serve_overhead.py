"""The server's overhead: ``POST /api/explain`` (uvicorn on 127.0.0.1, a keep-alive HTTP client) against the same
``Explainer.explain`` call in Python, on ~20-token SST-2 dev sentences with six fast methods.

Every sentence is explained once each way (so the server's cache never answers), the two interleaved and their
order alternated, so that the drifting load of a shared machine biases no ratio. Prints the median per-sentence
ratio and the ratio of the totals; the target is at most 1.2.

    python bench/serve_overhead.py [--sentences 40]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import httpx
import uvicorn
from common import MODEL, read_texts

from attnlens import Explainer
from attnlens.serve import create_app

METHODS = ["rawatt", "rollout", "agrad", "gae", "attcat", "inputxgradient"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=40)
    args = parser.parse_args()
    ex = Explainer.from_pretrained(MODEL)
    texts = [t for t in read_texts() if 18 <= len(ex.encode([t])[0].ids) <= 22][: args.sentences + 3]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app({"minilm": ex}), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/api/explain"

    with httpx.Client(timeout=60) as client:
        def served(text: str) -> float:
            t = time.perf_counter()
            r = client.post(url, json={"texts": [text], "methods": METHODS})
            r.raise_for_status()
            r.json()
            return time.perf_counter() - t

        def direct(text: str) -> float:
            t = time.perf_counter()
            [e.to_dict() for e in ex.explain([text], methods=METHODS)]  # noqa: B018 - what the server also does
            return time.perf_counter() - t

        for text in texts[:3]:  # warm-up
            served(text + " ."), direct(text)
        pairs = []
        for i, text in enumerate(texts[3:]):
            if i % 2:
                s, d = served(text), direct(text)
            else:
                d, s = direct(text), served(text)
            pairs.append((s, d))
    server.should_exit = True
    ratios = [s / d for s, d in pairs]
    total_s, total_d = sum(s for s, _ in pairs), sum(d for _, d in pairs)
    print(f"{len(pairs)} sentences of 18-22 tokens, methods {','.join(METHODS)}")
    print(f"python explain: median {1000 * statistics.median(d for _, d in pairs):.1f} ms; "
          f"POST /api/explain: median {1000 * statistics.median(s for s, _ in pairs):.1f} ms")
    print(f"server / python: median ratio {statistics.median(ratios):.3f}, ratio of totals {total_s / total_d:.3f} "
          "(target <= 1.2)")


if __name__ == "__main__":
    main()
