"""
fastapi-idempotency-key 0.1.1: ``IdempotencyMiddleware`` on its ``RedisBackend``.

A pure ASGI middleware (Starlette only, no FastAPI needed); here it is route middleware
on ``/things`` with the README's production settings: ``RedisBackend(redis_url=…,
prefix=…)``, 24 h TTL, ``Idempotency-Key``. ``BENCH_PREFIX`` is the backend's key
prefix. It claims the key with a Lua ``GET``/``SET``, captures status, headers and body
and stores them after the response has been sent, replaying them with
``Idempotency-Replayed: true``; a key in flight gets 409, 5xx and exceptions release the
key. Notable: the Redis backend stores the completed record with an empty fingerprint,
so every retry of a completed key fails the fingerprint check and gets 422 instead of
the replay (the memory backend keeps the fingerprint and replays).
"""

from __future__ import annotations

import os

from fastapi_idempotency_key import IdempotencyMiddleware, RedisBackend
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from bench._thing import create, health

URL = os.environ.get("BENCH_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_PREFIX", "bench:")


def make_app() -> Starlette:
    backend = RedisBackend(redis_url=URL, prefix=PREFIX)
    idempotency = Middleware(
        IdempotencyMiddleware,
        backend=backend,
        header_name="Idempotency-Key",
        default_ttl=86400,
    )
    return Starlette(
        routes=[
            Route("/", health),
            Route("/things", create, methods=["POST"], middleware=[idempotency]),
            Route("/plain/things", create, methods=["POST"]),
        ]
    )


app = make_app()
