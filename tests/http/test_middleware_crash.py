"""
Middleware mode, SIGKILL mid-handler: the effect stays, the key stays claimed
until the sweeper (issue 9's per-mode table, the middleware cell).

Middleware mode shares no transaction with the app: when the server dies after
the endpoint's write committed, nothing can roll it back. The claim is left
``in_progress`` (a retry gets 409 + Retry-After, never a second run while it
may still be running); after the stale threshold the sweeper releases it
(no reconciler) and the next retry runs the endpoint again — which is why
effects behind this mode go downstream under a downstream key.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from idemflow import Policy, State
from idemflow.stores.sqlite import SQLiteStore
from idemflow.sweeper import Sweeper
from tests.factories import free_port

pytestmark = pytest.mark.slow
POLICY = Policy(request_timeout=1)  # as the app's


@contextlib.contextmanager
def server(directory: Path, **settings: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", "tests.http.middleware_crash_app:app"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "CRASH_APP_DIR": str(directory), **settings}
    process = subprocess.Popen(command, env=env, cwd=Path(__file__).parents[2])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.TransportError):
                httpx.get(url + "/", timeout=1, verify=False)
                break
            assert process.poll() is None, "the app did not start"
            assert time.monotonic() < deadline, "the app did not start in time"
            time.sleep(0.05)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def things(directory: Path) -> list[str]:
    with contextlib.closing(sqlite3.connect(directory / "business.db")) as conn:
        return [row[0] for row in conn.execute("SELECT key FROM things")]


def _quietly(*call: Any, **kwargs: str) -> None:
    with contextlib.suppress(httpx.TransportError):
        call[0](*call[1:], **kwargs)


def post(url: str, key: str, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/things", headers={"idempotency-key": key, **headers}, timeout=10, verify=False
    )


def crash_mid_handler(directory: Path, key: str = "k-1") -> None:
    """Start the app, let ``key``'s endpoint write, SIGKILL the server while it waits."""
    with server(directory) as (url, process):
        # In flight in a thread of its own: only the kill answers it.
        first = threading.Thread(target=lambda: _quietly(post, url, key, **{"x-slow": "30"}))
        first.start()
        deadline = time.monotonic() + 10
        while things(directory) != [key]:  # the endpoint's write committed
            assert time.monotonic() < deadline, "the endpoint never ran"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        first.join(15)


def test_a_sigkill_mid_handler_stays_claimed_until_the_sweeper(tmp_path: Path) -> None:
    crash_mid_handler(tmp_path)

    store = SQLiteStore(tmp_path / "keys.db")
    try:
        record = store.get("alice", "k-1")
        assert record is not None
        assert record.state is State.IN_PROGRESS  # claimed: nobody may run it again yet

        with server(tmp_path) as (url, _):
            busy = post(url, "k-1")
            assert busy.status_code == 409
            assert busy.headers["retry-after"]
            assert things(tmp_path) == ["k-1"]

            # The sweeper's threshold passes (its clock moved past it; SQLite is a
            # one-host store on the caller's clock): no reconciler, so it releases.
            later = time.time() + POLICY.stale_seconds + 1
            report = Sweeper(store, POLICY, clock=lambda: later).sweep_once()
            assert report.released == 1

            again = post(url, "k-1")
            replay = post(url, "k-1")
    finally:
        store.close()

    assert again.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert things(tmp_path) == ["k-1", "k-1"]  # the effect ran again: not atomic in this mode


def test_a_client_honouring_retry_after_after_a_crash_asks_a_handful_of_times(
    tmp_path: Path,
) -> None:
    """Retry-After says when the crashed claim ends; the app's background sweeper keeps it.

    The claim outlived its 1 s request timeout, so the 409 asks the client to
    come back when the sweeper (default interval) has ended it: threshold
    12 s + one interval. With the old constant ``Retry-After: 1`` a client
    honouring it asked at least 12 times.
    """
    crash_mid_handler(tmp_path)
    with server(tmp_path, CRASH_APP_SWEEP="default") as (url, _):
        answers: list[httpx.Response] = []
        deadline = time.monotonic() + 90
        while not answers or answers[-1].status_code == 409:
            assert time.monotonic() < deadline, [a.headers.get("retry-after") for a in answers]
            if answers:
                # The client under test honours Retry-After: this wait is its behaviour.
                time.sleep(int(answers[-1].headers["retry-after"]))
            answers.append(post(url, "k-1"))

    hints = [int(a.headers["retry-after"]) for a in answers[:-1]]
    assert answers[-1].status_code == 201, answers[-1].text
    assert 1 <= len(hints) <= 5, hints
    assert max(hints) > 1  # derived from the claim's age, not the 1 s constant
    assert sum(hints) <= POLICY.stale_seconds + 2 * POLICY.sweep_interval  # not far past the end
    assert things(tmp_path) == ["k-1", "k-1"]  # swept, then run again (middleware mode)
