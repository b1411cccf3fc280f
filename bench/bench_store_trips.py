"""
Round trips per operation on the core paths, counted in each store's driver.

Run (from the repository root)::

    .venv/bin/python -m bench.bench_store_trips [--backends sqlite,postgres,mysql,redis]

For each store, ``Idempotency.run`` is called on a fresh key (claim +
complete) and on a completed key (replay), and on PostgreSQL also in the
transactional modes (the completion in the caller's transaction, two commits
or one); what the store and the caller's connection sent is counted where it
leaves the process:

- PostgreSQL: on the wire, from libpq's protocol trace of the pool's and the
  caller's connections: every message flight ending in ``Sync`` or a simple
  ``Query`` (``BEGIN``, ``COMMIT``), so transaction commands count too;
- SQLite: every statement SQLite runs (``set_trace_callback``): an in-process
  call, not a network round trip, but the unit its cost comes in;
- MySQL/MariaDB: every ``query`` PyMySQL sends;
- Redis: every command redis-py sends (``execute_command``).

Each figure is the mean over ``--runs`` operations (default 50), so a retry
would show as a fraction; the counts are exact integers when nothing raced.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from idemflow import Attempt, Idempotency, Intent, Policy, Response, fingerprint

BODY = b'{"amount": 1000, "currency": "EUR"}'
FINGERPRINT = fingerprint("POST", "/bench", BODY, content_type="application/json")
RESPONSE = Response.json(201, {"id": "pay_1"})
POLICY = Policy(request_timeout=30)
POSTGRES_URL = os.environ.get(
    "IDEMFLOW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
MYSQL_URL = os.environ.get("IDEMFLOW_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("IDEMFLOW_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
BACKENDS = ("sqlite", "postgres", "mysql", "redis")

Row = tuple[str, str, float]


class Counter:
    """How many statements or commands were sent since the last :meth:`take`."""

    def __init__(self) -> None:
        self.count = 0

    def hit(self, *args: object) -> None:
        self.count += 1

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def respond(attempt: Attempt) -> Response:
    return RESPONSE


def measure(backend: str, idem: Idempotency, counter: Counter, runs: int, label: str) -> list[Row]:
    """Claim + complete on fresh keys, then replay of those keys; trips per run."""
    keys = [f"{label}-{uuid.uuid4().hex[:8]}-{n}" for n in range(runs)]
    rows: list[Row] = []
    for path, expect_replay in (("claim+complete", False), ("replay", True)):
        counter.take()
        for key in keys:
            outcome = idem.run(Intent("bench", key, FINGERPRINT, endpoint="POST /bench"), respond)
            if outcome.replayed is not expect_replay:
                raise AssertionError(f"{backend} {path}: replayed={outcome.replayed}")
        rows.append((backend, path, counter.take() / runs))
    return rows


def sqlite_rows(runs: int) -> list[Row]:
    from idemflow.stores.sqlite import SQLiteStore

    counter = Counter()
    with tempfile.TemporaryDirectory(prefix="idemflow-trips-") as folder:
        store = SQLiteStore(Path(folder) / "keys.db")
        store.migrate()
        with store._connections() as conn:  # this thread's connection, opened now
            conn.set_trace_callback(counter.hit)
        try:
            return measure("sqlite", Idempotency(store, POLICY), counter, runs, "sqlite")
        finally:
            store.close()


class WireTrace:
    """libpq's protocol trace of every connection, read back as round trips.

    A round trip is a message flight that ends in ``Sync`` (the extended
    protocol: a statement with parameters) or a simple ``Query`` (``BEGIN``,
    ``COMMIT``): what the client then waits on.
    """

    def __init__(self, folder: str) -> None:
        self._path = Path(folder) / "libpq.trace"
        self._file = self._path.open("w")
        self._seen = 0

    def attach(self, conn: Any) -> None:
        conn.pgconn.trace(self._file.fileno())

    def take(self) -> int:
        self._file.flush()
        lines = self._path.read_text().splitlines()
        flights = sum(
            1 for line in lines[self._seen :] if re.search(r"\tF\t\d+\t(Sync|Query)\b", line)
        )
        self._seen = len(lines)
        return flights

    def close(self) -> None:
        self._file.close()


@contextlib.contextmanager
def counted_postgres(trace: WireTrace) -> Iterator[tuple[Any, Any, str]]:
    """A pool and a caller connection whose wire traffic is traced; a fresh table."""
    import psycopg
    import psycopg_pool

    table = f"trips_{uuid.uuid4().hex[:8]}"
    pool = psycopg_pool.ConnectionPool(
        POSTGRES_URL,
        min_size=1,
        max_size=1,
        kwargs={"autocommit": True},
        configure=trace.attach,
    )
    caller = psycopg.connect(POSTGRES_URL, autocommit=True)
    trace.attach(caller)
    try:
        yield pool, caller, table
    finally:
        caller.close()
        with pool.connection() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}, {table}_biz")
        pool.close()


def postgres_rows(runs: int) -> list[Row]:
    from idemflow.stores.postgres import PostgresStore
    from idemflow.transactions import PsycopgTransaction

    with tempfile.TemporaryDirectory(prefix="idemflow-trips-") as folder:
        trace = WireTrace(folder)
        counter = Counter()
        counter.take = trace.take  # type: ignore[method-assign]
        with counted_postgres(trace) as (pool, caller, table):
            store = PostgresStore(pool, table=table)
            store.migrate()
            caller.execute(f"CREATE TABLE {table}_biz (id BIGSERIAL PRIMARY KEY, note TEXT)")
            idem = Idempotency(store, POLICY)
            rows = measure("postgresql", idem, counter, runs, "pg")
            insert = f"INSERT INTO {table}_biz (note) VALUES (%(note)s)"

            def handler(attempt: Attempt) -> Response:
                attempt.connection.execute(insert, {"note": attempt.record.key})
                return RESPONSE

            for single in (False, True):
                path = "txn one-commit" if single else "txn two-commit"
                for replay in (False, True):
                    trace.take()
                    for n in range(runs):
                        key = f"txn-{single}-{n}"
                        intent = Intent("bench", key, FINGERPRINT, endpoint="POST /bench")
                        transaction = PsycopgTransaction(caller)
                        outcome = idem.run(
                            intent, handler, transaction=transaction, single_commit=single
                        )
                        if outcome.replayed is not replay:
                            raise AssertionError(f"{path}: replayed={outcome.replayed}")
                    what = "replay" if replay else "with the business INSERT"
                    rows.append(("postgresql", f"{path}, {what}", trace.take() / runs))
        trace.close()
        return rows


def mysql_rows(runs: int) -> list[Row]:
    import pymysql

    from idemflow.stores.mysql import MySQLStore

    counter = Counter()
    original = pymysql.connections.Connection.query

    def query(self: Any, sql: Any, unbuffered: bool = False) -> Any:
        counter.hit()
        return original(self, sql, unbuffered)

    table = f"trips_{uuid.uuid4().hex[:8]}"
    store = MySQLStore(MYSQL_URL, table=table, max_size=2)
    store.migrate()
    pymysql.connections.Connection.query = query  # type: ignore[method-assign]
    try:
        return measure("mariadb", Idempotency(store, POLICY), counter, runs, "mysql")
    finally:
        pymysql.connections.Connection.query = original  # type: ignore[method-assign]
        with store.pool.connection() as conn, conn.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {table}")
        store.close()


def redis_rows(runs: int) -> list[Row]:
    from redis import Redis

    from idemflow.stores.redis import RedisStore

    counter = Counter()
    prefix = f"trips-{uuid.uuid4().hex[:8]}"
    client = Redis.from_url(REDIS_URL)
    store = RedisStore(client, policy=POLICY, prefix=prefix, allow_volatile=True)
    store.start()  # the epochs, once per process: not a per-operation cost
    send = client.execute_command

    def counted(*args: Any, **options: Any) -> Any:
        counter.hit()
        return send(*args, **options)

    client.execute_command = counted  # type: ignore[method-assign]
    try:
        return measure("redis", Idempotency(store, POLICY), counter, runs, "redis")
    finally:
        client.execute_command = send  # type: ignore[method-assign]
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            client.delete(key)
        store.close()


MEASURES: dict[str, Callable[[int], list[Row]]] = {
    "sqlite": sqlite_rows,
    "postgres": postgres_rows,
    "mysql": mysql_rows,
    "redis": redis_rows,
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args(argv)
    rows: list[Row] = []
    for backend in args.backends.split(","):
        rows += MEASURES[backend.strip()](args.runs)
    print("| store | path | statements or commands per operation |")
    print("| --- | --- | ---: |")
    for backend, path, trips in rows:
        print(f"| {backend} | {path} | {trips:g} |")


if __name__ == "__main__":
    main()
