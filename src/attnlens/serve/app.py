"""The ASGI application of ``attnlens serve`` (Starlette; ``uvicorn`` serves it)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..core.memory import parse_budget
from ..errors import AttnLensError
from .requests import Limits
from .routes import ROUTES, BodyTooLarge, error
from .state import ServeState

# Everything the page loads comes from this server; no inline script, no framing, no third party.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + SECURITY_HEADERS
            await send(message)

        await self.app(scope, receive, with_headers)


class AllowedHosts:
    """Answers only requests whose ``Host`` header names one of ``hosts`` (the port aside): a web page elsewhere
    cannot reach a locally bound server through a name of its own that resolves to this machine (DNS rebinding).
    Other requests get the one-line JSON error every refusal of the server gives."""

    def __init__(self, app: ASGIApp, hosts: Sequence[str]) -> None:
        self.app, self.hosts = app, {h.lower() for h in hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = Headers(scope=scope).get("host", "").lower()
        name = host[: host.index("]") + 1] if host.startswith("[") and "]" in host else host.split(":")[0]
        if name in self.hosts:
            await self.app(scope, receive, send)
            return
        response = error(f"this server answers requests to {', '.join(sorted(self.hosts))} only, not "
                         f"{host or 'a request without a Host header'}", 400)
        await response(scope, receive, send)


async def _user_error(request: Request, exc: Exception) -> JSONResponse:
    return error(str(exc), 400)


async def _too_large(request: Request, exc: Exception) -> JSONResponse:
    return error(str(exc), 413)


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    return error(f"not found: {exc.args[0] if exc.args else request.url.path}"[:200], 404)


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return error(exc.detail or "request refused", exc.status_code)


async def _fault(request: Request, exc: Exception) -> JSONResponse:
    return error(f"internal error: {type(exc).__name__}", 500)


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    yield
    app.state.serve.jobs.shutdown()  # running computations stop at their next progress report


def create_app(
    explainers: Mapping[str, Any],
    *,
    results: Sequence[Path] = (),
    limits: Limits | None = None,
    allowed_hosts: Sequence[str] | None = None,
    memory_budget: str | int | None = None,
) -> Starlette:
    """The server's ASGI app.

    Args:
        explainers: model name -> loaded :class:`~attnlens.Explainer`; the page and the API choose among these
            names only.
        results: folders holding ``attnlens benchmark`` results (one results folder, or folders of them).
        limits: per-request limits (text length, texts per request, generated tokens, body size).
        allowed_hosts: the ``Host`` headers answered (the CLI passes the local names when it binds locally, which
            stops DNS-rebinding pages from reaching the API); ``None`` answers any.
        memory_budget: what each computation plans for (e.g. ``"4GB"``; default 4 GiB): the server runs one at a
            time, whatever its model, and its cache of results holds at most as much again (1 GiB at most).
    """
    state = ServeState(explainers, list(results), limits or Limits(), parse_budget(memory_budget))
    middleware = [Middleware(SecurityHeaders)]
    if allowed_hosts is not None:
        middleware.append(Middleware(AllowedHosts, hosts=list(allowed_hosts)))
    app = Starlette(
        routes=ROUTES, middleware=middleware,
        exception_handlers={AttnLensError: _user_error, BodyTooLarge: _too_large, LookupError: _not_found,
                            HTTPException: _http, Exception: _fault},
        lifespan=_lifespan,
    )
    app.state.serve = state
    return app
