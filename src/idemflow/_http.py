"""
The framework-neutral HTTP edge: request → :class:`Intent`, outcome or error → response.

Every integration (``idemflow.integrations.starlette``, ``…fastapi``) only
translates its framework's request into an :class:`HTTPRequest` and the
:class:`~idemflow.Response` returned here into its framework's response. What
to do with a key is decided in ``idemflow._flow``; what it looks like on the
wire is decided here, once, so the integrations cannot disagree:

- the ``Idempotency-Key`` is read by :func:`idemflow.parse_key`;
- the fingerprint covers the method, the full route *template* including
  mount prefixes (``/eu/payments/{id}``) with its path parameters
  (``id=pay_1``), the canonical query string, and the body: the same key sent
  to ``/payments/1/refunds`` and then ``/payments/2/refunds`` is a different
  request (422), not a replay of the first refund. The endpoint named in
  records and metrics is the bare template, so label values stay bounded;
- every error is an RFC 9457 ``application/problem+json`` body with ``type``,
  ``title``, ``status`` and ``detail``, and ``Retry-After`` on 409 and 503;
- the whole response is checked before anything is stored: a status or header
  that cannot be sent is never recorded (:func:`unsendable`). Where the effect
  rolls back with the record (a transaction), such a response is the
  handler's bug: :class:`ResponseNotStorable`, 500, key released. Where it
  does not, the key is settled with a ``response-not-stored`` marker
  (:func:`not_stored`) and never released after the endpoint ran;
- a replay carries the stored status, body and allow-listed headers, plus
  ``Idempotent-Replayed: true`` and the original request's correlation id;
- every response carries the request's own ``X-Request-Id``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import logging
import re
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
    "not_stored",
    "pooled_transaction",
    "problem",
    "problem_for",
    "request_id_from",
    "unsendable",
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

#: The problem type of the marker a key is settled with when the endpoint ran
#: but its response could not be stored (see :func:`not_stored`).
NOT_STORED_SLUG = "response-not-stored"

# Framing is the server's business: a handler's own Content-Length (or
# Transfer-Encoding) would contradict the one the server writes.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})

# RFC 9110 §5.1: a field name is a token.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# RFC 9110 §5.5: a field value is visible latin-1 octets, spaces and tabs; CR,
# LF, NUL and other controls would end the header or be refused by the server.
_UNSENDABLE_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]|[^\x00-\xff]")
# How much of a bad header name or value a message may quote.
_EXCERPT_LENGTH = 40

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
    #: The raw query string (``a=1&b=2``): part of the request, so of its fingerprint.
    query: str = ""

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
            never stored truncated: see :class:`Edge` for what happens instead.
        max_body_bytes: the largest request body read (413 above it, refused
            while it streams).
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
        if self.max_body_bytes < 0:
            raise ConfigurationError("max_body_bytes must not be negative")


class Edge:
    """Runs one protected request: intent, claim via the driver, response.

    A response the handler returns is checked whole before anything is
    stored: status and every header sendable (:func:`unsendable`), body
    within ``max_response_bytes``. What happens to one that fails depends on
    whether the effect can still be undone:

    - with a ``transaction`` (transactional mode) it is the handler's bug:
      :class:`ResponseNotStorable` rolls the effect back with the claim, the
      key is released and the client gets a 500 problem;
    - without one (middleware mode, non-transactional use) the effect has
      happened and stays: the key is never released after the endpoint ran.
      It is settled with a :func:`not_stored` marker, a 500
      ``response-not-stored`` problem naming the original status (and
      ``Location``), which the first caller gets too and every retry replays.

    Args:
        idempotency: the driver; its policy decides what is stored.
        options: see :class:`EdgeOptions`.
    """

    def __init__(self, idempotency: AsyncIdempotency, options: EdgeOptions | None = None) -> None:
        self.idempotency = idempotency
        self.options = options or EdgeOptions()
        self._marking: tuple[AsyncIdempotency, Any, AsyncIdempotency] | None = None

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
            query=request.query,
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
        stored (and replayed) keeps only the :data:`REPLAYED_HEADERS`. A
        response that cannot be stored or sent whole: see :class:`Edge`.
        Errors of idemflow become problem responses; the handler's own
        exceptions propagate (after the claim was released).
        """
        try:
            intent = self.intent(request)
            sent: list[Response] = []
            operation = self._storing(handler, sent, atomic=transaction is not None)
            async with _scope(transaction) as opened:
                outcome = await self._driver().run(
                    intent, operation, transaction=opened, single_commit=single_commit
                )
            if outcome.replayed:
                await self._authorize(outcome.record)
                return with_request_id(replayed(outcome), request.request_id)
            return with_request_id(sent[0], request.request_id)
        except IdempotencyError as exc:
            return problem_for(exc, request.request_id)

    def _storing(
        self, handler: OperationHandler, sent: list[Response], *, atomic: bool
    ) -> OperationHandler:
        """Wrap ``handler``: keep its full response to send, return the storable one.

        ``atomic``: the handler's effect rolls back with the claim (a
        transaction), so a response we cannot store may undo it.
        """
        limit = self.options.max_response_bytes
        classify = self.idempotency.policy.classify

        async def operation(attempt: AsyncAttempt) -> Response:
            response = await handler(attempt)
            if isinstance(response, _NotStored):  # the integration already knew
                sent.append(response)
                return response
            verdict = classify(response)
            reason = unsendable(response)
            if reason is None and verdict is not Verdict.TRANSIENT:
                reason = _oversized(response, limit)  # a transient one is never stored
            if reason is not None:
                if atomic:
                    raise ResponseNotStorable(reason)
                response = not_stored(response, reason, verdict)
            sent.append(response)
            return response if verdict is Verdict.TRANSIENT else storable(response, max_bytes=limit)

        return operation

    def _driver(self) -> AsyncIdempotency:
        """The driver, with a policy that settles :func:`not_stored` markers.

        The flow classifies every response with the policy; a marker (a 500)
        would be classified transient and released, running the effect again
        on the retry. A shallow copy of the driver (same store, clock and
        observer) gets the policy whose classifier knows markers; the caller's
        driver is left as it was.
        """
        idempotency = self.idempotency
        cached = self._marking
        if cached is not None and cached[0] is idempotency and cached[1] is idempotency.policy:
            return cached[2]
        marking = copy.copy(idempotency)
        marking.policy = dataclasses.replace(
            idempotency.policy, classify=_settling(idempotency.policy.classify)
        )
        self._marking = (idempotency, idempotency.policy, marking)
        return marking

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
    """``response`` as it is stored: allow-listed headers only, body within the limit.

    A :func:`not_stored` marker is stored as it is.
    """
    if isinstance(response, _NotStored):
        return response
    reason = unsendable(response) or _oversized(response, max_bytes)
    if reason is not None:
        raise ResponseNotStorable(reason)
    headers = tuple((k.lower(), v) for k, v in response.headers if k.lower() in REPLAYED_HEADERS)
    return Response(response.status, response.body, headers)


def unsendable(response: Response) -> str | None:
    """Why ``response`` cannot be sent as it is (None if it can): status, headers, body type.

    Every header counts, not only the replayed ones: the first caller is sent
    them all. A name must be an HTTP token; a value latin-1 text without CR,
    LF, NUL or other controls (a tab is allowed).
    """
    status = response.status
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        return f"the status {status!r} is not a final HTTP status (200-599)"
    if not isinstance(response.body, bytes):
        return f"the body is a {type(response.body).__name__}, not bytes"
    for name, value in response.headers:
        if not isinstance(name, str) or not _TOKEN.fullmatch(name):
            return f"the header name {_excerpt(name)} is not an HTTP token"
        if not isinstance(value, str) or _UNSENDABLE_VALUE.search(value):
            return (
                f"the {name} header value {_excerpt(value)} cannot be sent: only latin-1 "
                "text without CR, LF, NUL or other control characters can"
            )
    return None


def _oversized(response: Response, max_bytes: int) -> str | None:
    if len(response.body) <= max_bytes:
        return None
    return (
        f"the response body is {len(response.body)} bytes; the stored-body limit is "
        f"{max_bytes} bytes (raise max_response_bytes, or do not protect this endpoint)"
    )


def _excerpt(value: object) -> str:
    """At most _EXCERPT_LENGTH characters of a value, escaped by ``repr`` (safe in any log)."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= _EXCERPT_LENGTH:
        return repr(text)
    return repr(text[:_EXCERPT_LENGTH]) + "..."


@dataclass(frozen=True, slots=True)
class _NotStored(Response):
    """A marker response, and the verdict of the response it stands for."""

    verdict: Verdict = Verdict.COMPLETED


def not_stored(original: Response, reason: str, verdict: Verdict) -> Response:
    """The marker a key is settled with when the endpoint ran but its response cannot be stored.

    A 500 ``response-not-stored`` problem whose ``original_status`` (and
    ``location``, if the original had one) say what the endpoint answered, so
    a client can find the effect instead of running it again. It is settled
    with ``verdict``, the original's (completed or failed_permanent); a
    transient original is still released, and this problem is what its
    caller gets instead of a response that cannot be sent whole.
    """
    status = original.status if isinstance(original.status, int) else None
    extensions: dict[str, Any] = {"original_status": status}
    location = _text_header(original, "location")
    if location is not None:
        extensions["location"] = location
    if verdict is Verdict.TRANSIENT:
        detail = (
            f"the endpoint answered {original.status}, a transient failure (nothing was "
            f"recorded: retry), but its response cannot be sent: {reason}"
        )
    else:
        detail = (
            f"the request was executed (status {original.status}) but its response could "
            f"not be stored for replay: {reason}; do not retry, look up what it did"
        )
    logger.error("response not stored: %s", detail)
    marker = problem(500, "Response not stored", detail, slug=NOT_STORED_SLUG, **extensions)
    return _NotStored(marker.status, marker.body, marker.headers, verdict)


def _text_header(response: Response, name: str) -> str | None:
    """A header's value if it is text a JSON body can carry (any control is escaped there)."""
    value = response.header(name)
    if not isinstance(value, str):
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return None
    return value[:2048]


def _settling(classify: Callable[[Response], Verdict]) -> Callable[[Response], Verdict]:
    """``classify``, except that a :func:`not_stored` marker keeps its own verdict."""

    def verdict(response: Response) -> Verdict:
        if isinstance(response, _NotStored):
            return response.verdict
        return classify(response)

    return verdict


def replayed(outcome: Outcome) -> Response:
    """The stored response, marked as a replay and linked to the original request."""
    response = outcome.response
    extra = [(REPLAYED_HEADER, "true")]
    if outcome.record.correlation_id:
        extra.append((ORIGINAL_REQUEST_ID_HEADER, outcome.record.correlation_id))
    return Response(response.status, response.body, (*response.headers, *extra))


def sendable_headers(response: Response) -> list[tuple[bytes, bytes]]:
    """The handler's header lines as ASGI sends them, without framing (ours to write)."""
    return [
        (k.lower().encode("latin-1"), v.encode("latin-1"))
        for k, v in response.headers
        if k.lower() not in _FRAMING_HEADERS
    ]


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
