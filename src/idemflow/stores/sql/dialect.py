"""What a SQL dialect is made of: the statements every relational store speaks, built once
per dialect and table name (times in epoch milliseconds), and the rules they spell in SQL.
A new database: `Dialect.standard`, `dataclasses.replace` for what it spells differently,
`on_database_clock` (``docs/architecture.md``, "Adding a store").
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from ..._deprecation import moved
from ..._errors import InProgress
from ..._model import (
    DEFAULT_STALE_SECONDS,
    Intent,
    Record,
    Response,
    State,
    make_record,
    make_response,
    stored_headers,
)
from ..._model import headers_json as _headers_json  # dialect.headers_json is deprecated
from ..protocol import Statement

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["PURGEABLE_SQL", "Dialect", "create_table", "insert_claim", "on_database_clock"]

COLUMNS = (
    "id", "principal", "idempotency_key", "fingerprint", "endpoint", "state", "lease_token",
    "recovery_point", "correlation_id", "response_status", "response_headers", "response_body",
    "created_at", "updated_at", "expires_at", "attempt", "stale_at",
)  # fmt: skip

#: `is_retry` in SQL (the claimant's ``:fingerprint``).
RETRY_SQL = "(state = 'released' AND fingerprint = :fingerprint)"
#: `is_past_retention` in SQL: settled, or released with nothing to reconcile, and expired.
PAST_RETENTION_SQL = (
    "(expires_at <= :now AND (state IN ('completed', 'failed_permanent') "
    "OR (state = 'released' AND recovery_point IS NULL)))"
)
#: `can_take_over` in SQL.
TAKE_OVER_SQL = f"({RETRY_SQL} OR {PAST_RETENTION_SQL})"
#: `starts_new_intent` in SQL.
NEW_INTENT_SQL = f"({PAST_RETENTION_SQL} AND NOT {RETRY_SQL})"


def _in_state(state: str) -> str:
    """``state = '<state>'`` in a form no index can serve, for statements that name their
    row: a generic plan made on an empty table would otherwise scan the state index
    (tests/stores/test_postgres_plans.py).
    """
    return f"COALESCE(state, '') = '{state}'"


#: The fence every write of an owner carries: our record, our lease, still running.
_OWNED = f"id = :id AND lease_token = :lease_token AND {_in_state('in_progress')}"


# A released record is swept only past a recovery point (an external call may have
# happened): the reconciler settles or undoes it.
SWEEPABLE_SQL = "(state <> 'released' OR recovery_point IS NOT NULL)"
# A record's deadline, from its last write. ``stale_at`` is this version's copy of it, for
# the index: a row an earlier version wrote during a rolling upgrade has none (0) or an
# older one (its take-over left it), so the sweep also asks the write itself.
DEADLINE_SQL = "updated_at + CASE WHEN state = 'stale' THEN 0 ELSE stale_after END"
DUE_SQL = f"stale_at < :cutoff AND {DEADLINE_SQL} < :cutoff"
# Never in flight, being recovered, or released past an external call. Spelled NOT IN so
# no planner serves the purge from the (state, updated_at) index: the expiry index must.
PURGEABLE_SQL = (
    "state NOT IN ('in_progress', 'stale') AND (state <> 'released' OR recovery_point IS NULL)"
)


#: How often a claim is tried again when the record it lost to vanished before it was read.
CLAIM_RETRIES = 3


def claim_busy() -> InProgress:
    """The 409 of a claim that waited its bounded time on another's uncommitted claim."""
    return InProgress("a request with this Idempotency-Key is still in progress")


def claim_unsettled() -> InProgress:
    """The 409 of a claim whose record changed under it `CLAIM_RETRIES` times."""
    return InProgress("the record for this Idempotency-Key keeps changing; retry later")


BY_KEY = "WHERE principal = :principal AND idempotency_key = :key"
#: The time a read is made at, read with the record: the claim decides on it whether a
#: take-over is worth trying (on the database clock, the server's time).
CLOCK_NOW = ":now AS clock_now"

_Statements = TypeVar("_Statements", bound="DataclassInstance")
_CALLER_NOW = re.compile(r"(?<![:\w]):now\b")
_MARK, _CALLER_MARK = "@@server_now@@", "@@caller_now@@"
_INSTANTS = re.compile(r"(?<![:\w]):(expires_at|stale_at|cutoff|keep_until)\b")


def on_database_clock(dialect: _Statements, now_sql: str) -> _Statements:
    """``dialect`` (or any frozen dataclass of statements) on the database server's clock.

    ``:now`` becomes ``now_sql``; ``:expires_at``, ``:stale_at``, ``:cutoff``, ``:keep_until``
    keep their distance from the caller's ``:now``; ``:began_at`` and ``:marked_at`` are sent
    as they are.
    """

    server_now = f"({now_sql})"

    def rewrite(statement: Statement) -> Statement:
        # Instants first: their offsets name the caller's :now, which stays.
        text = _INSTANTS.sub(lambda m: f"({_MARK} + (:{m[1]} - {_CALLER_MARK}))", statement.named)
        text = _CALLER_NOW.sub(_MARK, text)
        return Statement(text.replace(_CALLER_MARK, ":now").replace(_MARK, server_now))

    changes: dict[str, Any] = {}
    for item in fields(dialect):
        value = getattr(dialect, item.name)
        if isinstance(value, Statement):
            changes[item.name] = rewrite(value)
        elif isinstance(value, tuple) and all(isinstance(v, Statement) for v in value):
            changes[item.name] = tuple(rewrite(v) for v in value)
    return dataclasses.replace(dialect, **changes)


@dataclass(frozen=True, slots=True)
class Dialect:
    """Everything a SQL backend says. ``claim`` must be one atomic statement."""

    name: str
    table: str
    ddl: Sequence[str]
    claim: Statement
    take_over: Statement
    select: Statement
    #: ``select`` plus ``clock_now``: the time the claim's take-over test uses.
    read_for_claim: Statement
    complete: Statement
    release: Statement
    checkpoint: Statement
    #: Keep a claim alive (a consumer's lease): date it now, fenced like ``release``.
    renew: Statement
    #: Maintenance: mark a batch stale (those whose ``stale_at`` is before ``:cutoff``),
    #: settle or release what was marked, purge.
    sweep: Statement
    settle_stale: Statement
    release_stale: Statement
    purge: Statement
    #: Run around a claim in the caller's transaction, e.g. to bound its wait on another's.
    before_claim_in_transaction: tuple[Statement, ...] = ()
    after_claim_in_transaction: tuple[Statement, ...] = ()
    #: The claim and, when it loses, the existing record, in one statement (`claim_or_read`),
    #: where a CTE can write (PostgreSQL); else ``claim`` then ``read_for_claim``.
    claim_or_read: Statement | None = None
    #: The sweeper's schedule: ``due_in``, the earliest sweepable record's ``stale_at`` minus
    #: ``:cutoff`` (no row: none). Without it the sweeper passes every interval.
    due: Statement | None = None
    #: Bring a table of an earlier version up to this one (`upgrade_table`): run by
    #: ``migrate`` before ``ddl`` when the table exists without ``stale_at``.
    upgrade: tuple[str, ...] = ()

    @classmethod
    def standard(
        cls,
        name: str,
        table: str,
        ddl: Sequence[str],
        claim: str,
        around_claim_in_transaction: tuple[Sequence[str], Sequence[str]] = ((), ()),
        skip_locked: bool = False,
        upgrade: Sequence[str] = (),
    ) -> Dialect:
        """A dialect whose non-claim statements are plain ANSI SQL; with ``skip_locked`` the
        sweeper's batch skips rows a live completion locked instead of waiting for them."""
        columns = ", ".join(COLUMNS)
        before, after = around_claim_in_transaction
        lock = " FOR UPDATE SKIP LOCKED" if skip_locked else ""
        # The sweeper's fence: the row it marked, unchanged since.
        marked = (
            f"id = :id AND lease_token = :lease_token AND {_in_state('stale')} "
            "AND updated_at = :marked_at"
        )
        # Every owner write that dates the claim moves its deadline by its own threshold.
        deadline = "stale_at = :now + stale_after"
        settle = (
            f"UPDATE {table} SET state = :state, response_status = :status, "
            "response_headers = :headers, response_body = :body, updated_at = :now, "
            "expires_at = :expires_at WHERE"
        )
        return cls(
            name=name,
            table=table,
            ddl=ddl,
            upgrade=tuple(upgrade),
            before_claim_in_transaction=tuple(map(Statement, before)),
            after_claim_in_transaction=tuple(map(Statement, after)),
            claim=Statement(claim),
            take_over=Statement(take_over_claim(table)),
            select=Statement(f"SELECT {columns} FROM {table} {BY_KEY}"),
            read_for_claim=Statement(f"SELECT {columns}, {CLOCK_NOW} FROM {table} {BY_KEY}"),
            complete=Statement(f"{settle} {_OWNED}"),
            release=Statement(
                f"UPDATE {table} SET state = 'released', updated_at = :now, {deadline} "
                f"WHERE {_OWNED}"
            ),
            checkpoint=Statement(
                f"UPDATE {table} SET recovery_point = :recovery_point, updated_at = :now, "
                f"{deadline} WHERE {_OWNED}"
            ),
            renew=Statement(f"UPDATE {table} SET updated_at = :now, {deadline} WHERE {_OWNED}"),
            # The condition is repeated outside the subquery so a row that changed in between
            # is not marked. A CTE, evaluated once: PostgreSQL may rescan an IN (subquery)
            # per row, each rescan skipping the rows already locked: the whole table marked.
            sweep=Statement(
                f"WITH due AS (SELECT id FROM {table} WHERE state = :from_state "
                f"AND {DUE_SQL} AND {SWEEPABLE_SQL} "
                f"ORDER BY stale_at LIMIT :limit{lock}) "
                f"UPDATE {table} SET state = 'stale', updated_at = :now, stale_at = :now, "
                "expires_at = CASE WHEN expires_at < :keep_until THEN :keep_until "
                "ELSE expires_at END "
                "WHERE id IN (SELECT id FROM due) "
                f"AND state = :from_state AND {DUE_SQL} AND {SWEEPABLE_SQL} "
                f"RETURNING {columns}"
            ),
            settle_stale=Statement(f"{settle} {marked}"),
            release_stale=Statement(
                f"UPDATE {table} SET state = 'released', updated_at = :now, {deadline}, "
                "recovery_point = CASE WHEN :forget_progress = 1 THEN NULL "
                f"ELSE recovery_point END WHERE {marked}"
            ),
            purge=Statement(
                f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table} "
                f"WHERE expires_at <= :now AND {PURGEABLE_SQL} ORDER BY expires_at LIMIT :limit)"
            ),
            # The sweep's own condition, without its deadline: the first row in index order.
            due=Statement(
                f"SELECT {DEADLINE_SQL} - :cutoff AS due_in FROM {table} "
                "WHERE state = :from_state "
                f"AND stale_at IS NOT NULL AND {SWEEPABLE_SQL} ORDER BY stale_at LIMIT 1"
            ),
        )


def create_table(
    table: str, *, id_column: str, bigint: str, blob: str, unique: str = "UNIQUE"
) -> list[str]:
    """The key table (unique ``(principal, idempotency_key)``: the claim's decision) and its
    indexes, ``(state, stale_at)`` for the sweeper, ``(state, updated_at)`` for the stats
    and ``expires_at`` for purging."""
    return [
        f"""CREATE TABLE IF NOT EXISTS {table} (
            {id_column},
            principal TEXT NOT NULL,
            idempotency_key TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            endpoint TEXT NOT NULL DEFAULT '',
            state TEXT NOT NULL CHECK (state IN
                ('in_progress', 'completed', 'failed_permanent', 'released', 'stale')),
            lease_token TEXT,
            recovery_point TEXT,
            correlation_id TEXT,
            response_status INTEGER,
            response_headers TEXT,
            response_body {blob},
            created_at {bigint} NOT NULL,
            updated_at {bigint} NOT NULL,
            expires_at {bigint} NOT NULL,
            attempt INTEGER NOT NULL DEFAULT 1,
            {stale_columns(bigint)},
            {unique} (principal, idempotency_key)
        )""",
        f"CREATE INDEX IF NOT EXISTS {table}_state_updated ON {table} (state, updated_at)",
        f"CREATE INDEX IF NOT EXISTS {table}_state_stale ON {table} (state, stale_at)",
        f"CREATE INDEX IF NOT EXISTS {table}_expires ON {table} (expires_at)",
    ]


def stale_columns(bigint: str) -> str:
    """Each record's own stale threshold (ms, chosen at its claim) and the deadline it
    dates (``stale_at``); the defaults only serve rows an earlier version writes."""
    return (
        f"stale_after {bigint} NOT NULL DEFAULT {int(DEFAULT_STALE_SECONDS * 1000)}, "
        f"stale_at {bigint} NOT NULL DEFAULT 0"
    )


def upgrade_table(table: str, bigint: str) -> list[str]:
    """A table of an earlier version given `stale_columns`, each row a deadline from its last
    write (a stale one: its mark); the ``CREATE INDEX`` after it adds the sweeper's index."""
    after, at = stale_columns(bigint).split(", ")
    return [
        f"ALTER TABLE {table} ADD COLUMN {after}",
        f"ALTER TABLE {table} ADD COLUMN {at}",
        f"UPDATE {table} SET stale_at = CASE WHEN state = 'stale' THEN updated_at "
        "ELSE updated_at + stale_after END",
    ]


def insert_claim(table: str) -> str:
    """The claim: ``INSERT … ON CONFLICT (principal, key) DO NOTHING RETURNING``. A row
    back: ours. DO NOTHING locks no existing row, so replays never queue.
    """
    columns = ", ".join(COLUMNS)
    return (
        f"INSERT INTO {table} (principal, idempotency_key, fingerprint, endpoint, "
        "state, lease_token, correlation_id, created_at, updated_at, expires_at, attempt, "
        "stale_after, stale_at) "
        "VALUES (:principal, :key, :fingerprint, :endpoint, 'in_progress', :lease_token, "
        ":correlation_id, :began_at, :now, :expires_at, 1, :stale_after, :stale_at) "
        f"ON CONFLICT (principal, idempotency_key) DO NOTHING RETURNING {columns}"
    )


def claim_or_read(table: str, claim: str) -> str:
    """``claim`` and the row it lost to, in one statement (``claimed`` 1 or 0, with
    ``clock_now``); a holder that committed after its snapshot gives no row: asked again."""
    columns = ", ".join(COLUMNS)
    return (
        f"WITH claimed AS ({claim}) "
        f"SELECT 1 AS claimed, {columns}, {CLOCK_NOW_BIGINT} FROM claimed "
        f"UNION ALL SELECT 0 AS claimed, {columns}, {CLOCK_NOW_BIGINT} FROM {table} "
        f"{BY_KEY} AND NOT EXISTS (SELECT 1 FROM claimed)"
    )


#: `CLOCK_NOW` typed, for the two branches of a UNION.
CLOCK_NOW_BIGINT = "CAST(:now AS BIGINT) AS clock_now"


def take_over_claim(table: str) -> str:
    """The takeover: a compare-and-swap ``UPDATE … WHERE <can_take_over> RETURNING``. A new
    intent resets everything; a retry keeps its recovery point and created_at."""
    columns = ", ".join(COLUMNS)
    expired = NEW_INTENT_SQL
    return (
        f"UPDATE {table} SET fingerprint = :fingerprint, endpoint = :endpoint, "
        "state = 'in_progress', lease_token = :lease_token, "
        "correlation_id = :correlation_id, updated_at = :now, expires_at = :expires_at, "
        "stale_after = :stale_after, stale_at = :stale_at, "
        f"created_at = CASE WHEN {expired} THEN :began_at ELSE created_at END, "
        f"recovery_point = CASE WHEN {expired} THEN NULL ELSE recovery_point END, "
        f"attempt = CASE WHEN {expired} THEN 1 ELSE attempt + 1 END, "
        "response_status = NULL, response_headers = NULL, response_body = NULL "
        "WHERE principal = :principal AND idempotency_key = :key "
        f"AND {TAKE_OVER_SQL} "
        f"RETURNING {columns}"
    )


def claim_params(
    intent: Intent,
    lease_token: str,
    now: float,
    expires_at: float,
    stale_after: float = DEFAULT_STALE_SECONDS,
) -> dict[str, Any]:
    now_ms = int(now * 1000)
    stale_ms = int(stale_after * 1000)
    return {
        "principal": intent.principal,
        "key": intent.key,
        "fingerprint": intent.fingerprint,
        "endpoint": intent.endpoint,
        "lease_token": lease_token,
        "correlation_id": intent.correlation_id,
        "now": now_ms,
        # An identity for downstream keys: the caller's clock, even on the database's.
        "began_at": now_ms,
        "expires_at": int(expires_at * 1000),
        "stale_after": stale_ms,
        "stale_at": now_ms + stale_ms,
    }


def complete_params(
    record: Record, state: State, response: Response, now: float, expires_at: float
) -> dict[str, Any]:
    return {
        "id": record.id,
        "lease_token": record.lease_token,
        "now": int(now * 1000),
        "expires_at": int(expires_at * 1000),
        "state": state.value,
        "status": response.status,
        "headers": _headers_json(response.headers),
        "body": response.body,
    }


def owner_params(record: Record, now: float) -> dict[str, Any]:
    return {"id": record.id, "lease_token": record.lease_token, "now": int(now * 1000)}


def sweep_params(
    from_state: State, cutoff: float, now: float, keep_until: float, limit: int
) -> dict[str, Any]:
    return {
        "from_state": from_state.value,
        "cutoff": int(cutoff * 1000),
        "now": int(now * 1000),
        "keep_until": int(keep_until * 1000),
        "limit": limit,
    }


def row_mapping(description: Sequence[Any], row: Sequence[Any]) -> Mapping[str, Any]:
    return {column[0]: value for column, value in zip(description, row, strict=True)}


_STATES = {state.value: state for state in State}


def record_from_values(row: Sequence[Any], start: int) -> Record:
    """The one record decoder for SQL rows: ``COLUMNS`` from ``start`` (times in ms)."""
    (
        record_id, principal, key, fingerprint, endpoint, state, lease_token,
        recovery_point, correlation_id, status, headers, body,
        created_at, updated_at, expires_at, attempt, stale_at,
    ) = row[start : start + 17]  # fmt: skip
    response = None
    if status is not None:
        if type(body) is not bytes:
            body = bytes(body or b"")
        response = make_response(int(status), body, stored_headers(headers))
    return make_record(
        record_id, principal, key, fingerprint, endpoint, _STATES[state], lease_token,
        created_at / 1000, updated_at / 1000, expires_at / 1000,
        correlation_id, recovery_point, response, int(attempt),
        None if stale_at is None else stale_at / 1000,
    )  # fmt: skip


def record_from_row(row: Mapping[str, Any]) -> Record:
    """`record_from_values` for a row as a mapping (the transaction adapters' shape)."""
    return record_from_values([row[column] for column in COLUMNS], 0)


#: Names of 0.1, importable from here with a DeprecationWarning until 0.3.
__getattr__ = moved(
    __name__,
    {
        "SQLStatement": "idemflow.stores.protocol:Statement",
        "StoreClock": "idemflow.stores.protocol:StoreClock",
        "check_clock": "idemflow.stores.protocol:check_clock",
        "headers_json": "idemflow._model:headers_json",
        **{
            name: f"idemflow.stores.sql._rows:{name}"
            for name in ("RowShape", "row_shape", "stale_params")
        },
    },
)
