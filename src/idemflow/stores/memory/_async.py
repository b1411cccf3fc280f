"""An in-memory store for users' own tests, following the SQL stores to the letter.
This is the async source of truth; ``idemflow/stores/memory/_sync.py`` is generated
from it by ``scripts/unasync.py``.
"""

from __future__ import annotations

import dataclasses
import math

from ..._errors import LeaseLost
from ..._model import Claim, Intent, Record, Response, State, can_take_over, is_past_retention
from ..protocol import AsyncMaintainableStore, AsyncTransaction
from ._table import TableStore, claimed, sweepable

__all__ = ["AsyncMemoryStore"]


class AsyncMemoryStore(TableStore, AsyncMaintainableStore):
    """A dict and a lock: thread-safe, not shared between processes, no shared transaction.

    ``store``: share the records of another memory store, sync or async (a
    test's sweeper and its app, say).
    """

    supports_transactions = False
    supports_single_commit = False
    renews_claims = True

    async def claim(
        self,
        intent: Intent,
        lease_token: str,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> Claim:
        with self._lock:
            slot = (intent.principal, intent.key)
            current = self.records.get(slot)
            if current is not None and not can_take_over(current, intent.fingerprint, now):
                return Claim(owned=False, record=current)
            record = claimed(current, intent, lease_token, now, expires_at, self._ids)
            self.records[slot] = record
            return Claim(owned=True, record=record)

    async def complete(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        settled = {"state": state, "response": response, "expires_at": expires_at}
        if not self._update_owned(record, updated_at=now, **settled):
            msg = "the claim on this Idempotency-Key was taken over before completion"
            raise LeaseLost(msg)

    async def release(
        self, record: Record, now: float, transaction: AsyncTransaction | None = None
    ) -> bool:
        return self._update_owned(record, state=State.RELEASED, updated_at=now)

    async def checkpoint(
        self,
        record: Record,
        recovery_point: str,
        now: float,
        transaction: AsyncTransaction | None = None,
    ) -> None:
        if not self._update_owned(record, recovery_point=recovery_point, updated_at=now):
            msg = "the claim on this Idempotency-Key was taken over"
            raise LeaseLost(msg)

    async def renew(self, record: Record, now: float) -> None:
        if not self._update_owned(record, updated_at=now):
            raise LeaseLost("the claim on this Idempotency-Key was taken over")

    async def get(self, principal: str, key: str) -> Record | None:
        with self._lock:
            return self.records.get((principal, key))

    async def sweep(
        self, from_state: State, cutoff: float, now: float, keep_until: float, limit: int
    ) -> list[Record]:
        with self._lock:
            due = sorted(
                (
                    r
                    for r in self.records.values()
                    if r.state is from_state and r.updated_at < cutoff and sweepable(r)
                ),
                key=lambda r: r.updated_at,
            )[:limit]
            marked = [
                dataclasses.replace(
                    r, state=State.STALE, updated_at=now, expires_at=max(r.expires_at, keep_until)
                )
                for r in due
            ]
            for record in marked:
                self.records[record.principal, record.key] = record
            return marked

    async def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
        with self._lock:
            oldest = min(
                (
                    r.updated_at
                    for r in self.records.values()
                    if r.state is from_state and sweepable(r)
                ),
                default=math.inf,
            )
        return oldest - cutoff

    async def settle_stale(
        self,
        record: Record,
        state: State,
        response: Response,
        now: float,
        expires_at: float,
        transaction: AsyncTransaction | None = None,
    ) -> bool:
        settled = {"state": state, "response": response, "expires_at": expires_at}
        return self._update_marked(record, updated_at=now, **settled)

    async def release_stale(
        self,
        record: Record,
        now: float,
        transaction: AsyncTransaction | None = None,
        *,
        forget_progress: bool = False,
    ) -> bool:
        point = None if forget_progress else record.recovery_point
        return self._update_marked(
            record, state=State.RELEASED, updated_at=now, recovery_point=point
        )

    async def purge(self, now: float, limit: int) -> int:
        with self._lock:
            expired = [slot for slot, r in self.records.items() if is_past_retention(r, now)][
                :limit
            ]
            for slot in expired:
                del self.records[slot]
            return len(expired)
