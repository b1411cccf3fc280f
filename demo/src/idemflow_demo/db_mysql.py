"""
The demo on MySQL 8 or MariaDB: keys, payments and refunds in one database, on asyncmy.

The key store is :class:`idemflow.stores.mysql.AsyncMySQLStore`; the endpoints'
transactions run on connections of its pool, and the completion joins them
through :class:`idemflow.transactions.AsyncmyTransaction`. Claims commit on
their own (two-commit mode): the claim, then the payment's phases, each
committing its rows with its recovery point, the last one with the completion.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from idemflow import ConfigurationError
from idemflow.stores.protocol import AsyncTransaction
from idemflow.transactions import AsyncmyTransaction

from .db import KEY_TABLE, Connection, RowsConnection, pyformat

__all__ = ["MYSQL_SCHEMA", "MySQLDatabase"]

#: The PostgreSQL backend's tables in MySQL's dialect: ``TEXT`` cannot be a
#: key, indexes are declared in the table (MySQL 8 has no ``CREATE INDEX IF
#: NOT EXISTS``), and the foreign key is a table constraint (MySQL ignores
#: one written on the column).
MYSQL_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS payments (
        id VARCHAR(64) NOT NULL PRIMARY KEY,
        intent_ref VARCHAR(255) UNIQUE,
        principal VARCHAR(255) NOT NULL,
        amount BIGINT NOT NULL,
        currency VARCHAR(3) NOT NULL,
        customer VARCHAR(255) NOT NULL,
        status VARCHAR(16) NOT NULL,
        charge_id VARCHAR(64),
        refunded BIGINT NOT NULL DEFAULT 0,
        created_at DOUBLE NOT NULL,
        INDEX payments_principal (principal, created_at)
    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin""",
    """CREATE TABLE IF NOT EXISTS refunds (
        id VARCHAR(64) NOT NULL PRIMARY KEY,
        payment_id VARCHAR(64) NOT NULL,
        principal VARCHAR(255) NOT NULL,
        amount BIGINT NOT NULL,
        created_at DOUBLE NOT NULL,
        FOREIGN KEY (payment_id) REFERENCES payments (id)
    ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin""",
)

#: ``CLIENT_FOUND_ROWS``: an UPDATE counts the rows it matched, as SQLite and
#: PostgreSQL do, not only those it changed.
_FOUND_ROWS = 2

#: Set once on each connection the endpoints take: no gap locks (REPEATABLE READ's
#: next-key locks on the payments' indexes made unrelated payments wait on each
#: other). The payment code writes before it reads, and the completion is a locking
#: UPDATE: both levels keep its guarantees (``docs/stores.md``). The store's own
#: statements are right under either.
_READ_COMMITTED = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED"


class _AsyncmyConnection(RowsConnection):
    """Business SQL on a pooled asyncmy connection, ``:name`` placeholders."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    async def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        async with self.raw.cursor() as cursor:
            return int(await cursor.execute(pyformat(sql), params or None))

    async def _rows(
        self, sql: str, params: Mapping[str, Any] | None, *, one: bool
    ) -> list[dict[str, Any]]:
        async with self.raw.cursor() as cursor:
            await cursor.execute(pyformat(sql), params or None)
            rows = [await cursor.fetchone()] if one else list(await cursor.fetchall())
            names = [column[0] for column in cursor.description or ()]
        return [dict(zip(names, row, strict=True)) for row in rows if row is not None]


class MySQLDatabase:
    """Keys and payments in MySQL 8 or MariaDB (two-commit mode)."""

    single_commit = False
    transactional = True

    def __init__(self, url: str, *, pool_size: int = 8) -> None:
        try:
            import asyncmy  # noqa: F401 -- the store's driver

            from idemflow.stores.mysql import AsyncMySQLStore, MySQLStore, connect_kwargs
        except ImportError as exc:  # pragma: no cover - depends on the install
            msg = "MySQL needs the driver: pip install 'idemflow[mysql]'"
            raise ConfigurationError(msg) from exc
        self.url = url.replace("mariadb://", "mysql://", 1)
        options = connect_kwargs(self.url, "asyncmy")
        options["client_flag"] = int(options.get("client_flag", 0)) | _FOUND_ROWS
        self.store = AsyncMySQLStore(options, table=KEY_TABLE, max_size=pool_size)
        # The endpoints' connections: the library's pool too, a second store's. Not the
        # key store's own: MySQL's claim takes no connection of the request's, so the
        # release after a failed transaction needs a free one while that one is held.
        self._endpoints = AsyncMySQLStore(options, table=KEY_TABLE, max_size=pool_size)
        self._read_committed: weakref.WeakSet[Any] = weakref.WeakSet()
        self._sync_store = MySQLStore
        self._stats: Any = None

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[Any]:
        async with self._endpoints.pool.connection() as raw:
            if raw not in self._read_committed:
                async with raw.cursor() as cursor:
                    await cursor.execute(_READ_COMMITTED)
                self._read_committed.add(raw)
            yield raw

    def transaction(self, raw: Any) -> AsyncTransaction:
        return AsyncmyTransaction(raw)

    def wrap(self, raw: Any) -> Connection:
        return _AsyncmyConnection(raw)

    def side_store(self) -> Any:
        if self._stats is None:  # PyMySQL, one connection: the gauge's COUNT, /healthz's lookup
            self._stats = self._sync_store(self.url, table=KEY_TABLE, max_size=1)
        return self._stats

    async def open(self) -> None:
        await self.store.migrate()
        async with self.connect() as pooled:
            business = self.wrap(pooled)
            for statement in MYSQL_SCHEMA:
                # Concurrent starts on one database: IF NOT EXISTS makes each a no-op.
                await business.execute(statement)

    async def close(self) -> None:
        if self._stats is not None:
            with contextlib.suppress(Exception):
                self._stats.close()
        await self._endpoints.close()
        await self.store.close()
