"""The demo answers a database outage with 503 + Retry-After, never a bare 500."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from starlette.requests import Request

from idemflow_demo.app import database_unavailable, server_error

psycopg = pytest.importorskip("psycopg")


def locked_sqlite_error(tmp_path: Path) -> sqlite3.OperationalError:
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    other = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        other.execute("INSERT INTO t VALUES (1)")
    except sqlite3.OperationalError as exc:
        return exc
    finally:
        other.close()
        holder.close()
    raise AssertionError("the write was not refused")


def refused_postgres_error() -> Exception:
    import psycopg  # typed, unlike the module-level handle that skips without it

    try:
        psycopg.connect("postgresql://postgres@127.0.0.1:1/test", connect_timeout=2)
    except psycopg.OperationalError as exc:
        return exc
    raise AssertionError("port 1 accepted a connection")


def test_outages_are_recognised_and_bugs_are_not(tmp_path: Path) -> None:
    """A locked SQLite file and a refused PostgreSQL connection are outages; a typo is not."""
    assert database_unavailable(locked_sqlite_error(tmp_path))
    assert database_unavailable(refused_postgres_error())
    assert not database_unavailable(sqlite3.OperationalError("no such table: payments"))
    assert not database_unavailable(KeyError("amount"))


@pytest.mark.anyio
async def test_an_outage_becomes_a_503_problem_with_retry_after() -> None:
    """The handler's outage is rendered as the store-unavailable problem."""
    request = Request({"type": "http", "method": "POST", "path": "/payments", "headers": []})

    response = await server_error(request, refused_postgres_error())

    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.headers["content-type"] == "application/problem+json"
    assert json.loads(bytes(response.body))["status"] == 503
