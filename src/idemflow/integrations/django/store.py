"""Moved: `DjangoStore` lives in ``idemflow.stores.django``."""

from __future__ import annotations

from ..._deprecation import moved

__all__: list[str] = []

#: Issue 32: importable from here, with a DeprecationWarning, until 0.3.
__getattr__ = moved(
    __name__,
    {
        "DjangoStore": "idemflow.stores.django:DjangoStore",
        "DjangoTransaction": "idemflow.integrations.django:DjangoTransaction",
        "dialect_for": "idemflow.stores.django:dialect_for",
    },
)
