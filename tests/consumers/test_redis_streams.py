"""
The Redis Streams adapter, sync and async, against the real Redis on loopback (each test
its own stream, group and key prefix): duplicates and a race between two consumers make
one effect, a consumer SIGKILLed between its commit and its ``XACK`` makes one effect
after the redelivery, a poisoned entry goes to the dead-letter stream, a transient
failure is redelivered and run once, a handler past its lease keeps it, and one whose
lease is stolen never completes.

Each case runs on both adapters with the same async handlers: the sync adapter polls in
a worker thread and runs each handler on the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from idemflow import AsyncIdempotency, Idempotency, State
from idemflow.consumers import AsyncConsumer, Consumer
from idemflow.testing import FrozenClock
from tests.backends import REDIS_URL, _open_redis, delete_keys, redis_client
from tests.conftest import POSTGRES_URL, unreachable
from tests.consumers._support import (
    Overrun,
    count_rows,
    outlive_the_lease,
    run_until_killable,
    steal_the_claim,
)
from tests.factories import POLICY

redis = pytest.importorskip("redis")
from idemflow.consumers.redis_streams import AsyncRedisStreams, RedisStreams  # noqa: E402

pytestmark = [pytest.mark.redis, pytest.mark.anyio]

Handler = Callable[[Any, dict[bytes, bytes]], Coroutine[Any, Any, Any]]


async def settled(value: Any) -> Any:
    """A sync store's answer as it is, an async one's awaited."""
    return await value if inspect.isawaitable(value) else value


@dataclass
class Side:
    """One adapter flavour: its store, and its adapters polled from the test's loop."""

    asynchronous: bool
    store: Any
    prefix: str
    clients: list[Any] = field(default_factory=list)

    def streams(
        self,
        name: str,
        clock: FrozenClock | None = None,
        renew_every: float | None = None,
        **options: Any,
    ) -> Any:
        timing: dict[str, Any] = {"clock": clock} if clock else {}
        if self.asynchronous:
            idempotency = AsyncIdempotency(self.store, POLICY, **timing)
            consumer: Any = AsyncConsumer(idempotency, self.prefix, renew_every=renew_every)
            client = redis.asyncio.Redis.from_url(REDIS_URL, socket_timeout=5)
            kind: Any = AsyncRedisStreams
        else:
            consumer, client = (
                Consumer(Idempotency(self.store, POLICY, **timing), self.prefix),
                redis_client(),
            )
            kind = RedisStreams
        self.clients.append(client)
        stream = f"{self.prefix}:orders"
        return kind(consumer, client, stream, "billing", name, min_idle=0, **options)

    async def make(
        self,
        name: str,
        clock: FrozenClock | None = None,
        renew_every: float | None = None,
        **options: Any,
    ) -> Any:
        adapter = self.streams(name, clock, renew_every, **options)
        await settled(adapter.create_group())
        return adapter

    async def poll(self, adapter: Any, handler: Handler, **options: Any) -> list[str]:
        if self.asynchronous:
            return list(await adapter.poll(handler, **options))
        loop = asyncio.get_running_loop()

        def on_the_loop(attempt: Any, fields: dict[bytes, bytes]) -> Any:
            return asyncio.run_coroutine_threadsafe(handler(attempt, fields), loop).result()

        return list(await asyncio.to_thread(adapter.poll, on_the_loop, **options))

    async def drain(self, adapter: Any, handler: Handler) -> list[str]:
        """Poll until nothing is pending or new (every entry acked or dead-lettered)."""
        actions: list[str] = []
        for _ in range(20):
            actions += await self.poll(adapter, handler)
            if pending(adapter) == 0:
                return actions
        raise AssertionError(f"entries still pending after {actions}")

    async def close(self) -> None:
        for client in self.clients:
            await settled(client.aclose() if self.asynchronous else client.close())
        await settled(self.store.close())


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


@pytest.fixture(params=["sync", "async"])
async def side(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[Side]:
    """The sync adapter on a ``RedisStore``, or the async one on an ``AsyncRedisStore``."""
    from idemflow.stores.redis import AsyncRedisStore

    if request.param == "sync":
        store: Any = _open_redis(prefix)
    else:
        client = redis.asyncio.Redis.from_url(REDIS_URL, socket_timeout=5)
        store = AsyncRedisStore(client, prefix=prefix, clock="caller", allow_volatile=True)
    await settled(store.migrate())
    opened = Side(request.param == "async", store, prefix)
    yield opened
    await opened.close()


@functools.cache
def admin() -> Any:
    """The test's own client: what it publishes, what it looks at."""
    return redis_client()


def publish(adapter: Any, key: str, payload: bytes) -> None:
    admin().xadd(adapter.stream, {"idempotency-key": key, "payload": payload})


def pending(adapter: Any) -> int:
    return int(admin().xpending(adapter.stream, adapter.group)["pending"])


async def test_a_message_published_twice_and_raced_by_two_consumers_has_one_effect(
    side: Side,
) -> None:
    first, second = await side.make("c1"), await side.make("c2")
    publish(first, "order-1", b'{"amount": 5}')
    publish(first, "order-1", b'{"amount": 5}')
    effects: list[str] = []
    running, raced = asyncio.Event(), asyncio.Event()

    async def held(attempt: Any, fields: dict[bytes, bytes]) -> str:
        running.set()
        await asyncio.wait_for(raced.wait(), 10)  # until the other consumer met our claim
        effects.append(attempt.record.key)
        return "charged"

    async def other(attempt: Any, fields: dict[bytes, bytes]) -> str:
        effects.append(attempt.record.key)
        return "charged again"

    holder = asyncio.create_task(side.poll(first, held, count=1))
    await asyncio.wait_for(running.wait(), 10)
    met = await side.poll(second, other, count=1)
    raced.set()
    assert await asyncio.wait_for(holder, 10) == ["ack"]

    assert set(met) == {"requeue_with_delay"}  # never waited for the holder
    assert set(await side.drain(second, other)) <= {"ack_with_stored_result"}
    assert effects == ["order-1"]


async def test_a_poisoned_message_goes_to_the_dead_letter_stream_without_an_effect(
    side: Side,
) -> None:
    adapter = await side.make("c1")
    publish(adapter, "order-1", b'{"amount": 5}')
    publish(adapter, "order-1", b'{"amount": 500}')
    effects: list[bytes] = []

    async def charge(attempt: Any, fields: dict[bytes, bytes]) -> None:
        effects.append(fields[b"payload"])

    assert await side.poll(adapter, charge) == ["ack", "dead_letter"]

    assert effects == [b'{"amount": 5}']
    ((_, dead),) = admin().xrange(adapter.dead_letter)
    assert dead[b"payload"] == b'{"amount": 500}'
    assert b"different request" in dead[b"idemflow-problem"]
    assert pending(adapter) == 0


async def test_an_entry_without_its_key_field_is_dead_lettered_with_the_field_named(
    side: Side,
) -> None:
    adapter = await side.make("c1")
    admin().xadd(adapter.stream, {"payload": b"{}"})

    async def charge(attempt: Any, fields: dict[bytes, bytes]) -> None:
        raise AssertionError("never run")

    assert await side.poll(adapter, charge) == ["dead_letter"]
    ((_, dead),) = admin().xrange(adapter.dead_letter)
    assert dead[b"idemflow-problem"] == b"the entry has no 'idempotency-key' field"


async def test_a_transient_failure_is_redelivered_and_run_once(side: Side) -> None:
    adapter = await side.make("c1")
    publish(adapter, "order-1", b"{}")
    calls: list[int] = []

    async def flaky(attempt: Any, fields: dict[bytes, bytes]) -> str:
        calls.append(attempt.record.attempt)
        if len(calls) == 1:
            raise ConnectionError("the provider is down")
        return "charged"

    assert await side.poll(adapter, flaky) == ["release_and_requeue"]
    assert pending(adapter) == 1
    assert await side.drain(adapter, flaky) == ["ack"]
    assert calls == [1, 2]
    assert await side.drain(adapter, flaky) == []


#: The lease keeper is the entry point's, alike for both adapters: the async one's handler
#: runs on the test's loop, where the store's renewals and the sweeper's pass interleave.
ASYNC_ONLY = pytest.mark.parametrize("side", ["async"], indirect=True)


@ASYNC_ONLY
async def test_a_handler_longer_than_its_lease_keeps_its_claim(
    side: Side, clock: FrozenClock
) -> None:
    adapter = await side.make("c1", clock, renew_every=0.01)
    publish(adapter, "order-1", b"{}")
    effects: list[str] = []

    async def long(attempt: Any, fields: dict[bytes, bytes]) -> str:
        await outlive_the_lease(side.store, side.prefix, clock)
        effects.append(attempt.record.key)
        return "done"

    assert await side.poll(adapter, long) == ["ack"]
    assert (effects, pending(adapter)) == (["order-1"], 0)


@ASYNC_ONLY
async def test_a_handler_whose_lease_is_stolen_never_completes(
    side: Side, clock: FrozenClock
) -> None:
    adapter = await side.make("c1", clock, renew_every=0.01)
    publish(adapter, "order-1", b"{}")
    overrun = Overrun()
    handling = asyncio.create_task(side.poll(adapter, overrun))
    await asyncio.wait_for(overrun.started.wait(), 10)
    await steal_the_claim(side.store, clock)

    assert await asyncio.wait_for(handling, 10) == ["requeue_with_delay"]
    record = await side.store.get(side.prefix, "order-1")
    assert record is not None
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "lease-b")
    assert overrun.effects == []
    assert pending(adapter) == 1  # left for lease-b's owner to settle, never acked


#: The child: a consumer whose XACK never comes (it reports, then waits to be killed).
CHILD = """
import asyncio, contextlib, sys, threading
import psycopg, redis.asyncio
from idemflow import AsyncIdempotency, Idempotency
from idemflow.consumers import AsyncConsumer, Consumer
from idemflow.consumers.redis_streams import AsyncRedisStreams, RedisStreams
from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore
from idemflow.transactions import AsyncPsycopgTransaction, PsycopgTransaction
from tests.backends import REDIS_URL, redis_client
from tests.factories import POLICY
url, table, prefix, where, flavour = sys.argv[1:]
insert = f"INSERT INTO biz_{table} (note) VALUES ('charged')"
where_from = (f"{prefix}:orders", "billing", "doomed")

def stalled(*args):
    print("killable", flush=True)
    threading.Event().wait()

@contextlib.contextmanager
def transaction():
    with psycopg.connect(url, autocommit=True) as conn:
        yield PsycopgTransaction(conn)

@contextlib.asynccontextmanager
async def async_transaction():
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        yield AsyncPsycopgTransaction(conn)

def charge(attempt, fields):
    attempt.connection.execute(insert)
    if where == "before the commit":
        stalled()
    return "charged"

async def async_charge(attempt, fields):
    await attempt.connection.execute(insert)
    if where == "before the commit":
        stalled()
    return "charged"

async def async_stalled(*args):
    stalled()

async def main():
    store = AsyncPostgresStore(url, table=table, clock="caller")
    consumer = AsyncConsumer(AsyncIdempotency(store, POLICY), prefix)
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    adapter = AsyncRedisStreams(consumer, client, *where_from, transaction=async_transaction)
    adapter.client.xack = async_stalled
    await adapter.poll(async_charge)

if flavour == "async":
    asyncio.run(main())
else:
    store = PostgresStore(url, table=table, clock="caller")
    consumer = Consumer(Idempotency(store, POLICY), prefix)
    adapter = RedisStreams(consumer, redis_client(), *where_from, transaction=transaction)
    adapter.client.xack = stalled
    adapter.poll(charge)
print("never reached: the XACK stalls", flush=True)
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


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("where", ["before the commit", "before the ack"])
async def test_a_consumer_killed_after_its_business_write_has_one_effect_after_redelivery(
    prefix: str, postgres_table: str, where: str, flavour: str
) -> None:
    """Killed before the commit: nothing committed, the claim left to the sweeper, then run
    once. Killed between the commit and the XACK: settled, acked with the stored result."""
    import psycopg

    from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore
    from idemflow.transactions import AsyncPsycopgTransaction, PsycopgTransaction

    @contextlib.contextmanager
    def transaction() -> Iterator[PsycopgTransaction]:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            yield PsycopgTransaction(conn)

    @contextlib.asynccontextmanager
    async def async_transaction() -> AsyncIterator[AsyncPsycopgTransaction]:
        async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as conn:
            yield AsyncPsycopgTransaction(conn)

    asynchronous = flavour == "async"
    kind: Any = AsyncPostgresStore if asynchronous else PostgresStore
    store = kind(POSTGRES_URL, table=postgres_table, clock="caller")
    side = Side(asynchronous, store, prefix)
    adapter = await side.make(
        "survivor", transaction=async_transaction if asynchronous else transaction
    )
    publish(adapter, "order-1", b"{}")
    await run_until_killable(CHILD, POSTGRES_URL, postgres_table, prefix, where, flavour)

    def count() -> int:
        return count_rows(POSTGRES_URL, postgres_table)

    async def again(attempt: Any, fields: dict[bytes, bytes]) -> None:
        await settled(
            attempt.connection.execute(f"INSERT INTO biz_{postgres_table} (note) VALUES ('again')")
        )

    record = await settled(store.get(prefix, "order-1"))
    assert record is not None
    assert pending(adapter) == 1  # the killed consumer never acked
    if where == "before the ack":
        assert (record.state, count()) == (State.COMPLETED, 1)
        assert await side.drain(adapter, again) == ["ack_with_stored_result"]
    else:
        assert (record.state, count()) == (State.IN_PROGRESS, 0)  # rolled back with the kill
        assert await side.poll(adapter, again) == ["requeue_with_delay"]  # never run twice
        # The sweeper's pass, its threshold past: the dead consumer's claim released.
        now = time.time()
        past = now + POLICY.stale_seconds + 1  # past the claim's own deadline
        (marked,) = await settled(store.sweep(State.IN_PROGRESS, past, now, now, 10))
        assert await settled(store.release_stale(marked, time.time()))
        assert await side.drain(adapter, again) == ["ack"]
    assert count() == 1
    await side.close()
