"""The idempotency protocol, sans I/O: claim → dispatch on state → execute → complete | release.

Every decision about a key lives here; the drivers perform the steps `idempotency_flow`
yields and send the results back. What they keep: docs/architecture.md."""

from __future__ import annotations

import enum
import inspect
import time
from collections.abc import Awaitable, Generator
from dataclasses import dataclass
from types import FunctionType, MethodType
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
    retry_after,
    swept_within,
)


# Steps: plain, not frozen (built on every run; nothing changes one).
@dataclass(slots=True)
class ClaimKey:
    """One atomic statement: insert ``in_progress``, or take over an expired or released record."""

    intent: Intent
    lease_token: str
    retention: float
    #: The claim's own stale threshold: its policy's.
    stale_after: float


@dataclass(slots=True)
class _OnRecord:
    record: Record


class CommitClaim(_OnRecord):
    """Commit the claim before the operation runs (single-commit mode, resuming past a phase)."""


class Execute(_OnRecord):
    """Run the operation; in transactional mode, inside the caller's open transaction."""


@dataclass(slots=True)
class Complete:
    """Store the settled outcome (a compare-and-swap on the lease), kept ``retention`` s."""

    record: Record
    state: State
    response: Response
    retention: float


class Release(_OnRecord):
    """Roll back and give the key back (if the claim is committed), so the next retry runs."""


class PhaseCommitted(_OnRecord):
    """Ask the driver whether the operation went past a committed phase (a bool)."""


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
    caller's transaction until its first commit. ``clock`` dates a 409."""
    try:
        claim: Claim = yield ClaimKey(
            intent, lease_token, policy.retention_seconds, policy.stale_seconds
        )
        if not claim.owned:
            return dispatch(claim.record, intent, policy, clock())
        record = claim.record
        if single_commit and record.recovery_point is not None:
            # Resuming, the next step may be an external call: a crash that rolled the
            # take-over back would let a retry resume (and call) a second time.
            yield CommitClaim(record)
        try:
            response: Response = yield Execute(record)
        except BaseException as exc:
            if (yield from _outcome_unknown(exc, record, single_commit)):
                # Releasing would let a retry make the external call again: the key stays
                # claimed for the sweeper's reconciler.
                if isinstance(exc, OutcomeUnknown):
                    exc.retry_after = max(exc.retry_after, swept_within(policy))
                raise
            # Failed (or cancelled) before it answered: nothing settled, the key given back.
            if isinstance(exc, OutcomeUnknown):
                exc.retry_after = max(exc.retry_after, policy.retry_after)
            yield Release(record)
            raise
        verdict = policy.verdict(response)
        if verdict is Verdict.TRANSIENT:
            yield Release(record)  # a 503 must not poison the key
            return Outcome(response, False, record)
        try:
            yield Complete(record, verdict.value, response, policy.retention_seconds)
        except LeaseLost:
            raise  # the key is someone else's now: nothing of ours to release
        except BaseException as exc:
            if atomic and not (yield from _past_a_committed_phase(record)):
                # The effect rolled back with the completion. The release is fenced: it
                # changes nothing if the commit did happen.
                yield Release(record)
                raise
            if isinstance(exc, StoreUnavailable):
                # The effect (or its part past a phase) may have happened: releasing would
                # run it again. The key stays claimed for the sweeper's reconciler.
                raise StoreUnavailable(_UNRECORDED, retry_after=exc.retry_after) from exc
            raise
        return Outcome(response, False, record)
    except InProgress as busy:  # one raised without the record to date it: the floor holds
        busy.retry_after = max(busy.retry_after, policy.retry_after)
        raise


def _outcome_unknown(
    exc: BaseException, record: Record, single_commit: bool
) -> Generator[Step, Any, bool]:
    """Did the operation end with its effect unknown, where its claim is durable? An
    ``OutcomeUnknown`` (in single-commit mode past a committed phase), or a cancellation
    past a committed phase; any other exception says the handler did nothing."""
    if isinstance(exc, OutcomeUnknown):
        if not single_commit:
            return True
    elif isinstance(exc, Exception):
        return False
    return (yield from _past_a_committed_phase(record, answered=False))


def _past_a_committed_phase(record: Record, *, answered: bool = True) -> Generator[Step, Any, bool]:
    """Past a committed phase (an earlier attempt's, or its own)? One that did not
    ``answered`` may never have started past its record's recovery point."""
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
    request, then 409 at once while in flight, then the settled response verbatim."""
    if record.fingerprint != intent.fingerprint:
        msg = (
            "this Idempotency-Key was first used for a different request "
            f"(endpoint {record.endpoint or 'unknown'}); use a new key for a new request"
        )
        raise KeyReused(msg)
    state, response = record.state, record.response
    if (state is State.COMPLETED or state is State.FAILED_PERMANENT) and response is not None:
        return Outcome(response, True, record)
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
    LENT = "lent"  # the transaction's, lent to the store, committed alone before its BEGIN
    TRANSACTION = "transaction"  # single commit: the transaction's first statement


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
    """Is the operation past a committed phase from its start (resumed, or nothing of it
    rolls back)?"""
    return record.recovery_point is not None or not transaction


#: How often a failed release is sent again before the key is left to the sweeper.
RELEASE_ATTEMPTS = 3
#: A release the store could not serve is sent again only if it failed this fast (a dead
#: pooled connection), not after a wait (at most half the store wait).
RELEASE_RETRY_WITHIN_SECONDS = 0.5


def release_again(exc: Exception, *, attempt: int, elapsed: float, policy: Policy) -> bool:
    """Send a failed (fenced, idempotent) release again? Not after waiting for the store
    in vain. ``elapsed``: on the monotonic clock."""
    within = min(RELEASE_RETRY_WITHIN_SECONDS, policy.store_wait_seconds / 2)
    waited_for_the_store = isinstance(exc, StoreUnavailable) and elapsed >= within
    return attempt < RELEASE_ATTEMPTS and not waited_for_the_store


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
    """``handler`` for async code, refused before the claim if an async generator
    function (it answers a generator, never a response)."""
    if _defined_as(handler, inspect.isasyncgenfunction):
        raise ConfigurationError(f"{_name(handler)} is an async generator function: {_ANSWER}")
    return handler


def checked_handler(handler: _Handler) -> _Handler:
    """``handler`` for sync code, refused before the claim if ``async def`` (sync code
    cannot await what it answers)."""
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
    if kind(handler):
        return True
    # A function's (or method's) own __call__ is a C wrapper: asking inspect about it is
    # the dearer half of the check, and it never answers yes.
    if isinstance(handler, FunctionType | MethodType):
        return False
    return bool(kind(getattr(handler, "__call__", None)))  # noqa: B004


def _name(handler: object) -> str:
    return str(getattr(handler, "__qualname__", None) or repr(handler))
