"""What an operator asks a key store (counts by state, what is stuck, what is due): the
`StatsSource` a store's [`stats()`][idemflow.stores.protocol.Store.stats] returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .._deprecation import moved
from .._model import State

__all__ = ["StoreStats"]

#: States a stuck claim can be in: never swept, or swept and not yet resolved.
STUCK_STATES = (State.IN_PROGRESS, State.STALE)


@dataclass(frozen=True, slots=True)
class OldestClaim:
    """The ``in_progress`` record untouched the longest. Times are epoch seconds."""

    principal: str
    key: str
    endpoint: str
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class StoreStats:
    """One snapshot of a key table, as ``idemflow stats`` prints it."""

    table: str
    now: float
    request_timeout: float
    stale_after: float
    counts: tuple[tuple[str, str, int], ...]
    oldest_in_progress: OldestClaim | None
    past_request_timeout: int
    past_stale_threshold: int
    expired_unpurged: int

    @property
    def total(self) -> int:
        return sum(n for _, _, n in self.counts)

    def by_state(self) -> dict[str, int]:
        """Records per state, every state listed (zero included)."""
        totals = dict.fromkeys((state.value for state in State), 0)
        for state, _, n in self.counts:
            totals[state] = totals.get(state, 0) + n
        return totals


class StatsSource(Protocol):
    """**Protocol:** the questions a store answers for operators."""

    table: str

    def stuck_claims(self, cutoff: float) -> dict[str, int]:
        """``in_progress`` records untouched since ``cutoff`` and ``stale`` ones, by state."""

    def snapshot(self, now: float, request_timeout: float, stale_after: float) -> StoreStats:
        """Everything ``idemflow stats`` shows."""

    def expired(self, now: float) -> int:
        """Records past their retention, not purged yet."""


#: Names of 0.1, importable from here with a DeprecationWarning until 0.3.
__getattr__ = moved(__name__, {"stats_refused": "idemflow.stores.protocol:_stats_refused"})
