"""
The minimal endpoint ``bench/bench_middleware.py`` serves: middleware mode on one store.

``POST /things`` (protected by ``IdempotencyMiddleware``) and ``POST /plain/things``
(the same endpoint, not opted in) parse the JSON body and answer 201 with a
small JSON object (``bench/_thing.py``, as every peer's app in ``bench/peers/``):
no business write, so what protection costs is all there is to see. Settings
from the environment: ``BENCH_STORE`` (``sqlite``, ``postgres``, ``redis``,
``mysql``), ``BENCH_URL`` (the PostgreSQL conninfo, Redis or MySQL URL),
``BENCH_DIR`` (the SQLite file's directory), ``BENCH_PREFIX`` (Redis keys),
``BENCH_TABLE`` (MySQL's key table).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection
from starlette.routing import Route

from bench._thing import create
from idemflow import AsyncIdempotency, Policy
from idemflow.integrations.starlette import IdempotencyMiddleware

KIND = os.environ.get("BENCH_STORE", "sqlite")
URL = os.environ.get("BENCH_URL", "")


class Bearer(AuthenticationBackend):
    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser]:
        return AuthCredentials(["authenticated"]), SimpleUser("alice")


def _store() -> Any:
    if KIND == "postgres":
        from idemflow.stores.postgres import AsyncPostgresStore

        return AsyncPostgresStore(URL, max_size=8)
    if KIND == "redis":
        from idemflow.stores.redis import open_redis

        # The client open_store makes from a URL (bounded timeouts, retries). The bench's
        # shared Redis keeps nothing on disk: acknowledged, as the tests do.
        prefix = os.environ.get("BENCH_PREFIX", "bench:")
        return open_redis(URL, prefix=prefix, asynchronous=True, allow_volatile=True)
    if KIND == "mysql":
        from idemflow.stores.mysql import AsyncMySQLStore

        return AsyncMySQLStore(URL, table=os.environ.get("BENCH_TABLE", "bench_keys"), max_size=8)
    from idemflow.stores.sqlite import AsyncSQLiteStore

    return AsyncSQLiteStore(Path(os.environ.get("BENCH_DIR", ".")) / "keys.db")


def make_app() -> Starlette:
    store = _store()

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if KIND != "redis":
            await store.migrate()
        yield

    app = Starlette(
        lifespan=lifespan,
        routes=[
            Route("/things", create, methods=["POST"]),
            Route("/plain/things", create, methods=["POST"]),
        ],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=Bearer()),
            Middleware(
                IdempotencyMiddleware,
                idempotency=AsyncIdempotency(store, Policy()),
                endpoints=["POST /things"],
            ),
        ],
    )
    app.state.store = store  # for benches that send the store's statements raw, beside the app
    return app


app = make_app()
