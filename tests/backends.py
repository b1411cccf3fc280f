"""
Every store the contract suite runs against, behind one small interface.

A :class:`Backend` gives the tests a store, and (where the store can share
one) a fresh caller connection wrapped in a transaction adapter, plus a
business table to prove that effect and record commit or roll back together.
Every backend kind is one entry of :data:`KINDS` (at the end): its name, its marker, how to
make its stores and rigs, what it can do. The suites derive their parameters from it
(:func:`kinds`, :func:`contract_params`, :func:`rig_params`, :func:`async_rig_params`):
adding a backend is one entry there.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import pytest

from idemflow import IdempotencyError, LeaseLost, Policy, StoreUnavailable
from idemflow.stores.memory import MemoryStore
from idemflow.stores.protocol import MaintainableStore, Store, Transaction
from idemflow.stores.sqlite import SQLiteStore
from idemflow.transactions import PsycopgTransaction, SQLite3Transaction
from tests.factories import AsyncForwardingTransaction, ForwardingTransaction


def lease_lost(store: str) -> tuple[type[IdempotencyError], ...]:
    """What a request whose claim was taken over meets at its next fenced write on
    ``store`` (a backend's or a rig's name): LeaseLost, or on Galera StoreUnavailable when
    the new owner's commit reached its node first and aborted its open transaction (a
    certification failure, a 503). Either way nothing of it commits."""
    if store == "galera":
        return (LeaseLost, StoreUnavailable)
    return (LeaseLost,)


@dataclass
class Backend:
    name: str
    #: Every backend's store has the maintenance statements (the sweeper's, the purger's).
    store: MaintainableStore
    #: Opens a caller connection in a transaction adapter; None if unsupported.
    open_transaction: Callable[[], contextlib.AbstractContextManager[Transaction]] | None
    #: Writes one business row through the caller's connection.
    write: Callable[[Any, str], None]
    #: Counts committed business rows (read on a connection of its own).
    count: Callable[[], int]
    #: Opens a new store on the same data, e.g. in another process: (name, args).
    spec: tuple[str, tuple[Any, ...]] = ("memory", ())
    closers: list[Callable[[], None]] = field(default_factory=list)
    #: A SQL backend's two tables, which the ``backend`` fixture keeps for the next test
    #: (:meth:`close` drops them).
    tables: Tables | None = None

    @property
    def transactional(self) -> bool:
        return self.open_transaction is not None

    @property
    def lease_lost(self) -> tuple[type[IdempotencyError], ...]:
        """What a request whose claim was taken over meets at its next fenced write:
        :func:`lease_lost`."""
        return lease_lost(self.name)

    def close(self) -> None:
        """Closes the store and drops its tables (the ``backend`` fixture keeps them instead)."""
        for close in self.closers:
            close()
        if self.tables is not None:
            self.tables.drop()


#: A pair of tables' columns, indexes and constraints, as their catalog lists them.
Shape = list[tuple[Any, ...]]
#: Each catalog's view of ``{table}`` and ``biz_{table}``: columns, indexes, constraints
#: (none once they are dropped).
_SHAPES = {
    "postgres": """
        WITH pair AS (SELECT oid FROM pg_class WHERE oid IN
            (to_regclass('{table}'), to_regclass('biz_{table}')))
        SELECT attrelid::regclass::text, attname::text, format_type(atttypid, atttypmod),
            attnotnull::text, coalesce(pg_get_expr(adbin, adrelid), ''), attidentity::text
        FROM pg_attribute LEFT JOIN pg_attrdef ON (adrelid, adnum) = (attrelid, attnum)
        WHERE attrelid IN (SELECT oid FROM pair) AND attnum > 0 AND NOT attisdropped
        UNION ALL SELECT indrelid::regclass::text, indexrelid::regclass::text,
            pg_get_indexdef(indexrelid), '', '', ''
        FROM pg_index WHERE indrelid IN (SELECT oid FROM pair)
        UNION ALL SELECT conrelid::regclass::text, conname::text, pg_get_constraintdef(oid),
            '', '', ''
        FROM pg_constraint WHERE conrelid IN (SELECT oid FROM pair)""",
    "mysql": """
        SELECT table_name, column_name, column_type, is_nullable, column_default, extra,
            ordinal_position
        FROM information_schema.columns
        WHERE table_schema = DATABASE() AND table_name IN ('{table}', 'biz_{table}')
        UNION ALL SELECT table_name, index_name, column_name, non_unique, seq_in_index, '', ''
        FROM information_schema.statistics
        WHERE table_schema = DATABASE() AND table_name IN ('{table}', 'biz_{table}')
        UNION ALL SELECT table_name, constraint_name, constraint_type, '', '', '', ''
        FROM information_schema.table_constraints
        WHERE constraint_schema = DATABASE() AND table_name IN ('{table}', 'biz_{table}')""",
}


@dataclass(frozen=True)
class Tables:
    """A SQL backend's ``<name>`` (the store's) and ``biz_<name>``, as the ``backend``
    fixture keeps them: emptied and handed to the next test of that backend, not dropped
    (their DDL costs more than most tests; on Galera each statement runs on every node)."""

    name: str
    #: "postgres" or "mysql": the catalog that tells their shape.
    dialect: str
    #: Runs statements in autocommit on a connection of its own; the last one's rows.
    sql: Callable[..., list[tuple[Any, ...]]]

    def shape(self) -> Shape:
        return sorted(self.sql(_SHAPES[self.dialect].format(table=self.name)), key=repr)

    def empty(self) -> None:
        """PostgreSQL: a DELETE (no DDL). InnoDB: TRUNCATE, a new table (its AUTO_INCREMENT
        from 1): rows deleted but not purged yet would lock other gaps than a new table's,
        and deadlock the next test's transactions differently (one DDL still, not three)."""
        if self.dialect == "postgres":
            self.sql(f"DELETE FROM {self.name}", f"DELETE FROM biz_{self.name}")
        else:
            self.sql(f"TRUNCATE TABLE {self.name}", f"TRUNCATE TABLE biz_{self.name}")

    def drop(self) -> None:
        self.sql(f"DROP TABLE IF EXISTS {self.name}, biz_{self.name}")


def _postgres_sql(*statements: str) -> list[tuple[Any, ...]]:
    import psycopg

    from tests.conftest import POSTGRES_URL

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        for statement in statements:
            cursor = conn.execute(statement)
        return cursor.fetchall() if cursor.description else []


def _pymysql_sql(connect: Callable[[], Any]) -> Callable[..., list[tuple[Any, ...]]]:
    """:attr:`Tables.sql` on PyMySQL connections from ``connect``."""

    def sql(*statements: str) -> list[tuple[Any, ...]]:
        with contextlib.closing(connect()) as conn, conn.cursor() as cursor:
            conn.autocommit(True)
            for statement in statements:
                cursor.execute(statement)
            return list(cursor.fetchall())

    return sql


# --- SQLite -------------------------------------------------------------------


def sqlite_backend(tmp_path: Path, table: str) -> Backend:
    path = str(tmp_path / "keys.db")
    store = SQLiteStore(path, table=table)
    store.migrate()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE business (id INTEGER PRIMARY KEY, note TEXT)")
        conn.commit()

    @contextlib.contextmanager
    def open_transaction() -> Iterator[Transaction]:
        conn = sqlite3.connect(path, isolation_level=None, timeout=10)
        try:
            yield SQLite3Transaction(conn)
        finally:
            conn.close()

    def write(conn: Any, note: str) -> None:
        conn.execute("INSERT INTO business (note) VALUES (?)", (note,))

    def count() -> int:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            return int(conn.execute("SELECT count(*) FROM business").fetchone()[0])

    return Backend("sqlite", store, open_transaction, write, count, ("sqlite", (path, table)))


# --- PostgreSQL ---------------------------------------------------------------


def postgres_backend(table: str, create: bool = True) -> Backend:
    """``create``: make both tables (else they exist, migrated and empty)."""
    psycopg = pytest.importorskip("psycopg")
    from idemflow.stores.postgres import PostgresStore
    from tests.conftest import POSTGRES_URL, unreachable

    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            if create:
                conn.execute(f"CREATE TABLE biz_{table} (id BIGSERIAL PRIMARY KEY, note TEXT)")
    except psycopg.OperationalError as exc:
        unreachable(KINDS["postgres"].service, exc)
    store = PostgresStore(POSTGRES_URL, table=table, max_size=8, clock="caller")
    if create:
        store.migrate()

    @contextlib.contextmanager
    def open_transaction() -> Iterator[Transaction]:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            yield PsycopgTransaction(conn)

    def write(conn: Any, note: str) -> None:
        conn.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

    def count() -> int:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM biz_{table}").fetchone()
            return int(row[0])

    return Backend(
        "postgres",
        store,
        open_transaction,
        write,
        count,
        ("postgres", (POSTGRES_URL, table)),
        [store.close],
        Tables(table, "postgres", _postgres_sql),
    )


# --- MySQL / MariaDB ------------------------------------------------------------

MYSQL_URL = os.environ.get("IDEMFLOW_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")


def mysql_backend(table: str, *, found_rows: bool = False, create: bool = True) -> Backend:
    """MariaDB/MySQL; ``found_rows`` sets CLIENT_FOUND_ROWS on every connection; ``create``:
    make both tables (else they exist, migrated and empty)."""
    pymysql = pytest.importorskip("pymysql")
    from idemflow.stores.mysql import MySQLStore, connect_kwargs
    from idemflow.transactions import PyMySQLTransaction
    from tests.conftest import unreachable

    kwargs = {**connect_kwargs(MYSQL_URL), "client_flag": 2 if found_rows else 0}
    try:
        conn = pymysql.connect(**kwargs, autocommit=True, connect_timeout=3)
    except pymysql.err.OperationalError as exc:
        unreachable(KINDS["mysql"].service, exc)
    with contextlib.closing(conn), conn.cursor() as cursor:
        if create:
            cursor.execute(
                f"CREATE TABLE biz_{table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, note TEXT)"
            )
    store = MySQLStore(kwargs, table=table, max_size=8, clock="caller")
    if create:
        store.migrate()

    @contextlib.contextmanager
    def open_transaction() -> Iterator[Transaction]:
        with contextlib.closing(pymysql.connect(**kwargs, autocommit=True)) as conn:
            yield PyMySQLTransaction(conn)

    def write(conn: Any, note: str) -> None:
        with conn.cursor() as cursor:
            cursor.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

    def count() -> int:
        with contextlib.closing(pymysql.connect(**kwargs)) as conn, conn.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM biz_{table}")
            return int(cursor.fetchone()[0])

    name = "mysql-found-rows" if found_rows else "mysql"
    tables = Tables(table, "mysql", _pymysql_sql(lambda: pymysql.connect(**kwargs)))
    spec = ("mysql", (table, found_rows))
    return Backend(name, store, open_transaction, write, count, spec, [store.close], tables)


def _open_mysql(table: str, found_rows: bool = False) -> Store:
    from idemflow.stores.mysql import MySQLStore, connect_kwargs

    kwargs = {**connect_kwargs(MYSQL_URL), "client_flag": 2 if found_rows else 0}
    return MySQLStore(kwargs, table=table, max_size=4, clock="caller")


def mysql_admin(kwargs: dict[str, Any]) -> Any:
    """An autocommit pymysql connection for DDL and faults (MariaDB unreachable: fails
    under CI, else skips)."""
    pymysql = pytest.importorskip("pymysql")
    from tests.conftest import unreachable

    try:
        return pymysql.connect(**kwargs, autocommit=True, connect_timeout=3)
    except pymysql.err.OperationalError as exc:
        unreachable(KINDS["mysql"].service, exc)


@contextlib.asynccontextmanager
async def async_mysql_backend(table: str, *, max_size: int = 8) -> AsyncIterator[Rig]:
    """AsyncMySQLStore (asyncmy) on MariaDB: the key table and ``biz_<table>``, dropped after;
    the caller's transaction an AsyncmyTransaction on a fresh connection per request."""
    asyncmy = pytest.importorskip("asyncmy")
    from idemflow.stores.mysql import AsyncMySQLStore, connect_kwargs
    from idemflow.transactions import AsyncmyTransaction

    kwargs = connect_kwargs(MYSQL_URL)
    admin = mysql_admin(kwargs)
    store = AsyncMySQLStore(kwargs, table=table, max_size=max_size, clock="caller")

    @contextlib.asynccontextmanager
    async def open_transaction() -> AsyncIterator[Any]:
        conn = await asyncmy.connect(**kwargs, autocommit=True)
        try:
            yield AsyncmyTransaction(conn)
        finally:
            await conn.ensure_closed()

    async def write(conn: Any, note: str) -> None:
        async with conn.cursor() as cursor:
            await cursor.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

    def notes() -> list[str]:
        with admin.cursor() as cursor:
            cursor.execute(f"SELECT note FROM biz_{table} ORDER BY id")
            return [r[0] for r in cursor.fetchall()]

    with contextlib.closing(admin), admin.cursor() as cursor:
        await store.migrate()
        cursor.execute(
            f"CREATE TABLE biz_{table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, note TEXT)"
        )
        try:
            yield Rig(
                "mysql-asyncmy", store, False, open_transaction, write, _no_fault, notes, _no_peek
            )
        finally:
            await store.close()
            cursor.execute(f"DROP TABLE IF EXISTS {table}, biz_{table}")


class LoopThread:
    """An event loop in a thread of its own: sync callers run coroutines on it."""

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Any) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=120)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class BridgedTransaction(ForwardingTransaction):
    """An async transaction adapter, driven from sync code on a :class:`LoopThread`."""

    def __init__(self, inner: Any, loop: LoopThread) -> None:
        self.inner, self._loop = inner, loop

    @property
    def connection(self) -> Any:
        return self.inner.connection

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        return lambda *args: self._loop.run(method(*args))


class BridgedStore:
    """An async store, driven from sync code on a :class:`LoopThread`: so the sync contract
    suite runs the async store's own code (its caller transactions bridged alike)."""

    def __init__(self, inner: Any, loop: LoopThread) -> None:
        self.inner, self._loop = inner, loop

    def __getattr__(self, name: str) -> Any:
        import inspect

        value = getattr(self.inner, name)
        if not inspect.iscoroutinefunction(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(_awaitable(a) for a in args)
            kwargs = {k: _awaitable(v) for k, v in kwargs.items()}
            return self._loop.run(value(*args, **kwargs))

        return call


class ThreadedTransaction(AsyncForwardingTransaction):
    """A sync transaction a test wrapped around a :class:`BridgedTransaction` (one that
    pauses its commit, say), for the async store: each call runs in a worker thread, so
    the bridged one it reaches can run its coroutine on the (free) loop."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def connection(self) -> Any:
        return self.inner.connection

    def __getattr__(self, name: str) -> Any:
        import asyncio

        method = getattr(self.inner, name)

        async def call(*args: Any) -> Any:
            return await asyncio.to_thread(method, *args)

        return call


def _awaitable(value: Any) -> Any:
    """A store call's argument, with any caller transaction made one the async store awaits."""
    if isinstance(value, BridgedTransaction):
        return value.inner
    if hasattr(value, "fetchone") and hasattr(value, "commit"):
        return ThreadedTransaction(value)
    return value


def async_mysql_bridged_backend(table: str, create: bool = True) -> Backend:
    """AsyncMySQLStore (asyncmy) through :class:`BridgedStore`, for the sync contract suite;
    ``create``: make both tables (else they exist, migrated and empty)."""
    pymysql = pytest.importorskip("pymysql")
    asyncmy = pytest.importorskip("asyncmy")
    from idemflow.stores.mysql import AsyncMySQLStore, connect_kwargs
    from idemflow.transactions import AsyncmyTransaction
    from tests.conftest import unreachable

    kwargs = connect_kwargs(MYSQL_URL)
    try:
        admin = pymysql.connect(**kwargs, autocommit=True, connect_timeout=3)
    except pymysql.err.OperationalError as exc:
        unreachable(KINDS["mysql"].service, exc)
    if create:
        with admin.cursor() as cursor:
            cursor.execute(
                f"CREATE TABLE biz_{table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, note TEXT)"
            )
    loop = LoopThread()
    store: Any = BridgedStore(
        AsyncMySQLStore(kwargs, table=table, max_size=8, clock="caller"), loop
    )
    if create:
        store.migrate()

    @contextlib.contextmanager
    def open_transaction() -> Iterator[Any]:
        conn = loop.run(asyncmy.connect(**kwargs, autocommit=True))
        try:
            yield BridgedTransaction(AsyncmyTransaction(conn), loop)
        finally:
            loop.run(conn.ensure_closed())

    def write(conn: Any, note: str) -> None:
        async def insert() -> None:
            async with conn.cursor() as cursor:
                await cursor.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

        loop.run(insert())

    def count() -> int:
        with admin.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM biz_{table}")
            return int(cursor.fetchone()[0])

    def close() -> None:
        store.close()
        loop.stop()
        admin.close()

    tables = Tables(table, "mysql", _pymysql_sql(lambda: pymysql.connect(**kwargs)))
    spec = ("mysql", (table,))
    return Backend("mysql-async", store, open_transaction, write, count, spec, [close], tables)


# --- MariaDB Galera (three primaries) ------------------------------------------------


def galera_connector(urls: tuple[str, ...]) -> Callable[[], Any]:
    """A PyMySQL connection factory that opens each new connection on the next node.

    The store's pool, and every caller connection, spread over all primaries:
    claimants of one key race from different nodes, and meet in certification.
    """
    import itertools

    import pymysql

    from idemflow.stores.mysql import DEFAULT_LOCK_WAIT_TIMEOUT, connect_kwargs

    nodes = itertools.cycle([connect_kwargs(url) for url in urls])
    lock = threading.Lock()
    # wsrep_sync_wait = 1, as docs/stores.md recommends for callers' connections: a
    # transaction begins only once its node applied the claim made on another node.
    init = (
        f"SET SESSION innodb_lock_wait_timeout = {DEFAULT_LOCK_WAIT_TIMEOUT}, "
        "SESSION wsrep_sync_wait = 1"
    )

    def connect() -> Any:
        with lock:
            kwargs = next(nodes)
        return pymysql.connect(**kwargs, charset="utf8mb4", connect_timeout=5, init_command=init)

    return connect


def galera_urls() -> tuple[str, ...]:
    """The session's Galera cluster (started on first use): one URL per primary."""
    from tests._galera import GaleraUnavailable, shared_cluster
    from tests.conftest import unreachable

    try:
        return tuple(shared_cluster().urls)
    except (GaleraUnavailable, OSError) as exc:
        unreachable(KINDS["galera"].service, exc)
        raise  # unreachable() never returns


def galera_backend(table: str, create: bool = True) -> Backend:
    """The MySQL store, unchanged, on a 3-node Galera cluster, its connections on every node;
    ``create``: make both tables (else they exist, migrated and empty)."""
    pytest.importorskip("pymysql")
    urls = galera_urls()
    store = _open_galera(table, urls, max_size=8)
    open_transaction, write = _galera_caller(table, urls)
    connect = galera_connector(urls)
    if create:
        store.migrate()
        with contextlib.closing(connect()) as conn, conn.cursor() as cursor:
            cursor.execute(
                f"CREATE TABLE biz_{table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, note TEXT)"
            )

    def count() -> int:
        # wsrep_sync_wait: wait until this node has applied every commit made before.
        with contextlib.closing(connect()) as conn, conn.cursor() as cursor:
            cursor.execute("SET SESSION wsrep_sync_wait = 1")
            cursor.execute(f"SELECT count(*) FROM biz_{table}")
            return int(cursor.fetchone()[0])

    spec = ("galera", (table, urls))
    tables = Tables(table, "mysql", _pymysql_sql(connect))
    return Backend("galera", store, open_transaction, write, count, spec, [store.close], tables)


def _open_galera(table: str, urls: tuple[str, ...], max_size: int = 4) -> Any:
    from idemflow.stores.mysql import MySQLStore

    return MySQLStore(galera_connector(urls), table=table, max_size=max_size, clock="caller")


def _galera_caller(table: str, urls: tuple[str, ...]) -> Caller:
    from idemflow.transactions import PyMySQLTransaction

    connect = galera_connector(urls)

    @contextlib.contextmanager
    def open_transaction() -> Iterator[Transaction]:
        with contextlib.closing(connect()) as conn:
            conn.autocommit(True)
            yield PyMySQLTransaction(conn)

    def write(conn: Any, note: str) -> None:
        with conn.cursor() as cursor:
            cursor.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

    return open_transaction, write


@pytest.fixture(scope="session", autouse=True)
def _stop_galera() -> Iterator[None]:
    """Stop the session's Galera cluster (if a test started one) and remove its files."""
    yield
    from tests._galera import stop_shared_cluster

    stop_shared_cluster()


# --- Redis / Redis Cluster --------------------------------------------------------

REDIS_URL = os.environ.get("IDEMFLOW_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
#: The contract suite's policy (request_timeout=5, retention=3600).
REDIS_POLICY_ARGS = (5.0, 3600.0)


def redis_client(url: str = REDIS_URL, *, cluster: bool = False) -> Any:
    """A client that gives up quickly: an outage must surface, not hang the suite."""
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    options: dict[str, Any] = {"socket_timeout": 5, "socket_connect_timeout": 2}
    if cluster:
        return RedisCluster.from_url(url, retry=Retry(NoBackoff(), 1), **options)
    return Redis.from_url(url, retry=Retry(NoBackoff(), 1), **options)


def _open_redis(prefix: str, url: str = REDIS_URL, cluster: bool = False) -> Store:
    from idemflow.stores.redis import RedisStore

    client = redis_client(url, cluster=cluster)
    timeout, retention = REDIS_POLICY_ARGS
    policy = Policy(request_timeout=timeout, retention=retention)
    # The shared Redis and the test clusters keep nothing on disk: acknowledged.
    return RedisStore(client, policy=policy, prefix=prefix, clock="caller", allow_volatile=True)


def delete_keys(client: Any, prefix: str) -> None:
    """Deletes every key under ``prefix``: one pipelined batch (per node on a cluster), not a
    round trip per key (a store writes 1024 bucket epochs as it starts)."""
    with client.pipeline(transaction=False) as pipe:
        for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            pipe.delete(key)
        pipe.execute()


async def adelete_keys(client: Any, prefix: str) -> None:
    """:func:`delete_keys` with an asyncio client."""
    async with client.pipeline(transaction=False) as pipe:
        async for key in client.scan_iter(match=f"{prefix}:*", count=1000):
            pipe.delete(key)
        await pipe.execute()


def redis_backend(
    table: str, url: str = REDIS_URL, *, cluster: bool = False, name: str | None = None
) -> Backend:
    """Redis has no transaction to share: business rows go to a list, as with the memory store."""
    pytest.importorskip("redis")
    from tests.conftest import unreachable

    name = name or ("redis-cluster" if cluster else "redis")
    store: Any = _open_redis(table, url, cluster)
    try:
        store.migrate()
    except Exception as exc:
        store.close()
        unreachable(KINDS[name].service, exc)
    rows: list[str] = []

    def drop() -> None:
        delete_keys(store.client, table)
        store.close()

    backend = Backend(
        name,
        store,
        None,
        lambda conn, note: rows.append(note),
        lambda: len(rows),
        (name, (table, url)),
    )
    backend.closers.append(drop)
    return backend


def redis_cluster_urls() -> list[str]:
    """The session's Redis Cluster (started on first use): its URL, then each master's."""
    from tests._redis_cluster import ClusterUnavailable, shared_cluster
    from tests.conftest import unreachable

    try:
        cluster = shared_cluster()
    except (ClusterUnavailable, OSError) as exc:
        unreachable(KINDS["redis-cluster"].service, exc)
        raise  # unreachable() never returns
    return [cluster.url, *(f"redis://{address}/0" for address in cluster.addresses)]


def redis_cluster_backend(table: str, *, valkey: bool = False) -> Backend:
    """The Redis store, unchanged, on a real 3-master Redis (or Valkey) cluster started
    for this session."""
    from tests._redis_cluster import ClusterUnavailable, shared_cluster, valkey_server
    from tests.conftest import unreachable

    name = "valkey-cluster" if valkey else "redis-cluster"
    try:
        cluster = shared_cluster(valkey_server() if valkey else "redis-server")
    except (ClusterUnavailable, OSError) as exc:
        unreachable(KINDS[name].service, exc)
    return redis_backend(table, cluster.url, cluster=True, name=name)


@pytest.fixture(scope="session", autouse=True)
def _stop_redis_cluster() -> Iterator[None]:
    """Shut down the session's Redis Cluster (if a test started one) and remove its files."""
    yield
    from tests._redis_cluster import stop_shared_cluster

    stop_shared_cluster()


# --- memory -------------------------------------------------------------------


def memory_backend() -> Backend:
    rows: list[str] = []
    return Backend(
        "memory",
        MemoryStore(),
        None,
        lambda conn, note: rows.append(note),
        lambda: len(rows),
    )


def _open_sqlite(path: str, table: str) -> Store:
    return SQLiteStore(path, table=table)


def _open_postgres(url: str, table: str) -> Store:
    from idemflow.stores.postgres import PostgresStore

    return PostgresStore(url, table=table, max_size=4, clock="caller")


def open_store(spec: tuple[str, tuple[Any, ...]]) -> Store:
    """Open a store from a picklable spec (used by child processes in race tests)."""
    kind, args = spec
    reopen = KINDS[kind].reopen
    assert reopen is not None, f"{kind}: its store lives in one process"
    return reopen(*args)


# --- the caller's side, rebuilt from a spec (child processes in race tests) -------

#: (open a caller transaction, write one business row through its connection).
Caller = tuple[
    Callable[[], contextlib.AbstractContextManager[Transaction]], Callable[[Any, str], None]
]


def open_caller(spec: tuple[str, tuple[Any, ...]]) -> Caller | None:
    """The caller's side of a backend from its picklable spec; None if it has no transaction.

    Mirrors the ``open_transaction``/``write`` pair each backend above builds, for
    code that only has the spec (a child process cannot unpickle closures).
    """
    kind, args = spec
    caller = KINDS[kind].caller
    return None if caller is None else caller(*args)


def _sqlite_caller(path: str, table: str) -> Caller:
    @contextlib.contextmanager
    def open_transaction() -> Iterator[Transaction]:
        with contextlib.closing(sqlite3.connect(path, isolation_level=None, timeout=10)) as conn:
            yield SQLite3Transaction(conn)

    def write(conn: Any, note: str) -> None:
        conn.execute("INSERT INTO business (note) VALUES (?)", (note,))

    return open_transaction, write


def _postgres_caller(url: str, table: str) -> Caller:
    import psycopg

    @contextlib.contextmanager
    def open_transaction() -> Iterator[Transaction]:
        with psycopg.connect(url, autocommit=True) as conn:
            yield PsycopgTransaction(conn)

    def write(conn: Any, note: str) -> None:
        conn.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

    return open_transaction, write


def _mysql_caller(table: str, found_rows: bool = False) -> Caller:
    import pymysql

    from idemflow.stores.mysql import connect_kwargs
    from idemflow.transactions import PyMySQLTransaction

    kwargs = {**connect_kwargs(MYSQL_URL), "client_flag": 2 if found_rows else 0}

    @contextlib.contextmanager
    def open_transaction() -> Iterator[Transaction]:
        with contextlib.closing(pymysql.connect(**kwargs, autocommit=True)) as conn:
            yield PyMySQLTransaction(conn)

    def write(conn: Any, note: str) -> None:
        with conn.cursor() as cursor:
            cursor.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

    return open_transaction, write


# --- one store per mode, on a pool its application shares (guarantees/test_phase_rules.py) ---


@dataclass
class Rig:
    """A store, the request's transaction on that store's own pool, and real faults.

    Sync rigs are driven by the sync driver (in a worker thread), async ones by the async
    driver; ``write``/``lose`` are coroutine functions on async rigs, plain ones on sync.
    """

    name: str
    store: Any
    sync: bool
    #: Opens the request's transaction on the store's own pool (None: no-transaction mode).
    transaction: Callable[[], Any] | None
    #: Writes one business row through the attempt's connection.
    write: Callable[[Any, str], Any]
    #: A real fault, from the handler: its completion can no longer be written.
    lose: Callable[[Any], Any]
    #: The committed business rows, read on a connection outside the pool.
    notes: Callable[[], list[str]]
    #: A record's state read outside the pool (from inside a handler); None: no record.
    peek: Callable[[str], Any]
    #: What the lost completion surfaces as.
    lost: type[BaseException] = Exception
    #: Undoes ``lose`` once the run is over (a lock held on the file, say).
    heal: Callable[[], None] = lambda: None
    #: Holds the one connection of the transaction's pool (the store's, unless the rig was
    #: opened with ``app_pool``) elsewhere until exit, a wait for it bounded by the seconds
    #: given meanwhile; yields the error a checkout then meets (the pool's own timeout).
    #: None: the store has no pool (SQLite).
    crowd: Callable[[float], contextlib.AbstractAsyncContextManager[BaseException]] | None = None
    #: Middleware mode (async rigs): the endpoint's own effect, committed on its own with no
    #: transaction of ours, through the store's own pool or connection where it has one
    #: (SQLite: a connection of its own, the memory store: a list); ``notes`` reads it.
    charge: Callable[[str], Awaitable[None]] | None = None
    #: The request's connection as a transactional integration takes it
    #: (``Idempotent(connect=…, transaction=…)``): a checkout of the pool ``transaction``
    #: takes from (SQLite: a new connection), and the adapter that wraps it.
    connect: Callable[[], Any] | None = None
    adapter: Callable[[Any], Any] | None = None

    @property
    def transactional(self) -> bool:
        return self.transaction is not None

    @property
    def single_commit(self) -> bool:
        return self.transaction is not None and bool(self.store.supports_single_commit)

    @property
    def lease_lost(self) -> tuple[type[IdempotencyError], ...]:
        """What a request whose claim was taken over meets at its next fenced write:
        :func:`lease_lost`."""
        return lease_lost(self.name)

    async def call(self, method: str, *args: Any) -> Any:
        """A store method, awaited or run in a worker thread."""
        import asyncio

        function = getattr(self.store, method)
        if self.sync:
            return await asyncio.to_thread(function, *args)
        return await function(*args)


def crowding(
    pool: Any, sync: bool, wait: str
) -> Callable[[float], contextlib.AbstractAsyncContextManager[BaseException]]:
    """:attr:`Rig.crowd` for ``pool`` of one connection, whose attribute ``wait`` bounds a
    wait for it (``timeout``: psycopg_pool's; the MySQL stores' own pools: ``_timeout``)."""

    async def checkout() -> None:
        if sync:
            with pool.connection():
                return
        async with pool.connection():
            return

    @contextlib.asynccontextmanager
    async def crowd(seconds: float) -> AsyncIterator[BaseException]:
        async with contextlib.AsyncExitStack() as held:
            if sync:
                held.enter_context(pool.connection())
            else:
                await held.enter_async_context(pool.connection())
            bound = getattr(pool, wait)
            setattr(pool, wait, seconds)
            try:
                try:
                    await checkout()
                except Exception as exc:  # the pool's own timeout error: what the test wants
                    met = exc
                else:
                    raise AssertionError("the pool served a second connection")
                yield met
            finally:
                setattr(pool, wait, bound)

    return crowd


@contextlib.asynccontextmanager
async def open_rig(
    rig_id: str,
    table: str,
    tmp_path: Path,
    *,
    transactional: bool,
    pool_size: int = 1,
    app_pool: bool = False,
    sqlalchemy: Literal["connect", "session"] | None = None,
    busy_timeout: float = 0.05,
) -> AsyncIterator[Rig]:
    """The store a rig id names (:func:`rig_params`: ``postgres``, ``postgres-sync``, …) on a
    pool of ``pool_size`` that requests share, clock="caller"; its kind's :attr:`Kind.rig`.

    ``galera`` is the MySQL rig (async) on the session's Galera cluster, its connections
    spread over the three primaries; ``redis-cluster`` the Redis rig (async) on the
    session's Redis Cluster.
    ``app_pool`` (a :attr:`Kind.pooled` store): the request's transaction takes its connection
    from a pool of its own instead (a second store's, of ``pool_size``), as an application
    with a pool apart from the key store's: no claim runs on a connection it lends.
    ``sqlalchemy`` (PostgreSQL and MySQL): that pool is a SQLAlchemy engine's instead (see
    :func:`sqlalchemy_app`), the transaction SQLAlchemy's adapter on one of its
    connections (``"connect"``) or sessions (``"session"``).
    ``busy_timeout`` (SQLite): the store's; short by default, so that the write lock held
    past it is a quick fault. Under pressure, where other writers of the file may hold the
    lock a while (a loaded machine), the store's default (5 s) is the honest one.
    (MySQL) a longer one is also the pool's wait for a connection: a test of what a pool of
    one may not do (wait on itself) is not one of how fast a loaded Galera cluster commits.
    """
    if sqlalchemy is not None:
        async with contextlib.AsyncExitStack() as stack:
            rig = await stack.enter_async_context(
                open_rig(rig_id, table, tmp_path, transactional=transactional)
            )
            yield await stack.enter_async_context(sqlalchemy_app(rig, table, pool_size, sqlalchemy))
        return
    kind = rig_kind(rig_id)
    if app_pool and not kind.pooled:
        raise ValueError(f"{rig_id}: only a pooled store's rig has an app pool")
    assert kind.rig is not None, f"{rig_id}: no rig"
    opened = kind.rig(rig_id, table, tmp_path, transactional, pool_size, app_pool, busy_timeout)
    async with opened as rig:
        yield rig


@contextlib.asynccontextmanager
async def sqlalchemy_app(
    rig: Rig, table: str, pool_size: int, holder: Literal["connect", "session"] = "connect"
) -> AsyncIterator[Rig]:
    """``rig`` with the request's transaction SQLAlchemy's (``SQLAlchemyTransaction``, or
    ``AsyncSQLAlchemyTransaction`` on an async rig) on an engine of its own, on the rig's
    database (psycopg; PyMySQL or asyncmy), its pool of ``pool_size`` and no overflow, as
    an application with a SQLAlchemy pool apart from the key store's. ``"connect"``: on a
    connection taken as the integrations take one (``connect=engine.connect``), so the
    checkout is its BEGIN's; ``"session"``: on a session, which checks one out only at
    its first statement. :attr:`Rig.crowd` holds that pool's connections; the error it
    yields, SQLAlchemy's ``TimeoutError``."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
    from sqlalchemy.orm import Session

    from idemflow._async.edge import pooled_transaction as async_pooled
    from idemflow._sync.edge import pooled_transaction as sync_pooled
    from idemflow.transactions import AsyncSQLAlchemyTransaction, SQLAlchemyTransaction
    from tests.conftest import POSTGRES_URL

    if rig.name.startswith("postgres"):
        url = POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1)
    else:
        driver = "pymysql" if rig.sync else "asyncmy"
        url = MYSQL_URL.replace("mysql://", f"mysql+{driver}://", 1) + "?charset=utf8mb4"
    options = {"pool_size": pool_size, "max_overflow": 0, "pool_timeout": 5}
    insert = sqlalchemy.text(f"INSERT INTO biz_{table} (note) VALUES (:note)")
    if rig.sync:
        engine = sqlalchemy.create_engine(url, **options)
        pool = engine.pool

        @contextlib.contextmanager
        def in_session() -> Iterator[Any]:
            with Session(engine) as session:
                yield SQLAlchemyTransaction(session)

        def transaction() -> Any:
            if holder == "session":
                return in_session()
            return sync_pooled(engine.connect, SQLAlchemyTransaction)

        def write(conn: Any, note: str) -> None:
            conn.execute(insert, {"note": note})
    else:
        aengine = create_async_engine(url, **options)
        pool = aengine.sync_engine.pool

        @contextlib.asynccontextmanager
        async def in_async_session() -> AsyncIterator[Any]:
            async with AsyncSession(aengine) as session:
                yield AsyncSQLAlchemyTransaction(session)

        def transaction() -> Any:
            if holder == "session":
                return in_async_session()
            return async_pooled(aengine.connect, AsyncSQLAlchemyTransaction)

        async def write(conn: Any, note: str) -> None:  # type: ignore[misc]
            await conn.execute(insert, {"note": note})

    @contextlib.asynccontextmanager
    async def crowd(seconds: float) -> AsyncIterator[BaseException]:
        async with contextlib.AsyncExitStack() as held:
            for _ in range(pool_size):
                if rig.sync:
                    held.enter_context(engine.connect())
                else:
                    await held.enter_async_context(aengine.connect())
            bound, pool._timeout = pool._timeout, seconds
            try:
                try:
                    if rig.sync:
                        engine.connect().close()
                    else:
                        await aengine.connect().start()
                except sqlalchemy.exc.TimeoutError as exc:
                    met = exc
                else:
                    raise AssertionError("the pool served one connection too many")
                yield met
            finally:
                pool._timeout = bound

    try:
        yield replace(rig, transaction=transaction, write=write, crowd=crowd)
    finally:
        if rig.sync:
            engine.dispose()
        else:
            await aengine.dispose()


@contextlib.asynccontextmanager
async def _postgres_rig(
    kind: str,
    table: str,
    tmp_path: Path,
    transactional: bool,
    pool_size: int,
    app_pool: bool,
    busy_timeout: float,
) -> AsyncIterator[Rig]:
    from tests.factories import psycopg_or_skip

    psycopg = psycopg_or_skip()
    from idemflow._async.edge import pooled_transaction as async_pooled
    from idemflow._sync.edge import pooled_transaction as sync_pooled
    from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore
    from idemflow.transactions import AsyncPsycopgTransaction, PsycopgTransaction
    from tests.conftest import POSTGRES_URL
    from tests.faults import named_url

    name = f"idemflow-{table}"  # the store's connections, named in pg_stat_activity
    admin = psycopg.connect(POSTGRES_URL, autocommit=True)
    admin.execute(f"CREATE TABLE biz_{table} (id BIGSERIAL PRIMARY KEY, note TEXT)")
    # Its DDL may wait on a catalog lock other tests hold: not the claims' 50 ms bound.
    outside = PostgresStore(
        POSTGRES_URL, table=table, max_size=1, clock="caller", claim_lock_timeout_ms=10_000
    )
    outside.migrate()
    sync = kind.endswith("-sync")

    async def open_store() -> Any:
        if sync:
            return PostgresStore(named_url(name), table=table, max_size=pool_size, clock="caller")
        opened = AsyncPostgresStore(
            named_url(name), table=table, max_size=pool_size, clock="caller"
        )
        await opened.pool.open(wait=True)
        return opened

    store = await open_store()
    app = await open_store() if app_pool else store

    def end_session(pid: int) -> None:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    def lose_the_store() -> None:
        """No transaction: the store's next completion ends its own server session before
        it takes effect, a connection lost *during* the completion (one ended before it,
        while the handler ran, the store's checkout skips: its socket says so)."""
        admin.execute(
            f"CREATE OR REPLACE FUNCTION die_{table}() RETURNS trigger LANGUAGE plpgsql "
            "AS $$ BEGIN IF NEW.state IN ('completed', 'failed_permanent') THEN "
            "PERFORM pg_terminate_backend(pg_backend_pid()); END IF; RETURN NEW; END $$"
        )
        admin.execute(
            f"CREATE OR REPLACE TRIGGER die BEFORE UPDATE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION die_{table}()"
        )

    def heal() -> None:
        admin.execute(f"DROP TRIGGER IF EXISTS die ON {table}")
        admin.execute(f"DROP FUNCTION IF EXISTS die_{table}()")

    if sync:

        def write(conn: Any, note: str) -> None:
            conn.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

        def lose(conn: Any) -> None:
            if conn is None:
                lose_the_store()
                return
            end_session(conn.execute("SELECT pg_backend_pid()").fetchone()[0])

        def transaction() -> Any:
            return sync_pooled(app.pool.connection, PsycopgTransaction)
    else:

        async def write(conn: Any, note: str) -> None:  # type: ignore[misc]
            await conn.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

        async def lose(conn: Any) -> None:  # type: ignore[misc]
            if conn is None:
                lose_the_store()
                return
            row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
            end_session(row[0])

        def transaction() -> Any:
            return async_pooled(app.pool.connection, AsyncPsycopgTransaction)

    sql = admin.execute
    async with _sql_rig(
        kind, store, app, sync, transactional, transaction, write, lose, table, outside, admin, sql
    ) as rig:
        adapter = PsycopgTransaction if sync else AsyncPsycopgTransaction
        try:
            yield replace(rig, connect=app.pool.connection, adapter=adapter, heal=heal)
        finally:
            heal()


@contextlib.asynccontextmanager
async def _mysql_rig(
    kind: str,
    table: str,
    tmp_path: Path,
    transactional: bool,
    pool_size: int,
    app_pool: bool,
    busy_timeout: float,
) -> AsyncIterator[Rig]:
    """MariaDB, or (``galera``) the session's Galera cluster: each new connection of the
    store's pool opens on the next primary, and a fault KILLs each on its own node."""
    pymysql = pytest.importorskip("pymysql")
    from idemflow._async.edge import pooled_transaction as async_pooled
    from idemflow._sync.edge import pooled_transaction as sync_pooled
    from idemflow.stores.mysql import AsyncMySQLStore, MySQLStore, connect_kwargs
    from idemflow.transactions import AsyncmyTransaction, PyMySQLTransaction
    from tests.conftest import unreachable

    galera = kind == "galera"
    urls = galera_urls() if galera else (MYSQL_URL,)
    nodes = [{**connect_kwargs(url), "charset": "utf8mb4"} for url in urls]
    init = "SET SESSION innodb_lock_wait_timeout = 5"
    try:
        # One per node, for faults; the first also for DDL and reads (on Galera, each read
        # first waits until its node applied every commit certified before it).
        admins = [pymysql.connect(**node, autocommit=True, connect_timeout=3) for node in nodes]
    except pymysql.err.OperationalError as exc:
        unreachable(rig_kind(kind).service, exc)
    admin = admins[0]

    def sql(statement: str) -> list[Any]:
        with admin.cursor() as cursor:
            if galera:
                cursor.execute("SET SESSION wsrep_sync_wait = 1")
            cursor.execute(statement)
            return list(cursor.fetchall())

    sql(f"CREATE TABLE biz_{table} (id BIGINT AUTO_INCREMENT PRIMARY KEY, note TEXT)")
    outside = MySQLStore(
        galera_connector(urls) if galera else MYSQL_URL, table=table, max_size=1, clock="caller"
    )
    outside.migrate()
    # The store's connections (connection, node, thread id), so a fault can end them; each
    # new one opens on the next node.
    opened: list[tuple[Any, int, int]] = []
    turns = itertools.count()

    def next_node() -> int:
        return next(turns) % len(nodes)

    def kill(node: int, thread_id: int) -> None:
        with admins[node].cursor() as cursor:
            cursor.execute(f"KILL CONNECTION {int(thread_id)}")

    killers: list[threading.Thread] = []

    def lose_the_store() -> None:
        """No transaction: the store's next completion loses its connection *during* the
        statement (one KILLed before it, while the handler ran, the store's checkout sees
        and replaces): a trigger holds the completion asleep, and a thread KILLs the
        connection asleep in it, on its node. (A KILL of its own connection inside the
        trigger works on MariaDB, and is refused on Galera as an implicit commit.)"""
        sql(
            f"CREATE OR REPLACE TRIGGER die_{table} BEFORE UPDATE ON {table} FOR EACH ROW "
            "BEGIN IF NEW.state IN ('completed', 'failed_permanent') THEN "
            "DO SLEEP(10); END IF; END"
        )
        killer = threading.Thread(target=kill_the_completion_asleep, daemon=True)
        killer.start()
        killers.append(killer)

    def kill_the_completion_asleep() -> None:
        own = [pymysql.connect(**node, autocommit=True) for node in nodes]
        try:
            for _ in range(500):  # 10 s at most
                for node, conn in enumerate(own):
                    ours = {thread_id for _, on, thread_id in list(opened) if on == node}
                    with conn.cursor() as cursor:
                        cursor.execute(
                            "SELECT ID FROM information_schema.PROCESSLIST "
                            "WHERE STATE = 'User sleep'"
                        )
                        asleep = [row[0] for row in cursor.fetchall() if row[0] in ours]
                        for thread_id in asleep:
                            cursor.execute(f"KILL CONNECTION {int(thread_id)}")
                    if asleep:
                        return
                time.sleep(0.02)
        finally:
            for conn in own:
                conn.close()

    def heal() -> None:
        while killers:
            killers.pop().join(15)
        sql(f"DROP TRIGGER IF EXISTS die_{table}")

    def kill_connection(conn: Any) -> None:
        kill(*next((node, thread_id) for c, node, thread_id in opened if c is conn))

    sync = kind.endswith("-sync")
    store: Any
    wait = busy_timeout if busy_timeout > Policy().store_wait_seconds else None

    if sync:

        def connect() -> Any:
            node = next_node()
            conn = pymysql.connect(**nodes[node], autocommit=True, init_command=init)
            opened.append((conn, node, conn.thread_id()))
            return conn

        store = MySQLStore(connect, table=table, max_size=pool_size, clock="caller", timeout=wait)
        app = (
            MySQLStore(connect, table=table, max_size=pool_size, clock="caller", timeout=wait)
            if app_pool
            else store
        )

        def write(conn: Any, note: str) -> None:
            with conn.cursor() as cursor:
                cursor.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

        def lose(conn: Any) -> None:
            if conn is None:
                lose_the_store()
                return
            kill_connection(conn)

        def transaction() -> Any:
            return sync_pooled(app.pool.connection, PyMySQLTransaction)
    else:
        asyncmy = pytest.importorskip("asyncmy")

        async def aconnect() -> Any:
            node = next_node()
            conn = await asyncmy.connect(**nodes[node], autocommit=True, init_command=init)
            async with conn.cursor() as cursor:
                await cursor.execute("SELECT CONNECTION_ID()")
                opened.append((conn, node, int((await cursor.fetchone())[0])))
            return conn

        store = AsyncMySQLStore(
            aconnect, table=table, max_size=pool_size, clock="caller", timeout=wait
        )
        app = (
            AsyncMySQLStore(aconnect, table=table, max_size=pool_size, clock="caller", timeout=wait)
            if app_pool
            else store
        )

        async def write(conn: Any, note: str) -> None:  # type: ignore[misc]
            async with conn.cursor() as cursor:
                await cursor.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

        async def lose(conn: Any) -> None:  # type: ignore[misc]
            if conn is None:
                lose_the_store()
                return
            kill_connection(conn)

        def transaction() -> Any:
            return async_pooled(app.pool.connection, AsyncmyTransaction)

    try:
        async with _sql_rig(
            kind,
            store,
            app,
            sync,
            transactional,
            transaction,
            write,
            lose,
            table,
            outside,
            admin,
            sql,
        ) as rig:
            adapter = PyMySQLTransaction if sync else AsyncmyTransaction
            try:
                yield replace(rig, connect=app.pool.connection, adapter=adapter, heal=heal)
            finally:
                heal()
    finally:
        for other in admins[1:]:
            other.close()


@contextlib.asynccontextmanager
async def _sql_rig(
    kind: str,
    store: Any,
    app: Any,
    sync: bool,
    transactional: bool,
    transaction: Callable[[], Any],
    write: Callable[[Any, str], Any],
    lose: Callable[[Any], Any],
    table: str,
    outside: Any,
    admin: Any,
    sql: Callable[[str], Any],
) -> AsyncIterator[Rig]:
    """What the PostgreSQL and MySQL rigs share once their store is open: the Rig, its
    ``notes`` and ``peek`` read past the pool (``sql`` runs a statement on ``admin``,
    ``outside`` is a second store on ``table``, ``app`` the store whose pool the
    request's transaction takes from), a loss surfacing as StoreUnavailable; then the
    stores and ``admin`` closed and both tables dropped."""
    from idemflow import StoreUnavailable

    def notes() -> list[str]:
        return [r[0] for r in sql(f"SELECT note FROM biz_{table} ORDER BY id")]

    def peek(key: str) -> Any:
        record = outside.get("alice", key)
        return None if record is None else record.state

    async def charge(note: str) -> None:
        async with app.pool.connection() as conn:
            await write(conn, note)

    try:
        yield Rig(
            kind,
            store,
            sync,
            transaction if transactional else None,
            write,
            lose,
            notes,
            peek,
            StoreUnavailable,
            crowd=crowding(
                app.pool, sync, "timeout" if kind.startswith("postgres") else "_timeout"
            ),
            charge=None if sync else charge,
        )
    finally:
        await _close(store, sync)
        if app is not store:
            await _close(app, sync)
        outside.close()
        sql(f"DROP TABLE IF EXISTS {table}, biz_{table}")
        admin.close()


async def _close(store: Any, sync: bool) -> None:
    """Closes a sync store or an async one (the rigs open either)."""
    if sync:
        store.close()
    else:
        await store.close()


#: A parent id that never exists: a business row naming it fails the COMMIT (deferred FK).
ORPHAN_PARENT = 42


@contextlib.asynccontextmanager
async def _sqlite_rig(
    kind: str,
    table: str,
    tmp_path: Path,
    transactional: bool,
    pool_size: int,
    app_pool: bool,
    busy_timeout: float,
) -> AsyncIterator[Rig]:
    """SQLite has no pool: each request opens its connection. Its faults: in a transaction,
    a deferred foreign key that fails the COMMIT; without one, another connection holding
    the write lock past the store's busy timeout (so the completion is "database is locked")."""
    from idemflow.stores.sqlite import AsyncSQLiteStore, SQLiteStore
    from idemflow.transactions import AsyncSQLite3Connection, AsyncSQLite3Transaction

    path = str(tmp_path / f"{table}.db")
    sync = kind.endswith("-sync")
    store: Any
    if sync:
        store = SQLiteStore(path, table=table, busy_timeout=busy_timeout)
        store.migrate()
    else:
        store = AsyncSQLiteStore(path, table=table, busy_timeout=busy_timeout)
        await store.migrate()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
        conn.execute(
            "CREATE TABLE business (id INTEGER PRIMARY KEY, note TEXT, parent INTEGER "
            "REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)"
        )
        conn.commit()
    holders: list[sqlite3.Connection] = []

    def caller() -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None, timeout=10, check_same_thread=False)
        conn.execute("PRAGMA foreign_keys = ON")
        return conn

    def hold_the_write_lock() -> None:
        holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")
        holders.append(holder)

    def heal() -> None:
        for holder in holders:
            holder.rollback()
            holder.close()
        holders.clear()

    orphan = "INSERT INTO business (note, parent) VALUES ('orphan', ?)"
    if sync:

        def write(conn: Any, note: str) -> None:
            conn.execute("INSERT INTO business (note) VALUES (?)", (note,))

        def lose(conn: Any) -> None:
            if conn is None:
                hold_the_write_lock()
                return
            conn.execute(orphan, (ORPHAN_PARENT,))

        def connect() -> Any:
            return contextlib.closing(caller())

        adapter: Callable[[Any], Any] = SQLite3Transaction

        @contextlib.contextmanager
        def transaction() -> Iterator[Any]:
            with contextlib.closing(caller()) as conn:
                yield SQLite3Transaction(conn)
    else:

        async def write(conn: Any, note: str) -> None:  # type: ignore[misc]
            await conn.run(conn.raw.execute, "INSERT INTO business (note) VALUES (?)", (note,))

        async def lose(conn: Any) -> None:  # type: ignore[misc]
            if conn is None:
                hold_the_write_lock()
                return
            await conn.run(conn.raw.execute, orphan, (ORPHAN_PARENT,))

        @contextlib.asynccontextmanager
        async def aconnect() -> AsyncIterator[AsyncSQLite3Connection]:
            conn = AsyncSQLite3Connection(caller())
            try:
                yield conn
            finally:
                conn.close()

        connect, adapter = aconnect, AsyncSQLite3Transaction

        @contextlib.asynccontextmanager
        async def transaction() -> AsyncIterator[Any]:  # type: ignore[misc]
            async with aconnect() as conn:
                yield AsyncSQLite3Transaction(conn)

    def notes() -> list[str]:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            return [r[0] for r in conn.execute("SELECT note FROM business ORDER BY id")]

    async def charge(note: str) -> None:
        conn = AsyncSQLite3Connection(caller())
        try:
            await conn.run(conn.raw.execute, "INSERT INTO business (note) VALUES (?)", (note,))
        finally:
            conn.close()

    def peek(key: str) -> Any:  # another connection to the file
        outside = SQLiteStore(path, table=table)
        try:
            record = outside.get("alice", key)
        finally:
            outside.close()
        return None if record is None else record.state

    try:
        yield Rig(
            kind,
            store,
            sync,
            transaction if transactional else None,
            write,
            lose,
            notes,
            peek,
            sqlite3.IntegrityError if transactional else _store_unavailable(),
            heal,
            charge=None if sync else charge,
            connect=connect,
            adapter=adapter,
        )
    finally:
        heal()
        await _close(store, sync)


def _store_unavailable() -> type[BaseException]:
    from idemflow import StoreUnavailable

    return StoreUnavailable


@contextlib.asynccontextmanager
async def _redis_rig(
    kind: str,
    table: str,
    tmp_path: Path,
    transactional: bool,
    pool_size: int,
    app_pool: bool,
    busy_timeout: float,
) -> AsyncIterator[Rig]:
    """One connection (``single_connection_client``), no client-side retry: a fault that ends
    it (``CLIENT KILL``) reaches the store, as the loss of the server would. ``redis-cluster``:
    the session's Redis Cluster through redis.asyncio's cluster client, named, no retry
    either; a fault ends every connection of that name on every master."""
    pytest.importorskip("redis")
    from redis import Redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from idemflow import Policy, StoreUnavailable
    from idemflow.stores.redis import AsyncRedisStore, RedisStore
    from tests.conftest import unreachable

    timeout, retention = REDIS_POLICY_ARGS
    policy = Policy(request_timeout=timeout, retention=retention)
    options: dict[str, Any] = {"socket_timeout": 5, "socket_connect_timeout": 2}
    cluster = kind == "redis-cluster"
    url, masters = REDIS_URL, [REDIS_URL]
    if cluster:
        url, *masters = redis_cluster_urls()
    admin = redis_client(url, cluster=cluster)
    try:
        admin.ping()
    except Exception as exc:
        unreachable(rig_kind(kind).service, exc)
    sync = kind.endswith("-sync")
    name = f"idemflow-{table}"  # the cluster client's connections, so a fault can end them
    store: Any
    if sync:
        client: Any = Redis.from_url(
            REDIS_URL, retry=Retry(NoBackoff(), 0), single_connection_client=True, **options
        )
        store = RedisStore(client, policy=policy, prefix=table, clock="caller", allow_volatile=True)
        store.migrate()
    else:
        from redis.asyncio import Redis as AsyncRedis
        from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
        from redis.asyncio.retry import Retry as AsyncRetry

        if cluster:
            client = AsyncRedisCluster.from_url(
                url, retry=AsyncRetry(NoBackoff(), 0), client_name=name, **options
            )
        else:
            client = AsyncRedis.from_url(
                url, retry=AsyncRetry(NoBackoff(), 0), single_connection_client=True, **options
            )
        store = AsyncRedisStore(
            client, policy=policy, prefix=table, clock="caller", allow_volatile=True
        )
        await store.migrate()

    # The store's one connection ends (it reconnects on the command after the next).
    def lose(conn: Any) -> None:
        assert admin.client_kill_filter(_id=client.client_id()) == 1

    async def alose(conn: Any) -> None:
        if not cluster:
            assert admin.client_kill_filter(_id=await client.client_id()) == 1
            return
        killed = 0
        for master in masters:
            with contextlib.closing(Redis.from_url(master)) as node:
                for seen in node.client_list():
                    if seen["name"] == name:
                        killed += node.client_kill_filter(_id=seen["id"])
        assert killed >= 1

    # The endpoint's own effect: a list beside the records, on the store's client.
    charges = f"{{{table}}}:charges"

    async def charge(note: str) -> None:
        await client.rpush(charges, note)

    def notes() -> list[str]:
        return [note.decode() for note in admin.lrange(charges, 0, -1)]

    try:
        yield Rig(
            kind,
            store,
            sync,
            None,
            lambda conn, note: None,
            lose if sync else alose,
            notes,
            lambda key: None,
            StoreUnavailable,
            charge=None if sync else charge,
        )
    finally:
        admin.delete(charges)
        delete_keys(admin, table)
        admin.close()
        await _close(store, sync)


class LosesCompletion:
    """A memory store whose next completion fails as an unreachable store's would (the memory
    store has no I/O to break: this double stands for the fault)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed = False

    async def complete(self, *args: Any, **kwargs: Any) -> None:
        from idemflow import StoreUnavailable

        if self.armed:
            self.armed = False
            raise StoreUnavailable("memory store: the completion could not be written")
        await self.inner.complete(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.asynccontextmanager
async def _memory_rig(
    kind: str,
    table: str,
    tmp_path: Path,
    transactional: bool,
    pool_size: int,
    app_pool: bool,
    busy_timeout: float,
) -> AsyncIterator[Rig]:
    from idemflow import StoreUnavailable
    from idemflow.stores.memory import AsyncMemoryStore

    store = LosesCompletion(AsyncMemoryStore())
    charges: list[str] = []

    async def lose(conn: Any) -> None:
        store.armed = True

    def heal() -> None:
        store.armed = False

    async def charge(note: str) -> None:
        charges.append(note)

    yield Rig(
        kind,
        store,
        False,
        None,
        lambda conn, note: None,
        lose,
        lambda: list(charges),
        lambda k: None,
        StoreUnavailable,
        heal,
        charge=charge,
    )


# --- the async driver end to end: a fresh caller connection per request ---------------
# (core/test_async_driver.py: each request on its own connection, as an async service's)


def _no_fault(conn: Any) -> None:
    raise AssertionError("this rig makes no fault")


def _no_peek(key: str) -> Any:
    raise AssertionError("this rig reads no record from outside")


@contextlib.asynccontextmanager
async def _async_memory(tmp_path: Path, table: str, max_size: int) -> AsyncIterator[Rig]:
    """The memory store: no transaction to share; business rows go to a list."""
    from idemflow.stores.memory import AsyncMemoryStore

    rows: list[str] = []

    async def write(conn: Any, note: str) -> None:
        rows.append(note)

    yield Rig("memory", AsyncMemoryStore(), False, None, write, _no_fault, rows.copy, _no_peek)


@contextlib.asynccontextmanager
async def _async_sqlite(
    tmp_path: Path, table: str, max_size: int, *, session: bool
) -> AsyncIterator[Rig]:
    """AsyncSQLiteStore; the caller's transaction SQLAlchemy's on aiosqlite: an
    ``AsyncSession`` (``session``) or an ``AsyncConnection``."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from idemflow.stores.sqlite import AsyncSQLiteStore
    from idemflow.transactions import AsyncSQLAlchemyTransaction

    path = str(tmp_path / "app.db")
    store = AsyncSQLiteStore(path, table=table)
    await store.migrate()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(f"CREATE TABLE biz_{table} (id INTEGER PRIMARY KEY, note TEXT)")
        conn.commit()
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    insert = text(f"INSERT INTO biz_{table} (note) VALUES (:note)")

    @contextlib.asynccontextmanager
    async def open_transaction() -> AsyncIterator[AsyncSQLAlchemyTransaction]:
        async with AsyncSession(engine) if session else engine.connect() as holder:
            yield AsyncSQLAlchemyTransaction(holder)

    async def write(conn: Any, note: str) -> None:
        await conn.execute(insert, {"note": note})

    def notes() -> list[str]:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            return [r[0] for r in conn.execute(f"SELECT note FROM biz_{table} ORDER BY id")]

    name = f"sqlite-sqlalchemy-{'session' if session else 'connection'}"
    try:
        yield Rig(name, store, False, open_transaction, write, _no_fault, notes, _no_peek)
    finally:
        await engine.dispose()


def postgres_notes(table: str) -> Callable[[], list[str]]:
    """Reads ``biz_<table>``'s notes, in order, on a connection of its own."""

    def notes() -> list[str]:
        import psycopg

        from tests.conftest import POSTGRES_URL

        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            return [r[0] for r in conn.execute(f"SELECT note FROM biz_{table} ORDER BY id")]

    return notes


@contextlib.contextmanager
def postgres_tables(table: str) -> Iterator[None]:
    """The key table (migrated) and the business table; both dropped afterwards."""
    psycopg = pytest.importorskip("psycopg")
    from idemflow.stores.postgres import PostgresStore
    from tests.conftest import POSTGRES_URL, unreachable

    try:
        conn = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        unreachable(KINDS["postgres"].service, exc)
    with conn:
        store = PostgresStore(POSTGRES_URL, table=table, max_size=1, clock="caller")
        store.migrate()
        store.close()
        conn.execute(f"CREATE TABLE biz_{table} (id BIGSERIAL PRIMARY KEY, note TEXT)")
        try:
            yield
        finally:
            conn.execute(f"DROP TABLE IF EXISTS {table}, biz_{table}")


@contextlib.asynccontextmanager
async def _async_postgres(
    tmp_path: Path, table: str, max_size: int, *, sqlalchemy: bool
) -> AsyncIterator[Rig]:
    """AsyncPostgresStore; the caller's transaction on a fresh psycopg connection, or
    (``sqlalchemy``) on a SQLAlchemy ``AsyncConnection``. Both tables dropped after."""
    with postgres_tables(table):
        import psycopg

        from idemflow.stores.postgres import AsyncPostgresStore
        from idemflow.transactions import AsyncPsycopgTransaction, AsyncSQLAlchemyTransaction
        from tests.conftest import POSTGRES_URL

        store = AsyncPostgresStore(POSTGRES_URL, table=table, max_size=max_size, clock="caller")
        engine: Any = None
        if sqlalchemy:
            from sqlalchemy.ext.asyncio import create_async_engine

            url = POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1)
            engine = create_async_engine(url, pool_size=max_size, max_overflow=0)

        @contextlib.asynccontextmanager
        async def open_transaction() -> AsyncIterator[Any]:
            if engine is not None:
                async with engine.connect() as holder:
                    yield AsyncSQLAlchemyTransaction(holder)
                return
            async with await psycopg.AsyncConnection.connect(POSTGRES_URL) as conn:
                yield AsyncPsycopgTransaction(conn)

        async def write(conn: Any, note: str) -> None:
            if engine is not None:
                from sqlalchemy import text

                insert = text(f"INSERT INTO biz_{table} (note) VALUES (:note)")
                await conn.execute(insert, {"note": note})
            else:
                await conn.execute(f"INSERT INTO biz_{table} (note) VALUES (%s)", (note,))

        name = "postgres-sqlalchemy-connection" if sqlalchemy else "postgres-psycopg"
        notes = postgres_notes(table)
        try:
            yield Rig(name, store, False, open_transaction, write, _no_fault, notes, _no_peek)
        finally:
            await store.close()
            if engine is not None:
                await engine.dispose()


# --- a private store that can be hung (guarantees/test_hung_store.py) ------------------

#: A started async store (not yet migrated), how to hang it, how to resume it (safe twice).
Hung = tuple[Any, Callable[[], object], Callable[[], object]]


@contextlib.contextmanager
def _hung_sqlite(tmp_path: Path, policy: Any) -> Iterator[Hung]:
    """Another connection takes the file's write lock (``BEGIN IMMEDIATE``)."""
    from idemflow.stores.sqlite import AsyncSQLiteStore

    path = tmp_path / "keys.db"
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    def unlock() -> None:
        if blocker.in_transaction:
            blocker.rollback()

    try:
        yield (
            AsyncSQLiteStore(path, policy=policy),
            lambda: blocker.execute("BEGIN IMMEDIATE"),
            unlock,
        )
    finally:
        unlock()
        blocker.close()


def _freeze_all(processes: list[Any]) -> None:
    from tests._private_redis import freeze

    for process in processes:
        freeze(process)


def _thaw_all(processes: list[Any]) -> None:
    from tests._private_redis import thaw

    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            thaw(process)


@contextlib.contextmanager
def _hung_redis(tmp_path: Path, policy: Any) -> Iterator[Hung]:
    """A private redis-server, frozen with SIGSTOP."""
    pytest.importorskip("redis")
    from idemflow.stores.redis import open_redis
    from tests._private_redis import own_redis_server

    with own_redis_server(tmp_path) as (process, url):
        store = open_redis(
            url, policy=policy, asynchronous=True, clock="caller", allow_volatile=True
        )
        yield store, lambda: _freeze_all([process]), lambda: _thaw_all([process])


@contextlib.contextmanager
def _hung_redis_cluster(tmp_path: Path, policy: Any) -> Iterator[Hung]:
    """The session's Redis Cluster, every node frozen; keys of this test's own."""
    pytest.importorskip("redis")
    from idemflow.stores.redis import open_redis
    from tests._redis_cluster import ClusterUnavailable, shared_cluster
    from tests.conftest import unreachable

    try:
        cluster = shared_cluster()
    except ClusterUnavailable as exc:
        unreachable("a private Redis Cluster", exc)
    store = open_redis(
        "redis+cluster://" + cluster.url.split("://", 1)[1],
        prefix=tmp_path.name,
        policy=policy,
        asynchronous=True,
        clock="caller",
        allow_volatile=True,
    )
    try:
        yield store, lambda: _freeze_all(cluster.processes), lambda: _thaw_all(cluster.processes)
    finally:
        _thaw_all(cluster.processes)


@contextlib.contextmanager
def _hung_postgres(tmp_path: Path, policy: Any) -> Iterator[Hung]:
    """A private PostgreSQL, every process stopped."""
    pytest.importorskip("psycopg_pool")
    from idemflow.stores.postgres import AsyncPostgresStore
    from tests._private_postgres import PrivatePostgresUnavailable, private_postgres
    from tests.conftest import unreachable

    try:
        with private_postgres() as pg:
            yield AsyncPostgresStore(pg.url, policy=policy, clock="caller"), pg.freeze, pg.thaw
    except PrivatePostgresUnavailable as exc:
        unreachable("a private PostgreSQL", exc)


@contextlib.contextmanager
def _hung_mysql(tmp_path: Path, policy: Any) -> Iterator[Hung]:
    """A private MariaDB, stopped."""
    pytest.importorskip("asyncmy")
    from idemflow.stores.mysql import AsyncMySQLStore
    from tests._private_mariadb import PrivateMariaDBUnavailable, private_mariadb
    from tests.conftest import unreachable

    try:
        with private_mariadb() as maria:
            yield (
                AsyncMySQLStore(maria.url, policy=policy, clock="caller"),
                maria.freeze,
                maria.thaw,
            )
    except PrivateMariaDBUnavailable as exc:
        unreachable("a private MariaDB", exc)


# --- the registry: every backend kind, once ------------------------------------------------

#: Opens a rig (:func:`open_rig`'s): (rig id, table, tmp_path, transactional, pool_size,
#: app_pool, busy_timeout); each opener uses the options its store has.
RigOpener = Callable[..., contextlib.AbstractAsyncContextManager[Rig]]
#: An async driver's store end to end, opening (:func:`open_async_rig`).
AsyncRig = contextlib.AbstractAsyncContextManager[Rig]
#: The drivers a rig runs under: its id is the kind's name (async) or ``<name>-sync``.
DRIVERS = ("async", "sync")


@dataclass(frozen=True)
class Kind:
    """One backend kind, and everything the tests know of it. Adding a backend is one entry
    in :data:`KINDS`: every suite derives its parameters from these fields (:func:`kinds`,
    :func:`contract_params`, :func:`rig_params`, :func:`async_rig_params`)."""

    name: str
    #: What is unreachable when it is (fails under CI=true, else skips).
    service: str
    #: Its pytest marker (``-m "not mysql"`` deselects it); None: it needs no service.
    mark: str | None = None
    #: Its store writes the completion in the caller's transaction (effect and record
    #: commit together).
    shares_transaction: bool = False
    #: And the claim too (single-commit mode).
    single_commit: bool = False
    #: Its store has a pool the request's transaction can take its connection from
    #: (:func:`open_rig`'s ``app_pool``, :attr:`Rig.crowd`).
    pooled: bool = False
    #: Its store decides on the server's clock by default (``clock="database"``; the tests
    #: build it with ``clock="caller"``).
    server_clock: bool = False
    #: A cluster the session starts on first use (``start``).
    cluster: bool = False
    #: The store lives in the test's own process: nothing outside to share or break.
    in_process: bool = False
    #: Built without ``policy=``, it is told the driver's store wait (``cover_store_wait``).
    covers_store_wait: bool = False
    #: The contract suite's sync stores (the ``backend`` fixture): id → (tmp_path, table,
    #: create) → :class:`Backend`; ``create`` False only for tables the fixture kept.
    contract: Mapping[str, Callable[[Path, str, bool], Backend]] = field(default_factory=dict)
    #: Reopens its store from the args of a :attr:`Backend.spec` named after it (another
    #: process); None: the store lives in one process.
    reopen: Callable[..., Store] | None = None
    #: Reopens the caller's side from the same args; None: no transaction to share.
    caller: Callable[..., Caller] | None = None
    #: Opens its rig (:func:`open_rig`) and, per mode ("transaction", "no-transaction"),
    #: the drivers the suites run it under.
    rig: RigOpener | None = None
    rigs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: The async driver end to end (core/test_async_driver.py): id → (tmp_path, table,
    #: max_size of the store's pool) → Rig; the first is the kind's own (the async race's).
    async_rigs: Mapping[str, Callable[[Path, str, int], AsyncRig]] = field(default_factory=dict)
    #: A private copy that can be hung (guarantees/test_hung_store.py): (tmp_path, policy).
    hung: Callable[[Path, Any], contextlib.AbstractContextManager[Hung]] | None = None
    #: Starts its cluster (if not up yet).
    start: Callable[[], object] | None = None

    @property
    def marks(self) -> tuple[Any, ...]:
        return () if self.mark is None else (getattr(pytest.mark, self.mark),)

    @property
    def param(self) -> Any:
        """The kind as a test parameter, its id its name, marked."""
        return pytest.param(self.name, marks=self.marks, id=self.name)


_BOTH, _ASYNC = DRIVERS, ("async",)

KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind(
            "memory",
            "the memory store",
            in_process=True,
            contract={"memory": lambda tmp_path, table, create: memory_backend()},
            rig=_memory_rig,
            rigs={"no-transaction": _ASYNC},
            async_rigs={"memory": _async_memory},
        ),
        Kind(
            "sqlite",
            "SQLite",
            shares_transaction=True,
            covers_store_wait=True,
            contract={"sqlite": lambda tmp_path, table, create: sqlite_backend(tmp_path, table)},
            reopen=_open_sqlite,
            caller=_sqlite_caller,
            rig=_sqlite_rig,
            rigs={"transaction": _BOTH, "no-transaction": _ASYNC},
            async_rigs={
                "sqlite-sqlalchemy-connection": partial(_async_sqlite, session=False),
                "sqlite-sqlalchemy-session": partial(_async_sqlite, session=True),
            },
            hung=_hung_sqlite,
        ),
        Kind(
            "postgres",
            "PostgreSQL",
            "postgres",
            shares_transaction=True,
            single_commit=True,
            pooled=True,
            server_clock=True,
            covers_store_wait=True,
            contract={"postgres": lambda tmp_path, table, create: postgres_backend(table, create)},
            reopen=_open_postgres,
            caller=_postgres_caller,
            rig=_postgres_rig,
            rigs={"transaction": _BOTH, "no-transaction": _ASYNC},
            async_rigs={
                "postgres-psycopg": partial(_async_postgres, sqlalchemy=False),
                "postgres-sqlalchemy-connection": partial(_async_postgres, sqlalchemy=True),
            },
            hung=_hung_postgres,
        ),
        Kind(
            "mysql",
            "MariaDB",
            "mysql",
            shares_transaction=True,
            single_commit=True,
            pooled=True,
            server_clock=True,
            contract={
                "mysql": lambda tmp_path, table, create: mysql_backend(table, create=create),
                "mysql-found-rows": lambda tmp_path, table, create: mysql_backend(
                    table, found_rows=True, create=create
                ),
                "mysql-async": lambda tmp_path, table, create: async_mysql_bridged_backend(
                    table, create
                ),
            },
            reopen=_open_mysql,
            caller=_mysql_caller,
            rig=_mysql_rig,
            rigs={"transaction": _BOTH, "no-transaction": _BOTH},
            async_rigs={
                "mysql-asyncmy": lambda tmp_path, table, max_size: async_mysql_backend(
                    table, max_size=max_size
                )
            },
            hung=_hung_mysql,
        ),
        Kind(
            "galera",
            "MariaDB Galera",
            "mysql",
            shares_transaction=True,
            single_commit=True,
            pooled=True,
            server_clock=True,
            cluster=True,
            contract={"galera": lambda tmp_path, table, create: galera_backend(table, create)},
            reopen=_open_galera,
            caller=_galera_caller,
            rig=_mysql_rig,
            rigs={"no-transaction": _ASYNC},
            start=galera_urls,
        ),
        Kind(
            "redis",
            "Redis",
            "redis",
            server_clock=True,
            contract={"redis": lambda tmp_path, table, create: redis_backend(table)},
            reopen=_open_redis,
            rig=_redis_rig,
            rigs={"no-transaction": _BOTH},
            hung=_hung_redis,
        ),
        Kind(
            "redis-cluster",
            "Redis Cluster",
            "redis",
            server_clock=True,
            cluster=True,
            contract={
                "redis-cluster": lambda tmp_path, table, create: redis_cluster_backend(table)
            },
            reopen=partial(_open_redis, cluster=True),
            rig=_redis_rig,
            rigs={"no-transaction": _ASYNC},
            hung=_hung_redis_cluster,
            start=redis_cluster_urls,
        ),
        Kind(
            "valkey-cluster",
            "Valkey Cluster",
            "redis",
            server_clock=True,
            cluster=True,
            contract={
                "valkey-cluster": lambda tmp_path, table, create: redis_cluster_backend(
                    table, valkey=True
                )
            },
            reopen=partial(_open_redis, cluster=True),
        ),
    )
}


def kinds(**capabilities: bool) -> list[Kind]:
    """The kinds that have each of ``capabilities`` (``kinds(shares_transaction=True)``)."""
    return [
        kind
        for kind in KINDS.values()
        if all(getattr(kind, name) == value for name, value in capabilities.items())
    ]


def kind_params(**capabilities: bool) -> list[Any]:
    """:func:`kinds` as test parameters: each kind's name, marked."""
    return [kind.param for kind in kinds(**capabilities)]


def rigs(
    mode: str | None = None, drivers: tuple[str, ...] = DRIVERS, **capabilities: bool
) -> list[tuple[Kind, str]]:
    """Each rig (its kind, its id) that runs in ``mode`` ("transaction", "no-transaction";
    None: either) under one of ``drivers``, of every kind with ``capabilities``."""
    found: list[tuple[Kind, str]] = []
    for kind in kinds(**capabilities):
        for opened in [mode] if mode else list(kind.rigs):
            for driver in kind.rigs.get(opened, ()):
                rig_id = kind.name if driver == "async" else f"{kind.name}-sync"
                if driver in drivers and (kind, rig_id) not in found:
                    found.append((kind, rig_id))
    return found


def rig_params(
    mode: str | None = None, drivers: tuple[str, ...] = DRIVERS, **capabilities: bool
) -> list[Any]:
    """:func:`rigs` as test parameters: each rig's id, marked with its kind's service."""
    return [
        pytest.param(rig_id, marks=kind.marks, id=rig_id)
        for kind, rig_id in rigs(mode, drivers, **capabilities)
    ]


def rig_kind(rig_id: str) -> Kind:
    """The kind a rig id (``postgres-sync``, say) is of."""
    return KINDS[rig_id.removesuffix("-sync")]


def contract_params(**capabilities: bool) -> list[Any]:
    """The contract store ids (variants too: ``mysql-found-rows``) of every kind with
    ``capabilities``, sorted, marked."""
    return sorted(
        (
            pytest.param(name, marks=kind.marks, id=name)
            for kind in kinds(**capabilities)
            for name in kind.contract
        ),
        key=lambda param: param.id,
    )


def _contract(name: str) -> Callable[[Path, str, bool], Backend]:
    return next(kind.contract[name] for kind in kinds() if name in kind.contract)


def async_rig_params() -> list[Any]:
    """Every store of the async driver end to end (:attr:`Kind.async_rigs`), marked."""
    return [
        pytest.param(name, marks=kind.marks, id=name)
        for kind in kinds()
        for name in kind.async_rigs
    ]


def open_async_rig(
    name: str, tmp_path: Path, table: str, max_size: int = 2
) -> contextlib.AbstractAsyncContextManager[Rig]:
    """The async driver's store ``name`` (:func:`async_rig_params`, or a kind's name: its
    first), its caller's transaction a fresh connection per request, its pool of
    ``max_size`` where it has one."""
    if name in KINDS:
        name = next(iter(KINDS[name].async_rigs))
    opener = next(kind.async_rigs[name] for kind in kinds() if name in kind.async_rigs)
    return opener(tmp_path, table, max_size)


def start_cluster(rig_id: str) -> None:
    """Start the session's cluster a rig runs on, if it has one and it is not up yet
    (Galera: ~10 s, longer on a loaded machine), so that opening the rig is quick."""
    start = rig_kind(rig_id).start
    if start is not None:
        start()


# --- the contract suite's fixture: every store, its SQL tables kept between tests ----------


#: Tables emptied for the next test, with their shape when created: by backend name.
KeptTables = dict[str, list[tuple[Tables, Shape]]]
_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Marks a test that did not pass: its tables are not kept (a test that failed, or stopped
    half-way, may have left a writer on them)."""
    report = yield
    if report.when == "call" and not report.passed:
        item.stash[_FAILED] = True
    return report


@pytest.fixture(scope="session")
def _kept_tables() -> Iterator[KeptTables]:
    """This worker's kept tables, dropped as it ends."""
    kept: KeptTables = {}
    yield kept
    for entries in kept.values():
        for tables, _ in entries:
            tables.drop()


@pytest.fixture(params=contract_params())
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, table_name: str, _kept_tables: KeptTables
) -> Iterator[Backend]:
    """Every store. A SQL store's tables are emptied (:meth:`Tables.empty`) and kept for
    the next test of that backend instead of dropped, only if the test passed and have the
    columns, indexes and constraints they were created with still; else they are dropped.
    The next test sees them as a fresh pair: empty, of the same shape."""
    yield from _kept_backend(request, tmp_path, table_name, _kept_tables)


@pytest.fixture(params=contract_params(shares_transaction=True))
def transactional(
    request: pytest.FixtureRequest, tmp_path: Path, table_name: str, _kept_tables: KeptTables
) -> Iterator[Backend]:
    """Every store that shares the caller's transaction, as :func:`backend` opens it."""
    yield from _kept_backend(request, tmp_path, table_name, _kept_tables)


def _kept_backend(
    request: pytest.FixtureRequest, tmp_path: Path, table_name: str, _kept_tables: KeptTables
) -> Iterator[Backend]:
    kept = _kept_tables.setdefault(request.param, [])
    name, shape = table_name, None
    if kept:
        taken, shape = kept.pop()
        name = taken.name
    made = _contract(request.param)(tmp_path, name, shape is None)
    tables = made.tables
    if tables is None:  # nothing to keep
        yield made
        made.close()
        return
    if shape is None:
        shape = tables.shape()
    yield made
    for close in made.closers:
        close()
    give_back(tables, shape, request.node.stash.get(_FAILED, False), kept)


def give_back(tables: Tables, shape: Shape, failed: bool, kept: list[tuple[Tables, Shape]]) -> None:
    """After a test, its store closed: ``tables``, emptied, join ``kept`` if the test passed
    and they still have ``shape`` (theirs when created); else they are dropped."""
    if not failed and tables.shape() == shape:
        tables.empty()
        kept.append((tables, shape))
    else:
        tables.drop()
