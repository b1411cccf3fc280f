"""``@idempotent``: a Django view run once per ``(principal, Idempotency-Key)`` in the
transaction its completion commits in; `protect`, shared with `IdempotencyMiddleware`.
docs/frameworks/django.md, "Three ways to protect an endpoint"."""

from __future__ import annotations

import functools
import io
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, TypeVar, overload

from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, RequestDataTooBig
from django.core.signals import setting_changed
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.utils.module_loading import import_string

from ..._errors import (
    ConfigurationError,
    IdempotencyError,
    MissingPrincipal,
    OutcomeUnknown,
    ResponseNotStorable,
)
from ..._model import Response
from ...edge import (
    REQUEST_ID_HEADER,
    SAFE_METHODS,
    Edge,
    HTTPRequest,
    RawHeaders,
    RoutePolicy,
    ViewEdges,
    body_cut_short,
    body_too_large,
    declared_length,
    plain_callable,
    problem,
    problem_for,
    raw_headers,
    report_outcome_unknown,
    request_id_from,
    sendable_headers,
    sync_replay_authorizer,
)
from ...stores.django import DjangoTransaction
from ..wsgi import (
    ReplayHook,
    _require_length,
    configured_replay_hook,
    read_body,
    view_options,
)
from .conf import IdemflowSettings, get_idempotency, idemflow_settings

__all__ = ["idempotency_public", "idempotent"]

_View = TypeVar("_View", bound=Callable[..., Any])


@overload
def idempotent(view: _View) -> _View: ...
@overload
def idempotent(
    *,
    public: bool = False,
    validate: Callable[..., object] | None = None,
    serializer: type[Any] | None = None,
    authorize_replay: ReplayHook | None = None,
    policy: RoutePolicy | None = None,
) -> Callable[[_View], _View]: ...


def idempotent(
    view: Any = None,
    *,
    public: bool = False,
    validate: Callable[..., object] | None = None,
    serializer: type[Any] | None = None,
    authorize_replay: ReplayHook | None = None,
    policy: RoutePolicy | None = None,
) -> Any:
    """Protect a view (see the module's docstring).

    Args:
        public: deliberately unauthenticated: keys scoped to ``"anonymous"`` (else 401).
        validate: called with the view's own arguments before the claim.
        serializer: a DRF serializer class validated once before the claim (invalid: a
            400 ``invalid-body`` problem, nothing recorded); passed as ``serializer=``.
        authorize_replay: ``(record) -> bool`` (plain, not ``async def``), asked before
            a replay (False: 403), in place of ``IDEMFLOW['authorize_replay']``.
        policy: this view's [`Policy`][idemflow.Policy], or ``(principal) -> Policy``.
    """
    if authorize_replay is not None:
        sync_replay_authorizer(authorize_replay, "@idempotent(authorize_replay=…)")
    policy = idemflow_settings().route_policy(policy, "@idempotent(policy=…)")

    def decorate(inner: _View) -> _View:
        call, checked = _plain(inner), None if validate is None else _plain(validate)

        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            request = _request_in(args)
            given: dict[str, Any] = {}

            def check() -> None:
                if checked is not None:
                    checked(*args, **kwargs)
                if serializer is not None:
                    given["serializer"] = _validated(serializer, args, request, kwargs)

            return protect(
                request,
                lambda: _rendered(call(*args, **given, **kwargs), args, request, kwargs),
                public=public or bool(getattr(inner, "idemflow_public", False)),
                validate=None if checked is None and serializer is None else check,
                authorize_replay=authorize_replay,
                policy=policy,
            )

        if iscoroutinefunction(inner):
            # Its awaited ORM calls come back to this thread: in the completion's transaction.
            wrapper = functools.wraps(inner)(_awaitable(wrapper))

        alias = idemflow_settings().database
        # A decorated view runs in idemflow's transaction, not in an ATOMIC_REQUESTS one.
        non_atomic = set(getattr(inner, "_non_atomic_requests", set()))
        wrapper._non_atomic_requests = non_atomic | {alias}  # type: ignore[attr-defined]
        _document(wrapper, serializer)
        return wrapper  # type: ignore[return-value]

    return decorate if view is None else decorate(view)


def _validated(serializer: type[Any], args: tuple[Any, ...], request: Any, kwargs: Any) -> Any:
    """``serializer`` on the request's data, validated; InvalidData with its errors if not."""
    view = args[0] if args and args[0] is not request else None
    made_by = getattr(view, "get_serializer_context", None)
    context = made_by() if made_by is not None else {"request": request, "view": view}
    made = serializer(data=request.data, context=context)
    if made.is_valid():
        return made
    raise InvalidData("; ".join(_messages(made.errors)) or "the body is not valid", made.errors)


def _messages(errors: Any, where: str = "") -> list[str]:
    """A serializer's nested errors as ``field: message`` lines."""
    if isinstance(errors, dict):
        return [m for name, value in errors.items() for m in _messages(value, f"{where}{name}.")]
    if isinstance(errors, list):
        return [m for value in errors for m in _messages(value, where)]
    return [f"{where.rstrip('.')}: {errors}" if where else str(errors)]


def _document(wrapper: Any, serializer: type[Any] | None) -> None:
    """Tell drf-spectacular, where the project uses it, what the protection adds."""
    try:
        from ._schema import idempotent_schema
    except ImportError:  # no DRF or no drf-spectacular: no OpenAPI document to tell
        return
    schema = idempotent_schema(wrapper, serializer)
    if schema is not None:
        # Where drf-spectacular reads a view method's own schema (extend_schema does too).
        wrapper.__dict__.setdefault("kwargs", {})["schema"] = schema


def _plain(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` called from sync code: an ``async def`` one through ``async_to_sync``."""
    return async_to_sync(function) if iscoroutinefunction(function) else function


def _awaitable(protected: Callable[..., Any]) -> Callable[..., Any]:
    """``protected`` as an ``async def`` view, so Django awaits it (ASGI or WSGI alike)."""
    in_thread = sync_to_async(protected, thread_sensitive=True)

    async def view(*args: Any, **kwargs: Any) -> Any:
        return await in_thread(*args, **kwargs)

    return view


def idempotency_public(view: _View) -> _View:
    """Mark a view deliberately unauthenticated for `IdempotencyMiddleware`."""
    view.idemflow_public = True  # type: ignore[attr-defined]
    return view


def _request_in(args: tuple[Any, ...]) -> Any:
    """The request among a view's first arguments (``request``, or ``self, request``)."""
    for candidate in args[:2]:
        if isinstance(getattr(candidate, "_request", candidate), HttpRequest):
            return candidate
    msg = "@idempotent decorates views: no HttpRequest among the first arguments"
    raise TypeError(msg)


def _rendered(response: Any, args: tuple[Any, ...], request: Any, kwargs: Any) -> Any:
    """A DRF Response, finalized by its view and rendered: the bytes that are sent."""
    render = getattr(response, "render", None)
    if render is None or getattr(response, "is_rendered", True):
        return response
    view = args[0] if args and args[0] is not request else None
    finalize = getattr(view, "finalize_response", None)
    if finalize is not None and getattr(response, "accepted_renderer", None) is None:
        view_args = args[2:] if view is not None else args[1:]
        response = finalize(request, response, *view_args, **kwargs)
    return response.render()


#: Runs the protected view and returns its Django response.
ViewCall = Callable[[], HttpResponseBase]

_INVALID = "Invalid request body"
_REPLAY_SETTING = "settings.IDEMFLOW['authorize_replay']"
_PRINCIPAL_SETTING = "settings.IDEMFLOW['principal']"


def _request_user(request: Any) -> str | None:
    """``request.user``'s primary key, never its username (which can change hands)."""
    user = getattr(request, "user", None)
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    return str(user.pk)


def _principal_getter(chosen: IdemflowSettings) -> Callable[[Any], str | None]:
    getter = chosen.principal
    if getter is None:
        return _request_user
    if isinstance(getter, str):
        getter = import_string(getter)
    if not callable(getter):
        raise ConfigurationError("settings.IDEMFLOW['principal'] must be a callable or its path")
    return plain_callable(getter, _PRINCIPAL_SETTING, "(request) -> str | None")  # type: ignore[no-any-return]


def check_replay_authorizer(chosen: IdemflowSettings) -> None:
    """The replay hook and a principal callable checked at start-up: ImproperlyConfigured."""
    try:
        configured_replay_hook(chosen.authorize_replay, _REPLAY_SETTING)
        if callable(chosen.principal):
            plain_callable(chosen.principal, _PRINCIPAL_SETTING, "(request) -> str | None")
    except ConfigurationError as exc:
        raise ImproperlyConfigured(str(exc)) from exc


def _headers(request: HttpRequest) -> RawHeaders:
    return raw_headers(request.META)


def _body_limit(max_body_bytes: int) -> int:
    """``max_body_bytes``, lowered by Django's ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (None: off)."""
    django_cap = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    return max_body_bytes if django_cap is None else min(max_body_bytes, int(django_cap))


def _body(request: HttpRequest, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes; 413 before reading when the length says so."""
    declared = declared_length(request.META.get("CONTENT_LENGTH"), limit)
    if declared is None and "wsgi.input" in request.META:
        return _unframed(request, limit)
    try:
        body = bytes(request.body)
    except RequestDataTooBig:  # an ASGI body without its length, over Django's own cap
        raise body_too_large(0, limit, streaming=True) from None
    if len(body) > limit:
        raise body_too_large(len(body), limit)
    if declared is not None and len(body) != declared:
        raise body_cut_short(len(body), declared)
    return body


def _unframed(request: HttpRequest, limit: int) -> bytes:
    """A WSGI body without its length (Django would see none): read, bounded, where the
    server ends the stream, and cached as Django caches a body it read; else 411 if chunked."""
    environ = request.META
    if not environ.get("wsgi.input_terminated"):
        _require_length(environ)  # a chunked body: 411
        return bytes(request.body)  # neither a length nor a framing: no body (RFC 9112 6.3)
    body = read_body(environ, limit)
    environ["wsgi.input"] = io.BytesIO(body)
    environ["CONTENT_LENGTH"] = str(len(body))
    # What HttpRequest.body leaves; what was parsed from the empty body (CSRF's POST) goes.
    request._body = body
    request._stream = io.BytesIO(body)
    for parsed in ("_post", "_files"):
        request.__dict__.pop(parsed, None)
    return body


def _django_request(
    request: Any,
    principal: str | None,
    request_id: str,
    limit: int,
    match: Any = None,
    headers: RawHeaders | None = None,
) -> HTTPRequest:
    """``request`` (Django's or DRF's) as the edge sees it, named by its route template."""
    raw: HttpRequest = getattr(request, "_request", request)
    match = match if match is not None else raw.resolver_match
    route = f"/{match.route}" if match is not None and match.route else raw.path
    params = {} if match is None else {str(k): str(v) for k, v in match.kwargs.items()}
    if match is not None:
        params.update({str(i): str(v) for i, v in enumerate(match.args)})
    lines, query = _headers(raw) if headers is None else headers, raw.META.get("QUERY_STRING", "")
    body, method = _body(raw, limit), raw.method or "POST"
    return HTTPRequest(method, route, lines, body, principal, request_id, params, str(query))


def _from_django(response: HttpResponseBase) -> Response:
    """A Django (or rendered DRF) response with its body in memory, as an idemflow Response."""
    if getattr(response, "streaming", False) or not isinstance(response, HttpResponse):
        msg = (
            f"{type(response).__name__} streams its body, which cannot be stored for replay; "
            "return a response with the body in memory from protected views"
        )
        raise ResponseNotStorable(msg)
    headers = [(str(k), str(v)) for k, v in response.items()]
    headers += [("set-cookie", morsel.OutputString()) for morsel in response.cookies.values()]
    return Response(response.status_code, bytes(response.content), tuple(headers))


def _to_django(response: Response) -> HttpResponse:
    """An idemflow Response (a replay, a problem) as a Django one, header for header."""
    result = HttpResponse(content=response.body, status=response.status)
    del result["Content-Type"]  # only the stored headers: no default text/html
    for name, value in sendable_headers(response):
        key, text = name.decode("latin-1"), value.decode("latin-1")
        # Django keeps one value per name: repeated lines (Link, Vary) are joined.
        result[key] = f"{result[key]}, {text}" if key in result else text
    return result


def protect(
    request: Any,
    view: ViewCall,
    *,
    public: bool = False,
    validate: Callable[[], object] | None = None,
    match: Any = None,
    authorize_replay: ReplayHook | None = None,
    policy: RoutePolicy | None = None,
) -> HttpResponseBase:
    """Run ``view`` once per ``(principal, Idempotency-Key)`` in its own transaction.

    ``validate`` runs before the claim: its `InvalidData` is a 400 ``invalid-body``
    problem; anything else it raises passes through, nothing recorded.
    """
    raw = getattr(request, "_request", request)
    headers = _headers(raw)
    rid = request_id_from(headers)
    try:
        prepared = _prepared()  # a bad authorize_replay path: the 500 problem naming it
        edge = prepared.edge(public, authorize_replay, policy)
        if str(raw.method).upper() in SAFE_METHODS:
            msg = f"{raw.method} is idempotent already; protect unsafe methods only"
            raise ConfigurationError(msg)
        who = prepared.principal()(request)
        limit = _body_limit(edge.options.max_body_bytes)
        http = _django_request(request, who, rid, limit, match, headers)
        if not who and not public:
            raise MissingPrincipal("authenticate first: idempotency keys are scoped to the caller")
    except IdempotencyError as exc:
        return _to_django(problem_for(exc, rid))
    if validate is not None:
        try:
            validate()
        except InvalidData as invalid:
            why: dict[str, Any] = {"request_id": rid, "errors": invalid.errors}
            return _to_django(problem(400, _INVALID, invalid.detail, slug="invalid-body", **why))
    ran: list[tuple[HttpResponseBase, Response]] = []

    def handler(attempt: Any) -> Response:
        original = view()
        ran.append((original, _from_django(original)))
        return ran[0][1]

    answer = edge.respond(
        http,
        handler,
        transaction=lambda: nullcontext(DjangoTransaction(prepared.settings.database)),
        single_commit=prepared.settings.single_commit,
    )
    if ran and answer.body is ran[0][1].body and answer.status == ran[0][1].status:
        original = ran[0][0]  # the first execution: the view's own response, cookies and all
        original.headers.setdefault(REQUEST_ID_HEADER, http.request_id)
        return original
    return _to_django(answer)


class InvalidData(Exception):
    """A body ``validate`` refuses: ``detail`` one line, ``errors`` the serializer's."""

    def __init__(self, detail: str, errors: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = errors


class _Prepared:
    """What every protected request of one ``settings.IDEMFLOW`` shares, made once."""

    def __init__(self, chosen: IdemflowSettings) -> None:
        self.settings, driver = chosen, get_idempotency()
        self._authorize_replay = configured_replay_hook(chosen.authorize_replay, _REPLAY_SETTING)
        options = view_options(functools.partial(getattr, chosen))
        self._edges = ViewEdges(functools.partial(Edge, driver), options)
        self._principal: Callable[[Any], str | None] | None = None

    def edge(
        self,
        public: bool,
        authorize_replay: ReplayHook | None = None,
        policy: RoutePolicy | None = None,
    ) -> Edge:
        hook = self._authorize_replay if authorize_replay is None else authorize_replay
        return self._edges(public, hook, policy)

    def principal(self) -> Callable[[Any], str | None]:
        """The principal getter; a bad ``IDEMFLOW['principal']`` raises on each request."""
        if self._principal is None:
            self._principal = _principal_getter(self.settings)
        return self._principal


@functools.cache  # made again after a change of the settings (override_settings)
def _prepared() -> _Prepared:
    return _Prepared(idemflow_settings())


def _forget(*, setting: str, **kwargs: Any) -> None:
    if setting in ("IDEMFLOW", "DATABASES"):
        _prepared.cache_clear()


setting_changed.connect(_forget, dispatch_uid="idemflow-prepared")


def _outcome_unknown_received(sender: Any, request: Any = None, **_: Any) -> None:
    """``got_request_exception``'s receiver: an ``OutcomeUnknown`` Django answered with a
    500 told to an idemflow WSGI/ASGI middleware around it, which then keeps the claim."""
    error = sys.exc_info()[1]
    if request is None or not isinstance(error, OutcomeUnknown):
        return
    slot = getattr(request, "environ", None)
    if slot is None:
        slot = getattr(request, "scope", None)
    if isinstance(slot, dict):
        report_outcome_unknown(slot, error)
