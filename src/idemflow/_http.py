"""
The framework-neutral HTTP edge: request → :class:`Intent`, outcome or error → response.

Every integration (``idemflow.integrations.starlette``, ``…fastapi``) only
translates its framework's request into an :class:`HTTPRequest` and the
:class:`~idemflow.Response` returned here into its framework's response. What
to do with a key is decided in ``idemflow._flow``; what it looks like on the
wire is decided here, once, so the integrations cannot disagree:

- the ``Idempotency-Key`` is read by :func:`idemflow.parse_key`;
- the fingerprint covers the method, the route *template* (``/payments/{id}``)
  with its path parameters (``id=pay_1``), and the body: the same key sent to
  ``/payments/1/refunds`` and then ``/payments/2/refunds`` is a different
  request (422), not a replay of the first refund. The endpoint named in
  records and metrics is the bare template, so label values stay bounded;
- every error is an RFC 9457 ``application/problem+json`` body with ``type``,
  ``title``, ``status`` and ``detail``, and ``Retry-After`` on 409 and 503;
- a replay carries the stored status, body and allow-listed headers, plus
  ``Idempotent-Replayed: true`` and the original request's correlation id;
- every response carries the request's own ``X-Request-Id``.
"""

from __future__ import annotations

import inspect
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeAlias
from urllib.parse import urlencode

from ._async.driver import AsyncAttempt, AsyncIdempotency
from ._errors import (
    PROBLEM_BASE,
    ConfigurationError,
    IdempotencyError,
    InProgress,
    MissingPrincipal,
    ReplayForbidden,
    ResponseNotStorable,
    StoreUnavailable,
)
from ._fingerprint import DEFAULT_MAX_BODY_BYTES, fingerprint
from ._key import parse_key
from ._model import Intent, Outcome, Record, Response, Verdict
from .stores.protocol import AsyncTransaction

__all__ = [
    "DEFAULT_MAX_RESPONSE_BYTES",
    "KEY_HEADER",
    "ORIGINAL_REQUEST_ID_HEADER",
    "PROBLEM_CONTENT_TYPE",
    "REPLAYED_HEADER",
    "REPLAYED_HEADERS",
    "REQUEST_ID_HEADER",
    "SAFE_METHODS",
    "Edge",
    "EdgeOptions",
    "HTTPRequest",
    "PooledTransaction",
    "ResponseNotStorable",
    "pooled_transaction",
    "problem",
    "problem_for",
    "request_id_from",
]

logger = logging.getLogger("idemflow.http")

KEY_HEADER = "idempotency-key"
REQUEST_ID_HEADER = "x-request-id"
REPLAYED_HEADER = "idempotent-replayed"
#: Names the request whose execution produced a replayed response: one support
#: question ("why was I charged?") resolves with one log query.
ORIGINAL_REQUEST_ID_HEADER = "idempotency-original-request-id"
PROBLEM_CONTENT_TYPE = "application/problem+json"

#: Methods that are idempotent already: the header is ignored on them.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

#: The headers a client needs to interpret a replayed response. Everything
#: else is dropped before storing: ``Set-Cookie`` would hand a session to
#: whoever replays, ``Date`` and rate-limit headers describe the first
#: request's moment, not this one.
REPLAYED_HEADERS = frozenset(
    {
        "cache-control",
        "content-disposition",
        "content-encoding",
        "content-language",
        "content-location",
        "content-type",
        "etag",
        "expires",
        "last-modified",
        "link",
        "location",
        "vary",
    }
)

#: The largest response body stored for replay (1 MiB); configurable per integration.
DEFAULT_MAX_RESPONSE_BYTES = 1_048_576

# A client-sent X-Request-Id is echoed only if it is short, printable ASCII:
# it goes into logs and a database column.
_MAX_REQUEST_ID_LENGTH = 128

RawHeaders: TypeAlias = Sequence[tuple[bytes, bytes]]
#: Returns whether the principal may still see a stored response (sync or async).
ReplayAuthorizer: TypeAlias = Callable[[Record], bool | Awaitable[bool]]
OperationHandler: TypeAlias = Callable[[AsyncAttempt], Awaitable[Response]]
#: Opens the caller's transaction for one run, e.g. ``lambda: pooled_transaction(…)``.
TransactionScope: TypeAlias = Callable[[], AbstractAsyncContextManager[AsyncTransaction]]


@dataclass(frozen=True, slots=True)
class HTTPRequest:
    """What the edge needs of a request, whatever the framework.

    ``route`` is the route template the request matched (``/payments/{id}``)
    and ``path_params`` its values; ``principal`` comes from the authentication
    that ran before (None if none).
    """

    method: str
    route: str
    headers: RawHeaders
    body: bytes
    principal: str | None
    request_id: str
    path_params: Mapping[str, str] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"{self.method.upper()} {self.route}"

    @property
    def fingerprinted_route(self) -> str:
        """The template plus its parameter values: ``/payments/{id}?id=pay_1``."""
        if not self.path_params:
            return self.route
        return f"{self.route}?{urlencode(sorted(self.path_params.items()))}"

    def header(self, name: str) -> str | None:
        values = header_values(self.headers, name)
        return values[0] if values else None


@dataclass(frozen=True, slots=True)
class EdgeOptions:
    """How an integration treats the requests it protects.

    Args:
        public: the endpoint is deliberately unauthenticated; keys are then
            scoped to ``anonymous_principal`` (all anonymous callers share one
            key space). Otherwise a request without a principal is refused (401).
        authorize_replay: asked again before a stored response is replayed; False
            answers 403. The principal already scopes the key; this re-checks
            object-level permission that may have changed since.
        max_response_bytes: the largest body stored for replay; a larger one is
            refused with :class:`ResponseNotStorable` (500), never stored truncated.
        max_body_bytes: the largest request body fingerprinted (400 above it).
        exclude_fields: JSON members left out of the fingerprint (per-attempt fields).
        strict_key: accept only the quoted sf-string form of the key.
    """

    public: bool = False
    anonymous_principal: str = "anonymous"
    authorize_replay: ReplayAuthorizer | None = None
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    exclude_fields: Collection[str] = field(default=())
    strict_key: bool = False

    def __post_init__(self) -> None:
        if self.max_response_bytes < 0:
            raise ConfigurationError("max_response_bytes must not be negative")


class Edge:
    """Runs one protected request: intent, claim via the driver, response.

    Args:
        idempotency: the driver; its policy decides what is stored.
        options: see :class:`EdgeOptions`.
    """

    def __init__(self, idempotency: AsyncIdempotency, options: EdgeOptions | None = None) -> None:
        self.idempotency = idempotency
        self.options = options or EdgeOptions()

    def intent(self, request: HTTPRequest) -> Intent:
        """The request's identity; raises the 400/401 client errors, claims nothing."""
        principal = request.principal
        if not principal:
            if not self.options.public:
                msg = "authenticate first: idempotency keys are scoped to the caller"
                raise MissingPrincipal(msg)
            principal = self.options.anonymous_principal
        key = parse_key(header_values(request.headers, KEY_HEADER), strict=self.options.strict_key)
        digest = fingerprint(
            request.method,
            request.fingerprinted_route,
            request.body,
            content_type=request.header("content-type"),
            exclude_fields=self.options.exclude_fields,
            max_body_bytes=self.options.max_body_bytes,
        )
        return Intent(
            principal, key, digest, endpoint=request.endpoint, correlation_id=request.request_id
        )

    async def respond(
        self,
        request: HTTPRequest,
        handler: OperationHandler,
        *,
        transaction: TransactionScope | None = None,
        single_commit: bool = False,
    ) -> Response:
        """Answer ``request``: run ``handler`` once per key, or replay, or a problem.

        ``transaction`` opens the caller's transaction for this one run (see
        :func:`pooled_transaction`); it is closed before the replay
        authorization hook runs, so the hook may use a connection of its own.
        The first execution answers with the handler's full response; what is
        stored (and replayed) keeps only the :data:`REPLAYED_HEADERS`.
        Errors of idemflow become problem responses; the handler's own
        exceptions propagate (after the claim was released).
        """
        try:
            intent = self.intent(request)
            sent: list[Response] = []
            async with _scope(transaction) as opened:
                outcome = await self.idempotency.run(
                    intent,
                    self._storing(handler, sent),
                    transaction=opened,
                    single_commit=single_commit,
                )
            if outcome.replayed:
                await self._authorize(outcome.record)
                return with_request_id(replayed(outcome), request.request_id)
            return with_request_id(sent[0], request.request_id)
        except IdempotencyError as exc:
            return problem_for(exc, request.request_id)

    def _storing(self, handler: OperationHandler, sent: list[Response]) -> OperationHandler:
        """Wrap ``handler``: keep its full response to send, return the storable one."""
        limit = self.options.max_response_bytes
        classify = self.idempotency.policy.classify

        async def operation(attempt: AsyncAttempt) -> Response:
            response = await handler(attempt)
            sent.append(response)
            if classify(response) is Verdict.TRANSIENT:
                return response  # released, never stored: no size limit to enforce
            return storable(response, max_bytes=limit)

        return operation

    async def _authorize(self, record: Record) -> None:
        hook = self.options.authorize_replay
        if hook is None:
            return
        allowed = hook(record)
        if inspect.isawaitable(allowed):
            allowed = await allowed
        if not allowed:
            raise ReplayForbidden("this principal may no longer see the stored response")


@asynccontextmanager
async def _scope(transaction: TransactionScope | None) -> AsyncIterator[AsyncTransaction | None]:
    if transaction is None:
        yield None
        return
    async with transaction() as opened:
        yield opened


def header_values(headers: RawHeaders, name: str) -> list[str]:
    """Every field line called ``name`` (lower-case), decoded as latin-1 (RFC 9110)."""
    wanted = name.encode("latin-1")
    return [v.decode("latin-1") for k, v in headers if k.lower() == wanted]


def request_id_from(headers: RawHeaders) -> str:
    """The client's ``X-Request-Id`` if it is sane, else a new one."""
    values = header_values(headers, REQUEST_ID_HEADER)
    if len(values) == 1:
        value = values[0].strip()
        if 0 < len(value) <= _MAX_REQUEST_ID_LENGTH and all("!" <= c <= "~" for c in value):
            return value
    return uuid.uuid4().hex


def storable(response: Response, *, max_bytes: int) -> Response:
    """``response`` as it is stored: allow-listed headers only, body within the limit."""
    if len(response.body) > max_bytes:
        msg = (
            f"the response body is {len(response.body)} bytes; the stored-body limit is "
            f"{max_bytes} bytes (raise max_response_bytes, or do not protect this endpoint)"
        )
        raise ResponseNotStorable(msg)
    headers = tuple((k.lower(), v) for k, v in response.headers if k.lower() in REPLAYED_HEADERS)
    return Response(response.status, response.body, headers)


def replayed(outcome: Outcome) -> Response:
    """The stored response, marked as a replay and linked to the original request."""
    response = outcome.response
    extra = [(REPLAYED_HEADER, "true")]
    if outcome.record.correlation_id:
        extra.append((ORIGINAL_REQUEST_ID_HEADER, outcome.record.correlation_id))
    return Response(response.status, response.body, (*response.headers, *extra))


def with_request_id(response: Response, request_id: str) -> Response:
    """``response`` with ``X-Request-Id`` unless the handler already set one."""
    if response.header(REQUEST_ID_HEADER) is not None:
        return response
    return Response(
        response.status, response.body, (*response.headers, (REQUEST_ID_HEADER, request_id))
    )


def problem(
    status: int,
    title: str,
    detail: str,
    *,
    slug: str,
    retry_after: int | None = None,
    request_id: str | None = None,
    **extensions: Any,
) -> Response:
    """An RFC 9457 problem response (``type`` is ``https://idemflow.dev/problems/<slug>``)."""
    content = {
        "type": PROBLEM_BASE + slug,
        "title": title,
        "status": status,
        "detail": detail,
        **extensions,
    }
    body = json.dumps(content, separators=(",", ":"), ensure_ascii=False).encode()
    headers = [("content-type", PROBLEM_CONTENT_TYPE)]
    if retry_after is not None:
        headers.append(("retry-after", str(retry_after)))
    if request_id is not None:
        headers.append((REQUEST_ID_HEADER, request_id))
    return Response(status, body, tuple(headers))


def problem_for(error: IdempotencyError, request_id: str | None = None) -> Response:
    """The problem response for one of idemflow's errors (409 and 503 with ``Retry-After``)."""
    retry_after = None
    if isinstance(error, InProgress | StoreUnavailable):
        retry_after = error.retry_after
    if not isinstance(error, ResponseNotStorable) and error.status >= 500:
        logger.error("idempotency failure: %s", error)
    return problem(
        error.status,
        error.title,
        error.detail,
        slug=error.slug,
        retry_after=retry_after,
        request_id=request_id,
    )


class PooledTransaction:
    """A transaction adapter that checks its connection out only when it begins.

    Replays and 409 answers never begin a transaction, so they never take a
    connection from the pool: duplicates cost one claim, not one pooled
    connection each. The connection is kept until :meth:`aclose` (the end of
    the request), across ``commit_phase`` boundaries, so ``attempt.connection``
    names the same connection in every phase.

    Args:
        acquire: returns an async context manager yielding a connection, e.g.
            ``psycopg_pool.AsyncConnectionPool.connection``.
        adapter: wraps that connection, e.g.
            :class:`idemflow.transactions.AsyncPsycopgTransaction`.
    """

    def __init__(
        self,
        acquire: Callable[[], AbstractAsyncContextManager[Any]],
        adapter: Callable[[Any], AsyncTransaction],
    ) -> None:
        self._acquire = acquire
        self._adapter = adapter
        self._context: AbstractAsyncContextManager[Any] | None = None
        self._inner: AsyncTransaction | None = None

    @property
    def connection(self) -> Any:
        return None if self._inner is None else self._inner.connection

    async def begin(self) -> None:
        if self._inner is None:
            self._context = self._acquire()
            self._inner = self._adapter(await self._context.__aenter__())
        await self._inner.begin()

    async def execute(self, statement: Any, params: Any) -> int:
        return await self._checked_out().execute(statement, params)

    async def fetchone(self, statement: Any, params: Any) -> Any:
        return await self._checked_out().fetchone(statement, params)

    async def commit(self) -> None:
        await self._checked_out().commit()

    async def rollback(self) -> None:
        await self._checked_out().rollback()

    async def aclose(self) -> None:
        """Give the connection back (if one was taken)."""
        context, self._context, self._inner = self._context, None, None
        if context is not None:
            await context.__aexit__(None, None, None)

    def _checked_out(self) -> AsyncTransaction:
        if self._inner is None:
            raise RuntimeError("the transaction has not begun")
        return self._inner


@asynccontextmanager
async def pooled_transaction(
    acquire: Callable[[], AbstractAsyncContextManager[Any]],
    adapter: Callable[[Any], AsyncTransaction],
) -> AsyncIterator[PooledTransaction]:
    """A :class:`PooledTransaction` that gives its connection back on exit."""
    transaction = PooledTransaction(acquire, adapter)
    try:
        yield transaction
    finally:
        await transaction.aclose()
