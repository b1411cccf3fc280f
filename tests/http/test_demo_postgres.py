"""
The demo on PostgreSQL (``--database postgresql://…``): the main flow and the race.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.http.conftest import ALICE, BOB, PAYMENT, Demo, assert_problem, new_key, run_demo
from tests.http.test_demo_races import assert_one_charge, storm

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(180)]


@pytest.fixture
def pg_demo(tmp_path: Path, pg_url: str) -> Iterator[Demo]:
    with run_demo(tmp_path / "data", "--provider-latency-ms", "300", database_url=pg_url) as demo:
        yield demo


def test_charge_replay_and_422_on_postgresql(pg_demo: Demo) -> None:
    key = new_key()
    with pg_demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        first = client.post("/payments", json=PAYMENT)
        again = client.post("/payments", json=PAYMENT)
        reused = client.post("/payments", json={**PAYMENT, "amount": 5})
        listed = client.get("/payments").json()["payments"]
    assert first.status_code == 201
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert_problem(reused, 422, "key-reused")
    assert listed == [first.json()]
    assert pg_demo.key_rows("alice", key) == [("completed", 201)]
    assert pg_demo.query("SELECT status FROM payments") == [("succeeded",)]
    assert len(pg_demo.charges()) == 1


def test_an_invalid_body_is_not_recorded_on_postgresql(pg_demo: Demo) -> None:
    key = new_key()
    with pg_demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        assert_problem(client.post("/payments", json={"amount": -1}), 400, "invalid-body")
    assert pg_demo.key_rows("alice", key) == []


@pytest.mark.anyio
async def test_50_parallel_posts_charge_once_per_principal_on_postgresql(pg_demo: Demo) -> None:
    key = new_key()
    alice, bob = await asyncio.gather(storm(pg_demo, key, ALICE), storm(pg_demo, key, BOB))
    assert any(r.status_code == 409 for r in alice + bob)
    assert_one_charge(pg_demo, "alice", key, alice)
    assert_one_charge(pg_demo, "bob", key, bob)
    assert pg_demo.query("SELECT count(*) FROM payments") == [(2,)]
    assert len(pg_demo.charges()) == 2
