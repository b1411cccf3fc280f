"""
Bad input to the demo on PostgreSQL: text PostgreSQL cannot store is a 400, never a 500.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.http.conftest import ALICE, Demo, assert_problem, new_key, run_demo

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(120)]


@pytest.fixture
def pg_demo(tmp_path: Path, pg_url: str) -> Iterator[Demo]:
    with run_demo(tmp_path / "data", database_url=pg_url) as demo:
        yield demo


@pytest.mark.parametrize("customer", ["ada\\u0000", "\\u0000", "\\ud83d alone"])
def test_text_postgresql_cannot_store_is_400_and_not_recorded(pg_demo: Demo, customer: str) -> None:
    """Issue 9, defect 12: a NUL in customer failed the INSERT after the claim (500)."""
    key = new_key()
    body = ('{"amount": 1000, "currency": "EUR", "customer": "' + customer + '"}').encode()
    with pg_demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        response = client.post("/payments", content=body, headers={"Content-Type": "text/plain"})
        valid = client.post(
            "/payments", json={"amount": 1000, "currency": "EUR", "customer": "ada"}
        )
    assert_problem(response, 400, "invalid-body")
    assert valid.status_code == 201  # the key was never claimed by the bad request
    assert pg_demo.key_rows("alice", key) == [("completed", 201)]
    assert pg_demo.query("SELECT customer FROM payments") == [("ada",)]
