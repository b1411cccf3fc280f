"""
The demo on MySQL 8 or MariaDB: keys, payments and refunds in one database, on asyncmy.

The key store is :class:`idemflow.stores.mysql.AsyncMySQLStore` with its own
pool; the endpoints' transactions run on a second pool of the demo's
(:class:`MySQLPool`), and the completion joins them through
:class:`idemflow.transactions.AsyncmyTransaction`. Two pools, because the
store takes a URL (or a connection factory), not a pool to share as
PostgreSQL's does; a request still holds at most one connection at any
moment (the claim's is back in the store's pool before the endpoint's
transaction takes one of these).

Claims commit on their own (two-commit mode): the claim, then the payment's
phases, each committing its rows with its recovery point, the last one with
the completion.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from idemflow import ConfigurationError
from idemflow.stores.mysql import DEFAULT_LOCK_WAIT_TIMEOUT, closed_by_server
from idemflow.stores.protocol import AsyncTransaction, Statement

from .db import KEY_TABLE, Connection, RowsConnection, pyformat

__all__ = ["MYSQL_SCHEMA", "MySQLConnection", "MySQLDatabase", "MySQLPool", "PoolTimeout"]

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

#: The endpoints' sessions, set on each new connection:
#:
#: - a statement waits at most the key store's lock wait for a row another
#:   transaction holds (InnoDB's default is 50 s), then fails: a 503, rolled
#:   back and released. A transaction stuck behind a lock keeps its own locks
#:   meanwhile, and the key store's claims queue behind those: with 50 s, one
#:   partition's stuck COMMIT left the store's pool exhausted for half a minute;
#: - READ COMMITTED: no gap locks (REPEATABLE READ's next-key locks on the
#:   payments' indexes made unrelated payments wait on each other). The
#:   payment code writes before it reads, and the completion is a locking
#:   UPDATE: both levels keep its guarantees (``docs/stores.md``).
SESSION = (
    f"SET SESSION innodb_lock_wait_timeout = {DEFAULT_LOCK_WAIT_TIMEOUT}",
    "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
)


class PoolTimeout(Exception):
    """Every connection of the demo's MySQL pool stayed busy: a 503, retried later."""


class MySQLConnection:
    """One pooled asyncmy connection; ``broken`` once anything failed on it."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        #: A statement failed or was cancelled on it: its session state, or
        #: where its socket stands in the protocol, is unknown. Never reused.
        self.broken = False
        #: Gives its pool slot back (set while it is checked out).
        self.give_slot_back: Callable[[], None] = lambda: None

    def mark_broken(self) -> None:
        """Close it now and give its slot back at once, not when the request ends.

        A request whose connection failed still holds it until it is done,
        and what it does next may take long: the release of its claim goes
        through the key store's own pool, three times 5 s at worst when that
        pool is busy too (``idemflow``'s driver). Meanwhile the slot would be
        taken by a connection nobody can use; after a partition, every slot
        at once.
        """
        if not self.broken:
            self.broken = True
            self.raw.close()  # abrupt: nothing is sent on a socket in an unknown state
            self.give_slot_back()


class MySQLPool:
    """Autocommit asyncmy connections, one request at a time, never reused after an error.

    asyncmy's own pool cannot be told that a connection saw an error (a reset
    mid-statement, a cancelled query), so this one keeps the rules the key
    store's pool keeps: such a connection is closed, and the next request
    opens a fresh one; an idle one the server closed is not handed out.
    """

    def __init__(self, kwargs: Mapping[str, Any], size: int, *, timeout: float = 5.0) -> None:
        self._kwargs = {
            "connect_timeout": timeout,
            "charset": "utf8mb4",
            **kwargs,
            "client_flag": int(kwargs.get("client_flag", 0)) | _FOUND_ROWS,
            "autocommit": True,
        }
        self._size = size
        self._timeout = timeout
        self._idle: list[MySQLConnection] = []
        self._slots: asyncio.Semaphore | None = None

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[MySQLConnection]:
        slots = self._slots = self._slots or asyncio.Semaphore(self._size)
        try:
            await asyncio.wait_for(slots.acquire(), self._timeout)
        except TimeoutError:
            msg = f"all {self._size} MySQL connections of the demo busy for {self._timeout:g}s"
            raise PoolTimeout(msg) from None
        released = False

        def give_slot_back() -> None:
            nonlocal released
            if not released:
                released = True
                slots.release()

        try:
            pooled = self._take_idle() or await self._connect()
            pooled.give_slot_back = give_slot_back
            try:
                yield pooled
            except BaseException:
                pooled.mark_broken()
                raise
            finally:
                pooled.give_slot_back = lambda: None
                await self._give_back(pooled)
        finally:
            give_slot_back()

    def _take_idle(self) -> MySQLConnection | None:
        """The connection given back last that the server has not closed since.

        A restart (or ``KILL``) ends every idle connection at once; each would be one
        refused request. One poll of its socket tells, no round trip: such a
        connection is closed here and the next one tried.
        """
        while self._idle:
            pooled = self._idle.pop()
            if not closed_by_server(pooled.raw):
                return pooled
            pooled.raw.close()
        return None

    async def _connect(self) -> MySQLConnection:
        import asyncmy

        raw = await asyncmy.connect(**self._kwargs)
        try:
            async with raw.cursor() as cursor:
                for statement in SESSION:
                    await cursor.execute(statement)
        except BaseException:
            raw.close()
            raise
        return MySQLConnection(raw)

    async def _give_back(self, pooled: MySQLConnection) -> None:
        if not pooled.broken and pooled.raw.get_transaction_status():
            try:  # an error left a transaction open: never hand that on
                await pooled.raw.rollback()
            except Exception:  # noqa: BLE001 -- broken after all: closed below
                pooled.mark_broken()
        if pooled.broken or not pooled.raw.connected:
            pooled.mark_broken()
            return
        self._idle.append(pooled)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for pooled in idle:
            try:
                await pooled.raw.ensure_closed()
            except Exception:  # noqa: BLE001 -- already broken: nothing left to release
                pooled.raw.close()


class _Guarded:
    """A block that marks the pooled connection broken when it fails (or is cancelled)."""

    def __init__(self, pooled: MySQLConnection) -> None:
        self.pooled = pooled

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.pooled.mark_broken()


class MySQLTransaction(AsyncTransaction):
    """:class:`~idemflow.transactions.AsyncmyTransaction` on a pooled connection.

    The same statements; a failure also marks the connection broken, so the
    pool closes it instead of handing it to the next request.
    ``connection`` is the :class:`MySQLConnection` (what the handler wraps).
    """

    connection: Any = None  # set per instance (the protocol declares it read-only)

    def __init__(self, pooled: MySQLConnection) -> None:
        from idemflow.transactions import AsyncmyTransaction

        self.connection = pooled
        self._inner = AsyncmyTransaction(pooled.raw)
        self._guard = _Guarded(pooled)

    async def begin(self) -> None:
        with self._guard:
            await self._inner.begin()

    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        with self._guard:
            return await self._inner.execute(statement, params)

    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        with self._guard:
            return await self._inner.fetchone(statement, params)

    async def commit(self) -> None:
        with self._guard:
            await self._inner.commit()

    async def rollback(self) -> None:
        with self._guard:
            await self._inner.rollback()


class _AsyncmyConnection(RowsConnection):
    """Business SQL on a pooled asyncmy connection, ``:name`` placeholders."""

    def __init__(self, pooled: MySQLConnection) -> None:
        self.pooled = pooled
        self._guard = _Guarded(pooled)

    async def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        with self._guard:
            async with self.pooled.raw.cursor() as cursor:
                return int(await cursor.execute(pyformat(sql), params or None))

    async def _rows(
        self, sql: str, params: Mapping[str, Any] | None, *, one: bool
    ) -> list[dict[str, Any]]:
        with self._guard:
            async with self.pooled.raw.cursor() as cursor:
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
            import asyncmy  # noqa: F401 -- the driver both pools need

            from idemflow.stores.mysql import AsyncMySQLStore, MySQLStore, connect_kwargs
        except ImportError as exc:  # pragma: no cover - depends on the install
            msg = "MySQL needs the driver: pip install 'idemflow[mysql]'"
            raise ConfigurationError(msg) from exc
        self.url = url.replace("mariadb://", "mysql://", 1)
        self.store = AsyncMySQLStore(self.url, table=KEY_TABLE, max_size=pool_size)
        self.pool = MySQLPool(connect_kwargs(self.url, "asyncmy"), pool_size)  # asyncmy.connect
        self._sync_store = MySQLStore
        self._stats: Any = None

    def connect(self) -> AbstractAsyncContextManager[MySQLConnection]:
        return self.pool.connection()

    def transaction(self, raw: Any) -> AsyncTransaction:
        return MySQLTransaction(raw)

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
        await self.pool.close()
        await self.store.close()
