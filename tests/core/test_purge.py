"""
``idemflow purge`` on real SQLite files and the real PostgreSQL server: it removes
exactly the records past their retention, in bounded batches through the
expiry index, keeps going with ``--every``, and shows progress on a terminal.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idemflow import Idempotency, Policy, State
from idemflow.cli import main
from idemflow.testing import FrozenClock
from tests.conftest import POSTGRES_URL
from tests.ops_support import DAY, crash_after_claim, created, intent, now, open_store, settle

KINDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
SCRIPT = Path(sys.executable).with_name("idemflow")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "idemflow"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store(kind: str, tmp_path: Path, table_name: str) -> Iterator[Any]:
    with open_store(kind, tmp_path, table_name) as store:
        yield store


@pytest.fixture
def url(kind: str, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'keys.db'}" if kind == "sqlite" else POSTGRES_URL


def keys_in(kind: str, tmp_path: Path, table: str) -> set[tuple[str, str]]:
    """Every (principal, key) in the table, read straight from the database."""
    query = f"SELECT principal, idempotency_key FROM {table}"
    if kind == "sqlite":
        with contextlib.closing(sqlite3.connect(tmp_path / "keys.db")) as conn:
            return {(p, k) for p, k in conn.execute(query)}
    import psycopg

    with psycopg.connect(POSTGRES_URL) as conn:
        return {(p, k) for p, k in conn.execute(query).fetchall()}


def purge(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["purge", *argv, "--json"])
    captured = capsys.readouterr()
    assert (code, captured.err) == (0, "")
    result: dict[str, Any] = json.loads(captured.out)
    return result


def seed(store: Any) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """24 expired records and 9 live ones, among them some that look old but are not."""
    t = now()
    # A crashed claim the sweeper marked is kept until it is resolved.
    crash_after_claim(store, "swept", at=t - DAY + 60)
    store.sweep(State.IN_PROGRESS, t - 600, t - DAY + 120, t + DAY, 10)

    expired = {("alice", f"old-{i}") for i in range(23)}
    for _, key in sorted(expired):
        settle(store, key, at=t - 2 * DAY)
    # A claim in flight is never purged, however old: only the sweeper ends it.
    crash_after_claim(store, "crashed-long-ago", at=t - 3 * DAY)
    settle(store, "edge", at=t - DAY - 1)
    expired |= {("alice", "edge")}

    live = {("alice", f"new-{i}") for i in range(4)} | {("bob", "old-0")}
    for principal, key in sorted(live):
        settle(store, key, at=t - 3600, principal=principal)
    # Another endpoint keeps its keys a week: two days old is not expired there.
    week = Policy(request_timeout=30, retention=7 * DAY)
    refunds = intent("refund-1", endpoint="POST /refunds")
    Idempotency(store, week, clock=FrozenClock(t - 2 * DAY)).run(refunds, created)
    crash_after_claim(store, "running", at=t)
    live |= {("alice", "refund-1"), ("alice", "swept"), ("alice", "running")}
    live |= {("alice", "crashed-long-ago")}
    return expired, live


def test_purge_removes_exactly_the_expired_records(
    kind: str,
    store: Any,
    url: str,
    tmp_path: Path,
    table_name: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """24 expired of 33: batches of 7 take four statements, and every live record stays."""
    expired, live = seed(store)
    assert keys_in(kind, tmp_path, table_name) == expired | live
    result = purge(capsys, url, "--table", table_name, "--batch", "7")
    assert (result["purged"], result["batches"]) == (24, 4)
    assert keys_in(kind, tmp_path, table_name) == live
    assert purge(capsys, url, "--table", table_name)["purged"] == 0


def test_purge_prints_a_summary_for_people(
    store: Any, url: str, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --json: one line saying how many, where, and in how many batches."""
    seed(store)
    assert main(["purge", url, "--table", table_name, "--batch", "10"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"purged 24 expired records from {table_name} in ")
    assert out.rstrip().endswith("(3 batches of at most 10)")


def test_retention_is_per_endpoint(
    kind: str,
    store: Any,
    url: str,
    tmp_path: Path,
    table_name: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each endpoint's Policy sets its records' expiry; purge honours each one."""
    t = now()
    payments = Idempotency(store, Policy(retention=DAY), clock=FrozenClock(t - 2 * DAY))
    refunds = Idempotency(store, Policy(retention=3 * DAY), clock=FrozenClock(t - 2 * DAY))
    payments.run(intent("p1", endpoint="POST /payments"), created)
    refunds.run(intent("r1", endpoint="POST /refunds"), created)
    assert purge(capsys, url, "--table", table_name)["purged"] == 1
    assert keys_in(kind, tmp_path, table_name) == {("alice", "r1")}


@pytest.mark.redis
def test_purge_on_redis_deletes_exactly_the_expired(
    capsys: pytest.CaptureFixture[str], table_name: str
) -> None:
    """Redis too: settled records past retention go now (their TTL would later); a claim stays."""
    from tests.backends import REDIS_URL, redis_backend

    backend = redis_backend(table_name)
    try:
        settle(backend.store, "old", at=now() - 2 * DAY)
        settle(backend.store, "young", at=now() - 3600)
        crash_after_claim(backend.store, "crashed-long-ago", at=now() - 3 * DAY)
        assert purge(capsys, REDIS_URL, "--table", table_name)["purged"] == 1
        assert backend.store.get("alice", "old") is None
        assert backend.store.get("alice", "young") is not None
        assert backend.store.get("alice", "crashed-long-ago") is not None
    finally:
        backend.close()


def test_purge_every_keeps_going_until_sigterm(tmp_path: Path, table_name: str) -> None:
    """--every: one JSON line per pass; records that expire later go in a later pass."""
    with open_store("sqlite", tmp_path, table_name) as store:
        settle(store, "k1", at=now() - 2 * DAY)
        process = subprocess.Popen(
            [
                *COMMAND,
                *("purge", f"sqlite:///{tmp_path / 'keys.db'}", "--table", table_name),
                *("--every", "0.2", "--json"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert process.stdout is not None
            assert json.loads(process.stdout.readline())["purged"] == 1
            settle(store, "k2", at=now() - 2 * DAY)
            settle(store, "k3", at=now() - 2 * DAY)
            purged = 0
            deadline = time.monotonic() + 30
            while purged < 2 and time.monotonic() < deadline:
                purged += json.loads(process.stdout.readline())["purged"]
            assert purged == 2
            process.send_signal(signal.SIGTERM)
            _, err = process.communicate(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert (process.returncode, err) == (0, "")


def test_purge_every_survives_an_outage_and_stops_on_a_missing_table(
    tmp_path: Path, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A locked database fails one pass (one line) and the next purges; no table ends it."""
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    with open_store("sqlite", tmp_path, table_name) as store:
        settle(store, "k1", at=now() - 2 * DAY)
    blocker = sqlite3.connect(tmp_path / "keys.db", isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    process = subprocess.Popen(
        [*COMMAND, "purge", url, "--table", table_name, "--every", "0.2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        assert process.stderr.readline().startswith("idemflow purge: pass failed: ")
        blocker.close()  # the outage ends
        assert process.stdout is not None
        assert json.loads(process.stdout.readline())["purged"] == 1
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0

    assert main(["purge", url, "--table", "absent", "--every", "0.2"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "idemflow purge: table absent does not exist (check --table): "
        "run idemflow migrate --table absent\n"
    )


@pytest.mark.parametrize(
    ("with_rich", "shown"), [(True, "purging expired records"), (False, "purged 12 of about 12")]
)
def test_purge_shows_progress_on_a_terminal(
    tmp_path: Path, table_name: str, with_rich: bool, shown: str
) -> None:
    """On a TTY: a Rich progress bar, or a plain counter without Rich; the summary on stdout."""
    with open_store("sqlite", tmp_path, table_name) as store:
        for i in range(12):
            settle(store, f"k{i}", at=now() - 2 * DAY)
    hide_rich = "" if with_rich else "sys.modules['rich'] = None; "
    script = (
        f"import sys; {hide_rich}from idemflow.cli import main; "
        f"sys.exit(main(['purge', 'sqlite:///{tmp_path / 'keys.db'}', '--table', "
        f"'{table_name}', '--batch', '5']))"
    )
    terminal, child_end = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=child_end,
        text=True,
    )
    os.close(child_end)
    screen = _read_all(terminal)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    assert shown in screen
    assert out.startswith("purged 12 expired records")


def _read_all(fd: int) -> str:
    chunks: list[bytes] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode(errors="replace")


# --- the expiry index -------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_purges_through_the_expiry_index(tmp_path: Path, table_name: str) -> None:
    """EXPLAIN: the batch is found by an index scan on <table>_expires, deleted by TID.

    20 000 rows, ANALYZEd, and no planner setting changed: with ``id IN
    (subquery)`` this plan was a sequential scan of the whole table per batch.
    """
    import psycopg

    with (
        open_store("postgres", tmp_path, table_name) as store,
        psycopg.connect(POSTGRES_URL, autocommit=True) as conn,
    ):
        conn.execute(
            f"INSERT INTO {table_name} (principal, idempotency_key, fingerprint, endpoint, "
            "state, created_at, updated_at, expires_at) "
            "SELECT 'p', 'k' || g, 'f', 'e', 'completed', g, g, 1000000 + g "
            "FROM generate_series(1, 20000) g"
        )
        conn.execute(f"ANALYZE {table_name}")
        purge = store.dialect.purge
        for now_ms in (1_000_400, 1_019_000):  # 2 % and 95 % of the table expired
            plan = "\n".join(
                row[0]
                for row in conn.execute(
                    "EXPLAIN " + purge.pyformat, purge.bind({"now": now_ms, "limit": 1000})
                ).fetchall()
            )
            assert f"Index Scan using {table_name}_expires" in plan, plan
            assert "Tid Scan" in plan, plan
            assert "Seq Scan" not in plan, plan


def test_sqlite_purges_through_the_expiry_index(tmp_path: Path, table_name: str) -> None:
    """EXPLAIN QUERY PLAN: the expiry index finds the batch, the rowid deletes it."""
    with open_store("sqlite", tmp_path, table_name) as store:
        purge = store.dialect.purge
        with contextlib.closing(sqlite3.connect(tmp_path / "keys.db")) as conn:
            plan = " | ".join(
                row[3]
                for row in conn.execute(
                    "EXPLAIN QUERY PLAN " + purge.named, purge.bind({"now": 1, "limit": 10})
                )
            )
    assert f"USING INDEX {table_name}_expires" in plan
    assert "USING INTEGER PRIMARY KEY" in plan
    assert "SCAN" not in plan.replace("SUBQUERY", "")


@pytest.mark.postgres
def test_a_record_claimed_again_while_the_purge_waits_is_kept(
    tmp_path: Path, table_name: str
) -> None:
    """The purge meets a row a new claim is taking over: it neither waits nor deletes it."""
    import psycopg

    with open_store("postgres", tmp_path, table_name) as store:
        settle(store, "k1", at=now() - 2 * DAY)
        with psycopg.connect(POSTGRES_URL) as claimer:
            # The takeover, uncommitted: what the upsert claim does to an expired record.
            claimer.execute(
                f"UPDATE {table_name} SET state = 'in_progress', expires_at = %s "
                "WHERE idempotency_key = 'k1'",
                (int((now() + DAY) * 1000),),
            )
            purged: list[int] = []
            purger = threading.Thread(target=lambda: purged.append(store.purge(now(), 100)))
            purger.start()
            purger.join(timeout=30)  # it skips the locked row: no wait, no lock timeout
            claimer.commit()
        assert purged == [0]
        record = store.get("alice", "k1")
        assert record is not None
        assert record.state is State.IN_PROGRESS
