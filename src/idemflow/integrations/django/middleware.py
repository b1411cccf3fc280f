"""``IdempotencyMiddleware``: protect the endpoints ``IDEMFLOW['endpoints']`` names, after
``AuthenticationMiddleware``. docs/frameworks/django.md, "Three ways to protect an endpoint"."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.urls import Resolver404, resolve
from django.utils.module_loading import import_string

from ..._deprecation import moved
from ...edge import SAFE_METHODS
from .conf import idemflow_settings
from .views import check_replay_authorizer, protect

__all__ = ["IdempotencyMiddleware"]

_AUTHENTICATION_MIDDLEWARE = "django.contrib.auth.middleware.AuthenticationMiddleware"
_RAISED = "_idemflow_view_raised"


class IdempotencyMiddleware:
    """See the module's docstring."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        chosen = idemflow_settings()
        _check_order(type(self), chosen.principal is None, chosen.auth_middleware)
        check_replay_authorizer(chosen)  # also without the app in INSTALLED_APPS
        self.get_response = get_response
        given = chosen.endpoints
        table = given if isinstance(given, Mapping) else dict.fromkeys(given)
        #: (method, route) -> the route's policy (None: the settings').
        self.endpoints = {
            _endpoint(entry): chosen.route_policy(policy, f"IDEMFLOW['endpoints'][{entry!r}]")
            for entry, policy in table.items()
        }
        if not self.endpoints:
            msg = "IdempotencyMiddleware protects IDEMFLOW['endpoints']; none are listed"
            raise ImproperlyConfigured(msg)

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        method = str(request.method).upper()
        match = None if method in SAFE_METHODS else _resolve(request)
        if match is None or (method, f"/{match.route}") not in self.endpoints:
            return self.get_response(request)
        public = bool(getattr(match.func, "idemflow_public", False))
        policy = self.endpoints[(method, f"/{match.route}")]
        return protect(
            request, lambda: self._view(request), public=public, match=match, policy=policy
        )

    def _view(self, request: HttpRequest) -> HttpResponseBase:
        """The rest of the stack; the view's exception, answered by Django below us, raised
        again here: it releases the key instead of being stored, and Django answers it above."""
        response = self.get_response(request)
        raised = request.__dict__.pop(_RAISED, None)
        if isinstance(raised, BaseException):
            raise raised
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> None:
        request.__dict__[_RAISED] = exception  # Django goes on to answer it


def _resolve(request: HttpRequest) -> Any:
    try:
        return resolve(request.path_info, urlconf=getattr(request, "urlconf", None))
    except Resolver404:
        return None


def _endpoint(entry: str) -> tuple[str, str]:
    method, _, route = entry.strip().partition(" ")
    route = route.strip()
    if not route.startswith("/") or method.upper() in SAFE_METHODS or not method:
        msg = f"IDEMFLOW['endpoints'] entry {entry!r} must be 'POST /route/<param>' (unsafe method)"
        raise ImproperlyConfigured(msg)
    return method.upper(), route


def _check_order(own: type, default_principal: bool, extra: Any) -> None:
    """Authentication must run before idempotency: keys are never claimed anonymously."""
    paths = list(settings.MIDDLEWARE)
    mine = next((i for i, path in enumerate(paths) if _is(path, own)), len(paths))
    required = list(extra)
    if default_principal:
        required.insert(0, _AUTHENTICATION_MIDDLEWARE)
    for path in required:
        if path not in paths:
            if path == _AUTHENTICATION_MIDDLEWARE and default_principal:
                msg = (
                    "IdempotencyMiddleware reads request.user, but AuthenticationMiddleware is "
                    "not in MIDDLEWARE; add it before IdempotencyMiddleware, or set "
                    "IDEMFLOW['principal']"
                )
                raise ImproperlyConfigured(msg)
            continue
        if paths.index(path) > mine:
            msg = (
                f"IdempotencyMiddleware is placed before {path} in MIDDLEWARE: it would "
                "claim keys before authentication ran; move it after"
            )
            raise ImproperlyConfigured(msg)


def _is(path: str, own: type) -> bool:
    try:
        found = import_string(path)
    except ImportError:
        return False
    return isinstance(found, type) and issubclass(found, own)


#: Issue 32: the middleware's own; importable from here, with a DeprecationWarning, until 0.3.
__getattr__ = moved(
    __name__,
    {"AUTHENTICATION_MIDDLEWARE": f"{__name__}:_AUTHENTICATION_MIDDLEWARE"},
)
