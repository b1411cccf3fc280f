"""
Transactional mode through the FastAPI dependency, on a small app over PostgreSQL.

The endpoint's rows and the ``completed`` record commit in one transaction: an
error, or a response that cannot be stored, rolls the rows back with the claim.
"""

# No ``from __future__ import annotations``: FastAPI must see the local ``Idem`` alias.

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

import httpx
import pytest

pytest.importorskip("fastapi")
psycopg = pytest.importorskip("psycopg")
psycopg_pool = pytest.importorskip("psycopg_pool")

from fastapi import Depends, FastAPI, Header, HTTPException  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from starlette.responses import Response as StarletteResponse  # noqa: E402
from starlette.responses import StreamingResponse  # noqa: E402

import idemflow  # noqa: E402
from idemflow import AsyncAttempt, AsyncIdempotency, Policy  # noqa: E402
from idemflow.integrations.fastapi import IdempotentRequest, dependency  # noqa: E402
from idemflow.integrations.starlette import (  # noqa: E402
    EdgeOptions,
    Idempotent,
    RequestIdMiddleware,
)
from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore  # noqa: E402
from idemflow.transactions import AsyncPsycopgTransaction  # noqa: E402
from tests.conftest import POSTGRES_URL, unreachable  # noqa: E402
from tests.factories import until  # noqa: E402
from tests.http.conftest import assert_problem, new_key, serve  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(90)]

LIMIT = 2048
BINARY = bytes(range(256)) * 4


class OrderIn(BaseModel):
    item: str
    quantity: int


def current_user(authorization: Annotated[str | None, Header()] = None) -> str | None:
    """Auth runs first: a wrong token is a 401 of its own; no token yields no principal."""
    if authorization is None:
        return None
    if not authorization.startswith("Bearer "):
        raise HTTPException(401, "bad token")
    return authorization.removeprefix("Bearer ")


def make_app(
    url: str, table: str, calls: collections.Counter[str], *, pool_timeout: float = 5.0
) -> FastAPI:
    pool = psycopg_pool.AsyncConnectionPool(
        url, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False, timeout=pool_timeout
    )
    store = AsyncPostgresStore(pool, table=table)
    idempotent = Idempotent(
        AsyncIdempotency(store, Policy(request_timeout=10)),
        connect=pool.connection,
        transaction=AsyncPsycopgTransaction,
        options=EdgeOptions(max_response_bytes=LIMIT),
    )
    Idem = Annotated[IdempotentRequest, Depends(dependency(idempotent, principal=current_user))]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.open(wait=False)
        yield
        await pool.close()

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(RequestIdMiddleware)

    async def insert(attempt: AsyncAttempt, order: OrderIn) -> int:
        cursor = await attempt.connection.execute(
            f"INSERT INTO orders_{table} (item, quantity) VALUES (%s, %s) RETURNING id",
            (order.item, order.quantity),
        )
        row = await cursor.fetchone()
        return int(row[0])

    @app.post("/orders", status_code=201)
    async def create_order(order: OrderIn, idem: Idem, sleep: float = 0) -> StarletteResponse:
        async def handler(attempt: AsyncAttempt) -> idemflow.Response:
            calls["orders"] += 1
            order_id = await insert(attempt, order)
            await asyncio.sleep(sleep)
            body = {"id": order_id, "item": order.item}
            headers = [("location", f"/orders/{order_id}"), ("set-cookie", "s=1")]
            return idemflow.Response.json(201, body, headers)

        return await idem.run(handler)

    @app.post("/orders-failing")
    async def failing(order: OrderIn, idem: Idem) -> StarletteResponse:
        async def handler(attempt: AsyncAttempt) -> idemflow.Response:
            calls["failing"] += 1
            await insert(attempt, order)
            raise RuntimeError("boom after the insert")

        return await idem.run(handler)

    @app.post("/orders-big")
    async def big(order: OrderIn, idem: Idem) -> StarletteResponse:
        async def handler(attempt: AsyncAttempt) -> StarletteResponse:
            calls["big"] += 1
            await insert(attempt, order)
            return StarletteResponse(b"x" * (LIMIT + 1))

        return await idem.run(handler)

    @app.post("/orders-streaming")
    async def streaming(order: OrderIn, idem: Idem) -> StarletteResponse:
        async def handler(attempt: AsyncAttempt) -> StarletteResponse:
            await insert(attempt, order)
            return StreamingResponse(iter([b"a", b"b"]))

        return await idem.run(handler)

    @app.post("/binary")
    async def binary(idem: Idem) -> StarletteResponse:
        async def handler(attempt: AsyncAttempt) -> StarletteResponse:
            calls["binary"] += 1
            return StarletteResponse(BINARY, media_type="application/octet-stream")

        return await idem.run(handler)

    return app


@pytest.fixture(scope="module")
def table() -> Iterator[str]:
    import uuid

    name = f"idem_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(
                f"CREATE TABLE orders_{name} (id BIGSERIAL PRIMARY KEY, item TEXT, quantity INT)"
            )
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    sync = PostgresStore(POSTGRES_URL, table=name, max_size=1)
    sync.migrate()
    sync.close()
    yield name
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}, orders_{name}")


class App:
    def __init__(self, url: str, table: str, calls: collections.Counter[str]) -> None:
        self.url, self.table, self.calls = url, table, calls

    def client(self, key: str | None = None, token: str | None = "dana") -> httpx.Client:
        headers = {}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if key is not None:
            headers["Idempotency-Key"] = key
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def rows(self, item: str) -> int:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            sql = f"SELECT count(*) FROM orders_{self.table} WHERE item = %s"
            return int(conn.execute(sql, (item,)).fetchone()[0])

    def key_state(self, key: str) -> Any:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            sql = f"SELECT state FROM {self.table} WHERE idempotency_key = %s"
            row = conn.execute(sql, (key,)).fetchone()
            return None if row is None else row[0]


@pytest.fixture(scope="module")
def app(table: str) -> Iterator[App]:
    calls: collections.Counter[str] = collections.Counter()
    with serve(make_app(POSTGRES_URL, table, calls)) as url:
        yield App(url, table, calls)


def item() -> str:
    return f"item-{new_key()}"


def test_the_row_and_the_completed_record_commit_together_and_retries_replay(app: App) -> None:
    key, name = new_key(), item()
    with app.client(key) as client:
        first = client.post("/orders", json={"item": name, "quantity": 1})
        again = client.post("/orders", json={"item": name, "quantity": 1})
    assert first.status_code == 201
    assert first.headers["set-cookie"] == "s=1"
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["location"] == first.headers["location"]
    assert "set-cookie" not in again.headers
    assert app.rows(name) == 1
    assert app.key_state(key) == "completed"


def test_a_handler_error_rolls_back_its_rows_and_releases_the_key(app: App) -> None:
    key, name = new_key(), item()
    # A client per request: uvicorn closes the connection after an unhandled error.
    with app.client(key) as client:
        assert client.post("/orders-failing", json={"item": name, "quantity": 1}).status_code == 500
    before = app.calls["failing"]
    with app.client(key) as client:
        assert client.post("/orders-failing", json={"item": name, "quantity": 1}).status_code == 500
    assert app.calls["failing"] == before + 1  # released: the retry really ran
    assert app.rows(name) == 0
    assert app.key_state(key) == "released"


@pytest.mark.parametrize(
    ("path", "why"), [("/orders-big", str(LIMIT)), ("/orders-streaming", "stream")]
)
def test_an_unstorable_response_is_refused_and_its_rows_roll_back(
    app: App, path: str, why: str
) -> None:
    key, name = new_key(), item()
    with app.client(key) as client:
        body = assert_problem(
            client.post(path, json={"item": name, "quantity": 1}), 500, "response-not-storable"
        )
    assert why in body["detail"]
    assert app.rows(name) == 0
    assert app.key_state(key) == "released"


def test_binary_responses_are_replayed_byte_for_byte(app: App) -> None:
    with app.client(new_key()) as client:
        first = client.post("/binary")
        again = client.post("/binary")
    assert first.content == again.content == BINARY
    assert again.headers["idempotent-replayed"] == "true"


def test_validation_and_authentication_failures_are_never_recorded(app: App) -> None:
    key = new_key()
    with app.client(key) as client:
        assert client.post("/orders", json={"item": "x"}).status_code == 422  # FastAPI's own
    with app.client(key, token=None) as client:
        client.headers["Authorization"] = "Basic x"
        assert client.post("/orders", json={"item": "x", "quantity": 1}).status_code == 401
    assert app.key_state(key) is None


def test_no_principal_is_401_problem_and_nothing_is_claimed(app: App) -> None:
    key = new_key()
    with app.client(key, token=None) as client:
        assert_problem(client.post("/orders", json={"item": "x", "quantity": 1}), 401)
    assert app.key_state(key) is None


def test_a_duplicate_during_the_first_gets_409_at_once_then_the_replay(app: App) -> None:
    key, name = new_key(), item()

    async def race() -> list[httpx.Response]:
        headers = {"Authorization": "Bearer dana", "Idempotency-Key": key}
        async with httpx.AsyncClient(base_url=app.url, headers=headers, timeout=30) as client:
            body = {"item": name, "quantity": 2}
            first = asyncio.create_task(client.post("/orders?sleep=0.6", json=body))
            await until(lambda: app.key_state(key) is not None, "claimed", blocking=True)
            conflict = await client.post("/orders?sleep=0.6", json=body)
            return [await first, conflict, await client.post("/orders?sleep=0.6", json=body)]

    first, conflict, replay = asyncio.run(race())
    assert first.status_code == 201
    assert_problem(conflict, 409, "in-progress")
    assert int(conflict.headers["retry-after"]) >= 1
    assert replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert app.rows(name) == 1


def test_an_unreachable_store_is_503_with_retry_after_and_the_handler_does_not_run(
    table: str,
) -> None:
    calls: collections.Counter[str] = collections.Counter()
    dead = "postgresql://postgres@127.0.0.1:1/test?connect_timeout=1"
    with (
        serve(make_app(dead, table, calls, pool_timeout=1.0)) as url,
        httpx.Client(base_url=url) as client,
    ):
        response = client.post(
            "/orders",
            json={"item": "x", "quantity": 1},
            headers={"Authorization": "Bearer dana", "Idempotency-Key": new_key()},
        )
    assert_problem(response, 503, "store-unavailable")
    assert response.headers["retry-after"] == "1"
    assert calls["orders"] == 0


def test_a_mounted_fastapi_app_names_its_mount_in_the_endpoint(table: str) -> None:
    """Issue 9, defect 9: the same sub-app mounted twice is two endpoints, with their prefix."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    calls: collections.Counter[str] = collections.Counter()
    inner = make_app(POSTGRES_URL, table, calls)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with inner.router.lifespan_context(inner):  # a mount does not run it
            yield

    outer = Starlette(routes=[Mount("/v1", app=inner), Mount("/v2", app=inner)], lifespan=lifespan)
    key, name = new_key(), item()
    headers = {"Authorization": "Bearer dana", "Idempotency-Key": key}
    with serve(outer) as url, httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        first = client.post("/v1/orders", json={"item": name, "quantity": 1})
        other = client.post("/v2/orders", json={"item": name, "quantity": 1})
    assert first.status_code == 201
    assert_problem(other, 422, "key-reused")
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        sql = f"SELECT endpoint FROM {table} WHERE idempotency_key = %s"
        assert conn.execute(sql, (key,)).fetchone() == ("POST /v1/orders",)
