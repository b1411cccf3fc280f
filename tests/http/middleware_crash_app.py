"""
A middleware-mode app for the crash test: uvicorn serves it in a subprocess.

``POST /things`` writes a business row in its own SQLite file (committed at
once: middleware mode shares no transaction with the key record), then waits
for ``slow_seconds`` so the test can SIGKILL the server mid-handler. Settings
come from the environment: ``CRASH_APP_DIR`` (the files),
``CRASH_APP_TIMEOUT`` (the request timeout, 1 s), ``CRASH_APP_SWEEP`` (run a
background sweeper: ``default`` for the library's interval, or seconds).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idemflow import AsyncIdempotency, Policy
from idemflow.integrations.starlette import IdempotencyMiddleware
from idemflow.stores.sqlite import AsyncSQLiteStore
from idemflow.sweeper import AsyncSweeper, start_background_sweeper

DIRECTORY = Path(os.environ.get("CRASH_APP_DIR", "."))
POLICY = Policy(request_timeout=float(os.environ.get("CRASH_APP_TIMEOUT", "1")))  # 1 s: stale at 12
SWEEP = os.environ.get("CRASH_APP_SWEEP")  # None: no sweeper in the app


class HeaderUser(AuthenticationBackend):
    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser]:
        return AuthCredentials(["authenticated"]), SimpleUser(conn.headers.get("x-user", "alice"))


async def create(request: Request) -> JSONResponse:
    key = request.headers["idempotency-key"]
    with sqlite3.connect(DIRECTORY / "business.db") as conn:
        conn.execute("INSERT INTO things (key) VALUES (?)", (key,))
    await asyncio.sleep(float(request.headers.get("x-slow", "0")))
    return JSONResponse({"key": key}, status_code=201)


def make_app() -> Starlette:
    with sqlite3.connect(DIRECTORY / "business.db") as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS things (key TEXT)")
    store = AsyncSQLiteStore(DIRECTORY / "keys.db")
    store.sync.migrate()
    idempotency = AsyncIdempotency(store, POLICY)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if SWEEP is None:
            yield
            return
        every = None if SWEEP == "default" else float(SWEEP)
        async with start_background_sweeper(AsyncSweeper(store, POLICY), every=every):
            yield

    return Starlette(
        lifespan=lifespan,
        routes=[Route("/things", create, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=HeaderUser()),
            Middleware(IdempotencyMiddleware, idempotency=idempotency, endpoints=["POST /things"]),
        ],
    )


app = make_app()
