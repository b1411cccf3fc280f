"""The MySQL store: its claim algorithm, on the shared SQL executor (see the package docstring)."""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from ..._errors import ConfigurationError, LeaseLost, StoreUnavailable
from ..._extras import optional
from ..._model import Claim, Intent, Record, State, can_take_over, record_from_row
from ..protocol import Transaction
from ..sql import SQLStore
from ..sql.dialect import (
    CLAIM_RETRIES,
    SQLStatement,
    StoreClock,
    check_clock,
    claim_busy,
    claim_params,
    claim_unsettled,
    owner_params,
    row_mapping,
    sweep_params,
)
from ._errors import (
    DUPLICATE,
    LOCK_WAIT_TIMEOUT,
    error_code,
    is_conflict,
    is_contention,
    is_unavailable,
)
from ._pool import Pool
from ._statements import DEFAULT_TABLE, mysql_dialect, mysql_statements
from ._url import connect_kwargs

#: How long (whole seconds, InnoDB's minimum is 1) a claim waits on a row
#: another transaction holds before answering 409 instead: never hold a
#: connection per duplicate.
DEFAULT_LOCK_WAIT_TIMEOUT = 1
# A deadlock victim's statement (or, on Galera, one that failed certification)
# had no effect: sending it again is safe.
_DEADLOCK_RETRIES = 5
# Between those: on Galera the winner's write set is committed but may not be
# applied on this node yet; a short random pause lets it land (seconds).
_CONFLICT_BACKOFF = 0.002
_CONFLICT_BACKOFF_MAX = 0.05

#: Galera: how often a fenced write in the caller's transaction that found no row
#: is judged again (pauses of up to 16, 32, 50, 50 … ms: the claim's apply lag).
_APPLY_RETRIES = 8

T = TypeVar("T")


def rolled_back() -> StoreUnavailable:
    """The 503 of a caller's transaction that a conflicting write rolled back."""
    return StoreUnavailable(
        "the transaction was rolled back by a conflicting write (a deadlock, or a Galera "
        "certification failure): nothing was recorded; retry with the same key"
    )


def _pause(attempt: int) -> None:
    time.sleep(random.uniform(0, min(_CONFLICT_BACKOFF * 2**attempt, _CONFLICT_BACKOFF_MAX)))


def retry_conflicts(run: Callable[[], T]) -> T:
    """Run an autocommit statement again while it loses a deadlock or certification.

    Only for statements that decide on the current row (fenced updates, the
    sweep's mark, purge): each attempt is judged again by its WHERE clause.
    Still losing after :data:`_DEADLOCK_RETRIES` attempts is a 503.
    """
    for attempt in range(_DEADLOCK_RETRIES):
        try:
            return run()
        except Exception as exc:
            if not is_conflict(exc):
                raise
        _pause(attempt)
    msg = "the key store kept losing write conflicts (deadlock or Galera certification)"
    raise StoreUnavailable(msg)


class MySQLStore(SQLStore):
    """Key records in MySQL 8 or MariaDB.

    Args:
        connect: a ``mysql://user:password@host:port/db`` URL, a dict of
            ``pymysql.connect`` arguments, or a function returning a new PyMySQL
            connection. Either way the store keeps up to ``max_size`` of them,
            switched to autocommit, so each statement is its own snapshot and
            a duplicate's read sees the current row.
        lock_wait_timeout: the longest (seconds) one of the store's
            statements waits on a row another transaction holds; a claim that
            times out answers 409.
        timeout: connect timeout, and the longest wait for a free connection.
        clock: ``"database"`` (the default) takes every time decision on the
            server's clock (see :class:`idemflow.stores.postgres.PostgresStore`);
            ``"caller"`` uses the ``now`` each call passes.

    The client flag ``CLIENT_FOUND_ROWS`` may be on or off: no decision
    rests on a count it changes.
    """

    # The claim in the caller's transaction bounds its lock wait itself
    # (innodb_lock_wait_timeout, then restored): single-commit mode is safe,
    # except on Galera, where the claim refuses it (see _claim_in_transaction).
    supports_single_commit = True
    #: Is the server a Galera node? Learnt by the first single-commit claim.
    _galera: bool | None = None

    def __init__(
        self,
        connect: str | Mapping[str, Any] | Callable[[], Any],
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
        self.pool = Pool(self._causal(self._factory(connect, timeout)), max_size, timeout)
        super().__init__(
            mysql_dialect(table, clock),
            self.pool.connection,
            paramstyle="pyformat",
            is_unavailable=is_unavailable,
            is_lock_timeout=is_contention,
        )

    def _factory(
        self, connect: str | Mapping[str, Any] | Callable[[], Any], timeout: float
    ) -> Callable[[], Any]:
        if callable(connect):
            return connect
        with optional("idemflow.stores.mysql"):
            import pymysql

        kwargs = {
            "connect_timeout": timeout,
            "init_command": f"SET SESSION innodb_lock_wait_timeout = {self.lock_wait_timeout}",
            "charset": "utf8mb4",
            **(connect_kwargs(connect) if isinstance(connect, str) else dict(connect)),
        }
        return lambda: pymysql.connect(**kwargs)

    def close(self) -> None:
        self.pool.close()

    #: Has a connection of this store reported ``wsrep_on=ON`` (a Galera node)?
    galera_seen = False

    def _causal(self, factory: Callable[[], Any]) -> Callable[[], Any]:
        """New connections, each told to act causally if the server is a Galera node.

        ``wsrep_sync_wait = 3``: a read, ``UPDATE`` or ``DELETE`` first waits
        until this node has applied every commit the cluster certified before
        it. Every decision is a certified write, so the guarantees do not need
        it; the answers do: a fenced write (a completion on another node than
        its claim) would otherwise miss a claim not applied here yet and call
        the lease lost, and a retry reaching another node right after the
        completion would get a 409 instead of the replay. One query per new
        connection.
        """

        def connect() -> Any:
            conn = factory()
            with conn.cursor() as cursor:
                cursor.execute(self.statements.wsrep_on.pyformat)
                row = cursor.fetchone()
                if row is not None and str(row[1]).upper() == "ON":
                    cursor.execute("SET SESSION wsrep_sync_wait = 3")
                    self.galera_seen = True
            return conn

        return connect

    def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: Transaction | None = None,
    ) -> Claim:
        """A plain INSERT decides a new key; a guarded upsert decides a takeover.

        Each decision is one atomic statement. The read after a duplicate only
        tells us whether a takeover is worth attempting (past retention, or
        released by this same request); the upsert then re-checks that on the
        current row and writes our lease token only if it still holds.
        """
        params = claim_params(intent, lease_token, now, expires_at)
        if transaction is not None:
            return self._claim_in_transaction(transaction, params)
        with self._translate(), self.pool.connection() as conn:
            for _ in range(CLAIM_RETRIES):
                row_id = self._insert(conn, params)
                if row_id is not None:
                    return Claim(owned=True, record=_inserted(intent, params, row_id))
                row = self._fetchone(conn, self.dialect.read_for_claim, params)
                if row is None:  # released and purged in between: claim again
                    continue
                if not _may_take_over(row, params):
                    return Claim(owned=False, record=record_from_row(row))
                self._take_over(conn, params)
                return _decided(self._fetchone(conn, self.dialect.select, params), lease_token)
        raise claim_busy()

    def _take_over(self, conn: Any, params: Mapping[str, Any]) -> None:
        """The guarded upsert. One that kept losing conflicts lost to a write of this
        row: what the row says now (read next, by our token) is the answer."""
        try:
            self._statement(conn, self.dialect.claim, params)
        except Exception as exc:
            if not is_conflict(exc):
                raise

    def _insert(self, conn: Any, params: Mapping[str, Any]) -> int | None:
        """The new row's id, or None when the key exists (error 1062).

        An insert that keeps losing a conflict (deadlock, or on Galera the
        certification of another node's insert of this key) lost it to a row
        that exists: None too, so the caller reads that row and dispatches.
        """
        try:
            return self._statement(conn, self.statements.insert, params)
        except Exception as exc:
            if error_code(exc) == DUPLICATE or is_conflict(exc):
                return None
            raise

    def _statement(self, conn: Any, statement: SQLStatement, params: Mapping[str, Any]) -> int:
        """Run a claiming statement; the id it inserted (0 if none).

        A deadlock victim's statement had no effect, so it is run again after
        a short pause (on Galera, a certification failure means another
        node's write of this row was ordered first: once applied here, the
        statement sees it). A lock wait that times out means a live
        transaction holds the row, which is a 409. Still conflicting after
        :data:`_DEADLOCK_RETRIES`: the last conflict is raised.
        """
        for attempt in range(_DEADLOCK_RETRIES):
            with conn.cursor() as cursor:
                try:
                    cursor.execute(statement.pyformat, statement.bind(params))
                except Exception as exc:
                    if is_conflict(exc) and attempt + 1 < _DEADLOCK_RETRIES:
                        _pause(attempt)
                        continue
                    if error_code(exc) == LOCK_WAIT_TIMEOUT:
                        raise claim_busy() from exc
                    raise
                return int(cursor.lastrowid or 0)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _claim_in_transaction(self, transaction: Transaction, params: Mapping[str, Any]) -> Claim:
        """Claim as a write of the caller's transaction (``single_commit=True``).

        Every read here is a locking read: under REPEATABLE READ a plain
        SELECT would answer from the transaction's snapshot, which may
        predate the winner's commit (no row at all, or its old state).
        ``FOR SHARE``/``FOR UPDATE`` read the latest committed version; the
        failed INSERT already holds a shared lock on the duplicate, so the
        shared read never waits. Ownership is read off our lease token.
        """
        bound = {**params, "lock_wait": self.lock_wait_timeout}
        with self._translate():
            self._refuse_galera(transaction)
            transaction.execute(self.statements.bound_lock_wait, bound)
            try:
                row = self._insert_or_read(transaction, params)
                if row is not None and _may_take_over(row, params):
                    transaction.execute(self.dialect.claim, params)
                    row = transaction.fetchone(self.statements.select_current, params)
            except Exception as exc:
                if is_contention(exc):
                    raise claim_busy() from exc
                raise
            finally:
                transaction.execute(self.statements.restore_lock_wait, {})
        return _decided(row, str(params["lease_token"]))

    def _refuse_galera(self, transaction: Transaction) -> None:
        """Single-commit mode needs the INSERT to decide. On Galera it does not: two
        nodes' inserts of one key both succeed locally, both handlers run, and one
        transaction fails certification at COMMIT. Refused before anything is claimed."""
        if self._galera is None:
            row = transaction.fetchone(self.statements.wsrep_on, {})
            self._galera = row is not None and str(row["Value"]).upper() == "ON"
        if self._galera:
            msg = (
                "single_commit is refused on Galera (wsrep_on=ON): a claim in your "
                "transaction is only certified at COMMIT, so two nodes could both run "
                "the handler; use the two-commit mode (the default)"
            )
            raise ConfigurationError(msg)

    def _write(
        self, statement: SQLStatement, params: Mapping[str, Any], transaction: Transaction | None
    ) -> bool:
        """A fenced UPDATE; a conflict it loses is sent again (autocommit) or is a 503.

        Autocommit: the losing statement had no effect and the fence judges the
        current row again, so it is retried. In the caller's transaction the
        conflict rolled the whole transaction back (the effect with it): a 503
        the flow answers after releasing the claim, never a 500.
        """
        if transaction is None:
            return retry_conflicts(lambda: super(MySQLStore, self)._write(statement, params, None))
        with _rolled_back_is_503():
            if super()._write(statement, params, transaction):
                return True
            if not self.galera_seen:
                return False
            # Galera: your connection's node may not have applied the claim yet
            # (made on another node, a moment ago). A causal wait cannot be asked
            # for inside a transaction, so judge again after short pauses; a
            # lease really lost stays lost. (wsrep_sync_wait >= 1 on your
            # connections makes BEGIN wait instead: see docs/stores.md.)
            for attempt in range(_APPLY_RETRIES):
                _pause(attempt + 3)
                if super()._write(statement, params, transaction):
                    return True
            return False

    def purge(self, now: float, limit: int) -> int:
        """Delete up to ``limit`` records past retention, again if it loses a conflict."""
        return retry_conflicts(lambda: super(MySQLStore, self).purge(now, limit))

    def _insert_or_read(
        self, transaction: Transaction, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        try:
            transaction.execute(self.statements.insert, params)
        except Exception as exc:
            if error_code(exc) != DUPLICATE:
                raise
            return transaction.fetchone(self.statements.select_shared, params)
        return transaction.fetchone(self.statements.select_current, params)

    def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: Transaction | None = None,
    ) -> None:
        """Record progress; an identical checkpoint in the same millisecond is not a loss.

        Without ``CLIENT_FOUND_ROWS`` MySQL counts *changed* rows, so a
        checkpoint that rewrites the same values reports 0; we then ask
        whether the record is still ours before calling the claim lost.
        """
        params = {**owner_params(record, now), "recovery_point": recovery_point}
        if self._write(self.dialect.checkpoint, params, transaction):
            return
        if not self._still_owned(params, transaction):
            raise LeaseLost("the claim on this Idempotency-Key was taken over")

    def _still_owned(self, params: Mapping[str, Any], transaction: Transaction | None) -> bool:
        statement = self.statements.still_owned
        with self._translate():
            if transaction is not None:
                with _rolled_back_is_503():
                    return transaction.fetchone(statement, params) is not None
            with self.pool.connection() as conn:
                return self._fetchone(conn, statement, params) is not None

    def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        """Mark up to ``limit`` stale claims with this sweep's token, then read them back.

        The marked records carry the sweep token as their lease token: only
        this sweeper can settle or release them, and the crashed owner's
        token no longer matches anything.
        """
        params = {
            **sweep_params(from_state, cutoff, now, keep_until, limit),
            "sweep_token": secrets.token_hex(16),
        }
        # A mark that lost a conflict marked nothing; the next one decides afresh.
        return retry_conflicts(lambda: self._mark(params))

    def _mark(self, params: Mapping[str, Any]) -> list[Record]:
        with self._translate(), self.pool.connection() as conn:
            cursor = conn.cursor()
            try:
                marked = cursor.execute(
                    self.dialect.sweep.pyformat, self.dialect.sweep.bind(params)
                )
                if not marked:
                    return []
                cursor.execute(self.statements.swept.pyformat, self.statements.swept.bind(params))
                rows = cursor.fetchall()
                return [record_from_row(row_mapping(cursor.description, r)) for r in rows]
            finally:
                cursor.close()


@contextmanager
def _rolled_back_is_503() -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if is_conflict(exc):
            raise rolled_back() from exc
        raise


def _may_take_over(row: Mapping[str, Any], params: Mapping[str, Any]) -> bool:
    """Worth attempting the guarded upsert? (It checks again, atomically.)"""
    return can_take_over(record_from_row(row), params["fingerprint"], row["clock_now"] / 1000)


def _decided(row: Mapping[str, Any] | None, lease_token: str) -> Claim:
    """Ours if the row carries our (unique) lease token: the statement wrote it only if we won."""
    if row is None:  # purged between the claim and the read: vanishingly rare
        raise claim_unsettled()
    record = record_from_row(row)
    owned = record.lease_token == lease_token and record.state is State.IN_PROGRESS
    return Claim(owned=owned, record=record)


def _inserted(intent: Intent, params: Mapping[str, Any], row_id: int) -> Record:
    """The row our plain INSERT created: exactly the values we sent."""
    return Record(
        id=row_id,
        principal=intent.principal,
        key=intent.key,
        fingerprint=intent.fingerprint,
        endpoint=intent.endpoint,
        state=State.IN_PROGRESS,
        lease_token=str(params["lease_token"]),
        created_at=params["began_at"] / 1000,
        updated_at=params["now"] / 1000,
        expires_at=params["expires_at"] / 1000,
        correlation_id=intent.correlation_id,
    )
