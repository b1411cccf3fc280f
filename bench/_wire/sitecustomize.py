"""
Round trips counted on the client side of every server process a benchmark starts.

``bench/_wire.py`` (``wire_env``) puts this directory on ``PYTHONPATH`` and sets
``IDEMFLOW_BENCH_WIRE`` to a directory; Python then imports this module at
start-up in every process (uvicorn, gunicorn's workers, the demo), and each
process keeps one counter file there, rewritten after every round trip:

- PostgreSQL (psycopg 3): every request psycopg sends and waits for: a
  statement (prepared or not, and the ``PREPARE`` of one), ``BEGIN``,
  ``COMMIT``, ``ROLLBACK``, a pool's check or reset; in pipeline mode, each
  ``Sync`` (the statements it ends travel together);
- Redis (redis-py): every ``send_packed_command`` (a pipeline sends once);
- MySQL/MariaDB (asyncmy): every statement (``Connection.query``, which each
  cursor's ``execute`` calls), ``ping``, ``begin``, ``commit``, ``rollback``;
- pool checkouts: every ``getconn`` of a ``psycopg_pool`` pool, and every
  checkout of the asyncio MySQL store's own pool.

Only benchmarks set the variable; without it this module does nothing.
"""

from __future__ import annotations

import os
import threading

_DIRECTORY = os.environ.get("IDEMFLOW_BENCH_WIRE")


class _Counter:
    def __init__(self, directory: str) -> None:
        self._directory = directory
        self._lock = threading.Lock()
        self._counts = {"postgres": 0, "redis": 0, "checkouts": 0, "mysql": 0}
        self._fd: int | None = None
        self._pid = -1

    def add(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1
            if self._pid != os.getpid():  # a forked worker counts in a file of its own
                self._pid = os.getpid()
                self._counts = {key: int(key == name) for key in self._counts}
                path = os.path.join(self._directory, f"{self._pid}.count")
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            counts = self._counts
            text = (
                f"{counts['postgres']} {counts['redis']} {counts['checkouts']} {counts['mysql']}\n"
            )
            assert self._fd is not None
            os.pwrite(self._fd, text.encode().ljust(48), 0)


def _install(counter: _Counter) -> None:
    _install_asyncmy(counter)
    try:
        from psycopg import _connection_base, _cursor_base, client_cursor
    except ImportError:
        pass
    else:
        from psycopg import _pipeline_base

        # Each of these sends one request and reads its results before the
        # caller goes on: one round trip. In pipeline mode they only queue
        # their request; the round trip is the pipeline's Sync, counted once.
        for owner, name in (
            (_connection_base.BaseConnection, "_exec_command"),  # BEGIN, COMMIT, ROLLBACK
            (_cursor_base.BaseCursor, "_execute_send"),
            (_cursor_base.BaseCursor, "_send_prepare"),
            (_cursor_base.BaseCursor, "_send_query_prepared"),
            (client_cursor.ClientCursorMixin, "_execute_send"),  # Django's cursors
        ):
            setattr(owner, name, _unless_pipelined(counter, getattr(owner, name)))
        sync = _pipeline_base.BasePipeline._enqueue_sync
        _pipeline_base.BasePipeline._enqueue_sync = _counted(counter, "postgres", sync)  # type: ignore[method-assign]
    try:
        import psycopg_pool
    except ImportError:
        pass
    else:
        # A connection taken from a psycopg pool (the stores', the demo's).
        for pool in (psycopg_pool.ConnectionPool, psycopg_pool.AsyncConnectionPool):
            pool.getconn = _counted(counter, "checkouts", pool.getconn)  # type: ignore[method-assign]
    try:
        import redis.asyncio.connection as async_redis
        import redis.connection as sync_redis
    except ImportError:
        return
    sync_send = sync_redis.AbstractConnection.send_packed_command
    async_send = async_redis.AbstractConnection.send_packed_command

    def send(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        counter.add("redis")
        return sync_send(self, *args, **kwargs)

    async def asend(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        counter.add("redis")
        return await async_send(self, *args, **kwargs)

    sync_redis.AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
    async_redis.AbstractConnection.send_packed_command = asend  # type: ignore[method-assign]


def _install_asyncmy(counter: _Counter) -> None:
    try:
        from asyncmy import connection
    except ImportError:
        return
    # Connection is a Python class (its cursors are not): each of these is one
    # request and its answer. ``autocommit`` is left out: the store sets it once,
    # when a connection opens, and asyncmy sends nothing when it is already so.
    for name in ("query", "ping", "begin", "commit", "rollback"):
        setattr(
            connection.Connection,
            name,
            _acounted(counter, "mysql", getattr(connection.Connection, name)),
        )
    try:
        from idemflow.stores.mysql import _async as mysql_store
    except ImportError:
        return
    checkout = mysql_store.AsyncCheckout
    checkout.__aenter__ = _acounted(counter, "checkouts", checkout.__aenter__)  # type: ignore[method-assign]


def _acounted(counter: _Counter, name: str, method):  # type: ignore[no-untyped-def]
    async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        counter.add(name)
        return await method(*args, **kwargs)

    return counted


def _unless_pipelined(counter: _Counter, method):  # type: ignore[no-untyped-def]
    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        connection = getattr(self, "_conn", self)  # a cursor's, or the connection itself
        if getattr(connection, "_pipeline", None) is None:
            counter.add("postgres")
        return method(self, *args, **kwargs)

    return counted


def _counted(counter: _Counter, name: str, method):  # type: ignore[no-untyped-def]
    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        counter.add(name)
        return method(*args, **kwargs)

    return counted


if _DIRECTORY:
    _install(_Counter(_DIRECTORY))
