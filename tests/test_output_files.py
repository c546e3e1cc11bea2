"""Files attnlens writes appear whole or not at all: an interruption (Ctrl-C) leaves what was there before."""

from __future__ import annotations

import os
import stat

import pytest

from attnlens.errors import InputError
from attnlens.paths import atomic_directory, atomic_output, atomic_write_text


def test_a_write_cut_off_leaves_the_earlier_file_and_nothing_else(tmp_path):
    out = tmp_path / "sub" / "out.json"
    atomic_write_text(out, "first\n")
    with pytest.raises(KeyboardInterrupt), atomic_output(out) as tmp:
        tmp.write_text("half of the sec", encoding="utf-8")
        raise KeyboardInterrupt
    assert out.read_text(encoding="utf-8") == "first\n"
    assert os.listdir(out.parent) == ["out.json"]


def test_a_finished_write_replaces_the_file_with_the_usual_mode(tmp_path):
    out = tmp_path / "out.txt"
    out.write_text("old", encoding="utf-8")
    assert atomic_write_text(out, "new") == out
    assert out.read_text(encoding="utf-8") == "new" and os.listdir(tmp_path) == ["out.txt"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # not the temporary file's private 0600


def test_a_folder_save_moves_in_whole_or_leaves_the_folder_as_it_was(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "metrics.json").write_text("old metrics", encoding="utf-8")
    (out / "keep.txt").write_text("the user's", encoding="utf-8")
    with pytest.raises(KeyboardInterrupt), atomic_directory(out, last="metrics.json") as staging:
        (staging / "weights.bin").write_bytes(b"1234")
        raise KeyboardInterrupt
    assert sorted(os.listdir(out)) == ["keep.txt", "metrics.json"] and os.listdir(tmp_path) == ["model"]
    with atomic_directory(out, last="metrics.json") as staging:
        (staging / "weights.bin").write_bytes(b"1234")
        (staging / "metrics.json").write_text("new metrics", encoding="utf-8")
    assert sorted(os.listdir(out)) == ["keep.txt", "metrics.json", "weights.bin"]
    assert (out / "metrics.json").read_text(encoding="utf-8") == "new metrics"
    assert os.listdir(tmp_path) == ["model"]


def test_a_save_under_a_file_is_one_clear_error(tmp_path):
    """A part of the way that is a file: one line naming it, not the operating system's error."""
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    for save in (lambda p: atomic_write_text(p, "y"), lambda p: atomic_directory(p).__enter__()):
        with pytest.raises(InputError, match=f"{afile} is a file, not a directory"):
            save(afile / "sub" / "out.json")
    assert afile.read_text() == "x"
