"""Exceptions raised for user mistakes; each carries a message that says what to change."""

from __future__ import annotations


class AttnLensError(Exception):
    """Base class for every error attnlens raises on purpose (bad input, unsupported model, ...)."""


class InputError(AttnLensError, ValueError):
    """Texts, targets or options that cannot be explained as given."""


class ModelError(AttnLensError, TypeError):
    """A model or tokenizer that attnlens cannot explain (wrong head, vocabulary mismatch, ...)."""


class MethodError(AttnLensError, RuntimeError):
    """A registered method (one of your own, :func:`attnlens.register`) failed, or returned scores that do not fit
    the batch it was given; the message names the method."""


class UnknownMethodError(InputError, KeyError):
    """A method id that is not in the registry."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


def exception_line(exc: BaseException) -> str:
    """A foreign exception in one line: its type and the first line of its message (the type alone without one),
    for the one-line errors that name what went wrong inside a model, a plugin or a method of one's own."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text.strip() else type(exc).__name__
