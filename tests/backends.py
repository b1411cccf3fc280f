"""
Every store the contract suite runs against, behind one small interface.

A :class:`Backend` gives the tests a store, and (where the store can share
one) a fresh caller connection wrapped in a transaction adapter, plus a
business table to prove that effect and record commit or roll back together.
Backends for further stores register themselves in ``BACKENDS``.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from idemflow.stores.memory import MemoryStore
from idemflow.stores.protocol import Store, Transaction
from idemflow.stores.sqlite import SQLiteStore
from idemflow.transactions import PsycopgTransaction, SQLite3Transaction


@dataclass
class Backend:
    name: str
    store: Store
    #: Opens a caller connection in a transaction adapter; None if unsupported.
    open_transaction: Callable[[], contextlib.AbstractContextManager[Transaction]] | None
    #: Writes one business row through the caller's connection.
    write: Callable[[Any, str], None]
    #: Counts committed business rows (read on a connection of its own).
    count: Callable[[], int]
    #: Opens a new store on the same data, e.g. in another process: (name, args).
    spec: tuple[str, tuple[Any, ...]] = ("memory", ())
    closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def transactional(self) -> bool:
        return self.open_transaction is not None


# --- SQLite -------------------------------------------------------------------


def sqlite_backend(tmp_path: Path, table: str) -> Backend:
    path = str(tmp_path / "keys.db")
    store = SQLiteStore(path, table=table)
    store.migrate()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE business (id INTEGER PRIMARY KEY, note TEXT)")
        conn.commit()

    @contextlib.contextmanager
    def open_transaction() -> Iterator[Transaction]:
        conn = sqlite3.connect(path, isolation_level=None, timeout=10)
        try:
            yield SQLite3Transaction(conn)
        finally:
            conn.close()

    def write(conn: Any, note: str) -> None:
        conn.execute("INSERT INTO business (note) VALUES (?)", (note,))

    def count() -> int:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            return int(conn.execute("SELECT count(*) FROM business").fetchone()[0])

    return Backend("sqlite", store, open_transaction, write, count, ("sqlite", (path, table)))


# --- PostgreSQL ---------------------------------------------------------------


def postgres_backend(table: str) -> Backend:
    psycopg = pytest.importorskip("psycopg")
    from idemflow.stores.postgres import PostgresStore
    from tests.conftest import POSTGRES_URL, unreachable

    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE TABLE biz_{table} (id BIGSERIAL PRIMARY KEY, note TEXT)")
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    store = PostgresStore(POSTGRES_URL, table=table, max_size=8)
    store.migrate()

    @contextlib.contextmanager
    def open_transaction() -> Iterator[Transaction]:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            yield PsycopgTransaction(conn)

    def write(conn: Any, note: str) -> None:
        conn.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

    def count() -> int:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM biz_{table}").fetchone()
            return int(row[0])

    def drop() -> None:
        store.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}, biz_{table}")

    backend = Backend(
        "postgres", store, open_transaction, write, count, ("postgres", (POSTGRES_URL, table))
    )
    backend.closers.append(drop)
    return backend


# --- memory -------------------------------------------------------------------


def memory_backend() -> Backend:
    rows: list[str] = []
    return Backend(
        "memory",
        MemoryStore(),
        None,
        lambda conn, note: rows.append(note),
        lambda: len(rows),
    )


BACKENDS: dict[str, Callable[[Path, str], Backend]] = {
    "memory": lambda tmp_path, table: memory_backend(),
    "sqlite": sqlite_backend,
    "postgres": lambda tmp_path, table: postgres_backend(table),
}


def open_store(spec: tuple[str, tuple[Any, ...]]) -> Store:
    """Open a store from a picklable spec (used by child processes in race tests)."""
    kind, args = spec
    if kind == "sqlite":
        return SQLiteStore(*args)
    if kind == "postgres":
        from idemflow.stores.postgres import PostgresStore

        url, table = args
        return PostgresStore(url, table=table, max_size=4)
    return STORE_OPENERS[kind](*args)


#: Further stores (MySQL, Redis, …) add an opener here for the process races.
STORE_OPENERS: dict[str, Callable[..., Store]] = {}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path, table_name: str) -> Iterator[Backend]:
    made = BACKENDS[request.param](tmp_path, table_name)
    yield made
    for close in made.closers:
        close()
