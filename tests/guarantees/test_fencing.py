"""
Fencing: a request that overran its lease has lost its key, in every store.

Its claim ended (swept as stale and released) and may already belong to a
new owner. Every write it still attempts — complete,
release, checkpoint — is a compare-and-swap on its lease token and fails; its
business transaction rolls back; the new owner's record is never touched.
Runs over every store in ``tests/backends.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from idemflow import (
    Attempt,
    Idempotency,
    LeaseLost,
    Outcome,
    Record,
    Response,
    State,
)
from idemflow.stores.protocol import Transaction
from idemflow.sweeper import Happened, Sweeper, SweepReport, Unknown
from idemflow.testing import FrozenClock
from tests.backends import Backend
from tests.factories import POLICY, intent

# The same numbers as the Redis backend's policy: its lease is this stale threshold.
OLD = Response.json(201, {"owner": "old"})
NEW = Response.json(201, {"owner": "new"})
RECONCILED = Response.json(201, {"owner": "provider"})


def end_the_claim(backend: Backend, clock: FrozenClock) -> None:
    """Let the claim overrun its lease: the sweeper marks it stale and releases it."""
    clock.advance(POLICY.stale_seconds + 1)
    report = Sweeper(backend.store, POLICY, clock=clock).sweep_once()
    assert report.released == 1


def new_owner(backend: Backend, clock: FrozenClock) -> Record:
    claim = backend.store.claim(
        intent(), "lease-new", clock(), clock() + 3600, stale_after=POLICY.stale_seconds
    )
    assert claim.owned
    return claim.record


def current(backend: Backend) -> Record:
    record = backend.store.get("alice", "k-1")
    assert record is not None
    return record


def test_overrun_owner_cannot_complete_release_or_checkpoint_the_new_owners_claim(
    backend: Backend, clock: FrozenClock
) -> None:
    """All three writes of the old lease fail; the new owner's record is exactly as it was."""
    old = backend.store.claim(
        intent(), "lease-old", clock(), clock() + 3600, stale_after=POLICY.stale_seconds
    ).record
    backend.store.checkpoint(old, "payment_created", clock())
    end_the_claim(backend, clock)
    mine = new_owner(backend, clock)
    backend.store.checkpoint(mine, "charged", clock())
    before = current(backend)

    with pytest.raises(LeaseLost):
        backend.store.complete(old, State.COMPLETED, OLD, clock(), clock() + 3600)
    assert backend.store.release(old, clock()) is False
    with pytest.raises(LeaseLost):
        backend.store.checkpoint(old, "payment_created", clock())

    assert current(backend) == before
    assert (before.state, before.lease_token, before.recovery_point) == (
        State.IN_PROGRESS,
        "lease-new",
        "charged",
    )


def test_overrun_owner_cannot_overwrite_the_new_owners_response(
    backend: Backend, clock: FrozenClock
) -> None:
    """After the new owner completed, the old lease still writes nothing."""
    old = backend.store.claim(
        intent(), "lease-old", clock(), clock() + 3600, stale_after=POLICY.stale_seconds
    ).record
    end_the_claim(backend, clock)
    mine = new_owner(backend, clock)
    backend.store.complete(mine, State.COMPLETED, NEW, clock(), clock() + 3600)

    with pytest.raises(LeaseLost):
        backend.store.complete(old, State.COMPLETED, OLD, clock(), clock() + 3600)
    assert backend.store.release(old, clock()) is False
    with pytest.raises(LeaseLost):
        backend.store.checkpoint(old, "late", clock())

    record = current(backend)
    assert (record.state, record.response, record.lease_token) == (
        State.COMPLETED,
        NEW,
        "lease-new",
    )


@contextlib.contextmanager
def caller_transaction(backend: Backend) -> Iterator[Transaction | None]:
    if backend.open_transaction is None:
        yield None
        return
    with backend.open_transaction() as transaction:
        yield transaction


def run(backend: Backend, clock: FrozenClock, handler: Any) -> Outcome:
    idem = Idempotency(backend.store, POLICY, clock=clock)
    with caller_transaction(backend) as transaction:
        return idem.run(intent(), handler, transaction=transaction)


def test_overrun_request_is_refused_at_completion_and_its_effect_rolls_back(
    backend: Backend, clock: FrozenClock
) -> None:
    """The old request's completion raises LeaseLost; only the new owner's row and answer stand."""

    def new_request(attempt: Attempt) -> Response:
        backend.write(attempt.connection, "new")
        return NEW

    def overrunning(attempt: Attempt) -> Response:
        # SQLite admits one writer: the old request writes after the others are done.
        if backend.name != "sqlite":
            backend.write(attempt.connection, "old")
        end_the_claim(backend, clock)
        assert run(backend, clock, new_request).response == NEW
        if backend.name == "sqlite":
            backend.write(attempt.connection, "old")
        return OLD

    with pytest.raises(backend.lease_lost):  # refused, whichever way (see lease_lost)
        run(backend, clock, overrunning)

    if backend.transactional:
        assert backend.count() == 1  # the old request's row rolled back
    replay = run(backend, clock, lambda attempt: OLD)
    assert (replay.replayed, replay.response) == (True, NEW)


def test_overrun_request_is_refused_at_its_next_checkpoint(
    backend: Backend, clock: FrozenClock
) -> None:
    """A recovery point after the claim was lost raises LeaseLost inside the handler."""
    raised: list[Exception] = []

    def overrunning(attempt: Attempt) -> Response:
        attempt.commit_phase("payment_created")  # durable now, and no lock held
        end_the_claim(backend, clock)
        assert run(backend, clock, lambda a: NEW).response == NEW
        with pytest.raises(backend.lease_lost) as lost:
            attempt.checkpoint("charged")
        raised.append(lost.value)
        raise lost.value

    with pytest.raises(backend.lease_lost):
        run(backend, clock, overrunning)

    assert len(raised) == 1
    record = current(backend)
    assert (record.state, record.response) == (State.COMPLETED, NEW)
    assert record.recovery_point == "payment_created"  # released by the sweeper: resumed


def test_every_claim_carries_its_own_lease_token(backend: Backend, clock: FrozenClock) -> None:
    """A retry of a released claim gets a new token: the old one fences nothing of it."""
    tokens: list[str | None] = []

    def transient(attempt: Attempt) -> Response:
        tokens.append(attempt.record.lease_token)
        return Response(503, b"provider down")

    def succeeding(attempt: Attempt) -> Response:
        tokens.append(attempt.record.lease_token)
        return NEW

    run(backend, clock, transient)
    run(backend, clock, succeeding)

    assert len(tokens) == 2
    assert all(tokens)
    assert tokens[0] != tokens[1]


@pytest.fixture
def sweepable(backend: Backend) -> Backend:
    """Every store: each one marks a claim stale and resolves it (Redis included)."""
    return backend


def test_swept_claim_is_fenced_before_anyone_takes_it_over(
    sweepable: Backend, clock: FrozenClock
) -> None:
    """While stale (being reconciled) the record refuses every write of its old owner."""
    old = sweepable.store.claim(
        intent(), "lease-old", clock(), clock() + 3600, stale_after=POLICY.stale_seconds
    ).record
    clock.advance(POLICY.stale_seconds + 1)
    report = Sweeper(
        sweepable.store, POLICY, reconciler=lambda r, k: Unknown(), clock=clock
    ).sweep_once()
    assert report == SweepReport(unknown=1, batches=1)
    marked = current(sweepable)

    with pytest.raises(LeaseLost):
        sweepable.store.complete(old, State.COMPLETED, OLD, clock(), clock() + 3600)
    assert sweepable.store.release(old, clock()) is False
    with pytest.raises(LeaseLost):
        sweepable.store.checkpoint(old, "late", clock())

    assert current(sweepable) == marked
    assert marked.state is State.STALE


def test_reconciled_claim_keeps_the_providers_answer_against_its_old_owner(
    sweepable: Backend, clock: FrozenClock
) -> None:
    """Once the sweeper settled from the provider's answer, the old owner cannot replace it."""
    old = sweepable.store.claim(
        intent(), "lease-old", clock(), clock() + 3600, stale_after=POLICY.stale_seconds
    ).record
    clock.advance(POLICY.stale_seconds + 1)
    Sweeper(
        sweepable.store, POLICY, reconciler=lambda r, k: Happened(RECONCILED), clock=clock
    ).sweep_once()

    with pytest.raises(LeaseLost):
        sweepable.store.complete(old, State.COMPLETED, OLD, clock(), clock() + 3600)
    assert sweepable.store.release(old, clock()) is False

    record = current(sweepable)
    assert (record.state, record.response) == (State.COMPLETED, RECONCILED)


def test_a_sweeper_cannot_resolve_a_record_it_no_longer_holds(
    sweepable: Backend, clock: FrozenClock
) -> None:
    """The sweeper's own writes are fenced too: on its mark, which a later sweep replaces."""
    store: Any = sweepable.store
    store.claim(intent(), "lease-old", clock(), clock() + 3600, stale_after=POLICY.stale_seconds)
    clock.advance(POLICY.stale_seconds + 1)
    (first_mark,) = store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 3600, 10)
    clock.advance(1)
    (second_mark,) = store.sweep(State.STALE, clock(), clock(), clock() + 3600, 10)

    assert store.settle_stale(first_mark, State.COMPLETED, OLD, clock(), clock() + 3600) is False
    assert store.release_stale(first_mark, clock()) is False
    assert (
        store.settle_stale(second_mark, State.COMPLETED, RECONCILED, clock(), clock() + 3600)
        is True
    )
    assert current(sweepable).response == RECONCILED
