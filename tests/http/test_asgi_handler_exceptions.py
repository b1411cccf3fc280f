"""
A handler's exception through the ASGI doors, in process (issue 31, item 7): Starlette's
``Idempotent``, the FastAPI dependency (both on PostgreSQL, in the handler's transaction)
and the ASGI ``IdempotencyMiddleware`` (SQLite keys). What the endpoint raised reaches the
caller of the application (httpx's ASGI transport re-raises it, after Starlette's 500) as
the very object, and the key is released as after any exception. A ``StopIteration``
cannot leave a coroutine in Python (PEP 479): there it is the ``__cause__`` of the
``RuntimeError`` Python makes of it, at its first coroutine, and nothing of ours wraps it
again. (The WSGI doors: tests/integrations/test_wsgi_doors.py.)
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

psycopg = pytest.importorskip("psycopg")
psycopg_pool = pytest.importorskip("psycopg_pool")

from fastapi import Depends, FastAPI  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response as StarletteResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from idemflow import AsyncAttempt, AsyncIdempotency, Policy, State  # noqa: E402
from idemflow.integrations.fastapi import IdempotentRequest, dependency  # noqa: E402
from idemflow.integrations.starlette import IdempotencyMiddleware, Idempotent  # noqa: E402
from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore  # noqa: E402
from idemflow.stores.sqlite import AsyncSQLiteStore  # noqa: E402
from idemflow.transactions import AsyncPsycopgTransaction  # noqa: E402
from tests.conftest import POSTGRES_URL, unreachable  # noqa: E402
from tests.factories import HANDLER_EXCEPTIONS, assert_passed_through  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

POLICY = Policy(request_timeout=10)


def alice(*_: Any) -> str:
    return "alice"


def signed_in() -> str:
    """The FastAPI dependency's principal: a dependency of its own, with no parameters."""
    return "alice"


class Door:
    """One ASGI application protected one way; ``failures``: what its handler raises."""

    def __init__(self, app: Any, record: Callable[[str], Any]) -> None:
        self.app = app
        self.record = record
        self.failures: list[BaseException] = []
        self.ran = 0

    def run(self) -> None:
        self.ran += 1
        if self.failures:
            raise self.failures.pop()


@pytest.fixture
def postgres_table() -> Iterator[str]:
    name = f"idem_{uuid.uuid4().hex[:12]}"
    try:
        store = PostgresStore(POSTGRES_URL, table=name, max_size=1)
        store.migrate()
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    yield name
    store.close()
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}")


@contextlib.asynccontextmanager
async def transactional(kind: str, table: str) -> AsyncIterator[Door]:
    pool = psycopg_pool.AsyncConnectionPool(
        POSTGRES_URL, min_size=1, max_size=2, kwargs={"autocommit": True}, open=False
    )
    await pool.open()
    store = AsyncPostgresStore(pool, table=table)
    idempotent = Idempotent(
        AsyncIdempotency(store, POLICY),
        connect=pool.connection,
        transaction=AsyncPsycopgTransaction,
        principal=alice,
    )
    door = Door(None, lambda key: store.get("alice", key))

    async def handler(attempt: AsyncAttempt) -> StarletteResponse:
        door.run()
        return StarletteResponse(b"paid", status_code=201)

    if kind == "starlette":

        async def pay(request: Request) -> StarletteResponse:
            return await idempotent.run(request, handler)

        door.app = Starlette(routes=[Route("/payments", pay, methods=["POST"])])
    else:
        app = FastAPI()
        protected = Depends(dependency(idempotent, principal=signed_in))

        @app.post("/payments")
        async def fastapi_pay(idem: IdempotentRequest = protected) -> StarletteResponse:
            return await idem.run(handler)

        door.app = app
    try:
        yield door
    finally:
        await pool.close()


@contextlib.asynccontextmanager
async def middleware(tmp_path: Path) -> AsyncIterator[Door]:
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    await store.migrate()
    door = Door(None, lambda key: store.get("alice", key))

    async def pay(request: Request) -> StarletteResponse:
        door.run()
        return StarletteResponse(b"paid", status_code=201)

    protection = Middleware(
        IdempotencyMiddleware,
        idempotency=AsyncIdempotency(store, POLICY),
        endpoints=["POST /payments"],
        principal=alice,
    )
    door.app = Starlette(
        routes=[Route("/payments", pay, methods=["POST"])], middleware=[protection]
    )
    try:
        yield door
    finally:
        await store.close()


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("starlette", marks=pytest.mark.postgres),
        pytest.param("fastapi", marks=pytest.mark.postgres),
        "middleware",
    ],
)
@HANDLER_EXCEPTIONS
async def test_an_endpoints_exception_reaches_the_caller_and_releases_the_key(
    kind: str, make_exception: Callable[[], Exception], tmp_path: Path, request: Any
) -> None:
    raised = make_exception()
    opened = (
        middleware(tmp_path)
        if kind == "middleware"
        else transactional(kind, request.getfixturevalue("postgres_table"))
    )
    async with opened as door:
        door.failures.append(raised)
        transport = httpx.ASGITransport(app=door.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
            headers = {"Idempotency-Key": "k-1"}
            with pytest.raises((type(raised), RuntimeError)) as caught:
                await client.post("/payments", content=b"{}", headers=headers)
            record = await door.record("k-1")
            retry = await client.post("/payments", content=b"{}", headers=headers)

    assert_passed_through(caught.value, raised, awaited=True)
    assert record is not None
    assert record.state is State.RELEASED
    assert retry.status_code == 201
    assert door.ran == 2
