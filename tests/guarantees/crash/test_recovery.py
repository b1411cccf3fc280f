"""
The demo's sweeper and reconciler on the states a crash leaves, set up by hand.

The crash tests reach these states by killing a server; here each one is
written directly (a claim made 100 s ago, a pending payment row, a provider
charge under the downstream key), so every branch of the reconciler is
exercised, including the ones a kill hits only by chance.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from idemflow import Intent, State
from idemflow._downstream import downstream_key
from idemflow._model import Record
from idemflow_demo import Settings
from idemflow_demo.app import DemoService
from idemflow_demo.payments import PAYMENT_CREATED, succeeded_response
from idemflow_demo.provider import ChargeRequest, ProviderDeclined
from idemflow_demo.recovery import recovery_sweeper
from tests.factories import started

pytestmark = pytest.mark.anyio

CRASHED_AGO = 100.0  # seconds: far past the 12 s threshold of a 1 s request timeout


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[DemoService]:
    settings = Settings(data_dir=tmp_path, request_timeout=timedelta(seconds=1), sweeper=False)
    async with started(DemoService(settings)) as service:
        yield service


async def crashed_claim(
    service: DemoService, *, endpoint: str = "POST /payments", phase: str | None = None
) -> Record:
    """An in_progress record whose process died CRASHED_AGO seconds ago (after ``phase``)."""
    when = time.time() - CRASHED_AGO
    intent = Intent("alice", f"k-{secrets.token_hex(4)}", "fp", endpoint=endpoint)
    claim = await service.db.store.claim(intent, secrets.token_hex(16), when, when + 86400)
    assert claim.owned
    if phase is None:
        return claim.record
    await service.db.store.checkpoint(claim.record, phase, when)
    return replace(claim.record, recovery_point=phase)


async def abandoned_claim(service: DemoService) -> Record:
    """A record released CRASHED_AGO seconds ago after phase 1 (a 503 nobody retried)."""
    record = await crashed_claim(service, phase=PAYMENT_CREATED)
    assert await service.db.store.release(record, time.time() - CRASHED_AGO)
    return record


async def pending_row(service: DemoService, record: Record, customer: str = "ada") -> str:
    """Phase 1 as the handler commits it: a pending payment named by the downstream key."""
    payment_id = f"pay_{secrets.token_hex(6)}"
    async with service.db.connect() as raw:
        await service.db.wrap(raw).execute(
            "INSERT INTO payments (id, intent_ref, principal, amount, currency, customer, "
            "status, created_at) VALUES (:id, :ref, 'alice', 1000, 'EUR', :customer, "
            "'pending', 0)",
            {"id": payment_id, "ref": downstream_key(record, "payment"), "customer": customer},
        )
    return payment_id


async def charge(service: DemoService, record: Record, customer: str = "ada") -> str:
    """The provider charge the crashed attempt made, under its downstream key."""
    request = ChargeRequest(downstream_key(record, "charge"), 1000, "EUR", customer, "alice")
    try:
        return (await service.provider.charge(request)).id
    except ProviderDeclined as declined:
        return declined.charge.id


async def payment(service: DemoService, payment_id: str) -> dict[str, object] | None:
    async with service.db.connect() as raw:
        return await service.db.wrap(raw).fetchone(
            "SELECT id, amount, currency, customer, status, charge_id FROM payments WHERE id = :id",
            {"id": payment_id},
        )


async def test_a_claim_without_phase_1_is_released(service: DemoService) -> None:
    """No recovery point: no payment row was committed, so no charge was made."""
    record = await crashed_claim(service)
    report = await recovery_sweeper(service).sweep_once()
    assert (report.released, report.completed) == (1, 0)
    after = await service.db.store.get("alice", record.key)
    assert after is not None
    assert after.state is State.RELEASED


async def test_phase_1_without_a_charge_is_released_and_its_row_forgotten(
    service: DemoService,
) -> None:
    """The provider holds nothing under the key: the pending row goes, with the progress."""
    record = await crashed_claim(service, phase=PAYMENT_CREATED)
    payment_id = await pending_row(service, record)
    report = await recovery_sweeper(service).sweep_once()
    assert report.released == 1
    after = await service.db.store.get("alice", record.key)
    assert after is not None
    assert after.state is State.RELEASED
    assert after.recovery_point is None  # a retry starts afresh, from phase 1
    assert await payment(service, payment_id) is None


async def test_a_charge_settles_the_record_and_the_row_together(service: DemoService) -> None:
    """Charged, not committed: the stored answer is the live 201, the row is succeeded."""
    record = await crashed_claim(service, phase=PAYMENT_CREATED)
    payment_id = await pending_row(service, record)
    charge_id = await charge(service, record)
    report = await recovery_sweeper(service).sweep_once()
    assert report.completed == 1
    row = await payment(service, payment_id)
    assert row is not None
    assert (row["status"], row["charge_id"]) == ("succeeded", charge_id)
    after = await service.db.store.get("alice", record.key)
    assert after is not None
    assert after.state is State.COMPLETED
    assert after.response == succeeded_response(row)


async def test_a_declined_charge_settles_as_failed_permanent(service: DemoService) -> None:
    """A decline the crashed attempt never recorded: stored 402, row declined."""
    record = await crashed_claim(service, phase=PAYMENT_CREATED)
    payment_id = await pending_row(service, record, customer="declined-bo")
    charge_id = await charge(service, record, customer="declined-bo")
    await recovery_sweeper(service).sweep_once()
    row = await payment(service, payment_id)
    assert row is not None
    assert (row["status"], row["charge_id"]) == ("declined", charge_id)
    after = await service.db.store.get("alice", record.key)
    assert after is not None
    assert after.state is State.FAILED_PERMANENT
    assert after.response is not None
    assert after.response.status == 402
    assert after.response.json_body()["payment_id"] == payment_id


async def test_a_charge_without_its_pending_row_stays_stale(service: DemoService) -> None:
    """Charged, but no pending row to settle: unknown, kept stale, asked again later."""
    record = await crashed_claim(service, phase=PAYMENT_CREATED)
    await charge(service, record)
    report = await recovery_sweeper(service).sweep_once()
    assert (report.unknown, report.completed, report.released) == (1, 0, 0)
    after = await service.db.store.get("alice", record.key)
    assert after is not None
    assert after.state is State.STALE


async def test_a_refund_is_local_and_released(service: DemoService) -> None:
    """Refunds are one local transaction: a crashed one rolled back, nothing to ask."""
    record = await crashed_claim(service, endpoint="POST /payments/{id}/refunds", phase="x")
    report = await recovery_sweeper(service).sweep_once()
    assert report.released == 1
    after = await service.db.store.get("alice", record.key)
    assert after is not None
    assert after.state is State.RELEASED


async def test_an_abandoned_charged_intent_settles_without_a_retry(service: DemoService) -> None:
    """Released after "timed out after charging", never retried: settled as the live 201."""
    record = await abandoned_claim(service)
    payment_id = await pending_row(service, record)
    charge_id = await charge(service, record)
    report = await recovery_sweeper(service).sweep_once()
    assert report.completed == 1
    row = await payment(service, payment_id)
    assert row is not None
    assert (row["status"], row["charge_id"]) == ("succeeded", charge_id)
    after = await service.db.store.get("alice", record.key)
    assert after is not None
    assert after.state is State.COMPLETED
    assert after.response == succeeded_response(row)


async def test_an_abandoned_uncharged_intent_leaves_no_payment(service: DemoService) -> None:
    """Released after "unreachable", never retried: the pending row is deleted."""
    record = await abandoned_claim(service)
    payment_id = await pending_row(service, record)
    report = await recovery_sweeper(service).sweep_once()
    assert report.released == 1
    assert await payment(service, payment_id) is None
    after = await service.db.store.get("alice", record.key)
    assert after is not None
    assert (after.state, after.recovery_point) == (State.RELEASED, None)
    assert (await recovery_sweeper(service).sweep_once()).resolved == 0  # visited once


async def test_a_recent_release_is_left_to_its_retry(service: DemoService) -> None:
    """Released a moment ago: the client may still retry; the sweeper keeps off."""
    record = await crashed_claim(service, phase=PAYMENT_CREATED)
    assert await service.db.store.release(record, time.time())
    payment_id = await pending_row(service, record)
    assert (await recovery_sweeper(service).sweep_once()).resolved == 0
    assert (await payment(service, payment_id) or {})["status"] == "pending"
