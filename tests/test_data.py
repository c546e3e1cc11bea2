"""Data loaders: the shared offline files, files of the same shape, subsets, and clear errors."""

from __future__ import annotations

import gzip
import json

import pytest
from conftest import needs

from attnlens.data import data_root, known_datasets, load_dataset
from attnlens.errors import InputError

ROOT = data_root()
needs_data = needs(ROOT is not None and (ROOT / "sst2" / "dev.jsonl").exists(), "../shared/data not found")


@needs_data
def test_sst2_dev_and_subset():
    ds = load_dataset("sst2")
    assert (ds.name, ds.split, ds.task, len(ds)) == ("sst2", "dev", "classification", 872)
    assert ds[0].text.startswith("it 's a charming") and ds[0].label == 1
    assert ds.labels == ["negative", "positive"]
    sub = load_dataset("sst2", "validation", limit=20, seed=3)
    again = load_dataset("glue/sst2", limit=20, seed=3)
    other = load_dataset("sst2", limit=20, seed=4)
    assert len(sub) == 20 and [e.id for e in sub] == [e.id for e in again] != [e.id for e in other]
    assert [int(e.id) for e in sub] == sorted(int(e.id) for e in sub)  # original order kept


@needs_data
def test_imdb_mnli_squad():
    imdb = load_dataset("imdb", "sample2000")
    assert len(imdb) == 2000 and sum(e.label for e in imdb) == 1000
    mnli = load_dataset("mnli", "dev_mismatched")
    assert mnli.task == "pair" and len(mnli) == 1000 and isinstance(mnli[0].text, list)
    assert mnli.labels == ["entailment", "neutral", "contradiction"]
    v2 = load_dataset("squad_v2", limit=50)
    assert v2.task == "qa" and len(v2) == 50
    assert all(len(e.text) == 2 and e.label is None for e in v2)
    assert any(e.answers == [] for e in load_dataset("squad_v2"))  # unanswerable questions
    sq = load_dataset("squad", limit=5)
    for e in sq:
        a = e.answers[0]
        assert e.text[1][a["answer_start"] : a["answer_start"] + len(a["text"])] == a["text"]


def test_files_of_the_same_shape(tmp_path, monkeypatch):
    pairs = tmp_path / "qqp" / "dev.jsonl.gz"
    pairs.parent.mkdir()
    with gzip.open(pairs, "wt") as f:
        f.write(json.dumps({"id": "a", "question1": "why?", "question2": "how?", "label": 0}) + "\n")
        f.write(json.dumps({"id": "b", "question1": "what?", "question2": "what is?", "label": 1}) + "\n")
    monkeypatch.setenv("ATTNLENS_DATA", str(tmp_path))
    qqp = load_dataset("qqp")
    assert qqp.task == "pair" and [e.text for e in qqp] == [["why?", "how?"], ["what?", "what is?"]]
    assert qqp.labels == ["not_duplicate", "duplicate"]
    amazon = tmp_path / "reviews.jsonl"
    amazon.write_text(json.dumps({"title": "Great", "content": "works well", "label": 1}) + "\n")
    ds = load_dataset(str(amazon))
    assert ds[0].text == "Great. works well" and ds[0].label == 1
    squad = tmp_path / "mini.json"
    squad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "q1", "question": "Where?", "answers": [{"text": "France", "answer_start": 12}]}]}]}]}))
    qa = load_dataset(squad)
    assert qa.task == "qa" and qa[0].text == ["Where?", "Paris is in France."]


def test_data_folder_from_argument_or_environment(tmp_path, monkeypatch):
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "dev.jsonl").write_text(json.dumps({"text": "fine", "label": 1}) + "\n")
    monkeypatch.delenv("ATTNLENS_DATA", raising=False)
    assert data_root() is None
    with pytest.raises(InputError, match=r"^no data folder for sst2: pass --data-root DIR .* set \$ATTNLENS_DATA$"):
        load_dataset("sst2", hub=False)
    assert [e.text for e in load_dataset("sst2", root=tmp_path, hub=False)] == ["fine"]
    monkeypatch.setenv("ATTNLENS_DATA", str(tmp_path))
    assert data_root() == tmp_path and [e.label for e in load_dataset("sst2", hub=False)] == [1]


def test_errors(tmp_path):
    with pytest.raises(InputError, match="known datasets: " + ", ".join(known_datasets())):
        load_dataset("nonesuch")
    with pytest.raises(InputError, match="no local file for yelp_polarity/test"):
        load_dataset("yelp_polarity", root=tmp_path, hub=False)
    with pytest.raises(InputError, match="has no split"):
        load_dataset("sst2", "nosplit", root=tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"words": "x", "label": 1}\n')
    with pytest.raises(InputError, match="bad.jsonl:1"):
        load_dataset(bad)
    with pytest.raises(InputError, match="does not exist"):
        load_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(InputError, match="positive"):
        load_dataset("sst2", limit=0)


def test_options_and_rows_that_once_failed_inside_python(tmp_path, monkeypatch):
    """A limit that is not a whole number, an unknown task, a row with a null label beside its label name: one
    line each; a task given for a .json file is followed; ``~`` in ``root`` is the home folder."""
    rows = tmp_path / "rows.json"  # JSON Lines, named .json
    rows.write_text(json.dumps({"text": "good", "label": 1, "label_text": "positive"}) + "\n"
                    + json.dumps({"text": "unknown", "label": None, "label_text": "?"}) + "\n"
                    + json.dumps({"text": "bad", "label": 0, "label_text": "negative"}) + "\n")
    ds = load_dataset(rows, task="classification")
    assert [e.label for e in ds] == [1, None, 0] and ds.labels == ["negative", "positive"]
    with pytest.raises(InputError, match=r"^limit must be a positive whole number of examples, got 2\.5$"):
        load_dataset(rows, task="classification", limit=2.5)
    with pytest.raises(InputError, match=r"^task must be one of classification, pair, qa .* got 'pairs'$"):
        load_dataset(rows, task="pairs")
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "dev.jsonl").write_text(json.dumps({"text": "fine", "label": 1}) + "\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert [e.text for e in load_dataset("sst2", root="~", hub=False)] == ["fine"]
