"""Imports every module that registers built-in methods (the order is the order of ``list_methods()``)."""

from . import attention, cat, decomposition, flow, gradient, lrp_methods  # noqa: F401
