"""Every outcome is counted: the events a driver reports, and the observer seam (metrics,
logs and traces are observers). ``elapsed`` is the time since the run began."""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from typing import Protocol

from ._errors import InProgress, KeyReused, LeaseLost, OutcomeUnknown, StoreUnavailable
from ._model import Intent

logger = logging.getLogger("idemflow")


class Event(enum.StrEnum):
    CLAIMED = "claimed"
    COMPLETED = "completed"
    REPLAYED = "replayed"
    IN_PROGRESS_CONFLICT = "in_progress_conflict"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    RELEASED = "released"
    LEASE_LOST = "lease_lost"
    STALE_RECLAIMED = "stale_reclaimed"
    STORE_UNAVAILABLE = "store_unavailable"
    #: The handler raised ``OutcomeUnknown``: 503, the key kept for the sweeper.
    OUTCOME_UNKNOWN = "outcome_unknown"
    #: The replay authorization hook refused a stored response (403), after its
    #: ``REPLAYED``: replays served = replayed - replay_forbidden.
    REPLAY_FORBIDDEN = "replay_forbidden"
    #: A release could not be written: retries get 409 until the sweeper releases it.
    RELEASE_FAILED = "release_failed"


class Observer(Protocol):
    """**Protocol:** told about each event of each run. Must not raise."""

    def __call__(self, event: Event, intent: Intent, elapsed: float) -> None: ...


def null_observer(event: Event, intent: Intent, elapsed: float) -> None:
    """Counts nothing."""


def fan_out(*observers: Observer) -> Observer:
    """One observer telling each of ``observers`` in turn (and the sweeper's
    ``stale_reclaimed`` hook to those that have one); one that raises is logged and skipped."""
    flat = tuple(
        inner
        for observer in observers
        for inner in (observer.observers if isinstance(observer, _FanOut) else (observer,))
        if inner is not null_observer  # told nothing, it needs no call
    )
    if not flat:
        return null_observer
    if len(flat) == 1:
        return flat[0]
    return _FanOut(flat)


class _FanOut:
    def __init__(self, observers: tuple[Observer, ...]) -> None:
        self.observers = observers

    def __call__(self, event: Event, intent: Intent, elapsed: float) -> None:
        for observer in self.observers:
            try:
                observer(event, intent, elapsed)
            except Exception:
                logger.exception("observer %r failed on %s", observer, event.value)

    def stale_reclaimed(self, resolution: str, endpoint: str) -> None:
        for observer in self.observers:
            hook = getattr(observer, "stale_reclaimed", None)
            if hook is None:
                continue
            try:
                hook(resolution, endpoint)
            except Exception:
                logger.exception("observer %r failed on stale_reclaimed", observer)


def error_event(exc: BaseException) -> Event | None:
    """The event an exception leaving ``run`` stands for, if it is one of ours."""
    for kind, event in (
        (LeaseLost, Event.LEASE_LOST),  # an InProgress: the narrower type first
        (InProgress, Event.IN_PROGRESS_CONFLICT),
        (KeyReused, Event.FINGERPRINT_MISMATCH),
        (StoreUnavailable, Event.STORE_UNAVAILABLE),
        (OutcomeUnknown, Event.OUTCOME_UNKNOWN),
    ):
        if isinstance(exc, kind):
            return event
    return None


class CountingObserver:
    """Counts events in memory, by event and endpoint. Thread-safe."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[Event, str]] = Counter()
        self._lock = threading.Lock()

    def __call__(self, event: Event, intent: Intent, elapsed: float) -> None:
        with self._lock:
            self.counts[event, intent.endpoint] += 1

    def total(self, event: Event) -> int:
        with self._lock:
            return sum(n for (e, _), n in self.counts.items() if e is event)
