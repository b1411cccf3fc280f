"""SQLite: the embedded default store, correct across threads and processes sharing one file
(the claim is one ``INSERT … ON CONFLICT … RETURNING``). Why, and when it waits:
docs/stores.md, "SQLite: one writer, many threads and processes".
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import functools
import os
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal, TypeVar

from ..._errors import ConfigurationError, StoreUnavailable
from ..._model import DEFAULT_STALE_SECONDS, Claim, Intent, Policy, Record, Response, State
from ..._process import PID
from ..protocol import AsyncMaintainableStore, AsyncTransaction
from ..sql import (
    AsyncSQLStore,
    Dialect,
    SQLStats,
    SQLStore,
    create_table,
    insert_claim,
)
from ..sql.dialect import upgrade_table

__all__ = ["AsyncSQLiteStore", "SQLiteStore", "connect", "is_unavailable"]

DEFAULT_TABLE = "idemflow_keys"


def sqlite_dialect(table: str = DEFAULT_TABLE) -> Dialect:
    table_ddl = create_table(
        table, id_column="id INTEGER PRIMARY KEY", bigint="INTEGER", blob="BLOB"
    )
    ddl = ["BEGIN IMMEDIATE", *table_ddl, "COMMIT"]
    upgrade = ["BEGIN IMMEDIATE", *upgrade_table(table, "INTEGER"), "COMMIT"]
    return Dialect.standard("sqlite", table, ddl, insert_claim(table), upgrade=upgrade)


# Primary result codes that mean "cannot use the file now", not "bad SQL":
# BUSY, LOCKED, READONLY, IOERR, FULL, CANTOPEN.
_UNAVAILABLE_CODES = frozenset({5, 6, 8, 10, 13, 14})


def is_unavailable(exc: BaseException) -> bool:
    """The file cannot be used now (locked past the busy timeout, read-only, full): an outage."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.Error) and code is not None and code & 0xFF in _UNAVAILABLE_CODES


# One lock per database file and process: its writers wake the moment it is free, where
# SQLite's busy handler sleeps and retries. busy_timeout stays for other processes.
_WRITERS: dict[str, threading.RLock] = {}
_WRITERS_GUARD = threading.Lock()


def _writer_lock(path: str) -> threading.RLock:
    key = path if path == ":memory:" or path.startswith("file:") else os.path.realpath(path)
    with _WRITERS_GUARD:
        lock = _WRITERS.get(key)
        if lock is None:
            lock = _WRITERS[key] = threading.RLock()
        return lock


def _forked() -> None:
    # A child's inherited locks may be held by a parent's thread it does not have.
    _WRITERS.clear()


os.register_at_fork(after_in_child=_forked)


class _Writer:
    """A thread's connection, entered while holding the process's lock on its file."""

    __slots__ = ("_lock", "_timeout", "conn")

    def __init__(self, conn: sqlite3.Connection, lock: threading.RLock, timeout: float) -> None:
        self.conn = conn
        self._lock = lock
        self._timeout = timeout

    def __enter__(self) -> sqlite3.Connection:
        if not self._lock.acquire(False) and not self._lock.acquire(timeout=self._timeout):
            msg = "sqlite key store unavailable: the database stayed locked past busy_timeout"
            raise StoreUnavailable(msg)
        return self.conn

    def __exit__(self, *exc_info: object) -> None:
        self._lock.release()


class _Connections:
    """One autocommit connection per (process, thread): sqlite3 objects cross neither."""

    def __init__(self, path: str, busy_timeout: float, *, checkpoints: bool = True) -> None:
        self.path = path
        self._busy_timeout = busy_timeout
        self._checkpoints = checkpoints
        self._local = threading.local()
        self._opened: list[sqlite3.Connection] = []  # every thread's, so close() reaches them
        self._lock = threading.Lock()

    def __call__(self) -> _Writer:
        writer: _Writer | None = getattr(self._local, "writer", None)
        if writer is None or self._local.pid != PID[0]:
            writer = self._open()
        elif writer._timeout != self._busy_timeout:  # a driver shortened it since: on its thread
            writer._timeout = self._busy_timeout
            writer.conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
        return writer

    def shorten(self, busy_timeout: float) -> None:
        """Wait at most ``busy_timeout`` for a lock, each connection from its next call on."""
        self._busy_timeout = min(self._busy_timeout, busy_timeout)

    def reader(self) -> nullcontext[sqlite3.Connection]:
        return nullcontext(self().conn)

    def _open(self) -> _Writer:
        conn = connect(self.path, busy_timeout=self._busy_timeout)
        if not self._checkpoints:  # another connection's commits checkpoint the WAL
            conn.execute("PRAGMA wal_autocheckpoint=0")
        writer = _Writer(conn, _writer_lock(self.path), self._busy_timeout)
        self._local.writer, self._local.pid = writer, PID[0]
        with self._lock:
            self._opened.append(conn)
        return writer

    def close(self) -> None:
        """Close every connection opened so far; a later call opens new ones."""
        with self._lock:
            opened, self._opened = self._opened, []
            self._local = threading.local()
        for conn in opened:
            conn.close()


def connect(path: str | Path, *, busy_timeout: float = 5.0) -> sqlite3.Connection:
    """An autocommit connection set up the way idemflow expects (WAL, NORMAL sync)."""
    conn = sqlite3.connect(
        path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
    )
    conn.execute("PRAGMA journal_mode=WAL")
    # In WAL mode NORMAL loses nothing to an application crash (an OS crash may).
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


class SQLiteStore(SQLStore):
    """Key records in a SQLite file (created on `migrate`).

    Args:
        busy_timeout: how long a write waits for another connection's lock on the
            file before ``StoreUnavailable`` (503); ``policy.store_wait_seconds``
            by default (half the request timeout, at most 5 s).
        policy: your app's policy, which bounds the waits (above).
    """

    #: Do this store's commits checkpoint the WAL (SQLite's default)?
    _checkpoints = True

    def __init__(
        self,
        path: str | Path,
        *,
        table: str = DEFAULT_TABLE,
        busy_timeout: float | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.path = str(path)
        if busy_timeout is None:
            busy_timeout = (policy or Policy()).store_wait_seconds
        self._connections = _Connections(self.path, busy_timeout, checkpoints=self._checkpoints)
        super().__init__(
            sqlite_dialect(table),
            self._connections,
            paramstyle="named",
            is_unavailable=is_unavailable,
            read_connect=self._connections.reader,
            extra_params=True,
        )

    def cover_store_wait(self, seconds: float) -> None:
        """A driver's store wait: no write waits longer for the file's lock."""
        self._connections.shorten(seconds)

    def close(self) -> None:
        """Close the store's connections (one per thread that used it)."""
        self._connections.close()


T = TypeVar("T")


class _Busy(enum.Enum):
    """What `if_free` answers when the write must hop instead."""

    BUSY = enum.auto()


class _AtOnce(SQLiteStore):
    """The file for writes on the event loop's thread: no busy timeout, no WAL checkpoint."""

    _checkpoints = False

    def __init__(self, path: str | Path, *, table: str) -> None:
        super().__init__(path, table=table, busy_timeout=0)

    def if_free(self, write: Callable[..., T], *args: Any) -> T | Literal[_Busy.BUSY]:
        """``write(*args)`` now, in one ``BEGIN IMMEDIATE`` transaction, if both the process's
        lock and SQLite's write lock are free at once; else BUSY and nothing is written."""
        try:
            writer = self._connections()
        except sqlite3.Error:  # opening it (``journal_mode=WAL``) met a lock: hop
            return _Busy.BUSY
        if not writer._lock.acquire(False):
            return _Busy.BUSY
        try:
            conn = writer.conn
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error:  # another process writes (or the file is unwell): hop
                return _Busy.BUSY
            try:
                done = write(*args)
                conn.execute("COMMIT")
            except BaseException as exc:
                if conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):  # the first error is the one to tell
                        conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error) and is_unavailable(exc):
                    raise StoreUnavailable(f"sqlite key store unavailable: {exc}") from exc
                raise
            return done
        finally:
            writer._lock.release()


class _WriteThread:
    """The async store's own writes, in turn, on one thread of its own (one per process):
    docs/benchmarks.md, "SQLite: the async store's writes on one thread"."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()
        #: Writes handed over and not finished: one on the loop's thread waits for them.
        self.pending = 0
        self._idle_waiters: list[asyncio.Future[None]] = []

    def busy(self) -> bool:
        """Is a write handed over and not finished (in this process: not a parent's)?"""
        return self.pending > 0 and self._pid == PID[0]

    async def idle(self) -> None:
        """Return once no write handed over is pending (else every later write would hop)."""
        while self.busy():
            waiter = asyncio.get_running_loop().create_future()
            with self._lock:
                if not self.busy():
                    return
                self._idle_waiters.append(waiter)
            await waiter

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the thread, in the caller's context (as ``to_thread``)."""
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        with self._lock:
            self.pending += 1
        try:
            return await loop.run_in_executor(self._thread(), context.run, function, *args)
        finally:
            woken: list[asyncio.Future[None]] = []
            with self._lock:
                self.pending -= 1
                if self.pending == 0:
                    woken, self._idle_waiters = self._idle_waiters, []
            for waiter in woken:
                _wake(waiter, loop)

    def _thread(self) -> ThreadPoolExecutor:
        executor = self._executor
        if executor is None or self._pid != PID[0]:  # none yet, closed, or a forked child's
            with self._lock:
                if self._executor is None or self._pid != PID[0]:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="idemflow-sqlite")
                    self._pid = PID[0]
                executor = self._executor
        return executor

    def close(self) -> None:
        """Finish the writes handed over; the next write starts a new thread."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None and self._pid == PID[0]:
            executor.shutdown(wait=True)


def _wake(waiter: asyncio.Future[None], running: asyncio.AbstractEventLoop) -> None:
    """Settle ``waiter`` (cancelled meanwhile: nothing to do), from its own loop."""
    if waiter.get_loop() is running:
        if not waiter.done():
            waiter.set_result(None)
    else:  # a store shared by event loops on several threads
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits there
            waiter.get_loop().call_soon_threadsafe(_wake, waiter, waiter.get_loop())


#: One completion in this many commits on the write thread, whose commits checkpoint the WAL.
CHECKPOINT_HOP = 64


class AsyncSQLiteStore(AsyncMaintainableStore):
    """The SQLite store for asyncio code: each operation is one hop to a thread, or none."""

    supports_transactions = True
    # One writer at a time: a duplicate would queue behind the whole transaction.
    supports_single_commit = False
    renews_claims = True

    def __init__(
        self,
        path: str | Path,
        *,
        table: str = DEFAULT_TABLE,
        busy_timeout: float | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.sync = SQLiteStore(path, table=table, busy_timeout=busy_timeout, policy=policy)
        self.dialect = self.sync.dialect
        self._writes = _WriteThread()
        self._at_once = _AtOnce(path, table=table)
        self._completions = 0
        # Writes in the caller's transaction, on the caller's connection: it has none of its own.
        self._in_transaction = AsyncSQLStore(
            self.dialect, nullcontext, paramstyle="named", is_unavailable=is_unavailable
        )

    def is_unavailable(self, exc: BaseException) -> bool:
        return is_unavailable(exc)

    def cover_store_wait(self, seconds: float) -> None:
        """[`SQLiteStore.cover_store_wait`][idemflow.stores.sqlite.SQLiteStore.cover_store_wait]."""
        self.sync.cover_store_wait(seconds)

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
        if transaction is not None:
            msg = "single-commit mode needs PostgreSQL; SQLite admits one writer"
            raise ConfigurationError(msg)
        return await self._write(
            functools.partial(self._at_once.claim, stale_after=stale_after),
            functools.partial(self.sync.claim, stale_after=stale_after),
            intent,
            lease_token,
            now,
            expires_at,
        )

    async def _write(self, at_once: Callable[..., T], on_thread: Callable[..., T], *args: Any) -> T:
        """``at_once(*args)`` on the loop's thread when no handed-over write is pending and
        both locks are free (a hop costs more than the statement); else ``on_thread(*args)``."""
        await self._writes.idle()
        done = self._at_once.if_free(at_once, *args)
        if done is not _Busy.BUSY:
            return done
        return await self._writes.run(on_thread, *args)

    async def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        if transaction is not None:
            await self._in_transaction.complete(
                record, state, response, now, expires_at, transaction
            )
            return
        args = (record, state, response, now, expires_at)
        if self._checkpoint_due():
            await self._writes.run(self.sync.complete, *args)
        else:
            await self._write(self._at_once.complete, self.sync.complete, *args)

    def _checkpoint_due(self) -> bool:
        """Is this completion the one in `CHECKPOINT_HOP` that commits (and checkpoints) on
        the write thread? The loop's thread never checkpoints."""
        self._completions += 1
        return self._completions % CHECKPOINT_HOP == 0

    async def release(
        self, record: Record, now: float, transaction: AsyncTransaction | None = None
    ) -> bool:
        if transaction is None:
            return await self._write(self._at_once.release, self.sync.release, record, now)
        return await self._in_transaction.release(record, now, transaction)

    async def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        if transaction is None:
            args = (record, recovery_point, now)
            await self._write(self._at_once.checkpoint, self.sync.checkpoint, *args)
            return
        await self._in_transaction.checkpoint(record, recovery_point, now, transaction)

    async def renew(self, record: Record, now: float) -> None:
        await self._write(self._at_once.renew, self.sync.renew, record, now)

    async def get(self, principal: str, key: str) -> Record | None:
        return await asyncio.to_thread(self.sync.get, principal, key)

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        return await self._writes.run(self.sync.sweep, from_state, cutoff, now, keep_until, limit)

    async def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
        return await asyncio.to_thread(self.sync.next_due, from_state, cutoff, now)

    async def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> bool:
        if transaction is None:
            return await self._writes.run(
                self.sync.settle_stale, record, state, response, now, expires_at
            )
        return await self._in_transaction.settle_stale(
            record, state, response, now, expires_at, transaction
        )

    async def release_stale(
        self,
        record: Record,
        now: float,
        transaction: AsyncTransaction | None = None,
        *,
        forget_progress: bool = False,
    ) -> bool:
        if transaction is None:
            return await self._writes.run(
                functools.partial(self.sync.release_stale, forget_progress=forget_progress),
                record,
                now,
            )
        return await self._in_transaction.release_stale(
            record, now, transaction, forget_progress=forget_progress
        )

    async def purge(self, now: float, limit: int) -> int:
        return await self._writes.run(self.sync.purge, now, limit)

    async def migrate(self) -> None:
        await self._writes.run(self.sync.migrate)

    def stats(self) -> SQLStats:
        """The operator's questions, on the sync store's connections (a local file: no hop)."""
        return self.sync.stats()

    async def close(self) -> None:
        """Finish the writes handed over, then close the connections this store opened."""
        await asyncio.to_thread(self._writes.close)
        await asyncio.to_thread(self.sync.close)
        self._at_once.close()
