"""Key stores, one package per backend, imported by path (one never pulls in another's driver).

:mod:`~idemflow.stores.sqlite` (the embedded default), :mod:`~idemflow.stores.postgres`
(psycopg 3), :mod:`~idemflow.stores.mysql` (MySQL 8, MariaDB), :mod:`~idemflow.stores.redis`
(no shared transaction), :mod:`~idemflow.stores.django` (Django's own connections) and
:mod:`~idemflow.stores.memory` (tests). The relational ones share :mod:`idemflow.stores.sql`
(one executor, and the public ``Dialect``); :mod:`idemflow.stores.protocol` is the
contract; :mod:`idemflow.stores.urls` opens a store from a URL.
"""

from .memory import AsyncMemoryStore, MemoryStore
from .protocol import AsyncStore, AsyncTransaction, Store, Transaction

__all__ = [
    "AsyncMemoryStore",
    "AsyncStore",
    "AsyncTransaction",
    "MemoryStore",
    "Store",
    "Transaction",
]
