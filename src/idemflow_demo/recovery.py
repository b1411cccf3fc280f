"""
Crash recovery for the demo: the reconciler and the background sweeper.

A payment is three atomic phases (:mod:`idemflow_demo.payments`). An intent
can stop between them in two ways: the process dies (its key stays
``in_progress``), or the provider fails and the client, told 503, never
retries (its key stays ``released`` with the recovery point
``payment_created`` and a pending payment row). Either way the sweeper finds
the record once it is untouched for longer than the stale threshold, marks it
``stale`` and asks :class:`PaymentReconciler` what the attempt did, by the
downstream key the attempt sent to the provider:

========================  ========================  ===========================================
the intent stopped…        the provider holds         the reconciler answers
========================  ========================  ===========================================
before phase 1 committed   nothing (no call made)     DidNotHappen: released, the retry starts over
after phase 1              no charge under the key    DidNotHappen: the pending row is deleted with
                                                      the release (progress forgotten): nothing
                                                      recorded; a retry starts over
after the charge           the charge                 Happened: the stored answer and the payment
                                                      row's final status commit together
========================  ========================  ===========================================

So every intent converges, retried or not: charged, one succeeded (or
declined) payment whose replay is the live answer; not charged, no payment
row. A ``Happened`` answer is exactly the response a live success would have
stored (the same builders make both), so a client cannot tell a reconciled
payment from one that never stopped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from idemflow import Record
from idemflow.integrations.starlette import pooled_transaction
from idemflow.stores.protocol import AsyncMaintainableStore
from idemflow.sweeper import (
    Answer,
    AsyncBackgroundSweeper,
    AsyncSweeper,
    DidNotHappen,
    Happened,
    Unknown,
    start_background_sweeper,
)

from .db import Database
from .payments import PAYMENT_CREATED, declined_response, succeeded_response
from .provider import Charge, FakeProvider, ProviderDeclined

if TYPE_CHECKING:
    from .app import DemoService

__all__ = ["STEPS", "PaymentReconciler", "recovery_sweeper", "start_recovery"]

#: The steps whose downstream keys the reconciler needs: the payment row's
#: ``intent_ref`` and the provider charge.
STEPS = ("payment", "charge")

PAYMENTS_ENDPOINT = "POST /payments"

_PENDING = (
    "SELECT id, amount, currency, customer, status, charge_id FROM payments "
    "WHERE intent_ref = :ref AND status = 'pending'"
)
# Fenced on 'pending': a row some other path settled is never overwritten.
_SETTLE = (
    "UPDATE payments SET status = :status, charge_id = :charge_id "
    "WHERE id = :id AND status = 'pending'"
)
# Phase 1's only trace, undone when the provider holds no charge. At most one
# row (intent_ref is unique); none if phase 1's row never committed.
_FORGET = "DELETE FROM payments WHERE intent_ref = :ref AND status = 'pending'"


class PaymentReconciler:
    """Asks the provider whether a crashed payment was charged (an ``AsyncReconciler``).

    Args:
        provider: the provider, asked by downstream key only; never charged here.
        db: the demo's database, for the pending payment row.
    """

    def __init__(self, provider: FakeProvider, db: Database) -> None:
        self.provider = provider
        self.db = db

    async def __call__(self, record: Record, downstream_keys: Mapping[str, str]) -> Answer:
        if record.endpoint != PAYMENTS_ENDPOINT:
            # Refunds are one local transaction: uncommitted means rolled back.
            return DidNotHappen("a local operation: its transaction rolled back")
        if record.recovery_point != PAYMENT_CREATED:
            return DidNotHappen("phase 1 never committed: no payment row, so no charge")
        charge = await self.provider.find(downstream_keys["charge"])
        if charge is None:
            reason = "the provider holds no charge under the downstream key"
            return DidNotHappen(reason, apply=_forget_row(self.db, downstream_keys["payment"]))
        row = await self._pending(downstream_keys["payment"])
        if row is None:
            return Unknown("charged, but no pending payment row to settle")
        return _happened(row, charge, self.db)

    async def _pending(self, intent_ref: str) -> dict[str, Any] | None:
        async with self.db.connect() as raw:
            return await self.db.wrap(raw).fetchone(_PENDING, {"ref": intent_ref})


def _happened(row: dict[str, Any], charge: Charge, db: Database) -> Happened:
    """The live path's answer for this charge, and the row update that goes with it."""
    settled = {**row, "status": charge.status, "charge_id": charge.id}
    if charge.status == "declined":
        response = declined_response(row["id"], ProviderDeclined(charge))
    else:
        response = succeeded_response(settled)
    return Happened(response, apply=_settle_row(db, settled))


def _settle_row(db: Database, settled: dict[str, Any]) -> Callable[[Any], Awaitable[None]]:
    async def apply(connection: Any) -> None:
        changed = await db.wrap(connection).execute(_SETTLE, settled)
        if changed != 1:  # raising rolls the settled record back too; asked again later
            msg = f"payment {settled['id']} is no longer pending"
            raise RuntimeError(msg)

    return apply


def _forget_row(db: Database, intent_ref: str) -> Callable[[Any], Awaitable[None]]:
    """Delete the pending row, in the sweeper's transaction with the release."""

    async def apply(connection: Any) -> None:
        await db.wrap(connection).execute(_FORGET, {"ref": intent_ref})

    return apply


def sweep_interval(service: DemoService) -> timedelta | None:
    """``--sweep-every``, else None: the library's default (``Policy.sweep_interval``)."""
    return service.settings.sweep_every


def start_recovery(service: DemoService) -> AsyncBackgroundSweeper | None:
    """Start the demo's background sweeper (None when ``--sweep-every off``).

    Call it from inside the event loop, once the database and the provider
    are open; ``await background.stop()`` before closing them.
    """
    if not service.settings.sweeper:
        return None
    return start_background_sweeper(recovery_sweeper(service), every=sweep_interval(service))


def recovery_sweeper(service: DemoService) -> AsyncSweeper:
    """The demo's sweeper: its policy, its reconciler, transactions on its own pool."""
    db = service.db
    return AsyncSweeper(
        # Both demo stores (SQLite, PostgreSQL) have the maintenance statements.
        cast("AsyncMaintainableStore", db.store),
        service.idempotency.policy,
        reconciler=PaymentReconciler(service.provider, db),
        steps=STEPS,
        transaction_factory=lambda: pooled_transaction(db.connect, db.transaction),
        observer=service.metrics,
    )
