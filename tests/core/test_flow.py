"""
The sans-I/O protocol driven by hand: every branch of ``idempotency_flow``.

No store, no event loop: the test plays the driver, sends each step's result
into the generator (or throws the step's exception into it) and checks the
next step the flow asks for.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import Any

import pytest

from idemflow import (
    Claim,
    InProgress,
    Intent,
    KeyReused,
    LeaseLost,
    Outcome,
    OutcomeUnknown,
    Policy,
    Record,
    Response,
    State,
    StoreUnavailable,
    Verdict,
)
from idemflow._flow import (
    ClaimKey,
    CommitClaim,
    Complete,
    Execute,
    Flow,
    PhaseCommitted,
    Release,
    Step,
    idempotency_flow,
)
from idemflow.testing import FrozenClock
from tests.factories import CREATED_AT as CREATED

POLICY = Policy(request_timeout=5, retention=3600, retry_after=7)
INTENT = Intent("alice", "k-1", "fp-1", endpoint="POST /payments", correlation_id="req-1")


def record(
    state: State = State.IN_PROGRESS,
    fingerprint: str = "fp-1",
    response: Response | None = None,
    lease: str = "lease-1",
) -> Record:
    return Record(
        id=1,
        principal="alice",
        key="k-1",
        fingerprint=fingerprint,
        endpoint="POST /payments",
        state=state,
        lease_token=lease,
        created_at=1000.0,
        updated_at=1000.0,
        expires_at=4600.0,
        correlation_id="req-0",
        response=response,
    )


def start(policy: Policy = POLICY, *, atomic: bool = True) -> tuple[Flow, Step]:
    flow = idempotency_flow(INTENT, policy, "lease-1", atomic=atomic)
    return flow, next(flow)


def finish(flow: Flow, result: Any = None) -> Outcome:
    """Send the last step's result; the flow must end with an Outcome."""
    with pytest.raises(StopIteration) as stopped:
        flow.send(result)
    outcome: Outcome = stopped.value.value
    return outcome


def owned(policy: Policy = POLICY, *, atomic: bool = True) -> tuple[Flow, Record]:
    """A flow whose claim we won, standing at the Execute step."""
    flow, _ = start(policy, atomic=atomic)
    mine = record()
    step = flow.send(Claim(owned=True, record=mine))
    assert step == Execute(mine)
    return flow, mine


# --- the claim ----------------------------------------------------------------


def test_first_step_is_one_atomic_claim_with_the_policy_retention() -> None:
    """The flow begins by claiming: intent, our lease token and the retention window."""
    _, step = start()

    assert step == ClaimKey(INTENT, "lease-1", 3600.0, POLICY.stale_seconds)


def test_store_failure_during_the_claim_propagates_and_nothing_else_happens() -> None:
    """If the claim itself fails, there is nothing to release: the error leaves the flow."""
    flow, _ = start()
    down = StoreUnavailable("down")

    with pytest.raises(StoreUnavailable) as raised:
        flow.throw(down)
    assert raised.value is down


# --- owned: execute, then complete or release ---------------------------------


@pytest.mark.parametrize("status", [200, 201, 204, 302])
def test_success_is_completed_with_the_response(status: int) -> None:
    """2xx/3xx: the flow completes the record as completed with the exact response."""
    flow, mine = owned()
    response = Response(status, b"ok", (("x-a", "1"),))

    step = flow.send(response)

    assert step == Complete(mine, State.COMPLETED, response, 3600.0)
    assert finish(flow) == Outcome(response, replayed=False, record=mine)


@pytest.mark.parametrize("status", [400, 402, 404, 409, 422])
def test_business_rejection_is_stored_as_failed_permanent(status: int) -> None:
    """A deterministic 4xx settles the key as failed_permanent, to be replayed."""
    flow, mine = owned()
    rejected = Response.json(status, {"error": "card_declined"})

    step = flow.send(rejected)

    assert step == Complete(mine, State.FAILED_PERMANENT, rejected, 3600.0)
    assert finish(flow) == Outcome(rejected, replayed=False, record=mine)


@pytest.mark.parametrize("status", [503, 429, 408, 425, 500, 502, 504])
def test_transient_failure_releases_and_is_returned_but_not_stored(status: int) -> None:
    """A transient status releases the claim (never Complete) and still reaches the caller."""
    flow, mine = owned()
    transient = Response(status, b"try again")

    step = flow.send(transient)

    assert step == Release(mine)
    assert finish(flow) == Outcome(transient, replayed=False, record=mine)


def test_handler_exception_releases_then_reraises_the_same_object() -> None:
    """The handler's exception is never wrapped: Release first, then the very same object."""
    flow, mine = owned()
    boom = RuntimeError("boom")

    step = flow.throw(boom)

    assert step == Release(mine)
    with pytest.raises(RuntimeError) as raised:
        flow.send(None)
    assert raised.value is boom


def test_base_exceptions_from_the_handler_also_release() -> None:
    """Cancellation or Ctrl-C inside the handler still gives the key back (before any
    committed phase: the flow asks, and the driver says none)."""
    flow, mine = owned()
    interrupt = KeyboardInterrupt()

    assert flow.throw(interrupt) == PhaseCommitted(mine)
    assert flow.send(False) == Release(mine)
    with pytest.raises(KeyboardInterrupt) as raised:
        flow.send(None)
    assert raised.value is interrupt


@pytest.mark.parametrize("recovery_point", [None, "charging"], ids=["own-phase", "resumed"])
def test_a_cancellation_past_a_committed_phase_keeps_the_claim(
    recovery_point: str | None,
) -> None:
    """Cancelled past a committed phase (its own, or from the start of a resumed run: the
    driver knows whether it started), the operation may have made the external call that
    followed it and never said otherwise: no release, the key is the sweeper's. An
    exception is the operation's own answer, and still releases."""
    flow, _ = start()
    mine = replace(record(), recovery_point=recovery_point)
    assert flow.send(Claim(owned=True, record=mine)) == Execute(mine)
    cancelled = asyncio.CancelledError()

    assert flow.throw(cancelled) == PhaseCommitted(mine)
    with pytest.raises(asyncio.CancelledError) as raised:
        flow.send(True)
    assert raised.value is cancelled

    flow, _ = start()
    assert flow.send(Claim(owned=True, record=mine)) == Execute(mine)
    assert flow.throw(RuntimeError("the handler's own")) == Release(mine)


#: POLICY's sweeper horizon: its 20 s stale threshold (2 x 5 s + 10 s) plus one 2 s interval.
SWEPT_WITHIN = 22


@pytest.mark.parametrize("recovery_point", [None, "charging"], ids=["fresh", "resumed"])
@pytest.mark.parametrize("atomic", [True, False], ids=["two-commit", "no-transaction"])
def test_an_unknown_outcome_keeps_a_durable_claim_without_asking(
    atomic: bool, recovery_point: str | None
) -> None:
    """The handler says it cannot tell whether its external effect happened. Its claim is
    durable from the claim on with two commits, without a transaction and in middleware
    mode: no release (a retry would call again), no question to the driver, the very same
    exception out, its ``retry_after`` raised to when the sweeper will have passed."""
    flow, _ = start(atomic=atomic)
    mine = replace(record(), recovery_point=recovery_point)
    assert flow.send(Claim(owned=True, record=mine)) == Execute(mine)
    unknown = OutcomeUnknown("the provider timed out")

    with pytest.raises(OutcomeUnknown) as raised:
        flow.throw(unknown)
    assert raised.value is unknown
    assert (
        unknown.retry_after
        == SWEPT_WITHIN
        == math.ceil(POLICY.stale_seconds + POLICY.sweep_interval)
    )


def test_an_unknown_outcome_never_lowers_the_handlers_retry_after() -> None:
    flow, _ = owned()
    with pytest.raises(OutcomeUnknown) as raised:
        flow.throw(OutcomeUnknown(retry_after=600))
    assert raised.value.retry_after == 600


@pytest.mark.parametrize("resumed", [False, True], ids=["own-phase", "resumed"])
def test_single_commit_keeps_an_unknown_outcome_past_a_committed_phase_only(
    resumed: bool,
) -> None:
    """Single-commit mode: before the first ``commit_phase`` the claim is in the request's
    transaction, and the rollback takes it with the effect (nothing durable to keep: the
    Release step is that rollback). Past a committed phase (its own, or a resumed run's,
    whose take-over committed first) the claim is durable and stays."""
    mine = replace(record(), recovery_point="charging" if resumed else None)

    def executing() -> Flow:
        flow = idempotency_flow(INTENT, POLICY, "lease-1", atomic=True, single_commit=True)
        next(flow)
        step = flow.send(Claim(owned=True, record=mine))
        if resumed:
            assert step == CommitClaim(mine)
            step = flow.send(None)
        assert step == Execute(mine)
        return flow

    flow = executing()
    assert flow.throw(OutcomeUnknown()) == PhaseCommitted(mine)
    with pytest.raises(OutcomeUnknown) as kept:
        flow.send(True)
    assert kept.value.retry_after == SWEPT_WITHIN

    flow = executing()
    assert flow.throw(OutcomeUnknown()) == PhaseCommitted(mine)
    assert flow.send(False) == Release(mine)
    with pytest.raises(OutcomeUnknown) as rolled_back:
        flow.send(None)
    assert rolled_back.value.retry_after == POLICY.retry_after


def test_lost_lease_at_completion_propagates_without_a_release() -> None:
    """A failed completion CAS means the key is someone else's: no release, LeaseLost out."""
    flow, _ = owned()
    flow.send(CREATED)
    lost = LeaseLost("taken over")

    with pytest.raises(LeaseLost) as raised:
        flow.throw(lost)
    assert raised.value is lost


def test_failed_completion_releases_then_reraises() -> None:
    """A completion that did not commit (e.g. a deferred constraint failed) settles nothing:
    the key is released, fenced by our lease, and the commit's error goes out unchanged."""
    flow, mine = owned()
    assert flow.send(CREATED) == Complete(mine, State.COMPLETED, CREATED, 3600.0)
    failed = RuntimeError("deferred constraint violated at COMMIT")

    assert flow.throw(failed) == PhaseCommitted(mine)
    assert flow.send(False) == Release(mine)  # no phase of its own committed
    with pytest.raises(RuntimeError) as raised:
        flow.send(None)
    assert raised.value is failed


def test_failed_completion_after_a_committed_phase_keeps_the_claim() -> None:
    """Past a ``commit_phase`` the effect no longer rolls back whole: an external call made
    after it may have happened. Releasing would let a retry make it again (a second charge
    without a downstream key), so the key stays claimed for the sweeper's reconciler and
    the outage says the outcome went unrecorded."""
    flow, mine = owned()
    assert flow.send(CREATED) == Complete(mine, State.COMPLETED, CREATED, 3600.0)

    assert flow.throw(StoreUnavailable("connection lost")) == PhaseCommitted(mine)
    with pytest.raises(StoreUnavailable, match="could not be recorded"):
        flow.send(True)


def test_failed_completion_of_a_resumed_intent_keeps_the_claim() -> None:
    """A retry that resumed after an earlier attempt's committed phase runs past it too: its
    record says so, and the flow keeps the claim without asking the driver."""
    flow, _ = start()
    resumed = replace(record(), recovery_point="charging")
    assert flow.send(Claim(owned=True, record=resumed)) == Execute(resumed)
    assert flow.send(CREATED) == Complete(resumed, State.COMPLETED, CREATED, 3600.0)

    with pytest.raises(StoreUnavailable, match="could not be recorded"):
        flow.throw(StoreUnavailable("connection lost"))


@pytest.mark.parametrize("error", [StoreUnavailable("connection lost"), RuntimeError("bug")])
def test_failed_completion_without_a_shared_transaction_keeps_the_claim(
    error: Exception,
) -> None:
    """No shared transaction: the effect happened, only its record failed. Releasing would
    run it again on the retry, so the flow asks for no release and the key stays claimed
    for the sweeper. A store outage says truthfully that the outcome went unrecorded."""
    flow, mine = owned(atomic=False)
    assert flow.send(CREATED) == Complete(mine, State.COMPLETED, CREATED, 3600.0)

    with pytest.raises(type(error)) as raised:
        flow.throw(error)
    if isinstance(error, StoreUnavailable):
        assert raised.value.__cause__ is error
        assert "could not be recorded" in str(raised.value)
    else:
        assert raised.value is error


def test_handler_exception_without_a_shared_transaction_still_releases() -> None:
    """The handler raised before answering: by its contract nothing took effect."""
    flow, mine = owned(atomic=False)
    boom = ValueError("validation failed inside the handler")

    assert flow.throw(boom) == Release(mine)
    with pytest.raises(ValueError, match="validation failed"):
        flow.send(None)


def test_retention_starts_at_settlement_and_is_the_policy_retention() -> None:
    policy = Policy(request_timeout=30, retention=2)  # shorter than the stale threshold
    flow, mine = owned(policy)
    assert flow.send(CREATED) == Complete(mine, State.COMPLETED, CREATED, 2.0)


def test_failure_to_release_surfaces_after_a_transient_response() -> None:
    """If even the release fails, the driver hears about it (it decides how to log it)."""
    flow, _ = owned()
    flow.send(Response(503))
    down = StoreUnavailable("down")

    with pytest.raises(StoreUnavailable) as raised:
        flow.throw(down)
    assert raised.value is down


# --- not owned: dispatch on the existing record -------------------------------


def dispatched(existing: Record, policy: Policy = POLICY) -> Outcome:
    flow, _ = start(policy)
    return finish(flow, Claim(owned=False, record=existing))


@pytest.mark.parametrize("state", list(State))
def test_fingerprint_mismatch_is_key_reused_in_every_state(state: State) -> None:
    """A different request under the key is 422, even while the first is in progress."""
    response = CREATED if state.is_settled else None
    existing = record(state, fingerprint="fp-other", response=response)

    with pytest.raises(KeyReused) as raised:
        dispatched(existing)
    assert raised.value.status == 422
    assert "POST /payments" in str(raised.value)


@pytest.mark.parametrize("state", [State.IN_PROGRESS, State.STALE, State.RELEASED])
def test_unsettled_record_is_in_progress_with_the_policy_retry_after(state: State) -> None:
    """In flight, being recovered or being retried: 409 at once with Retry-After."""
    with pytest.raises(InProgress) as raised:
        dispatched(record(state))

    assert type(raised.value) is InProgress
    assert raised.value.status == 409
    assert raised.value.retry_after == 7


def test_a_409s_retry_after_is_dated_by_the_drivers_clock(clock: FrozenClock) -> None:
    """The flow asks its clock when the 409 is answered: the record's age decides the hint."""
    policy = Policy(request_timeout=30, retention=3600)  # stale after 70 s, swept every 7 s
    existing = replace(record(), updated_at=clock())
    hints = []
    for age in (0.5, 12.0, 45.0):
        clock.advance(age - (clock() - existing.updated_at))
        flow = idempotency_flow(INTENT, policy, "lease-1", atomic=True, clock=clock)
        next(flow)
        with pytest.raises(InProgress) as raised:
            flow.send(Claim(owned=False, record=existing))
        hints.append(raised.value.retry_after)

    assert hints == [1, 12, 32]  # live: its age so far; timed out: until the sweep ends it


@pytest.mark.parametrize("busy", [InProgress("lock wait"), LeaseLost("lost")])
def test_a_409_raised_without_a_record_gets_the_policys_floor(busy: InProgress) -> None:
    """The store's own 409s (lock wait, lease lost) carry at least ``Policy.retry_after``."""
    flow, _ = start()
    with pytest.raises(InProgress) as raised:
        flow.throw(busy)
    assert raised.value is busy
    assert busy.retry_after == 7

    flow, _ = owned()
    flow.send(Response(201))
    lost = LeaseLost("swept")
    with pytest.raises(LeaseLost):
        flow.throw(lost)
    assert lost.retry_after == 7


@pytest.mark.parametrize("state", [State.COMPLETED, State.FAILED_PERMANENT])
def test_settled_record_is_replayed_verbatim(state: State) -> None:
    """Settled: the stored status, headers and body, marked as a replay of the original."""
    stored = Response(402 if state is State.FAILED_PERMANENT else 201, b"\x00body", (("a", "b"),))
    existing = record(state, response=stored)

    outcome = dispatched(existing)

    assert outcome == Outcome(stored, replayed=True, record=existing)
    assert outcome.record.correlation_id == "req-0"


def test_settled_record_without_a_response_is_not_replayed() -> None:
    """A settled state with no stored response is never invented: 409, retry later."""
    with pytest.raises(InProgress):
        dispatched(record(State.COMPLETED, response=None))


def test_dispatch_never_asks_for_more_steps() -> None:
    """A duplicate ends the flow on the claim's answer: no Execute, no store write."""
    flow, _ = start()

    with pytest.raises(StopIteration):
        flow.send(Claim(owned=False, record=record(State.COMPLETED, response=CREATED)))


# --- the classifier is policy --------------------------------------------------


def test_custom_classifier_changes_the_verdict() -> None:
    """A policy may decide a 409 from a provider is transient and a 503 is final."""

    def classify(response: Response) -> Verdict:
        if response.status == 409:
            return Verdict.TRANSIENT
        if response.status == 503:
            return Verdict.FAILED_PERMANENT
        return Verdict.COMPLETED

    policy = Policy(request_timeout=5, retention=3600, classify=classify)

    flow, mine = owned(policy)
    assert flow.send(Response(409)) == Release(mine)

    flow, mine = owned(policy)
    assert flow.send(Response(503)) == Complete(mine, State.FAILED_PERMANENT, Response(503), 3600.0)

    flow, mine = owned(policy)
    assert flow.send(Response(422)) == Complete(mine, State.COMPLETED, Response(422), 3600.0)


@pytest.mark.parametrize("recovery_point", [None, "charging"])
def test_single_commit_commits_a_take_over_past_a_phase_before_executing(
    recovery_point: str | None,
) -> None:
    """Single-commit mode keeps the claim in the caller's transaction, except when the
    intent resumes past a committed phase: then the claim commits before the operation."""
    flow = idempotency_flow(INTENT, POLICY, "lease-1", atomic=True, single_commit=True)
    next(flow)
    mine = replace(record(), recovery_point=recovery_point)
    step = flow.send(Claim(owned=True, record=mine))
    if recovery_point is not None:
        assert step == CommitClaim(mine)
        step = flow.send(None)
    assert step == Execute(mine)
