"""Whether the HuggingFace hub can be reached, so that a hub id is loaded from the local cache at once when it
cannot (huggingface_hub would retry its requests for about 30 seconds before giving up)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):
        return False
    return True


def _hub_host() -> str | None:
    """The host of the hub huggingface_hub talks to (``HF_ENDPOINT``, by default huggingface.co)."""
    from huggingface_hub import constants

    return urlparse(constants.ENDPOINT).hostname


def hub_unreachable() -> str | None:
    """The hub's host when its name does not resolve here (no network, as on an offline machine), else ``None``.
    Behind a proxy (whose address the environment names) the proxy resolves it: ``None``."""
    if any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    host = _hub_host()
    return host if host and not _resolves(host) else None


def cache_only(name: str) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments for model ``name``: ``local_files_only=True`` for a hub id when the hub
    cannot be reached (it is then loaded from the local cache, or refused at once), none otherwise."""
    if Path(name).expanduser().exists() or hub_unreachable() is None:
        return {}
    return {"local_files_only": True}


def not_cached_message(name: str) -> str:
    """The one line for a hub id that the unreachable hub would have to provide."""
    return (f"could not load model {name!r}: the HuggingFace hub ({_hub_host()}) cannot be reached from here "
            "and the model is not in the local cache; give a local model directory, or connect and retry")
