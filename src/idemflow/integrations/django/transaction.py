"""Moved: import `DjangoTransaction` from ``idemflow.integrations.django``."""

from __future__ import annotations

from ..._deprecation import moved

__all__: list[str] = []

#: Importable from here, with a DeprecationWarning, until 0.3.
__getattr__ = moved(
    __name__, {"DjangoTransaction": "idemflow.integrations.django:DjangoTransaction"}
)
