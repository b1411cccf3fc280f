"""The store's own pool of autocommit PyMySQL connections (PyMySQL has none)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ._errors import PoolExhausted

# An idle connection older than this is pinged before use (seconds).
_PING_AFTER = 30.0


class Pool:
    """A small thread-safe pool of autocommit PyMySQL connections.

    A connection that saw any error is closed rather than reused: its
    session state is unknown. One idle for longer than ``_PING_AFTER`` is
    pinged (and reconnected) first, so a server that dropped it while idle
    (``wait_timeout``) costs a round trip, not a 503. After ``fork`` the child
    starts empty and never touches the parent's sockets.
    """

    def __init__(self, factory: Callable[[], Any], max_size: int, timeout: float) -> None:
        self._factory = factory
        self._max_size = max_size
        self._timeout = timeout
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._idle: list[tuple[Any, float]] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self._max_size)

    @contextmanager
    def connection(self) -> Iterator[Any]:
        if self._pid != os.getpid():
            self._reset()
        if not self._slots.acquire(timeout=self._timeout):
            msg = f"all {self._max_size} MySQL connections busy for {self._timeout:g}s"
            raise PoolExhausted(msg)
        try:
            conn = self._checkout()
            try:
                yield conn
            except BaseException:
                _close_quietly(conn)
                raise
            with self._lock:
                self._idle.append((conn, time.monotonic()))
        finally:
            self._slots.release()

    def _checkout(self) -> Any:
        with self._lock:
            conn, since = self._idle.pop() if self._idle else (None, 0.0)
        if conn is not None:
            if time.monotonic() - since > _PING_AFTER:
                conn.ping(reconnect=True)
            return conn
        conn = self._factory()
        conn.autocommit(True)
        return conn

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            _close_quietly(conn)


def _close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001 -- already broken: nothing left to release
        return
