"""
What each failure leaves behind, per mode: the cells of the table in
docs/crash-safety.md ("What each failure leaves behind, per mode") that no
other test proved (issue 9: "a table checked against these tests").

The modes are the four ways a request can be protected: a transaction shared
with the handler, committing the claim on its own (two-commit) or with the
handler's first phase (single-commit); ``run()`` without a transaction; and
``IdempotencyMiddleware``. As in tests/guarantees/test_seams.py every fault is real: a
server session terminated, a task cancelled while its claim is in flight, a
deferred constraint failing at COMMIT, a claim swept away mid-request by the
sweeper's own statements.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse
from starlette.responses import Response as StarletteResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import idemflow
from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    Attempt,
    Event,
    Idempotency,
    InProgress,
    LeaseLost,
    Observer,
    Policy,
    Response,
    State,
    StoreUnavailable,
)
from idemflow._async.edge import AsyncEdge
from idemflow._sync.edge import Edge
from idemflow.integrations.starlette import IdempotencyMiddleware, Idempotent
from idemflow.stores.sqlite import AsyncSQLiteStore
from idemflow.sweeper import AsyncSweeper, DidNotHappen
from idemflow.testing import FrozenClock
from tests.backends import Rig, open_rig, rig_params, start_cluster
from tests.conftest import POSTGRES_URL
from tests.core.test_sync_edge import request
from tests.factories import CREATED, psycopg_or_skip
from tests.factories import uncorrelated_intent as intent
from tests.faults import (
    SignallingStore,
    business_rows,
    shared_pool,
    transaction_on,
)
from tests.guarantees.test_phase_rules import transactional_modes
from tests.http.conftest import assert_problem, new_key, serve
from tests.sweeping import async_sweep_away

if TYPE_CHECKING:
    pass

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

POLICY = Policy(request_timeout=5)
UNAVAILABLE = Response(503, b"provider down")
ORPHAN = 42  # a parent id that never exists: the deferred foreign key fails at COMMIT
BAD_LOCATION = "/payments/1\r\nset-cookie: stolen=1"  # a header that cannot be sent

IN_A_TRANSACTION = pytest.mark.parametrize(
    "single_commit", [False, True], ids=["two-commit", "single-commit"]
)


# --- PostgreSQL: a key table, a business table, pools shared by store and handler -----


@contextlib.contextmanager
def postgres_tables(table: str) -> Iterator[Any]:
    """The key table, and a business table whose deferred foreign key can fail a COMMIT."""
    psycopg = psycopg_or_skip()
    from idemflow.stores.postgres import PostgresStore

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        store = PostgresStore(POSTGRES_URL, table=table, max_size=1)
        store.migrate()
        store.close()
        conn.execute(f"CREATE TABLE parent_{table} (id INTEGER PRIMARY KEY)")
        conn.execute(
            f"CREATE TABLE biz_{table} (id BIGSERIAL PRIMARY KEY, note TEXT, parent INTEGER "
            f"REFERENCES parent_{table} (id) DEFERRABLE INITIALLY DEFERRED)"
        )
        try:
            yield psycopg
        finally:
            conn.execute(f"DROP TABLE IF EXISTS {table}, biz_{table}, parent_{table}")


async def terminate_own_session(connection: Any) -> None:
    """End the server session behind ``connection`` from another one."""
    import psycopg

    row = await (await connection.execute("SELECT pg_backend_pid()")).fetchone()
    async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as killer:
        await killer.execute("SELECT pg_terminate_backend(%s)", (row[0],))


async def insert(attempt: AsyncAttempt, table: str, note: str, parent: int | None = None) -> None:
    await attempt.connection.execute(
        f"INSERT INTO biz_{table} (note, parent) VALUES (%s, %s)", (note, parent)
    )


async def run_in_transaction(
    store: Any,
    handler: Callable[[AsyncAttempt], Awaitable[Response]],
    *,
    single_commit: bool,
    idem: AsyncIdempotency | None = None,
) -> idemflow.Outcome:
    idem = idem or AsyncIdempotency(store, POLICY)
    async with transaction_on(store) as transaction:
        return await idem.run(
            intent(), handler, transaction=transaction, single_commit=single_commit
        )


def expected_after_a_rollback(single_commit: bool) -> State | None:
    """Two commits: the claim was committed, so it is released. One: it rolled back."""
    return None if single_commit else State.RELEASED


async def state_of(store: Any, key: str = "k-1") -> State | None:
    record = await store.get("alice", key)
    return None if record is None else record.state


# --- transactional modes ---------------------------------------------------------------


@pytest.mark.postgres
@IN_A_TRANSACTION
async def test_cancelled_while_claiming_in_a_transaction_leaves_no_claim(
    single_commit: bool, table_name: str
) -> None:
    """Cancelled while the claim is in flight: the claim finishes (shielded), the deferred
    cancellation is delivered before the handler, and what was claimed is given back: with
    two commits by a fenced release on the request's own connection, with one by the
    rollback. The handler never runs; the retry does."""
    ran: list[int] = []

    async def handler(attempt: AsyncAttempt) -> Response:
        ran.append(attempt.record.attempt)
        return CREATED

    with postgres_tables(table_name):
        async with shared_pool(table_name) as real:
            store = SignallingStore(real)
            idem = AsyncIdempotency(store, POLICY)
            task = asyncio.create_task(
                run_in_transaction(store, handler, single_commit=single_commit, idem=idem)
            )
            await store.claim_sent.wait()
            store.cancel(task)
            with pytest.raises(asyncio.CancelledError):
                await task
            left = await state_of(real)
            retry = await run_in_transaction(store, handler, single_commit=single_commit, idem=idem)

    assert left is expected_after_a_rollback(single_commit)
    assert retry.response.status == 201
    assert ran == [1 if single_commit else 2]  # only the retry ran


@pytest.mark.postgres
@IN_A_TRANSACTION
async def test_cancelled_mid_handler_in_a_transaction_rolls_back_the_effect(
    single_commit: bool, table_name: str
) -> None:
    """``asyncio.timeout`` around a run in a transaction: the handler's write rolls back, the
    key is given back (released, or gone with the single commit's rollback), and the caller
    still gets its TimeoutError."""
    entered = asyncio.Event()

    async def slow(attempt: AsyncAttempt) -> Response:
        await insert(attempt, table_name, "half-done")
        entered.set()
        await asyncio.sleep(30)
        return CREATED

    with postgres_tables(table_name):
        async with shared_pool(table_name) as store:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await run_in_transaction(store, slow, single_commit=single_commit)
            left = await state_of(store)
        rows = business_rows(table_name)

    assert entered.is_set()
    assert left is expected_after_a_rollback(single_commit)
    assert rows == []


@pytest.mark.postgres
@IN_A_TRANSACTION
async def test_a_lost_completion_in_a_transaction_rolls_back_and_frees_the_key(
    single_commit: bool, table_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The handler's connection dies before the completion is written. The effect was in the
    same transaction, so nothing happened: the caller hears StoreUnavailable, the key is
    free again (released through a connection of the store's, or never committed), and the
    retry runs once."""
    with postgres_tables(table_name):
        async with shared_pool(table_name) as store:

            async def charge(attempt: AsyncAttempt) -> Response:
                await insert(attempt, table_name, "charged")
                await terminate_own_session(attempt.connection)
                return CREATED

            with pytest.raises(StoreUnavailable):
                await run_in_transaction(store, charge, single_commit=single_commit)
            left = await state_of(store)

            async def again(attempt: AsyncAttempt) -> Response:
                await insert(attempt, table_name, "retried")
                return CREATED

            retry = await run_in_transaction(store, again, single_commit=single_commit)
        rows = business_rows(table_name)

    assert left is expected_after_a_rollback(single_commit)
    assert retry.response.status == 201
    assert rows == ["retried"]


@pytest.mark.postgres
@IN_A_TRANSACTION
async def test_a_lost_completion_after_a_committed_phase_keeps_the_claim(
    single_commit: bool, table_name: str
) -> None:
    """Past a ``commit_phase`` the provider was called: that effect does not roll back with
    the completion. The connection dies before the completion is written: the caller hears
    "could not be recorded", the key stays claimed at its recovery point, and a retry gets
    409 instead of calling the provider a second time (the sweeper's reconciler decides)."""
    provider_calls: list[str] = []

    async def charge(attempt: AsyncAttempt) -> Response:
        await insert(attempt, table_name, "payment")
        await attempt.commit_phase("charging")
        provider_calls.append(attempt.downstream_key("charge"))  # no downstream key honoured
        await insert(attempt, table_name, "charged")
        await terminate_own_session(attempt.connection)
        return CREATED

    with postgres_tables(table_name):
        async with shared_pool(table_name) as store:
            with pytest.raises(StoreUnavailable, match="could not be recorded"):
                await run_in_transaction(store, charge, single_commit=single_commit)
            record = await store.get("alice", "k-1")
            with pytest.raises(InProgress):
                await run_in_transaction(store, charge, single_commit=single_commit)
        rows = business_rows(table_name)

    assert record is not None
    assert (record.state, record.recovery_point) == (State.IN_PROGRESS, "charging")
    assert len(provider_calls) == 1
    assert rows == ["payment"]  # the committed phase stays; what followed rolled back


@pytest.mark.postgres
async def test_single_commit_commits_the_take_over_before_resuming_past_a_phase(
    table_name: str,
) -> None:
    """A single-commit retry that resumes after a committed phase may call the provider
    first thing. Its take-over is committed before the handler runs: had it stayed in the
    open transaction, a crash would roll it back, the intent would read "released" again,
    and the next retry would resume (and call) a second time (found by model/idemflow.pml)."""
    seen: list[tuple[str | None, State | None]] = []

    async def first(attempt: AsyncAttempt) -> Response:
        await insert(attempt, table_name, "payment")
        await attempt.commit_phase("charging")
        return Response(503)  # transient past the phase: released with its recovery point

    async def resumed(attempt: AsyncAttempt) -> Response:
        # What any other session sees while the resumed handler runs.
        seen.append((attempt.recovery_point, await state_of(store)))
        return CREATED

    with postgres_tables(table_name):
        async with shared_pool(table_name) as store:
            await run_in_transaction(store, first, single_commit=True)
            assert await state_of(store) is State.RELEASED
            outcome = await run_in_transaction(store, resumed, single_commit=True)

    assert seen == [("charging", State.IN_PROGRESS)]
    assert outcome.response.status == 201


@pytest.mark.postgres
async def test_single_commit_failed_commit_leaves_no_record(table_name: str) -> None:
    """A COMMIT refused by a deferred constraint takes the claim with it in single-commit
    mode: no effect, no record, and the retry is attempt 1 of a fresh claim."""
    with postgres_tables(table_name):
        async with shared_pool(table_name) as store:

            async def orphan(attempt: AsyncAttempt) -> Response:
                await insert(attempt, table_name, "orphan", ORPHAN)
                return CREATED

            with pytest.raises(Exception, match=r"(?i)foreign key") as raised:
                await run_in_transaction(store, orphan, single_commit=True)
            left = await state_of(store)

            async def fine(attempt: AsyncAttempt) -> Response:
                await insert(attempt, table_name, "fine")
                return CREATED

            retry = await run_in_transaction(store, fine, single_commit=True)
        rows = business_rows(table_name)

    assert not isinstance(raised.value, LeaseLost)
    assert left is None
    assert (retry.response.status, retry.record.attempt) == (201, 1)
    assert rows == ["fine"]


@pytest.mark.postgres
async def test_single_commit_lease_lost_after_commit_phase_keeps_only_the_committed_phase(
    table_name: str,
) -> None:
    """After its first commit_phase a single-commit claim is committed, so the sweeper can
    end it. The owner's completion then matches nothing: LeaseLost, the open phase rolls
    back, the committed phase and its recovery point stay, and the record is the
    sweeper's (here released, as a reconciler that says "did not happen" leaves it)."""
    clock = FrozenClock()
    with postgres_tables(table_name):
        async with shared_pool(table_name, clock="caller") as store:
            idem = AsyncIdempotency(store, POLICY, clock=clock)

            async def overrun(attempt: AsyncAttempt) -> Response:
                await insert(attempt, table_name, "phase 1")
                await attempt.commit_phase("payment_created")
                await insert(attempt, table_name, "phase 2")
                clock.advance(POLICY.stale_seconds + 1)  # the request outlived its timeout
                assert len(await async_sweep_away(store, clock())) == 1
                return CREATED

            with pytest.raises(LeaseLost):
                await run_in_transaction(store, overrun, single_commit=True, idem=idem)
            record = await store.get("alice", "k-1")
        rows = business_rows(table_name)

    assert rows == ["phase 1"]
    assert record is not None
    assert (record.state, record.recovery_point) == (State.RELEASED, "payment_created")


@pytest.mark.postgres
@pytest.mark.parametrize("shared", [True, False], ids=["two-commit", "no-transaction"])
async def test_a_failure_after_commit_phase_releases_and_keeps_the_recovery_point(
    shared: bool, table_name: str
) -> None:
    """A 503 after a commit_phase (a checkpoint, without a transaction): the key is released
    with its recovery point, so the retry resumes after the committed phase instead of
    starting over (single-commit mode: tests/guarantees/test_seams.py)."""
    resumed: list[str | None] = []
    with postgres_tables(table_name):
        async with shared_pool(table_name) as store:
            idem = AsyncIdempotency(store, POLICY)

            async def two_phases(attempt: AsyncAttempt) -> Response:
                resumed.append(attempt.recovery_point)
                if attempt.recovery_point is None:
                    await attempt.commit_phase("payment_created")
                    return UNAVAILABLE
                return CREATED

            async def once() -> idemflow.Outcome:
                if shared:
                    return await run_in_transaction(store, two_phases, single_commit=False)
                return await idem.run(intent(), two_phases)

            first = await once()
            released = await store.get("alice", "k-1")
            retry = await once()

    assert first.response.status == 503
    assert released is not None
    assert (released.state, released.recovery_point) == (State.RELEASED, "payment_created")
    assert retry.response.status == 201
    assert resumed == [None, "payment_created"]


@pytest.mark.postgres
async def test_single_commit_with_its_connection_gone_before_the_claim_runs_nothing(
    table_name: str,
) -> None:
    """The database connection a single-commit request would claim on is dead before the
    claim: nothing is written and the handler never runs. Its BEGIN fails inside the
    store's claim (the claim's first statement begins the transaction), so the store's
    rule says what that means: StoreUnavailable, a 503."""
    psycopg = psycopg_or_skip()
    from idemflow.transactions import AsyncPsycopgTransaction

    ran: list[str] = []

    async def handler(attempt: AsyncAttempt) -> Response:
        ran.append("ran")
        return CREATED

    with postgres_tables(table_name):
        async with shared_pool(table_name) as store:
            idem = AsyncIdempotency(store, POLICY)
            async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as conn:
                await terminate_own_session(conn)
                with pytest.raises(StoreUnavailable):
                    await idem.run(
                        intent(),
                        handler,
                        transaction=AsyncPsycopgTransaction(conn),
                        single_commit=True,
                    )
            left = await state_of(store)

    assert ran == []
    assert left is None


def pooled_modes() -> list[Any]:
    """The transactional modes on every store with a pool (SQLite has none)."""
    return list(transactional_modes(pooled=True))


async def respond(
    rig: Rig,
    act: Callable[[Any], Any],
    key: str,
    *,
    single_commit: bool,
    observer: Observer = lambda event, intent, elapsed: None,
) -> Response:
    """One request through the HTTP edge (the sync edge on a sync rig), in the rig's
    transaction: the handler does ``act(attempt)``, then answers 201."""
    assert rig.transaction is not None
    if rig.sync:

        def handler(attempt: Attempt) -> Response:
            act(attempt)
            return CREATED

        edge = Edge(Idempotency(rig.store, POLICY, observer=observer))
        return await asyncio.to_thread(
            edge.respond,
            request(key),
            handler,
            transaction=rig.transaction,
            single_commit=single_commit,
        )

    async def ahandler(attempt: AsyncAttempt) -> Response:
        done = act(attempt)
        if inspect.isawaitable(done):
            await done
        return CREATED

    aedge = AsyncEdge(AsyncIdempotency(rig.store, POLICY, observer=observer))
    return await aedge.respond(
        request(key), ahandler, transaction=rig.transaction, single_commit=single_commit
    )


@pytest.mark.parametrize(("kind", "single_commit"), pooled_modes())
async def test_a_claim_the_pool_cannot_serve_is_503_but_the_handlers_own_timeout_is_its_own(
    kind: str, single_commit: bool, tmp_path: Path, table_name: str
) -> None:
    """The pool's one connection (the store's and the requests') is held elsewhere past a
    shortened wait: the claim's checkout times out. The edge answers what a claim on an
    unreachable store answers, a 503 store-unavailable problem with Retry-After, the
    handler not run, nothing recorded: with two commits the checkout is the one lent to
    the claim, with one it is the claim's transaction's, and in both the store's rule
    (``is_unavailable``) says what the pool's error means. The same error raised by the
    handler (a checkout of its own) is the handler's: it propagates unchanged, the key
    given back. The retry runs once."""
    ran: list[str] = []

    def charge(attempt: Any) -> Any:
        ran.append(attempt.record.key)
        return rig.write(attempt.connection, "charged")

    async with open_rig(kind, table_name, tmp_path, transactional=True) as rig:
        assert rig.crowd is not None
        async with rig.crowd(0.05) as timed_out:
            refused = await respond(rig, charge, "k-1", single_commit=single_commit)
        left = rig.peek("k-1")

        def own_timeout(attempt: Any) -> Any:
            raise timed_out

        with pytest.raises(type(timed_out)) as raised:
            await respond(rig, own_timeout, "k-2", single_commit=single_commit)
        given_back = rig.peek("k-2")
        retried = await respond(rig, charge, "k-1", single_commit=single_commit)
        notes = rig.notes()

    assert refused.status == 503, refused
    assert refused.header("content-type") == "application/problem+json"
    assert refused.header("retry-after") is not None
    problem = json.loads(refused.body)
    assert problem["type"].endswith("/store-unavailable")
    assert "key store unavailable" in problem["detail"]
    assert left is None
    assert raised.value is timed_out
    assert given_back is expected_after_a_rollback(single_commit)
    assert retried.status == 201
    assert (ran, notes) == (["k-1"], ["charged"])


def apart_pools() -> list[Any]:
    """The request's transaction on a pool apart from the store's: psycopg's or MySQL's
    (two commits: with one, that pool's checkout is the claim's, as in the test above), or a
    SQLAlchemy engine's (both modes)."""
    return [
        pytest.param(*mode.values, app, id=f"{mode.id}-{app}")
        for mode in pooled_modes()
        for app in ("pool", "sqlalchemy")
        if app == "sqlalchemy" or not mode.values[1]
    ]


@pytest.mark.parametrize(("kind", "single_commit", "app"), apart_pools())
async def test_a_transaction_its_own_pool_cannot_begin_is_503_and_the_key_released_at_once(
    kind: str, single_commit: bool, app: str, tmp_path: Path, table_name: str
) -> None:
    """The request's transaction takes its connection from a pool apart from the store's,
    whose one connection is held elsewhere past a shortened wait: its checkout, the
    transaction's BEGIN, times out. With two commits that comes after the claim committed
    on a store connection, with one inside the claim the transaction begins with. The
    infrastructure failed, not the handler: a 503 store-unavailable problem with
    Retry-After, the handler not run, nothing recorded, the key released at once (two
    commits: counted) or never committed (one), so the retry, once the pool is free, runs
    the handler once. SQLAlchemy's ``TimeoutError`` is judged by the transaction's own
    rule (the store's knows its driver's errors only). The same error raised by the
    handler itself is the handler's: it propagates unchanged, the key given back."""
    ran: list[str] = []
    events: list[Event] = []

    def charge(attempt: Any) -> Any:
        ran.append(attempt.record.key)
        return rig.write(attempt.connection, "charged")

    def own_timeout(attempt: Any) -> Any:
        raise timed_out

    apart: dict[str, Any] = {"app_pool": True} if app == "pool" else {"sqlalchemy": "connect"}
    async with open_rig(kind, table_name, tmp_path, transactional=True, **apart) as rig:
        assert rig.crowd is not None
        async with rig.crowd(0.05) as timed_out:
            refused = await respond(
                rig,
                charge,
                "k-1",
                single_commit=single_commit,
                observer=lambda event, intent, elapsed: events.append(event),
            )
        left = rig.peek("k-1")
        with pytest.raises(type(timed_out)) as raised:
            await respond(rig, own_timeout, "k-2", single_commit=single_commit)
        given_back = rig.peek("k-2")
        retried = await respond(rig, charge, "k-1", single_commit=single_commit)
        notes = rig.notes()

    assert refused.status == 503, refused
    assert refused.header("content-type") == "application/problem+json"
    assert refused.header("retry-after") is not None
    assert json.loads(refused.body)["type"].endswith("/store-unavailable")
    if single_commit:
        assert events == [Event.STORE_UNAVAILABLE]
    else:
        assert events == [Event.CLAIMED, Event.RELEASED, Event.STORE_UNAVAILABLE]
    assert left is expected_after_a_rollback(single_commit)
    assert raised.value is timed_out
    assert given_back is expected_after_a_rollback(single_commit)
    assert retried.status == 201
    assert (ran, notes) == (["k-1"], ["charged"])


def session_cases() -> list[Any]:
    """Where a session's first statement is: the claim's (one commit), the handler's (two
    commits, a handler that writes) or the completion's (two, a handler that wrote nothing)."""
    return [
        pytest.param(*mode.values, writes, id=f"{mode.id}-{'writes' if writes else 'quiet'}")
        for mode in pooled_modes()
        for writes in (True, False)
        if writes or not mode.values[1]
    ]


@pytest.mark.parametrize(("kind", "single_commit", "handler_writes"), session_cases())
async def test_a_sqlalchemy_session_its_pool_cannot_serve_gives_the_key_back_at_once(
    kind: str, single_commit: bool, handler_writes: bool, tmp_path: Path, table_name: str
) -> None:
    """The request's transaction is a SQLAlchemy session, whose engine's pool of one is
    held elsewhere past a shortened wait: the session checks a connection out only at its
    first statement. With one commit that is the claim's, which the transaction begins
    with: a 503 store-unavailable, nothing recorded, the handler not run. With two and a
    handler that writes it is the handler's own: its error propagates unchanged, and the
    key is released at once, through the store's connection (the release sent again on
    the session met that pool's timeout each time and left the key claimed for the
    sweeper). With two and a handler that wrote nothing it is the completion's, inside the
    store's completion: nothing was written, so a 503 (the transaction's rule judges it,
    as at BEGIN), the key released at once. Either way the retry charges once."""
    ran: list[str] = []
    events: list[Event] = []

    def charge(attempt: Any) -> Any:
        ran.append(attempt.record.key)
        return rig.write(attempt.connection, "charged")

    def answer_only(attempt: Any) -> None:
        ran.append(attempt.record.key)

    async with open_rig(
        kind, table_name, tmp_path, transactional=True, sqlalchemy="session"
    ) as rig:
        assert rig.crowd is not None
        async with rig.crowd(0.05) as timed_out:
            refused: Response | None = None
            with contextlib.ExitStack() as expecting:
                if handler_writes and not single_commit:
                    raised = expecting.enter_context(pytest.raises(type(timed_out)))
                refused = await respond(
                    rig,
                    charge if handler_writes else answer_only,
                    "k-1",
                    single_commit=single_commit,
                    observer=lambda event, intent, elapsed: events.append(event),
                )
        left = rig.peek("k-1")
        retried = await respond(rig, charge, "k-1", single_commit=single_commit)
        notes = rig.notes()

    if handler_writes and not single_commit:
        assert isinstance(raised.value, type(timed_out))
        assert events == [Event.CLAIMED, Event.RELEASED]
    else:
        assert refused is not None
        assert refused.status == 503, refused
        assert refused.header("retry-after") is not None
        assert json.loads(refused.body)["type"].endswith("/store-unavailable")
        claimed = [] if single_commit else [Event.CLAIMED, Event.RELEASED]
        assert events == [*claimed, Event.STORE_UNAVAILABLE]
    assert ran == (["k-1"] if single_commit else ["k-1", "k-1"])
    assert left is expected_after_a_rollback(single_commit)
    assert retried.status == 201
    assert notes == ["charged"]


# --- HTTP, transactional single-commit mode ----------------------------------------------


@pytest.mark.postgres
def test_single_commit_unstorable_response_rolls_back_the_claim_with_the_effect(
    table_name: str,
) -> None:
    """Through a real server: a response with a header that cannot be sent is the handler's
    bug in a transaction. In single-commit mode the rollback takes the effect and the claim
    together: a 500 problem, no row, no record (two-commit mode: tests/http/)."""
    psycopg_pool = pytest.importorskip("psycopg_pool")
    from idemflow.stores.postgres import AsyncPostgresStore
    from idemflow.transactions import AsyncPsycopgTransaction

    with postgres_tables(table_name):
        pool = psycopg_pool.AsyncConnectionPool(
            POSTGRES_URL, min_size=1, max_size=2, kwargs={"autocommit": True}, open=False
        )
        store = AsyncPostgresStore(pool, table=table_name)
        idempotent = Idempotent(
            AsyncIdempotency(store, POLICY),
            connect=pool.connection,
            transaction=AsyncPsycopgTransaction,
            principal=lambda scope: "carol",
            single_commit=True,
        )

        async def create(request: Request) -> StarletteResponse:
            async def handler(attempt: AsyncAttempt) -> Response:
                await insert(attempt, table_name, "charged")
                return Response.json(201, {"id": 1}, [("location", BAD_LOCATION)])

            return await idempotent.run(request, handler)

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            await pool.open(wait=True)
            yield
            await pool.close()

        app = Starlette(routes=[Route("/payments", create, methods=["POST"])], lifespan=lifespan)
        key = new_key()
        with serve(app) as url, httpx.Client(base_url=url, timeout=30) as client:
            answer = client.post("/payments", content=b"{}", headers={"Idempotency-Key": key})
        rows = business_rows(table_name)
        record = _sync_record(table_name, "carol", key)

    assert_problem(answer, 500, "response-not-storable")
    assert rows == []
    assert record is None


def _sync_record(table: str, principal: str, key: str) -> Any:
    from idemflow.stores.postgres import PostgresStore

    store = PostgresStore(POSTGRES_URL, table=table, max_size=1)
    try:
        return store.get(principal, key)
    finally:
        store.close()


# --- middleware mode -------------------------------------------------------------------


class HeaderAuth(AuthenticationBackend):
    """``X-User: name`` authenticates as ``name`` (tests only)."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        user = conn.headers.get("x-user")
        return None if user is None else (AuthCredentials(["authenticated"]), SimpleUser(user))


def middleware_app(
    idempotency: AsyncIdempotency,
    endpoint: Callable[[Request], Awaitable[StarletteResponse]],
    lifespan: Any = None,
) -> Starlette:
    return Starlette(
        routes=[Route("/payments", endpoint, methods=["POST"])],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=HeaderAuth()),
            Middleware(
                IdempotencyMiddleware, idempotency=idempotency, endpoints=["POST /payments"]
            ),
        ],
        lifespan=lifespan,
    )


def post(client: httpx.Client, key: str) -> httpx.Response:
    return client.post("/payments", json={}, headers={"X-User": "carol", "Idempotency-Key": key})


@contextlib.contextmanager
def sqlite_store(tmp_path: Path) -> Iterator[AsyncSQLiteStore]:
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    store.sync.migrate()
    try:
        yield store
    finally:
        store.sync.close()


class ServerSees:
    """Outermost ASGI wrapper: keeps what the application raised to its server.

    Starlette answers 500 and re-raises for the server to log; a server that gets the
    exception may reset the connection before the client read the 500. Keeping it here
    makes the answer reliable and lets the test see the exception came out unchanged.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.raised: list[Exception] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            self.raised.append(exc)


Endpoint = Callable[[Request], Awaitable[StarletteResponse]]


class RigServer:
    """An ASGI app that opens a rig (tests/backends.py ``open_rig``) on the server's own
    loop as it starts, and serves :func:`middleware_app` on the rig's store: the store's
    pool and the endpoint's live on the loop that serves the requests. ``endpoint`` makes
    the endpoint from the rig; :meth:`call` runs a coroutine (a store read) on that loop."""

    def __init__(
        self,
        kind: str,
        table: str,
        tmp_path: Path,
        endpoint: Callable[[Rig], Endpoint],
        clock: FrozenClock | None = None,
        **options: Any,
    ) -> None:
        self.opening = (kind, table, tmp_path)
        self.options = options  # open_rig's
        self.endpoint = endpoint
        self.clock = clock
        #: Why the rig did not open (a skip or a failure), raised again by :func:`served`.
        self.failed: BaseException | None = None
        self.raised: list[Exception] = []  # what the application raised to its server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        try:  # as ServerSees: the server does not reset the connection before the 500
            await self.app(scope, receive, send)
        except Exception as exc:
            self.raised.append(exc)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        kind, table, tmp_path = self.opening
        async with contextlib.AsyncExitStack() as stack:
            try:
                rig = await stack.enter_async_context(
                    open_rig(kind, table, tmp_path, transactional=False, **self.options)
                )
            except BaseException as exc:  # pytest's skip or fail too: raised in the test
                self.failed = exc
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            self.rig, self.loop = rig, asyncio.get_running_loop()
            idempotency = AsyncIdempotency(rig.store, POLICY, clock=self.clock or time.time)
            self.app = middleware_app(idempotency, self.endpoint(rig))
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})

    def call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coroutine`` on the server's loop (where the rig's store lives)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=60)

    def state(self, key: str) -> State | None:
        record = self.call(self.rig.store.get("carol", key))
        return None if record is None else record.state


@contextlib.contextmanager
def served(app: RigServer) -> Iterator[str]:
    """:func:`serve` for a :class:`RigServer`: a rig that could not open is its own error.
    The rig's cluster, if any, starts first: not within the server's startup deadline."""
    start_cluster(app.opening[0])
    try:
        with serve(app) as url:
            yield url
    except AssertionError:
        if app.failed is not None:
            raise app.failed from None
        raise


#: Every rig the middleware runs on (async, no transaction), the self-started clusters too
#: (their ids name them, so xdist runs them on one worker).
MIDDLEWARE_STORES = pytest.mark.parametrize("kind", rig_params("no-transaction", ("async",)))


@MIDDLEWARE_STORES
def test_middleware_endpoint_exception_releases_and_the_retry_runs_it_again(
    kind: str, tmp_path: Path, table_name: str
) -> None:
    """The endpoint raises: the server answers 500, the key is released (the middleware
    cannot undo what the endpoint did, and by its contract an endpoint that raised did
    nothing), and the retry runs the endpoint again. On every store the middleware can
    use, each on a pool of one connection (Redis: one connection) the endpoint shares."""
    calls: collections.Counter[str] = collections.Counter()

    def endpoint(rig: Rig) -> Endpoint:
        async def create(request: Request) -> StarletteResponse:
            calls["payments"] += 1
            if calls["payments"] == 1:
                raise RuntimeError("the endpoint's own failure")
            assert rig.charge is not None
            await rig.charge(request.headers["idempotency-key"])
            return JSONResponse({"n": calls["payments"]}, status_code=201)

        return create

    app = RigServer(kind, table_name, tmp_path, endpoint)
    key = new_key()
    with served(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        first = post(client, key)
        left = app.state(key)
        retry = post(client, key)
        again = post(client, key)
        charged = app.rig.notes()

    assert first.status_code == 500
    assert [str(exc) for exc in app.raised] == ["the endpoint's own failure"]  # unchanged
    assert left is State.RELEASED
    assert retry.status_code == 201
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert calls["payments"] == 2
    assert charged == [key]


#: Statuses the policy calls transient, each answered by the endpoint in turn.
TRANSIENTS = (503, 429, 502, 504)


@MIDDLEWARE_STORES
def test_middleware_transient_answers_release_at_once_and_the_retry_runs(
    kind: str, tmp_path: Path, table_name: str
) -> None:
    """The endpoint answers a transient status (503, 429, 502, 504, one per attempt)
    before it charges: each is sent to the client as it is, never stored, and the key is
    released at once (never left claimed for the sweeper), so the next attempt runs the
    endpoint again; the one that charges is stored and replayed. On every store."""
    calls: collections.Counter[str] = collections.Counter()

    def endpoint(rig: Rig) -> Endpoint:
        async def create(request: Request) -> StarletteResponse:
            calls["payments"] += 1
            if calls["payments"] <= len(TRANSIENTS):
                status = TRANSIENTS[calls["payments"] - 1]
                return JSONResponse({"error": "provider down"}, status_code=status)
            assert rig.charge is not None
            await rig.charge(request.headers["idempotency-key"])
            return JSONResponse({"id": 1}, status_code=201)

        return create

    app = RigServer(kind, table_name, tmp_path, endpoint)
    key = new_key()
    with served(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        transients: list[tuple[int, State | None]] = []
        for _ in TRANSIENTS:
            answer = post(client, key)
            transients.append((answer.status_code, app.state(key)))
        created = post(client, key)
        replay = post(client, key)
        charged = app.rig.notes()

    assert transients == [(status, State.RELEASED) for status in TRANSIENTS]
    assert created.status_code == 201
    assert replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert calls["payments"] == len(TRANSIENTS) + 1
    assert charged == [key]


@MIDDLEWARE_STORES
def test_middleware_lost_completion_keeps_the_claim_and_answers_503(
    kind: str, tmp_path: Path, table_name: str
) -> None:
    """The endpoint's effect happened, then the store's connection died before the
    completion (PostgreSQL: pg_terminate_backend; MariaDB and Galera: KILL CONNECTION on
    its node; Redis and Redis Cluster: CLIENT KILL; SQLite: its write lock held past the
    busy timeout). Releasing would run the endpoint again on the retry: the key stays
    claimed for the sweeper, the client gets a 503 saying the outcome went unrecorded, and
    the retry gets 409 with Retry-After, not a second execution. On every store."""
    calls: collections.Counter[str] = collections.Counter()

    def endpoint(rig: Rig) -> Endpoint:
        async def create(request: Request) -> StarletteResponse:
            calls["payments"] += 1
            assert rig.charge is not None
            await rig.charge(request.headers["idempotency-key"])
            await rig.lose(None)  # the store's own connections
            return JSONResponse({"id": 1}, status_code=201)

        return create

    app = RigServer(kind, table_name, tmp_path, endpoint)
    key = new_key()
    with served(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        first = post(client, key)
        app.rig.heal()
        retry = post(client, key)
        state = app.state(key)
        charged = app.rig.notes()

    body = assert_problem(first, 503, "store-unavailable")
    assert "could not be recorded" in body["detail"]
    assert_problem(retry, 409, "in-progress")
    assert retry.headers["retry-after"]
    assert state is State.IN_PROGRESS  # the sweeper's (and its reconciler's) now
    assert calls["payments"] == 1
    assert charged == [key]


@MIDDLEWARE_STORES
def test_middleware_under_a_pool_of_one_releases_transients_at_once_and_charges_once(
    kind: str, tmp_path: Path, table_name: str
) -> None:
    """Middleware mode under pressure, on every store: one pooled connection shared by the
    store and the endpoint (Redis: one connection; the Redis Cluster client's per node;
    SQLite: the file's one writer), 50 keys sent by two racing clients each. The
    endpoint's first answer for a key is a transient 503 (it wrote nothing); its second
    charges (on the same pool). A request holds at most one connection at a time, so
    nothing waits on itself: every transient is released at once (the retry runs the
    endpoint, never a stored 503), a duplicate in flight gets 409 with Retry-After, never
    a 500 or a pool timeout, and every key ends charged exactly once."""
    keys = [new_key() for _ in range(50)]
    answered: collections.Counter[str] = collections.Counter()

    def endpoint(rig: Rig) -> Endpoint:
        async def create(request: Request) -> StarletteResponse:
            key = request.headers["idempotency-key"]
            answered[key] += 1
            if answered[key] == 1:
                return JSONResponse({"error": "provider down"}, status_code=503)
            assert rig.charge is not None
            await rig.charge(key)
            return JSONResponse({"key": key}, status_code=201)

        return create

    async def until_created(client: httpx.AsyncClient, key: str) -> list[httpx.Response]:
        seen: list[httpx.Response] = []
        headers = {"X-User": "carol", "Idempotency-Key": key}
        for _ in range(40):  # a key that never settles fails the test, never hangs it
            seen.append(await client.post("/payments", json={}, headers=headers))
            if seen[-1].status_code == 201:
                break
            await asyncio.sleep(0.02)  # Retry-After, shortened for the test
        return seen

    async def race(url: str) -> list[httpx.Response]:
        # No keep-alive: a pooled connection the server closes as idle (uvicorn, after 5 s
        # on a loaded machine) while a POST is sent on it is an httpx.ReadError, not an answer.
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            racing = [until_created(client, key) for key in keys for _ in range(2)]
            return [answer for seen in await asyncio.gather(*racing) for answer in seen]

    # The store waits long for what it shares (SQLite's file lock, MySQL's one connection):
    # 300 statements through one connection of a loaded three-node Galera cluster may queue
    # past the default 5 s, while a request waiting on itself would still hang it.
    app = RigServer(kind, table_name, tmp_path, endpoint, busy_timeout=15.0)
    with served(app) as url:
        answers = asyncio.run(race(url))
        notes = app.rig.notes()
        states = [app.state(key) for key in keys]

    statuses = collections.Counter(answer.status_code for answer in answers)
    assert statuses[201] == 100  # both racing clients of every key got their 201
    assert set(statuses) <= {201, 409, 503}, statuses
    assert all(a.headers.get("retry-after") for a in answers if a.status_code == 409)
    assert statuses[503] == 50  # each key's transient, answered once, never stored
    assert sorted(notes) == sorted(keys)  # charged exactly once per key
    assert all(count == 2 for count in answered.values())  # the transient, then the charge
    assert states == [State.COMPLETED] * len(keys)


@MIDDLEWARE_STORES
def test_middleware_lost_lease_answers_409_and_the_sweepers_resolution_stands(
    kind: str, tmp_path: Path, table_name: str
) -> None:
    """The endpoint outlives the stale threshold and the sweeper ends its claim meanwhile.
    Its completion matches nothing: 409 lease-lost (on Galera the rule of
    ``Backend.lease_lost``: that, or a 503 when the sweeper's commit aborted the
    completion's). The endpoint's effect is not the middleware's to roll back; the record
    is what the sweeper made of it, and the retry runs. On every store."""
    clock = FrozenClock()
    calls: collections.Counter[str] = collections.Counter()

    def endpoint(rig: Rig) -> Endpoint:
        async def create(request: Request) -> StarletteResponse:
            calls["payments"] += 1
            if calls["payments"] == 1:
                clock.advance(POLICY.stale_seconds + 1)
                assert len(await async_sweep_away(rig.store, clock())) == 1
            return JSONResponse({"id": 1}, status_code=201)

        return create

    app = RigServer(kind, table_name, tmp_path, endpoint, clock)
    key = new_key()
    with served(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        answer = post(client, key)
        state = app.state(key)
        retry = post(client, key)
        lease_lost = app.rig.lease_lost

    slugs = {LeaseLost: (409, "lease-lost"), StoreUnavailable: (503, "store-unavailable")}
    assert any(answer.status_code == slugs[met][0] for met in lease_lost), answer.text
    status, slug = slugs[LeaseLost if answer.status_code == 409 else StoreUnavailable]
    assert_problem(answer, status, slug)
    assert state is State.RELEASED  # as the sweeper left it
    assert retry.status_code == 201
    assert calls["payments"] == 2


# Cancellation is the ASGI server's doing (a shutdown past its grace period cancels the
# request's task), so these two call the application as a server does, and cancel it.


def http_scope(key: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/payments",
        "raw_path": b"/payments",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"x-user", b"carol"),
            (b"idempotency-key", key.encode()),
            (b"content-type", b"application/json"),
            (b"content-length", b"2"),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
        "state": {},
    }


async def call_asgi(app: ASGIApp, key: str) -> list[Message]:
    """One request as a server sends it; the client then stays connected until the end."""
    sent: list[Message] = []
    delivered = False
    stays = asyncio.Event()

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await stays.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(http_scope(key), receive, send)
    return sent


def status_of(messages: list[Message]) -> int:
    return int(next(m["status"] for m in messages if m["type"] == "http.response.start"))


async def test_middleware_cancelled_while_claiming_leaves_no_claim(tmp_path: Path) -> None:
    """The server cancels the request while its claim is in flight: the claim finishes,
    the key is given back, the endpoint never runs, and the next request runs it."""
    calls: collections.Counter[str] = collections.Counter()

    async def create(request: Request) -> StarletteResponse:
        calls["payments"] += 1
        return JSONResponse({"id": 1}, status_code=201)

    with sqlite_store(tmp_path) as real:
        store = SignallingStore(real)
        app = middleware_app(AsyncIdempotency(store, POLICY), create)
        key = new_key()
        task = asyncio.create_task(call_asgi(app, key))
        await store.claim_sent.wait()
        store.cancel(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        left = await real.get("carol", key)
        retry = await call_asgi(app, key)

    assert left is None or left.state is State.RELEASED
    assert status_of(retry) == 201
    assert calls["payments"] == 1  # only the retry ran


@MIDDLEWARE_STORES
async def test_middleware_cancelled_mid_endpoint_keeps_the_claim_for_the_sweeper(
    kind: str, tmp_path: Path, table_name: str
) -> None:
    """The server cancels the request while the endpoint runs. Nothing the endpoint did
    rolls back (the middleware shares no transaction with it), and it may have made its
    external call: releasing would let the retry make it again. The key stays claimed
    (409 to the retry), and the sweeper asks the reconciler: here the call never went
    out, so the key is released and the next retry runs the endpoint. On every store,
    each on a pool of one connection the requests share."""
    clock = FrozenClock()
    entered = asyncio.Event()
    calls: collections.Counter[str] = collections.Counter()

    async def create(request: Request) -> StarletteResponse:
        calls["payments"] += 1
        if calls["payments"] == 1:
            entered.set()
            await asyncio.Event().wait()  # until cancelled
        return JSONResponse({"id": 1}, status_code=201)

    async def reconciler(record: idemflow.Record, downstream: Any) -> DidNotHappen:
        calls["asked"] += 1
        return DidNotHappen()

    async with open_rig(kind, table_name, tmp_path, transactional=False) as rig:
        store = rig.store
        app = middleware_app(AsyncIdempotency(store, POLICY, clock=clock), create)
        key = new_key()
        task = asyncio.create_task(call_asgi(app, key))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        left = await store.get("carol", key)
        busy = await call_asgi(app, key)
        clock.advance(POLICY.stale_seconds + 1)
        report = await AsyncSweeper(store, POLICY, reconciler=reconciler, clock=clock).sweep_once()
        retry = await call_asgi(app, key)

    assert left is not None
    assert left.state is State.IN_PROGRESS
    assert status_of(busy) == 409
    assert calls["asked"] == 1
    assert report.released == 1
    assert status_of(retry) == 201
    assert calls["payments"] == 2
