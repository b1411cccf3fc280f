"""
Many claimants of one key at the same instant: exactly one execution, always.

Every claimant goes through ``Idempotency.run`` (or ``AsyncIdempotency.run``)
with the same intent and a handler that sleeps a little and writes one
business row in the caller's transaction. All claimants of a round wait at a
barrier (across processes too) and then run at once. Whatever the store, one
of them executes; every other one gets 409 (still running) or the replay;
nothing else, ever. Rounds repeat on fresh keys, and on keys that were
released by a transient failure or expired past retention, because those
take the store's other claim path (the takeover).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
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
    Intent,
    LeaseLost,
    Response,
    State,
)
from idemflow.stores.protocol import AsyncTransaction, Statement, Transaction
from idemflow.testing import FrozenClock
from tests.backends import Backend, Rig, kinds, open_async_rig, open_caller, open_store
from tests.factories import POLICY

pytestmark = pytest.mark.slow

CREATED = Response(201, b"created", (("x-race", "1"),))
CLAIMANTS = 50
#: The longest the winner holds its claim waiting for every other claimant's answer:
#: reached only when a second one executes too (then the round fails its count).
HOLD_LIMIT = 10.0
BARRIER_TIMEOUT = 60.0
#: Rounds per backend: enough to meet a rare window, few enough for ~20 s per backend.
THREAD_ROUNDS = 30
PROCESSES, THREADS_PER_PROCESS, PROCESS_ROUNDS = 4, 13, 15
ASYNC_ROUNDS = 20
#: fresh: plain insert; released/expired: the takeover branch of the claim.
KINDS = ("fresh", "released", "expired")

Opener = Callable[[], contextlib.AbstractContextManager[Any]]
Write = Callable[[Any, str], None]


def intent(key: str) -> Intent:
    return Intent("racer", key, "fp-race", endpoint="POST /race")


class LazyTransaction(Transaction):
    """The caller's transaction, on a connection opened only when the flow begins it.

    Only the winner of a race begins a transaction: 50 claimants hold one
    caller connection instead of 50 (PostgreSQL's max_connections is shared).
    """

    def __init__(self, opener: Opener) -> None:
        self._opener = opener
        self._stack = contextlib.ExitStack()
        self._inner: Any = None

    @property
    def connection(self) -> Any:
        return self._inner.connection

    def begin(self) -> None:
        self._inner = self._stack.enter_context(self._opener())
        self._inner.begin()

    def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        result: int = self._inner.execute(statement, params)
        return result

    def fetchone(self, statement: Statement, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        row: Mapping[str, Any] | None = self._inner.fetchone(statement, params)
        return row

    def commit(self) -> None:
        with self._stack:
            self._inner.commit()

    def rollback(self) -> None:
        with self._stack:
            self._inner.rollback()


class Race:
    """Runs rounds of ``claimants`` threads on one key each, from one store."""

    def __init__(
        self,
        store: Any,
        open_transaction: Opener | None,
        write: Write,
        *,
        clock: Callable[[], float] = time.time,
        claimants: int = CLAIMANTS,
        start: Callable[[], None] | None = None,
    ) -> None:
        self.idem = Idempotency(store, POLICY, clock=clock)
        self.open_transaction = open_transaction
        self.write = write
        self.claimants = claimants
        self.start = start
        self.executions: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(claimants, thread_name_prefix="claimant")
        # Per round: the winner holds its claim until every other claimant has its
        # answer, so the claims overlap by construction rather than by a sleep.
        self._answered = 0
        self._others_answered = threading.Event()

    def close(self) -> None:
        self._pool.shutdown()

    def round(self, key: str) -> collections.Counter[str]:
        """All claimants released at once on ``key``; what each of them got."""
        barrier = threading.Barrier(self.claimants, action=self.start)
        self._answered = 0
        self._others_answered = threading.Event()
        if self.claimants == 1:
            self._others_answered.set()
        futures = [self._pool.submit(self._claimant, key, barrier) for _ in range(self.claimants)]
        return collections.Counter(future.result() for future in futures)

    def _claimant(self, key: str, barrier: threading.Barrier) -> str:
        answer = self._attempt(key, barrier)
        with self._lock:
            self._answered += 1
            if self._answered >= self.claimants - 1:
                self._others_answered.set()
        return answer

    def _attempt(self, key: str, barrier: threading.Barrier) -> str:
        transaction = (
            None if self.open_transaction is None else LazyTransaction(self.open_transaction)
        )
        barrier.wait(BARRIER_TIMEOUT)
        try:
            outcome = self.idem.run(intent(key), self._handler(key), transaction=transaction)
        except LeaseLost:
            return "error: lease lost (a second execution was attempted)"
        except InProgress:
            return "in_progress"
        except BaseException as exc:
            return f"error: {type(exc).__name__}: {exc}"
        if outcome.response != CREATED:
            return f"error: wrong response {outcome.response}"
        return "replayed" if outcome.replayed else "executed"

    def _handler(self, key: str) -> Callable[[Attempt], Response]:
        def handler(attempt: Attempt) -> Response:
            with self._lock:
                self.executions[key] += 1
            self._others_answered.wait(HOLD_LIMIT)
            self.write(attempt.connection, key)
            return CREATED

        return handler


def assert_exactly_once(outcomes: collections.Counter[str], claimants: int) -> None:
    """One execution; every other claimant got 409 or the replay; nothing else."""
    assert outcomes["executed"] == 1, outcomes
    assert outcomes["replayed"] + outcomes["in_progress"] == claimants - 1, outcomes


def assert_overlapped(rounds: list[collections.Counter[str]]) -> None:
    """The claimants really met the winner mid-flight (else the race proved nothing)."""
    assert sum(outcomes["in_progress"] for outcomes in rounds) > 0, rounds


# --- threads, every backend -------------------------------------------------------


def prepare(kind: str, backend: Backend, key: str, clock: FrozenClock) -> None:
    """Leave ``key`` released by a transient failure, or settled and then expired."""
    if kind == "fresh":
        return
    status = 503 if kind == "released" else 201
    idem = Idempotency(backend.store, POLICY, clock=clock)
    with opened(backend.open_transaction) as transaction:
        idem.run(intent(key), lambda attempt: Response(status), transaction=transaction)
    if kind == "expired":
        clock.advance(POLICY.retention_seconds + 1)


@contextlib.contextmanager
def opened(opener: Opener | None) -> Iterator[Any]:
    if opener is None:
        yield None
        return
    with opener() as transaction:
        yield transaction


def test_threads_claim_exactly_once(backend: Backend) -> None:
    """≥ 50 threads per key, fresh, released and expired keys: one execution per key."""
    clock = FrozenClock()
    race = Race(backend.store, backend.open_transaction, backend.write, clock=clock)
    keys = [f"t{n}-{KINDS[n % len(KINDS)]}" for n in range(THREAD_ROUNDS)]
    rounds = []
    try:
        for n, key in enumerate(keys):
            prepare(KINDS[n % len(KINDS)], backend, key, clock)
            rounds.append(race.round(key))
            assert_exactly_once(rounds[-1], CLAIMANTS)
    finally:
        race.close()

    assert_overlapped(rounds)
    assert race.executions == dict.fromkeys(keys, 1)
    assert backend.count() == len(keys)  # one business row per key, none from a loser
    for key in keys:
        record = backend.store.get("racer", key)
        assert record is not None
        assert (record.state, record.response) == (State.COMPLETED, CREATED)


# --- OS processes, every backend that other processes can open -----------------------


def _process_child(
    spec: tuple[str, tuple[Any, ...]], keys: list[str], barrier: Any, results: Any
) -> None:
    """In a child process: its own store and caller connections, one race per key."""
    store: Any = open_store(spec)
    caller = open_caller(spec)
    open_transaction, write = caller if caller is not None else (None, _no_write)
    race = Race(
        store,
        open_transaction,
        write,
        claimants=THREADS_PER_PROCESS,
        start=functools.partial(_wait, barrier),  # every process enters the round at once
    )
    try:
        for key in keys:
            outcomes = race.round(key)
            results.put((key, dict(outcomes), race.executions[key]))
    finally:
        race.close()
        close = getattr(store, "close", None)
        if close is not None:
            close()


def _wait(barrier: Any) -> None:
    barrier.wait(BARRIER_TIMEOUT)


def _no_write(connection: Any, note: str) -> None:
    """Stores without a shared transaction: executions are counted by the handler."""


def collect(results: Any, children: list[Any], expected: int) -> Iterator[Any]:
    """Every child's reports; fails at once (not after a timeout) if a child died."""
    deadline = time.monotonic() + BARRIER_TIMEOUT * 2
    received = 0
    while received < expected:
        try:
            yield results.get(timeout=0.2)
        except queue.Empty:
            dead = [c.exitcode for c in children if c.exitcode not in (None, 0)]
            assert not dead, f"a child process died: exit codes {dead}"
            assert time.monotonic() < deadline, f"only {received} of {expected} reports"
            continue
        received += 1


def test_processes_claim_exactly_once(backend: Backend) -> None:
    """4 OS processes × 13 threads claim each key together: one execution per key."""
    if backend.spec[0] == "memory":
        pytest.skip("the memory store lives in one process")
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(PROCESSES), context.Queue()
    keys = [f"p{n}" for n in range(PROCESS_ROUNDS)]
    children = [
        context.Process(target=_process_child, args=(backend.spec, keys, barrier, results))
        for _ in range(PROCESSES)
    ]
    for child in children:
        child.start()
    outcomes = {key: collections.Counter[str]() for key in keys}
    executions: collections.Counter[str] = collections.Counter()
    try:
        for key, counts, executed in collect(results, children, PROCESSES * PROCESS_ROUNDS):
            outcomes[key].update(counts)
            executions[key] += executed
    finally:
        for child in children:
            child.join(30)
            if child.is_alive():
                child.kill()

    assert [child.exitcode for child in children] == [0] * PROCESSES
    for key in keys:
        assert_exactly_once(outcomes[key], PROCESSES * THREADS_PER_PROCESS)
    assert_overlapped(list(outcomes.values()))
    assert executions == dict.fromkeys(keys, 1)
    if backend.transactional:
        assert backend.count() == len(keys)


# --- asyncio tasks: every kind with an async store -----------------------------------------


class AsyncLazyTransaction(AsyncTransaction):
    """:class:`LazyTransaction` for asyncio: only the winner opens a caller connection."""

    def __init__(self, opener: Callable[[], contextlib.AbstractAsyncContextManager[Any]]) -> None:
        self._opener = opener
        self._stack = contextlib.AsyncExitStack()
        self._inner: Any = None

    @property
    def connection(self) -> Any:
        return self._inner.connection

    async def begin(self) -> None:
        self._inner = await self._stack.enter_async_context(self._opener())
        await self._inner.begin()

    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        result: int = await self._inner.execute(statement, params)
        return result

    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        row: Mapping[str, Any] | None = await self._inner.fetchone(statement, params)
        return row

    async def commit(self) -> None:
        async with self._stack:
            await self._inner.commit()

    async def rollback(self) -> None:
        async with self._stack:
            await self._inner.rollback()


async def async_round(
    setup: Rig, key: str, executions: collections.Counter[str]
) -> collections.Counter[str]:
    """``CLAIMANTS`` tasks released together by one event."""
    idem = AsyncIdempotency(setup.store, POLICY)
    go = asyncio.Event()
    # The winner holds its claim until every other task has its answer.
    others_answered = asyncio.Event()
    answered = collections.Counter[str]()

    async def handler(attempt: AsyncAttempt) -> Response:
        executions[key] += 1
        await asyncio.wait_for(others_answered.wait(), HOLD_LIMIT)
        await setup.write(attempt.connection, key)
        return CREATED

    async def claimant() -> str:
        answer = await attempt_claim()
        answered["n"] += 1
        if answered["n"] >= CLAIMANTS - 1:
            others_answered.set()
        return answer

    async def attempt_claim() -> str:
        opener = setup.transaction
        transaction = None if opener is None else AsyncLazyTransaction(opener)
        await go.wait()
        try:
            outcome = await idem.run(intent(key), handler, transaction=transaction)
        except LeaseLost:
            return "error: lease lost (a second execution was attempted)"
        except InProgress:
            return "in_progress"
        except BaseException as exc:
            return f"error: {type(exc).__name__}: {exc}"
        return "replayed" if outcome.replayed else "executed"

    tasks = [asyncio.create_task(claimant()) for _ in range(CLAIMANTS)]
    await asyncio.sleep(0)  # every task is parked on the event
    go.set()
    return collections.Counter(await asyncio.gather(*tasks))


@pytest.mark.anyio
@pytest.mark.parametrize("name", [kind.param for kind in kinds() if kind.async_rigs])
async def test_async_tasks_claim_exactly_once(name: str, tmp_path: Path, table_name: str) -> None:
    """≥ 50 asyncio tasks per key through AsyncIdempotency (each kind's async store, its
    pool of 8): one execution per key."""
    async with open_async_rig(name, tmp_path, table_name, max_size=8) as setup:
        executions: collections.Counter[str] = collections.Counter()
        keys = [f"a{n}" for n in range(ASYNC_ROUNDS)]
        rounds = [await async_round(setup, key, executions) for key in keys]

        for outcomes in rounds:
            assert_exactly_once(outcomes, CLAIMANTS)
        assert_overlapped(rounds)

        assert executions == dict.fromkeys(keys, 1)
        assert len(setup.notes()) == len(keys)
