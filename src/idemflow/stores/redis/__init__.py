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

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._model import Policy, State
from ..protocol import StoreClock
from ._async import AsyncRedisStore
from ._scripts import (
    CONNECT_TIMEOUT,
    DEFAULT_PREFIX,
    EXPIRES,
    IN_PROGRESS,
    INDEXES,
    RELEASED,
    RETRIES,
    SCRIPTS,
    SHAS,
    SOCKET_TIMEOUT,
    STALE,
    is_unavailable,
    ms,
    record_from_hash,
    record_from_reply,
    text,
    translated,
)
from ._sync import RedisStore as _GeneratedRedisStore

if TYPE_CHECKING:
    from .._stats import OldestClaim, StoreStats

__all__ = [
    "EXPIRES",
    "INDEXES",
    "IN_PROGRESS",
    "RELEASED",
    "SCRIPTS",
    "SHAS",
    "STALE",
    "AsyncRedisStore",
    "RedisStats",
    "RedisStore",
    "is_unavailable",
    "open_redis",
    "record_from_hash",
]


class RedisStore(_GeneratedRedisStore):
    __doc__ = _GeneratedRedisStore.__doc__

    def stats_source(self) -> RedisStats:
        """What ``idemflow stats`` and the stuck-claims gauge read."""
        return RedisStats(self)


class RedisStats:
    """The operator's questions (``idemflow stats``, the stuck-claims gauge), asked of Redis.

    Counts come from the bucket indexes, one pipelined round trip per
    :data:`PROBE_CHUNK` buckets; only the breakdown by state and endpoint
    reads every record (``SCAN``), as the SQL stores' full scan does.
    """

    def __init__(self, store: RedisStore) -> None:
        self.table = store.layout.prefix
        self._client = store.client
        self._layout = store.layout

    def stuck_claims(self, cutoff: float) -> dict[str, int]:
        running, stale = self._sums(
            lambda pipe, idx: pipe.zcount(idx[IN_PROGRESS], "-inf", f"({ms(cutoff)}"),
            lambda pipe, idx: pipe.zcard(idx[STALE]),
        )
        return {State.IN_PROGRESS.value: running, State.STALE.value: stale}

    def expired(self, now: float) -> int:
        """Expiry entries past ``now``: records not purged yet (or just deleted by their TTL)."""
        (expired,) = self._sums(lambda pipe, idx: pipe.zcount(idx[EXPIRES], "-inf", ms(now)))
        return expired

    def snapshot(self, now: float, request_timeout: float, stale_after: float) -> StoreStats:
        from .._stats import StoreStats

        with translated():
            counts = self._counts()
            oldest = self._oldest_in_progress()
            stuck = self.stuck_claims(now - request_timeout)[State.IN_PROGRESS.value]
            past_stale = self.stuck_claims(now - stale_after)[State.IN_PROGRESS.value]
            expired = self.expired(now)
        return StoreStats(
            table=self.table,
            now=now,
            request_timeout=request_timeout,
            stale_after=stale_after,
            counts=tuple((s, e, n) for (s, e), n in sorted(counts.items())),
            oldest_in_progress=oldest,
            past_request_timeout=stuck,
            past_stale_threshold=past_stale,
            expired_unpurged=expired,
        )

    def _sums(self, *asks: Callable[[Any, tuple[bytes, ...]], object]) -> list[int]:
        """Each question asked of every bucket's indexes, summed; one walk for all."""
        totals = [0] * len(asks)
        with translated():
            for chunk in self._layout.walk():
                pipe = self._client.pipeline(transaction=False)
                for bucket in chunk:
                    for ask in asks:
                        ask(pipe, self._layout.indexes(bucket))
                replies = pipe.execute()
                for n in range(len(asks)):
                    totals[n] += sum(int(count) for count in replies[n :: len(asks)])
        return totals

    def _counts(self) -> Counter[tuple[str, str]]:
        """(state, endpoint) → records, reading every record's two fields (SCAN)."""
        tally: Counter[tuple[str, str]] = Counter()
        batch: list[bytes] = []
        for key in self._client.scan_iter(match=self._layout.record_pattern(), count=1000):
            batch.append(key)
            if len(batch) >= 500:
                self._tally(batch, tally)
                batch = []
        self._tally(batch, tally)
        return tally

    def _tally(self, keys: list[bytes], tally: Counter[tuple[str, str]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(key, "state", "endpoint")
        for state, endpoint in pipe.execute() if keys else []:
            if state is not None:  # deleted by its TTL since the SCAN saw it
                tally[text(state), text(endpoint or b"")] += 1

    def _oldest_in_progress(self) -> OldestClaim | None:
        from .._stats import OldestClaim

        oldest: tuple[float, bytes] | None = None
        for chunk in self._layout.walk():
            pipe = self._client.pipeline(transaction=False)
            for bucket in chunk:
                pipe.zrange(self._layout.indexes(bucket)[IN_PROGRESS], 0, 0, withscores=True)
            for first in pipe.execute():
                if first and (oldest is None or first[0][1] < oldest[0]):
                    oldest = (first[0][1], first[0][0])
        if oldest is None:
            return None
        found = record_from_reply(self._client.hgetall(oldest[1]))
        if found is None:
            return None
        return OldestClaim(
            found.principal, found.key, found.endpoint, found.created_at, found.updated_at
        )


def open_redis(
    url: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    policy: Policy | None = None,
    asynchronous: bool = False,
    clock: StoreClock = "database",
) -> RedisStore | AsyncRedisStore:
    """A store on a client made from ``url``; ``redis+cluster://`` means a Redis Cluster."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    cluster = url.lower().startswith("redis+cluster://")
    if cluster:
        url = "redis://" + url.split("://", 1)[1]
    options: dict[str, Any] = {
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": CONNECT_TIMEOUT,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES),
    }
    if asynchronous:
        from redis.asyncio import Redis as AsyncRedis
        from redis.asyncio.cluster import RedisCluster as AsyncCluster

        aclient: Any = (AsyncCluster if cluster else AsyncRedis).from_url(url, **options)
        return AsyncRedisStore(aclient, policy=policy, prefix=prefix, clock=clock)
    from redis import Redis
    from redis.cluster import RedisCluster

    client: Any = (RedisCluster if cluster else Redis).from_url(url, **options)
    return RedisStore(client, policy=policy, prefix=prefix, clock=clock)
