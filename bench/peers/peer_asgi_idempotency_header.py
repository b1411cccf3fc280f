"""
asgi-idempotency-header 0.2.0 (snok): ``IdempotencyHeaderMiddleware`` on its ``RedisBackend``.

A pure ASGI middleware; here it wraps the ``/things`` route only, with the package's
defaults (``Idempotency-Key``, ``POST``/``PATCH``, 24 h expiry, set on the backend).
``BENCH_PREFIX`` prefixes both Redis names the backend takes (its in-flight key set
and its response keys). Notable: no request fingerprint (a key reused with another body
gets the first response back), only JSON bodies are stored and replayed (as
``JSONResponse``, so headers other than the content ones are not replayed) and a replay
adds ``Idempotent-Replayed: true``; every status is stored, 5xx included. The in-flight
set is one Redis set without expiry that a completed key is never removed from; a
concurrent duplicate gets 409, and so, for good, do the retries of a key whose handler
raised. The package pins ``fastapi<0.71`` (its Redis backend imports
``fastapi.responses``), hence Starlette 0.16 and pydantic 1.
"""

from __future__ import annotations

import os

import redis.asyncio
from idempotency_header_middleware import IdempotencyHeaderMiddleware
from idempotency_header_middleware.backends import RedisBackend
from starlette.applications import Starlette
from starlette.routing import Route, request_response

from bench._thing import create, health

URL = os.environ.get("BENCH_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_PREFIX", "bench:")


def make_app() -> Starlette:
    backend = RedisBackend(
        redis=redis.asyncio.Redis.from_url(URL),
        keys_key=f"{PREFIX}idempotency-key-keys",
        response_key=f"{PREFIX}idempotency-key-responses",
    )
    protected = IdempotencyHeaderMiddleware(request_response(create), backend=backend)
    return Starlette(
        routes=[
            Route("/", health),
            Route("/things", protected, methods=["POST"]),
            Route("/plain/things", create, methods=["POST"]),
        ]
    )


app = make_app()
