"""The HTTP edge's I/O: one request through the driver (the rules: ``idemflow._http``).
This is the async source of truth; ``idemflow/_sync/edge.py`` is generated from it by
``scripts/unasync.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any, TypeAlias, cast

from .._errors import IdempotencyError, ReplayForbidden
from .._events import Event
from .._flow import async_checked_handler, async_resolve
from .._http import (
    EdgeOptions,
    HTTPRequest,
    intent_for,
    not_read,
    policy_for,
    problem_for,
    replayed,
    stored_form,
    storing,
    with_request_id,
)
from .._model import Intent, Policy, Response, Verdict
from ..stores.protocol import AsyncTransaction
from .driver import AsyncAttempt, AsyncHandler, AsyncIdempotency

#: Reads what a framework's endpoint answered (its own response object) as a Response.
Reader: TypeAlias = Callable[[Any], Response]
#: Opens the caller's transaction for one run, e.g. ``lambda: pooled_transaction(…)``.
AsyncTransactionScope: TypeAlias = Callable[[], AbstractAsyncContextManager[AsyncTransaction]]


class AsyncEdge:
    """Runs one protected request: intent, claim via the driver, response.

    Where "the endpoint failed" (the key released) ends and "we failed after it ran"
    begins is drawn here, for every door: a response that cannot be stored (or read)
    is, with a ``transaction``, the handler's bug (500, rolled back, key released);
    without one the key is settled with a ``response-not-stored`` marker.

    Args:
        idempotency: the driver; its policy decides what is stored.
        options: see [`EdgeOptions`][idemflow.edge.EdgeOptions]."""

    def __init__(self, idempotency: AsyncIdempotency, options: EdgeOptions | None = None) -> None:
        self.idempotency = idempotency
        self.options = options or EdgeOptions()
        if isinstance(self.options.policy, Policy):  # a route's: refused now, not per request
            idempotency.route(self.options.policy)

    def intent(self, request: HTTPRequest) -> Intent:
        """The request's identity; raises the 400/401 client errors, claims nothing."""
        return intent_for(request, self.options)

    async def respond(
        self,
        request: HTTPRequest,
        handler: AsyncHandler,
        *,
        transaction: AsyncTransactionScope | None = None,
        single_commit: bool = False,
        read: Reader | None = None,
    ) -> Response:
        """Answer ``request``: run ``handler`` once per key, or replay, or a problem.

        ``read`` makes a Response of what the handler returns (the framework's endpoint's
        answer) once it has run; what it raises is never the endpoint's failure.
        ``transaction`` opens the caller's transaction for this one run (see
        [`pooled_transaction`][idemflow.edge.pooled_transaction]), closed before the replay
        authorization hook runs. The first execution answers with the handler's full
        response; what is stored keeps only the allow-listed headers. Errors of idemflow
        become problem responses; the handler's own propagate (the claim released)."""
        async_checked_handler(handler)
        sent: list[Response] = []  # what to send; the operation returns what to store
        atomic, limit = transaction is not None, self.options.max_response_bytes

        async def operation(attempt: AsyncAttempt) -> Response:
            answer: Response = await async_resolve(handler(attempt))  # raising: released
            policy = attempt.policy
            # The endpoint has run: unless its effect rolls back with us, nothing we fail
            # at from here may release the key.
            try:
                response = answer if read is None else read(answer)
                verdict = policy.verdict(response)
                response = storing(response, verdict, atomic=atomic, max_bytes=limit)
            except Exception as exc:
                if atomic:
                    raise
                response = not_read(exc, policy.verdict)
                verdict = policy.verdict(response)
            sent.append(response)
            if verdict is Verdict.TRANSIENT:
                return response  # released, never stored
            return stored_form(response)  # checked whole by storing() already

        try:
            intent = self.intent(request)
            policy = policy_for(self.options, intent.principal)
            started = self.idempotency.clock()
            async with nullcontext() if transaction is None else transaction() as opened:
                outcome = await self.idempotency.run(
                    intent,
                    operation,
                    transaction=opened,
                    single_commit=single_commit,
                    policy=policy,
                )
            hook = self.options.authorize_replay
            if outcome.replayed:
                if hook is not None and not await async_resolve(hook(outcome.record)):
                    observer, clock = self.idempotency.observer, self.idempotency.clock
                    observer(Event.REPLAY_FORBIDDEN, intent, clock() - started)
                    raise ReplayForbidden("this principal may no longer see the stored response")
                return with_request_id(replayed(outcome), request.request_id)
            return with_request_id(sent[0], request.request_id)
        except IdempotencyError as exc:
            return problem_for(exc, request.request_id)


class AsyncPooledTransaction:
    """A transaction adapter that checks its connection out only when it begins (or lends
    it to the claim, when both come from the store's pool), so replays and 409s take no
    pooled connection. It keeps the connection until `aclose`, across phases and the
    release: a request never holds two. One that fails to begin or roll back is given
    back at once, with its error, for the pool to discard.

    Args:
        acquire: returns an async context manager yielding a connection, e.g.
            ``psycopg_pool.AsyncConnectionPool.connection``.
        adapter: wraps that connection, e.g.
            `idemflow.transactions.AsyncPsycopgTransaction`."""

    def __init__(
        self,
        acquire: Callable[[], AbstractAsyncContextManager[Any]],
        adapter: Callable[[Any], AsyncTransaction],
    ) -> None:
        self._acquire = acquire
        self._adapter = adapter
        # The adapter's class judges a failed checkout, before any adapter is made.
        rule = cast(Any, adapter).is_unavailable if isinstance(adapter, type) else None
        self._rule: Callable[[BaseException], bool] = rule or (lambda exc: False)
        self._context: AbstractAsyncContextManager[Any] | None = None
        self._inner: AsyncTransaction | None = None

    @property
    def connection(self) -> Any:
        return None if self._inner is None else self._inner.connection

    async def begin(self) -> None:
        inner = await self._taken()
        try:
            await inner.begin()
        except BaseException as exc:
            await self._give_up(exc)
            raise

    async def execute(self, statement: Any, params: Any) -> int:
        return await self._checked_out().execute(statement, params)

    async def fetchone(self, statement: Any, params: Any) -> Any:
        return await self._checked_out().fetchone(statement, params)

    async def commit(self) -> None:
        await self._checked_out().commit()

    async def rollback(self) -> None:
        if self._inner is None:
            return  # never begun, or given up: nothing is open
        try:
            await self._inner.rollback()
        except BaseException as exc:
            await self._give_up(exc)
            raise

    async def execute_and_commit(self, statement: Any, params: Any, *, begin: bool = False) -> int:
        """The adapter's: the write and its COMMIT together where it can (``AsyncCommitAfter``)."""
        return await self._checked_out().execute_and_commit(statement, params, begin=begin)

    def is_unavailable(self, exc: BaseException) -> bool:
        """The adapter's rule: its library's errors, a failed checkout's too."""
        return self._rule(exc)

    async def lend(self, sources: tuple[Any, ...]) -> Any:
        """The connection, taken now for a claim, if it comes from one of ``sources`` (the
        store's own); else None, nothing taken."""
        if self._acquire not in sources:
            return None
        inner = await self._taken()
        return inner.connection

    async def _taken(self) -> AsyncTransaction:
        """The adapter on this transaction's connection, checked out now if none is yet."""
        if self._inner is not None:
            return self._inner
        context = self._acquire()
        # Kept only once it served one: a failed checkout has nothing to give back.
        connection = await context.__aenter__()
        self._context = context
        self._inner = inner = self._adapter(connection)
        return inner

    async def aclose(self) -> None:
        """Give the connection back (if one was taken)."""
        context, self._context, self._inner = self._context, None, None
        if context is not None:
            await context.__aexit__(None, None, None)

    async def _give_up(self, error: BaseException) -> None:
        """Give a connection that failed back now, with ``error``, so the pool discards it
        (and a pool of one shared with the store has its slot for the release)."""
        context, self._context, self._inner = self._context, None, None
        if context is None:
            return
        try:
            await context.__aexit__(type(error), error, error.__traceback__)
        except Exception:  # noqa: BLE001 -- the pool's cleanup of a dead connection; error says it
            return

    def _checked_out(self) -> AsyncTransaction:
        if self._inner is None:
            raise RuntimeError("the transaction has not begun")
        return self._inner


@asynccontextmanager
async def pooled_transaction(
    acquire: Callable[[], AbstractAsyncContextManager[Any]],
    adapter: Callable[[Any], AsyncTransaction],
) -> AsyncIterator[AsyncPooledTransaction]:
    """An `AsyncPooledTransaction` that gives its connection back on exit."""
    transaction = AsyncPooledTransaction(acquire, adapter)
    try:
        yield transaction
    finally:
        await transaction.aclose()
