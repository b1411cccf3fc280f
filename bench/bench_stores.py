"""
MySQL/MariaDB, Redis and Redis Cluster: what the library costs over the raw driver.

Run (from the repository root)::

    .venv/bin/python -m bench.bench_stores [--seconds N] [--callers 1,16]
                                           [--backends mysql,redis,redis-cluster]
                                           [--no-claim-forms] [--no-claim-rates]

For each backend, path and number of concurrent callers, the library and the
raw driver take turns in short slices (see :mod:`bench._harness`), so noise
from other work on the machine hits both alike; then one table is printed.

``claim+complete``
    ``Idempotency.run`` with a fresh key and a trivial handler (no caller
    transaction), against the raw driver sending the very same commands: the
    store's own claim statement and completion (MySQL: the dialect's SQL text
    on a per-thread autocommit PyMySQL connection; Redis: ``EVALSHA`` of the
    store's own Lua scripts).
``replay``
    ``run`` on a completed key (the claim loses, the stored response is
    returned), against the same commands plus the work a hand-written replay
    does with the answer (check fingerprint and state, decode the headers).
    MySQL: the INSERT that fails with 1062, then the store's read after a
    duplicate (``read_for_claim``: the row and the server's clock, which the
    store needs to decide whether a takeover is worth attempting).

MySQL's pool holds as many connections as the most callers of the run
(``--pool-size`` says otherwise), every one opened before anything is
measured: the raw side has one connection per thread, so a smaller pool
would measure threads waiting for a connection, not the library's cost.

``--claim-forms`` (MySQL) measures the two claim designs, raw, side by side:
a plain ``INSERT`` that learns "duplicate" from error 1062, then reads the
row (what the store does), and the guarded ``INSERT … ON DUPLICATE KEY
UPDATE`` for every claim (what it does only for a takeover), then the read
when the count is not 1.

``--claim-rates`` measures raw claims per second of each store at the
highest caller count (PostgreSQL included, for the scaling section of
``docs/stores.md``): the claim alone, each on a fresh key, from Python.

``--native`` (alone: ``--native --backends none``) asks what the servers
themselves can take, without Python in the way: the claim statement through
``pgbench`` and ``mariadb-slap``, and the claim script through three
``redis-benchmark`` processes against one Redis and against a 3-master
cluster (one process per master).

Redis Cluster: a 3-master cluster is started on free loopback ports for the
run (``tests/_redis_cluster.py``) and removed afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from idemflow import Attempt, Idempotency, Intent, Policy, Response, fingerprint
from idemflow._model import new_lease_token

from ._harness import Contender, Crew, Measurement, Row, interleave, parse_list, table

PRINCIPAL = "bench-principal"
ENDPOINT = "POST /bench"
BODY = b'{"amount": 1000, "currency": "EUR"}'
FINGERPRINT = fingerprint("POST", "/bench", BODY, content_type="application/json")
RESPONSE = Response.json(201, {"id": "pay_1", "amount": 1000, "currency": "EUR"})
POLICY = Policy(request_timeout=30)
RETENTION = POLICY.retention_seconds
REPLAY_KEYS = 512
MYSQL_URL = os.environ.get("IDEMFLOW_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("IDEMFLOW_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get(
    "IDEMFLOW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
BACKENDS = ("mysql", "redis", "redis-cluster")
HEADERS_JSON = json.dumps([list(p) for p in RESPONSE.headers], separators=(",", ":"))

Op = Callable[[], object]


@dataclass(frozen=True)
class Settings:
    seconds: float
    slices: int
    callers: tuple[int, ...]
    backends: tuple[str, ...]
    claim_forms: bool
    claim_rates: bool
    native: bool
    pool_size: int | None = None

    @property
    def mysql_pool(self) -> int:
        """The MySQL store's ``max_size``: one connection per caller, as raw has."""
        return self.pool_size or max(self.callers, default=1)


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    form_rows: list[Row] = field(default_factory=list)
    rates: list[tuple[str, int | str, float]] = field(default_factory=list)


class Keys:
    """Fresh keys ``<run>-<label>-<n>``; drawing one is atomic (``itertools.count``)."""

    def __init__(self, run_id: str, label: str) -> None:
        self._prefix = f"{run_id}-{label}-"
        self._numbers = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._numbers)}"


class ReplayKeys:
    """Cycles through keys completed beforehand (many, so callers rarely share a row)."""

    def __init__(self, run_id: str, label: str) -> None:
        self.keys = [f"{run_id}-{label}-done-{n}" for n in range(REPLAY_KEYS)]
        self._numbers = itertools.count()

    def __call__(self) -> str:
        return self.keys[next(self._numbers) % REPLAY_KEYS]


def intent(key: str) -> Intent:
    return Intent(PRINCIPAL, key, FINGERPRINT, endpoint=ENDPOINT)


def respond(attempt: Attempt) -> Response:
    return RESPONSE


def lease() -> str:
    """A lease token made the way the library makes its own (a prefix and a counter):
    ``secrets.token_hex`` here would charge the raw side an ``os.urandom`` the library
    does not pay."""
    return new_lease_token()


def library_ops(idem: Idempotency, fresh: Keys, done: ReplayKeys) -> tuple[Op, Op]:
    def claim_complete() -> None:
        if idem.run(intent(fresh()), respond).replayed:
            raise AssertionError("a fresh key was replayed")

    def replay() -> None:
        if not idem.run(intent(done()), respond).replayed:
            raise AssertionError("a completed key ran again")

    return claim_complete, replay


def compare(
    settings: Settings,
    report: Report,
    backend: str,
    path: str,
    callers: int,
    raw: Op,
    library: Op,
) -> None:
    with Crew(callers) as crew:
        results = interleave(
            [Contender("raw", crew.slice(raw)), Contender("library", crew.slice(library))],
            seconds=settings.seconds,
            slices=settings.slices,
        )
    row = Row.compare(backend, path, callers, results)
    report.rows.append(row)
    print(table([row], cpu=True).splitlines()[-1], flush=True)


# --- MySQL / MariaDB ----------------------------------------------------------


class RawMySQL:
    """PyMySQL, one autocommit connection per thread, sending the store's SQL text."""

    def __init__(self, table: str) -> None:
        import pymysql

        from idemflow.stores.mysql import (
            connect_kwargs,
            mysql_dialect,
            mysql_statements,
            unpack_read,
        )

        self.unpack = unpack_read
        self.dialect = mysql_dialect(table)
        self.insert = mysql_statements(table).insert
        self.packed_read = mysql_statements(table).packed_read
        self._kwargs = connect_kwargs(MYSQL_URL)
        self._pymysql = pymysql
        self._local = threading.local()
        self._all: list[Any] = []

    def conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._pymysql.connect(**self._kwargs, autocommit=True)
            self._local.conn = conn
            self._all.append(conn)
        return conn

    def close(self) -> None:
        for conn in self._all:
            conn.close()

    def execute(self, statement: Any, params: dict[str, Any]) -> tuple[int, Any]:
        with self.conn().cursor() as cursor:
            count = cursor.execute(statement.pyformat, statement.bind(params))
            return count, cursor

    def claim_complete(self, keys: Keys) -> Op:
        from idemflow.stores.sql.dialect import claim_params, complete_params

        def op() -> None:
            now, token = time.time(), lease()
            with self.conn().cursor() as cursor:
                claim = self.insert
                count = cursor.execute(claim.pyformat, claim.bind(
                    claim_params(intent(keys()), token, now, now + RETENTION)
                ))  # fmt: skip
                if count != 1:
                    raise AssertionError("a fresh key was not inserted")
                record = _record_stub(cursor.lastrowid, token)
                complete = self.dialect.complete
                done = time.time()
                params = complete_params(record, _completed(), RESPONSE, done, done + RETENTION)
                if cursor.execute(complete.pyformat, complete.bind(params)) != 1:
                    raise AssertionError("completion matched no row")

        return op

    def replay(self, keys: ReplayKeys) -> Op:
        import pymysql

        from idemflow.stores.sql.dialect import claim_params

        def op() -> None:
            now = time.time()
            params = claim_params(intent(keys()), lease(), now, now + RETENTION)
            with self.conn().cursor() as cursor:
                # The store's own read after a duplicate (packed, with the server's clock).
                claim, read = self.insert, self.packed_read
                try:
                    cursor.execute(claim.pyformat, claim.bind(params))
                    raise AssertionError("a completed key was claimed")
                except pymysql.err.IntegrityError as exc:
                    if exc.args[0] != 1062:
                        raise
                cursor.execute(read.pyformat, read.bind(params))
                row = cursor.fetchone()
                if row is None:
                    raise AssertionError("no record")
                _check_values(self.unpack(row))

        return op


def _record_stub(record_id: int, token: str) -> Any:
    """What ``complete_params`` reads from a record: id, lease token."""
    from idemflow import Record, State

    return Record(
        record_id, PRINCIPAL, "", FINGERPRINT, ENDPOINT, State.IN_PROGRESS, token, 0, 0, 0
    )


def _completed() -> Any:
    from idemflow import State

    return State.COMPLETED


def _check_values(values: Sequence[Any]) -> None:
    """What a hand-written replay does with the row (``COLUMNS`` in order): check it,
    decode the response."""
    from idemflow.stores.sql.dialect import COLUMNS

    record = dict(zip(COLUMNS, values, strict=False))
    if record["fingerprint"] != FINGERPRINT or record["state"] != "completed":
        raise AssertionError(f"expected a completed record, got {record!r}")
    json.loads(record["response_headers"])
    bytes(record["response_body"])


@contextlib.contextmanager
def mysql_table(run_id: str, pool_size: int = 16) -> Iterator[tuple[str, Any]]:
    """A fresh key table and a store on it whose ``pool_size`` connections are all open."""
    from idemflow.stores.mysql import MySQLStore

    table = f"bench_{run_id}"
    store = MySQLStore(MYSQL_URL, table=table, max_size=pool_size)
    store.migrate()
    open_every_connection(store, pool_size)
    try:
        yield table, store
    finally:
        store.close()
        import pymysql

        from idemflow.stores.mysql import connect_kwargs

        conn = pymysql.connect(**connect_kwargs(MYSQL_URL))
        with contextlib.closing(conn), conn.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {table}")


def open_every_connection(store: Any, size: int) -> None:
    """Check ``size`` connections out at once, then give them back: none is opened
    (a TLS context built, a handshake made) inside a measured slice."""
    with contextlib.ExitStack() as held:
        for _ in range(size):
            held.enter_context(store.pool.connection())


def bench_mysql(settings: Settings, run_id: str, report: Report) -> None:
    with mysql_table(run_id, settings.mysql_pool) as (table, store):
        raw = RawMySQL(table)
        idem = Idempotency(store, POLICY)
        done = ReplayKeys(run_id, "mysql")
        for key in done.keys:
            idem.run(intent(key), respond)
        library = library_ops(idem, Keys(run_id, "mysql-lib"), done)
        raw_ops = (raw.claim_complete(Keys(run_id, "mysql-raw")), raw.replay(done))
        try:
            for callers in settings.callers:
                for path, raw_op, lib_op in zip(PATHS, raw_ops, library, strict=True):
                    compare(settings, report, "mariadb", path, callers, raw_op, lib_op)
            if settings.claim_forms:
                bench_claim_forms(settings, run_id, raw, report)
        finally:
            raw.close()


PATHS = ("claim+complete", "replay")


def bench_claim_forms(settings: Settings, run_id: str, raw: RawMySQL, report: Report) -> None:
    """The store's plain INSERT (+ read on 1062) against the guarded upsert for every claim.

    Both read the row when the key exists (a replay); neither takes over here
    (the replay keys are completed and within retention).
    """
    from idemflow.stores.sql.dialect import claim_params

    plain_insert = raw.insert.pyformat
    select = raw.dialect.select

    def odku(keys: Callable[[], str]) -> Op:
        def op() -> None:
            now = time.time()
            params = claim_params(intent(keys()), lease(), now, now + RETENTION)
            with raw.conn().cursor() as cursor:
                if cursor.execute(raw.dialect.claim.pyformat, raw.dialect.claim.bind(params)) != 1:
                    cursor.execute(select.pyformat, select.bind(params))
                    cursor.fetchone()

        return op

    def insert_1062(keys: Callable[[], str]) -> Op:
        import pymysql

        def op() -> None:
            now = time.time()
            params = claim_params(intent(keys()), lease(), now, now + RETENTION)
            with raw.conn().cursor() as cursor:
                try:
                    cursor.execute(plain_insert, raw.insert.bind(params))
                    return
                except pymysql.err.IntegrityError as exc:
                    if exc.args[0] != 1062:
                        raise
                cursor.execute(select.pyformat, select.bind(params))
                cursor.fetchone()

        return op

    done = ReplayKeys(run_id, "mysql")
    cases = [
        (callers, path, a_keys, b_keys)
        for callers in settings.callers
        for path, a_keys, b_keys in (
            ("fresh claim", Keys(run_id, f"odku{callers}"), Keys(run_id, f"i1062-{callers}")),
            ("duplicate claim", done, done),
        )
    ]
    for callers, path, a_keys, b_keys in cases:
        with Crew(callers) as crew:
            results = interleave(
                [
                    Contender("odku", crew.slice(odku(a_keys))),
                    Contender("insert+1062", crew.slice(insert_1062(b_keys))),
                ],
                seconds=settings.seconds,
                slices=settings.slices,
            )
        row = Row.compare("mariadb", path, callers, results, "odku", "insert+1062")
        report.form_rows.append(row)
        print(f"claim forms: {path}: {table_row(row)}", flush=True)


def table_row(row: Row) -> str:
    return table([row]).splitlines()[-1]


# --- Redis / Redis Cluster ----------------------------------------------------


class RawRedis:
    """redis-py sending ``EVALSHA`` of the store's own scripts with the same arguments."""

    def __init__(self, store: Any) -> None:
        from idemflow.stores.redis._scripts import SCRIPTS

        self.store = store
        self.client = store.client
        self.layout = store.layout
        self.sha = {name: self.client.script_load(lua) for name, lua in SCRIPTS.items()}

    def claim_complete(self, keys: Keys) -> Op:
        def op() -> None:
            token, key = lease(), keys()
            reply = self.client.evalsha(*redis_claim(self.store, self.sha, key, token))
            check_redis_claim(reply)
            done = self.client.evalsha(*redis_complete(self.store, self.sha, key, token))
            if done != 1:
                raise AssertionError("completion refused")

        return op

    def replay(self, keys: ReplayKeys) -> Op:
        def op() -> None:
            reply = self.client.evalsha(*redis_claim(self.store, self.sha, keys(), lease()))
            check_redis_replay(reply)

        return op


def redis_claim(store: Any, sha: dict[str, str], key: str, token: str) -> tuple[Any, ...]:
    """``EVALSHA``'s arguments for the store's own claim of ``key``, as the store sends them."""
    now, target = time.time(), store.layout.claim_keys(PRINCIPAL, key)
    args = store.layout.claim_args(intent(key), token, now, now + RETENTION, store.quarantine)
    return (sha["claim"], len(target), *target, *args)


def redis_complete(store: Any, sha: dict[str, str], key: str, token: str) -> tuple[Any, ...]:
    """``EVALSHA``'s arguments for the completion of a claim :func:`redis_claim` made."""
    from idemflow import State

    now = time.time()
    record = _redis_record(token, key, now)
    args = store.layout.complete_args(record, State.COMPLETED, RESPONSE, now, now + RETENTION)
    fenced = store.layout.claim_keys(PRINCIPAL, key)[:-1]  # the claim's KEYS but the epoch
    return (sha["complete"], len(fenced), *fenced, *args)


def check_redis_claim(reply: bytes) -> None:
    if not reply.startswith(b"new "):
        raise AssertionError(f"a fresh key was not new: {reply[:5]!r}")


def check_redis_replay(reply: bytes) -> None:
    """What a hand-written replay does with the claim's answer: check it, decode the record."""
    from idemflow import State
    from idemflow.stores.redis._scripts import unpacked

    verdict, _, packed = reply.partition(b" ")
    record = unpacked(packed)
    if verdict != b"held" or record.fingerprint != FINGERPRINT:
        raise AssertionError("expected a held record")
    if record.state is not State.COMPLETED or record.response is None:
        raise AssertionError("expected a completed record")


def _redis_record(token: str, key: str, now: float) -> Any:
    from idemflow import Record, State

    created = int(now * 1000) / 1000
    return Record(
        token, PRINCIPAL, key, FINGERPRINT, ENDPOINT, State.IN_PROGRESS, token,
        created, created, int((now + RETENTION) * 1000) / 1000,
    )  # fmt: skip


def redis_store(url: str, cluster: bool, prefix: str) -> Any:
    from redis import Redis
    from redis.cluster import RedisCluster

    from idemflow.stores.redis import RedisStore

    client_class: Any = RedisCluster if cluster else Redis
    client = client_class.from_url(url, max_connections=32)
    return RedisStore(client, policy=POLICY, prefix=prefix, allow_volatile=True)


def bench_redis(settings: Settings, run_id: str, report: Report, url: str, cluster: bool) -> None:
    name = "redis-cluster" if cluster else "redis"
    prefix = f"bench-{run_id}-{name}"
    store = redis_store(url, cluster, prefix)
    try:
        raw = RawRedis(store)
        idem = Idempotency(store, POLICY)
        done = ReplayKeys(run_id, name)
        for key in done.keys:
            idem.run(intent(key), respond)
        library = library_ops(idem, Keys(run_id, f"{name}-lib"), done)
        raw_ops = (raw.claim_complete(Keys(run_id, f"{name}-raw")), raw.replay(done))
        for callers in settings.callers:
            for path, raw_op, lib_op in zip(PATHS, raw_ops, library, strict=True):
                compare(settings, report, name, path, callers, raw_op, lib_op)
    finally:
        for key in store.client.scan_iter(match=f"{prefix}:*", count=1000):
            store.client.delete(key)
        store.close()


@contextlib.contextmanager
def started_cluster() -> Iterator[str]:
    sys.path.insert(0, os.getcwd())
    from tests._redis_cluster import RedisClusterProcess

    with RedisClusterProcess.start() as cluster:
        yield cluster.url


# --- raw claim rates (the scaling section) -------------------------------------


def claim_rates(settings: Settings, run_id: str, report: Report, cluster_url: str | None) -> None:
    """Claims per second, raw, each on a fresh key, at the highest caller count."""
    from idemflow.stores.sql.dialect import claim_params

    callers = max(settings.callers)
    ops: dict[str, Op] = {}
    closers: list[Callable[[], None]] = []
    with contextlib.ExitStack() as stack:
        if "mysql" in settings.backends:
            table, _ = stack.enter_context(mysql_table(f"{run_id}r"))
            raw = RawMySQL(table)
            closers.append(raw.close)
            keys = Keys(run_id, "rate-mysql")

            def mysql_claim() -> None:
                now = time.time()
                params = claim_params(intent(keys()), lease(), now, now + RETENTION)
                raw.execute(raw.insert, params)

            ops["mariadb"] = mysql_claim
        postgres = stack.enter_context(postgres_claim(run_id))
        if postgres is not None:
            ops["postgresql"] = postgres
        for name, url, cluster in (
            ("redis", REDIS_URL, False),
            ("redis-cluster", cluster_url, True),
        ):
            if url is None or name not in settings.backends:
                continue
            store = redis_store(url, cluster, f"bench-{run_id}-rate")
            closers.append(_redis_cleanup(store))
            ops[name] = _redis_claim(RawRedis(store), Keys(run_id, f"rate-{name}"))
        with Crew(callers) as crew:
            results = interleave(
                [Contender(name, crew.slice(op)) for name, op in ops.items()],
                seconds=settings.seconds * len(ops) / 2,
                slices=settings.slices,
            )
        for closer in closers:
            closer()
    for name, measurement in results.items():
        report.rates.append((name, callers, measurement.ops_per_second))
        print(f"raw claims/s, {name}, {callers} callers: {measurement.ops_per_second:,.0f}")


def _redis_claim(raw: RawRedis, keys: Keys) -> Op:
    def op() -> None:
        now, key = time.time(), keys()
        target = raw.layout.keys(PRINCIPAL, key)
        args = raw.layout.claim_args(intent(key), lease(), now, now + RETENTION)
        raw.client.evalsha(raw.sha["claim"], len(target), *target, *args)

    return op


def _redis_cleanup(store: Any) -> Callable[[], None]:
    def cleanup() -> None:
        for key in store.client.scan_iter(match=f"{store.layout.prefix}:*", count=1000):
            store.client.delete(key)
        store.close()

    return cleanup


@contextlib.contextmanager
def postgres_claim(run_id: str) -> Iterator[Op | None]:
    """The PostgreSQL claim statement through a psycopg pool, if the server is there."""
    try:
        import psycopg
        import psycopg_pool

        from idemflow.stores.postgres import PostgresStore
        from idemflow.stores.sql.dialect import claim_params
    except ImportError:
        yield None
        return
    table = f"bench_{run_id}"
    try:
        store = PostgresStore(POSTGRES_URL, table=table, max_size=8)
        store.migrate()
    except (psycopg.OperationalError, psycopg_pool.PoolTimeout):
        yield None
        return
    keys = Keys(run_id, "rate-pg")
    claim = store.dialect.claim

    def op() -> None:
        now = time.time()
        params = claim_params(intent(keys()), lease(), now, now + RETENTION)
        with store.pool.connection() as conn:
            conn.execute(claim.pyformat, claim.bind(params)).fetchone()

    try:
        yield op
    finally:
        store.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")


# --- native clients (the servers' own capacity) --------------------------------

NATIVE_SECONDS = 10
REDIS_ARGS = ["1800000000000 1800086400000 0 70000", "tok", FINGERPRINT, ENDPOINT]


def native_rates(run_id: str, report: Report) -> None:
    for name, measure in (
        ("postgresql", native_postgres),
        ("mariadb", native_mariadb),
        ("redis", native_redis),
        ("redis-cluster", native_redis_cluster),
    ):
        result = measure(run_id)
        if result is not None:
            report.rates.append((name, result[0], result[1]))
            print(f"native claims/s, {name} ({result[0]}): {result[1]:,.0f}", flush=True)


def _substitute(sql: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        sql = re.sub(rf"(?<![:\w]):{name}\b", value, sql)
    return sql


def native_postgres(run_id: str) -> tuple[str, float] | None:
    """pgbench, 16 clients, the claim statement (each its own transaction) on random keys."""
    from idemflow.stores.postgres import PostgresStore
    from idemflow.stores.sql import insert_claim

    if shutil.which("pgbench") is None:
        return None
    table = f"native_{run_id}"
    store = PostgresStore(POSTGRES_URL, table=table, max_size=2)
    store.migrate()
    now_ms = "(extract(epoch from now()) * 1000)::bigint"
    sql = _substitute(insert_claim(table), {
        "principal": "'bench'", "key": "(:k)::text", "fingerprint": f"'{FINGERPRINT}'",
        "endpoint": f"'{ENDPOINT}'", "lease_token": "md5(random()::text)",
        "correlation_id": "NULL", "now": now_ms, "expires_at": f"{now_ms} + 86400000",
    })  # fmt: skip
    script = f"{os.getcwd()}/.bench-claim-{run_id}.sql"
    try:
        with open(script, "w") as f:
            f.write("\\set k random(1, 2000000000)\n" + sql + ";\n")
        command = ["pgbench", *urlsplit_postgres(), "-n", "-c", "16", "-j", "2"]
        command += ["-T", str(NATIVE_SECONDS), "-f", script]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        tps = float(re.findall(r"tps = ([\d.]+)", done.stdout)[-1])
    finally:
        os.remove(script)
        with store.pool.connection() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}")
        store.close()
    return "pgbench, 16", tps


def urlsplit_postgres() -> list[str]:
    from urllib.parse import urlsplit

    url = urlsplit(POSTGRES_URL)
    return ["-h", url.hostname or "127.0.0.1", "-p", str(url.port or 5432),
            "-U", url.username or "postgres", url.path.lstrip("/") or "postgres"]  # fmt: skip


def native_mariadb(run_id: str) -> tuple[str, float] | None:
    """mariadb-slap, 16 clients, 40 000 plain-INSERT claims with UUID() keys."""
    from idemflow.stores.mysql import connect_kwargs, mysql_statements

    tool = shutil.which("mariadb-slap") or shutil.which("mysqlslap")
    if tool is None:
        return None
    queries = 40_000
    with mysql_table(f"n{run_id}") as (table, _):
        sql = _substitute(mysql_statements(table).insert.named, {
            "principal": "'bench'", "key": "UUID()", "fingerprint": f"'{FINGERPRINT}'",
            "endpoint": f"'{ENDPOINT}'", "lease_token": "MD5(RAND())", "correlation_id": "NULL",
            "now": "1800000000000", "expires_at": "1800086400000",
        })  # fmt: skip
        kwargs = connect_kwargs(MYSQL_URL)
        started = time.perf_counter()
        subprocess.run(
            [tool, f"-h{kwargs['host']}", f"-P{kwargs['port']}", f"-u{kwargs['user']}",
             f"--create-schema={kwargs['database']}", "--concurrency=16", "--iterations=1",
             f"--number-of-queries={queries}", f"--query={sql}"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        elapsed = time.perf_counter() - started
    return "mariadb-slap, 16", queries / elapsed


def _redis_benchmarks(targets: list[tuple[int, str]]) -> float:
    """Run one redis-benchmark per (port, key pattern) at once; their requests/s summed."""
    from idemflow.stores.redis._scripts import INDEXES, SHAS

    def keys(pattern: str) -> list[str]:  # the bucket's four indexes (same tag), then the record
        tag = pattern[pattern.index("{") : pattern.index("}") + 1]
        return [f"native:{tag}:i:{name}" for name in INDEXES] + [pattern]

    commands = [
        ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", "8", "-n", "100000",
         "-r", "1000000000", "-q", "EVALSHA", SHAS["claim"], "5", *keys(pattern), *REDIS_ARGS]
        for port, pattern in targets
    ]  # fmt: skip
    running = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True) for c in commands]
    outputs = [p.communicate()[0] for p in running]
    return sum(float(re.findall(r"([\d.]+) requests per second", out)[-1]) for out in outputs)


def native_redis(run_id: str) -> tuple[str, float] | None:
    """Three redis-benchmark processes × 8 connections against one Redis of our own.

    A private server, like the cluster's: the shared one on 6379 also serves
    whatever tests run at the same time.
    """
    if shutil.which("redis-benchmark") is None or shutil.which("redis-server") is None:
        return None
    with started_redis() as port:
        url = f"redis://127.0.0.1:{port}/0"
        store = redis_store(url, False, "native")
        store.migrate()
        rate = _redis_benchmarks([(port, "native:{__rand_int__}:k:5:bench:k")] * 3)
        store.close()
    return "redis-benchmark, 3 × 8", rate


@contextlib.contextmanager
def started_redis() -> Iterator[int]:
    """A redis-server on a free loopback port, no persistence; stopped afterwards."""
    import socket
    import tempfile

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="idemflow-bench-redis-") as directory:
        command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "no", "--dir", directory]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            for _ in range(100):
                ping = subprocess.run(
                    ["redis-cli", "-p", str(port), "PING"],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if ping.stdout.strip() == "PONG":
                    break
                time.sleep(0.05)
            yield port
        finally:
            server.terminate()
            server.wait(timeout=10)


def native_redis_cluster(run_id: str) -> tuple[str, float] | None:
    """One redis-benchmark × 8 connections per master of a fresh 3-master cluster.

    redis-benchmark cannot route EVALSHA by key, so each process gets a hash
    tag that lands on its master and random keys under it.
    """
    if shutil.which("redis-benchmark") is None:
        return None
    with started_cluster() as url:
        store = redis_store(url, True, "native")
        store.migrate()
        tags: dict[int, str] = {}
        for n in itertools.count():
            port = store.client.get_node_from_key(f"{{t{n}}}").port
            tags.setdefault(port, f"t{n}")
            if len(tags) == 3:
                break
        rate = _redis_benchmarks(
            [(p, f"native:{{{t}}}:k:5:bench:__rand_int__") for p, t in tags.items()]
        )
        store.close()
    return "redis-benchmark, 3 × 8", rate


# --- main ---------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="per contender and row")
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--callers", default="1,16")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--no-claim-forms", action="store_true")
    parser.add_argument("--no-claim-rates", action="store_true")
    parser.add_argument("--native", action="store_true", help="also pgbench/mariadb-slap/…")
    parser.add_argument(
        "--pool-size", type=int, help="the MySQL store's max_size (default: the most callers)"
    )
    args = parser.parse_args(argv)
    return Settings(
        seconds=args.seconds,
        slices=args.slices,
        callers=tuple(int(n) for n in parse_list(args.callers)),
        backends=tuple(b for b in parse_list(args.backends) if b != "none"),
        claim_forms=not args.no_claim_forms,
        claim_rates=not args.no_claim_rates,
        native=args.native,
        pool_size=args.pool_size,
    )


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_args(argv)
    run_id = uuid.uuid4().hex[:8]
    print(
        f"# {platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"{settings.seconds:g}s per contender in {settings.slices} slices",
        flush=True,
    )
    report = Report()
    with contextlib.ExitStack() as stack:
        cluster_url = None
        if "redis-cluster" in settings.backends:
            cluster_url = stack.enter_context(started_cluster())
        if "mysql" in settings.backends:
            bench_mysql(settings, run_id, report)
        if "redis" in settings.backends:
            bench_redis(settings, run_id, report, REDIS_URL, cluster=False)
        if cluster_url is not None:
            bench_redis(settings, run_id, report, cluster_url, cluster=True)
        if settings.claim_rates and settings.backends:
            claim_rates(settings, run_id, report, cluster_url)
        if settings.native:
            native_rates(run_id, report)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\nlibrary / raw (the same commands through the same driver):\n")
    print(table(report.rows, cpu=True))
    if report.form_rows:
        print("\nMySQL claim forms, raw: INSERT + 1062 (chosen) / ON DUPLICATE KEY UPDATE:\n")
        print(table(report.form_rows, ("odku ops/s", "insert+1062 ops/s")))
    if report.rates:
        print("\nclaims per second (fresh keys, each its own commit):\n")
        print("| store | client, connections | claims/s |\n| --- | --- | ---: |")
        for name, callers, rate in report.rates:
            client = callers if isinstance(callers, str) else f"Python threads, {callers}"
            print(f"| {name} | {client} | {rate:,.0f} |")


if __name__ == "__main__":
    main()


__all__ = ["Measurement", "main"]
