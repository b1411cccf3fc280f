"""
A route's own policy on the ASGI doors, in each one's idiom: the ASGI middleware's
endpoint table (``{"POST /orders": Policy(…)}``) and FastAPI's
``dependency(idempotent, policy=…)`` per route (on PostgreSQL). The stored record keeps
the route's retention and its own stale threshold (a longer one than the app's too); the
route's classifier decides what is stored.
"""

# No ``from __future__ import annotations``: FastAPI must see the local route aliases.
import uuid
from datetime import timedelta
from typing import Any

import httpx
import pytest

from idemflow import AsyncIdempotency, Policy, Response, Verdict
from idemflow.integrations.asgi import IdempotencyMiddleware
from idemflow.stores.memory import AsyncMemoryStore

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

WEEK = timedelta(days=7).total_seconds()
APP = Policy(request_timeout=30)
KEPT_A_WEEK = Policy(request_timeout=5, retention=WEEK)


def _never_stored(response: Response) -> Verdict:
    return Verdict.TRANSIENT


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def _middleware(store: AsyncMemoryStore) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(
        _app,
        idempotency=AsyncIdempotency(store, APP),
        endpoints={
            "POST /orders": KEPT_A_WEEK,
            "POST /quotes": Policy(request_timeout=5, classify=_never_stored),
            "POST /refunds": None,  # the app's
        },
        principal=lambda scope: "alice",
    )


async def test_the_asgi_middlewares_endpoint_table_gives_each_route_its_policy() -> None:
    store = AsyncMemoryStore()
    transport = httpx.ASGITransport(app=_middleware(store))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for path in ("/orders", "/quotes", "/refunds"):
            answer = await client.post(path, headers={"Idempotency-Key": path}, content=b"{}")
            assert answer.status_code == 201

    orders, quotes, refunds = [
        await store.get("alice", k) for k in ("/orders", "/quotes", "/refunds")
    ]
    assert orders is not None
    assert refunds is not None
    assert orders.expires_at - orders.updated_at == pytest.approx(WEEK, abs=0.002)
    assert refunds.expires_at - refunds.updated_at == pytest.approx(
        APP.retention_seconds, abs=0.002
    )
    assert quotes is not None
    assert quotes.state.value == "released"  # the route's own classifier: never stored


async def test_a_route_outliving_the_apps_threshold_carries_its_own() -> None:
    """A 10-minute route under a 30 s app: accepted, its claim dated by its own threshold."""
    store, slow = AsyncMemoryStore(), Policy(request_timeout=600)
    middleware = IdempotencyMiddleware(
        _app,
        idempotency=AsyncIdempotency(store, APP),
        endpoints={"POST /orders": slow},
        principal=lambda scope: "alice",
    )
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        answer = await client.post("/orders", headers={"Idempotency-Key": "k"}, content=b"{}")
        assert answer.status_code == 201

    record = await store.get("alice", "k")
    assert record is not None
    assert record.stale_at is not None
    assert record.stale_at - record.created_at == pytest.approx(slow.stale_seconds, abs=0.002)


@pytest.mark.postgres
async def test_fastapi_takes_a_routes_policy_as_its_dependencys_argument() -> None:
    """``Depends(dependency(idempotent, principal=…, policy=…))``: one Idempotent (one
    driver, one pool), two routes, each record kept its own route's retention."""
    pytest.importorskip("fastapi")
    psycopg_pool = pytest.importorskip("psycopg_pool")
    from typing import Annotated

    from fastapi import Depends, FastAPI

    from idemflow.integrations.fastapi import IdempotentRequest, IdempotentRoute, dependency
    from idemflow.integrations.starlette import Idempotent
    from idemflow.stores.postgres import AsyncPostgresStore
    from idemflow.transactions import AsyncPsycopgTransaction
    from tests.conftest import POSTGRES_URL

    table = f"idem_{uuid.uuid4().hex[:12]}"
    pool = psycopg_pool.AsyncConnectionPool(
        POSTGRES_URL, min_size=1, max_size=2, kwargs={"autocommit": True}, open=False
    )
    await pool.open()
    store = AsyncPostgresStore(pool, table=table)
    await store.migrate()
    idempotent = Idempotent(
        AsyncIdempotency(store, APP), connect=pool.connection, transaction=AsyncPsycopgTransaction
    )

    def user() -> str:
        return "alice"

    Weekly = Annotated[
        IdempotentRequest, Depends(dependency(idempotent, principal=user, policy=KEPT_A_WEEK))
    ]
    Daily = Annotated[IdempotentRequest, Depends(dependency(idempotent, principal=user))]
    app = FastAPI()
    app.router.route_class = IdempotentRoute

    @app.post("/orders", status_code=201)
    async def order(idem: Weekly) -> dict[str, str]:
        return {"id": "o"}

    @app.post("/refunds", status_code=201)
    async def refund(idem: Daily) -> dict[str, str]:
        return {"id": "r"}

    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for path in ("/orders", "/refunds"):
                answer = await client.post(path, headers={"Idempotency-Key": path}, json={})
                assert answer.status_code == 201, answer.text
        orders, refunds = await store.get("alice", "/orders"), await store.get("alice", "/refunds")
        assert orders is not None
        assert refunds is not None
        assert orders.expires_at - orders.updated_at == pytest.approx(WEEK, abs=0.002)
        daily = APP.retention_seconds
        assert refunds.expires_at - refunds.updated_at == pytest.approx(daily, abs=0.002)
        dependency(idempotent, principal=user, policy=Policy(request_timeout=600))  # accepted
    finally:
        async with pool.connection() as conn:
            await conn.execute(f"DROP TABLE IF EXISTS {table}")
        await pool.close()
