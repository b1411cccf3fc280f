"""
The demo on MariaDB (``--database mysql://…``) and on Redis (``redis://…``: keys in
Redis, payments in SQLite): the main flow, a refund, and the race, as on PostgreSQL.

Checked through what the demo and the key store show (``GET /payments``, the
provider's ledger, the key record read with the store the URL opens), so the
same assertions hold for both. One demo per backend for the whole module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.demo_stores import mysql_database, redis_prefix
from tests.http.conftest import ALICE, BOB, PAYMENT, Demo, assert_problem, new_key, run_demo
from tests.http.test_demo_races import PARALLEL

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("mysql", marks=pytest.mark.mysql),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
def backend_demo(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Demo]:
    """The demo on a database of its own; its provider takes 300 ms, so requests overlap."""
    database = mysql_database() if request.param == "mysql" else redis_prefix()
    data = tmp_path_factory.mktemp(request.param) / "data"
    with database as url, run_demo(data, "--provider-latency-ms", "300", database_url=url) as demo:
        yield demo


def listed(demo: Demo, headers: dict[str, str]) -> list[dict[str, Any]]:
    with demo.client(headers=headers) as client:
        payments: list[dict[str, Any]] = client.get("/payments").json()["payments"]
        return payments


def test_charge_replay_and_422(backend_demo: Demo) -> None:
    key = new_key()
    charges_before = len(backend_demo.charges())
    with backend_demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        first = client.post("/payments", json=PAYMENT)
        again = client.post("/payments", json=PAYMENT)
        reused = client.post("/payments", json={**PAYMENT, "amount": 5})
    assert first.status_code == 201, first.text
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["location"] == first.headers["location"]
    assert_problem(reused, 422, "key-reused")
    assert first.json() in listed(backend_demo, ALICE)
    assert backend_demo.key_state("alice", key) == ("completed", 201)
    assert len(backend_demo.charges()) == charges_before + 1


def test_an_invalid_body_is_not_recorded(backend_demo: Demo) -> None:
    key = new_key()
    with backend_demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        assert_problem(client.post("/payments", json={"amount": -1}), 400, "invalid-body")
    assert backend_demo.key_state("alice", key) is None


def test_a_refund_is_made_once_and_replayed(backend_demo: Demo) -> None:
    with backend_demo.client(headers={**ALICE, "Idempotency-Key": new_key()}) as client:
        payment = client.post("/payments", json=PAYMENT).json()
    key = new_key()
    path = f"/payments/{payment['id']}/refunds"
    with backend_demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        first = client.post(path, json={"amount": 300})
        again = client.post(path, json={"amount": 300})
        refunded = client.get(f"/payments/{payment['id']}").json()
    assert first.status_code == 201, first.text
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert first.json()["id"].startswith("re_")
    assert refunded["status"] == "succeeded"
    assert backend_demo.key_state("alice", key) == ("completed", 201)


async def storm(demo: Demo, key: str, headers: dict[str, str]) -> list[httpx.Response]:
    async with demo.async_client(headers={**headers, "Idempotency-Key": key}) as client:
        return list(
            await asyncio.gather(*(client.post("/payments", json=PAYMENT) for _ in range(PARALLEL)))
        )


@pytest.mark.anyio
async def test_50_parallel_posts_charge_once_per_principal(backend_demo: Demo) -> None:
    key = new_key()
    charges_before = len(backend_demo.charges())
    alice, bob = await asyncio.gather(
        storm(backend_demo, key, ALICE), storm(backend_demo, key, BOB)
    )
    assert any(r.status_code == 409 for r in alice + bob)
    for principal, headers, responses in (("alice", ALICE, alice), ("bob", BOB, bob)):
        created = [r for r in responses if r.status_code == 201]
        assert {r.status_code for r in responses} <= {201, 409}
        assert sum("idempotent-replayed" not in r.headers for r in created) == 1
        assert len({r.content for r in created}) == 1
        for conflict in (r for r in responses if r.status_code == 409):
            assert_problem(conflict, 409, "in-progress")
            assert int(conflict.headers["retry-after"]) >= 1
        ids = [p["id"] for p in listed(backend_demo, headers)]
        assert ids.count(created[0].json()["id"]) == 1
        assert backend_demo.key_state(principal, key) == ("completed", 201)
    assert len(backend_demo.charges()) == charges_before + 2


def test_the_banner_names_where_keys_and_payments_live(backend_demo: Demo) -> None:
    where = backend_demo.banner[1]
    if backend_demo.database_url and backend_demo.database_url.startswith("redis"):
        assert where.startswith("  keys: redis://")
        assert "payments: SQLite" in where
    else:
        assert where.startswith("  keys + payments: mysql://")
    assert Path(backend_demo.data_dir).is_dir()
