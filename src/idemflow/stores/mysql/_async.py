"""The MySQL store's I/O: its pool of autocommit connections and its claim algorithm
(the package docstring says why), on the shared SQL executor; the driver named only
through ``_binding.py``.
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

from ..._errors import ConfigurationError, LeaseLost
from ..._model import Claim, Policy, Record, State, can_take_over, make_claim
from ..._process import PID
from ..protocol import AsyncTransaction, Statement, StoreClock, check_clock
from ..sql import AsyncSQLStore
from ..sql.dialect import (
    CLAIM_RETRIES,
    claim_busy,
    owner_params,
    record_from_row,
    record_from_values,
    row_mapping,
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
    """The store's own small pool of autocommit connections.

    PyMySQL has none and asyncmy's cannot drop a connection that saw an error:
    here one that did (or whose task was cancelled) is closed, its state unknown.
    One idle past `PING_AFTER` is pinged first (``wait_timeout``: a round
    trip, not a 503); after ``fork`` the child starts empty; the deque's atomic
    appends and pops let threads share it without a lock.
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
        # A factory of the caller's may hand out a connection in a transaction:
        # each statement of the store must be its own (no round trip if it is).
        await conn.autocommit(True)
        return conn

    async def _checked(self, conn: Any) -> Any:
        """``conn`` if it still answers a ping, else a new one from the factory (set up as
        every other, where PyMySQL's deprecated ``ping(reconnect=True)`` is not).
        """
        try:
            await conn.ping(False)
        except Exception:  # noqa: BLE001 -- whatever the failure, the connection is done
            AsyncBinding.drop(conn)
            return await self._open()
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
        # The pool's checkout, inline (every statement of the store passes here).
        try:
            try:
                conn, since = pool._idle.pop()
            except IndexError:
                conn = await pool._open()
            else:
                # Pinged when idle long (the server's wait_timeout may have ended it),
                # or when the server closed it (a restart): one poll, no round trip.
                if time.monotonic() - since > PING_AFTER or AsyncBinding.closed_by_server(conn):
                    conn = await pool._checked(conn)
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
    """Run an autocommit statement again while it loses a deadlock or certification:
    only statements judged again by their WHERE clause; still losing after
    `DEADLOCK_RETRIES` attempts is a 503.
    """
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
        connect: a ``mysql://user:password@host:port/db`` URL, a dict of the
            driver's ``connect`` arguments, or a function returning a new
            connection of it (PyMySQL for the sync store; asyncmy, awaited, for
            the asyncio one). Either way the store keeps up to ``max_size`` of
            them, switched to autocommit, so each statement is its own snapshot
            and a duplicate's read sees the current row. A URL chooses TLS as
            MySQL's clients do, ``?ssl-mode=DISABLED|PREFERRED|REQUIRED|VERIFY_CA|
            VERIFY_IDENTITY`` (and ``ssl-ca=/path/ca.pem``); without it, the
            driver's default: PyMySQL ``PREFERRED``, asyncmy no TLS (asyncmy
            cannot do ``PREFERRED``). The store's connections share one TLS
            context, built once (``docs/stores.md``, "TLS").
        lock_wait_timeout: the longest (seconds) one of the store's
            statements waits on a row another transaction holds; a claim that
            times out answers 409.
        timeout: connect and read timeout, and the longest wait for a free
            connection: ``policy.store_wait_seconds`` by default (half the
            request timeout, at most 5 s), so a server that stops answering is
            a 503 within it (the store's own connections; a claim in your
            transaction waits on your connection's bounds).
        policy: your app's policy, which bounds the waits (above).
        clock: ``"database"`` (the default) takes every time decision on the
            server's clock (see `idemflow.stores.postgres.PostgresStore`);
            ``"caller"`` uses the ``now`` each call passes.

    The client flag ``CLIENT_FOUND_ROWS`` may be on or off: no decision
    rests on a count it changes.
    """

    # The claim in the caller's transaction bounds its lock wait itself
    # (innodb_lock_wait_timeout, then restored): single-commit mode is safe,
    # except on Galera, where the claim refuses it (see _claim_in).
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
        """A connection of its own without the pool's read timeout: a migration waits for
        the locks it needs (``ALTER TABLE`` on a busy table), as no request may."""
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
        # A URL's TLS context (ssl-mode REQUIRED, VERIFY_*) is built here, once: every
        # connection of the store is handed that one.
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
        """New connections, each told to read causally (``wsrep_sync_wait = 3``) on Galera.

        Decisions are certified writes and need no more; the answers do: a completion
        on another node than its claim would call the lease lost, a retry right after
        the completion would get 409 instead of the replay. One query per connection.
        """

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
        """A plain INSERT decides a new key; a guarded upsert decides a takeover.

        The read after a duplicate only tells whether a takeover is worth trying; the
        upsert checks again on the current row and writes our token only if it holds.
        """
        insert = self.statements.insert
        text, bound = insert.pyformat, insert.bind(params)
        for _ in range(CLAIM_RETRIES):
            row_id = await self._claiming(cursor, text, bound)
            if row_id is not None:
                return make_claim(True, inserted(params, row_id))
            values = await self._read_after_duplicate(cursor, params)
            if values is None:  # released and purged in between: claim again
                continue
            record = record_from_values(values, 0)
            # On the server's clock (or the caller's): the upsert decides again on it.
            if not can_take_over(record, fingerprint, values[PACKED_CLOCK_AT] / 1000):
                return make_claim(False, record)
            await self._take_over(cursor, params)
            row, shape = await self._row(cursor, self.dialect.select, params)
            current = None if row is None else record_from_values(row, shape.start)
            return decided(current, str(params["lease_token"]))
        raise claim_busy()

    async def _read_after_duplicate(
        self, cursor: Any, params: Mapping[str, Any]
    ) -> list[Any] | None:
        """The row the INSERT lost to and the clock (``unpack_read``), or None if gone."""
        read = self.statements.packed_read
        await cursor.execute(read.pyformat, read.bind(params))
        row = await cursor.fetchone()
        return None if row is None else unpack_read(row)

    async def _take_over(self, cursor: Any, params: Mapping[str, Any]) -> None:
        """The guarded upsert. One that kept losing conflicts (None) lost to a write of
        this row: what the row says now (read next, by our token) is the answer."""
        upsert = self.dialect.claim
        await self._claiming(cursor, upsert.pyformat, upsert.bind(params))

    async def _claiming(self, cursor: Any, text: str, bound: Any) -> int | None:
        """Send a claiming statement: the id it inserted (0 if none), or None when it lost
        to a row that exists (1062, or a deadlock or Galera certification lost
        DEADLOCK_RETRIES times). A deadlock victim had no effect and is sent again after
        a pause; a lock wait that timed out is a live holder: 409.
        """
        for attempt in range(DEADLOCK_RETRIES):
            try:
                await cursor.execute(text, bound)
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
        """Claim as a write of the caller's transaction (``single_commit=True``).

        Every read locks: under REPEATABLE READ a plain SELECT answers from a snapshot
        that may predate the winner's commit. The failed INSERT already holds a shared
        lock on the duplicate, so the shared read never waits.
        """
        bound = {**params, "lock_wait": self.lock_wait_timeout}
        with self._translate():
            await self._refuse_galera(transaction)
            await transaction.execute(self.statements.bound_lock_wait, bound)
            try:
                row = await self._insert_or_read(transaction, params)
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
        """Single-commit mode needs the INSERT to decide. On Galera it does not: two
        nodes' inserts of one key both succeed locally, both handlers run, and one
        transaction fails certification at COMMIT. Refused before anything is claimed."""
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
        statement: Statement,
        params: Mapping[str, Any],
        transaction: AsyncTransaction | None,
    ) -> bool:
        """A fenced UPDATE; a conflict it loses is sent again (autocommit: the fence judges
        the row again) or, in the caller's transaction (rolled back with the effect), a
        503 the flow answers after releasing the claim, never a 500.
        """
        parent = super()._write
        if transaction is None:
            return await retry_conflicts(lambda: parent(statement, params, None))
        with rolled_back_is_503():
            if await parent(statement, params, transaction):
                return True
            if not self.galera_seen:
                return False
            # Galera: your connection's node may not have applied the claim yet
            # (made on another node, a moment ago). A causal wait cannot be asked
            # for inside a transaction, so judge again after short pauses; a
            # lease really lost stays lost. (wsrep_sync_wait >= 1 on your
            # connections makes BEGIN wait instead: see docs/stores.md.)
            for attempt in range(APPLY_RETRIES):
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
        """Record progress. Without ``CLIENT_FOUND_ROWS`` an identical checkpoint in the
        same millisecond counts 0 rows changed: whether the record is still ours is asked.
        """
        params = {**owner_params(record, now), "recovery_point": recovery_point}
        if await self._write(self.dialect.checkpoint, params, transaction):
            return
        if not await self._still_owned(params, transaction):
            raise LeaseLost("the claim on this Idempotency-Key was taken over")

    async def renew(self, record: Record, now: float) -> None:
        """Keep the claim alive; a renewal in the claim's millisecond changes 0 rows
        (no ``CLIENT_FOUND_ROWS``): whether the record is still ours is asked."""
        params = owner_params(record, now)
        if await self._write(self.dialect.renew, params, None):
            return
        if not await self._still_owned(params, None):
            raise LeaseLost("the claim on this Idempotency-Key was taken over")

    async def _still_owned(
        self, params: Mapping[str, Any], transaction: AsyncTransaction | None
    ) -> bool:
        statement = self.statements.still_owned
        with self._translate():
            if transaction is not None:
                with rolled_back_is_503():
                    return await transaction.fetchone(statement, params) is not None
            async with self.pool.connection() as conn, conn.cursor() as cursor:
                await cursor.execute(statement.pyformat, statement.bind(params))
                return await cursor.fetchone() is not None

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        """Mark up to ``limit`` stale claims with this sweep's token, then read them back:
        only this sweeper can settle or release them now.
        """
        params = {
            **sweep_params(from_state, cutoff, now, keep_until, limit),
            "sweep_token": secrets.token_hex(16),
        }
        # A mark that lost a conflict marked nothing; the next one decides afresh.
        return await retry_conflicts(lambda: self._mark(params))

    async def _mark(self, params: Mapping[str, Any]) -> list[Record]:
        with self._translate():
            async with self.pool.connection() as conn, conn.cursor() as cursor:
                sweep, swept = self.dialect.sweep, self.statements.swept
                if not await cursor.execute(sweep.pyformat, sweep.bind(params)):
                    return []
                await cursor.execute(swept.pyformat, swept.bind(params))
                rows = await cursor.fetchall()
                return [record_from_row(row_mapping(cursor.description, r)) for r in rows]
