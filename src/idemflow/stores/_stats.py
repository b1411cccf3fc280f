"""
What an operator asks a key store: how many records in which state, what is stuck, what is due.

The metrics gauge (``idemflow.metrics``) and ``idemflow stats`` read the same
numbers from here. On SQL stores every question is one statement, and the
ones asked on every scrape (stuck claims) or every purge (expired records)
run through the ``(state, updated_at)`` and ``(expires_at)`` indexes, so they
stay cheap however large the table grows. The per-state-and-endpoint
breakdown is the one full scan; only ``idemflow stats`` asks it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from .._errors import ConfigurationError
from .._model import State, is_past_retention
from .memory import MemoryStore
from .sql import PAST_RETENTION_SQL, SQLStatement, SQLStore

__all__ = [
    "OldestClaim",
    "StatsSource",
    "StoreStats",
    "missing_table_is_clear",
    "stats_source",
]

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
    """One snapshot of a key table, as ``idemflow stats`` prints it.

    ``past_request_timeout`` counts ``in_progress`` records untouched for longer
    than the request timeout (what the gauge exports: each one is a crashed
    attempt); ``past_stale_threshold`` those the sweeper will take
    (``Policy.stale_after``, derived from the same timeout).
    """

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
        """``in_progress`` records untouched since before ``cutoff``, and every ``stale`` one.

        Keyed by state (``in_progress``, ``stale``); both keys always present.
        """

    def snapshot(self, now: float, request_timeout: float, stale_after: float) -> StoreStats:
        """Everything ``idemflow stats`` shows."""

    def expired(self, now: float) -> int:
        """Records past their retention, not purged yet."""


def stats_source(store: Any) -> StatsSource:
    """The stats view of ``store``; ConfigurationError for a store that has none."""
    # The async SQLite and memory stores wrap a sync one; the async PostgreSQL
    # store does not (open a sync store on the same URL for stats).
    inner = getattr(store, "sync", store)
    if isinstance(inner, SQLStore):
        return SQLStats(inner)
    if isinstance(inner, MemoryStore):
        return MemoryStats(inner)
    own: Callable[[], StatsSource] | None = getattr(inner, "stats_source", None)
    if own is not None:  # a store that answers for itself (Redis)
        return own()
    msg = (
        f"{type(store).__name__} cannot answer stats queries: only the sync SQL, "
        "memory and Redis stores can (open a sync store on the same database)"
    )
    raise ConfigurationError(msg)


# --- SQL ------------------------------------------------------------------------


class SQLStats:
    """Stats queries on any SQL store, on the store's own connections."""

    def __init__(self, store: SQLStore) -> None:
        table = store.dialect.table
        self.table = table
        self._connect: Callable[[], AbstractContextManager[Any]] = store._connect
        self._pyformat: bool = store._pyformat
        self._by_state_endpoint = SQLStatement(
            f"SELECT state, endpoint, COUNT(*) FROM {table} "
            "GROUP BY state, endpoint ORDER BY state, endpoint"
        )
        # Both arms are range scans of the (state, updated_at) index.
        self._stuck = SQLStatement(
            f"SELECT state, COUNT(*) FROM {table} "
            "WHERE (state = 'in_progress' AND updated_at < :cutoff) OR state = 'stale' "
            "GROUP BY state"
        )
        self._in_progress_before = SQLStatement(
            f"SELECT COUNT(*) FROM {table} WHERE state = 'in_progress' AND updated_at < :cutoff"
        )
        self._oldest = SQLStatement(
            f"SELECT principal, idempotency_key, endpoint, created_at, updated_at FROM {table} "
            "WHERE state = 'in_progress' ORDER BY updated_at LIMIT 1"
        )
        # Exactly what purge would delete: not in-flight, stale or
        # released-past-a-recovery-point records, whose expires_at means nothing.
        self._expired = SQLStatement(f"SELECT COUNT(*) FROM {table} WHERE {PAST_RETENTION_SQL}")

    def stuck_claims(self, cutoff: float) -> dict[str, int]:
        rows = self._rows(self._stuck, {"cutoff": _ms(cutoff)})
        counts = {state.value: 0 for state in STUCK_STATES}
        counts.update({str(state): int(n) for state, n in rows})
        return counts

    def expired(self, now: float) -> int:
        return self._count(self._expired, {"now": _ms(now)})

    def snapshot(self, now: float, request_timeout: float, stale_after: float) -> StoreStats:
        counts = tuple(
            (str(state), str(endpoint), int(n))
            for state, endpoint, n in self._rows(self._by_state_endpoint, {})
        )
        oldest = self._rows(self._oldest, {})
        return StoreStats(
            table=self.table,
            now=now,
            request_timeout=request_timeout,
            stale_after=stale_after,
            counts=counts,
            oldest_in_progress=_oldest_claim(oldest[0]) if oldest else None,
            past_request_timeout=self._count(
                self._in_progress_before, {"cutoff": _ms(now - request_timeout)}
            ),
            past_stale_threshold=self._count(
                self._in_progress_before, {"cutoff": _ms(now - stale_after)}
            ),
            expired_unpurged=self.expired(now),
        )

    def _count(self, statement: SQLStatement, params: Mapping[str, Any]) -> int:
        rows = self._rows(statement, params)
        return int(rows[0][0]) if rows else 0

    def _rows(self, statement: SQLStatement, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        text = statement.pyformat if self._pyformat else statement.named
        with missing_table_is_clear(self.table), self._connect() as conn:
            cursor = conn.cursor()
            try:
                cursor.execute(text, statement.bind(params) or {})
                return [tuple(row) for row in cursor.fetchall()]
            finally:
                cursor.close()


def _oldest_claim(row: tuple[Any, ...]) -> OldestClaim:
    principal, key, endpoint, created_at, updated_at = row
    return OldestClaim(principal, key, endpoint, created_at / 1000, updated_at / 1000)


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


# --- memory ---------------------------------------------------------------------


class MemoryStats:
    """The same questions, answered from a :class:`MemoryStore`'s dict."""

    table = "memory"

    def __init__(self, store: MemoryStore) -> None:
        self._store = store

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

    def _records(self) -> list[Any]:
        with self._store._lock:
            return list(self._store.records.values())


# --- errors ---------------------------------------------------------------------


@contextmanager
def missing_table_is_clear(table: str) -> Iterator[None]:
    """A missing key table becomes one actionable line instead of a driver error."""
    try:
        yield
    except Exception as exc:
        if not is_missing_table(exc):
            raise
        msg = f"table {table} does not exist: run idemflow migrate"
        raise ConfigurationError(msg) from exc


def is_missing_table(exc: BaseException) -> bool:
    """SQLite's "no such table", PostgreSQL's 42P01, MySQL's 1146."""
    if isinstance(exc, sqlite3.OperationalError):
        return str(exc).startswith("no such table")
    if getattr(exc, "sqlstate", None) == "42P01":
        return True
    args: tuple[Any, ...] = getattr(exc, "args", ())
    return bool(args) and args[0] == 1146 and "doesn't exist" in str(exc)
