"""
``idemflow sweep``, run as an operator runs it: a real process on a real database.

Crashed claims are made with the real clock, some minutes in the past, so the
command (which uses the real clock too) finds them stale.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from idemflow import Intent, Policy, Record, Response, State, downstream_key
from idemflow.stores.protocol import Store
from idemflow.sweeper import Answer, Happened

ROOT = Path(__file__).resolve().parents[2]
BUSINESS_TABLE_ENV = "IDEMFLOW_TEST_BUSINESS_TABLE"


# --- a reconciler the command loads with --reconciler -------------------------


def provider_says_charged(record: Record, downstream_keys: Mapping[str, str]) -> Answer:
    """The provider found the charge under the downstream key: settle and write the payment."""
    table = os.environ[BUSINESS_TABLE_ENV]

    def apply(conn: Any) -> None:
        placeholder = "?" if isinstance(conn, sqlite3.Connection) else "%s"
        conn.execute(f"INSERT INTO {table} (note) VALUES ({placeholder})", (record.key,))

    body = {"charge": downstream_keys.get("charge")}
    return Happened(Response.json(201, body), apply=apply)


# --- the database under the command -------------------------------------------


@dataclass
class Database:
    url: str
    table: str
    store: Store
    notes: Callable[[], Counter[str]]  # the business rows, read on a connection of its own

    def crash(self, key: str, age: float, timeout: float = 30) -> Record:
        """A claim whose request (of a ``timeout`` s route) died ``age`` seconds ago."""
        now = time.time() - age
        intent = Intent("alice", key, "fp", endpoint="POST /payments")
        stale_after = Policy(request_timeout=timeout).stale_seconds
        return self.store.claim(
            intent, f"lease-{key}", now, now + 3600, stale_after=stale_after
        ).record

    def state(self, key: str) -> State:
        record = self.store.get("alice", key)
        assert record is not None
        return State(record.state)


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path, table_name: str) -> Iterator[Database]:
    if request.param == "sqlite":
        yield sqlite_database(tmp_path, table_name)
    else:
        with postgres_database(table_name) as made:
            yield made


def sqlite_database(tmp_path: Path, table: str) -> Database:
    from idemflow.stores.sqlite import SQLiteStore

    path = tmp_path / "keys.db"
    store = SQLiteStore(path, table=table)
    store.migrate()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"CREATE TABLE biz_{table} (id INTEGER PRIMARY KEY, note TEXT)")
        conn.commit()

    def notes() -> Counter[str]:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            return Counter(n for (n,) in conn.execute(f"SELECT note FROM biz_{table}"))

    return Database(f"sqlite:///{path}", table, store, notes)


@contextlib.contextmanager
def postgres_database(table: str) -> Iterator[Database]:
    psycopg = pytest.importorskip("psycopg")
    from idemflow.stores.postgres import PostgresStore
    from tests.conftest import POSTGRES_URL, unreachable

    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE TABLE biz_{table} (id BIGSERIAL PRIMARY KEY, note TEXT)")
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    store = PostgresStore(POSTGRES_URL, table=table, max_size=2, clock="caller")
    store.migrate()

    def notes() -> Counter[str]:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            return Counter(n for (n,) in conn.execute(f"SELECT note FROM biz_{table}"))

    try:
        yield Database(POSTGRES_URL, table, store, notes)
    finally:
        store.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}, biz_{table}")


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "idemflow", "sweep", *args]


def environment(db: Database | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "IDEMFLOW_DATABASE_URL"}
    if db is not None:
        env[BUSINESS_TABLE_ENV] = f"biz_{db.table}"
    return env


def sweep(db: Database, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(db.url, "--table", db.table, *args),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=environment(db),
        check=False,
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The failure an operator sees: exactly one line on stderr, no traceback, no stdout."""
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


# --- once ---------------------------------------------------------------------


def test_sweep_releases_crashed_claims_and_leaves_live_ones(database: Database) -> None:
    """Default timeout 30 s → stale after 70 s: 100 s old claims go, a 10 s old one stays."""
    for key in ("a", "b", "c"):
        database.crash(key, age=100)
    live = database.crash("live", age=10)

    done = sweep(database, "--json")

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["released"] == 3
    assert (report["completed"], report["unknown"], report["lost"]) == (0, 0, 0)
    assert report["stale_after"] == 70
    assert {database.state(k) for k in "abc"} == {State.RELEASED}
    assert database.store.get("alice", "live") == live
    again = json.loads(sweep(database, "--json").stdout)
    assert again["released"] == 0


def test_each_claim_is_swept_at_its_own_threshold_whatever_the_sweepers(
    database: Database,
) -> None:
    """Two 50 s old claims: one of a 5 s route (stale after 20 s) goes, one of a 60 s route
    (130 s) stays, whichever request timeout the sweeper is given."""
    database.crash("quick", age=50, timeout=5)
    database.crash("slow", age=50, timeout=60)

    slow = sweep(database, "--request-timeout", "60", "--json")
    assert (json.loads(slow.stdout)["stale_after"], json.loads(slow.stdout)["released"]) == (130, 1)
    assert (database.state("quick"), database.state("slow")) == (State.RELEASED, State.IN_PROGRESS)

    fast = sweep(database, "--request-timeout", "5", "--json")
    assert json.loads(fast.stdout)["released"] == 0
    assert database.state("slow") is State.IN_PROGRESS


def test_a_longer_stale_after_is_accepted(database: Database) -> None:
    """Above the derived minimum the operator may wait longer before asking again about an
    unknown outcome; a claim past its own threshold (70 s) goes all the same."""
    database.crash("k", age=100)

    done = sweep(database, "--stale-after", "200", "--json")

    assert json.loads(done.stdout)["stale_after"] == 200
    assert database.state("k") is State.RELEASED


def test_text_summary_and_progress_of_a_long_sweep(database: Database) -> None:
    """One summary line per pass on stdout; a progress line per batch on stderr."""
    for n in range(25):
        database.crash(f"k-{n}", age=100)

    done = sweep(database, "--batch", "10")

    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1
    assert "25 released" in done.stdout
    assert "stale after 70s" in done.stdout
    progress = [line for line in done.stderr.splitlines() if "batches" in line]
    assert len(progress) == 3
    assert "25 records after 3 batches" in progress[-1]


def test_reconciler_settles_with_the_business_row(database: Database) -> None:
    """--reconciler answers Happened: the record completes and the payment row is written."""
    crashed = database.crash("paid", age=100)

    done = sweep(
        database,
        "--reconciler",
        "tests.cli.test_cli_sweep:provider_says_charged",
        "--step",
        "charge",
    )

    assert done.returncode == 0, done.stderr
    assert "1 completed" in done.stdout
    record = database.store.get("alice", "paid")
    assert record is not None
    assert record.state is State.COMPLETED
    assert record.response is not None
    assert record.response.json_body() == {"charge": downstream_key(crashed, "charge")}
    assert database.notes() == Counter({"paid": 1})


def test_several_processes_resolve_each_record_exactly_once(database: Database) -> None:
    """Three sweeps at once over 300 crashed claims: 300 resolutions, 300 payment rows."""
    total = 300
    for n in range(total):
        database.crash(f"k-{n}", age=100)
    args = [
        "--table",
        database.table,
        "--batch",
        "10",
        "--json",
        "--reconciler",
        "tests.cli.test_cli_sweep:provider_says_charged",
    ]
    processes = [
        subprocess.Popen(
            command(database.url, *args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=environment(database),
        )
        for _ in range(3)
    ]
    outputs = [process.communicate(timeout=120) for process in processes]

    assert [p.returncode for p in processes] == [0, 0, 0], [err for _, err in outputs]
    reports = [json.loads(out) for out, _ in outputs]
    assert sum(r["completed"] for r in reports) == total
    assert sum(r["lost"] for r in reports) == 0
    assert database.notes() == Counter({f"k-{n}": 1 for n in range(total)})


# --- every N seconds ----------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_every_sweeps_until_a_signal_ends_it(database: Database, signum: int) -> None:
    """--every loops, picking up claims that crash meanwhile, and stops cleanly on a signal."""
    database.crash("first", age=100)
    process = subprocess.Popen(
        command(database.url, "--table", database.table, "--every", "0.2", "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=environment(database),
    )
    try:
        assert process.stdout is not None
        assert json.loads(process.stdout.readline())["released"] == 1
        database.crash("second", age=100)
        released = 0
        for _ in range(50):
            released = json.loads(process.stdout.readline())["released"]
            if released:
                break
        assert released == 1
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()

    assert process.returncode == 0, stderr
    assert database.state("second") is State.RELEASED


# --- errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needed"),
    [
        (["--stale-after", "60"], "70s"),
        (["--request-timeout", "60", "--stale-after", "100"], "130s"),
        (["--request-timeout", "30", "--stale-after", "69.9"], "70s"),
    ],
)
def test_unsafe_stale_after_is_refused_before_the_database_is_opened(
    tmp_path: Path, args: list[str], needed: str
) -> None:
    """A threshold under 2 × timeout + 10 s is rejected with the policy's reason."""
    missing = f"sqlite:///{tmp_path}/no/such/dir/keys.db"  # opening it would fail differently

    done = subprocess.run(
        command(missing, *args), capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )

    assert done.returncode == 1
    line = one_line_error(done)
    assert line.startswith("idemflow sweep: stale_after=")
    assert "unsafe" in line
    assert needed in line


@pytest.mark.parametrize(
    "args",
    [
        ["--batch", "0"],
        ["--batch", "many"],
        ["--every", "0"],
        ["--request-timeout", "-1"],
        ["--stale-after", "nan"],
    ],
)
def test_malformed_arguments_are_usage_errors(tmp_path: Path, args: list[str]) -> None:
    """Values that are not positive numbers stop argparse with exit code 2."""
    done = subprocess.run(
        command(f"sqlite:///{tmp_path}/k.db", *args),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )

    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "error: argument" in done.stderr


@pytest.mark.parametrize(
    ("url", "extra", "says"),
    [
        ("", [], "no DATABASE_URL"),
        ("sqlite:///{tmp}/missing/keys.db", [], "no SQLite database at"),
        ("sqlite:///{tmp}/k.db", ["--reconciler", "no_such_module:reconcile"], "cannot load"),
        ("sqlite:///{tmp}/k.db", ["--reconciler", "just-a-name"], "MODULE:NAME"),
        ("postgresql://postgres@127.0.0.1:1/test", [], "unavailable"),
    ],
    ids=["no-url", "missing-dir", "bad-reconciler", "reconciler-spec", "unreachable-postgres"],
)
def test_failures_are_one_line_and_exit_1(
    tmp_path: Path, url: str, extra: list[str], says: str
) -> None:
    """Operators get one line saying what is wrong, never a traceback."""
    args = [url.format(tmp=tmp_path)] if url else []

    done = subprocess.run(
        command(*args, *extra),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=environment(),
        check=False,
    )

    assert done.returncode == 1
    assert says in one_line_error(done)
