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
from dataclasses import dataclass, field
from pathlib import Path

from tests.backends import redis_client
from tests.conftest import unreachable
from tests.factories import free_port
from tests.faults import freeze_process

__all__ = [
    "PERSISTENT",
    "VOLATILE",
    "RedisServer",
    "freeze",
    "own_redis_server",
    "thaw",
    "wait_until_drained",
]


#: A server that keeps what it acknowledged across a SIGKILL: an AOF fsynced at every write.
PERSISTENT = ("--save", "", "--appendonly", "yes", "--appendfsync", "always")
#: A server that keeps nothing on disk: a restart empties it.
VOLATILE = ("--save", "", "--appendonly", "no")


@dataclass
class RedisServer:
    """A private ``binary`` (redis-server, valkey-server) on a fixed port and directory,
    which a test may stop (SIGTERM: its shutdown runs), kill (SIGKILL: nothing runs) and
    start again."""

    binary: str
    directory: Path
    options: tuple[str, ...]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it answers PING (its data loaded)."""
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--dir", str(self.directory), *self.options]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        _wait_for_ping(self.url, self.process)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


def _wait_for_ping(url: str, process: subprocess.Popen[bytes], seconds: float = 20.0) -> None:
    import redis

    client = redis_client(url)
    deadline = time.monotonic() + seconds
    try:
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                assert process.poll() is None, "the server exited at start"
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.05)
    finally:
        client.close()


@contextlib.contextmanager
def own_redis_server(directory: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A redis-server of our own on a free loopback port, so we may stop it."""
    if shutil.which("redis-server") is None:
        unreachable("redis-server", FileNotFoundError("redis-server"))
    server = RedisServer("redis-server", directory, VOLATILE)
    server.start()
    assert server.process is not None
    process = server.process
    try:
        yield process, server.url
    finally:
        thaw(process)  # a frozen server would never act on SIGTERM
        server.stop()


def freeze(process: subprocess.Popen[bytes]) -> None:
    """Stop ``process`` (SIGSTOP): it hangs, never refuses. :func:`own_redis_server` resumes
    it in any case when it ends, before stopping it."""
    freeze_process(process.pid)


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
    redis-py drops a connection that timed out.) Run it off the loop
    (``asyncio.to_thread``): a socket the client closed is closed at the loop's next turn.
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
