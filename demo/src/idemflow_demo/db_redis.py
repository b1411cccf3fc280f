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

The URL is a ``redis://`` URL as :func:`idemflow.stores.urls.open_async_store`
takes it (``?allow_volatile=1`` accepts a server without persistence), plus
one option of the demo's own, ``key_prefix=NAME`` (default ``idemflow_keys``):
the start of every key the store writes, so several demos can share one server.

The client is the one ``open_async_store`` would make (the same socket
timeouts and bounded retries), on a **blocking** pool of ``--pool-size``
connections: a command waits up to :data:`POOL_TIMEOUT` for a free one, as the
SQL pools do. redis-py's default pool refuses the 101st connection at once
(``MaxConnectionsError``), and a partition that holds every connection's
reply makes a crowd of requests reach it: measured with the storm (100 keys ×
3 clients, partitions of ~1.5 s), 732 answers were 503, 42 releases failed
and 59 keys did not settle in time. ``redis+cluster://`` URLs go through
``open_async_store`` unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from idemflow import ConfigurationError

from .db import KEY_TABLE, SQLitePayments, SQLitePool

__all__ = ["KEY_PREFIX_OPTION", "POOL_TIMEOUT", "RedisDatabase", "open_key_store", "split_prefix"]

#: The demo's own option in a ``redis://`` URL; redis-py never sees it.
KEY_PREFIX_OPTION = "key_prefix"
#: The longest a command waits for a free pooled connection (then a 503).
POOL_TIMEOUT = 5.0
#: What ``idemflow.stores.redis.open_redis`` gives its client (it does not
#: export them): a command's socket timeout, the connect timeout, and the
#: retries of a command whose connection failed (every script is safe to retry).
SOCKET_TIMEOUT, CONNECT_TIMEOUT, RETRIES = 5.0, 2.0, 2


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


def open_key_store(url: str, prefix: str, pool_size: int) -> Any:
    """The async key store on ``url``: a blocking pool of ``pool_size`` connections."""
    from idemflow.stores.urls import open_async_store

    if not url.lower().startswith(("redis://", "rediss://")):
        return open_async_store(url, table=prefix)  # a cluster: its own pools, per node
    from redis.asyncio import BlockingConnectionPool, Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    from idemflow.stores.redis import AsyncRedisStore

    bare, volatile = _without(url, "allow_volatile")
    pool = BlockingConnectionPool.from_url(
        bare,
        max_connections=pool_size,
        timeout=POOL_TIMEOUT,
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=CONNECT_TIMEOUT,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES),
    )
    # from_pool: closing the store's client closes its pool too.
    return AsyncRedisStore(Redis.from_pool(pool), prefix=prefix, allow_volatile=volatile)


def _without(url: str, name: str) -> tuple[str, bool]:
    """``url`` without the query option ``name``, and whether it was set true."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    values = [value for key, value in query if key == name]
    kept = urlencode([(key, value) for key, value in query if key != name])
    truthy = any(value.lower() in ("", "1", "true", "yes") for value in values)
    return urlunsplit(parts._replace(query=kept)), truthy


class RedisDatabase(SQLitePayments):
    """Keys in Redis (:class:`~idemflow.stores.redis.AsyncRedisStore`); payments in SQLite.

    The payments' connections, transaction and start-up are SQLite's (SQLitePayments);
    their transaction is the business rows' own: the key store never joins it.
    """

    single_commit = False
    transactional = False

    def __init__(self, url: str, sqlite_path: Path, *, pool_size: int = 8) -> None:
        try:
            import redis  # noqa: F401 -- the store's driver
        except ImportError as exc:  # pragma: no cover - depends on the install
            msg = "Redis needs the driver: pip install 'idemflow[redis]'"
            raise ConfigurationError(msg) from exc
        self.url, self.prefix = split_prefix(url)
        self.path = sqlite_path
        self.store = open_key_store(self.url, self.prefix, pool_size)
        self.pool = SQLitePool(sqlite_path, pool_size)
        self._stats: Any = None

    def side_store(self) -> Any:
        from idemflow.stores.urls import open_store

        if self._stats is None:
            self._stats = open_store(self.url, table=self.prefix)
        return self._stats

    async def close(self) -> None:
        self.pool.close()
        if self._stats is not None:
            self._stats.close()
        await self.store.close()
