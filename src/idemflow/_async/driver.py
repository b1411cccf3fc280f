"""
The async driver: performs the steps of ``idemflow._flow`` and nothing else.

This is the async source of truth; ``idemflow/_sync/driver.py`` is generated
from it by ``scripts/unasync.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

from .._concurrency import async_cancel_point, async_checked_handler, async_resolve, async_shielded
from .._downstream import downstream_key
from .._errors import ConfigurationError, StoreUnavailable
from .._events import Event, Observer, error_event, null_observer
from .._flow import (
    ClaimKey,
    CommitClaim,
    Complete,
    Execute,
    Flow,
    PhaseCommitted,
    Step,
    idempotency_flow,
)
from .._lease import new_lease_token
from .._model import Claim, Clock, Intent, Outcome, Policy, Record, Response
from ..stores.protocol import AsyncStore, AsyncTransaction
from .transactions import AsyncBeginsOnFirstStatement, AsyncCommitAfter

__all__ = ["AsyncAttempt", "AsyncHandler", "AsyncIdempotency"]

logger = logging.getLogger("idemflow")

#: How often a failed release is sent again before the key is left to the sweeper.
RELEASE_ATTEMPTS = 3
#: A release the store could not serve (StoreUnavailable) is sent again only if it failed
#: within this many seconds: a pooled connection found dead, which its pool has dropped.
#: One that waited for the store (its pool's timeout: connections refused; SQLite's
#: busy_timeout; a socket timeout) would wait as long again, and the request's answer
#: with it. Timed on the monotonic clock: the injected one dates records, not waits.
#: Half the policy's store wait if that is shorter: a release that waited that long for a
#: store bounded by it waited for the store (a 0.4 s request timeout: 0.1 s).
RELEASE_RETRY_WITHIN_SECONDS = 0.5


class AsyncAttempt:
    """What the operation gets: its claimed record and the caller's connection.

    ``connection`` is the connection of the transaction passed to ``run`` (in
    which the completion will be written), or None without one.
    """

    def __init__(
        self,
        record: Record,
        store: AsyncStore,
        transaction: AsyncTransaction | None,
        clock: Clock,
        on_commit: Callable[[], None] = lambda: None,
    ) -> None:
        self.record = record
        #: The last progress committed for this intent, by this or an earlier attempt.
        self.recovery_point = record.recovery_point
        self._store = store
        self._transaction = transaction
        self._clock = clock
        self._on_commit = on_commit

    @property
    def connection(self) -> Any:
        return None if self._transaction is None else self._transaction.connection

    def downstream_key(self, step: str) -> str:
        """The idempotency key to send to a downstream provider for ``step``.

        The same on every retry and after every crash within one retention
        period, so a re-executed call cannot charge twice; a new one after
        retention, when the same key starts a new intent.
        """
        return downstream_key(self.record, step)

    async def checkpoint(self, recovery_point: str) -> None:
        """Record progress in the current transaction (it commits with your writes).

        Also renews the claim, so the sweeper measures staleness from here.
        Raises LeaseLost if the claim is no longer ours.
        """
        await self._store.checkpoint(self.record, recovery_point, self._clock(), self._transaction)
        self.recovery_point = recovery_point
        if self._transaction is None:
            self._on_commit()  # written at once: a committed phase

    async def commit_phase(self, recovery_point: str) -> None:
        """End an atomic phase: checkpoint, commit, and begin the next transaction.

        A retry after a crash finds ``recovery_point`` and resumes from there
        (rocket-rides' atomic phases). Call it before any external call, so
        the local writes it depends on are durable and the call is not made
        while holding locks.
        """
        if self._transaction is None:
            await self.checkpoint(recovery_point)
            return
        # The checkpoint carries the COMMIT and the next BEGIN where the adapter
        # can send them together. Once the COMMIT may have run, the claim may be
        # committed (single-commit mode): a failure must give it back with a
        # write of its own (on_commit).
        phase = AsyncCommitAfter(self._transaction, begin=True, on_commit=self._on_commit)
        await self._store.checkpoint(self.record, recovery_point, self._clock(), phase)
        self.recovery_point = recovery_point
        await phase.finish()


AsyncHandler: TypeAlias = Callable[[AsyncAttempt], Awaitable[Response]]


class AsyncIdempotency:
    """Run operations exactly once per ``(principal, key)``.

    Args:
        store: where key records live.
        policy: timeouts, retention and the outcome classifier.
        clock: seconds since the epoch; inject one to control time in tests.
        observer: told about every outcome (claimed, replayed, …) for metrics.
    """

    def __init__(
        self,
        store: AsyncStore,
        policy: Policy | None = None,
        *,
        clock: Clock = time.time,
        observer: Observer = null_observer,
    ) -> None:
        self.store = store
        self.policy = policy or Policy()
        self.clock = clock
        self.observer = observer
        # Its refusal after a possible loss of claims must cover our stale threshold.
        store.cover_stale_threshold(self.policy.stale_seconds)
        # And no wait of the store's may outlast our request's budget.
        store.cover_store_wait(self.policy.store_wait_seconds)
        self._release_retry_within = min(
            RELEASE_RETRY_WITHIN_SECONDS, self.policy.store_wait_seconds / 2
        )

    async def run(
        self,
        intent: Intent,
        handler: AsyncHandler,
        *,
        transaction: AsyncTransaction | None = None,
        single_commit: bool = False,
    ) -> Outcome:
        """Claim ``intent``, then replay, refuse, or run ``handler`` once.

        With ``transaction`` (the caller's connection, see
        :mod:`idemflow.transactions`), the handler runs inside it and the
        completion commits with the handler's own writes. With
        ``single_commit=True`` the claim joins that transaction too.

        Raises:
            ConfigurationError: before anything is claimed, for a handler this
                driver could never run (see ``_concurrency.async_checked_handler``).
        """
        async_checked_handler(handler)
        if transaction is not None and not self.store.supports_transactions:
            msg = f"{type(self.store).__name__} cannot share the caller's transaction"
            raise ConfigurationError(msg)
        if single_commit and transaction is None:
            msg = "single_commit needs the caller's transaction"
            raise ConfigurationError(msg)
        if single_commit and not self.store.supports_single_commit:
            msg = (
                f"{type(self.store).__name__} cannot bound a duplicate's wait on an "
                "uncommitted claim; single_commit needs PostgreSQL or MySQL"
            )
            raise ConfigurationError(msg)
        perform = _Performer(self, intent, handler, transaction, single_commit)
        try:
            flow = idempotency_flow(
                intent,
                self.policy,
                new_lease_token(),
                atomic=transaction is not None,
                single_commit=single_commit,
                clock=self.clock,
            )
            outcome = await _drive(flow, perform)
        except BaseException as exc:
            await perform.abandon()
            event = error_event(exc)
            if event is not None:
                perform.observe(event)
            raise
        await perform.abandon()  # a replay in single-commit mode left the claim's transaction open
        if outcome.replayed:
            perform.observe(Event.REPLAYED)
        return outcome


async def _drive(flow: Flow, perform: Callable[[Step], Awaitable[Any]]) -> Outcome:
    """Feed each step's result (or exception) back into the flow until it returns."""
    result: Any = None
    error: BaseException | None = None
    thrown: BaseException | None = None  # the last exception thrown into the flow
    while True:
        try:
            if error is None:
                step = flow.send(result)
            else:
                thrown = error
                step = flow.throw(error)
        except StopIteration as stop:
            outcome: Outcome = stop.value
            return outcome
        except RuntimeError as raised:
            if not _rewrapped(raised, thrown):
                raise
            break
        result, error = None, None
        try:
            result = await perform(step)
        except BaseException as exc:  # noqa: BLE001 -- the flow decides, then re-raises
            error = exc
    # Raised outside the except clause, where it would gain our RuntimeError as its
    # __context__: the exception goes on unchanged. (A coroutine turns a StopIteration
    # leaving it into a RuntimeError of its own: Python's rule, not ours.)
    assert thrown is not None
    raise thrown


def _rewrapped(raised: RuntimeError, thrown: BaseException | None) -> bool:
    """Is ``raised`` only PEP 479's wrapping of a ``StopIteration`` thrown into the flow?

    The flow re-raises what it was thrown (the handler's exception, after its release
    step) from inside a generator, which turns a ``StopIteration`` into
    ``RuntimeError("generator raised StopIteration")``; the caller is owed the object
    itself (``contextlib`` unwraps it the same way).
    """
    return isinstance(thrown, StopIteration) and raised.__cause__ is thrown


class _Performer:
    """Performs one run's steps against the store, the handler and the transaction.

    Holds at most one connection at any moment: the claim and replays use the
    store's (given back before the handler runs), everything after the claim
    the caller's transaction, the release included, so a pool shared by the
    store and the application can never deadlock on a request of its own.
    Where the transaction takes its connection from the store's own pool, the
    claim runs on that very connection (two commits: committed alone, before
    BEGIN), so the request checks one connection out, not two.
    """

    def __init__(
        self,
        idempotency: AsyncIdempotency,
        intent: Intent,
        handler: AsyncHandler,
        transaction: AsyncTransaction | None,
        single_commit: bool,
    ) -> None:
        self._idem = idempotency
        self._intent = intent
        self._started = idempotency.clock()
        self._handler = handler
        self._transaction = transaction
        self._single_commit = single_commit
        self._open = False  # is the caller's transaction begun and not yet ended?
        # Did its BEGIN before the handler fail? Then the release goes through the store's
        # own connection: another BEGIN would meet the same pool, or the same dead session.
        self._unbegun = False
        # Does giving the claim back take a write? From the start with two
        # commits; with one, once the first commit_phase may have committed it.
        self._claim_committed = not single_commit
        # Has the handler gone past a committed phase (and so part of its effect) yet?
        self._phase_committed = False

    async def __call__(self, step: Step) -> Any:
        if isinstance(step, ClaimKey):
            return await async_shielded(self._claim(step))
        if isinstance(step, Execute):
            attempt = AsyncAttempt(
                step.record, self._idem.store, self._transaction, self._idem.clock, self._committed
            )
            await async_cancel_point()  # a cancellation deferred by the claim: release now
            await self._begin_for_handler()
            # A resumed operation runs past the phase its record names from its start;
            # one without a transaction from its first step: nothing it does rolls back,
            # so an external call it makes before a cancellation may have happened.
            self._phase_committed = (
                step.record.recovery_point is not None or self._transaction is None
            )
            # An answer the driver cannot take (a coroutine, in sync code: it ran nothing)
            # is a ConfigurationError here, in the flow's Execute: the key is given back.
            return await async_resolve(self._handler(attempt))
        if isinstance(step, Complete):
            await async_shielded(self._complete(step))
            self.observe(Event.COMPLETED)
            return None
        if isinstance(step, PhaseCommitted):
            return self._phase_committed
        if isinstance(step, CommitClaim):
            await async_shielded(self._commit_claim())
            return None
        released = await async_shielded(self._release(step.record))
        self.observe(Event.RELEASED if released else Event.RELEASE_FAILED)
        return None

    async def _claim(self, step: ClaimKey) -> Claim:
        now = self._idem.clock()
        store, expires_at = self._idem.store, now + step.retention
        transaction = self._transaction
        if transaction is None:
            claim = await store.claim(step.intent, step.lease_token, now, expires_at)
        elif self._single_commit:
            claim = await self._claim_in_transaction(step, now, expires_at, transaction)
        else:
            # Two commits: on the connection the transaction then uses where it lends
            # one of the store's own (one checkout), committed alone before its BEGIN.
            claim = await store.claim_on_lent(
                step.intent, step.lease_token, now, expires_at, transaction
            )
        if claim.owned:
            self.observe(Event.CLAIMED)
        return claim

    async def _claim_in_transaction(
        self, step: ClaimKey, now: float, expires_at: float, transaction: AsyncTransaction
    ) -> Claim:
        """One commit: the transaction begins with the claim's first statement, in the
        store's claim, whose rule then says what a pool timeout or a lost connection means
        (a 503), as in two-commit mode, where the store takes that checkout. What the store
        let through, the transaction's own rule judges (a checkout of SQLAlchemy's pool):
        nothing was committed, so StoreUnavailable leaves nothing behind."""
        begun = AsyncBeginsOnFirstStatement(transaction, self._begin)
        try:
            return await self._idem.store.claim(
                step.intent, step.lease_token, now, expires_at, begun
            )
        except Exception as exc:
            if not transaction.is_unavailable(exc):
                raise
            raise _could_not_begin(exc) from exc

    async def _complete(self, step: Complete) -> None:
        now, store = self._idem.clock(), self._idem.store
        expires_at = now + step.retention
        if self._transaction is None or not self._open:
            await store.complete(
                step.record, step.state, step.response, now, expires_at, self._transaction
            )
            return
        # The completion carries the COMMIT where the adapter can send them together.
        # Still open if the COMMIT fails (SQLite keeps the transaction after a
        # deferred constraint fails), so abandon() can roll it back.
        ending = AsyncCommitAfter(self._transaction)
        try:
            await store.complete(step.record, step.state, step.response, now, expires_at, ending)
        except Exception as exc:
            # The store judged its own driver's errors; what the transaction's library
            # raises (a session that checks out only now, for the completion) its rule
            # judges: the effect rolls back with the completion, so a 503, the key given back.
            if not self._transaction.is_unavailable(exc):
                raise
            msg = f"the request's transaction could not complete: {exc}".strip()
            raise StoreUnavailable(msg) from exc
        await ending.finish()
        self._open = False

    async def _release(self, record: Record) -> bool:
        """Roll back, then give the key back if the claim was committed.

        Never raises: the flow re-raises the exception that led here, and our
        cleanup must not replace it. What cannot be released is the sweeper's.
        """
        connection_usable = await self._rollback() and not self._unbegun
        if not self._claim_committed:
            return True  # single-commit mode: the rollback took the claim with it
        transaction = self._transaction if connection_usable else None
        for attempt in range(1, RELEASE_ATTEMPTS + 1):
            started = time.monotonic()
            try:
                await self._release_on(transaction, record)
            except Exception as exc:
                # A deadlock victim (InnoDB under load) or a serialization
                # failure: the fenced release is idempotent, so it is simply
                # sent again; a key left claimed waits for the sweeper. Sent
                # again through the store's connection when the transaction's
                # pool cannot serve it (a Session checks out only now): that
                # pool's next wait would end as this one did. Not sent again,
                # on either connection, when the store itself was waited for in
                # vain (its rule said StoreUnavailable): the database is the same.
                waited_for_the_store = (
                    isinstance(exc, StoreUnavailable)
                    and time.monotonic() - started >= self._idem._release_retry_within
                )
                if transaction is not None and transaction.is_unavailable(exc):
                    transaction = None
                if (
                    attempt == RELEASE_ATTEMPTS
                    or waited_for_the_store
                    or not (await self._rollback() or transaction is None)
                ):
                    logger.warning("could not release claim; the sweeper will", exc_info=True)
                    return False
            else:
                return True
        return False

    async def _release_on(self, transaction: AsyncTransaction | None, record: Record) -> None:
        """The fenced release, on the request's own connection when it has one."""
        store, now = self._idem.store, self._idem.clock()
        if transaction is None:
            await store.release(record, now)
            return
        self._open = True  # before: a BEGIN that fails (or is cancelled) may still have run
        await transaction.begin()
        await store.release(record, now, transaction)
        await self._end_with_commit()

    async def _commit_claim(self) -> None:
        self._claim_committed = True  # giving it back takes a write from here on
        await self._end_with_commit()

    def _committed(self) -> None:
        self._claim_committed = self._phase_committed = True

    def observe(self, event: Event) -> None:
        observer = self._idem.observer
        if observer is not null_observer:  # nobody listens: not even a clock read
            observer(event, self._intent, self._idem.clock() - self._started)

    async def _begin(self) -> None:
        if self._transaction is not None and not self._open:
            # Open from before the BEGIN: one that fails, or is cancelled, may still have
            # begun (SQLite's worker thread runs it anyway), so the error path rolls back.
            self._open = True
            await self._transaction.begin()

    async def _begin_for_handler(self) -> None:
        """:meth:`_begin`, whose error is the request's, not the handler's: the transaction's
        rule (its library's errors, SQLAlchemy's pool timeout), then the store's (its
        driver's, as for the claim), say whether it means the database cannot serve the
        request (a pool timeout, a connection gone): StoreUnavailable, a 503, the key given
        back on the store's connection, nothing recorded."""
        try:
            await self._begin()
        except Exception as exc:
            self._unbegun = True
            assert self._transaction is not None  # _begin raises only with one
            if not (self._transaction.is_unavailable(exc) or self._idem.store.is_unavailable(exc)):
                raise
            raise _could_not_begin(exc) from exc

    async def _end_with_commit(self) -> None:
        if self._transaction is None or not self._open:
            return
        # Still open if COMMIT fails (SQLite keeps the transaction after a
        # deferred constraint fails), so abandon() can roll it back.
        await self._transaction.commit()
        self._open = False

    async def _rollback(self) -> bool:
        """Roll back if open; False when the rollback failed (the connection is unusable)."""
        if self._transaction is None or not self._open:
            return True
        self._open = False
        try:
            await self._transaction.rollback()
        except Exception:
            logger.warning("rollback failed; giving the connection up", exc_info=True)
            return False
        return True

    async def abandon(self) -> None:
        """Never leave the caller's transaction open behind an error.

        Shielded, as the release's rollback is: a rollback cut short by a second
        cancellation would give the connection back in its open transaction (or
        dead, unnoticed) to the pool the store shares.
        """
        if self._transaction is None or not self._open:
            return  # nothing open (every run that ended well): no step to shield
        await async_shielded(self._rollback())


def _could_not_begin(exc: BaseException) -> StoreUnavailable:
    return StoreUnavailable(f"the request's transaction could not begin: {exc}".strip())
