"""Public names that moved or merged: importable still, with a DeprecationWarning."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

#: The release that removes every name deprecated in this one.
REMOVED_IN = "0.3"


def moved(module: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` answering each old name in ``names`` with its replacement
    (``"package.module:Name"``, imported when used), with a warning naming both."""

    def __getattr__(name: str) -> Any:
        target = names.get(name)
        if target is None:
            msg = f"module {module!r} has no attribute {name!r}"
            raise AttributeError(msg)
        where, _, new = target.partition(":")
        warnings.warn(
            f"{module}.{name} is deprecated: use {where}.{new} (removed in {REMOVED_IN})",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), new)

    return __getattr__
