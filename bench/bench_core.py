"""
What the library costs over the raw driver issuing the very same SQL.

Run::

    .venv/bin/python -m bench.bench_core [--seconds N] [--callers 1,16]
                                         [--backends sqlite,postgres]

For each backend, path and number of concurrent callers, the library and the
raw driver take turns in short slices (see :mod:`bench._harness`), then one
table is printed: raw ops/s, library ops/s, and their ratio. The paths:

``claim+complete``
    ``Idempotency.run`` with a fresh key and a trivial handler, non-transactional
    (the completion goes through the store's own connection) — against the
    dialect's claim and complete statements issued through a ``psycopg_pool``
    pool of autocommit connections (PostgreSQL) or a per-thread ``sqlite3``
    connection in WAL mode with ``synchronous=NORMAL`` (SQLite).
``replay``
    ``run`` on a key already completed (the claim loses, the record is read and
    replayed) — against the claim statement followed by the select.
``txn two-commit`` / ``txn one-commit`` (PostgreSQL)
    the claim commits alone, then a business ``INSERT`` and the completion
    commit together on a caller's connection; or (``single_commit=True``) the
    claim, the ``INSERT`` and the completion commit once. A second table gives
    one commit / two commits. The completion and its ``COMMIT`` are one
    pipeline on both sides (the psycopg adapters' fenced form).
``async …`` (PostgreSQL)
    ``AsyncIdempotency`` on ``AsyncPostgresStore`` against raw async psycopg,
    asyncio tasks on one event loop.
``store: …`` (``--paths store``)
    the store's own ``claim`` and ``complete`` called directly, without
    ``Idempotency.run``, against the same raw side: the store's share alone.
``raw replay`` (``--paths replay,round-trips``, PostgreSQL)
    raw against raw: the replay as the dialect's one ``claim_or_read``
    statement against the older pair (claim, then select).

The raw side reads its statement text from the store's own dialect
(``store.dialect.claim.pyformat`` …) and builds the same parameters, so the
two sides send the database identical statements; the difference is what the
library does in Python around them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    Attempt,
    Idempotency,
    Intent,
    Policy,
    Response,
    fingerprint,
)
from idemflow._async.transactions import _fenced
from idemflow._model import new_lease_token
from idemflow.stores.sql import Dialect
from idemflow.stores.sql.dialect import COLUMNS
from idemflow.transactions import PsycopgTransaction

from ._harness import Contender, Crew, Row, interleave, parse_list, table, task_slice

PRINCIPAL = "bench-principal"
ENDPOINT = "POST /bench"
BODY = b'{"amount": 1000, "currency": "EUR"}'
FINGERPRINT = fingerprint("POST", "/bench", BODY, content_type="application/json")
RESPONSE = Response.json(201, {"id": "pay_1", "amount": 1000, "currency": "EUR"})
# Completed keys the replay path cycles through; enough that 16 callers rarely
# meet on one row (a hot single key would measure row-lock queueing instead).
REPLAY_KEYS = 512
RETENTION = Policy().retention_seconds
POSTGRES_URL = os.environ.get(
    "IDEMFLOW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
PATHS = ("claim", "replay", "transactional", "async", "round-trips", "store")

# Column positions in a claim/select row (the dialect returns COLUMNS in order).
ID, FP, STATE = (COLUMNS.index(c) for c in ("id", "fingerprint", "state"))
STATUS, HEADERS, BODY_COL = (
    COLUMNS.index(c) for c in ("response_status", "response_headers", "response_body")
)

Op = Callable[[], object]
AsyncOp = Callable[[], Awaitable[object]]


@dataclass(frozen=True)
class Settings:
    seconds: float
    slices: int
    callers: tuple[int, ...]
    paths: frozenset[str]
    postgres_url: str
    async_tasks: int


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    commit_rows: list[Row] = field(default_factory=list)
    trip_rows: list[Row] = field(default_factory=list)


# --- what both sides do -------------------------------------------------------


class Keys:
    """Fresh idempotency keys: ``<run>-<path>-<n>``; ``next()`` on a count is atomic."""

    def __init__(self, run_id: str, label: str) -> None:
        self._prefix = f"{run_id}-{label}-"
        self._numbers = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._numbers)}"


class ReplayKeys:
    """Cycles through the keys completed before the replay path is measured."""

    def __init__(self, run_id: str) -> None:
        self.keys = [f"{run_id}-done-{n}" for n in range(REPLAY_KEYS)]
        self._numbers = itertools.count()

    def __call__(self) -> str:
        return self.keys[next(self._numbers) % REPLAY_KEYS]


def respond(attempt: Attempt) -> Response:
    return RESPONSE


async def respond_async(attempt: AsyncAttempt) -> Response:
    return RESPONSE


def intent(key: str) -> Intent:
    return Intent(PRINCIPAL, key, FINGERPRINT, endpoint=ENDPOINT)


def claim_params(key: str, lease_token: str, now: float) -> dict[str, Any]:
    """The claim's parameters, exactly as ``idemflow.stores.sql.claim_params`` builds them."""
    now_ms = int(now * 1000)
    return {
        "principal": PRINCIPAL,
        "key": key,
        "fingerprint": FINGERPRINT,
        "endpoint": ENDPOINT,
        "lease_token": lease_token,
        "correlation_id": None,
        "now": now_ms,
        "began_at": now_ms,
        "expires_at": int((now + RETENTION) * 1000),
    }


def complete_params(record_id: int, lease_token: str, now: float) -> dict[str, Any]:
    """The completion's parameters, as ``complete_params`` builds them (headers as JSON)."""
    return {
        "id": record_id,
        "lease_token": lease_token,
        "now": int(now * 1000),
        "expires_at": int((now + RETENTION) * 1000),
        "state": "completed",
        "status": RESPONSE.status,
        "headers": json.dumps([list(pair) for pair in RESPONSE.headers], separators=(",", ":")),
        "body": RESPONSE.body,
    }


def check_replay(row: Sequence[Any] | None) -> None:
    """What a hand-written replay does with the row: check it, decode the stored response."""
    if row is None or row[FP] != FINGERPRINT or row[STATE] != "completed":
        raise AssertionError(f"expected a completed record, got {row!r}")
    json.loads(row[HEADERS])
    bytes(row[BODY_COL])


def library_claim_complete(idem: Idempotency, keys: Keys) -> Op:
    def op() -> None:
        if idem.run(intent(keys()), respond).replayed:
            raise AssertionError("a fresh key was replayed")

    return op


def library_replay(idem: Idempotency, keys: ReplayKeys) -> Op:
    def op() -> None:
        if not idem.run(intent(keys()), respond).replayed:
            raise AssertionError("a completed key ran again")

    return op


def store_claim_complete(store: Any, keys: Keys) -> Op:
    """The store's own methods, no driver: what the store adds to the statements."""
    from idemflow import State

    def op() -> None:
        now = time.time()
        claim = store.claim(intent(keys()), lease(), now, now + RETENTION)
        if not claim.owned:
            raise AssertionError("a fresh key was not claimed")
        done = time.time()
        store.complete(claim.record, State.COMPLETED, RESPONSE, done, done + RETENTION)

    return op


def store_replay(store: Any, keys: ReplayKeys) -> Op:
    def op() -> None:
        now = time.time()
        claim = store.claim(intent(keys()), lease(), now, now + RETENTION)
        if claim.owned or claim.record.response is None:
            raise AssertionError("a completed key was claimed")

    return op


def lease() -> str:
    """A lease token made the way the library makes its own (the claim needs one)."""
    return new_lease_token()


# --- SQLite -------------------------------------------------------------------


class RawSQLite:
    """The dialect's statements through stdlib ``sqlite3``, one connection per thread."""

    def __init__(self, path: Path, dialect: Dialect) -> None:
        self._path = path
        self._dialect = dialect
        self._local = threading.local()
        self._opened: list[sqlite3.Connection] = []

    def connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(
                self._path, timeout=5.0, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
            self._opened.append(conn)
        return conn

    def claim_complete(self, keys: Keys) -> Op:
        claim, complete = self._dialect.claim.named, self._dialect.complete.named

        def op() -> None:
            conn, token = self.connection(), lease()
            row = conn.execute(claim, claim_params(keys(), token, time.time())).fetchone()
            if row is None:
                raise AssertionError("a fresh key was not claimed")
            done = conn.execute(complete, complete_params(row[ID], token, time.time()))
            if done.rowcount != 1:
                raise AssertionError("completion matched no row")

        return op

    def replay(self, keys: ReplayKeys) -> Op:
        claim, select = self._dialect.claim.named, self._dialect.select.named

        def op() -> None:
            conn = self.connection()
            params = claim_params(keys(), lease(), time.time())
            if conn.execute(claim, params).fetchone() is not None:
                raise AssertionError("a completed key was claimed")
            check_replay(conn.execute(select, params).fetchone())

        return op

    def close(self) -> None:
        for conn in self._opened:
            conn.close()


def bench_sqlite(settings: Settings, run_id: str, report: Report) -> None:
    from idemflow.stores.sqlite import SQLiteStore

    with tempfile.TemporaryDirectory(prefix="idemflow-bench-") as folder:
        path = Path(folder) / "keys.db"
        store = SQLiteStore(path)
        store.migrate()
        idem = Idempotency(store)
        raw = RawSQLite(path, store.dialect)
        replay_keys = prepare_replay(idem, run_id)
        try:
            for callers in settings.callers:
                with Crew(callers) as crew:
                    if "claim" in settings.paths:
                        label = f"sqlite-{callers}"
                        pair = (
                            raw.claim_complete(Keys(run_id, f"raw-{label}")),
                            library_claim_complete(idem, Keys(run_id, f"lib-{label}")),
                        )
                        report.rows.append(
                            compare(settings, crew, "sqlite", "claim+complete", *pair)
                        )
                    if "replay" in settings.paths:
                        pair = (raw.replay(replay_keys), library_replay(idem, replay_keys))
                        report.rows.append(compare(settings, crew, "sqlite", "replay", *pair))
                    if "store" in settings.paths:
                        store_rows(
                            settings, run_id, report, crew, "sqlite", raw, store, replay_keys
                        )
            with contextlib.closing(raw.connection()) as conn:
                audit("sqlite", conn.execute(STATE_COUNTS.format(table=store.dialect.table)))
        finally:
            raw.close()


# Every record the run wrote, by state: all must be settled, none left in_progress.
STATE_COUNTS = "SELECT state, count(*) FROM {table} GROUP BY state ORDER BY state"


def audit(backend: str, state_counts: Any, business: tuple[int, int] | None = None) -> None:
    """Check what both sides wrote: a benchmark that silently failed measures nothing."""
    counts = dict(state_counts.fetchall())
    line = f"{backend} records by state: {counts}"
    if business is not None:
        line += f"; business rows {business[0]} for {business[1]} transactional completions"
    print(line, flush=True)
    if set(counts) != {"completed"} or (business is not None and business[0] != business[1]):
        raise AssertionError(f"unexpected records after the run: {line}")


def prepare_replay(idem: Idempotency, run_id: str) -> ReplayKeys:
    keys = ReplayKeys(run_id)
    for key in keys.keys:
        idem.run(intent(key), respond)
    return keys


def compare(settings: Settings, crew: Crew, backend: str, path: str, raw: Op, lib: Op) -> Row:
    results = interleave(
        [Contender("raw", crew.slice(raw)), Contender("library", crew.slice(lib))],
        seconds=settings.seconds,
        slices=settings.slices,
    )
    row = Row.compare(backend, path, crew.size, results)
    print(table([row]).splitlines()[-1], flush=True)
    return row


# --- PostgreSQL ---------------------------------------------------------------


class RawPostgres:
    """The dialect's statements through psycopg, on the same pool the store uses.

    Where the dialect reads a lost claim's record in the claim statement itself
    (``claim_or_read``, one round trip for a replay), the raw side sends that
    same statement; :meth:`replay_two` is the older pair (claim, then select).
    """

    def __init__(self, pool: Any, dialect: Dialect, business_insert: str) -> None:
        self._pool = pool
        self._dialect = dialect
        self._business_insert = business_insert
        combined = dialect.claim_or_read
        self._claim = (combined or dialect.claim).pyformat
        self._offset = 0 if combined is None else 1  # the ``claimed`` column comes first
        self._combined = combined is not None

    def claim_complete(self, keys: Keys) -> Op:
        claim, complete = self._claim, self._dialect.complete.pyformat
        pool, offset, combined = self._pool, self._offset, self._combined

        def op() -> None:
            token = lease()
            with pool.connection() as conn:
                row = conn.execute(claim, claim_params(keys(), token, time.time())).fetchone()
            if row is None or (combined and not row[0]):
                raise AssertionError("a fresh key was not claimed")
            with pool.connection() as conn:
                done = conn.execute(complete, complete_params(row[ID + offset], token, time.time()))
            if done.rowcount != 1:
                raise AssertionError("completion matched no row")

        return op

    def replay(self, keys: ReplayKeys) -> Op:
        if not self._combined:
            return self.replay_two(keys)
        claim, pool = self._claim, self._pool

        def op() -> None:
            params = claim_params(keys(), lease(), time.time())
            with pool.connection() as conn:
                row = conn.execute(claim, params).fetchone()
            if row is None or row[0]:
                raise AssertionError("a completed key was claimed")
            check_replay(row[1:])

        return op

    def replay_two(self, keys: ReplayKeys) -> Op:
        """The replay as two statements: the plain claim (no row), then the select."""
        claim, select = self._dialect.claim.pyformat, self._dialect.select.pyformat
        pool = self._pool

        def op() -> None:
            params = claim_params(keys(), lease(), time.time())
            with pool.connection() as conn:
                if conn.execute(claim, params).fetchone() is not None:
                    raise AssertionError("a completed key was claimed")
                row = conn.execute(select, params).fetchone()
            check_replay(row)

        return op

    def two_commits(self, keys: Keys, callers: CallerConnections) -> Op:
        """Claim on the pool (commit 1); INSERT and completion on the caller's (commit 2)."""
        claim, complete = self._dialect.claim.pyformat, self._dialect.complete.pyformat
        insert, pool = self._business_insert, self._pool

        def op() -> None:
            key, token = keys(), lease()
            with pool.connection() as conn:
                row = conn.execute(claim, claim_params(key, token, time.time())).fetchone()
            if row is None:
                raise AssertionError("a fresh key was not claimed")
            caller = callers.get()
            caller.execute("BEGIN")
            caller.execute(insert, {"note": key})
            self._complete_and_commit(caller, complete, row[ID], token)

        return op

    def one_commit(self, keys: Keys, callers: CallerConnections) -> Op:
        """Claim, INSERT and completion in the caller's one transaction (bounded claim wait)."""
        dialect, insert = self._dialect, self._business_insert
        claim, complete = dialect.claim.pyformat, dialect.complete.pyformat
        before = [s.pyformat for s in dialect.before_claim_in_transaction]
        after = [s.pyformat for s in dialect.after_claim_in_transaction]

        def op() -> None:
            key, token, caller = keys(), lease(), callers.get()
            caller.execute("BEGIN")
            for statement in before:
                caller.execute(statement)
            row = caller.execute(claim, claim_params(key, token, time.time())).fetchone()
            for statement in after:
                caller.execute(statement)
            if row is None:
                caller.rollback()
                raise AssertionError("a fresh key was not claimed")
            caller.execute(insert, {"note": key})
            self._complete_and_commit(caller, complete, row[ID], token)

        return op

    @staticmethod
    def _complete_and_commit(caller: Any, complete: str, record_id: int, token: str) -> None:
        """The completion and its COMMIT in one pipeline, as the psycopg adapters send them.

        (The fenced form raises on the server when it matches no row.)
        """
        with caller.pipeline():
            caller.execute(_fenced(complete), complete_params(record_id, token, time.time()))
            caller.execute("COMMIT")


class CallerConnections:
    """The application's own connection, one per thread (autocommit; BEGIN is explicit)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._local = threading.local()
        self._opened: list[Any] = []
        self._lock = threading.Lock()

    def get(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            import psycopg

            conn = psycopg.connect(self._url, autocommit=True)
            self._local.conn = conn
            with self._lock:
                self._opened.append(conn)
        return conn

    def close(self) -> None:
        for conn in self._opened:
            conn.close()


def library_transactional(
    idem: Idempotency, keys: Keys, callers: CallerConnections, insert: str, *, single: bool
) -> Op:
    def handler(attempt: Attempt) -> Response:
        attempt.connection.execute(insert, {"note": attempt.record.key})
        return RESPONSE

    def op() -> None:
        transaction = PsycopgTransaction(callers.get())
        outcome = idem.run(intent(keys()), handler, transaction=transaction, single_commit=single)
        if outcome.replayed:
            raise AssertionError("a fresh key was replayed")

    return op


@contextlib.contextmanager
def postgres_tables(url: str, run_id: str) -> Iterator[tuple[str, str]]:
    """A fresh key table and business table for this run, dropped afterwards."""
    import psycopg

    table, business = f"bench_core_{run_id}", f"bench_core_{run_id}_biz"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {business} (id BIGSERIAL PRIMARY KEY, note TEXT NOT NULL)")
    try:
        yield table, business
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}, {business}")


def bench_postgres(settings: Settings, run_id: str, report: Report) -> None:
    import psycopg_pool

    from idemflow.stores.postgres import PostgresStore

    size = max(settings.callers)
    with postgres_tables(settings.postgres_url, run_id) as (table, business):
        pool = psycopg_pool.ConnectionPool(
            settings.postgres_url,
            min_size=size,
            max_size=size,
            kwargs={"autocommit": True},
            open=True,
        )
        callers_conns = CallerConnections(settings.postgres_url)
        try:
            pool.wait()
            store = PostgresStore(pool, table=table)
            store.migrate()
            idem = Idempotency(store)
            insert = f"INSERT INTO {business} (note) VALUES (%(note)s)"
            raw = RawPostgres(pool, store.dialect, insert)
            replay_keys = prepare_replay(idem, run_id)
            for callers in settings.callers:
                with Crew(callers) as crew:
                    postgres_paths(settings, run_id, report, crew, idem, raw, replay_keys)
                    if "transactional" in settings.paths:
                        transactional(
                            settings, run_id, report, crew, idem, raw, callers_conns, insert
                        )
            if "async" in settings.paths:
                bench_postgres_async(settings, run_id, report, table)
            audit_postgres(pool, table, business)
        finally:
            callers_conns.close()
            pool.close()


def audit_postgres(pool: Any, table: str, business: str) -> None:
    """Every record settled; one business row per transactional completion (raw or library)."""
    transactional_completions = (
        f"SELECT count(*) FROM {table} WHERE state = 'completed' "
        "AND idempotency_key ~ '-(raw|lib)[12]-'"
    )
    with pool.connection() as conn:
        rows = conn.execute(f"SELECT count(*) FROM {business}").fetchone()
        completions = conn.execute(transactional_completions).fetchone()
        audit(
            "postgresql", conn.execute(STATE_COUNTS.format(table=table)), (rows[0], completions[0])
        )


def postgres_paths(
    settings: Settings,
    run_id: str,
    report: Report,
    crew: Crew,
    idem: Idempotency,
    raw: RawPostgres,
    replay_keys: ReplayKeys,
) -> None:
    label = f"pg-{crew.size}"
    if "claim" in settings.paths:
        pair = (
            raw.claim_complete(Keys(run_id, f"raw-{label}")),
            library_claim_complete(idem, Keys(run_id, f"lib-{label}")),
        )
        report.rows.append(compare(settings, crew, "postgresql", "claim+complete", *pair))
    if "replay" in settings.paths:
        pair = (raw.replay(replay_keys), library_replay(idem, replay_keys))
        report.rows.append(compare(settings, crew, "postgresql", "replay", *pair))
    if "store" in settings.paths:
        store_rows(settings, run_id, report, crew, "postgresql", raw, idem.store, replay_keys)
    if "replay" in settings.paths and "round-trips" in settings.paths:
        results = interleave(
            [
                Contender("two", crew.slice(raw.replay_two(replay_keys))),
                Contender("one", crew.slice(raw.replay(replay_keys))),
            ],
            seconds=settings.seconds,
            slices=settings.slices,
        )
        row = Row.compare("postgresql", "raw replay", crew.size, results, "two", "one")
        report.trip_rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)


def store_rows(
    settings: Settings,
    run_id: str,
    report: Report,
    crew: Crew,
    backend: str,
    raw: Any,
    store: Any,
    replay_keys: ReplayKeys,
) -> None:
    """Raw against the store's claim and complete called directly (the driver left out)."""
    label = f"store-{backend}-{crew.size}"
    pair = (
        raw.claim_complete(Keys(run_id, f"raw-{label}")),
        store_claim_complete(store, Keys(run_id, f"lib-{label}")),
    )
    report.rows.append(compare(settings, crew, backend, "store: claim+complete", *pair))
    pair = (raw.replay(replay_keys), store_replay(store, replay_keys))
    report.rows.append(compare(settings, crew, backend, "store: replay", *pair))


def transactional(
    settings: Settings,
    run_id: str,
    report: Report,
    crew: Crew,
    idem: Idempotency,
    raw: RawPostgres,
    conns: CallerConnections,
    insert: str,
) -> None:
    """Both commit variants, library and raw, all four taking turns."""
    label = f"pg-{crew.size}"
    ops = {
        "raw two": raw.two_commits(Keys(run_id, f"raw2-{label}"), conns),
        "library two": library_transactional(
            idem, Keys(run_id, f"lib2-{label}"), conns, insert, single=False
        ),
        "raw one": raw.one_commit(Keys(run_id, f"raw1-{label}"), conns),
        "library one": library_transactional(
            idem, Keys(run_id, f"lib1-{label}"), conns, insert, single=True
        ),
    }
    results = interleave(
        [Contender(name, crew.slice(op)) for name, op in ops.items()],
        seconds=settings.seconds,
        slices=settings.slices,
    )
    for variant in ("two", "one"):
        row = Row.compare(
            "postgresql",
            f"txn {variant}-commit",
            crew.size,
            results,
            f"raw {variant}",
            f"library {variant}",
        )
        report.rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
    for side in ("library", "raw"):
        report.commit_rows.append(
            Row.compare("postgresql", side, crew.size, results, f"{side} two", f"{side} one")
        )


# --- PostgreSQL, asyncio ------------------------------------------------------


class RawAsyncPostgres:
    """The dialect's statements through async psycopg, on the store's own pool."""

    def __init__(self, pool: Any, dialect: Dialect) -> None:
        self._pool = pool
        self._dialect = dialect
        combined = dialect.claim_or_read
        self._claim = (combined or dialect.claim).pyformat
        self._offset = 0 if combined is None else 1
        self._combined = combined is not None

    def claim_complete(self, keys: Keys) -> AsyncOp:
        claim, complete = self._claim, self._dialect.complete.pyformat
        pool, offset, combined = self._pool, self._offset, self._combined

        async def op() -> None:
            token = lease()
            async with pool.connection() as conn:
                cursor = await conn.execute(claim, claim_params(keys(), token, time.time()))
                row = await cursor.fetchone()
            if row is None or (combined and not row[0]):
                raise AssertionError("a fresh key was not claimed")
            params = complete_params(row[ID + offset], token, time.time())
            async with pool.connection() as conn:
                done = await conn.execute(complete, params)
            if done.rowcount != 1:
                raise AssertionError("completion matched no row")

        return op

    def replay(self, keys: ReplayKeys) -> AsyncOp:
        claim, select = self._claim, self._dialect.select.pyformat
        pool, combined = self._pool, self._combined

        async def op() -> None:
            params = claim_params(keys(), lease(), time.time())
            async with pool.connection() as conn:
                cursor = await conn.execute(claim, params)
                row = await cursor.fetchone()
                if combined:
                    if row is None or row[0]:
                        raise AssertionError("a completed key was claimed")
                    check_replay(row[1:])
                    return
                if row is not None:
                    raise AssertionError("a completed key was claimed")
                cursor = await conn.execute(select, params)
                row = await cursor.fetchone()
            check_replay(row)

        return op


def async_library_ops(
    idem: AsyncIdempotency, fresh: Keys, done: ReplayKeys
) -> tuple[AsyncOp, AsyncOp]:
    async def claim_complete() -> None:
        if (await idem.run(intent(fresh()), respond_async)).replayed:
            raise AssertionError("a fresh key was replayed")

    async def replay() -> None:
        if not (await idem.run(intent(done()), respond_async)).replayed:
            raise AssertionError("a completed key ran again")

    return claim_complete, replay


def bench_postgres_async(settings: Settings, run_id: str, report: Report, table_name: str) -> None:
    import psycopg_pool

    from idemflow.stores.postgres import AsyncPostgresStore

    tasks = settings.async_tasks
    with asyncio.Runner() as runner:
        pool = psycopg_pool.AsyncConnectionPool(
            settings.postgres_url,
            min_size=tasks,
            max_size=tasks,
            kwargs={"autocommit": True},
            open=False,
        )
        runner.run(pool.open(wait=True))
        try:
            idem = AsyncIdempotency(AsyncPostgresStore(pool, table=table_name))
            raw = RawAsyncPostgres(pool, idem.store.dialect)  # type: ignore[attr-defined]
            done = ReplayKeys(run_id)
            lib_claim, lib_replay = async_library_ops(idem, Keys(run_id, "lib-async"), done)
            pairs = {
                "claim+complete": (raw.claim_complete(Keys(run_id, "raw-async")), lib_claim),
                "replay": (raw.replay(done), lib_replay),
            }
            for path, (raw_op, lib_op) in pairs.items():
                if path.split("+")[0] not in settings.paths:
                    continue
                results = interleave(
                    [
                        Contender("raw", task_slice(runner, raw_op, tasks)),
                        Contender("library", task_slice(runner, lib_op, tasks)),
                    ],
                    seconds=settings.seconds,
                    slices=settings.slices,
                )
                row = Row.compare("postgresql", f"async {path}", f"{tasks} tasks", results)
                report.rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
        finally:
            runner.run(pool.close())


# --- main ---------------------------------------------------------------------


def describe_machine(settings: Settings, backends: Sequence[str]) -> str:
    import psycopg

    lines = [
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"SQLite {sqlite3.sqlite_version}, psycopg {psycopg.__version__}",
        f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"{settings.slices} interleaved slices of {settings.seconds / settings.slices:g} s "
        "per contender and row",
    ]
    if "postgres" in backends:
        with psycopg.connect(settings.postgres_url) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            lines.append(f"PostgreSQL {row[0] if row else '?'} on loopback")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_core", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=10.0,
        help="measured seconds per contender and row (default 10)",
    )
    parser.add_argument(
        "--slices",
        type=int,
        default=10,
        help="interleaved slices those seconds are cut into (default 10: 1 s each)",
    )
    parser.add_argument(
        "--callers", default="1,16", help="concurrent caller threads (default 1,16)"
    )
    parser.add_argument(
        "--backends", default="sqlite,postgres", help="sqlite, postgres (default both)"
    )
    parser.add_argument(
        "--paths", default=",".join(PATHS), help=f"any of {', '.join(PATHS)} (default all)"
    )
    parser.add_argument(
        "--async-tasks", type=int, default=16, help="asyncio tasks for the async rows (default 16)"
    )
    parser.add_argument(
        "--postgres-url",
        default=POSTGRES_URL,
        help="default: $IDEMFLOW_TEST_POSTGRES_URL or the loopback test database",
    )
    args = parser.parse_args(argv)
    backends = parse_list(args.backends)
    unknown = set(backends) - {"sqlite", "postgres"} | set(parse_list(args.paths)) - set(PATHS)
    if unknown:
        parser.error(f"unknown backend or path: {', '.join(sorted(unknown))}")
    settings = Settings(
        seconds=args.seconds,
        slices=args.slices,
        callers=tuple(int(n) for n in parse_list(args.callers)),
        paths=frozenset(parse_list(args.paths)),
        postgres_url=args.postgres_url,
        async_tasks=args.async_tasks,
    )
    return settings, backends


def main(argv: Sequence[str] | None = None) -> None:
    settings, backends = parse_args(argv)
    run_id = uuid.uuid4().hex[:8]
    print(describe_machine(settings, backends), flush=True)
    print(table([]), flush=True)
    report = Report()
    if "sqlite" in backends:
        bench_sqlite(settings, run_id, report)
    if "postgres" in backends:
        bench_postgres(settings, run_id, report)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\nlibrary / raw (the same statements through the same driver):\n")
    print(table(report.rows, cpu=True))
    if report.trip_rows:
        print("\nreplay in one statement (claim_or_read) / two (claim, select), raw psycopg:\n")
        print(table(report.trip_rows, ("two statements ops/s", "one statement ops/s"), cpu=True))
    if report.commit_rows:
        print("\none commit / two commits (transactional mode, PostgreSQL):\n")
        print(table(report.commit_rows, ("two commits ops/s", "one commit ops/s"), cpu=True))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
