"""Deterministic idempotency keys for calls to downstream providers."""

from __future__ import annotations

import hashlib

from ._model import Record

__all__ = ["downstream_key"]


def downstream_key(record: Record, step: str, *, namespace: str = "idemflow") -> str:
    """The key to send downstream for ``step`` of the intent ``record`` stands for.

    Derived from ``(principal, key, step)`` and the request's fingerprint only:
    nothing the database assigns, so it is the same on every retry and after
    every crash of one intent, in both commit modes (in single-commit mode a
    crash rolls the record back and the retry creates it afresh). A key
    reused after retention for a *different* request gets a different
    downstream key; the same request again gets the same one, and a provider
    that still remembers it answers with the charge it already made.
    Length-prefixed so no two tuples encode alike; hashed so the principal and
    the client's key are not disclosed to the provider.
    """
    parts = (namespace, record.principal, record.key, step, record.fingerprint)
    encoded = b"".join(f"{len(p.encode())}:".encode() + p.encode() for p in parts)
    return f"{namespace}-{hashlib.sha256(encoded).hexdigest()[:40]}"
