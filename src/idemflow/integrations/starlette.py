"""
idemflow for Starlette (and so for FastAPI): ``pip install 'idemflow[starlette]'``.

Two modes. Transactional mode, :class:`Idempotent` (``await
idempotent.run(request, handler)``): the handler's rows and the ``completed``
record commit in one transaction; use it wherever the effect lives in the key
store's database. Middleware mode, :class:`IdempotencyMiddleware` (pure ASGI),
for effects elsewhere: it cannot make the effect and the record atomic.
:class:`RequestIdMiddleware` gives every response its ``X-Request-Id``; the
other names (:func:`problem`, :func:`problem_for`, :func:`parse_json`,
:func:`to_starlette`, :func:`from_starlette`, :func:`send_response`,
:func:`pooled_transaction`, :func:`route_template`) are the pieces the two
modes are built from, for an application's own endpoints.
The two modes, the body rules, authentication first and the pieces:
docs/http.md.
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any, TypeAlias

from .. import AsyncAttempt, AsyncIdempotency
from .._errors import (
    ConfigurationError,
    IdempotencyError,
    ResponseNotStorable,
)
from .._extras import optional
from .._model import Response, Verdict
from ..edge import (
    OUTCOME_SLOT,
    REQUEST_ID_HEADER,
    SAFE_METHODS,
    AsyncEdge,
    EdgeOptions,
    HTTPRequest,
    OutcomeSlot,
    async_resolve,
    body_cut_short,
    body_too_large,
    declared_length,
    header_values,
    not_stored,
    parse_json,
    plain_callable,
    problem,
    problem_for,
    report_outcome_unknown,
    request_id_from,
    sendable_headers,
    settled_verdict,
)
from ..edge import async_pooled_transaction as pooled_transaction
from ..stores.protocol import AsyncTransaction

with optional("idemflow.integrations.starlette"):
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import FileResponse, StreamingResponse
    from starlette.responses import Response as StarletteResponse
    from starlette.routing import BaseRoute, Host, Match, Mount, compile_path
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "EdgeOptions",
    "IdempotencyMiddleware",
    "Idempotent",
    "RequestIdMiddleware",
    "ResponseNotStorable",
    "authenticated_user",
    "from_starlette",
    "parse_json",
    "pooled_transaction",
    "problem",
    "problem_for",
    "read_body",
    "report_outcome_unknown",
    "request_id",
    "route_template",
    "send_response",
    "to_starlette",
]

#: Returns the authenticated principal of a request's scope, or None.
PrincipalGetter: TypeAlias = Callable[[Scope], str | None]
#: A transactional handler: business writes on ``attempt.connection``.
StarletteHandler: TypeAlias = Callable[[AsyncAttempt], Awaitable[Response | StarletteResponse]]

# Mounts nest this deep at most when the route template is looked up: a
# bound on a walk that follows the application's own route tree.
_MAX_MOUNT_DEPTH = 32


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


_PRINCIPAL = "principal= (called without awaiting, before the claim)"


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
        self.edge = AsyncEdge(idempotency, options)
        self._connect = connect
        self._transaction = transaction
        self._principal = plain_callable(principal, _PRINCIPAL, "(scope) -> str | None")
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
        FastAPI dependency passes what its auth dependency returned). The
        body is read with :meth:`body` (bounded, whole, or refused).
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
                await self.body(request),
                who,
                rid,
                _path_params(request.scope),
                _query(request.scope),
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

    async def body(self, request: Request) -> bytes:
        """The request body, whole and at most ``options.max_body_bytes``: see :func:`read_body`.

        Validate from it before calling :meth:`run`; ``run`` reads the same bytes.
        """
        return await read_body(request, self.edge.options.max_body_bytes)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole request body, or an error before more than ``limit`` bytes are held.

    Raises:
        BodyTooLarge: ``Content-Length`` is over ``limit`` (nothing is read),
            or the bytes received so far are (413, while the client still sends).
        IncompleteBody: the client went away before the body ended, or sent
            fewer bytes than its ``Content-Length``. Nothing may be
            fingerprinted, claimed or run on part of a request.

    The body is kept on the request, as ``Request.body()`` keeps it, so
    ``await request.body()`` or ``request.json()`` afterwards return it.
    """
    cached = getattr(request, "_body", None)
    if isinstance(cached, bytes):  # read before, by us or by the endpoint
        if len(cached) > limit:
            raise body_too_large(len(cached), limit)
        return cached
    declared = declared_length(request.headers.get("content-length"), limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with aclosing(request.stream()) as stream:
            async for chunk in stream:
                size += len(chunk)
                if size > limit:
                    raise body_too_large(size, limit, streaming=True)
                chunks.append(chunk)
    except ClientDisconnect:
        raise body_cut_short(size, declared) from None
    if declared is not None and size != declared:
        raise body_cut_short(size, declared)
    body = b"".join(chunks)
    # Starlette's own cache: request.body() returns it instead of reading again.
    request._body = body
    return body


def _first(values: list[str]) -> str | None:
    return values[0] if values else None


def route_template(scope: Scope) -> str:
    """The full template of the route that matched: mount prefixes, then the route's own.

    ``Mount("/eu", routes=[Route("/payments", …)])`` gives ``/eu/payments``;
    ``Mount("/{region}", …)`` gives ``/{region}/payments`` (the value is a
    path parameter, so label values stay bounded while the fingerprint, which
    covers the parameters, tells regions apart). Without a matched route, the
    raw path.
    """
    route = scope.get("route")
    # FastAPI (0.120+) serves a route included under a prefix through an
    # "effective" copy holding the full path; scope["route"] is the original.
    effective = scope.get("fastapi", {}).get("effective_route_context")
    if effective is not None and getattr(effective, "original_route", None) is route:
        route = effective
    template = getattr(route, "path", None)
    if not isinstance(template, str) or isinstance(route, Mount | Host):
        return str(scope["path"])
    return mount_prefix(scope) + template


def mount_prefix(scope: Scope) -> str:
    """The templates of the mounts this request went through (``""`` if none).

    Each ``Mount`` appends the path it matched to ``scope["root_path"]``;
    ``app_root_path`` is the root path before the first mount (a proxy's
    prefix, the same for every request: not part of the route). The matched
    text holds values (``/acme``), so the templates are found by walking the
    application's routes from ``scope["router"]`` the way starlette matched
    them. If that walk cannot account for the prefix (an app mounted by
    something other than starlette), the matched text is used as it is.
    """
    root_path = str(scope.get("root_path", ""))
    app_root = str(scope.get("app_root_path", root_path))
    if not root_path.startswith(app_root) or root_path == app_root:
        return ""
    templates = _mount_templates(scope, app_root, root_path)
    return root_path[len(app_root) :] if templates is None else templates


def _mount_templates(scope: Scope, start: str, target: str) -> str | None:
    routes: Sequence[BaseRoute] | None = getattr(scope.get("router"), "routes", None)
    probe: Scope = {
        "type": "http",
        "path": scope["path"],
        "root_path": start,
        "method": scope.get("method", "POST"),
        "headers": scope.get("headers", []),
        "path_params": {},
    }
    prefix = ""
    for _ in range(_MAX_MOUNT_DEPTH):
        if probe["root_path"] == target:
            return prefix
        mount = _first_full_match(routes or (), probe)
        if mount is None:
            return None
        route, child = mount
        if isinstance(route, Mount):
            prefix += route.path
        probe = {**probe, **child}
        routes = route.routes
    return None


def _first_full_match(
    routes: Iterable[BaseRoute], probe: Scope
) -> tuple[Mount | Host, Scope] | None:
    """The mount (or host) starlette dispatched ``probe`` to; None if it went to a route."""
    for route in routes:
        match, child = route.matches(probe)
        if match is Match.FULL:
            return (route, child) if isinstance(route, Mount | Host) else None
    return None


def _path_params(scope: Scope) -> dict[str, str]:
    return {str(k): str(v) for k, v in scope.get("path_params", {}).items()}


def _query(scope: Scope) -> str:
    raw = scope.get("query_string", b"")
    return raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)


def _storable_handler(handler: StarletteHandler) -> Callable[[AsyncAttempt], Awaitable[Response]]:
    async def operation(attempt: AsyncAttempt) -> Response:
        # A plain function ran when it was called: its answer is taken as it is.
        result: Response | StarletteResponse = await async_resolve(handler(attempt))
        if isinstance(result, Response):
            return result
        if isinstance(result, StarletteResponse):
            return from_starlette(result)
        msg = (
            f"the handler returned a {type(result).__name__}; return an idemflow.Response "
            "(e.g. Response.json(201, {...})) or a starlette Response with its body in memory"
        )
        raise TypeError(msg)

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
    """An idemflow Response as a starlette one, header lines kept as they are (repeats too).

    Starlette writes ``Content-Length`` for the body; a handler's own is dropped.
    """
    result = StarletteResponse(content=response.body, status_code=response.status)
    result.raw_headers.extend(sendable_headers(response))
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
    endpoint again; an ``OutcomeUnknown`` keeps it for the sweeper (a 503).
    Starlette and FastAPI raise it on after their ``ServerErrorMiddleware``
    has sent its 500, so it arrives here wherever the middleware is placed.
    An app that answers it itself (Django's ``ASGIHandler`` turns every
    exception into a 500) needs nothing either: an ``OutcomeUnknown`` made
    while the app ran, followed by a failure (that 500, any transient status,
    an exception), keeps the claim. It may also report it through the slot
    left in ``scope["idemflow.outcome_unknown"]`` (Django's app
    ``idemflow.integrations.django`` in ``INSTALLED_APPS`` does; any other
    framework's error handler calls :func:`report_outcome_unknown`); what is
    reported keeps the claim whatever response the app sent.

    The app always runs to its end: its response is buffered (at most
    ``max_response_bytes``, never an error raised into the app mid-stream).
    A body sent in several messages is stored whole if it fits. One that
    cannot be stored or sent whole (over the limit, a header that cannot be
    sent, an ``http.response.pathsend``) is never released, since its effect
    has happened: the key is settled with a ``response-not-stored`` marker
    (see :func:`idemflow._http.not_stored`), which the caller gets and every
    retry replays. An opted-in route whose endpoint is declared to stream
    (a ``StreamingResponse``/``FileResponse`` response class or return
    annotation, a generator endpoint) is refused at start-up (the ASGI
    lifespan startup fails), and its requests answered 500 unrun.

    The ``endpoints`` are templates relative to where the middleware sits:
    inside ``Mount("/eu", …, middleware=[…])``, ``"POST /payments"`` matches
    ``/eu/payments`` and its records name ``POST /eu/payments``.

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
        self.edge = AsyncEdge(idempotency, options)
        self._principal = plain_callable(principal, _PRINCIPAL, "(scope) -> str | None")
        self._routes = [_compile_endpoint(endpoint) for endpoint in endpoints]
        if not self._routes:
            raise ConfigurationError("IdempotencyMiddleware needs at least one endpoint to protect")
        self._refusal: str | None = None
        self._checked = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        route = self._match(scope) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        try:
            refusal = self._check_routes()
            if refusal is not None:
                raise ConfigurationError(refusal)
            who = self._principal(scope)
            body = await _read_body(receive, scope, self.edge.options.max_body_bytes)
        except IdempotencyError as exc:
            # After a disconnect this answer goes nowhere (the server drops
            # it); it is sent all the same, so there is one path, no traceback.
            await send_response(send, problem_for(exc, rid))
            return
        template, params = route
        request = HTTPRequest(
            scope["method"], template, scope["headers"], body, who, rid, params, _query(scope)
        )
        response = await self.edge.respond(request, self._endpoint(scope, body, receive))
        await send_response(send, response)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Fail the ASGI startup if an opted-in route is declared to stream."""
        message = await receive()
        if message["type"] == "lifespan.startup":
            refusal = self._check_routes(again=True)
            if refusal is not None:
                await send({"type": "lifespan.startup.failed", "message": refusal})
                return
        pending = [message]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    def _check_routes(self, *, again: bool = False) -> str | None:
        """Why this middleware must not run (a protected route that streams), or None."""
        if again or not self._checked:
            self._refusal = _streaming_refusal(self.app, self._routes)
            self._checked = True
        return self._refusal

    def _match(self, scope: Scope) -> tuple[str, dict[str, str]] | None:
        """The opted-in route this request matches: its full template, and its path parameters.

        The path is matched below the mount the middleware sits in (the
        ``root_path``), and the mount's template and parameters are added.
        """
        method = scope["method"].upper()
        if method in SAFE_METHODS:
            return None
        path = _route_path(scope)
        for route_method, pattern, template in self._routes:
            match = pattern.match(path) if route_method == method else None
            if match is not None:
                params = {**_path_params(scope), **match.groupdict()}
                return mount_prefix(scope) + template, params
        return None

    def _endpoint(
        self, scope: Scope, body: bytes, receive: Receive
    ) -> Callable[[AsyncAttempt], Awaitable[Response]]:
        # The app has run when it is asked: a classifier that fails settles, never releases.
        classify = functools.partial(settled_verdict, self.edge.idempotency.policy.verdict)

        async def operation(attempt: AsyncAttempt) -> Response:
            buffer = _ResponseBuffer(self.edge.options.max_response_bytes)
            # Where an app that answers its own exceptions reports an OutcomeUnknown;
            # one made while it ran and then failed is raised too, reported or not.
            slot = scope[OUTCOME_SLOT] = OutcomeSlot()
            try:
                with slot.watching():
                    await self.app(scope, _replaying(body, receive), buffer.send)
            except Exception:
                slot.raise_made()
                raise
            finally:
                slot.raise_reported()
            response = buffer.response(classify)
            if classify(response) is Verdict.TRANSIENT:
                slot.raise_made()  # Django's ASGI handler's own 500 for it, say
            return response

        return operation


def _compile_endpoint(endpoint: str) -> tuple[str, re.Pattern[str], str]:
    method, _, template = endpoint.strip().partition(" ")
    if not method.isalpha() or not template.startswith("/"):
        msg = f"endpoint {endpoint!r} must be 'METHOD /route/{{param}}'"
        raise ConfigurationError(msg)
    if method.upper() in SAFE_METHODS:  # it would never be protected: say so at start-up
        msg = (
            f"endpoint {endpoint!r}: {method.upper()} is idempotent already and is never "
            "protected; list unsafe methods only"
        )
        raise ConfigurationError(msg)
    pattern, _, _ = compile_path(template.strip())
    return method.upper(), pattern, template.strip()


def _route_path(scope: Scope) -> str:
    """The path below ``root_path`` (the mount, or a proxy's prefix), as starlette routes it."""
    path = str(scope.get("path", ""))
    root_path = str(scope.get("root_path", ""))
    if root_path and path.startswith(root_path) and path[len(root_path) :][:1] in ("/", ""):
        return path[len(root_path) :]
    return path


async def _read_body(receive: Receive, scope: Scope, limit: int) -> bytes:
    """The whole request body, as :func:`read_body` reads it, from ASGI messages."""
    declared = declared_length(
        _first(header_values(scope.get("headers", ()), "content-length")), limit
    )
    chunks: list[bytes] = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise body_cut_short(size, declared)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_too_large(size, limit, streaming=True)
        chunks.append(chunk)
        more = bool(message.get("more_body", False))
    if declared is not None and size != declared:
        raise body_cut_short(size, declared)
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
    """A ``send`` that keeps the app's response in memory instead of sending it.

    It never raises into the app: the app's effect is happening, and an error
    mid-stream would only hide how it ended. It keeps at most ``limit`` body
    bytes and counts the rest; :meth:`response` decides what can be stored.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._start: Message | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._ended = False
        self._other: str | None = None

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
        elif kind == "http.response.body":
            chunk = bytes(message.get("body", b""))
            self._size += len(chunk)
            if self._size <= self._limit:
                self._chunks.append(chunk)
            self._ended = not message.get("more_body", False)
        elif self._other is None:  # http.response.pathsend, zerocopysend, trailers
            self._other = kind

    def response(self, classify: Callable[[Response], Any]) -> Response:
        """The app's response; a :func:`~idemflow._http.not_stored` marker if not whole.

        Never raises: the app has run, and what it did stays (no transaction).
        """
        if self._start is None:
            why = "the endpoint returned without sending a response"
            return not_stored(None, why, Verdict.FAILED_PERMANENT)
        headers = tuple(
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in self._start.get("headers", ())
            if k.lower() != b"content-length"
        )
        response = Response(int(self._start["status"]), b"".join(self._chunks), headers)
        reason = self._unstorable()
        return response if reason is None else not_stored(response, reason, classify(response))

    def _unstorable(self) -> str | None:
        if self._other is not None:
            return f"the endpoint sent its body as {self._other}, which cannot be buffered"
        if self._size > self._limit:
            return (
                f"the response body is {self._size} bytes; the stored-body limit is "
                f"{self._limit} bytes (raise max_response_bytes, or do not protect this endpoint)"
            )
        if not self._ended:
            return "the endpoint returned before its response body ended"
        return None


# --- what a route declares ------------------------------------------------------------------

_STREAMING = (StreamingResponse, FileResponse)


def _streaming_refusal(
    app: ASGIApp, endpoints: Sequence[tuple[str, re.Pattern[str], str]]
) -> str | None:
    """Why an opted-in endpoint cannot be protected: its route declares a streamed body."""
    routes = _routes_below(app)
    if routes is None:
        return None
    wanted = {(method, _normalised(template)) for method, _, template in endpoints}
    for template, route in _leaf_routes(routes, "", 0):
        why = _declares_streaming(route)
        if why is None:
            continue
        methods = getattr(route, "methods", None) or {m for m, _ in wanted}
        for method in methods:
            if (str(method).upper(), _normalised(template)) in wanted:
                return (
                    f"{method} {template} is protected by IdempotencyMiddleware but {why}: a "
                    "streamed body cannot be stored for replay, and a retry would run the "
                    "endpoint again; return a body in memory, or do not protect it"
                )
    return None


def _routes_below(app: ASGIApp) -> Sequence[BaseRoute] | None:
    """The routes of the router under this middleware (through other middleware's ``.app``)."""
    current: Any = app
    for _ in range(_MAX_MOUNT_DEPTH):
        routes = getattr(current, "routes", None)
        if isinstance(routes, list):
            return routes
        current = getattr(current, "app", None)
        if current is None:
            return None
    return None


def _leaf_routes(
    routes: Iterable[BaseRoute], prefix: str, depth: int
) -> Iterator[tuple[str, BaseRoute]]:
    for route in routes:
        if isinstance(route, Mount | Host):
            if depth < _MAX_MOUNT_DEPTH:
                inner = prefix + route.path if isinstance(route, Mount) else prefix
                yield from _leaf_routes(route.routes, inner, depth + 1)
            continue
        path = getattr(route, "path", None)
        if isinstance(path, str):
            yield prefix + path, route


def _normalised(template: str) -> str:
    """``/orders/{id:int}`` and ``/orders/{id}`` are one template."""
    return re.sub(r"\{(\w+)(?::\w+)?\}", r"{\1}", template.strip())


def _declares_streaming(route: BaseRoute) -> str | None:
    """How ``route`` says it streams its response (FastAPI or starlette), or None."""
    if getattr(route, "is_sse_stream", False) or getattr(route, "is_json_stream", False):
        return "its endpoint is a generator FastAPI streams"
    response_class: Any = getattr(route, "response_class", None)
    response_class = getattr(response_class, "value", response_class)  # FastAPI's default
    if _is_streaming_class(response_class):
        return f"its response_class is {response_class.__name__}"
    endpoint = getattr(route, "endpoint", None)
    if endpoint is None or inspect.isclass(endpoint):
        return None
    return _endpoint_streams(endpoint)


def _endpoint_streams(endpoint: Callable[..., Any]) -> str | None:
    if inspect.isasyncgenfunction(endpoint) or inspect.isgeneratorfunction(endpoint):
        return "its endpoint is a generator"
    try:
        annotation = inspect.signature(endpoint, eval_str=True).return_annotation
    except (NameError, TypeError, ValueError, SyntaxError):
        return None  # an annotation we cannot resolve declares nothing we can read
    for candidate in (annotation, *typing.get_args(annotation)):
        if _is_streaming_class(candidate):
            return f"its endpoint is annotated to return {candidate.__name__}"
    return None


def _is_streaming_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, _STREAMING)


async def send_response(send: Send, response: Response) -> None:
    """Send an idemflow Response as ASGI messages (with its ``Content-Length``)."""
    headers = sendable_headers(response)
    if response.status >= 200 and response.status not in (204, 304):
        headers.append((b"content-length", str(len(response.body)).encode("latin-1")))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
