"""
A redis-server of the test's own, on a free loopback port, which the test may stop or freeze.

Frozen (SIGSTOP) it is a *hung* server: the kernel still accepts its connections
and buffers what clients send, but nothing answers until SIGCONT, when it runs
whatever was buffered, also for clients that gave up waiting. The shared Redis
on 6379 is never touched; the server is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.backends import redis_client
from tests.conftest import unreachable
from tests.factories import free_port

__all__ = ["PersistentRedis", "freeze", "own_redis_server", "thaw", "wait_until_drained"]


class PersistentRedis:
    """A redis-server of the test's own that keeps its data: an AOF fsynced at every write.

    :meth:`stop` SIGKILLs it (no shutdown, no last flush) and :meth:`start` starts it
    again on the same port and directory, where it reloads the AOF: what it had
    acknowledged is still there. Use it as a context manager: running inside, stopped
    after.
    """

    def __init__(self, directory: Path) -> None:
        if shutil.which("redis-server") is None:
            unreachable("redis-server", FileNotFoundError("redis-server"))
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait until it answers PING (its AOF loaded)."""
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        command += ["--dir", str(self.directory)]
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        _wait_for_ping(self.url)

    def stop(self) -> None:
        """SIGKILL, by its PID, and reap it."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None

    def __enter__(self) -> PersistentRedis:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _wait_for_ping(url: str, seconds: float = 10.0) -> None:
    import redis

    client = redis_client(url)
    deadline = time.monotonic() + seconds
    try:
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        client.close()


@contextlib.contextmanager
def own_redis_server(directory: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A redis-server of our own on a free loopback port, so we may stop it."""
    if shutil.which("redis-server") is None:
        unreachable("redis-server", FileNotFoundError("redis-server"))
    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    command += ["--appendonly", "no", "--dir", str(directory)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for_ping(url)
        yield process, url
    finally:
        thaw(process)  # a frozen server would never act on SIGTERM
        process.terminate()
        process.wait(timeout=10)


def freeze(process: subprocess.Popen[bytes]) -> None:
    """Stop ``process`` (SIGSTOP): it hangs, never refuses. :func:`own_redis_server` resumes
    it in any case when it ends, before stopping it."""
    os.kill(process.pid, signal.SIGSTOP)


def thaw(process: subprocess.Popen[bytes]) -> None:
    """Resume ``process`` (SIGCONT): it runs what its clients sent while it was frozen."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)


def wait_until_drained(url: str, timeout: float = 10.0) -> None:
    """Once thawed: wait until the server has run all it was sent while frozen.

    Every client that gave up on it closed its connection, and Redis frees a
    connection only once it has read, and run, what came before its end; the
    reconnections made while it was frozen sit in its backlog until it accepts
    them. So it has drained when this connection, accepted after all of them, is
    the only one left. (The stores here keep none open after a call that failed:
    redis-py drops a connection that timed out.)
    """
    client = redis_client(url)
    try:
        deadline = time.monotonic() + timeout
        while len(client.client_list()) > 1:
            if time.monotonic() > deadline:
                raise AssertionError(f"redis never drained: {client.client_list()}")
            time.sleep(0.01)
    finally:
        client.close()
