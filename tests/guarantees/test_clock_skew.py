"""
Host clocks that disagree cannot break a guarantee (issue 9, defect 14).

With several application hosts and a sweeper on another, each host's clock is
off by its own amount. The shared stores take every time decision on the
database server's clock, so a sweeper and a claimer whose clocks run five
minutes ahead neither take over a live claim nor treat an unexpired record
as expired. (SQLite and the memory store live on one host, whose clock is the
only one there is.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idemflow import Idempotency, Intent, KeyReused, Policy, Response, State
from idemflow.sweeper import Sweeper
from tests.conftest import POSTGRES_URL, unreachable
from tests.factories import psycopg_or_skip

POLICY = Policy(request_timeout=5, retention=60)  # stale after 20 s
AHEAD = 300.0  # five minutes: far past both the stale threshold and the retention
CREATED = Response(201, b"created")


def ahead() -> float:
    return time.time() + AHEAD


def intent(fingerprint: str = "fp-1") -> Intent:
    return Intent("alice", "k-1", fingerprint, endpoint="POST /payments")


def postgres_store(table: str) -> Iterator[Any]:
    psycopg = psycopg_or_skip()
    from idemflow.stores.postgres import PostgresStore

    store = PostgresStore(POSTGRES_URL, table=table, max_size=2)
    store.migrate()
    try:
        yield store
    finally:
        store.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


def mysql_store(table: str) -> Iterator[Any]:
    pymysql = pytest.importorskip("pymysql")
    from idemflow.stores.mysql import MySQLStore, connect_kwargs
    from tests.backends import MYSQL_URL

    try:
        pymysql.connect(**connect_kwargs(MYSQL_URL)).close()
    except pymysql.err.OperationalError as exc:
        unreachable("MariaDB", exc)
    store = MySQLStore(MYSQL_URL, table=table, max_size=2)
    store.migrate()
    try:
        yield store
    finally:
        store.close()
        with pymysql.connect(**connect_kwargs(MYSQL_URL)) as conn, conn.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {table}")


STORES: dict[str, Callable[[str], Iterator[Any]]] = {
    "postgres": postgres_store,
    "mysql": mysql_store,
}


@pytest.fixture(
    params=[
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ]
)
def store(request: pytest.FixtureRequest, table_name: str) -> Iterator[Any]:
    yield from STORES[request.param](table_name)


def test_a_sweeper_whose_clock_runs_ahead_leaves_a_live_claim_alone(store: Any) -> None:
    """On its own clock the claim is five minutes old, far past the 20 s threshold; on the
    database's it was made a moment ago. The sweeper marks nothing, the owner completes."""
    now = time.time()
    claim = store.claim(intent(), "lease-live", now, now + 60, stale_after=POLICY.stale_seconds)
    assert claim.owned

    report = Sweeper(store, POLICY, clock=ahead).sweep_once()

    assert report.resolved == 0
    store.complete(claim.record, State.COMPLETED, CREATED, time.time(), time.time() + 60)
    record = store.get("alice", "k-1")
    assert record is not None
    assert (record.state, record.response) == (State.COMPLETED, CREATED)


def test_a_claimer_whose_clock_runs_ahead_replays_an_unexpired_record(store: Any) -> None:
    """Settled a moment ago with a 60 s retention: a host five minutes ahead must still be
    answered with the replay (same request) or a 422 (another one), never run it again."""
    calls: list[str] = []

    def charge(attempt: Any) -> Response:
        calls.append(attempt.record.key)
        return CREATED

    Idempotency(store, POLICY).run(intent(), charge)
    skewed = Idempotency(store, POLICY, clock=ahead)

    replay = skewed.run(intent(), charge)
    with pytest.raises(KeyReused):
        skewed.run(intent("fp-other"), charge)

    assert replay.replayed
    assert replay.response == CREATED
    assert calls == ["k-1"]


def test_a_claimer_whose_clock_runs_behind_still_sees_retention_end(store: Any) -> None:
    """The other direction: retention ends on the database's clock, so a host that lags
    does not keep a key settled past it. A 1 s retention, the host ten minutes behind."""
    short = Policy(request_timeout=5, retention=1)
    Idempotency(store, short).run(intent(), lambda attempt: CREATED)
    deadline = time.monotonic() + 10
    behind = Idempotency(store, short, clock=lambda: time.time() - 600)
    while True:
        try:
            outcome = behind.run(intent("fp-new"), lambda attempt: Response(201, b"new"))
            break
        except KeyReused:  # still within retention on the database's clock
            assert time.monotonic() < deadline, "retention never ended on the database clock"
            time.sleep(0.05)

    assert not outcome.replayed
    assert outcome.response.body == b"new"


def redis_store(table: str) -> Iterator[Any]:
    pytest.importorskip("redis")
    from idemflow.stores.redis import RedisStore
    from tests.backends import delete_keys, redis_client

    client = redis_client()
    try:
        client.ping()
    except Exception as exc:
        unreachable("Redis", exc)
    store = RedisStore(client, policy=POLICY, prefix=table, allow_volatile=True)
    store.migrate()
    try:
        yield store
    finally:
        delete_keys(client, table)
        store.close()


@pytest.fixture(
    params=[
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def scheduled_store(request: pytest.FixtureRequest, table_name: str) -> Iterator[Any]:
    yield from {**STORES, "redis": redis_store}[request.param](table_name)


def test_a_sweeper_whose_clock_runs_ahead_sleeps_until_the_database_s_deadline(
    scheduled_store: Any,
) -> None:
    """Its next pass is due when the claim is stale on the database's clock: a whole
    threshold from now, not five minutes ago (which would pass now and find nothing)."""
    now = time.time()
    assert scheduled_store.claim(
        intent(), "lease-live", now, now + 60, stale_after=POLICY.stale_seconds
    ).owned

    due = Sweeper(scheduled_store, POLICY, clock=ahead).due_in()

    assert due is not None
    assert POLICY.stale_seconds - 5 < due <= POLICY.stale_seconds + 0.001
