"""
Every intent converges through the real demo: retention, abandonment, shutdown.

- After retention the same request is a new execution (a new payment and a
  new charge), never a 500; within it, a replay.
- A client told 503 sees nothing recorded, and an intent it abandons settles
  by itself: charged, one succeeded payment whose replay is the 201; not
  charged, no payment row.
- SIGTERM during a slow request lets it finish: the graceful shutdown waits
  at least the request timeout, so no claim is left in flight.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from tests.http.conftest import ALICE, Demo, assert_problem, new_key, run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

T = TypeVar("T")

REQUEST_TIMEOUT = 1.0
SWEEP_EVERY = 0.5
#: Stale threshold (2 × 1 s + 10 s) + one sweep + room for a loaded machine.
SETTLE_WITHIN = 2 * REQUEST_TIMEOUT + 10 + SWEEP_EVERY + 8


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest) -> str | None:
    """None for the demo's embedded SQLite, else a PostgreSQL URL on a fresh schema."""
    if request.param == "sqlite":
        return None
    url: str = request.getfixturevalue("pg_url")
    return url


def body_for(customer: str, amount: int = 1000) -> dict[str, Any]:
    return {"amount": amount, "currency": "EUR", "customer": customer}


def post(demo: Demo, key: str, body: dict[str, Any]) -> httpx.Response:
    with demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        return client.post("/payments", json=body)


def poll(what: str, check: Callable[[], T | None], within: float, every: float = 0.2) -> T:
    """``check()`` until it returns something, or fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        found = check()
        if found is not None:
            return found
        assert time.monotonic() < deadline, f"{what}: not within {within:g} s"
        time.sleep(every)


def charges_for(demo: Demo, customer: str) -> list[dict[str, Any]]:
    return [c for c in demo.charges() if c["customer"] == customer]


def payment_rows(demo: Demo, customer: str) -> list[tuple[Any, ...]]:
    return demo.query(
        "SELECT id, status, charge_id FROM payments WHERE customer = ? ORDER BY created_at",
        customer,
    )


def key_state(demo: Demo, key: str) -> tuple[Any, ...] | None:
    rows = demo.query(
        "SELECT state, response_status, recovery_point FROM idemflow_keys "
        "WHERE principal = 'alice' AND idempotency_key = ?",
        key,
    )
    return rows[0] if rows else None


# --- retention ------------------------------------------------------------------------------


def test_after_retention_the_same_request_is_a_new_payment_and_another_body_is_accepted(
    tmp_path: Path, database_url: str | None
) -> None:
    """--retention 2s: replayed within it; after it a NEW 201 (new payment, new charge)."""
    with run_demo(tmp_path / "data", "--retention", "2s", database_url=database_url) as demo:
        key, customer = new_key(), f"kept-{new_key()}"
        first = post(demo, key, body_for(customer))
        again = post(demo, key, body_for(customer))
        assert first.status_code == 201, first.text
        assert again.headers.get("idempotent-replayed") == "true"
        assert again.content == first.content

        def executed_anew() -> httpx.Response | None:
            response = post(demo, key, body_for(customer))
            assert response.status_code == 201, response.text  # never a 500
            return None if response.headers.get("idempotent-replayed") else response

        second = poll("a new execution after retention", executed_anew, within=15)
        assert second.json()["id"] != first.json()["id"]
        assert second.json()["charge_id"] != first.json()["charge_id"]
        charges = charges_for(demo, customer)
        assert len(charges) == 2
        assert len({c["downstream_key"] for c in charges}) == 2  # a new intent, a new key
        assert [r[1] for r in payment_rows(demo, customer)] == ["succeeded", "succeeded"]

        other = body_for(customer, amount=2500)
        refused = post(demo, key, other)
        assert_problem(refused, 422, "key-reused")  # the second payment is within retention

        def accepted() -> httpx.Response | None:
            response = post(demo, key, other)
            assert response.status_code in (201, 422), response.text
            return response if response.status_code == 201 else None

        third = poll("another body accepted after retention", accepted, within=15)
        assert third.json()["amount"] == 2500
        assert "idempotent-replayed" not in third.headers
        assert len(charges_for(demo, customer)) == 3
        assert (key_state(demo, key) or ())[:2] == ("completed", 201)


def seed_for(wanted: Callable[[list[float]], bool], draws: int) -> int:
    """A provider seed whose first ``draws`` random numbers satisfy ``wanted``.

    Each provider call draws twice: fail if the first is below the failure
    rate; then fail *before* charging if the second is below 0.5, else after.
    """
    for seed in range(10_000):
        rng = random.Random(seed)
        if wanted([rng.random() for _ in range(draws)]):
            return seed
    raise AssertionError("no such seed")


def released_past_retention(demo: Demo, key: str) -> bool | None:
    rows = demo.query(
        "SELECT expires_at FROM idemflow_keys WHERE principal = 'alice' AND idempotency_key = ? "
        "AND state = 'released'",
        key,
    )
    return True if rows and rows[0][0] <= time.time() * 1000 else None


def test_a_retry_after_a_short_retention_does_not_charge_a_503_twice(tmp_path: Path) -> None:
    """503 "timed out after charging", retried past a 2 s retention: still one charge.

    A released key whose attempt got past an external call outlives its
    retention: the retry resumes it with the same downstream keys, rather
    than starting a new intent that would charge again.
    """
    flags = ("--retention", "2s", "--provider-failure-rate", "0.5")
    # The first call fails after charging; the retry's call succeeds.
    seed = str(seed_for(lambda r: r[0] < 0.5 <= r[1] and r[2] >= 0.5, draws=3))
    with run_demo(tmp_path / "data", *flags, "--provider-seed", seed) as demo:
        key, customer = new_key(), f"twice-{new_key()}"
        assert_problem(post(demo, key, body_for(customer)), 503, "provider-unavailable")
        assert len(charges_for(demo, customer)) == 1  # charged, the answer lost
        poll("retention over", lambda: released_past_retention(demo, key), within=10)
        retried = post(demo, key, body_for(customer))
        assert retried.status_code == 201, retried.text
        assert [c["id"] for c in charges_for(demo, customer)] == [retried.json()["charge_id"]]
        assert [r[1] for r in payment_rows(demo, customer)] == ["succeeded"]


def test_another_body_waits_until_the_abandoned_intent_is_reconciled(tmp_path: Path) -> None:
    """Past retention, a released key with a charge refuses a new body until it is reconciled.

    SQLite only: the take-over rule itself is checked on every store by the
    contract suite; this is the demo's view of it.
    """
    flags = (
        *("--retention", "2s", "--provider-failure-rate", "0.5"),
        *("--request-timeout", f"{REQUEST_TIMEOUT:g}", "--sweep-every", f"{SWEEP_EVERY:g}"),
        # The first call fails after charging; the next one succeeds.
        *("--provider-seed", str(seed_for(lambda r: r[0] < 0.5 <= r[1] and r[2] >= 0.5, 3))),
    )
    with run_demo(tmp_path / "data", *flags) as demo:
        key, first, other = new_key(), f"first-{new_key()}", f"other-{new_key()}"
        assert_problem(post(demo, key, body_for(first)), 503, "provider-unavailable")
        poll("retention over", lambda: released_past_retention(demo, key), within=10)
        assert_problem(post(demo, key, body_for(other)), 422, "key-reused")

        def accepted() -> httpx.Response | None:
            response = post(demo, key, body_for(other))
            assert response.status_code in (201, 409, 422), response.text
            return response if response.status_code == 201 else None

        created = poll("the other body accepted", accepted, within=SETTLE_WITHIN + 5)
        assert "idempotent-replayed" not in created.headers
        ((_, status, charge_id),) = payment_rows(demo, first)  # reconciled, not lost
        assert [c["id"] for c in charges_for(demo, first)] == [charge_id]
        assert status == "succeeded"
        assert [c["id"] for c in charges_for(demo, other)] == [created.json()["charge_id"]]


# --- a 503 records nothing; an abandoned intent converges -----------------------------------


def test_an_abandoned_intent_converges_without_a_retry(
    tmp_path: Path, database_url: str | None
) -> None:
    """Provider failed, client gone: charged ⇒ one succeeded payment; not charged ⇒ no row."""
    flags = (
        *(
            "--provider-failure-rate",
            "1",
            "--provider-seed",
            str(seed_for(lambda r: r[1] >= 0.5 > r[3], draws=4)),
        ),
        *("--request-timeout", f"{REQUEST_TIMEOUT:g}", "--sweep-every", f"{SWEEP_EVERY:g}"),
    )
    with run_demo(tmp_path / "data", *flags, database_url=database_url) as demo:
        charged_key, charged = new_key(), f"charged-{new_key()}"
        lost_key, lost = new_key(), f"lost-{new_key()}"
        for key, customer in ((charged_key, charged), (lost_key, lost)):
            failed = post(demo, key, body_for(customer))
            assert_problem(failed, 503, "provider-unavailable")
        assert len(charges_for(demo, charged)) == 1  # "timed out after charging"
        assert charges_for(demo, lost) == []  # "unreachable": never charged

        # Told 503: nothing is recorded, as far as the client can see.
        with demo.client(headers=ALICE) as client:
            assert client.get("/payments").json()["payments"] == []
            for payment_id, status, _ in payment_rows(demo, charged) + payment_rows(demo, lost):
                assert status == "pending"
                assert_problem(client.get(f"/payments/{payment_id}"), 404, "not-found")

        # Nobody retries. The sweeper reconciles both intents by itself.
        def settled() -> bool | None:
            done = (key_state(demo, charged_key) or ())[:2] == ("completed", 201)
            forgotten = key_state(demo, lost_key) == ("released", None, None)
            return True if done and forgotten else None

        poll("both abandoned intents resolved", settled, within=SETTLE_WITHIN)
        (charge,) = charges_for(demo, charged)
        ((payment_id, status, charge_id),) = payment_rows(demo, charged)
        assert (status, charge_id) == ("succeeded", charge["id"])
        assert payment_rows(demo, lost) == []

        replay = post(demo, charged_key, body_for(charged))
        assert replay.status_code == 201
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json() == {
            **body_for(charged),
            "id": payment_id,
            "status": "succeeded",
            "charge_id": charge["id"],
        }
        with demo.client(headers=ALICE) as client:
            assert [p["id"] for p in client.get("/payments").json()["payments"]] == [payment_id]
            assert client.get(f"/payments/{payment_id}").status_code == 200
        assert len(charges_for(demo, charged)) == 1


# --- graceful shutdown ----------------------------------------------------------------------


def claimed(demo: Demo, key: str) -> bool | None:
    state = key_state(demo, key)
    return True if state is not None and state[0] == "in_progress" else None


def test_sigterm_during_a_slow_request_lets_it_finish(tmp_path: Path) -> None:
    """A 3 s provider call under a 5 s request timeout: SIGTERM mid-call, the 201 still comes.

    3 s leave the test room to see the claim and signal while the call runs;
    the 2 s more of timeout keep a loaded machine's slow call from timing out.
    """
    flags = ("--provider-latency-ms", "3000", "--request-timeout", "5", "--sweep-every", "off")
    with run_demo(tmp_path / "data", *flags) as demo:
        key, customer = new_key(), f"slow-{new_key()}"
        answers: list[httpx.Response | BaseException] = []
        signalled = threading.Event()
        answered_after_signal: list[bool] = []

        def send() -> None:
            try:
                answers.append(post(demo, key, body_for(customer)))
            except httpx.HTTPError as exc:
                answers.append(exc)
            answered_after_signal.append(signalled.is_set())

        sender = threading.Thread(target=send)
        sender.start()
        poll("the claim", lambda: claimed(demo, key), within=10, every=0.05)
        signalled.set()
        demo.process.send_signal(signal.SIGTERM)
        sender.join(30)
        assert demo.process.wait(30) == -signal.SIGTERM
        # The request was still running when SIGTERM came: else this proves nothing.
        assert answered_after_signal == [True]
        (answer,) = answers
        assert isinstance(answer, httpx.Response), answer
        assert answer.status_code == 201, answer.text
        assert (key_state(demo, key) or ())[:2] == ("completed", 201)
        ((payment_id, status, _),) = payment_rows(demo, customer)
        assert (payment_id, status) == (answer.json()["id"], "succeeded")
