"""The HTTP routes (docs/serve.md): the page, its static files, and the JSON API.

Synchronous routes (``POST /api/explain`` ...) answer with the result itself, as scripts want it; the page uses
``/api/jobs`` to follow progress and cancel. Every mistake is a JSON ``{"error": one line}`` with a 4xx status.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import InputError
from .jobs import CANCELLED, DONE, Job
from .state import ServeState

STATIC = Path(__file__).parent / "static"
NON_FINITE = "$float"  # {"$float": "NaN" | "Infinity" | "-Infinity"}: a number JSON cannot write


class ResultResponse(JSONResponse):
    """JSON where each number that is not finite (a NaN score, an overflowed one) is written as
    ``{"$float": "NaN"}``, ``"Infinity"`` or ``"-Infinity"``: JSON has no such numbers, and a score must not be
    dropped or turned into another number. The page reads them back as numbers."""

    def render(self, content: Any) -> bytes:
        try:
            text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except ValueError:  # some number is not finite: only then is the result walked
            text = json.dumps(_marked(content), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")


def _marked(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {NON_FINITE: "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}
    if isinstance(value, dict):
        return {k: _marked(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_marked(v) for v in value]
    return value


def error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": " ".join(str(message).split())}, status_code=status)


def _state(request: Request) -> ServeState:
    return request.app.state.serve


async def read_json(request: Request) -> Any:
    """The request's JSON body, refused past the size limit (``413``) or when it is not JSON (``400``)."""
    limit = _state(request).limits.max_body
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise BodyTooLarge(limit)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise InputError("the request body is not valid JSON") from None


class BodyTooLarge(Exception):
    """A request body over the server's limit (answered with 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than this server takes ({limit} bytes)")


async def _answer(job: Job) -> Response:
    """Wait for ``job`` and answer with its result (or its one-line error)."""
    if job.future is not None and not job.finished:
        try:
            await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            if not job.future.cancelled():
                raise  # the client went away
    if job.state == DONE:
        return ResultResponse(job.result)
    if job.state == CANCELLED:
        return error("the computation was cancelled", 409)
    return error(job.error or "the computation failed", job.status)


def _sync(kind: str):
    async def handler(request: Request) -> Response:
        body = await read_json(request)
        return await _answer(_state(request).submit(kind, body))

    handler.__name__ = f"{kind}_route"
    return handler


async def index(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")


async def models(request: Request) -> Response:
    state = _state(request)
    return JSONResponse({"models": list(state.facts.values()), "limits": vars(state.limits),
                         "benchmarks": bool(state.results)})


async def submit_job(request: Request) -> Response:
    body = await read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("request"), dict):
        raise InputError('a job is {"kind": "explain" | "faithfulness" | "attention" | "generate" | "answer" | '
                         '"attribute", "request": {...}}')
    state = _state(request)
    job = state.submit(str(body.get("kind")), body["request"])
    return ResultResponse(job.to_dict(state.jobs.position(job)), status_code=200 if job.finished else 202)


def _job(request: Request) -> Job:
    job = _state(request).jobs.get(request.path_params["job_id"])
    if job is None:
        raise LookupError("no such job (finished jobs are kept for a while, then forgotten)")
    return job


async def job_status(request: Request) -> Response:
    job = _job(request)
    return ResultResponse(job.to_dict(_state(request).jobs.position(job)))


async def cancel_job(request: Request) -> Response:
    job = _job(request)
    _state(request).jobs.cancel(job)
    return JSONResponse(job.to_dict(_state(request).jobs.position(job), with_result=False))


async def benchmarks(request: Request) -> Response:
    out = []
    for name, folder in _state(request).benchmarks().items():
        try:
            summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            summary = {}
        summary = summary if isinstance(summary, dict) else {}
        out.append({"name": name, "model": summary.get("model"), "dataset": summary.get("dataset"),
                    "n_examples": summary.get("n_examples")})
    return JSONResponse({"results": out})


async def benchmark(request: Request) -> Response:
    return JSONResponse(_state(request).benchmark(request.path_params["name"]))


ROUTES = [
    Route("/", index),
    Route("/api/models", models),
    Route("/api/explain", _sync("explain"), methods=["POST"]),
    Route("/api/faithfulness", _sync("faithfulness"), methods=["POST"]),
    Route("/api/attention", _sync("attention"), methods=["POST"]),
    Route("/api/generate", _sync("generate"), methods=["POST"]),
    Route("/api/answer", _sync("answer"), methods=["POST"]),
    Route("/api/attribute", _sync("attribute"), methods=["POST"]),
    Route("/api/jobs", submit_job, methods=["POST"]),
    Route("/api/jobs/{job_id}", job_status, methods=["GET"]),
    Route("/api/jobs/{job_id}", cancel_job, methods=["DELETE"]),
    Route("/api/benchmarks", benchmarks),
    Route("/api/benchmarks/{name:path}", benchmark),
    Mount("/static", StaticFiles(directory=STATIC), name="static"),
]
