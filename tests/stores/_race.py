"""
Many claimants, one key, at the same instant: threads, and threads in several processes.

Every claimant goes through ``Idempotency.run`` with the same intent. Each
round all of them wait at a barrier (across processes too), then run at
once. Whatever the store, exactly one may execute per key; the others get
409 (still running) or the replay.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import threading
from collections.abc import Callable, Iterator
from typing import Any

from idemflow import Attempt, Idempotency, InProgress, Intent, Response
from idemflow.stores.protocol import Store, Transaction
from tests.factories import POLICY

CREATED = Response(201, b"created")
#: The longest the winner holds its claim waiting for the others' answers: reached
#: only when a second claimant executes too (then the count fails the round).
HOLD_LIMIT = 10.0
BARRIER_TIMEOUT = 120.0

OpenTransaction = Callable[[], contextlib.AbstractContextManager[Transaction | None]]
#: Writes one business row through the caller's connection (None: no transaction).
Write = Callable[[Any, str], None]


@contextlib.contextmanager
def _no_transaction() -> Iterator[None]:
    yield None


def race_round(
    store: Store,
    key: str,
    claimants: int,
    *,
    open_transaction: OpenTransaction = _no_transaction,
    write: Write | None = None,
    single_commit: bool = False,
    start: Callable[[], None] | None = None,
) -> collections.Counter[str]:
    """One round on ``key``: ``claimants`` threads released together. Counts their outcomes."""
    idem = Idempotency(store, POLICY)
    barrier = threading.Barrier(claimants, action=start)
    outcomes: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    # The winner holds its claim until every other claimant of this process has
    # its answer (409 or, after the winner, the replay cannot happen yet): the
    # claims overlap by construction, not by a sleep long enough.
    others_answered = threading.Event()
    if claimants == 1:
        others_answered.set()

    def handler(attempt: Attempt) -> Response:
        others_answered.wait(HOLD_LIMIT)
        if write is not None:
            write(attempt.connection, key)
        return CREATED

    def claimant() -> None:
        with open_transaction() as transaction:
            barrier.wait(timeout=BARRIER_TIMEOUT)
            try:
                outcome = idem.run(
                    Intent("racer", key, "fp-race"),
                    handler,
                    transaction=transaction,
                    single_commit=single_commit,
                )
                result = "replayed" if outcome.replayed else "executed"
                assert outcome.response == CREATED
            except InProgress:
                result = "in_progress"
            except BaseException as exc:
                result = f"error: {type(exc).__name__}: {exc}"
        with lock:
            outcomes[result] += 1
            if outcomes.total() >= claimants - 1:
                others_answered.set()

    threads = [threading.Thread(target=claimant) for _ in range(claimants)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def race_threads(
    store: Store, prefix: str, *, rounds: int, claimants: int, **options: Any
) -> list[collections.Counter[str]]:
    """``rounds`` rounds, each on a fresh key."""
    return [race_round(store, f"{prefix}-{n}", claimants, **options) for n in range(rounds)]


def _child(
    spec: tuple[str, tuple[Any, ...]],
    keys: list[str],
    claimants: int,
    barrier: Any,
    results: Any,
) -> None:
    from tests.backends import open_store

    store = open_store(spec)
    try:
        for key in keys:
            # Every process enters the round at the same moment.
            counts = race_round(store, key, claimants, start=lambda: barrier.wait(BARRIER_TIMEOUT))
            results.put((key, dict(counts)))
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def race_processes(
    spec: tuple[str, tuple[Any, ...]],
    prefix: str,
    *,
    processes: int,
    rounds: int,
    claimants_per_process: int,
) -> dict[str, collections.Counter[str]]:
    """``processes`` OS processes, each reopening the store from ``spec``; counts per key."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    results = context.Queue()
    keys = [f"{prefix}-{n}" for n in range(rounds)]
    children = [
        context.Process(target=_child, args=(spec, keys, claimants_per_process, barrier, results))
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    totals: dict[str, collections.Counter[str]] = {key: collections.Counter() for key in keys}
    try:
        for _ in range(processes * rounds):
            key, counts = results.get(timeout=BARRIER_TIMEOUT)
            totals[key].update(counts)
    finally:
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    assert all(child.exitcode == 0 for child in children), [c.exitcode for c in children]
    return totals


class Recorder:
    """A handler that records each attempt it is called with and answers ``response``."""

    def __init__(self, response: Response = CREATED, write: Write | None = None) -> None:
        self.calls: list[Attempt] = []
        self._response = response
        self._write = write

    def __call__(self, attempt: Attempt) -> Response:
        self.calls.append(attempt)
        if self._write is not None:
            self._write(attempt.connection, attempt.record.key)
        return self._response


def assert_exactly_once(counts: collections.Counter[str], claimants: int) -> None:
    """One execution; every other claimant was told 409 or got the replay; no errors."""
    assert counts["executed"] == 1, counts
    assert counts["executed"] + counts["replayed"] + counts["in_progress"] == claimants, counts
