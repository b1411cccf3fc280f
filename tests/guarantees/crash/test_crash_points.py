"""
A server killed (SIGKILL) at each crash point of a payment charges once, and says so forever.

Each test starts the demo with ``IDEMFLOW_DEMO_CRASH_AT`` set, sends one
payment and sees the connection drop as the process kills itself. It then
restarts the demo on the same database and port, without the variable, and
retries as a client would: honouring 409 + ``Retry-After`` until the demo's
background sweeper has resolved the crashed claim. The request timeout is 1 s,
so the stale threshold is 2 × 1 s + 10 s = 12 s.

Most scenarios wait out that threshold, so they are *staged*: when the module
starts, one background thread crashes and restarts each selected scenario's demo
in turn (one at a time, so each restart follows its own crash as closely as when
it ran alone, well before the threshold) and its client starts retrying in a
thread of its own. Each test then takes its scenario's outcome and checks it; the
thresholds run out together instead of one after another.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import selected_in_module
from tests.http.conftest import ALICE, Demo, pg_schema, run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

#: A short request timeout (stale after 12 s), swept twice a second.
FAST_RECOVERY = ("--request-timeout", "1", "--sweep-every", "0.5")
SETTLE_WITHIN = 40.0  # seconds: 12 s threshold + sweeps + restarts on a loaded machine
SETTLED = (201, 402)


@dataclass(frozen=True)
class Crash:
    """One scenario: where the server dies, and how the sweeper must resolve the claim."""

    point: str
    customer: str
    status: int
    #: The stale_reclaimed resolution the restarted server reports (None: nothing to sweep).
    resolution: str | None
    #: Is the first answer after the restart a replay (the record was settled for us)?
    replayed: bool


CRASHES = [
    # The claim committed, nothing else: the reconciler finds no payment row,
    # the sweeper releases the key, the retry charges for the first time.
    Crash("after_claim", "ada", 201, "released", replayed=False),
    # The provider charged; the local commit never happened: the reconciler
    # finds the charge and settles the record with the success response.
    Crash("after_charge", "ada", 201, "completed", replayed=True),
    # Everything committed, the response was lost: the retry replays it.
    Crash("after_commit", "ada", 201, None, replayed=True),
]
DECLINED = Crash("after_charge", "declined-ada", 402, "completed", replayed=True)


@dataclass
class Attempts:
    """What a retrying client saw until the key settled."""

    final: httpx.Response
    conflicts: int = 0
    errors: int = 0


def post(client: httpx.Client, key: str, body: dict[str, Any]) -> httpx.Response:
    return client.post("/payments", json=body, headers={**ALICE, "Idempotency-Key": key})


def retry_until_settled(demo: Demo, key: str, body: dict[str, Any]) -> Attempts:
    """Retry like a well-behaved client: sleep Retry-After on 409/503, back off on errors."""
    conflicts = errors = 0
    deadline = time.monotonic() + SETTLE_WITHIN
    with demo.client() as client:
        while time.monotonic() < deadline:
            try:
                response = post(client, key, body)
            except httpx.TransportError:
                errors += 1
                time.sleep(0.2)
                continue
            if response.status_code in SETTLED:
                return Attempts(response, conflicts, errors)
            assert response.status_code in (409, 503), response.text
            conflicts += response.status_code == 409
            time.sleep(min(float(response.headers.get("retry-after", "1")), 2.0))
    raise AssertionError(f"key {key} still unsettled after {SETTLE_WITHIN:g}s")


def crash_once(
    tmp_path: Path, database_url: str | None, crash: Crash, key: str, body: dict[str, Any]
) -> str:
    """Start a demo that kills itself at ``crash.point``; send the payment; return the port."""
    env = {"IDEMFLOW_DEMO_CRASH_AT": crash.point}  # the restart runs without it
    with run_demo(tmp_path / "data", *FAST_RECOVERY, database_url=database_url, env=env) as doomed:
        with doomed.client() as client, pytest.raises(httpx.TransportError):
            post(client, key, body)
        assert doomed.process.wait(10) == -signal.SIGKILL
        return doomed.url.rsplit(":", 1)[1]


def stale_reclaimed(demo: Demo) -> dict[str, float]:
    with demo.client() as client:
        text = client.get("/metrics").text
    prefix = 'idemflow_stale_reclaimed_total{resolution="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def assert_charged_once(demo: Demo, crash: Crash, body: dict[str, Any], answer: bytes) -> None:
    """One payment row, one provider charge, and the answer names both."""
    rows = demo.query(
        "SELECT id, status, charge_id FROM payments WHERE customer = ?", body["customer"]
    )
    charges = [c for c in demo.charges() if c["customer"] == body["customer"]]
    assert len(rows) == 1, rows
    assert len(charges) == 1, charges
    payment_id, status, charge_id = rows[0]
    assert charge_id == charges[0]["id"]
    assert status == charges[0]["status"] == ("succeeded" if crash.status == 201 else "declined")
    decoded = json.loads(answer)
    assert decoded["charge_id"] == charge_id
    assert decoded.get("payment_id", decoded.get("id")) == payment_id


def assert_same_as_live(demo: Demo, final: httpx.Response) -> None:
    """A 201 is byte for byte what a live success sends: the payment as GET shows it."""
    payment = final.json()
    assert final.headers["location"] == f"/payments/{payment['id']}"
    assert final.headers["content-type"] == "application/json"
    with demo.client(headers=ALICE) as client:
        shown = client.get(final.headers["location"]).json()
    assert final.content == json.dumps(shown, separators=(",", ":")).encode()


@dataclass
class Scenario:
    """One crash, its restarted demo, and its client retrying until the key settles."""

    crash: Crash
    key: str
    body: dict[str, Any]
    demo: Demo
    attempts: Future[Attempts]
    stack: contextlib.ExitStack  # its demo and its database: closed after its test


def stage(crash: Crash, backend: str, tmp_path: Path, retries: ThreadPoolExecutor) -> Scenario:
    """Crash, restart on the same database and port, and start the client's retries."""
    stack = contextlib.ExitStack()
    try:
        database_url = stack.enter_context(pg_schema()) if backend == "postgresql" else None
        key = f"crash-{uuid.uuid4().hex}"
        body = {"amount": 1234, "currency": "EUR", "customer": f"{crash.customer}-{key}"}
        port = crash_once(tmp_path, database_url, crash, key, body)
        demo = stack.enter_context(
            run_demo(tmp_path / "data", *FAST_RECOVERY, "--port", port, database_url=database_url)
        )
    except BaseException:
        stack.close()
        raise
    attempts = retries.submit(retry_until_settled, demo, key, body)
    return Scenario(crash, key, body, demo, attempts, stack)


@dataclass
class Stages:
    """Every selected scenario, staged in test order by one background thread."""

    futures: dict[tuple[Crash, str], Future[Scenario]] = field(default_factory=dict)

    @contextlib.contextmanager
    def take(self, crash: Crash, backend: str) -> Iterator[Scenario]:
        scenario = self.futures[crash, backend].result(timeout=60)
        with scenario.stack:
            yield scenario


def _scenario_of(item: pytest.Item) -> tuple[Crash, str] | None:
    function = getattr(item, "function", None)
    if function is test_a_crash_after_a_declined_charge_replays_the_decline:
        return DECLINED, "sqlite"
    if function is test_a_crash_leaves_one_payment_one_charge_and_one_answer:
        params = item.callspec.params  # type: ignore[attr-defined]
        return params["crash"], params["backend"]
    return None


@pytest.fixture(scope="module")
def stages(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stages]:
    """Only the scenarios selected in this run are staged (``-k``, ``-m 'not postgres'``)."""
    selected = selected_in_module(request, _scenario_of)
    staged = Stages()
    # One stager: a restart that waited behind other demos' start-ups could come
    # after its claim's threshold, and its first retry would not see the 409.
    with ThreadPoolExecutor(1) as stager, ThreadPoolExecutor(max(1, len(selected))) as retries:
        for crash, backend in selected:
            tmp = tmp_path_factory.mktemp(f"{crash.point}-{backend}")
            staged.futures[crash, backend] = stager.submit(stage, crash, backend, tmp, retries)
        try:
            yield staged
        finally:
            for future in staged.futures.values():  # a scenario whose test did not take it
                if not future.cancel() and future.exception() is None:
                    scenario = future.result()
                    with scenario.stack, contextlib.suppress(Exception):
                        scenario.attempts.result()  # its demo stays up for its retries


def check_scenario(scenario: Scenario) -> None:
    crash, key, body, demo = scenario.crash, scenario.key, scenario.body, scenario.demo
    attempts = scenario.attempts.result(timeout=SETTLE_WITHIN + 30)
    later = [retry_until_settled(demo, key, body).final for _ in range(3)]
    final = attempts.final
    assert final.status_code == crash.status, final.text
    assert (final.headers.get("idempotent-replayed") == "true") is crash.replayed
    for again in later:
        assert again.status_code == final.status_code
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == final.content
    assert_charged_once(demo, crash, body, final.content)
    if crash.status == 201:
        assert_same_as_live(demo, final)
    resolutions = stale_reclaimed(demo)
    expected = {"completed": 0.0, "released": 0.0, "unknown": 0.0}
    if crash.resolution is not None:
        expected[crash.resolution] = 1.0
        assert attempts.conflicts > 0  # the key was blocked until the sweeper came
    assert resolutions == expected
    assert demo.key_rows("alice", key) == [
        ("completed" if crash.status == 201 else "failed_permanent", crash.status)
    ]


@pytest.mark.parametrize("crash", CRASHES, ids=[c.point for c in CRASHES])
def test_a_crash_leaves_one_payment_one_charge_and_one_answer(
    stages: Stages, backend: str, crash: Crash
) -> None:
    """Killed after the claim, after the charge, or after the commit: exactly once, same body."""
    with stages.take(crash, backend) as scenario:
        check_scenario(scenario)


def test_a_crash_after_a_declined_charge_replays_the_decline(stages: Stages) -> None:
    """The reconciler settles a declined charge as the same stored 402, and the row as declined."""
    with stages.take(DECLINED, "sqlite") as scenario:
        check_scenario(scenario)
