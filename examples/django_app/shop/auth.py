"""
Stand-in authentication for the example: the caller names itself in ``X-User``.

Your project has real authentication (sessions, tokens, OAuth); idemflow only
needs it to have run, so that ``request.user`` is the caller.
"""

from dataclasses import dataclass

from rest_framework.authentication import BaseAuthentication


@dataclass(frozen=True)
class HeaderUser:
    pk: str
    is_authenticated: bool = True
    is_active: bool = True


class HeaderUserMiddleware:
    """Sets ``request.user`` from ``X-User`` (after Django's AuthenticationMiddleware)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        name = request.headers.get("X-User")
        if name:
            request.user = HeaderUser(name)
        return self.get_response(request)


class HeaderAuthentication(BaseAuthentication):
    """The same, the way DRF authenticates: inside the view."""

    def authenticate(self, request):
        name = request.headers.get("X-User")
        return (HeaderUser(name), None) if name else None

    def authenticate_header(self, request):
        return "X-User"
