"""
What a fenced write and its COMMIT cost, sent the ways psycopg can send them (PostgreSQL).

Run::

    .venv/bin/python -m bench.bench_fenced_commit [--ops 1500] [--rounds 5]

One connection (``synchronous_commit = off`` on it: the WAL flush costs every
variant the same and would drown the rest), one key row, the store's own
completion statement, each operation ``BEGIN``, the write and ``COMMIT``:

``separate``
    the completion (prepared, as psycopg prepares repeated statements), then
    ``COMMIT``: three round trips, what the adapters sent before;
``separate, bound on the client``
    the same three statements through a ``ClientCursor`` (Django's default
    ``server_side_binding = False``): the completion is a simple query, parsed
    and planned on every execution; what Django's adapter sent before the fusing;
``simple query``
    the completion inside the fence (``WITH fenced AS (…) SELECT CAST(…)``)
    and ``COMMIT`` in one simple-query message, the values bound on the client;
``pipeline``
    the fenced completion (prepared) and ``COMMIT`` in one psycopg pipeline,
    one ``Sync``: what the psycopg adapters send now.

The variants take turns, round after round; per variant the CPU per operation
of this process (``time.process_time``) and of the server backend (``/proc``),
the minimum and the median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.bench_core import POSTGRES_URL

_TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def variants(conn: Any, statement: Any, params: dict[str, Any]) -> dict[str, Callable[[], None]]:
    import psycopg

    from idemflow._async.transactions import _fenced

    bound = statement.bind(params)
    fenced = _fenced(statement.pyformat)

    def separate() -> None:
        conn.execute("BEGIN")
        conn.execute(statement.pyformat, bound)
        conn.execute("COMMIT")

    def separate_on_client() -> None:
        conn.execute("BEGIN")
        cursor = psycopg.ClientCursor(conn)
        cursor.execute(statement.pyformat, bound)
        cursor.close()
        conn.execute("COMMIT")

    def simple_query() -> None:
        conn.execute("BEGIN")
        cursor = psycopg.ClientCursor(conn)
        cursor.execute(fenced + "; COMMIT", bound)
        cursor.close()

    def pipeline() -> None:
        conn.execute("BEGIN")
        with conn.pipeline():
            conn.execute(fenced, bound)
            conn.execute("COMMIT")

    return {
        "separate": separate,
        "separate, bound on the client": separate_on_client,
        "simple query": simple_query,
        "pipeline": pipeline,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=1500, help="operations per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    import psycopg

    from idemflow.stores.postgres import postgres_dialect

    table = f"fenced_{uuid.uuid4().hex[:8]}"
    dialect = postgres_dialect(table)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        for ddl in dialect.ddl:
            conn.execute(ddl)
        try:
            conn.execute("SET synchronous_commit = off")
            row = conn.execute(
                f"INSERT INTO {table} (principal, idempotency_key, fingerprint, state, "
                "lease_token, created_at, updated_at, expires_at) "
                "VALUES ('p', 'k', 'f', 'in_progress', 't', 1, 1, 1) RETURNING id"
            ).fetchone()
            assert row is not None
            # The state written stays in_progress, so the fence matches every time.
            params = {
                "id": row[0],
                "lease_token": "t",
                "now": 1,
                "expires_at": 2,
                "state": "in_progress",
                "status": 201,
                "headers": '[["location","/payments/pay_1"]]',
                "body": b'{"id":"pay_1"}',
            }
            ops = variants(conn, dialect.complete, params)
            pid = conn.info.backend_pid
            measured: dict[str, list[tuple[float, float]]] = {name: [] for name in ops}
            for _ in range(args.rounds):
                for name, op in ops.items():
                    for _ in range(50):
                        op()
                    client, server = time.process_time(), backend_cpu(pid)
                    for _ in range(args.ops):
                        op()
                    client, server = time.process_time() - client, backend_cpu(pid) - server
                    measured[name].append((client / args.ops * 1e6, server / args.ops * 1e6))
        finally:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| variant | round trips | client CPU µs/op: min (median) | server: min (median) |")
    print("| --- | ---: | ---: | ---: |")
    trips = {"separate": 3, "separate, bound on the client": 3, "simple query": 2, "pipeline": 2}
    for name, values in measured.items():
        client = [c for c, _ in values]
        server = [s for _, s in values]
        print(
            f"| {name} | {trips[name]} | {min(client):,.0f} ({statistics.median(client):,.0f}) "
            f"| {min(server):,.0f} ({statistics.median(server):,.0f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
