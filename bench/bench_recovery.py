"""
How soon a crashed claim ends, and how often a client honouring ``Retry-After`` asks meanwhile.

Run::

    .venv/bin/python -m bench.bench_recovery [--timeout 10] [--trials 3]

Each trial starts a middleware-mode Starlette app under uvicorn (its own
process, SQLite key store, the crash test's own app
``tests/http/middleware_crash_app.py``), sends a request whose
endpoint writes and then waits, and SIGKILLs the server mid-handler: the claim
stays ``in_progress``. The app is started again with a background sweeper at
the library's default interval, and one client posts the same key, sleeping
for each 409's ``Retry-After``, until it gets its 201. Measured per trial:

- **ended after threshold**: from the claim's stale deadline (``updated_at +
  stale_after``) to the moment the sweeper released it (this process polls the
  key file every 20 ms): what the sweep interval adds;
- **requests**: how many the client sent until its 201, the 201 included;
- **client waited**: from the kill to the 201.

The figures depend on where the crash falls in the sweeper's beat, so the
trials restart the app after delays spread evenly over one request timeout
(the old default interval), the same delays for every checkout. To measure
the code of another checkout (e.g. main before a change), point
``PYTHONPATH`` at its ``src``: the app imports ``idemflow`` from there, this
process only speaks HTTP and reads the SQLite file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Trial:
    ended_after_threshold: float
    requests: int
    client_waited: float
    hints: tuple[int, ...]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def _server(
    directory: Path, timeout: float, *, sweep: bool
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    command = [sys.executable, "-m", "uvicorn", "tests.http.middleware_crash_app:app"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "CRASH_APP_DIR": str(directory), "CRASH_APP_TIMEOUT": str(timeout)}
    if sweep:
        env["CRASH_APP_SWEEP"] = "default"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    process = subprocess.Popen(command, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                httpx.get(url + "/", timeout=1)
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the app did not start")
            time.sleep(0.05)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def _post(url: str, key: str, **headers: str) -> httpx.Response:
    return httpx.post(url + "/things", headers={"idempotency-key": key, **headers}, timeout=30)


def _record(directory: Path) -> tuple[str, float] | None:
    """State and ``updated_at`` (epoch seconds) of the one key, read from the SQLite file."""
    with contextlib.closing(sqlite3.connect(directory / "keys.db", timeout=5)) as conn:
        row = conn.execute("SELECT state, updated_at FROM idemflow_keys").fetchone()
    return None if row is None else (str(row[0]), row[1] / 1000)


def _wrote(directory: Path) -> bool:
    path = directory / "business.db"
    if not path.exists():
        return False
    with contextlib.closing(sqlite3.connect(path, timeout=5)) as conn:
        return conn.execute("SELECT count(*) FROM things").fetchone()[0] > 0


def trial(timeout: float, stale_after: float, restart_after: float) -> Trial:
    with tempfile.TemporaryDirectory(prefix="idemflow-recovery-") as name:
        directory = Path(name)
        with _server(directory, timeout, sweep=False) as (url, process):
            slow = threading.Thread(target=_quiet_post, args=(url,), daemon=True)
            slow.start()
            deadline = time.monotonic() + 20
            while not _wrote(directory):
                if time.monotonic() > deadline:
                    raise RuntimeError("the endpoint never ran")
                time.sleep(0.02)
            process.send_signal(signal.SIGKILL)
            process.wait(10)
            killed = time.time()
        record = _record(directory)
        if record is None or record[0] != "in_progress":
            raise RuntimeError(f"the crash left {record!r}, not a claim")
        stale_at = record[1] + stale_after
        released: list[float] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                with contextlib.suppress(sqlite3.OperationalError):
                    now = _record(directory)
                    if now is not None and now[0] != "in_progress":
                        released.append(time.time())
                        return
                stop.wait(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        time.sleep(restart_after)  # where the crash falls in the restarted sweeper's beat
        with _server(directory, timeout, sweep=True) as (url, _):
            hints: list[int] = []
            while True:
                answer = _post(url, "k-1")
                if answer.status_code != 409:
                    break
                hints.append(int(answer.headers["retry-after"]))
                time.sleep(hints[-1])  # the client honours Retry-After
            done = time.time()
        stop.set()
        watcher.join(5)
        assert answer.status_code == 201, answer.text
        ended = (released[0] if released else done) - stale_at
        return Trial(ended, len(hints) + 1, done - killed, tuple(hints))


def _quiet_post(url: str) -> None:
    with contextlib.suppress(httpx.TransportError):
        _post(url, "k-1", **{"x-slow": "600"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="request timeout, s")
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    stale_after = 2 * args.timeout + 10  # the policy's default threshold
    # The same restart delays for every checkout measured: spread over one old
    # sweep interval (the timeout), so each trial meets the beat elsewhere.
    delays = [args.timeout * (n + 0.5) / args.trials for n in range(args.trials)]
    trials = [trial(args.timeout, stale_after, delay) for delay in delays]
    print(f"request timeout {args.timeout:g} s, stale threshold {stale_after:g} s")
    print(
        "| trial | ended after threshold, s | requests until 201 | client waited, s "
        "| Retry-After hints |"
    )
    print("| ---: | ---: | ---: | ---: | --- |")
    for number, one in enumerate(trials, 1):
        hints = ", ".join(map(str, one.hints))
        print(
            f"| {number} | {one.ended_after_threshold:.1f} | {one.requests} | "
            f"{one.client_waited:.1f} | {hints} |"
        )
    print(
        f"| median | {statistics.median(t.ended_after_threshold for t in trials):.1f} | "
        f"{statistics.median(t.requests for t in trials):g} | "
        f"{statistics.median(t.client_waited for t in trials):.1f} | |"
    )


if __name__ == "__main__":
    main()
