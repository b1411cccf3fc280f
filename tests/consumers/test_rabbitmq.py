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
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from idemflow import AsyncAttempt, AsyncIdempotency, OutcomeUnknown, State
from idemflow.consumers import AsyncConsumer
from idemflow.testing import FrozenClock
from tests.conftest import unreachable
from tests.consumers._support import (
    App,
    Flaky,
    Overrun,
    Race,
    outlive_the_lease,
    run_until_killable,
    steal_the_claim,
)
from tests.factories import POLICY, until
from tests.sweeping import async_sweep_away

aio_pika = pytest.importorskip("aio_pika")
from idemflow.consumers.rabbitmq import RabbitMQ  # noqa: E402

pytestmark = [pytest.mark.rabbitmq, pytest.mark.anyio]

RABBITMQ_URL = os.environ.get("IDEMFLOW_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")


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
    shop: App, broker: Broker
) -> None:
    first, second = await broker.consumer(shop), await broker.consumer(shop)
    await broker.publish("order-1", b'{"amount": 5}')
    await broker.publish("order-1", b'{"amount": 5}')
    one, two = await first.next(), await second.next()  # each holds a copy, unacked
    race = Race(shop)

    holding = asyncio.create_task(first.adapter.deliver(one, race.held))
    await race.running.wait()
    met = await second.adapter.deliver(two, race.other)
    requeued = time.monotonic()
    race.raced.set()

    assert (met, await holding) == ("requeue_with_delay", "ack")  # never waited for it
    back = await second.next()  # the copy, back from the delay queue
    assert time.monotonic() - requeued >= 0.9  # its TTL: POLICY.retry_after, 1 s
    assert await second.adapter.deliver(back, race.other) == "ack_with_stored_result"
    assert (race.effects, shop.count()) == (["order-1"], 1)
    assert await broker.left(broker.queue) == 0


async def test_a_poisoned_message_is_dead_lettered_without_an_effect(
    shop: App, broker: Broker
) -> None:
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


async def test_a_transient_failure_is_redelivered_and_run_once(shop: App, broker: Broker) -> None:
    rabbit = await broker.consumer(shop)
    await broker.publish("order-1", b"{}")
    flaky = Flaky(shop)
    await rabbit.adapter.consume(flaky)  # as a service consumes: each message in a task
    await until(lambda: shop.count() == 1, "the redelivery's effect", blocking=True)
    await asyncio.sleep(0.2)  # time for a second run, were there one

    assert (flaky.calls, shop.count()) == ([1, 2], 1)
    assert await broker.left(broker.queue) == 0
    assert await broker.left(f"{broker.queue}.delay.1s") == 0


async def test_a_handler_longer_than_its_lease_keeps_its_claim(
    shop: App, broker: Broker, clock: FrozenClock
) -> None:
    rabbit = await broker.consumer(shop, clock, renew_every=0.01)
    await broker.publish("order-1", b"{}")

    async def long(attempt: AsyncAttempt, message: Any) -> str:
        await outlive_the_lease(shop.store, broker.queue, clock)
        await shop.write(attempt.connection)
        return "done"

    assert await rabbit.adapter.deliver(await rabbit.next(), long) == "ack"
    assert shop.count() == 1


async def test_a_handler_whose_lease_is_stolen_never_completes(
    shop: App, broker: Broker, clock: FrozenClock
) -> None:
    rabbit = await broker.consumer(shop, clock, renew_every=0.01)
    await broker.publish("order-1", b"{}")
    overrun = Overrun()
    handling = asyncio.create_task(rabbit.adapter.deliver(await rabbit.next(), overrun))
    await overrun.started.wait()
    await steal_the_claim(shop.store, clock)

    assert await handling == "requeue_with_delay"

    record = await shop.store.get(broker.queue, "order-1")
    assert record is not None
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "lease-b")
    assert overrun.effects == []

    async def charge(attempt: AsyncAttempt, message: Any) -> None:
        overrun.effects.append("ran")

    back = await rabbit.next()  # redelivered after its delay: lease-b's to settle
    assert await rabbit.adapter.deliver(back, charge) == "requeue_with_delay"
    assert overrun.effects == []


#: The child: a consumer whose ack never comes (it reports, then waits to be killed).
CHILD = """
import asyncio, sys
import aio_pika
from idemflow import AsyncIdempotency
from idemflow.consumers import AsyncConsumer
from idemflow.consumers.rabbitmq import RabbitMQ
from tests.consumers._support import charging, open_app, stalled
from tests.consumers.test_rabbitmq import RABBITMQ_URL
from tests.factories import POLICY
kind, where, table, queue, stall = sys.argv[1:]

async def main():
    app = open_app(kind, where, table)
    connection = await aio_pika.connect(RABBITMQ_URL)
    consumer = AsyncConsumer(AsyncIdempotency(app.store, POLICY), queue)
    adapter = RabbitMQ(consumer, await connection.channel(), queue, transaction=app.transaction)
    aio_pika.IncomingMessage.ack = stalled
    await adapter.consume(charging(app, stall))
    await asyncio.Event().wait()  # killed meanwhile

asyncio.run(main())
"""


@pytest.mark.parametrize("stall", ["before the commit", "before the ack"])
async def test_a_consumer_killed_after_its_business_write_has_one_effect_after_redelivery(
    shop: App, broker: Broker, stall: str
) -> None:
    """Killed before the commit: nothing committed, the claim left to the sweeper, then run
    once. Killed between the commit and the ack: settled, acked with the stored result."""
    await broker.publish("order-1", b"{}")
    await run_until_killable(CHILD, *shop.argv, broker.queue, stall)

    rabbit = await broker.consumer(shop)
    redelivered = await rabbit.next()  # the killed consumer never acked it
    record = await shop.store.get(broker.queue, "order-1")
    assert record is not None
    if stall == "before the ack":
        assert (record.state, shop.count()) == (State.COMPLETED, 1)
        assert await rabbit.adapter.deliver(redelivered, shop.charge) == "ack_with_stored_result"
    else:
        assert (record.state, shop.count()) == (State.IN_PROGRESS, 0)  # rolled back
        # Still claimed: never run twice, never waited for.
        assert await rabbit.adapter.deliver(redelivered, shop.charge) == "requeue_with_delay"
        # The sweeper's pass, its threshold past: the dead consumer's claim released.
        assert len(await async_sweep_away(shop.store, time.time() + POLICY.stale_seconds + 1)) == 1
        assert await rabbit.adapter.deliver(await rabbit.next(), shop.charge) == "ack"
    assert shop.count() == 1
    assert await broker.left(broker.queue) == 0


async def test_a_message_without_its_key_header_is_dead_lettered(shop: App, broker: Broker) -> None:
    rabbit = await broker.consumer(shop)
    channel = await broker.connection.channel()
    await channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=broker.queue)

    assert await rabbit.adapter.deliver(await rabbit.next(), shop.charge) == "dead_letter"
    assert shop.count() == 0
    assert await broker.left(rabbit.adapter.dead_letter) == 1


async def test_an_unknown_outcome_keeps_the_claim_and_comes_back_after_the_sweep(
    shop: App, broker: Broker
) -> None:
    """Not acked as done, not run again: the claim stays for the sweeper and reconciler,
    and the message waits in the delay queue past the sweeper's pass."""
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
