"""What each MySQL store needs of its driver beyond ``await``, under one name
``scripts/unasync.py`` maps: `AsyncBinding` (asyncmy) for ``_async.py``, `Binding` (PyMySQL).
"""

from __future__ import annotations

import asyncio
import functools
import queue
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..._extras import optional
from .._socket import readable_now
from ._errors import is_unavailable


class AsyncBinding:
    """asyncmy (asyncio), for [`AsyncMySQLStore`][idemflow.stores.mysql.AsyncMySQLStore]."""

    sleep = staticmethod(asyncio.sleep)

    #: How [`connect_kwargs`][idemflow.stores.mysql.connect_kwargs] spells a URL for this driver.
    driver = "asyncmy"

    @staticmethod
    def connector(kwargs: Mapping[str, Any]) -> Callable[[], Awaitable[Any]]:
        """A coroutine function opening a new connection (``asyncmy.connect`` arguments, or
        PyMySQL's ``ssl_disabled=True``)."""
        with optional("idemflow.stores.mysql"):
            import asyncmy

        options = {**kwargs, "autocommit": True}
        if options.pop("ssl_disabled", False):
            options.pop("ssl", None)
        return functools.partial(asyncmy.connect, **options)

    @staticmethod
    def drop(conn: Any) -> None:
        """Close a connection that saw an error, sending nothing: its socket's state is unknown."""
        conn.close()

    @staticmethod
    async def close(conn: Any) -> None:
        """Close an idle connection politely (``COM_QUIT``), abruptly if that fails."""
        try:
            await conn.ensure_closed()
        except Exception:  # noqa: BLE001 -- already broken: nothing left to release
            conn.close()

    @staticmethod
    def closed_by_server(conn: Any) -> bool:
        """Has the server closed this idle connection (a restart, ``KILL``)?"""
        transport = getattr(conn, "_transport", None)
        if transport is None:
            return False
        if transport.is_closing() or getattr(getattr(conn, "_proto", None), "eof", False):
            return True
        sock = transport.get_extra_info("socket")
        return sock is not None and readable_now(sock.fileno())

    @staticmethod
    def is_unavailable(exc: BaseException) -> bool:
        """`is_unavailable`, plus a socket asyncmy lets through unwrapped (reset, EOF)."""
        return is_unavailable(exc) or isinstance(exc, (OSError, asyncio.IncompleteReadError))

    class Slots(asyncio.BoundedSemaphore):
        """How many of the pool's connections may be out at once (one event loop's tasks)."""

        async def take(self, timeout: float) -> bool:
            """One slot, waiting up to ``timeout`` seconds; False if none came free."""
            if not self.locked():  # free: no timer, no task
                return await self.acquire()
            try:
                return await asyncio.wait_for(self.acquire(), timeout)
            except TimeoutError:
                return False


class Binding:
    """PyMySQL (threads), for [`MySQLStore`][idemflow.stores.mysql.MySQLStore]."""

    sleep = staticmethod(time.sleep)
    is_unavailable = staticmethod(is_unavailable)

    driver = "pymysql"

    @staticmethod
    def connector(kwargs: Mapping[str, Any]) -> Callable[[], Any]:
        """A function opening a new connection (``pymysql.connect`` arguments)."""
        with optional("idemflow.stores.mysql"):
            import pymysql  # noqa: F401 -- the extra's message if it is missing

        return functools.partial(_sharing_connection(), **kwargs)

    @staticmethod
    def drop(conn: Any) -> None:
        """Close a connection (PyMySQL has no abrupt close; a broken one raises, and is gone)."""
        try:
            conn.close()
        except Exception:  # noqa: BLE001 -- already broken: nothing left to release
            return

    close = drop

    @staticmethod
    def closed_by_server(conn: Any) -> bool:
        """`AsyncBinding.closed_by_server`."""
        sock = getattr(conn, "_sock", None)
        return sock is None or readable_now(sock.fileno())

    class Slots:
        """How many of the pool's connections may be out at once (across threads): a queue of
        tokens, whose get and put are C (faster than a ``threading.Semaphore``)."""

        def __init__(self, size: int) -> None:
            self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
            for _ in range(size):
                self._tokens.put(None)

        def take(self, timeout: float) -> bool:
            """One slot, waiting up to ``timeout`` seconds; False if none came free."""
            try:
                self._tokens.get(timeout=timeout)
            except queue.Empty:
                return False
            return True

        def release(self) -> None:
            self._tokens.put(None)


@functools.cache
def _sharing_connection() -> Callable[..., Any]:
    """``pymysql.connect``, whose connections share one ``PREFERRED`` TLS context (PyMySQL
    builds one per connection in ``_create_ssl_ctx({})``: ~20-65 ms of CPU each)."""
    import pymysql.connections

    shared: list[ssl.SSLContext] = []  # at most one (two threads may race to build it)

    class Connection(pymysql.connections.Connection):  # type: ignore[misc]
        def _create_ssl_ctx(self, sslp: Any) -> Any:
            if not (isinstance(sslp, dict) and not sslp):
                return super()._create_ssl_ctx(sslp)
            if not shared:
                shared.append(super()._create_ssl_ctx({}))
            return shared[0]

    return Connection


def closed_by_server(connection: Any) -> bool:
    """Has the server closed this idle connection (a restart, ``KILL``)? One poll of its
    socket: an idle MySQL connection is sent nothing but the goodbye."""
    if getattr(connection, "_transport", None) is not None:  # asyncmy
        return AsyncBinding.closed_by_server(connection)
    return Binding.closed_by_server(connection)
