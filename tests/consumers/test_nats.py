"""
The NATS JetStream adapter against the real server on loopback (each test its own
stream and durable consumer, deleted after), on PostgreSQL and SQLite stores (the app
fixture of the RabbitMQ tests): duplicates delivered to two consumers at once make one
effect, a poisoned message is dead-lettered, a transient failure is redelivered (a
delayed ``nak``) and run once, a handler past ack wait and its lease keeps both, a
stolen lease never completes, and a consumer SIGKILLed after its business write (before
its commit, or between it and its ack) makes one effect after the redelivery.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from idemflow import AsyncAttempt, AsyncIdempotency, Intent, State
from idemflow.consumers import AsyncConsumer
from idemflow.testing import FrozenClock
from tests.conftest import unreachable
from tests.factories import POLICY
from tests.sweeping import async_sweep_away

nats = pytest.importorskip("nats")
pytest.importorskip("aio_pika")  # the shared app fixture lives with the RabbitMQ tests
from nats.js.api import ConsumerConfig  # noqa: E402

from idemflow.consumers.nats import JetStream  # noqa: E402
from tests.consumers import test_rabbitmq  # noqa: E402
from tests.consumers.test_rabbitmq import App  # noqa: E402

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

app = test_rabbitmq.app  # the fixture, shared

ROOT = Path(__file__).resolve().parents[2]
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
    app: tuple[App, list[str]], broker: Broker
) -> None:
    shop, _ = app
    first, second = await broker.consumer(shop), await broker.consumer(shop)
    await broker.publish("order-1", b'{"amount": 5}')
    await broker.publish("order-1", b'{"amount": 5}')
    one, two = await broker.next(), await broker.next()  # two copies, both unacked
    effects: list[str] = []
    running, raced = asyncio.Event(), asyncio.Event()

    async def held(attempt: AsyncAttempt, message: Any) -> str:
        running.set()
        await asyncio.wait_for(raced.wait(), 10)
        await shop.write(attempt.connection)
        effects.append(attempt.record.key)
        return "charged"

    async def other(attempt: AsyncAttempt, message: Any) -> str:
        await shop.write(attempt.connection)
        effects.append(attempt.record.key)
        return "charged again"

    holding = asyncio.create_task(first.deliver(one, held))
    await running.wait()
    met = await second.deliver(two, other)
    raced.set()

    assert (met, await holding) == ("requeue_with_delay", "ack")  # never waited for it
    back = await broker.next()  # the nak'd copy, redelivered after its delay
    assert back.metadata.num_delivered == 2
    assert await second.deliver(back, other) == "ack_with_stored_result"
    assert (effects, shop.count()) == (["order-1"], 1)
    assert await broker.pending() == 0


async def test_a_poisoned_message_is_dead_lettered_without_an_effect(
    app: tuple[App, list[str]], broker: Broker
) -> None:
    shop, _ = app
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


async def test_a_transient_failure_is_redelivered_and_run_once(
    app: tuple[App, list[str]], broker: Broker
) -> None:
    shop, _ = app
    jet = await broker.consumer(shop)
    await broker.publish("order-1", b"{}")
    calls: list[int] = []

    async def flaky(attempt: AsyncAttempt, message: Any) -> str:
        calls.append(attempt.record.attempt)
        await shop.write(attempt.connection)
        if len(calls) == 1:
            raise ConnectionError("the provider is down")  # the write rolls back
        return "charged"

    assert await jet.fetch(flaky) == 1
    assert shop.count() == 0
    assert await jet.fetch(flaky, timeout=10) == 1  # back after the nak's delay
    assert (calls, shop.count()) == ([1, 2], 1)
    assert await broker.pending() == 0


async def test_a_handler_longer_than_ack_wait_and_its_lease_keeps_both(
    app: tuple[App, list[str]], broker: Broker, clock: FrozenClock
) -> None:
    shop, _ = app
    jet = await broker.consumer(shop, clock, renew_every=0.01)
    await broker.publish("order-1", b"{}")

    async def renewed() -> bool:
        record = await shop.store.get(broker.scope, "order-1")
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
    app: tuple[App, list[str]], broker: Broker, clock: FrozenClock
) -> None:
    shop, _ = app
    jet = await broker.consumer(shop, clock, renew_every=0.01)
    await broker.publish("order-1", b"{}")
    effects: list[str] = []
    started = asyncio.Event()

    async def overrun(attempt: AsyncAttempt, message: Any) -> str:
        started.set()
        await asyncio.Event().wait()  # cancelled once a renewal meets lease-b
        effects.append("never")
        return "too late"

    handling = asyncio.create_task(jet.deliver(await broker.next(), overrun))
    await started.wait()
    clock.advance(POLICY.stale_seconds + 1)
    (marked,) = await async_sweep_away(shop.store, clock() + 1)
    intent = Intent(marked.principal, marked.key, marked.fingerprint, marked.endpoint)
    assert (await shop.store.claim(intent, "lease-b", clock(), clock() + 60)).owned

    assert await handling == "requeue_with_delay"
    record = await shop.store.get(broker.scope, "order-1")
    assert record is not None
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "lease-b")
    assert effects == []
    assert shop.count() == 0


#: The child: a consumer whose ack never comes (it reports, then waits to be killed).
CHILD = """
import asyncio, sys
import nats
from nats.aio.msg import Msg
from idemflow import AsyncIdempotency
from idemflow.consumers import AsyncConsumer
from idemflow.consumers.nats import JetStream
from tests.consumers.test_nats import NATS_URL
from tests.consumers.test_rabbitmq import open_app
from tests.factories import POLICY
kind, where, table, stream, stall = sys.argv[1:]

async def stalled(*args, **kwargs):
    print("killable", flush=True)
    await asyncio.Event().wait()

async def main():
    app = open_app(kind, where, table)
    nc = await nats.connect(NATS_URL)
    consumer = AsyncConsumer(AsyncIdempotency(app.store, POLICY), f"{stream}/workers")
    adapter = JetStream(consumer, nc.jetstream(), stream, "workers", transaction=app.transaction)
    Msg.ack_sync = stalled

    async def charge(attempt, message):
        await app.write(attempt.connection)
        if stall == "before the commit":
            await stalled()
        return "charged"

    while True:
        await adapter.fetch(charge)  # killed meanwhile

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
        broker.stream,
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

    jet = await broker.consumer(shop)
    redelivered = await broker.next()  # never acked: back after the ack wait (2 s)
    assert redelivered.metadata.num_delivered == 2
    record = await shop.store.get(broker.scope, "order-1")
    assert record is not None
    if stall == "before the ack":
        assert (record.state, shop.count()) == (State.COMPLETED, 1)
        assert await jet.deliver(redelivered, again) == "ack_with_stored_result"
    else:
        assert (record.state, shop.count()) == (State.IN_PROGRESS, 0)  # rolled back
        assert await jet.deliver(redelivered, again) == "requeue_with_delay"
        assert len(await async_sweep_away(shop.store, time.time() + 1)) == 1
        assert await jet.deliver(await broker.next(), again) == "ack"
    assert shop.count() == 1
    assert await broker.pending() == 0
