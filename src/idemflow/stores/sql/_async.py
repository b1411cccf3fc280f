"""Run a [`Dialect`][idemflow.stores.sql.Dialect] on async DB-API connections: one store
operation per call, driver failures mapped to [`StoreUnavailable`][idemflow.StoreUnavailable].
This is the async source of truth; ``idemflow/stores/sql/_sync.py`` is generated
from it by ``scripts/unasync.py``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any, Literal, TypeAlias

from ..._errors import LeaseLost
from ..._model import (
    DEFAULT_STALE_SECONDS,
    Claim,
    Intent,
    Record,
    Response,
    State,
    can_take_over,
    make_claim,
)
from ..protocol import AsyncMaintainableStore, AsyncTransaction, Statement
from ._rows import Executor, RowShape, stale_params
from ._stats import AsyncSQLObservable, is_missing_table
from .dialect import (
    CLAIM_RETRIES,
    COLUMNS,
    Dialect,
    claim_params,
    claim_unsettled,
    complete_params,
    owner_params,
    record_from_values,
    sweep_params,
)

__all__ = ["AsyncSQLStore"]

#: A record statement's one row (a sequence) or None, and where the record sits in it.
_Fetched: TypeAlias = tuple[Any, RowShape]
_Fetch: TypeAlias = Callable[[Statement, Mapping[str, Any]], Awaitable[_Fetched]]
#: How a transaction adapter's row (a mapping) is laid out for record_from_values.
_LAID_OUT = (*COLUMNS, "clock_now", "claimed")
_LAID_OUT_SHAPE = RowShape(0, len(COLUMNS), len(COLUMNS) + 1)


class AsyncSQLStore(Executor, AsyncSQLObservable, AsyncMaintainableStore):
    """A key store on any SQL dialect, with connections from ``connect()``.

    Args:
        dialect: the statements to run.
        connect: returns an async context manager yielding an *autocommit*
            connection, e.g. ``psycopg_pool.AsyncConnectionPool.connection``.
        paramstyle: the driver's placeholder style.
        is_unavailable: the driver errors that mean "cannot reach the store" (a 503).
        is_lock_timeout: the error of a bounded wait on another's uncommitted claim (a 409).
        read_connect: connections for reads alone (`get`, stats); ``connect`` by default.
        extra_params: the driver ignores parameters a statement does not name (no copy).
        lend_sources: where the store's connections come from, for `claim_on_lent`.
        claims_alone_on: does a lent connection commit a statement on its own right now?
        migrate_connect: connections for `migrate` (waits no request's); ``connect`` by default.
    """

    supports_transactions = True
    renews_claims = True

    def __init__(
        self,
        dialect: Dialect,
        connect: Callable[[], AbstractAsyncContextManager[Any]],
        *,
        paramstyle: Literal["named", "pyformat"],
        is_unavailable: Callable[[BaseException], bool],
        is_lock_timeout: Callable[[BaseException], bool] = lambda exc: False,
        read_connect: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
        extra_params: bool = False,
        lend_sources: tuple[Any, ...] = (),
        claims_alone_on: Callable[[Any], bool] = lambda connection: False,
        migrate_connect: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
    ) -> None:
        self.dialect = dialect
        self._migrate_connect = migrate_connect or connect
        self._lend_sources = lend_sources
        self._claims_alone_on = claims_alone_on
        self._connect = connect
        self._read_connect = read_connect or connect
        self._extra_params = extra_params
        self._pyformat = paramstyle == "pyformat"
        self._is_unavailable = is_unavailable
        self._is_lock_timeout = is_lock_timeout
        self._shapes: dict[str, RowShape] = {}  # per statement text

    async def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
        *,
        stale_after: float = DEFAULT_STALE_SECONDS,
    ) -> Claim:
        params = claim_params(intent, lease_token, now, expires_at, stale_after)
        if transaction is not None:
            return await self._claim_in(transaction, params, intent.fingerprint)
        return await self._claim_alone(params, intent.fingerprint, None)

    async def claim_on_lent(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        lender: AsyncTransaction,
        *,
        stale_after: float = DEFAULT_STALE_SECONDS,
    ) -> Claim:
        params = claim_params(intent, lease_token, now, expires_at, stale_after)
        return await self._claim_alone(params, intent.fingerprint, lender)

    async def _claim_alone(
        self, params: Mapping[str, Any], fingerprint: str, lender: AsyncTransaction | None
    ) -> Claim:
        with self._translate(self._claim_failure):
            lent = None
            if lender is not None and self._lend_sources:
                lent = await lender.lend(self._lend_sources)
            connection: AbstractAsyncContextManager[Any] = (
                nullcontext(lent)
                if lent is not None and self._claims_alone_on(lent)
                else self._connect()
            )
            async with connection as conn:
                cursor = conn.cursor()
                try:
                    return await self._claim_on(cursor, params, fingerprint)
                finally:
                    await cursor.close()

    async def _claim_on(self, cursor: Any, params: Mapping[str, Any], fingerprint: str) -> Claim:
        async def fetch(statement: Statement, params: Mapping[str, Any]) -> _Fetched:
            return await self._row(cursor, statement, params)

        return await self._claim_with(fetch, params, fingerprint)

    async def _row(
        self, cursor: Any, statement: Statement, params: Mapping[str, Any]
    ) -> tuple[Any, RowShape]:
        text = self._text(statement)
        await cursor.execute(text, params if self._extra_params else statement.bind(params))
        # fetchall runs the statement to its end: on SQLite an INSERT … RETURNING
        # commits and frees the write lock now, not after our Python work.
        rows = await cursor.fetchall()
        shape = self._shapes.get(text)
        if shape is None:
            shape = self._learn_shape(text, cursor)
        return (rows[0] if rows else None), shape

    async def _claim_in(
        self, transaction: AsyncTransaction, params: Mapping[str, Any], fingerprint: str
    ) -> Claim:
        """Claim as the first write of the caller's transaction (single-commit mode): the
        dialect bounds the wait on a duplicate's uncommitted claim, answered 409."""

        async def fetch(statement: Statement, params: Mapping[str, Any]) -> _Fetched:
            row = await transaction.fetchone(statement, params)
            return (None if row is None else [row.get(name) for name in _LAID_OUT]), _LAID_OUT_SHAPE

        with self._translate(self._claim_failure):
            for statement in self.dialect.before_claim_in_transaction:
                await transaction.execute(statement, params)
            claim = await self._claim_with(fetch, params, fingerprint)
            for statement in self.dialect.after_claim_in_transaction:
                await transaction.execute(statement, params)
        return claim

    async def _claim_with(
        self, fetch: _Fetch, params: Mapping[str, Any], fingerprint: str
    ) -> Claim:
        """Insert, or read and dispatch, or take over (a compare-and-swap UPDATE); a record
        that vanished or was taken meanwhile, or an empty answer, is tried again."""
        combined = self.dialect.claim_or_read
        for _ in range(CLAIM_RETRIES):
            if combined is not None:
                row, shape = await fetch(combined, params)
                if row is None:
                    continue
                if row[shape.claimed]:
                    return make_claim(True, record_from_values(row, shape.start))
            else:
                row, shape = await fetch(self.dialect.claim, params)
                if row is not None:
                    return make_claim(True, record_from_values(row, shape.start))
                row, shape = await fetch(self.dialect.read_for_claim, params)
                if row is None:
                    continue
            record = record_from_values(row, shape.start)
            # On the store's clock: the take-over statement decides again on it, atomically.
            if not can_take_over(record, fingerprint, row[shape.clock_now] / 1000):
                return make_claim(False, record)
            row, shape = await fetch(self.dialect.take_over, params)
            if row is not None:
                return make_claim(True, record_from_values(row, shape.start))
        raise claim_unsettled()

    async def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        params = complete_params(record, state, response, now, expires_at)
        if not await self._write(self.dialect.complete, params, transaction):
            raise LeaseLost(
                "the claim on this Idempotency-Key was taken over before completion; "
                "the operation's transaction was rolled back"
            )

    async def release(
        self, record: Record, now: float, transaction: AsyncTransaction | None = None
    ) -> bool:
        params = owner_params(record, now)
        return await self._write(self.dialect.release, params, transaction)

    async def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        params = {**owner_params(record, now), "recovery_point": recovery_point}
        await self._owner_write(self.dialect.checkpoint, params, transaction)

    async def renew(self, record: Record, now: float) -> None:
        await self._owner_write(self.dialect.renew, owner_params(record, now), None)

    async def _owner_write(
        self, statement: Statement, params: Mapping[str, Any], transaction: AsyncTransaction | None
    ) -> None:
        """A fenced write that dates the claim: `LeaseLost` unless it changed our row or
        `_still_owned` says the record is ours (a write that changed no value)."""
        written = await self._write(statement, params, transaction)
        if not (written or await self._still_owned(params, transaction)):
            raise LeaseLost("the claim on this Idempotency-Key was taken over")

    async def _still_owned(
        self, params: Mapping[str, Any], transaction: AsyncTransaction | None
    ) -> bool:
        """Is the record ours though the write changed no row? Not here: rows count as matched."""
        return False

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        params = sweep_params(from_state, cutoff, now, keep_until, limit)
        text = self._text(self.dialect.sweep)
        async with self._cursor(self._connect) as cursor:
            await cursor.execute(text, self.dialect.sweep.bind(params))
            rows = await cursor.fetchall()
            if not rows:
                return []
            start = self._learn_shape(text, cursor).start
            return [record_from_values(row, start) for row in rows]

    async def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
        """One probe of the ``(state, stale_at)`` index (the dialect's ``due``), if any."""
        statement = self.dialect.due
        if statement is None:
            return None
        params = sweep_params(from_state, cutoff, now, now, 1)
        async with self._cursor(self._read_connect) as cursor:
            await cursor.execute(self._text(statement), statement.bind(params))
            row = await cursor.fetchone()
        return math.inf if row is None else float(row[0]) / 1000

    async def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> bool:
        params = {
            **complete_params(record, state, response, now, expires_at),
            **stale_params(record, now),
        }
        return await self._write(self.dialect.settle_stale, params, transaction)

    async def release_stale(
        self,
        record: Record,
        now: float,
        transaction: AsyncTransaction | None = None,
        *,
        forget_progress: bool = False,
    ) -> bool:
        params = stale_params(record, now, forget_progress=forget_progress)
        return await self._write(self.dialect.release_stale, params, transaction)

    async def purge(self, now: float, limit: int) -> int:
        params = {"now": int(now * 1000), "limit": limit}
        async with self._cursor(self._connect) as cursor:
            await cursor.execute(self._text(self.dialect.purge), self.dialect.purge.bind(params))
            return int(cursor.rowcount)

    async def migrate(self) -> None:
        async with self._cursor(self._migrate_connect) as cursor:
            try:
                if await self._needs_upgrade(cursor):
                    for statement in self.dialect.upgrade:
                        await cursor.execute(statement)
                for statement in self.dialect.ddl:
                    await cursor.execute(statement)
            except BaseException:
                await cursor.execute("ROLLBACK")
                raise

    async def _needs_upgrade(self, cursor: Any) -> bool:
        """Is the table there without this version's ``stale_at`` (an earlier version's)?"""
        if not self.dialect.upgrade:
            return False
        try:
            await cursor.execute(f"SELECT * FROM {self.dialect.table} WHERE 1 = 0")
            await cursor.fetchall()
        except Exception as exc:
            # None yet (a driver's error, or Django's wrapping it): ``ddl`` creates it whole.
            if is_missing_table(exc) or is_missing_table(exc.__cause__ or exc):
                return False
            raise
        return "stale_at" not in {column[0] for column in cursor.description}

    async def get(self, principal: str, key: str) -> Record | None:
        params = {"principal": principal, "key": key}
        async with self._cursor(self._read_connect) as cursor:
            row, shape = await self._row(cursor, self.dialect.select, params)
        return None if row is None else record_from_values(row, shape.start)

    async def _write(
        self, statement: Statement, params: Mapping[str, Any], transaction: AsyncTransaction | None
    ) -> bool:
        """Run a fenced UPDATE; True when it changed our row."""
        with self._translate():
            if transaction is not None:
                return await transaction.execute(statement, params) == 1
            async with self._connect() as conn:
                cursor = conn.cursor()
                try:
                    bound = params if self._extra_params else statement.bind(params)
                    await cursor.execute(self._text(statement), bound)
                    return bool(cursor.rowcount == 1)
                finally:
                    await cursor.close()

    @asynccontextmanager
    async def _cursor(
        self, connect: Callable[[], AbstractAsyncContextManager[Any]]
    ) -> AsyncIterator[Any]:
        """A cursor on a connection of ``connect``, its driver failures translated."""
        with self._translate():
            async with connect() as conn:
                cursor = conn.cursor()
                try:
                    yield cursor
                finally:
                    await cursor.close()
