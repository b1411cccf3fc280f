"""The ``backend`` fixture keeps a SQL backend's tables for the next test only when that
test leaves them as it found them (tests/backends.py, :func:`give_back`): emptied, of the
shape they were created with. A test that failed, or changed their shape, has them dropped."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.backends import KINDS, Shape, Tables, give_back, kind_params

#: The SQL servers' stores (PostgreSQL, MariaDB): the tables the ``backend`` fixture keeps.
SQL_BACKENDS = kind_params(pooled=True, cluster=False)

#: Changes of shape a test might make, in either dialect: ``{t}`` the store's table.
CHANGES = {
    "column added": "ALTER TABLE biz_{t} ADD COLUMN extra INTEGER",
    "column dropped": "ALTER TABLE {t} DROP COLUMN correlation_id",
    "index added": "CREATE INDEX {t}_extra ON {t} (created_at)",
    "constraint added": "ALTER TABLE biz_{t} ADD CONSTRAINT {t}_noted CHECK (note <> '')",
}


@contextlib.contextmanager
def given_back(
    name: str, tmp_path: Path, table: str, change: str | None, failed: bool
) -> Iterator[tuple[list[tuple[Tables, Shape]], Tables]]:
    """``name``'s tables, a row written to each and ``change`` made, given back as the
    ``backend`` fixture does after a test: what it kept, and the tables (dropped after)."""
    made = KINDS[name].contract[name](tmp_path, table, True)
    assert made.tables is not None
    shape = made.tables.shape()
    made.tables.sql(
        f"INSERT INTO {table} (principal, idempotency_key, fingerprint, state, "
        "created_at, updated_at, expires_at) VALUES ('p', 'k', 'f', 'released', 1, 1, 1)",
        f"INSERT INTO biz_{table} (note) VALUES ('n')",
    )
    if change is not None:
        made.tables.sql(change.format(t=table))
    for close in made.closers:
        close()
    kept: list[tuple[Tables, Shape]] = []
    try:
        give_back(made.tables, shape, failed, kept)
        yield kept, made.tables
    finally:
        made.tables.drop()


@pytest.mark.parametrize("name", SQL_BACKENDS)
def test_tables_left_as_found_are_kept_emptied(name: str, tmp_path: Path, table_name: str) -> None:
    with given_back(name, tmp_path, table_name, None, failed=False) as (kept, tables):
        assert kept == [(tables, tables.shape())]
        counts = (
            f"SELECT (SELECT count(*) FROM {table_name}), (SELECT count(*) FROM biz_{table_name})"
        )
        assert [tuple(row) for row in tables.sql(counts)] == [(0, 0)]


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("name", SQL_BACKENDS)
def test_tables_whose_shape_changed_are_dropped(
    name: str, change: str, tmp_path: Path, table_name: str
) -> None:
    with given_back(name, tmp_path, table_name, CHANGES[change], failed=False) as (kept, tables):
        assert (kept, tables.shape()) == ([], [])  # nothing kept; no column, index left


@pytest.mark.parametrize("name", SQL_BACKENDS)
def test_tables_of_a_failed_test_are_dropped(name: str, tmp_path: Path, table_name: str) -> None:
    with given_back(name, tmp_path, table_name, None, failed=True) as (kept, tables):
        assert (kept, tables.shape()) == ([], [])
