"""
Run a :class:`~idemflow.stores.sql.Dialect` on async DB-API connections.

It holds no SQL of its own and makes no decision about keys: it performs one
store operation per call and maps driver failures to
:class:`~idemflow.StoreUnavailable` at the boundary. Import it from
:mod:`idemflow.stores.sql`.

This is the async source of truth; ``idemflow/stores/sql/_sync.py`` is generated
from it by ``scripts/unasync.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any, Literal, TypeAlias

from ..._errors import LeaseLost, StoreUnavailable
from ..._model import Claim, Intent, Record, Response, State, can_take_over, record_from_row
from ..protocol import AsyncTransaction
from ._stats import AsyncSQLObservable, is_missing_table, missing_table
from .dialect import (
    CLAIM_RETRIES,
    Dialect,
    SQLStatement,
    claim_busy,
    claim_params,
    claim_unsettled,
    complete_params,
    owner_params,
    row_mapping,
    stale_params,
    sweep_params,
)

__all__ = ["AsyncSQLStore"]

_Row: TypeAlias = Mapping[str, Any] | None
_Fetch: TypeAlias = Callable[[SQLStatement, Mapping[str, Any]], Awaitable[_Row]]


class AsyncSQLStore(AsyncSQLObservable):
    """A key store on any SQL dialect, with connections from ``connect()``.

    Args:
        dialect: the statements to run.
        connect: returns an async context manager yielding an *autocommit*
            connection, e.g. ``psycopg_pool.AsyncConnectionPool.connection``.
        paramstyle: the driver's placeholder style.
        is_unavailable: recognises driver errors that mean "cannot reach the
            store" (connection refused, pool exhausted, database locked).
        is_lock_timeout: recognises the error a bounded wait on a concurrent
            uncommitted claim raises (single-commit mode only).
    """

    supports_transactions = True

    @property
    def supports_single_commit(self) -> bool:
        """Can the claim join the caller's transaction without holding duplicates?

        Only where the dialect bounds the wait on a concurrent uncommitted
        claim (PostgreSQL's lock timeout). SQLite admits one writer: there a
        duplicate would queue behind the whole transaction.
        """
        return bool(self.dialect.before_claim_in_transaction)

    def __init__(
        self,
        dialect: Dialect,
        connect: Callable[[], AbstractAsyncContextManager[Any]],
        *,
        paramstyle: Literal["named", "pyformat"],
        is_unavailable: Callable[[BaseException], bool],
        is_lock_timeout: Callable[[BaseException], bool] = lambda exc: False,
    ) -> None:
        self.dialect = dialect
        self._connect = connect
        self._pyformat = paramstyle == "pyformat"
        self._is_unavailable = is_unavailable
        self._is_lock_timeout = is_lock_timeout
        # Result column names per statement text (they cannot change), because
        # psycopg builds ``cursor.description`` afresh on every access.
        self._names: dict[str, tuple[str, ...]] = {}

    async def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> Claim:
        params = claim_params(intent, lease_token, now, expires_at)
        if transaction is not None:
            return await self._claim_in(transaction, params, intent.fingerprint)
        with self._translate(), self._bounded_wait():
            async with self._connect() as conn:

                async def fetch(statement: SQLStatement, values: Mapping[str, Any]) -> _Row:
                    return await self._fetchone(conn, statement, values)

                return await self._claim_with(fetch, params, intent.fingerprint)

    async def _claim_in(
        self,
        transaction: AsyncTransaction,
        params: Mapping[str, Any],
        fingerprint: str,
    ) -> Claim:
        """Claim as the first write of the caller's transaction (single-commit mode).

        A concurrent duplicate's uncommitted claim would make us wait on its
        index entry; the dialect bounds that wait and we answer 409 instead.
        """
        with self._translate(), self._bounded_wait():
            for statement in self.dialect.before_claim_in_transaction:
                await transaction.execute(statement, params)
            claim = await self._claim_with(transaction.fetchone, params, fingerprint)
            for statement in self.dialect.after_claim_in_transaction:
                await transaction.execute(statement, params)
            return claim

    async def _claim_with(
        self, fetch: _Fetch, params: Mapping[str, Any], fingerprint: str
    ) -> Claim:
        """Insert, or read and dispatch, or take over: ownership is decided by a statement.

        The insert claims an absent key. A record that may be taken over
        (expired, or released by this same request) is taken by a
        compare-and-swap UPDATE; the read before it only spares replays that
        UPDATE's row lock. A record that vanished in between (purged) or was
        taken by a racing retry is simply tried again.
        """
        for _ in range(CLAIM_RETRIES):
            row = await fetch(self.dialect.claim, params)
            if row is not None:
                return Claim(owned=True, record=record_from_row(row))
            row = await fetch(self.dialect.read_for_claim, params)
            if row is None:
                continue
            record = record_from_row(row)
            # On the store's clock (the database's, see on_database_clock): the
            # take-over statement decides again on it, atomically.
            if not can_take_over(record, fingerprint, row["clock_now"] / 1000):
                return Claim(owned=False, record=record)
            row = await fetch(self.dialect.take_over, params)
            if row is not None:
                return Claim(owned=True, record=record_from_row(row))
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
        if not await self._write(self.dialect.checkpoint, params, transaction):
            raise LeaseLost("the claim on this Idempotency-Key was taken over")

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        """Mark up to ``limit`` records in ``from_state`` untouched since ``cutoff`` as stale.

        Returns them as marked; only this caller can settle or release them
        (see :meth:`settle_stale`), so parallel sweepers never resolve one twice.
        """
        params = sweep_params(from_state, cutoff, now, keep_until, limit)
        with self._translate():
            async with self._connect() as conn:
                cursor = conn.cursor()
                try:
                    await cursor.execute(
                        self._text(self.dialect.sweep), self.dialect.sweep.bind(params)
                    )
                    rows = await cursor.fetchall()
                    return [record_from_row(row_mapping(cursor.description, r)) for r in rows]
                finally:
                    await cursor.close()

    async def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> bool:
        """Complete a record this sweeper marked stale (a reconciler found the effect)."""
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
        """Give back a key this sweeper marked stale (the effect did not happen).

        ``forget_progress`` also clears the recovery point: the reconciler
        undid the local traces, so a retry must start from the beginning.
        """
        params = stale_params(record, now, forget_progress=forget_progress)
        return await self._write(self.dialect.release_stale, params, transaction)

    async def purge(self, now: float, limit: int) -> int:
        """Delete up to ``limit`` records past their retention; how many went."""
        params = {"now": int(now * 1000), "limit": limit}
        with self._translate():
            async with self._connect() as conn:
                cursor = conn.cursor()
                try:
                    await cursor.execute(
                        self._text(self.dialect.purge), self.dialect.purge.bind(params)
                    )
                    return int(cursor.rowcount)
                finally:
                    await cursor.close()

    async def migrate(self) -> None:
        """Create the table and its indexes if they do not exist (idempotent)."""
        with self._translate():
            async with self._connect() as conn:
                cursor = conn.cursor()
                try:
                    for statement in self.dialect.ddl:
                        await cursor.execute(statement)
                except BaseException:
                    await cursor.execute("ROLLBACK")
                    raise
                finally:
                    await cursor.close()

    async def get(self, principal: str, key: str) -> Record | None:
        with self._translate():
            async with self._connect() as conn:
                params = {"principal": principal, "key": key}
                row = await self._fetchone(conn, self.dialect.select, params)
        return None if row is None else record_from_row(row)

    async def _write(
        self,
        statement: SQLStatement,
        params: Mapping[str, Any],
        transaction: AsyncTransaction | None,
    ) -> bool:
        """Run a fenced UPDATE; True when it changed our row."""
        with self._translate():
            if transaction is not None:
                return await transaction.execute(statement, params) == 1
            async with self._connect() as conn:
                cursor = conn.cursor()
                try:
                    await cursor.execute(self._text(statement), statement.bind(params))
                    return bool(cursor.rowcount == 1)
                finally:
                    await cursor.close()

    async def _fetchone(
        self, conn: Any, statement: SQLStatement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        cursor = conn.cursor()
        try:
            await cursor.execute(self._text(statement), statement.bind(params))
            # fetchall, not fetchone: it runs the statement to its end, so on
            # SQLite an INSERT … RETURNING commits and frees the write lock
            # now, not after our Python work (other writers sleep until then).
            rows = await cursor.fetchall()
            names = self._column_names(statement, cursor) if rows else ()
        finally:
            await cursor.close()
        return dict(zip(names, rows[0], strict=True)) if rows else None

    def _column_names(self, statement: SQLStatement, cursor: Any) -> tuple[str, ...]:
        names = self._names.get(statement.named)
        if names is None:
            names = self._names[statement.named] = tuple(c[0] for c in cursor.description)
        return names

    def _text(self, statement: SQLStatement) -> str:
        return statement.pyformat if self._pyformat else statement.named

    @contextmanager
    def _bounded_wait(self) -> Iterator[None]:
        """A claim that waited too long on another request's uncommitted claim is a 409.

        The wait is bounded by the connection's lock timeout (see the
        PostgreSQL store): duplicates are refused, never held.
        """
        try:
            yield
        except Exception as exc:
            if self._is_lock_timeout(exc):
                raise claim_busy() from exc
            raise

    @contextmanager
    def _translate(self) -> Iterator[None]:
        """Driver errors that mean "unreachable" become StoreUnavailable (fail closed).

        A missing key table is the newcomer's mistake, not an outage: it
        becomes :class:`~idemflow.MissingTable`, naming the command that fixes it.
        """
        try:
            yield
        except Exception as exc:
            if is_missing_table(exc):
                raise missing_table(self.dialect.table, self.dialect.name) from exc
            if not self._is_unavailable(exc):
                raise
            msg = f"{self.dialect.name} key store unavailable: {exc}".strip()
            raise StoreUnavailable(msg) from exc
