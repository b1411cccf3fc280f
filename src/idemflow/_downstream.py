"""Deterministic idempotency keys for calls to downstream providers."""

from __future__ import annotations

import hashlib

from ._model import Record


def downstream_key(record: Record, step: str, *, namespace: str = "idemflow") -> str:
    """The key to send downstream for ``step`` of ``record``'s intent: the same on every
    retry within one retention period (it hashes ``created_at``), new for a new intent.
    Length-prefixed (no two tuples alike), hashed (nothing disclosed to the provider)."""
    began = str(round(record.created_at * 1000))
    parts = (namespace, record.principal, record.key, step, record.fingerprint, began)
    encoded = b"".join(f"{len(p.encode())}:".encode() + p.encode() for p in parts)
    return f"{namespace}-{hashlib.sha256(encoded).hexdigest()[:40]}"
