"""Helpers for testing code that uses idemflow: a clock you move by hand, and the memory store."""

from __future__ import annotations

import threading
from datetime import timedelta

from ._model import seconds
from .stores.memory import AsyncMemoryStore, MemoryStore

__all__ = ["AsyncMemoryStore", "FrozenClock", "MemoryStore"]


class FrozenClock:
    """A clock that stands still until `advance` moves it. Pass it as ``clock=``."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, by: timedelta | float) -> None:
        with self._lock:
            self._now += seconds(by)
