"""
``AsyncSQLite3Transaction``: the completion in an asyncio app's own SQLite transaction.

The same promises as every adapter in ``tests/core/test_transactions.py`` (both
commit, or neither; a handler's exception releases the key; a lost claim or a
refused COMMIT leaves nothing), and the two that are SQLite's own: every
statement runs on the connection's one thread, and the transaction begins
deferred, so a handler that waits before its first write holds no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from idemflow import AsyncAttempt, AsyncIdempotency, Intent, LeaseLost, Response, State
from idemflow.stores.sqlite import AsyncSQLiteStore, connect
from idemflow.testing import FrozenClock
from idemflow.transactions import AsyncSQLite3Connection, AsyncSQLite3Transaction
from tests.factories import POLICY
from tests.sweeping import async_sweep_away

pytestmark = pytest.mark.anyio

INTENT = Intent("alice", "k-1", "fp-1", endpoint="POST /payments")
OTHER = Intent("alice", "k-2", "fp-2", endpoint="POST /payments")
CREATED = Response.json(201, {"id": "pay_1"})
ORPHAN = 42  # a parent id that never exists: the deferred foreign key fails at COMMIT


@dataclass
class App:
    """A key table and a business table in one file, an async connection, a frozen clock."""

    path: Path
    table: str
    store: AsyncSQLiteStore
    connection: AsyncSQLite3Connection
    clock: FrozenClock

    def idempotency(self) -> AsyncIdempotency:
        return AsyncIdempotency(self.store, POLICY, clock=self.clock)

    def transaction(self, *, immediate: bool = False) -> AsyncSQLite3Transaction:
        return AsyncSQLite3Transaction(self.connection, immediate=immediate)

    async def write(
        self, connection: AsyncSQLite3Connection, note: str, parent: int | None
    ) -> None:
        """A business row, as a handler writes it: on the connection's own thread."""
        insert = f"INSERT INTO biz_{self.table} (note, parent) VALUES (?, ?)"
        await connection.run(connection.raw.execute, insert, (note, parent))

    def notes(self) -> list[str]:
        """Committed business rows, read on a connection of their own."""
        with contextlib.closing(sqlite3.connect(self.path)) as conn:
            return [row[0] for row in conn.execute(f"SELECT note FROM biz_{self.table}")]

    async def state(self, intent: Intent = INTENT) -> State | None:
        record = await self.store.get(intent.principal, intent.key)
        return None if record is None else record.state


@pytest.fixture
async def app(tmp_path: Path, table_name: str) -> AsyncIterator[App]:
    path = tmp_path / "app.db"
    store = AsyncSQLiteStore(path, table=table_name)
    await store.migrate()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"CREATE TABLE parent_{table_name} (id INTEGER PRIMARY KEY)")
        conn.execute(
            f"CREATE TABLE biz_{table_name} (id INTEGER PRIMARY KEY, note TEXT NOT NULL, "
            f"parent INTEGER REFERENCES parent_{table_name} (id) DEFERRABLE INITIALLY DEFERRED)"
        )
        conn.commit()
    raw = connect(path, busy_timeout=5.0)
    raw.execute("PRAGMA foreign_keys = ON")
    connection = AsyncSQLite3Connection(raw)
    try:
        yield App(path, table_name, store, connection, FrozenClock())
    finally:
        connection.close()
        store.sync.close()


async def test_success_commits_the_effect_and_the_completion(app: App) -> None:
    """The business row and the completed record commit together, on the connection given."""

    async def handler(attempt: AsyncAttempt) -> Response:
        assert attempt.connection is app.connection
        await app.write(attempt.connection, "paid", None)
        return CREATED

    outcome = await app.idempotency().run(INTENT, handler, transaction=app.transaction())

    assert (outcome.response, outcome.replayed) == (CREATED, False)
    assert app.notes() == ["paid"]
    assert await app.state() is State.COMPLETED
    assert not app.connection.raw.in_transaction


async def test_handler_exception_rolls_back_and_releases(app: App) -> None:
    """The business write is undone, the key released, the handler's exception passes unchanged."""
    boom = RuntimeError("boom")

    async def handler(attempt: AsyncAttempt) -> Response:
        await app.write(attempt.connection, "half-done", None)
        raise boom

    with pytest.raises(RuntimeError) as raised:
        await app.idempotency().run(INTENT, handler, transaction=app.transaction())

    assert raised.value is boom
    assert app.notes() == []
    assert await app.state() is State.RELEASED
    assert not app.connection.raw.in_transaction


async def test_lost_claim_rolls_back_the_effect(app: App) -> None:
    """Taken over mid-flight: the completion's compare-and-set fails; the business write is gone."""

    async def handler(attempt: AsyncAttempt) -> Response:
        app.clock.advance(3601)  # past the stale threshold: the sweeper ends our claim
        now = app.clock()
        assert len(await async_sweep_away(app.store, now)) == 1
        assert (await app.store.claim(INTENT, "thief", now, now + 3600)).owned
        await app.write(attempt.connection, "second effect", None)
        return CREATED

    with pytest.raises(LeaseLost):
        await app.idempotency().run(INTENT, handler, transaction=app.transaction())

    assert app.notes() == []
    record = await app.store.get(INTENT.principal, INTENT.key)
    assert record is not None
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "thief")
    assert not app.connection.raw.in_transaction


async def test_failed_commit_stores_nothing_and_releases(app: App) -> None:
    """A COMMIT refused by a deferred foreign key leaves no effect, no completion, a free key."""

    async def handler(attempt: AsyncAttempt) -> Response:
        await app.write(attempt.connection, "orphan", ORPHAN)
        return CREATED

    with pytest.raises(sqlite3.IntegrityError, match=r"(?i)foreign key"):
        await app.idempotency().run(INTENT, handler, transaction=app.transaction())

    assert app.notes() == []
    assert await app.state() is State.RELEASED  # not stuck in_progress until the sweeper
    assert not app.connection.raw.in_transaction
    retry = await app.idempotency().run(INTENT, lambda attempt: _created())
    assert (retry.response, retry.replayed) == (CREATED, False)


async def _created() -> Response:
    return CREATED


async def test_every_statement_runs_on_the_connections_own_thread(app: App) -> None:
    """idemflow's statements and the handler's take turns on one thread, never the event loop's."""
    seen: set[str] = set()
    original: sqlite3.Connection = app.connection.raw

    class Watched:
        """The raw connection, noting the thread of every statement."""

        def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
            seen.add(threading.current_thread().name)
            return original.execute(sql, params)

        def __getattr__(self, name: str) -> object:
            return getattr(original, name)

    app.connection.raw = Watched()
    try:

        async def handler(attempt: AsyncAttempt) -> Response:
            await app.write(attempt.connection, "paid", None)
            return CREATED

        transaction = AsyncSQLite3Transaction(app.connection)
        await app.idempotency().run(INTENT, handler, transaction=transaction)
    finally:
        app.connection.raw = original

    assert len(seen) == 1, seen
    assert next(iter(seen)).startswith("idemflow-sqlite")
    assert threading.current_thread().name not in seen


async def test_a_fenced_write_and_its_commit_take_one_hop(app: App) -> None:
    """The checkpoint, its COMMIT and the next BEGIN are one hop to the thread; so are the
    completion and its COMMIT: protection adds no hop beyond the transaction's own BEGIN."""
    hops: list[str] = []
    run = app.connection.run

    async def counted(function: Any, *args: Any) -> Any:
        hops.append(getattr(function, "__name__", repr(function)))
        return await run(function, *args)

    app.connection.run = counted  # type: ignore[method-assign]

    async def handler(attempt: AsyncAttempt) -> Response:
        await app.write(attempt.connection, "pending", None)
        await attempt.commit_phase("created")
        await app.write(attempt.connection, "paid", None)
        return CREATED

    outcome = await app.idempotency().run(INTENT, handler, transaction=app.transaction())

    assert (outcome.response, outcome.replayed) == (CREATED, False)
    # BEGIN, the handler's write, checkpoint+COMMIT+BEGIN, the handler's write, complete+COMMIT.
    assert len(hops) == 5, hops
    assert app.notes() == ["pending", "paid"]
    assert await app.state() is State.COMPLETED
    assert not app.connection.raw.in_transaction


async def test_a_deferred_transaction_holds_no_lock_until_it_writes(app: App) -> None:
    """While a handler waits (an external call) before its first write, another request commits."""
    waiting, go_on = asyncio.Event(), asyncio.Event()

    async def slow(attempt: AsyncAttempt) -> Response:
        waiting.set()
        await go_on.wait()
        await app.write(attempt.connection, "slow", None)
        return CREATED

    async def fast(attempt: AsyncAttempt) -> Response:
        await app.write(attempt.connection, "fast", None)
        return CREATED

    other = AsyncSQLite3Connection(connect(app.path, busy_timeout=0.0))
    try:
        first = asyncio.create_task(
            app.idempotency().run(INTENT, slow, transaction=app.transaction())
        )
        await waiting.wait()
        # No busy wait: were the first transaction holding the write lock, this would fail at once.
        await app.idempotency().run(OTHER, fast, transaction=AsyncSQLite3Transaction(other))
        assert app.notes() == ["fast"]
        go_on.set()
        await first
    finally:
        other.close()

    assert sorted(app.notes()) == ["fast", "slow"]
    assert (await app.state(), await app.state(OTHER)) == (State.COMPLETED, State.COMPLETED)


async def test_immediate_takes_the_write_lock_at_begin(app: App) -> None:
    """``immediate=True``: the lock is held from BEGIN, before the handler writes anything."""
    inside, go_on = asyncio.Event(), asyncio.Event()

    async def handler(attempt: AsyncAttempt) -> Response:
        inside.set()
        await go_on.wait()
        await app.write(attempt.connection, "paid", None)
        return CREATED

    run = app.idempotency().run(INTENT, handler, transaction=app.transaction(immediate=True))
    task = asyncio.create_task(run)
    await inside.wait()
    rival = sqlite3.connect(app.path, timeout=0, isolation_level=None)
    with contextlib.closing(rival), pytest.raises(sqlite3.OperationalError, match="locked"):
        rival.execute(f"INSERT INTO parent_{app.table} (id) VALUES (1)")
    go_on.set()
    await task

    assert app.notes() == ["paid"]


async def test_close_finishes_the_thread_and_closes_the_connection(tmp_path: Path) -> None:
    """After close() the sqlite3 connection is closed: nothing can run on it by mistake."""
    connection = AsyncSQLite3Connection(connect(tmp_path / "x.db"))
    assert await connection.run(lambda: connection.raw.execute("SELECT 1").fetchone()) == (1,)

    connection.close()

    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        connection.raw.execute("SELECT 1")
    with pytest.raises(RuntimeError, match="shutdown"):
        await connection.run(lambda: None)
