"""
The library and raw psycopg against pgbench running idemflow's exact statements (PostgreSQL).

Run::

    .venv/bin/python -m bench.bench_pgbench [--seconds 24] [--slices 8] [--clients 16]

pgbench is the server's limit for these statements: a C client, prepared
statements (``-M prepared``), one connection per client, nothing between two
statements but the network. Three contenders take turns in slices of the same
length (see :mod:`bench._harness`), each one claim + completion per operation,
each statement its own transaction (the store's own connection, autocommit):

``pgbench``
    the dialect's ``claim_or_read`` (``\\gset`` keeps the id and lease token)
    then its ``complete``, text substituted with constants where pgbench cannot
    hold a string;
``raw``
    the same two statements through psycopg from ``--clients`` threads, on a
    ``psycopg_pool`` pool (``bench_core``'s raw side);
``library``
    ``Idempotency.run`` on a fresh key with a trivial handler, ``PostgresStore``
    on a pool of the same size.

Each contender opens its ``--clients`` connections before its slice and closes
them after it, so the run holds at most ``--clients`` connections (plus one
to set up). Target (issue 12): library ≥ 0.70 × pgbench at 16 clients.

``--hot`` adds a fourth contender, ``pgbench-hot``: the same script on a copy of
the key table without the two indexes on columns a completion writes
(``(state, updated_at)``, ``expires_at``) and with room on each page
(``fillfactor = 70``), so every completion is a HOT update (no new index
entries). Not a design (the sweeper and the purge have no access path left on
it): it measures what those two indexes cost the server, the most a key table
with HOT-able completions could give.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench._harness import Contender, Crew, Row, SliceRunner, interleave, table
from bench.bench_core import (
    ENDPOINT,
    FINGERPRINT,
    POSTGRES_URL,
    PRINCIPAL,
    RETENTION,
    Keys,
    RawPostgres,
    library_claim_complete,
)


def pgbench_script(dialect: Any) -> str:
    """The dialect's claim_or_read and complete, as a pgbench script (``-M prepared``)."""

    def substitute(sql: str, values: dict[str, str]) -> str:
        for name, value in values.items():
            sql = re.sub(rf"(?<![:\w]):{name}\b", lambda _, v=value: v, sql)
        return sql

    constants = {
        "principal": f"'{PRINCIPAL}'",
        "key": "('pgb-' || CAST(:k AS BIGINT))",
        # pgbench would read the ":aa…" of "sha256:aa…" as a variable.
        "fingerprint": "'" + FINGERPRINT.replace(":", "' || ':' || '") + "'",
        "endpoint": f"'{ENDPOINT}'",
        "lease_token": "md5(CAST(:k AS TEXT))",
        "correlation_id": "NULL",
    }
    # pgbench's parameters are untyped; psycopg's integers arrive as BIGINT.
    typed = {name: f"CAST(:{name} AS BIGINT)" for name in ("now", "began_at", "expires_at", "id")}
    claim = substitute(dialect.claim_or_read.named, {**constants, **typed})
    complete = substitute(
        dialect.complete.named,
        {
            **typed,
            "state": "'completed'",
            "status": "201",
            "headers": "'[]'",
            "body": "'\\x7b7d'::bytea",
        },
    )
    retention_ms = int(RETENTION * 1000)
    return (
        "\\set k random(1, 9000000000000000)\n"
        "\\set now 1800000000000\n"
        "\\set began_at 1800000000000\n"
        f"\\set expires_at {1800000000000 + retention_ms}\n"
        f"{claim}\n\\gset\n"
        f"{complete};\n"
    )


def server_cpu_seconds() -> float:
    """The CPU time of every PostgreSQL process on this machine, ended backends included.

    A backend that has exited is counted in its postmaster's children's time, so
    the sum over the live ``postgres`` processes of their own and their children's
    time only grows. 0.0 where ``/proc`` is not there.
    """
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            name, _, rest = text.partition(") ")
            if name.endswith("(postgres"):
                fields = rest.split()
                total += sum(int(value) for value in fields[11:15])  # utime … cstime
    return total / os.sysconf("SC_CLK_TCK")


class ServerCPU:
    """What the server spent per transaction over a contender's slices."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.transactions = 0

    def per_operation_us(self) -> float:
        return self.seconds / max(1, self.transactions) * 1e6


def pgbench_slice(script: Path, clients: int, cpu: ServerCPU | None = None) -> SliceRunner:
    """pgbench for ``seconds`` (whole seconds); the transactions it finished.

    ``cpu`` adds up the server's CPU time and transactions of these slices.
    """
    url = urlsplit(POSTGRES_URL)
    command = [
        "pgbench",
        *("-h", url.hostname or "127.0.0.1", "-p", str(url.port or 5432)),
        *("-U", url.username or "postgres", url.path.lstrip("/") or "postgres"),
        *("-n", "-M", "prepared", "-c", str(clients), "-j", "2", "-f", str(script)),
    ]

    def run(seconds: float) -> int:
        whole = max(1, round(seconds))
        before = server_cpu_seconds()
        done = subprocess.run(
            [*command, "-T", str(whole)], capture_output=True, text=True, check=True
        )
        found = re.search(r"number of transactions actually processed: (\d+)", done.stdout)
        if found is None:
            raise RuntimeError(f"pgbench said: {done.stdout}{done.stderr}")
        if cpu is not None:
            cpu.seconds += server_cpu_seconds() - before
            cpu.transactions += int(found[1])
        # Per the slice's nominal length, as the harness divides every count.
        return round(int(found[1]) * seconds / whole)

    return run


def pooled_slice(crew: Crew, clients: int, make: Any) -> SliceRunner:
    """A slice on a pool opened (``clients`` connections) before it and closed after it."""
    import psycopg_pool

    def run(seconds: float) -> int:
        with psycopg_pool.ConnectionPool(
            POSTGRES_URL, min_size=clients, max_size=clients, kwargs={"autocommit": True}
        ) as pool:
            pool.wait()
            return crew.slice(make(pool))(seconds)

    return run


@contextlib.contextmanager
def key_table() -> Iterator[str]:
    from idemflow.stores.postgres import PostgresStore

    table = f"pgbench_keys_{uuid.uuid4().hex[:8]}"
    store = PostgresStore(POSTGRES_URL, table=table, max_size=1)
    try:
        store.migrate()
        yield table
    finally:
        with store.pool.connection() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
        store.close()


@contextlib.contextmanager
def hot_table(table: str) -> Iterator[str]:
    """A copy of ``table`` (empty) whose completions are HOT updates: see ``--hot``."""
    from idemflow.stores.postgres import PostgresStore

    hot = f"{table}_hot"
    store = PostgresStore(POSTGRES_URL, table=table, max_size=1)
    try:
        with store.pool.connection() as conn:
            conn.execute(
                f"CREATE TABLE {hot} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                "INCLUDING IDENTITY) WITH (fillfactor = 70)"
            )
            conn.execute(f"ALTER TABLE {hot} ADD PRIMARY KEY (id)")
            conn.execute(f"ALTER TABLE {hot} ADD UNIQUE (principal, idempotency_key)")
        yield hot
    finally:
        with store.pool.connection() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {hot}")
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=24.0, help="per contender (default 24)")
    parser.add_argument("--slices", type=int, default=8, help="turns those are cut into")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument(
        "--hot", action="store_true", help="also pgbench on a key table with HOT completions"
    )
    args = parser.parse_args(argv)
    if shutil.which("pgbench") is None:
        parser.error("pgbench is not installed")
    from idemflow import Idempotency
    from idemflow.stores.postgres import PostgresStore, postgres_dialect

    run_id = uuid.uuid4().hex[:8]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with contextlib.ExitStack() as stack:
        keys_table = stack.enter_context(key_table())
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        dialect = postgres_dialect(keys_table)
        script = folder / "claim_complete.sql"
        script.write_text(pgbench_script(dialect))
        cpu = {"pgbench": ServerCPU()}
        extra = []
        if args.hot:
            hot_script = folder / "claim_complete_hot.sql"
            hot_script.write_text(
                pgbench_script(postgres_dialect(stack.enter_context(hot_table(keys_table))))
            )
            cpu["pgbench-hot"] = ServerCPU()
            extra.append(
                Contender(
                    "pgbench-hot", pgbench_slice(hot_script, args.clients, cpu["pgbench-hot"])
                )
            )
        with Crew(args.clients) as crew:
            contenders = [
                Contender("pgbench", pgbench_slice(script, args.clients, cpu["pgbench"])),
                Contender(
                    "raw",
                    pooled_slice(
                        crew,
                        args.clients,
                        lambda pool: RawPostgres(pool, dialect, "").claim_complete(
                            Keys(run_id, f"raw-{uuid.uuid4().hex[:6]}")
                        ),
                    ),
                ),
                Contender(
                    "library",
                    pooled_slice(
                        crew,
                        args.clients,
                        lambda pool: library_claim_complete(
                            Idempotency(PostgresStore(pool, table=keys_table)),
                            Keys(run_id, f"lib-{uuid.uuid4().hex[:6]}"),
                        ),
                    ),
                ),
                *extra,
            ]
            results = interleave(contenders, seconds=args.seconds, slices=args.slices, warmup=1)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    rows = [
        Row.compare("postgresql", f"{name} / pgbench", args.clients, results, "pgbench", name)
        for name in ("raw", "library", *(["pgbench-hot"] if args.hot else []))
    ]
    print(table(rows, ("pgbench ops/s", "contender ops/s")))
    for name, spent in cpu.items():
        print(f"server CPU per claim + completion under {name}: {spent.per_operation_us():,.0f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
