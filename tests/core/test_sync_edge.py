"""
The sync HTTP edge, generated from the async one: the WSGI frameworks' way in.

The same rules as ``tests/http/test_edge.py`` (which drives the async edge),
through ``idemflow._sync.edge.Edge`` on real SQLite and PostgreSQL, with the
store and the request's transaction sharing one small pool.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idemflow import Attempt, Event, Idempotency, Policy, Response, State
from idemflow._events import CountingObserver
from idemflow._http import EdgeOptions, HTTPRequest
from idemflow._sync.edge import Edge, pooled_transaction
from idemflow.stores.sqlite import SQLiteStore
from idemflow.transactions import PsycopgTransaction, SQLite3Transaction
from tests.conftest import POSTGRES_URL, unreachable
from tests.factories import CREATED_AT as CREATED
from tests.factories import psycopg_or_skip

POLICY = Policy(request_timeout=5)


def request(key: str = "k-1", body: bytes = b'{"amount":1}', principal: str = "alice") -> Any:
    return HTTPRequest(
        "POST",
        "/payments",
        [(b"idempotency-key", key.encode()), (b"content-type", b"application/json")],
        body,
        principal,
        f"req-{key}",
    )


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[tuple[SQLiteStore, Any]]:
    path = tmp_path / "keys.db"
    store = SQLiteStore(path)
    store.migrate()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE business (note TEXT)")
        conn.commit()

    @contextlib.contextmanager
    def connect() -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(path, isolation_level=None, timeout=5)
        try:
            yield conn
        finally:
            conn.close()

    try:
        yield store, lambda: pooled_transaction(connect, SQLite3Transaction)
    finally:
        store.close()


def notes(store: SQLiteStore) -> list[str]:
    with contextlib.closing(sqlite3.connect(store.path)) as conn:
        return [r[0] for r in conn.execute("SELECT note FROM business")]


def charging(attempt: Attempt) -> Response:
    attempt.connection.execute("INSERT INTO business VALUES (?)", (attempt.record.key,))
    return CREATED


def test_first_execution_then_a_byte_identical_replay(sqlite: tuple[SQLiteStore, Any]) -> None:
    store, transaction = sqlite
    edge = Edge(Idempotency(store, POLICY))

    first = edge.respond(request(), charging, transaction=transaction)
    again = edge.respond(request(), charging, transaction=transaction)

    assert first.status == again.status == 201
    assert again.body == first.body
    assert again.header("idempotent-replayed") == "true"
    assert again.header("location") == "/payments/pay_1"
    assert again.header("idempotency-original-request-id") == "req-k-1"
    assert notes(store) == ["k-1"]


def test_another_body_is_422_and_no_principal_is_401(sqlite: tuple[SQLiteStore, Any]) -> None:
    store, transaction = sqlite
    edge = Edge(Idempotency(store, POLICY))
    edge.respond(request(), charging, transaction=transaction)

    reused = edge.respond(request(body=b'{"amount":2}'), charging, transaction=transaction)
    anonymous = edge.respond(request(principal=""), charging, transaction=transaction)

    assert reused.status == 422
    assert json.loads(reused.body)["type"].endswith("/key-reused")
    assert anonymous.status == 401
    assert notes(store) == ["k-1"]


def test_a_transient_answer_is_released_and_the_retry_runs(
    sqlite: tuple[SQLiteStore, Any],
) -> None:
    store, transaction = sqlite
    edge = Edge(Idempotency(store, POLICY))
    answers = iter([Response(503, b"down"), CREATED])

    def flaky(attempt: Attempt) -> Response:
        attempt.connection.execute("INSERT INTO business VALUES (?)", ("try",))
        return next(answers)

    first = edge.respond(request(), flaky, transaction=transaction)
    second = edge.respond(request(), flaky, transaction=transaction)

    assert (first.status, second.status) == (503, 201)
    assert notes(store) == ["try"]  # the 503's write rolled back with its release


def test_an_unsendable_header_without_a_transaction_settles_a_marker(
    sqlite: tuple[SQLiteStore, Any],
) -> None:
    """No shared transaction: the effect happened; the key is settled, never released."""
    store, _ = sqlite
    edge = Edge(Idempotency(store, POLICY))
    runs: list[int] = []

    def bad_header(attempt: Attempt) -> Response:
        runs.append(1)
        return Response(201, b"{}", (("location", "/payments/1\r\nx: y"),))

    first = edge.respond(request(), bad_header)
    again = edge.respond(request(), bad_header)

    assert first.status == again.status == 500
    assert json.loads(again.body)["original_status"] == 201
    assert runs == [1]
    record = store.get("alice", "k-1")
    assert record is not None
    assert record.state is State.COMPLETED


def test_replay_authorization_is_asked_and_an_async_hook_is_refused(
    sqlite: tuple[SQLiteStore, Any],
) -> None:
    store, transaction = sqlite
    counted = CountingObserver()
    idempotency = Idempotency(store, POLICY, observer=counted)
    Edge(idempotency).respond(request(), charging, transaction=transaction)

    denied = Edge(idempotency, EdgeOptions(authorize_replay=lambda record: False))
    allowed = Edge(idempotency, EdgeOptions(authorize_replay=lambda record: True))

    async def async_hook(record: Any) -> bool:
        return True

    confused = Edge(idempotency, EdgeOptions(authorize_replay=async_hook))

    assert denied.respond(request(), charging).status == 403
    assert allowed.respond(request(), charging).status == 201
    refused = confused.respond(request(), charging)  # never taken for "allowed"
    assert refused.status == 500
    assert "coroutine function" in json.loads(refused.body)["detail"]
    # Each refused replay is counted as such, next to the replay the claim found.
    assert (counted.total(Event.REPLAYED), counted.total(Event.REPLAY_FORBIDDEN)) == (3, 1)


def hammer(edge: Edge, transaction: Any, table: str, execute: Any) -> list[int]:
    """20 threads, each retrying its own key until 201 against a dependency failing every
    other call; returns every status seen."""
    lock, calls, statuses = threading.Lock(), [0], []

    def charge(attempt: Attempt) -> Response:
        execute(attempt.connection, f"INSERT INTO biz_{table} VALUES (%s)", attempt.record.key)
        with lock:
            calls[0] += 1
            failing = calls[0] % 2 == 1
        return Response(503, b"down") if failing else CREATED

    def client(key: str) -> None:
        for _ in range(20):
            answer = edge.respond(request(key), charge, transaction=transaction)
            with lock:
                statuses.append(answer.status)
            if answer.status == 201:
                return

    threads = [threading.Thread(target=client, args=(f"k-{n}",)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return statuses


def psycopg_execute(conn: Any, sql: str, value: str) -> None:
    conn.execute(sql, (value,))


def pymysql_execute(conn: Any, sql: str, value: str) -> None:
    with conn.cursor() as cursor:
        cursor.execute(sql, (value,))


@pytest.mark.postgres
@pytest.mark.parametrize("pool_size", [1, 2])
def test_threads_sharing_a_tiny_pool_with_the_store_never_deadlock(
    pool_size: int, table_name: str
) -> None:
    """20 threads, one pool of 1-2 connections for the store and the requests, a dependency
    failing every other call: every key ends 201 with one business row, no 409."""
    psycopg_or_skip()
    psycopg_pool = pytest.importorskip("psycopg_pool")
    from idemflow.stores.postgres import PostgresStore, connection_options

    pool = psycopg_pool.ConnectionPool(
        POSTGRES_URL,
        min_size=1,
        max_size=pool_size,
        kwargs=connection_options(50),
        timeout=10,
        open=True,
    )
    store = PostgresStore(pool, table=table_name)
    store.migrate()
    with pool.connection() as conn:
        conn.execute(f"CREATE TABLE biz_{table_name} (note TEXT)")
    try:
        statuses = hammer(
            Edge(Idempotency(store, POLICY)),
            lambda: pooled_transaction(pool.connection, PsycopgTransaction),
            table_name,
            psycopg_execute,
        )
        with pool.connection() as conn:
            rows = [r[0] for r in conn.execute(f"SELECT note FROM biz_{table_name}")]
    finally:
        with pool.connection() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table_name}, biz_{table_name}")
        pool.close()

    assert 409 not in statuses
    assert statuses.count(201) == 20
    assert sorted(rows) == sorted(f"k-{n}" for n in range(20))


@pytest.mark.mysql
@pytest.mark.parametrize("pool_size", [1, 2])
def test_threads_sharing_a_tiny_mysql_pool_with_the_store_never_deadlock(
    pool_size: int, table_name: str
) -> None:
    """The same on MariaDB: the MySQL store's own pool of 1-2 serves the requests too."""
    pymysql = pytest.importorskip("pymysql")
    from idemflow.stores.mysql import MySQLStore, connect_kwargs
    from idemflow.transactions import PyMySQLTransaction
    from tests.backends import MYSQL_URL

    try:
        pymysql.connect(**connect_kwargs(MYSQL_URL)).close()
    except pymysql.err.OperationalError as exc:
        unreachable("MariaDB", exc)
    store = MySQLStore(MYSQL_URL, table=table_name, max_size=pool_size, timeout=10)
    store.migrate()
    with store.pool.connection() as conn, conn.cursor() as cursor:
        cursor.execute(f"CREATE TABLE biz_{table_name} (note TEXT)")
    try:
        statuses = hammer(
            Edge(Idempotency(store, POLICY)),
            lambda: pooled_transaction(store.pool.connection, PyMySQLTransaction),
            table_name,
            pymysql_execute,
        )
        with store.pool.connection() as conn, conn.cursor() as cursor:
            cursor.execute(f"SELECT note FROM biz_{table_name}")
            rows = [r[0] for r in cursor.fetchall()]
    finally:
        with store.pool.connection() as conn, conn.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {table_name}, biz_{table_name}")
        store.close()

    assert 409 not in statuses
    assert statuses.count(201) == 20
    assert sorted(rows) == sorted(f"k-{n}" for n in range(20))
