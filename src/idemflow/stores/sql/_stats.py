"""The operator's questions (see [`idemflow.stores.stats`][idemflow.stores.stats]) on any SQL
store: one statement each, through an index but for the breakdown ``idemflow stats`` asks.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from ..._errors import MissingTable
from ..protocol import Statement
from ..stats import STUCK_STATES, OldestClaim, StoreStats
from .dialect import PAST_RETENTION_SQL, Dialect

__all__ = [
    "AsyncSQLObservable",
    "SQLObservable",
    "SQLStats",
    "is_missing_table",
    "missing_table",
    "missing_table_is_clear",
]


class SQLObservable:
    """What [`SQLStore`][idemflow.stores.sql.SQLStore] adds for operators: its stats."""

    dialect: Dialect
    _read_connect: Callable[[], AbstractContextManager[Any]]
    _pyformat: bool

    def stats(self) -> SQLStats:
        """The operator's questions (``idemflow stats``, the stuck-claims gauge) on this table."""
        return SQLStats(self.dialect.table, self._read_connect, pyformat=self._pyformat)


class AsyncSQLObservable:
    """What [`AsyncSQLStore`][idemflow.stores.sql.AsyncSQLStore] adds: nothing (asked sync)."""


class SQLStats:
    """Stats queries on any SQL store, on the store's own connections."""

    def __init__(
        self, table: str, connect: Callable[[], AbstractContextManager[Any]], *, pyformat: bool
    ) -> None:
        self.table = table
        self._connect = connect
        self._pyformat = pyformat
        self._by_state_endpoint = Statement(
            f"SELECT state, endpoint, COUNT(*) FROM {table} "
            "GROUP BY state, endpoint ORDER BY state, endpoint"
        )
        # Both arms are range scans of the (state, updated_at) index.
        self._stuck = Statement(
            f"SELECT state, COUNT(*) FROM {table} "
            "WHERE (state = 'in_progress' AND updated_at < :cutoff) OR state = 'stale' "
            "GROUP BY state"
        )
        self._in_progress_before = Statement(
            f"SELECT COUNT(*) FROM {table} WHERE state = 'in_progress' AND updated_at < :cutoff"
        )
        self._oldest = Statement(
            f"SELECT principal, idempotency_key, endpoint, created_at, updated_at FROM {table} "
            "WHERE state = 'in_progress' ORDER BY updated_at LIMIT 1"
        )
        # Exactly what purge would delete.
        self._expired = Statement(f"SELECT COUNT(*) FROM {table} WHERE {PAST_RETENTION_SQL}")

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

    def _count(self, statement: Statement, params: Mapping[str, Any]) -> int:
        rows = self._rows(statement, params)
        return int(rows[0][0]) if rows else 0

    def _rows(self, statement: Statement, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
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


@contextmanager
def missing_table_is_clear(table: str) -> Iterator[None]:
    """A missing key table becomes one actionable line instead of a driver error."""
    try:
        yield
    except Exception as exc:
        # The store's own hint (MissingTable) too: the CLI's line names no URL, it has one.
        if not (isinstance(exc, MissingTable) or is_missing_table(exc)):
            raise
        raise missing_table(table) from exc


def missing_table(table: str, store: str = "") -> MissingTable:
    """The one hint for a key table that was never created, from the library and the CLI."""
    # `idemflow migrate` creates idemflow_keys unless told the name.
    named = "" if table == "idemflow_keys" else f" --table {table}"
    if not store:  # the CLI, which was given the URL
        check = " (check --table)" if named else ""
        return MissingTable(f"table {table} does not exist{check}: run idemflow migrate{named}")
    return MissingTable(
        f"table {table} does not exist in the {store} key store: run idemflow migrate "
        f"DATABASE_URL{named} (or store.migrate()) once before serving requests"
    )


def is_missing_table(exc: BaseException) -> bool:
    """SQLite's "no such table", PostgreSQL's 42P01, MySQL's 1146."""
    if isinstance(exc, sqlite3.OperationalError):
        return str(exc).startswith("no such table")
    if getattr(exc, "sqlstate", None) == "42P01":
        return True
    args: tuple[Any, ...] = getattr(exc, "args", ())
    return bool(args) and args[0] == 1146 and "doesn't exist" in str(exc)
