"""The operator's questions (see `idemflow.stores.stats`), asked of Redis."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._model import State
from ..stats import OldestClaim, StoreStats
from ._scripts import EXPIRES, FIELDS, IN_PROGRESS, STALE, ms, text, translated
from ._scripts import record_from_fields as decoded

if TYPE_CHECKING:
    from ._scripts import Layout

__all__ = ["AsyncRedisObservable", "RedisObservable", "RedisStats"]


class RedisObservable:
    """The sync store's stats (a base of the generated store: only the sync one answers)."""

    client: Any
    layout: Layout

    def stats(self) -> RedisStats:
        """What ``idemflow stats`` and the stuck-claims gauge read."""
        return RedisStats(self.layout.prefix, self.client, self.layout)

    #: The name this method had before the Protocol declared ``stats()``.
    stats_source = stats


class AsyncRedisObservable:
    """Nothing: the async store's stats are refused (scrapes and the CLI ask synchronously)."""


class RedisStats:
    """The operator's questions, asked of the bucket indexes (one round trip per chunk); only
    the breakdown by state and endpoint reads every record (``SCAN``)."""

    def __init__(self, table: str, client: Any, layout: Layout) -> None:
        self.table = table
        self._client = client
        self._layout = layout

    def stuck_claims(self, cutoff: float) -> dict[str, int]:
        (stale,) = self._sums(lambda pipe, idx: pipe.zcard(idx[STALE]))
        with translated():
            running = sum(1 for dated, _ in self._in_progress() if dated < ms(cutoff))
        return {State.IN_PROGRESS.value: running, State.STALE.value: stale}

    def expired(self, now: float) -> int:
        """Expiry entries past ``now``: records not purged yet (or just deleted by their TTL)."""
        (expired,) = self._sums(lambda pipe, idx: pipe.zcount(idx[EXPIRES], "-inf", ms(now)))
        return expired

    def snapshot(self, now: float, request_timeout: float, stale_after: float) -> StoreStats:
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

    def _in_progress(self) -> list[tuple[int, bytes]]:
        """Every claim in flight as (``updated_at`` in ms, its key). The index is scored by
        each claim's own deadline, so its age is read from the records: as many as are in
        flight, two round trips per chunk of buckets."""
        dated: list[tuple[int, bytes]] = []
        for chunk in self._layout.walk():
            pipe = self._client.pipeline(transaction=False)
            for bucket in chunk:
                pipe.zrange(self._layout.indexes(bucket)[IN_PROGRESS], 0, -1)
            members = [member for found in pipe.execute() for member in found]
            pipe = self._client.pipeline(transaction=False)
            for member in members:
                pipe.hmget(member, "state", "updated_at")
            for member, (state, updated_at) in zip(members, pipe.execute(), strict=True):
                if state == b"in_progress" and updated_at is not None:
                    dated.append((int(updated_at), member))
        return dated

    def _oldest_in_progress(self) -> OldestClaim | None:
        oldest = min(self._in_progress(), default=None)
        if oldest is None:
            return None
        found = decoded(self._client.hmget(oldest[1], FIELDS))
        if found is None:
            return None
        return OldestClaim(
            found.principal, found.key, found.endpoint, found.created_at, found.updated_at
        )
