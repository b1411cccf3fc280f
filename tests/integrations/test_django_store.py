"""
The store contract, run on :class:`DjangoStore` over Django's own connections.

The scenarios are the contract suite's own (imported, not copied): the same
functions, here with a ``backend`` fixture that puts the key table and the
business table in a Django alias (SQLite, PostgreSQL, MariaDB) and runs each
caller transaction as :class:`DjangoTransaction`, the way a view's
``transaction.atomic()`` would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idemflow.integrations.django import DjangoTransaction
from idemflow.stores.django import DjangoStore
from tests.backends import Backend
from tests.factories import intent
from tests.integrations.django_setup import VENDOR_ALIAS, execute, own_connection, require
from tests.stores.test_contract import *  # noqa: F403 -- the contract's scenarios, run here
from tests.stores.test_contract import harness  # noqa: F401 -- its fixture (clock is shared)

_BUSINESS_ID = {
    "sqlite": "id INTEGER PRIMARY KEY",
    "postgres": "id BIGSERIAL PRIMARY KEY",
    "mysql": "id BIGINT AUTO_INCREMENT PRIMARY KEY",
}


def django_backend(vendor: str, table: str) -> Backend:
    alias = VENDOR_ALIAS[vendor]
    require(alias)
    store = DjangoStore(alias, table=table, clock="caller")
    store.migrate()
    execute(alias, f"CREATE TABLE biz_{table} ({_BUSINESS_ID[vendor]}, note TEXT)")

    @contextlib.contextmanager
    def open_transaction() -> Iterator[DjangoTransaction]:
        # Each run is a request of its own, on a connection of its own.
        with own_connection(alias):
            yield DjangoTransaction(alias)

    def write(conn: Any, note: str) -> None:
        with conn.cursor() as cursor:
            cursor.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", [note])

    def count() -> int:
        return int(execute(alias, f"SELECT count(*) FROM biz_{table}")[0][0])

    def drop() -> None:
        store.close()
        execute(alias, f"DROP TABLE IF EXISTS {table}")
        execute(alias, f"DROP TABLE IF EXISTS biz_{table}")

    backend = Backend(f"django-{vendor}", store, open_transaction, write, count)
    backend.closers.append(drop)
    return backend


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path, table_name: str) -> Iterator[Backend]:
    made = django_backend(request.param, table_name)
    yield made
    for close in made.closers:
        close()


def test_the_operators_questions_are_answered_on_djangos_connections(backend: Backend) -> None:
    """``DjangoStore`` is an ``SQLStore``: its stats (``idemflow stats``, the stuck gauge) too."""
    now = 1_700_000_000.0
    backend.store.claim(intent("k-stats"), "lease-1", now, now + 60)

    assert backend.store.stats().stuck_claims(now + 1)["in_progress"] == 1
