"""
The take-over rule is defined once, in ``idemflow._model``; the SQL stores
speak it as ``TAKE_OVER_SQL`` / ``NEW_INTENT_SQL`` / ``PURGEABLE_SQL``. This
evaluates the SQL on every case (state × past expiry × same request × recovery
point) in each real database and checks it says what the Python says.
(The Redis claim script is held to the same cases through the contract suite.)
"""

from __future__ import annotations

import contextlib
import itertools
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from idemflow import Record, State
from idemflow._model import can_take_over, is_past_retention, starts_new_intent
from idemflow.stores.sql import PURGEABLE_SQL, Statement
from idemflow.stores.sql.dialect import NEW_INTENT_SQL, TAKE_OVER_SQL
from tests.conftest import POSTGRES_URL, unreachable

NOW_MS = 1_800_000_000_000
CASES = list(
    itertools.product(
        list(State),  # every state
        [True, False],  # past its expiry
        [True, False],  # the claimant is the same request
        [None, "payment_created"],  # recovery point
    )
)

QUERY = Statement(
    f"SELECT CASE WHEN {TAKE_OVER_SQL} THEN 1 ELSE 0 END AS take_over, "
    f"CASE WHEN {NEW_INTENT_SQL} THEN 1 ELSE 0 END AS new_intent, "
    f"CASE WHEN expires_at <= :now AND {PURGEABLE_SQL} THEN 1 ELSE 0 END AS purgeable "
    "FROM (SELECT :state AS state, :expires_at AS expires_at, "
    ":stored_fingerprint AS fingerprint, :recovery_point AS recovery_point) AS r"
)


def bound(values: dict[str, Any]) -> dict[str, Any]:
    """The query's parameters: it names some, so ``bind`` never answers None here."""
    params = QUERY.bind(values)
    assert params is not None
    return params


def record(state: State, expired: bool, recovery_point: str | None) -> Record:
    expires_at = (NOW_MS - 1 if expired else NOW_MS + 1) / 1000
    return Record(
        1, "alice", "k", "fp-stored", "POST /x", state, "l", 0.0, 0.0, expires_at,
        recovery_point=recovery_point,
    )  # fmt: skip


def params(state: State, expired: bool, same: bool, recovery_point: str | None) -> dict[str, Any]:
    return {
        "state": state.value,
        "expires_at": NOW_MS - 1 if expired else NOW_MS + 1,
        "stored_fingerprint": "fp-stored",
        "recovery_point": recovery_point,
        "fingerprint": "fp-stored" if same else "fp-other",
        "now": NOW_MS,
    }


def expected(
    state: State, expired: bool, same: bool, recovery_point: str | None
) -> tuple[int, ...]:
    held = record(state, expired, recovery_point)
    fingerprint = "fp-stored" if same else "fp-other"
    now = NOW_MS / 1000
    return (
        int(can_take_over(held, fingerprint, now)),
        int(starts_new_intent(held, fingerprint, now)),
        int(is_past_retention(held, now)),
    )


@contextlib.contextmanager
def sqlite_query() -> Iterator[Callable[[dict[str, Any]], tuple[int, ...]]]:
    with contextlib.closing(sqlite3.connect(":memory:")) as conn:
        yield lambda values: tuple(conn.execute(QUERY.named, bound(values)).fetchone())


@contextlib.contextmanager
def postgres_query() -> Iterator[Callable[[dict[str, Any]], tuple[int, ...]]]:
    psycopg = pytest.importorskip("psycopg")
    try:
        conn = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    # Typed as the key table's columns are (text, bigint), not as unknown literals.
    text = QUERY.pyformat.replace("%(state)s", "%(state)s::text").replace(
        "%(expires_at)s AS", "%(expires_at)s::bigint AS"
    )
    text = text.replace("%(recovery_point)s AS", "%(recovery_point)s::text AS")
    with conn:
        yield lambda values: tuple(conn.execute(text, bound(values)).fetchone())


@contextlib.contextmanager
def mysql_query() -> Iterator[Callable[[dict[str, Any]], tuple[int, ...]]]:
    pymysql = pytest.importorskip("pymysql")
    from idemflow.stores.mysql import connect_kwargs
    from tests.backends import MYSQL_URL

    try:
        conn = pymysql.connect(**connect_kwargs(MYSQL_URL), autocommit=True)
    except pymysql.err.OperationalError as exc:
        unreachable("MariaDB", exc)

    def run(values: dict[str, Any]) -> tuple[int, ...]:
        with conn.cursor() as cursor:
            cursor.execute(QUERY.pyformat, bound(values))
            return tuple(int(v) for v in cursor.fetchone())

    with contextlib.closing(conn):
        yield run


DATABASES = {"sqlite": sqlite_query, "postgres": postgres_query, "mysql": mysql_query}


@pytest.mark.parametrize(
    "database",
    [
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_the_sql_says_what_the_model_says_in_every_case(database: str) -> None:
    with DATABASES[database]() as query:
        disagreements = [
            (case, got, want)
            for case in CASES
            if (got := query(params(*case))) != (want := expected(*case))
        ]

    assert disagreements == []
    assert len(CASES) == 40


def test_the_cases_cover_every_answer() -> None:
    """The table exercises each branch: takeovers, new intents and purges both ways."""
    answers = {expected(*case) for case in CASES}
    assert {(1, 1, 1), (1, 0, 1), (1, 0, 0), (0, 0, 0)} <= answers
