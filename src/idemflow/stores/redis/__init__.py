"""
Redis and Redis Cluster: key records as hashes, every decision in one Lua script.

The claim is the seed's ``SET key value NX``, generalised to the record's
whole life. Redis runs a script atomically, so the test and the write have no
window between them, as with ``SET NX``. The claim script writes a fresh
``in_progress`` record if the key is absent (or past its retention), takes
over a *released* record of the same request (keeping its recovery point and
``created_at``), and otherwise returns the record as it stands, so a replay is one round trip.
Completion, release and checkpoint are compare-and-swap scripts on the lease
token, and so are the sweeper's writes, on its mark.

The record lives exactly as in the SQL stores. A claim never expires: an
``in_progress`` record stays until its owner settles or releases it, or until
the sweeper marks it ``stale`` (one sweeper wins), asks the reconciler and
settles or releases it. Its recovery point survives a crash. Only records that
hold nothing left to resolve carry a TTL, the rest of their retention: settled
ones and released ones without a recovery point. ``in_progress``, ``stale``
and released-with-a-recovery-point records never expire by themselves, and
purge never deletes them.

Time is Redis's (``clock="database"``, the default): each script reads
``TIME`` and decides on it, and the instants a caller computed on its own
clock (an expiry, the sweeper's cutoff) keep only their distance from the
caller's now, so hosts whose clocks disagree agree on what is stale or
expired. ``clock="caller"`` takes the caller's times as given (frozen-clock
tests).

Layout. The sweeper needs the records by ``(state, updated_at)``, and in a
Redis Cluster one script may only touch keys of one slot. So every record
falls in one of :data:`BUCKETS` buckets, chosen by a digest of ``(principal,
key)``, and the bucket number is its hash tag; each bucket has four sorted
sets in the same slot, kept by the same scripts, atomically::

    <prefix>:{<bucket>}:k:<len(principal)>:<principal>:<key>   the record (a hash)
    <prefix>:{<bucket>}:i:in_progress   score updated_at   what the sweeper marks
    <prefix>:{<bucket>}:i:stale         score updated_at   what it marks again
    <prefix>:{<bucket>}:i:released      score updated_at   released with a recovery point
    <prefix>:{<bucket>}:i:expires       score expires_at   settled, or released without one

Every script declares every key it reads or writes (the bucket's four indexes,
then the record or records) except for one bounded chore: a settling write
also purges up to two records of its bucket past their retention, so the
expiry index stays bounded even where nobody runs ``idemflow purge`` (TTLs
delete the records, this the index entries they leave). The 1024 tags spread
over the slots of every master. The sweeper and purge walk the buckets from a
random one (concurrent sweepers rarely meet): a pipelined one-key probe
script per bucket (``ZRANGEBYSCORE`` on its node's clock) says what is due,
then one script per bucket marks (or deletes) those records, re-checking
each, so a record is marked by one sweeper only.

What this store cannot do is share a transaction with your business write
(``supports_transactions = False``: passing a transaction is refused before
anything runs). The claim may commit while your database rolls back, and a
completion may be lost after your effect committed. Send
``attempt.downstream_key(step)`` with every external call and reconcile:
see ``docs/stores.md``.
"""

from __future__ import annotations

from typing import Any

from ..._deprecation import moved
from ..._extras import optional
from ..._model import Policy
from ..protocol import StoreClock
from . import _scripts
from ._async import AsyncRedisStore
from ._scripts import DEFAULT_PREFIX, is_unavailable
from ._stats import RedisStats
from ._sync import RedisStore

__all__ = [
    "AsyncRedisStore",
    "RedisStats",
    "RedisStore",
    "is_unavailable",
    "open_redis",
]

#: The store's own layout and scripts (issue 32: a public API chosen on purpose);
#: importable from here, with a DeprecationWarning, until 0.3.
__getattr__ = moved(
    __name__,
    {
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
    """A store on a client made from ``url``; ``redis+cluster://`` means a Redis Cluster.

    ``?allow_volatile=1`` in the URL is ``allow_volatile=True``: a server without
    persistence is accepted (see :class:`RedisStore`). The client's connect and socket
    timeouts, its retries included, fit in ``policy.store_wait_seconds`` (``Policy()``'s
    without one): a hung server is a 503 within it.
    """
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
        # redis.asyncio's client awaits each attempt through its own Retry: given the
        # sync one, it makes one attempt and never retries (a connection the server
        # closed was a 503, where a second attempt on a new one answers).
        "retry": (AsyncRetry if asynchronous else Retry)(
            ExponentialBackoff(cap=min(0.5, timeout / 10), base=0.05), _scripts.RETRIES
        ),
    }
    if asynchronous:
        from redis.asyncio import Redis as AsyncRedis
        from redis.asyncio.cluster import RedisCluster as AsyncCluster

        aclient: Any = (AsyncCluster if cluster else AsyncRedis).from_url(url, **options)
        return AsyncRedisStore(
            aclient, policy=policy, prefix=prefix, clock=clock, allow_volatile=allow_volatile
        )
    from redis import Redis
    from redis.cluster import RedisCluster

    client: Any = (RedisCluster if cluster else Redis).from_url(url, **options)
    return RedisStore(
        client, policy=policy, prefix=prefix, clock=clock, allow_volatile=allow_volatile
    )


def _without_option(url: str, name: str) -> tuple[str, bool]:
    """``url`` without the query option ``name`` (redis-py would refuse it), and its truth."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    values = [value for key, value in query if key == name]
    kept = urlencode([(key, value) for key, value in query if key != name])
    truthy = any(value.lower() in ("", "1", "true", "yes") for value in values)
    return urlunsplit(parts._replace(query=kept)), truthy
