"""
The Redis Streams adapter against the real Redis on loopback (each test its own stream,
group and key prefix): duplicates and a race between two consumers make one effect, a
consumer SIGKILLed between its commit and its ``XACK`` makes one effect after the
redelivery, a poisoned entry goes to the dead-letter stream, a transient failure is
redelivered and run once.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from idemflow import Attempt, Idempotency, State
from idemflow.consumers import Consumer
from tests.backends import _open_redis, delete_keys, redis_client
from tests.conftest import POSTGRES_URL, unreachable
from tests.consumers._support import count_rows, run_until_killable_sync
from tests.factories import POLICY

redis = pytest.importorskip("redis")
from idemflow.consumers.redis_streams import RedisStreams  # noqa: E402

pytestmark = pytest.mark.redis


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"idemflow-test-cons-{uuid.uuid4().hex[:10]}"
    client = redis_client()
    try:
        client.ping()
    except redis.RedisError as exc:
        unreachable("Redis", exc)
    yield name
    delete_keys(client, name)
    client.close()


@pytest.fixture
def store(prefix: str) -> Iterator[Any]:
    store: Any = _open_redis(prefix)
    store.migrate()
    yield store
    store.close()


def streams(store: Any, prefix: str, name: str, **options: Any) -> RedisStreams:
    consumer = Consumer(Idempotency(store, POLICY), prefix)
    adapter = RedisStreams(
        consumer, redis_client(), f"{prefix}:orders", "billing", name, min_idle=0, **options
    )
    adapter.create_group()
    return adapter


def publish(adapter: RedisStreams, key: str, payload: bytes) -> None:
    adapter.client.xadd(adapter.stream, {"idempotency-key": key, "payload": payload})


def pending(adapter: RedisStreams) -> int:
    return int(adapter.client.xpending(adapter.stream, adapter.group)["pending"])


def drain(adapter: RedisStreams, handler: Any) -> list[str]:
    """Poll until nothing is pending or new (every entry acked or dead-lettered)."""
    actions: list[str] = []
    for _ in range(20):
        actions += adapter.poll(handler)
        if pending(adapter) == 0:
            return actions
    raise AssertionError(f"entries still pending after {actions}")


def test_a_message_published_twice_and_raced_by_two_consumers_has_one_effect(
    store: Any, prefix: str
) -> None:
    first, second = streams(store, prefix, "c1"), streams(store, prefix, "c2")
    publish(first, "order-1", b'{"amount": 5}')
    publish(first, "order-1", b'{"amount": 5}')
    effects: list[str] = []
    running, raced = threading.Event(), threading.Event()

    def held(attempt: Attempt, fields: dict[bytes, bytes]) -> str:
        running.set()
        assert raced.wait(10)  # until the other consumer met our claim
        effects.append(attempt.record.key)
        return "charged"

    def other(attempt: Attempt, fields: dict[bytes, bytes]) -> str:
        effects.append(attempt.record.key)
        return "charged again"

    holder = threading.Thread(target=lambda: first.poll(held, count=1))
    holder.start()
    assert running.wait(10)
    met = second.poll(other, count=1)
    raced.set()
    holder.join(10)

    assert set(met) == {"requeue_with_delay"}  # never waited for the holder
    assert set(drain(second, other)) <= {"ack_with_stored_result"}
    assert effects == ["order-1"]


def test_a_poisoned_message_goes_to_the_dead_letter_stream_without_an_effect(
    store: Any, prefix: str
) -> None:
    adapter = streams(store, prefix, "c1")
    publish(adapter, "order-1", b'{"amount": 5}')
    publish(adapter, "order-1", b'{"amount": 500}')
    effects: list[bytes] = []

    def charge(attempt: Attempt, fields: dict[bytes, bytes]) -> None:
        effects.append(fields[b"payload"])

    assert adapter.poll(charge) == ["ack", "dead_letter"]

    assert effects == [b'{"amount": 5}']
    ((_, dead),) = adapter.client.xrange(adapter.dead_letter)
    assert dead[b"payload"] == b'{"amount": 500}'
    assert b"different request" in dead[b"idemflow-problem"]
    assert pending(adapter) == 0


def test_a_transient_failure_is_redelivered_and_run_once(store: Any, prefix: str) -> None:
    adapter = streams(store, prefix, "c1")
    publish(adapter, "order-1", b"{}")
    calls: list[int] = []

    def flaky(attempt: Attempt, fields: dict[bytes, bytes]) -> str:
        calls.append(attempt.record.attempt)
        if len(calls) == 1:
            raise ConnectionError("the provider is down")
        return "charged"

    assert adapter.poll(flaky) == ["release_and_requeue"]
    assert pending(adapter) == 1
    assert drain(adapter, flaky) == ["ack"]
    assert calls == [1, 2]
    assert drain(adapter, flaky) == []


#: The child: a consumer whose XACK never comes (it reports, then waits to be killed).
CHILD = """
import sys, threading
import psycopg
from idemflow import Idempotency
from idemflow.consumers import Consumer
from idemflow.consumers.redis_streams import RedisStreams
from idemflow.stores.postgres import PostgresStore
from idemflow.transactions import PsycopgTransaction
from tests.backends import redis_client
from tests.factories import POLICY
url, table, prefix, where = sys.argv[1:]

class Transaction:
    def __enter__(self):
        self.conn = psycopg.connect(url, autocommit=True)
        return PsycopgTransaction(self.conn)
    def __exit__(self, *exc):
        self.conn.close()

def stalled_ack(*args):
    print("killable", flush=True)
    threading.Event().wait()

store = PostgresStore(url, table=table, clock="caller")
adapter = RedisStreams(Consumer(Idempotency(store, POLICY), prefix), redis_client(),
                       f"{prefix}:orders", "billing", "doomed", transaction=Transaction)
adapter.client.xack = stalled_ack
def charge(attempt, fields):
    attempt.connection.execute(f"INSERT INTO biz_{table} (note) VALUES ('charged')")
    if where == "before the commit":
        stalled_ack()
    return "charged"

print(adapter.poll(charge), flush=True)  # never reached: the XACK stalls
"""


@pytest.fixture
def postgres_table(prefix: str) -> Iterator[str]:
    psycopg = pytest.importorskip("psycopg")
    from idemflow.stores.postgres import PostgresStore

    table = prefix.replace("-", "_")
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE TABLE biz_{table} (id BIGSERIAL PRIMARY KEY, note TEXT)")
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    store = PostgresStore(POSTGRES_URL, table=table, clock="caller")
    store.migrate()
    store.close()
    yield table
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP TABLE biz_{table}")
        conn.execute(f"DROP TABLE {table}")


@pytest.mark.parametrize("where", ["before the commit", "before the ack"])
def test_a_consumer_killed_after_its_business_write_has_one_effect_after_redelivery(
    prefix: str, postgres_table: str, where: str
) -> None:
    """Killed before the commit: nothing committed, the claim left to the sweeper, then run
    once. Killed between the commit and the XACK: settled, acked with the stored result."""
    import psycopg

    from idemflow.stores.postgres import PostgresStore
    from idemflow.transactions import PsycopgTransaction

    @contextlib.contextmanager
    def transaction() -> Iterator[PsycopgTransaction]:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            yield PsycopgTransaction(conn)

    store = PostgresStore(POSTGRES_URL, table=postgres_table, clock="caller")
    adapter = streams(store, prefix, "survivor", transaction=transaction)
    publish(adapter, "order-1", b"{}")
    run_until_killable_sync(CHILD, POSTGRES_URL, postgres_table, prefix, where)

    def count() -> int:
        return count_rows(POSTGRES_URL, postgres_table)

    def again(attempt: Attempt, fields: dict[bytes, bytes]) -> None:
        attempt.connection.execute(f"INSERT INTO biz_{postgres_table} (note) VALUES ('again')")

    record = store.get(prefix, "order-1")
    assert record is not None
    assert pending(adapter) == 1  # the killed consumer never acked
    if where == "before the ack":
        assert (record.state, count()) == (State.COMPLETED, 1)
        assert drain(adapter, again) == ["ack_with_stored_result"]
    else:
        assert (record.state, count()) == (State.IN_PROGRESS, 0)  # rolled back with the kill
        assert adapter.poll(again) == ["requeue_with_delay"]  # still claimed: never run twice
        # The sweeper's pass, its threshold past: the dead consumer's claim released.
        past = time.time() + POLICY.stale_seconds + 1
        (marked,) = store.sweep(State.IN_PROGRESS, past, time.time(), time.time(), 10)
        assert store.release_stale(marked, time.time())
        assert drain(adapter, again) == ["ack"]
    assert count() == 1
    store.close()
