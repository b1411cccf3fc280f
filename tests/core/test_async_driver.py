"""
``AsyncIdempotency`` end to end on every async store, and the single-commit variant.

Each scenario runs the way an async service would: a fresh caller connection
per request (SQLAlchemy ``AsyncSession``/``AsyncConnection`` on aiosqlite or
psycopg, or a psycopg ``AsyncConnection``), the business row written through
it, the completion committed with it.

Single-commit mode (PostgreSQL, sync and async) puts the claim in the caller's
transaction too: a duplicate meeting the uncommitted claim is answered 409 in
milliseconds, a crash leaves no record at all, and a commit leaves a replayable one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pytest

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    Attempt,
    ConfigurationError,
    Idempotency,
    InProgress,
    Intent,
    KeyReused,
    LeaseLost,
    Outcome,
    Response,
    State,
)
from idemflow.stores.memory import AsyncMemoryStore
from idemflow.testing import FrozenClock
from idemflow.transactions import AsyncPsycopgTransaction, PsycopgTransaction
from tests.backends import Rig, async_rig_params, open_async_rig, postgres_notes, postgres_tables
from tests.conftest import POSTGRES_URL
from tests.factories import HANDLER_EXCEPTIONS, POLICY, assert_passed_through, intent
from tests.sweeping import async_sweep_away

CREATED = Response(201, b'{"id":"pay_1"}\xff', (("content-type", "application/json"), ("x-a", "1")))

#: Every kind's async store, a fresh caller connection per request (:attr:`Kind.async_rigs`).
BACKENDS = async_rig_params()


class Harness:
    """Runs operations the way an async service would, one caller transaction per request."""

    def __init__(self, backend: Rig, clock: FrozenClock) -> None:
        self.backend = backend
        self.clock = clock
        self.idem = AsyncIdempotency(backend.store, POLICY, clock=clock)
        self.calls = 0

    async def run(
        self,
        request: Intent,
        respond: Callable[[AsyncAttempt], Awaitable[Response]] | None = None,
    ) -> Outcome:
        async def handler(attempt: AsyncAttempt) -> Response:
            self.calls += 1
            # Respond first, write last: SQLite's one writer would queue the
            # duplicates some scenarios make from inside the handler.
            response = CREATED if respond is None else await respond(attempt)
            await self.backend.write(attempt.connection, f"{request.principal}/{request.key}")
            return response

        if self.backend.transaction is None:
            return await self.idem.run(request, handler)
        async with self.backend.transaction() as transaction:
            return await self.idem.run(request, handler, transaction=transaction)


@contextlib.asynccontextmanager
async def harness_for(name: str, tmp_path: Path, table: str) -> AsyncIterator[Harness]:
    async with open_async_rig(name, tmp_path, table) as backend:
        yield Harness(backend, FrozenClock())


def responding(response: Response) -> Callable[[AsyncAttempt], Awaitable[Response]]:
    async def respond(attempt: AsyncAttempt) -> Response:
        return response

    return respond


# --- the scenarios ------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("name", BACKENDS)
async def test_first_run_executes_once_and_completes(
    name: str, tmp_path: Path, table_name: str
) -> None:
    """An unseen key runs the handler once; effect and completed record both commit."""
    async with harness_for(name, tmp_path, table_name) as h:
        outcome = await h.run(intent())

        assert (outcome.response, outcome.replayed) == (CREATED, False)
        assert h.calls == 1
        assert h.backend.notes() == ["alice/k-1"]
        record = await h.backend.store.get("alice", "k-1")
        assert (record.state, record.response, record.correlation_id) == (
            State.COMPLETED,
            CREATED,
            "req-1",
        )


@pytest.mark.anyio
@pytest.mark.parametrize("name", BACKENDS)
async def test_retry_replays_verbatim(name: str, tmp_path: Path, table_name: str) -> None:
    """Status, headers and body bytes come back exactly; the handler does not run again."""
    async with harness_for(name, tmp_path, table_name) as h:
        await h.run(intent())

        replay = await h.run(intent(), responding(Response(500, b"must not run")))

        assert replay.replayed
        assert replay.response == CREATED
        assert replay.response.body.endswith(b"\xff")
        assert replay.response.headers == CREATED.headers
        assert (h.calls, h.backend.notes()) == (1, ["alice/k-1"])


@pytest.mark.anyio
@pytest.mark.parametrize("name", BACKENDS)
async def test_mismatch_is_key_reused(name: str, tmp_path: Path, table_name: str) -> None:
    """The same key for a different request is refused with 422, nothing runs."""
    async with harness_for(name, tmp_path, table_name) as h:
        await h.run(intent())

        with pytest.raises(KeyReused) as raised:
            await h.run(intent(fp="fp-other"))

        assert raised.value.status == 422
        assert h.calls == 1


@pytest.mark.anyio
@pytest.mark.parametrize("name", BACKENDS)
async def test_duplicate_in_flight_is_in_progress(
    name: str, tmp_path: Path, table_name: str
) -> None:
    """A duplicate arriving while the first runs gets 409 with Retry-After, at once."""
    async with harness_for(name, tmp_path, table_name) as h:
        seen: list[InProgress] = []

        async def meanwhile(attempt: AsyncAttempt) -> Response:
            with pytest.raises(InProgress) as raised:
                await h.idem.run(intent(), _never)
            seen.append(raised.value)
            return CREATED

        await h.run(intent(), meanwhile)

        assert [(e.status, e.retry_after) for e in seen] == [(409, 1)]
        assert h.calls == 1


async def _never(attempt: AsyncAttempt) -> Response:
    raise AssertionError("a duplicate must not run")


@pytest.mark.anyio
@pytest.mark.parametrize("name", BACKENDS)
async def test_transient_failure_releases_and_the_retry_runs(
    name: str, tmp_path: Path, table_name: str
) -> None:
    """A 503 is returned but not stored; its effect rolls back; the retry really runs."""
    async with harness_for(name, tmp_path, table_name) as h:
        first = await h.run(intent(), responding(Response(503, b"provider down")))

        assert (first.response.status, first.replayed) == (503, False)
        record = await h.backend.store.get("alice", "k-1")
        assert record.state is State.RELEASED
        if h.backend.transactional:
            assert h.backend.notes() == []

        second = await h.run(intent())

        assert (second.response, second.replayed) == (CREATED, False)
        assert second.record.attempt == 2
        assert h.calls == 2
        if h.backend.transactional:
            assert h.backend.notes() == ["alice/k-1"]


@pytest.mark.anyio
@pytest.mark.parametrize("name", BACKENDS)
@HANDLER_EXCEPTIONS
async def test_exception_passes_through_unchanged(
    name: str, tmp_path: Path, table_name: str, make_exception: Callable[[], Exception]
) -> None:
    """The handler's own exception object leaves ``run``, whatever its type; the key is
    released for a retry. (Raised as the handler is called, before any await: an
    ``async def`` handler's StopIteration is a RuntimeError before the driver sees it.)"""
    async with harness_for(name, tmp_path, table_name) as h:
        boom = make_exception()

        def explode(attempt: AsyncAttempt) -> Awaitable[Response]:
            raise boom

        with pytest.raises((type(boom), RuntimeError)) as raised:
            await h.run(intent(), explode)

        assert_passed_through(raised.value, boom, awaited=True)
        record = await h.backend.store.get("alice", "k-1")
        assert record.state is State.RELEASED
        if h.backend.transactional:
            assert h.backend.notes() == []
        assert (await h.run(intent())).response == CREATED


@pytest.mark.anyio
@pytest.mark.parametrize("name", BACKENDS)
async def test_lease_lost_rolls_back_the_business_write(
    name: str, tmp_path: Path, table_name: str
) -> None:
    """A claim taken over mid-flight cannot complete, and its business write never commits."""
    async with harness_for(name, tmp_path, table_name) as h:

        async def overrun(attempt: AsyncAttempt) -> Response:
            h.clock.advance(3601)  # past the stale threshold: the sweeper ends our claim
            assert len(await async_sweep_away(h.backend.store, h.clock())) == 1
            await Harness(h.backend, h.clock).run(intent(), responding(Response(201, b"new")))
            return CREATED

        with pytest.raises(LeaseLost) as raised:
            await h.run(intent(), overrun)

        assert raised.value.status == 409
        record = await h.backend.store.get("alice", "k-1")
        assert (record.state, record.response) == (State.COMPLETED, Response(201, b"new"))
        if h.backend.transactional:
            assert h.backend.notes() == ["alice/k-1"]  # only the new owner's effect


# --- configuration errors -----------------------------------------------------


@pytest.mark.anyio
async def test_memory_store_refuses_a_transaction() -> None:
    """A store that cannot share the caller's transaction says so before claiming."""
    store = AsyncMemoryStore()
    idem = AsyncIdempotency(store, POLICY)

    with pytest.raises(ConfigurationError, match="cannot share"):
        await idem.run(intent(), _never, transaction=object())  # type: ignore[arg-type]
    assert await store.get("alice", "k-1") is None


@pytest.mark.anyio
async def test_single_commit_needs_a_transaction() -> None:
    """single_commit without the caller's transaction is a configuration error."""
    with pytest.raises(ConfigurationError, match="single_commit"):
        await AsyncIdempotency(AsyncMemoryStore(), POLICY).run(intent(), _never, single_commit=True)


@pytest.mark.anyio
async def test_single_commit_is_refused_on_sqlite(tmp_path: Path, table_name: str) -> None:
    """SQLite admits one writer: single-commit mode is refused there, nothing is claimed."""
    async with open_async_rig("sqlite-sqlalchemy-connection", tmp_path, table_name) as backend:
        idem = AsyncIdempotency(backend.store, POLICY)
        assert backend.transaction is not None
        async with backend.transaction() as transaction:
            with pytest.raises(ConfigurationError, match="PostgreSQL"):
                await idem.run(intent(), _never, transaction=transaction, single_commit=True)
        assert await backend.store.get("alice", "k-1") is None


# --- single commit on PostgreSQL ------------------------------------------------

#: How long a handler is held at most: the duplicate is answered long before.
HELD_FOR_AT_MOST = 10.0


def committed_record_count(table: str) -> int:
    """Records visible to everyone else, i.e. committed."""
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture
def postgres_table(table_name: str) -> Iterator[str]:
    with postgres_tables(table_name):
        yield table_name


@pytest.fixture
def sync_store(postgres_table: str) -> Iterator[Any]:
    from idemflow.stores.postgres import PostgresStore

    store = PostgresStore(POSTGRES_URL, table=postgres_table, max_size=2, clock="caller")
    yield store
    store.close()


@contextlib.contextmanager
def psycopg_transaction() -> Iterator[PsycopgTransaction]:
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        yield PsycopgTransaction(conn)


def sync_single_commit(store: Any, table: str, handler: Callable[[Attempt], Response]) -> Outcome:
    with psycopg_transaction() as transaction:
        return Idempotency(store, POLICY).run(
            intent(), handler, transaction=transaction, single_commit=True
        )


def raised_by(run: Callable[[], Outcome]) -> BaseException | None:
    try:
        run()
    except BaseException as exc:
        return exc
    return None


@pytest.mark.postgres
def test_sync_single_commit_claims_in_the_callers_transaction(
    sync_store: Any, postgres_table: str
) -> None:
    """Claim, effect and completion commit as one: nobody sees the claim until the commit,
    and a duplicate meeting the uncommitted claim is answered 409 in well under the
    handler's duration."""
    table = postgres_table
    running = threading.Event()
    visible_during: list[int] = []

    answered = threading.Event()

    def slow(attempt: Attempt) -> Response:
        attempt.connection.execute(f"INSERT INTO biz_{table} (note) VALUES ('paid')")
        visible_during.append(committed_record_count(table))
        running.set()
        answered.wait(HELD_FOR_AT_MOST)  # held until the duplicate has its answer
        return CREATED

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(sync_single_commit, sync_store, table, slow)
        assert running.wait(5)
        error = raised_by(lambda: sync_single_commit(sync_store, table, _never_sync))
        while_held = not first.done()
        answered.set()
        outcome = first.result(10)

    assert isinstance(error, InProgress), error
    assert while_held  # answered while the first still held its claim, not after it
    assert visible_during == [0]  # the uncommitted claim was invisible to everyone else
    assert (outcome.response, outcome.replayed) == (CREATED, False)
    record = sync_store.get("alice", "k-1")
    assert record.state is State.COMPLETED
    assert postgres_notes(table)() == ["paid"]

    replay = sync_single_commit(sync_store, table, _never_sync)
    assert (replay.replayed, replay.response) == (True, CREATED)


def _never_sync(attempt: Attempt) -> Response:
    raise AssertionError("a duplicate must not run")


@pytest.mark.postgres
@HANDLER_EXCEPTIONS
def test_sync_single_commit_crash_leaves_no_record(
    sync_store: Any, postgres_table: str, make_exception: Callable[[], Exception]
) -> None:
    """A handler that fails rolls back claim and effect together: the key was never used.
    Its exception, whatever its type, is the one the caller gets."""
    crashed = make_exception()

    def crash(attempt: Attempt) -> Response:
        attempt.connection.execute(f"INSERT INTO biz_{postgres_table} (note) VALUES ('lost')")
        raise crashed

    with pytest.raises(type(crashed)) as raised:
        sync_single_commit(sync_store, postgres_table, crash)

    assert raised.value is crashed

    assert sync_store.get("alice", "k-1") is None
    assert postgres_notes(postgres_table)() == []
    retry = sync_single_commit(sync_store, postgres_table, lambda attempt: CREATED)
    assert (retry.replayed, retry.record.attempt) == (False, 1)


@pytest.mark.anyio
@pytest.mark.postgres
async def test_async_single_commit_duplicate_is_answered_at_once(postgres_table: str) -> None:
    """Async single-commit: the duplicate of an uncommitted claim gets 409 in milliseconds."""
    import psycopg

    from idemflow.stores.postgres import AsyncPostgresStore

    store = AsyncPostgresStore(POSTGRES_URL, table=postgres_table, max_size=2, clock="caller")
    idem = AsyncIdempotency(store, POLICY)
    running, answered = anyio.Event(), anyio.Event()
    while_held: list[bool] = []

    async def run(handler: Callable[[AsyncAttempt], Awaitable[Response]]) -> Outcome:
        async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as conn:
            transaction = AsyncPsycopgTransaction(conn)
            return await idem.run(intent(), handler, transaction=transaction, single_commit=True)

    async def slow(attempt: AsyncAttempt) -> Response:
        await attempt.connection.execute(f"INSERT INTO biz_{postgres_table} (note) VALUES ('paid')")
        running.set()
        with anyio.fail_after(HELD_FOR_AT_MOST):
            await answered.wait()  # held until the duplicate has its answer
        return CREATED

    async def duplicate() -> None:
        await running.wait()
        assert committed_record_count(postgres_table) == 0
        with pytest.raises(InProgress):
            await run(_never)
        while_held.append(not answered.is_set())
        answered.set()

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(duplicate)
            first = await run(slow)
        assert first.response == CREATED
        assert while_held == [True]  # answered while the first still held its claim
        assert (await run(_never)).replayed
        assert postgres_notes(postgres_table)() == ["paid"]

        async def crash(attempt: AsyncAttempt) -> Response:
            raise RuntimeError("crash")

        other = Intent("alice", "k-2", "fp-1")
        async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as conn:
            with pytest.raises(RuntimeError):
                await idem.run(
                    other, crash, transaction=AsyncPsycopgTransaction(conn), single_commit=True
                )
        assert await store.get("alice", "k-2") is None
    finally:
        await store.close()


@pytest.mark.anyio
@pytest.mark.postgres
@HANDLER_EXCEPTIONS
async def test_async_single_commit_crash_leaves_no_record(
    postgres_table: str, make_exception: Callable[[], Exception]
) -> None:
    """Async single-commit: a handler that fails after its write rolls back claim and write
    together, and its exception is the caller's (a StopIteration as the cause of the
    RuntimeError Python makes of it on the way out of a coroutine)."""
    import psycopg

    from idemflow.stores.postgres import AsyncPostgresStore

    store = AsyncPostgresStore(POSTGRES_URL, table=postgres_table, max_size=1, clock="caller")
    crashed = make_exception()

    def crash(attempt: AsyncAttempt) -> Awaitable[Response]:
        raise crashed

    async def write_then_crash(attempt: AsyncAttempt) -> Response:
        await attempt.connection.execute(f"INSERT INTO biz_{postgres_table} (note) VALUES ('x')")
        return await crash(attempt)

    try:
        async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as conn:
            with pytest.raises((type(crashed), RuntimeError)) as raised:
                await AsyncIdempotency(store, POLICY).run(
                    intent(),
                    write_then_crash,
                    transaction=AsyncPsycopgTransaction(conn),
                    single_commit=True,
                )
        assert_passed_through(raised.value, crashed, awaited=True)
        assert await store.get("alice", "k-1") is None
        assert postgres_notes(postgres_table)() == []
    finally:
        await store.close()


def _single_commit_child(table: str, ready: Any) -> None:
    """Runs in a child process: claims in single-commit mode and hangs inside the handler."""
    from idemflow.stores.postgres import PostgresStore

    store = PostgresStore(POSTGRES_URL, table=table, max_size=1, clock="caller")

    def hang(attempt: Attempt) -> Response:
        attempt.connection.execute(f"INSERT INTO biz_{table} (note) VALUES ('doomed')")
        ready.set()
        time.sleep(60)
        return CREATED

    sync_single_commit(store, table, hang)


@pytest.mark.postgres
@pytest.mark.slow
def test_killed_single_commit_process_leaves_no_record(
    sync_store: Any, postgres_table: str
) -> None:
    """SIGKILL mid-handler: PostgreSQL aborts the transaction, so no claim survives to block
    the key and no sweeper is needed; the next attempt runs as the first."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=_single_commit_child, args=(postgres_table, ready))
    child.start()
    try:
        assert ready.wait(30), "child never reached its handler"
        error = raised_by(lambda: sync_single_commit(sync_store, postgres_table, _never_sync))
        assert isinstance(error, InProgress)
        assert child.is_alive()  # answered while the child still held its claim
    finally:
        child.kill()
        child.join(10)

    outcome = _first_run_after_kill(sync_store, postgres_table)
    assert (outcome.replayed, outcome.record.attempt) == (False, 1)
    assert postgres_notes(postgres_table)() == ["after"]


def _first_run_after_kill(store: Any, table: str) -> Outcome:
    """PostgreSQL notices the dead client within moments; until then the claim is held."""

    def after(attempt: Attempt) -> Response:
        attempt.connection.execute(f"INSERT INTO biz_{table} (note) VALUES ('after')")
        return CREATED

    deadline = time.monotonic() + 10
    while True:
        try:
            return sync_single_commit(store, table, after)
        except InProgress:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
