"""
The consumer entry point on the memory store: each outcome's broker action, the lease
that lives as long as the work (renewed, and never completing once stolen), and the
outcomes counted per queue by the same observer as requests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    Attempt,
    ConfigurationError,
    Event,
    Idempotency,
    Intent,
    KeyReused,
    LeaseLost,
    MissingKey,
    OutcomeUnknown,
    Response,
    ResponseNotStorable,
    State,
)
from idemflow.consumers import AsyncConsumer, Consumer
from idemflow.metrics import PrometheusMetrics
from idemflow.stores.memory import AsyncMemoryStore, MemoryStore
from idemflow.stores.sqlite import AsyncSQLiteStore
from idemflow.testing import FrozenClock
from tests.consumers._support import Overrun, outlive_the_lease, steal_the_claim
from tests.factories import POLICY

QUEUE = "payments"


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def metrics() -> PrometheusMetrics:
    return PrometheusMetrics()


@pytest.fixture
def consumer(store: MemoryStore, clock: FrozenClock, metrics: PrometheusMetrics) -> Consumer:
    return Consumer(Idempotency(store, POLICY, clock=clock, observer=metrics), QUEUE)


def effect(effects: list[str], value: Any = None) -> Callable[[Attempt], Any]:
    def handler(attempt: Attempt) -> Any:
        effects.append(attempt.record.key)
        return value

    return handler


def test_a_message_delivered_twice_runs_once_and_the_second_is_acked_with_the_result(
    consumer: Consumer,
) -> None:
    effects: list[str] = []

    first = consumer.handle("m-1", b'{"amount": 5}', effect(effects, {"charged": 5}))
    second = consumer.handle("m-1", b'{"amount": 5}', effect(effects, {"charged": 6}))

    assert (first.action, second.action) == ("ack", "ack_with_stored_result")
    assert second.response is not None
    assert second.response.json_body() == {"charged": 5}
    assert effects == ["m-1"]


def test_same_key_other_payload_is_dead_lettered_without_running(consumer: Consumer) -> None:
    effects: list[str] = []
    consumer.handle("m-1", b"one", effect(effects))

    poisoned = consumer.handle("m-1", b"two", effect(effects))

    assert poisoned.action == "dead_letter"
    assert isinstance(poisoned.problem, KeyReused)
    assert effects == ["m-1"]


def test_a_message_without_a_key_is_dead_lettered(consumer: Consumer) -> None:
    decision = consumer.handle("", b"one", effect([]))

    assert decision.action == "dead_letter"
    assert isinstance(decision.problem, MissingKey)


def test_a_key_read_by_a_function_is_the_key_and_its_missing_key_dead_letters(
    consumer: Consumer,
) -> None:
    """The adapters hand the entry point a function reading the message's key: its answer
    is the key, its ``MissingKey`` (no such header or field) a dead letter, nothing run."""
    effects: list[str] = []

    def absent() -> str:
        raise MissingKey("the message has no 'Idempotency-Key' header")

    read = consumer.handle(lambda: "m-1", b"one", effect(effects))
    missing = consumer.handle(absent, b"one", effect(effects))

    assert (read.action, effects) == ("ack", ["m-1"])
    assert missing.action == "dead_letter"
    assert str(missing.problem) == "the message has no 'Idempotency-Key' header"


def test_a_key_function_that_fails_otherwise_is_a_mistake_raised(consumer: Consumer) -> None:
    """Not a message to dead-letter or redeliver: the adapter leaves it unacked."""

    def broken() -> str:
        raise AttributeError("'NoneType' object has no attribute 'get'")

    with pytest.raises(AttributeError):
        consumer.handle(broken, b"one", effect([]))


def test_in_progress_elsewhere_is_requeued_with_a_delay_never_waited_for(
    consumer: Consumer,
) -> None:
    seen = []

    def first(attempt: Attempt) -> None:
        seen.append(consumer.handle("m-1", b"one", effect([])))

    assert consumer.handle("m-1", b"one", first).action == "ack"

    (duplicate,) = seen
    assert duplicate.action == "requeue_with_delay"
    assert duplicate.delay >= POLICY.retry_after


def test_a_transient_failure_releases_and_the_redelivery_runs_once(
    consumer: Consumer, store: MemoryStore
) -> None:
    effects: list[str] = []

    def failing(attempt: Attempt) -> None:
        raise ConnectionError("the payment provider is down")

    failed = consumer.handle("m-1", b"one", failing)
    assert failed.action == "release_and_requeue"
    assert isinstance(failed.problem, ConnectionError)
    unavailable = consumer.handle("m-1", b"one", lambda attempt: Response(503, b""))
    assert unavailable.action == "release_and_requeue"
    record = store.get(QUEUE, "m-1")
    assert record is not None
    assert record.state is State.RELEASED

    assert consumer.handle("m-1", b"one", effect(effects)).action == "ack"
    assert consumer.handle("m-1", b"one", effect(effects)).action == "ack_with_stored_result"
    assert effects == ["m-1"]


def test_an_unknown_outcome_keeps_the_claim(consumer: Consumer, store: MemoryStore) -> None:
    def unknown(attempt: Attempt) -> None:
        raise OutcomeUnknown("the provider timed out after the request was sent")

    decision = consumer.handle("m-1", b"one", unknown)

    assert decision.action == "keep_claimed"
    record = store.get(QUEUE, "m-1")
    assert record is not None
    assert record.state is State.IN_PROGRESS


def test_an_answer_that_cannot_be_stored_is_a_mistake_raised_not_a_redelivery(
    consumer: Consumer, store: MemoryStore
) -> None:
    with pytest.raises(ResponseNotStorable):
        consumer.handle("m-1", b"one", lambda attempt: object())

    record = store.get(QUEUE, "m-1")
    assert record is not None
    assert record.state is State.RELEASED


def test_an_async_handler_given_to_the_sync_consumer_is_refused(consumer: Consumer) -> None:
    async def handler(attempt: Attempt) -> None:
        return None

    with pytest.raises(ConfigurationError, match="coroutine function"):
        consumer.handle("m-1", b"one", handler)


def test_outcomes_are_counted_per_queue_like_requests(
    consumer: Consumer, metrics: PrometheusMetrics
) -> None:
    consumer.handle("m-1", b"one", effect([]))
    consumer.handle("m-1", b"one", effect([]))
    consumer.handle("m-1", b"two", effect([]))

    counted = {
        event: metrics.count(event, QUEUE)
        for event in (Event.CLAIMED, Event.COMPLETED, Event.REPLAYED, Event.FINGERPRINT_MISMATCH)
    }
    assert counted == {
        Event.CLAIMED: 1,
        Event.COMPLETED: 1,
        Event.REPLAYED: 1,
        Event.FINGERPRINT_MISMATCH: 1,
    }


def swept(store: Any, clock: FrozenClock) -> list[Any]:
    """The sweeper's pass at ``clock()``: claims untouched for the stale threshold, released."""
    cutoff = clock() - POLICY.stale_seconds
    marked = store.sweep(State.IN_PROGRESS, cutoff, clock(), clock() + 3600, 100)
    for record in marked:
        assert store.release_stale(record, clock())
    return list(marked)


def intent_of(record: Any) -> Intent:
    return Intent(record.principal, record.key, record.fingerprint, record.endpoint)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """The sync twin of ``until``: poll the real state, fail after 10 s."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        threading.Event().wait(0.005)


def renewed_at(store: Any, clock: FrozenClock) -> Callable[[], bool]:
    def check() -> bool:
        record = store.get(QUEUE, "m-1")
        return record is not None and record.updated_at == clock()

    return check


def test_a_handler_longer_than_its_lease_keeps_its_claim(
    store: MemoryStore, clock: FrozenClock
) -> None:
    consumer = Consumer(Idempotency(store, POLICY, clock=clock), QUEUE, renew_every=0.01)

    def long(attempt: Attempt) -> str:
        clock.advance(POLICY.stale_seconds - 1)
        wait_for(renewed_at(store, clock), "a renewal")
        clock.advance(2)  # past the threshold counted from the claim
        assert swept(store, clock) == []
        return "done"

    assert consumer.handle("m-1", b"one", long).action == "ack"


def test_a_sync_handler_whose_lease_is_stolen_never_completes(
    store: MemoryStore, clock: FrozenClock
) -> None:
    consumer = Consumer(Idempotency(store, POLICY, clock=clock), QUEUE, renew_every=0.01)

    def overrun(attempt: Attempt) -> str:
        clock.advance(POLICY.stale_seconds + 1)
        assert len(swept(store, clock)) == 1
        assert store.claim(intent_of(attempt.record), "lease-b", clock(), clock() + 60).owned
        return "too late"

    decision = consumer.handle("m-1", b"one", overrun)

    assert decision.action == "requeue_with_delay"
    assert isinstance(decision.problem, LeaseLost)
    record = store.get(QUEUE, "m-1")
    assert record is not None
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "lease-b")


@pytest.fixture(params=["memory", "sqlite"])
async def async_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """An async store (its ``renew`` written for it: the memory store's, SQLite's hops)."""
    if request.param == "memory":
        yield AsyncMemoryStore()
        return
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    await store.migrate()
    yield store
    await store.close()


@pytest.mark.anyio
async def test_an_async_handler_longer_than_its_lease_keeps_its_claim(
    clock: FrozenClock, async_store: Any
) -> None:
    consumer = AsyncConsumer(
        AsyncIdempotency(async_store, POLICY, clock=clock), QUEUE, renew_every=0.01
    )

    async def long(attempt: AsyncAttempt) -> str:
        await outlive_the_lease(async_store, QUEUE, clock, key="m-1")
        return "done"

    assert (await consumer.handle("m-1", b"one", long)).action == "ack"


@pytest.mark.anyio
async def test_an_async_handler_whose_lease_is_stolen_is_cancelled(clock: FrozenClock) -> None:
    store = AsyncMemoryStore()
    consumer = AsyncConsumer(AsyncIdempotency(store, POLICY, clock=clock), QUEUE, renew_every=0.01)
    stuck = Overrun()

    handling = asyncio.create_task(consumer.handle("m-1", b"one", stuck))
    await stuck.started.wait()
    await steal_the_claim(store, clock)

    decision = await handling

    assert decision.action == "requeue_with_delay"
    assert isinstance(decision.problem, LeaseLost)
    assert stuck.effects == []
    record = await store.get(QUEUE, "m-1")
    assert record is not None
    assert (record.state, record.lease_token) == (State.IN_PROGRESS, "lease-b")


class KeepsNoClaimAlive(MemoryStore):
    """A store as a third party might write one: every write fenced, but no `renew`."""

    renews_claims = False

    def renew(self, record: Any, now: float) -> None:
        raise ConfigurationError("cannot renew")


class AsyncKeepsNoClaimAlive(AsyncMemoryStore):
    renews_claims = False

    async def renew(self, record: Any, now: float) -> None:
        raise ConfigurationError("cannot renew")


def test_a_store_that_cannot_renew_a_claim_is_refused_at_start_up(clock: FrozenClock) -> None:
    """Its claims would age out under a long handler and the sweeper would hand the message
    to another consumer: refused when the consumer is made, naming the fix, never found out
    mid-handler."""
    with pytest.raises(ConfigurationError, match=r"cannot renew a claim.*renews_claims"):
        Consumer(Idempotency(KeepsNoClaimAlive(), POLICY, clock=clock), QUEUE)
    with pytest.raises(ConfigurationError, match=r"cannot renew a claim.*renews_claims"):
        AsyncConsumer(AsyncIdempotency(AsyncKeepsNoClaimAlive(), POLICY, clock=clock), QUEUE)
