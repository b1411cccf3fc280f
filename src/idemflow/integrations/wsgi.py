"""idemflow for any WSGI application, middleware mode (effect and record not atomic), and
what Flask's and Django's doors share. The rules: docs/frameworks/wsgi.md."""

from __future__ import annotations

import contextlib
import functools
import io
import pkgutil
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeAlias

from .. import Attempt, Idempotency
from .._deprecation import moved
from .._errors import (
    ConfigurationError,
    IdempotencyError,
    LengthRequired,
    OutcomeUnknown,
)
from .._model import Record, Response, Verdict
from ..edge import (
    OUTCOME_SLOT,
    SAFE_METHODS,
    BodyReader,
    Edge,
    EdgeOptions,
    Endpoints,
    HTTPRequest,
    OutcomeSlot,
    RawHeaders,
    ResponseSink,
    not_stored,
    plain_callable,
    problem_for,
    raw_headers,
    report_outcome_unknown,
    request_id_from,
    route_table,
    sendable_headers,
    settled_verdict,
    sync_replay_authorizer,
)
from ..edge import Endpoint as _Endpoint
from ..edge import compile_endpoint as compile_any_endpoint

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = [
    "EdgeOptions",
    "IdempotencyMiddleware",
    "read_body",
    "remote_user",
    "report_outcome_unknown",
    "request_id",
]

#: Returns the authenticated principal of a request's environ, or None.
PrincipalGetter: TypeAlias = Callable[["WSGIEnvironment"], "str | None"]

#: May the stored record's principal still see it? Plain, not ``async def`` (the sync edge).
ReplayHook: TypeAlias = Callable[[Record], bool]

#: Where the request's correlation id is kept for the application.
REQUEST_ID_KEY = "idemflow.request_id"

_READ_SIZE = 65_536
_STATUS = re.compile(r"([0-9]{3})(?: .*)?")

# Framing is the server's (we write Content-Length); hop-by-hop ones PEP 3333 forbids.
_HOP_BY_HOP = ("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te")
_NOT_FORWARDED = frozenset(
    {*_HOP_BY_HOP, "content-length", "trailer", "trailers", "transfer-encoding", "upgrade"}
)


def remote_user(environ: WSGIEnvironment) -> str | None:
    """``REMOTE_USER``, as the server or an authentication middleware set it (None if unset)."""
    value = environ.get("REMOTE_USER")
    return value if isinstance(value, str) and value else None


def request_id(environ: WSGIEnvironment, headers: RawHeaders | None = None) -> str:
    """This request's correlation id (the client's ``X-Request-Id`` if sane), kept in environ."""
    value = environ.get(REQUEST_ID_KEY)
    if not isinstance(value, str):
        value = request_id_from(raw_headers(environ) if headers is None else headers)
        environ[REQUEST_ID_KEY] = value
    return value


_ASGI_APP = (
    "the WSGI IdempotencyMiddleware's app (an ASGI application? wrap it in "
    "idemflow.integrations.starlette.IdempotencyMiddleware)"
)


class IdempotencyMiddleware:
    """Middleware mode for WSGI: claim, capture the response, store it, replay it.

    Args:
        app: the WSGI application whose endpoints are protected.
        idempotency: the (sync) driver: store, policy, observer.
        endpoints: ``"METHOD /route/{param}"`` templates, relative to ``PATH_INFO``.
        principal: the environ's authenticated principal (default: ``REMOTE_USER``).
        options: public endpoints, replay authorization, size limits.

    Raises:
        ConfigurationError: no or a bad endpoint; an async driver, app, getter or hook.
    """

    def __init__(
        self,
        app: WSGIApplication,
        *,
        idempotency: Idempotency,
        endpoints: Endpoints,
        principal: PrincipalGetter = remote_user,
        options: EdgeOptions | None = None,
    ) -> None:
        if not isinstance(idempotency, Idempotency):
            msg = (
                f"the WSGI middleware runs in a thread, not a loop: pass idemflow.Idempotency, "
                f"not {type(idempotency).__name__}"
            )
            raise ConfigurationError(msg)
        # Refused now, not as a 500 (or coroutines nobody awaits) on every request.
        if options is not None and options.authorize_replay is not None:
            sync_replay_authorizer(options.authorize_replay, "EdgeOptions(authorize_replay=…)")
        plain_callable(app, _ASGI_APP, "(environ, start_response)")
        plain_callable(principal, "IdempotencyMiddleware(principal=…)", "(environ) -> str | None")
        self.app = app
        self.edge = Edge(idempotency, options)
        self._principal = principal
        table = route_table(endpoints, self.edge.options)
        self._endpoints = [_compile_endpoint(endpoint) for endpoint in table]
        self._edges = [Edge(idempotency, chosen) for chosen in table.values()]
        if not self._endpoints:
            raise ConfigurationError("IdempotencyMiddleware needs at least one endpoint to protect")
        _report_from_flask(app)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        route = self._match(environ)
        if route is None:
            return self.app(environ, start_response)
        headers = raw_headers(environ)
        rid = request_id(environ, headers)
        try:
            who = self._principal(environ)
            body = read_body(environ, self.edge.options.max_body_bytes)
        except IdempotencyError as exc:
            # After a disconnect this goes nowhere; sent all the same: one path, no traceback.
            return send(start_response, problem_for(exc, rid))
        template, params, edge = route
        method, query = str(environ["REQUEST_METHOD"]), str(environ.get("QUERY_STRING", ""))
        request = HTTPRequest(method, template, headers, body, who, rid, params, query)
        return send(start_response, edge.respond(request, self._endpoint(environ, body)))

    def _match(self, environ: WSGIEnvironment) -> tuple[str, dict[str, str], Edge] | None:
        """The opted-in endpoint matched: its full template, path parameters and edge."""
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        if method in SAFE_METHODS:
            return None
        path = str(environ.get("PATH_INFO", "")) or "/"
        for endpoint, edge in zip(self._endpoints, self._edges, strict=True):
            match = endpoint.pattern.fullmatch(path) if endpoint.method == method else None
            if match is not None:
                template = str(environ.get("SCRIPT_NAME", "")) + endpoint.template
                return template, match.groupdict(), edge
        return None

    def _endpoint(self, environ: WSGIEnvironment, body: bytes) -> Callable[[Attempt], Response]:
        limit = self.edge.options.max_response_bytes

        def operation(attempt: Attempt) -> Response:
            # The app has run when it is asked: a classifier that fails settles, never releases.
            classify = functools.partial(settled_verdict, attempt.policy.verdict)
            environ["wsgi.input"] = io.BytesIO(body)  # the server's stream is spent
            environ["CONTENT_LENGTH"] = str(len(body))
            environ["wsgi.input_terminated"] = True
            captured = _Captured(limit)
            # A framework's error hook reports an OutcomeUnknown it answered itself here.
            slot = environ[OUTCOME_SLOT] = OutcomeSlot()
            with slot.watching():
                result = self.app(environ, captured.start_response)
                try:
                    for chunk in result:
                        captured.add(chunk)
                finally:
                    close = getattr(result, "close", None)
                    if close is not None:
                        close()
            response = captured.response(classify)
            if slot.made is not None and classify(response) is Verdict.TRANSIENT:
                slot.raise_made()  # the framework's own 500 for it, or the app's 503 after it
            return response

        return operation


def _report_from_flask(app: object) -> None:
    """`report_from_flask` on the Flask app under ``app`` (through methods and ``.app``)."""
    flask = sys.modules.get("flask")
    if flask is None:
        return
    for _ in range(_MAX_WRAPPERS):
        if isinstance(app, flask.Flask):
            with contextlib.suppress(AssertionError):  # it has served a request already
                report_from_flask(app)
            return
        app = getattr(app, "__self__", None) or getattr(app, "app", None)


def report_from_flask(app: Any) -> None:
    """An ``OutcomeUnknown`` handler on ``app`` (unless it has one): the slot, then 503."""
    if OutcomeUnknown in app.error_handler_spec.get(None, {}).get(None, {}):
        return
    flask = sys.modules["flask"]  # loaded: ``app`` is one of its apps

    def reported(error: OutcomeUnknown) -> tuple[bytes, int, list[tuple[str, str]]]:
        environ = flask.request.environ
        report_outcome_unknown(environ, error)
        rid = environ.get(REQUEST_ID_KEY)  # the middleware's, when it runs
        answer = problem_for(
            error, rid if isinstance(rid, str) else request_id_from(raw_headers(environ))
        )
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in sendable_headers(answer)]
        return answer.body, answer.status, headers

    app.register_error_handler(OutcomeUnknown, reported)


#: How many wrappers (``ProxyFix(app.wsgi_app)``, …) are looked through for a Flask app.
_MAX_WRAPPERS = 8


def configured_replay_hook(hook: object, setting: str) -> ReplayHook | None:
    """A replay hook setting (Flask's, Django's): the callable, or the one its import path
    names, checked plain (ConfigurationError)."""
    if hook is None:
        return None
    if isinstance(hook, str):
        try:
            hook = pkgutil.resolve_name(hook)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigurationError(f"{setting} = {hook!r} does not import: {exc}") from exc
    return sync_replay_authorizer(hook, setting)


def view_options(setting: Callable[[str], Any]) -> EdgeOptions:
    """A framework's settings (``setting("max_body_bytes")`` reads one) as view options."""
    return EdgeOptions(
        max_body_bytes=int(setting("max_body_bytes")),
        max_response_bytes=int(setting("max_response_bytes")),
        exclude_fields=tuple(setting("exclude_fields")),
        strict_key=bool(setting("strict_key")),
    )


def _compile_endpoint(endpoint: str) -> _Endpoint:
    # WSGI spells a path as its UTF-8 bytes decoded as latin-1 (PEP 3333).
    return compile_any_endpoint(endpoint, lambda text: text.encode("utf-8").decode("latin-1"))


def read_body(environ: WSGIEnvironment, limit: int) -> bytes:
    """The whole request body, never more than ``limit`` bytes held: BodyTooLarge,
    IncompleteBody, or LengthRequired (chunked where the server does not end the stream)."""
    reader = BodyReader(environ.get("CONTENT_LENGTH"), limit)
    if reader.declared is None and not environ.get("wsgi.input_terminated"):
        _require_length(environ)
        return b""
    stream = environ.get("wsgi.input")
    while reader.declared is None or reader.size < reader.declared:
        # Without a length, one byte past ``limit`` at most: enough to tell it is over.
        want = min(
            _READ_SIZE, (limit + 1 if reader.declared is None else reader.declared) - reader.size
        )
        chunk = _read(stream, want)
        if chunk is None:
            raise reader.cut_short()
        if not chunk:
            break
        reader.add(chunk)
    return reader.body()


def _require_length(environ: Mapping[str, Any]) -> None:
    """411 for a ``Transfer-Encoding`` body the server does not end (PEP 3333: empty)."""
    if environ.get("wsgi.input_terminated"):
        return
    if str(environ.get("HTTP_TRANSFER_ENCODING") or "").strip():
        raise LengthRequired(
            "the request body came without a Content-Length (Transfer-Encoding), and this "
            "server does not say where it ends; send it with its Content-Length"
        )


def _read(stream: Any, size: int) -> bytes | None:
    """At most ``size`` bytes of the server's stream; None if reading it failed."""
    if stream is None:
        return b""
    try:
        chunk = stream.read(size)
    # Each server says the client went away its own way (NoMoreData, ClientDisconnected, …).
    except Exception:  # noqa: BLE001
        return None
    return bytes(chunk)


class _Captured(ResponseSink):
    """A ``start_response`` and body sink that keep the application's response in memory."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self._status: object = None
        self._headers: list[Any] = []
        self._not_bytes: str | None = None

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], object]:
        # Nothing is sent yet: an error page may replace the headers (PEP 3333, with exc_info).
        if self._status is not None and exc_info is None:
            raise RuntimeError("start_response was called twice without exc_info")
        self._status, self._headers = status, list(headers)
        return self.add  # the legacy ``write`` callable

    def add(self, chunk: object) -> None:
        if isinstance(chunk, bytes | bytearray | memoryview):
            super().add(bytes(chunk))
        else:
            self._not_bytes = self._not_bytes or type(chunk).__name__

    def response(self, classify: Callable[[Response], Any]) -> Response:  # type: ignore[override]
        """The application's response; a ``not_stored`` marker if not whole. Never raises."""
        if self._status is None:
            why = "the WSGI application returned without calling start_response"
            return not_stored(None, why, Verdict.FAILED_PERMANENT)
        status = _STATUS.fullmatch(self._status) if isinstance(self._status, str) else None
        if status is None:
            why = f"the WSGI application's status {self._status!r} is not '<3 digits> <reason>'"
            return not_stored(None, why, Verdict.FAILED_PERMANENT)
        headers = [_pair(header) for header in self._headers]
        reason = None
        if self._not_bytes is not None:
            reason = f"the application yielded a {self._not_bytes}, not bytes"
        return super().response(int(status.group(1)), headers, classify, reason)


def _pair(header: Any) -> tuple[Any, Any]:
    """A header as the application passed it; anything but a pair is an unsendable name."""
    if isinstance(header, tuple | list) and len(header) == 2:
        return header[0], header[1]
    return header, ""


def send(start_response: StartResponse, response: Response) -> list[bytes]:
    """Answer with an idemflow Response: status line, headers, its Content-Length, its body."""
    headers = [
        (name, value) for name, value in response.headers if name.lower() not in _NOT_FORWARDED
    ]
    if response.status >= 200 and response.status not in (204, 304):
        headers.append(("Content-Length", str(len(response.body))))
    start_response(status_line(response.status), headers)
    return [response.body]


def status_line(status: int) -> str:
    """``201 Created``: WSGI wants the reason phrase; an unregistered status gets its class's."""
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} {_CLASS_PHRASES.get(status // 100, 'Unknown')}"


_CLASS_PHRASES = {2: "Success", 3: "Redirection", 4: "Client Error", 5: "Server Error"}


#: Importable from here with a DeprecationWarning until 0.3.
__getattr__ = moved(
    __name__,
    {name: f"{__name__}:_{name}" for name in ("Endpoint", "compile_endpoint", "require_length")},
)
