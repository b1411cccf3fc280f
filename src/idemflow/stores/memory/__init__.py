"""
An in-memory store for users' own tests (and the reference the others match).

``_async.py`` is the source; ``_sync.py`` is generated from it by
``scripts/unasync.py``. Both stores may share one table (``AsyncMemoryStore(store)``).
"""

from ..._deprecation import moved
from ._async import AsyncMemoryStore
from ._sync import MemoryStore

__all__ = [
    "AsyncMemoryStore",
    "MemoryStore",
]

#: Issue 32: the stores' shared table is their own (``AsyncMemoryStore(store)`` shares
#: it); importable from here, with a DeprecationWarning, until 0.3.
__getattr__ = moved(
    __name__,
    {name: f"idemflow.stores.memory._table:{name}" for name in ("MemoryStats", "MemoryTable")},
)
