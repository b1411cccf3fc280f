"""
The endpoints without a shared transaction: keys in Redis, payments in SQLite.

:class:`idemflow.integrations.starlette.Idempotent` needs a store that joins
the endpoint's transaction, and ``IdempotencyMiddleware`` hides the attempt
from the endpoint (no ``commit_phase``, no downstream keys), so this is the
no-transaction mode at the HTTP edge, built from :mod:`idemflow.edge`'s
:class:`~idemflow.edge.AsyncEdge` with the same request reading as
``Idempotent`` (the body whole and bounded, the route template and its
parameters, the authenticated principal).

Each phase of a payment is a transaction of its own on the business database,
which the key store never joins:

1. the phase's rows commit first, then its recovery point is written to the
   key store (``attempt.checkpoint``). A checkpoint that fails after the rows
   committed leaves them behind without a recovery point: the retry writes
   them again (the payment's insert is a no-op for an ``intent_ref`` that
   exists), so the rows must be safe to write twice;
2. the last phase commits before the handler returns; the edge then writes
   the completion. If that write fails the key stays claimed (503 "could not
   be recorded", 409 to retries) until the sweeper's reconciler settles it
   from the provider's ledger and the committed rows; a transient answer (the
   provider's 503) rolls the phase back and the key is released.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from starlette.requests import Request
from starlette.responses import Response as StarletteResponse

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    IdempotencyError,
    Response,
    Verdict,
)
from idemflow.edge import AsyncEdge, EdgeOptions, HTTPRequest
from idemflow.integrations.starlette import (
    authenticated_user,
    problem_for,
    read_body,
    request_id,
    route_template,
    to_starlette,
)
from idemflow.stores.protocol import AsyncTransaction

from .payments import Phases

__all__ = ["LocalPhases", "UnsharedIdempotent"]

#: A handler of the demo's: its writes on ``phases.connection``.
PhasedHandler = Callable[[Phases], Awaitable[Response]]


class LocalPhases:
    """A payment's phases on the business database, checkpointed in the key store apart."""

    def __init__(self, attempt: AsyncAttempt, transaction: AsyncTransaction) -> None:
        self._attempt = attempt
        self._transaction = transaction

    @property
    def connection(self) -> Any:
        return self._transaction.connection

    @property
    def recovery_point(self) -> str | None:
        return self._attempt.recovery_point

    def downstream_key(self, step: str) -> str:
        return self._attempt.downstream_key(step)

    async def commit_phase(self, recovery_point: str) -> None:
        """The phase's rows, then its recovery point; the next phase begins."""
        await self._transaction.commit()
        await self._attempt.checkpoint(recovery_point)
        await self._transaction.begin()


class UnsharedIdempotent:
    """``Idempotent``'s ``run`` and ``body`` for a store that shares no transaction.

    Args:
        idempotency: the driver, on a store such as Redis.
        connect: a pooled connection to the business database.
        transaction: that connection's own transaction adapter (it carries the
            business rows only).
        options: as for ``Idempotent``.
    """

    def __init__(
        self,
        idempotency: AsyncIdempotency,
        *,
        connect: Callable[[], AbstractAsyncContextManager[Any]],
        transaction: Callable[[Any], AsyncTransaction],
        options: EdgeOptions | None = None,
    ) -> None:
        self.edge = AsyncEdge(idempotency, options)
        self._connect = connect
        self._transaction = transaction

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.edge.options.max_body_bytes)

    async def run(self, request: Request, handler: PhasedHandler) -> StarletteResponse:
        rid = request_id(request.scope)
        try:
            http_request = HTTPRequest(
                request.method,
                route_template(request.scope),
                request.headers.raw,
                await self.body(request),
                authenticated_user(request.scope),
                rid,
                {str(k): str(v) for k, v in request.path_params.items()},
                request.scope.get("query_string", b"").decode("latin-1"),
            )
        except IdempotencyError as exc:
            return to_starlette(problem_for(exc, rid))
        return to_starlette(await self.edge.respond(http_request, self._phased(handler)))

    def _phased(self, handler: PhasedHandler) -> Callable[[AsyncAttempt], Awaitable[Response]]:
        policy = self.edge.idempotency.policy

        async def operation(attempt: AsyncAttempt) -> Response:
            async with self._connect() as raw:
                transaction = self._transaction(raw)
                await transaction.begin()
                try:
                    response = await handler(LocalPhases(attempt, transaction))
                except BaseException:
                    with contextlib.suppress(Exception):  # the handler's error is the one to see
                        await transaction.rollback()
                    raise
                if policy.verdict(response) is Verdict.TRANSIENT:
                    await transaction.rollback()  # released: nothing of this phase may stay
                else:
                    await transaction.commit()  # settled: the rows, then the completion
                return response

        return operation
