"""MySQL's statements: the table, the guarded takeover upsert, the dialect and the reads it
adds, and what the claim's answers mean (sent by ``_async.py`` and its twin)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._model import Claim, Record, State, can_take_over
from ..protocol import Statement, StoreClock
from ..sql.dialect import (
    BY_KEY,
    CLOCK_NOW,
    COLUMNS,
    DUE_SQL,
    NEW_INTENT_SQL,
    PURGEABLE_SQL,
    SWEEPABLE_SQL,
    TAKE_OVER_SQL,
    Dialect,
    claim_unsettled,
    on_database_clock,
    record_from_row,
    record_from_values,
    stale_columns,
    upgrade_table,
)

DEFAULT_TABLE = "idemflow_keys"
#: How long (whole seconds) a claim waits on a row another transaction holds before a 409.
DEFAULT_LOCK_WAIT_TIMEOUT = 1

# Binary strings come back as bytes; the model wants text.
_TEXT_COLUMNS = {"principal": "utf8mb4", "idempotency_key": "ascii", "fingerprint": "ascii"}
_SELECT_LIST = ", ".join(
    f"CONVERT({c} USING {_TEXT_COLUMNS[c]}) AS {c}" if c in _TEXT_COLUMNS else c for c in COLUMNS
)
#: Left out of ``packed_read``'s JSON array: the body (binary) and the headers (unbounded).
_UNPACKED = ("response_headers", "response_body")
_PACKED = [c for c in COLUMNS if c not in _UNPACKED]
_PACKED_LIST = ", ".join(
    f"CONVERT({c} USING {_TEXT_COLUMNS[c]})" if c in _TEXT_COLUMNS else c for c in _PACKED
)


@dataclass(frozen=True, slots=True)
class MySQLStatements:
    """What MySQL says beyond the shared [`Dialect`][idemflow.stores.sql.Dialect]."""

    #: The plain INSERT that claims a new key (error 1062 when it exists).
    insert: Statement
    #: The claim's read after a duplicate, packed (`unpack_read`): a descriptor packet per
    #: column was a third of a replay's client CPU (``bench/bench_mysql_claim_shapes.py``).
    packed_read: Statement
    #: The current row, read with a lock: the latest committed even under REPEATABLE READ.
    select_current: Statement
    select_shared: Statement
    #: The rows one sweep marked (found by its sweep token).
    swept: Statement
    #: Is the record still ours? For an update that matched but changed nothing.
    still_owned: Statement
    #: Bound, then restore, the caller's lock wait around a claim in its transaction.
    bound_lock_wait: Statement
    restore_lock_wait: Statement
    #: Is this node a Galera (wsrep) node? No row on MySQL 8, ``OFF`` on a plain MariaDB.
    wsrep_on: Statement


def mysql_ddl(table: str) -> list[str]:
    """One ``CREATE TABLE IF NOT EXISTS`` with its indexes (MySQL 8 has no
    ``CREATE INDEX IF NOT EXISTS``, so they live inside it)."""
    return [
        f"""CREATE TABLE IF NOT EXISTS {table} (
            id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
            principal VARBINARY(255) NOT NULL,
            idempotency_key VARBINARY(255) NOT NULL,
            fingerprint VARBINARY(128) NOT NULL,
            endpoint VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL DEFAULT '',
            state VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
            lease_token VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NULL,
            recovery_point VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
            correlation_id VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
            response_status INT NULL,
            response_headers MEDIUMTEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
            response_body LONGBLOB NULL,
            created_at BIGINT NOT NULL,
            updated_at BIGINT NOT NULL,
            expires_at BIGINT NOT NULL,
            attempt INT NOT NULL DEFAULT 1,
            {stale_columns("BIGINT")},
            UNIQUE KEY {table}_principal_key (principal, idempotency_key),
            KEY {table}_state_updated (state, updated_at),
            KEY {table}_state_stale (state, stale_at),
            KEY {table}_expires (expires_at),
            CONSTRAINT {table}_state CHECK (state IN
                ('in_progress', 'completed', 'failed_permanent', 'released', 'stale'))
        ) ENGINE=InnoDB"""
    ]


def mysql_upgrade(table: str) -> list[str]:
    """`upgrade_table`, and the sweeper's index (MySQL 8: no ``CREATE INDEX IF NOT EXISTS``)."""
    index = f"ALTER TABLE {table} ADD KEY {table}_state_stale (state, stale_at)"
    return [*upgrade_table(table, "BIGINT"), index]


def _quiet(ddl: list[str]) -> list[str]:
    """``ddl`` with the session's notes off: ``CREATE TABLE IF NOT EXISTS`` leaves one
    that asyncmy fetches (a round trip) and logs at every start.
    """
    return [
        "SET @idemflow_sql_notes = @@session.sql_notes, SESSION sql_notes = 0",
        *ddl,
        "SET SESSION sql_notes = @idemflow_sql_notes",
    ]


def upsert_claim(table: str) -> str:
    """The takeover: ``INSERT … ON DUPLICATE KEY UPDATE``, every assignment guarded alike.

    The lease token goes first, guarded by the takeover condition on the old row; every
    later one asks "is the token ours now, or does the old row qualify", right whether
    assignments see earlier ones (MySQL) or not (MariaDB). ``state`` and ``expires_at`` go
    last: the others need the old row to tell a new intent from a retry.
    """
    qualifies = TAKE_OVER_SQL
    taken = f"(lease_token <=> :lease_token OR {qualifies})"
    expired = NEW_INTENT_SQL

    def guarded(column: str, value: str) -> str:
        return f"{column} = IF({taken}, {value}, {column})"

    assignments = [
        f"lease_token = IF({qualifies}, :lease_token, lease_token)",
        guarded("created_at", f"IF({expired}, :began_at, created_at)"),
        guarded("recovery_point", f"IF({expired}, NULL, recovery_point)"),
        guarded("attempt", f"IF({expired}, 1, attempt + 1)"),
        guarded("fingerprint", ":fingerprint"),
        guarded("endpoint", ":endpoint"),
        guarded("correlation_id", ":correlation_id"),
        guarded("response_status", "NULL"),
        guarded("response_headers", "NULL"),
        guarded("response_body", "NULL"),
        guarded("updated_at", ":now"),
        guarded("stale_after", ":stale_after"),
        guarded("stale_at", ":stale_at"),
        guarded("state", "'in_progress'"),
        guarded("expires_at", ":expires_at"),
    ]
    return (
        f"INSERT INTO {table} (principal, idempotency_key, fingerprint, endpoint, state, "
        "lease_token, correlation_id, created_at, updated_at, expires_at, attempt, "
        "stale_after, stale_at) "
        "VALUES (:principal, :key, :fingerprint, :endpoint, 'in_progress', :lease_token, "
        ":correlation_id, :began_at, :now, :expires_at, 1, :stale_after, :stale_at) "
        f"ON DUPLICATE KEY UPDATE {', '.join(assignments)}"
    )


#: The server's time in epoch milliseconds, whatever the session's time zone.
SERVER_NOW_MS = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000"


def mysql_dialect(table: str = DEFAULT_TABLE, clock: StoreClock = "database") -> Dialect:
    """The shared fenced UPDATEs, with MySQL's own claim (the guarded upsert, sent only for a
    takeover), read, sweep and purge."""
    standard = Dialect.standard(
        "mysql", table, _quiet(mysql_ddl(table)), upsert_claim(table), upgrade=mysql_upgrade(table)
    )
    dialect = dataclasses.replace(
        standard,
        select=Statement(f"SELECT {_SELECT_LIST} FROM {table} {BY_KEY}"),
        read_for_claim=Statement(f"SELECT {_SELECT_LIST}, {CLOCK_NOW} FROM {table} {BY_KEY}"),
        # No LIMIT inside IN (…), no UPDATE … RETURNING: marked with a token, read back by it.
        sweep=Statement(
            f"UPDATE {table} SET state = 'stale', lease_token = :sweep_token, "
            "updated_at = :now, stale_at = :now, expires_at = GREATEST(expires_at, :keep_until) "
            f"WHERE state = :from_state AND {DUE_SQL} AND {SWEEPABLE_SQL} "
            "ORDER BY stale_at LIMIT :limit"
        ),
        purge=Statement(
            f"DELETE FROM {table} WHERE expires_at <= :now AND {PURGEABLE_SQL} "
            "ORDER BY expires_at LIMIT :limit"
        ),
    )
    return on_database_clock(dialect, SERVER_NOW_MS) if clock == "database" else dialect


def mysql_statements(table: str = DEFAULT_TABLE, clock: StoreClock = "database") -> MySQLStatements:
    """The plain INSERT, the locking reads and the maintenance read-backs."""
    read = f"SELECT {_SELECT_LIST}, {CLOCK_NOW} FROM {table} {BY_KEY}"
    statements = MySQLStatements(
        insert=Statement(upsert_claim(table).split(" ON DUPLICATE KEY UPDATE ")[0]),
        packed_read=Statement(
            f"SELECT JSON_ARRAY({_PACKED_LIST}, :now) AS packed, response_headers, "
            f"response_body FROM {table} {BY_KEY}"
        ),
        select_current=Statement(f"{read} FOR UPDATE"),
        # LOCK IN SHARE MODE: spelled alike by MySQL 8 and MariaDB.
        select_shared=Statement(f"{read} LOCK IN SHARE MODE"),
        swept=Statement(
            f"SELECT {_SELECT_LIST} FROM {table} WHERE state = 'stale' "
            "AND lease_token = :sweep_token ORDER BY updated_at, id"
        ),
        still_owned=Statement(
            f"SELECT id FROM {table} WHERE id = :id AND lease_token = :lease_token "
            "AND state = 'in_progress' FOR UPDATE"
        ),
        bound_lock_wait=Statement(
            "SET @idemflow_lock_wait = @@SESSION.innodb_lock_wait_timeout, "
            "SESSION innodb_lock_wait_timeout = :lock_wait"
        ),
        wsrep_on=Statement("SHOW VARIABLES LIKE 'wsrep_on'"),
        restore_lock_wait=Statement("SET SESSION innodb_lock_wait_timeout = @idemflow_lock_wait"),
    )
    return on_database_clock(statements, SERVER_NOW_MS) if clock == "database" else statements


#: Where `unpack_read` puts the headers and the body back, and the clock after COLUMNS.
_HEADERS_AT, _BODY_AT = COLUMNS.index("response_headers"), COLUMNS.index("response_body")
PACKED_CLOCK_AT = len(COLUMNS)


def unpack_read(row: tuple[Any, ...]) -> list[Any]:
    """A `MySQLStatements.packed_read` row as the plain read's: ``COLUMNS`` in
    order from 0, then the clock (at `PACKED_CLOCK_AT`), for ``record_from_values``."""
    packed, headers, body = row
    values: list[Any] = json.loads(packed)
    values.insert(_HEADERS_AT, headers)
    values.insert(_BODY_AT, body)
    return values


def may_take_over(row: Mapping[str, Any], params: Mapping[str, Any]) -> bool:
    """Worth attempting the guarded upsert? (It checks again, atomically.)"""
    return can_take_over(record_from_row(row), params["fingerprint"], row["clock_now"] / 1000)


def decided(record: Record | None, lease_token: str) -> Claim:
    """Ours if the row carries our (unique) lease token: the statement wrote it only if we won."""
    if record is None:  # purged between the claim and the read: vanishingly rare
        raise claim_unsettled()
    owned = record.lease_token == lease_token and record.state is State.IN_PROGRESS
    return Claim(owned=owned, record=record)


def inserted(params: Mapping[str, Any], row_id: int) -> Record:
    """The row our plain INSERT created: exactly the values we sent (``claim_params``)."""
    values = {**params, "id": row_id, "idempotency_key": params["key"], "state": "in_progress"}
    values |= {"created_at": params["began_at"], "updated_at": params["now"], "attempt": 1}
    return record_from_values([values.get(column) for column in COLUMNS], 0)
