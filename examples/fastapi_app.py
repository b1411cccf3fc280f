"""
A FastAPI orders service protected by idemflow: the quick start of
docs/frameworks/fastapi.md (SQLAlchemy's asyncio engine), runnable.

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
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from idemflow.integrations.fastapi import IdempotentRequest, IdempotentRoute, dependency
from idemflow.stores.postgres import AsyncPostgresStore

DATABASE_URL = os.environ.get(
    "FASTAPI_APP_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
engine = create_async_engine(DATABASE_URL.replace("postgresql://", "postgresql+psycopg://", 1))


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    item: Mapped[str]
    quantity: Mapped[int]


class OrderIn(BaseModel):
    item: str
    quantity: int


class OrderOut(OrderIn):
    id: int


def current_user(authorization: Annotated[str | None, Header()] = None) -> str | None:
    """Stand-in authentication: runs before the claim, so a 401 is never recorded."""
    if authorization is None:
        return None
    if not authorization.startswith("Bearer "):
        raise HTTPException(401, "send Authorization: Bearer <name>")
    return authorization.removeprefix("Bearer ")


Idem = Annotated[
    IdempotentRequest[AsyncSession], Depends(dependency(engine, principal=current_user))
]
router = APIRouter(route_class=IdempotentRoute)


@router.post("/orders", status_code=201, response_model=OrderOut)
async def create_order(order: OrderIn, idem: Idem) -> OrderOut:
    session = idem.connection  # this request's AsyncSession, in the transaction
    row = Order(item=order.item, quantity=order.quantity)
    session.add(row)
    await session.flush()
    return OrderOut(id=row.id, item=row.item, quantity=row.quantity)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    keys = AsyncPostgresStore(DATABASE_URL, max_size=1)
    await keys.migrate()  # the key table, idempotently (`idemflow migrate` does the same)
    await keys.close()
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    yield
    await engine.dispose()


app = FastAPI(title="orders", lifespan=lifespan)
app.include_router(router)
