"""
The sweeper: ends stale claims and reconciles what they left behind.

This is the async source of truth; ``idemflow/_sync/sweeper.py`` is generated
from it by ``scripts/unasync.py``. Import the public names from
:mod:`idemflow.sweeper`.

One pass marks ``stale``, in bounded batches, the ``in_progress`` records
untouched for ``policy.stale_after``, (with a reconciler) the ``released``
ones past a recovery point, and the ``stale`` ones due to be asked again,
then resolves each; every resolution is fenced on the mark
(``settle_stale``/``release_stale``). What one sweep does: docs/crash-safety.md,
"What one sweep does".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from .. import _reconcile
from .._errors import ConfigurationError
from .._events import Event, Observer, null_observer
from .._model import Clock, Duration, Policy, Record, State, seconds
from .._reconcile import (
    Answer,
    DidNotHappen,
    Happened,
    Resolution,
    SweepReport,
    Unknown,
    downstream_keys,
    intent_of,
    settled_state,
)
from ..stores.protocol import AsyncMaintainableStore, AsyncTransaction

__all__ = ["AsyncReconciler", "AsyncSweeper"]

logger = logging.getLogger("idemflow.sweeper")

#: Records marked per statement. Small enough that one batch's UPDATE holds
#: its row locks briefly; large enough that a backlog clears in few round trips.
DEFAULT_BATCH_SIZE = 100
#: How long past a record's deadline the sweeper wakes: the SQL and Redis stores keep
#: whole milliseconds, and a record is due once strictly older than the cutoff (two
#: milliseconds, so the cutoff's own rounding to one cannot land on the deadline).
DEADLINE_MARGIN = 0.002
#: The shortest wait between passes when a record is still due right after one.
MIN_PAUSE = 0.05
#: Transactions a resolution tries to begin before its error ends the pass: one
#: lost pooled connection is replaced by the second; a store that is down fails both.
BEGIN_ATTEMPTS = 2


class AsyncReconciler(Protocol):
    """**Protocol:** asks the external system what a crashed attempt did.

    Called with the stale record (its ``recovery_point`` tells how far the
    attempt got) and the downstream keys of the sweeper's ``steps``, e.g.
    ``{"charge": "idemflow-3f2a…"}``: the keys the attempt sent to the
    provider, by which the provider can be asked. Must not have side effects
    of its own beyond asking. Raising counts as :class:`Unknown`.
    """

    async def __call__(self, record: Record, downstream_keys: Mapping[str, str], /) -> Answer: ...


class AsyncSweeper:
    """Resolves stale claims of one store. Safe to run in several processes at once.

    Args:
        store: a store with the maintenance statements (every SQL store, memory).
        policy: the same policy the application runs with; its ``stale_after``
            (derived from ``request_timeout``) is the threshold, its
            ``retention`` how long unresolved records are kept.
        reconciler: asks the external system what happened. Without one every
            stale record is released, which is right only when the effect is
            local (it rolled back with the lost completion) or goes downstream
            under a downstream key (see ``docs/crash-safety.md``).
        steps: step names whose downstream keys the reconciler is given.
        transaction_factory: opens a transaction adapter (see
            :mod:`idemflow.transactions`) in which a :class:`Happened` answer's
            ``apply`` and the settled record commit together.
        clock: seconds since the epoch.
        batch_size: records marked per statement.
        retry_unknown_after: how long a record stays stale before an unknown
            answer is asked again. Defaults to ``policy.stale_after``.
        observer: told ``STALE_RECLAIMED`` for every resolution (``elapsed`` is
            the time that resolution took, reconciler included); if it has a
            ``stale_reclaimed(resolution, endpoint)`` method (as
            :class:`idemflow.metrics.PrometheusMetrics` has), that is called too.
    """

    def __init__(
        self,
        store: AsyncMaintainableStore,
        policy: Policy | None = None,
        *,
        reconciler: AsyncReconciler | None = None,
        steps: Sequence[str] = (),
        transaction_factory: Callable[[], AbstractAsyncContextManager[AsyncTransaction]]
        | None = None,
        clock: Clock = time.time,
        batch_size: int = DEFAULT_BATCH_SIZE,
        retry_unknown_after: Duration | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.store = store
        self.policy = policy or Policy()
        self.reconciler = reconciler
        self.steps = tuple(steps)
        self.clock = clock
        self.observer = null_observer if observer is None else observer
        self.batch_size = batch_size
        self.retry_unknown_after = seconds(
            self.policy.stale_seconds if retry_unknown_after is None else retry_unknown_after
        )
        self._transactions = transaction_factory
        self._check_settings()
        # A sweep's calls are bounded as a request's are.
        store.cover_store_wait(self.policy.store_wait_seconds)

    async def sweep_once(
        self, progress: Callable[[SweepReport], None] | None = None
    ) -> SweepReport:
        """One pass over everything due now; returns the counts per resolution.

        ``progress`` is called with the running totals after each batch.
        """
        now = self.clock()
        stale_cutoff = now - self.policy.stale_seconds
        report = await self._drain(State.IN_PROGRESS, stale_cutoff, progress)
        if self.reconciler is not None:  # without one there is nothing to learn about them
            report += await self._drain(State.RELEASED, stale_cutoff, progress, report)
        return report + await self._drain(
            State.STALE, now - self.retry_unknown_after, progress, report
        )

    async def due_in(self) -> float | None:
        """Seconds until a pass would have something to do: negative if it has now.

        The earliest deadline among the records a pass looks at (in flight past
        the threshold; released past a recovery point, with a reconciler;
        stale past ``retry_unknown_after``), each asked of the store
        (``next_due``: one index probe on the SQL stores); ``math.inf`` when
        there is none, None when the store cannot tell.
        """
        now = self.clock()
        stale_cutoff = now - self.policy.stale_seconds
        asked = [(State.IN_PROGRESS, stale_cutoff), (State.STALE, now - self.retry_unknown_after)]
        if self.reconciler is not None:
            asked.append((State.RELEASED, stale_cutoff))
        soonest = math.inf
        for state, cutoff in asked:
            due = await self.store.next_due(state, cutoff, now)
            if due is None:
                return None
            soonest = min(soonest, due)
        return soonest

    async def run_forever(
        self, every: Duration | None = None, *, stop: _reconcile.AsyncStop | None = None
    ) -> None:
        """Sweep at the earliest stale deadline, or at least every ``every`` seconds.

        After each look the loop sleeps until the oldest claim in flight (or
        record to ask again) can become due (:meth:`due_in`), so a crashed
        claim ends a few milliseconds after its threshold, and a sweeper with
        nothing due passes only when something is: it asks one index probe
        per state instead. Nothing needs to wake it earlier: a claim written
        while it sleeps is due a whole threshold later. It looks at least every
        ``every`` seconds (default ``policy.sweep_interval``, a tenth of the
        stale threshold, at most the request timeout), which bounds a wrong
        answer (a host whose clock lags writing on its own clock).

        On a store that cannot tell (``next_due`` answers None) it passes every
        ``every`` seconds, on that beat (the time a pass takes is not added
        to the wait): a crashed claim then ends within one interval after its
        threshold, what a 409's ``Retry-After`` promises. A failed pass or look
        (store unreachable) is logged and the loop goes on.
        """
        interval = seconds(self.policy.sweep_interval if every is None else every)
        stop = stop or _reconcile.AsyncStop()
        due = False  # the last look found a deadline within the wait: pass on waking
        while not stop.is_set():
            started = time.monotonic()
            try:
                wait, due = await self._step(interval, due=due)
            except Exception as exc:  # an outage must not end the loop
                logger.error(
                    "sweep pass failed: %s", exc, exc_info=logger.isEnabledFor(logging.DEBUG)
                )
                wait, due = None, False
            if wait is None:  # on the interval's beat
                wait = interval - (time.monotonic() - started)
            if await stop.wait(max(0.0, wait)):
                return

    async def _step(self, interval: float, *, due: bool) -> tuple[float | None, bool]:
        """Look (unless a pass is ``due``), pass if something is due, look again.

        Returns the wait until the next step (None: the interval's beat) and
        whether a pass is due when it ends, so the step after a deadline passes
        without asking first (on Redis a look walks every bucket).
        """
        if not due:
            asked = self.clock()
            until = await self.due_in()
            if until is not None and until >= 0:
                return self._until(until, asked, interval)
            if until is None:
                await self.sweep_once()
                return None, False
        await self.sweep_once()
        asked = self.clock()
        after = await self.due_in()
        if after is None:
            return None, False
        if after < 0:
            # Due again at once: a record that fell due during the pass, or one it
            # could not take (locked by a completion committing now). Soon, not busily.
            return min(MIN_PAUSE, interval), True
        return self._until(after, asked, interval)

    def _until(self, until: float, asked: float, interval: float) -> tuple[float, bool]:
        """The wait for a deadline ``until`` seconds after ``asked`` (the answer's own
        time is taken off), at most ``interval``; and whether a pass is due after it."""
        wait = until + DEADLINE_MARGIN - (self.clock() - asked)
        if wait <= interval:
            return max(0.0, wait), True
        return interval, False

    #: ``await sweeper.run(every=30)`` reads better in asyncio code.
    run = run_forever

    async def _drain(
        self,
        from_state: State,
        cutoff: float,
        progress: Callable[[SweepReport], None] | None,
        before: SweepReport | None = None,
    ) -> SweepReport:
        """Mark and resolve batch after batch until a batch comes back short.

        Terminates: every record we mark leaves ``from_state`` or gets a fresh
        ``updated_at``, and nothing new can fall behind the fixed ``cutoff``.
        """
        report = SweepReport()
        while True:
            now = self.clock()
            keep_until = now + self.policy.retention_seconds
            batch = await self.store.sweep(from_state, cutoff, now, keep_until, self.batch_size)
            if not batch:
                return report
            report += SweepReport(batches=1)
            for record in batch:
                resolution = await self._resolve(record, abandoned=from_state is State.RELEASED)
                report += SweepReport.of(resolution, retried=from_state is State.STALE)
            if progress is not None:
                progress(report if before is None else before + report)
            if len(batch) < self.batch_size:
                return report

    async def _resolve(self, record: Record, *, abandoned: bool) -> Resolution:
        """Ask, then settle or release as the answer says.

        ``abandoned``: the record was released, not crashed. Its client gave
        up, so a "did not happen" also forgets its recovery point; else it
        would be swept again and again, and kept past its retention forever.
        """
        started = self.clock()
        answer = await self._ask(record)
        if isinstance(answer, Happened):
            resolution = await self._settle(record, answer)
        elif isinstance(answer, DidNotHappen):
            resolution = await self._release(record, answer, forget_progress=abandoned)
        else:
            resolution = Resolution.UNKNOWN
        self._report(record, resolution, self.clock() - started)
        return resolution

    async def _ask(self, record: Record) -> Answer:
        if self.reconciler is None:
            return DidNotHappen("no reconciler: the effect was local and rolled back")
        try:
            answer = await self.reconciler(record, downstream_keys(record, self.steps))
        except Exception as exc:  # a reconciler's failure means "unknown"
            logger.warning(
                "reconciler failed for record %s (%s); it stays stale",
                record.id,
                exc,
                exc_info=True,
            )
            return Unknown(f"reconciler raised {type(exc).__name__}")
        if not isinstance(answer, Happened | DidNotHappen | Unknown):
            logger.error(
                "reconciler answered %r for record %s; treated as unknown", answer, record.id
            )
            return Unknown("not an answer")
        return answer

    async def _release(
        self, record: Record, answer: DidNotHappen, *, forget_progress: bool
    ) -> Resolution:
        if answer.apply is None:
            released = await self.store.release_stale(
                record, self.clock(), forget_progress=forget_progress
            )
            return Resolution.RELEASED if released else Resolution.LOST
        if self._transactions is None:
            return self._needs_transaction("DidNotHappen", record)

        async def release(transaction: AsyncTransaction) -> bool:
            now = self.clock()
            return await self.store.release_stale(record, now, transaction, forget_progress=True)

        return await self._in_transaction(record, release, answer.apply, Resolution.RELEASED)

    def _needs_transaction(self, answer: str, record: Record) -> Resolution:
        logger.error(
            "%s.apply for record %s needs the sweeper's transaction_factory; "
            "the record stays stale",
            answer,
            record.id,
        )
        return Resolution.UNKNOWN

    async def _settle(self, record: Record, answer: Happened) -> Resolution:
        state = settled_state(answer, self.policy)
        if state is None:
            logger.error(
                "reconciler answered Happened with transient status %s for record %s; "
                "a transient response is not an outcome, the record stays stale",
                answer.response.status,
                record.id,
            )
            return Resolution.UNKNOWN
        expires_at = self.clock() + self.policy.retention_seconds
        if self._transactions is None:
            if answer.apply is not None:
                return self._needs_transaction("Happened", record)
            settled = await self.store.settle_stale(
                record, state, answer.response, self.clock(), expires_at
            )
            return Resolution.COMPLETED if settled else Resolution.LOST

        async def settle(transaction: AsyncTransaction) -> bool:
            now = self.clock()
            return await self.store.settle_stale(
                record, state, answer.response, now, expires_at, transaction
            )

        return await self._in_transaction(record, settle, answer.apply, Resolution.COMPLETED)

    async def _in_transaction(
        self,
        record: Record,
        write: Callable[[AsyncTransaction], Awaitable[bool]],
        apply: Callable[[Any], Any] | None,
        resolution: Resolution,
    ) -> Resolution:
        """The fenced write first (it locks the record), then ``apply``; both or neither.

        A transaction that cannot be opened or begun says nothing about the
        record: its connection is gone (a pooled one is given up, so the pool
        discards it) or the store is down. It is tried once more on a fresh
        one; if that cannot begin either, the error ends the pass (``run_forever``
        logs it and passes again; the batch's marked records are asked again
        after ``retry_unknown_after``) instead of failing every record of the
        batch in turn. A failure once begun is this record's: it stays stale,
        and the pass goes on with the others.
        """
        assert self._transactions is not None
        attempt = 1
        while True:
            begun = False
            try:
                async with self._transactions() as transaction:
                    await transaction.begin()
                    begun = True
                    return await self._write_then_apply(
                        record, transaction, write, apply, resolution
                    )
            except Exception:
                if begun:  # the transaction's own exit failed, after the resolution
                    logger.warning(
                        "resolving record %s failed; it stays stale", record.id, exc_info=True
                    )
                    return Resolution.UNKNOWN
                if attempt >= BEGIN_ATTEMPTS:
                    raise
                attempt += 1
                logger.warning(
                    "the transaction resolving record %s could not begin; trying a fresh one",
                    record.id,
                    exc_info=logger.isEnabledFor(logging.DEBUG),
                )

    async def _write_then_apply(
        self,
        record: Record,
        transaction: AsyncTransaction,
        write: Callable[[AsyncTransaction], Awaitable[bool]],
        apply: Callable[[Any], Any] | None,
        resolution: Resolution,
    ) -> Resolution:
        """In a begun transaction: commit the write and ``apply``, or roll both back."""
        try:
            written = await write(transaction)
            if not written:  # re-marked by another sweeper: nothing of ours may commit
                await transaction.rollback()
                return Resolution.LOST
            if apply is not None:
                await apply(transaction.connection)
            await transaction.commit()
        except Exception:
            # A failed COMMIT may have committed: the record is then settled, else stale.
            logger.warning(
                "resolving record %s failed; unless it committed, it stays stale",
                record.id,
                exc_info=True,
            )
            try:
                await transaction.rollback()
            except Exception:  # its connection is gone; the warning above says why
                logger.debug("rollback after a failed resolution failed", exc_info=True)
            return Resolution.UNKNOWN
        return resolution

    def _check_settings(self) -> None:
        """Refuse settings that cannot work, at construction time."""
        if self.batch_size < 1:
            msg = f"batch_size must be at least 1, got {self.batch_size}"
            raise ConfigurationError(msg)
        if self.retry_unknown_after <= 0:
            msg = "retry_unknown_after must be a positive duration"
            raise ConfigurationError(msg)
        if self._transactions is not None and not self.store.supports_transactions:
            msg = f"{type(self.store).__name__} cannot share a transaction_factory's transaction"
            raise ConfigurationError(msg)

    def _report(self, record: Record, resolution: Resolution, elapsed: float) -> None:
        """Tell the observer; a failing metrics hook must not stop the sweep."""
        if resolution is Resolution.LOST:
            return
        logger.info("stale record %s: %s", record.id, resolution.value)
        try:
            self.observer(Event.STALE_RECLAIMED, intent_of(record), elapsed)
            hook: Callable[[str, str], object] | None = getattr(
                self.observer, "stale_reclaimed", None
            )
            if hook is not None:
                hook(resolution.value, record.endpoint or "unknown")
        except Exception:  # metrics must never stop the sweep
            logger.warning("observer failed on stale_reclaimed", exc_info=True)
