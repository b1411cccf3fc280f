"""The asyncio MySQL store, on asyncmy: the claim algorithm of ``_store.py``, awaited.

It sends the very same statements (``_statements.py``), classifies errors with
the same rules (``_errors.py``), parses the same URLs (``_url.py``) and decides
with the same helpers (``_store.py``'s ``_decided``, ``_may_take_over``,
``_inserted``). What is written twice is the control flow of the claim, the
conflict retries and the Galera re-judging, sync there and awaited here: see
``docs/stores.md`` ("The asyncio MySQL store").
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from ..._errors import ConfigurationError, LeaseLost, StoreUnavailable
from ..._extras import optional
from ..._model import Claim, Intent, Record, State, record_from_row
from ..protocol import AsyncTransaction
from ..sql import AsyncSQLStore
from ..sql.dialect import (
    CLAIM_RETRIES,
    SQLStatement,
    StoreClock,
    check_clock,
    claim_busy,
    claim_params,
    owner_params,
    row_mapping,
    sweep_params,
)
from ._async_pool import AsyncPool
from ._errors import (
    DUPLICATE,
    LOCK_WAIT_TIMEOUT,
    error_code,
    is_conflict,
    is_contention,
    is_unavailable,
)
from ._statements import DEFAULT_TABLE, mysql_dialect, mysql_statements
from ._store import (
    _APPLY_RETRIES,
    _CONFLICT_BACKOFF,
    _CONFLICT_BACKOFF_MAX,
    _DEADLOCK_RETRIES,
    DEFAULT_LOCK_WAIT_TIMEOUT,
    _decided,
    _inserted,
    _may_take_over,
    rolled_back,
)
from ._url import connect_kwargs

T = TypeVar("T")


async def _pause(attempt: int) -> None:
    await asyncio.sleep(
        random.uniform(0, min(_CONFLICT_BACKOFF * 2**attempt, _CONFLICT_BACKOFF_MAX))
    )


async def retry_conflicts(run: Callable[[], Awaitable[T]]) -> T:
    """``_store.retry_conflicts``, awaited: only for statements judged on the current row."""
    for attempt in range(_DEADLOCK_RETRIES):
        try:
            return await run()
        except Exception as exc:
            if not is_conflict(exc):
                raise
        await _pause(attempt)
    msg = "the key store kept losing write conflicts (deadlock or Galera certification)"
    raise StoreUnavailable(msg)


def is_async_unavailable(exc: BaseException) -> bool:
    """:func:`is_unavailable`, plus a socket asyncmy lets through unwrapped (reset, EOF)."""
    return is_unavailable(exc) or isinstance(exc, (OSError, asyncio.IncompleteReadError))


class AsyncMySQLStore(AsyncSQLStore):
    """Key records in MySQL 8 or MariaDB, from asyncio (the asyncmy driver).

    Args:
        connect: a ``mysql://user:password@host:port/db`` URL, a dict of
            ``asyncmy.connect`` arguments, or a coroutine function returning a
            new asyncmy connection. The store keeps up to ``max_size`` of them,
            in autocommit.
        lock_wait_timeout: the longest (seconds) one of the store's statements
            waits on a row another transaction holds; a claim that times out
            answers 409 (as :class:`~idemflow.stores.mysql.MySQLStore`).
        timeout: connect timeout, and the longest wait for a free connection.
        clock: ``"database"`` (the default) or ``"caller"``, as for
            :class:`~idemflow.stores.mysql.MySQLStore`.

    Every decision is the sync store's, statement for statement; the caller's
    transaction is an :class:`~idemflow.transactions.AsyncmyTransaction`.
    """

    supports_single_commit = True
    #: Is the server a Galera node? Learnt by the first single-commit claim.
    _galera: bool | None = None
    #: Has a connection of this store reported ``wsrep_on=ON`` (a Galera node)?
    galera_seen = False

    def __init__(
        self,
        connect: str | Mapping[str, Any] | Callable[[], Awaitable[Any]],
        *,
        table: str = DEFAULT_TABLE,
        max_size: int = 8,
        lock_wait_timeout: int = DEFAULT_LOCK_WAIT_TIMEOUT,
        timeout: float = 5.0,
        clock: StoreClock = "database",
    ) -> None:
        if lock_wait_timeout < 1:
            msg = "lock_wait_timeout must be at least 1 second (InnoDB's minimum)"
            raise ConfigurationError(msg)
        clock = check_clock(clock)
        self.statements = mysql_statements(table, clock)
        self.lock_wait_timeout = int(lock_wait_timeout)
        self.pool = AsyncPool(self._causal(self._factory(connect, timeout)), max_size, timeout)
        super().__init__(
            mysql_dialect(table, clock),
            self.pool.connection,
            paramstyle="pyformat",
            is_unavailable=is_async_unavailable,
            is_lock_timeout=is_contention,
        )

    def _factory(
        self, connect: str | Mapping[str, Any] | Callable[[], Awaitable[Any]], timeout: float
    ) -> Callable[[], Awaitable[Any]]:
        if callable(connect):
            return connect
        with optional("idemflow.stores.mysql"):
            import asyncmy

        kwargs = {
            "connect_timeout": timeout,
            "init_command": f"SET SESSION innodb_lock_wait_timeout = {self.lock_wait_timeout}",
            "charset": "utf8mb4",
            **(connect_kwargs(connect) if isinstance(connect, str) else dict(connect)),
            "autocommit": True,
        }

        async def connect_new() -> Any:
            return await asyncmy.connect(**kwargs)

        return connect_new

    async def close(self) -> None:
        await self.pool.close()

    def _causal(self, factory: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        """New connections, causal on a Galera node (see ``MySQLStore._causal``)."""

        async def connect() -> Any:
            conn = await factory()
            async with conn.cursor() as cursor:
                await cursor.execute(self.statements.wsrep_on.pyformat)
                row = await cursor.fetchone()
                if row is not None and str(row[1]).upper() == "ON":
                    await cursor.execute("SET SESSION wsrep_sync_wait = 3")
                    self.galera_seen = True
            return conn

        return connect

    async def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> Claim:
        """A plain INSERT decides a new key; a guarded upsert decides a takeover."""
        params = claim_params(intent, lease_token, now, expires_at)
        if transaction is not None:
            return await self._claim_in_transaction(transaction, params)
        with self._translate():
            async with self.pool.connection() as conn:
                for _ in range(CLAIM_RETRIES):
                    row_id = await self._insert(conn, params)
                    if row_id is not None:
                        return Claim(owned=True, record=_inserted(intent, params, row_id))
                    row = await self._fetchone(conn, self.dialect.read_for_claim, params)
                    if row is None:  # released and purged in between: claim again
                        continue
                    if not _may_take_over(row, params):
                        return Claim(owned=False, record=record_from_row(row))
                    await self._take_over(conn, params)
                    current = await self._fetchone(conn, self.dialect.select, params)
                    return _decided(current, lease_token)
        raise claim_busy()

    async def _take_over(self, conn: Any, params: Mapping[str, Any]) -> None:
        try:
            await self._statement(conn, self.dialect.claim, params)
        except Exception as exc:
            if not is_conflict(exc):
                raise

    async def _insert(self, conn: Any, params: Mapping[str, Any]) -> int | None:
        """The new row's id, or None when the key exists (1062) or a conflict lost to it."""
        try:
            return await self._statement(conn, self.statements.insert, params)
        except Exception as exc:
            if error_code(exc) == DUPLICATE or is_conflict(exc):
                return None
            raise

    async def _statement(
        self, conn: Any, statement: SQLStatement, params: Mapping[str, Any]
    ) -> int:
        """Run a claiming statement; the id it inserted (0 if none). See ``MySQLStore``."""
        for attempt in range(_DEADLOCK_RETRIES):
            async with conn.cursor() as cursor:
                try:
                    await cursor.execute(statement.pyformat, statement.bind(params))
                except Exception as exc:
                    if is_conflict(exc) and attempt + 1 < _DEADLOCK_RETRIES:
                        await _pause(attempt)
                        continue
                    if error_code(exc) == LOCK_WAIT_TIMEOUT:
                        raise claim_busy() from exc
                    raise
                return int(cursor.lastrowid or 0)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _claim_in_transaction(
        self, transaction: AsyncTransaction, params: Mapping[str, Any]
    ) -> Claim:
        """Claim as a write of the caller's transaction, with locking reads (see ``MySQLStore``)."""
        bound = {**params, "lock_wait": self.lock_wait_timeout}
        with self._translate():
            await self._refuse_galera(transaction)
            await transaction.execute(self.statements.bound_lock_wait, bound)
            try:
                row = await self._insert_or_read(transaction, params)
                if row is not None and _may_take_over(row, params):
                    await transaction.execute(self.dialect.claim, params)
                    row = await transaction.fetchone(self.statements.select_current, params)
            except Exception as exc:
                if is_contention(exc):
                    raise claim_busy() from exc
                raise
            finally:
                await transaction.execute(self.statements.restore_lock_wait, {})
        return _decided(row, str(params["lease_token"]))

    async def _refuse_galera(self, transaction: AsyncTransaction) -> None:
        """Single-commit mode is refused on Galera (see ``MySQLStore._refuse_galera``)."""
        if self._galera is None:
            row = await transaction.fetchone(self.statements.wsrep_on, {})
            self._galera = row is not None and str(row["Value"]).upper() == "ON"
        if self._galera:
            msg = (
                "single_commit is refused on Galera (wsrep_on=ON): a claim in your "
                "transaction is only certified at COMMIT, so two nodes could both run "
                "the handler; use the two-commit mode (the default)"
            )
            raise ConfigurationError(msg)

    async def _insert_or_read(
        self, transaction: AsyncTransaction, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        try:
            await transaction.execute(self.statements.insert, params)
        except Exception as exc:
            if error_code(exc) != DUPLICATE:
                raise
            return await transaction.fetchone(self.statements.select_shared, params)
        return await transaction.fetchone(self.statements.select_current, params)

    async def _write(
        self,
        statement: SQLStatement,
        params: Mapping[str, Any],
        transaction: AsyncTransaction | None,
    ) -> bool:
        """A fenced UPDATE; a conflict it loses is sent again (autocommit) or is a 503."""
        parent = super()._write
        if transaction is None:
            return await retry_conflicts(lambda: parent(statement, params, None))
        async with _rolled_back_is_503():
            if await parent(statement, params, transaction):
                return True
            if not self.galera_seen:
                return False
            # Galera: the claim may not be applied on this node yet (see MySQLStore._write).
            for attempt in range(_APPLY_RETRIES):
                await _pause(attempt + 3)
                if await parent(statement, params, transaction):
                    return True
            return False

    async def purge(self, now: float, limit: int) -> int:
        """Delete up to ``limit`` records past retention, again if it loses a conflict."""
        parent = super().purge
        return await retry_conflicts(lambda: parent(now, limit))

    async def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        """Record progress; an identical checkpoint in the same millisecond is not a loss."""
        params = {**owner_params(record, now), "recovery_point": recovery_point}
        if await self._write(self.dialect.checkpoint, params, transaction):
            return
        if not await self._still_owned(params, transaction):
            raise LeaseLost("the claim on this Idempotency-Key was taken over")

    async def _still_owned(
        self, params: Mapping[str, Any], transaction: AsyncTransaction | None
    ) -> bool:
        statement = self.statements.still_owned
        with self._translate():
            if transaction is not None:
                async with _rolled_back_is_503():
                    return await transaction.fetchone(statement, params) is not None
            async with self.pool.connection() as conn:
                return await self._fetchone(conn, statement, params) is not None

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        """Mark up to ``limit`` stale claims with this sweep's token, then read them back."""
        params = {
            **sweep_params(from_state, cutoff, now, keep_until, limit),
            "sweep_token": secrets.token_hex(16),
        }
        return await retry_conflicts(lambda: self._mark(params))

    async def _mark(self, params: Mapping[str, Any]) -> list[Record]:
        with self._translate():
            async with self.pool.connection() as conn, conn.cursor() as cursor:
                marked = await cursor.execute(
                    self.dialect.sweep.pyformat, self.dialect.sweep.bind(params)
                )
                if not marked:
                    return []
                swept = self.statements.swept
                await cursor.execute(swept.pyformat, swept.bind(params))
                rows = await cursor.fetchall()
                return [record_from_row(row_mapping(cursor.description, r)) for r in rows]


@asynccontextmanager
async def _rolled_back_is_503() -> AsyncIterator[None]:
    try:
        yield
    except Exception as exc:
        if is_conflict(exc):
            raise rolled_back() from exc
        raise
