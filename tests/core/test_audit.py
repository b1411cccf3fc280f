"""
``idemflow audit``: every check passes against the real demo over HTTP, against
idemflow's own Flask integration in process (WSGI), and against a reference
endpoint (ASGI); each deliberately broken variant of the reference fails exactly
the checks its defect breaks (a mutation test of the kit itself).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import pytest

from idemflow.audit import CHECKS, Report, audit
from tests.audit_reference import PRINCIPALS, Reference
from tests.http.conftest import ALICE, BOB, run_demo, serve

ALICE_REF = {"Authorization": "Bearer alice"}
BOB_REF = {"Authorization": "Bearer bob"}
REFERENCE: dict[str, Any] = {
    "headers": ALICE_REF,
    "second_principal_headers": BOB_REF,
    "body": '{"n": {n}}',
    "slow_body": '{"n": {n}, "slow": true}',
}
DEMO_BODY = '{"amount": {n}, "currency": "EUR", "customer": "audit"}'
#: Informational checks: they describe, they never fail.
INFO = {"replay-marked", "errors-are-problem-json", "json-equivalence"}


def verdicts(report: Report) -> dict[str, str]:
    return {check.name: check.result for check in report.checks}


def assert_all_pass(report: Report) -> None:
    assert [check.name for check in report.checks] == list(CHECKS)
    expected = {name: "info" if name in INFO else "pass" for name in CHECKS}
    assert verdicts(report) == expected, report.table()


@pytest.mark.slow  # a real demo, each charge held a second
def test_every_check_passes_against_the_demo_over_http(tmp_path: Path) -> None:
    """The command line against a real ``idemflow demo`` (its provider slowed to 1 s a
    charge, for the in-flight check; its ledger counts executions): every check passes,
    the JSON has the documented shape, the JUnit file has one case per check."""
    junit = tmp_path / "audit.xml"
    with run_demo(tmp_path / "data", "--provider-latency-ms", "1000") as demo:
        done = subprocess.run(
            [
                *(sys.executable, "-m", "idemflow", "audit", f"{demo.url}/payments", "--json"),
                *("--header", f"Authorization: {ALICE['Authorization']}"),
                *("--second-principal-header", f"Authorization: {BOB['Authorization']}"),
                *("--body", DEMO_BODY, "--slow-body", DEMO_BODY),
                *("--count-url", "/provider/charges?limit=100000", "--junit", str(junit)),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    # Before it starts, what it will send and how many requests (on stderr).
    assert "13 checks, at most 82 requests" in done.stderr
    assert "Bearer" not in done.stderr  # credentials are not printed
    report = json.loads(done.stdout)
    assert set(report) == {"target", "checks", "summary"}
    assert report["target"] == f"{demo.url}/payments"
    assert [check["name"] for check in report["checks"]] == list(CHECKS)
    assert all(set(check) == {"name", "result", "detail"} for check in report["checks"])
    results = {check["name"]: check["result"] for check in report["checks"]}
    assert results == {name: "info" if name in INFO else "pass" for name in CHECKS}
    assert report["summary"] == {"pass": len(CHECKS) - len(INFO), "fail": 0, "skip": 0}
    cases = ElementTree.parse(junit).getroot().findall("testcase")
    assert [case.get("name") for case in cases] == list(CHECKS)


@pytest.mark.parametrize("counted", [True, False], ids=["count-url", "answers-only"])
def test_every_check_passes_against_the_reference_endpoint(counted: bool) -> None:
    """The correct reference passes every check, in process over ASGI, with executions
    counted and judged from the answers alone."""
    count: dict[str, Any] = {"count_url": "/count"} if counted else {}
    report = audit("/things", asgi=Reference(), **REFERENCE, **count)

    assert_all_pass(report)


#: Each defect, and the checks it must fail: those, and no other. A check that
#: has nothing to judge once another reported the defect skips, saying which.
MUTANTS: dict[str, tuple[dict[str, Any], set[str]]] = {
    "check-then-act claim": (
        {"atomic_claim": False},
        {"concurrent-duplicates-one-execution", "concurrent-other-bodies-one-success"},
    ),
    "no principal scope": ({"scoped_by_principal": False}, {"principal-isolation"}),
    "409 for a completed key": ({"replays_completed": False}, {"completed-not-409"}),
    "a stored 503 replayed": ({"releases_transient": False}, {"first-request-succeeds"}),
    "a replay re-serialises the body": ({"replays_bytes": False}, {"replay-same-status-and-body"}),
    "no fingerprint": ({"fingerprints": False}, {"key-reuse-other-body-422"}),
}


@pytest.mark.parametrize("counted", [True, False], ids=["count-url", "answers-only"])
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_broken_variant_fails_exactly_its_checks(mutant: str, counted: bool) -> None:
    defect, breaks = MUTANTS[mutant]
    count: dict[str, Any] = {"count_url": "/count"} if counted else {}
    report = audit("/things", asgi=Reference(**defect), **REFERENCE, **count)

    failed = {check.name for check in report.failed}
    assert failed == breaks, report.table()
    skipped = {name for name, result in verdicts(report).items() if result == "skip"}
    assert skipped == (REPLAY_CHECKS if mutant == "409 for a completed key" else set())


#: What looks at a successful replay: nothing to look at when a completed key answers 409.
REPLAY_CHECKS = {"replay-same-status-and-body", "replay-marked"}


def test_a_duplicate_that_overtakes_the_slow_request_is_tried_again() -> None:
    """On a busy server the duplicate may claim before the slow request it follows
    (which then gets the 409): not a held duplicate, so the in-flight check tries
    again with a longer head start, and passes."""
    busy = Reference(first_slow_claim_delay=0.3, downstream_failed_once=True)
    report = audit("/things", asgi=busy, only=["in-flight-409-retry-after"], **REFERENCE)

    assert verdicts(report) == {"in-flight-409-retry-after": "pass"}, report.table()


def flask_app() -> Any:
    """idemflow's own Flask integration on a memory store: a WSGI app."""
    from flask import Flask, request

    from idemflow.integrations.flask import Idempotency
    from idemflow.testing import MemoryStore

    app = Flask(__name__)
    lock, executions = threading.Lock(), [0]
    idempotency = Idempotency(
        app,
        store=MemoryStore(),
        principal=lambda: PRINCIPALS.get(request.headers.get("Authorization", "")),
    )

    @app.post("/things")
    @idempotency.protect
    def create_thing() -> Any:
        value = request.get_json()
        if value.get("slow"):
            time.sleep(1.0)  # the work a slow request does
        with lock:
            executions[0] += 1
        thing = uuid.uuid4().hex
        return {"id": thing, "n": value["n"]}, 201, {"Location": f"/things/{thing}"}

    @app.get("/count")
    def count() -> Any:
        return {"executions": executions[0]}

    return app


def test_every_check_passes_against_idemflow_flask_over_wsgi() -> None:
    """In process over WSGI (each request on a thread of its own): idemflow's Flask
    integration passes every check."""
    report = audit("/things", wsgi=flask_app(), count_url="/count", **REFERENCE)

    assert_all_pass(report)


def idemflow_audit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "idemflow", "audit", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_command_exits_1_on_a_failed_check_and_runs_only_what_is_asked() -> None:
    """``--only``: just those checks run; a failed one makes the exit status 1."""
    with serve(Reference(replays_completed=False)) as url:
        done = idemflow_audit(
            f"{url}/things",
            "--header",
            "Authorization: Bearer alice",
            "--only",
            "completed-not-409,key-reuse-other-body-422",
            "--json",
        )
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert {c["name"]: c["result"] for c in report["checks"]} == {
        "key-reuse-other-body-422": "pass",
        "completed-not-409": "fail",
    }
    assert report["summary"] == {"pass": 1, "fail": 1, "skip": 0}


def test_the_command_table_and_skip() -> None:
    """``--skip`` leaves checks out; without a second principal or a slow request
    their checks are skipped, said so in the table, and the exit status is 0."""
    with serve(Reference()) as url:
        done = idemflow_audit(
            f"{url}/things",
            "--header",
            "Authorization: Bearer alice",
            "--skip",
            "concurrent-duplicates-one-execution",
            "--skip",
            "concurrent-other-bodies-one-success",
        )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()[:-1]}
    assert "concurrent-duplicates-one-execution" not in rows
    assert rows["in-flight-409-retry-after"] == "skip"
    assert rows["principal-isolation"] == "skip"
    assert done.stdout.splitlines()[-1].endswith("6 pass, 0 fail, 2 skip")


def test_a_host_other_than_loopback_needs_yes() -> None:
    """Nothing is sent to a host other than loopback unless ``--yes`` says so."""
    done = idemflow_audit("http://audit.example/payments")

    assert done.returncode == 1
    assert "audit.example is not a loopback address" in done.stderr
    assert "--yes" in done.stderr


def test_an_unknown_check_name_is_refused() -> None:
    done = idemflow_audit("http://127.0.0.1:9/x", "--only", "no-such-check")

    assert done.returncode == 1
    assert "no such check: no-such-check" in done.stderr


def test_without_httpx_the_command_names_the_extra() -> None:
    """httpx missing: one line saying how to install it, no traceback."""
    code = (
        "import sys; sys.modules['httpx'] = None\n"
        "from idemflow.cli import main\n"
        "sys.exit(main(['audit', 'http://127.0.0.1:9/x']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 1
    assert done.stderr.strip() == (
        "idemflow audit: idemflow.audit needs httpx: pip install 'idemflow[client]'"
    )
