"""
idemflow for FastAPI, transactional mode: ``pip install 'idemflow[fastapi]'``.

A dependency hands the endpoint an :class:`IdempotentRequest`. The endpoint's
body has been validated by FastAPI before the endpoint runs, and the claim is
made only when the endpoint calls :meth:`IdempotentRequest.run`, so a 422 from
validation (or a 401 from the auth dependency) is never recorded::

    idempotent = Idempotent(idem, connect=pool.connection, transaction=AsyncPsycopgTransaction)
    Idem = Annotated[IdempotentRequest, Depends(dependency(idempotent, principal=current_user))]

    @app.post("/payments", status_code=201)
    async def create_payment(payment: PaymentIn, idem: Idem) -> Response:
        async def charge(attempt: AsyncAttempt) -> idemflow.Response:
            await attempt.connection.execute("INSERT INTO payments …")
            return idemflow.Response.json(201, {...})
        return await idem.run(charge)

``principal`` is your authentication dependency: FastAPI runs it first, and
what it returns (a ``str``, or an object with ``identity`` or ``username``)
scopes the key. For middleware mode, use
:class:`idemflow.integrations.starlette.IdempotencyMiddleware`.

FastAPI reads a body model's bytes itself before any dependency runs, without
a bound: ``max_body_bytes`` is then checked on what it read (413), after the
memory was spent. Bound those apps where the bytes arrive (Starlette's
``RequestBodyLimitMiddleware``, or the server). An endpoint without a body
model has its body read by :meth:`IdempotentRequest.run`, bounded.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the
# dependency's signature at runtime, including names from this closure.

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from starlette.responses import Response as StarletteResponse

from .._errors import ConfigurationError
from .starlette import Idempotent, StarletteHandler

__all__ = ["IdempotentRequest", "dependency"]


class IdempotentRequest:
    """One request's handle on transactional idempotency; see :meth:`run`."""

    def __init__(self, idempotent: Idempotent, request: Request, principal: str | None) -> None:
        self._idempotent = idempotent
        self._request = request
        #: None: read it from the scope; "": the auth dependency found nobody (401).
        self._principal = principal

    async def run(self, handler: StarletteHandler) -> StarletteResponse:
        """Run ``handler`` once per key in the endpoint's transaction, or replay, or refuse."""
        return await self._idempotent.run(self._request, handler, principal=self._principal)


def dependency(
    idempotent: Idempotent, *, principal: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """A FastAPI dependency yielding :class:`IdempotentRequest`.

    Args:
        idempotent: the transactional configuration (store, connections, options).
        principal: your authentication dependency. Without it the principal is
            read from ``scope["user"]`` (starlette's ``AuthenticationMiddleware``).
    """
    if principal is None:

        async def from_scope(request: Request) -> IdempotentRequest:
            return IdempotentRequest(idempotent, request, None)

        return from_scope

    async def from_dependency(
        request: Request, who: Annotated[Any, Depends(principal)]
    ) -> IdempotentRequest:
        return IdempotentRequest(idempotent, request, principal_name(who) or "")

    return from_dependency


def principal_name(who: Any) -> str | None:
    """What an auth dependency returned, as the principal that scopes keys."""
    if who is None or isinstance(who, str):
        return who or None
    for attribute in ("identity", "username"):
        value = getattr(who, attribute, None)
        if isinstance(value, str):
            return value
    msg = f"the principal dependency returned {type(who).__name__}; return a str (or None)"
    raise ConfigurationError(msg)
