"""
A claim that committed but whose answer was lost: claimed, then swept, then run once.

The claim statement reaches the server and commits (the store's connection is
autocommit), and its reply is lost on the way back (a loopback proxy drops it
and closes the connection). The request cannot know it owns the key: it
answers 503 ``StoreUnavailable`` and never runs the handler. The key stays
**claimed** with no progress: a retry gets 409, never a second execution
while the first could still be running. Past the stale threshold the sweeper
releases it (nothing ran, nothing to reconcile) and the next retry runs the
handler exactly once. This is the row "The claim fails" of the failure table
in docs/crash-safety.md, for two-commit mode.

The completion's reply lost (PostgreSQL, where it travels with its COMMIT)
is the other unknown: there the record is settled once, never run again.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import pytest

from idemflow import (
    Attempt,
    Idempotency,
    InProgress,
    Outcome,
    Policy,
    Response,
    State,
    StoreUnavailable,
)
from idemflow.stores.protocol import MaintainableStore
from idemflow.sweeper import Sweeper
from idemflow.testing import FrozenClock
from tests._proxy import LosingProxy, losing_proxy
from tests.backends import MYSQL_URL, REDIS_URL
from tests.conftest import POSTGRES_URL
from tests.factories import CREATED
from tests.factories import uncorrelated_intent as intent

POLICY = Policy(request_timeout=5)


class ProxiedStore(MaintainableStore, Protocol):
    """What this test needs of a store besides the protocol: its table made, and closing."""

    def migrate(self) -> None: ...
    def close(self) -> None: ...


#: Builds a store that talks to the database through the proxy's port.
Opener = Callable[[int, str], ProxiedStore]


def _postgres(port: int, table: str) -> ProxiedStore:
    pytest.importorskip("psycopg")
    from idemflow.stores.postgres import PostgresStore

    url = POSTGRES_URL.replace(":5432/", f":{port}/")
    return PostgresStore(url, table=table, max_size=1, clock="caller")


def _mysql(port: int, table: str) -> ProxiedStore:
    pytest.importorskip("pymysql")
    from idemflow.stores.mysql import MySQLStore, connect_kwargs

    return MySQLStore({**connect_kwargs(MYSQL_URL), "port": port}, table=table, clock="caller")


def _redis(port: int, prefix: str) -> ProxiedStore:
    pytest.importorskip("redis")
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from idemflow.stores.redis import RedisStore

    # No client-side retry: the lost reply must surface as the failure it is.
    client = Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0), socket_timeout=5)
    return RedisStore(client, policy=POLICY, prefix=prefix, clock="caller", allow_volatile=True)


def _target(url: str, default: int) -> tuple[str, int]:
    return "127.0.0.1", urlsplit(url).port or default


@dataclass(frozen=True)
class Backend:
    """How to reach one database through the proxy, and to drop the test's table there."""

    open: Opener
    target: tuple[str, int]
    drop: Callable[[str], None] = lambda name: None  # Redis keys expire with the retention


def _drop_postgres(name: str) -> None:
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}")


def _drop_mysql(name: str) -> None:
    import pymysql

    from idemflow.stores.mysql import connect_kwargs

    with pymysql.connect(**connect_kwargs(MYSQL_URL), autocommit=True) as conn:
        conn.cursor().execute(f"DROP TABLE IF EXISTS {name}")


STORES = [
    pytest.param(
        Backend(_postgres, _target(POSTGRES_URL, 5432), _drop_postgres),
        marks=pytest.mark.postgres,
        id="postgres",
    ),
    pytest.param(
        Backend(_mysql, _target(MYSQL_URL, 3306), _drop_mysql), marks=pytest.mark.mysql, id="mysql"
    ),
    pytest.param(Backend(_redis, _target(REDIS_URL, 6379)), marks=pytest.mark.redis, id="redis"),
]


def is_the_claim(name: bytes) -> Callable[[bytes], bool]:
    """The request that claims: the SQL insert into the key table, or the Lua call on its keys."""
    return lambda chunk: (
        (b"INSERT INTO " + name in chunk)
        or (b"EVALSHA" in chunk and name in chunk and b"k-lost" in chunk)
    )


@contextlib.contextmanager
def store_behind(backend: Backend) -> Iterator[tuple[ProxiedStore, LosingProxy]]:
    name = f"lost_{uuid.uuid4().hex[:10]}"
    with losing_proxy(backend.target, is_the_claim(name.encode())) as proxy:
        store = backend.open(proxy.port, name)
        store.migrate()
        try:
            yield store, proxy
        finally:
            store.close()
            backend.drop(name)


@pytest.mark.parametrize("backend", STORES)
def test_a_claim_whose_answer_was_lost_stays_claimed_until_swept_then_runs_once(
    backend: Backend,
) -> None:
    clock = FrozenClock()
    ran: list[int] = []

    def charge(attempt: Attempt) -> Response:
        ran.append(1)
        return CREATED

    with store_behind(backend) as (store, proxy):
        idem = Idempotency(store, POLICY, clock=clock)
        with pytest.raises(StoreUnavailable):
            idem.run(intent("k-lost"), charge)
        assert proxy.lost.is_set(), "the claim's reply was not the one lost"
        assert ran == []
        record = store.get("alice", "k-lost")
        assert record is not None
        assert record.state is State.IN_PROGRESS  # it did commit

        # Until the threshold, every retry is told to come back: nothing runs twice.
        clock.advance(POLICY.stale_seconds - 1)
        with pytest.raises(InProgress):
            idem.run(intent("k-lost"), charge)
        Sweeper(store, POLICY, clock=clock).sweep_once()
        assert store.get("alice", "k-lost").state is State.IN_PROGRESS  # type: ignore[union-attr]

        # Past it, the sweeper releases the claim (no progress: nothing to reconcile) ...
        clock.advance(2)
        report = Sweeper(store, POLICY, clock=clock).sweep_once()
        assert report.released == 1, report
        # ... and the retry runs the handler exactly once; later retries replay it.
        first = idem.run(intent("k-lost"), charge)
        again = idem.run(intent("k-lost"), charge)
    assert (first.response.status, first.replayed) == (201, False)
    assert (again.response.status, again.replayed) == (201, True)
    assert ran == [1]


@contextlib.contextmanager
def completion_behind(
    name: str, port: int, table: str
) -> Iterator[tuple[Any, Callable[[], Any], Callable[[Any, str], None]]]:
    """(the store, a new transaction as a context manager, write(attempt.connection, sql))
    of ``name``, whose completion travels through the proxy at ``port``: psycopg's
    ``PsycopgTransaction`` on the store's pool behind it, or Django's or SQLAlchemy's
    own connection behind it (the claim on it, Django, or on the store's, SQLAlchemy).
    The caller closes the store."""
    from idemflow.stores.postgres import PostgresStore

    if name == "psycopg":
        from idemflow.edge import pooled_transaction
        from idemflow.transactions import PsycopgTransaction

        url = POSTGRES_URL.replace(":5432/", f":{port}/")
        store = PostgresStore(url, table=table, max_size=2, clock="caller")
        yield (
            store,
            lambda: pooled_transaction(store.pool.connection, PsycopgTransaction),
            lambda conn, sql: conn.execute(sql),
        )
        return
    if name == "django":
        django_setup = pytest.importorskip("tests.integrations.django_setup")
        from django.db import connections

        from idemflow.integrations.django import DjangoTransaction
        from idemflow.stores.django import DjangoStore

        alias = django_setup.VENDOR_ALIAS["postgres"]
        django_setup.require(alias)
        previous = connections[alias]
        proxied = type(previous)({**previous.settings_dict, "PORT": str(port)}, alias)
        connections[alias] = proxied

        def django_write(conn: Any, sql: str) -> None:
            with conn.cursor() as cursor:
                cursor.execute(sql)

        try:
            yield (
                DjangoStore("postgres", table=table, clock="caller"),
                lambda: contextlib.nullcontext(DjangoTransaction(alias)),
                django_write,
            )
        finally:
            connections[alias] = previous
            proxied.close()
        return
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    from idemflow.transactions import SQLAlchemyTransaction

    url = POSTGRES_URL.replace(":5432/", f":{port}/").replace(
        "postgresql://", "postgresql+psycopg://"
    )
    engine = sqlalchemy.create_engine(url)
    try:
        yield (
            PostgresStore(POSTGRES_URL, table=table, max_size=1, clock="caller"),
            lambda: contextlib.nullcontext(SQLAlchemyTransaction(Session(engine))),
            lambda session, sql: session.execute(sqlalchemy.text(sql)),
        )
    finally:
        engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("phase", [False, True], ids=["one-phase", "past-a-phase"])
@pytest.mark.parametrize("name", ["psycopg", "django", "sqlalchemy"])
def test_a_completion_whose_commit_reply_was_lost_settles_once_and_never_runs_again(
    name: str, phase: bool
) -> None:
    """Two commits on PostgreSQL: the completion travels with its COMMIT in one round trip
    (a pipeline: ``WITH fenced AS (UPDATE …) SELECT …``, ``COMMIT``, one ``Sync``), through
    ``PsycopgTransaction`` and through Django's and SQLAlchemy's adapters on psycopg 3. The
    server runs both and the reply is lost. The request cannot know it committed: it
    answers 503 (with a committed phase behind it, "could not be recorded", the key left
    to the sweeper). The fenced release it may send changes nothing of a completed record,
    so effect and record stand once, and every retry replays: the handler never runs a
    second time."""
    psycopg = pytest.importorskip("psycopg")

    table = f"lost_{uuid.uuid4().hex[:10]}"
    ran: list[int] = []

    def the_completion(chunk: bytes) -> bool:
        return b"WITH fenced AS (UPDATE " in chunk and b"response_status" in chunk

    with (
        psycopg.connect(POSTGRES_URL, autocommit=True) as admin,
        losing_proxy(_target(POSTGRES_URL, 5432), the_completion) as proxy,
        completion_behind(name, proxy.port, table) as (store, transaction, write),
    ):
        admin.execute(f"CREATE TABLE biz_{table} (id BIGSERIAL PRIMARY KEY, note TEXT)")
        try:
            store.migrate()
            idem = Idempotency(store, POLICY, clock=FrozenClock())

            def charge(attempt: Attempt) -> Response:
                ran.append(1)
                write(attempt.connection, f"INSERT INTO biz_{table} (note) VALUES ('paid')")
                if phase:
                    attempt.commit_phase("payment_created")
                return CREATED

            def run() -> Outcome:
                with transaction() as tx:
                    return idem.run(intent("k-lost"), charge, transaction=tx)

            with pytest.raises(StoreUnavailable) as unknown:
                run()
            assert proxy.lost.is_set(), "the completion's reply was not the one lost"
            record = store.get("alice", "k-lost")
            retries = [run(), run()]
        finally:
            store.close()
            rows = admin.execute(f"SELECT note FROM biz_{table}").fetchall()
            admin.execute(f"DROP TABLE IF EXISTS {table}, biz_{table}")

    assert ("could not be recorded" in str(unknown.value)) is phase
    assert record is not None
    assert record.state is State.COMPLETED  # the COMMIT ran: effect and record together
    assert [r.replayed for r in retries] == [True, True]
    assert ran == [1]
    assert rows == [("paid",)]
