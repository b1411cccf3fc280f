"""idemflow for Starlette (and so FastAPI): `Idempotent` (transactional mode) and
`IdempotencyMiddleware` (middleware mode, knowing Starlette's routes). See docs/http.md."""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, aclosing
from typing import Any, TypeAlias

from .. import AsyncAttempt, AsyncIdempotency
from .._errors import ConfigurationError, IdempotencyError, ResponseNotStorable
from .._extras import optional
from .._model import Response
from ..edge import (
    SAFE_METHODS,
    AsyncEdge,
    BodyReader,
    EdgeOptions,
    Endpoint,
    HTTPRequest,
    async_pooled_transaction,
    async_resolve,
    body_too_large,
    parse_json,
    plain_callable,
    problem,
    problem_for,
    report_outcome_unknown,
    sendable_headers,
)
from ..stores.protocol import AsyncTransaction
from . import asgi
from .asgi import (
    PRINCIPAL_HOOK,
    PrincipalGetter,
    RequestIdMiddleware,
    authenticated_user,
    path_params,
    query_of,
    request_id,
    send_response,
)

with optional("idemflow.integrations.starlette"):
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import FileResponse, StreamingResponse
    from starlette.responses import Response as StarletteResponse
    from starlette.routing import BaseRoute, Host, Match, Mount
    from starlette.types import Scope

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

#: The async transaction scope, under the name applications import from here.
pooled_transaction = async_pooled_transaction

#: A transactional handler: business writes on ``attempt.connection``.
StarletteHandler: TypeAlias = Callable[[AsyncAttempt], Awaitable[Response | StarletteResponse]]

# A bound on walks that follow the application's own route tree.
_MAX_MOUNT_DEPTH = 32


class IdempotencyMiddleware(asgi.IdempotencyMiddleware):
    """The ASGI middleware (`idemflow.integrations.asgi.IdempotencyMiddleware`) knowing
    Starlette's routes.

    Records name the full template through mounts (``Mount("/{region}")`` gives
    ``/{region}/payments``); an opted-in route declared to stream (response class,
    return annotation, generator endpoint) fails the lifespan startup, its requests
    answered 500 unrun. Place it after authentication.
    """

    def refusal(self, endpoints: list[Endpoint]) -> str | None:
        return _streaming_refusal(self.app, endpoints)

    def mount_prefix(self, scope: Scope) -> str:
        return mount_prefix(scope)


class Idempotent:
    """Transactional mode: the endpoint's own transaction carries the completion.

    Args:
        idempotency: the driver (store, policy, observer).
        connect: returns an async context manager yielding a connection to the key
            table's database (e.g. ``pool.connection``), called only when the handler
            is about to run: replays and 409 answers take no connection.
        transaction: wraps that connection in a transaction adapter, e.g.
            `idemflow.transactions.AsyncPsycopgTransaction`.
        principal: reads the authenticated principal from the scope.
        options: public endpoints, replay authorization, size limits.
        single_commit: claim inside the endpoint's transaction too (PostgreSQL): no
            commit of its own; a duplicate waits at most the store's claim lock
            timeout for it, and every request, replays included, takes a connection.
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
        self._principal = plain_callable(principal, PRINCIPAL_HOOK, "(scope) -> str | None")
        self._single_commit = single_commit

    async def run(
        self,
        request: Request,
        handler: StarletteHandler,
        *,
        principal: str | None = None,
    ) -> StarletteResponse:
        """Run ``handler`` once per ``(principal, Idempotency-Key)``; replay or refuse otherwise.

        Call it after validating the request (failures before it are never recorded).
        ``principal`` overrides the ``principal`` hook.
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
                path_params(request.scope),
                query_of(request.scope),
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
        """The request body (`read_body`, at most ``options.max_body_bytes``); `run` reuses it."""
        return await read_body(request, self.edge.options.max_body_bytes)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole request body, kept on the request as ``Request.body()`` keeps it:
    `BodyTooLarge` over ``limit``, `IncompleteBody` if the client went away or sent less."""
    cached = getattr(request, "_body", None)
    if isinstance(cached, bytes):
        if len(cached) > limit:
            raise body_too_large(len(cached), limit)
        return cached
    reader = BodyReader(request.headers.get("content-length"), limit)
    try:
        async with aclosing(request.stream()) as stream:
            async for chunk in stream:
                reader.add(chunk)
    except ClientDisconnect:
        raise reader.cut_short() from None
    body = reader.body()
    request._body = body
    return body


def route_template(scope: Scope) -> str:
    """The full template of the route that matched (``Mount("/{region}")`` and
    ``Route("/payments")``: ``/{region}/payments``); without one, the raw path."""
    route = effective_route(scope.get("route"), scope)
    template = getattr(route, "path", None)
    if not isinstance(template, str) or isinstance(route, Mount | Host):
        return str(scope["path"])
    return mount_prefix(scope) + template


def effective_route(route: Any, scope: Scope) -> Any:
    """``route`` as this request sees it: FastAPI (0.120+) serves a route included in a
    router through an "effective" copy (the full path, the router's defaults)."""
    effective = scope.get("fastapi", {}).get("effective_route_context")
    if effective is not None and getattr(effective, "original_route", None) is route:
        return effective
    return route


def mount_prefix(scope: Scope) -> str:
    """The templates of the mounts this request went through (``""`` if none): ``root_path``
    holds the text they matched (after ``app_root_path``, a proxy's prefix), so the app's
    routes are matched again; an app mounted by something else keeps the matched text."""
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


def _storable_handler(handler: StarletteHandler) -> Callable[[AsyncAttempt], Awaitable[Response]]:
    async def operation(attempt: AsyncAttempt) -> Response:
        result: Response | StarletteResponse = await async_resolve(handler(attempt))
        if isinstance(result, Response):
            return result
        if isinstance(result, StarletteResponse):
            return from_starlette(result)
        raise not_a_response(result)

    return operation


def not_a_response(result: object) -> TypeError:
    msg = (
        f"the handler returned a {type(result).__name__}; return an idemflow.Response "
        "(e.g. Response.json(201, {...})) or a starlette Response with its body in memory"
    )
    return TypeError(msg)


def from_starlette(response: StarletteResponse) -> Response:
    """A starlette response with its body in memory as an idemflow Response; a streaming
    or file response is refused (`ResponseNotStorable`), never stored empty."""
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
    """An idemflow Response as a starlette one, header lines kept (Content-Length: Starlette's)."""
    result = StarletteResponse(content=response.body, status_code=response.status)
    result.raw_headers.extend(sendable_headers(response))
    return result


_STREAMING = (StreamingResponse, FileResponse)


def _streaming_refusal(app: Any, endpoints: Sequence[Endpoint]) -> str | None:
    """Why an opted-in endpoint cannot be protected: its route declares a streamed body."""
    routes = _routes_below(app)
    if routes is None:
        return None
    wanted = {(e.method, _normalised(e.template)) for e in endpoints}
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


def _routes_below(app: Any) -> Sequence[BaseRoute] | None:
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
