"""
The NATS JetStream adapter when its broker is SIGKILLed or frozen (SIGSTOP) between the
commit and the ack: the ack fails within its own timeout (the consumer never hangs), and
once the broker is back the message is either acked already (a frozen server runs the
buffered ack on SIGCONT) or redelivered and acked with the stored result: one effect.
A private nats-server on a free loopback port, stopped by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idemflow import AsyncIdempotency
from idemflow.consumers import AsyncConsumer
from tests.conftest import unreachable
from tests.consumers._support import App
from tests.factories import POLICY, free_port
from tests.faults import freeze_process

nats = pytest.importorskip("nats")
from nats.js.api import ConsumerConfig  # noqa: E402

from idemflow.consumers.nats import JetStream  # noqa: E402

pytestmark = [pytest.mark.nats, pytest.mark.anyio]

ACK_WAIT = 2.0


class NatsServer:
    """A private nats-server with JetStream, its store in ``directory`` (kept across a kill)."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("nats-server", path=f"{os.environ.get('PATH', '')}:/usr/sbin")
        if binary is None:
            unreachable("NATS", FileNotFoundError("nats-server"))
        self.command = [binary, "-js", "-sd", str(directory), "-a", "127.0.0.1"]
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        command = [*self.command, "-p", str(self.port)]
        self.process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            assert self.process.poll() is None, "nats-server exited"
            assert time.monotonic() < deadline, "nats-server never listened"
            time.sleep(0.02)

    def signal(self, number: int) -> None:
        """Send ``number`` and return once it took effect: a SIGKILLed server gone, a
        SIGSTOPped one stopped."""
        assert self.process is not None
        if number == signal.SIGSTOP:
            freeze_process(self.process.pid)
            return
        os.kill(self.process.pid, number)
        if number == signal.SIGKILL:
            self.process.wait(timeout=10)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    own = NatsServer(tmp_path / "jetstream")
    own.start()
    try:
        yield own
    finally:
        with contextlib.suppress(ProcessLookupError, AssertionError):
            own.signal(signal.SIGCONT)
        own.kill()


async def connected(url: str) -> Any:
    return await nats.connect(url, connect_timeout=3, max_reconnect_attempts=0)


@pytest.mark.parametrize("shop", ["sqlite"], indirect=True)
@pytest.mark.parametrize("fault", ["killed", "frozen"])
async def test_a_broker_lost_between_the_commit_and_the_ack_leaves_one_effect(
    shop: App, server: NatsServer, fault: str
) -> None:
    stream = f"faults-{uuid.uuid4().hex[:8]}"
    nc = await connected(server.url)
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[f"{stream}.>"])
    config = ConsumerConfig(durable_name="workers", ack_wait=ACK_WAIT)
    await js.add_consumer(stream, config)
    await js.publish(f"{stream}.orders", b"{}", headers={"Idempotency-Key": "order-1"})

    def adapter(js: Any) -> JetStream:
        consumer = AsyncConsumer(AsyncIdempotency(shop.store, POLICY), f"{stream}/workers")
        return JetStream(consumer, js, stream, "workers", transaction=shop.transaction)

    async def charge_then_lose_the_broker(attempt: Any, message: Any) -> str:
        await shop.write(attempt.connection)
        server.signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        return "charged"  # committed with the completion; the ack meets no broker

    sub = await js.pull_subscribe_bind("workers", stream)
    (message,) = await sub.fetch(1, timeout=5)
    with pytest.raises(Exception):  # noqa: B017,PT011 -- nats-py's timeout or closed connection
        await asyncio.wait_for(adapter(js).deliver(message, charge_then_lose_the_broker), 30)
    assert shop.count() == 1

    if fault == "killed":
        server.process = None  # gone: started again on its store
        server.start()
    else:
        server.signal(signal.SIGCONT)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 5)

    nc = await connected(server.url)  # the consumer, restarted
    js = nc.jetstream()
    again = adapter(js)
    actions = []
    deadline = time.monotonic() + 3 * ACK_WAIT + 10
    while (info := await js.consumer_info(stream, "workers")).num_ack_pending + info.num_pending:
        assert time.monotonic() < deadline, f"never settled: {info}"
        sub = await js.pull_subscribe_bind("workers", stream)
        with contextlib.suppress(nats.errors.TimeoutError):
            for redelivered in await sub.fetch(1, timeout=ACK_WAIT):
                actions.append(await again.deliver(redelivered, charge_then_lose_the_broker))
        await sub.unsubscribe()
    await nc.close()

    if fault == "killed":  # the ack never reached a broker: redelivered, never run again
        assert actions == ["ack_with_stored_result"]
    else:  # the thawed server ran the buffered ack, or it redelivers: never run again
        assert set(actions) <= {"ack_with_stored_result"}, actions
    assert shop.count() == 1
