"""
Key stores. Each backend is its own module, imported by path, so importing
one never pulls in another's driver:

- :mod:`idemflow.stores.sqlite`: ``SQLiteStore`` / ``AsyncSQLiteStore`` (embedded default)
- :mod:`idemflow.stores.postgres`: ``PostgresStore`` / ``AsyncPostgresStore`` (psycopg 3)
- :mod:`idemflow.stores.mysql`: ``MySQLStore`` + ``PyMySQLTransaction`` (MySQL 8, MariaDB; PyMySQL)
- :mod:`idemflow.stores.redis`: ``RedisStore`` / ``AsyncRedisStore`` (Redis and Redis Cluster;
  no shared transaction)
- :mod:`idemflow.stores.memory`: ``MemoryStore`` / ``AsyncMemoryStore`` (for tests)

The contract every store meets is :mod:`idemflow.stores.protocol`.
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
