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

Without a shared transaction (keys in Redis, payments in SQLite:
:attr:`Database.transactional` False) the sweeper has no transaction in which
to write the rows with the record, and the rows may be ahead of the record
(they commit first):

========================  ========================  ===========================================
the intent stopped…        the provider holds         the reconciler answers
========================  ========================  ===========================================
before its checkpoint      nothing (no call made)     DidNotHappen: released; the retry's phase 1
                                                      finds the row it may have left
after phase 1              no charge under the key    DidNotHappen: released; a retry resumes
                                                      after phase 1 (an abandoned intent's pending
                                                      row stays, never listed)
after the charge           the charge                 Happened, from the payment row: a pending
                                                      row is settled first (fenced on pending, so
                                                      done once), one the live path settled before
                                                      its completion was lost is read as it is
a refund, completion lost  the refund row             Happened (its id is its downstream key's)
========================  ========================  ===========================================
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol, cast

from idemflow import AsyncIdempotency, Observer, Record
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
from .payments import (
    PAYMENT_CREATED,
    declined_response,
    refund_id,
    refund_response,
    succeeded_response,
)
from .provider import Charge, FakeProvider, ProviderDeclined
from .settings import Settings

__all__ = ["STEPS", "PaymentReconciler", "RecoveredService", "recovery_sweeper", "start_recovery"]


class RecoveredService(Protocol):
    """What recovery needs of the demo's service (``app.DemoService``), so that this module
    never imports the app that starts it."""

    @property
    def settings(self) -> Settings: ...
    @property
    def db(self) -> Database: ...
    @property
    def idempotency(self) -> AsyncIdempotency: ...
    @property
    def provider(self) -> FakeProvider: ...
    @property
    def metrics(self) -> Observer: ...


#: The steps whose downstream keys the reconciler needs: the payment row's
#: ``intent_ref``, the provider charge, and a refund's id.
STEPS = ("payment", "charge", "refund")

PAYMENTS_ENDPOINT = "POST /payments"
REFUNDS_ENDPOINT = "POST /payments/{id}/refunds"

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
_PAYMENT = (
    "SELECT id, amount, currency, customer, status, charge_id FROM payments WHERE intent_ref = :ref"
)
_REFUND = "SELECT id, payment_id, amount FROM refunds WHERE id = :id"


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
        if record.endpoint == PAYMENTS_ENDPOINT:
            return await self._payment(record, downstream_keys)
        if record.endpoint == REFUNDS_ENDPOINT and not self.db.transactional:
            return await self._refund(downstream_keys["refund"])
        # Refunds are one local transaction: uncommitted means rolled back.
        return DidNotHappen("a local operation: its transaction rolled back")

    async def _payment(self, record: Record, downstream_keys: Mapping[str, str]) -> Answer:
        shared = self.db.transactional
        if record.recovery_point != PAYMENT_CREATED:
            return DidNotHappen("phase 1 never committed: no payment row, so no charge")
        charge = await self.provider.find(downstream_keys["charge"])
        if charge is None:
            reason = "the provider holds no charge under the downstream key"
            # Without a transaction to delete the row in, a retry resumes with it.
            forget = _forget_row(self.db, downstream_keys["payment"]) if shared else None
            return DidNotHappen(reason, apply=forget)
        if not shared:
            return await self._settled_apart(downstream_keys["payment"], charge)
        row = await self._read(_PENDING, {"ref": downstream_keys["payment"]})
        if row is None:
            return Unknown("charged, but no pending payment row to settle")
        return _happened(row, charge, self.db)

    async def _read(self, sql: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
        async with self.db.connect() as raw:
            return await self.db.wrap(raw).fetchone(sql, params)

    async def _settled_apart(self, intent_ref: str, charge: Charge) -> Answer:
        """No shared transaction: settle the row now (once), then answer from it."""
        row = await self._read(_PAYMENT, {"ref": intent_ref})
        if row is None:
            return Unknown("charged, but no payment row to settle")
        if row["status"] == "pending":
            settled = {**row, "status": charge.status, "charge_id": charge.id}
            async with self.db.connect() as raw:
                # Fenced on 'pending'; 0 rows: settled meanwhile, read again next sweep.
                if await self.db.wrap(raw).execute(_SETTLE, settled) != 1:
                    return Unknown("the payment row changed while it was settled")
            row = settled
        if (row["status"], row["charge_id"]) != (charge.status, charge.id):
            return Unknown("the payment row disagrees with the provider's charge")
        return _happened(row, charge, None)

    async def _refund(self, downstream_key: str) -> Answer:
        """No shared transaction: the refund committed if its row exists."""
        row = await self._read(_REFUND, {"id": refund_id(downstream_key)})
        if row is None:
            return DidNotHappen("no refund row under the attempt's id: it rolled back")
        return Happened(refund_response(row))


def _happened(row: dict[str, Any], charge: Charge, db: Database | None) -> Happened:
    """The live path's answer for this charge, and the row update that goes with it.

    ``db`` None: the row is settled already (no transaction to settle it in).
    """
    settled = {**row, "status": charge.status, "charge_id": charge.id}
    if charge.status == "declined":
        response = declined_response(row["id"], ProviderDeclined(charge))
    else:
        response = succeeded_response(settled)
    return Happened(response, apply=None if db is None else _settle_row(db, settled))


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


def sweep_interval(service: RecoveredService) -> timedelta | None:
    """``--sweep-every``, else None: the library's default (``Policy.sweep_interval``)."""
    return service.settings.sweep_every


def retry_stale_after(service: RecoveredService) -> timedelta:
    """How long a record this sweeper marked stale waits before it is asked about again.

    The library's default is the stale threshold, so a resolution that failed
    half-way (the store or the pool out of reach just after the mark, a reply
    lost in a partition) left its key waiting a second threshold: measured in
    the network storm, keys then settled 25–45 s after their claim and missed
    the storm's deadline. One request timeout is enough: every write of a
    resolution is fenced by the mark's token, so a sweeper that marks the
    record again meanwhile only makes the first one's write change nothing.
    """
    return service.settings.request_timeout


def start_recovery(service: RecoveredService) -> AsyncBackgroundSweeper | None:
    """Start the demo's background sweeper (None when ``--sweep-every off``).

    Call it from inside the event loop, once the database and the provider
    are open; ``await background.stop()`` before closing them.
    """
    if not service.settings.sweeper:
        return None
    return start_background_sweeper(recovery_sweeper(service), every=sweep_interval(service))


def recovery_sweeper(service: RecoveredService) -> AsyncSweeper:
    """The demo's sweeper: its policy, its reconciler, transactions on its own pool."""
    db = service.db
    return AsyncSweeper(
        # Every demo store (SQLite, PostgreSQL, MySQL, Redis) has the maintenance statements.
        cast("AsyncMaintainableStore", db.store),
        service.idempotency.policy,
        reconciler=PaymentReconciler(service.provider, db),
        steps=STEPS,
        # Redis shares no transaction: its answers carry no apply (see the table above).
        transaction_factory=(
            (lambda: pooled_transaction(db.connect, db.transaction)) if db.transactional else None
        ),
        retry_unknown_after=retry_stale_after(service),
        observer=service.metrics,
    )
