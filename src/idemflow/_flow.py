"""
The idempotency protocol, sans I/O: claim → dispatch on state → execute → complete | release.

Every decision about a key lives here: the order of the steps, dispatch, when a
failure releases or keeps the claim, which connection a claim uses
(`claim_on`), whether a failed release is sent again (`release_again`),
what a run or a handler may not be asked (`refuse_run`, `checked_handler`). The
drivers perform the steps `idempotency_flow` yields and send the results back. What
they keep, and
why (docs/architecture.md, "What the drivers keep"): *whether* an exception
means "the database cannot serve" (``is_unavailable``: only the store or the
transaction adapter knows its library's exceptions; the flow says what it then
means), and the state of the caller's transaction (open, begun, committed), which
only the code that sends BEGIN and COMMIT sees.
"""

from __future__ import annotations

import enum
import inspect
import time
from collections.abc import Awaitable, Generator
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from ._errors import (
    ConfigurationError,
    InProgress,
    KeyReused,
    LeaseLost,
    OutcomeUnknown,
    StoreUnavailable,
)
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

__all__ = [
    "ClaimOn",
    "Step",
    "async_checked_handler",
    "async_resolve",
    "checked_handler",
    "claim_on",
    "dispatch",
    "idempotency_flow",
    "refuse_run",
    "release_again",
    "resolve",
    "starts_past_a_phase",
]


# Plain slotted, not frozen: built on every run, and nothing changes one.


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
    """Store the settled outcome (a compare-and-swap on the lease), kept ``retention`` s."""

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
    """Ask the driver whether the operation went past a committed phase (a bool): past
    one, an external call made after it may have happened (`starts_past_a_phase`)."""

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
    """The whole protocol. Yields steps; returns the [`Outcome`][idemflow.Outcome] or raises.

    ``atomic``: the effect commits or rolls back with the completion (until it
    commits a phase of its own). ``single_commit``: the claim is part of the
    caller's transaction until its first commit. ``clock`` dates a 409.
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

    ``OutcomeUnknown`` is unknown wherever the claim is durable (in single-commit
    mode only past a committed phase: before it the claim rolls back). Any other
    exception is the handler's answer that it did nothing. A cancellation is
    unknown past a committed phase (guarantee 2: never resolved by re-executing).
    """
    if isinstance(exc, OutcomeUnknown):
        if not single_commit:
            return True
    elif isinstance(exc, Exception):
        return False
    return (yield from _past_a_committed_phase(record, answered=False))


def _past_a_committed_phase(record: Record, *, answered: bool = True) -> Generator[Step, Any, bool]:
    """Past a committed phase (an earlier attempt's, or its own)? One that ``answered``
    ran past its record's recovery point; one that did not may never have started."""
    if answered and record.recovery_point is not None:
        return True
    committed: bool = yield PhaseCommitted(record)
    return committed


_UNRECORDED = (
    "the operation ran but its outcome could not be recorded; the key stays claimed "
    "until it is recovered: retry later with the same key"
)


def dispatch(record: Record, intent: Intent, policy: Policy, now: float) -> Outcome:
    """Answer a request whose claim found someone else's record: 422 for a different
    request (even while the first runs), then 409 at once while in flight (never wait),
    then the settled response verbatim."""
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


class ClaimOn(enum.Enum):
    """Which connection a claim uses: a request holds at most one at any moment."""

    STORE = "store"  # no transaction: the store's own
    # Two commits: the transaction's where it lends one of the store's (one checkout),
    # committed alone before its BEGIN.
    LENT = "lent"
    # One commit: the claim is the transaction's first statement.
    TRANSACTION = "transaction"


def claim_on(*, transaction: bool, single_commit: bool) -> ClaimOn:
    if not transaction:
        return ClaimOn.STORE
    return ClaimOn.TRANSACTION if single_commit else ClaimOn.LENT


def refuse_run(
    store: str, *, transaction: bool, single_commit: bool, shares: bool, single_commits: bool
) -> None:
    """Raise ConfigurationError, before anything is claimed, for a run the store cannot do."""
    if transaction and not shares:
        msg = f"{store} cannot share the caller's transaction"
        raise ConfigurationError(msg)
    if single_commit and not transaction:
        msg = "single_commit needs the caller's transaction"
        raise ConfigurationError(msg)
    if single_commit and not single_commits:
        msg = (
            f"{store} cannot bound a duplicate's wait on an uncommitted claim; "
            "single_commit needs PostgreSQL or MySQL"
        )
        raise ConfigurationError(msg)


def starts_past_a_phase(record: Record, *, transaction: bool) -> bool:
    """Is the operation past a committed phase from its start? A resumed one is; one
    without a transaction too: nothing it does rolls back."""
    return record.recovery_point is not None or not transaction


#: How often a failed release is sent again before the key is left to the sweeper.
RELEASE_ATTEMPTS = 3
#: A release the store could not serve is sent again only if it failed this fast (a
#: pooled connection found dead, which the pool dropped): one that waited for the store
#: would wait as long again, and the answer with it. At most half the store wait.
RELEASE_RETRY_WITHIN_SECONDS = 0.5


def release_again(exc: Exception, *, attempt: int, elapsed: float, policy: Policy) -> bool:
    """Send a failed release again? The fenced release is idempotent, so a deadlock
    victim or a dropped connection is retried; a store waited for in vain is not.
    ``elapsed``: on the monotonic clock (the injected one dates records, not waits)."""
    within = min(RELEASE_RETRY_WITHIN_SECONDS, policy.store_wait_seconds / 2)
    waited_for_the_store = isinstance(exc, StoreUnavailable) and elapsed >= within
    return attempt < RELEASE_ATTEMPTS and not waited_for_the_store


# What a handler or a hook may be, refused before anything is claimed, and how
# their answer is taken: awaited by async code, refused by sync code.

_T = TypeVar("_T")
_Handler = TypeVar("_Handler")


async def async_resolve(answer: _T | Awaitable[_T]) -> _T:
    """A hook's answer: awaited if the hook was a coroutine function."""
    if inspect.isawaitable(answer):
        return await answer
    return answer


def resolve(answer: _T | Awaitable[_T]) -> _T:
    """A hook's answer in sync code, where an awaitable one is a configuration mistake."""
    if inspect.isawaitable(answer):
        if inspect.iscoroutine(answer):
            answer.close()  # never awaited: say so here, not as a RuntimeWarning later
        msg = (
            "a coroutine function was given to sync code, which cannot await it: pass a "
            "plain function (or use the async API: AsyncIdempotency)"
        )
        raise ConfigurationError(msg)
    return answer


def async_checked_handler(handler: _Handler) -> _Handler:
    """``handler`` for async code; an ``async def`` with ``yield`` answers an async
    generator, never a response, and runs nothing: refused before the claim. (A plain
    function is fine: its answer is awaited if it is awaitable, else taken as it is.)"""
    if _defined_as(handler, inspect.isasyncgenfunction):
        raise ConfigurationError(f"{_name(handler)} is an async generator function: {_ANSWER}")
    return handler


def checked_handler(handler: _Handler) -> _Handler:
    """``handler`` for sync code; an ``async def`` one answers a coroutine that sync code
    cannot await (it would run nothing, and used to leave its key claimed): refused
    before the claim, with the fix."""
    if _defined_as(handler, inspect.iscoroutinefunction) or _defined_as(
        handler, inspect.isasyncgenfunction
    ):
        msg = (
            f"{_name(handler)} is an 'async def' function, which sync code cannot await: "
            "use AsyncIdempotency (or an async integration), or make it a plain function"
        )
        raise ConfigurationError(msg)
    return handler


_ANSWER = "a handler must return its Response (or an awaitable of one)"


def _defined_as(handler: object, kind: Any) -> bool:
    """Is ``handler`` (or its ``__call__``, for an object) a function of ``kind``?"""
    return bool(kind(handler) or kind(getattr(handler, "__call__", None)))  # noqa: B004


def _name(handler: object) -> str:
    return str(getattr(handler, "__qualname__", None) or repr(handler))
