"""
The demo's database: key store, payments and refunds.

Where both live in the same database the payment row and the ``completed``
key record commit in one transaction: SQLite (the default, a file under the
data folder), PostgreSQL and MySQL/MariaDB (:mod:`idemflow_demo.db_mysql`).
With Redis (:mod:`idemflow_demo.db_redis`) the keys live in Redis and the
payments in an embedded SQLite file, with no transaction shared between them
(:attr:`Database.transactional` is False: see :mod:`idemflow_demo.unshared`).
The business SQL is written once with ``:name`` placeholders and run through a
small async :class:`Connection`.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol, cast

from idemflow import ConfigurationError
from idemflow.stores.protocol import AsyncStore, AsyncTransaction
from idemflow.stores.sqlite import AsyncSQLiteStore, connect
from idemflow.transactions import (
    AsyncPsycopgTransaction,
    AsyncSQLite3Connection,
    AsyncSQLite3Transaction,
)

__all__ = [
    "CLAIM_COMMITS",
    "KEY_TABLE",
    "SCHEMA",
    "Connection",
    "Database",
    "PostgresDatabase",
    "RowsConnection",
    "SQLiteConnection",
    "SQLiteDatabase",
    "SQLitePayments",
    "SQLitePool",
    "create_schema_sqlite",
    "pyformat",
]

KEY_TABLE = "idemflow_keys"

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS payments (
        id TEXT PRIMARY KEY,
        intent_ref TEXT UNIQUE,
        principal TEXT NOT NULL,
        amount BIGINT NOT NULL,
        currency TEXT NOT NULL,
        customer TEXT NOT NULL,
        status TEXT NOT NULL,
        charge_id TEXT,
        refunded BIGINT NOT NULL DEFAULT 0,
        created_at DOUBLE PRECISION NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS payments_principal ON payments (principal, created_at)",
    """CREATE TABLE IF NOT EXISTS refunds (
        id TEXT PRIMARY KEY,
        payment_id TEXT NOT NULL REFERENCES payments (id),
        principal TEXT NOT NULL,
        amount BIGINT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL
    )""",
)

_NAMED = re.compile(r"(?<![:\w]):([a-z_]+)")


class Connection(Protocol):
    """What the payment code needs of a connection: named-parameter SQL, awaited."""

    async def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> int: ...
    async def fetchone(
        self, sql: str, params: Mapping[str, Any] | None = None
    ) -> dict[str, Any] | None: ...
    async def fetchall(
        self, sql: str, params: Mapping[str, Any] | None = None
    ) -> list[dict[str, Any]]: ...


class Database(Protocol):
    """One database holding the key table and the business tables."""

    @property
    def store(self) -> AsyncStore: ...

    @property
    def single_commit(self) -> bool:
        """Can the claim join the endpoint's transaction (PostgreSQL)?"""

    @property
    def transactional(self) -> bool:
        """Do the key records and the business rows commit in one transaction?

        False for Redis: the completion is written after the business rows
        committed, on the store's own connection (the no-transaction mode).
        """

    def connect(self) -> AbstractAsyncContextManager[Any]:
        """A raw driver connection from the pool (autocommit)."""

    def transaction(self, raw: Any) -> AsyncTransaction:
        """The idemflow transaction adapter for a raw connection."""

    def wrap(self, raw: Any) -> Connection:
        """The raw connection as a :class:`Connection` for business SQL."""

    def side_store(self) -> Any:
        """A synchronous store on the same keys, on a connection of its own: the
        stuck-claims gauge and /healthz read through it."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...


# --- SQLite -----------------------------------------------------------------------------------


class SQLiteConnection:
    """Business SQL on an :class:`~idemflow.transactions.AsyncSQLite3Connection`.

    Its statements take their turn on the connection's own thread with the
    completion's (never a shared pool: see there why).
    """

    def __init__(self, pooled: AsyncSQLite3Connection) -> None:
        self.pooled = pooled

    async def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        return await self.pooled.run(_sqlite_execute, self.pooled.raw, sql, params)

    async def fetchone(
        self, sql: str, params: Mapping[str, Any] | None = None
    ) -> dict[str, Any] | None:
        rows = await self.pooled.run(_sqlite_rows, self.pooled.raw, sql, params, 1)
        return rows[0] if rows else None

    async def fetchall(
        self, sql: str, params: Mapping[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        return await self.pooled.run(_sqlite_rows, self.pooled.raw, sql, params, None)


def _sqlite_execute(raw: sqlite3.Connection, sql: str, params: Mapping[str, Any] | None) -> int:
    return raw.execute(sql, params or {}).rowcount


def _sqlite_rows(
    raw: sqlite3.Connection, sql: str, params: Mapping[str, Any] | None, limit: int | None
) -> list[dict[str, Any]]:
    cursor = raw.execute(sql, params or {})
    rows = cursor.fetchall() if limit is None else cursor.fetchmany(limit)
    names = [column[0] for column in cursor.description]
    return [dict(zip(names, row, strict=True)) for row in rows]


class SQLitePool:
    """A few autocommit sqlite3 connections to one file, handed out one request at a time."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self._size = size
        self._idle: asyncio.Queue[AsyncSQLite3Connection] | None = None
        self._all: list[AsyncSQLite3Connection] = []

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncSQLite3Connection]:
        idle = self._queue()
        pooled = await idle.get()
        try:
            yield pooled
        finally:
            if pooled.raw.in_transaction:  # an error left it open: never hand that on
                await pooled.run(pooled.raw.rollback)
            idle.put_nowait(pooled)

    def _queue(self) -> asyncio.Queue[AsyncSQLite3Connection]:
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self._size):
                pooled = AsyncSQLite3Connection(connect(self.path, busy_timeout=10.0))
                self._all.append(pooled)
                self._idle.put_nowait(pooled)
        return self._idle

    def close(self) -> None:
        for pooled in self._all:
            pooled.close()
        self._all.clear()
        self._idle = None


class SQLitePayments:
    """The payments in a SQLite file at ``path`` on ``pool``, whatever holds the keys
    (:class:`SQLiteDatabase` the same file, ``RedisDatabase`` a Redis): one definition
    for both of the connections, the transaction and the start-up."""

    path: Path
    pool: SQLitePool
    store: Any  # the key store (open migrates it): SQLite's or Redis's

    def connect(self) -> AbstractAsyncContextManager[AsyncSQLite3Connection]:
        """A connection to the payments' SQLite file."""
        return self.pool.connection()

    def transaction(self, raw: Any) -> AsyncTransaction:
        # Deferred: SQLite's write lock is taken at the first write, so a
        # phase that waits on the provider holds no lock.
        return AsyncSQLite3Transaction(raw)

    def wrap(self, raw: Any) -> Connection:
        return SQLiteConnection(raw)

    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        await self.store.migrate()
        async with self.connect() as pooled:
            await pooled.run(create_schema_sqlite, pooled.raw)


class SQLiteDatabase(SQLitePayments):
    """Keys and payments in one SQLite file (WAL)."""

    # One writer at a time: a claim held in an open transaction would queue
    # every duplicate behind it instead of answering 409.
    single_commit = False
    transactional = True

    def __init__(self, path: Path, *, pool_size: int = 8) -> None:
        self.path = path
        self.store = AsyncSQLiteStore(path, table=KEY_TABLE, busy_timeout=10.0)
        self.pool = SQLitePool(path, pool_size)

    def side_store(self) -> Any:
        return self.store.sync

    async def close(self) -> None:
        self.pool.close()


def create_schema_sqlite(raw: sqlite3.Connection) -> None:
    for statement in SCHEMA:
        raw.execute(statement)


# --- PostgreSQL -------------------------------------------------------------------------------


class RowsConnection:
    """``fetchone`` and ``fetchall`` of a :class:`Connection` over one ``_rows``: the
    shape the PostgreSQL and MySQL wrappers share (each reads its own driver's rows)."""

    async def fetchone(
        self, sql: str, params: Mapping[str, Any] | None = None
    ) -> dict[str, Any] | None:
        rows = await self._rows(sql, params, one=True)
        return rows[0] if rows else None

    async def fetchall(
        self, sql: str, params: Mapping[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        return await self._rows(sql, params, one=False)

    async def _rows(
        self, sql: str, params: Mapping[str, Any] | None, *, one: bool
    ) -> list[dict[str, Any]]:
        """The first row only (``one``) or all of them, as mappings."""
        raise NotImplementedError


class _PsycopgConnection(RowsConnection):
    """A psycopg AsyncConnection speaking ``:name`` placeholders."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    async def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        cursor = await self.raw.execute(pyformat(sql), params or None)
        return int(cursor.rowcount)

    async def _rows(
        self, sql: str, params: Mapping[str, Any] | None, *, one: bool
    ) -> list[dict[str, Any]]:
        cursor = await self.raw.execute(pyformat(sql), params or None)
        rows: Sequence[Any] = [await cursor.fetchone()] if one else await cursor.fetchall()
        names = [column.name for column in cursor.description or ()]
        return [dict(zip(names, row, strict=True)) for row in rows if row is not None]


def pyformat(sql: str) -> str:
    return _NAMED.sub(r"%(\1)s", sql)


#: How the claim commits on PostgreSQL: ``own`` in a commit of its own (the
#: default); ``single`` as the first statement of the endpoint's first
#: transaction (single-commit mode: one commit fewer, but concurrent replays
#: of one key then queue on its row lock, and some answer 409 under load).
CLAIM_COMMITS = ("own", "single")


class PostgresDatabase:
    """Keys and payments in PostgreSQL.

    The store and the endpoints share one pool. That is safe because a
    protected request holds at most one pooled connection at any moment: the
    claim runs before the endpoint's transaction takes its connection; the
    handler's reads and writes, every checkpoint, the completion and (after a
    rollback) the release run on that transaction's connection; the replay's
    authorization read runs after it was given back. A second checkout while
    one is held would deadlock a small pool under load (every request holding
    one, waiting for another).
    """

    def __init__(self, url: str, *, pool_size: int = 8, claim_commit: str = "own") -> None:
        try:
            import psycopg_pool

            from idemflow.stores.postgres import AsyncPostgresStore
        except ImportError as exc:  # pragma: no cover - depends on the install
            msg = "PostgreSQL needs the driver: pip install 'idemflow[postgres]'"
            raise ConfigurationError(msg) from exc
        if claim_commit not in CLAIM_COMMITS:
            msg = f"claim_commit must be one of {', '.join(CLAIM_COMMITS)}"
            raise ConfigurationError(msg)
        self.url = url.replace("postgres://", "postgresql://", 1)
        self.single_commit = claim_commit == "single"
        self.transactional = True
        self.pool = psycopg_pool.AsyncConnectionPool(
            self.url,
            min_size=1,
            max_size=pool_size,
            kwargs=_connection_options(self.url, bounded_locks=self.single_commit),
            open=False,
            timeout=5.0,
        )
        self.store = AsyncPostgresStore(self.pool, table=KEY_TABLE)
        self._stats: Any = None
        # The store's checkout of the pool: a request's transaction taken from it is
        # one the store recognises, so the claim runs on that connection too (one
        # checkout per request), and never on one a restart of the server closed.
        self.connect: Callable[[], AbstractAsyncContextManager[Any]] = self.store.connection

    def transaction(self, raw: Any) -> AsyncTransaction:
        # cast: the adapter takes the concrete Statement the protocol abstracts.
        return cast("AsyncTransaction", AsyncPsycopgTransaction(raw))

    def wrap(self, raw: Any) -> Connection:
        return _PsycopgConnection(raw)

    def side_store(self) -> Any:
        from idemflow.stores.postgres import PostgresStore

        if self._stats is None:  # one connection: the gauge's COUNT, /healthz's lookup
            import psycopg_pool

            pool = psycopg_pool.ConnectionPool(
                self.url,
                min_size=1,
                max_size=1,
                kwargs=_connection_options(self.url, bounded_locks=False),
                open=True,
                timeout=5.0,  # /healthz reads here: a database down answers 503 soon
            )
            self._stats = PostgresStore(pool, table=KEY_TABLE)
        return self._stats

    async def open(self) -> None:
        # No wait for the pool to fill: a timed-out wait closes the pool for good,
        # and the start tries again while the database is unavailable
        # (``DemoService._open_database``); the migration's checkout waits instead.
        await self.pool.open()
        await self.store.migrate()
        async with self.pool.connection() as raw, raw.transaction():
            # Serialise concurrent demo starts on one database.
            await raw.execute("SELECT pg_advisory_xact_lock(4242)")
            for statement in SCHEMA:
                await raw.execute(statement)

    async def close(self) -> None:
        if self._stats is not None:
            self._stats.close()
        await self.pool.close()


def _connection_options(url: str, *, bounded_locks: bool) -> dict[str, Any]:
    """Autocommit connections; with ``bounded_locks``, the store's lock timeout too.

    The bound matters in single-commit mode, where a duplicate would otherwise
    wait for another request's uncommitted claim. With claims committed on
    their own a claim only ever waits for a statement or a completion to
    finish (milliseconds), and a bound would turn concurrent replays of one
    key into 409s under load. ``options`` given as a keyword would replace the
    URL's own (a ``search_path``, say): they are joined instead.
    """
    from idemflow.stores.postgres import connection_options

    if not bounded_locks:
        return {"autocommit": True}
    return connection_options(conninfo=url)
