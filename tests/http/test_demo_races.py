"""
Concurrency and failure through the real demo: races, 409s, principals, provider outages.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.http.conftest import ALICE, BOB, PAYMENT, Demo, assert_problem, new_key, run_demo

pytestmark = pytest.mark.timeout(180)

PARALLEL = 50


@pytest.fixture(scope="module")
def slow_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    """A demo whose provider takes 400 ms, so requests overlap the first one."""
    data = tmp_path_factory.mktemp("slow") / "data"
    with run_demo(data, "--provider-latency-ms", "400") as running:
        yield running


async def storm(demo: Demo, key: str, headers: dict[str, str]) -> list[httpx.Response]:
    async with demo.async_client(headers={**headers, "Idempotency-Key": key}) as client:
        return list(
            await asyncio.gather(*(client.post("/payments", json=PAYMENT) for _ in range(PARALLEL)))
        )


def assert_one_charge(demo: Demo, principal: str, key: str, responses: list[httpx.Response]) -> str:
    """Exactly one 201 (others 409 with Retry-After, or its replay): one row, one charge."""
    created = [r for r in responses if r.status_code == 201]
    conflicts = [r for r in responses if r.status_code == 409]
    assert len(created) + len(conflicts) == len(responses), [r.status_code for r in responses]
    assert created, "nobody got the 201"
    assert sum("idempotent-replayed" not in r.headers for r in created) == 1
    assert len({r.content for r in created}) == 1
    for conflict in conflicts:
        assert_problem(conflict, 409, "in-progress")
        assert int(conflict.headers["retry-after"]) >= 1
    payment = created[0].json()
    rows = demo.query(
        "SELECT id FROM payments WHERE principal = ? AND id = ?", principal, payment["id"]
    )
    assert len(rows) == 1
    charges = [c for c in demo.charges() if c["id"] == payment["charge_id"]]
    assert len(charges) == 1
    assert demo.key_rows(principal, key) == [("completed", 201)]
    return str(payment["id"])


def count_payments_for(demo: Demo, principal: str) -> int:
    return int(demo.query("SELECT count(*) FROM payments WHERE principal = ?", principal)[0][0])


@pytest.mark.anyio
async def test_50_parallel_identical_posts_make_one_payment_and_one_charge(
    slow_demo: Demo,
) -> None:
    key = new_key()
    payments_before = count_payments_for(slow_demo, "alice")
    charges_before = len(slow_demo.charges())
    responses = await storm(slow_demo, key, ALICE)
    assert_one_charge(slow_demo, "alice", key, responses)
    assert any(r.status_code == 409 for r in responses)
    assert count_payments_for(slow_demo, "alice") == payments_before + 1
    assert len(slow_demo.charges()) == charges_before + 1


@pytest.mark.anyio
async def test_a_409_is_immediate_and_the_retry_after_completion_gets_the_201_replay(
    slow_demo: Demo,
) -> None:
    key = new_key()
    async with slow_demo.async_client(headers={**ALICE, "Idempotency-Key": key}) as client:
        first = asyncio.create_task(client.post("/payments", json=PAYMENT))
        await asyncio.sleep(0.15)  # the first is now waiting on the provider
        started = time.monotonic()
        conflict = await client.post("/payments", json=PAYMENT)
        waited = time.monotonic() - started
        original = await first
        retry = await client.post("/payments", json=PAYMENT)
    assert_problem(conflict, 409, "in-progress")
    assert conflict.headers["retry-after"] == "1"
    assert waited < 0.3, "a 409 must not wait for the first request"
    assert original.status_code == 201
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content == original.content


@pytest.mark.anyio
async def test_alice_and_bob_with_the_same_key_get_two_independent_payments(
    slow_demo: Demo,
) -> None:
    key = new_key()
    alice, bob = await asyncio.gather(storm(slow_demo, key, ALICE), storm(slow_demo, key, BOB))
    alice_payment = assert_one_charge(slow_demo, "alice", key, alice)
    bob_payment = assert_one_charge(slow_demo, "bob", key, bob)
    assert alice_payment != bob_payment


def seed_where(first_call_charges: bool) -> int:
    """A provider seed whose first call fails, after charging or before."""
    for seed in range(1000):
        rng = random.Random(seed)
        if rng.random() < 0.5 and (rng.random() >= 0.5) == first_call_charges:
            return seed
    raise AssertionError("no such seed")


@pytest.mark.parametrize(
    "charged_before_failing", [False, True], ids=["lost-request", "lost-answer"]
)
def test_a_503_from_the_provider_releases_the_key_and_the_retry_charges_once(
    tmp_path: Path, charged_before_failing: bool
) -> None:
    seed = str(seed_where(charged_before_failing))
    flags = ("--provider-failure-rate", "0.5", "--provider-seed", seed)
    with run_demo(tmp_path / "data", *flags) as demo:
        key = new_key()
        with demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
            failed = client.post("/payments", json=PAYMENT)
            assert_problem(failed, 503, "provider-unavailable")
            assert failed.headers["retry-after"] == "1"
            assert demo.key_rows("alice", key) == [("released", None)]
            assert len(demo.charges()) == (1 if charged_before_failing else 0)
            for _ in range(30):
                retried = client.post("/payments", json=PAYMENT)
                if retried.status_code != 503:
                    break
        assert retried.status_code == 201
        assert "idempotent-replayed" not in retried.headers
        assert demo.query("SELECT count(*) FROM payments")[0][0] == 1
        (charge,) = demo.charges()
        assert charge["id"] == retried.json()["charge_id"]
        with demo.client() as client:
            metrics = client.get("/metrics").text
        assert 'idemflow_requests_total{endpoint="POST /payments",outcome="released"}' in metrics
