"""
A hung database under the app's own SQLAlchemy engine (guarantee 5): the key store that
FastAPI's ``dependency(engine)`` and Flask's ``db=`` build on the engine's pool waits no
longer than the store wait of the request being served (a route's own when shorter), so
a PostgreSQL frozen with SIGSTOP is a 503 within the request's budget, a ``pool_pre_ping``
included, and the connection left mid-statement never goes back to the app's pool: once
the server resumes, the next request works.
"""

# No ``from __future__ import annotations``: FastAPI must see the local ``Idem`` alias.

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Annotated, Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sqlalchemy")
pytest.importorskip("psycopg")

import httpx
from fastapi import APIRouter, Depends, FastAPI, Header
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from idemflow import Policy
from idemflow.edge import RoutePolicy
from idemflow.integrations.fastapi import IdempotentRequest, IdempotentRoute, dependency
from idemflow.stores.postgres import PostgresStore
from tests._private_postgres import (
    PrivatePostgres,
    PrivatePostgresUnavailable,
    private_postgres,
)
from tests.conftest import unreachable

pytestmark = [pytest.mark.timeout(120), pytest.mark.anyio, pytest.mark.postgres]

#: Each store wait at most 1 s, half the 2 s budget (tests/guarantees/test_hung_store.py).
BUDGETED = Policy(request_timeout=2)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def cluster() -> Iterator[PrivatePostgres]:
    """One server for the module (a cluster is seconds to make): every test thaws it."""
    try:
        with private_postgres() as pg:
            store = PostgresStore(pg.url)
            store.migrate()
            store.close()
            yield pg
    except PrivatePostgresUnavailable as exc:
        unreachable("a private PostgreSQL", exc)


@pytest.fixture
def server(cluster: PrivatePostgres) -> PrivatePostgres:
    """The module's server, its key table empty: each test's keys are its own."""
    import psycopg

    with psycopg.connect(cluster.url, autocommit=True) as conn:
        conn.execute("TRUNCATE idemflow_keys")
    return cluster


class Frozen:
    """How long the answer took under `frozen`, and whether it came within the budget."""

    in_budget = False
    answered_after = 0.0


@contextlib.contextmanager
def frozen(server: PrivatePostgres) -> Iterator[Frozen]:
    """``server`` frozen (SIGSTOP) while the block runs, thawed by a rescue timer at the
    request's budget if the block has not ended by then (and at its end either way)."""
    rescued = threading.Event()

    def rescue() -> None:
        rescued.set()
        server.thaw()

    safety = threading.Timer(BUDGETED.timeout_seconds, rescue)
    found = Frozen()
    server.freeze()
    safety.start()
    began = time.monotonic()
    try:
        yield found
    finally:
        found.in_budget = not rescued.is_set()
        found.answered_after = time.monotonic() - began
        safety.cancel()
        server.thaw()


def current_user(authorization: Annotated[str | None, Header()] = None) -> str | None:
    return None if authorization is None else authorization.removeprefix("Bearer ")


def make_app(engine: AsyncEngine, policy: RoutePolicy = BUDGETED) -> FastAPI:
    Idem = Annotated[
        IdempotentRequest[AsyncSession],
        Depends(dependency(engine, principal=current_user, policy=policy)),
    ]
    router = APIRouter(route_class=IdempotentRoute)

    @router.post("/orders", status_code=201)
    async def create_order(idem: Idem) -> dict[str, Any]:
        number = (await idem.connection.execute(text("SELECT 1"))).scalar_one()
        return {"ok": number}

    app = FastAPI()
    app.include_router(router)
    return app


@pytest.mark.parametrize("pre_ping", [False, True], ids=["plain", "pool_pre_ping"])
async def test_a_frozen_database_under_the_apps_engine_answers_503_within_the_budget(
    server: PrivatePostgres, pre_ping: bool
) -> None:
    """Frozen before the claim, the store's statement on the engine's connection waits
    its store wait (1 s), not until the server resumes: 503 before the rescue timer (the
    request's budget) thaws it. Thawed, the next request answers 201 on the same pool of
    one connection: the one left mid-statement was invalidated, not handed back. With
    ``pool_pre_ping`` the wait is the checkout's ping: 503 the same (before: at the thaw),
    the late checkout's connection given back once it ends."""
    engine = create_async_engine(
        server.url.replace("postgresql://", "postgresql+psycopg://"),
        pool_size=1,
        max_overflow=0,
        pool_pre_ping=pre_ping,
    )
    transport = httpx.ASGITransport(app=make_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        warm = await client.post(
            "/orders", headers={"Authorization": "Bearer alice", "Idempotency-Key": "k-warm"}
        )
        assert warm.status_code == 201, warm.text
        with frozen(server) as during:
            hung = await client.post(
                "/orders", headers={"Authorization": "Bearer alice", "Idempotency-Key": "k-hung"}
            )
        after = await client.post(
            "/orders", headers={"Authorization": "Bearer alice", "Idempotency-Key": "k-after"}
        )
    await engine.dispose()

    assert during.in_budget, f"past the budget: answered after {during.answered_after:.2f} s"
    assert hung.status_code == 503, hung.text
    assert after.status_code == 201, after.text


async def test_a_routes_shorter_budget_bounds_the_wait_on_the_apps_engine(
    server: PrivatePostgres,
) -> None:
    """The app's policy the default (30 s: a 5 s store wait), the route's own 2 s (a
    resolver's, per principal): frozen, the route answers 503 within its own budget
    (before: after the app's 5 s store wait, past the thaw at 2 s)."""
    engine = create_async_engine(
        server.url.replace("postgresql://", "postgresql+psycopg://"), pool_size=1, max_overflow=0
    )
    transport = httpx.ASGITransport(app=make_app(engine, lambda who: BUDGETED))
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        warm = await client.post(
            "/orders", headers={"Authorization": "Bearer alice", "Idempotency-Key": "k-warm"}
        )
        assert warm.status_code == 201, warm.text
        with frozen(server) as during:
            hung = await client.post(
                "/orders", headers={"Authorization": "Bearer alice", "Idempotency-Key": "k-hung"}
            )
    await engine.dispose()

    assert during.in_budget, f"past the budget: answered after {during.answered_after:.2f} s"
    assert hung.status_code == 503, hung.text


async def test_a_request_waiting_for_the_apps_pool_answers_503_within_the_store_wait(
    server: PrivatePostgres,
) -> None:
    """The engine's only connection held elsewhere, its ``pool_timeout`` SQLAlchemy's 30 s:
    the store's checkout ends after its store wait (1 s), a 503 well before the 30 s."""
    engine = create_async_engine(
        server.url.replace("postgresql://", "postgresql+psycopg://"), pool_size=1, max_overflow=0
    )
    transport = httpx.ASGITransport(app=make_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        async with engine.connect() as held:
            await held.execute(text("SELECT 1"))
            began = time.monotonic()
            waiting = await client.post(
                "/orders", headers={"Authorization": "Bearer alice", "Idempotency-Key": "k-wait"}
            )
            waited = time.monotonic() - began
        after = await client.post(
            "/orders", headers={"Authorization": "Bearer alice", "Idempotency-Key": "k-wait"}
        )
    await engine.dispose()

    assert waiting.status_code == 503, waiting.text
    assert waited < BUDGETED.timeout_seconds, f"the 503 came after {waited:.2f} s"
    assert after.status_code == 201, after.text


def make_flask_app(engine: Any, *, route: Policy | None = None) -> Any:
    """The app's policy ``BUDGETED``; with ``route``, the default's (30 s) and the view's
    own ``route``."""
    from flask import Flask
    from flask import request as http

    from idemflow.integrations.flask import Idempotency

    app = Flask(__name__)
    if route is None:
        app.config["IDEMFLOW_REQUEST_TIMEOUT"] = BUDGETED.timeout_seconds
    idem = Idempotency(app, db=engine, principal=lambda: http.headers.get("X-User"))

    @app.post("/orders")
    @idem.protect(policy=route)
    def create_order() -> tuple[dict[str, int], int]:
        return {"ok": idem.session.execute(text("SELECT 1")).scalar_one()}, 201

    return app


def test_flask_refuses_an_engine_whose_pool_waits_longer_than_the_store(
    server: PrivatePostgres,
) -> None:
    """SQLAlchemy's default ``pool_timeout`` (30 s) would hold a request waiting for a free
    connection past its 2 s budget: refused when the app is set up, naming the fix."""
    pytest.importorskip("flask")
    from sqlalchemy import create_engine

    from idemflow import ConfigurationError

    url = server.url.replace("postgresql://", "postgresql+psycopg://")
    engine = create_engine(url)
    with pytest.raises(ConfigurationError, match=r"create_engine\(\.\.\., pool_timeout=1\)"):
        make_flask_app(engine)
    engine.dispose()
    bounded = create_engine(url, pool_timeout=1)
    make_flask_app(bounded)
    bounded.dispose()


@pytest.mark.parametrize("pre_ping", [False, True], ids=["plain", "pool_pre_ping"])
def test_a_frozen_database_under_flasks_engine_answers_503_within_the_budget(
    server: PrivatePostgres, pre_ping: bool
) -> None:
    """Flask's ``db=`` on PostgreSQL: frozen before the claim, the store's statement on the
    engine's connection ends after its store wait, psycopg's own timeout (the frozen
    server never runs its ``statement_timeout``): 503 before the rescue timer. Thawed,
    the next request answers 201 on the same pool of one connection. With
    ``pool_pre_ping`` the wait is the checkout's ping (then SQLAlchemy's reconnect,
    bounded only by the URL's ``connect_timeout``): 503 the same (before: at the thaw)."""
    pytest.importorskip("flask")
    from sqlalchemy import create_engine

    engine = create_engine(
        server.url.replace("postgresql://", "postgresql+psycopg://"),
        pool_size=1,
        max_overflow=0,
        pool_timeout=1,
        pool_pre_ping=pre_ping,
    )
    client = make_flask_app(engine).test_client()
    warm = client.post("/orders", headers={"X-User": "alice", "Idempotency-Key": "k-warm"})
    assert warm.status_code == 201, warm.text
    with frozen(server) as during:
        hung = client.post("/orders", headers={"X-User": "alice", "Idempotency-Key": "k-hung"})
    after = client.post("/orders", headers={"X-User": "alice", "Idempotency-Key": "k-after"})
    engine.dispose()

    assert during.in_budget, f"past the budget: answered after {during.answered_after:.2f} s"
    assert hung.status_code == 503, hung.text
    assert after.status_code == 201, after.text


def test_a_flask_views_shorter_budget_bounds_the_wait_on_the_apps_engine(
    server: PrivatePostgres,
) -> None:
    """``@idem.protect(policy=…)`` with a 2 s budget under the app's default 30 s (a 5 s
    store wait): frozen, the view answers 503 within its own budget (before: after 5 s)."""
    pytest.importorskip("flask")
    from sqlalchemy import create_engine

    engine = create_engine(
        server.url.replace("postgresql://", "postgresql+psycopg://"),
        pool_size=1,
        max_overflow=0,
        pool_timeout=1,
    )
    client = make_flask_app(engine, route=BUDGETED).test_client()
    warm = client.post("/orders", headers={"X-User": "alice", "Idempotency-Key": "k-warm"})
    assert warm.status_code == 201, warm.text
    with frozen(server) as during:
        hung = client.post("/orders", headers={"X-User": "alice", "Idempotency-Key": "k-hung"})
    engine.dispose()

    assert during.in_budget, f"past the budget: answered after {during.answered_after:.2f} s"
    assert hung.status_code == 503, hung.text
