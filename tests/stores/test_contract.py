"""
The contract every store keeps, run against each backend in ``tests/backends.py``.

Each test is a scenario from the seed's state table, driven through the sync
driver exactly as a user's service layer would call it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idemflow import (
    Attempt,
    Idempotency,
    InProgress,
    Intent,
    KeyReused,
    LeaseLost,
    Outcome,
    Policy,
    Record,
    Response,
    State,
)
from idemflow.testing import FrozenClock
from tests.backends import Backend
from tests.factories import CREATED_AT as CREATED
from tests.factories import HANDLER_EXCEPTIONS, POLICY, intent


class Harness:
    """Runs operations the way a service would: in the caller's transaction when it can."""

    def __init__(self, backend: Backend, clock: FrozenClock) -> None:
        self.backend = backend
        self.clock = clock
        self.idem = Idempotency(backend.store, POLICY, clock=clock)
        self.calls = 0

    def run(
        self,
        intent: Intent,
        respond: Callable[[Attempt], Response] = lambda attempt: CREATED,
        policy: Policy | None = None,
    ) -> Outcome:
        def handler(attempt: Attempt) -> Response:
            self.calls += 1
            # Respond first, write last: on SQLite an open write transaction
            # would queue the nested duplicate claims some scenarios make.
            response = respond(attempt)
            self.backend.write(attempt.connection, f"{intent.principal}/{intent.key}")
            return response

        with self._transaction() as transaction:
            return self.idem.run(intent, handler, transaction=transaction, policy=policy)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Any]:
        if self.backend.open_transaction is None:
            yield None
            return
        with self.backend.open_transaction() as transaction:
            yield transaction


@pytest.fixture
def harness(backend: Backend, clock: FrozenClock) -> Harness:
    return Harness(backend, clock)


def test_first_execution_runs_once_and_completes(harness: Harness, backend: Backend) -> None:
    """An unseen key is claimed, executed once and stored as completed."""
    outcome = harness.run(intent())

    assert (outcome.response, outcome.replayed) == (CREATED, False)
    assert harness.calls == 1
    assert backend.count() == 1
    record = backend.store.get("alice", "k-1")
    assert record is not None
    assert (record.state, record.response) == (State.COMPLETED, CREATED)
    assert record.correlation_id == "req-1"


def test_retry_replays_stored_response_verbatim(harness: Harness, backend: Backend) -> None:
    """A retry gets the stored status, headers and body, and the handler does not run."""
    harness.run(intent())

    replay = harness.run(intent(), lambda attempt: Response(500, b"must not run"))

    assert replay.replayed
    assert replay.response == CREATED
    assert replay.record.correlation_id == "req-1"
    assert (harness.calls, backend.count()) == (1, 1)


def test_every_text_of_a_record_survives_the_read_of_a_duplicate(
    backend: Backend, clock: FrozenClock
) -> None:
    """Quotes, backslashes, control characters and non-BMP text come back as written.

    (MySQL packs the read after a duplicate into one JSON array: its escaping must
    round-trip; keys are ASCII at the edge.)"""
    odd = Intent(
        'tenant "ü" \\ \t 😀',
        "k\"\\'-1",
        'fp"\\1',
        endpoint='POST /pay"ments\\ü',
        correlation_id='req "1" \\ \n 😀',
    )
    headers = (("content-type", "application/json"), ("x-note", 'a "b" \\ ✓'))
    response = Response(201, b'{"\\u00fc":"\xc3\xbc"}\x00\xff', headers)
    store = backend.store
    claim = store.claim(odd, "lease-a", clock(), clock() + 60)
    store.checkpoint(claim.record, 'step "2" \\ ✓', clock())
    held = store.claim(odd, "lease-b", clock(), clock() + 60)
    store.complete(claim.record, State.COMPLETED, response, clock(), clock() + 60)
    replay = store.claim(odd, "lease-c", clock(), clock() + 60)

    assert claim.owned
    assert not held.owned
    assert not replay.owned
    for record in (held.record, replay.record):
        assert (record.principal, record.key, record.fingerprint) == (
            odd.principal,
            odd.key,
            odd.fingerprint,
        )
        assert (record.endpoint, record.correlation_id) == (odd.endpoint, odd.correlation_id)
    assert (held.record.lease_token, held.record.recovery_point) == ("lease-a", 'step "2" \\ ✓')
    assert replay.record.response == response


def test_same_key_different_request_is_rejected(harness: Harness) -> None:
    """A key reused for another fingerprint is the client's bug: KeyReused (422)."""
    harness.run(intent())

    with pytest.raises(KeyReused) as raised:
        harness.run(intent(fp="fp-other"))
    assert raised.value.status == 422
    assert harness.calls == 1


def test_mismatch_wins_over_in_progress(harness: Harness) -> None:
    """Fingerprint is compared before state: a different request gets 422 even mid-flight."""
    seen: list[BaseException] = []

    def meanwhile(attempt: Attempt) -> Response:
        with pytest.raises(KeyReused) as raised:
            harness.idem.run(intent(fp="fp-other"), lambda a: CREATED)
        seen.append(raised.value)
        return CREATED

    harness.run(intent(), meanwhile)
    assert len(seen) == 1


def test_duplicate_while_running_gets_in_progress_at_once(harness: Harness) -> None:
    """A duplicate of a running request is refused with a retry hint, never held."""
    seen: list[InProgress] = []

    def meanwhile(attempt: Attempt) -> Response:
        with pytest.raises(InProgress) as raised:
            harness.idem.run(intent(), lambda a: CREATED)
        seen.append(raised.value)
        return CREATED

    harness.run(intent(), meanwhile)
    assert seen[0].status == 409
    assert seen[0].retry_after >= 1
    assert harness.calls == 1


def test_transient_failure_releases_and_retry_really_runs(
    harness: Harness, backend: Backend
) -> None:
    """A 503 is not stored: the key is released and the next attempt executes."""
    first = harness.run(intent(), lambda attempt: Response(503, b"provider down"))
    assert first.response.status == 503
    record = backend.store.get("alice", "k-1")
    assert record is not None
    assert record.state is State.RELEASED

    second = harness.run(intent())

    assert (second.response, second.replayed) == (CREATED, False)
    assert harness.calls == 2
    if backend.transactional:  # the failed attempt's business write rolled back
        assert backend.count() == 1


def test_released_key_is_not_free_for_a_different_request(harness: Harness) -> None:
    """Released means "retry the same request", not "reuse the key": 422."""
    harness.run(intent(), lambda attempt: Response(503))

    with pytest.raises(KeyReused):
        harness.run(intent(fp="fp-other"))


def test_permanent_failure_is_stored_and_replayed(harness: Harness, backend: Backend) -> None:
    """A deterministic rejection (402) settles the key as failed_permanent."""
    declined = Response.json(402, {"error": "card_declined"})
    harness.run(intent(), lambda attempt: declined)

    replay = harness.run(intent())

    assert (replay.response, replay.replayed) == (declined, True)
    record = backend.store.get("alice", "k-1")
    assert record is not None
    assert record.state is State.FAILED_PERMANENT
    assert harness.calls == 1


@HANDLER_EXCEPTIONS
def test_unexpected_exception_releases_and_passes_through_unchanged(
    harness: Harness, backend: Backend, make_exception: Callable[[], Exception]
) -> None:
    """The handler's own exception propagates as is, whatever its type (a StopIteration
    too, which the flow's generator would turn into a RuntimeError); the key is free to
    retry."""
    boom = make_exception()

    def explode(attempt: Attempt) -> Response:
        raise boom

    with pytest.raises(type(boom)) as raised:
        harness.run(intent(), explode)
    assert raised.value is boom
    record = backend.store.get("alice", "k-1")
    assert record is not None
    assert record.state is State.RELEASED
    if backend.transactional:
        assert backend.count() == 0

    assert harness.run(intent()).response == CREATED


def test_principals_are_isolated(harness: Harness, backend: Backend) -> None:
    """The same key from two principals is two intents: two executions, no leak."""
    alice = harness.run(intent(principal="alice"), lambda a: Response(201, b"alice's"))
    bob = harness.run(intent(principal="bob"), lambda a: Response(201, b"bob's"))

    assert (alice.response.body, bob.response.body) == (b"alice's", b"bob's")
    assert not bob.replayed
    assert harness.calls == 2
    assert harness.run(intent(principal="bob")).response.body == b"bob's"


def test_expired_record_is_treated_as_absent(harness: Harness, clock: FrozenClock) -> None:
    """Past retention the key starts over, even for a different request."""
    harness.run(intent())
    clock.advance(3601)

    outcome = harness.run(intent(fp="fp-new"), lambda a: Response(201, b"new"))

    assert (outcome.replayed, outcome.response.body) == (False, b"new")
    assert outcome.record.attempt == 1
    assert harness.calls == 2


def sweep_away(store: Any, clock: FrozenClock) -> list[Any]:
    """What the sweeper does to a claim whose request it takes for dead: mark, then release."""
    marked = store.sweep(State.IN_PROGRESS, clock() + 1, clock(), clock() + 3600, 100)
    for record in marked:
        assert store.release_stale(record, clock())
    return list(marked)


def test_lost_claim_cannot_complete_and_its_effect_rolls_back(
    harness: Harness, backend: Backend, clock: FrozenClock
) -> None:
    """If the claim is taken over mid-flight, completion fails and nothing commits."""
    taken_over: list[Outcome] = []

    def overrun(attempt: Attempt) -> Response:
        # We run past the stale threshold: the sweeper ends our claim and a
        # retry takes the key over meanwhile.
        clock.advance(POLICY.stale_seconds + 1)
        assert len(sweep_away(backend.store, clock)) == 1
        taken_over.append(Harness(backend, clock).run(intent(), lambda a: Response(201, b"new")))
        return CREATED

    with pytest.raises(backend.lease_lost) as raised:
        harness.run(intent(), overrun)

    assert raised.value.status == (409 if isinstance(raised.value, LeaseLost) else 503)
    record = backend.store.get("alice", "k-1")
    assert record is not None
    assert record.response is not None
    assert record.response.body == b"new"  # the new owner's record is untouched
    if backend.transactional:
        assert backend.count() == 1  # only the new owner's effect committed


def test_retention_never_takes_over_a_claim_in_flight(backend: Backend, clock: FrozenClock) -> None:
    """However long a claim runs, retention cannot hand its key to another request: only
    the sweeper's fenced path ends a claim in flight."""
    store = backend.store
    first = store.claim(intent(), "lease-a", clock(), clock() + 1)
    clock.advance(10_000)

    same = store.claim(intent(), "lease-b", clock(), clock() + 1)
    other = store.claim(intent(fp="fp-other"), "lease-c", clock(), clock() + 1)

    assert first.owned
    assert (same.owned, other.owned) == (False, False)
    assert same.record.lease_token == "lease-a"
    store.complete(first.record, State.COMPLETED, CREATED, clock(), clock() + 60)
    settled = store.get("alice", "k-1")
    assert settled is not None
    assert settled.state is State.COMPLETED


def test_retention_counts_from_settlement(backend: Backend, clock: FrozenClock) -> None:
    """A short retention after a long request: replayed for the retention after it
    settled, then the same key is a new intent (new created_at, no recovery point)."""
    store = backend.store
    first = store.claim(intent(), "lease-a", clock(), clock() + 2).record
    store.checkpoint(first, "payment_created", clock())
    clock.advance(100)  # the request ran far longer than the retention
    store.complete(first, State.COMPLETED, CREATED, clock(), clock() + 2)
    settled_at = clock()

    clock.advance(1.5)
    replay = store.claim(intent(fp="fp-other"), "lease-b", clock(), clock() + 2)
    assert not replay.owned
    assert replay.record.response == CREATED

    clock.advance(1)
    again = store.claim(intent(), "lease-c", clock(), clock() + 2)
    assert again.owned
    assert again.record.recovery_point is None
    assert again.record.attempt == 1
    assert again.record.created_at > settled_at
    assert again.record.created_at != first.created_at


def test_a_released_intent_past_an_external_call_outlives_its_retention(
    backend: Backend, clock: FrozenClock
) -> None:
    """Released after a recovery point (the provider may have charged), then left past its
    retention: the same request still resumes it (same created_at, so the same downstream
    keys: the provider de-duplicates), another request gets no takeover, and purge keeps
    it: only reconciliation or a retry may end it, never the clock."""
    store: Any = backend.store
    first = store.claim(intent(), "lease-a", clock(), clock() + 2).record
    store.checkpoint(first, "payment_created", clock())
    assert store.release(first, clock())
    clock.advance(10)

    other = store.claim(intent(fp="fp-other"), "lease-b", clock(), clock() + 2)
    assert store.purge(clock(), 10) == 0
    retry = store.claim(intent(), "lease-c", clock(), clock() + 2)

    assert not other.owned
    assert retry.owned
    assert retry.record.recovery_point == "payment_created"
    assert retry.record.created_at == first.created_at
    assert retry.record.attempt == 2


def test_release_and_complete_are_fenced_by_the_lease(backend: Backend, clock: FrozenClock) -> None:
    """A stale owner's lease token can neither release nor complete the new owner's record."""
    store = backend.store
    first = store.claim(intent(), "lease-a", clock(), clock() + 3600, stale_after=20).record
    clock.advance(21)
    sweep_away(store, clock)
    second = store.claim(intent(), "lease-b", clock(), clock() + 3600)
    assert second.owned

    assert store.release(first, clock()) is False
    with pytest.raises(LeaseLost):
        store.complete(first, State.COMPLETED, CREATED, clock(), clock() + 3600)
    current = store.get("alice", "k-1")
    assert current is not None
    assert (current.state, current.lease_token) == (State.IN_PROGRESS, "lease-b")


def test_a_renewed_claim_outlives_the_stale_threshold_and_a_stolen_one_cannot_renew(
    backend: Backend, clock: FrozenClock
) -> None:
    """``renew`` dates the claim now (its deadline its own threshold from the last renewal),
    fenced by the lease: once the claim is swept and taken over, renewing raises LeaseLost."""
    store: Any = backend.store
    first = store.claim(intent(), "lease-a", clock(), clock() + 3600, stale_after=20).record
    clock.advance(19)
    store.renew(first, clock())
    clock.advance(2)  # past the threshold counted from the claim, not from the renewal

    def sweep() -> list[Any]:
        return list(store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 3600, 100))

    assert sweep() == []
    clock.advance(20)
    (marked,) = sweep()
    assert store.release_stale(marked, clock())
    assert store.claim(intent(), "lease-b", clock(), clock() + 3600).owned
    with pytest.raises(LeaseLost):
        store.renew(first, clock())
    current = store.get("alice", "k-1")
    assert current is not None
    assert (current.state, current.lease_token) == (State.IN_PROGRESS, "lease-b")


def test_each_claim_is_swept_at_its_own_threshold_which_its_owner_writes_move_on(
    backend: Backend, clock: FrozenClock
) -> None:
    """A claim made with a longer stale threshold than the app's (a slow route, a
    consumer's lease) is not swept at the app's threshold but once its own has passed,
    counted from its owner's last write: a checkpoint or a renewal moves its deadline on."""
    store: Any = backend.store
    app, own = POLICY.stale_seconds, 3 * POLICY.stale_seconds

    def claim(name: str, token: str, stale_after: float) -> Record:
        claimed = store.claim(intent(name), token, clock(), clock() + 3600, stale_after=stale_after)
        assert claimed.owned
        return claimed.record  # type: ignore[no-any-return]

    def sweep() -> list[str]:
        marked = store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 3600, 100)
        return sorted(record.key for record in marked)

    claim("short", "lease-a", app)
    long = claim("long", "lease-b", own)
    assert long.stale_at == pytest.approx(long.updated_at + own, abs=0.001)
    read = store.get("alice", "long")
    assert read.stale_at == pytest.approx(long.stale_at, abs=0.001)

    clock.advance(app + 1)
    assert sweep() == ["short"]  # the app's threshold passed: only the claim made with it
    store.checkpoint(long, "payment_created", clock())
    clock.advance(own - 1)  # past the claim's own deadline, not the checkpoint's
    assert sweep() == []
    store.renew(long, clock())
    clock.advance(own - 1)
    assert sweep() == []
    clock.advance(2)
    assert sweep() == ["long"]


def test_claim_reports_owner_only_once(backend: Backend, clock: FrozenClock) -> None:
    """Two claims of one key: the first owns it, the second sees the first's record."""
    store = backend.store
    first = store.claim(intent(), "lease-a", clock(), clock() + 60)
    second = store.claim(intent(), "lease-b", clock(), clock() + 60)

    assert (first.owned, second.owned) == (True, False)
    assert second.record.lease_token == "lease-a"
    assert second.record.state is State.IN_PROGRESS


def test_checkpoint_keeps_recovery_point_across_release(
    backend: Backend, clock: FrozenClock
) -> None:
    """A retry of a released attempt resumes from its last committed recovery point."""
    store = backend.store
    claim = store.claim(intent(), "lease-a", clock(), clock() + 60)
    store.checkpoint(claim.record, "payment_created", clock())
    assert store.release(claim.record, clock())

    retry = store.claim(intent(), "lease-b", clock(), clock() + 60)

    assert retry.owned
    assert retry.record.recovery_point == "payment_created"
    assert retry.record.attempt == 2


def test_sweep_marks_each_stale_claim_once(backend: Backend, clock: FrozenClock) -> None:
    """Only claims whose deadline passed are marked, and a second sweep finds none."""
    store: Any = backend.store
    old = store.claim(intent("old"), "lease-a", clock(), clock() + 3600, stale_after=50).record
    clock.advance(100)
    store.claim(intent("fresh"), "lease-b", clock(), clock() + 3600, stale_after=50)

    marked = store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 3600, 100)
    again = store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 3600, 100)

    assert [r.key for r in marked] == ["old"]
    assert marked[0].state is State.STALE
    assert again == []
    with pytest.raises(LeaseLost):  # the crashed owner, should it wake, cannot complete
        store.complete(old, State.COMPLETED, CREATED, clock(), clock() + 3600)


def test_stale_record_settles_or_releases_only_as_marked(
    backend: Backend, clock: FrozenClock
) -> None:
    """A sweeper's resolution is fenced by the mark: a second resolution is refused."""
    store: Any = backend.store
    store.claim(intent("a"), "lease-a", clock(), clock() + 3600)
    store.claim(intent("b"), "lease-b", clock(), clock() + 3600)
    clock.advance(100)
    marked = store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 3600, 10)
    a, b = sorted(marked, key=lambda r: r.key)

    assert store.settle_stale(a, State.COMPLETED, CREATED, clock(), clock() + 3600) is True
    assert store.settle_stale(a, State.COMPLETED, CREATED, clock(), clock() + 3600) is False
    assert store.release_stale(b, clock()) is True
    assert store.release_stale(b, clock()) is False
    settled, released = store.get("alice", "a"), store.get("alice", "b")
    assert (settled.state, settled.response) == (State.COMPLETED, CREATED)
    assert released.state is State.RELEASED


def test_released_records_are_swept_only_past_a_recovery_point(
    backend: Backend, clock: FrozenClock
) -> None:
    """An abandoned intent that got past a recovery point (an external call may have
    happened) is marked for reconciliation; one with no progress holds nothing to resolve.
    Releasing it with forget_progress clears the point, so the retry starts afresh."""
    store: Any = backend.store
    progressed = store.claim(intent("progressed"), "lease-a", clock(), clock() + 3600).record
    store.checkpoint(progressed, "payment_created", clock())
    assert store.release(progressed, clock())
    plain = store.claim(intent("plain"), "lease-b", clock(), clock() + 3600).record
    assert store.release(plain, clock())
    clock.advance(POLICY.stale_seconds * 10)  # past the default threshold the claims carry

    marked = store.sweep(State.RELEASED, clock(), clock(), clock() + 3600, 10)

    assert [(r.key, r.state, r.recovery_point) for r in marked] == [
        ("progressed", State.STALE, "payment_created")
    ]
    assert store.release_stale(marked[0], clock(), forget_progress=True)
    resumed = store.claim(intent("progressed"), "lease-c", clock(), clock() + 3600)
    assert resumed.owned
    assert resumed.record.recovery_point is None
    assert resumed.record.created_at == progressed.created_at  # the same intent


def test_purge_deletes_exactly_the_expired(backend: Backend, clock: FrozenClock) -> None:
    """Purge removes settled and released records past retention in bounded batches, and
    nothing else: never a claim in flight, however old its claim's expiry."""
    store: Any = backend.store
    for n in range(4):
        old = store.claim(intent(f"old-{n}"), "l", clock(), clock() + 10).record
        store.complete(old, State.COMPLETED, CREATED, clock(), clock() + 10)
    released = store.claim(intent("old-released"), "l", clock(), clock() + 10).record
    assert store.release(released, clock())
    young = store.claim(intent("young"), "l", clock(), clock() + 10).record
    store.complete(young, State.COMPLETED, CREATED, clock(), clock() + 1000)
    store.claim(intent("running"), "l", clock(), clock() + 10)
    clock.advance(11)

    assert store.purge(clock(), 3) == 3
    assert store.purge(clock(), 3) == 2
    assert store.purge(clock(), 3) == 0
    assert store.get("alice", "young") is not None
    assert store.get("alice", "old-0") is None
    running = store.get("alice", "running")
    assert running is not None
    assert running.state is State.IN_PROGRESS


def test_each_route_keeps_its_outcomes_for_its_own_retention(
    harness: Harness, backend: Backend, clock: FrozenClock
) -> None:
    """Two routes through one driver, kept a minute and an hour: each record carries its own
    expiry from its route's policy, so one purge removes exactly the one past it, and that
    key alone is free for a new intent."""
    minute = Policy(request_timeout=5, retention=60)
    harness.run(intent("minute"), policy=minute)
    harness.run(intent("hour"))
    clock.advance(61)

    assert backend.store.purge(clock(), 10) == 1
    assert backend.store.get("alice", "minute") is None
    with pytest.raises(KeyReused):  # the hour's record holds its key still
        harness.run(intent("hour", fp="fp-other"))
    again = harness.run(intent("minute", fp="fp-new"), lambda a: Response(201, b"new"), minute)
    assert (again.replayed, again.response.body) == (False, b"new")


def test_next_due_is_the_deadline_of_the_oldest_record_sweep_would_mark(
    backend: Backend, clock: FrozenClock
) -> None:
    """``next_due``: the earliest sweepable record's ``stale_at`` minus the cutoff (negative
    once it is due), ``inf`` when there is none; settled records and released ones
    without a recovery point never count. The sweeper sleeps until it."""
    store: Any = backend.store

    def due(state: State, since: float = 0) -> float | None:
        answer: float | None = store.next_due(state, clock() - since, clock())
        return answer

    def claim(name: str, token: str) -> Record:
        record: Record = store.claim(
            intent(name), token, clock(), clock() + 3600, stale_after=50
        ).record
        return record

    assert [due(s) for s in (State.IN_PROGRESS, State.STALE, State.RELEASED)] == [math.inf] * 3
    first = claim("first", "lease-a")
    clock.advance(10)
    claim("second", "lease-b")
    assert due(State.IN_PROGRESS) == pytest.approx(40, abs=0.001)  # the first, 10 s old

    store.complete(first, State.COMPLETED, CREATED, clock(), clock() + 3600)
    assert due(State.IN_PROGRESS) == pytest.approx(50, abs=0.001)  # now the second
    clock.advance(60)
    assert due(State.IN_PROGRESS) == pytest.approx(-10, abs=0.001)  # due 10 s ago

    (marked,) = store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 3600, 10)
    assert due(State.IN_PROGRESS) == math.inf
    assert due(State.STALE, since=30) == pytest.approx(30, abs=0.001)  # to ask again
    assert store.release_stale(marked, clock())
    assert due(State.STALE) == math.inf
    assert due(State.RELEASED) == math.inf  # released, nothing to reconcile

    progressed = claim("progressed", "lease-c")
    store.checkpoint(progressed, "payment_created", clock())
    clock.advance(5)
    assert store.release(progressed, clock())
    assert due(State.RELEASED) == pytest.approx(50, abs=0.001)  # its own threshold on
