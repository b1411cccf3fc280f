"""
Shapes of MySQL's claim on MariaDB, raw PyMySQL: what a one-round-trip replay would
cost the first execution, and what the read after a duplicate costs (issue 12).

Run (from the repository root)::

    .venv/bin/python -m bench.bench_mysql_claim_shapes [--callers 1,16] [--seconds 6]

A replay on MySQL/MariaDB is two round trips: the claim's plain ``INSERT`` fails on
the duplicate (error 1062), then the row is read. Two ways of answering both in one
round trip exist on MariaDB, and each is measured here against the shape the store
had before (``MySQLStore``'s table and ``INSERT``), as is the store's packed read, in
interleaved slices, every contender on its own connection per caller:

``today``
    ``INSERT``; on 1062, ``SELECT`` of the row's 16 columns and the server's clock
    (``mysql_dialect().read_for_claim``: the store's read until session 26).
``packed``
    ``INSERT``; on 1062, ``mysql_statements().packed_read``: the same values in three
    columns (a JSON array, the headers, the body), decoded by ``unpack_read``: what
    the store sends now. PyMySQL parses one descriptor packet per result column.
``procedure``
    ``CALL`` of a stored procedure that runs the same ``INSERT`` with a ``CONTINUE
    HANDLER FOR 1062`` and then, only on a duplicate, the same ``SELECT`` (else
    ``SELECT LAST_INSERT_ID()``): one round trip, the same locks as today.
``upsert``
    ``INSERT … ON DUPLICATE KEY UPDATE id = id RETURNING`` the read's columns (MariaDB
    ≥ 10.5; 10.11 returns the row the insert lost to): one round trip, an exclusive
    row lock on every replay.

Two paths for each: ``replay`` (one of 512 keys completed beforehand) and ``first``
(a fresh key every time). Ratios are each shape's throughput over today's in the same
run. The table and the procedure are dropped at the end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pymysql

from bench._harness import Contender, Crew, Row, interleave, parse_list, table
from idemflow import Idempotency, Intent, Response
from idemflow.stores.mysql import MySQLStore, mysql_dialect, mysql_statements
from idemflow.stores.mysql._statements import unpack_read

TABLE = "bench_claim_shapes"
PROCEDURE = f"{TABLE}_claim"
REPLAY_KEYS = 512
RETENTION_MS = 86_400_000
STATE = 5  # the read's column index of ``state``
COLUMNS = (
    "principal, idempotency_key, fingerprint, endpoint, state, lease_token, "
    "correlation_id, created_at, updated_at, expires_at, attempt"
)

Op = Callable[[], None]


def connect(url: str) -> Any:
    host, port = url.rsplit(":", 1)
    return pymysql.connect(host=host, port=int(port), user="root", database="test", autocommit=True)


def params(key: str) -> dict[str, Any]:
    now = int(time.time() * 1000)
    return {
        "principal": b"bench",
        "key": key.encode(),
        "fingerprint": b"fp",
        "endpoint": "POST /bench",
        "lease_token": uuid.uuid4().hex,
        "correlation_id": None,
        "began_at": now,
        "now": now,
        "expires_at": now + RETENTION_MS,
    }


class Shapes:
    """Today's statements, and the two one-round-trip shapes built from them."""

    def __init__(self) -> None:
        self.insert = mysql_statements(TABLE).insert.pyformat
        self.read = mysql_dialect(TABLE).read_for_claim.pyformat
        self.packed_read = mysql_statements(TABLE).packed_read.pyformat
        columns = self.read.split(" FROM ")[0].removeprefix("SELECT ")
        self.upsert = f"{self.insert} ON DUPLICATE KEY UPDATE id = id RETURNING {columns}"
        self.call = (
            f"CALL {PROCEDURE}(%(principal)s, %(key)s, %(fingerprint)s, %(endpoint)s, "
            "%(lease_token)s, %(correlation_id)s, %(began_at)s, %(now)s, %(expires_at)s)"
        )
        read_in_procedure = self.read.replace("%(principal)s", "p_principal")
        read_in_procedure = read_in_procedure.replace("%(key)s", "p_key")
        self.procedure = f"""CREATE PROCEDURE {PROCEDURE}(p_principal VARBINARY(255),
            p_key VARBINARY(255), p_fingerprint VARBINARY(128), p_endpoint VARCHAR(255),
            p_token VARCHAR(64), p_correlation VARCHAR(255), p_began BIGINT, p_now BIGINT,
            p_expires BIGINT)
        SQL SECURITY INVOKER
        BEGIN
          DECLARE duplicate BOOL DEFAULT FALSE;
          DECLARE CONTINUE HANDLER FOR 1062 SET duplicate = TRUE;
          INSERT INTO {TABLE} ({COLUMNS}) VALUES (p_principal, p_key, p_fingerprint,
            p_endpoint, 'in_progress', p_token, p_correlation, p_began, p_now, p_expires, 1);
          IF duplicate THEN
            {read_in_procedure.replace("%(now)s", "p_now")};
          ELSE
            SELECT LAST_INSERT_ID() AS id;
          END IF;
        END"""

    def today(self, cursor: Any, key: str) -> tuple[Any, ...] | None:
        return self._insert_then_read(cursor, key, self.read, tuple)

    def packed(self, cursor: Any, key: str) -> tuple[Any, ...] | None:
        return self._insert_then_read(cursor, key, self.packed_read, unpack_read)

    def _insert_then_read(
        self, cursor: Any, key: str, read: str, values: Callable[[Any], Sequence[Any]]
    ) -> tuple[Any, ...] | None:
        """The store's two round trips: the INSERT; on 1062, ``read`` (its row's values)."""
        bound = params(key)
        try:
            cursor.execute(self.insert, bound)
        except pymysql.err.IntegrityError:
            cursor.execute(read, bound)
            return tuple(values(cursor.fetchone()))
        return None

    def by_procedure(self, cursor: Any, key: str) -> tuple[Any, ...] | None:
        cursor.execute(self.call, params(key))
        row: tuple[Any, ...] = cursor.fetchone()
        while cursor.nextset():  # the CALL's own status
            pass
        return row if len(row) > 1 else None

    def by_upsert(self, cursor: Any, key: str) -> tuple[Any, ...] | None:
        cursor.execute(self.upsert, params(key))
        row: tuple[Any, ...] = cursor.fetchone()
        return None if row[STATE] == "in_progress" else row


class PerThread:
    """One connection per caller thread and shape, opened outside the measured slices."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._local = threading.local()
        self._opened: list[Any] = []

    def cursor(self) -> Any:
        cursor = getattr(self._local, "cursor", None)
        if cursor is None:
            conn = connect(self.url)
            self._opened.append(conn)
            cursor = self._local.cursor = conn.cursor()
        return cursor

    def close(self) -> None:
        for conn in self._opened:
            conn.close()


Shape = Callable[[Any, str], "tuple[Any, ...] | None"]


def replay_op(shape: Shape, cursors: PerThread, keys: Iterator[str]) -> Op:
    def op() -> None:
        row = shape(cursors.cursor(), next(keys))
        if row is None or row[STATE] != "completed":
            raise AssertionError(f"a completed key was not found: {row!r}")

    return op


def first_op(shape: Shape, cursors: PerThread, fresh: Iterator[int]) -> Op:
    def op() -> None:
        if shape(cursors.cursor(), f"new-{next(fresh)}") is not None:
            raise AssertionError("a fresh key was not claimed")

    return op


def prepare(url: str, shapes: Shapes) -> list[str]:
    """The table (through the store), 512 completed keys, the procedure."""
    store = MySQLStore(f"mysql://root@{url}/test", table=TABLE)
    with connect(url) as conn, conn.cursor() as cursor:
        cursor.execute(f"DROP TABLE IF EXISTS {TABLE}")
        cursor.execute(f"DROP PROCEDURE IF EXISTS {PROCEDURE}")
        store.migrate()
        cursor.execute(shapes.procedure)
    idempotency = Idempotency(store)
    keys = [f"done-{n}" for n in range(REPLAY_KEYS)]
    for key in keys:
        idempotency.run(
            Intent("bench", key, "fp", endpoint="POST /bench"),
            lambda _: Response.json(201, {"ok": True}),
        )
    store.close()
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="127.0.0.1:3306", help="MariaDB host:port (root)")
    parser.add_argument("--callers", default="1,16")
    parser.add_argument("--seconds", type=float, default=6.0, help="per contender and row")
    parser.add_argument("--slices", type=int, default=6)
    args = parser.parse_args()
    shapes = Shapes()
    done = prepare(args.url, shapes)
    fresh = itertools.count()
    rows: list[Row] = []
    by_name: dict[str, Shape] = {
        "today": shapes.today,
        "packed": shapes.packed,
        "procedure": shapes.by_procedure,
        "upsert": shapes.by_upsert,
    }
    cursors = {name: PerThread(args.url) for name in by_name}
    try:
        for callers in map(int, parse_list(args.callers)):
            with Crew(callers) as crew:
                for path in ("replay", "first"):
                    contenders = []
                    for name, shape in by_name.items():
                        if path == "replay":
                            op = replay_op(shape, cursors[name], itertools.cycle(done))
                        else:
                            op = first_op(shape, cursors[name], fresh)
                        contenders.append(Contender(name, crew.slice(op)))
                    results = interleave(contenders, seconds=args.seconds, slices=args.slices)
                    for name in ("packed", "procedure", "upsert"):
                        rows.append(
                            Row.compare(f"mariadb {name}", path, callers, results, "today", name)
                        )
    finally:
        for per_thread in cursors.values():
            per_thread.close()
        with connect(args.url) as conn, conn.cursor() as cursor:
            cursor.execute(f"DROP PROCEDURE IF EXISTS {PROCEDURE}")
            cursor.execute(f"DROP TABLE IF EXISTS {TABLE}")
    print(f"load average before the last row: {os.getloadavg()[0]:.2f}")
    print(table(rows, ("today ops/s", "shape ops/s"), cpu=True))


if __name__ == "__main__":
    main()
