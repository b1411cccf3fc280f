"""PostgreSQL: the production store, on psycopg 3's autocommit connections (a claim is one
round trip). A SQLAlchemy ``Connection`` or ``Session`` still takes the completion:
[`idemflow.transactions`][idemflow.transactions].
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..._errors import driver_error
from ..._extras import optional
from ..._model import Policy
from ..protocol import StoreClock, check_clock
from ..sql import (
    PURGEABLE_SQL,
    AsyncSQLStore,
    Dialect,
    SQLStore,
    Statement,
    create_table,
    insert_claim,
    on_database_clock,
)
from ..sql.dialect import claim_or_read, upgrade_table
from ._async import AsyncLiveConnection
from ._async import bounded_connection_class as async_bounded_connection_class
from ._sync import LiveConnection, bounded_connection_class

if TYPE_CHECKING:
    import psycopg_pool  # noqa: F401 -- named (as text) by the stores' base classes

    from ..._model import Claim

__all__ = [
    "AsyncPostgresStore",
    "PostgresStore",
    "connection_options",
    "is_unavailable",
]

DEFAULT_TABLE = "idemflow_keys"
_Pool = TypeVar("_Pool")

# Single-commit mode: the longest wait on a duplicate's uncommitted claim before a 409.
DEFAULT_CLAIM_LOCK_TIMEOUT_MS = 50

# Serialises concurrent `idemflow migrate` runs (CREATE … IF NOT EXISTS races).
_MIGRATE_LOCK = 0x1DE3F10
#: How long a migration waits for a lock (a busy table's writers, another migration).
MIGRATE_LOCK_TIMEOUT_S = 60

#: The server's time in epoch milliseconds, one value per statement.
SERVER_NOW_MS = "CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS BIGINT)"


def postgres_dialect(
    table: str = DEFAULT_TABLE,
    claim_lock_timeout_ms: int = DEFAULT_CLAIM_LOCK_TIMEOUT_MS,
    clock: StoreClock = "database",
) -> Dialect:
    table_ddl = create_table(
        table,
        id_column="id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
        bigint="BIGINT",
        blob="BYTEA",
        unique=f"CONSTRAINT {table}_principal_key UNIQUE",
    )

    # The connections' lock_timeout bounds a claim's wait, not a migration's.
    def locked(statements: list[str]) -> list[str]:
        return [
            "BEGIN",
            f"SET LOCAL lock_timeout = '{MIGRATE_LOCK_TIMEOUT_S}s'",
            f"SELECT pg_advisory_xact_lock({_MIGRATE_LOCK})",
            *statements,
            "COMMIT",
        ]

    around = (
        [f"SET LOCAL lock_timeout = '{int(claim_lock_timeout_ms)}ms'"],
        ["SET LOCAL lock_timeout = DEFAULT"],
    )
    standard = Dialect.standard(
        "postgresql",
        table,
        locked(table_ddl),
        insert_claim(table),
        around,
        skip_locked=True,
        upgrade=locked(upgrade_table(table, "BIGINT")),
    )
    # One bounded batch of expired records, found through the expiry index and deleted by
    # TID scan (``id IN (subquery)`` hash-joined a full scan per batch); the expiry and state
    # are tested again on the deleted version (``+ 0``: not a second index scan).
    purge = Statement(
        f"DELETE FROM {table} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {table} "
        f"WHERE expires_at <= :now AND {PURGEABLE_SQL} "
        "ORDER BY expires_at LIMIT :limit FOR UPDATE SKIP LOCKED)) "
        f"AND expires_at + 0 <= :now AND {PURGEABLE_SQL}"
    )
    # A replay is one round trip: the claim and the read of the record it lost to.
    combined = Statement(claim_or_read(table, insert_claim(table)))
    dialect = dataclasses.replace(standard, purge=purge, claim_or_read=combined)
    return on_database_clock(dialect, SERVER_NOW_MS) if clock == "database" else dialect


def connection_options(
    claim_lock_timeout_ms: int = DEFAULT_CLAIM_LOCK_TIMEOUT_MS, conninfo: str = ""
) -> dict[str, Any]:
    """Autocommit connections whose lock waits are bounded (a claim meeting another's
    uncommitted claim answers 409), keeping ``conninfo``'s options: for a pool of yours."""
    with optional("idemflow.stores.postgres"):
        from psycopg.conninfo import conninfo_to_dict

    bound = f"-c lock_timeout={int(claim_lock_timeout_ms)}"
    own = conninfo_to_dict(conninfo).get("options") if conninfo else None
    return {"autocommit": True, "options": f"{own} {bound}" if own else bound}


def is_lock_timeout(exc: BaseException) -> bool:
    """SQLSTATE 55P03, raised by psycopg directly or wrapped (SQLAlchemy, Django)."""
    original = driver_error(exc)
    return getattr(original, "sqlstate", None) == "55P03"


def is_unavailable(exc: BaseException) -> bool:
    """Connection refused or lost, pool exhausted: an outage (fail closed), raised by psycopg
    directly or wrapped (SQLAlchemy, Django)."""
    import psycopg

    original = driver_error(exc)
    return isinstance(original, psycopg.OperationalError | psycopg.InterfaceError)


def _claims_alone_on(connection: Any) -> bool:
    """Does a statement on ``connection`` commit on its own now (autocommit, no transaction)?"""
    from psycopg.pq import TransactionStatus

    status = connection.info.transaction_status
    return bool(connection.autocommit) and status == TransactionStatus.IDLE


class _Postgres(Generic[_Pool]):
    """What both PostgreSQL stores are made of: the pool (made from a conninfo string:
    opened now if sync), and the SQL executor on its checkouts, bounded by the store's wait."""

    pool: _Pool
    _asynchronous: bool

    def __init__(
        self,
        pool: _Pool | str,
        *,
        table: str = DEFAULT_TABLE,
        max_size: int = 16,
        claim_lock_timeout_ms: int = DEFAULT_CLAIM_LOCK_TIMEOUT_MS,
        clock: StoreClock = "database",
        policy: Policy | None = None,
    ) -> None:
        self._store_wait = (policy or Policy()).store_wait_seconds
        store: Any = self  # a PostgresStore or an AsyncPostgresStore
        store.pool = pool
        if isinstance(pool, str):
            with optional("idemflow.stores.postgres"):
                import psycopg_pool

            asynchronous = self._asynchronous
            kind = psycopg_pool.AsyncConnectionPool if asynchronous else psycopg_pool.ConnectionPool
            bounded = async_bounded_connection_class if asynchronous else bounded_connection_class
            store.pool = kind(
                pool,
                min_size=1,
                max_size=max_size,
                kwargs=connection_options(claim_lock_timeout_ms, pool),
                # The store's wait without a free connection is an outage (503), not a queue.
                timeout=self._store_wait,
                connection_class=bounded(),
                open=not asynchronous,  # an async pool cannot open here: _OpeningConnection
            )
        super().__init__(  # type: ignore[call-arg]  # the SQL executor, next in the MRO
            connect=lambda: store._checkout(self._store_wait),
            dialect=postgres_dialect(table, claim_lock_timeout_ms, check_clock(clock)),
            paramstyle="pyformat",
            is_unavailable=is_unavailable,
            is_lock_timeout=is_lock_timeout,
            extra_params=True,
            # A request's transaction on this pool lends its connection to the claim.
            lend_sources=(store.connection, store.pool.connection),
            claims_alone_on=_claims_alone_on,
            # A migration waits for its locks (CREATE INDEX on a busy table), as no request may.
            migrate_connect=store.connection,
        )

    def cover_store_wait(self, seconds: float) -> None:
        """A driver's store wait: the store's own checkouts and statements wait no longer."""
        self._store_wait = min(self._store_wait, seconds)


class PostgresStore(_Postgres["psycopg_pool.ConnectionPool[Any]"], SQLStore):
    """Key records in PostgreSQL.

    Args:
        pool: a ``psycopg_pool.ConnectionPool`` of autocommit connections, or a conninfo
            string (``postgresql://…``) from which one is made with ``max_size``. A request
            whose transaction takes its connection from this pool
            (``pooled_transaction(store.pool.connection, …)``) claims on it too, in
            two-commit mode: one checkout per request.
        clock: ``"database"`` (the default) takes every time decision (stale, expired,
            retention) on the server's clock, so hosts whose clocks disagree cannot take
            over a live claim or an unexpired record; ``"caller"`` uses the ``now`` each
            call passes (tests with a frozen clock).
        policy: your app's policy: ``policy.store_wait_seconds`` (half the request
            timeout, at most 5 s) bounds the wait for a free connection and each of the
            store's own statements on it (a silent server: a 503 within it); yours, on
            your transaction's connection, wait as your own do. A pool you bring bounds
            them if made with ``connection_class=bounded_connection_class()``.
    """

    _asynchronous = False

    def connection(self) -> LiveConnection:
        """A connection of the store's pool, never one the server has closed. Given to the
        request's transaction, ``pooled_transaction(store.connection, …)``, it carries the
        claim too (one checkout per request)."""
        return self._checkout(None)

    def _checkout(self, store_wait: float | None) -> LiveConnection:
        """`connection`, its waits bounded by ``store_wait`` (the store's own)."""
        return LiveConnection(self.pool, store_wait)

    def close(self) -> None:
        self.pool.close()


class AsyncPostgresStore(_Postgres["psycopg_pool.AsyncConnectionPool[Any]"], AsyncSQLStore):
    """Key records in PostgreSQL, for asyncio code.

    Args:
        pool: a ``psycopg_pool.AsyncConnectionPool`` of autocommit connections,
            or a conninfo string from which one is made (opened on first use).
        clock: as for [`PostgresStore`][idemflow.stores.postgres.PostgresStore].
        policy: as for `PostgresStore` (a pool you bring: with
            ``connection_class=async_bounded_connection_class()``).
    """

    _asynchronous = True

    def connection(self) -> Any:
        """A connection of the store's pool (an async context manager), never one the
        server has closed; the pool is opened by its first use. As
        `PostgresStore.connection`, for ``pooled_transaction(store.connection, …)``."""
        return self._checkout(None)

    def _checkout(self, store_wait: float | None) -> Any:
        """`connection`, its waits bounded by ``store_wait`` (the store's own)."""
        if self.pool.closed:  # never yet opened (or closed): opened by the first use
            return _OpeningConnection(self.pool, store_wait)
        return AsyncLiveConnection(self.pool, store_wait)

    async def claim_on_lent(self, *args: Any, **kwargs: Any) -> Claim:
        """As the executor's, once the pool is open (the lent connection is taken from it)."""
        if self.pool.closed:
            await self.pool.open(wait=False)
        return await super().claim_on_lent(*args, **kwargs)

    async def close(self) -> None:
        await self.pool.close()


class _OpeningConnection(AsyncLiveConnection):
    """`AsyncLiveConnection` that opens the pool first if it is closed (never yet opened:
    an async pool cannot open in ``__init__``; or closed since)."""

    __slots__ = ()

    async def __aenter__(self) -> Any:
        if self._pool.closed:
            await self._pool.open(wait=False)
        return await super().__aenter__()
