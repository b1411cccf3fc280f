"""
The transaction adapters for psycopg and SQLAlchemy, sync and async alike.

This is the async source of truth; ``idemflow/_sync/transactions.py`` is generated
from it by ``scripts/unasync.py``. Import the adapters from :mod:`idemflow.transactions`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from ..stores.protocol import Statement

__all__ = ["AsyncPsycopgTransaction", "AsyncSQLAlchemyTransaction"]


class AsyncPsycopgTransaction:
    """A ``psycopg.AsyncConnection``, autocommit or not."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    async def begin(self) -> None:
        # A non-autocommit connection begins by itself on the first statement.
        if self.connection.autocommit:
            await self.connection.execute("BEGIN")

    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        cursor = await self.connection.execute(statement.pyformat, statement.bind(params))
        return int(cursor.rowcount)

    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        cursor = await self.connection.execute(statement.pyformat, statement.bind(params))
        row = await cursor.fetchone()
        return None if row is None else _psycopg_mapping(statement, cursor, row)

    async def commit(self) -> None:
        await self.connection.commit()

    async def rollback(self) -> None:
        await self.connection.rollback()


# Result column names per statement text (they cannot change): psycopg builds
# ``cursor.description`` afresh, one Column object per column, on every access.
_psycopg_names: dict[str, tuple[str, ...]] = {}


def _psycopg_mapping(statement: Statement, cursor: Any, row: Sequence[Any]) -> Mapping[str, Any]:
    names = _psycopg_names.get(statement.pyformat)
    if names is None:
        names = _psycopg_names[statement.pyformat] = tuple(c[0] for c in cursor.description)
    return dict(zip(names, row, strict=True))


@functools.lru_cache(maxsize=64)
def _text(named: str) -> Any:
    from sqlalchemy import text

    return text(named)


class AsyncSQLAlchemyTransaction:
    """A SQLAlchemy ``AsyncConnection`` or ``AsyncSession``; joins a transaction already begun."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    async def begin(self) -> None:
        if not self.connection.in_transaction():
            await self.connection.begin()

    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        result = await self.connection.execute(_text(statement.named), statement.bind(params))
        return int(result.rowcount)

    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        result = await self.connection.execute(_text(statement.named), statement.bind(params))
        row = result.mappings().fetchone()
        return None if row is None else dict(row)

    async def commit(self) -> None:
        await self.connection.commit()

    async def rollback(self) -> None:
        active = self.connection.in_transaction()
        await self.connection.rollback()
        if not active:
            # After a failed COMMIT a Connection drops its transaction without a
            # ROLLBACK, but SQLite keeps it open (with the write lock): end it.
            await self.connection.begin()
            await self.connection.rollback()
