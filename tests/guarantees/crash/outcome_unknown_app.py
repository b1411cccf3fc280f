"""
A payments app whose provider call ends in ``OutcomeUnknown``, killed (SIGKILL) by itself
around it, for tests/guarantees/crash/test_outcome_unknown_kills.py; uvicorn serves it
in a subprocess.

``POST /payments`` charges the provider (a row in its ledger, committed on a connection
of its own: the provider is another system), then cannot tell whether the charge went
through and raises ``OutcomeUnknown``. In ``transactional`` mode (Starlette's
``Idempotent``, two commits) the endpoint first writes a ``pending`` payment row in the
request's transaction, which the raise rolls back; in ``middleware`` mode
(``IdempotencyMiddleware``) the endpoint is a plain route.

``OU_CRASH_AT`` names where the process SIGKILLs itself (unset: never):

- ``raised``: right after the handler raised, while idemflow acts on it (transactional:
  as the request's transaction rolls back; middleware: as the exception leaves the
  endpoint for the middleware);
- ``answer``: during the 503 ``outcome-unknown`` answer, its status line handed to the
  server, its body not.

Settings: ``OU_DATABASE_URL`` (PostgreSQL; the key table ``idemflow_keys``, the tables
``payments`` and ``ledger``), ``OU_MODE``. The store runs on the caller's clock, so the
test's sweeper can be moved past the stale threshold instead of waiting for it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response as StarletteResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from idemflow import AsyncAttempt, AsyncIdempotency, OutcomeUnknown, Policy, Response
from idemflow.integrations.starlette import IdempotencyMiddleware, Idempotent
from idemflow.stores.postgres import AsyncPostgresStore
from idemflow.transactions import AsyncPsycopgTransaction

URL = os.environ.get("OU_DATABASE_URL", "")
MODE = os.environ.get("OU_MODE", "transactional")
CRASH_AT = os.environ.get("OU_CRASH_AT")
POLICY = Policy(request_timeout=1)


def crash_point(point: str) -> None:
    """TEST-ONLY: SIGKILL this process if ``OU_CRASH_AT`` names ``point``."""
    if point == CRASH_AT:
        os.kill(os.getpid(), signal.SIGKILL)


def principal(scope: Scope) -> str | None:
    return "alice"


async def charge(key: str) -> None:
    """The provider's effect: committed at once, on a connection of its own."""
    async with await psycopg.AsyncConnection.connect(URL, autocommit=True) as provider:
        await provider.execute("INSERT INTO ledger (key) VALUES (%s)", (key,))


class CrashingTransaction(AsyncPsycopgTransaction):
    """The request's transaction; it dies as idemflow rolls it back after the raise."""

    async def rollback(self) -> None:
        crash_point("raised")
        await super().rollback()


def make_app() -> Any:
    store = AsyncPostgresStore(URL, max_size=4, clock="caller")
    idempotency = AsyncIdempotency(store, POLICY)

    async def healthz(request: Request) -> StarletteResponse:
        return StarletteResponse(b"ok")

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await store.pool.open(wait=True)
        yield
        await store.close()

    if MODE == "transactional":
        idempotent = Idempotent(
            idempotency,
            connect=store.pool.connection,
            transaction=CrashingTransaction,
            principal=principal,
        )

        async def pay(request: Request) -> StarletteResponse:
            key = request.headers["idempotency-key"]

            async def handler(attempt: AsyncAttempt) -> Response:
                await attempt.connection.execute(
                    "INSERT INTO payments (key, state) VALUES (%s, 'pending')", (key,)
                )
                await charge(key)
                raise OutcomeUnknown("the provider did not answer")

            return await idempotent.run(request, handler)

        routes = [Route("/payments", pay, methods=["POST"])]
        inner: Any = Starlette(routes=[*routes, Route("/healthz", healthz)], lifespan=lifespan)
        return _killed_during_503(inner)

    async def pay_plain(request: Request) -> StarletteResponse:
        await charge(request.headers["idempotency-key"])
        raise OutcomeUnknown("the provider did not answer")

    app = Starlette(
        routes=[Route("/payments", pay_plain, methods=["POST"]), Route("/healthz", healthz)],
        lifespan=lifespan,
    )
    protected = IdempotencyMiddleware(
        _killed_after_raise(app),
        idempotency=idempotency,
        endpoints=["POST /payments"],
        principal=principal,
    )
    return _killed_during_503(protected)


def _killed_after_raise(app: Any) -> Any:
    """Between the middleware and the endpoint: dies as the OutcomeUnknown passes."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await app(scope, receive, send)
        except OutcomeUnknown:
            crash_point("raised")
            raise

    return wrapped


def _killed_during_503(app: Any) -> Any:
    """Outside everything: dies once the 503's status line went to the server."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.start" and message["status"] == 503:
                crash_point("answer")

        await app(scope, receive, sending)

    return wrapped


app = make_app()
