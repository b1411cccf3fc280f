"""
An in-memory store for users' own tests (and the reference the others match).

``_async.py`` is the source; ``_sync.py`` is generated from it by
``scripts/unasync.py``. Both stores may share one table (``AsyncMemoryStore(store)``).
"""

from ._async import AsyncMemoryStore
from ._sync import MemoryStore
from ._table import MemoryStats, MemoryTable

__all__ = ["AsyncMemoryStore", "MemoryStats", "MemoryStore", "MemoryTable"]
