"""Issue 9, methods and the shared pass: options written once, one rollout, the capture keeps what is asked."""

from __future__ import annotations

import inspect

import pytest

from attnlens.methods import get_method, list_methods, registry
from attnlens.methods.registry import ATTENTION, MethodOutput, register


def test_options_are_the_compute_signature_defaults():
    for name in list_methods():
        spec = get_method(name)
        params = list(inspect.signature(spec.compute).parameters.values())[1:]
        assert spec.options == {p.name: p.default for p in params}, name
    assert get_method("attcat").options == {"hidden": "input", "alpha": "mean"}
    assert get_method("transatt").options == {"start_layer": 0, "rules": "chefer", "epsilon": 0.0}


def test_option_without_default_is_refused_at_registration(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    def bad(ctx, alpha) -> MethodOutput:  # no default: the option would have no value
        raise AssertionError

    with pytest.raises(ValueError, match="option 'alpha' needs a default"):
        register("bad", needs={ATTENTION}, summary="", citation="")(bad)
    assert "bad" not in registry._REGISTRY
