"""
idemkit 1.0.2 on PostgreSQL: its ASGI ``IdempotencyMiddleware`` with ``PostgresBackend``.

The backend is ``PostgresBackend.from_url(BENCH_URL, table=...)`` (asyncpg pool of idemkit's
default 4 to 20 connections; the first in-flight wait takes one for ``LISTEN``); the table is
named from ``BENCH_PREFIX`` and created at startup with ``init_pg`` (what ``idemkit init-pg``
runs). The ``pg_notify`` channel ``idemkit_completions`` is fixed (payloads name the key, so
runs do not mix). The middleware wraps only the ``POST /things`` route, single-tenant (no
``scope``), with ``HttpConfig`` defaults otherwise: the body is fingerprinted (a mismatch is 422
``application/problem+json``), 200/201/202 are stored, a replay answers the stored status and
body with only allow-listed headers (``content-type`` here) plus ``idempotency-replayed: true``
— ``content-length`` is not on the default allow list, so it is added to ``header_allow`` for
the replay not to be chunked. A request without a key passes through unprotected.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from idemkit import HttpConfig, IdempotencyMiddleware, PostgresBackend
from idemkit.backends.postgres import init_pg
from idemkit.core.config import DEFAULT_HEADER_ALLOW
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from bench._thing import create, health

URL = os.environ.get("BENCH_URL", "postgresql://postgres@127.0.0.1:5432/test")
TABLE = re.sub(r"\W", "_", os.environ.get("BENCH_PREFIX", "bench_")) + "idemkit"


def make_app() -> Starlette:
    backend = PostgresBackend.from_url(URL, table=TABLE)
    config = HttpConfig(
        scope_mode="single_tenant",
        header_allow={*DEFAULT_HEADER_ALLOW, "content-length"},
    )

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await init_pg(URL, table=TABLE)
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
