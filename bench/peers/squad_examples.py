"""Context-attribution examples from SQuAD v1.1 dev, in the examples file's shape.

attnlens writes the benchmark's examples file itself; this one is for developing and checking the peer side
(and gives AT2's training examples). Sources are the paragraph's sentences (a regular-expression split: after
``.``, ``!`` or ``?`` and before a capital, digit or quote); ``gold`` is the sentence holding the first answer;
``answer`` is that answer with a leading space. Articles are taken by position in the file's ``data`` list:
``--articles odd`` (1, 3, ...) or ``even`` (0, 2, ...), one question per paragraph, ``--limit`` of them spread
evenly over the articles.

    python bench/peers/squad_examples.py --out /tmp/squad-context.jsonl --articles odd --limit 20
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

SQUAD_DEV = Path(__file__).resolve().parents[3] / "shared" / "data" / "squad_v1.1" / "dev-v1.1.reconstructed.json.gz"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'“(])")


def sentence_spans(text: str) -> list[dict]:
    """The sentences of ``text`` as ``{"start", "end", "text"}`` character spans, whitespace between them left out."""
    spans, start = [], 0
    for gap in [*SENTENCE_END.finditer(text), None]:
        end = gap.start() if gap else len(text.rstrip())
        if end > start:
            spans.append({"start": start, "end": end, "text": text[start:end]})
        start = gap.end() if gap else len(text)
    return spans


def squad_examples(articles: str, limit: int | None, min_sources: int = 3, path: Path = SQUAD_DEV) -> list[dict]:
    """One example per paragraph (its first question) of the articles at ``articles`` ("odd"/"even") positions,
    ``limit`` of them evenly spread."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = json.load(f)["data"]
    parity = {"even": 0, "odd": 1}[articles]
    out = []
    for a, article in enumerate(data):
        if a % 2 != parity:
            continue
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            spans = sentence_spans(context)
            qa = paragraph["qas"][0]
            answer = qa["answers"][0]
            at = answer["answer_start"]
            gold = [i for i, s in enumerate(spans) if s["start"] <= at < s["end"]]
            if len(spans) < min_sources or not gold:
                continue
            out.append({"id": qa["id"], "context": context, "query": qa["question"].strip(),
                        "answer": " " + answer["text"].strip(), "sources": spans, "gold": gold[0]})
    if limit is not None and limit < len(out):  # evenly spread over the articles, not the first few
        out = [out[k * len(out) // limit] for k in range(limit)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--articles", choices=["odd", "even"], default="odd")
    parser.add_argument("--limit", type=int, default=20)
    args = parser.parse_args()
    rows = squad_examples(args.articles, args.limit)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} examples -> {args.out}")


if __name__ == "__main__":
    main()
