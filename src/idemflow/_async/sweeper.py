"""The sweeper: ends stale claims and reconciles what they left behind (docs/crash-safety.md).
This is the async source of truth; ``idemflow/_sync/sweeper.py`` is generated from it by
``scripts/unasync.py``."""

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
    Plan,
    Resolution,
    SweepReport,
    Unknown,
    downstream_keys,
    intent_of,
    plan,
)
from ..stores.protocol import AsyncMaintainableStore, AsyncTransaction

logger = logging.getLogger("idemflow.sweeper")

#: Records marked per statement: row locks held briefly, a backlog cleared in few trips.
DEFAULT_BATCH_SIZE = 100
#: Wake this long past a deadline: stores keep whole milliseconds.
DEADLINE_MARGIN = 0.002
#: The shortest wait between passes when a record is still due right after one.
MIN_PAUSE = 0.05
#: A lost pooled connection is replaced by the second; a store that is down fails both.
BEGIN_ATTEMPTS = 2


class AsyncReconciler(Protocol):
    """**Protocol:** asks the external system what a crashed attempt did, given the stale
    record and the downstream keys of the sweeper's ``steps``. Raising counts as Unknown."""

    async def __call__(self, record: Record, downstream_keys: Mapping[str, str], /) -> Answer: ...


class AsyncSweeper:
    """Resolves stale claims of one store; safe to run in several processes at once.

    Without a ``reconciler`` every stale record is released: right only when the effect
    was local or went downstream under a downstream key. ``transaction_factory`` opens
    the transaction an answer's ``apply`` commits in. The arguments:
    docs/crash-safety.md, "Running the sweeper"."""

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
        if self.batch_size < 1:
            msg = f"batch_size must be at least 1, got {self.batch_size}"
            raise ConfigurationError(msg)
        if self.retry_unknown_after <= 0:
            msg = "retry_unknown_after must be a positive duration"
            raise ConfigurationError(msg)
        if self._transactions is not None and not self.store.supports_transactions:
            msg = f"{type(self.store).__name__} cannot share a transaction_factory's transaction"
            raise ConfigurationError(msg)
        store.cover_store_wait(self.policy.store_wait_seconds)

    async def sweep_once(
        self, progress: Callable[[SweepReport], None] | None = None
    ) -> SweepReport:
        """One pass over everything due now (``progress`` gets the totals per batch)."""
        report = SweepReport()
        for state, cutoff in self._cutoffs(self.clock()):
            report += await self._drain(state, cutoff, progress, report)
        return report

    def _cutoffs(self, now: float) -> list[tuple[State, float]]:
        """What a pass looks at, in order: released ones only with a reconciler to ask. A
        claim is due at its own deadline (``stale_at``, from the threshold it was claimed
        with), a stale record ``retry_unknown_after`` from its mark."""
        looked = [(State.IN_PROGRESS, now)]
        if self.reconciler is not None:
            looked.append((State.RELEASED, now))
        return [*looked, (State.STALE, now - self.retry_unknown_after)]

    async def due_in(self) -> float | None:
        """Seconds until a pass would have something to do (negative: now; ``math.inf``:
        nothing; None: the store cannot tell), one ``next_due`` per state a pass looks at."""
        now = self.clock()
        soonest = math.inf
        for state, cutoff in self._cutoffs(now):
            due = await self.store.next_due(state, cutoff, now)
            if due is None:
                return None
            soonest = min(soonest, due)
        return soonest

    async def run_forever(
        self, every: Duration | None = None, *, stop: _reconcile.AsyncStop | None = None
    ) -> None:
        """Sweep at the earliest stale deadline (`due_in`), looking at least every
        ``every`` seconds (``policy.sweep_interval``; a store that cannot tell: a pass on
        that beat). A failed pass is logged and the loop goes on."""
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
        """Look (unless a pass is ``due``), pass if something is due, look again; returns
        the wait (None: the interval's beat) and whether a pass is due after it."""
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
        if after < 0:  # due again at once (locked by a completion committing): soon, not busily
            return min(MIN_PAUSE, interval), True
        return self._until(after, asked, interval)

    def _until(self, until: float, asked: float, interval: float) -> tuple[float, bool]:
        """The wait for a deadline ``until`` seconds after ``asked``, at most ``interval``."""
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
        before: SweepReport,
    ) -> SweepReport:
        """Mark and resolve batches until one comes back short (a marked record leaves
        ``from_state`` or is re-dated, and nothing new falls behind ``cutoff``)."""
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
                progress(before + report)
            if len(batch) < self.batch_size:
                return report

    async def _resolve(self, record: Record, *, abandoned: bool) -> Resolution:
        """Ask, then settle or release (an ``abandoned`` record's "did not happen" forgets
        its recovery point too, or it would be swept forever)."""
        started = self.clock()
        answer = await self._ask(record)
        todo = plan(answer, self.policy, transactions=self._transactions is not None)
        if todo.why:
            logger.error(todo.why, record.id)
        resolution = todo.resolution
        if resolution is not Resolution.UNKNOWN and not isinstance(answer, Unknown):
            resolution = await self._write(record, answer, todo, abandoned=abandoned)
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

    async def _write(
        self, record: Record, answer: Happened | DidNotHappen, todo: Plan, *, abandoned: bool
    ) -> Resolution:
        """The fenced settle or release; in a transaction, it locks the record, then the
        answer's ``apply`` runs: both or neither. A transaction that cannot begin is tried
        afresh, then ends the pass; a failure once begun leaves the record stale."""
        expires_at = self.clock() + self.policy.retention_seconds

        async def write(transaction: AsyncTransaction | None) -> bool:
            now = self.clock()
            if isinstance(answer, Happened) and todo.state is not None:
                return await self.store.settle_stale(
                    record, todo.state, answer.response, now, expires_at, transaction
                )
            forget = abandoned or transaction is not None
            return await self.store.release_stale(record, now, transaction, forget_progress=forget)

        if not todo.in_transaction:
            return todo.resolution if await write(None) else Resolution.LOST
        assert self._transactions is not None
        attempt = 1
        while True:
            begun = False
            try:
                async with self._transactions() as transaction:
                    await transaction.begin()
                    begun = True
                    return await self._write_then_apply(
                        record, transaction, write, answer.apply, todo.resolution
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
            if not await write(transaction):  # re-marked by another sweeper: nothing may commit
                await transaction.rollback()
                return Resolution.LOST
            if apply is not None:
                await apply(transaction.connection)
            await transaction.commit()
        except Exception:
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

    def _report(self, record: Record, resolution: Resolution, elapsed: float) -> None:
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
