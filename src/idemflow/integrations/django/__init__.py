"""
idemflow for Django: ``pip install 'idemflow[django]'`` (``[drf]`` for Django REST framework).

Add ``"idemflow.integrations.django"`` to ``INSTALLED_APPS`` and the key table
lives in your database, created by ``manage.py migrate``.
[`DjangoStore`][idemflow.stores.django.DjangoStore] keeps key records on Django's own
connections, so the completion can be written in the view's
``transaction.atomic()`` ([`DjangoTransaction`][idemflow.integrations.django.DjangoTransaction]);
`idempotent` protects a function view, a class-based view's method or a
DRF action; `IdempotencyMiddleware` protects the endpoints
``IDEMFLOW['endpoints']`` lists; ``manage.py idemflow_sweep`` and
``idemflow_purge`` maintain the table. See ``docs/frameworks/django.md`` for
the whole story, ``ATOMIC_REQUESTS`` included.
"""

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

#: Issue 32: the checked settings are the integration's own, the store lives under
#: ``idemflow.stores``; importable from here, with a DeprecationWarning, until 0.3.
__getattr__ = moved(
    __name__,
    {
        **{name: f"{__name__}.conf:{name}" for name in ("IdemflowSettings", "idemflow_settings")},
        "DjangoStore": "idemflow.stores.django:DjangoStore",
    },
)
