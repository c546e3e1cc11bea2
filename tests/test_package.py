"""The installed package as a user meets it: what ``import attnlens`` gives and what it costs."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import attnlens

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_imports_and_has_a_docstring():
    for name in attnlens.__all__:
        obj = getattr(attnlens, name)
        assert (obj.__doc__ or "").strip(), name
    assert {"ContextAttribution", "load_attributions", "save_attributions"} <= set(attnlens.__all__)


def test_import_leaves_captum_and_pyplot_for_the_methods_that_use_them():
    code = "import sys, attnlens; print(sorted(m for m in ('captum', 'matplotlib.pyplot') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_source_distribution_carries_what_its_tests_need(tmp_path):
    pytest.importorskip("build")
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)],
                   capture_output=True, check=True)
    (archive,) = tmp_path.glob("attnlens-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    tracked = subprocess.run(["git", "ls-files", "tests", "docs"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked and set(tracked) <= names
    assert {"CHANGELOG.md", "mkdocs.yml", "LICENSE"} <= names
    assert not [n for n in names if "__pycache__" in n]
