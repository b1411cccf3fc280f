"""An in-memory store for users' own tests (and the reference the others match); both
stores may share one table (``AsyncMemoryStore(store)``)."""

from ..._deprecation import moved
from ._store import AsyncMemoryStore, MemoryStore

__all__ = ["AsyncMemoryStore", "MemoryStore"]

#: Names of 0.1, importable from here with a DeprecationWarning until 0.3.
__getattr__ = moved(
    __name__,
    {name: f"idemflow.stores.memory._table:{name}" for name in ("MemoryStats", "MemoryTable")},
)
