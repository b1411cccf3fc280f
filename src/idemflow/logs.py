"""Logs for idemflow: `LoggingObserver` writes one `logging` record per event with
structured ``extra`` fields (never the key: its `key_digest`). docs/operations.md, "Logs"."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping

from ._deprecation import moved
from ._events import Event
from ._model import Intent

__all__ = ["LoggingObserver"]

_DEFAULT_LEVELS: Mapping[Event, int] = {
    Event.CLAIMED: logging.DEBUG,
    Event.COMPLETED: logging.DEBUG,
    Event.REPLAYED: logging.DEBUG,
    Event.IN_PROGRESS_CONFLICT: logging.INFO,
    Event.FINGERPRINT_MISMATCH: logging.INFO,
    Event.RELEASED: logging.INFO,
    Event.STALE_RECLAIMED: logging.WARNING,
    Event.STORE_UNAVAILABLE: logging.WARNING,
    Event.LEASE_LOST: logging.WARNING,
    Event.OUTCOME_UNKNOWN: logging.WARNING,
    Event.REPLAY_FORBIDDEN: logging.INFO,
    Event.RELEASE_FAILED: logging.WARNING,
}

_MESSAGES: Mapping[Event, str] = {
    Event.CLAIMED: "idempotency key claimed on %s",
    Event.COMPLETED: "idempotent request completed on %s",
    Event.REPLAYED: "stored response replayed on %s",
    Event.IN_PROGRESS_CONFLICT: "idempotency key still in progress on %s: answered 409",
    Event.FINGERPRINT_MISMATCH: "idempotency key reused for a different request on %s: 422",
    Event.RELEASED: "idempotency key released after a transient failure on %s",
    Event.STALE_RECLAIMED: "stale claim reclaimed on %s",
    Event.STORE_UNAVAILABLE: "idempotency key store unavailable on %s: answered 503",
    Event.LEASE_LOST: "claim taken over before completion on %s: work rolled back",
    Event.OUTCOME_UNKNOWN: "outcome unknown on %s: answered 503, the claim kept for the sweeper",
    Event.REPLAY_FORBIDDEN: "stored response refused on %s by the replay authorization: 403",
    Event.RELEASE_FAILED: "idempotency key could not be released on %s: left to the sweeper",
}

_DIGEST_BYTES = 8


def key_digest(principal: str, key: str, salt: bytes = b"") -> str:
    """A short, non-reversible name for ``(principal, key)`` (BLAKE2b keyed with ``salt``)."""
    who = principal.encode()
    data = len(who).to_bytes(4, "big") + who + key.encode()  # unambiguous: no separator to forge
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES, key=salt).hexdigest()


class LoggingObserver:
    """Logs each event with ``extra`` fields (to ``idemflow.events`` unless given a logger)."""

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        levels: Mapping[Event, int] | None = None,
        salt: bytes = b"",
    ) -> None:
        self.logger = logger if logger is not None else logging.getLogger("idemflow.events")
        self.levels = {**_DEFAULT_LEVELS, **(levels or {})}
        self.salt = salt

    def __call__(self, event: Event, intent: Intent, elapsed: float) -> None:
        level = self.levels[event]
        if not self.logger.isEnabledFor(level):  # the normal paths cost one check
            return
        endpoint = intent.endpoint or "unknown"
        self.logger.log(
            level,
            _MESSAGES[event],
            endpoint,
            extra={
                "outcome": event.value,
                "endpoint": endpoint,
                "principal": intent.principal,
                "key_digest": key_digest(intent.principal, intent.key, self.salt),
                "correlation_id": intent.correlation_id,
                "elapsed_ms": round(elapsed * 1000, 3),
            },
        )


__getattr__ = moved(__name__, {"DEFAULT_LEVELS": "idemflow.logs:_DEFAULT_LEVELS"})
