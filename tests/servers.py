"""A real server process on a loopback socket the test binds itself (no port race)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import httpx

#: How long a server may take to answer ``/healthz`` on a loaded machine.
STARTUP_SECONDS = 30


@contextlib.contextmanager
def serve_on_socket(
    command: Callable[[int], list[str]],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    backlog: int = 64,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``command(fd)`` (a server told to serve on the inherited socket ``fd``) and
    yield its URL and process once ``/healthz`` answers 200; its output goes to ``log``
    (appended). At the end it is stopped: SIGTERM, SIGKILL after 15 s."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    sock.set_inheritable(True)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with log.open("ab") as output:
        process = subprocess.Popen(
            command(sock.fileno()),
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=output,
            stderr=subprocess.STDOUT,
            pass_fds=[sock.fileno()],
        )
    try:
        wait_until_healthy(url, process, log)
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        sock.close()


def wait_until_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Poll ``url``'s ``/healthz`` until 200, the process dies, or the deadline passes."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            # verify=False: plain HTTP; the default loads the CA bundle (~40 ms) per call.
            if httpx.get(url + "/healthz", timeout=2, verify=False).status_code == 200:
                return
        time.sleep(0.05)  # polling the server's health, with a deadline
    raise AssertionError(f"the server did not start:\n{log.read_text()}")
