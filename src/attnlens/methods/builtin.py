"""Imports every module that registers built-in methods (the order is the order of ``list_methods()``)."""

from importlib import import_module

from . import attention, cat, flow, gradient, lrp_methods  # noqa: F401

# the norm-based and decomposition family last (after the LRP methods), so earlier lists keep their order
import_module(f"{__package__}.decomposition")
