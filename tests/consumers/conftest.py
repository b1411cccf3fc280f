"""The app fixture of the broker adapters' tests (see :mod:`tests.consumers._support`)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.conftest import POSTGRES_URL, unreachable
from tests.consumers._support import App, open_app


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"])
async def shop(
    request: pytest.FixtureRequest, tmp_path: Path, table_name: str
) -> AsyncIterator[App]:
    """The app on PostgreSQL or SQLite, its business table made (dropped after)."""
    kind = request.param
    where = POSTGRES_URL if kind == "postgres" else str(tmp_path / "app.db")
    create = f"CREATE TABLE biz_{table_name} (id INTEGER PRIMARY KEY, note TEXT)"
    if kind == "postgres":
        psycopg = pytest.importorskip("psycopg")
        try:
            with psycopg.connect(where, autocommit=True, connect_timeout=3) as conn:
                conn.execute(create.replace("INTEGER PRIMARY KEY", "BIGSERIAL PRIMARY KEY"))
        except psycopg.OperationalError as exc:
            unreachable("PostgreSQL", exc)
    else:
        with contextlib.closing(sqlite3.connect(where)) as conn:
            conn.execute(create)
    opened = open_app(kind, where, table_name)
    await opened.store.migrate()
    yield opened
    await opened.close()
    if kind == "postgres":
        with psycopg.connect(where, autocommit=True) as conn:
            conn.execute(f"DROP TABLE biz_{table_name}")
            conn.execute(f"DROP TABLE {table_name}")
