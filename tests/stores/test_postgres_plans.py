"""
PostgreSQL serves every fenced write through a unique index, whatever the planner knew.

A connection that prepares a statement while the key table is empty or was
never analysed keeps a generic plan. If that plan picked the
``(state, updated_at)`` index, every completion, release and checkpoint would
scan all ``in_progress`` rows (issue 12 measured 3.4 ms against 0.08 ms with
10k of them). The fences name the row by its primary key and the claim's
statements by ``(principal, idempotency_key)``, so no generic plan can do
otherwise: checked here with ``plan_cache_mode = force_generic_plan`` on a
table, empty or of 10k in-flight rows, that autovacuum never analysed.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from idemflow.stores.postgres import postgres_dialect
from idemflow.stores.sql import Dialect
from tests.conftest import POSTGRES_URL
from tests.factories import psycopg_or_skip

pytestmark = pytest.mark.postgres

#: Statements that write one known row, and the index that must find it.
BY_ID = ("complete", "release", "checkpoint", "settle_stale", "release_stale")
BY_KEY = ("take_over", "select", "read_for_claim")
#: The parameters' SQL types (as psycopg would send them); the others are text.
TYPES = {
    **dict.fromkeys(
        ("id", "now", "expires_at", "marked_at", "began_at", "status", "cutoff"),
        "bigint",
    ),
    **dict.fromkeys(("stale_at", "stale_after"), "bigint"),
    "body": "bytea",
    "forget_progress": "integer",
}


@pytest.fixture(scope="module", params=[0, 10_000], ids=["empty", "10k-in-flight"])
def unanalysed(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Dialect]]:
    """A key table, empty or with 10k ``in_progress`` rows, never analysed; its dialect."""
    psycopg = psycopg_or_skip()
    table = f"plans_{uuid.uuid4().hex[:10]}"
    dialect = postgres_dialect(table)
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        for statement in dialect.ddl:
            conn.execute(statement)
        conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        conn.execute(
            f"INSERT INTO {table} (principal, idempotency_key, fingerprint, state, "
            "lease_token, created_at, updated_at, expires_at) "
            "SELECT 'p', 'k' || g, 'f', 'in_progress', 't' || g, g, g, g "
            "FROM generate_series(1, %s) g",
            (request.param,),
        )
        conn.execute("SET plan_cache_mode = force_generic_plan")
        try:
            yield conn, dialect
        finally:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


def generic_plan(conn: Any, named: str) -> str:
    """The generic plan PostgreSQL keeps for ``named`` (``:name`` placeholders)."""
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match[1] not in order:
            order.append(match[1])
        return f"${order.index(match[1]) + 1}"

    text = re.sub(r"(?<!:):(\w+)", number, named)
    name = f"s_{uuid.uuid4().hex[:8]}"
    types = ", ".join(TYPES.get(param, "text") for param in order)
    conn.execute(f"PREPARE {name} ({types}) AS {text}")
    try:
        values = ", ".join("'1'" for _ in order)
        rows = conn.execute(f"EXPLAIN EXECUTE {name}({values})").fetchall()
        return "\n".join(row[0] for row in rows)
    finally:
        conn.execute(f"DEALLOCATE {name}")


@pytest.mark.parametrize("statement", BY_ID)
def test_a_fenced_write_is_served_by_the_primary_key(
    unanalysed: tuple[Any, Dialect], statement: str
) -> None:
    conn, dialect = unanalysed
    plan = generic_plan(conn, getattr(dialect, statement).named)
    assert f"using {dialect.table}_pkey" in plan, plan
    assert "_state_" not in plan, plan  # neither state index


@pytest.mark.parametrize("statement", BY_KEY)
def test_a_statement_by_key_is_served_by_the_unique_key(
    unanalysed: tuple[Any, Dialect], statement: str
) -> None:
    conn, dialect = unanalysed
    plan = generic_plan(conn, getattr(dialect, statement).named)
    assert f"using {dialect.table}_principal_key" in plan, plan
    assert "_state_" not in plan, plan  # neither state index


def test_the_sweeper_s_question_is_one_probe_of_the_state_index(
    unanalysed: tuple[Any, Dialect],
) -> None:
    """``next_due`` reads the first row of ``(state, stale_at)`` in index order: never a
    scan and sort of the table, whatever the generic plan knew of it."""
    conn, dialect = unanalysed
    assert dialect.due is not None
    plan = generic_plan(conn, dialect.due.named)
    assert f"using {dialect.table}_state_stale" in plan, plan
    assert "Sort" not in plan, plan
    assert "Seq Scan" not in plan, plan


@pytest.mark.parametrize("statement", ["complete", "checkpoint"])
def test_a_fenced_write_sent_with_its_commit_is_served_by_the_primary_key(
    unanalysed: tuple[Any, Dialect], statement: str
) -> None:
    """The form the psycopg adapters pipeline with the COMMIT (the write in a CTE that
    raises when it changed no row) is prepared as any statement: its generic plan too must
    find the row by id."""
    from idemflow._async.transactions import _fenced

    conn, dialect = unanalysed
    plan = generic_plan(conn, _fenced(getattr(dialect, statement).named))
    assert f"using {dialect.table}_pkey" in plan, plan
    assert "_state_" not in plan, plan  # neither state index
