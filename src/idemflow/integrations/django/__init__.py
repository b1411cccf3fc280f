"""
idemflow for Django (``pip install 'idemflow[django]'``, ``[drf]`` for DRF): add
``"idemflow.integrations.django"`` to ``INSTALLED_APPS``, protect views with `idempotent`
or `IdempotencyMiddleware`; ``manage.py idemflow_sweep`` and ``idemflow_purge`` maintain
the table. The whole story: docs/frameworks/django.md.
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
