"""Explanation methods, keyed by id in one registry (:mod:`attnlens.methods.registry`).

Importing this package registers the built-in methods: the order of the modules below is the order of
``list_methods()``. The method modules import only the registry, never this package, so there is no cycle.
"""

# The built-in methods, in their documented order (each module registers its methods on import).
from . import attention, cat, flow, gradient, lrp_methods, valuezeroing  # noqa: F401
from .registry import Method, MethodOutput, get_method, list_methods, register, resolve_methods

__all__ = ["Method", "MethodOutput", "get_method", "list_methods", "register", "resolve_methods"]
