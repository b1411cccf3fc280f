"""
``migrate()`` on a table an earlier version created (no ``stale_after``/``stale_at``, no
``(state, stale_at)`` index), on every SQL database: the columns and the sweeper's index
are added, each row gets the default threshold from its last write, and the sweeper then
ends exactly the claims past it, the old rows' and the new ones' alike.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from idemflow import Intent, State
from idemflow._model import DEFAULT_STALE_SECONDS
from idemflow.stores.protocol import MaintainableStore
from idemflow.stores.sql import SQLStore
from idemflow.stores.sql.dialect import stale_columns
from idemflow.stores.urls import open_store
from tests.backends import MYSQL_URL
from tests.conftest import POSTGRES_URL

#: How each database spells the BIGINT the stale columns are made of.
_BIGINT = {"sqlite": "INTEGER", "postgresql": "BIGINT", "mysql": "BIGINT"}


def earlier_ddl(store: SQLStore) -> list[str]:
    """The table as the version before per-record thresholds created it: this version's
    statements without the stale columns and the sweeper's index."""
    columns = stale_columns(_BIGINT[store.dialect.name]) + ","
    earlier = []
    for statement in store.dialect.ddl:
        if not statement.lstrip().startswith("CREATE") or "_state_stale ON" in statement:
            continue  # a transaction's or a session's, or the sweeper's index
        table = statement.replace(columns, "")
        earlier.append(re.sub(r"KEY \w+_state_stale \(state, stale_at\),", "", table))
    assert all("stale" not in s.replace("'stale'", "") for s in earlier), earlier
    return earlier


def _sqlite(tmp_path: Path, table: str) -> tuple[str, Callable[[str], None]]:
    path = tmp_path / "keys.db"

    def execute(statement: str) -> None:
        with closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute(statement)

    return f"sqlite:///{path}", execute


def _postgres(tmp_path: Path, table: str) -> tuple[str, Callable[[str], None]]:
    psycopg = pytest.importorskip("psycopg")

    def execute(statement: str) -> None:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(statement)

    return POSTGRES_URL, execute


def _mysql(tmp_path: Path, table: str) -> tuple[str, Callable[[str], None]]:
    pymysql = pytest.importorskip("pymysql")
    url = urlsplit(MYSQL_URL)
    server = {"host": url.hostname, "port": url.port or 3306, "user": url.username}
    server |= {"password": url.password or "", "database": url.path.lstrip("/")}

    def execute(statement: str) -> None:
        with closing(pymysql.connect(**server, autocommit=True)) as conn:
            conn.cursor().execute(statement)

    return MYSQL_URL, execute


@pytest.fixture(
    params=[
        pytest.param(_sqlite, id="sqlite"),
        pytest.param(_postgres, id="postgres", marks=pytest.mark.postgres),
        pytest.param(_mysql, id="mysql", marks=pytest.mark.mysql),
    ]
)
def earlier_table(
    request: pytest.FixtureRequest, tmp_path: Path, table_name: str
) -> Iterator[tuple[MaintainableStore, Callable[[str], None]]]:
    """A store on a table of the earlier version, and a way to run SQL beside it."""
    url, execute = request.param(tmp_path, table_name)
    store = open_store(url, table=table_name)
    assert isinstance(store, SQLStore)
    try:
        for statement in earlier_ddl(store):
            execute(statement)
        yield store, execute
    finally:
        execute(f"DROP TABLE IF EXISTS {table_name}")
        store.close()


def test_migrate_upgrades_an_earlier_table_and_the_sweeper_then_honours_each_rows_threshold(
    earlier_table: tuple[Any, Callable[[str], None]], table_name: str
) -> None:
    store, execute = earlier_table
    now_ms = int(time.time() * 1000)

    def left(key: str, age: float) -> None:
        """A claim the earlier version wrote ``age`` seconds ago."""
        at = now_ms - int(age * 1000)
        execute(
            f"INSERT INTO {table_name} (principal, idempotency_key, fingerprint, endpoint, "
            f"state, lease_token, created_at, updated_at, expires_at) VALUES ('alice', "
            f"'{key}', 'fp', '', 'in_progress', 'lease-{key}', {at}, {at}, {at + 3_600_000})"
        )

    left("crashed", age=DEFAULT_STALE_SECONDS + 30)  # past the default threshold
    left("running", age=1)
    store.migrate()
    store.migrate()  # once upgraded, nothing more to do

    crashed = store.get("alice", "crashed")
    assert crashed is not None
    assert crashed.stale_at == pytest.approx(crashed.updated_at + DEFAULT_STALE_SECONDS)
    now = time.time()
    claimed = store.claim(Intent("alice", "new", "fp"), "lease-new", now, now + 3600, stale_after=5)
    assert claimed.owned
    assert claimed.record.stale_at is not None

    def swept(at: float) -> list[str]:
        marked = store.sweep(State.IN_PROGRESS, at, now, now + 3600, 10)
        return sorted(record.key for record in marked)

    assert swept(now) == ["crashed"]
    assert swept(now + 10) == ["new"]  # its own 5 s, on the store's clock
    assert swept(now + DEFAULT_STALE_SECONDS + 10) == ["running"]


def test_a_rolling_upgrade_s_earlier_writes_are_ended_by_their_own_write_never_before(
    earlier_table: tuple[Any, Callable[[str], None]], table_name: str
) -> None:
    """Instances of the earlier version still run beside the migrated table: their claim
    sets no deadline, their take-over leaves the last owner's. Each is ended the default
    threshold after the write it made, and the sweeper's schedule says so."""
    store, execute = earlier_table
    store.migrate()
    now = time.time()
    now_ms = int(now * 1000)
    columns = (
        "principal, idempotency_key, fingerprint, endpoint, state, lease_token, created_at, "
        "updated_at, expires_at"
    )
    # The earlier version's claim, as it writes it: no stale columns.
    execute(
        f"INSERT INTO {table_name} ({columns}) VALUES ('alice', 'claimed-by-earlier', 'fp', "
        f"'', 'in_progress', 'lease-e', {now_ms}, {now_ms}, {now_ms + 3_600_000})"
    )
    # This version released a claim a minute ago (its deadline 10 s from now) ...
    released = now_ms - 60_000
    execute(
        f"INSERT INTO {table_name} ({columns}, stale_after, stale_at) VALUES ('alice', "
        f"'taken-over', 'fp', '', 'released', 'lease-n', {released}, {released}, "
        f"{now_ms + 3_600_000}, {int(DEFAULT_STALE_SECONDS * 1000)}, {released + 70_000})"
    )
    # ... and the earlier version takes it over now, leaving that deadline as it was.
    execute(
        f"UPDATE {table_name} SET state = 'in_progress', lease_token = 'lease-t', "
        f"updated_at = {now_ms} WHERE idempotency_key = 'taken-over'"
    )

    def swept(at: float) -> list[str]:
        marked = store.sweep(State.IN_PROGRESS, at, now, now + 3600, 10)
        return sorted(record.key for record in marked)

    due = store.next_due(State.IN_PROGRESS, now, now)
    assert due == pytest.approx(DEFAULT_STALE_SECONDS, abs=1)
    assert swept(now + 20) == []  # the old deadline passed: not the claim's own
    assert swept(now + DEFAULT_STALE_SECONDS + 5) == ["claimed-by-earlier", "taken-over"]
