"""Redis and Redis Cluster: key records as hashes, every decision in one Lua script.

No shared transaction with your business write: send ``attempt.downstream_key(step)``
with every external call and reconcile. The design: docs/stores.md, "Redis".
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from ..._deprecation import moved
from ..._extras import optional
from ..._model import Policy
from ..protocol import StoreClock
from . import _scripts
from ._async import AsyncRedisStore
from ._scripts import DEFAULT_PREFIX, is_unavailable
from ._sync import RedisStore

__all__ = ["AsyncRedisStore", "RedisStore", "is_unavailable"]

#: Names of 0.1, importable from here with a DeprecationWarning until 0.3.
__getattr__ = moved(
    __name__,
    {
        "RedisStats": "idemflow.stores.redis._stats:RedisStats",
        **{
            name: f"idemflow.stores.redis._scripts:{name}"
            for name in (
                "EXPIRES",
                "INDEXES",
                "IN_PROGRESS",
                "RELEASED",
                "RETRIES",
                "SCRIPTS",
                "SHAS",
                "STALE",
                "attempt_timeout",
                "record_from_hash",
            )
        },
    },
)


def open_redis(
    url: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    policy: Policy | None = None,
    asynchronous: bool = False,
    clock: StoreClock = "database",
    allow_volatile: bool = False,
) -> RedisStore | AsyncRedisStore:
    """A store on a client made from ``url`` (``redis+cluster://``: a Redis Cluster;
    ``?allow_volatile=1``), its timeouts and retries within ``policy.store_wait_seconds``."""
    with optional("idemflow.stores.redis"):
        from redis.asyncio.retry import Retry as AsyncRetry
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

    url, volatile = _without_option(url, "allow_volatile")
    allow_volatile = allow_volatile or volatile
    cluster = url.lower().startswith("redis+cluster://")
    if cluster:
        url = "redis://" + url.split("://", 1)[1]
    timeout = _scripts.attempt_timeout(policy or Policy())
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        # redis.asyncio's client never retries with the sync Retry.
        "retry": (AsyncRetry if asynchronous else Retry)(
            ExponentialBackoff(cap=min(0.5, timeout / 10), base=0.05), _scripts.RETRIES
        ),
    }
    if asynchronous and url.lower().startswith("redis://"):  # TLS, unix: their own class
        options["connection_class"] = _bounded_writes()
    import redis
    import redis.asyncio

    lib: Any = redis.asyncio if asynchronous else redis
    client = (lib.RedisCluster if cluster else lib.Redis).from_url(url, **options)
    store = AsyncRedisStore if asynchronous else RedisStore
    return store(client, policy=policy, prefix=prefix, clock=clock, allow_volatile=allow_volatile)


@functools.cache
def _bounded_writes() -> type[Any]:
    """redis.asyncio's connection, its socket writes bounded by ``asyncio.timeout`` (redis-py's
    ``asyncio.wait_for`` costs a task and a loop turn per command on Python 3.11), the
    store's scripts packed in one join."""
    from redis.asyncio.connection import Connection
    from redis.exceptions import TimeoutError as RedisTimeoutError

    class BoundedWrites(Connection):
        def pack_command(self, *args: Any) -> Any:
            """The store's scripts (their arguments bytes) packed in one join: redis-py's
            packer costs ~40 bytecodes an argument, ~1,000 a protected request."""
            if args[0] == "EVALSHA":
                try:
                    body = b"".join([b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args[1:]])
                except TypeError:  # an argument not bytes: redis-py encodes it
                    return super().pack_command(*args)
                return [b"*%d\r\n$7\r\nEVALSHA\r\n%s" % (len(args), body)]
            return super().pack_command(*args)

        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            # One command at a time holds a connection: the swap is seen by no other.
            timeout, self.socket_timeout = self.socket_timeout, None
            try:
                if _cannot_wait(self._writer, command):  # no wait to bound: no timer
                    await super().send_packed_command(command, check_health)
                    return
                async with asyncio.timeout(timeout):
                    await super().send_packed_command(command, check_health)
            except TimeoutError:  # what redis-py raises, so its Retry tries again
                raise RedisTimeoutError("Timeout writing to socket") from None
            finally:
                self.socket_timeout = timeout

    return BoundedWrites


def _cannot_wait(writer: Any, command: Any) -> bool:
    """Can sending ``command`` on a connected ``writer`` not wait? asyncio's ``drain()``
    waits only while the transport's buffer is past its high-water mark: from an empty
    buffer, a command no larger cannot get it there (a timer per command cost ~800
    bytecodes a protected request: docs/benchmarks.md)."""
    if writer is None or not isinstance(command, list | bytes):
        return False  # it connects first; or what it is sent is not measured without using it
    transport = writer.transport
    size = len(command) if isinstance(command, bytes) else sum(map(len, command))
    return not transport.get_write_buffer_size() and size <= transport.get_write_buffer_limits()[1]


def _without_option(url: str, name: str) -> tuple[str, bool]:
    """``url`` without the query option ``name`` (redis-py would refuse it), and its truth."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    values = [value for key, value in query if key == name]
    kept = urlencode([(key, value) for key, value in query if key != name])
    truthy = any(value.lower() in ("", "1", "true", "yes") for value in values)
    return urlunsplit(parts._replace(query=kept)), truthy
