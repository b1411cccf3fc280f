"""
The sweeper's resolutions under real faults on PostgreSQL and MariaDB: a server session
ended (``pg_terminate_backend``, ``KILL``) just before a resolution's transaction begins,
and a transaction that cannot begin at all (nothing listens where it connects).

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
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from idemflow import Policy, Record, State
from idemflow.edge import async_pooled_transaction, pooled_transaction
from idemflow.sweeper import AsyncStop, AsyncSweeper, Happened, Sweeper
from idemflow.testing import FrozenClock
from tests.backends import MYSQL_URL, mysql_admin
from tests.conftest import POSTGRES_URL, unreachable
from tests.factories import CREATED, free_port, intent
from tests.faults import named_url, terminate

pytestmark = pytest.mark.anyio

POLICY = Policy(request_timeout=5)
KEYS = ("k-1", "k-2", "k-3")
#: Each store the sweeper resolves in a transaction, marked with the server it needs.
STORES = [
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
]


@dataclass
class Crashed:
    """A store on a pool of one connection (the caller's clock) with three crashed claims."""

    store: Any
    #: Ends the server sessions of the store's pool (a real connection loss): how many.
    end_sessions: Callable[[], int]
    #: A resolution's transaction, on a connection of the store's own pool.
    transaction: Callable[[], Any]
    #: A resolution's transaction that connects where nothing listens: (its factory,
    #: the error connecting raises), each connection attempt appended to the list.
    nowhere: Callable[[list[int]], tuple[Callable[[], Any], type[BaseException]]]


@contextlib.contextmanager
def _postgres(table: str, sync: bool) -> Iterator[tuple[Any, Callable[[], int]]]:
    """(store, end its sessions) on PostgreSQL, its pool not opened yet; drops its table."""
    psycopg = pytest.importorskip("psycopg")
    from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore

    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    name = f"sweep_{uuid.uuid4().hex[:8]}"
    kind = PostgresStore if sync else AsyncPostgresStore
    store = kind(named_url(name), table=table, max_size=1, clock="caller")
    try:
        yield store, lambda: terminate(name)
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f"DROP TABLE IF EXISTS {table}")


@contextlib.contextmanager
def _mysql(table: str, sync: bool) -> Iterator[tuple[Any, Callable[[], int]]]:
    """(store, KILL its connections) on MariaDB (each connection's id kept); drops its table."""
    pymysql = pytest.importorskip("pymysql")
    from idemflow.stores.mysql import AsyncMySQLStore, MySQLStore, connect_kwargs

    kwargs = connect_kwargs(MYSQL_URL)
    admin = mysql_admin(kwargs)
    opened: list[int] = []  # the store's connections (their ids), so a fault can end them

    def kill() -> int:
        ended = 0
        with admin.cursor() as cursor:
            for thread_id in opened:
                with contextlib.suppress(pymysql.err.OperationalError):  # already gone
                    cursor.execute(f"KILL {thread_id}")
                    ended += 1
        opened.clear()
        return ended

    store: Any
    if sync:

        def connect() -> Any:
            conn = pymysql.connect(**kwargs, autocommit=True)
            opened.append(conn.thread_id())
            return conn

        store = MySQLStore(connect, table=table, max_size=1, clock="caller")
    else:
        asyncmy = pytest.importorskip("asyncmy")

        async def aconnect() -> Any:
            conn = await asyncmy.connect(**kwargs, autocommit=True)
            async with conn.cursor() as cursor:
                await cursor.execute("SELECT CONNECTION_ID()")
                opened.append((await cursor.fetchone())[0])
            return conn

        store = AsyncMySQLStore(aconnect, table=table, max_size=1, clock="caller")
    try:
        yield store, kill
    finally:
        with contextlib.closing(admin), admin.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {table}")


@contextlib.asynccontextmanager
async def crashed_claims(kind: str, table: str, clock: FrozenClock) -> AsyncIterator[Crashed]:
    """The async store ``kind`` names, with three crashed claims past the threshold."""
    with (_postgres if kind == "postgres" else _mysql)(table, False) as (store, end):
        try:
            if kind == "postgres":
                await store.pool.open(wait=True)
            await store.migrate()
            for key in KEYS:
                await store.claim(
                    intent(key),
                    f"lease-{key}",
                    clock(),
                    clock() + 3600,
                    stale_after=POLICY.stale_seconds,
                )
            clock.advance(POLICY.stale_seconds + 1)
            yield Crashed(store, end, *_transactions(kind, store))
        finally:
            await store.close()


def _transactions(kind: str, store: Any) -> tuple[Callable[[], Any], Any]:
    """(on the store's pool, nowhere) for the async store ``kind`` names."""
    if kind == "postgres":
        import psycopg

        from idemflow.transactions import AsyncPsycopgTransaction

        def pg_nowhere(attempts: list[int]) -> tuple[Callable[[], Any], type[BaseException]]:
            dead = f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere"

            @contextlib.asynccontextmanager
            async def connect() -> AsyncIterator[Any]:
                attempts.append(1)
                conn = await psycopg.AsyncConnection.connect(
                    dead, connect_timeout=2, autocommit=True
                )
                try:
                    yield conn
                finally:
                    await conn.close()

            return (
                lambda: async_pooled_transaction(connect, AsyncPsycopgTransaction),
                psycopg.OperationalError,
            )

        return (
            lambda: async_pooled_transaction(store.pool.connection, AsyncPsycopgTransaction),
            pg_nowhere,
        )
    import asyncmy

    from idemflow.stores.mysql import connect_kwargs
    from idemflow.transactions import AsyncmyTransaction

    def my_nowhere(attempts: list[int]) -> tuple[Callable[[], Any], type[BaseException]]:
        dead = {**connect_kwargs(MYSQL_URL), "port": free_port(), "connect_timeout": 2}

        @contextlib.asynccontextmanager
        async def connect() -> AsyncIterator[Any]:
            attempts.append(1)
            conn = await asyncmy.connect(**dead, autocommit=True)
            try:
                yield conn
            finally:
                await conn.ensure_closed()

        return (
            lambda: async_pooled_transaction(connect, AsyncmyTransaction),
            asyncmy.errors.OperationalError,
        )

    return lambda: async_pooled_transaction(store.pool.connection, AsyncmyTransaction), my_nowhere


async def states(store: Any) -> dict[str, State]:
    found: dict[str, State] = {}
    for key in KEYS:
        record = await store.get("alice", key)
        assert record is not None
        found[key] = record.state
    return found


@pytest.mark.parametrize("kind", STORES)
async def test_a_session_lost_before_a_resolution_begins_does_not_end_the_pass(
    kind: str, table_name: str, clock: FrozenClock
) -> None:
    """The reconciler of the first record ends the pool's one session: the settling
    transaction that follows begins on a dead connection. It is retried on a fresh one, and
    every record of the batch is settled in this pass (on the old code the pass raised,
    leaving all three marked stale until ``retry_unknown_after``)."""
    async with crashed_claims(kind, table_name, clock) as crashed:
        killed: list[int] = []

        async def reconciler(record: Record, keys: Mapping[str, str]) -> Happened:
            if not killed:
                killed.append(crashed.end_sessions())  # the idle one the settle will take
            return Happened(CREATED)

        sweeper = AsyncSweeper(
            crashed.store,
            POLICY,
            reconciler=reconciler,
            transaction_factory=crashed.transaction,
            clock=clock,
        )
        report = await sweeper.sweep_once()
        after = await states(crashed.store)

    assert killed == [1]  # a real session was ended
    assert report.completed == len(KEYS), report
    assert after == dict.fromkeys(KEYS, State.COMPLETED)


@pytest.mark.parametrize("kind", STORES)
async def test_a_store_that_cannot_begin_ends_the_pass_after_one_retry(
    kind: str, table_name: str, clock: FrozenClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The resolutions' transactions connect where nothing listens: the pass ends with the
    error after two attempts for the first record (not one per record of the batch), the
    rest stay marked stale (asked again after ``retry_unknown_after``), and ``run_forever``
    logs the failed pass and goes on (on the old code: one attempt, no retry)."""
    attempts: list[int] = []
    async with crashed_claims(kind, table_name, clock) as crashed:
        nowhere, error = crashed.nowhere(attempts)
        sweeper = AsyncSweeper(
            crashed.store,
            POLICY,
            reconciler=lambda record, keys: _happened(),
            transaction_factory=nowhere,
            clock=clock,
        )
        with pytest.raises(error):
            await sweeper.sweep_once()
        assert len(attempts) == 2  # one retry on a fresh transaction, then the pass ended
        after = await states(crashed.store)

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


@pytest.mark.parametrize("kind", STORES)
def test_the_sync_sweeper_retries_a_lost_session_too(
    kind: str, table_name: str, clock: FrozenClock
) -> None:
    """The generated ``Sweeper``, on ``PostgresStore`` or ``MySQLStore`` and a sync pooled
    transaction: the same ended session, the same three settled records in one pass."""
    with (_postgres if kind == "postgres" else _mysql)(table_name, True) as (store, end):
        adapter: Any
        if kind == "postgres":
            from idemflow.transactions import PsycopgTransaction

            adapter = PsycopgTransaction
        else:
            from idemflow.transactions import PyMySQLTransaction

            adapter = PyMySQLTransaction
        killed: list[int] = []

        def reconciler(record: Record, keys: Mapping[str, str]) -> Happened:
            if not killed:
                killed.append(end())
            return Happened(CREATED)

        try:
            store.migrate()
            for key in KEYS:
                store.claim(
                    intent(key),
                    f"lease-{key}",
                    clock(),
                    clock() + 3600,
                    stale_after=POLICY.stale_seconds,
                )
            clock.advance(POLICY.stale_seconds + 1)
            sweeper = Sweeper(
                store,
                POLICY,
                reconciler=reconciler,
                transaction_factory=lambda: pooled_transaction(store.pool.connection, adapter),
                clock=clock,
            )
            report = sweeper.sweep_once()
            after = {key: getattr(store.get("alice", key), "state", None) for key in KEYS}
        finally:
            store.close()

    assert killed == [1]
    assert report.completed == len(KEYS), report
    assert after == dict.fromkeys(KEYS, State.COMPLETED)
