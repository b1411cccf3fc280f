"""Key stores, one package per backend, imported by path (one never pulls in another's driver).

[`sqlite`][idemflow.stores.sqlite] (the embedded default), [`postgres`][idemflow.stores.postgres]
(psycopg 3), [`mysql`][idemflow.stores.mysql] (MySQL 8, MariaDB), [`redis`][idemflow.stores.redis]
(no shared transaction), [`django`][idemflow.stores.django] (Django's own connections) and
`memory` (tests). The relational ones share `idemflow.stores.sql`
(one executor, and the public ``Dialect``); `idemflow.stores.protocol` is the
contract; [`idemflow.stores.urls`][idemflow.stores.urls] opens a store from a URL.
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
