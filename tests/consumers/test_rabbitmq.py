"""
The RabbitMQ adapter against the real broker on loopback (each test its own queue, its
dead-letter and delay queues deleted after), on PostgreSQL and SQLite stores, each
handler's business write in the app's transaction: duplicates delivered to two
consumers at once make one effect, a poisoned message is dead-lettered, a transient
failure is redelivered (through the delay queue) and run once, a handler longer than
its lease keeps its claim and one whose lease is stolen never completes, and a consumer
SIGKILLed after its business write (before its commit, or between it and its ack) makes
one effect after the redelivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from idemflow import AsyncAttempt, AsyncIdempotency, Intent, OutcomeUnknown, State
from idemflow.consumers import AsyncConsumer
from idemflow.stores.protocol import AsyncTransaction
from idemflow.testing import FrozenClock
from tests.conftest import POSTGRES_URL, unreachable
from tests.factories import POLICY, until
from tests.sweeping import async_sweep_away

aio_pika = pytest.importorskip("aio_pika")
from idemflow.consumers.rabbitmq import RabbitMQ  # noqa: E402

pytestmark = [pytest.mark.rabbitmq, pytest.mark.anyio]

ROOT = Path(__file__).resolve().parents[2]
RABBITMQ_URL = os.environ.get("IDEMFLOW_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")


@dataclass
class App:
    """A store, the app's business table beside it, and the app's transactions on it."""

    store: Any
    transaction: Callable[[], AbstractAsyncContextManager[AsyncTransaction]]
    write: Callable[[Any], Awaitable[None]]  # a business row, on ``attempt.connection``
    count: Callable[[], int]  # committed business rows
    close: Callable[[], Awaitable[None]]


def open_app(kind: str, where: str, table: str) -> App:
    """``kind``'s store and transactions on ``where`` (a URL, a file), tables made."""
    if kind == "postgres":
        import psycopg

        from idemflow.stores.postgres import AsyncPostgresStore
        from idemflow.transactions import AsyncPsycopgTransaction

        @contextlib.asynccontextmanager
        async def pg_transaction() -> AsyncIterator[AsyncTransaction]:
            async with await psycopg.AsyncConnection.connect(where, autocommit=True) as conn:
                yield AsyncPsycopgTransaction(conn)

        async def pg_write(conn: Any) -> None:
            await conn.execute(f"INSERT INTO biz_{table} (note) VALUES ('charged')")

        def pg_count() -> int:
            with psycopg.connect(where, autocommit=True) as conn:
                row = conn.execute(f"SELECT count(*) FROM biz_{table}").fetchone()
                assert row is not None
                return int(row[0])

        pg = AsyncPostgresStore(where, table=table, clock="caller")
        return App(pg, pg_transaction, pg_write, pg_count, pg.close)

    from idemflow.stores.sqlite import AsyncSQLiteStore, connect
    from idemflow.transactions import AsyncSQLite3Connection, AsyncSQLite3Transaction

    @contextlib.asynccontextmanager
    async def sqlite_transaction() -> AsyncIterator[AsyncTransaction]:
        conn = AsyncSQLite3Connection(connect(where, busy_timeout=5.0))
        try:
            yield AsyncSQLite3Transaction(conn)
        finally:
            conn.close()

    async def sqlite_write(conn: Any) -> None:
        await conn.run(conn.raw.execute, f"INSERT INTO biz_{table} (note) VALUES ('charged')")

    def sqlite_count() -> int:
        with contextlib.closing(sqlite3.connect(where)) as conn:
            return int(conn.execute(f"SELECT count(*) FROM biz_{table}").fetchone()[0])

    lite = AsyncSQLiteStore(where, table=table)

    async def sqlite_close() -> None:
        await lite.close()

    return App(lite, sqlite_transaction, sqlite_write, sqlite_count, sqlite_close)


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"])
async def app(
    request: pytest.FixtureRequest, tmp_path: Path, table_name: str
) -> AsyncIterator[tuple[App, list[str]]]:
    """The app and what a child process needs to open it too."""
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
    yield opened, [kind, where, table_name]
    await opened.close()
    if kind == "postgres":
        with psycopg.connect(where, autocommit=True) as conn:
            conn.execute(f"DROP TABLE biz_{table_name}")
            conn.execute(f"DROP TABLE {table_name}")


@dataclass
class Broker:
    connection: Any
    queue: str

    async def consumer(self, app: App, clock: Any = None, **options: Any) -> Rabbit:
        """A consumer of the queue on a channel of its own."""
        idempotency = AsyncIdempotency(app.store, POLICY, **({"clock": clock} if clock else {}))
        channel = await self.connection.channel()
        consumer = AsyncConsumer(idempotency, self.queue, **options)
        adapter = RabbitMQ(consumer, channel, self.queue, transaction=app.transaction)
        return Rabbit(adapter, await channel.get_queue(self.queue, ensure=False))

    async def publish(self, key: str, body: bytes) -> None:
        channel = await self.connection.channel()
        message = aio_pika.Message(body, headers={"Idempotency-Key": key})
        await channel.default_exchange.publish(message, routing_key=self.queue)
        await channel.close()

    async def left(self, queue: str) -> int:
        """Messages ready in ``queue`` (0 if it does not exist)."""
        channel = await self.connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return 0
        ready = int(declared.declaration_result.message_count)
        await channel.close()
        return ready


@dataclass
class Rabbit:
    adapter: RabbitMQ
    queue: Any

    async def next(self, within: float = 20) -> Any:
        """The next message delivered to this consumer (a delayed one back from its delay
        queue once its TTL ran out)."""
        deadline = time.monotonic() + within
        while (message := await self.queue.get(fail=False)) is None:
            assert time.monotonic() < deadline, "no message came"
            await asyncio.sleep(0.05)
        return message


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    try:
        connection = await aio_pika.connect(RABBITMQ_URL, timeout=3)
    except (TimeoutError, OSError, aio_pika.exceptions.AMQPConnectionError) as exc:
        unreachable("RabbitMQ", exc)
    name = f"idemflow-test-{uuid.uuid4().hex[:10]}"
    channel = await connection.channel()
    await channel.declare_queue(name, durable=True)
    yield Broker(connection, name)
    for queue in [name, f"{name}.dead", *(f"{name}.delay.{1 << n}s" for n in range(8))]:
        await channel.queue_delete(queue)
    await connection.close()


async def test_a_message_published_twice_and_delivered_to_two_consumers_has_one_effect(
    app: tuple[App, list[str]], broker: Broker
) -> None:
    shop, _ = app
    first, second = await broker.consumer(shop), await broker.consumer(shop)
    await broker.publish("order-1", b'{"amount": 5}')
    await broker.publish("order-1", b'{"amount": 5}')
    one, two = await first.next(), await second.next()  # each holds a copy, unacked
    effects: list[str] = []
    running, raced = asyncio.Event(), asyncio.Event()

    async def held(attempt: AsyncAttempt, message: Any) -> str:
        running.set()
        await asyncio.wait_for(raced.wait(), 10)  # until the other consumer met our claim
        await shop.write(attempt.connection)
        effects.append(attempt.record.key)
        return "charged"

    async def other(attempt: AsyncAttempt, message: Any) -> str:
        await shop.write(attempt.connection)
        effects.append(attempt.record.key)
        return "charged again"

    holding = asyncio.create_task(first.adapter.deliver(one, held))
    await running.wait()
    met = await second.adapter.deliver(two, other)
    requeued = time.monotonic()
    raced.set()

    assert (met, await holding) == ("requeue_with_delay", "ack")  # never waited for it
    back = await second.next()  # the copy, back from the delay queue
    assert time.monotonic() - requeued >= 0.9  # its TTL: POLICY.retry_after, 1 s
    assert await second.adapter.deliver(back, other) == "ack_with_stored_result"
    assert (effects, shop.count()) == (["order-1"], 1)
    assert await broker.left(broker.queue) == 0


async def test_a_poisoned_message_is_dead_lettered_without_an_effect(
    app: tuple[App, list[str]], broker: Broker
) -> None:
    shop, _ = app
    rabbit = await broker.consumer(shop)
    await broker.publish("order-1", b'{"amount": 5}')
    await broker.publish("order-1", b'{"amount": 500}')
    effects: list[bytes] = []

    async def charge(attempt: AsyncAttempt, message: Any) -> None:
        await shop.write(attempt.connection)
        effects.append(message.body)

    actions = [await rabbit.adapter.deliver(await rabbit.next(), charge) for _ in range(2)]

    assert actions == ["ack", "dead_letter"]
    assert (effects, shop.count()) == ([b'{"amount": 5}'], 1)
    dead_letters = await rabbit.adapter.channel.get_queue(rabbit.adapter.dead_letter)
    dead = await dead_letters.get()
    assert dead.body == b'{"amount": 500}'
    assert dead.headers["Idempotency-Key"] == "order-1"
    assert "different request" in str(dead.headers["idemflow-problem"])
    await dead.ack()
    assert await broker.left(broker.queue) == 0


async def test_a_transient_failure_is_redelivered_and_run_once(
    app: tuple[App, list[str]], broker: Broker
) -> None:
    shop, _ = app
    rabbit = await broker.consumer(shop)
    await broker.publish("order-1", b"{}")
    calls: list[int] = []

    async def flaky(attempt: AsyncAttempt, message: Any) -> str:
        calls.append(attempt.record.attempt)
        await shop.write(attempt.connection)
        if len(calls) == 1:
            raise ConnectionError("the provider is down")  # the write rolls back
        return "charged"

    await rabbit.adapter.consume(flaky)  # as a service consumes: each message in a task
    await until(lambda: shop.count() == 1, "the redelivery's effect", blocking=True)
    await asyncio.sleep(0.2)  # time for a second run, were there one

    assert (calls, shop.count()) == ([1, 2], 1)
    assert await broker.left(broker.queue) == 0
    assert await broker.left(f"{broker.queue}.delay.1s") == 0


async def test_a_handler_longer_than_its_lease_keeps_its_claim(
    app: tuple[App, list[str]], broker: Broker, clock: FrozenClock
) -> None:
    shop, _ = app
    rabbit = await broker.consumer(shop, clock, renew_every=0.01)
    await broker.publish("order-1", b"{}")

    async def renewed() -> bool:
        record = await shop.store.get(broker.queue, "order-1")
        return record is not None and record.updated_at == clock()

    async def long(attempt: AsyncAttempt, message: Any) -> str:
        clock.advance(POLICY.stale_seconds - 1)
        deadline = time.monotonic() + 10
        while not await renewed():
            assert time.monotonic() < deadline, "never renewed"
            await asyncio.sleep(0.01)
        clock.advance(2)  # past the threshold counted from the claim
        cutoff = clock() - POLICY.stale_seconds
        assert await shop.store.sweep(State.IN_PROGRESS, cutoff, clock(), clock() + 60, 10) == []
        await shop.write(attempt.connection)
        return "done"

    assert await rabbit.adapter.deliver(await rabbit.next(), long) == "ack"
    assert shop.count() == 1


async def test_a_handler_whose_lease_is_stolen_never_completes(
    app: tuple[App, list[str]], broker: Broker, clock: FrozenClock
) -> None:
    shop, _ = app
    rabbit = await broker.consumer(shop, clock, renew_every=0.01)
    await broker.publish("order-1", b"{}")
    effects: list[str] = []
    started = asyncio.Event()

    async def overrun(attempt: AsyncAttempt, message: Any) -> str:
        started.set()
        await asyncio.Event().wait()  # cancelled once a renewal meets lease-b
        effects.append("never")
        return "too late"

    handling = asyncio.create_task(rabbit.adapter.deliver(await rabbit.next(), overrun))
    await started.wait()
    # The sweeper ends the claim (whatever the renewals did), another consumer takes it.
    clock.advance(POLICY.stale_seconds + 1)
    (marked,) = await async_sweep_away(shop.store, clock() + 1)
    intent = Intent(marked.principal, marked.key, marked.fingerprint, marked.endpoint)
    assert (await shop.store.claim(intent, "lease-b", clock(), clock() + 60)).owned

    assert await handling == "requeue_with_delay"

    record = await shop.store.get(broker.queue, "order-1")
    assert record is not None
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "lease-b")
    assert effects == []

    async def charge(attempt: AsyncAttempt, message: Any) -> None:
        effects.append("ran")

    back = await rabbit.next()  # redelivered after its delay: lease-b's to settle
    assert await rabbit.adapter.deliver(back, charge) == "requeue_with_delay"
    assert effects == []


#: The child: a consumer whose ack never comes (it reports, then waits to be killed).
CHILD = """
import asyncio, sys
import aio_pika
from idemflow import AsyncIdempotency
from idemflow.consumers import AsyncConsumer
from idemflow.consumers.rabbitmq import RabbitMQ
from tests.consumers.test_rabbitmq import RABBITMQ_URL, open_app
from tests.factories import POLICY
kind, where, table, queue, stall = sys.argv[1:]

async def stalled(*args):
    print("killable", flush=True)
    await asyncio.Event().wait()

async def main():
    app = open_app(kind, where, table)
    connection = await aio_pika.connect(RABBITMQ_URL)
    consumer = AsyncConsumer(AsyncIdempotency(app.store, POLICY), queue)
    adapter = RabbitMQ(consumer, await connection.channel(), queue, transaction=app.transaction)
    aio_pika.IncomingMessage.ack = stalled

    async def charge(attempt, message):
        await app.write(attempt.connection)
        if stall == "before the commit":
            await stalled()
        return "charged"

    await adapter.consume(charge)
    await asyncio.Event().wait()  # killed meanwhile

asyncio.run(main())
"""


@pytest.mark.parametrize("stall", ["before the commit", "before the ack"])
async def test_a_consumer_killed_after_its_business_write_has_one_effect_after_redelivery(
    app: tuple[App, list[str]], broker: Broker, stall: str
) -> None:
    """Killed before the commit: nothing committed, the claim left to the sweeper, then run
    once. Killed between the commit and the ack: settled, acked with the stored result."""
    shop, where = app
    await broker.publish("order-1", b"{}")
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        textwrap.dedent(CHILD),
        *where,
        broker.queue,
        stall,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 30)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        _, errors = await child.communicate()
    assert line == b"killable\n", errors.decode()

    async def again(attempt: AsyncAttempt, message: Any) -> None:
        await shop.write(attempt.connection)

    rabbit = await broker.consumer(shop)
    redelivered = await rabbit.next()  # the killed consumer never acked it
    record = await shop.store.get(broker.queue, "order-1")
    assert record is not None
    if stall == "before the ack":
        assert (record.state, shop.count()) == (State.COMPLETED, 1)
        assert await rabbit.adapter.deliver(redelivered, again) == "ack_with_stored_result"
    else:
        assert (record.state, shop.count()) == (State.IN_PROGRESS, 0)  # rolled back
        # Still claimed: never run twice, never waited for.
        assert await rabbit.adapter.deliver(redelivered, again) == "requeue_with_delay"
        # The sweeper's pass, its threshold past: the dead consumer's claim released.
        assert len(await async_sweep_away(shop.store, time.time() + 1)) == 1
        assert await rabbit.adapter.deliver(await rabbit.next(), again) == "ack"
    assert shop.count() == 1
    assert await broker.left(broker.queue) == 0


async def test_a_message_without_its_key_header_is_dead_lettered(
    app: tuple[App, list[str]], broker: Broker
) -> None:
    shop, _ = app
    rabbit = await broker.consumer(shop)
    channel = await broker.connection.channel()
    await channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=broker.queue)

    async def charge(attempt: AsyncAttempt, message: Any) -> None:
        await shop.write(attempt.connection)

    assert await rabbit.adapter.deliver(await rabbit.next(), charge) == "dead_letter"
    assert shop.count() == 0
    assert await broker.left(rabbit.adapter.dead_letter) == 1


async def test_an_unknown_outcome_keeps_the_claim_and_comes_back_after_the_sweep(
    app: tuple[App, list[str]], broker: Broker
) -> None:
    """Not acked as done, not run again: the claim stays for the sweeper and reconciler,
    and the message waits in the delay queue past the sweeper's pass."""
    shop, _ = app
    rabbit = await broker.consumer(shop)
    await broker.publish("order-1", b"{}")

    async def unknown(attempt: AsyncAttempt, message: Any) -> None:
        raise OutcomeUnknown("the provider timed out after the request was sent")

    assert await rabbit.adapter.deliver(await rabbit.next(), unknown) == "keep_claimed"

    record = await shop.store.get(broker.queue, "order-1")
    assert record is not None
    assert record.state is State.IN_PROGRESS
    waiting = {n: await broker.left(f"{broker.queue}.delay.{1 << n}s") for n in range(8)}
    assert waiting == {n: int(n == 5) for n in range(8)}  # 32 s: the sweep's 22 s, rounded up
    assert await broker.left(broker.queue) == 0
