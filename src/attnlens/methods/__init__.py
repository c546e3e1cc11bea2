"""Explanation methods, keyed by id in one registry."""

from . import builtin  # noqa: F401  (registers the built-in methods in their documented order)
from .registry import Method, MethodOutput, get_method, list_methods, register, resolve_methods

__all__ = ["Method", "MethodOutput", "get_method", "list_methods", "register", "resolve_methods"]
