"""
A Redis (or Valkey) that loses data: refused at start-up, found out while running.

Restarted without persistence, a server forgets every claim: a request that
claimed before the restart may still be running when its retry finds no
record and runs again. So a store refuses a server that keeps neither an AOF
nor RDB snapshots unless told ``allow_volatile=True``, and while running it
notices a bucket whose epoch key vanished and answers its claims 503 +
``Retry-After`` until the stale threshold has passed. Each test runs a
private ``redis-server`` or ``valkey-server`` of its own, restarted by PID.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from idemflow import (
    ConfigurationError,
    Idempotency,
    LeaseLost,
    Policy,
    Response,
    StoreUnavailable,
)
from idemflow.testing import FrozenClock
from tests._redis_cluster import ClusterUnavailable, valkey_server
from tests.backends import redis_client
from tests.conftest import unreachable
from tests.factories import free_port, intent
from tests.stores._race import Recorder

redis = pytest.importorskip("redis")
from idemflow.stores.redis import RedisStore  # noqa: E402
from idemflow.stores.urls import open_store  # noqa: E402

pytestmark = pytest.mark.redis

POLICY = Policy(request_timeout=5, retention=3600)
CREATED = Response(201, b"created")
VOLATILE = ("--save", "", "--appendonly", "no")


@dataclass
class Server:
    """A private server on a fixed port, which a test may stop and start again."""

    binary: str
    directory: Path
    options: tuple[str, ...]
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--dir", str(self.directory), *self.options]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        client = redis_client(self.url)
        deadline = time.monotonic() + 20
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.exceptions.ConnectionError:
                    assert self.process.poll() is None, "the server exited at start"
                    assert time.monotonic() < deadline, "the server did not answer"
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()


def binary(name: str) -> str:
    if name == "valkey-server":
        try:
            return valkey_server()
        except ClusterUnavailable as exc:
            unreachable("valkey-server", exc)
    if shutil.which(name) is None:
        unreachable(name, FileNotFoundError(name))
    return name


@contextlib.contextmanager
def server(name: str, directory: Path, *options: str) -> Iterator[Server]:
    running = Server(binary(name), directory, options)
    running.start()
    try:
        yield running
    finally:
        running.stop()


SERVERS = ["redis-server", "valkey-server"]


@pytest.mark.parametrize("name", SERVERS)
def test_a_server_without_persistence_is_refused_unless_acknowledged(
    name: str, tmp_path: Path
) -> None:
    """No AOF and no RDB: the first claim refuses the server, the handler never runs.
    ``allow_volatile=True`` (or ``?allow_volatile=1``) accepts it."""
    with server(name, tmp_path, *VOLATILE) as running:
        handler = Recorder()
        refused = RedisStore(redis_client(running.url), prefix="v")
        with pytest.raises(ConfigurationError, match="allow_volatile"):
            Idempotency(refused, POLICY).run(intent(), handler)
        assert handler.calls == []
        assert refused.get("alice", "k-1") is None

        accepted = RedisStore(redis_client(running.url), prefix="v", allow_volatile=True)
        assert not Idempotency(accepted, POLICY).run(intent(), handler).replayed
        by_url: Any = open_store(running.url + "?allow_volatile=1", table="v")
        assert Idempotency(by_url, POLICY).run(intent(), handler).replayed
        assert len(handler.calls) == 1
        for store in (refused, accepted, by_url):
            store.close()


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("redis-server", ("--save", "", "--appendonly", "yes", "--appendfsync", "everysec")),
        ("redis-server", ("--save", "3600 1", "--appendonly", "no")),
        ("valkey-server", ("--save", "", "--appendonly", "yes", "--appendfsync", "always")),
    ],
    ids=["redis-aof", "redis-rdb", "valkey-aof"],
)
def test_a_server_that_persists_is_accepted(
    name: str, options: tuple[str, ...], tmp_path: Path
) -> None:
    """AOF (any fsync policy) or RDB snapshots: the store starts without being told."""
    with server(name, tmp_path, *options) as running:
        store = RedisStore(redis_client(running.url), prefix="p")
        handler = Recorder()
        assert not Idempotency(store, POLICY).run(intent(), handler).replayed
        assert Idempotency(store, POLICY).run(intent(), handler).replayed
        store.close()
    assert len(handler.calls) == 1


@pytest.mark.parametrize("name", SERVERS)
def test_claims_in_flight_across_a_restart_without_persistence_never_run_twice(
    name: str, tmp_path: Path
) -> None:
    """20 requests have claimed and are still running when the server restarts empty.
    Their retries are told 503 + Retry-After (the stale threshold) instead of running
    again beside them; their own completions are lost (LeaseLost: the record is gone).
    Once the threshold has passed, a retry runs: what was settled before a loss is
    lost with it, and no store can save that."""
    clock = FrozenClock()
    keys = [f"k-{n}" for n in range(20)]
    with server(name, tmp_path, *VOLATILE) as running:
        store = RedisStore(
            redis_client(running.url),
            policy=POLICY,
            prefix="lost",
            clock="caller",
            allow_volatile=True,
        )
        idem = Idempotency(store, POLICY, clock=clock)
        release, claimed = threading.Event(), threading.Semaphore(0)
        first: dict[str, str] = {}

        def running_request(key: str) -> None:
            def handler(attempt: Any) -> Response:
                claimed.release()
                assert release.wait(60)
                return CREATED

            try:
                idem.run(intent(key), handler)
                first[key] = "completed"
            except LeaseLost:
                first[key] = "lease lost"

        threads = [threading.Thread(target=running_request, args=(key,)) for key in keys]
        for thread in threads:
            thread.start()
        for _ in keys:
            assert claimed.acquire(timeout=60)

        running.restart()  # every claim forgotten while its request still runs
        retries = Recorder()
        answers = []
        for key in keys:
            with pytest.raises(StoreUnavailable) as raised:
                idem.run(intent(key), retries)
            answers.append(raised.value)
        release.set()
        for thread in threads:
            thread.join(timeout=60)

        assert retries.calls == []  # nothing ran beside a request still in flight
        assert {a.status for a in answers} == {503}
        assert all(1 <= a.retry_after <= POLICY.stale_seconds + 1 for a in answers)
        assert first == dict.fromkeys(keys, "lease lost")

        clock.advance(POLICY.stale_seconds + 1)
        for key in keys:
            assert not idem.run(intent(key), retries).replayed
        assert len(retries.calls) == len(keys)
        store.close()


def test_a_store_started_on_an_existing_server_does_not_quarantine(tmp_path: Path) -> None:
    """Starting (or restarting) the app on a server that kept its data is no loss:
    the epochs are there, claims go on at once."""
    with server("redis-server", tmp_path, *VOLATILE) as running:
        first = RedisStore(redis_client(running.url), prefix="e", allow_volatile=True)
        Idempotency(first, POLICY).run(intent(), Recorder())
        first.close()
        second = RedisStore(redis_client(running.url), prefix="e", allow_volatile=True)
        assert Idempotency(second, POLICY).run(intent(), Recorder()).replayed
        assert not Idempotency(second, POLICY).run(intent("k-2"), Recorder()).replayed
        second.close()
