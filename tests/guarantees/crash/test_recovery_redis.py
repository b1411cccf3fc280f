"""
The demo with its keys in Redis and its payments in SQLite: no shared transaction.

Each phase's rows commit in SQLite before its recovery point (or, at the end,
the completion) is written to Redis (``idemflow_demo.unshared``), and the
sweeper has no transaction to write rows in, so the states a failure leaves
differ from the transactional demo's (``test_recovery.py``): a row settled
whose completion was lost, a pending row whose checkpoint was lost. Each one
is set up by hand here (a claim made 100 s ago on Redis's clock, the rows,
the provider's charge), or, for the live path, by failing one store call of
a request sent to the app in-process.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from idemflow import State, StoreUnavailable
from idemflow._downstream import downstream_key
from idemflow._model import Record
from idemflow.stores.redis import open_redis
from idemflow_demo import Settings
from idemflow_demo.app import DemoService, create_app
from idemflow_demo.db_redis import RedisDatabase
from idemflow_demo.payments import PAYMENT_CREATED, refund_id, refund_response, succeeded_response
from idemflow_demo.recovery import recovery_sweeper
from tests.demo_stores import redis_url
from tests.factories import started
from tests.guarantees.crash.test_recovery import charge, crashed_claim, payment, pending_row

__all__ = ["redis_url"]

pytestmark = [pytest.mark.anyio, pytest.mark.redis]

ALICE = {"authorization": "Bearer alice-token"}
BODY = {"amount": 1000, "currency": "EUR", "customer": "ada"}


@pytest.fixture
async def service(tmp_path: Path, redis_url: str) -> AsyncIterator[DemoService]:
    """The demo on Redis; its sweeper's store (``db.store``) on the caller's clock.

    On Redis's own clock a claim cannot be made "100 s ago"; the requests
    (``service.idempotency``) keep the store the demo opened.
    """
    settings = Settings(
        database_url=redis_url,
        data_dir=tmp_path,
        request_timeout=timedelta(seconds=1),
        sweeper=False,
    )
    service = DemoService(settings)
    db = service.db
    assert isinstance(db, RedisDatabase)
    opened = db.store
    db.store = open_redis(
        db.url, prefix=db.prefix, asynchronous=True, clock="caller", allow_volatile=True
    )
    try:
        async with started(service):
            yield service
    finally:
        await opened.close()


async def settle_row(service: DemoService, payment_id: str, charge_id: str) -> None:
    """What the live path commits before it writes the completion."""
    async with service.db.connect() as raw:
        await service.db.wrap(raw).execute(
            "UPDATE payments SET status = 'succeeded', charge_id = :charge WHERE id = :id",
            {"id": payment_id, "charge": charge_id},
        )


async def state_of(service: DemoService, record: Record) -> Record:
    after = await service.db.store.get("alice", record.key)
    assert after is not None
    return after


async def test_the_demo_on_redis_shares_no_transaction(service: DemoService) -> None:
    assert not service.db.transactional
    assert not service.db.store.supports_transactions


async def test_a_charge_settles_the_pending_row_then_the_record(service: DemoService) -> None:
    """Charged, crashed before phase 3: the row is settled first, then the live 201 stored."""
    record = await crashed_claim(service, phase=PAYMENT_CREATED)
    payment_id = await pending_row(service, record)
    charge_id = await charge(service, record)
    report = await recovery_sweeper(service).sweep_once()
    assert report.completed == 1
    row = await payment(service, payment_id)
    assert row is not None
    assert (row["status"], row["charge_id"]) == ("succeeded", charge_id)
    after = await state_of(service, record)
    assert after.state is State.COMPLETED
    assert after.response == succeeded_response(row)


async def test_a_row_settled_before_its_completion_was_lost_is_stored_as_it_is(
    service: DemoService,
) -> None:
    """Phase 3 committed, the completion never reached Redis: the answer comes from the row."""
    record = await crashed_claim(service, phase=PAYMENT_CREATED)
    payment_id = await pending_row(service, record)
    charge_id = await charge(service, record)
    await settle_row(service, payment_id, charge_id)
    report = await recovery_sweeper(service).sweep_once()
    assert (report.completed, report.unknown) == (1, 0)
    row = await payment(service, payment_id)
    assert row is not None
    after = await state_of(service, record)
    assert after.state is State.COMPLETED
    assert after.response == succeeded_response(row)


async def test_phase_1_without_a_charge_is_released_and_keeps_its_row(
    service: DemoService,
) -> None:
    """No charge: released with the recovery point, so a retry resumes with the pending row."""
    record = await crashed_claim(service, phase=PAYMENT_CREATED)
    payment_id = await pending_row(service, record)
    report = await recovery_sweeper(service).sweep_once()
    assert report.released == 1
    after = await state_of(service, record)
    assert (after.state, after.recovery_point) == (State.RELEASED, PAYMENT_CREATED)
    assert (await payment(service, payment_id) or {})["status"] == "pending"


async def test_a_charge_the_rows_disagree_with_stays_stale(service: DemoService) -> None:
    """Charged, but no row, or a row settled with another charge: unknown, asked again later."""
    without_row = await crashed_claim(service, phase=PAYMENT_CREATED)
    await charge(service, without_row)
    other = await crashed_claim(service, phase=PAYMENT_CREATED)
    payment_id = await pending_row(service, other)
    await charge(service, other)
    await settle_row(service, payment_id, "ch_someone_else")
    report = await recovery_sweeper(service).sweep_once()
    assert (report.unknown, report.completed, report.released) == (2, 0, 0)
    assert (await state_of(service, without_row)).state is State.STALE
    assert (await state_of(service, other)).state is State.STALE


async def test_a_refund_is_settled_from_its_row_or_released(service: DemoService) -> None:
    """A refund committed in SQLite whose completion was lost is stored; one not, released."""
    endpoint = "POST /payments/{id}/refunds"
    committed = await crashed_claim(service, endpoint=endpoint)
    rolled_back = await crashed_claim(service, endpoint=endpoint)
    paid = await crashed_claim(service, phase=PAYMENT_CREATED)
    payment_id = await pending_row(service, paid)
    row = {
        "id": refund_id(downstream_key(committed, "refund")),
        "payment_id": payment_id,
        "amount": 100,
    }
    async with service.db.connect() as raw:
        await service.db.wrap(raw).execute(
            "INSERT INTO refunds (id, payment_id, principal, amount, created_at) "
            "VALUES (:id, :payment_id, 'alice', :amount, 0)",
            row,
        )
    report = await recovery_sweeper(service).sweep_once()
    assert report.completed == 1
    after = await state_of(service, committed)
    assert after.state is State.COMPLETED
    assert after.response == refund_response(row)
    assert (await state_of(service, rolled_back)).state is State.RELEASED


def client(service: DemoService) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(service))
    return httpx.AsyncClient(transport=transport, base_url="http://demo", headers=ALICE)


async def rows(service: DemoService) -> list[dict[str, Any]]:
    async with service.db.connect() as raw:
        return await service.db.wrap(raw).fetchall("SELECT id, status FROM payments")


async def test_a_checkpoint_lost_after_phase_1_committed_is_retried_on_the_same_row(
    service: DemoService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phase 1's row committed, its recovery point never reached Redis: the retry reuses it."""
    store = service.idempotency.store
    checkpoint = store.checkpoint
    failures = [StoreUnavailable("redis unreachable (injected)")]

    async def failing_once(*args: Any, **kwargs: Any) -> None:
        if failures:
            raise failures.pop()
        await checkpoint(*args, **kwargs)

    monkeypatch.setattr(store, "checkpoint", failing_once)
    key = {"idempotency-key": f"k-{secrets.token_hex(4)}"}
    async with client(service) as http:
        first = await http.post("/payments", json=BODY, headers=key)
        assert first.status_code == 503, first.text
        assert [r["status"] for r in await rows(service)] == ["pending"]
        again = await http.post("/payments", json=BODY, headers=key)
    assert again.status_code == 201, again.text
    assert await rows(service) == [{"id": again.json()["id"], "status": "succeeded"}]
    assert len(await service.provider.ledger()) == 1


async def test_a_lost_completion_keeps_the_key_claimed_with_its_rows_committed(
    service: DemoService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The payment committed and was charged; the completion failed: 503, and retries get 409."""

    async def unreachable(*args: Any, **kwargs: Any) -> None:
        raise StoreUnavailable("redis unreachable (injected)")

    monkeypatch.setattr(service.idempotency.store, "complete", unreachable)
    key = f"k-{secrets.token_hex(4)}"
    async with client(service) as http:
        lost = await http.post("/payments", json=BODY, headers={"idempotency-key": key})
        retry = await http.post("/payments", json=BODY, headers={"idempotency-key": key})
    assert lost.status_code == 503
    assert "retry-after" in lost.headers
    assert "could not be recorded" in lost.json()["detail"]
    assert retry.status_code == 409
    assert "retry-after" in retry.headers
    assert [r["status"] for r in await rows(service)] == ["succeeded"]
    assert len(await service.provider.ledger()) == 1
    record = await service.idempotency.store.get("alice", key)
    assert record is not None
    # Left for the sweeper's reconciler: the row settled before, as in the test above.
    assert (record.state, record.recovery_point) == (State.IN_PROGRESS, PAYMENT_CREATED)
