"""
The demo's HTTP contract, one rule per test, through the real server on SQLite.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import httpx
import pytest

from tests.http.conftest import (
    ALICE,
    BOB,
    CONTROL_KEYS,
    MALFORMED_KEYS,
    PAYMENT,
    Demo,
    assert_problem,
    new_key,
)
from tests.http.rawhttp import post_chunks, post_declaring, send_partial

pytestmark = pytest.mark.timeout(120)


def post_payment(
    demo: Demo, key: str | None, body: object = PAYMENT, headers: dict[str, str] = ALICE
) -> httpx.Response:
    sent = dict(headers)
    if key is not None:
        sent["Idempotency-Key"] = key
    with demo.client() as client:
        return client.post("/payments", json=body, headers=sent)


def test_a_first_charge_answers_201_with_location_and_the_payment(demo: Demo) -> None:
    response = post_payment(demo, new_key())
    assert response.status_code == 201
    body = response.json()
    assert set(body) == {"id", "amount", "currency", "customer", "status", "charge_id"}
    assert body["status"] == "succeeded"
    assert (body["amount"], body["currency"], body["customer"]) == (1000, "EUR", "ada")
    assert body["charge_id"].startswith("ch_")
    assert response.headers["location"] == f"/payments/{body['id']}"
    assert response.headers["x-request-id"]


def test_a_completed_key_replays_status_body_and_headers_with_the_replay_marker(
    demo: Demo,
) -> None:
    key = new_key()
    first = post_payment(demo, key)
    again = post_payment(demo, key)
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["location"] == first.headers["location"]
    assert again.headers["content-type"] == "application/json"
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    charges = [c for c in demo.charges() if c["id"] == first.json()["charge_id"]]
    assert len(charges) == 1


def test_a_replay_links_to_the_original_requests_correlation_id(demo: Demo) -> None:
    key = new_key()
    first = post_payment(demo, key, headers={**ALICE, "X-Request-Id": "support-case-42"})
    assert first.headers["x-request-id"] == "support-case-42"
    again = post_payment(demo, key)
    assert again.headers["idempotency-original-request-id"] == "support-case-42"
    assert again.headers["x-request-id"] not in ("", "support-case-42")


def test_a_missing_key_is_400_and_nothing_is_recorded(demo: Demo) -> None:
    before = demo.query("SELECT count(*) FROM payments")[0][0]
    response = post_payment(demo, None)
    assert_problem(response, 400, "missing-key")
    assert demo.query("SELECT count(*) FROM payments")[0][0] == before


@pytest.mark.parametrize("lines", [*MALFORMED_KEYS.values(), *CONTROL_KEYS.values()],
                         ids=[*MALFORMED_KEYS, *CONTROL_KEYS])  # fmt: skip
def test_a_malformed_key_is_400_and_nothing_is_recorded(
    demo: Demo, lines: tuple[bytes, ...]
) -> None:
    """Every malformed key of the table the WSGI doors are held to too (tests/http/conftest)."""
    before = demo.query("SELECT count(*) FROM idemflow_keys")[0][0]
    with demo.client() as client:
        # Bytes, so that a key httpx could not encode as ASCII still goes out as sent.
        headers = [(name.encode(), value.encode()) for name, value in ALICE.items()]
        headers += [(b"Idempotency-Key", line) for line in lines]
        response = client.post("/payments", json=PAYMENT, headers=headers)
    assert_problem(response, 400, "invalid-key")
    assert demo.query("SELECT count(*) FROM idemflow_keys")[0][0] == before


def test_an_invalid_body_is_400_and_not_recorded_so_the_key_stays_usable(demo: Demo) -> None:
    key = new_key()
    for bad in (
        {"amount": 0, "currency": "EUR", "customer": "ada"},
        {"amount": 10, "currency": "euro", "customer": "ada"},
        {"amount": 10, "currency": "EUR", "customer": ""},
        {"amount": True, "currency": "EUR", "customer": "ada"},
        {"amount": 10, "currency": "EUR"},
        [1, 2],
    ):
        assert_problem(post_payment(demo, key, body=bad), 400, "invalid-body")
    assert demo.key_rows("alice", key) == []
    assert post_payment(demo, key).status_code == 201


def test_a_missing_or_unknown_token_is_401_and_not_recorded(demo: Demo) -> None:
    key = new_key()
    assert_problem(post_payment(demo, key, headers={}), 401)
    assert_problem(post_payment(demo, key, headers={"Authorization": "Bearer nope"}), 401)
    with demo.client() as client:
        assert_problem(client.get("/payments"), 401)
    assert demo.query("SELECT count(*) FROM idemflow_keys WHERE idempotency_key = ?", key) == [(0,)]


def test_the_same_key_with_a_different_body_is_422(demo: Demo) -> None:
    key = new_key()
    assert post_payment(demo, key).status_code == 201
    problem = assert_problem(post_payment(demo, key, body={**PAYMENT, "amount": 2}), 422)
    assert problem["type"].endswith("/key-reused")


def test_a_key_used_on_payments_and_reused_on_refunds_is_422(demo: Demo) -> None:
    key = new_key()
    payment = post_payment(demo, key).json()
    with demo.client() as client:
        response = client.post(
            f"/payments/{payment['id']}/refunds",
            json={"amount": 100},
            headers={**ALICE, "Idempotency-Key": key},
        )
    assert_problem(response, 422, "key-reused")


def test_a_refund_is_idempotent_too(demo: Demo) -> None:
    payment = post_payment(demo, new_key()).json()
    key = new_key()
    with demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        first = client.post(f"/payments/{payment['id']}/refunds", json={"amount": 400})
        again = client.post(f"/payments/{payment['id']}/refunds", json={"amount": 400})
        too_much = client.post(
            f"/payments/{payment['id']}/refunds",
            json={"amount": 700},
            headers={"Idempotency-Key": new_key()},
        )
    assert first.status_code == 201
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert_problem(too_much, 400, "refund-not-possible")
    refunds = demo.query("SELECT amount FROM refunds WHERE payment_id = ?", payment["id"])
    assert refunds == [(400,)]


def test_a_declined_customer_is_402_stored_as_failed_permanent_and_replayed(demo: Demo) -> None:
    key = new_key()
    body = {**PAYMENT, "customer": "declined-card"}
    first = post_payment(demo, key, body=body)
    assert_problem(first, 402, "payment-declined")
    again = post_payment(demo, key, body=body)
    assert again.status_code == 402
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert demo.key_rows("alice", key) == [("failed_permanent", 402)]


def test_get_head_and_options_ignore_the_idempotency_key(demo: Demo) -> None:
    with demo.client(headers={**ALICE, "Idempotency-Key": "not,valid"}) as client:
        assert client.get("/payments").status_code == 200
        assert client.head("/payments").status_code == 200
        assert client.get("/healthz").status_code == 200
        options = client.options("/payments")
    assert options.status_code != 400
    assert demo.query("SELECT count(*) FROM idemflow_keys WHERE idempotency_key = 'not,valid'") == [
        (0,)
    ]


def test_payments_are_listed_and_read_only_by_their_principal(demo: Demo) -> None:
    payment = post_payment(demo, new_key()).json()
    with demo.client(headers=ALICE) as alice, demo.client(headers=BOB) as bob:
        assert alice.get(f"/payments/{payment['id']}").json() == payment
        assert payment in alice.get("/payments").json()["payments"]
        assert_problem(bob.get(f"/payments/{payment['id']}"), 404)
        assert payment not in bob.get("/payments").json()["payments"]


def test_the_provider_ledger_shows_charge_downstream_key_amount_and_principal(
    demo: Demo,
) -> None:
    payment = post_payment(demo, new_key()).json()
    (charge,) = [c for c in demo.charges() if c["id"] == payment["charge_id"]]
    assert charge["amount"] == 1000
    assert charge["principal"] == "alice"
    assert charge["downstream_key"].startswith("idemflow-")


def test_metrics_count_every_outcome_by_endpoint(demo: Demo) -> None:
    post_payment(demo, new_key())
    with demo.client() as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    for outcome in (
        "claimed",
        "replayed",
        "in_progress_conflict",
        "fingerprint_mismatch",
        "released",
        "stale_reclaimed",
    ):
        assert (
            f'idemflow_requests_total{{endpoint="POST /payments",outcome="{outcome}"}}'
            in response.text
        )
    assert 'idemflow_stale_in_progress{state="in_progress"} 0.0' in response.text


def test_unknown_routes_answer_problems_too(demo: Demo) -> None:
    with demo.client(headers=ALICE) as client:
        assert_problem(client.get("/nowhere"), 404)
        assert_problem(client.delete("/payments"), 405)


def test_the_printed_curl_lines_show_a_charge_a_replay_and_a_422(demo: Demo) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    lines = [line.strip() for line in demo.banner if line.strip().startswith("curl -i")]
    assert len(lines) == 3
    heads = []
    for line in lines:
        out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, check=True)
        heads.append(out.stdout.lower())
    assert heads[0].startswith("http/1.1 201")
    assert heads[1].startswith("http/1.1 201")
    assert "idempotent-replayed: true" in heads[1]
    assert heads[2].startswith("http/1.1 422")
    assert json.loads(heads[2].split("\n\n", 1)[1])["status"] == 422


def test_the_same_refund_key_on_another_payment_is_422_not_a_replay(demo: Demo) -> None:
    first = post_payment(demo, new_key()).json()
    second = post_payment(demo, new_key()).json()
    key = new_key()
    with demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        assert (
            client.post(f"/payments/{first['id']}/refunds", json={"amount": 1}).status_code == 201
        )
        other = client.post(f"/payments/{second['id']}/refunds", json={"amount": 1})
    assert_problem(other, 422, "key-reused")


# --- bad input is a 400 (or 413) problem, never a 500, and nothing is recorded (issue 9) ----


def unrecorded(demo: Demo, key: str, payments_before: int) -> bool:
    payments = demo.query("SELECT count(*) FROM payments")[0][0]
    return demo.key_rows("alice", key) == [] and payments == payments_before


def payment_count(demo: Demo) -> int:
    return int(demo.query("SELECT count(*) FROM payments")[0][0])


def test_10000_deep_json_is_400_and_not_recorded(demo: Demo) -> None:
    """Defect 12: json.loads raised RecursionError, answered 500."""
    key, before = new_key(), payment_count(demo)
    body = b"[" * 10_000 + b"]" * 10_000
    with demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        response = client.post("/payments", content=body, headers={"Content-Type": "text/plain"})
        nested = client.post(
            "/payments",
            content=b'{"amount":' * 10_000 + b"1" + b"}" * 10_000,
            headers={"Content-Type": "application/json"},
        )
    assert_problem(response, 400, "invalid-body")
    assert_problem(nested, 400, "invalid-body")
    assert unrecorded(demo, key, before)


@pytest.mark.parametrize(
    ("customer", "content_type"),
    [
        ("\\ud800", "text/plain"),  # a lone surrogate, escaped: the database cannot encode it
        ("\\udfff ada", "application/octet-stream"),
        ("ada\\u0000", "application/json"),  # NUL: PostgreSQL refuses it
        ("ada\\u0007bell", "application/json"),
        ("line\\nbreak", "application/json"),
    ],
)
def test_unstorable_text_in_customer_is_400_and_not_recorded(
    demo: Demo, customer: str, content_type: str
) -> None:
    """Defect 12: these reached the INSERT (500, or a NUL stored)."""
    key, before = new_key(), payment_count(demo)
    body = ('{"amount": 1000, "currency": "EUR", "customer": "' + customer + '"}').encode()
    with demo.client(headers={**ALICE, "Idempotency-Key": key}) as client:
        response = client.post("/payments", content=body, headers={"Content-Type": content_type})
    assert_problem(response, 400, "invalid-body")
    assert unrecorded(demo, key, before)


@pytest.mark.parametrize("path", ["/payments", "/provider/charges"])
@pytest.mark.parametrize("limit", ["\u00b2", "\u2460", "9" * 5000, "0", "-1", "ten", ""])
def test_a_limit_that_is_not_a_count_is_400(demo: Demo, path: str, limit: str) -> None:
    """Defect 12: str.isdigit() accepts '²' and '①', which int() refuses (500)."""
    with demo.client(headers=ALICE) as client:
        response = client.get(path, params={"limit": limit})
    body = assert_problem(response, 400, "invalid-query")
    assert "limit" in body["detail"]


@pytest.mark.parametrize("path", ["/payments", "/provider/charges"])
def test_a_limit_is_still_read_and_capped(demo: Demo, path: str) -> None:
    with demo.client(headers=ALICE) as client:
        assert client.get(path, params={"limit": "1"}).status_code == 200
        assert client.get(path, params={"limit": "999999999"}).status_code == 200


def test_a_declared_body_over_the_cap_is_413_at_once_and_not_recorded(demo: Demo) -> None:
    """Defect 12: a 100 MB body was read whole (286 MiB of RSS) before its 400."""
    key, before = new_key(), payment_count(demo)
    headers = {**ALICE, "Idempotency-Key": key, "Content-Type": "application/json"}
    response = post_declaring(demo.url, "/payments", headers, length=100_000_000)
    assert response.status == 413
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"].endswith("/body-too-large")
    assert unrecorded(demo, key, before)


def test_a_streamed_body_over_the_cap_is_413_while_it_streams(demo: Demo) -> None:
    key, before = new_key(), payment_count(demo)
    headers = {**ALICE, "Idempotency-Key": key, "Content-Type": "application/json"}
    chunks = [b" " * 65_536] * 17  # 1 MiB + 64 KiB, the body never finished
    response = post_chunks(demo.url, "/payments", headers, chunks, finish=False)
    assert response.status == 413
    assert response.json()["type"].endswith("/body-too-large")
    assert unrecorded(demo, key, before)


def test_a_body_cut_short_is_not_run_recorded_or_logged_and_the_retry_charges_once(
    demo: Demo,
) -> None:
    """Defects 4 and 15: a mid-body disconnect logged an "unhandled" traceback."""
    key, before = new_key(), payment_count(demo)
    body = json.dumps(PAYMENT).encode()
    log_start = demo.log.stat().st_size
    headers = {**ALICE, "Idempotency-Key": key, "Content-Type": "application/json"}
    send_partial(demo.url, "/payments", headers, declared=len(body), sent=body[:9])
    assert unrecorded(demo, key, before)
    retry = post_payment(demo, key)  # after the server closed the first connection
    assert retry.status_code == 201
    assert payment_count(demo) == before + 1
    assert demo.key_rows("alice", key) == [("completed", 201)]
    with demo.log.open() as log:
        log.seek(log_start)
        written = log.read()
    assert "unhandled" not in written
    assert "Traceback" not in written


def test_an_unauthenticated_request_is_the_documented_401_problem(demo: Demo) -> None:
    """Defect 15: docs/http.md says missing-principal; the demo answered 'unauthenticated'."""
    response = post_payment(demo, new_key(), headers={})
    body = assert_problem(response, 401, "missing-principal")
    assert body["title"] == "Authentication required"
    assert response.headers["www-authenticate"].startswith("Bearer")
