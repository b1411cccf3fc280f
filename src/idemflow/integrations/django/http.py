"""Moved into `views` (issue 32): importable from here, with a DeprecationWarning, until 0.3."""

from __future__ import annotations

from ..._deprecation import moved

__all__: list[str] = []

__getattr__ = moved(
    __name__,
    {
        name: f"idemflow.integrations.django.views:_{name}"
        for name in (
            "body_limit",
            "django_request",
            "from_django",
            "outcome_unknown_received",
            "request_user",
            "to_django",
        )
    },
)
