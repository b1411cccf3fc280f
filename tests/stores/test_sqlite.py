"""
SQLite's writers queue on a lock of this process, one per database file, instead
of SQLite's sleeping busy handler; reads never take it, and a writer that cannot
get it within ``busy_timeout`` is an outage (503), as SQLITE_BUSY is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from idemflow import StoreUnavailable
from idemflow.stores.sqlite import SQLiteStore, _writer_lock
from tests.factories import intent

NOW = 1_800_000_000.0


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
