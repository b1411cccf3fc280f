"""
The idempotency protocol, sans I/O: claim → dispatch on state → execute → complete | release.

Every decision about a key lives in this module. The drivers in ``_async/``
and ``_sync/`` only *perform* the steps :func:`idempotency_flow` yields and
send the results back in; they decide nothing. The protocol step by step:
docs/core.md, "The flow: claim → dispatch → execute → complete | release"; how
a driver runs it: docs/architecture.md, "How a driver runs the flow".
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeAlias

from ._errors import InProgress, KeyReused, LeaseLost, OutcomeUnknown, StoreUnavailable
from ._model import (
    Claim,
    Clock,
    Intent,
    Outcome,
    Policy,
    Record,
    Response,
    State,
    Verdict,
    make_outcome,
    retry_after,
    swept_within,
)

__all__ = ["Step", "dispatch", "idempotency_flow"]


# The steps are built on every run, so they are plain slotted dataclasses: a frozen
# one's __init__ pays an object.__setattr__ per field. Nothing ever changes one.


@dataclass(slots=True)
class ClaimKey:
    """One atomic statement: insert ``in_progress``, or take over an expired or released record."""

    intent: Intent
    lease_token: str
    retention: float


@dataclass(slots=True)
class CommitClaim:
    """Commit the claim before the operation runs (single-commit mode, resuming past a phase)."""

    record: Record


@dataclass(slots=True)
class Execute:
    """Run the operation; in transactional mode, inside the caller's open transaction."""

    record: Record


@dataclass(slots=True)
class Complete:
    """Store the settled outcome with a compare-and-swap on the lease, then commit.

    Its retention starts now: the outcome is replayed for ``retention`` seconds.
    """

    record: Record
    state: State
    response: Response
    retention: float


@dataclass(slots=True)
class Release:
    """Roll back and give the key back (if the claim is committed), so the next retry runs."""

    record: Record


@dataclass(slots=True)
class PhaseCommitted:
    """Ask the driver whether this run's operation went past a committed phase: a bool.

    It did once it committed one (``attempt.commit_phase``), or once it started
    from its record's ``recovery_point`` (a resumed run; when the operation
    answered, the flow knows that from the record without asking), or, without
    a transaction, once it started at all: nothing it does rolls back.

    Past a committed phase the effect no longer rolls back whole with the
    completion: an external call made after it may have happened.
    """

    record: Record


Step: TypeAlias = ClaimKey | CommitClaim | Execute | Complete | Release | PhaseCommitted
Flow: TypeAlias = Generator[Step, Any, Outcome]


def idempotency_flow(
    intent: Intent,
    policy: Policy,
    lease_token: str,
    *,
    atomic: bool,
    single_commit: bool = False,
    clock: Clock = time.time,
) -> Flow:
    """The whole protocol. Yields steps; returns the :class:`Outcome` or raises.

    ``atomic``: the operation's effect commits or rolls back with the
    completion (transactional mode), until it commits a phase of its own.
    Without that, an effect may have happened when its completion fails, and
    only the sweeper may decide.
    ``single_commit``: the claim is part of the caller's transaction until its
    first commit. ``clock`` dates a 409's ``Retry-After`` (see
    :func:`idemflow._model.retry_after`).
    """
    # One generator, not one delegating to another: every step crosses one frame.
    try:
        claim: Claim = yield ClaimKey(intent, lease_token, policy.retention_seconds)
        if not claim.owned:
            return dispatch(claim.record, intent, policy, clock())
        record = claim.record
        if single_commit and record.recovery_point is not None:
            # Resuming past a committed phase, the operation's next step may be an
            # external call: a crash that rolled the take-over back would leave the
            # intent released, and a retry would resume (and call) a second time.
            yield CommitClaim(record)
        try:
            response: Response = yield Execute(record)
        except BaseException as exc:
            if (yield from _outcome_unknown(exc, record, single_commit)):
                # The external call may have happened and nobody can say: releasing would
                # let a retry resume and make it again. The key stays claimed (the driver
                # rolls back what is still open) for the sweeper's reconciler.
                if isinstance(exc, OutcomeUnknown):
                    exc.retry_after = max(exc.retry_after, swept_within(policy))
                raise
            # The operation failed (or was cancelled) before it answered: nothing
            # settled. Give the key back and let its own exception through unchanged.
            if isinstance(exc, OutcomeUnknown):
                exc.retry_after = max(exc.retry_after, policy.retry_after)
            yield Release(record)
            raise
        verdict = policy.verdict(response)
        if verdict is Verdict.TRANSIENT:
            yield Release(record)  # a 503 must not poison the key
            return make_outcome(response, False, record)
        try:
            yield Complete(record, verdict.value, response, policy.retention_seconds)
        except LeaseLost:
            raise  # the key is someone else's now: nothing of ours to release
        except BaseException as exc:
            if atomic and not (yield from _past_a_committed_phase(record)):
                # The completion did not commit (or we cannot tell), and the effect
                # rolled back with it: nothing settled. The release is fenced by our
                # lease and in_progress, so it changes nothing if the commit did happen.
                yield Release(record)
                raise
            if isinstance(exc, StoreUnavailable):
                # The effect happened, or its part past a committed phase may have
                # (an external call): only its record is missing. Releasing would run
                # it again: the key stays claimed for the sweeper's reconciler.
                raise StoreUnavailable(_UNRECORDED, retry_after=exc.retry_after) from exc
            raise
        return make_outcome(response, False, record)
    except InProgress as busy:
        # A 409 raised without the record to date it (the store's lock wait on
        # an uncommitted claim, a lease lost): the policy's floor still holds.
        busy.retry_after = max(busy.retry_after, policy.retry_after)
        raise


def _outcome_unknown(
    exc: BaseException, record: Record, single_commit: bool
) -> Generator[Step, Any, bool]:
    """Did the operation end without an answer, its effect unknown, where its claim is durable?

    The one rule for an operation that ends without answering (DEVELOPERS.md, guarantee
    2: an unknown outcome is never resolved by re-executing):

    - ``OutcomeUnknown``: the handler says it cannot tell whether its external effect
      happened. Unknown wherever the claim is durable: from the claim on with two
      commits, without a transaction and in middleware mode; in single-commit mode only
      past a committed phase (before it the claim rolls back with the transaction, and
      there is nothing to keep).
    - any other exception: the handler's own answer, by contract that it did nothing.
    - a cancellation (or a BaseException): unknown past a committed phase (without a
      transaction, from the operation's start), where an external call made after it
      may have happened and the handler never said it did not.
    """
    if isinstance(exc, OutcomeUnknown):
        if not single_commit:
            return True
    elif isinstance(exc, Exception):
        return False
    return (yield from _past_a_committed_phase(record, answered=False))


def _past_a_committed_phase(record: Record, *, answered: bool = True) -> Generator[Step, Any, bool]:
    """Did the operation run past a committed phase (an earlier attempt's, or its own)?

    One that ``answered`` ran, past its record's recovery point if it has one;
    one that did not may have been stopped before it started: the driver knows.
    """
    if answered and record.recovery_point is not None:
        return True
    committed: bool = yield PhaseCommitted(record)
    return committed


_UNRECORDED = (
    "the operation ran but its outcome could not be recorded; the key stays claimed "
    "until it is recovered: retry later with the same key"
)


def dispatch(record: Record, intent: Intent, policy: Policy, now: float) -> Outcome:
    """Answer a request whose claim found someone else's record. Order matters.

    1. A different request under the same key is the client's bug: 422, even
       while the first is still running.
    2. In flight (or stale and being reconciled): 409 at once, never wait,
       with the ``Retry-After`` the record's age says (``now`` dates it).
    3. Settled: the stored response, verbatim.
    """
    if record.fingerprint != intent.fingerprint:
        msg = (
            "this Idempotency-Key was first used for a different request "
            f"(endpoint {record.endpoint or 'unknown'}); use a new key for a new request"
        )
        raise KeyReused(msg)
    state, response = record.state, record.response
    if (state is State.COMPLETED or state is State.FAILED_PERMANENT) and response is not None:
        return make_outcome(response, True, record)
    raise InProgress(_BUSY[record.state], retry_after=retry_after(record, policy, now))


_BUSY = {
    State.IN_PROGRESS: "a request with this Idempotency-Key is still in progress; retry later",
    State.STALE: "the request with this Idempotency-Key is being recovered; retry later",
    State.RELEASED: "the request with this Idempotency-Key is being retried; retry later",
    State.COMPLETED: "the response for this Idempotency-Key is not stored; retry later",
    State.FAILED_PERMANENT: "the response for this Idempotency-Key is not stored; retry later",
}
