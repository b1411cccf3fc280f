"""
idemkit 1.0.2: its ASGI ``IdempotencyMiddleware`` on ``PostgresBackend`` or ``RedisBackend``.

``BENCH_STORE`` picks the backend. PostgreSQL: ``PostgresBackend.from_url(BENCH_URL,
table=…)`` (an asyncpg pool of idemkit's default 4 to 20 connections; the first in-flight
wait takes one for ``LISTEN``), its table created at startup with ``init_pg`` (what
``idemkit init-pg`` runs) in the bench's schema; the ``pg_notify`` channel
``idemkit_completions`` is fixed (payloads name the key, so runs do not mix). Redis:
``RedisBackend.from_url(BENCH_URL, namespace=…)`` (redis-py's asyncio client, one Lua
script each for the claim and the completion, a Pub/Sub subscriber for in-flight waits),
the namespace from ``BENCH_PREFIX`` prefixing every key and the channel. The middleware
wraps only the ``POST /things`` route, single-tenant (no ``scope``), with ``HttpConfig``
defaults otherwise: the body is fingerprinted (a mismatch is 422
``application/problem+json``), 200/201/202 are stored, a duplicate in flight waits for the
first one's result, a replay answers the stored status and body with only allow-listed
headers (``content-type`` here) plus ``idempotency-replayed: true`` — ``content-length`` is
not on the default allow list, so it is added to ``header_allow`` for the replay not to be
chunked. The response is passed through to the client as the handler sends it and stored
after (``on_complete`` follows the last body message). A request without a key passes
through unprotected.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from idemkit import HttpConfig, IdempotencyMiddleware, PostgresBackend, RedisBackend
from idemkit.backends.postgres import init_pg
from idemkit.core.config import DEFAULT_HEADER_ALLOW
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from bench._thing import create, health

STORE = os.environ.get("BENCH_STORE", "redis")
URL = os.environ.get("BENCH_URL", "redis://127.0.0.1:6379/0")
TABLE = "bench_idemkit"  # in the bench's own schema (BENCH_URL's search_path)


def backend() -> Any:
    if STORE == "postgres":
        return PostgresBackend.from_url(URL, table=TABLE)
    return RedisBackend.from_url(
        URL, namespace=os.environ.get("BENCH_PREFIX", "bench:").rstrip(":")
    )


def make_app() -> Starlette:
    store = backend()
    config = HttpConfig(
        scope_mode="single_tenant",
        header_allow={*DEFAULT_HEADER_ALLOW, "content-length"},
    )

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if STORE == "postgres":
            await init_pg(URL, table=TABLE)
        try:
            yield
        finally:
            await store.aclose()  # the route-level middleware never sees the lifespan

    protect = Middleware(IdempotencyMiddleware, backend=store, config=config)
    return Starlette(
        lifespan=lifespan,
        routes=[
            Route("/", health),
            Route("/things", create, methods=["POST"], middleware=[protect]),
            Route("/plain/things", create, methods=["POST"]),
        ],
    )


app = make_app()
