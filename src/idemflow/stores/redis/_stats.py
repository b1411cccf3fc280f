"""The operator's questions (see `idemflow.stores.stats`), asked of Redis."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..._model import State
from ..stats import OldestClaim, StoreStats
from ._scripts import EXPIRES, FIELDS, IN_PROGRESS, STALE, ms, record_from_fields, text, translated

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
        with translated():
            stale = self._sum(lambda pipe, idx: pipe.zcard(idx[STALE]))
            running = _older(self._in_progress(), cutoff)
        return {State.IN_PROGRESS.value: running, State.STALE.value: stale}

    def expired(self, now: float) -> int:
        """Expiry entries past ``now``: records not purged yet (or just deleted by their TTL)."""
        with translated():
            return self._sum(lambda pipe, idx: pipe.zcount(idx[EXPIRES], "-inf", ms(now)))

    def snapshot(self, now: float, request_timeout: float, stale_after: float) -> StoreStats:
        with translated():
            counts = self._counts()
            running = self._in_progress()  # read once: the oldest and both ages from it
            oldest = self._oldest(running)
            expired = self.expired(now)
        return StoreStats(
            table=self.table,
            now=now,
            request_timeout=request_timeout,
            stale_after=stale_after,
            counts=tuple((s, e, n) for (s, e), n in sorted(counts.items())),
            oldest_in_progress=oldest,
            past_request_timeout=_older(running, now - request_timeout),
            past_stale_threshold=_older(running, now - stale_after),
            expired_unpurged=expired,
        )

    def _sum(self, ask: Callable[[Any, tuple[bytes, ...]], object]) -> int:
        """One question asked of every bucket's indexes, its answers summed."""
        total = 0
        for chunk in self._layout.walk():
            pipe = self._client.pipeline(transaction=False)
            for bucket in chunk:
                ask(pipe, self._layout.indexes(bucket))
            total += sum(int(count) for count in pipe.execute())
        return total

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

    def _oldest(self, running: list[tuple[int, bytes]]) -> OldestClaim | None:
        found = record_from_fields(self._client.hmget(min(running)[1], FIELDS)) if running else None
        if found is None:
            return None
        return OldestClaim(
            found.principal, found.key, found.endpoint, found.created_at, found.updated_at
        )


def _older(running: list[tuple[int, bytes]], cutoff: float) -> int:
    """How many claims in flight were last written before ``cutoff``."""
    limit = ms(cutoff)
    return sum(1 for dated, _ in running if dated < limit)
