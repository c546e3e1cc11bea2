"""Half-precision models: the decomposition products stay finite, and scores that are not finite are said."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import MODELS, missing

from attnlens import Explainer
from attnlens.core import engine


def test_globenc_on_a_float16_model_stays_finite_and_matches_float32():
    """GlobEnc's unnormalised product over a post-LN encoder's layers reaches 1e6 on MiniLM: beyond float16."""
    path = MODELS / "minilm-sst2"
    if not path.is_dir():
        missing(f"reference model not found at {path}")
    (half,) = Explainer.from_pretrained(path, dtype="float16").explain(["a dull plot"], methods=["globenc"])
    (full,) = Explainer.from_pretrained(path).explain(["a dull plot"], methods=["globenc"])
    assert np.isfinite(half.scores["globenc"]).all() and np.isfinite(half.layers["globenc"]).all()
    assert full.scores["globenc"].max() > 1e5  # past float16's largest number, 65,504
    np.testing.assert_allclose(half.scores["globenc"], full.scores["globenc"], rtol=2e-2)


def test_scores_that_are_not_finite_are_warned_about():
    from types import SimpleNamespace

    runner = SimpleNamespace(model=torch.nn.Linear(2, 2).half())
    with pytest.warns(UserWarning, match=r"globenc: 1 of its scores are not finite .* float16 model"):
        engine._warn_if_not_finite("globenc", torch.tensor([[1.0, float("inf")]]), runner)
