"""Adapters that let idemflow write its completion in *your* transaction.

Pass one to ``Idempotency.run(…, transaction=…)``: the library begins (or joins) the
transaction on your connection, runs your handler in it, writes the completion and
commits, or rolls back and releases the key. One adapter per driver; for another,
implement `idemflow.stores.protocol.Transaction`. Which for which connection:
docs/core.md, "Where the transaction boundary goes"."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ._async.transactions import (
    AsyncmyTransaction,
    AsyncPsycopgTransaction,
    AsyncSQLAlchemyTransaction,
)
from ._sync.transactions import (
    PsycopgTransaction,
    PyMySQLTransaction,
    SQLAlchemyTransaction,
    _execute_then_commit,
)
from .stores.protocol import AsyncTransaction, Statement, Transaction
from .stores.sql.dialect import row_mapping

__all__ = [
    "AsyncPsycopgTransaction",
    "AsyncSQLAlchemyTransaction",
    "AsyncSQLite3Connection",
    "AsyncSQLite3Transaction",
    "AsyncmyTransaction",
    "PsycopgTransaction",
    "PyMySQLTransaction",
    "SQLAlchemyTransaction",
    "SQLite3Transaction",
]


class SQLite3Transaction(Transaction):
    """A ``sqlite3.Connection``.

    SQLite admits one writer at a time, and a claim is a write: while your transaction
    holds the write lock, a duplicate's claim queues behind it. So the transaction
    begins *deferred*, taking the lock at your first write: keep slow work before it.
    ``immediate=True`` takes it at once (a deferred one that reads, then writes after
    another writer committed, fails "database is locked": released, the retry runs again)."""

    connection: Any = None  # set per instance (the protocol declares it read-only)

    def __init__(self, connection: Any, *, immediate: bool = False) -> None:
        self.connection = connection
        self._begin = "BEGIN IMMEDIATE" if immediate else "BEGIN"

    def begin(self) -> None:
        self.connection.execute(self._begin)

    def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        return int(self.connection.execute(statement.named, statement.bind(params)).rowcount)

    def fetchone(self, statement: Statement, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        cursor = self.connection.execute(statement.named, statement.bind(params))
        row = cursor.fetchone()
        return None if row is None else row_mapping(cursor.description, row)

    def commit(self) -> None:
        self.connection.commit()

    def rollback(self) -> None:
        self.connection.rollback()


T = TypeVar("T")


class AsyncSQLite3Connection:
    """A ``sqlite3.Connection`` for asyncio: its statements run, in order, on a thread of
    its own (shared workers waiting for the write lock could starve the transaction
    holding it).

    Args:
        raw: an autocommit connection that may cross threads
            (``isolation_level=None, check_same_thread=False``), as
            [`idemflow.stores.sqlite.connect`][idemflow.stores.sqlite.connect] opens it."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idemflow-sqlite")

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on this connection's thread, e.g. ``run(raw.execute, sql)``."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    def close(self) -> None:
        """Finish the statements already handed over, then close the connection."""
        self._thread.shutdown(wait=True)
        self.raw.close()


class AsyncSQLite3Transaction(AsyncTransaction):
    """`SQLite3Transaction` for asyncio, on an `AsyncSQLite3Connection`: run your own
    statements through its [`run`][idemflow.transactions.AsyncSQLite3Connection.run]
    (``attempt.connection``), so they take their turn on its thread with idemflow's.
    Deferred unless ``immediate=True``, as `SQLite3Transaction` explains."""

    connection: Any = None  # set per instance (the protocol declares it read-only)

    def __init__(self, connection: AsyncSQLite3Connection, *, immediate: bool = False) -> None:
        self.connection = self._on = connection
        self._sync = SQLite3Transaction(connection.raw, immediate=immediate)

    async def begin(self) -> None:
        await self._on.run(self._sync.begin)

    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        return await self._on.run(self._sync.execute, statement, params)

    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        return await self._on.run(self._sync.fetchone, statement, params)

    async def execute_and_commit(
        self, statement: Statement, params: Mapping[str, Any], *, begin: bool = False
    ) -> int:
        """The fenced write, then COMMIT (and BEGIN), in one hop to the connection's thread:
        a write that changed no row commits nothing; a failed COMMIT or BEGIN raises
        `CommitFailed` from its own error."""
        return await self._on.run(_execute_then_commit, self._sync, statement, params, begin)

    async def commit(self) -> None:
        await self._on.run(self._sync.commit)

    async def rollback(self) -> None:
        await self._on.run(self._sync.rollback)
