"""Keeping third-party chatter out of the user's output while attnlens works."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

# Libraries whose deprecation notices address the code calling them (attnlens), not the user of attnlens: e.g.
# transformers' "`past_key_values` is deprecated ... Use `cache` instead" on every cached generation step.
THIRD_PARTY = ("transformers", "torch", "captum", "accelerate", "huggingface_hub", "tokenizers")
_DEPRECATIONS = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars and load reports while loading: attnlens checks what they report
    (newly initialised weights) itself and turns it into an error or one line of its own. Third-party deprecation
    notices are filtered as in :func:`quiet_third_party`."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    with quiet_third_party():
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if bar:
                hf_logging.enable_progress_bar()


@contextmanager
def transformers_log_errors_only() -> Iterator[None]:
    """transformers' logger prints errors only (its ``warning_once`` notices about arguments attnlens passes,
    ``[transformers] ... are deprecated``, are not the user's business); its verbosity is restored after."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


@contextmanager
def quiet_third_party() -> Iterator[None]:
    """While attnlens runs a model: deprecation warnings raised inside the libraries of :data:`THIRD_PARTY` are
    filtered, and transformers logs errors only. Warnings of attnlens itself and the user's code pass, as do the
    libraries' other warnings (a ``UserWarning`` may concern the user's model or inputs)."""
    with warnings.catch_warnings(), transformers_log_errors_only():
        for library in THIRD_PARTY:
            for category in _DEPRECATIONS:
                warnings.filterwarnings("ignore", category=category, module=rf"{library}(\.|$)")
        yield
