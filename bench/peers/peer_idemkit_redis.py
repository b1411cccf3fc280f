"""
idemkit 1.0.2 on Redis: its ASGI ``IdempotencyMiddleware`` with ``RedisBackend``.

The backend is ``RedisBackend.from_url(BENCH_URL, namespace=...)`` (redis-py asyncio client,
Lua scripts for claim and complete, a Pub/Sub subscriber for in-flight waits); the namespace,
from ``BENCH_PREFIX``, prefixes every key and the Pub/Sub channel. The middleware wraps only the
``POST /things`` route, single-tenant (no ``scope``), with ``HttpConfig`` defaults otherwise:
the body is fingerprinted (a mismatch is 422 ``application/problem+json``), 200/201/202 are
stored, a replay answers the stored status and body with only allow-listed headers
(``content-type`` here) plus ``idempotency-replayed: true`` — ``content-length`` is not on the
default allow list, so it is added to ``header_allow`` for the replay not to be chunked. A
request without a key passes through unprotected.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from idemkit import HttpConfig, IdempotencyMiddleware, RedisBackend
from idemkit.core.config import DEFAULT_HEADER_ALLOW
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from bench._thing import create, health

URL = os.environ.get("BENCH_URL", "redis://127.0.0.1:6379/0")
NAMESPACE = os.environ.get("BENCH_PREFIX", "bench:").rstrip(":")


def make_app() -> Starlette:
    backend = RedisBackend.from_url(URL, namespace=NAMESPACE)
    config = HttpConfig(
        scope_mode="single_tenant",
        header_allow={*DEFAULT_HEADER_ALLOW, "content-length"},
    )

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await backend.aclose()  # the route-level middleware never sees the lifespan

    protect = Middleware(IdempotencyMiddleware, backend=backend, config=config)
    return Starlette(
        lifespan=lifespan,
        routes=[
            Route("/", health),
            Route("/things", create, methods=["POST"], middleware=[protect]),
            Route("/plain/things", create, methods=["POST"]),
        ],
    )


app = make_app()
