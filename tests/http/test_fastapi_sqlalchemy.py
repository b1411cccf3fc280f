"""
FastAPI on the app's own SQLAlchemy engine: ``dependency(engine)`` (or an
``async_sessionmaker``, SQLModel's included), on PostgreSQL and on a SQLite file.

One pool: the store claims on the engine's own connections (a pool of two,
no second pool beside it); the endpoint writes on its ``AsyncSession``,
``idem.connection``, and the completion commits in that session's transaction.
"""

# No ``from __future__ import annotations``: FastAPI must see the local ``Idem`` alias.

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sqlalchemy")
psycopg = pytest.importorskip("psycopg")

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from sqlalchemy import String, func, select  # noqa: E402
from sqlalchemy.ext.asyncio import (  # noqa: E402
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column  # noqa: E402
from sqlmodel.ext.asyncio.session import AsyncSession as SQLModelSession  # noqa: E402

from idemflow.integrations.fastapi import IdempotentRequest, IdempotentRoute, dependency  # noqa: E402
from idemflow.stores.postgres import PostgresStore  # noqa: E402
from idemflow.stores.sqlite import SQLiteStore  # noqa: E402
from tests.conftest import POSTGRES_URL, unreachable  # noqa: E402
from tests.http.conftest import new_key  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.anyio]

CONCURRENT = 50


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str] = mapped_column(String(50))


class OrderIn(BaseModel):
    item: str


class OrderOut(BaseModel):
    id: int
    item: str


def current_user(authorization: Annotated[str | None, Header()] = None) -> str | None:
    return None if authorization is None else authorization.removeprefix("Bearer ")


def make_app(sessions: AsyncEngine | async_sessionmaker[AsyncSession]) -> FastAPI:
    """The page's quick start, on ``sessions``: five idemflow lines."""
    Idem = Annotated[
        IdempotentRequest[AsyncSession], Depends(dependency(sessions, principal=current_user))
    ]
    router = APIRouter(route_class=IdempotentRoute)

    @router.post("/orders", status_code=201, response_model=OrderOut)
    async def create_order(order: OrderIn, idem: Idem) -> OrderOut:
        row = Order(item=order.item)
        idem.connection.add(row)
        await idem.connection.flush()
        if order.item == "fails-after-its-write":
            raise HTTPException(500, "after the write")
        return OrderOut(id=row.id, item=row.item)

    app = FastAPI()
    app.include_router(router)
    return app


@pytest.fixture(params=[pytest.param("postgresql", marks=pytest.mark.postgres), "sqlite"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AsyncEngine]:
    """The app's engine, a pool of one connection and one overflow, its tables made."""
    if request.param == "sqlite":
        path = tmp_path / "app.db"
        SQLiteStore(path).migrate()
        made = create_async_engine(f"sqlite+aiosqlite:///{path}", pool_size=1, max_overflow=1)
        asyncio.run(_create(made))
        yield made
        return
    schema = f"fw_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    options = f"-c search_path={schema}"
    store = PostgresStore(f"{POSTGRES_URL}?options={quote(options, safe='')}")
    store.migrate()
    store.close()
    made = create_async_engine(
        POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://")
        + f"?application_name={schema}",
        pool_size=1,
        max_overflow=1,
        connect_args={"options": options},
    )
    asyncio.run(_create(made))
    try:
        yield made
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


async def _create(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await engine.dispose()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def client(engine: AsyncEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as made:
        yield made
    await engine.dispose()


async def orders(engine: AsyncEngine) -> int:
    async with AsyncSession(engine) as session:
        return int((await session.execute(select(func.count()).select_from(Order))).scalar_one())


async def test_fifty_concurrent_requests_with_one_key_make_one_row_on_a_pool_of_two(
    engine: AsyncEngine, client: httpx.AsyncClient
) -> None:
    """One runs, the others get 409 or its replay; every connection is the engine's."""
    key = new_key()
    headers = {"Authorization": "Bearer alice", "Idempotency-Key": key}
    answers = await asyncio.gather(
        *(client.post("/orders", json={"item": "book"}, headers=headers) for _ in range(CONCURRENT))
    )
    statuses = sorted({answer.status_code for answer in answers})
    assert set(statuses) <= {201, 409}, statuses
    assert 201 in statuses
    assert await orders(engine) == 1
    if engine.dialect.name == "postgresql":
        # The key table is in the engine's search_path only: the store claimed on its pool.
        with psycopg.connect(POSTGRES_URL) as conn:
            seen = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (engine.url.query["application_name"],),
            ).fetchone()
        assert seen is not None
        assert seen[0] <= 2


async def test_a_replay_is_the_first_answer_verbatim(
    engine: AsyncEngine, client: httpx.AsyncClient
) -> None:
    headers = {"Authorization": "Bearer alice", "Idempotency-Key": new_key()}
    first = await client.post("/orders", json={"item": "pen"}, headers=headers)
    again = await client.post("/orders", json={"item": "pen"}, headers=headers)
    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert await orders(engine) == 1


async def test_an_endpoint_failing_after_its_write_rolls_back_its_row_and_releases_the_key(
    engine: AsyncEngine, client: httpx.AsyncClient
) -> None:
    """The completion is the session's: the failure leaves no row and no record, so the
    same key runs again."""
    headers = {"Authorization": "Bearer alice", "Idempotency-Key": new_key()}
    failed = await client.post("/orders", json={"item": "fails-after-its-write"}, headers=headers)
    assert failed.status_code == 500
    assert await orders(engine) == 0
    retried = await client.post("/orders", json={"item": "fails-after-its-write"}, headers=headers)
    assert retried.status_code == 500  # ran again: released, never replayed
    assert "idempotent-replayed" not in retried.headers


async def test_sqlmodel_sessions_take_the_same_path(engine: AsyncEngine) -> None:
    """An ``async_sessionmaker`` of SQLModel's ``AsyncSession``: the endpoint gets one."""
    sessions = async_sessionmaker(engine, class_=SQLModelSession)
    app = make_app(sessions)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        headers = {"Authorization": "Bearer alice", "Idempotency-Key": new_key()}
        first = await c.post("/orders", json={"item": "lamp"}, headers=headers)
        again = await c.post("/orders", json={"item": "lamp"}, headers=headers)
    assert first.status_code == 201
    assert again.content == first.content
    assert await orders(engine) == 1
    await engine.dispose()
