"""
``@idempotent``: one decorator for function views, class-based view methods and DRF actions.

The view runs once per ``(principal, Idempotency-Key)``, inside a
``transaction.atomic()`` on ``IDEMFLOW['database']`` in which the completion
is written: its ORM writes and the stored response commit together. Retries
get the stored response byte for byte, with ``Idempotent-Replayed: true``.
``validate=`` runs before the claim, and so does a DRF action's ``serializer=``
(validated once, handed to the view; its errors a 400 problem, nothing recorded);
``authorize_replay=`` is asked before a replay; ``async def`` views the same way.
DRF actions, validation, ``async def`` views: docs/frameworks/django.md,
"Three ways to protect an endpoint"; replays: "Authorization on replay";
``ATOMIC_REQUESTS`` (a decorated function view opts out of it, a method runs
inside it, see `DjangoTransaction`): "Transactions,
``ATOMIC_REQUESTS`` and what commits when".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, overload

from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.http import HttpRequest

from ...edge import RoutePolicy, sync_replay_authorizer
from ..wsgi import ReplayHook
from .conf import idemflow_settings
from .http import InvalidData, protect

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
        public: the view is deliberately unauthenticated; its keys are scoped
            to ``"anonymous"``. Otherwise an anonymous request is a 401.
        validate: called with the view's own arguments before the claim.
        serializer: a DRF action's serializer class: built on ``request.data``
            (with the view's serializer context) and validated once, before the
            claim; invalid, a 400 ``invalid-body`` problem whose ``errors`` are the
            serializer's, nothing recorded (the corrected body may keep the key);
            valid, passed to the view as its ``serializer`` keyword argument.
        authorize_replay: ``(record) -> bool``, asked before a stored response
            is replayed (``record.principal`` is the caller); False answers 403.
            Replaces ``IDEMFLOW['authorize_replay']`` for this view. A plain
            function: an ``async def`` one is a ``ConfigurationError`` here.
        policy: this view's [`Policy`][idemflow.Policy] (retention, request timeout;
            its stale threshold within the settings'), or ``(principal) -> Policy``.
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
                public=public or _is_public(inner),
                validate=None if checked is None and serializer is None else check,
                authorize_replay=authorize_replay,
                policy=policy,
            )

        if iscoroutinefunction(inner):
            # An async view runs inside the sync protect(): its transaction.atomic() is
            # thread-bound, and so is Django's connection. The view's coroutine runs on
            # the request's event loop (async_to_sync), and every ORM call it awaits
            # (acreate, sync_to_async) comes back to this thread, on this connection:
            # its writes are in the transaction the completion commits with.
            wrapper = functools.wraps(inner)(_awaitable(wrapper))

        alias = idemflow_settings().database
        # Django reads this off the view it resolved: a decorated function view
        # runs in idemflow's transaction, not in an ATOMIC_REQUESTS one.
        non_atomic = set(getattr(inner, "_non_atomic_requests", set()))
        wrapper._non_atomic_requests = non_atomic | {alias}  # type: ignore[attr-defined]
        _document(wrapper, serializer)
        return wrapper  # type: ignore[return-value]

    return decorate if view is None else decorate(view)


def _validated(serializer: type[Any], args: tuple[Any, ...], request: Any, kwargs: Any) -> Any:
    """``serializer`` on the request's data, validated; InvalidData with its errors if not."""
    view = args[0] if args and args[0] is not request else None
    context = getattr(view, "get_serializer_context", None)
    made = serializer(
        data=request.data,
        context=context() if context is not None else {"request": request, "view": view},
    )
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
        kwargs = wrapper.__dict__.setdefault("kwargs", {})
        kwargs["schema"] = schema


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


def _is_public(view: Any) -> bool:
    return bool(getattr(view, "idemflow_public", False))


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
