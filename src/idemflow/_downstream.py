"""Deterministic idempotency keys for calls to downstream providers."""

from __future__ import annotations

import hashlib

from ._model import Record

__all__ = ["downstream_key"]


def downstream_key(record: Record, step: str, *, namespace: str = "idemflow") -> str:
    """The key to send downstream for ``step`` of the intent ``record`` stands for.

    Derived from ``(principal, key, step)``, the request's fingerprint and the
    moment the intent began (``created_at``, in milliseconds): the same on
    every retry and after every crash within one retention period (a retry of
    a released key keeps ``created_at``), and new once retention ended and the
    same key starts a new intent, so a provider never answers a new intent
    with an old charge. In single-commit mode the record exists only once the
    first ``commit_phase`` committed it; a crash before rolls the claim back
    and the retry begins a new ``created_at``, which is why external calls
    belong after a ``commit_phase`` (see docs/crash-safety.md).
    Length-prefixed so no two tuples encode alike; hashed so the principal and
    the client's key are not disclosed to the provider.
    """
    began = str(round(record.created_at * 1000))
    parts = (namespace, record.principal, record.key, step, record.fingerprint, began)
    encoded = b"".join(f"{len(p.encode())}:".encode() + p.encode() for p in parts)
    return f"{namespace}-{hashlib.sha256(encoded).hexdigest()[:40]}"
