"""
A FastAPI orders service protected by idemflow: the quick start of
docs/frameworks/fastapi.md, runnable.

    FASTAPI_APP_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test \
        uvicorn examples.fastapi_app:app --port 8010

The key table (``idemflow_keys``) and the ``orders`` table are created at start
when missing. ``Authorization: Bearer <name>`` is the (stand-in) principal.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

from idemflow.integrations.fastapi import IdempotentRequest, IdempotentRoute, dependency
from idemflow.stores.postgres import AsyncPostgresStore

DATABASE_URL = os.environ.get(
    "FASTAPI_APP_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


class OrderIn(BaseModel):
    item: str
    quantity: int


class OrderOut(BaseModel):
    id: int
    item: str
    quantity: int


def current_user(authorization: Annotated[str | None, Header()] = None) -> str | None:
    """Stand-in authentication: runs before the claim, so a 401 is never recorded."""
    if authorization is None:
        return None
    if not authorization.startswith("Bearer "):
        raise HTTPException(401, "send Authorization: Bearer <name>")
    return authorization.removeprefix("Bearer ")


pool = AsyncConnectionPool(DATABASE_URL, kwargs={"autocommit": True}, open=False)
Idem = Annotated[IdempotentRequest, Depends(dependency(pool, principal=current_user))]
router = APIRouter(route_class=IdempotentRoute)


@router.post("/orders", status_code=201, response_model=OrderOut)
async def create_order(order: OrderIn, idem: Idem) -> OrderOut:
    cursor = await idem.connection.execute(
        "INSERT INTO orders (item, quantity) VALUES (%s, %s) RETURNING id",
        (order.item, order.quantity),
    )
    row = await cursor.fetchone()
    assert row is not None
    return OrderOut(id=row[0], item=order.item, quantity=order.quantity)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    await pool.open()
    await AsyncPostgresStore(pool).migrate()  # the key table, idempotently
    async with pool.connection() as conn:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS orders "
            "(id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL, quantity INTEGER NOT NULL)"
        )
    yield
    await pool.close()


app = FastAPI(title="orders", lifespan=lifespan)
app.include_router(router)
