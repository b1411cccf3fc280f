"""The consumer entry point under pressure, on every store and mode: one pooled connection
shared by the store and the app (Redis: one connection; SQLite: the file's one writer),
50 messages each delivered to two consumers at once, every first run a transient failure."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from pathlib import Path
from typing import Any

import pytest

from idemflow import AsyncAttempt, AsyncIdempotency, Attempt, Idempotency, Response
from idemflow.consumers import AsyncConsumer, Consumer
from idemflow.consumers._decision import Action, Decision
from tests.backends import DRIVERS, Rig, open_rig, rigs
from tests.factories import POLICY

MESSAGES = 50
DELIVERIES = 2  # of each message, at once
SETTLED = {Action.ACK, Action.ACK_WITH_STORED_RESULT}
#: How long a message is redelivered before the test fails (never hangs): 100 deliveries
#: through SQLite's one writer queue for the file's lock.
PATIENCE = 60.0
REDELIVERED = {Action.REQUEUE_WITH_DELAY, Action.RELEASE_AND_REQUEUE}


class Handler:
    """Each message's first run answers a transient 503 (it wrote nothing, and is given
    back); its second writes the business row, in the app's transaction where there is one."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.runs: collections.Counter[str] = collections.Counter()

    def first_run(self, key: str) -> bool:
        self.runs[key] += 1
        return self.runs[key] == 1

    async def __call__(self, attempt: AsyncAttempt) -> Any:
        key = attempt.record.key
        if self.first_run(key):
            return Response.json(503, {"error": "provider down"})
        if self.rig.transactional:
            await self.rig.write(attempt.connection, key)
        else:
            assert self.rig.charge is not None
            await self.rig.charge(key)
        return {"charged": key}

    def sync(self, attempt: Attempt) -> Any:
        key = attempt.record.key
        if self.first_run(key):
            return Response.json(503, {"error": "provider down"})
        self.rig.write(attempt.connection, key)
        return {"charged": key}


async def deliveries_async(rig: Rig, keys: list[str]) -> list[list[Decision]]:
    consumer = AsyncConsumer(AsyncIdempotency(rig.store, POLICY), "orders")
    handler = Handler(rig)

    async def once(key: str) -> Decision:
        payload = key.encode()
        if rig.transaction is None:
            return await consumer.handle(key, payload, handler)
        async with rig.transaction() as transaction:
            return await consumer.handle(key, payload, handler, transaction=transaction)

    async def redelivered(key: str) -> list[Decision]:
        seen: list[Decision] = []
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            seen.append(await once(key))
            if seen[-1].action in SETTLED:
                break
            await asyncio.sleep(0.02)  # the decision's delay, shortened for the test
        return seen

    return list(await asyncio.gather(*(redelivered(k) for k in keys for _ in range(DELIVERIES))))


def deliveries_sync(rig: Rig, keys: list[str]) -> list[list[Decision]]:
    consumer = Consumer(Idempotency(rig.store, POLICY), "orders")
    handler = Handler(rig)
    transaction_of = rig.transaction
    assert transaction_of is not None

    def redelivered(key: str) -> list[Decision]:
        seen: list[Decision] = []
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            with transaction_of() as transaction:
                seen.append(
                    consumer.handle(key, key.encode(), handler.sync, transaction=transaction)
                )
            if seen[-1].action in SETTLED:
                break
            time.sleep(0.02)  # the decision's delay, shortened for the test
        return seen

    racing = [key for key in keys for _ in range(DELIVERIES)]
    with concurrent.futures.ThreadPoolExecutor(len(racing)) as pool:
        return list(pool.map(redelivered, racing))


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("rig_id", "mode"),
    [
        pytest.param(rig_id, mode, marks=kind.marks, id=f"{rig_id}-{mode}")
        for mode, drivers in (("transaction", DRIVERS), ("no-transaction", ("async",)))
        for kind, rig_id in rigs(mode, drivers)
    ],
)
async def test_a_pool_of_one_releases_transients_at_once_and_runs_each_message_once(
    rig_id: str, mode: str, tmp_path: Path, table_name: str
) -> None:
    """A delivery holds at most one connection at a time, so nothing waits on itself:
    every transient is given back at once (the redelivery runs the handler), a duplicate
    in flight is requeued with a delay, never dead-lettered or kept claimed, and every
    message ends with one business row and one ``ack`` that ran it."""
    keys = [f"order-{n}" for n in range(MESSAGES)]
    async with open_rig(
        rig_id, table_name, tmp_path, transactional=mode == "transaction", busy_timeout=15.0
    ) as rig:
        if rig.sync:
            answers = await asyncio.to_thread(deliveries_sync, rig, keys)
        else:
            answers = await deliveries_async(rig, keys)
        notes = await asyncio.to_thread(rig.notes)

    decisions = [decision for seen in answers for decision in seen]
    unexpected = [d for d in decisions if d.action not in SETTLED | REDELIVERED]
    assert not unexpected, [(d.action, repr(d.problem)) for d in unexpected[:5]]
    unsettled = [seen for seen in answers if seen[-1].action not in SETTLED]
    assert not unsettled, [(d.action, repr(d.problem)) for d in unsettled[0][-3:]]
    ran = collections.Counter(d.action for d in decisions)
    assert ran[Action.ACK] == MESSAGES  # one run acked per message, its duplicate replayed
    assert ran[Action.ACK_WITH_STORED_RESULT] == MESSAGES * (DELIVERIES - 1)
    assert ran[Action.RELEASE_AND_REQUEUE] == MESSAGES  # every first run given back
    assert sorted(notes) == sorted(keys)  # one business row per message
