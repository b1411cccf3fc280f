"""
The NATS JetStream adapter against the real server on loopback (each test its own
stream and durable consumer, deleted after), on PostgreSQL and SQLite stores (the consumer
tests' shared app): duplicates delivered to two consumers at once make one
effect, a poisoned message is dead-lettered, a transient failure is redelivered (a
delayed ``nak``) and run once, a handler past ack wait and its lease keeps both, a
stolen lease never completes, and a consumer SIGKILLed after its business write (before
its commit, or between it and its ack) makes one effect after the redelivery.
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

from idemflow import AsyncAttempt, AsyncIdempotency, State
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
from tests.factories import POLICY
from tests.sweeping import async_sweep_away

nats = pytest.importorskip("nats")
from nats.js.api import ConsumerConfig  # noqa: E402

from idemflow.consumers.nats import JetStream  # noqa: E402

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

NATS_URL = os.environ.get("IDEMFLOW_TEST_NATS_URL", "nats://127.0.0.1:4222")


@dataclass
class Broker:
    nc: Any
    js: Any
    stream: str
    subject: str

    @property
    def scope(self) -> str:
        return f"{self.stream}/workers"

    async def consumer(self, app: App, clock: Any = None, **options: Any) -> JetStream:
        idempotency = AsyncIdempotency(app.store, POLICY, **({"clock": clock} if clock else {}))
        consumer = AsyncConsumer(idempotency, self.scope, **options)
        return JetStream(
            consumer, self.js, self.stream, "workers", transaction=app.transaction, ack_wait=2
        )

    async def publish(self, key: str, body: bytes) -> None:
        await self.js.publish(self.subject, body, headers={"Idempotency-Key": key})

    async def next(self, durable: str = "workers", within: float = 10) -> Any:
        sub = await self.js.pull_subscribe_bind(durable, self.stream)
        try:
            (message,) = await sub.fetch(1, timeout=within)
        finally:
            await sub.unsubscribe()
        return message

    async def pending(self, durable: str = "workers") -> int:
        info = await self.js.consumer_info(self.stream, durable)
        return int(info.num_pending + info.num_ack_pending)


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    try:
        nc = await nats.connect(NATS_URL, connect_timeout=3, max_reconnect_attempts=0)
    except Exception as exc:  # any failure to connect means no server
        unreachable("NATS", exc)
    js = nc.jetstream()
    name = f"idemflow-test-{uuid.uuid4().hex[:10]}"
    subject = f"{name}.orders"
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    await js.add_consumer(
        name, ConsumerConfig(durable_name="workers", filter_subject=subject, ack_wait=2)
    )
    yield Broker(nc, js, name, subject)
    await js.delete_stream(name)
    await nc.close()


async def test_a_message_published_twice_and_delivered_to_two_consumers_has_one_effect(
    shop: App, broker: Broker
) -> None:
    first, second = await broker.consumer(shop), await broker.consumer(shop)
    await broker.publish("order-1", b'{"amount": 5}')
    await broker.publish("order-1", b'{"amount": 5}')
    one, two = await broker.next(), await broker.next()  # two copies, both unacked
    race = Race(shop)

    holding = asyncio.create_task(first.deliver(one, race.held))
    await race.running.wait()
    met = await second.deliver(two, race.other)
    race.raced.set()

    assert (met, await holding) == ("requeue_with_delay", "ack")  # never waited for it
    back = await broker.next()  # the nak'd copy, redelivered after its delay
    assert back.metadata.num_delivered == 2
    assert await second.deliver(back, race.other) == "ack_with_stored_result"
    assert (race.effects, shop.count()) == (["order-1"], 1)
    assert await broker.pending() == 0


async def test_a_poisoned_message_is_dead_lettered_without_an_effect(
    shop: App, broker: Broker
) -> None:
    jet = await broker.consumer(shop)
    await broker.publish("order-1", b'{"amount": 5}')
    await broker.publish("order-1", b'{"amount": 500}')
    effects: list[bytes] = []

    async def charge(attempt: AsyncAttempt, message: Any) -> None:
        await shop.write(attempt.connection)
        effects.append(message.data)

    actions = [await jet.deliver(await broker.next(), charge) for _ in range(2)]

    assert actions == ["ack", "dead_letter"]
    assert (effects, shop.count()) == ([b'{"amount": 5}'], 1)
    dead = await broker.js.get_last_msg(broker.stream, f"{broker.subject}.dead")
    assert dead.data == b'{"amount": 500}'
    assert dead.headers["Idempotency-Key"] == "order-1"
    assert "different request" in dead.headers["Idemflow-Problem"]
    assert await broker.pending() == 0


async def test_a_transient_failure_is_redelivered_and_run_once(shop: App, broker: Broker) -> None:
    jet = await broker.consumer(shop)
    await broker.publish("order-1", b"{}")
    flaky = Flaky(shop)
    assert await jet.fetch(flaky) == 1
    assert shop.count() == 0
    assert await jet.fetch(flaky, timeout=10) == 1  # back after the nak's delay
    assert (flaky.calls, shop.count()) == ([1, 2], 1)
    assert await broker.pending() == 0


async def test_a_handler_longer_than_ack_wait_and_its_lease_keeps_both(
    shop: App, broker: Broker, clock: FrozenClock
) -> None:
    jet = await broker.consumer(shop, clock, renew_every=0.01)
    await broker.publish("order-1", b"{}")

    async def long(attempt: AsyncAttempt, message: Any) -> str:
        await outlive_the_lease(shop.store, broker.scope, clock)
        await asyncio.sleep(3)  # past the broker's ack wait (2 s): in_progress() keeps it
        with pytest.raises(TimeoutError):  # not redelivered to anyone meanwhile
            await broker.next(within=0.5)
        await shop.write(attempt.connection)
        return "done"

    message = await broker.next()
    assert await jet.deliver(message, long) == "ack"
    assert message.metadata.num_delivered == 1
    assert shop.count() == 1
    assert await broker.pending() == 0  # never redelivered while it ran


async def test_a_handler_whose_lease_is_stolen_never_completes(
    shop: App, broker: Broker, clock: FrozenClock
) -> None:
    jet = await broker.consumer(shop, clock, renew_every=0.01)
    await broker.publish("order-1", b"{}")
    overrun = Overrun()
    handling = asyncio.create_task(jet.deliver(await broker.next(), overrun))
    await overrun.started.wait()
    await steal_the_claim(shop.store, clock)

    assert await handling == "requeue_with_delay"
    record = await shop.store.get(broker.scope, "order-1")
    assert record is not None
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "lease-b")
    assert overrun.effects == []
    assert shop.count() == 0


#: The child: a consumer whose ack never comes (it reports, then waits to be killed).
CHILD = """
import asyncio, sys
import nats
from nats.aio.msg import Msg
from idemflow import AsyncIdempotency
from idemflow.consumers import AsyncConsumer
from idemflow.consumers.nats import JetStream
from tests.consumers._support import charging, open_app, stalled
from tests.consumers.test_nats import NATS_URL
from tests.factories import POLICY
kind, where, table, stream, stall = sys.argv[1:]

async def main():
    app = open_app(kind, where, table)
    nc = await nats.connect(NATS_URL)
    consumer = AsyncConsumer(AsyncIdempotency(app.store, POLICY), f"{stream}/workers")
    adapter = JetStream(consumer, nc.jetstream(), stream, "workers", transaction=app.transaction)
    Msg.ack_sync = stalled
    while True:
        await adapter.fetch(charging(app, stall))  # killed meanwhile

asyncio.run(main())
"""


@pytest.mark.parametrize("stall", ["before the commit", "before the ack"])
async def test_a_consumer_killed_after_its_business_write_has_one_effect_after_redelivery(
    shop: App, broker: Broker, stall: str
) -> None:
    """Killed before the commit: nothing committed, the claim left to the sweeper, then run
    once. Killed between the commit and the ack: settled, acked with the stored result."""
    await broker.publish("order-1", b"{}")
    await run_until_killable(CHILD, *shop.argv, broker.stream, stall)

    jet = await broker.consumer(shop)
    redelivered = await broker.next()  # never acked: back after the ack wait (2 s)
    assert redelivered.metadata.num_delivered == 2
    record = await shop.store.get(broker.scope, "order-1")
    assert record is not None
    if stall == "before the ack":
        assert (record.state, shop.count()) == (State.COMPLETED, 1)
        assert await jet.deliver(redelivered, shop.charge) == "ack_with_stored_result"
    else:
        assert (record.state, shop.count()) == (State.IN_PROGRESS, 0)  # rolled back
        assert await jet.deliver(redelivered, shop.charge) == "requeue_with_delay"
        assert len(await async_sweep_away(shop.store, time.time() + POLICY.stale_seconds + 1)) == 1
        assert await jet.deliver(await broker.next(), shop.charge) == "ack"
    assert shop.count() == 1
    assert await broker.pending() == 0
