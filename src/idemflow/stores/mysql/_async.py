"""The MySQL store's I/O: its pool of autocommit connections and its claim algorithm, on
the shared SQL executor; the driver named only through ``_binding.py``.
This is the async source of truth; ``idemflow/stores/mysql/_sync.py`` is generated
from it by ``scripts/unasync.py``.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Any, TypeVar

from ..._errors import ConfigurationError
from ..._model import Claim, Policy, Record, State, can_take_over, make_claim
from ..._process import PID
from ..protocol import AsyncTransaction, Statement, StoreClock, check_clock
from ..sql import AsyncSQLStore
from ..sql.dialect import (
    CLAIM_RETRIES,
    claim_busy,
    record_from_row,
    record_from_values,
    sweep_params,
)
from ._binding import AsyncBinding
from ._errors import (
    APPLY_RETRIES,
    DEADLOCK,
    DEADLOCK_RETRIES,
    DUPLICATE,
    LOCK_WAIT_TIMEOUT,
    PoolExhausted,
    conflict_pause,
    error_code,
    is_conflict,
    is_contention,
    kept_losing,
    rolled_back_is_503,
)
from ._statements import (
    DEFAULT_LOCK_WAIT_TIMEOUT,
    DEFAULT_TABLE,
    PACKED_CLOCK_AT,
    decided,
    inserted,
    may_take_over,
    mysql_dialect,
    mysql_statements,
    unpack_read,
)
from ._url import connect_kwargs

T = TypeVar("T")

#: An idle connection older than this is pinged before use (seconds).
PING_AFTER = 30.0


class AsyncPool:
    """The store's own pool of autocommit connections (PyMySQL has none; asyncmy's cannot
    drop a connection that saw an error). The deque's atomic appends and pops let threads
    share it without a lock; after ``fork`` the child starts empty.
    """

    def __init__(
        self, factory: Callable[[], Awaitable[Any]], max_size: int, timeout: float
    ) -> None:
        self._factory = factory
        self._max_size = max_size
        self._timeout = timeout
        self._reset()

    def _reset(self) -> None:
        self._pid = PID[0]
        self._idle: deque[tuple[Any, float]] = deque()
        self._slots = AsyncBinding.Slots(self._max_size)

    def connection(self) -> AbstractAsyncContextManager[Any]:
        """A connection for one ``async with`` block; closed, not kept, if the block raised."""
        return AsyncCheckout(self)

    async def _open(self) -> Any:
        conn = await self._factory()
        # A caller's factory may hand out a connection in a transaction (no round trip if not).
        await conn.autocommit(True)
        return conn

    async def close(self) -> None:
        while True:
            try:
                conn, _ = self._idle.pop()
            except IndexError:
                return
            await AsyncBinding.close(conn)


class AsyncCheckout:
    """One use of a pooled connection (a class, not a generator: it is on every call's path)."""

    __slots__ = ("_conn", "_pool", "_slots")

    def __init__(self, pool: AsyncPool) -> None:
        self._pool = pool

    async def __aenter__(self) -> Any:
        pool = self._pool
        if pool._pid != PID[0]:
            pool._reset()
        self._slots = slots = pool._slots
        if not await slots.take(pool._timeout):
            msg = f"all {pool._max_size} MySQL connections busy for {pool._timeout:g}s"
            raise PoolExhausted(msg)
        try:
            try:
                conn, since = pool._idle.pop()
            except IndexError:
                conn = await pool._open()
            else:
                # Idle long (wait_timeout may have ended it), or closed by the server: pinged,
                # and replaced if it does not answer (``ping(reconnect=True)`` skips `_open`).
                if time.monotonic() - since > PING_AFTER or AsyncBinding.closed_by_server(conn):
                    try:
                        await conn.ping(False)
                    except Exception:  # noqa: BLE001 -- whatever the failure, the connection is done
                        AsyncBinding.drop(conn)
                        conn = await pool._open()
        except BaseException:
            slots.release()
            raise
        self._conn = conn
        return conn

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if kind is None:
                self._pool._idle.append((self._conn, time.monotonic()))
            else:
                AsyncBinding.drop(self._conn)
        finally:
            self._slots.release()


async def _pause(attempt: int) -> None:
    await AsyncBinding.sleep(conflict_pause(attempt))


async def retry_conflicts(run: Callable[[], Awaitable[T]]) -> T:
    """Run an autocommit statement (judged again by its WHERE clause) again while it loses a
    deadlock or certification; still losing after `DEADLOCK_RETRIES` attempts is a 503."""
    for attempt in range(DEADLOCK_RETRIES):
        try:
            return await run()
        except Exception as exc:
            if not is_conflict(exc):
                raise
        await _pause(attempt)
    raise kept_losing()


class AsyncMySQLStore(AsyncSQLStore):
    """Key records in MySQL 8 or MariaDB.

    Args:
        connect: a ``mysql://user:password@host:port/db`` URL (TLS as MySQL's clients
            spell it, ``?ssl-mode=…&ssl-ca=…``: ``docs/stores.md``, "TLS"), a dict of the
            driver's ``connect`` arguments, or a function returning a new connection
            (PyMySQL for the sync store; asyncmy, awaited, for the asyncio one); the
            store keeps up to ``max_size`` of them, switched to autocommit.
        lock_wait_timeout: the longest (seconds) a statement of the store waits on a
            row another transaction holds; a claim that times out answers 409.
        timeout: connect and read timeout, and the longest wait for a free connection:
            ``policy.store_wait_seconds`` by default (a silent server: a 503 within it).
        policy: your app's policy, which bounds the waits (above).
        clock: ``"database"`` (the default) takes every time decision on the
            server's clock; ``"caller"`` uses the ``now`` each call passes.

    ``CLIENT_FOUND_ROWS`` may be on or off: no decision rests on a count it changes.
    """

    # The claim in the caller's transaction bounds its own lock wait (refused on Galera).
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
        timeout: float | None = None,
        clock: StoreClock = "database",
        policy: Policy | None = None,
    ) -> None:
        if lock_wait_timeout < 1:
            msg = "lock_wait_timeout must be at least 1 second (InnoDB's minimum)"
            raise ConfigurationError(msg)
        clock = check_clock(clock)
        self.statements = mysql_statements(table, clock)
        self.lock_wait_timeout = int(lock_wait_timeout)
        if timeout is None:
            timeout = (policy or Policy()).store_wait_seconds
        self.pool = AsyncPool(
            self._causal(self._factory(connect, timeout, timeout)), max_size, timeout
        )
        self._unbounded = self._factory(connect, timeout, None)
        super().__init__(
            mysql_dialect(table, clock),
            self.pool.connection,
            paramstyle="pyformat",
            is_unavailable=AsyncBinding.is_unavailable,
            is_lock_timeout=is_contention,
            migrate_connect=self._migration_connection,
        )

    @asynccontextmanager
    async def _migration_connection(self) -> AsyncIterator[Any]:
        """A connection without the pool's read timeout: a migration waits for its locks."""
        conn = await self._unbounded()
        try:
            yield conn
        finally:
            await AsyncBinding.close(conn)

    def _factory(
        self,
        connect: str | Mapping[str, Any] | Callable[[], Awaitable[Any]],
        timeout: float,
        read_timeout: float | None,
    ) -> Callable[[], Awaitable[Any]]:
        if callable(connect):
            return connect
        # A URL's TLS context is built here, once, for every connection of the store.
        return AsyncBinding.connector(
            {
                "connect_timeout": timeout,
                "read_timeout": read_timeout,
                "init_command": f"SET SESSION innodb_lock_wait_timeout = {self.lock_wait_timeout}",
                "charset": "utf8mb4",
                **(
                    connect_kwargs(connect, AsyncBinding.driver)
                    if isinstance(connect, str)
                    else dict(connect)
                ),
            }
        )

    async def close(self) -> None:
        await self.pool.close()

    def _causal(self, factory: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        """New connections, each told to read causally (``wsrep_sync_wait = 3``) on Galera:
        decisions are certified writes, but answers read on another node may lag."""

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

    async def _claim_on(self, cursor: Any, params: Mapping[str, Any], fingerprint: str) -> Claim:
        """A plain INSERT decides a new key; a guarded upsert decides a takeover (the read
        between only tells whether one is worth trying: the upsert checks again)."""
        read = self.statements.packed_read
        for _ in range(CLAIM_RETRIES):
            row_id = await self._claiming(cursor, self.statements.insert, params)
            if row_id is not None:
                return make_claim(True, inserted(params, row_id))
            await cursor.execute(read.pyformat, read.bind(params))
            packed = await cursor.fetchone()
            if packed is None:  # released and purged in between: claim again
                continue
            values = unpack_read(packed)
            record = record_from_values(values, 0)
            if not can_take_over(record, fingerprint, values[PACKED_CLOCK_AT] / 1000):
                return make_claim(False, record)
            # One that kept losing conflicts lost to a write of this row: the read decides.
            await self._claiming(cursor, self.dialect.claim, params)
            row, shape = await self._row(cursor, self.dialect.select, params)
            current = None if row is None else record_from_values(row, shape.start)
            return decided(current, str(params["lease_token"]))
        raise claim_busy()

    async def _claiming(
        self, cursor: Any, statement: Statement, params: Mapping[str, Any]
    ) -> int | None:
        """The id a claiming statement inserted (0 if none), or None when it lost to a row
        that exists (1062, or a deadlock lost DEADLOCK_RETRIES times: resent after a pause,
        it had no effect). A lock wait that timed out is a live holder: 409."""
        for attempt in range(DEADLOCK_RETRIES):
            try:
                await cursor.execute(statement.pyformat, statement.bind(params))
            except Exception as exc:
                code = error_code(exc)
                if code == DUPLICATE or (code == DEADLOCK and attempt + 1 == DEADLOCK_RETRIES):
                    return None
                if code == LOCK_WAIT_TIMEOUT:
                    raise claim_busy() from exc
                if code != DEADLOCK:
                    raise
                await _pause(attempt)
            else:
                return int(cursor.lastrowid or 0)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _claim_in(
        self, transaction: AsyncTransaction, params: Mapping[str, Any], fingerprint: str
    ) -> Claim:
        """Claim as a write of the caller's transaction. Every read locks: under REPEATABLE
        READ a plain SELECT may answer from a snapshot older than the winner's commit."""
        bound = {**params, "lock_wait": self.lock_wait_timeout}
        with self._translate():
            await self._refuse_galera(transaction)
            await transaction.execute(self.statements.bound_lock_wait, bound)
            try:
                try:
                    await transaction.execute(self.statements.insert, params)
                    read = self.statements.select_current
                except Exception as exc:
                    if error_code(exc) != DUPLICATE:
                        raise
                    read = self.statements.select_shared
                row = await transaction.fetchone(read, params)
                if row is not None and may_take_over(row, params):
                    await transaction.execute(self.dialect.claim, params)
                    row = await transaction.fetchone(self.statements.select_current, params)
            except Exception as exc:
                if is_contention(exc):
                    raise claim_busy() from exc
                raise
            finally:
                await transaction.execute(self.statements.restore_lock_wait, {})
        return decided(None if row is None else record_from_row(row), str(params["lease_token"]))

    async def _refuse_galera(self, transaction: AsyncTransaction) -> None:
        """Refuse single-commit mode on Galera: two nodes' inserts of one key both succeed
        locally (both handlers run) until certification at COMMIT."""
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

    async def _write(
        self, statement: Statement, params: Mapping[str, Any], transaction: AsyncTransaction | None
    ) -> bool:
        """A fenced UPDATE; a conflict it loses is sent again (autocommit) or, in the
        caller's transaction (rolled back with the effect), a 503, never a 500."""
        parent = super()._write
        if transaction is None:
            return await retry_conflicts(lambda: parent(statement, params, None))
        # Galera: your node may not have applied the claim yet: judge again after pauses.
        with rolled_back_is_503():
            for attempt in range(1 + (APPLY_RETRIES if self.galera_seen else 0)):
                if attempt:
                    await _pause(attempt + 2)
                if await parent(statement, params, transaction):
                    return True
            return False

    async def purge(self, now: float, limit: int) -> int:
        parent = super().purge
        return await retry_conflicts(lambda: parent(now, limit))

    async def _still_owned(
        self, params: Mapping[str, Any], transaction: AsyncTransaction | None
    ) -> bool:
        """Without ``CLIENT_FOUND_ROWS`` a write of the same values in the same millisecond
        changes 0 rows: whether the record is still ours is asked then."""
        statement = self.statements.still_owned
        if transaction is not None:
            with self._translate(), rolled_back_is_503():
                return await transaction.fetchone(statement, params) is not None
        async with self._cursor(self._connect) as cursor:
            await cursor.execute(statement.pyformat, statement.bind(params))
            return await cursor.fetchone() is not None

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        """Mark up to ``limit`` stale claims with this sweep's token, then read them back."""
        params = {
            **sweep_params(from_state, cutoff, now, keep_until, limit),
            "sweep_token": secrets.token_hex(16),
        }
        # A mark that lost a conflict marked nothing; the next one decides afresh.
        return await retry_conflicts(lambda: self._mark(params))

    async def _mark(self, params: Mapping[str, Any]) -> list[Record]:
        async with self._cursor(self._connect) as cursor:
            sweep, swept = self.dialect.sweep, self.statements.swept
            if not await cursor.execute(sweep.pyformat, sweep.bind(params)):
                return []
            await cursor.execute(swept.pyformat, swept.bind(params))
            return [record_from_values(row, 0) for row in await cursor.fetchall()]
