"""The demo as the storm's victim: started, SIGKILLed and restarted on one database and port."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time
from pathlib import Path

import httpx

from idemflow import ConfigurationError

from .config import StormConfig

__all__ = ["DemoProcess", "StormError"]

#: The longest one start (imports, migration, first /healthz) may take.
STARTUP_SECONDS = 60.0


class StormError(ConfigurationError):
    """The storm could not run (the demo would not start): no verdict."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now; every restart of the demo binds it again."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class DemoProcess:
    """``idemflow demo`` in a subprocess; each (re)start is a new incarnation.

    Its output goes to ``data_dir/demo.log``, appended across incarnations: a
    traceback there is what to read when a verdict is red. Beside the first,
    demo ``index`` n logs to ``demo-<n + 1>.log`` in the same folder (whose
    provider ledger they share).
    """

    def __init__(self, config: StormConfig, data_dir: Path, *, index: int = 0) -> None:
        self.config = config
        self.data_dir = data_dir
        self.index = index
        self.port = free_port() if config.port is None else config.port + index
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir / ("demo.log" if index == 0 else f"demo-{index + 1}.log")
        self.incarnation = 0
        self.kills = 0
        #: Seconds each incarnation took to answer /healthz.
        self.startups: list[float] = []
        self._process: asyncio.subprocess.Process | None = None

    def command(self) -> list[str]:
        config = self.config
        command = [sys.executable, "-m", "idemflow", "demo", "--no-access-log"]
        command += ["--port", str(self.port), "--data-dir", str(self.data_dir)]
        command += ["--request-timeout", f"{config.request_timeout:g}"]
        command += ["--sweep-every", f"{config.sweep_interval:g}"]
        command += ["--provider-latency-ms", str(config.provider_latency_ms)]
        command += ["--provider-failure-rate", f"{config.provider_failure_rate:g}"]
        if config.seed is not None:  # each incarnation its own, reproducible failures
            seed = config.seed * 1000 + 100 * self.index + self.incarnation
            command += ["--provider-seed", str(seed)]
        if config.database:
            command += ["--database", config.database]
        if config.claim_commit != "own":
            command += ["--claim-commit", config.claim_commit]
        return command

    async def start(self) -> None:
        """Start an incarnation and wait until it answers ``/healthz``."""
        self.incarnation += 1
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as log:
            log.write(f"--- incarnation {self.incarnation} at {time.strftime('%X')}\n")
            log.flush()
            self._process = await asyncio.create_subprocess_exec(
                *self.command(), stdout=log, stderr=log, stdin=asyncio.subprocess.DEVNULL
            )
        began = time.monotonic()
        await self._wait_ready(self._process)
        self.startups.append(time.monotonic() - began)
        with self.log.open("a") as log:
            log.write(f"--- incarnation {self.incarnation} ready after {self.startups[-1]:.2f} s\n")

    async def _wait_ready(self, process: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        async with httpx.AsyncClient(base_url=self.url, timeout=2.0) as client:
            while time.monotonic() < deadline:
                if process.returncode is not None:
                    break
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/healthz")).status_code == 200:
                        return
                await asyncio.sleep(0.05)
        await self.stop()
        tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
        msg = f"the demo did not start ({self.log}): {' | '.join(tail) or 'no output'}"
        raise StormError(msg)

    async def kill(self) -> None:
        """SIGKILL: no shutdown, no rollback, no flush, as a power cut."""
        process = self._running()
        with contextlib.suppress(ProcessLookupError):  # gone already: its exit code says how
            process.send_signal(signal.SIGKILL)
        if (code := await process.wait()) != -signal.SIGKILL:
            msg = f"the demo exited by itself (exit code {code}) before its SIGKILL: {self.log}"
            raise StormError(msg)
        self.kills += 1
        with self.log.open("a") as log:
            log.write(f"--- incarnation {self.incarnation} SIGKILLed at {time.strftime('%X')}\n")

    async def stop(self) -> None:
        """End the current incarnation politely: SIGTERM, then SIGKILL once its grace is over."""
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            # Its graceful shutdown waits for requests in flight; a few seconds
            # more for the lifespan shutdown (sweeper, pool) before SIGKILL.
            await asyncio.wait_for(process.wait(), self.config.shutdown_grace + 5)
        except TimeoutError:
            process.kill()
            await process.wait()

    def _running(self) -> asyncio.subprocess.Process:
        if self._process is None:
            raise RuntimeError("the demo is not running")
        return self._process
