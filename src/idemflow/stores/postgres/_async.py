"""The PostgreSQL stores' checkout: a pooled connection, never one the server closed
(docs/stores.md, "A restart of PostgreSQL under the store's pool").
This is the async source of truth; ``idemflow/stores/postgres/_sync.py`` is generated
from it by ``scripts/unasync.py``.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from .._socket import readable_now

__all__ = ["AsyncLiveConnection", "bounded_connection_class"]

#: psycopg's own interval between two checks for an interruption while it waits.
_WAIT_INTERVAL = 0.1


class AsyncLiveConnection:
    """``pool.connection()`` that skips connections the server has closed; ``store_wait``
    bounds each wait for the server while it holds a bounded connection (None: psycopg's)."""

    __slots__ = ("_bounded", "_context", "_pool", "_store_wait")

    def __init__(self, pool: Any, store_wait: float | None = None) -> None:
        self._pool = pool
        self._context: Any = None
        self._store_wait = store_wait
        self._bounded: Any = None  # the connection whose waits this checkout bounds

    async def __aenter__(self) -> Any:
        context = self._pool.connection(timeout=self._store_wait)
        conn = await context.__aenter__()
        if conn.closed or readable_now(conn.pgconn.socket):  # rare: a restart, a notice
            context, conn = await self._live(context, conn)
        self._context = context
        if self._store_wait is not None and hasattr(conn, "store_wait"):
            conn.store_wait = self._store_wait
            self._bounded = conn
        return conn

    async def _live(self, context: Any, conn: Any) -> tuple[Any, Any]:
        """The first connection that answers, ``conn`` or the next ones: at most the pool's
        size are skipped (all dead after a restart), then the pool waits for a new one."""
        for _ in range(self._pool.max_size):
            try:
                if await _answers(conn):
                    return context, conn
                await conn.close()  # given back closed: the pool makes another in its place
            except BaseException as exc:  # cancelled mid-check: the pool gets it back
                await context.__aexit__(type(exc), exc, exc.__traceback__)
                raise
            await context.__aexit__(None, None, None)
            context = self._pool.connection(timeout=self._store_wait)
            conn = await context.__aenter__()
            if not (conn.closed or readable_now(conn.pgconn.socket)):
                return context, conn
        return context, conn

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> Any:
        if self._bounded is not None:  # the next checkout may be the application's own
            self._bounded.store_wait = None
            self._bounded = None
        return await self._context.__aexit__(exc_type, exc, traceback)


async def _answers(conn: Any) -> bool:
    """Does ``conn``, whose socket had something to read, answer psycopg_pool's own check?"""
    from psycopg_pool import AsyncConnectionPool

    if conn.closed:
        return False
    try:
        await AsyncConnectionPool.check_connection(conn)
    except Exception:  # noqa: BLE001 -- any failure: not handed out
        return False
    return True


def bounded_connection_class() -> type[Any]:
    """A psycopg connection whose every wait for the server ends after its ``store_wait``
    seconds, if set, with an ``OperationalError`` (docs/stores.md, "A database that stops
    answering"); its pool then closes it."""
    from psycopg import AsyncConnection

    class AsyncBoundedConnection(AsyncConnection[Any]):
        store_wait: float | None = None

        async def wait(
            self, gen: Any, interval: float = _WAIT_INTERVAL, timeout: float | None = None
        ) -> Any:
            bound = self.store_wait if timeout is None else timeout
            return await super().wait(gen, interval, bound)

    return AsyncBoundedConnection
