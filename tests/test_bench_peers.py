"""The peer benchmark's pure-Python pieces (bench/peers): the examples file's checks and the SQuAD sentence spans.

The peers themselves (ContextCite, AT2) live in a separate virtualenv; their forcing is checked there by
bench/peers/loo_check.py against a leave-one-out computed with plain transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import needs

PEERS = Path(__file__).resolve().parents[1] / "bench" / "peers"
sys.path.insert(0, str(PEERS))

from peer_common import read_examples  # noqa: E402
from squad_examples import SQUAD_DEV, sentence_spans, squad_examples  # noqa: E402


def test_sentence_spans_are_the_sentences_as_slices():
    text = "Warsaw is big. It lies on the Vistula!  In 1945 it was rebuilt? \"Yes,\" he said. end."
    spans = sentence_spans(text)
    assert [s["text"] for s in spans] == ["Warsaw is big.", "It lies on the Vistula!", "In 1945 it was rebuilt?",
                                          "\"Yes,\" he said. end."]
    for s in spans:
        assert text[s["start"] : s["end"]] == s["text"]
    # only whitespace lies between and around the spans
    bounds = [0] + [b for s in spans for b in (s["start"], s["end"])] + [len(text)]
    assert all(not text[a:b].strip() for a, b in zip(bounds[::2], bounds[1::2]))


def _write(tmp_path, **changes) -> Path:
    row = {"id": "a", "context": "One. Two.", "query": "q?", "answer": " x",
           "sources": [{"start": 0, "end": 4, "text": "One."}, {"start": 5, "end": 9, "text": "Two."}], "gold": 1}
    row.update(changes)
    path = tmp_path / "ex.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


def test_read_examples_accepts_a_good_line(tmp_path):
    (ex,) = read_examples(_write(tmp_path))
    assert [(s.start, s.end, s.text) for s in ex.sources] == [(0, 4, "One."), (5, 9, "Two.")]
    assert ex.gold == 1 and ex.answer == " x"


@pytest.mark.parametrize(("changes", "message"), [
    ({"sources": [{"start": 0, "end": 5, "text": "One. "}, {"start": 4, "end": 9, "text": " Two."}]}, "overlaps"),
    ({"sources": [{"start": 0, "end": 4, "text": "Two."}]}, "text differs"),
    ({"sources": [{"start": 5, "end": 12, "text": "Two."}]}, "outside"),
    ({"gold": 2}, "gold 2"),
    ({"sources": []}, "no sources"),
    ({"answer": ""}, "empty answer"),
])
def test_read_examples_refuses_bad_lines(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        read_examples(_write(tmp_path, **changes))


@needs(SQUAD_DEV.is_file(), "needs ../shared/data/squad_v1.1")
def test_squad_examples_gold_sentence_holds_the_answer():
    rows = squad_examples("odd", 12)
    assert len(rows) == 12 and len({r["id"] for r in rows}) == 12
    for r in rows:
        gold = r["sources"][r["gold"]]
        assert r["answer"].startswith(" ") and r["answer"].strip() in gold["text"]
        assert r["context"][gold["start"] : gold["end"]] == gold["text"]
    # even and odd articles are disjoint (AT2 trains on the even ones)
    even = {r["context"] for r in squad_examples("even", 12)}
    assert not even & {r["context"] for r in rows}
