"""idemflow as pure ASGI middleware, no framework imported (middleware mode: docs/http.md)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeAlias

from .. import AsyncAttempt, AsyncIdempotency
from .._errors import ConfigurationError, IdempotencyError
from .._model import Response, Verdict
from ..edge import (
    OUTCOME_SLOT,
    REQUEST_ID_HEADER,
    SAFE_METHODS,
    AsyncEdge,
    BodyReader,
    EdgeOptions,
    Endpoint,
    Endpoints,
    HTTPRequest,
    OutcomeSlot,
    ResponseSink,
    compile_endpoint,
    header_values,
    not_stored,
    plain_callable,
    problem_for,
    request_id_from,
    route_table,
    sendable_headers,
    settled_verdict,
)

__all__ = ["IdempotencyMiddleware", "RequestIdMiddleware", "authenticated_user", "request_id"]

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
ASGIApp: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]
#: Returns the authenticated principal of a request's scope, or None.
PrincipalGetter: TypeAlias = Callable[[Scope], str | None]

PRINCIPAL_HOOK = "principal= (called without awaiting, before the claim)"


def authenticated_user(scope: Scope) -> str | None:
    """The identity of ``scope["user"]``; ConfigurationError if no authentication ran at all."""
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
    """This request's correlation id: set by `RequestIdMiddleware`, else made now."""
    state = scope.setdefault("state", {})
    value = state.get("request_id")
    if not isinstance(value, str):
        value = request_id_from(scope.get("headers", ()))
        state["request_id"] = value
    return value


class RequestIdMiddleware:
    """Give every response an ``X-Request-Id`` (the client's if sane, else a new one), also
    ``request.state.request_id`` and the record's correlation id."""

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


class IdempotencyMiddleware:
    """Middleware mode: claim, buffer the response, store it, replay it. Pure ASGI.

    Only the ``endpoints`` listed opt in (``"POST /payments/{id}/refunds"``, relative to
    where the middleware sits), each under the driver's policy or the
    [`Policy`][idemflow.Policy] it maps to. What is released, kept or stored: docs/http.md.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        idempotency: AsyncIdempotency,
        endpoints: Endpoints,
        principal: PrincipalGetter = authenticated_user,
        options: EdgeOptions | None = None,
    ) -> None:
        self.app = app
        self.edge = AsyncEdge(idempotency, options)
        self._principal = plain_callable(principal, PRINCIPAL_HOOK, "(scope) -> str | None")
        table = route_table(endpoints, self.edge.options)
        self._routes = [compile_endpoint(endpoint) for endpoint in table]
        self._edges = [AsyncEdge(idempotency, chosen) for chosen in table.values()]
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
            # After a disconnect this goes nowhere; sent all the same: one path, no traceback.
            await send_response(send, problem_for(exc, rid))
            return
        template, params, edge = route
        request = HTTPRequest(
            scope["method"], template, scope["headers"], body, who, rid, params, query_of(scope)
        )
        response = await edge.respond(request, self._endpoint(scope, body, receive))
        await send_response(send, response)

    def refusal(self, endpoints: list[Endpoint]) -> str | None:
        """Why this middleware must not run on the app below (a framework's override), or None."""
        return None

    def mount_prefix(self, scope: Scope) -> str:
        """The templates of the mounts above the middleware: here, the text they matched."""
        root_path = str(scope.get("root_path", ""))
        app_root = str(scope.get("app_root_path", root_path))
        if not root_path.startswith(app_root) or root_path == app_root:
            return ""
        return root_path[len(app_root) :]

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        if again or not self._checked:
            self._refusal = self.refusal(self._routes)
            self._checked = True
        return self._refusal

    def _match(self, scope: Scope) -> tuple[str, dict[str, str], AsyncEdge] | None:
        """The opted-in route matched below ``root_path``: full template, parameters, edge."""
        method = scope["method"].upper()
        if method in SAFE_METHODS:
            return None
        path = _route_path(scope)
        for route, edge in zip(self._routes, self._edges, strict=True):
            match = route.pattern.fullmatch(path) if route.method == method else None
            if match is not None:
                params = {**path_params(scope), **match.groupdict()}
                return self.mount_prefix(scope) + route.template, params, edge
        return None

    def _endpoint(
        self, scope: Scope, body: bytes, receive: Receive
    ) -> Callable[[AsyncAttempt], Awaitable[Response]]:

        async def operation(attempt: AsyncAttempt) -> Response:
            # The app has run when it is asked: a classifier that fails settles, never releases.
            classify = functools.partial(settled_verdict, attempt.policy.verdict)
            buffer = _ResponseBuffer(self.edge.options.max_response_bytes)
            # An app that answers its own exceptions reports an OutcomeUnknown here.
            slot = scope[OUTCOME_SLOT] = OutcomeSlot()
            with slot.watching():
                await self.app(scope, _replaying(body, receive), buffer.send)
            response = buffer.response(classify)
            if slot.made is not None and classify(response) is Verdict.TRANSIENT:
                slot.raise_made()  # Django's ASGI handler's own 500 for it, say
            return response

        return operation


def path_params(scope: Scope) -> dict[str, str]:
    return {str(k): str(v) for k, v in scope.get("path_params", {}).items()}


def query_of(scope: Scope) -> str:
    raw = scope.get("query_string", b"")
    return raw.decode("latin-1") if isinstance(raw, bytes) else str(raw)


def _route_path(scope: Scope) -> str:
    """The path below ``root_path`` (the mount, or a proxy's prefix), as a router routes it."""
    path = str(scope.get("path", ""))
    root_path = str(scope.get("root_path", ""))
    if root_path and path.startswith(root_path) and path[len(root_path) :][:1] in ("/", ""):
        return path[len(root_path) :]
    return path


async def _read_body(receive: Receive, scope: Scope, limit: int) -> bytes:
    lengths = header_values(scope.get("headers", ()), "content-length")
    reader = BodyReader(lengths[0] if lengths else None, limit)
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise reader.cut_short()
        reader.add(message.get("body", b""))
        more = bool(message.get("more_body", False))
    return reader.body()


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


class _ResponseBuffer(ResponseSink):
    """A ``send`` that keeps the app's response in memory instead of sending it."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self._start: Message | None = None
        self._ended = False
        self._other: str | None = None

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
        elif kind == "http.response.body":
            self.add(bytes(message.get("body", b"")))
            self._ended = not message.get("more_body", False)
        elif self._other is None:  # http.response.pathsend, zerocopysend, trailers
            self._other = kind

    def response(self, classify: Callable[[Response], Any]) -> Response:  # type: ignore[override]
        """The app's response; a ``not_stored`` marker if not whole. Never raises."""
        if self._start is None:
            why = "the endpoint returned without sending a response"
            return not_stored(None, why, Verdict.FAILED_PERMANENT)
        headers = [
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in self._start.get("headers", ())
        ]
        reason = None
        if self._other is not None:
            reason = f"the endpoint sent its body as {self._other}, which cannot be buffered"
        elif self.size <= self.limit and not self._ended:
            reason = "the endpoint returned before its response body ended"
        return super().response(int(self._start["status"]), headers, classify, reason)


async def send_response(send: Send, response: Response) -> None:
    """Send an idemflow Response as ASGI messages (with its ``Content-Length``)."""
    headers = sendable_headers(response)
    if response.status >= 200 and response.status not in (204, 304):
        headers.append((b"content-length", str(len(response.body)).encode("latin-1")))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})
