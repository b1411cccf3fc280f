"""
The sweeper: ends stale claims and reconciles what they left behind.

This is the async source of truth; ``idemflow/_sync/sweeper.py`` is generated
from it by ``scripts/unasync.py``. Import the public names from
:mod:`idemflow.sweeper`.

One pass has two parts, each in bounded batches through the ``(state,
updated_at)`` index:

1. ``in_progress`` records untouched for longer than ``policy.stale_after``
   are marked ``stale`` (one atomic statement per batch, so each is marked by
   exactly one sweeper) and resolved;
2. records still ``stale`` after an earlier *unknown* answer (or a sweeper
   that died mid-resolution) are marked again once ``retry_unknown_after`` has
   passed, and resolved again.

Every resolution is fenced on the mark (``settle_stale``/``release_stale``):
a sweeper whose record was re-marked by another can no longer write it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

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


class AsyncReconciler(Protocol):
    """**Protocol:** asks the external system what a crashed attempt did.

    Called with the stale record (its ``recovery_point`` tells how far the
    attempt got) and the downstream keys of the sweeper's ``steps``, e.g.
    ``{"charge": "idemflow-3f2a…"}``: the keys the attempt sent to the
    provider, by which the provider can be asked. Must not have side effects
    of its own beyond asking. Raising counts as :class:`Unknown`.
    """

    async def __call__(self, record: Record, downstream_keys: Mapping[str, str]) -> Answer: ...


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

    async def sweep_once(
        self, progress: Callable[[SweepReport], None] | None = None
    ) -> SweepReport:
        """One pass over everything due now; returns the counts per resolution.

        ``progress`` is called with the running totals after each batch.
        """
        now = self.clock()
        report = await self._drain(State.IN_PROGRESS, now - self.policy.stale_seconds, progress)
        return report + await self._drain(
            State.STALE, now - self.retry_unknown_after, progress, report
        )

    async def run_forever(
        self, every: Duration | None = None, *, stop: _reconcile.AsyncStop | None = None
    ) -> None:
        """Sweep every ``every`` seconds (default: the request timeout) until ``stop`` is set.

        A failed pass (store unreachable) is logged and the loop goes on.
        """
        interval = seconds(self.policy.request_timeout if every is None else every)
        stop = stop or _reconcile.AsyncStop()
        while not stop.is_set():
            try:
                await self.sweep_once()
            except Exception as exc:  # an outage must not end the loop
                logger.error(
                    "sweep pass failed: %s", exc, exc_info=logger.isEnabledFor(logging.DEBUG)
                )
            if await stop.wait(interval):
                return

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
                resolution = await self._resolve(record)
                report += SweepReport.of(resolution, retried=from_state is State.STALE)
            if progress is not None:
                progress(report if before is None else before + report)
            if len(batch) < self.batch_size:
                return report

    async def _resolve(self, record: Record) -> Resolution:
        started = self.clock()
        answer = await self._ask(record)
        if isinstance(answer, Happened):
            resolution = await self._settle(record, answer)
        elif isinstance(answer, DidNotHappen):
            released = await self.store.release_stale(record, self.clock())
            resolution = Resolution.RELEASED if released else Resolution.LOST
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
        if self._transactions is None:
            if answer.apply is not None:
                logger.error(
                    "Happened.apply for record %s needs the sweeper's transaction_factory; "
                    "the record stays stale",
                    record.id,
                )
                return Resolution.UNKNOWN
            settled = await self.store.settle_stale(record, state, answer.response, self.clock())
            return Resolution.COMPLETED if settled else Resolution.LOST
        return await self._settle_in_transaction(record, state, answer)

    async def _settle_in_transaction(
        self, record: Record, state: State, answer: Happened
    ) -> Resolution:
        """Settle first (it locks the record), then apply; commit both or neither."""
        assert self._transactions is not None
        async with self._transactions() as transaction:
            await transaction.begin()
            try:
                settled = await self.store.settle_stale(
                    record, state, answer.response, self.clock(), transaction
                )
                if settled and answer.apply is not None:
                    await answer.apply(transaction.connection)
            except Exception:
                await transaction.rollback()
                logger.warning(
                    "settling record %s failed; it stays stale", record.id, exc_info=True
                )
                return Resolution.UNKNOWN
            if not settled:  # re-marked by another sweeper: nothing of ours may commit
                await transaction.rollback()
                return Resolution.LOST
            await transaction.commit()
            return Resolution.COMPLETED

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
