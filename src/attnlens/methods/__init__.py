"""Explanation methods, keyed by id in one registry (:mod:`attnlens.methods.registry`).

Importing this package registers the built-in methods: the order of the modules below is the order of
``list_methods()``. The method modules import only the registry, never this package, so there is no cycle.
"""

from importlib import import_module

from .registry import Method, MethodOutput, check_option_owners, get_method, list_methods, register, resolve_methods

# The built-in method modules, in their documented order (each registers its methods on import).
BUILTIN_MODULES = ("attention", "cat", "flow", "gradient", "lrp_methods", "decomposition", "valuezeroing",
                   "perturbation")
for _module in BUILTIN_MODULES:
    import_module(f"{__name__}.{_module}")

__all__ = ["Method", "MethodOutput", "check_option_owners", "get_method", "list_methods", "register", "resolve_methods"]
