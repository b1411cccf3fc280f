"""The memory stores (sync and async): a dict and a lock, following the SQL stores to the
letter. Nothing here waits: the async store answers its coroutines from the same logic."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from ..._errors import LeaseLost
from ..._model import (
    DEFAULT_STALE_SECONDS,
    Claim,
    Intent,
    Record,
    Response,
    State,
    can_take_over,
    is_past_retention,
    starts_new_intent,
)
from ..protocol import AsyncMaintainableStore, AsyncTransaction, MaintainableStore, Transaction
from ._table import MemoryStats, MemoryTable, SharesTable

__all__ = ["AsyncMemoryStore", "MemoryStore"]

#: What an owner's write refused for its lease lost says.
LOST = "the claim on this Idempotency-Key was taken over"


class MemoryStore(MaintainableStore):
    """A dict and a lock: thread-safe, not shared between processes, no shared transaction.

    ``store``: share the records of another memory store, sync or async (a
    test's sweeper and its app, say).
    """

    supports_transactions = False
    supports_single_commit = False
    renews_claims = True

    def __init__(self, store: SharesTable | None = None) -> None:
        self.table = MemoryTable() if store is None else store.table
        self.records = self.table.records
        self._thresholds = self.table.thresholds
        self._lock = self.table.lock
        self._ids = self.table.ids

    def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: Transaction | None = None,
        *,
        stale_after: float = DEFAULT_STALE_SECONDS,
    ) -> Claim:
        with self._lock:
            slot = (intent.principal, intent.key)
            current = self.records.get(slot)
            if current is not None and not can_take_over(current, intent.fingerprint, now):
                return Claim(owned=False, record=current)
            record = _claimed(current, intent, lease_token, now, expires_at, stale_after, self._ids)
            self.records[slot] = record
            self._thresholds[slot] = stale_after
            return Claim(owned=True, record=record)

    def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: Transaction | None = None,
    ) -> None:
        settled = {"state": state, "response": response, "expires_at": expires_at}
        if not self._update(record, False, updated_at=now, **settled):
            raise LeaseLost(LOST + " before completion")

    def release(self, record: Record, now: float, transaction: Transaction | None = None) -> bool:
        return self._update(record, False, state=State.RELEASED, updated_at=now, stale_at=now)

    def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: Transaction | None = None,
    ) -> None:
        if not self._update(
            record, False, recovery_point=recovery_point, updated_at=now, stale_at=now
        ):
            raise LeaseLost(LOST)

    def renew(self, record: Record, now: float) -> None:
        if not self._update(record, False, updated_at=now, stale_at=now):
            raise LeaseLost(LOST)

    def get(self, principal: str, key: str) -> Record | None:
        with self._lock:
            return self.records.get((principal, key))

    def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        with self._lock:
            due = [r for r in self._sweepable(from_state) if _stale_at(r) < cutoff]
            marked = [
                dataclasses.replace(
                    r,
                    state=State.STALE,
                    updated_at=now,
                    stale_at=now,
                    expires_at=max(r.expires_at, keep_until),
                )
                for r in sorted(due, key=_stale_at)[:limit]
            ]
            for record in marked:
                self.records[record.principal, record.key] = record
            return marked

    def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
        with self._lock:
            oldest = min(map(_stale_at, self._sweepable(from_state)), default=math.inf)
        return oldest - cutoff

    def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: Transaction | None = None,
    ) -> bool:
        settled = {"state": state, "response": response, "expires_at": expires_at}
        return self._update(record, True, updated_at=now, **settled)

    def release_stale(
        self,
        record: Record,
        now: float,
        transaction: Transaction | None = None,
        *,
        forget_progress: bool = False,
    ) -> bool:
        point = None if forget_progress else record.recovery_point
        changes = {"state": State.RELEASED, "stale_at": now, "recovery_point": point}
        return self._update(record, True, updated_at=now, **changes)

    def purge(self, now: float, limit: int) -> int:
        with self._lock:
            expired = [slot for slot, r in self.records.items() if is_past_retention(r, now)][
                :limit
            ]
            for slot in expired:
                del self.records[slot]
                self._thresholds.pop(slot, None)
            return len(expired)

    def stats(self) -> MemoryStats:
        """The operator's questions (``idemflow stats``, the stuck-claims gauge), from the dict."""
        return MemoryStats(self.table)

    def _sweepable(self, from_state: State) -> list[Record]:
        """The records in ``from_state`` the sweeper may act on (a released one only past a
        recovery point, as the SQL stores): call it holding the lock."""
        return [
            r
            for r in self.records.values()
            if r.state is from_state
            and (r.state is not State.RELEASED or r.recovery_point is not None)
        ]

    def _update(self, record: Record, marked: bool, **changes: Any) -> bool:
        """Write ``changes`` if the record is still the caller's: its owner's claim in progress,
        or exactly as this sweeper ``marked`` it. A ``stale_at`` given is the write's now: the
        deadline is that plus the record's own threshold (SQL: ``:now + stale_after``)."""
        with self._lock:
            slot = (record.principal, record.key)
            current = self.records.get(slot)
            if current is None or (current != record if marked else not _owned(current, record)):
                return False
            if "stale_at" in changes:
                changes["stale_at"] += self._thresholds.get(slot, DEFAULT_STALE_SECONDS)
            self.records[slot] = dataclasses.replace(current, **changes)
            return True


class AsyncMemoryStore(AsyncMaintainableStore):
    """`MemoryStore` answering coroutines (nothing here waits): thread-safe, not shared
    between processes, no shared transaction.

    ``store``: share the records of another memory store, sync or async (a
    test's sweeper and its app, say).
    """

    supports_transactions = False
    supports_single_commit = False
    renews_claims = True

    def __init__(self, store: SharesTable | None = None) -> None:
        self._store = MemoryStore(store)
        self.table = self._store.table
        self.records = self._store.records

    async def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
        *,
        stale_after: float = DEFAULT_STALE_SECONDS,
    ) -> Claim:
        return self._store.claim(intent, lease_token, now, expires_at, stale_after=stale_after)

    async def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        self._store.complete(record, state, response, now, expires_at)

    async def release(
        self, record: Record, now: float, transaction: AsyncTransaction | None = None
    ) -> bool:
        return self._store.release(record, now)

    async def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        self._store.checkpoint(record, recovery_point, now)

    async def renew(self, record: Record, now: float) -> None:
        self._store.renew(record, now)

    async def get(self, principal: str, key: str) -> Record | None:
        return self._store.get(principal, key)

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        return self._store.sweep(from_state, cutoff, now, keep_until, limit)

    async def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
        return self._store.next_due(from_state, cutoff, now)

    async def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> bool:
        return self._store.settle_stale(record, state, response, now, expires_at)

    async def release_stale(
        self,
        record: Record,
        now: float,
        transaction: AsyncTransaction | None = None,
        *,
        forget_progress: bool = False,
    ) -> bool:
        return self._store.release_stale(record, now, forget_progress=forget_progress)

    async def purge(self, now: float, limit: int) -> int:
        return self._store.purge(now, limit)

    def stats(self) -> MemoryStats:
        """The operator's questions (``idemflow stats``, the stuck-claims gauge), from the dict."""
        return self._store.stats()


def _claimed(
    current: Record | None,
    intent: Intent,
    lease_token: str,
    now: float,
    expires_at: float,
    stale_after: float,
    ids: itertools.count[int],
) -> Record:
    kept = (
        None if current is None or starts_new_intent(current, intent.fingerprint, now) else current
    )
    return Record(
        id=next(ids) if current is None else current.id,
        principal=intent.principal,
        key=intent.key,
        fingerprint=intent.fingerprint,
        endpoint=intent.endpoint,
        state=State.IN_PROGRESS,
        lease_token=lease_token,
        created_at=now if kept is None else kept.created_at,
        updated_at=now,
        expires_at=expires_at,
        correlation_id=intent.correlation_id,
        recovery_point=None if kept is None else kept.recovery_point,
        attempt=1 if kept is None else kept.attempt + 1,
        stale_at=now + stale_after,
    )


def _stale_at(record: Record) -> float:
    """The record's deadline (every record this store wrote has one)."""
    return math.inf if record.stale_at is None else record.stale_at


def _owned(current: Record, record: Record) -> bool:
    return (
        current.id == record.id
        and current.lease_token == record.lease_token
        and current.state is State.IN_PROGRESS
    )
