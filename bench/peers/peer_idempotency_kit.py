"""
idempotency-kit 0.5.0: ``@async_idempotent`` on an ``AsyncIdempotencyCoordinator`` over
``RedisAsyncIdempotencyRepository``.

Not HTTP middleware: it makes a function idempotent, so the handler reads the
``Idempotency-Key`` header and calls a use case whose ``execute`` is decorated, as the
README's quick start does, with ``JsonResultAdapter`` and ``fingerprint_params`` naming
the parsed order. Defaults otherwise: 1 h TTL, ``in_flight="wait"`` (a concurrent
duplicate waits for the first result, up to the 30 s lease), ``on_storage_error="run"``
(a store outage runs the action unprotected). ``BENCH_PREFIX`` is the repository's key
prefix. Notable: only the function's return value is stored, so the handler rebuilds the
response (same 201 and body, no replay marker, headers are the handler's own); the
library raises rather than answering HTTP, and this app maps a key reused with another
body (``IdempotencyKeyReuseError``) to 422 and ``IdempotencyInProgressError`` to 409;
no key means no protection.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis.asyncio
from idempotency_kit import (
    AsyncIdempotencyCoordinator,
    IdempotencyDomainService,
    IdempotencyInProgressError,
    IdempotencyKeyReuseError,
    JsonResultAdapter,
    async_idempotent,
)
from idempotency_kit.infra.storage.redis.aio import RedisAsyncIdempotencyRepository
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from bench._thing import create, health, thing

URL = os.environ.get("BENCH_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_PREFIX", "bench:")


class CreateThing:
    def __init__(self, coordinator: AsyncIdempotencyCoordinator) -> None:
        self.coordinator = coordinator

    @async_idempotent(
        operation="things.create", adapter=JsonResultAdapter(), fingerprint_params=("order",)
    )
    async def execute(
        self, order: dict[str, Any], idempotency_key: str | None = None
    ) -> dict[str, Any]:
        return thing(order)


use_case = CreateThing(
    AsyncIdempotencyCoordinator(
        repository=RedisAsyncIdempotencyRepository(
            redis.asyncio.Redis.from_url(URL), key_prefix=PREFIX
        ),
        domain_service=IdempotencyDomainService(),
    )
)


async def create_idempotent(request: Request) -> JSONResponse:
    order = json.loads(await request.body())
    key = request.headers.get("Idempotency-Key")
    try:
        result = await use_case.execute(order, idempotency_key=key)
    except IdempotencyKeyReuseError:
        return JSONResponse({"detail": "key reused with another request"}, status_code=422)
    except IdempotencyInProgressError:
        return JSONResponse({"detail": "request in progress"}, status_code=409)
    return JSONResponse(result, status_code=201)


app = Starlette(
    routes=[
        Route("/", health),
        Route("/things", create_idempotent, methods=["POST"]),
        Route("/plain/things", create, methods=["POST"]),
    ]
)
