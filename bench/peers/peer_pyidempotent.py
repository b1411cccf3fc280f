"""
pyidempotent 0.1.0: the ``@idempotent`` decorator on a FastAPI endpoint, ``RedisBackend``.

Set up as the README's FastAPI example: the decorator under ``@app.post``, 24 h TTL,
``Idempotency-Key``, ``RedisBackend(redis.from_url(…), prefix=…)`` with ``BENCH_PREFIX``
as the prefix. It claims the key with ``SET NX EX`` after a ``GET``, runs the endpoint
and stores its return value (the dict, not the response); the fingerprint is a SHA-256
of the endpoint's arguments other than the ``Request``, here the parsed JSON body.
Notable: the replay is FastAPI serialising the stored dict again, so status (the
route's 201), body and headers equal the first, with no replay marker; a key in flight
is waited on (polled every 100 ms, up to 10 s). The package answers nothing itself: it
raises, and this app maps ``IdempotencyConflict`` (same key, other body) to 422,
``IdempotencyProcessing`` to 409 and ``IdempotencyKeyMissing`` (a key is mandatory) to
400.
"""

from __future__ import annotations

import os
from typing import Any

import redis.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pyidempotent import (
    IdempotencyConflict,
    IdempotencyKeyMissing,
    IdempotencyProcessing,
    idempotent,
)
from pyidempotent.backends.redis import RedisBackend

from bench._thing import thing

URL = os.environ.get("BENCH_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_PREFIX", "bench:")

app = FastAPI()
backend = RedisBackend(redis.asyncio.from_url(URL), prefix=PREFIX)

ERRORS: dict[type[Exception], tuple[int, str]] = {
    IdempotencyConflict: (422, "Idempotency-Key already used with different payload"),
    IdempotencyProcessing: (409, "A request with this Idempotency-Key is in progress"),
    IdempotencyKeyMissing: (400, "Idempotency-Key header is required"),
}


async def idempotency_error(request: Request, exc: Exception) -> JSONResponse:
    status, detail = ERRORS[type(exc)]
    return JSONResponse({"detail": detail}, status_code=status)


for error in ERRORS:
    app.add_exception_handler(error, idempotency_error)


@app.get("/", response_class=PlainTextResponse)
async def health() -> str:
    return "ok"


@app.post("/things", status_code=201, response_model=None)
@idempotent(backend=backend, ttl=24 * 3600, key_header="Idempotency-Key")
async def create(request: Request, order: dict[str, Any]) -> dict[str, Any]:
    return thing(order)


@app.post("/plain/things", status_code=201, response_model=None)
async def create_plain(order: dict[str, Any]) -> dict[str, Any]:
    return thing(order)
