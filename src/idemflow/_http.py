"""The framework-neutral HTTP edge, sans I/O: request → [`Intent`][idemflow.Intent], outcome or
error → response, and what every door shares. The rules: docs/http.md; where each lives:
docs/architecture.md, "Where each rule lives"."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Mapping,
    MutableMapping,
    Sequence,
)
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeAlias, TypeVar
from urllib.parse import urlencode

from ._errors import (
    OUTCOME_UNKNOWN_WITNESS,
    PROBLEM_BASE,
    BodyTooLarge,
    ConfigurationError,
    IdempotencyError,
    IncompleteBody,
    InProgress,
    MissingPrincipal,
    OutcomeUnknown,
    ResponseNotStorable,
    StoreUnavailable,
    problem_types,
)
from ._identity import DEFAULT_MAX_BODY_BYTES, excerpt, fingerprint, parse_key
from ._model import (
    Classified,
    Intent,
    Outcome,
    Policy,
    Record,
    Response,
    Verdict,
    default_classifier,
)

logger = logging.getLogger("idemflow.http")

_Edge = TypeVar("_Edge")
_ReplayHook: TypeAlias = Callable[[Record], bool]

KEY_HEADER = "idempotency-key"
REQUEST_ID_HEADER = "x-request-id"
REPLAYED_HEADER = "idempotent-replayed"
#: Names the request whose execution produced a replayed response.
ORIGINAL_REQUEST_ID_HEADER = "idempotency-original-request-id"
PROBLEM_CONTENT_TYPE = "application/problem+json"
_KEY_NAME = KEY_HEADER.encode("latin-1")
_CONTENT_TYPE_NAME = b"content-type"

#: Methods that are idempotent already: the header is ignored on them.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})

#: The headers a client needs to interpret a replayed response; the rest is not stored
#: (``Set-Cookie`` would hand a session to whoever replays, ``Date`` is the first moment's).
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

#: The problem type of the `not_stored` marker.
NOT_STORED_SLUG = "response-not-stored"

# Framing is the server's business: a handler's own Content-Length (or
# Transfer-Encoding) would contradict the one the server writes.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding"})

# RFC 9110 §5.1: a field name is a token.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# RFC 9110 §5.5: visible latin-1, spaces and tabs; a control would end the header.
_UNSENDABLE_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]|[^\x00-\xff]")
# A client's X-Request-Id is echoed only if short, printable ASCII: it goes into logs.
_MAX_REQUEST_ID_LENGTH = 128

RawHeaders: TypeAlias = Sequence[tuple[bytes, bytes]]
#: Returns whether the principal may still see a stored response (sync or async).
ReplayAuthorizer: TypeAlias = Callable[[Record], bool | Awaitable[bool]]
#: A route's policy, or a function of the request's principal answering one.
RoutePolicy: TypeAlias = Policy | Callable[[str], Policy]


@dataclass(frozen=True, slots=True)
class HTTPRequest:
    """What the edge needs of a request, whatever the framework: ``route`` is the template
    it matched (``/payments/{id}``), ``path_params`` its values, ``principal`` who the
    authentication that ran before says sent it (None if none)."""

    method: str
    route: str
    headers: RawHeaders
    body: bytes
    principal: str | None
    request_id: str
    path_params: Mapping[str, str] = field(default_factory=dict)
    #: The raw query string (``a=1&b=2``), part of the fingerprint.
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
        authorize_replay: asked before a stored response is replayed (False: 403), to
            re-check object-level permission that may have changed since.
        max_response_bytes: the largest body stored for replay; a larger one is
            never stored truncated (see `storing`).
        max_body_bytes: the largest request body read (413, while it streams).
        exclude_fields: JSON members left out of the fingerprint (per-attempt fields).
        strict_key: accept only the quoted sf-string form of the key.
        policy: this route's [`Policy`][idemflow.Policy] (retention, request timeout,
            classifier), or ``(principal) -> Policy``; None: the driver's. Its stale
            threshold may not exceed the driver's, which the sweeper runs on."""

    public: bool = False
    anonymous_principal: str = "anonymous"
    authorize_replay: ReplayAuthorizer | None = None
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    exclude_fields: Collection[str] = field(default=())
    strict_key: bool = False
    policy: RoutePolicy | None = None

    def __post_init__(self) -> None:
        if self.max_response_bytes < 0:
            raise ConfigurationError("max_response_bytes must not be negative")
        if self.max_body_bytes < 0:
            raise ConfigurationError("max_body_bytes must not be negative")


#: A middleware's ``endpoints``: templates, or templates mapped to their route's policy.
Endpoints: TypeAlias = Iterable[str] | Mapping[str, RoutePolicy | None]


def route_table(endpoints: Endpoints, options: EdgeOptions) -> dict[str, EdgeOptions]:
    """Each endpoint's options, with the policy the table maps it to (if any)."""
    if not isinstance(endpoints, Mapping):
        return dict.fromkeys(endpoints, options)
    return {
        endpoint: options if policy is None else replace(options, policy=policy)
        for endpoint, policy in endpoints.items()
    }


def policy_for(options: EdgeOptions, principal: str) -> Policy | None:
    """The route's policy for ``principal`` (its resolver's answer); None: the driver's."""
    chosen = options.policy
    if chosen is None or isinstance(chosen, Policy):
        return chosen
    answered = chosen(principal)
    if not isinstance(answered, Policy):
        msg = f"EdgeOptions(policy=…) answered {answered!r} for a principal, not a Policy"
        raise ConfigurationError(msg)
    return answered


def sync_replay_authorizer(hook: object, name: str) -> Callable[[Record], bool]:
    """`plain_callable` for a WSGI door's replay hook: the sync edge cannot await one."""
    checked: Callable[[Record], bool] = plain_callable(hook, name, "(record) -> bool")
    return checked


def plain_callable(hook: object, name: str, signature: str) -> Any:
    """``hook``, refused where it is configured unless a plain callable ``signature``:
    code that does not await would take an ``async def`` one's coroutine for its answer."""
    if not callable(hook):
        raise ConfigurationError(f"{name} must be a callable {signature}, got {hook!r}")
    # An object whose __call__ is async answers a coroutine just the same.
    if inspect.iscoroutinefunction(hook) or inspect.iscoroutinefunction(hook.__call__):
        msg = (
            f"{name} is a coroutine function, but this integration calls it without "
            f"awaiting: pass a plain function {signature}"
        )
        raise ConfigurationError(msg)
    return hook


def intent_for(request: HTTPRequest, options: EdgeOptions) -> Intent:
    """The request's identity; raises the 400/401 client errors, claims nothing."""
    principal = request.principal
    if not isinstance(principal, str | None) and inspect.isawaitable(principal):
        # its text would differ on every request
        if inspect.iscoroutine(principal):
            principal.close()
        msg = "the principal getter answered an awaitable: pass a plain function returning str"
        raise ConfigurationError(msg)
    if not principal:
        if not options.public:
            msg = "authenticate first: idempotency keys are scoped to the caller"
            raise MissingPrincipal(msg)
        principal = options.anonymous_principal
    keys: list[str] = []
    content_type = None
    for raw_name, value in request.headers:
        name = raw_name.lower()
        if name == _KEY_NAME:
            keys.append(value.decode("latin-1"))
        elif name == _CONTENT_TYPE_NAME and content_type is None:
            content_type = value.decode("latin-1")
    key = parse_key(keys, strict=options.strict_key)
    digest = fingerprint(
        request.method,
        request.fingerprinted_route,
        request.body,
        content_type=content_type,
        exclude_fields=options.exclude_fields,
        max_body_bytes=options.max_body_bytes,
        query=request.query,
    )
    return Intent(
        principal, key, digest, endpoint=request.endpoint, correlation_id=request.request_id
    )


def storing(response: Response, verdict: Verdict, *, atomic: bool, max_bytes: int) -> Response:
    """What to send and store for ``response``, checked whole first. One that cannot be
    stored raises `ResponseNotStorable` where the effect rolls back with the claim
    (``atomic``); elsewhere it settles the key as a `not_stored` marker. A transient
    response is released, never stored: no size limit applies."""
    if isinstance(response, Classified):  # a marker the integration already made
        return response
    reason = unsendable(response)
    if reason is None and verdict is not Verdict.TRANSIENT:
        reason = oversized(response, max_bytes)
    if reason is None:
        return response
    if atomic:
        raise ResponseNotStorable(reason)
    return not_stored(response, reason, verdict)


def declared_length(value: str | None, limit: int) -> int | None:
    """A request's ``Content-Length``, if one was sent; BodyTooLarge at once if over ``limit``."""
    text = value.strip() if isinstance(value, str) else ""
    if not (text.isascii() and text.isdigit()):
        return None  # none (chunked), or a framing the server already refused
    digits = text.lstrip("0") or "0"
    # More digits than the limit has: over it, without converting 5,000 digits.
    if len(digits) > len(str(limit)) or int(digits) > limit:
        raise BodyTooLarge(
            f"the request body is {digits[:20]} bytes (Content-Length); "
            f"the limit for idempotent requests is {limit} bytes"
        )
    return int(digits)


def body_too_large(size: int, limit: int, *, streaming: bool = False) -> BodyTooLarge:
    """The 413 for a body that passed ``limit`` (while it streamed, or in a buffer)."""
    read = f"more than {limit} bytes arrived" if streaming else f"the request body is {size} bytes"
    return BodyTooLarge(f"{read}; the limit for idempotent requests is {limit} bytes")


def body_cut_short(size: int, declared: int | None) -> IncompleteBody:
    """The 400 for a body that did not arrive whole: never fingerprinted, claimed or run."""
    expected = f" of the {declared} declared" if declared is not None else ""
    return IncompleteBody(
        f"the request body ended after {size} bytes{expected}: the client went away; "
        "nothing was recorded, send the whole request again"
    )


class BodyReader:
    """A request body read whole and bounded, sans I/O: each door feeds it what arrived."""

    def __init__(self, content_length: str | None, limit: int) -> None:
        self.limit = limit
        self.declared = declared_length(content_length, limit)
        self.size = 0
        self._chunks: list[bytes] = []

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise body_too_large(self.size, self.limit, streaming=True)
        self._chunks.append(chunk)

    def cut_short(self) -> IncompleteBody:
        return body_cut_short(self.size, self.declared)

    def body(self) -> bytes:
        if self.declared is not None and self.size != self.declared:
            raise self.cut_short()
        return b"".join(self._chunks)


class ResponseSink:
    """An app's response body kept in memory, at most ``limit`` bytes (the rest counted).
    Never raises into the app: its effect is happening."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.chunks: list[bytes] = []

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size <= self.limit:
            self.chunks.append(chunk)

    def response(
        self,
        status: int,
        headers: Iterable[tuple[str, str]],
        classify: Callable[[Response], Any],
        reason: str | None = None,
    ) -> Response:
        """The response; a `not_stored` marker if ``reason`` or the size forbid storing."""
        kept = tuple(
            (k, v) for k, v in headers if not (isinstance(k, str) and k.lower() == "content-length")
        )
        response = Response(status, b"".join(self.chunks), kept)
        if reason is None and self.size > self.limit:
            reason = _too_large(self.size, self.limit)
        return response if reason is None else not_stored(response, reason, classify(response))


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One opted-in endpoint: its method, template, and the pattern matching its path."""

    method: str
    template: str
    pattern: re.Pattern[str]


_PARAMETER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::(str|int|float|path|uuid))?\}")
_CONVERTERS = {
    None: "[^/]+",
    "str": "[^/]+",
    "int": "[0-9]+",
    "float": r"[0-9]+(?:\.[0-9]+)?",
    "path": ".*",
    "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
}


def compile_endpoint(endpoint: str, spell: Callable[[str], str] = str) -> Endpoint:
    """``"POST /payments/{id}/refunds"`` compiled; ConfigurationError if malformed.
    ``spell`` turns a literal segment into how the door's paths spell it (WSGI: latin-1)."""
    method, _, template = endpoint.strip().partition(" ")
    method, template = method.upper(), template.strip()
    if not _TOKEN.fullmatch(method) or not template.startswith("/"):
        msg = f"endpoint {endpoint!r} must be 'METHOD /route/{{param}}'"
        raise ConfigurationError(msg)
    if method in SAFE_METHODS:
        msg = (
            f"endpoint {endpoint!r}: {method} is idempotent already and is never "
            "protected; list unsafe methods only"
        )
        raise ConfigurationError(msg)
    parts: list[str] = []
    names: set[str] = set()
    for segment in template.split("/")[1:]:
        parameter = _PARAMETER.fullmatch(segment)
        if parameter is not None:
            name = parameter.group(1)
            if name in names:
                msg = f"endpoint {endpoint!r} names the parameter {name!r} twice"
                raise ConfigurationError(msg)
            names.add(name)
            parts.append(f"(?P<{name}>{_CONVERTERS[parameter.group(2)]})")
        elif "{" in segment or "}" in segment:
            msg = f"endpoint {endpoint!r}: a parameter is a whole segment, '{{name}}'"
            raise ConfigurationError(msg)
        else:
            parts.append(re.escape(spell(segment)))
    return Endpoint(method, template, re.compile("/" + "/".join(parts)))


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
    return os.urandom(16).hex()  # a uuid4's 32 hex digits, without building the UUID


def raw_headers(environ: Mapping[str, Any]) -> list[tuple[bytes, bytes]]:
    """A WSGI environ's (or Django's ``META``'s) header lines as (lower-case name, value)
    bytes, as werkzeug lists them. An empty ``HTTP_*`` value is a line (``Idempotency-Key:``
    is a 400 "empty"); ``CONTENT_TYPE`` and ``CONTENT_LENGTH`` only when set (CGI leaves
    them empty when absent), never their ``HTTP_`` twins: the server framed the body by its own."""
    headers: list[tuple[bytes, bytes]] = []
    names = _HEADER_NAMES
    for key, value in environ.items():
        name = names.get(key)
        if name is None:
            if key.startswith("HTTP_") and key not in ("HTTP_CONTENT_TYPE", "HTTP_CONTENT_LENGTH"):
                name = key[5:].replace("_", "-").lower().encode("latin-1")
            elif key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                name = key.replace("_", "-").lower().encode("latin-1")
            else:
                name = b""  # not a header line
            if len(names) < _MAX_HEADER_NAMES:
                names[key] = name
        if name and isinstance(value, str) and (value or name not in _CONTENT_HEADERS):
            headers.append((name, value.encode("latin-1", "replace")))
    return headers


# environ key -> header name (b"": no header), learned as requests come; bounded, since
# clients choose header names.
_HEADER_NAMES: dict[str, bytes] = {}
_MAX_HEADER_NAMES = 512
_CONTENT_HEADERS = (b"content-type", b"content-length")  # listed only when set


class ViewEdges(Generic[_Edge]):
    """The edges of one app's views (Flask's, Django's): one per publicness, replay hook
    and route policy, made by ``make`` on first use, never per request."""

    def __init__(self, make: Callable[[EdgeOptions], _Edge], options: EdgeOptions) -> None:
        self._make = make
        self._options = options
        # (public, id of the hook, id of the policy) -> (both, kept so their ids stay
        # unique; the edge)
        self._made: dict[tuple[bool, int, int], tuple[object, _Edge]] = {}

    def __call__(
        self,
        public: bool,
        authorize_replay: _ReplayHook | None,
        policy: RoutePolicy | None = None,
    ) -> _Edge:
        made = self._made.get((public, id(authorize_replay), id(policy)))
        if made is None:  # two threads may both make it: the same options, either will do
            options = replace(
                self._options, public=public, authorize_replay=authorize_replay, policy=policy
            )
            made = (authorize_replay, policy), self._make(options)
            self._made[(public, id(authorize_replay), id(policy))] = made
        return made[1]


def stored_form(response: Response) -> Response:
    """``response``, checked by `storing`, with only the `REPLAYED_HEADERS` (a marker as is)."""
    if isinstance(response, Classified):
        return response
    headers = tuple((k.lower(), v) for k, v in response.headers if k.lower() in REPLAYED_HEADERS)
    return Response(response.status, response.body, headers)


def unsendable(response: Response) -> str | None:
    """Why ``response`` cannot be sent as it is (None if it can): status, body type, and
    every header (the first caller is sent them all), each an HTTP token and latin-1
    text without controls but a tab."""
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


def oversized(response: Response, max_bytes: int) -> str | None:
    """Why ``response`` is too large to store (None if it is not)."""
    return None if len(response.body) <= max_bytes else _too_large(len(response.body), max_bytes)


def _too_large(size: int, limit: int) -> str:
    return (
        f"the response body is {size} bytes; the stored-body limit is {limit} bytes "
        "(raise max_response_bytes, or do not protect this endpoint)"
    )


def _excerpt(value: object) -> str:
    return excerpt(value if isinstance(value, str) else repr(value))


def not_stored(original: Response | None, reason: str, verdict: Verdict) -> Response:
    """The marker a key is settled with (by ``verdict``, the original's) when the endpoint
    ran but its response cannot be stored: a 500 ``response-not-stored`` problem whose
    ``original_status`` and ``location`` let a client find the effect instead of running
    it again (``original`` None: not even its status could be read). A transient
    original is still released; its caller gets this instead of what cannot be sent."""
    extensions: dict[str, Any] = {"original_status": None}
    if original is not None:
        extensions["original_status"] = (
            original.status if isinstance(original.status, int) else None
        )
        location = _text_header(original, "location")
        if location is not None:
            extensions["location"] = location
    if original is None:
        detail = (
            f"the request was executed but its response could not be read: {reason}; "
            "do not retry, look up what it did"
        )
    elif verdict is Verdict.TRANSIENT:
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
    # Released (transient): the retry runs again. Settled: it replays this marker.
    retryable = verdict is Verdict.TRANSIENT
    marker = problem(
        500, "Response not stored", detail, slug=NOT_STORED_SLUG, retryable=retryable, **extensions
    )
    return Classified(marker.status, marker.body, marker.headers, verdict)


def not_read(error: Exception, classify: Callable[[Response], Verdict]) -> Response:
    """The `not_stored` marker for an answer that could not be read or checked where the
    effect stays: settled by the verdict of the ``response`` a `ResponseNotStorable`
    ``error`` carries, else ``failed_permanent``; never a release."""
    original: Response | None = error.response if isinstance(error, ResponseNotStorable) else None
    if original is None:
        logger.error("the endpoint ran but its answer could not be read", exc_info=error)
        verdict = Verdict.FAILED_PERMANENT
    else:
        verdict = settled_verdict(classify, original)
    return not_stored(original, str(error) or type(error).__name__, verdict)


def settled_verdict(classify: Callable[[Response], Verdict], response: Response) -> Verdict:
    """``classify(response)``, or ``failed_permanent`` when the classifier fails: where the
    effect stays, a failure of ours after the endpoint ran settles the key."""
    try:
        return classify(response)
    except Exception:
        logger.exception("the classifier failed on the endpoint's answer: settled as failed")
        return Verdict.FAILED_PERMANENT


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
    retryable: bool | None = None,
    **extensions: Any,
) -> Response:
    """An RFC 9457 problem response (``type`` is ``https://idemflow.dev/problems/<slug>``);
    ``retryable``: may the same request, unchanged, succeed if sent again (`is_retryable`)."""
    if retryable is None:
        retryable = is_retryable(slug, status)
    content = {
        "type": PROBLEM_BASE + slug,
        "title": title,
        "status": status,
        "detail": detail,
        "retryable": retryable,
        **extensions,
    }
    body = json.dumps(content, separators=(",", ":"), ensure_ascii=False).encode()
    headers = [("content-type", PROBLEM_CONTENT_TYPE)]
    if retry_after is not None:
        headers.append(("retry-after", str(retry_after)))
    if request_id is not None:
        headers.append((REQUEST_ID_HEADER, request_id))
    return Response(status, body, tuple(headers))


def is_retryable(slug: str, status: int) -> bool:
    """The ``retryable`` member of a problem: an idemflow error's own; an application's
    when its status is transient (released, not stored, so the retry runs again)."""
    error = problem_types().get(slug)
    if error is not None:
        return error.retryable
    return default_classifier(Response(status)) is Verdict.TRANSIENT


def problem_for(error: IdempotencyError, request_id: str | None = None) -> Response:
    """The problem response for one of idemflow's errors (409 and 503 with ``Retry-After``)."""
    retry_after = None
    if isinstance(error, InProgress | StoreUnavailable | OutcomeUnknown):
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
        retryable=error.retryable,
    )


#: The WSGI environ / ASGI scope key of a middleware's `OutcomeSlot`.
OUTCOME_SLOT = "idemflow.outcome_unknown"


class OutcomeSlot:
    """Where an application reports the ``OutcomeUnknown`` its framework turned into a 500
    (which would release the key): filled by `report_outcome_unknown` or noted by
    `watching`, raised by the middleware so the claim is kept (docs/http.md)."""

    __slots__ = ("_token", "made", "reported")

    def __init__(self) -> None:
        self.reported: OutcomeUnknown | None = None
        self.made: OutcomeUnknown | None = None

    def watching(self) -> OutcomeSlot:
        """Run the application inside: the first ``OutcomeUnknown`` made meanwhile (in this
        context and those it starts) is noted, hook or not. After it, what was reported is
        raised; if the application raised, what was made."""
        return self

    def __enter__(self) -> None:
        self._token = OUTCOME_UNKNOWN_WITNESS.set(self._note)

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> None:
        OUTCOME_UNKNOWN_WITNESS.reset(self._token)
        if self.reported is not None:
            raise self.reported
        if isinstance(error, Exception):
            self.raise_made()

    def _note(self, made: OutcomeUnknown) -> None:
        if self.made is None:
            self.made = made

    def raise_made(self) -> None:
        """Raise the ``OutcomeUnknown`` made while the application ran, if any: for an
        application that failed (raised, or answered a transient status)."""
        if self.made is not None:
            raise self.made


def report_outcome_unknown(request: MutableMapping[str, Any], error: BaseException) -> bool:
    """Tell the idemflow middleware running this request that its outcome is unknown.

    Call it from the framework's error handler with the exception it handles;
    ``request`` is the WSGI environ or the ASGI scope (``flask.request.environ``,
    Django's ``request.environ`` or ``request.scope``). Returns whether there was a
    middleware to tell; anything but an ``OutcomeUnknown`` is ignored. The first report wins."""
    slot = request.get(OUTCOME_SLOT)
    if not isinstance(slot, OutcomeSlot) or not isinstance(error, OutcomeUnknown):
        return False
    if slot.reported is None:
        slot.reported = error
    return True
