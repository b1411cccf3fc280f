"""
MySQL 8 and MariaDB (≥ 10.6): key records in InnoDB, on PyMySQL.

Neither server has ``UPDATE … RETURNING`` (MySQL 8 has no ``INSERT …
RETURNING`` either), and ``INSERT IGNORE`` is out: it turns every error
(truncation, bad values, a NULL in a NOT NULL column) into a warning, so
"0 rows" would no longer mean "duplicate". The claim is therefore:

1. a plain ``INSERT``: it succeeds (the key is ours, and we know every
   column of the row: one round trip), or fails with error 1062;
2. on 1062, the current row is read. Held, or settled: that is the answer
   (a replay is these two round trips). Past its retention, or released by
   this same request: a takeover is attempted with one
   ``INSERT … ON DUPLICATE KEY UPDATE`` whose every assignment is guarded by
   that same condition on the *current* row, writing a fresh lease token only
   if it still holds; reading the row back by that token tells us whether
   we won.

Each decision is one atomic statement; the reads only report or route it.
``INSERT … ON DUPLICATE KEY UPDATE`` for every claim was measured and
rejected: its long guarded statement costs the server about twice a plain
insert, and halved fresh-claim throughput at 16 callers (``python -m
bench.bench_stores``, ``docs/stores.md``). Its affected-row count (1 new, 2
updated, 0 untouched; *1* untouched under ``CLIENT_FOUND_ROWS``) is never
trusted alone: ownership is read off the lease token, so the store is correct
with the flag on or off.

Keys, principals and fingerprints are ``VARBINARY``: MySQL's ``*_bin``
collations (``ascii_bin``, ``utf8mb4_bin``) are PAD SPACE, so ``'k'`` and
``'k '`` would collide in the unique index; binary strings compare byte for
byte, so neither case nor trailing spaces can merge two keys.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from .._errors import ConfigurationError, LeaseLost
from .._model import Claim, Intent, Record, State, can_take_over, record_from_row
from .._sync.sql import SQLStore
from ._sql import (
    CLAIM_RETRIES,
    CLOCK_NOW,
    COLUMNS,
    NEW_INTENT_SQL,
    PURGEABLE_SQL,
    SWEEPABLE_SQL,
    TAKE_OVER_SQL,
    Dialect,
    SQLStatement,
    StoreClock,
    check_clock,
    claim_busy,
    claim_params,
    claim_unsettled,
    on_database_clock,
    owner_params,
    row_mapping,
    sweep_params,
)
from .protocol import Statement, Transaction

__all__ = [
    "MySQLStore",
    "PyMySQLTransaction",
    "connect_kwargs",
    "mysql_dialect",
    "mysql_statements",
]

DEFAULT_TABLE = "idemflow_keys"

#: How long (whole seconds, InnoDB's minimum is 1) a claim waits on a row
#: another transaction holds before answering 409 instead: never hold a
#: connection per duplicate.
DEFAULT_LOCK_WAIT_TIMEOUT = 1

# Client errors meaning "the server is not there": can't connect (2002,
# 2003), gone away / lost (2006, 2013), too many connections (1040), server
# shutting down (1053), connection killed (1927 MariaDB, 4031 MySQL 8).
_UNREACHABLE = frozenset({1040, 1053, 1927, 2002, 2003, 2006, 2013, 4031})
_DUPLICATE, _LOCK_WAIT_TIMEOUT, _DEADLOCK = 1062, 1205, 1213
#: Error numbers that mean the server cannot take the statement now: a 503, not a 500.
UNAVAILABLE_CODES = _UNREACHABLE | {_LOCK_WAIT_TIMEOUT}
# A deadlock victim's statement had no effect: claiming again is safe.
_DEADLOCK_RETRIES = 5
_FOUND_ROWS = 2  # pymysql.constants.CLIENT.FOUND_ROWS
# An idle connection older than this is pinged before use (seconds).
_PING_AFTER = 30.0
_IN_TRANSACTION = 1  # pymysql.constants.SERVER_STATUS.SERVER_STATUS_IN_TRANS

# Binary strings come back as bytes; the model wants text.
_TEXT_COLUMNS = {"principal": "utf8mb4", "idempotency_key": "ascii", "fingerprint": "ascii"}
_SELECT_LIST = ", ".join(
    f"CONVERT({c} USING {_TEXT_COLUMNS[c]}) AS {c}" if c in _TEXT_COLUMNS else c for c in COLUMNS
)


@dataclass(frozen=True, slots=True)
class MySQLStatements:
    """What MySQL says beyond the shared :class:`Dialect`."""

    #: The plain INSERT that claims a new key (error 1062 when it exists).
    insert: SQLStatement
    #: The current row, read with a lock: the latest committed version even
    #: inside a REPEATABLE READ transaction whose snapshot is older.
    select_current: SQLStatement
    select_shared: SQLStatement
    #: The rows one sweep marked (found by its sweep token).
    swept: SQLStatement
    #: Is the record still ours? For an update that matched but changed nothing.
    still_owned: SQLStatement
    #: Bound, then restore, the caller's lock wait around a claim in its transaction.
    bound_lock_wait: SQLStatement
    restore_lock_wait: SQLStatement


def mysql_ddl(table: str) -> list[str]:
    """One ``CREATE TABLE IF NOT EXISTS`` with its indexes (MySQL 8 has no
    ``CREATE INDEX IF NOT EXISTS``, so they live inside it)."""
    return [
        f"""CREATE TABLE IF NOT EXISTS {table} (
            id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
            principal VARBINARY(255) NOT NULL,
            idempotency_key VARBINARY(255) NOT NULL,
            fingerprint VARBINARY(128) NOT NULL,
            endpoint VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL DEFAULT '',
            state VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
            lease_token VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NULL,
            recovery_point VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
            correlation_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
            response_status INT NULL,
            response_headers MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
            response_body LONGBLOB NULL,
            created_at BIGINT NOT NULL,
            updated_at BIGINT NOT NULL,
            expires_at BIGINT NOT NULL,
            attempt INT NOT NULL DEFAULT 1,
            UNIQUE KEY {table}_principal_key (principal, idempotency_key),
            KEY {table}_state_updated (state, updated_at),
            KEY {table}_expires (expires_at),
            CONSTRAINT {table}_state CHECK (state IN
                ('in_progress', 'completed', 'failed_permanent', 'released', 'stale'))
        ) ENGINE=InnoDB"""
    ]


def upsert_claim(table: str) -> str:
    """The takeover: ``INSERT … ON DUPLICATE KEY UPDATE``, every assignment guarded alike.

    MySQL evaluates the assignments left to right, each seeing the columns
    already changed (MariaDB too, unless ``SIMULTANEOUS_ASSIGNMENT`` is on, in
    which case all see the old row). So the lease token goes first, guarded
    by the takeover condition on the old row; every later assignment asks
    "is the token ours now, or does the old row qualify", which gives the
    same answer under both orders. ``state`` and ``expires_at`` go last because
    ``created_at``, ``recovery_point`` and ``attempt`` need their old values to
    tell a fresh intent (reset everything) from a retry of a released one
    (keep its recovery point).
    """
    qualifies = TAKE_OVER_SQL
    taken = f"(lease_token <=> :lease_token OR {qualifies})"
    expired = NEW_INTENT_SQL

    def guarded(column: str, value: str) -> str:
        return f"{column} = IF({taken}, {value}, {column})"

    assignments = [
        f"lease_token = IF({qualifies}, :lease_token, lease_token)",
        guarded("created_at", f"IF({expired}, :began_at, created_at)"),
        guarded("recovery_point", f"IF({expired}, NULL, recovery_point)"),
        guarded("attempt", f"IF({expired}, 1, attempt + 1)"),
        guarded("fingerprint", ":fingerprint"),
        guarded("endpoint", ":endpoint"),
        guarded("correlation_id", ":correlation_id"),
        guarded("response_status", "NULL"),
        guarded("response_headers", "NULL"),
        guarded("response_body", "NULL"),
        guarded("updated_at", ":now"),
        guarded("state", "'in_progress'"),
        guarded("expires_at", ":expires_at"),
    ]
    return (
        f"INSERT INTO {table} (principal, idempotency_key, fingerprint, endpoint, state, "
        "lease_token, correlation_id, created_at, updated_at, expires_at, attempt) "
        "VALUES (:principal, :key, :fingerprint, :endpoint, 'in_progress', :lease_token, "
        ":correlation_id, :began_at, :now, :expires_at, 1) "
        f"ON DUPLICATE KEY UPDATE {', '.join(assignments)}"
    )


#: The server's time in epoch milliseconds, whatever the session's time zone;
#: one value per statement.
SERVER_NOW_MS = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000"


def mysql_dialect(table: str = DEFAULT_TABLE, clock: StoreClock = "database") -> Dialect:
    """The shared fenced UPDATEs, with MySQL's own claim, read, sweep and purge.

    ``claim`` is the guarded upsert, which the store sends only for a
    takeover; a new key is claimed by :func:`mysql_statements`' plain INSERT.
    """
    standard = Dialect.standard("mysql", table, mysql_ddl(table), upsert_claim(table))
    by_key = "WHERE principal = :principal AND idempotency_key = :key"
    dialect = dataclasses.replace(
        standard,
        select=SQLStatement(f"SELECT {_SELECT_LIST} FROM {table} {by_key}"),
        read_for_claim=SQLStatement(f"SELECT {_SELECT_LIST}, {CLOCK_NOW} FROM {table} {by_key}"),
        # No LIMIT inside IN (…) and no UPDATE … RETURNING: mark a batch with
        # a token of this sweep in one statement, then read it back by token.
        sweep=SQLStatement(
            f"UPDATE {table} SET state = 'stale', lease_token = :sweep_token, "
            "updated_at = :now, expires_at = GREATEST(expires_at, :keep_until) "
            f"WHERE state = :from_state AND updated_at < :cutoff AND {SWEEPABLE_SQL} "
            "ORDER BY updated_at LIMIT :limit"
        ),
        purge=SQLStatement(
            f"DELETE FROM {table} WHERE expires_at <= :now AND {PURGEABLE_SQL} "
            "ORDER BY expires_at LIMIT :limit"
        ),
    )
    return on_database_clock(dialect, SERVER_NOW_MS) if clock == "database" else dialect


def mysql_statements(table: str = DEFAULT_TABLE, clock: StoreClock = "database") -> MySQLStatements:
    """The plain INSERT, the locking reads and the maintenance read-backs."""
    by_key = "WHERE principal = :principal AND idempotency_key = :key"
    statements = MySQLStatements(
        insert=SQLStatement(upsert_claim(table).split(" ON DUPLICATE KEY UPDATE ")[0]),
        select_current=SQLStatement(
            f"SELECT {_SELECT_LIST}, {CLOCK_NOW} FROM {table} {by_key} FOR UPDATE"
        ),
        # LOCK IN SHARE MODE: spelled alike by MySQL 8 and MariaDB.
        select_shared=SQLStatement(
            f"SELECT {_SELECT_LIST}, {CLOCK_NOW} FROM {table} {by_key} LOCK IN SHARE MODE"
        ),
        swept=SQLStatement(
            f"SELECT {_SELECT_LIST} FROM {table} WHERE state = 'stale' "
            "AND lease_token = :sweep_token ORDER BY updated_at, id"
        ),
        still_owned=SQLStatement(
            f"SELECT id FROM {table} WHERE id = :id AND lease_token = :lease_token "
            "AND state = 'in_progress' FOR UPDATE"
        ),
        bound_lock_wait=SQLStatement(
            "SET @idemflow_lock_wait = @@SESSION.innodb_lock_wait_timeout, "
            "SESSION innodb_lock_wait_timeout = :lock_wait"
        ),
        restore_lock_wait=SQLStatement(
            "SET SESSION innodb_lock_wait_timeout = @idemflow_lock_wait"
        ),
    )
    return on_database_clock(statements, SERVER_NOW_MS) if clock == "database" else statements


def error_code(exc: BaseException) -> int | None:
    """The server's error number of a PyMySQL error (or of one wrapped by SQLAlchemy)."""
    original = getattr(exc, "orig", None) or exc
    args = getattr(original, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def is_unavailable(exc: BaseException) -> bool:
    """Cannot reach the server, or it is too busy to take the statement: fail closed."""
    if isinstance(exc, _PoolExhausted) or _is_driver_error(exc, "InterfaceError"):
        return True
    return _is_driver_error(exc, "OperationalError") and error_code(exc) in UNAVAILABLE_CODES


def _is_driver_error(exc: BaseException, name: str) -> bool:
    """Is ``exc`` PyMySQL's error ``name``? By name, not identity: PyMySQL installed as
    MySQLdb (Django) runs its error module a second time, with classes of its own."""
    return any(c.__name__ == name and c.__module__.endswith(".err") for c in type(exc).__mro__)


def is_contention(exc: BaseException) -> bool:
    """A lock wait timeout or deadlock: another transaction holds this key's row."""
    return error_code(exc) in (_LOCK_WAIT_TIMEOUT, _DEADLOCK)


class _PoolExhausted(Exception):
    """Every connection of the pool stayed busy for the whole timeout."""


class _Pool:
    """A small thread-safe pool of autocommit PyMySQL connections.

    A connection that saw any error is closed rather than reused: its
    session state is unknown. One idle for longer than ``_PING_AFTER`` is
    pinged (and reconnected) first, so a server that dropped it while idle
    (``wait_timeout``) costs a round trip, not a 503. After ``fork`` the child
    starts empty and never touches the parent's sockets.
    """

    def __init__(self, factory: Callable[[], Any], max_size: int, timeout: float) -> None:
        self._factory = factory
        self._max_size = max_size
        self._timeout = timeout
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._idle: list[tuple[Any, float]] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self._max_size)

    @contextmanager
    def connection(self) -> Iterator[Any]:
        if self._pid != os.getpid():
            self._reset()
        if not self._slots.acquire(timeout=self._timeout):
            msg = f"all {self._max_size} MySQL connections busy for {self._timeout:g}s"
            raise _PoolExhausted(msg)
        try:
            conn = self._checkout()
            try:
                yield conn
            except BaseException:
                _close_quietly(conn)
                raise
            with self._lock:
                self._idle.append((conn, time.monotonic()))
        finally:
            self._slots.release()

    def _checkout(self) -> Any:
        with self._lock:
            conn, since = self._idle.pop() if self._idle else (None, 0.0)
        if conn is not None:
            if time.monotonic() - since > _PING_AFTER:
                conn.ping(reconnect=True)
            return conn
        conn = self._factory()
        conn.autocommit(True)
        return conn

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            _close_quietly(conn)


def _close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001 -- already broken: nothing left to release
        return


def connect_kwargs(url: str) -> dict[str, Any]:
    """``mysql://user:password@host:3306/db?found_rows=1`` → ``pymysql.connect`` arguments."""
    parts = urlsplit(url)
    database = unquote(parts.path.lstrip("/"))
    if not parts.hostname or not database:
        msg = f"MySQL URLs name a host and a database: mysql://user@host:3306/db, not {url!r}"
        raise ConfigurationError(msg)
    kwargs: dict[str, Any] = {
        "host": parts.hostname,
        "port": parts.port or 3306,
        "user": unquote(parts.username or "root"),
        "password": unquote(parts.password or ""),
        "database": database,
    }
    options = dict(parse_qsl(parts.query))
    if options.get("found_rows", "").lower() in ("1", "true", "yes"):
        kwargs["client_flag"] = _FOUND_ROWS
    return kwargs


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
    # (innodb_lock_wait_timeout, then restored): single-commit mode is safe.
    supports_single_commit = True

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
        self.pool = _Pool(self._factory(connect, timeout), max_size, timeout)
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
                self._statement(conn, self.dialect.claim, params)
                return _decided(self._fetchone(conn, self.dialect.select, params), lease_token)
        raise claim_busy()

    def _insert(self, conn: Any, params: Mapping[str, Any]) -> int | None:
        """The new row's id, or None when the key exists (error 1062)."""
        try:
            return self._statement(conn, self.statements.insert, params)
        except Exception as exc:
            if error_code(exc) == _DUPLICATE:
                return None
            raise

    def _statement(self, conn: Any, statement: SQLStatement, params: Mapping[str, Any]) -> int:
        """Run a claiming statement; the id it inserted (0 if none).

        A deadlock victim's statement had no effect, so it is simply run
        again; a lock wait that times out means a live transaction holds the
        row, which is a 409.
        """
        for _ in range(_DEADLOCK_RETRIES):
            with conn.cursor() as cursor:
                try:
                    cursor.execute(statement.pyformat, statement.bind(params))
                except Exception as exc:
                    if error_code(exc) == _DEADLOCK:
                        continue
                    if error_code(exc) == _LOCK_WAIT_TIMEOUT:
                        raise claim_busy() from exc
                    raise
                return int(cursor.lastrowid or 0)
        raise claim_busy()

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

    def _insert_or_read(
        self, transaction: Transaction, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        try:
            transaction.execute(self.statements.insert, params)
        except Exception as exc:
            if error_code(exc) != _DUPLICATE:
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


class PyMySQLTransaction:
    """A ``pymysql.Connection``; joins a transaction the caller already began.

    Works under any isolation level: the store's own statements in your
    transaction are writes or locking reads, which always see the latest
    committed row, never an older REPEATABLE READ snapshot.
    """

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def begin(self) -> None:
        # BEGIN would silently commit what the caller's transaction already did.
        if not self.connection.server_status & _IN_TRANSACTION:
            self.connection.begin()

    def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        with self.connection.cursor() as cursor:
            return int(cursor.execute(statement.pyformat, _bind(statement, params)))

    def fetchone(self, statement: Statement, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        with self.connection.cursor() as cursor:
            cursor.execute(statement.pyformat, _bind(statement, params))
            row = cursor.fetchone()
            return None if row is None else row_mapping(cursor.description, row)

    def commit(self) -> None:
        self.connection.commit()

    def rollback(self) -> None:
        self.connection.rollback()


def _bind(statement: Statement, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
    bind = getattr(statement, "bind", None)
    return dict(params) if bind is None else bind(params)
