"""
Crash recovery for the demo: the reconciler and the background sweeper.

A payment is three atomic phases (:mod:`idemflow.demo.payments`). A process
that dies between them leaves its key ``in_progress``; once the claim is older
than the stale threshold the sweeper marks it ``stale`` and asks
:class:`PaymentReconciler` what the crashed attempt did, by the downstream key
the attempt sent to the provider:

========================  ========================  ===========================================
the process died…          the provider holds         the reconciler answers
========================  ========================  ===========================================
before phase 1 committed   nothing (no call made)     DidNotHappen: released, the retry starts over
after phase 1              no charge under the key    DidNotHappen: released, the retry resumes
after the charge           the charge                 Happened: the stored answer and the payment
                                                      row's final status commit together
========================  ========================  ===========================================

A ``Happened`` answer is exactly the response a live success would have
stored (the same builders make both), so a client cannot tell a reconciled
payment from one that never crashed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

from .._http import pooled_transaction
from .._model import Record
from ..stores.protocol import AsyncMaintainableStore
from ..sweeper import (
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
            return DidNotHappen("the provider holds no charge under the downstream key")
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


def sweep_interval(service: DemoService) -> timedelta:
    """``--sweep-every``, else the request timeout (the library's default)."""
    return service.settings.sweep_every or service.settings.request_timeout


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
