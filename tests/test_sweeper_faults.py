"""
The sweeper's resolutions under real faults on PostgreSQL: a server session terminated
(``pg_terminate_backend``) just before a resolution's transaction begins, and a
transaction that cannot begin at all (nothing listens where it connects).

A transaction that cannot begin says nothing about the record it was for: its pooled
connection is gone (the pool discards it) or the store is down. The first is tried again
on a fresh connection, so one lost session neither ends the pass nor leaves the rest of
the batch marked and unresolved; the second ends the pass with the error after that one
retry (``run_forever`` logs it and passes again), instead of failing every record of the
batch in turn.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from idemflow import Policy, Record, State
from idemflow.edge import async_pooled_transaction
from idemflow.sweeper import AsyncStop, AsyncSweeper, Happened
from idemflow.testing import FrozenClock
from tests.conftest import POSTGRES_URL, unreachable
from tests.factories import CREATED, free_port, intent
from tests.faults import shared_pool, terminate, transaction_on

pytestmark = [pytest.mark.postgres, pytest.mark.anyio]

POLICY = Policy(request_timeout=5)
KEYS = ("k-1", "k-2", "k-3")


@contextlib.asynccontextmanager
async def crashed_claims(
    table: str, application_name: str, clock: FrozenClock
) -> AsyncIterator[Any]:
    """A store (one pooled connection, on the caller's clock) with three crashed claims."""
    psycopg = pytest.importorskip("psycopg")
    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    async with shared_pool(
        table, size=1, application_name=application_name, clock="caller"
    ) as store:
        try:
            await store.migrate()
            for key in KEYS:
                await store.claim(intent(key), f"lease-{key}", clock(), clock() + 3600)
            clock.advance(POLICY.stale_seconds + 1)
            yield store
        finally:
            with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
                admin.execute(f"DROP TABLE IF EXISTS {table}")


async def states(store: Any) -> dict[str, State]:
    found: dict[str, State] = {}
    for key in KEYS:
        record = await store.get("alice", key)
        assert record is not None
        found[key] = record.state
    return found


async def test_a_session_lost_before_a_resolution_begins_does_not_end_the_pass(
    table_name: str, clock: FrozenClock
) -> None:
    """The reconciler of the first record terminates the pool's one session: the settling
    transaction that follows begins on a dead connection. It is retried on a fresh one, and
    every record of the batch is settled in this pass (on the old code the pass raised,
    leaving all three marked stale until ``retry_unknown_after``)."""
    name = f"sweep_begin_{uuid.uuid4().hex[:8]}"
    async with crashed_claims(table_name, name, clock) as store:
        killed: list[int] = []

        async def reconciler(record: Record, keys: Mapping[str, str]) -> Happened:
            if not killed:
                killed.append(terminate(name))  # the idle pooled session the settle will take
            return Happened(CREATED)

        sweeper = AsyncSweeper(
            store,
            POLICY,
            reconciler=reconciler,
            transaction_factory=lambda: transaction_on(store),
            clock=clock,
        )
        report = await sweeper.sweep_once()
        after = await states(store)

    assert killed == [1]  # a real session was ended
    assert report.completed == len(KEYS), report
    assert after == dict.fromkeys(KEYS, State.COMPLETED)


async def test_a_store_that_cannot_begin_ends_the_pass_after_one_retry(
    table_name: str, clock: FrozenClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The resolutions' transactions connect where nothing listens: the pass ends with the
    error after two attempts for the first record (not one per record of the batch), the
    rest stay marked stale (asked again after ``retry_unknown_after``), and ``run_forever``
    logs the failed pass and goes on (on the old code: one attempt, no retry)."""
    psycopg = pytest.importorskip("psycopg")
    from idemflow.transactions import AsyncPsycopgTransaction

    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere"
    attempts: list[int] = []

    @contextlib.asynccontextmanager
    async def nowhere() -> AsyncIterator[Any]:
        attempts.append(1)
        conn = await psycopg.AsyncConnection.connect(dead, connect_timeout=2, autocommit=True)
        try:
            yield conn
        finally:
            await conn.close()

    name = f"sweep_down_{uuid.uuid4().hex[:8]}"
    async with crashed_claims(table_name, name, clock) as store:
        sweeper = AsyncSweeper(
            store,
            POLICY,
            reconciler=lambda record, keys: _happened(),
            transaction_factory=lambda: async_pooled_transaction(nowhere, AsyncPsycopgTransaction),
            clock=clock,
        )
        with pytest.raises(psycopg.OperationalError):
            await sweeper.sweep_once()
        assert len(attempts) == 2  # one retry on a fresh transaction, then the pass ended
        after = await states(store)

        # The loop logs the failed pass and goes on (its stop ends it after one pass).
        stop = AsyncStop()
        passes: list[int] = []

        def stop_after_pass(record: Record, keys: Mapping[str, str]) -> Any:
            passes.append(1)
            stop.set()
            return _happened()

        attempts.clear()
        sweeper.reconciler = stop_after_pass
        clock.advance(POLICY.stale_seconds + 1)  # the stale records are due again
        with caplog.at_level(logging.ERROR, logger="idemflow.sweeper"):
            await sweeper.run_forever(every=0.01, stop=stop)

    assert after == dict.fromkeys(KEYS, State.STALE)  # marked, unresolved, nothing lost
    assert passes == [1]
    assert len(attempts) == 2  # the loop's pass, bounded the same way
    assert "sweep pass failed" in caplog.text


async def _happened() -> Happened:
    return Happened(CREATED)


def test_the_sync_sweeper_retries_a_lost_session_too(table_name: str, clock: FrozenClock) -> None:
    """The generated ``Sweeper``, on ``PostgresStore`` and a sync pooled transaction: the
    same terminated session, the same three settled records in one pass."""
    psycopg = pytest.importorskip("psycopg")
    from idemflow.edge import pooled_transaction
    from idemflow.stores.postgres import PostgresStore
    from idemflow.sweeper import Sweeper
    from idemflow.transactions import PsycopgTransaction
    from tests.faults import named_url

    name = f"sweep_sync_{uuid.uuid4().hex[:8]}"
    store = PostgresStore(named_url(name), table=table_name, max_size=1, clock="caller")
    killed: list[int] = []

    def reconciler(record: Record, keys: Mapping[str, str]) -> Happened:
        if not killed:
            killed.append(terminate(name))
        return Happened(CREATED)

    try:
        store.migrate()
        for key in KEYS:
            store.claim(intent(key), f"lease-{key}", clock(), clock() + 3600)
        clock.advance(POLICY.stale_seconds + 1)
        sweeper = Sweeper(
            store,
            POLICY,
            reconciler=reconciler,
            transaction_factory=lambda: pooled_transaction(
                store.pool.connection, PsycopgTransaction
            ),
            clock=clock,
        )
        report = sweeper.sweep_once()
        after = {key: getattr(store.get("alice", key), "state", None) for key in KEYS}
    finally:
        store.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f"DROP TABLE IF EXISTS {table_name}")

    assert killed == [1]
    assert report.completed == len(KEYS), report
    assert after == dict.fromkeys(KEYS, State.COMPLETED)
