"""What each MySQL store needs of its driver, under one name ``scripts/unasync.py`` maps.

The store's I/O (its pool, its claim algorithm) is written once, awaited, in
``_async.py``, against :class:`AsyncBinding` (asyncmy); its generated twin
``_sync.py`` reads :class:`Binding` (PyMySQL) instead. Everything in which the
two drivers differ beyond ``await`` is here: how a connection is opened and
closed, how the pool bounds its checkouts, how a pause waits, which errors
mean the server is not there. The rest of their API (``cursor()`` as a context
manager, ``execute``, ``fetchone``, ``fetchall``, ``lastrowid``,
``description``, ``ping``, ``autocommit``) is the same, awaited or not.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..._extras import optional
from ._errors import is_unavailable


class AsyncBinding:
    """asyncmy (asyncio), for :class:`~idemflow.stores.mysql.AsyncMySQLStore`."""

    sleep = staticmethod(asyncio.sleep)

    @staticmethod
    def connector(kwargs: Mapping[str, Any]) -> Callable[[], Awaitable[Any]]:
        """A coroutine function opening a new connection (``asyncmy.connect`` arguments)."""
        with optional("idemflow.stores.mysql"):
            import asyncmy

        options = {**kwargs, "autocommit": True}

        async def connect() -> Any:
            return await asyncmy.connect(**options)

        return connect

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
    def is_unavailable(exc: BaseException) -> bool:
        """:func:`is_unavailable`, plus a socket asyncmy lets through unwrapped (reset, EOF)."""
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
    """PyMySQL (threads), for :class:`~idemflow.stores.mysql.MySQLStore`."""

    sleep = staticmethod(time.sleep)
    is_unavailable = staticmethod(is_unavailable)

    @staticmethod
    def connector(kwargs: Mapping[str, Any]) -> Callable[[], Any]:
        """A function opening a new connection (``pymysql.connect`` arguments)."""
        with optional("idemflow.stores.mysql"):
            import pymysql

        options = dict(kwargs)
        return lambda: pymysql.connect(**options)

    @staticmethod
    def drop(conn: Any) -> None:
        """Close a connection (PyMySQL has no abrupt close; a broken one raises, and is gone)."""
        try:
            conn.close()
        except Exception:  # noqa: BLE001 -- already broken: nothing left to release
            return

    close = drop

    class Slots:
        """How many of the pool's connections may be out at once (across threads).

        A queue of tokens, not a ``threading.Semaphore``: its get and put are C,
        several microseconds less on every checkout.
        """

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
