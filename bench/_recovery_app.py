"""
The app ``bench/bench_recovery.py`` crashes: middleware mode, SQLite, a background sweeper.

``POST /things`` writes a business row (committed at once: middleware mode)
and then waits ``X-Slow`` seconds, so the benchmark can SIGKILL the server
mid-handler. Settings come from the environment: ``RECOVERY_DIR`` (the files),
``RECOVERY_TIMEOUT`` (the request timeout, seconds), ``RECOVERY_SWEEP`` (set:
run a background sweeper at the library's default interval). It uses only the
public API that existed before ``Retry-After`` was derived, so the same app
measures an older checkout too.
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

DIRECTORY = Path(os.environ.get("RECOVERY_DIR", "."))
POLICY = Policy(request_timeout=float(os.environ.get("RECOVERY_TIMEOUT", "10")))


class User(AuthenticationBackend):
    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser]:
        return AuthCredentials(["authenticated"]), SimpleUser("alice")


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

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if "RECOVERY_SWEEP" not in os.environ:
            yield
            return
        async with start_background_sweeper(AsyncSweeper(store, POLICY)):
            yield

    return Starlette(
        lifespan=lifespan,
        routes=[Route("/things", create, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=User()),
            Middleware(
                IdempotencyMiddleware,
                idempotency=AsyncIdempotency(store, POLICY),
                endpoints=["POST /things"],
            ),
        ],
    )


app = make_app()
