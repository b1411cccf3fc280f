"""What the memory stores (sync and async) hold, and what they answer operators from it."""

from __future__ import annotations

import itertools
import threading
from typing import Protocol

from ..._model import Record, State, is_past_retention
from ..stats import STUCK_STATES, OldestClaim, StoreStats

__all__ = ["MemoryStats", "MemoryTable", "SharesTable"]


class MemoryTable:
    """The records, their lock and their ids: one table any number of memory stores share."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], Record] = {}
        #: Each record's own stale threshold, chosen at its claim (the SQL ``stale_after``).
        self.thresholds: dict[tuple[str, str], float] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count(1)


class SharesTable(Protocol):
    """A memory store, sync or async: anything with a `MemoryTable`."""

    @property
    def table(self) -> MemoryTable: ...


class MemoryStats:
    """The questions `StatsSource` asks, answered from the dict."""

    table = "memory"

    def __init__(self, records: MemoryTable) -> None:
        self._table = records

    def stuck_claims(self, cutoff: float) -> dict[str, int]:
        counts = {state.value: 0 for state in STUCK_STATES}
        for record in self._records():
            if record.state is State.STALE or (
                record.state is State.IN_PROGRESS and record.updated_at < cutoff
            ):
                counts[record.state.value] += 1
        return counts

    def expired(self, now: float) -> int:
        return sum(1 for record in self._records() if is_past_retention(record, now))

    def snapshot(self, now: float, request_timeout: float, stale_after: float) -> StoreStats:
        records = self._records()
        tally: dict[tuple[str, str], int] = {}
        for record in records:
            slot = (record.state.value, record.endpoint)
            tally[slot] = tally.get(slot, 0) + 1
        running = sorted(
            (r for r in records if r.state is State.IN_PROGRESS), key=lambda r: r.updated_at
        )
        oldest = running[0] if running else None
        return StoreStats(
            table=self.table,
            now=now,
            request_timeout=request_timeout,
            stale_after=stale_after,
            counts=tuple((s, e, n) for (s, e), n in sorted(tally.items())),
            oldest_in_progress=None
            if oldest is None
            else OldestClaim(
                oldest.principal, oldest.key, oldest.endpoint, oldest.created_at, oldest.updated_at
            ),
            past_request_timeout=sum(1 for r in running if r.updated_at < now - request_timeout),
            past_stale_threshold=sum(1 for r in running if r.updated_at < now - stale_after),
            expired_unpurged=self.expired(now),
        )

    def _records(self) -> list[Record]:
        with self._table.lock:
            return list(self._table.records.values())
