"""The inputs of the GPU benches, written for a machine without the model's package or the data: SmolLM2's
config.json and tokenizer files (from the GGUF file attnlens reads offline) and plain IMDB review text of at least
``--tokens`` tokens.

Run: ``python bench/gpu_inputs.py OUT [--tokens 36000]``; then ``bench/long_context_gpu.py --model-dir OUT/smollm2
--text OUT/imdb.txt`` (and ``bench/globenc_gpu_paths.py`` alike) on the GPU machine, with this checkout.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

IMDB = Path(__file__).resolve().parents[2] / "shared" / "data" / "imdb" / "test.jsonl.gz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=36_000, help="tokens of text at least (the longest prompt)")
    parser.add_argument("--imdb", type=Path, default=IMDB, help="IMDB reviews, JSON Lines (gzip) with 'text'")
    args = parser.parse_args()

    from attnlens import Explainer

    ex = Explainer.from_pretrained("smollm2")
    folder = args.out / "smollm2"
    ex.model.config.save_pretrained(folder)
    ex.tokenizer.save_pretrained(folder)
    texts, count = [], 0
    with gzip.open(args.imdb, "rt", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            texts.append(text)
            count += len(ex.tokenizer(text, add_special_tokens=False)["input_ids"])
            if count >= args.tokens:
                break
    if count < args.tokens:
        raise SystemExit(f"{args.imdb} holds {count:,} tokens; {args.tokens:,} were asked for")
    (args.out / "imdb.txt").write_text("\n\n".join(texts), encoding="utf-8")
    print(f"wrote {folder} and {args.out / 'imdb.txt'} ({count:,} tokens)")


if __name__ == "__main__":
    main()
