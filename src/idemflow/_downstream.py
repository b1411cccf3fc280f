"""Deterministic idempotency keys for calls to downstream providers."""

from __future__ import annotations

import hashlib

from ._model import Record

__all__ = ["downstream_key"]


def downstream_key(record: Record, step: str, *, namespace: str = "idemflow") -> str:
    """The key to send downstream for ``step`` of the intent ``record`` stands for.

    Derived from ``(principal, key, step)`` and the record's creation time, so it
    is the same on every retry and after every crash of one intent, and
    different once the key expired and was reused for a new intent (otherwise
    the provider would answer the new intent with the old charge).
    Length-prefixed so no two tuples encode alike; hashed so the principal and
    the client's key are not disclosed to the provider.
    """
    parts = (namespace, record.principal, record.key, step, str(int(record.created_at * 1000)))
    encoded = b"".join(f"{len(p.encode())}:".encode() + p.encode() for p in parts)
    return f"{namespace}-{hashlib.sha256(encoded).hexdigest()[:40]}"
