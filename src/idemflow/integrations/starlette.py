"""
idemflow for Starlette (and so for FastAPI): ``pip install 'idemflow[starlette]'``.

Two modes, and the first is the one to use wherever the effect lives in the
same database as the keys:

**Transactional mode** — :class:`Idempotent`. The endpoint validates its
input, then calls ``await idempotent.run(request, handler)``. The handler gets
an :class:`~idemflow.AsyncAttempt` whose ``connection`` is the transaction the
completion is written in: the business rows and the ``completed`` record
commit together, or neither does::

    idempotent = Idempotent(idem, connect=pool.connection, transaction=AsyncPsycopgTransaction)

    async def create_payment(request: Request) -> Response:
        payment = parse(await request.body())       # 400 here is never recorded
        async def charge(attempt: AsyncAttempt) -> idemflow.Response:
            await attempt.connection.execute("INSERT INTO payments …")
            return idemflow.Response.json(201, {...})
        return await idempotent.run(request, charge)

**Middleware mode** — :class:`IdempotencyMiddleware`, pure ASGI (not
``BaseHTTPMiddleware``), for endpoints whose effect is elsewhere. It claims,
buffers the response through a ``send`` wrapper (as starlette's GZip
middleware does), stores it and replays it. It **cannot make the effect and the
record atomic**: it does not own the endpoint's transaction, so a crash between
the endpoint's commit and the completion leaves the effect applied and the key
``in_progress`` (the sweeper resolves it, it cannot undo it).

Both need authentication to run first: the principal comes from
``scope["user"]`` (starlette's ``AuthenticationMiddleware``) or a ``principal``
hook; without one the request is refused with 401 rather than claimed
anonymously, unless the integration is marked ``public``.
:class:`RequestIdMiddleware` gives every response its ``X-Request-Id``.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeAlias

from starlette.requests import Request
from starlette.responses import Response as StarletteResponse
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._async.driver import AsyncAttempt, AsyncIdempotency
from .._errors import ConfigurationError, IdempotencyError
from .._http import (
    REQUEST_ID_HEADER,
    SAFE_METHODS,
    Edge,
    EdgeOptions,
    HTTPRequest,
    ResponseNotStorable,
    pooled_transaction,
    problem_for,
    request_id_from,
)
from .._model import Response
from ..stores.protocol import AsyncTransaction

__all__ = [
    "EdgeOptions",
    "IdempotencyMiddleware",
    "Idempotent",
    "RequestIdMiddleware",
    "ResponseNotStorable",
    "authenticated_user",
    "request_id",
]

#: Returns the authenticated principal of a request's scope, or None.
PrincipalGetter: TypeAlias = Callable[[Scope], str | None]
#: A transactional handler: business writes on ``attempt.connection``.
StarletteHandler: TypeAlias = Callable[[AsyncAttempt], Awaitable[Response | StarletteResponse]]


def authenticated_user(scope: Scope) -> str | None:
    """The identity of ``scope["user"]`` as starlette's ``AuthenticationMiddleware`` sets it.

    Raises ConfigurationError when no authentication ran at all: that is a
    wiring mistake (idempotency placed before authentication), not a 401.
    """
    if "user" not in scope:
        msg = (
            "no authentication ran before idempotency: add AuthenticationMiddleware "
            "before it, or pass principal=… (keys are never claimed anonymously)"
        )
        raise ConfigurationError(msg)
    user = scope["user"]
    if not getattr(user, "is_authenticated", False):
        return None
    return str(user.identity)


def request_id(scope: Scope) -> str:
    """This request's correlation id: set by :class:`RequestIdMiddleware`, else made now."""
    state = scope.setdefault("state", {})
    value = state.get("request_id")
    if not isinstance(value, str):
        value = request_id_from(scope.get("headers", ()))
        state["request_id"] = value
    return value


class RequestIdMiddleware:
    """Give every response an ``X-Request-Id``: the client's (if sane) or a new one.

    The id is also ``request.state.request_id`` and becomes the key record's
    correlation id, which replays link back to.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        value = request_id(scope).encode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(k.lower() == REQUEST_ID_HEADER.encode() for k, _ in headers):
                    headers.append((REQUEST_ID_HEADER.encode(), value))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


# --- transactional mode ---------------------------------------------------------------------


class Idempotent:
    """Transactional mode: the endpoint's own transaction carries the completion.

    Args:
        idempotency: the driver (store, policy, observer).
        connect: returns an async context manager yielding a connection to the
            database the key table lives in (e.g. ``pool.connection``). It is
            called only when the handler is about to run: replays and 409
            answers take no connection.
        transaction: wraps that connection in a transaction adapter, e.g.
            :class:`idemflow.transactions.AsyncPsycopgTransaction`.
        principal: reads the authenticated principal from the scope.
        options: public endpoints, replay authorization, size limits.
        single_commit: claim inside the endpoint's transaction too (PostgreSQL),
            so the claim costs no commit of its own: it commits with the
            endpoint's first phase. A duplicate that meets a claim not yet
            committed waits for it at most the store's claim lock timeout
            (50 ms by default), then gets its 409. Every request then takes a
            connection, replays included.
    """

    def __init__(
        self,
        idempotency: AsyncIdempotency,
        *,
        connect: Callable[[], AbstractAsyncContextManager[Any]],
        transaction: Callable[[Any], AsyncTransaction],
        principal: PrincipalGetter = authenticated_user,
        options: EdgeOptions | None = None,
        single_commit: bool = False,
    ) -> None:
        if not idempotency.store.supports_transactions:
            msg = (
                f"{type(idempotency.store).__name__} cannot share the endpoint's transaction; "
                "use IdempotencyMiddleware (middleware mode) with it"
            )
            raise ConfigurationError(msg)
        self.edge = Edge(idempotency, options)
        self._connect = connect
        self._transaction = transaction
        self._principal = principal
        self._single_commit = single_commit

    async def run(
        self,
        request: Request,
        handler: StarletteHandler,
        *,
        principal: str | None = None,
    ) -> StarletteResponse:
        """Run ``handler`` once per ``(principal, Idempotency-Key)``; replay or refuse otherwise.

        Call it after validating the request: failures before this call are
        never recorded. ``principal`` overrides the ``principal`` hook (the
        FastAPI dependency passes what its auth dependency returned).
        """
        rid = request_id(request.scope)
        try:
            if request.method.upper() in SAFE_METHODS:
                msg = f"{request.method} is idempotent already; protect unsafe methods only"
                raise ConfigurationError(msg)
            who = principal if principal is not None else self._principal(request.scope)
            http_request = HTTPRequest(
                request.method,
                route_template(request.scope),
                request.headers.raw,
                await request.body(),
                who,
                rid,
                _path_params(request.scope),
            )
        except IdempotencyError as exc:
            return to_starlette(problem_for(exc, rid))
        response = await self.edge.respond(
            http_request,
            _storable_handler(handler),
            transaction=lambda: pooled_transaction(self._connect, self._transaction),
            single_commit=self._single_commit,
        )
        return to_starlette(response)


def route_template(scope: Scope) -> str:
    """The template of the route that matched (``/payments/{id}``), else the raw path."""
    route = scope.get("route")
    template = getattr(route, "path", None)
    return template if isinstance(template, str) else str(scope["path"])


def _path_params(scope: Scope) -> dict[str, str]:
    return {str(k): str(v) for k, v in scope.get("path_params", {}).items()}


def _storable_handler(handler: StarletteHandler) -> Callable[[AsyncAttempt], Awaitable[Response]]:
    async def operation(attempt: AsyncAttempt) -> Response:
        result = await handler(attempt)
        return result if isinstance(result, Response) else from_starlette(result)

    return operation


def from_starlette(response: StarletteResponse) -> Response:
    """A starlette response with a body in memory as an idemflow Response.

    Streaming and file responses have no body to store: refused, never stored empty.
    """
    body = getattr(response, "body", None)
    if not isinstance(body, bytes | memoryview):
        msg = (
            f"{type(response).__name__} streams its body, which cannot be stored for "
            "replay; return a Response with the body in memory from protected endpoints"
        )
        raise ResponseNotStorable(msg)
    headers = tuple(
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in response.raw_headers
        if k.lower() != b"content-length"
    )
    return Response(response.status_code, bytes(body), headers)


def to_starlette(response: Response) -> StarletteResponse:
    """An idemflow Response as a starlette one, header lines kept as they are (repeats too)."""
    result = StarletteResponse(content=response.body, status_code=response.status)
    result.raw_headers.extend(
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers
    )
    return result


# --- middleware mode ------------------------------------------------------------------------


class IdempotencyMiddleware:
    """Middleware mode: claim, buffer the response, store it, replay it. Pure ASGI.

    Only the ``endpoints`` listed opt in (``"POST /payments"``,
    ``"POST /payments/{id}/refunds"``: method and route template); every other
    request, and every GET/HEAD/OPTIONS, passes through untouched.

    It cannot put the completion in the endpoint's transaction (it does not
    own it): the endpoint's effect commits first, then the record. A 5xx, 408
    or 429 response (or an exception) releases the claim, so a retry runs the
    endpoint again. Streaming responses and bodies over ``max_response_bytes``
    are refused with a 500 problem and the claim released — the endpoint's
    effect has happened by then, so do not opt such endpoints in.

    Place it after authentication (inside ``AuthenticationMiddleware``).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        idempotency: AsyncIdempotency,
        endpoints: Iterable[str],
        principal: PrincipalGetter = authenticated_user,
        options: EdgeOptions | None = None,
    ) -> None:
        self.app = app
        self.edge = Edge(idempotency, options)
        self._principal = principal
        self._routes = [_compile_endpoint(endpoint) for endpoint in endpoints]
        if not self._routes:
            raise ConfigurationError("IdempotencyMiddleware needs at least one endpoint to protect")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self._match(scope) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        try:
            who = self._principal(scope)
            body = await _read_body(receive, self.edge.options.max_body_bytes)
        except IdempotencyError as exc:
            await send_response(send, problem_for(exc, rid))
            return
        template, params = route
        request = HTTPRequest(scope["method"], template, scope["headers"], body, who, rid, params)
        response = await self.edge.respond(request, self._endpoint(scope, body, receive))
        await send_response(send, response)

    def _match(self, scope: Scope) -> tuple[str, dict[str, str]] | None:
        """The opted-in route template this request matches, and its path parameters."""
        method = scope["method"].upper()
        if method in SAFE_METHODS:
            return None
        path = scope.get("path", "")
        for route_method, pattern, template in self._routes:
            match = pattern.match(path) if route_method == method else None
            if match is not None:
                return template, match.groupdict()
        return None

    def _endpoint(
        self, scope: Scope, body: bytes, receive: Receive
    ) -> Callable[[AsyncAttempt], Awaitable[Response]]:
        async def operation(attempt: AsyncAttempt) -> Response:
            buffer = _ResponseBuffer(self.edge.options.max_response_bytes)
            await self.app(scope, _replaying(body, receive), buffer.send)
            return buffer.response()

        return operation


def _compile_endpoint(endpoint: str) -> tuple[str, re.Pattern[str], str]:
    method, _, template = endpoint.strip().partition(" ")
    if not template.startswith("/"):
        msg = f"endpoint {endpoint!r} must be 'METHOD /route/{{param}}'"
        raise ConfigurationError(msg)
    pattern, _, _ = compile_path(template.strip())
    return method.upper(), pattern, template.strip()


async def _read_body(receive: Receive, limit: int) -> bytes:
    """The request body; past ``limit`` bytes the rest is dropped (the fingerprint refuses it)."""
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break  # the client went away; the fingerprint of what we have is moot
        chunk = message.get("body", b"")
        if size <= limit:
            chunks.append(chunk)
            size += len(chunk)
        more = bool(message.get("more_body", False))
    return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the buffered body to the app once, then defers to the client."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class _ResponseBuffer:
    """A ``send`` that keeps the app's response in memory instead of sending it."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._size = 0

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._start = message
        elif message["type"] == "http.response.body":
            if message.get("more_body", False):
                msg = (
                    "the endpoint streams its response, which middleware mode cannot store "
                    "for replay; do not protect streaming endpoints"
                )
                raise ResponseNotStorable(msg)
            self._chunks.append(message.get("body", b""))
            self._size += len(self._chunks[-1])
            if self._size > self._limit:
                msg = f"the response body exceeds the stored-body limit of {self._limit} bytes"
                raise ResponseNotStorable(msg)

    def response(self) -> Response:
        if self._start is None:
            raise RuntimeError("the endpoint returned without sending a response")
        headers = tuple(
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in self._start.get("headers", ())
            if k.lower() != b"content-length"
        )
        return Response(int(self._start["status"]), b"".join(self._chunks), headers)


async def send_response(send: Send, response: Response) -> None:
    """Send an idemflow Response as ASGI messages (with its ``Content-Length``)."""
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers]
    if response.status >= 200 and response.status not in (204, 304):
        headers.append((b"content-length", str(len(response.body)).encode("latin-1")))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
