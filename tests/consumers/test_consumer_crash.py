"""
A consumer SIGKILLed mid-handler with no transaction to roll its effect back (a Redis or
SQLite store beside an external ledger): the claim stays, so the redelivery is requeued and
never runs; the sweeper asks the reconciler, and the message settles with what the ledger
says: the stored result if the effect happened, one run if it did not.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from idemflow import AsyncIdempotency, Response
from idemflow.consumers import AsyncConsumer
from idemflow.consumers._decision import Action
from idemflow.sweeper import AsyncSweeper, DidNotHappen, Happened
from idemflow.testing import FrozenClock
from tests.backends import REDIS_URL, delete_keys, redis_client
from tests.consumers._support import run_until_killable
from tests.factories import POLICY

pytestmark = pytest.mark.anyio

#: The consumer in a child: its effect appended to the ledger (or not), then SIGKILLed.
CHILD = """
    import asyncio, sys
    from idemflow import AsyncIdempotency
    from idemflow.consumers import AsyncConsumer
    from tests.consumers.test_consumer_crash import open_store, POLICY

    kind, where, table, ledger, effect = sys.argv[1:]

    async def handler(attempt):
        if effect == "charged":
            with open(ledger, "a") as book:
                book.write(attempt.record.key + "\\n")
        print("killable", flush=True)
        await asyncio.Event().wait()

    async def main():
        consumer = AsyncConsumer(AsyncIdempotency(open_store(kind, where, table), POLICY), "orders")
        await consumer.handle("order-1", b"{}", handler)

    asyncio.run(main())
"""


def open_store(kind: str, where: str, table: str) -> Any:
    """The store both processes open: the caller's clock, so the test can move past the
    stale threshold."""
    if kind == "redis":
        import redis.asyncio

        from idemflow.stores.redis import AsyncRedisStore

        client = redis.asyncio.Redis.from_url(where)
        return AsyncRedisStore(client, prefix=table, clock="caller", allow_volatile=True)
    from idemflow.stores.sqlite import AsyncSQLiteStore

    return AsyncSQLiteStore(where, table=table)


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis), "sqlite"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.parametrize("effect", ["charged", "not charged"])
async def test_a_consumer_killed_without_a_transaction_converges_without_a_second_run(
    kind: str, effect: str, tmp_path: Path, table_name: str
) -> None:
    where = REDIS_URL if kind == "redis" else str(tmp_path / "keys.db")
    ledger = tmp_path / "ledger"
    ledger.touch()
    store = open_store(kind, where, table_name)
    await store.migrate()
    try:
        await run_until_killable(CHILD, kind, where, table_name, str(ledger), effect)
        clock = FrozenClock(start=time.time())
        consumer = AsyncConsumer(AsyncIdempotency(store, POLICY, clock=clock), "orders")
        runs: list[str] = []

        async def handler(attempt: Any) -> Any:
            runs.append(attempt.record.key)
            with ledger.open("a") as book:
                book.write(attempt.record.key + "\n")
            return {"charged": attempt.record.key}

        redelivered = await consumer.handle("order-1", b"{}", handler)
        assert redelivered.action is Action.REQUEUE_WITH_DELAY  # claimed still: never run

        async def reconcile(record: Any, downstream: Any) -> Any:
            if record.key in ledger.read_text().split():
                return Happened(Response.json(200, {"charged": record.key}))
            return DidNotHappen("the ledger holds no charge under the key")

        clock.advance(POLICY.stale_seconds + 1)
        sweeper = AsyncSweeper(store, POLICY, reconciler=reconcile, clock=clock)
        report = await sweeper.sweep_once()
        charged = effect == "charged"
        assert (report.completed, report.released) == (int(charged), int(not charged))

        settled = await consumer.handle("order-1", b"{}", handler)
        if charged:
            assert (settled.action, runs) == (Action.ACK_WITH_STORED_RESULT, [])
        else:
            assert (settled.action, runs) == (Action.ACK, ["order-1"])
        assert ledger.read_text().split() == ["order-1"]  # one effect either way
    finally:
        await store.close()
        if kind == "redis":
            delete_keys(redis_client(REDIS_URL), table_name)
