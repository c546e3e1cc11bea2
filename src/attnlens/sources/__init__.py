"""Which part of the context did an answer come from: sources, their attribution, ablations and AT2."""

from . import at2, gates  # noqa: F401  (register the at2 and attngate source methods)
from .attribute import DEFAULT_METHODS, attribute_context
from .methods import SOURCE_METHODS
from .segment import split_sources

__all__ = ["DEFAULT_METHODS", "SOURCE_METHODS", "attribute_context", "split_sources"]
