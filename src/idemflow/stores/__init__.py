"""
Key stores. Each backend is its own package, self-contained and imported by
path, so importing one never pulls in another's driver:

- :mod:`idemflow.stores.sqlite`: ``SQLiteStore`` / ``AsyncSQLiteStore`` (embedded default)
- :mod:`idemflow.stores.postgres`: ``PostgresStore`` / ``AsyncPostgresStore`` (psycopg 3)
- :mod:`idemflow.stores.mysql`: ``MySQLStore`` (MySQL 8, MariaDB; PyMySQL), with its
  own pool, URL parser and claim algorithm
- :mod:`idemflow.stores.redis`: ``RedisStore`` / ``AsyncRedisStore`` (Redis and Redis Cluster;
  no shared transaction), its Lua scripts beside it
- :mod:`idemflow.stores.memory`: ``MemoryStore`` / ``AsyncMemoryStore`` (for tests)

The relational ones share :mod:`idemflow.stores.sql` (one executor, and the
public :class:`~idemflow.stores.sql.Dialect` a new SQL database is added
with). The contract every store meets is :mod:`idemflow.stores.protocol`;
:mod:`idemflow.stores.urls` opens a store from a URL.
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
