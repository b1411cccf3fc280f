"""The async store's own pool of autocommit asyncmy connections (asyncmy's pool cannot
be told to drop a connection that saw an error, so it is not used)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from ._errors import PoolExhausted
from ._pool import _PING_AFTER


class AsyncPool:
    """:class:`~idemflow.stores.mysql._pool.Pool` for asyncio, with the same rules.

    A connection that saw any error (or whose task was cancelled while it was
    out) is closed rather than reused: its session state, or the protocol
    position of its socket, is unknown. One idle for longer than
    ``_PING_AFTER`` is pinged (and reconnected) first.
    """

    def __init__(
        self, factory: Callable[[], Awaitable[Any]], max_size: int, timeout: float
    ) -> None:
        self._factory = factory
        self._max_size = max_size
        self._timeout = timeout
        self._idle: list[tuple[Any, float]] = []
        self._slots = asyncio.Semaphore(max_size)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        try:
            await asyncio.wait_for(self._slots.acquire(), self._timeout)
        except TimeoutError:
            msg = f"all {self._max_size} MySQL connections busy for {self._timeout:g}s"
            raise PoolExhausted(msg) from None
        try:
            conn = await self._checkout()
            try:
                yield conn
            except BaseException:
                conn.close()  # abrupt: the socket's state is unknown
                raise
            self._idle.append((conn, time.monotonic()))
        finally:
            self._slots.release()

    async def _checkout(self) -> Any:
        if self._idle:
            conn, since = self._idle.pop()
            if time.monotonic() - since > _PING_AFTER:
                await conn.ping(reconnect=True)
            return conn
        conn = await self._factory()
        # A factory of the caller's may hand out a connection in a transaction:
        # each statement of the store must be its own (no round trip if it is).
        await conn.autocommit(True)
        return conn

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            try:
                await conn.ensure_closed()
            except Exception:  # noqa: BLE001 -- already broken: nothing left to release
                conn.close()
