"""
idemflow.client against the real demo on 127.0.0.1, watched on the wire.

Every test puts a recording relay (``tests/client/recording.py``) between the
client and the demo: it sees each request as the server receives it, so
"one key per operation" and "never a second body under one key" are checked
on what was actually sent, not on what the client says it did. The provider
fails a quarter of its calls (``--provider-failure-rate 0.25``), so operations
need retries; the kill test SIGKILLs the demo mid-request and restarts it on the
same port while one client call is still retrying.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from idemflow.client import (
    AsyncIdempotentTransport,
    ClientOutcome,
    IdempotentTransport,
    KeyForm,
    RetryPolicy,
    idempotent_session,
    outcome,
)
from idemflow.client._keys import KeyReusedLocally
from tests.client.recording import Recorded, RecordingRelay, recording_relay
from tests.http.conftest import ALICE, Demo, run_demo

#: The flaky demo's provider fails this share of calls, each failure costing its
#: operation a ``Retry-After: 1`` wait: a test lasts about as many seconds as its
#: longest run of failures. A quarter, not a half: that run is ~2.6 calls long
#: over 40 operations, not ~4.4 over 16.
FAILURE_RATE = 0.25
#: Enough operations that some surely meet the failing provider: none does with
#: probability 0.75 ** 40 ≈ 1e-5 (as 0.5 ** 16 did at half the calls failing).
OPERATIONS = 40
#: The demo's 503s say ``Retry-After: 1``; backing off further than that only costs test time.
POLICY = RetryPolicy(max_backoff=1)


@dataclass(frozen=True)
class Final:
    """How one operation ended, as its caller saw it."""

    customer: str
    status: int
    outcome: ClientOutcome


@pytest.fixture(scope="module")
def flaky(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Demo, RecordingRelay]]:
    """The demo with a provider failing a quarter of its calls, behind a recording relay."""
    data = tmp_path_factory.mktemp("flaky") / "data"
    with (
        run_demo(data, "--provider-failure-rate", f"{FAILURE_RATE:g}") as demo,
        recording_relay(port_of(demo.url)) as relay,
    ):
        yield demo, relay


@pytest.fixture(scope="module")
def steady(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Demo, RecordingRelay]]:
    """The demo with a provider that never fails, behind a recording relay."""
    with (
        run_demo(tmp_path_factory.mktemp("steady") / "data") as demo,
        recording_relay(port_of(demo.url)) as relay,
    ):
        yield demo, relay


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def payment(customer: str, amount: int = 1000) -> bytes:
    return json.dumps({"amount": amount, "currency": "EUR", "customer": customer}).encode()


JSON = {**ALICE, "content-type": "application/json"}


def final(customer: str, response: httpx.Response) -> Final:
    found = outcome(response)
    assert found is not None, "the client managed this POST"
    return Final(customer, response.status_code, found)


def run_async_httpx(url: str, customers: Sequence[str]) -> list[Final]:
    async def run() -> list[Final]:
        transport = AsyncIdempotentTransport(policy=POLICY)
        async with httpx.AsyncClient(base_url=url, transport=transport, timeout=30) as client:

            async def one(customer: str) -> Final:
                response = await client.post("/payments", content=payment(customer), headers=JSON)
                return final(customer, response)

            return await asyncio.gather(*(one(c) for c in customers))

    return asyncio.run(run())


def run_sync_httpx(url: str, customers: Sequence[str]) -> list[Final]:
    with httpx.Client(
        base_url=url, transport=IdempotentTransport(policy=POLICY), timeout=30
    ) as client:

        def one(customer: str) -> Final:
            response = client.post("/payments", content=payment(customer), headers=JSON)
            return final(customer, response)

        with ThreadPoolExecutor(len(customers)) as pool:
            return list(pool.map(one, customers))


def run_requests(url: str, customers: Sequence[str]) -> list[Final]:
    def one(customer: str) -> Final:
        # A generator body: the adapter reads it once and sends the same bytes every time.
        body = payment(customer)
        chunks = iter([body[:10], body[10:]])
        with idempotent_session(POLICY) as session:
            response = session.post(f"{url}/payments", data=chunks, headers=JSON, timeout=30)
        found = outcome(response)
        assert found is not None
        return Final(customer, response.status_code, found)

    with ThreadPoolExecutor(len(customers)) as pool:
        return list(pool.map(one, customers))


RUNNERS: dict[str, Callable[[str, Sequence[str]], list[Final]]] = {
    "httpx-async": run_async_httpx,
    "httpx-sync": run_sync_httpx,
    "requests": run_requests,
}


def customer_of(request: Recorded) -> str:
    return str(json.loads(request.body).get("customer"))


def assert_one_key_one_body(sent: Sequence[Recorded], finals: Sequence[Final]) -> None:
    """On the wire: one key per operation, one body per key, and as many attempts as reported."""
    by_customer: defaultdict[str, list[Recorded]] = defaultdict(list)
    for request in sent:
        by_customer[customer_of(request)].append(request)
    for end in finals:
        requests = by_customer[end.customer]
        assert {r.keys for r in requests} == {(end.outcome.key,)}, end  # one key, sent bare
        assert len({r.body for r in requests}) == 1, end  # one body, byte for byte
        assert len(requests) == end.outcome.attempts, end
    by_key: defaultdict[tuple[str, ...], set[bytes]] = defaultdict(set)
    for request in sent:
        by_key[request.keys].add(request.body)
    assert all(len(bodies) == 1 for bodies in by_key.values())


def assert_charged_once(demo: Demo, finals: Sequence[Final]) -> None:
    charges = defaultdict(list)
    for charge in demo.charges():
        charges[charge["customer"]].append(charge)
    for end in finals:
        assert len(charges[end.customer]) == 1, end
        assert demo.key_rows("alice", end.outcome.key) == [("completed", 201)]


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_a_failing_provider_still_charges_every_operation_once(
    flaky: tuple[Demo, RecordingRelay], runner: str
) -> None:
    """Provider failing 25 %: every operation ends 201, charged once, one key, one body."""
    demo, relay = flaky
    customers = [f"client-{runner}-{uuid.uuid4().hex[:8]}-{i}" for i in range(OPERATIONS)]
    finals = RUNNERS[runner](relay.url, customers)
    assert [end.status for end in finals] == [201] * OPERATIONS
    ours = [r for r in relay.requests("/payments") if customer_of(r) in set(customers)]
    assert len(ours) > OPERATIONS  # the provider failed: some operations took several attempts
    assert_one_key_one_body(ours, finals)
    assert_charged_once(demo, finals)
    assert all(not end.outcome.exhausted and end.outcome.status == 201 for end in finals)


def test_a_key_is_never_sent_with_a_second_body(flaky: tuple[Demo, RecordingRelay]) -> None:
    """The caller's key, reused for another body, is refused before it reaches the wire."""
    _, relay = flaky
    key = f'"caller-{uuid.uuid4().hex}"'  # the sf-string form: kept verbatim
    customer = f"reuse-{uuid.uuid4().hex[:8]}"
    headers = {**JSON, "Idempotency-Key": key}
    with httpx.Client(base_url=relay.url, transport=IdempotentTransport(), timeout=30) as client:
        first = client.post("/payments", content=payment(customer), headers=headers)
        assert first.status_code == 201
        again = client.post("/payments", content=payment(customer), headers=headers)
        assert again.status_code == 201
        assert again.headers["idempotent-replayed"] == "true"
        found = outcome(again)
        assert found is not None
        assert found.replayed
        with pytest.raises(KeyReusedLocally, match="different request"):
            client.post("/payments", content=payment(customer, 2500), headers=headers)
    sent = [r for r in relay.requests("/payments") if r.keys == (key,)]
    assert len({r.body for r in sent}) == 1  # the 2500 never left the client
    first_outcome = outcome(first)
    assert first_outcome is not None
    assert len(sent) == first_outcome.attempts + found.attempts


def test_settled_answers_are_sent_once(steady: tuple[Demo, RecordingRelay]) -> None:
    """401, 400 and 422 are answers, not failures: one attempt each, never retried."""
    _, relay = steady
    key = f"settled-{uuid.uuid4().hex}"
    customer = f"settled-{uuid.uuid4().hex[:8]}"

    def send(body: bytes, headers: dict[str, str]) -> httpx.Response:
        # A transport of its own each time: no local ledger stands between us and the 422.
        with httpx.Client(base_url=relay.url, transport=IdempotentTransport()) as client:
            return client.post("/payments", content=body, headers=headers)

    bad_token = {**JSON, "Authorization": "Bearer wrong", "Idempotency-Key": key + "-401"}
    assert send(payment(customer), bad_token).status_code == 401
    invalid = {**JSON, "Idempotency-Key": key + "-400"}
    assert send(b'{"amount": -1}', invalid).status_code == 400
    mine = {**JSON, "Idempotency-Key": key}
    assert send(payment(customer), mine).status_code == 201
    reused = send(payment(customer, 2500), mine)
    assert reused.status_code == 422
    found = outcome(reused)
    assert found is not None
    assert (found.attempts, found.exhausted) == (1, False)
    for suffix in ("-401", "-400"):
        assert len([r for r in relay.requests() if r.keys == (key + suffix,)]) == 1
    assert len([r for r in relay.requests() if r.keys == (key,) and b"2500" in r.body]) == 1


@pytest.mark.parametrize("runner", ["httpx-sync", "requests"])
def test_an_answer_cut_short_is_retried(steady: tuple[Demo, RecordingRelay], runner: str) -> None:
    """The 201 is cut off mid-body, after the server did its work: retried into its replay.

    The transports read the answer whole inside their retry loop, so a cut is
    a lost answer like any other (and not an error the caller meets later).
    """
    demo, relay = steady
    customers = [f"cut-{runner}-{uuid.uuid4().hex[:8]}"]
    cut_before = relay.cut
    relay.cut_answers(1)
    finals = RUNNERS[runner](relay.url, customers)
    assert relay.cut == cut_before + 1
    assert [end.status for end in finals] == [201]
    assert (finals[0].outcome.attempts, finals[0].outcome.replayed) == (2, True)
    ours = [r for r in relay.requests("/payments") if customer_of(r) in customers]
    assert_one_key_one_body(ours, finals)
    assert_charged_once(demo, finals)


def test_a_generated_key_in_the_sf_string_form(steady: tuple[Demo, RecordingRelay]) -> None:
    """KeyForm.SF_STRING: the wire carries "…", the server reads the same key."""
    demo, relay = steady
    customer = f"sf-{uuid.uuid4().hex[:8]}"
    transport = IdempotentTransport(policy=RetryPolicy(key_form=KeyForm.SF_STRING))
    with httpx.Client(base_url=relay.url, transport=transport, timeout=30) as client:
        response = client.post("/payments", content=payment(customer), headers=JSON)
    found = outcome(response)
    assert response.status_code == 201
    assert found is not None
    sent = [r for r in relay.requests("/payments") if customer_of(r) == customer]
    assert {r.keys for r in sent} == {(f'"{found.key}"',)}
    assert demo.key_rows("alice", found.key) == [("completed", 201)]


def test_a_read_timeout_is_retried_until_the_answer_is_replayed(tmp_path: Path) -> None:
    """The answer is late (1.5 s, read timeout 0.5 s): the retry meets 409, then the replay.

    With requests, whose adapter sees the timeout; a GET beside it passes through untouched.
    """
    customer = f"slow-{uuid.uuid4().hex[:8]}"
    with (
        run_demo(tmp_path / "data", "--provider-latency-ms", "1500") as demo,
        recording_relay(port_of(demo.url)) as relay,
    ):
        seen: list[str] = []
        with idempotent_session(POLICY, on_attempt=lambda r: seen.append(r.decision.reason)) as s:
            response = s.post(
                f"{relay.url}/payments", data=payment(customer), headers=JSON, timeout=(5, 0.5)
            )
            listed = s.get(f"{relay.url}/payments", headers=ALICE, timeout=5)
        assert response.status_code == 201, seen
        found = outcome(response)
        assert found is not None
        assert found.replayed
        assert seen[0] == "read timeout"
        assert any(reason.startswith("409") for reason in seen), seen
        assert outcome(listed) is None
        sent = relay.requests("/payments")
        assert [r.method for r in sent] == ["POST"] * found.attempts + ["GET"]
        assert {r.keys for r in sent if r.method == "POST"} == {(found.key,)}
        assert len([c for c in demo.charges() if c["customer"] == customer]) == 1


# --- a server killed mid-request ---------------------------------------------------------------

#: Stale after 2 × 1 s + 10 s, swept twice a second: the orphaned claim resolves in ~13 s.
FAST_RECOVERY = ("--request-timeout", "1", "--sweep-every", "0.5")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_killed_mid_request_charges_once(tmp_path: Path) -> None:
    """SIGKILL after the provider charged, restart on the same port: one call, one charge.

    One ``client.post`` spans it all: the dropped connection, the refused ones
    while the demo is down, the 409s while the orphaned claim waits for the
    sweeper, and the replay of the outcome the sweeper settled.
    """
    customer = f"killed-{uuid.uuid4().hex[:8]}"
    reports: list[str] = []
    policy = RetryPolicy(deadline=60, max_backoff=1)
    transport = IdempotentTransport(policy=policy, on_attempt=lambda r: reports.append(str(r)))
    results: list[httpx.Response | BaseException] = []

    def call(url: str) -> None:
        try:
            with httpx.Client(base_url=url, transport=transport, timeout=30) as client:
                results.append(client.post("/payments", content=payment(customer), headers=JSON))
        except BaseException as exc:  # the test thread asserts on it
            results.append(exc)

    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("IDEMFLOW_DEMO_CRASH_AT", "after_charge")  # the restart runs without it
            with run_demo(tmp_path / "data", *FAST_RECOVERY) as doomed:
                port = port_of(doomed.url)
                relay = stack.enter_context(recording_relay(port))
                caller = threading.Thread(target=call, args=(relay.url,), daemon=True)
                caller.start()
                assert doomed.process.wait(30) == -signal.SIGKILL
        demo = stack.enter_context(run_demo(tmp_path / "data", *FAST_RECOVERY, "--port", str(port)))
        caller.join(90)
        assert not caller.is_alive(), reports
        (response,) = results
        assert isinstance(response, httpx.Response), response
        assert response.status_code == 201, (response.text, reports)
        found = outcome(response)
        assert found is not None
        assert found.replayed  # the sweeper settled it from the provider's charge
        # Attempts refused while the demo was down never reached it; the others did.
        sent = relay.requests("/payments")
        assert 2 < len(sent) <= found.attempts  # the killed one, the 409s, the replay
        assert {r.keys for r in sent} == {(found.key,)}
        assert {r.body for r in sent} == {payment(customer)}
        charges = [c for c in demo.charges() if c["customer"] == customer]
        assert len(charges) == 1
        assert response.json()["charge_id"] == charges[0]["id"]
        assert demo.key_rows("alice", found.key) == [("completed", 201)]
