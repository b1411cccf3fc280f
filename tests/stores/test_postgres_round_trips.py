"""
PostgreSQL, transactional two-commit mode: protection adds no round trip and no checkout.

A protected request's fenced writes travel with the COMMIT that ends their
phase, in one round trip (a pipeline: checkpoint, ``COMMIT``, ``BEGIN`` for
``commit_phase``; completion, ``COMMIT``), and its claim runs on the
connection its transaction then uses when both come from the store's pool.
So the same work protected and unprotected sends as many messages and takes
one connection from the pool. The fence still holds: a write that matches no
row raises on the server, so its COMMIT never runs (a lost lease commits
nothing of its phase), and a cancellation while the round trip is in flight
commits nothing either, and leaves the key claimed (the request cannot know).

Round trips are counted on the wire (libpq's trace of the pool's connections:
each flight ending in ``Sync`` or a simple ``Query``), checkouts by the
pool's own statistics.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    Attempt,
    Idempotency,
    InProgress,
    LeaseLost,
    Policy,
    Response,
    State,
)
from idemflow.edge import async_pooled_transaction, pooled_transaction
from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore, connection_options
from idemflow.testing import FrozenClock
from idemflow.transactions import AsyncPsycopgTransaction, PsycopgTransaction
from tests.conftest import POSTGRES_URL
from tests.factories import CREATED, psycopg_or_skip
from tests.factories import uncorrelated_intent as intent
from tests.faults import business_rows
from tests.sweeping import async_sweep_away, sweep_away

pytestmark = pytest.mark.postgres

POLICY = Policy(request_timeout=5)
#: BEGIN, INSERT, COMMIT, BEGIN, UPDATE, COMMIT: two phases, unprotected.
UNPROTECTED_TRIPS = 6
_FLIGHT = re.compile(r"(^|\t)F\t\d+\t(Sync|Query)\b")


class WireTrace:
    """libpq's protocol trace of every pooled connection, read back as round trips."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._file = path.open("w")
        self._seen = 0

    def attach(self, conn: Any) -> None:
        conn.pgconn.trace(self._file.fileno())

    async def attach_async(self, conn: Any) -> None:
        self.attach(conn)

    def take(self) -> int:
        """Round trips since the last call."""
        self._file.flush()
        lines = self._path.read_text().splitlines()
        flights = sum(1 for line in lines[self._seen :] if _FLIGHT.search(line))
        self._seen = len(lines)
        return flights


@contextlib.contextmanager
def tables(table: str) -> Iterator[None]:
    psycopg = psycopg_or_skip()
    PostgresStore(POSTGRES_URL, table=table, max_size=1).migrate()
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE biz_{table} (id BIGSERIAL PRIMARY KEY, note TEXT)")
        try:
            yield
        finally:
            conn.execute(f"DROP TABLE IF EXISTS {table}, biz_{table}")


def pool_kwargs(size: int = 1) -> dict[str, Any]:
    """The store's own settings, so the counts are those of a store-made pool."""
    return {"min_size": 1, "max_size": size, "kwargs": connection_options(50), "timeout": 5.0}


def insert(table: str) -> str:
    return f"INSERT INTO biz_{table} (note) VALUES (%s)"


def update(table: str) -> str:
    return f"UPDATE biz_{table} SET note = note || '+' WHERE note = %s"


def unprotected(conn: Any, table: str, note: str) -> None:
    """The same two phases with no idempotency: the baseline's round trips."""
    for statement in ("BEGIN", insert(table), "COMMIT", "BEGIN", update(table), "COMMIT"):
        conn.execute(statement, (note,) if "%s" in statement else None)


def requests(pool: Any) -> int:
    """Checkouts since the last call (``requests_num`` of ``pop_stats``)."""
    return int(pool.pop_stats().get("requests_num", 0))


@pytest.mark.parametrize("taken_from", ["pool", "store"])
def test_a_protected_request_sends_the_round_trips_of_the_same_work_unprotected(
    table_name: str, tmp_path: Path, taken_from: str
) -> None:
    """Sync: 6 round trips and one checkout either way, on a pool of one shared connection,
    whether the request's transaction takes it from the pool or through the store's
    checkout (``store.connection``): either is lent to the claim."""
    import psycopg_pool

    trace = WireTrace(tmp_path / "libpq.trace")

    def charge(attempt: Attempt) -> Response:
        attempt.connection.execute(insert(table_name), ("paid",))
        attempt.commit_phase("payment_created")
        attempt.connection.execute(update(table_name), ("paid",))
        return CREATED

    with (
        tables(table_name),
        psycopg_pool.ConnectionPool(POSTGRES_URL, **pool_kwargs(), configure=trace.attach) as pool,
    ):
        store = PostgresStore(pool, table=table_name)
        idem = Idempotency(store, POLICY)
        requests(pool), trace.take()
        with pool.connection() as conn:
            unprotected(conn, table_name, "plain")
        plain = (trace.take(), requests(pool))
        acquire = pool.connection if taken_from == "pool" else store.connection
        with pooled_transaction(acquire, PsycopgTransaction) as transaction:
            outcome = idem.run(intent(), charge, transaction=transaction)
        protected = (trace.take(), requests(pool))
        record = store.get("alice", "k-1")
        rows = business_rows(table_name)

    assert outcome.response == CREATED
    assert record is not None
    assert (record.state, record.recovery_point) == (State.COMPLETED, "payment_created")
    assert rows == ["plain+", "paid+"]
    assert plain == (UNPROTECTED_TRIPS, 1)
    assert protected == plain


@pytest.mark.anyio
@pytest.mark.parametrize("taken_from", ["pool", "store"])
async def test_an_async_protected_request_sends_the_round_trips_of_the_same_work_unprotected(
    table_name: str, tmp_path: Path, taken_from: str
) -> None:
    """Async: the same counts through AsyncPostgresStore and the async pooled transaction."""
    import psycopg_pool

    trace = WireTrace(tmp_path / "libpq.trace")

    async def charge(attempt: AsyncAttempt) -> Response:
        await attempt.connection.execute(insert(table_name), ("paid",))
        await attempt.commit_phase("payment_created")
        await attempt.connection.execute(update(table_name), ("paid",))
        return CREATED

    with tables(table_name):
        async with psycopg_pool.AsyncConnectionPool(
            POSTGRES_URL, **pool_kwargs(), configure=trace.attach_async, open=False
        ) as pool:
            store = AsyncPostgresStore(pool, table=table_name)
            idem = AsyncIdempotency(store, POLICY)
            requests(pool), trace.take()
            acquire = pool.connection if taken_from == "pool" else store.connection
            async with async_pooled_transaction(acquire, AsyncPsycopgTransaction) as tx:
                outcome = await idem.run(intent(), charge, transaction=tx)
            protected = (trace.take(), requests(pool))
        rows = business_rows(table_name)

    assert outcome.response == CREATED
    assert rows == ["paid+"]
    assert protected == (UNPROTECTED_TRIPS, 1)


def test_a_transaction_on_another_pool_is_not_lent_to_the_claim(
    table_name: str, tmp_path: Path
) -> None:
    """The claim takes a connection of the request's transaction only from the store's own
    pool: the application's pool here is another one, so the claim runs on the store's and
    the application's connection is taken when the transaction begins, as before."""
    import psycopg_pool

    with (
        tables(table_name),
        psycopg_pool.ConnectionPool(POSTGRES_URL, **pool_kwargs()) as keys,
        psycopg_pool.ConnectionPool(POSTGRES_URL, **pool_kwargs()) as app,
    ):
        idem = Idempotency(PostgresStore(keys, table=table_name), POLICY)
        requests(keys), requests(app)
        with pooled_transaction(app.connection, PsycopgTransaction) as transaction:
            outcome = idem.run(intent(), lambda attempt: CREATED, transaction=transaction)
        checkouts = (requests(keys), requests(app))

    assert outcome.response == CREATED
    assert checkouts == (1, 1)


def test_a_lost_lease_at_commit_phase_commits_nothing_of_that_phase(table_name: str) -> None:
    """Two commits: the claim is swept and taken over during the second phase. Its
    ``commit_phase`` travels with its COMMIT, so the fence raising on the server is all that
    stops that COMMIT: the handler gets LeaseLost, the second phase's row rolls back, the
    first phase's stays, and the new owner's record is untouched."""
    clock = FrozenClock()
    raised: list[LeaseLost] = []

    def charge(attempt: Attempt) -> Response:
        attempt.connection.execute(insert(table_name), ("phase 1",))
        attempt.commit_phase("payment_created")
        clock.advance(POLICY.stale_seconds + 1)
        assert len(sweep_away(store, clock())) == 1
        assert store.claim(intent(), "thief", clock(), clock() + 3600).owned
        attempt.connection.execute(insert(table_name), ("phase 2",))
        with pytest.raises(LeaseLost) as lost:
            attempt.commit_phase("charged")
        raised.append(lost.value)
        raise lost.value

    with tables(table_name):
        store = PostgresStore(POSTGRES_URL, table=table_name, max_size=2, clock="caller")
        try:
            idem = Idempotency(store, POLICY, clock=clock)
            with (
                pooled_transaction(store.pool.connection, PsycopgTransaction) as transaction,
                pytest.raises(LeaseLost),
            ):
                idem.run(intent(), charge, transaction=transaction)
            record = store.get("alice", "k-1")
        finally:
            store.close()
        rows = business_rows(table_name)

    assert len(raised) == 1
    assert record is not None
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "thief")
    assert record.recovery_point == "payment_created"
    assert rows == ["phase 1"]


#: Writes the attempt's business row: (attempt, note).
Execute = Callable[[AsyncAttempt, str], Awaitable[Any]]
#: The handler, given how to write its row.
Charge = Callable[[AsyncAttempt, Execute], Awaitable[Response]]


@contextlib.asynccontextmanager
async def cancellable(
    adapter: str, table: str, clock: FrozenClock
) -> AsyncIterator[tuple[AsyncPostgresStore, Callable[[Charge], Coroutine[Any, Any, Any]], str]]:
    """(store, run(charge), the checkpoint's statement as a LIKE pattern) of ``adapter``."""
    if adapter == "psycopg":
        # Lock waits bounded at 10 s, not 50 ms: the checkpoint waits for the cancel.
        store = AsyncPostgresStore(
            POSTGRES_URL, table=table, max_size=2, claim_lock_timeout_ms=10_000, clock="caller"
        )

        async def psycopg_execute(attempt: AsyncAttempt, note: str) -> Any:
            return await attempt.connection.execute(insert(table), (note,))

        async def psycopg_run(charge: Charge) -> Any:
            idem = AsyncIdempotency(store, POLICY, clock=clock)
            async with async_pooled_transaction(
                store.pool.connection, AsyncPsycopgTransaction
            ) as tx:
                return await idem.run(
                    intent(), lambda attempt: charge(attempt, psycopg_execute), transaction=tx
                )

        try:
            yield store, psycopg_run, "%WITH fenced AS%"
        finally:
            await store.close()
        return
    import sqlalchemy
    from sqlalchemy.ext.asyncio import AsyncSession

    from idemflow.transactions import AsyncSQLAlchemyTransaction

    engine = async_engine()
    store = AsyncPostgresStore(POSTGRES_URL, table=table, max_size=1, clock="caller")

    async def sqlalchemy_run(charge: Charge) -> Any:
        async with AsyncSession(engine) as session:

            async def execute(attempt: AsyncAttempt, note: str) -> Any:
                return await session.execute(
                    sqlalchemy.text(insert(table).replace("%s", ":note")), {"note": note}
                )

            idem = AsyncIdempotency(store, POLICY, clock=clock)
            return await idem.run(
                intent(),
                lambda attempt: charge(attempt, execute),
                transaction=AsyncSQLAlchemyTransaction(session),
            )

    try:
        # The checkpoint, inside its fence.
        yield store, sqlalchemy_run, f"%UPDATE {table} %"
    finally:
        await store.close()
        await engine.dispose()


@pytest.mark.anyio
@pytest.mark.parametrize("adapter", ["psycopg", "sqlalchemy"])
async def test_cancelled_while_commit_phase_is_in_flight_stays_claimed_and_commits_nothing(
    table_name: str, adapter: str
) -> None:
    """The task is cancelled while ``commit_phase``'s round trip (checkpoint, ``COMMIT``,
    ``BEGIN``) waits on the server (another session holds the key's row lock), through
    ``AsyncPsycopgTransaction`` and through ``AsyncSQLAlchemyTransaction`` (checkpoint and
    COMMIT, on the psycopg connection under SQLAlchemy's). psycopg cancels the statement
    there, so neither the phase's row nor its recovery point commits; but the request
    cannot know that its COMMIT did not run: the key stays claimed (a retry gets 409,
    nothing runs twice) until the sweeper releases it, and the retry then starts over
    from the beginning."""
    import psycopg

    clock = FrozenClock()
    inserted, locked = asyncio.Event(), asyncio.Event()
    attempts: list[str | None] = []

    async def charge(attempt: AsyncAttempt, execute: Execute) -> Response:
        attempts.append(attempt.recovery_point)
        await execute(attempt, f"try {len(attempts)}")
        if len(attempts) == 1:
            inserted.set()
            await locked.wait()
        await attempt.commit_phase("payment_created")
        return CREATED

    with tables(table_name):
        async with cancellable(adapter, table_name, clock) as (store, run, checkpoint):
            async with (
                await psycopg.AsyncConnection.connect(POSTGRES_URL) as locker,
                await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as watcher,
            ):
                task = asyncio.create_task(run(charge))
                await inserted.wait()
                await locker.execute(f"SELECT 1 FROM {table_name} FOR UPDATE")
                locked.set()
                await waiting_on_a_lock(watcher, checkpoint)
                task.cancel()
                # Once the server cancelled it, free the row: a release would go through.
                await waiting_on_a_lock(watcher, checkpoint, waiting=False)
                await locker.rollback()
                with pytest.raises(asyncio.CancelledError):
                    await task
            left = await store.get("alice", "k-1")
            with pytest.raises(InProgress):
                await run(charge)
            clock.advance(POLICY.stale_seconds + 1)
            assert len(await async_sweep_away(store, clock())) == 1
            retry = await run(charge)
        rows = business_rows(table_name)

    assert left is not None
    assert (left.state, left.recovery_point) == (State.IN_PROGRESS, None)
    assert retry.response == CREATED
    assert attempts == [None, None]  # the retry did not resume past a phase
    assert rows == ["try 2"]


async def waiting_on_a_lock(
    watcher: Any, query: str, *, waiting: bool = True, deadline: float = 10.0
) -> None:
    """Poll (autocommit: a fresh snapshot each time) until a session waits on a lock in a
    statement like ``query`` (or, ``waiting=False``, until none does)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + deadline
    while loop.time() < until:
        cursor = await watcher.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE %s",
            (query,),
        )
        row = await cursor.fetchone()
        if bool(row and row[0]) is waiting:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"a wait on a lock in {query} never {'began' if waiting else 'ended'}")


# --- the framework adapters: Django's and SQLAlchemy's transactions, on psycopg 3 ------------
#
# Their fenced writes travel with their COMMIT too (on the psycopg connection under the
# framework's); the next BEGIN after ``commit_phase`` is the framework's own, sent with the
# next statement (sent with the COMMIT, the framework's own COMMIT would end it). So the
# same two phases cost the claim and nothing more: unprotected + 1 (was + 3: each fenced
# write, then its COMMIT).

#: What protection adds through a framework's transaction: the claim.
FRAMEWORK_ADDED_TRIPS = 1


def two_phases(execute: Any, commit_phase: Any, table: str) -> Response:
    execute(insert(table), "paid")
    commit_phase("payment_created")
    execute(update(table), "paid")
    return CREATED


@pytest.mark.parametrize("binding", ["client", "server"])
def test_django_sends_each_fenced_write_with_its_commit(
    table_name: str, tmp_path: Path, binding: str
) -> None:
    """``DjangoTransaction`` on PostgreSQL: the claim is the one round trip protection adds,
    on the thread's own connection (the store claims there in autocommit). With values
    bound on the client (Django's default) the fenced write and its COMMIT are one simple
    query; with ``OPTIONS["server_side_binding"]`` (compared in docs/frameworks/django.md)
    one prepared pipeline: the same round trips either way."""
    django_setup = pytest.importorskip("tests.integrations.django_setup")
    from django.db import connections, transaction

    from idemflow.integrations.django import DjangoTransaction
    from idemflow.stores.django import DjangoStore

    alias = django_setup.VENDOR_ALIAS["postgres"]
    django_setup.require(alias)
    trace = WireTrace(tmp_path / "libpq.trace")

    def run(sql: str, note: str) -> None:
        with connections[alias].cursor() as cursor:
            cursor.execute(sql, [note])

    def charge(attempt: Attempt) -> Response:
        return two_phases(run, attempt.commit_phase, table_name)

    with tables(table_name), django_setup.own_connection(alias) as conn:
        store = DjangoStore(alias, table=table_name)
        idem = Idempotency(store, POLICY)
        conn.ensure_connection()
        if binding == "server":
            # What Django sets on the connection for OPTIONS["server_side_binding"] = True.
            from django.db.backends.postgresql.base import ServerBindingCursor

            conn.connection.cursor_factory = ServerBindingCursor
        trace.attach(conn.connection)
        trace.take()
        with transaction.atomic(using=alias):
            run(insert(table_name), "plain")
        with transaction.atomic(using=alias):
            run(update(table_name), "plain")
        plain = trace.take()
        outcome = idem.run(intent(), charge, transaction=DjangoTransaction(alias))
        protected = trace.take()
        record = store.get("alice", "k-1")
        store.close()
        rows = business_rows(table_name)

    assert outcome.response == CREATED
    assert record is not None
    assert (record.state, record.recovery_point) == (State.COMPLETED, "payment_created")
    assert rows == ["plain+", "paid+"]
    assert plain == UNPROTECTED_TRIPS
    assert protected == plain + FRAMEWORK_ADDED_TRIPS


@pytest.mark.parametrize("session", [False, True], ids=["connection", "session"])
def test_sqlalchemy_sends_each_fenced_write_with_its_commit(
    table_name: str, tmp_path: Path, session: bool
) -> None:
    """``SQLAlchemyTransaction`` on ``postgresql+psycopg``, a ``Connection`` or a ``Session``
    (Flask-SQLAlchemy's), the claim on the store's own pool: the claim is the one round trip
    protection adds."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    import psycopg_pool
    from sqlalchemy.orm import Session

    from idemflow.transactions import SQLAlchemyTransaction

    trace = WireTrace(tmp_path / "libpq.trace")

    with tables(table_name):
        engine = sqlalchemy.create_engine(
            POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1), pool_size=1
        )
        sqlalchemy.event.listen(engine, "connect", lambda dbapi, _record: trace.attach(dbapi))
        pool = psycopg_pool.ConnectionPool(
            POSTGRES_URL, **pool_kwargs(), configure=trace.attach, open=True
        )
        store = PostgresStore(pool, table=table_name)
        try:
            idem = Idempotency(store, POLICY)
            pool.wait()
            with contextlib.ExitStack() as stack:
                holder = stack.enter_context(Session(engine) if session else engine.connect())

                def run(sql: str, note: str) -> None:
                    holder.execute(sqlalchemy.text(sql.replace("%s", ":note")), {"note": note})

                def commit_phase(_point: str) -> None:
                    holder.commit()

                holder.execute(sqlalchemy.text("SELECT 1"))  # connected: its setup not counted
                holder.rollback()
                trace.take()
                two_phases(run, commit_phase, table_name)
                holder.commit()
                plain = trace.take()
                outcome = idem.run(
                    intent(),
                    lambda attempt: two_phases(run, attempt.commit_phase, table_name),
                    transaction=SQLAlchemyTransaction(holder),
                )
                protected = trace.take()
            record = store.get("alice", "k-1")
        finally:
            pool.close()
            engine.dispose()
        rows = business_rows(table_name)

    assert outcome.response == CREATED
    assert record is not None
    assert (record.state, record.recovery_point) == (State.COMPLETED, "payment_created")
    assert rows == ["paid+", "paid+"]
    assert plain == UNPROTECTED_TRIPS
    assert protected == plain + FRAMEWORK_ADDED_TRIPS


@contextlib.contextmanager
def framework(name: str, table: str) -> Iterator[tuple[Any, Any, Any]]:
    """(store, a new transaction, execute(sql, note) in it) for ``name``, clock="caller"."""
    if name == "django":
        django_setup = pytest.importorskip("tests.integrations.django_setup")
        from django.db import connections

        from idemflow.integrations.django import DjangoTransaction
        from idemflow.stores.django import DjangoStore

        alias = django_setup.VENDOR_ALIAS["postgres"]
        django_setup.require(alias)

        def run(sql: str, note: str) -> None:
            with connections[alias].cursor() as cursor:
                cursor.execute(sql, [note])

        with django_setup.own_connection(alias):
            keys = DjangoStore(alias, table=table, clock="caller")
            try:
                yield keys, lambda: DjangoTransaction(alias), run
            finally:
                keys.close()
        return
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    from idemflow.transactions import SQLAlchemyTransaction

    engine = sqlalchemy.create_engine(
        POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1), pool_size=1
    )
    store = PostgresStore(POSTGRES_URL, table=table, max_size=2, clock="caller")
    try:
        with Session(engine) as session:

            def run_in_session(sql: str, note: str) -> None:
                session.execute(sqlalchemy.text(sql.replace("%s", ":note")), {"note": note})

            yield store, lambda: SQLAlchemyTransaction(session), run_in_session
    finally:
        store.close()
        engine.dispose()


FRAMEWORKS = ["django", "sqlalchemy"]


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_lost_lease_commits_nothing_of_its_phase_through_a_framework(
    table_name: str, name: str
) -> None:
    """The lost-lease test above, through Django's and SQLAlchemy's adapters: their
    ``commit_phase`` travels with its COMMIT too, and only the fence stops it."""
    clock = FrozenClock()

    with tables(table_name), framework(name, table_name) as (store, transaction, run):

        def charge(attempt: Attempt) -> Response:
            run(insert(table_name), "phase 1")
            attempt.commit_phase("payment_created")
            clock.advance(POLICY.stale_seconds + 1)
            assert len(sweep_away(store, clock())) == 1
            assert store.claim(intent(), "thief", clock(), clock() + 3600).owned
            run(insert(table_name), "phase 2")
            attempt.commit_phase("charged")
            return CREATED

        idem = Idempotency(store, POLICY, clock=clock)
        with pytest.raises(LeaseLost):
            idem.run(intent(), charge, transaction=transaction())
        record = store.get("alice", "k-1")
        rows = business_rows(table_name)

    assert record is not None
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "thief")
    assert record.recovery_point == "payment_created"
    assert rows == ["phase 1"]


def orphaned(run: Any, orphan: str) -> Response:
    run(orphan, "orphan")
    return CREATED


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_a_commit_that_fails_through_a_framework_raises_its_own_error_and_releases(
    table_name: str, name: str
) -> None:
    """The completion went through and its COMMIT failed (a deferred constraint, checked at
    COMMIT): nothing of the request commits, the key is released, and the error is the
    framework's own, as its ``commit()`` raises it (Django's, SQLAlchemy's IntegrityError)."""
    import psycopg

    with (
        tables(table_name),
        psycopg.connect(POSTGRES_URL, autocommit=True) as admin,
        framework(name, table_name) as (store, transaction, run),
    ):
        admin.execute(
            f"CREATE TABLE parent_{table_name} (id INTEGER PRIMARY KEY); "
            f"ALTER TABLE biz_{table_name} ADD COLUMN parent INTEGER REFERENCES "
            f"parent_{table_name} (id) DEFERRABLE INITIALLY DEFERRED"
        )
        orphan = f"INSERT INTO biz_{table_name} (note, parent) VALUES (%s, 42)"
        idem = Idempotency(store, POLICY, clock=FrozenClock())
        try:
            with pytest.raises(Exception, match=r"(?i)foreign key") as raised:
                idem.run(intent(), lambda a: orphaned(run, orphan), transaction=transaction())
            record = store.get("alice", "k-1")
            rows = business_rows(table_name)
        finally:
            admin.execute(f"DROP TABLE IF EXISTS parent_{table_name} CASCADE")

    assert type(raised.value).__module__.split(".")[0] == name
    assert type(raised.value).__name__ == "IntegrityError"
    assert record is not None
    assert record.state is State.RELEASED
    assert rows == []


def async_engine() -> Any:
    sqlalchemy_asyncio = pytest.importorskip("sqlalchemy.ext.asyncio")
    url = POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1)
    return sqlalchemy_asyncio.create_async_engine(url, pool_size=1)


@pytest.mark.anyio
async def test_async_sqlalchemy_sends_each_fenced_write_with_its_commit(
    table_name: str, tmp_path: Path
) -> None:
    """``AsyncSQLAlchemyTransaction`` on an ``AsyncSession`` (``postgresql+psycopg``): the
    claim is the one round trip protection adds, as with the sync adapter."""
    import psycopg_pool
    import sqlalchemy
    from sqlalchemy.ext.asyncio import AsyncSession

    from idemflow.transactions import AsyncSQLAlchemyTransaction

    trace = WireTrace(tmp_path / "libpq.trace")
    engine = async_engine()
    sqlalchemy.event.listen(
        engine.sync_engine, "connect", lambda dbapi, _record: trace.attach(dbapi.driver_connection)
    )
    with tables(table_name):
        async with psycopg_pool.AsyncConnectionPool(
            POSTGRES_URL, **pool_kwargs(), configure=trace.attach_async, open=False
        ) as pool:
            store = AsyncPostgresStore(pool, table=table_name)
            idem = AsyncIdempotency(store, POLICY)
            async with AsyncSession(engine) as session:

                async def run(sql: str, note: str) -> None:
                    await session.execute(
                        sqlalchemy.text(sql.replace("%s", ":note")), {"note": note}
                    )

                async def charge(attempt: AsyncAttempt) -> Response:
                    await run(insert(table_name), "paid")
                    await attempt.commit_phase("payment_created")
                    await run(update(table_name), "paid")
                    return CREATED

                await session.execute(sqlalchemy.text("SELECT 1"))  # connected: not counted
                await session.rollback()
                trace.take()
                await run(insert(table_name), "plain")
                await session.commit()
                await run(update(table_name), "plain")
                await session.commit()
                plain = trace.take()
                outcome = await idem.run(
                    intent(), charge, transaction=AsyncSQLAlchemyTransaction(session)
                )
                protected = trace.take()
        await engine.dispose()
        rows = business_rows(table_name)

    assert outcome.response == CREATED
    assert rows == ["plain+", "paid+"]
    assert plain == UNPROTECTED_TRIPS
    assert protected == plain + FRAMEWORK_ADDED_TRIPS
