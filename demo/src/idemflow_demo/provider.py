"""
A fake external payment provider with a ledger of its own.

The ledger is a separate SQLite file: charging the provider and writing the
payment row are two writes to two systems, with no transaction spanning both
(the dual write). What keeps a retry from charging twice is the provider's own
de-duplication on the downstream idempotency key the service sends: the same
key returns the charge that key already made.

Injected transient failures (``failure_rate``) come in two kinds, half each:
the request never reaches the provider, or the provider charges and the answer
is lost on the way back. The second kind is why the downstream key matters: the
service cannot know whether the charge happened, and a retry without the same
key would charge again.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from idemflow.stores.sqlite import connect

__all__ = ["Charge", "ChargeRequest", "FakeProvider", "ProviderDeclined", "ProviderUnavailable"]

_SCHEMA = """CREATE TABLE IF NOT EXISTS charges (
    id TEXT PRIMARY KEY,
    downstream_key TEXT NOT NULL UNIQUE,
    amount INTEGER NOT NULL,
    currency TEXT NOT NULL,
    customer TEXT NOT NULL,
    principal TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at REAL NOT NULL
)"""

_COLUMNS = "id, downstream_key, amount, currency, customer, principal, status, created_at"


class ProviderUnavailable(Exception):
    """Transient: the charge may or may not have happened; retry with the same key."""


@dataclass(frozen=True, slots=True)
class ChargeRequest:
    downstream_key: str
    amount: int
    currency: str
    customer: str
    principal: str


@dataclass(frozen=True, slots=True)
class Charge:
    """One ledger entry: ``status`` is ``succeeded`` or ``declined``."""

    id: str
    downstream_key: str
    amount: int
    currency: str
    customer: str
    principal: str
    status: str
    created_at: float

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "downstream_key": self.downstream_key,
            "amount": self.amount,
            "currency": self.currency,
            "customer": self.customer,
            "principal": self.principal,
            "status": self.status,
        }


class ProviderDeclined(Exception):
    """Permanent: the provider refused the charge; retrying cannot change it."""

    def __init__(self, charge: Charge) -> None:
        super().__init__(f"charge {charge.id} declined for customer {charge.customer!r}")
        self.charge = charge


class FakeProvider:
    """Charges customers, once per downstream key. Declines customers named ``declined…``.

    Args:
        path: the ledger's own SQLite file.
        latency_ms: how long each call takes.
        failure_rate: the share of calls that fail transiently (0–1).
        rng: the source of injected failures (seed it for reproducible runs).
    """

    def __init__(
        self,
        path: Path,
        *,
        latency_ms: int = 0,
        failure_rate: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        self.path = path
        self.latency = latency_ms / 1000
        self.failure_rate = failure_rate
        self._rng = rng or random.Random()
        self._conn: sqlite3.Connection | None = None
        self._lock = asyncio.Lock()

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = connect(self.path, busy_timeout=10.0)
        self._conn.execute(_SCHEMA)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def charge(self, request: ChargeRequest) -> Charge:
        """Charge once per ``request.downstream_key``; the same key returns the same charge.

        Raises:
            ProviderUnavailable: injected transient failure (before or after charging).
            ProviderDeclined: the customer's name starts with ``declined``.
        """
        if self.latency:
            await asyncio.sleep(self.latency)
        failing = self._rng.random() < self.failure_rate
        if failing and self._rng.random() < 0.5:
            raise ProviderUnavailable("payment provider unreachable (injected)")
        async with self._lock:  # one ledger connection, one statement pair at a time
            charge = await asyncio.to_thread(self._record, request)
        if failing:
            raise ProviderUnavailable("payment provider timed out after charging (injected)")
        if charge.status == "declined":
            raise ProviderDeclined(charge)
        return charge

    def _record(self, request: ChargeRequest) -> Charge:
        conn = self._connection()
        status = "declined" if request.customer.startswith("declined") else "succeeded"
        conn.execute(
            f"INSERT INTO charges ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (downstream_key) DO NOTHING",
            (
                "ch_" + secrets.token_hex(12),
                request.downstream_key,
                request.amount,
                request.currency,
                request.customer,
                request.principal,
                status,
                time.time(),
            ),
        )
        row = conn.execute(
            f"SELECT {_COLUMNS} FROM charges WHERE downstream_key = ?", (request.downstream_key,)
        ).fetchone()
        return Charge(*row)

    async def find(self, downstream_key: str) -> Charge | None:
        """The charge made under ``downstream_key``, if any (what a reconciler asks)."""
        async with self._lock:
            row = await asyncio.to_thread(
                lambda: (
                    self._connection()
                    .execute(
                        f"SELECT {_COLUMNS} FROM charges WHERE downstream_key = ?",
                        (downstream_key,),
                    )
                    .fetchone()
                )
            )
        return None if row is None else Charge(*row)

    async def ledger(self, limit: int = 1000) -> list[Charge]:
        """The most recent charges, newest first."""
        async with self._lock:
            rows = await asyncio.to_thread(
                lambda: (
                    self._connection()
                    .execute(
                        f"SELECT {_COLUMNS} FROM charges ORDER BY created_at DESC LIMIT ?", (limit,)
                    )
                    .fetchall()
                )
            )
        return [Charge(*row) for row in rows]

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("the provider is not open")
        return self._conn
