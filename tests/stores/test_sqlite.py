"""
SQLite's writers queue on a lock of this process, one per database file, instead
of SQLite's sleeping busy handler; reads never take it, and a writer that cannot
get it within ``busy_timeout`` is an outage (503), as SQLITE_BUSY is.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from idemflow import Response, State, StoreUnavailable
from idemflow.stores.sqlite import SQLiteStore, _writer_lock
from tests.factories import intent

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
