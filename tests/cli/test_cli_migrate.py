"""
``idemflow migrate`` as an operator runs it: a separate process, real databases.

It creates the key table with its unique ``(principal, key)`` constraint, the
sweeper's ``(state, stale_at)`` index, the stats' ``(state, updated_at)`` and the
purger's expiry index; running
it again (or four times at once) changes nothing; failures are one line on
stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import POSTGRES_URL, unreachable

SCRIPT = Path(sys.executable).with_name("idemflow")
#: The installed console script when there is one, else the module (same code path).
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "idemflow"]


def migrate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "IDEMFLOW_DATABASE_URL"}
    environment.update(env or {})
    return subprocess.run(
        [*COMMAND, "migrate", *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
        check=False,
    )


def assert_ok(done: subprocess.CompletedProcess[str]) -> None:
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.startswith("migrated ")


def assert_one_line_failure(done: subprocess.CompletedProcess[str]) -> str:
    """A failed command says why in one line on stderr and exits non-zero."""
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("idemflow migrate: ")
    assert done.stdout == ""
    return lines[0]


# --- SQLite -------------------------------------------------------------------


def sqlite_schema(path: Path, table: str) -> dict[str, Any]:
    """The table's indexes as ``{name: (unique, [columns])}``."""
    with closing(sqlite3.connect(path)) as conn:
        indexes = {}
        for _, name, unique, *_ in conn.execute(f"PRAGMA index_list({table})"):
            columns = [row[2] for row in conn.execute(f"PRAGMA index_info({name})")]
            indexes[name] = (bool(unique), columns)
        return indexes


def test_sqlite_table_has_unique_claim_and_both_indexes(tmp_path: Path, table_name: str) -> None:
    """The claim's unique (principal, key), the sweeper's index and the expiry index exist."""
    path = tmp_path / "keys.db"

    assert_ok(migrate(f"sqlite:///{path}", "--table", table_name))

    indexes = sqlite_schema(path, table_name)
    assert sorted(indexes.values()) == [
        (False, ["expires_at"]),
        (False, ["state", "stale_at"]),
        (False, ["state", "updated_at"]),
        (True, ["principal", "idempotency_key"]),
    ]
    assert f"{table_name}_state_updated" in indexes
    assert f"{table_name}_state_stale" in indexes
    assert f"{table_name}_expires" in indexes


def test_sqlite_migrate_twice_changes_nothing(tmp_path: Path) -> None:
    """The second run succeeds and leaves the schema (and the rows) as they were."""
    path = tmp_path / "keys.db"
    assert_ok(migrate(f"sqlite:///{path}"))
    with closing(sqlite3.connect(path)) as conn:
        conn.execute(
            "INSERT INTO idemflow_keys (principal, idempotency_key, fingerprint, state, "
            "created_at, updated_at, expires_at) VALUES ('a', 'k', 'f', 'completed', 1, 1, 2)"
        )
        conn.commit()
    before = sqlite_schema(path, "idemflow_keys")

    assert_ok(migrate(f"sqlite:///{path}"))

    assert sqlite_schema(path, "idemflow_keys") == before
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("SELECT count(*) FROM idemflow_keys").fetchone()[0] == 1


def test_relative_sqlite_path_is_relative_to_the_working_directory(tmp_path: Path) -> None:
    """``sqlite:///keys.db`` is a file in the current directory."""
    done = subprocess.run(
        [*COMMAND, "migrate", "sqlite:///keys.db"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
        check=False,
    )

    assert_ok(done)
    assert (tmp_path / "keys.db").exists()


def test_database_url_comes_from_the_environment(tmp_path: Path) -> None:
    """Without an argument, IDEMFLOW_DATABASE_URL names the store."""
    path = tmp_path / "from-env.db"

    assert_ok(migrate(env={"IDEMFLOW_DATABASE_URL": f"sqlite:///{path}"}))

    assert sqlite_schema(path, "idemflow_keys")


def test_argument_wins_over_the_environment(tmp_path: Path) -> None:
    """An explicit DATABASE_URL argument overrides the environment variable."""
    named, ignored = tmp_path / "named.db", tmp_path / "ignored.db"

    assert_ok(migrate(f"sqlite:///{named}", env={"IDEMFLOW_DATABASE_URL": f"sqlite:///{ignored}"}))

    assert named.exists()
    assert not ignored.exists()


def test_module_entry_point_runs_the_same_command(tmp_path: Path) -> None:
    """``python -m idemflow migrate`` works where the console script is not on PATH."""
    path = tmp_path / "keys.db"
    done = subprocess.run(
        [sys.executable, "-m", "idemflow", "migrate", f"sqlite:///{path}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert_ok(done)
    assert sqlite_schema(path, "idemflow_keys")


# --- failures -----------------------------------------------------------------


def test_unsupported_scheme_is_one_line_on_stderr() -> None:
    """An unknown scheme names the schemes that work."""
    line = assert_one_line_failure(migrate("foo://somewhere/db"))

    assert "unsupported database URL" in line
    assert "sqlite://" in line


def test_missing_sqlite_directory_is_one_line_on_stderr(tmp_path: Path) -> None:
    """A SQLite file in a directory that does not exist is refused, and nothing is created."""
    missing = tmp_path / "no" / "such" / "dir"

    line = assert_one_line_failure(migrate(f"sqlite:///{missing}/keys.db"))

    assert str(missing) in line
    assert not missing.exists()


def test_missing_database_url_is_one_line_on_stderr() -> None:
    """No argument and no environment variable: say which variable to set."""
    line = assert_one_line_failure(migrate())

    assert "IDEMFLOW_DATABASE_URL" in line


def test_unreachable_postgres_is_one_line_and_never_shows_the_password() -> None:
    """A closed port is an outage: one line, non-zero exit, and the password stays secret."""
    line = assert_one_line_failure(migrate("postgresql://postgres:s3cret-pw@127.0.0.1:1/test"))

    assert "unavailable" in line
    assert "s3cret-pw" not in line


# --- PostgreSQL ---------------------------------------------------------------


@pytest.fixture
def postgres(table_name: str) -> Iterator[Any]:
    """An autocommit connection for inspection; drops the test's table afterwards."""
    psycopg = pytest.importorskip("psycopg")
    try:
        conn = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    with conn:
        yield conn
        conn.execute(f"DROP TABLE IF EXISTS {table_name}")


def postgres_indexes(conn: Any, table: str) -> dict[str, str]:
    rows = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", (table,)
    ).fetchall()
    return dict(rows)


@pytest.mark.postgres
def test_postgres_table_has_unique_claim_and_both_indexes(postgres: Any, table_name: str) -> None:
    """The unique constraint backs the claim; the two indexes serve the sweeper and purge."""
    assert_ok(migrate(POSTGRES_URL, "--table", table_name))

    indexes = postgres_indexes(postgres, table_name)
    assert "(principal, idempotency_key)" in indexes[f"{table_name}_principal_key"]
    assert indexes[f"{table_name}_principal_key"].startswith("CREATE UNIQUE INDEX")
    assert "(state, updated_at)" in indexes[f"{table_name}_state_updated"]
    assert "(state, stale_at)" in indexes[f"{table_name}_state_stale"]
    assert "(expires_at)" in indexes[f"{table_name}_expires"]
    assert sorted(indexes) == sorted(
        f"{table_name}_{suffix}"
        for suffix in ("pkey", "principal_key", "state_updated", "state_stale", "expires")
    )
    constraint = postgres.execute(
        "SELECT contype FROM pg_constraint WHERE conname = %s", (f"{table_name}_principal_key",)
    ).fetchone()
    assert constraint == ("u",)


@pytest.mark.postgres
def test_postgres_migrate_twice_changes_nothing(postgres: Any, table_name: str) -> None:
    """Running it again succeeds, keeps the rows and adds no index."""
    assert_ok(migrate(POSTGRES_URL, "--table", table_name))
    postgres.execute(
        f"INSERT INTO {table_name} (principal, idempotency_key, fingerprint, state, "
        "created_at, updated_at, expires_at) VALUES ('a', 'k', 'f', 'completed', 1, 1, 2)"
    )
    before = postgres_indexes(postgres, table_name)

    assert_ok(migrate(POSTGRES_URL, "--table", table_name))

    assert postgres_indexes(postgres, table_name) == before
    assert postgres.execute(f"SELECT count(*) FROM {table_name}").fetchone() == (1,)


@pytest.mark.postgres
def test_concurrent_postgres_migrations_all_succeed(postgres: Any, table_name: str) -> None:
    """Four deploys migrating at once all exit 0 (CREATE … IF NOT EXISTS alone would race)."""
    with ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(lambda _: migrate(POSTGRES_URL, "--table", table_name), range(4)))

    for done in runs:
        assert_ok(done)
    assert len(postgres_indexes(postgres, table_name)) == 5


@pytest.mark.postgres
def test_postgres_url_from_the_environment(postgres: Any, table_name: str) -> None:
    """IDEMFLOW_DATABASE_URL works for PostgreSQL too."""
    assert_ok(migrate("--table", table_name, env={"IDEMFLOW_DATABASE_URL": POSTGRES_URL}))

    assert f"{table_name}_principal_key" in postgres_indexes(postgres, table_name)
