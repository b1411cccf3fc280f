"""idemflow for Django (``idemflow[django]``, ``[drf]``): the app in ``INSTALLED_APPS``, views
protected by `idempotent` or `IdempotencyMiddleware`. The whole story: docs/frameworks/django.md."""

from __future__ import annotations

from ..._deprecation import moved
from ..._extras import optional

with optional("idemflow.integrations.django"):
    from ...stores.django import DjangoTransaction
    from .conf import get_idempotency, get_store
    from .middleware import IdempotencyMiddleware
    from .views import idempotency_public, idempotent

__all__ = [
    "DjangoTransaction",
    "IdempotencyMiddleware",
    "get_idempotency",
    "get_store",
    "idempotency_public",
    "idempotent",
]

#: Issue 32: importable from here, with a DeprecationWarning, until 0.3.
__getattr__ = moved(
    __name__,
    {
        **{name: f"{__name__}.conf:{name}" for name in ("IdemflowSettings", "idemflow_settings")},
        "DjangoStore": "idemflow.stores.django:DjangoStore",
    },
)
