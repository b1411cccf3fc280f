"""
The demo with its keys in Redis and its payments in an embedded SQLite file.

Redis cannot join a SQL transaction, so nothing commits the payment row and
the key record together: this is the no-transaction mode (``run()`` without
``transaction=``, see ``docs/crash-safety.md``). Each phase commits its rows
in SQLite first, then its recovery point (or, at the end, the completion) is
written to Redis (:mod:`idemflow_demo.unshared`). A completion that cannot be
written leaves the key claimed: the operation ran, so a retry gets 409 until
the sweeper's reconciler finds out from the provider and the rows what
happened (:mod:`idemflow_demo.recovery`); never a second execution.

The URL is a ``redis://`` URL for :func:`idemflow.stores.urls.open_async_store`
(``?allow_volatile=1`` accepts a server without persistence), plus one option
of the demo's own, ``key_prefix=NAME`` (default ``idemflow_keys``): the start
of every key the store writes, so several demos can share one server.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from idemflow import ConfigurationError
from idemflow.stores.protocol import AsyncTransaction
from idemflow.transactions import AsyncSQLite3Connection, AsyncSQLite3Transaction

from .db import KEY_TABLE, Connection, SQLiteConnection, SQLitePool, create_schema_sqlite

__all__ = ["KEY_PREFIX_OPTION", "RedisDatabase", "split_prefix"]

#: The demo's own option in a ``redis://`` URL; redis-py never sees it.
KEY_PREFIX_OPTION = "key_prefix"


def split_prefix(url: str) -> tuple[str, str]:
    """``redis://h/0?allow_volatile=1&key_prefix=p`` → (the URL without it, ``p``)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefixes = [value for name, value in query if name == KEY_PREFIX_OPTION]
    kept = urlencode([(name, value) for name, value in query if name != KEY_PREFIX_OPTION])
    prefix = prefixes[-1] if prefixes else KEY_TABLE
    if not prefix:
        raise ConfigurationError(f"{KEY_PREFIX_OPTION}= needs a name")
    return urlunsplit(parts._replace(query=kept)), prefix


class RedisDatabase:
    """Keys in Redis (:class:`~idemflow.stores.redis.AsyncRedisStore`); payments in SQLite."""

    single_commit = False
    transactional = False

    def __init__(self, url: str, sqlite_path: Path, *, pool_size: int = 8) -> None:
        from idemflow.stores.urls import open_async_store

        try:
            import redis  # noqa: F401 -- the store's driver
        except ImportError as exc:  # pragma: no cover - depends on the install
            msg = "Redis needs the driver: pip install 'idemflow[redis]'"
            raise ConfigurationError(msg) from exc
        self.url, self.prefix = split_prefix(url)
        self.path = sqlite_path
        self.store = open_async_store(self.url, table=self.prefix)
        self.pool = SQLitePool(sqlite_path, pool_size)
        self._stats: Any = None

    def connect(self) -> AbstractAsyncContextManager[AsyncSQLite3Connection]:
        """A connection to the payments' SQLite file (the keys are not there)."""
        return self.pool.connection()

    def transaction(self, raw: Any) -> AsyncTransaction:
        # The business rows' own transaction: the key store never joins it.
        return AsyncSQLite3Transaction(raw)

    def wrap(self, raw: Any) -> Connection:
        return SQLiteConnection(raw)

    def stats_store(self) -> Any:
        from idemflow.stores.urls import open_store

        if self._stats is None:
            self._stats = open_store(self.url, table=self.prefix)
        return self._stats

    async def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        await self.store.migrate()
        async with self.connect() as pooled:
            await pooled.run(create_schema_sqlite, pooled.raw)

    async def close(self) -> None:
        self.pool.close()
        if self._stats is not None:
            self._stats.close()
        await self.store.close()
