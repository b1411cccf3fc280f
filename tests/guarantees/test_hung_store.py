"""
A hung store: it accepts the request's bytes and never answers.

A private redis-server frozen with SIGSTOP (the kernel still accepts connections and
buffers what clients send; resumed, Redis runs it all, also for clients that gave up),
and a SQLite file whose write lock another connection holds past the store's
``busy_timeout``. Where a client timeout turns the hang into ``StoreUnavailable``, every
answer is bounded and nothing runs twice, without a transaction (sync and async
drivers) and behind the ASGI middleware:

- frozen before the claim: a 503 within the client's bound, the handler never runs; a
  claim Redis runs from its buffer once resumed is a key nobody runs, which the sweeper
  resolves, and the retry then runs once;
- frozen after a settled answer: the completion is lost, never released (503 "could not
  be recorded"); resumed, the record is completed (the buffered completion ran: the
  retry replays) or claimed until the sweeper's reconciler settles it: one charge;
- frozen before a transient answer: the release waits out the client and is sent once,
  not ``RELEASE_ATTEMPTS`` times (``_flow.RELEASE_RETRY_WITHIN_SECONDS``): a second
  would wait as long again before the caller hears anything. The same rule where the
  wait is SQLite's lock.

PostgreSQL has no client bound (psycopg sets none, ``statement_timeout`` is the server's):
a private server stopped whole after the charge, a duplicate sent meanwhile, is waited
for in every mode (no transaction, two commits, one), and once resumed the request is
completed and the duplicate replays it or hears 409: one charge.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    Event,
    Idempotency,
    IdempotencyError,
    Policy,
    Record,
    Response,
    State,
)
from idemflow._errors import PROBLEM_BASE
from idemflow._events import CountingObserver
from idemflow._http import PROBLEM_CONTENT_TYPE, REPLAYED_HEADER
from idemflow.stores.sqlite import AsyncSQLiteStore, SQLiteStore, connect
from idemflow.sweeper import Answer, AsyncSweeper, DidNotHappen, Happened, Sweeper
from idemflow.testing import FrozenClock
from idemflow.transactions import SQLite3Transaction
from tests._private_redis import freeze, own_redis_server, thaw, wait_until_drained
from tests.backends import KINDS, kinds
from tests.conftest import unreachable
from tests.factories import CREATED
from tests.factories import uncorrelated_intent as intent

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

POLICY = Policy(request_timeout=5)
UNAVAILABLE = Response(503, b"provider down")
#: How a request reaches the driver: ``run()`` (sync, async), or the ASGI middleware.
MODES = ("sync", "async", "middleware")
#: The modes whose store and sweeper are sync ("two-commit": a request's transaction).
SYNC_MODES = ("sync", "two-commit")

#: redis-py's wait for each reply: short, so a hang becomes a 503 soon.
SOCKET_TIMEOUT = 0.7
#: Bounded retries, as the Redis store's docstring advises; the backoff between them.
RETRIES, BACKOFF_CAP = 2, 0.5
#: The least one store call takes against a frozen Redis: every attempt waits its timeout.
ONE_CALL_AT_LEAST = (1 + RETRIES) * SOCKET_TIMEOUT
#: And the most (generous): an attempt may wait twice (a reconnection's handshake, then
#: its command), plus the backoffs. Three releases, each waiting ONE_CALL_AT_LEAST, are past it.
ONE_CALL_AT_MOST = (1 + RETRIES) * 2 * SOCKET_TIMEOUT + RETRIES * BACKOFF_CAP
#: SQLite's wait for another connection's write lock (``busy_timeout``).
BUSY_TIMEOUT = 0.6


class Boom(Exception):
    """The handler's own exception."""


# --- counting releases ---------------------------------------------------------------


class CountingSQLiteStore(SQLiteStore):
    releases = 0

    def release(self, *args: Any, **kwargs: Any) -> bool:
        self.releases += 1
        return super().release(*args, **kwargs)


class AsyncCountingSQLiteStore(AsyncSQLiteStore):
    releases = 0

    async def release(self, *args: Any, **kwargs: Any) -> bool:
        self.releases += 1
        return await super().release(*args, **kwargs)


def redis_stores() -> tuple[type[Any], type[Any]]:
    """The sync and async Redis stores, counting the releases they are sent."""
    from idemflow.stores.redis import AsyncRedisStore, RedisStore

    class CountingRedisStore(RedisStore):
        releases = 0

        def release(self, *args: Any, **kwargs: Any) -> bool:
            self.releases += 1
            return super().release(*args, **kwargs)

    class AsyncCountingRedisStore(AsyncRedisStore):
        releases = 0

        async def release(self, *args: Any, **kwargs: Any) -> bool:
            self.releases += 1
            return await super().release(*args, **kwargs)

    return CountingRedisStore, AsyncCountingRedisStore


# --- one store in one mode --------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What the caller got, and how long it waited for it."""

    status: int | None  # None: the handler's own exception came through
    problem: str | None  # the problem type's slug, for one of idemflow's answers
    detail: str
    replayed: bool
    seconds: float


@dataclass(frozen=True)
class Driven:
    """One store (counting its releases) driven in one mode: requests, records, sweeps."""

    mode: str
    store: Any
    #: Two commits (sync): opens the connection of the request's own transaction.
    connect: Callable[[], sqlite3.Connection] | None = None
    #: What every request's driver reported.
    counted: CountingObserver = field(default_factory=CountingObserver)

    async def ask(self, key: str, act: Callable[[], Response]) -> Reply:
        """One request under ``key`` whose handler answers ``act()``."""
        started = time.monotonic()
        try:
            if self.mode == "middleware":
                status, problem, detail, replayed = await self._post(key, act)
            else:
                status, problem, detail, replayed = await self._run(key, act)
        except Boom:
            status, problem, detail, replayed = None, None, "", False
        return Reply(status, problem, detail, replayed, time.monotonic() - started)

    async def record(self, key: str) -> Record | None:
        if self.mode in SYNC_MODES:
            found: Record | None = self.store.get("alice", key)
            return found
        return await self.store.get("alice", key)  # type: ignore[no-any-return]

    async def sweep(self, reconcile: Callable[[], Answer]) -> None:
        """One pass past the stale threshold; the reconciler answers ``reconcile()``."""
        clock = FrozenClock(time.time() + POLICY.stale_seconds + 1)
        if self.mode in SYNC_MODES:
            sweeper = Sweeper(self.store, POLICY, reconciler=lambda r, k: reconcile(), clock=clock)
            sweeper.sweep_once()
            return

        async def areconcile(record: Record, keys: Any) -> Answer:
            return reconcile()

        await AsyncSweeper(self.store, POLICY, reconciler=areconcile, clock=clock).sweep_once()

    async def _run(
        self, key: str, act: Callable[[], Response]
    ) -> tuple[int, str | None, str, bool]:
        try:
            if self.mode == "sync":
                # A frozen clock, as tests inject one: the release's wait is timed on the
                # monotonic clock, never on the one that dates records.
                idem = Idempotency(
                    self.store, POLICY, clock=FrozenClock(time.time()), observer=self.counted
                )
                outcome = idem.run(intent(key), lambda a: act())
            elif self.mode == "two-commit":
                assert self.connect is not None
                with contextlib.closing(self.connect()) as conn:
                    outcome = Idempotency(self.store, POLICY, observer=self.counted).run(
                        intent(key), lambda a: act(), transaction=SQLite3Transaction(conn)
                    )
            else:

                async def handler(attempt: AsyncAttempt) -> Response:
                    return act()

                driver = AsyncIdempotency(self.store, POLICY, observer=self.counted)
                outcome = await driver.run(intent(key), handler)
        except IdempotencyError as error:
            return error.status, error.slug, error.detail, False
        return outcome.response.status, None, "", outcome.replayed

    async def _post(
        self, key: str, act: Callable[[], Response]
    ) -> tuple[int, str | None, str, bool]:
        httpx = pytest.importorskip("httpx")
        from starlette.applications import Starlette
        from starlette.middleware import Middleware
        from starlette.responses import Response as StarletteResponse
        from starlette.routing import Route

        from idemflow.integrations.starlette import IdempotencyMiddleware

        async def endpoint(request: Any) -> StarletteResponse:
            answer = act()
            return StarletteResponse(answer.body, status_code=answer.status)

        app = Starlette(
            routes=[Route("/payments", endpoint, methods=["POST"])],
            middleware=[
                Middleware(
                    IdempotencyMiddleware,
                    idempotency=AsyncIdempotency(self.store, POLICY, observer=self.counted),
                    endpoints=["POST /payments"],
                    principal=lambda scope: "alice",
                )
            ],
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            got = await client.post("/payments", json={}, headers={"Idempotency-Key": key})
        problem = got.json() if got.headers.get("content-type") == PROBLEM_CONTENT_TYPE else {}
        slug = problem["type"].removeprefix(PROBLEM_BASE) if problem else None
        replayed = got.headers.get(REPLAYED_HEADER) == "true"
        return got.status_code, slug, problem.get("detail", ""), replayed


class Provider:
    """What the handler calls: every answer it gave, and what its reconciler says."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def charge(self) -> Response:
        self.calls.append("charged")
        return CREATED

    def fail(self) -> Response:
        self.calls.append("failed")
        return UNAVAILABLE

    def reconcile(self) -> Answer:
        return Happened(CREATED) if "charged" in self.calls else DidNotHappen("never charged")


# --- Redis, frozen ---------------------------------------------------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    pytest.importorskip("redis")
    with own_redis_server(tmp_path) as server:
        yield server


@contextlib.asynccontextmanager
async def driven_redis(mode: str, url: str) -> AsyncIterator[Driven]:
    """A started Redis store (its scripts loaded: what hangs is the request's own script)
    whose client gives up after ``SOCKET_TIMEOUT``, ``RETRIES`` times."""
    from redis import Redis
    from redis.asyncio import Redis as AsyncRedis
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    sync_store, async_store = redis_stores()
    options: dict[str, Any] = {"socket_timeout": SOCKET_TIMEOUT, "socket_connect_timeout": 1}
    backoff = ExponentialBackoff(cap=BACKOFF_CAP, base=0.05)
    settings: dict[str, Any] = {"prefix": "hung", "clock": "caller", "allow_volatile": True}
    if mode == "sync":
        client = Redis.from_url(url, retry=Retry(backoff, RETRIES), **options)
        store = sync_store(client, **settings)
        store.start()
        try:
            yield Driven(mode, store)
        finally:
            store.close()
        return
    # redis.asyncio's own Retry: its client only awaits a coroutine through one.
    aclient = AsyncRedis.from_url(url, retry=AsyncRetry(backoff, RETRIES), **options)
    astore = async_store(aclient, **settings)
    await astore.start()
    try:
        yield Driven(mode, astore)
    finally:
        await astore.close()


@pytest.mark.redis
@pytest.mark.parametrize("mode", MODES)
async def test_redis_frozen_before_the_claim_is_a_bounded_503_and_the_retry_runs_once(
    mode: str, redis_server: tuple[subprocess.Popen[bytes], str]
) -> None:
    """The claim's script waits for a frozen server until the client gives up: a 503, the
    handler unrun. Resumed, Redis may run that script from its buffer: the key is then
    claimed with nobody running it (409) until the sweeper releases it. One run in all."""
    process, url = redis_server
    provider = Provider()
    async with driven_redis(mode, url) as driven:
        freeze(process)
        answer = await driven.ask("k-hung", provider.charge)
        thaw(process)
        await asyncio.to_thread(wait_until_drained, url)
        left = await driven.record("k-hung")
        early = await driven.ask("k-hung", provider.charge)
        ran_before_the_sweeper = list(provider.calls)
        await driven.sweep(provider.reconcile)
        retry = await driven.ask("k-hung", provider.charge)
        record = await driven.record("k-hung")

    assert (answer.status, answer.problem) == (503, "store-unavailable")
    assert ONE_CALL_AT_LEAST <= answer.seconds <= ONE_CALL_AT_MOST, answer.seconds
    assert left is None or left.state is State.IN_PROGRESS
    if left is not None:  # the buffered claim ran: nobody's, until the sweeper
        assert (early.status, early.problem, ran_before_the_sweeper) == (409, "in-progress", [])
        assert (retry.status, retry.replayed) == (201, False)
    else:
        assert (early.status, early.replayed, retry.replayed) == (201, False, True)
    assert provider.calls == ["charged"]
    assert record is not None
    assert record.state is State.COMPLETED
    assert driven.store.releases == 0


@pytest.mark.redis
@pytest.mark.parametrize("mode", MODES)
async def test_redis_frozen_after_the_charge_keeps_the_outcome_and_never_charges_again(
    mode: str, redis_server: tuple[subprocess.Popen[bytes], str]
) -> None:
    """The handler charges, the server freezes, the handler answers 201: its completion
    cannot be written, and is not given back (a retry would charge again): a 503 that says
    so, within the client's bound. Resumed, the record is completed with that 201 (Redis
    ran the buffered completion) or still claimed, until the sweeper's reconciler settles
    it. Either way the retry replays the one charge."""
    process, url = redis_server
    provider = Provider()

    def charge_then_freeze() -> Response:
        answer = provider.charge()
        freeze(process)
        return answer

    async with driven_redis(mode, url) as driven:
        answer = await driven.ask("k-hung", charge_then_freeze)
        thaw(process)
        await asyncio.to_thread(wait_until_drained, url)
        left = await driven.record("k-hung")
        early = await driven.ask("k-hung", provider.charge)
        await driven.sweep(provider.reconcile)
        retry = await driven.ask("k-hung", provider.charge)

    assert (answer.status, answer.problem) == (503, "store-unavailable")
    assert "could not be recorded" in answer.detail
    assert ONE_CALL_AT_LEAST <= answer.seconds <= ONE_CALL_AT_MOST, answer.seconds
    assert left is not None
    assert left.state in (State.COMPLETED, State.IN_PROGRESS)
    if left.state is State.COMPLETED:  # the buffered completion ran
        assert left.response is not None
        assert left.response.status == 201
        assert (early.status, early.replayed) == (201, True)
    else:
        assert (early.status, early.problem) == (409, "in-progress")
    assert (retry.status, retry.replayed) == (201, True)
    assert provider.calls == ["charged"]
    assert driven.store.releases == 0


@pytest.mark.redis
@pytest.mark.parametrize("mode", MODES)
async def test_redis_frozen_before_a_transient_answer_sends_one_release_that_waited(
    mode: str, redis_server: tuple[subprocess.Popen[bytes], str]
) -> None:
    """The server freezes, the handler answers 503: the release waits until the client
    gives up, and is not sent again (each would wait as long: the caller hears its 503
    after one wait, not three). Resumed, the key is released (Redis ran the buffered
    release) or claimed for the sweeper; the retry runs, and its 201 is what is stored."""
    process, url = redis_server
    provider = Provider()

    def freeze_then_fail() -> Response:
        freeze(process)
        return provider.fail()

    async with driven_redis(mode, url) as driven:
        answer = await driven.ask("k-hung", freeze_then_fail)
        releases = driven.store.releases
        thaw(process)
        await asyncio.to_thread(wait_until_drained, url)
        left = await driven.record("k-hung")
        await driven.sweep(provider.reconcile)
        retry = await driven.ask("k-hung", provider.charge)
        record = await driven.record("k-hung")

    assert (answer.status, answer.problem) == (503, None)  # the handler's own 503
    assert releases == 1
    assert ONE_CALL_AT_LEAST <= answer.seconds <= ONE_CALL_AT_MOST, answer.seconds
    assert left is not None
    assert left.state in (State.RELEASED, State.IN_PROGRESS)
    assert (retry.status, retry.replayed) == (201, False)
    assert provider.calls == ["failed", "charged"]
    assert record is not None
    assert record.response is not None
    assert (record.state, record.response.status) == (State.COMPLETED, 201)


# --- SQLite, locked -----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def driven_sqlite(mode: str, path: Path) -> AsyncIterator[Driven]:
    if mode in SYNC_MODES:
        store = CountingSQLiteStore(path, busy_timeout=BUSY_TIMEOUT)
        store.migrate()
        try:
            yield Driven(mode, store, lambda: connect(path, busy_timeout=BUSY_TIMEOUT))
        finally:
            store.close()
        return
    astore = AsyncCountingSQLiteStore(path, busy_timeout=BUSY_TIMEOUT)
    await astore.migrate()
    try:
        yield Driven(mode, astore)
    finally:
        await astore.close()


@pytest.mark.parametrize("failure", ["transient", "exception"])
@pytest.mark.parametrize("mode", [*MODES, "two-commit"])
async def test_a_release_that_waited_out_sqlites_lock_is_not_sent_again(
    mode: str, failure: str, tmp_path: Path
) -> None:
    """Another connection takes the file's write lock (``BEGIN IMMEDIATE``) and holds it
    while the handler fails (a 503, or its own exception): the release waits out the
    store's ``busy_timeout`` and is not sent again. With two commits the release goes
    through the request's own connection, which waits as long: the store is the same
    file, so it is not sent again through the store's connection either. The key stays
    claimed (SQLite ran nothing); with the lock given back, the sweeper releases it and
    the retry runs once."""
    path = tmp_path / "keys.db"
    provider = Provider()
    blocker = sqlite3.connect(path, isolation_level=None)

    def lock_then_fail() -> Response:
        blocker.execute("BEGIN IMMEDIATE")
        if failure == "exception":
            provider.calls.append("raised")
            raise Boom("the handler's own failure")
        return provider.fail()

    async with driven_sqlite(mode, path) as driven:
        try:
            answer = await driven.ask("k-locked", lock_then_fail)
        finally:
            blocker.rollback()
            blocker.close()
        left = await driven.record("k-locked")
        releases = driven.store.releases
        await driven.sweep(provider.reconcile)
        retry = await driven.ask("k-locked", provider.charge)

    assert answer.status == (503 if failure == "transient" else None)
    assert releases == 1
    # The release that failed is counted as such, never as released.
    assert driven.counted.total(Event.RELEASE_FAILED) == 1
    assert driven.counted.total(Event.RELEASED) == 0
    assert left is not None
    assert left.state is State.IN_PROGRESS  # the sweeper's
    assert (retry.status, retry.replayed) == (201, False)
    assert provider.calls == ["failed" if failure == "transient" else "raised", "charged"]


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_release_that_waited_out_a_short_store_wait_is_not_sent_again(
    mode: str, tmp_path: Path
) -> None:
    """``Policy(request_timeout=0.4)``: the store's wait (SQLite's ``busy_timeout``) is
    0.2 s, shorter than ``RELEASE_RETRY_WITHIN_SECONDS``; a release that waited it out
    waited for the store all the same, and is not sent again (three would hold the
    request 0.6 s, past its timeout). The key is the sweeper's."""
    short = Policy(request_timeout=0.4)
    path = tmp_path / "keys.db"
    provider = Provider()
    blocker = sqlite3.connect(path, isolation_level=None)

    def lock_then_fail() -> Response:
        blocker.execute("BEGIN IMMEDIATE")
        return provider.fail()

    try:
        if mode == "sync":
            store: Any = CountingSQLiteStore(path, policy=short)
            store.migrate()
            outcome = Idempotency(store, short).run(intent("k-short"), lambda a: lock_then_fail())
            store.close()
        else:

            async def handler(attempt: AsyncAttempt) -> Response:
                return lock_then_fail()

            store = AsyncCountingSQLiteStore(path, policy=short)
            await store.migrate()
            outcome = await AsyncIdempotency(store, short).run(intent("k-short"), handler)
            await store.close()
    finally:
        blocker.rollback()
        blocker.close()

    assert outcome.response.status == 503  # the handler's own
    assert store.releases == 1
    assert provider.calls == ["failed"]


# --- PostgreSQL stopped whole, in every mode ----------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("mode", ["no-transaction", "two-commit", "single-commit"])
async def test_postgresql_frozen_after_the_charge_then_resumed_charges_once(mode: str) -> None:
    """Every PostgreSQL process stopped (SIGSTOP) right after the charge, a duplicate sent
    meanwhile. psycopg bounds nothing on the client, so the completion and the duplicate's
    claim wait for the server (docs/stores.md, "A database that stops answering"); resumed
    a second later, the request is completed and the duplicate replays it or hears 409
    (its claim met the live claim), never runs: one charge, in every mode. The request's
    own writes wait the same way, so no client bound of ours would have shortened it."""
    import asyncio
    import threading

    psycopg_pool = pytest.importorskip("psycopg_pool")
    from idemflow import InProgress
    from idemflow.edge import async_pooled_transaction
    from idemflow.stores.postgres import (
        DEFAULT_CLAIM_LOCK_TIMEOUT_MS,
        AsyncPostgresStore,
        connection_options,
    )
    from idemflow.transactions import AsyncPsycopgTransaction
    from tests._private_postgres import PrivatePostgresUnavailable, private_postgres

    transactional = mode != "no-transaction"
    charged: list[str] = []
    duplicates: list[asyncio.Future[Any]] = []
    held: list[float] = []  # how long the first request took: the freeze held it

    async def run(idem: AsyncIdempotency, store: Any, handler: Any) -> Any:
        if not transactional:
            return await idem.run(intent("k-frozen"), handler)
        opened = async_pooled_transaction(store.connection, AsyncPsycopgTransaction)
        async with opened as transaction:
            return await idem.run(
                intent("k-frozen"),
                handler,
                transaction=transaction,
                single_commit=mode == "single-commit",
            )

    async def scenario(cluster: Any) -> tuple[Any, Any, list[tuple[Any, ...]]]:
        options = connection_options(DEFAULT_CLAIM_LOCK_TIMEOUT_MS)
        pool = psycopg_pool.AsyncConnectionPool(
            cluster.url, min_size=2, max_size=2, kwargs=options, open=False, timeout=30
        )
        await pool.open(wait=True)
        try:
            store = AsyncPostgresStore(pool)
            await store.migrate()
            async with pool.connection() as conn:
                await conn.execute("CREATE TABLE biz (note TEXT)")
            idem = AsyncIdempotency(store, POLICY)

            async def never(attempt: AsyncAttempt) -> Response:
                charged.append("the duplicate ran")
                return CREATED

            async def charge(attempt: AsyncAttempt) -> Response:
                if transactional:
                    await attempt.connection.execute("INSERT INTO biz VALUES ('charged')")
                else:
                    charged.append("charged")
                cluster.freeze()
                threading.Timer(1.0, cluster.thaw).start()
                duplicates.append(asyncio.ensure_future(run(idem, store, never)))
                await asyncio.sleep(0.2)  # the duplicate's claim is sent, and waits
                return CREATED

            began = time.monotonic()
            first = await run(idem, store, charge)
            held.append(time.monotonic() - began)
            try:
                again = await duplicates[0]
            except InProgress as exc:
                again = exc
            async with pool.connection() as conn:
                rows = await (await conn.execute("SELECT note FROM biz")).fetchall()
            record = await store.get("alice", "k-frozen")
            return (first, record), again, rows
        finally:
            await pool.close()

    try:
        with private_postgres() as cluster:
            (first, record), again, rows = await scenario(cluster)
    except PrivatePostgresUnavailable as exc:
        unreachable("a private PostgreSQL", exc)

    assert held[0] >= 1.0  # its completion waited for the server
    assert first.response == CREATED
    assert not first.replayed
    assert isinstance(again, InProgress) or (again.replayed and again.response == CREATED)
    assert record is not None
    assert record.state is State.COMPLETED
    assert charged + [row[0] for row in rows] == ["charged"]


# --- every store, hung, within the request's own budget ---------------------------------

#: A short request timeout: each store call waits at most its store wait (1 s), half the
#: budget; the other second is slack for a loaded CI machine's stalls (a Redis Cluster
#: 503 that takes 0.6 s alone once came after 1 s under the whole suite).
BUDGETED = Policy(request_timeout=2)


def hung_store(kind: str, tmp_path: Path, policy: Policy | None) -> Any:
    """A started async store of ``kind`` made with ``policy`` on the caller's clock (the
    sweeper's frozen clock must see its claims as stale); how to hang it; how to resume
    it (safe to call twice): :attr:`Kind.hung`."""
    hung = KINDS[kind].hung
    assert hung is not None
    return hung(tmp_path, policy)


async def _prepared(store: Any) -> None:
    """Tables made, scripts loaded, one pooled connection: what hangs is the claim."""
    if hasattr(store, "migrate"):
        await store.migrate()
    else:
        await store.start()
    await store.get("alice", "k-warm")


#: Every kind with a private copy to hang (:attr:`Kind.hung`).
HUNG_KINDS = [kind.param for kind in kinds() if kind.hung is not None]


@pytest.mark.parametrize("moment", ["before-the-claim", "after-the-charge"])
@pytest.mark.parametrize("kind", HUNG_KINDS)
async def test_a_hung_store_answers_503_within_the_request_budget_and_the_key_resolves(
    kind: str, moment: str, tmp_path: Path
) -> None:
    """``Policy(request_timeout=1)``: a store that stops answering (SIGSTOP; SQLite's
    write lock held) is a 503 within the request timeout, whatever the store: every wait
    of the store's own (connect, checkout, reads, the client's retries, busy_timeout)
    fits in ``store_wait_seconds``. Before, a frozen Redis held the request 15 s (a 5 s
    socket timeout, retried), PostgreSQL and MariaDB until the server came back.

    Hung before the claim: the handler never runs; resumed, a claim the server ran from
    its buffer is the sweeper's, and the retry runs once. Hung after the charge: the
    completion that timed out is an unknown outcome, never given back (503 "could not
    be recorded"); resumed, the record is completed (the buffered completion ran) or
    the sweeper's reconciler settles it: the retry replays the one charge."""
    import asyncio
    import threading

    from idemflow import InProgress, StoreUnavailable

    provider = Provider()
    before_the_claim = moment == "before-the-claim"

    with hung_store(kind, tmp_path, BUDGETED) as (store, hang, resume):

        async def handler(attempt: AsyncAttempt) -> Response:
            answer = provider.charge()
            if not before_the_claim:
                hang()
            return answer

        async def reconcile(record: Record, keys: Any) -> Answer:
            return provider.reconcile()

        await _prepared(store)
        idem = AsyncIdempotency(store, BUDGETED)
        # The store is resumed once the request's budget has passed: a 503 that came
        # later (no bound) came after this rescue, and the request never hangs the run.
        rescued = threading.Event()

        def rescue() -> None:
            rescued.set()
            resume()

        safety = threading.Timer(BUDGETED.timeout_seconds, rescue)
        if before_the_claim:
            hang()
        safety.start()
        refused: StoreUnavailable | None = None
        began = time.monotonic()
        try:
            try:
                await idem.run(intent("k-hung"), handler)
            except StoreUnavailable as raised:
                refused = raised
            in_budget = not rescued.is_set()
            answered_after = time.monotonic() - began
        finally:
            safety.cancel()
            resume()
        ran_while_hung = list(provider.calls)
        # The sweeper (past the threshold) ends a claim the server ran late, until the
        # retry is answered: the server may run its buffer after a first pass.
        clock = FrozenClock(time.time() + BUDGETED.stale_seconds + 1)
        sweeper = AsyncSweeper(store, BUDGETED, reconciler=reconcile, clock=clock)
        deadline = time.monotonic() + 20
        while True:
            await sweeper.sweep_once()
            try:
                retry = await idem.run(intent("k-hung"), handler)
                break
            except (InProgress, StoreUnavailable):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        record = await store.get("alice", "k-hung")
        await store.close()

    assert in_budget, f"past the request's budget: the 503 came after {answered_after:.2f} s"
    assert refused is not None
    assert ran_while_hung == ([] if before_the_claim else ["charged"])
    if not before_the_claim:
        assert "could not be recorded" in str(refused)
    assert (retry.response.status, retry.replayed) == (201, not before_the_claim)
    assert provider.calls == ["charged"]
    assert record is not None
    assert record.state is State.COMPLETED


#: The kinds told the driver's store wait (:attr:`Kind.covers_store_wait`). Redis and
#: MariaDB are not: told it, the partitioned-network storm left keys unresolved on both
#: (CHANGELOG, "Fixed").
TOLD_KINDS = [kind.param for kind in kinds(covers_store_wait=True) if kind.hung is not None]


@pytest.mark.parametrize("kind", TOLD_KINDS)
async def test_a_store_built_without_the_policy_waits_within_the_drivers_budget(
    kind: str, tmp_path: Path
) -> None:
    """A store built without ``policy=`` (``Policy()``'s 5 s store wait) under a driver of
    ``Policy(request_timeout=1)``: the driver tells the store its 0.5 s store wait
    (``cover_store_wait``), so a store frozen before the claim is a 503 within the
    request timeout, not within the store's own 5 s (before: 5 s to 15 s)."""
    import threading

    from idemflow import StoreUnavailable

    ran: list[str] = []

    async def handler(attempt: AsyncAttempt) -> Response:
        ran.append("charged")
        return CREATED

    with hung_store(kind, tmp_path, None) as (store, hang, resume):
        await _prepared(store)
        idem = AsyncIdempotency(store, BUDGETED)
        safety = threading.Timer(10 * BUDGETED.timeout_seconds, resume)
        safety.start()
        hang()
        began = time.monotonic()
        try:
            with pytest.raises(StoreUnavailable):
                await idem.run(intent("k-hung"), handler)
            waited = time.monotonic() - began
        finally:
            safety.cancel()
            resume()
        await store.close()

    assert waited <= BUDGETED.timeout_seconds, waited
    assert ran == []


@pytest.mark.postgres
@pytest.mark.parametrize("request_timeout", [1, 30])
async def test_the_store_wait_is_derived_from_the_request_timeout(
    request_timeout: float, tmp_path: Path
) -> None:
    """Half the request timeout, at most 5 s (0.5 s at 1 s; 5 s at 30 s, the default), and
    each store made with the policy waits that long, no longer (the 30 s case without
    waiting): SQLite's busy timeout; each Redis attempt a third of it (two retries);
    MySQL's connect, read and checkout; PostgreSQL's checkout and its own statements,
    never the application's checkout of the same pool."""
    policy = Policy(request_timeout=request_timeout)
    bound = policy.store_wait_seconds
    assert bound == min(request_timeout / 2, 5.0)

    sqlite_store = SQLiteStore(tmp_path / "keys.db", policy=policy)
    busy = sqlite_store._connections().conn.execute("PRAGMA busy_timeout").fetchone()
    sqlite_store.close()
    assert busy == (int(bound * 1000),)

    pytest.importorskip("redis")
    from idemflow.stores.redis import open_redis
    from idemflow.stores.redis._scripts import RETRIES

    redis_store: Any = open_redis("redis://127.0.0.1:1/0", policy=policy, asynchronous=True)
    settings = redis_store.client.connection_pool.connection_kwargs
    assert settings["socket_timeout"] == settings["socket_connect_timeout"]
    assert settings["socket_timeout"] * (1 + RETRIES) == pytest.approx(bound)
    await redis_store.client.aclose()

    pytest.importorskip("asyncmy")
    from idemflow.stores.mysql import AsyncMySQLStore

    mysql_store = AsyncMySQLStore("mysql://root@127.0.0.1:1/test", policy=policy)
    assert mysql_store.pool._timeout == bound

    pytest.importorskip("psycopg_pool")
    from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore
    from tests.conftest import POSTGRES_URL

    pg_store = AsyncPostgresStore(POSTGRES_URL, policy=policy)
    try:
        assert pg_store.pool.timeout == bound
        async with pg_store._checkout(bound) as own:
            assert own.store_wait == bound
        async with pg_store.connection() as lent:
            assert lent.store_wait is None
        async with pg_store.pool.connection() as raw:
            assert raw.store_wait is None
    finally:
        await pg_store.close()
    sync_store = PostgresStore(POSTGRES_URL, policy=policy)
    try:
        assert sync_store.pool.timeout == bound
        with sync_store._checkout(bound) as own:
            assert (type(own).__name__, own.store_wait) == ("BoundedConnection", bound)
        with sync_store.connection() as lent:
            assert lent.store_wait is None
    finally:
        sync_store.close()


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mysql),
    ],
)
async def test_a_migration_waits_for_its_locks_past_the_store_wait(
    kind: str, table_name: str
) -> None:
    """A migration is no request: it waits for the locks it needs (another migration's,
    a table another session holds) longer than the store wait that bounds a request's
    statements (0.5 s here). The lock is given back after a second."""
    import threading

    if kind == "postgres":
        psycopg = pytest.importorskip("psycopg")
        from idemflow.stores.postgres import _MIGRATE_LOCK, AsyncPostgresStore
        from tests.conftest import POSTGRES_URL

        holder: Any = psycopg.connect(POSTGRES_URL, autocommit=True)
        holder.execute(f"SELECT pg_advisory_lock({_MIGRATE_LOCK})")  # another migration
        store: Any = AsyncPostgresStore(POSTGRES_URL, table=table_name, policy=BUDGETED)
        give_back = f"SELECT pg_advisory_unlock({_MIGRATE_LOCK})"
        drop = f"DROP TABLE IF EXISTS {table_name}"
    else:
        pymysql = pytest.importorskip("pymysql")
        pytest.importorskip("asyncmy")
        from idemflow.stores.mysql import AsyncMySQLStore
        from tests.backends import MYSQL_URL

        store = AsyncMySQLStore(MYSQL_URL, table=table_name, policy=BUDGETED)
        await store.migrate()
        holder = pymysql.connect(host="127.0.0.1", port=3306, user="root", database="test")
        holder.cursor().execute(f"LOCK TABLES {table_name} WRITE")  # a busy table
        give_back, drop = "UNLOCK TABLES", f"DROP TABLE IF EXISTS {table_name}"
    # Set before the lock is given back: the migration cannot return before that, and a
    # flag set after the holder's reply would race the migration's own return.
    giving_back = threading.Event()

    def give_the_lock_back() -> None:
        giving_back.set()
        holder.cursor().execute(give_back)

    timer = threading.Timer(2 * BUDGETED.store_wait_seconds, give_the_lock_back)
    timer.start()
    try:
        await store.migrate()
        waited_for_the_holder = giving_back.is_set()
    finally:
        timer.cancel()
        timer.join()
        await store.close()
        holder.cursor().execute(give_back)
        holder.cursor().execute(drop)
        holder.close()

    assert waited_for_the_holder  # past its store wait: the lock came back at twice that


def test_a_flask_store_named_by_url_waits_within_the_apps_request_timeout(
    tmp_path: Path,
) -> None:
    """``IDEMFLOW_STORE`` opened with the app's own policy (``IDEMFLOW_REQUEST_TIMEOUT``):
    its waits are bounded by that policy's store wait, not ``Policy()``'s 5 s."""
    flask = pytest.importorskip("flask")
    from idemflow.integrations.flask import Idempotency as FlaskIdempotency

    app = flask.Flask(__name__)
    app.config["IDEMFLOW_STORE"] = f"sqlite:///{tmp_path / 'keys.db'}"
    app.config["IDEMFLOW_REQUEST_TIMEOUT"] = 1
    FlaskIdempotency(app, principal=lambda: "alice")
    store = app.extensions["idemflow"].store
    busy = store._connections().conn.execute("PRAGMA busy_timeout").fetchone()
    store.close()
    assert busy == (500,)  # half of 1 s (Policy()'s would be 5 s)
