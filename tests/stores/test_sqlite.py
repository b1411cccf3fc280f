"""
SQLite's writers queue on a lock of this process, one per database file, instead
of SQLite's sleeping busy handler; reads never take it, and a writer that cannot
get it within ``busy_timeout`` is an outage (503), as SQLITE_BUSY is.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from idemflow import Response, State, StoreUnavailable
from idemflow.stores.sqlite import (
    CHECKPOINT_HOP,
    AsyncSQLiteStore,
    SQLiteStore,
    _writer_lock,
    connect,
)
from tests.factories import intent, until

NOW = 1_800_000_000.0
CREATED = Response(201, b"created")


@contextmanager
def held(lock: threading.RLock) -> Iterator[None]:
    """``lock`` held by another thread until the block ends."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        release.set()
        holder.join(10)


def test_stores_on_one_file_share_its_writer_lock(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    assert _writer_lock(str(path)) is _writer_lock(f"{tmp_path}/./keys.db")
    assert _writer_lock(str(path)) is not _writer_lock(str(tmp_path / "other.db"))


def test_a_writer_that_cannot_get_the_lock_in_time_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    store = SQLiteStore(path, busy_timeout=0.2)
    store.migrate()
    try:
        with held(_writer_lock(str(path))), pytest.raises(StoreUnavailable):
            store.claim(intent("k-1"), "lease-1", NOW, NOW + 60)
        assert store.get("alice", "k-1") is None  # nothing was written
        assert store.claim(intent("k-1"), "lease-2", NOW, NOW + 60).owned
    finally:
        store.close()


def test_reads_do_not_wait_for_the_writer_lock(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    store = SQLiteStore(path, busy_timeout=30)
    store.migrate()
    try:
        claimed = store.claim(intent("k-1"), "lease-1", NOW, NOW + 60).record
        with held(_writer_lock(str(path))):
            assert store.get("alice", "k-1") == claimed
            assert store.stats().stuck_claims(NOW + 1)["in_progress"] == 1
    finally:
        store.close()


def test_the_stores_own_writers_never_wait_in_sqlites_busy_handler(tmp_path: Path) -> None:
    """8 threads claim, checkpoint, complete and release while another sweeps and purges,
    every connection with SQLite's busy timeout at 0: no write ever finds the file locked
    (SQLITE_BUSY, a 503), because this process's writers wait on its lock, never in
    SQLite's sleeping busy handler."""
    path = tmp_path / "keys.db"
    store = SQLiteStore(path, busy_timeout=30)
    store.migrate()
    failures: list[BaseException] = []
    start = threading.Barrier(9)

    def no_busy_handler() -> None:
        store._connections().conn.execute("PRAGMA busy_timeout = 0")
        start.wait(10)

    def requests(worker: int) -> None:
        try:
            no_busy_handler()
            for n in range(150):
                claim = store.claim(intent(f"k-{worker}-{n}"), f"lease-{worker}-{n}", NOW, NOW + 60)
                store.checkpoint(claim.record, "halfway", NOW)
                if n % 3:
                    store.complete(claim.record, State.COMPLETED, CREATED, NOW, NOW + 60)
                else:
                    store.release(claim.record, NOW)
        except BaseException as exc:  # handed to the test
            failures.append(exc)

    def sweeper() -> None:
        try:
            no_busy_handler()
            for _ in range(150):
                store.sweep(State.IN_PROGRESS, NOW - 1, NOW, NOW + 60, 10)
                store.purge(NOW + 120, 10)
        except BaseException as exc:  # handed to the test
            failures.append(exc)

    threads = [threading.Thread(target=requests, args=(n,)) for n in range(8)]
    threads.append(threading.Thread(target=sweeper))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    store.close()
    assert failures == []


def test_a_forked_child_opens_its_own_connection_and_writer_lock(tmp_path: Path) -> None:
    # The store knows its process from a pid kept current at fork (no getpid per
    # call): a child must open its own connection, never write on the parent's,
    # and must not wait on a writer lock a parent's thread held at the fork.
    store = SQLiteStore(str(tmp_path / "keys.db"))
    store.migrate()
    parent_conn = store._connections().conn
    with held(_writer_lock(store.path)):
        child = os.fork()
        if child == 0:  # pragma: no cover -- the child reports by its exit status
            code = 1
            try:
                store.claim(intent(key="from-the-child"), "lease-1", NOW, NOW + 3600)
                code = 0 if store._connections().conn is not parent_conn else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert store._connections().conn is parent_conn
    assert store.get("alice", "from-the-child") is not None


# --- the async store: its writes on one thread of its own, its reads beside them ---------


def _writes_seen(store: AsyncSQLiteStore) -> list[str]:
    """The names of the threads the async store's claims, completions, releases and
    checkpoints run on."""
    seen: list[str] = []

    def on_thread(function: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            seen.append(threading.current_thread().name)
            return function(*args, **kwargs)

        return recorded

    for store_ in (store.sync, store._at_once):
        for name in ("claim", "complete", "release", "checkpoint"):
            setattr(store_, name, on_thread(getattr(store_, name)))
    return seen


@pytest.mark.anyio
async def test_the_async_stores_writes_take_their_turn_on_one_thread_of_its_own(
    tmp_path: Path,
) -> None:
    """Its writes queue on the process's lock on the file anyway: from the loop's default
    executor they took several threads that handed it (and the GIL) to one another.
    Purges always hop: 32 at once run on one thread, the store's."""
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    await store.migrate()
    seen: list[str] = []
    purge = store.sync.purge

    def recorded(now: float, limit: int) -> int:
        seen.append(threading.current_thread().name)
        return purge(now, limit)

    store.sync.purge = recorded  # type: ignore[method-assign]
    try:
        await asyncio.gather(*(store.purge(NOW, 10) for _ in range(32)))
        assert len(seen) == 32
        assert len(set(seen)) == 1
        assert seen[0].startswith("idemflow-sqlite")
    finally:
        await store.close()


@pytest.mark.anyio
async def test_writes_wait_for_one_handed_over_then_run_on_the_loops_thread(
    tmp_path: Path,
) -> None:
    """A write handed over is never overtaken: claims and completions arriving meanwhile
    wait for it on the loop, then run there. (They used to hop behind it, and each write
    arriving while one was pending hopped too: under load, all of them did.)"""
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    await store.migrate()
    seen = _writes_seen(store)
    loop_thread = threading.current_thread().name
    gate = threading.Event()

    async def request(n: int) -> None:
        claim = await store.claim(intent(f"k-{n}"), f"lease-{n}", NOW, NOW + 60)
        await asyncio.sleep(0)  # the handler
        await store.complete(claim.record, State.COMPLETED, CREATED, NOW, NOW + 60)

    try:
        handed_over = asyncio.ensure_future(store._writes.run(gate.wait, 10))
        requests = asyncio.gather(*(request(n) for n in range(32)))
        await until(lambda: len(store._writes._idle_waiters) == 32, "every claim waits")
        assert seen == []  # every claim waits for the write handed over
        gate.set()
        await requests
        assert await handed_over
        assert seen == [loop_thread] * 64
    finally:
        gate.set()
        await store.close()


@pytest.mark.anyio
async def test_a_write_cancelled_while_it_waits_for_one_handed_over_writes_nothing(
    tmp_path: Path,
) -> None:
    """Cancelled in ``idle()``, before its transaction began: no record, and the key's
    next claim is the first."""
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    await store.migrate()
    gate = threading.Event()
    try:
        handed_over = asyncio.ensure_future(store._writes.run(gate.wait, 10))
        waiting = asyncio.ensure_future(store.claim(intent("k-1"), "lease-1", NOW, NOW + 60))
        await until(lambda: len(store._writes._idle_waiters) == 1, "the claim waits")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.set()
        assert await handed_over
        assert store.sync.get("alice", "k-1") is None
        assert (await store.claim(intent("k-1"), "lease-2", NOW, NOW + 60)).owned
    finally:
        gate.set()
        await store.close()


def test_a_write_waiting_on_another_event_loop_is_woken_from_the_one_that_handed_over(
    tmp_path: Path,
) -> None:
    """One store, two event loops on two threads: the loop whose write was handed over
    wakes the other's waiting claim through that loop's own queue."""
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    asyncio.run(store.migrate())
    gate, handed = threading.Event(), threading.Event()
    claims: list[bool] = []

    def hand_over() -> None:
        async def write() -> None:
            pending = asyncio.ensure_future(store._writes.run(gate.wait, 10))
            await until(lambda: store._writes.pending == 1, "the write handed over")
            handed.set()
            assert await pending

        asyncio.run(write())

    def claim_on_another_loop() -> None:
        handed.wait(10)
        claim = store.claim(intent("k-1"), "lease-1", NOW, NOW + 60)
        claims.append(asyncio.run(claim).owned)

    # Daemons: a claim never woken must fail the test, not hang the run at its exit.
    threads = [
        threading.Thread(target=target, daemon=True)
        for target in (hand_over, claim_on_another_loop)
    ]
    for thread in threads:
        thread.start()
    try:
        handed.wait(10)
        deadline = time.monotonic() + 10
        while not store._writes._idle_waiters:  # the claim on the other loop waits
            assert time.monotonic() < deadline, "the claim never waited"
            time.sleep(0.005)
        assert claims == []  # waiting for the write handed over on the first loop
        gate.set()
        for thread in threads:
            thread.join(10)
        assert claims == [True]
    finally:
        gate.set()
        asyncio.run(store.close())


@pytest.mark.anyio
async def test_writes_with_nothing_to_wait_for_run_on_the_loops_thread(tmp_path: Path) -> None:
    """A hop to the write thread costs more than the statement (docs/benchmarks.md): with
    no write handed over and the file's locks free, a claim, a completion, a checkpoint
    and a release run where they are awaited, each committed before it returns (another
    connection reads it)."""
    path = tmp_path / "keys.db"
    store = AsyncSQLiteStore(path)
    await store.migrate()
    seen = _writes_seen(store)
    loop_thread = threading.current_thread().name
    try:
        first = await store.claim(intent("k-1"), "lease-1", NOW, NOW + 60)
        replay_of_held = await store.claim(intent("k-1"), "lease-2", NOW, NOW + 60)
        assert first.owned
        assert not replay_of_held.owned
        assert replay_of_held.record == first.record
        reader = SQLiteStore(path)
        try:
            assert reader.get("alice", "k-1") == first.record
            await store.complete(first.record, State.COMPLETED, CREATED, NOW + 1, NOW + 60)
            completed = reader.get("alice", "k-1")
        finally:
            reader.close()
        assert completed is not None
        assert completed.state is State.COMPLETED
        assert completed.response == CREATED
        other = await store.claim(intent("k-2"), "lease-3", NOW, NOW + 60)
        await store.checkpoint(other.record, "charged", NOW + 1)
        assert await store.release(other.record, NOW + 2)
        released = store.sync.get("alice", "k-2")  # the sync store's own connection
        assert seen == [loop_thread] * 6
        assert released is not None
        assert released.state is State.RELEASED
        assert released.recovery_point == "charged"
    finally:
        await store.close()


WRITES = ["claim", "completion", "checkpoint", "release"]


async def _claimed_then(store: AsyncSQLiteStore, write: str) -> Awaitable[Any]:
    """What the next two tests await: a claim of a fresh key, or another write of one."""
    if write == "claim":
        return store.claim(intent("k-1"), "lease-1", NOW, NOW + 60)
    record = (await store.claim(intent("k-2"), "lease-2", NOW, NOW + 60)).record
    if write == "completion":
        return store.complete(record, State.COMPLETED, CREATED, NOW, NOW + 60)
    if write == "checkpoint":
        return store.checkpoint(record, "charged", NOW)
    return store.release(record, NOW)


def _assert_written(store: AsyncSQLiteStore, write: str, answer: Any) -> None:
    """The write that waited took effect, read back on the sync store's connection."""
    if write == "claim":
        assert answer.owned
        record = store.sync.get("alice", "k-1")
        assert record is not None
        assert record.state is State.IN_PROGRESS
        return
    record = store.sync.get("alice", "k-2")
    assert record is not None
    if write == "completion":
        assert record.state is State.COMPLETED
        assert record.response == CREATED
    elif write == "checkpoint":
        assert record.state is State.IN_PROGRESS
        assert record.recovery_point == "charged"
    else:
        assert answer is True
        assert record.state is State.RELEASED


@pytest.mark.anyio
@pytest.mark.parametrize("write", WRITES)
async def test_a_write_never_overtakes_one_handed_over(tmp_path: Path, write: str) -> None:
    """Writes handed to the store's thread go first, in turn: any write awaited meanwhile
    waits for them rather than take the file from under them (one after another on the
    loop's thread, writes could keep one handed over waiting past its busy timeout)."""
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    await store.migrate()
    gate = threading.Event()
    try:
        pending = await _claimed_then(store, write)
        before = asyncio.ensure_future(store._writes.run(gate.wait, 10))
        queued = asyncio.ensure_future(pending)
        await until(lambda: len(store._writes._idle_waiters) == 1, "the write waits")
        assert not queued.done()  # waiting for the write handed over
        gate.set()
        assert await before
        _assert_written(store, write, await asyncio.wait_for(queued, 10))
    finally:
        gate.set()
        await store.close()


@pytest.mark.anyio
@pytest.mark.parametrize("write", WRITES)
async def test_a_write_that_would_wait_never_blocks_the_loop(tmp_path: Path, write: str) -> None:
    """Another process holds SQLite's write lock: the write's try on the loop's thread
    gives up at once (no busy timeout there) and it waits on the write thread; the loop
    goes on serving meanwhile."""
    path = tmp_path / "keys.db"
    store = AsyncSQLiteStore(path, busy_timeout=5)
    await store.migrate()
    other = connect(path)
    try:
        pending = await _claimed_then(store, write)
        other.execute("BEGIN IMMEDIATE")
        waiting = asyncio.ensure_future(pending)
        # Handed to the write thread while the loop polls: a try on the loop's thread
        # that waited out a busy timeout would have failed the write, never handed it over.
        await until(lambda: store._writes.pending == 1, "the write handed over")
        assert not waiting.done()
        other.execute("ROLLBACK")
        _assert_written(store, write, await asyncio.wait_for(waiting, 10))
    finally:
        other.close()
        await store.close()


def _frames_in_wal(path: Path) -> int:
    other = connect(path)
    try:
        _, frames, _ = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    finally:
        other.close()
    return int(frames)


@pytest.mark.anyio
async def test_a_claim_on_the_loops_thread_never_checkpoints_the_wal(tmp_path: Path) -> None:
    """A WAL checkpoint writes the database file and syncs it: on the loop's thread it
    would stall every request. Claims there leave the WAL to the write thread's
    commits (SQLite's default checkpoints at 1,000 pages: each claim writes a few)."""
    path = tmp_path / "keys.db"
    store = AsyncSQLiteStore(path)
    await store.migrate()
    seen = _writes_seen(store)
    try:
        for n in range(400):
            assert (await store.claim(intent(f"k-{n}"), f"lease-{n}", NOW, NOW + 60)).owned
        assert set(seen) == {threading.current_thread().name}
        assert _frames_in_wal(path) > 1000
    finally:
        await store.close()


@pytest.mark.anyio
async def test_one_completion_in_checkpoint_hop_commits_on_the_write_thread_to_bound_the_wal(
    tmp_path: Path,
) -> None:
    """With every write on the loop's thread, which never checkpoints, the WAL would grow
    without end (~7 pages a first execution: 4,300 here). Every CHECKPOINT_HOP-th
    completion commits on the write thread, where SQLite checkpoints past 1,000 pages."""
    path = tmp_path / "keys.db"
    store = AsyncSQLiteStore(path)
    await store.migrate()
    seen = _writes_seen(store)
    loop_thread = threading.current_thread().name
    executions = 600
    try:
        for n in range(executions):
            claim = await store.claim(intent(f"k-{n}"), f"lease-{n}", NOW, NOW + 60)
            await store.complete(claim.record, State.COMPLETED, CREATED, NOW, NOW + 60)
        handed_over = [name for name in seen if name != loop_thread]
        assert len(handed_over) == executions // CHECKPOINT_HOP
        assert _frames_in_wal(path) < 1000 + 20 * CHECKPOINT_HOP
    finally:
        await store.close()


@pytest.mark.anyio
async def test_an_async_stores_reads_do_not_queue_behind_its_writes(tmp_path: Path) -> None:
    """A claim waiting for another connection's write lock holds the store's write
    thread; a replay's read runs beside it (a WAL reader never waits for the writer)."""
    path = tmp_path / "keys.db"
    store = AsyncSQLiteStore(path, busy_timeout=30)
    await store.migrate()
    done = await store.claim(intent("done"), "lease-0", NOW, NOW + 60)
    other = connect(path)
    try:
        other.execute("BEGIN IMMEDIATE")  # another connection (process) holds the write lock
        waiting = asyncio.ensure_future(store.claim(intent("k-1"), "lease-1", NOW, NOW + 60))
        await asyncio.sleep(0.2)  # the claim is on the write thread, in the busy handler
        assert await asyncio.wait_for(store.get("alice", "done"), 10) == done.record
        assert not waiting.done()
        other.execute("ROLLBACK")
        assert (await asyncio.wait_for(waiting, 30)).owned
    finally:
        other.close()
        await store.close()


def test_a_forked_child_writes_on_a_thread_of_its_own(tmp_path: Path) -> None:
    """The parent's write thread does not exist in a child: the child starts its own
    (a write handed to the parent's would wait forever)."""
    store = AsyncSQLiteStore(tmp_path / "keys.db")

    async def claim(key: str) -> bool:
        return (await store.claim(intent(key), f"lease-{key}", NOW, NOW + 60)).owned

    asyncio.run(store.migrate())
    assert asyncio.run(claim("from-the-parent"))
    child = os.fork()
    if child == 0:  # pragma: no cover -- the child reports by its exit status
        code = 1
        try:
            signal.alarm(20)  # a write stuck on the parent's thread ends the child
            code = 0 if asyncio.run(claim("from-the-child")) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert asyncio.run(store.get("alice", "from-the-child")) is not None
    asyncio.run(store.close())
