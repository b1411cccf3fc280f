"""The async driver: performs the steps of ``idemflow._flow`` and nothing else.
This is the async source of truth; ``idemflow/_sync/driver.py`` is generated from it by
``scripts/unasync.py``."""

from __future__ import annotations

import asyncio
import logging
import time
from asyncio.tasks import _enter_task, _leave_task
from collections.abc import Awaitable, Callable, Generator, Mapping
from typing import Any, TypeAlias, TypeVar

from .._downstream import downstream_key
from .._errors import StoreUnavailable
from .._events import Event, Observer, error_event, null_observer
from .._flow import (
    ClaimKey,
    ClaimOn,
    CommitClaim,
    Complete,
    Execute,
    Flow,
    PhaseCommitted,
    Step,
    async_checked_handler,
    async_resolve,
    claim_on,
    idempotency_flow,
    refuse_run,
    release_again,
    starts_past_a_phase,
)
from .._model import (
    RUN_STORE_WAIT,
    Claim,
    Clock,
    Intent,
    Outcome,
    Policy,
    Record,
    Response,
    new_lease_token,
)
from ..stores.protocol import AsyncStore, AsyncTransaction, CommitFailed, NotFused, Statement

logger = logging.getLogger("idemflow")


class AsyncAttempt:
    """What the operation gets: its claimed record and the caller's connection (that of
    the transaction passed to ``run``, where the completion is written; or None)."""

    def __init__(
        self,
        record: Record,
        store: AsyncStore,
        transaction: AsyncTransaction | None,
        clock: Clock,
        on_commit: Callable[[], None] = lambda: None,
        policy: Policy | None = None,
    ) -> None:
        self.record = record
        self.policy = policy or Policy()  # the route's, else the driver's
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
        """The key to send a downstream provider for ``step``: the same on every retry
        within one retention period, so a re-executed call cannot charge twice."""
        return downstream_key(self.record, step)

    async def checkpoint(self, recovery_point: str) -> None:
        """Record progress in the current transaction (it commits with your writes) and
        renew the claim. Raises LeaseLost if the claim is no longer ours."""
        await self._store.checkpoint(self.record, recovery_point, self._clock(), self._transaction)
        self.recovery_point = recovery_point
        if self._transaction is None:
            self._on_commit()

    async def commit_phase(self, recovery_point: str) -> None:
        """End an atomic phase: checkpoint, commit, begin the next transaction. A retry
        resumes from ``recovery_point``; call it before any external call."""
        if self._transaction is None:
            await self.checkpoint(recovery_point)
            return
        # Once its COMMIT may have run, giving a single-commit claim back takes a write.
        phase = AsyncCommitAfter(self._transaction, begin=True, on_commit=self._on_commit)
        await self._store.checkpoint(self.record, recovery_point, self._clock(), phase)
        self.recovery_point = recovery_point
        await phase.finish()


AsyncHandler: TypeAlias = Callable[[AsyncAttempt], Awaitable[Response]]


class AsyncIdempotency:
    """Run operations exactly once per ``(principal, key)``: ``observer`` is told every
    outcome; ``clock`` (seconds since the epoch) dates records."""

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
        store.cover_stale_threshold(self.policy.stale_seconds)
        store.cover_store_wait(self.policy.store_wait_seconds)
        self._routes: set[Policy] = set()  # the route policies the store was told of

    async def run(
        self,
        intent: Intent,
        handler: AsyncHandler,
        *,
        transaction: AsyncTransaction | None = None,
        single_commit: bool = False,
        policy: Policy | None = None,
    ) -> Outcome:
        """Claim ``intent``, then replay, refuse, or run ``handler`` once. With
        ``transaction`` (`idemflow.transactions`) the completion commits with the
        handler's writes; ``single_commit=True`` puts the claim in it too. ``policy``:
        this route's (its retention, timeout and the stale threshold its claims carry,
        classifier); by default the driver's."""
        async_checked_handler(handler)
        policy = self.route(policy)
        if transaction is not None or single_commit:  # else nothing to refuse
            refuse_run(
                type(self.store).__name__,
                transaction=transaction is not None,
                single_commit=single_commit,
                shares=self.store.supports_transactions,
                single_commits=self.store.supports_single_commit,
            )
        perform = _Performer(self, intent, handler, transaction, single_commit, policy)
        waits = RUN_STORE_WAIT.set(policy.store_wait_seconds)
        try:
            flow = idempotency_flow(
                intent,
                policy,
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
        finally:
            RUN_STORE_WAIT.reset(waits)
        if perform.open is not None:  # a single-commit replay left the claim's transaction open
            await perform.abandon()
        if outcome.replayed:
            perform.observe(Event.REPLAYED)
        return outcome

    def route(self, policy: Policy | None) -> Policy:
        """A route's ``policy`` (by default the driver's), its store told its wait budget
        and stale threshold once (remembered, bounded: a resolver may answer a new one per
        request)."""
        if policy is None or policy is self.policy:
            return self.policy
        if policy not in self._routes:
            if len(self._routes) >= _ROUTES_KEPT:
                self._routes.clear()
            self._routes.add(policy)
            self.store.cover_store_wait(policy.store_wait_seconds)  # it keeps the shortest
            self.store.cover_stale_threshold(policy.stale_seconds)  # and the longest
        return policy


_ROUTES_KEPT = 64


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
            # Only PEP 479's wrapping of a StopIteration thrown into the flow, whose caller
            # is owed the object itself (as ``contextlib`` unwraps it)?
            if not (isinstance(thrown, StopIteration) and raised.__cause__ is thrown):
                raise
            break
        result, error = None, None
        try:
            result = await perform(step)
        except BaseException as exc:  # noqa: BLE001 -- the flow decides, then re-raises
            error = exc
    # Raised outside the except clause, where it would gain our RuntimeError as __context__.
    assert thrown is not None
    raise thrown


class _Performer:
    """Performs one run's steps, holding at most one connection at any moment (so a pool
    the store shares can never deadlock on one request)."""

    def __init__(
        self,
        idempotency: AsyncIdempotency,
        intent: Intent,
        handler: AsyncHandler,
        transaction: AsyncTransaction | None,
        single_commit: bool,
        policy: Policy,
    ) -> None:
        self._idem = idempotency
        self._policy = policy
        self._intent = intent
        self._started = idempotency.clock()
        self._handler = handler
        self._transaction = transaction
        self._single_commit = single_commit
        #: The caller's transaction while it is begun and not yet ended, else None.
        self.open: AsyncTransaction | None = None
        self._unbegun = False  # a failed BEGIN: the release goes on the store's connection
        self._claim_committed = not single_commit  # does giving it back take a write?
        self._phase_committed = False

    async def __call__(self, step: Step) -> Any:
        if isinstance(step, ClaimKey):
            return await async_shielded(self._claim(step))
        if isinstance(step, Execute):
            attempt = AsyncAttempt(
                step.record,
                self._idem.store,
                self._transaction,
                self._idem.clock,
                self._committed,
                self._policy,
            )
            await async_cancel_point()  # a cancellation deferred by the claim: release now
            transaction = self._transaction
            if transaction is not None:
                try:
                    await self._begin()
                except Exception as exc:  # one either rule calls unavailable is a 503
                    self._unbegun = True
                    if not (
                        transaction.is_unavailable(exc) or self._idem.store.is_unavailable(exc)
                    ):
                        raise
                    raise _could_not_begin(exc) from exc
            self._phase_committed = starts_past_a_phase(
                step.record, transaction=transaction is not None
            )
            return await async_resolve(self._handler(attempt))
        if isinstance(step, Complete):
            await async_shielded(self._complete(step))
            self.observe(Event.COMPLETED)
            return None
        if isinstance(step, PhaseCommitted):
            return self._phase_committed
        if isinstance(step, CommitClaim):
            self._claim_committed = True  # giving it back takes a write from here on
            await async_shielded(self._end_with_commit())
            return None
        released = await async_shielded(self._release(step.record))
        self.observe(Event.RELEASED if released else Event.RELEASE_FAILED)
        return None

    async def _claim(self, step: ClaimKey) -> Claim:
        now, store, transaction = self._idem.clock(), self._idem.store, self._transaction
        args = (step.intent, step.lease_token, now, now + step.retention)
        on = claim_on(transaction=transaction is not None, single_commit=self._single_commit)
        if on is ClaimOn.LENT and transaction is not None:
            claim = await store.claim_on_lent(*args, transaction, stale_after=step.stale_after)
        elif on is ClaimOn.TRANSACTION and transaction is not None:
            # The transaction begins with the claim's first statement (see
            # `AsyncBeginsOnFirstStatement`); nothing committed, so a 503 is safe.
            begun = AsyncBeginsOnFirstStatement(transaction, self._begin)
            try:
                claim = await store.claim(*args, begun, stale_after=step.stale_after)
            except Exception as exc:
                if not transaction.is_unavailable(exc):
                    raise
                raise _could_not_begin(exc) from exc
        else:
            claim = await store.claim(*args, stale_after=step.stale_after)
        if claim.owned:
            self.observe(Event.CLAIMED)
        return claim

    async def _complete(self, step: Complete) -> None:
        now, opened = self._idem.clock(), self.open
        expires_at = now + step.retention
        ending = None if opened is None else AsyncCommitAfter(opened)
        try:
            await self._idem.store.complete(
                step.record, step.state, step.response, now, expires_at, ending or self._transaction
            )
        except Exception as exc:  # the effect rolls back with it: a 503, the key given back
            if opened is None or not opened.is_unavailable(exc):
                raise
            msg = f"the request's transaction could not complete: {exc}".strip()
            raise StoreUnavailable(msg) from exc
        if ending is not None:  # a failed COMMIT may leave it open (SQLite): abandon() rolls back
            await ending.finish()
            self.open = None

    async def _release(self, record: Record) -> bool:
        """Roll back, then give the key back if the claim was committed; never raises (what
        cannot be released is the sweeper's)."""
        connection_usable = await self._rollback() and not self._unbegun
        if not self._claim_committed:
            return True  # single-commit mode: the rollback took the claim with it
        transaction = self._transaction if connection_usable else None
        attempt = 0
        while True:
            attempt += 1
            started = time.monotonic()
            try:
                await self._release_on(transaction, record)
            except Exception as exc:  # on the store's connection if the transaction's failed
                if transaction is not None and transaction.is_unavailable(exc):
                    transaction = None
                elapsed = time.monotonic() - started
                if not release_again(
                    exc, attempt=attempt, elapsed=elapsed, policy=self._idem.policy
                ) or not (await self._rollback() or transaction is None):
                    logger.warning("could not release claim; the sweeper will", exc_info=True)
                    return False
            else:
                return True

    async def _release_on(self, transaction: AsyncTransaction | None, record: Record) -> None:
        """The fenced release, on the request's own connection when it has one."""
        store, now = self._idem.store, self._idem.clock()
        if transaction is None:
            await store.release(record, now)
            return
        self.open = transaction  # before: a failed or cancelled BEGIN may still have run
        await transaction.begin()
        await store.release(record, now, transaction)
        await self._end_with_commit()

    def _committed(self) -> None:
        self._claim_committed = self._phase_committed = True

    def observe(self, event: Event) -> None:
        observer = self._idem.observer
        if observer is not null_observer:  # nobody listens: not even a clock read
            observer(event, self._intent, self._idem.clock() - self._started)

    async def _begin(self) -> None:
        if self._transaction is not None and self.open is None:
            self.open = self._transaction  # before: a failed or cancelled BEGIN may have run
            await self._transaction.begin()

    async def _end_with_commit(self) -> None:
        if self.open is not None:
            await self.open.commit()  # still open if it fails: abandon() rolls back
            self.open = None

    async def _rollback(self) -> bool:
        """Roll back if open; False when the rollback failed (the connection is unusable)."""
        opened, self.open = self.open, None
        if opened is None:
            return True
        try:
            await opened.rollback()
        except Exception:
            logger.warning("rollback failed; giving the connection up", exc_info=True)
            return False
        return True

    async def abandon(self) -> None:
        """Never leave the caller's transaction open behind an error (shielded: a rollback
        cut short would give the connection back open to the pool)."""
        if self.open is None:
            return  # nothing open (every run that ended well): no step to shield
        await async_shielded(self._rollback())


def _could_not_begin(exc: BaseException) -> StoreUnavailable:
    return StoreUnavailable(f"the request's transaction could not begin: {exc}".strip())


class AsyncCommitAfter(AsyncTransaction):
    """The caller's transaction, for one fenced write its COMMIT follows at once (in one
    round trip where ``execute_and_commit`` can, else in `finish`); the COMMIT's own error
    comes out of `finish`. ``on_commit`` is called once the COMMIT may have run."""

    def __init__(
        self,
        transaction: AsyncTransaction,
        *,
        begin: bool = False,
        on_commit: Callable[[], None] = lambda: None,
    ) -> None:
        self._transaction = transaction
        self._fused = True  # until NotFused: then the write alone, finish() commits
        self._begin = begin
        self._on_commit = on_commit
        self._committed = False
        self._error: BaseException | None = None

    @property
    def connection(self) -> Any:
        return self._transaction.connection

    async def begin(self) -> None:
        await self._transaction.begin()

    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        if self._committed:
            raise RuntimeError("the write this transaction was lent for has committed")
        if not self._fused:
            return await self._transaction.execute(statement, params)
        try:
            changed = await self._transaction.execute_and_commit(
                statement, params, begin=self._begin
            )
        except NotFused:  # nothing sent: the write alone, finish() commits
            self._fused = False
            return await self._transaction.execute(statement, params)
        except CommitFailed as failed:
            self._committed, self._error = True, failed.__cause__
            self._on_commit()
            return 1
        except BaseException:
            self._on_commit()  # sent, perhaps with its COMMIT: it may have committed
            raise
        if changed == 1:
            self._committed = True
            self._on_commit()
        return changed

    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        return await self._transaction.fetchone(statement, params)

    async def commit(self) -> None:
        await self._transaction.commit()

    async def rollback(self) -> None:
        await self._transaction.rollback()

    async def finish(self) -> None:
        """Commit (and begin) unless the write did; raise the COMMIT's own error if it failed."""
        if self._committed:
            if self._error is not None:
                raise self._error
            return
        self._on_commit()
        await self._transaction.commit()
        if self._begin:
            await self._transaction.begin()


class AsyncBeginsOnFirstStatement(AsyncTransaction):
    """The caller's transaction, for a single-commit claim: begun by its first statement,
    so the store's claim judges the BEGIN's errors (and its checkout's) as its own."""

    def __init__(self, transaction: AsyncTransaction, begin: Callable[[], Awaitable[None]]) -> None:
        self._transaction = transaction
        self._begin = begin

    @property
    def connection(self) -> Any:
        return self._transaction.connection

    async def begin(self) -> None:
        await self._begin()

    async def execute(self, statement: Statement, params: Mapping[str, Any]) -> int:
        await self._begin()
        return await self._transaction.execute(statement, params)

    async def fetchone(
        self, statement: Statement, params: Mapping[str, Any]
    ) -> Mapping[str, Any] | None:
        await self._begin()
        return await self._transaction.fetchone(statement, params)

    async def commit(self) -> None:
        await self._transaction.commit()

    async def rollback(self) -> None:
        await self._transaction.rollback()


# Async only: scripts/unasync.py drops this block (and the shields' calls). Why:
# docs/architecture.md, "Sync and async".

_T = TypeVar("_T")


def async_shielded(awaitable: Awaitable[_T]) -> Awaitable[_T]:
    """Await ``awaitable`` to its end even if this task is cancelled meanwhile: the
    cancellation is requested again (its count kept) once the step is done."""
    return _Shield(awaitable)


class _StepTask:
    """The current task while a shielded step runs: what the step's own timeouts cancel."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.waiting: Any = None  # the future the step waits on
        self.must_cancel = False  # a cancel() the step has not received yet
        self._cancels = 0
        self.finished = False

    def cancel(self, msg: Any = None) -> bool:
        if self.finished:
            return False
        self._cancels += 1
        if self.waiting is None or not self.waiting.cancel(msg):
            self.must_cancel = True
        return True

    def cancelling(self) -> int:
        return self._cancels

    def uncancel(self) -> int:
        self._cancels = max(self._cancels - 1, 0)
        return self._cancels

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop


class _Shield:
    """What the caller's task waits on: the step's future's wake-up, not its ``cancel()``."""

    _asyncio_future_blocking = False

    def __init__(self, awaitable: Awaitable[Any]) -> None:
        self._awaitable = awaitable
        self._step: _StepTask | None = None

    def get_loop(self) -> asyncio.AbstractEventLoop:
        assert self._step is not None
        return self._step.get_loop()

    def add_done_callback(self, callback: Any, *, context: Any = None) -> None:
        assert self._step is not None
        self._step.waiting.add_done_callback(callback, context=context)

    def cancel(self, msg: Any = None) -> bool:
        return False  # the caller's task keeps it as ``_must_cancel``: thrown in after the wait

    def __await__(self) -> Generator[Any, None, Any]:
        loop = asyncio.get_running_loop()
        caller = asyncio.current_task(loop)
        assert caller is not None
        cancels = caller.cancelling()
        step = self._step = _StepTask(loop)
        inner = self._awaitable.__await__()
        resume: Any = inner.send
        sent: Any = None
        try:
            while True:
                if step.must_cancel:
                    step.must_cancel = False
                    resume, sent = inner.throw, asyncio.CancelledError()
                # The step runs with its stand-in as the current task (what its own
                # asyncio.timeout cancels), then the caller is current again.
                _leave_task(loop, caller)
                _enter_task(loop, step)  # type: ignore[arg-type]  # task-like, as asyncio.timeout needs
                try:
                    waiting = resume(sent)
                except StopIteration as stop:
                    return stop.value
                finally:
                    _leave_task(loop, step)  # type: ignore[arg-type]
                    _enter_task(loop, caller)
                resume, sent = inner.send, None
                blocking = getattr(waiting, "_asyncio_future_blocking", False)
                if blocking:  # else a bare yield: the caller's task steps again soon
                    waiting._asyncio_future_blocking = False
                    self._asyncio_future_blocking = True  # the caller's task blocks on us
                    step.waiting = waiting
                try:
                    yield self if blocking else waiting
                except asyncio.CancelledError as exc:
                    if blocking and waiting.cancelled():
                        resume, sent = inner.throw, exc  # the step's own (its timeout)
                    # else: the caller's, delivered once the step is done
                except GeneratorExit:
                    inner.close()  # the caller's coroutine is closed: so is the step
                    raise
                except BaseException as exc:  # noqa: BLE001 -- the step's future's error: the step's
                    resume, sent = inner.throw, exc
                finally:
                    step.waiting = None
        finally:
            step.finished = True
            if caller.cancelling() > cancels:
                # A cancellation of the caller arrived meanwhile: raise it at its next await.
                caller.uncancel()
                caller.cancel()


async def async_cancel_point() -> None:
    """Raise a cancellation `async_shielded` deferred, before anything else runs."""
    current = asyncio.current_task()
    if current is not None and current.cancelling():
        await asyncio.sleep(0)


# End of async only.
