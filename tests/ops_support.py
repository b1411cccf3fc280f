"""
Helpers for the operations tests (metrics, CLI, purge): real stores and a real scrape.

Stores are opened on real SQLite files and the real PostgreSQL server, one
table per test; records are written through the public driver or the store
contract, never by hand-made rows, so what the tests read is what apps write.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from idemflow import Idempotency, Intent, Policy, Response, fingerprint
from idemflow.stores.sqlite import SQLiteStore
from idemflow.testing import FrozenClock
from tests.conftest import POSTGRES_URL
from tests.factories import psycopg_or_skip

#: (metric sample name, sorted label pairs) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

DAY = 86_400.0


@contextlib.contextmanager
def sqlite_store(tmp_path: Path, table: str) -> Iterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "keys.db", table=table)
    store.migrate()
    yield store


@contextlib.contextmanager
def postgres_store(table: str) -> Iterator[Any]:
    """A migrated PostgreSQL store on its own table, dropped afterwards."""
    psycopg = psycopg_or_skip()
    from idemflow.stores.postgres import PostgresStore

    store = PostgresStore(POSTGRES_URL, table=table, max_size=2, clock="caller")
    try:
        store.migrate()
        yield store
    finally:
        store.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


def open_store(kind: str, tmp_path: Path, table: str) -> contextlib.AbstractContextManager[Any]:
    return sqlite_store(tmp_path, table) if kind == "sqlite" else postgres_store(table)


def store_url(kind: str, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'keys.db'}" if kind == "sqlite" else POSTGRES_URL


def intent(
    key: str,
    *,
    principal: str = "alice",
    body: bytes = b'{"amount":1000}',
    endpoint: str = "POST /payments",
    correlation_id: str | None = None,
) -> Intent:
    digest = fingerprint("POST", "/payments", body, content_type="application/json")
    return Intent(principal, key, digest, endpoint=endpoint, correlation_id=correlation_id)


def created(attempt: object) -> Response:
    return Response.json(201, {"id": 1, "status": "succeeded"})


def settle(store: Any, key: str, *, at: float, retention: float = DAY, **kwargs: Any) -> None:
    """One completed request for ``key``, made as if at ``at`` (epoch seconds)."""
    policy = Policy(request_timeout=30, retention=retention)
    Idempotency(store, policy, clock=FrozenClock(at)).run(intent(key, **kwargs), created)


def crash_after_claim(store: Any, key: str, *, at: float, **kwargs: Any) -> None:
    """A claim whose request died before completing: the record stays in_progress."""
    store.claim(intent(key, **kwargs), f"lease-{key}", at, at + DAY)


@contextlib.contextmanager
def metrics_endpoint(registry: CollectorRegistry) -> Iterator[Callable[[], Samples]]:
    """Serve ``registry`` on a free loopback port; yields a function that scrapes it."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        with httpx.Client(timeout=10, verify=False) as client:

            def scrape() -> Samples:
                reply = client.get(url)
                reply.raise_for_status()
                return parse(reply.text)

            yield scrape
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 when the sample is absent (a counter never incremented)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def now() -> float:
    return time.time()
