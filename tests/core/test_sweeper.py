"""
The stale-claim sweeper: crashed claims end, live ones are never touched, and
every stale record is resolved exactly once, whatever races it.

Runs over every store in ``tests/backends.py`` (memory, SQLite, PostgreSQL);
the races use real threads, real row locks and real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    Attempt,
    ConfigurationError,
    Event,
    Idempotency,
    InProgress,
    Intent,
    Outcome,
    Policy,
    Record,
    Response,
    State,
    downstream_key,
)
from idemflow.stores.memory import AsyncMemoryStore, MemoryStore
from idemflow.stores.protocol import Transaction
from idemflow.stores.sqlite import AsyncSQLiteStore, SQLiteStore
from idemflow.sweeper import (
    Answer,
    AsyncStop,
    AsyncSweeper,
    DidNotHappen,
    Happened,
    Reconciler,
    Stop,
    Sweeper,
    SweepReport,
    Unknown,
    start_background_sweeper,
)
from idemflow.testing import FrozenClock
from tests.backends import Backend, open_caller, open_store
from tests.factories import CREATED_AT as CREATED
from tests.factories import POLICY, psycopg_or_skip

STALE = POLICY.stale_seconds
RECONCILED = Response.json(201, {"id": "pay_from_provider"})


def intent(key: str = "k-1", principal: str = "alice", fp: str = "fp-1") -> Intent:
    return Intent(principal, key, fp, endpoint="POST /payments", correlation_id=f"req-{key}")


def crash_after_claim(backend: Backend, clock: FrozenClock, key: str = "k-1") -> Record:
    """A request that claimed its key and died: the claim is all that is left."""
    return backend.store.claim(
        intent(key), f"lease-{key}", clock(), clock() + 3600, stale_after=STALE
    ).record


class Recorder:
    """An observer that also has the ``stale_reclaimed`` metrics hook. Thread-safe."""

    def __init__(self) -> None:
        self.events: list[tuple[Event, Intent]] = []
        self.resolutions: list[tuple[str, str]] = []
        #: (key, resolution): the sweeper calls the hook right after the event, in its thread.
        self.outcomes: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._last = threading.local()

    def __call__(self, event: Event, intent: Intent, elapsed: float) -> None:
        self._last.key = intent.key
        with self._lock:
            self.events.append((event, intent))

    def stale_reclaimed(self, resolution: str, endpoint: str) -> None:
        with self._lock:
            self.resolutions.append((resolution, endpoint))
            self.outcomes.append((self._last.key, resolution))

    def keys(self) -> Counter[str]:
        with self._lock:
            return Counter(i.key for e, i in self.events if e is Event.STALE_RECLAIMED)

    def settled(self) -> Counter[str]:
        """Each key's resolutions other than "unknown" (which leaves the record stale)."""
        with self._lock:
            return Counter(key for key, resolution in self.outcomes if resolution != "unknown")


class Answers:
    """A reconciler that answers from a script and remembers what it was asked."""

    def __init__(self, *answers: Answer | Exception) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[Record, Mapping[str, str]]] = []

    def __call__(self, record: Record, downstream_keys: Mapping[str, str]) -> Answer:
        self.asked.append((record, downstream_keys))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def run_retry(backend: Backend, clock: FrozenClock, body: bytes = b"retried") -> Outcome:
    """The client's retry, run in the caller's transaction when the store can share one."""

    def handler(attempt: Attempt) -> Response:
        backend.write(attempt.connection, f"{attempt.record.key}/attempt-{attempt.record.attempt}")
        return Response(201, body)

    idem = Idempotency(backend.store, POLICY, clock=clock)
    with _transaction(backend) as transaction:
        return idem.run(intent(), handler, transaction=transaction)


@contextlib.contextmanager
def _transaction(backend: Backend) -> Iterator[Transaction | None]:
    if backend.open_transaction is None:
        yield None
        return
    with backend.open_transaction() as transaction:
        yield transaction


# --- crashed and live claims --------------------------------------------------


def test_crashed_claim_is_released_so_the_next_retry_runs(
    backend: Backend, clock: FrozenClock
) -> None:
    """A claim whose request died blocks retries (409) only until the sweeper releases it."""
    crash_after_claim(backend, clock)
    with pytest.raises(InProgress):
        run_retry(backend, clock)
    clock.advance(STALE + 1)

    report = Sweeper(backend.store, POLICY, clock=clock).sweep_once()

    assert (report.released, report.resolved, report.batches) == (1, 1, 1)
    outcome = run_retry(backend, clock)
    assert (outcome.replayed, outcome.response.body) == (False, b"retried")
    assert outcome.record.attempt == 2
    assert backend.count() == 1


@pytest.mark.parametrize("age", [0.0, STALE - 0.001, STALE])
def test_claim_not_older_than_the_threshold_is_never_touched(
    backend: Backend, clock: FrozenClock, age: float
) -> None:
    """Up to and including the threshold a claim is live: unmarked, and its owner completes."""
    claimed = crash_after_claim(backend, clock)
    clock.advance(age)

    report = Sweeper(backend.store, POLICY, clock=clock).sweep_once()

    assert report == SweepReport()
    assert backend.store.get("alice", "k-1") == claimed
    backend.store.complete(claimed, State.COMPLETED, CREATED, clock(), clock() + 3600)
    assert run_retry(backend, clock).response == CREATED


def test_threshold_comes_from_the_request_timeout(clock: FrozenClock) -> None:
    """Request timeout 30 s → stale after 70 s: a claim of 70 s stays, of 70.001 s goes."""
    store, policy = MemoryStore(), Policy(request_timeout=30)
    sweeper = Sweeper(store, policy, clock=clock)
    store.claim(intent(), "lease", clock(), clock() + 3600, stale_after=policy.stale_seconds)

    clock.advance(70)
    assert sweeper.sweep_once().resolved == 0
    clock.advance(0.001)
    assert sweeper.sweep_once().released == 1


@pytest.mark.parametrize(
    ("timeout", "stale_after"),
    [(30, 60), (30, 69.999), (5, 5), (60, 0), (1, 11.9)],
)
def test_unsafe_threshold_is_rejected_before_any_sweeper_exists(
    timeout: float, stale_after: float
) -> None:
    """A threshold under 2 × timeout + 10 s could release a live claim: refused with why."""
    with pytest.raises(ConfigurationError, match=r"unsafe|positive"):
        Sweeper(MemoryStore(), Policy(request_timeout=timeout, stale_after=stale_after))


@pytest.mark.parametrize(
    "settings",
    [{"batch_size": 0}, {"retry_unknown_after": 0}, {"retry_unknown_after": -5}],
)
def test_impossible_sweeper_settings_are_rejected(settings: dict[str, Any]) -> None:
    """A sweeper that could never make progress is refused at construction."""
    with pytest.raises(ConfigurationError):
        Sweeper(MemoryStore(), POLICY, **settings)


def test_transaction_factory_needs_a_store_that_shares_transactions() -> None:
    """The memory store cannot commit a business row with the record: refused."""

    def never_opened() -> contextlib.AbstractContextManager[Transaction]:
        raise AssertionError("refused before any transaction is opened")

    with pytest.raises(ConfigurationError, match="transaction"):
        Sweeper(MemoryStore(), POLICY, transaction_factory=never_opened)


# --- reconciliation -----------------------------------------------------------


def test_happened_settles_and_the_retry_replays_the_reconciled_response(
    backend: Backend, clock: FrozenClock
) -> None:
    """The provider says it charged: the key completes with its answer, nothing runs again."""
    claimed = crash_after_claim(backend, clock)
    clock.advance(STALE + 1)
    reconciler = Answers(Happened(RECONCILED))

    report = Sweeper(
        backend.store, POLICY, reconciler=reconciler, steps=["charge"], clock=clock
    ).sweep_once()

    assert report.completed == 1
    asked, keys = reconciler.asked[0]
    assert (asked.key, asked.state) == ("k-1", State.STALE)
    # The same key the crashed attempt sent downstream (attempt.downstream_key).
    assert keys == {"charge": downstream_key(claimed, "charge")}
    replay = run_retry(backend, clock)
    assert (replay.replayed, replay.response) == (True, RECONCILED)
    assert backend.count() == 0


def test_happened_with_a_decline_settles_as_failed_permanent(
    backend: Backend, clock: FrozenClock
) -> None:
    """The classifier decides the state of a reconciled response, as for a live run."""
    crash_after_claim(backend, clock)
    clock.advance(STALE + 1)
    declined = Response.json(402, {"error": "card_declined"})

    Sweeper(backend.store, POLICY, reconciler=Answers(Happened(declined)), clock=clock).sweep_once()

    record = backend.store.get("alice", "k-1")
    assert record is not None
    assert (record.state, record.response) == (State.FAILED_PERMANENT, declined)


def test_happened_applies_the_business_row_in_the_settling_transaction(
    transactional: Backend, clock: FrozenClock
) -> None:
    """In transactional mode the reconciled local row and the completed record commit together."""
    crash_after_claim(transactional, clock)
    clock.advance(STALE + 1)
    answer = Happened(RECONCILED, apply=lambda conn: transactional.write(conn, "reconciled"))

    report = Sweeper(
        transactional.store,
        POLICY,
        reconciler=Answers(answer),
        transaction_factory=transactional.open_transaction,
        clock=clock,
    ).sweep_once()

    assert report.completed == 1
    assert transactional.count() == 1
    assert run_retry(transactional, clock).response == RECONCILED


def test_failing_apply_rolls_back_and_keeps_the_record_stale(
    transactional: Backend, clock: FrozenClock
) -> None:
    """If writing the business row fails, neither it nor the settle commits."""

    def apply(conn: Any) -> None:
        transactional.write(conn, "half")
        raise RuntimeError("constraint violated")

    crash_after_claim(transactional, clock)
    clock.advance(STALE + 1)
    report = Sweeper(
        transactional.store,
        POLICY,
        reconciler=Answers(Happened(RECONCILED, apply=apply)),
        transaction_factory=transactional.open_transaction,
        clock=clock,
    ).sweep_once()

    assert report.unknown == 1
    assert transactional.count() == 0
    record = transactional.store.get("alice", "k-1")
    assert record is not None
    assert (record.state, record.response) == (State.STALE, None)


def test_did_not_happen_releases(backend: Backend, clock: FrozenClock) -> None:
    """The provider has no charge under the downstream key: the retry really runs."""
    crash_after_claim(backend, clock)
    clock.advance(STALE + 1)

    report = Sweeper(
        backend.store, POLICY, reconciler=Answers(DidNotHappen("no charge")), clock=clock
    ).sweep_once()

    assert report.released == 1
    assert run_retry(backend, clock).replayed is False


def test_unknown_stays_stale_counted_and_is_retried_on_a_later_pass(
    backend: Backend, clock: FrozenClock
) -> None:
    """Unknown keeps blocking (409), is counted each time, and is asked again when due."""
    crash_after_claim(backend, clock)
    clock.advance(STALE + 1)
    reconciler = Answers(Unknown("provider timed out"), Happened(RECONCILED))
    recorder = Recorder()
    sweeper = Sweeper(
        backend.store,
        POLICY,
        reconciler=reconciler,
        clock=clock,
        retry_unknown_after=60,
        observer=recorder,
    )

    first = sweeper.sweep_once()
    assert (first.unknown, first.resolved) == (1, 1)
    record = backend.store.get("alice", "k-1")
    assert record is not None
    assert record.state is State.STALE
    with pytest.raises(InProgress):
        run_retry(backend, clock)

    clock.advance(59)
    assert sweeper.sweep_once() == SweepReport()  # not due again yet
    clock.advance(2)
    second = sweeper.sweep_once()

    assert (second.completed, second.retried) == (1, 1)
    assert len(reconciler.asked) == 2
    assert recorder.resolutions == [("unknown", "POST /payments"), ("completed", "POST /payments")]
    assert run_retry(backend, clock).response == RECONCILED


def test_unresolved_stale_record_is_kept_past_its_retention(
    backend: Backend, clock: FrozenClock
) -> None:
    """A stale record is the only evidence of an unknown effect: purge must not take it."""
    backend.store.claim(
        intent(), "lease", clock(), clock() + 30, stale_after=STALE
    )  # retention 30 s
    clock.advance(STALE + 1)
    Sweeper(backend.store, POLICY, reconciler=Answers(Unknown()), clock=clock).sweep_once()

    clock.advance(600)
    store: Any = backend.store
    assert store.purge(clock(), 100) == 0
    record = store.get("alice", "k-1")
    assert record is not None
    assert record.state is State.STALE


@pytest.mark.parametrize(
    "answer",
    [
        RuntimeError("provider API down"),
        Happened(Response(503, b"provider down")),
        Happened(RECONCILED, apply=lambda conn: None),  # apply without transaction_factory
    ],
    ids=["raises", "transient-response", "apply-without-transaction"],
)
def test_reconciler_that_cannot_answer_counts_as_unknown(
    backend: Backend,
    clock: FrozenClock,
    caplog: pytest.LogCaptureFixture,
    answer: Answer | Exception,
) -> None:
    """A failing or impossible answer is logged and leaves the record stale; the pass goes on."""
    crash_after_claim(backend, clock, "a")
    crash_after_claim(backend, clock, "b")
    clock.advance(STALE + 1)

    with caplog.at_level(logging.WARNING, logger="idemflow.sweeper"):
        report = Sweeper(
            backend.store, POLICY, reconciler=Answers(answer), clock=clock
        ).sweep_once()

    assert (report.unknown, report.resolved) == (2, 2)
    assert caplog.records
    for key in "ab":
        record = backend.store.get("alice", key)
        assert record is not None
        assert (record.state, record.response) == (State.STALE, None)


def test_every_resolution_reaches_the_observer(backend: Backend, clock: FrozenClock) -> None:
    """STALE_RECLAIMED carries the record's intent; the metrics hook gets the resolution."""
    for key in ("done", "gone", "lost-track"):
        crash_after_claim(backend, clock, key)
    clock.advance(STALE + 1)
    answers: dict[str, Answer] = {
        "done": Happened(RECONCILED),
        "gone": DidNotHappen(),
        "lost-track": Unknown(),
    }
    recorder = Recorder()

    Sweeper(
        backend.store,
        POLICY,
        reconciler=lambda record, downstream_keys: answers[record.key],
        clock=clock,
        observer=recorder,
    ).sweep_once()

    intents = {i.key: i for e, i in recorder.events if e is Event.STALE_RECLAIMED}
    assert intents["done"] == Intent(
        "alice", "done", "fp-1", endpoint="POST /payments", correlation_id="req-done"
    )
    assert sorted(recorder.resolutions) == [
        ("completed", "POST /payments"),
        ("released", "POST /payments"),
        ("unknown", "POST /payments"),
    ]


def test_prometheus_metrics_count_resolutions(clock: FrozenClock) -> None:
    """With PrometheusMetrics as observer, both counters move: by outcome and by resolution."""
    pytest.importorskip("prometheus_client")
    from idemflow.metrics import PrometheusMetrics

    metrics, store = PrometheusMetrics(), MemoryStore()
    for key in ("a", "b"):
        store.claim(intent(key), "lease", clock(), clock() + 3600, stale_after=STALE)
    clock.advance(STALE + 1)
    answers: dict[str, Answer] = {"a": DidNotHappen(), "b": Unknown()}

    Sweeper(
        store,
        POLICY,
        reconciler=lambda record, downstream_keys: answers[record.key],
        clock=clock,
        observer=metrics,
    ).sweep_once()

    def sample(name: str, **labels: str) -> float | None:
        value: float | None = metrics.registry.get_sample_value(name, labels)
        return value

    assert sample("idemflow_stale_reclaimed_total", resolution="released") == 1
    assert sample("idemflow_stale_reclaimed_total", resolution="unknown") == 1
    assert sample("idemflow_stale_reclaimed_total", resolution="completed") == 0
    assert metrics.count(Event.STALE_RECLAIMED, "POST /payments") == 2


def test_a_broken_observer_does_not_stop_the_sweep(clock: FrozenClock) -> None:
    """Metrics failing is logged; the records are still resolved."""

    def broken(event: Event, intent: Intent, elapsed: float) -> None:
        raise RuntimeError("exporter down")

    store = MemoryStore()
    for key in "abc":
        store.claim(intent(key), "lease", clock(), clock() + 3600, stale_after=STALE)
    clock.advance(STALE + 1)

    assert Sweeper(store, POLICY, clock=clock, observer=broken).sweep_once().released == 3


def test_a_backlog_is_drained_in_bounded_batches(backend: Backend, clock: FrozenClock) -> None:
    """250 crashed claims, batches of 100: three statements, progress after each."""
    for n in range(250):
        crash_after_claim(backend, clock, f"k-{n}")
    clock.advance(STALE + 1)
    progress: list[SweepReport] = []

    report = Sweeper(backend.store, POLICY, clock=clock, batch_size=100).sweep_once(progress.append)

    assert (report.released, report.batches) == (250, 3)
    assert [(p.released, p.batches) for p in progress] == [(100, 1), (200, 2), (250, 3)]


# --- races with the original request ------------------------------------------


class PausedCommit(Transaction):
    """The caller's transaction, stopped right before COMMIT until told to go on.

    When it pauses, the business row and the completion UPDATE are written but
    not committed: on PostgreSQL the key row is locked by the completion.
    """

    inner: Transaction

    def __init__(self) -> None:
        self.written = threading.Event()
        self.go_on = threading.Event()

    @property
    def connection(self) -> Any:
        return self.inner.connection

    def begin(self) -> None:
        self.inner.begin()

    def execute(self, statement: Any, params: Mapping[str, Any]) -> int:
        return self.inner.execute(statement, params)

    def fetchone(self, statement: Any, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        return self.inner.fetchone(statement, params)

    def commit(self) -> None:
        self.written.set()
        assert self.go_on.wait(30), "test never let the commit go on"
        self.inner.commit()

    def rollback(self) -> None:
        self.inner.rollback()


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``target`` in a real thread; its result (or exception) lands in the list."""
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(target())
        except BaseException as exc:
            results.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, results


@contextlib.contextmanager
def sweeper_waiting(backend: Backend) -> Iterator[Callable[[], bool]]:
    """Is the sweeper now waiting on the paused commit? Asked where the wait shows.

    SQLite: the sweeper holds the store's writer lock of the file (its UPDATE then
    waits on the file lock the caller's transaction holds). MySQL, Galera: its
    UPDATE is running on the server (on any node, for Galera), where it waits for
    the row lock the paused transaction holds. (The process list, not
    ``innodb_trx``: that one is a cache, refreshed only when it was not read for
    100 ms.) PostgreSQL's never waits (SKIP LOCKED): nothing to ask.
    """
    kind, args = backend.spec
    if kind == "postgres":
        yield lambda: False
        return
    if kind == "sqlite":
        from idemflow.stores.sqlite import _writer_lock

        lock = _writer_lock(args[0])

        def held_elsewhere() -> bool:
            if lock.acquire(blocking=False):
                lock.release()
                return False
            return True

        yield held_elsewhere
        return
    assert kind.startswith("mysql") or kind == "galera", f"where does {kind}'s sweeper wait?"
    import pymysql

    from idemflow.stores.mysql import connect_kwargs
    from tests.backends import MYSQL_URL

    table = args[0]
    urls = args[1] if kind == "galera" else (MYSQL_URL,)
    conns = [pymysql.connect(**connect_kwargs(url), autocommit=True) for url in urls]
    query = "SELECT COUNT(*) FROM information_schema.processlist WHERE info LIKE %s"

    def updating() -> bool:
        for conn in conns:
            with conn.cursor() as cursor:
                cursor.execute(query, (f"UPDATE {table} SET state = 'stale'%",))
                if cursor.fetchone()[0]:
                    return True
        return False

    try:
        yield updating
    finally:
        for conn in conns:
            conn.close()


def test_sweeper_skips_a_completion_committing_at_the_threshold(
    transactional: Backend, clock: FrozenClock
) -> None:
    """The original completes as it turns stale: the sweeper leaves it, one effect only."""
    assert transactional.open_transaction is not None
    idem = Idempotency(transactional.store, POLICY, clock=clock)

    def slow_handler(attempt: Attempt) -> Response:
        transactional.write(attempt.connection, "original")
        clock.advance(STALE + 0.001)  # the request ran right up to the threshold
        return CREATED

    paused = PausedCommit()

    def original_request() -> Outcome:
        assert transactional.open_transaction is not None
        with transactional.open_transaction() as paused.inner:  # opened in its own thread
            return idem.run(intent(), slow_handler, transaction=paused)

    original, outcome = in_thread(original_request)
    assert paused.written.wait(10), outcome
    # Ready to look before the sweeper starts: its lock wait is bounded (1 s on MySQL).
    with sweeper_waiting(transactional) as waiting:
        sweeping, swept = in_thread(Sweeper(transactional.store, POLICY, clock=clock).sweep_once)
        if transactional.name == "postgres":
            # SKIP LOCKED: the sweeper passes over the locked row without waiting.
            sweeping.join(10)
            assert not sweeping.is_alive()
        else:
            # One writer (SQLite) or a plain row lock (MySQL): the sweeper queues behind
            # the commit. The commit goes on once the sweeper is seen waiting for it.
            wait_for(lambda: waiting() or not sweeping.is_alive())
            assert sweeping.is_alive(), f"the sweeper did not wait for the commit: {swept}"
    paused.go_on.set()
    original.join(10)
    sweeping.join(10)

    assert swept == [SweepReport()]
    assert isinstance(outcome[0], Outcome)
    assert outcome[0].replayed is False
    assert Sweeper(transactional.store, POLICY, clock=clock).sweep_once() == SweepReport()
    assert transactional.count() == 1
    assert run_retry(transactional, clock).response == CREATED


def test_original_loses_to_a_sweeper_that_marked_first_and_rolls_back(
    transactional: Backend, clock: FrozenClock
) -> None:
    """Swept, released, retried meanwhile: the original's completion is refused, its row undone."""
    idem = Idempotency(transactional.store, POLICY, clock=clock)
    retried: list[Any] = []

    def overrunning_handler(attempt: Attempt) -> Response:
        if transactional.name == "postgres":  # business row first: no lock on the key row
            transactional.write(attempt.connection, "original")
        clock.advance(STALE + 1)
        sweeping, swept = in_thread(Sweeper(transactional.store, POLICY, clock=clock).sweep_once)
        sweeping.join(10)
        assert swept == [SweepReport(released=1, batches=1)]
        retrying, results = in_thread(lambda: run_retry(transactional, clock, b"second"))
        retrying.join(10)
        retried.extend(results)
        if transactional.name != "postgres":  # SQLite: write after the others are done
            transactional.write(attempt.connection, "original")
        return CREATED

    # On Galera the retry's commit may abort the original's open transaction first (a
    # certification failure: 503) rather than its fenced completion finding the lease
    # gone; either way nothing of the original commits.
    with pytest.raises(transactional.lease_lost), _transaction(transactional) as transaction:
        idem.run(intent(), overrunning_handler, transaction=transaction)

    assert isinstance(retried[0], Outcome)
    assert transactional.count() == 1  # the retry's row only
    replay = run_retry(transactional, clock)
    assert (replay.replayed, replay.response.body) == (True, b"second")


def test_slow_sweeper_loses_its_record_to_one_that_re_marked_it(
    backend: Backend, clock: FrozenClock
) -> None:
    """A sweeper stuck in its reconciler past the retry interval cannot resolve a second time."""
    crash_after_claim(backend, clock)
    clock.advance(STALE + 1)
    recorder = Recorder()
    factory = backend.open_transaction

    def sweeper(reconciler: Reconciler) -> Sweeper:
        return Sweeper(
            backend.store,
            POLICY,
            reconciler=reconciler,
            transaction_factory=factory,
            clock=clock,
            retry_unknown_after=60,
            observer=recorder,
        )

    def answer() -> Happened:
        if factory is None:
            return Happened(RECONCILED)
        return Happened(RECONCILED, apply=lambda conn: backend.write(conn, "reconciled"))

    inner_reports: list[SweepReport] = []

    def stuck(record: Record, downstream_keys: Mapping[str, str]) -> Answer:
        clock.advance(61)  # so long that the record is due again
        inner_reports.append(sweeper(lambda r, k: answer()).sweep_once())
        return answer()

    outer = sweeper(stuck).sweep_once()

    assert inner_reports == [SweepReport(completed=1, retried=1, batches=1)]
    assert (outer.lost, outer.resolved) == (1, 0)
    assert recorder.keys() == Counter({"k-1": 1})
    if backend.transactional:
        assert backend.count() == 1  # the loser, fenced out, wrote nothing


# --- many sweepers at once ----------------------------------------------------


class _BusinessAnswer:
    """A reconciler whose answer writes one business row, named after the key, per resolution."""

    def __init__(self, write: Callable[[Any, str], None] | None) -> None:
        self.write = write

    def __call__(self, record: Record, downstream_keys: Mapping[str, str]) -> Answer:
        write = self.write
        if write is None:  # a store without transactions: nothing local to apply
            return Happened(RECONCILED)
        return Happened(RECONCILED, apply=lambda conn: write(conn, record.key))


def business_notes(backend: Backend) -> Counter[str]:
    """Every committed business row's note, counted (read past the backend's store)."""
    if backend.tables is None:  # SQLite: the file its spec names
        with contextlib.closing(sqlite3.connect(backend.spec[1][0])) as conn:
            rows = conn.execute("SELECT note FROM business").fetchall()
    else:
        rows = backend.tables.sql(f"SELECT note FROM biz_{backend.tables.name}")
    return Counter(note for (note,) in rows)


#: Records and batch for the racing sweepers (threads, processes): every sweeper holds a
#: batch at once (its reconciler's first answer waits for the others), then they race.
MANY, BATCH = 40, 5


def test_parallel_sweeper_threads_resolve_each_record_exactly_once(
    backend: Backend, clock: FrozenClock
) -> None:
    """Four sweepers in threads over 40 stale records: 40 resolutions, one per record.

    Each sweeper's first answer waits until all four hold a marked batch, so they
    contend for the records left. InnoDB may pick a settle's transaction as a
    deadlock victim: that record stays stale (counted unknown) and a pass once it
    is due again resolves it, never twice.
    """
    for n in range(MANY):
        crash_after_claim(backend, clock, f"k-{n}")
    clock.advance(STALE + 1)
    recorder = Recorder()
    start, together = threading.Barrier(4), threading.Barrier(4, timeout=60)
    answer = _BusinessAnswer(backend.write if backend.transactional else None)

    def meeting_the_others() -> Reconciler:
        waited = False

        def reconcile(record: Record, downstream_keys: Mapping[str, str]) -> Answer:
            nonlocal waited
            if not waited:
                waited = True
                together.wait()  # every sweeper has marked a batch of its own
            return answer(record, downstream_keys)

        return reconcile

    def sweeper(reconciler: Reconciler = answer) -> Sweeper:
        return Sweeper(
            backend.store,
            POLICY,
            reconciler=reconciler,
            transaction_factory=backend.open_transaction,
            clock=clock,
            batch_size=BATCH,
            observer=recorder,
        )

    def sweep() -> SweepReport:
        one = sweeper(meeting_the_others())
        start.wait()
        return one.sweep_once()

    threads = [in_thread(sweep) for _ in range(4)]
    for thread, _ in threads:
        thread.join(120)
    reports = [results[0] for _, results in threads]
    assert all(isinstance(r, SweepReport) for r in reports), reports
    assert not together.broken  # the four did meet, each with records of its own
    assert all(r.resolved >= 1 for r in reports), reports
    left_stale = sum(r.unknown for r in reports)
    if not backend.name.startswith(("mysql", "galera")):
        assert left_stale == 0  # only InnoDB's deadlock victims may be left for a later pass
    clock.advance(STALE + 1)  # a stale record is marked again once retry_unknown_after passed
    then = sweeper().sweep_once()

    assert then.completed == left_stale
    assert sum(r.completed for r in reports) + then.completed == MANY
    assert sum(r.lost for r in reports) + then.lost == 0
    assert recorder.settled() == Counter({f"k-{n}": 1 for n in range(MANY)})
    assert recorder.keys().total() == MANY + left_stale  # plus one "unknown" per victim
    if backend.transactional:  # one business row per record, each with its settle
        assert backend.count() == MANY


def _sweep_in_child(
    spec: tuple[str, tuple[Any, ...]],
    now: float,
    start: Any,
    together: Any,
    results: Any,
) -> None:
    """One sweeper process (spawned): its own store, connections and reconciler, whose
    first answer waits until every sweeper process holds a marked batch."""
    store: Any = open_store(spec)
    caller = open_caller(spec)
    assert caller is not None  # a transactional backend's spec
    open_transaction, write = caller
    answer = _BusinessAnswer(write)
    waited = False

    def reconcile(record: Record, downstream_keys: Mapping[str, str]) -> Answer:
        nonlocal waited
        if not waited:
            waited = True
            together.wait(60)  # raises if the others never came: counted unknown
        return answer(record, downstream_keys)

    sweeper = Sweeper(
        store,
        POLICY,
        reconciler=reconcile,
        transaction_factory=open_transaction,
        clock=lambda: now,
        batch_size=BATCH,
    )
    start.wait(60)
    try:
        results.put(sweeper.sweep_once().as_dict())
    finally:
        store.close()


@pytest.mark.slow
def test_parallel_sweeper_processes_resolve_each_record_exactly_once(
    transactional: Backend, clock: FrozenClock
) -> None:
    """Three sweeper processes over 40 stale records, each holding a batch before any
    answers: each record resolved, and its row written, once. Every SQL store: each child
    opens the store and its caller from the backend's spec (Galera: on every node)."""
    total = MANY
    for n in range(total):
        crash_after_claim(transactional, clock, f"k-{n}")
    clock.advance(STALE + 1)
    context = multiprocessing.get_context("spawn")
    start, together, results = context.Barrier(3), context.Barrier(3), context.Queue()
    spec = transactional.spec
    children = [
        context.Process(target=_sweep_in_child, args=(spec, clock(), start, together, results))
        for _ in range(3)
    ]
    for child in children:
        child.start()
    reports = [SweepReport(**results.get(timeout=120)) for _ in children]
    for child in children:
        child.join(30)

    assert [child.exitcode for child in children] == [0, 0, 0]
    assert all(r.resolved >= 1 for r in reports), reports  # all three met, each with records
    left_stale = sum(r.unknown for r in reports)
    if not transactional.name.startswith(("mysql", "galera")):
        assert left_stale == 0  # only InnoDB's deadlock victims may be left for a later pass
    clock.advance(STALE + 1)  # a stale record is marked again once retry_unknown_after passed
    then = Sweeper(
        transactional.store,
        POLICY,
        reconciler=_BusinessAnswer(transactional.write),
        transaction_factory=transactional.open_transaction,
        clock=clock,
    ).sweep_once()
    assert then.completed == left_stale
    assert sum(r.completed for r in reports) + then.completed == total
    assert sum(r.lost for r in reports) + then.lost == 0
    assert business_notes(transactional) == Counter({f"k-{n}": 1 for n in range(total)})
    assert Sweeper(transactional.store, POLICY, clock=clock).sweep_once() == SweepReport()


# --- loops, background tasks, asyncio -----------------------------------------


def wait_for(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_background_sweeper_survives_an_outage_and_stops_on_request(
    tmp_path: Path, clock: FrozenClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Passes that cannot reach the store are logged; once it is back, crashed claims end."""
    directory = tmp_path / "not-yet"
    store = SQLiteStore(directory / "keys.db")
    background = start_background_sweeper(Sweeper(store, POLICY, clock=clock), every=0.02)
    try:
        wait_for(lambda: sum("sweep pass failed" in r.message for r in caplog.records) >= 2)
        directory.mkdir()
        store.migrate()
        store.claim(intent(), "lease", clock(), clock() + 3600, stale_after=STALE)
        clock.advance(STALE + 1)
        wait_for(lambda: getattr(store.get("alice", "k-1"), "state", None) is State.RELEASED)
        assert background.running
    finally:
        background.stop(timeout=10)
    assert not background.running


class ClockStop(Stop):
    """A loop's stop whose wait moves the frozen clock instead of sleeping.

    Each wait is recorded with the time it started; the stop is set when
    ``done()`` holds (checked before each wait) or after ``most`` waits.
    """

    def __init__(self, clock: FrozenClock, done: Callable[[], bool], most: int = 200) -> None:
        super().__init__()
        self.clock, self.done, self.most = clock, done, most
        self.waits: list[tuple[float, float]] = []

    def wait(self, timeout: float) -> bool:
        if self.done() or len(self.waits) >= self.most:
            self.set()
            return True
        self.waits.append((self.clock(), timeout))
        self.clock.advance(timeout)
        return False


class CountingSweeper(Sweeper):
    """A sweeper that remembers when (on its clock) each of its passes started."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.passes: list[float] = []

    def sweep_once(self, progress: Any = None) -> SweepReport:
        self.passes.append(self.clock())
        return super().sweep_once(progress)


class CannotTell(MemoryStore):
    """A memory store that cannot say when its next record falls due."""

    def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
        return None


def _released(store: Any, key: str = "k-1") -> Callable[[], bool]:
    return lambda: getattr(store.get("alice", key), "state", None) is State.RELEASED


def test_a_crashed_claim_ends_at_its_threshold_not_an_interval_later(
    backend: Backend, clock: FrozenClock
) -> None:
    """The loop sleeps until the oldest claim in flight can be stale (at most an interval
    at a time), so it passes once, a millisecond past the threshold, and releases it."""
    claimed_at = clock()
    crash_after_claim(backend, clock)
    clock.advance(STALE - 3)  # the loop starts 3 s before the threshold (an interval is 2 s)
    sweeper = CountingSweeper(backend.store, POLICY, clock=clock)
    stop = ClockStop(clock, _released(backend.store))

    sweeper.run_forever(stop=stop)

    assert _released(backend.store)()
    assert len(sweeper.passes) == 1
    assert 0 < sweeper.passes[0] - (claimed_at + STALE) <= 0.003
    assert max(timeout for _, timeout in stop.waits) <= POLICY.sweep_interval


def test_an_idle_sweeper_looks_every_interval_and_never_passes(
    backend: Backend, clock: FrozenClock
) -> None:
    """Nothing in flight, nothing stale: one look per interval, no pass."""
    sweeper = CountingSweeper(backend.store, POLICY, clock=clock)
    stop = ClockStop(clock, lambda: False, most=2)

    sweeper.run_forever(stop=stop)

    assert sweeper.passes == []
    assert [timeout for _, timeout in stop.waits] == [POLICY.sweep_interval] * 2


def test_a_record_asked_again_is_looked_at_when_its_retry_is_due(clock: FrozenClock) -> None:
    """An unknown answer leaves the record stale; the next pass comes when it may be
    asked again (``retry_unknown_after``), not on the interval's beat."""
    store = MemoryStore()
    store.claim(intent(), "lease", clock(), clock() + 3600, stale_after=STALE)
    clock.advance(STALE + 1)
    sweeper = CountingSweeper(
        store, POLICY, clock=clock, reconciler=Answers(Unknown("down")), retry_unknown_after=7.5
    )
    stop = ClockStop(clock, lambda: len(sweeper.passes) >= 2)

    sweeper.run_forever(every=5, stop=stop)

    marked, asked_again = sweeper.passes
    assert 7.5 < asked_again - marked <= 7.503


def test_a_store_that_cannot_tell_is_swept_on_the_interval_s_beat(clock: FrozenClock) -> None:
    """``next_due`` answers None: a pass every interval, as before, and the crashed claim
    ends within one interval after its threshold."""
    store = CannotTell()
    claimed_at = clock()
    store.claim(intent(), "lease", clock(), clock() + 3600, stale_after=STALE)
    sweeper = CountingSweeper(store, POLICY, clock=clock)
    stop = ClockStop(clock, _released(store))

    sweeper.run_forever(every=3, stop=stop)

    assert _released(store)()
    assert len(sweeper.passes) == len(stop.waits) + 1
    assert {round(timeout, 1) for _, timeout in stop.waits} == {3.0}
    assert STALE < sweeper.passes[-1] - claimed_at <= STALE + 3


def test_a_record_still_due_after_a_pass_is_tried_again_soon_not_busily(
    clock: FrozenClock,
) -> None:
    """A claim the pass could not mark (here: a store that never marks) is looked at again
    after a short pause, neither at once nor an interval later."""

    class Stubborn(MemoryStore):
        def sweep(self, *args: Any) -> list[Record]:
            return []

    store = Stubborn()
    store.claim(intent(), "lease", clock(), clock() + 3600, stale_after=STALE)
    clock.advance(STALE + 1)
    sweeper = CountingSweeper(store, POLICY, clock=clock)
    stop = ClockStop(clock, lambda: False, most=3)

    sweeper.run_forever(stop=stop)

    assert len(sweeper.passes) == len(stop.waits) + 1 == 4  # a pass before each wait
    pauses = {timeout for _, timeout in stop.waits}
    assert len(pauses) == 1
    assert 0.01 <= pauses.pop() <= POLICY.sweep_interval / 10


def test_async_run_forever_sleeps_until_the_threshold(clock: FrozenClock) -> None:
    """The async loop schedules exactly as the sync one (it is its source)."""
    store = AsyncMemoryStore()
    waits: list[float] = []

    class AsyncClockStop(AsyncStop):
        async def wait(self, timeout: float) -> bool:
            record = await store.get("alice", "k-1")
            if record is not None and record.state is State.RELEASED:
                return True
            waits.append(timeout)
            clock.advance(timeout)
            return False

    async def scenario() -> float:
        await store.claim(intent(), "lease", clock(), clock() + 3600, stale_after=STALE)
        claimed_at = clock()
        await AsyncSweeper(store, POLICY, clock=clock).run_forever(stop=AsyncClockStop())
        return clock() - claimed_at

    elapsed = asyncio.run(scenario())
    assert STALE < elapsed <= STALE + 0.003
    assert max(waits) <= POLICY.sweep_interval


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres"])
def test_async_sweeper_resolves_like_the_sync_one(
    kind: str, tmp_path: Path, table_name: str, clock: FrozenClock
) -> None:
    """AsyncSweeper: releases a crashed claim, settles a reconciled one, runs in a task."""
    store = _async_store(kind, tmp_path, table_name)

    async def reconcile(record: Record, downstream_keys: Mapping[str, str]) -> Answer:
        await asyncio.sleep(0)
        return Happened(RECONCILED) if record.key == "paid" else DidNotHappen()

    async def scenario() -> None:
        try:
            if hasattr(store, "migrate"):
                await store.migrate()
            for key in ("paid", "unpaid"):
                await store.claim(intent(key), "lease", clock(), clock() + 3600, stale_after=STALE)
            clock.advance(STALE + 1)
            sweeper = AsyncSweeper(store, POLICY, reconciler=reconcile, clock=clock)
            report = await sweeper.sweep_once()
            assert (report.completed, report.released) == (1, 1)
            paid = await store.get("alice", "paid")
            assert (paid.state, paid.response) == (State.COMPLETED, RECONCILED)

            await store.claim(intent("later"), "lease", clock(), clock() + 3600, stale_after=STALE)
            clock.advance(STALE + 1)
            background = start_background_sweeper(sweeper, every=0.01)
            for _ in range(500):
                later = await store.get("alice", "later")
                if later.state is State.RELEASED:
                    break
                await asyncio.sleep(0.01)
            await background.stop()
            assert later.state is State.RELEASED
            assert not background.running
        finally:
            close = getattr(store, "close", None)
            if close is not None:
                await close()

    asyncio.run(scenario())


def _async_store(kind: str, tmp_path: Path, table: str) -> Any:
    if kind == "memory":
        return AsyncMemoryStore()
    if kind == "sqlite":
        return AsyncSQLiteStore(tmp_path / "async.db", table=table)
    psycopg_or_skip()
    from idemflow.stores.postgres import AsyncPostgresStore
    from tests.conftest import POSTGRES_URL

    return _DroppingPostgres(
        AsyncPostgresStore(POSTGRES_URL, table=table, max_size=4, clock="caller"), table
    )


class _DroppingPostgres:
    """The async PostgreSQL store, whose close also drops the test's table."""

    def __init__(self, store: Any, table: str) -> None:
        self._store, self._table = store, table

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def close(self) -> None:
        import psycopg

        from tests.conftest import POSTGRES_URL

        await self._store.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {self._table}")
