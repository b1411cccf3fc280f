"""
The seams around the core, under pressure and faults (issue 9, library side).

Each test drives the real driver against a real database, with the fault made
real too: a pool of one or two connections shared by the store and the
application, a server connection terminated mid-request, a task cancelled
while its claim is in flight, a rollback on a connection that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    Attempt,
    Idempotency,
    InProgress,
    Policy,
    Response,
    State,
    StoreUnavailable,
)
from idemflow.stores.sqlite import AsyncSQLiteStore
from tests.backends import open_rig, rig_params
from tests.conftest import POSTGRES_URL, unreachable
from tests.factories import CREATED, psycopg_or_skip
from tests.factories import uncorrelated_intent as intent
from tests.faults import (
    SignallingStore,
    business_rows,
    shared_pool,
    terminate,
    transaction_on,
)

pytestmark = pytest.mark.anyio

POLICY = Policy(request_timeout=5)
UNAVAILABLE = Response(503, b"provider down")


class Boom(Exception):
    """The handler's own exception: it must come out of ``run`` unchanged."""


# --- PostgreSQL fixtures ------------------------------------------------------


@contextlib.contextmanager
def postgres_tables(table: str) -> Iterator[Any]:
    """The key table and a business table; dropped afterwards. Yields psycopg."""
    psycopg = psycopg_or_skip()
    from idemflow.stores.postgres import PostgresStore

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        store = PostgresStore(POSTGRES_URL, table=table, max_size=1)
        store.migrate()
        store.close()
        conn.execute(f"CREATE TABLE biz_{table} (id BIGSERIAL PRIMARY KEY, note TEXT)")
        try:
            yield psycopg
        finally:
            conn.execute(f"DROP TABLE IF EXISTS {table}, biz_{table}")


# --- defect 1: a pool shared by the store and the application ---------------------


@pytest.mark.slow
@pytest.mark.parametrize("single_commit", [False, True], ids=["two-commit", "single-commit"])
@pytest.mark.parametrize("pool_size", [1, 2])
# The rigs whose store has a pool the request's transaction takes its connection from, in
# both commit modes, each with the asyncio and the sync driver.
@pytest.mark.parametrize("kind", rig_params("transaction", pooled=True))
async def test_a_pool_shared_with_the_application_never_deadlocks_a_release(
    kind: str,
    pool_size: int,
    single_commit: bool,
    tmp_path: Path,
    table_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """50 keys at once, each retried sequentially against a dependency failing half the
    time, on a pool of 1–2 connections that store and handler share (the store's own pool
    lends the request's transaction its connection: psycopg's, or the MySQL stores' own):
    every key reaches 201 with one committed effect, no sequential retrier ever sees a
    409, nothing is left for the sweeper. (The release used to take a second connection
    while the request held one: with a small pool it timed out and poisoned the key.)"""
    rng = random.Random(f"{kind}-{pool_size}-{single_commit}")
    conflicts: list[str] = []
    attempts = 0
    async with contextlib.AsyncExitStack() as stack:
        stack.enter_context(caplog.at_level(logging.WARNING, "idemflow"))
        rig = await stack.enter_async_context(
            open_rig(kind, table_name, tmp_path, transactional=True, pool_size=pool_size)
        )
        begin = rig.transaction  # on a connection of the store's own pool
        assert begin is not None

        def dependency() -> Response:
            return UNAVAILABLE if rng.random() < 0.5 else CREATED

        def charge(attempt: Attempt) -> Response:
            rig.write(attempt.connection, f"{attempt.record.key}/{attempt.record.attempt}")
            return dependency()

        async def acharge(attempt: AsyncAttempt) -> Response:
            await rig.write(attempt.connection, f"{attempt.record.key}/{attempt.record.attempt}")
            return dependency()

        def attempt_once(key: str) -> Response:
            """One attempt with the sync driver (in a thread of its own)."""
            idem = Idempotency(rig.store, POLICY)
            with begin() as transaction:
                return idem.run(
                    intent(key), charge, transaction=transaction, single_commit=single_commit
                ).response

        async def aattempt_once(key: str) -> Response:
            async with begin() as transaction:
                ran = await AsyncIdempotency(rig.store, POLICY).run(
                    intent(key), acharge, transaction=transaction, single_commit=single_commit
                )
            return ran.response

        threads = stack.enter_context(ThreadPoolExecutor(50)) if rig.sync else None

        async def client(key: str) -> None:
            nonlocal attempts
            loop = asyncio.get_running_loop()
            for _ in range(60):
                attempts += 1
                try:
                    if threads is not None:
                        response = await loop.run_in_executor(threads, attempt_once, key)
                    else:
                        response = await aattempt_once(key)
                except InProgress:
                    conflicts.append(key)
                    continue
                if response.status == 201:
                    return
            pytest.fail(f"{key} never reached 201")

        await asyncio.gather(*(client(f"key-{n}") for n in range(50)))
        records = [await rig.call("get", "alice", f"key-{n}") for n in range(50)]
        rows = rig.notes()

    assert conflicts == []
    assert [r.state for r in records if r is not None] == [State.COMPLETED] * 50
    assert len(rows) == 50  # the 503 attempts rolled back with their release
    assert len({row.split("/")[0] for row in rows}) == 50
    assert attempts > 75  # the dependency really failed about half the time
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


# --- defect 2: a failed completion without a shared transaction ---------------------


@contextlib.contextmanager
def completions_end_their_connection(table: str) -> Iterator[None]:
    """A trigger on the key table: a completion's UPDATE ends its own server session
    (``pg_terminate_backend``) before it takes effect, a connection lost *during* the
    completion, whatever its checkout saw."""
    psycopg = psycopg_or_skip()
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(
            f"CREATE FUNCTION die_{table}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.state = 'completed' THEN PERFORM pg_terminate_backend(pg_backend_pid()); "
            "END IF; RETURN NEW; END $$"
        )
        conn.execute(
            f"CREATE TRIGGER die BEFORE UPDATE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION die_{table}()"
        )
        try:
            yield
        finally:
            conn.execute(f"DROP TRIGGER IF EXISTS die ON {table}")
            conn.execute(f"DROP FUNCTION die_{table}()")


async def charge_on_its_own(psycopg: Any, table: str) -> None:
    """The handler's effect, committed on a connection of its own (no shared transaction)."""
    async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as own:
        await own.execute(f"INSERT INTO biz_{table} (note) VALUES ('charged')")


@pytest.mark.postgres
async def test_a_lost_completion_without_a_transaction_keeps_the_claim(table_name: str) -> None:
    """The effect commits on its own (no shared transaction), then the store's connection
    dies during the completion. Releasing would run the effect again on the retry; the key
    stays claimed instead, the caller hears that the outcome went unrecorded, and a retry
    gets 409 until the sweeper resolves it. One effect, whatever the client does."""
    with postgres_tables(table_name) as psycopg:
        async with shared_pool(table_name, 1) as store:
            idem = AsyncIdempotency(store, POLICY)

            async def charge(attempt: AsyncAttempt) -> Response:
                await charge_on_its_own(psycopg, table_name)
                return CREATED

            with completions_end_their_connection(table_name):
                with pytest.raises(StoreUnavailable, match="could not be recorded"):
                    await idem.run(intent(), charge)
                with pytest.raises(InProgress):
                    await idem.run(intent(), charge)
            record = await store.get("alice", "k-1")

        assert record is not None
        assert record.state is State.IN_PROGRESS  # the sweeper's and its reconciler's now
        assert business_rows(table_name) == ["charged"]


@pytest.mark.postgres
async def test_a_connection_lost_before_the_completion_is_skipped_and_the_outcome_kept(
    table_name: str,
) -> None:
    """The store's one pooled connection is ended while the handler runs (after the
    effect committed on its own): the completion's checkout sees the server closed it and
    takes a new one, so the outcome is recorded and the retry replays it; one effect."""
    name = f"idemflow-seam-{uuid.uuid4().hex[:8]}"
    with postgres_tables(table_name) as psycopg:
        async with shared_pool(table_name, 1, name) as store:
            idem = AsyncIdempotency(store, POLICY)

            async def charge(attempt: AsyncAttempt) -> Response:
                await charge_on_its_own(psycopg, table_name)
                assert terminate(name) == 1  # the store's one pooled connection
                return CREATED

            first = await idem.run(intent(), charge)
            again = await idem.run(intent(), charge)

        assert (first.replayed, again.replayed) == (False, True)
        assert again.response.body == CREATED.body
        assert business_rows(table_name) == ["charged"]


# --- defect 3: single-commit mode after commit_phase --------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("failure", ["transient", "exception"])
async def test_single_commit_releases_what_commit_phase_committed(
    failure: str, table_name: str
) -> None:
    """Once a commit_phase committed the claim with the first phase, a 503 or an exception
    must give the key back with a write: the rollback no longer does. The retry resumes."""
    with postgres_tables(table_name):
        async with shared_pool(table_name, 1) as store:
            idem = AsyncIdempotency(store, POLICY)

            async def two_phases(attempt: AsyncAttempt) -> Response:
                if attempt.recovery_point is None:
                    await attempt.commit_phase("payment_created")
                    if failure == "exception":
                        raise Boom("provider exploded")
                    return UNAVAILABLE
                return CREATED

            async with transaction_on(store) as transaction:
                if failure == "exception":
                    with pytest.raises(Boom):
                        await idem.run(
                            intent(), two_phases, transaction=transaction, single_commit=True
                        )
                else:
                    first = await idem.run(
                        intent(), two_phases, transaction=transaction, single_commit=True
                    )
                    assert first.response.status == 503
            released = await store.get("alice", "k-1")
            async with transaction_on(store) as transaction:
                retry = await idem.run(
                    intent(), two_phases, transaction=transaction, single_commit=True
                )

    assert released is not None
    assert (released.state, released.recovery_point) == (State.RELEASED, "payment_created")
    assert retry.response.status == 201


@pytest.mark.mysql
def test_single_commit_releases_after_commit_phase_on_mysql(table_name: str) -> None:
    """The same on MariaDB, through the sync driver and the PyMySQL adapter."""
    pymysql = pytest.importorskip("pymysql")
    from idemflow.stores.mysql import MySQLStore, connect_kwargs
    from idemflow.transactions import PyMySQLTransaction
    from tests.backends import MYSQL_URL

    try:
        caller = pymysql.connect(**connect_kwargs(MYSQL_URL), autocommit=True)
    except pymysql.err.OperationalError as exc:
        unreachable("MariaDB", exc)
    store = MySQLStore(MYSQL_URL, table=table_name, max_size=1)
    try:
        store.migrate()
        idem = Idempotency(store, POLICY)

        def two_phases(attempt: Attempt) -> Response:
            if attempt.recovery_point is None:
                attempt.commit_phase("payment_created")
                return UNAVAILABLE
            return CREATED

        transaction = PyMySQLTransaction(caller)
        first = idem.run(intent(), two_phases, transaction=transaction, single_commit=True)
        released = store.get("alice", "k-1")
        retry = idem.run(intent(), two_phases, transaction=transaction, single_commit=True)
    finally:
        with caller.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {table_name}")
        caller.close()
        store.close()

    assert first.response.status == 503
    assert released is not None
    assert (released.state, released.recovery_point) == (State.RELEASED, "payment_created")
    assert retry.response.status == 201


# --- defect 11: a failed rollback never masks the handler's exception ----------------


@pytest.mark.postgres
async def test_the_handler_exception_survives_a_rollback_on_a_dead_connection(
    table_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler's transaction loses its server session, then the handler raises. The
    rollback fails; the caller must still see the handler's own exception, the key must
    still be released (on a connection of the store's), and the retry must run."""
    name = f"idemflow-seam-{uuid.uuid4().hex[:8]}"
    boom = Boom("the handler's own failure")
    with postgres_tables(table_name) as psycopg:
        async with shared_pool(table_name, 2, name) as store:
            idem = AsyncIdempotency(store, POLICY)

            async def dies(attempt: AsyncAttempt) -> Response:
                row = await (await attempt.connection.execute("SELECT pg_backend_pid()")).fetchone()
                async with await psycopg.AsyncConnection.connect(
                    POSTGRES_URL, autocommit=True
                ) as killer:
                    await killer.execute("SELECT pg_terminate_backend(%s)", (row[0],))
                raise boom

            with caplog.at_level(logging.WARNING, "idemflow"), pytest.raises(Boom) as raised:
                async with transaction_on(store) as transaction:
                    await idem.run(intent(), dies, transaction=transaction)
            released = await store.get("alice", "k-1")
            async with transaction_on(store) as transaction:
                retry = await idem.run(
                    intent(), lambda a: _respond(CREATED), transaction=transaction
                )

    assert raised.value is boom
    assert "rollback failed" in caplog.text
    assert released is not None
    assert released.state is State.RELEASED
    assert retry.response.status == 201


async def _respond(response: Response) -> Response:
    return response


# --- defect 10: cancellation -------------------------------------------------------


@contextlib.asynccontextmanager
async def async_store(kind: str, tmp_path: Path, table: str) -> AsyncIterator[Any]:
    if kind == "sqlite":
        store = AsyncSQLiteStore(tmp_path / "keys.db", table=table)
        await store.migrate()
        try:
            yield store
        finally:
            await store.close()
        return
    with postgres_tables(table):
        async with shared_pool(table, 2) as pooled:
            yield pooled


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def test_cancelled_while_claiming_leaves_no_claim_behind(
    kind: str, tmp_path: Path, table_name: str
) -> None:
    """A request cancelled while its claim is in flight (the claim commits anyway, in its
    worker thread or on the server) gives the key back: no in_progress orphan, and the
    handler never runs."""
    ran: list[str] = []

    async def handler(attempt: AsyncAttempt) -> Response:
        ran.append(attempt.record.key)
        return CREATED

    async with async_store(kind, tmp_path, table_name) as real:
        store = SignallingStore(real)
        idem = AsyncIdempotency(store, POLICY)
        task = asyncio.create_task(idem.run(intent(), handler))
        await store.claim_sent.wait()
        store.cancel(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        record = await real.get("alice", "k-1")
        retry = await idem.run(intent(), handler)

    assert ran == ["k-1"]  # only the retry ran
    assert record is None or record.state is State.RELEASED
    assert retry.response.status == 201


@pytest.mark.parametrize(
    ("kind", "transactional"),
    [
        ("sqlite", False),
        pytest.param("postgres", False, marks=pytest.mark.postgres),
        pytest.param("postgres", True, marks=pytest.mark.postgres),
    ],
    ids=["sqlite-no-transaction", "postgres-no-transaction", "postgres-in-a-transaction"],
)
async def test_a_timeout_mid_handler_stays_a_timeout(
    kind: str, transactional: bool, tmp_path: Path, table_name: str
) -> None:
    """``asyncio.timeout`` around a run: the handler is cancelled, the shielded cleanup
    completes, and the caller still gets its TimeoutError (the deferred cancellation
    keeps asyncio's cancel count, so the timeout recognises it as its own). In a
    transaction the effect rolled back and the key is released; without one the handler
    may have made its call, so the key stays claimed for the sweeper."""
    entered = asyncio.Event()

    async def slow(attempt: AsyncAttempt) -> Response:
        entered.set()
        await asyncio.sleep(30)
        return CREATED

    async def run(idem: AsyncIdempotency, store: Any) -> None:
        if not transactional:
            await idem.run(intent(), slow)
            return
        async with transaction_on(store) as transaction:
            await idem.run(intent(), slow, transaction=transaction)

    async with async_store(kind, tmp_path, table_name) as store:
        idem = AsyncIdempotency(store, POLICY)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await run(idem, store)
        record = await store.get("alice", "k-1")

    assert entered.is_set()
    assert record is not None
    assert record.state is (State.RELEASED if transactional else State.IN_PROGRESS)


# --- the release when the store stopped answering ------------------------------------


#: Each mode whose release may go through the store's own pool of one. With the store
#: stopped under its handler, each sends one release: the checkout skips the connection
#: that died with the server (its socket says so), so the release waits for a new one
#: until the pool's timeout, and is not sent again. (Before the checkout polled, the
#: first release met the dead connection, failed at once and was sent again: two.)
MODES_WITH_THE_STORE_STOPPED = [
    "no-transaction",
    "two-commit",
    "async-no-transaction",
    "middleware",
]


@pytest.mark.parametrize(("failed_after", "releases_sent"), [(0.0, 2), (0.6, 1)])
def test_a_release_refused_at_once_is_sent_again_one_that_waited_is_not(
    failed_after: float, releases_sent: int
) -> None:
    """The driver's rule on its own, with a store whose first release is refused
    (StoreUnavailable) at once (a connection found dead: a new one may serve the next)
    or after waiting past ``RELEASE_RETRY_WITHIN_SECONDS`` (the store itself did not
    answer: the next would wait as long). The handler's own exception reaches the
    caller either way; an instant refusal is sent again and the key given back."""
    from idemflow.stores.memory import MemoryStore

    sent: list[float] = []

    class RefusingOnce(MemoryStore):
        def release(self, *args: Any, **kwargs: Any) -> bool:
            sent.append(failed_after)
            if len(sent) == 1:
                time.sleep(failed_after)
                raise StoreUnavailable("refused")
            return super().release(*args, **kwargs)

    store = RefusingOnce()

    def fail(attempt: Attempt) -> Response:
        raise Boom("the handler's own failure")

    with pytest.raises(Boom):
        Idempotency(store, POLICY).run(intent("k-release"), fail)

    record = store.get("alice", "k-release")
    assert len(sent) == releases_sent
    assert record is not None
    assert record.state is (State.RELEASED if releases_sent == 2 else State.IN_PROGRESS)


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES_WITH_THE_STORE_STOPPED)
async def test_a_release_that_waited_for_a_stopped_store_is_not_sent_again(
    mode: str, table_name: str
) -> None:
    """The store's PostgreSQL (a private one) stops under a request whose handler then
    raises, on a pool of one: the release that waited for the store until the pool's
    timeout (1 s) is not sent a third time, which would only wait as long again before the
    handler's own exception reaches the caller (the Flask shop answered its 503 after two
    5 s waits). A release that failed at once, on a connection found dead, is sent again.
    The key stays claimed for the sweeper; nothing was recorded."""
    from tests._private_postgres import PrivatePostgresUnavailable, private_postgres

    try:
        with private_postgres() as cluster:
            releases, record = await _releases_with_the_store_stopped(mode, cluster, table_name)
    except PrivatePostgresUnavailable as exc:
        unreachable("a private PostgreSQL", exc)

    assert releases == 1
    assert record is not None
    assert record.state is State.IN_PROGRESS  # the sweeper's: nothing recorded


async def _releases_with_the_store_stopped(mode: str, cluster: Any, table: str) -> tuple[int, Any]:
    """Run ``mode``'s request whose handler stops ``cluster`` and raises :class:`Boom`:
    how many releases the store was sent, and the record once the server is back."""
    psycopg_pool = pytest.importorskip("psycopg_pool")
    from idemflow.edge import pooled_transaction
    from idemflow.stores.postgres import (
        DEFAULT_CLAIM_LOCK_TIMEOUT_MS,
        AsyncPostgresStore,
        PostgresStore,
        connection_options,
    )
    from idemflow.transactions import PsycopgTransaction

    releases = 0
    settings: dict[str, Any] = {
        "min_size": 1,
        "max_size": 1,
        "kwargs": connection_options(DEFAULT_CLAIM_LOCK_TIMEOUT_MS),
        "timeout": 1.0,
    }

    class CountingStore(PostgresStore):
        def release(self, *args: Any, **kwargs: Any) -> bool:
            nonlocal releases
            releases += 1
            return super().release(*args, **kwargs)

    class AsyncCountingStore(AsyncPostgresStore):
        async def release(self, *args: Any, **kwargs: Any) -> bool:
            nonlocal releases
            releases += 1
            return await super().release(*args, **kwargs)

    def stop_then_fail(*_: Any) -> Any:
        cluster.stop("immediate")
        raise Boom("the handler's own failure")

    sync_store = CountingStore(
        psycopg_pool.ConnectionPool(cluster.url, **settings, open=True), table=table
    )
    sync_store.migrate()
    try:
        if mode in ("no-transaction", "two-commit"):
            idem = Idempotency(sync_store, POLICY)
            with contextlib.ExitStack() as stack:
                transaction = None
                if mode == "two-commit":
                    transaction = stack.enter_context(
                        pooled_transaction(sync_store.pool.connection, PsycopgTransaction)
                    )
                with pytest.raises(Boom):
                    idem.run(intent("k-stopped"), stop_then_fail, transaction=transaction)
        else:
            pool = psycopg_pool.AsyncConnectionPool(cluster.url, **settings, open=False)
            await pool.open(wait=True)
            async_store = AsyncCountingStore(pool, table=table)
            try:
                await _run_async(mode, AsyncIdempotency(async_store, POLICY), stop_then_fail)
            finally:
                await pool.close()
        sent = releases
        cluster.start()
        for _ in range(10):  # a dead connection or two refuse first
            with contextlib.suppress(StoreUnavailable):
                return sent, sync_store.get("alice", "k-stopped")
        pytest.fail("the store never served again after its restart")
    finally:
        sync_store.close()


async def _run_async(mode: str, idem: AsyncIdempotency, fail: Callable[..., Any]) -> None:
    """The async driver, called directly or behind the ASGI middleware (whose endpoint
    raises through Starlette, and out of the in-process transport)."""
    httpx = pytest.importorskip("httpx")
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    from idemflow.integrations.starlette import IdempotencyMiddleware

    async def handler(attempt: AsyncAttempt) -> Response:
        return fail()  # type: ignore[no-any-return]

    if mode == "async-no-transaction":
        with pytest.raises(Boom):
            await idem.run(intent("k-stopped"), handler)
        return

    async def endpoint(request: Any) -> Any:
        return fail()

    app = Starlette(
        routes=[Route("/payments", endpoint, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                idempotency=idem,
                endpoints=["POST /payments"],
                principal=lambda scope: "alice",
            )
        ],
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        with pytest.raises(Boom):
            await client.post("/payments", json={}, headers={"Idempotency-Key": "k-stopped"})
