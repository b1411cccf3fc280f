"""
One storm from start to verdict.

1. Start the demo (unless ``--url``): a fresh data folder, a fixed port.
2. Attack: each key's clients start together at a random moment of the
   attack window and retry until answered; meanwhile the killer SIGKILLs the
   demo at random moments about ``kill_every`` apart and restarts it on the
   same database and port.
   With network faults, the link between the demo and its database is
   partitioned at random moments about ``partition_every`` apart (and may
   delay and stall every chunk): see :mod:`idemflow_demo.storm.network`.
3. Settle: after the window, no more faults; clients keep retrying until
   every key is answered (a claim orphaned by a kill answers 409 until the
   sweeper resolves it) or the settle time runs out.
4. Check: one more retry per answered key (it must be a replay of the same
   answer), then the service's payments, the provider's ledger and the
   metrics, judged by :func:`idemflow_demo.storm.verdict.judge`.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from .clients import Deadline, KeyTally, new_client, send_payment
from .config import KeyPlan, StormConfig, plan_keys
from .network import FaultyLink, LinkFaults
from .server import DemoProcess
from .service import MetricsTally, read_ledger
from .verdict import Verdict, judge

__all__ = ["StormResult", "run_storm"]

#: Clients of one key start within this many seconds of each other: concurrent.
CLIENT_SPREAD = 0.02
PROGRESS_EVERY = 5.0
#: How long the closing replay of each key may take (it may meet a 503).
LATE_RETRY_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class StormResult:
    """The verdict, and where the storm ran."""

    verdict: Verdict
    target: str
    run_id: str
    seed: int | None
    #: The demo's files (its log among them); kept when the verdict is red.
    data_dir: Path | None
    #: Network faults: partitions made, and connections they reset.
    partitions: int = 0
    resets: int = 0


Progress = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def run_storm(config: StormConfig, *, progress: Progress | None = _stderr) -> StormResult:
    """Run one storm against ``config.url`` or a demo started (and killed) here."""
    say = progress or (lambda line: None)
    rng = random.Random(config.seed)
    run_id = secrets.token_hex(3)  # never seeded: reruns on one database stay apart
    plans = plan_keys(config, run_id, rng)
    data_dir = config.data_dir
    if config.url is None and data_dir is None:
        data_dir = Path(tempfile.mkdtemp(prefix="idemflow-storm-"))
    link = _link(config, rng) if config.network_faults else None
    if link is not None:
        await link.start()
    server = None
    if data_dir is not None and not config.url:
        linked = replace(config, database=link.url(config.database or "")) if link else config
        server = DemoProcess(linked, data_dir)
    storm = _Storm(config, plans, server, rng, say, link)
    try:
        verdict = await storm.run(run_id)
    finally:
        if server is not None:
            await server.stop()
        if link is not None:
            await link.stop()
    keep = data_dir is not None and (config.data_dir is not None or not verdict.ok)
    if data_dir is not None and not keep:
        shutil.rmtree(data_dir, ignore_errors=True)
    partitions, resets = (link.partitions, link.resets) if link else (0, 0)
    return StormResult(
        verdict, storm.target, run_id, config.seed, data_dir if keep else None, partitions, resets
    )


def _link(config: StormConfig, rng: random.Random) -> FaultyLink:
    faults = LinkFaults(
        config.network_delay_ms, config.network_jitter_ms, config.network_stall_rate
    )
    return FaultyLink.for_url(config.database or "", faults, random.Random(rng.random()))


class _Storm:
    def __init__(
        self,
        config: StormConfig,
        plans: Sequence[KeyPlan],
        server: DemoProcess | None,
        rng: random.Random,
        say: Progress,
        link: FaultyLink | None = None,
    ) -> None:
        self.config = config
        self.server = server
        self.link = link
        self.rng = rng
        self.say = say
        self.tallies = [KeyTally(plan) for plan in plans]
        self.metrics = MetricsTally()
        self.url = config.url or (server.url if server else "")
        self.done = asyncio.Event()
        self.deadline = Deadline(0.0)

    @property
    def target(self) -> str:
        if self.server is None:
            return self.url
        database = self.config.database or (
            f"SQLite in {self.server.data_dir}" if self.config.data_dir else "SQLite (temporary)"
        )
        mode = ", single-commit claims" if self.config.claim_commit == "single" else ""
        if self.link is not None:
            mode += ", through a faulty network"
        return f"the demo on {database.split('@')[-1]}{mode} at {self.url}"

    async def run(self, run_id: str) -> Verdict:
        started = time.monotonic()
        if self.server is not None:
            self.say(f"storm: starting {self.target}")
            await self.server.start()
        async with new_client(self.url, self.config, self.tallies, self.rng) as http:
            await self.metrics.scrape(http, self._incarnation())
            if self.server is None:
                self.metrics.set_baseline(0)
            await self._attack(http)
            self.say("storm: every client is done; checking replays, payments and the ledger")
            await self._late_retries(http)
            await self.metrics.scrape(http, self._incarnation())
            limit = 2 * len(self.tallies) + 1000
            ledger = await read_ledger(http, self.config, run_id, limit)
        return judge(
            self.tallies,
            ledger,
            self.metrics.totals(),
            run_id=run_id,
            clients_per_key=self.config.retries,
            kills=self.server.kills if self.server else 0,
            elapsed=time.monotonic() - started,
            metrics_missed=self.metrics.missed,
        )

    def _incarnation(self) -> int:
        return self.server.incarnation if self.server else 0

    async def _attack(self, http: httpx.AsyncClient) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        attack_end = start + self.config.duration
        self.deadline = Deadline(attack_end + self.config.settle_seconds)
        self.say(
            f"storm: {len(self.tallies)} keys × {self.config.retries} clients over "
            f"{self.config.duration:g} s"
            + (f", a SIGKILL every ~{self.config.kill_every:g} s" if self._killing() else "")
            + (
                f", a network partition every ~{self.config.partition_every:g} s"
                if self.link is not None and self.config.partition_every is not None
                else ""
            )
            + f"; then up to {self.config.settle_seconds:g} s to settle"
        )
        clients = asyncio.ensure_future(
            asyncio.gather(*(self._key(http, t, start) for t in self.tallies))
        )
        reporter = asyncio.ensure_future(self._report_progress(http, start))
        faults = []
        if self.server is not None and self.config.kill_every is not None:
            faults.append(
                asyncio.ensure_future(
                    self._kill_loop(http, self.server, self.config.kill_every, attack_end)
                )
            )
        if self.link is not None and self.config.partition_every is not None:
            faults.append(
                asyncio.ensure_future(
                    self._partition_loop(self.link, self.config.partition_every, attack_end)
                )
            )
        try:
            await _first_failure(clients, faults)
        finally:
            self.done.set()
            reporter.cancel()
            clients.cancel()  # a no-op unless the killer failed (the demo did not come back)
            await asyncio.gather(reporter, clients, return_exceptions=True)
            for fault in faults:
                await fault  # a restart in progress ends first; a failure is raised here

    def _killing(self) -> bool:
        return self.server is not None and self.config.kill_every is not None

    async def _key(self, http: httpx.AsyncClient, tally: KeyTally, start: float) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, start + tally.plan.start - loop.time()))
        await asyncio.gather(*(self._client(http, tally) for _ in range(self.config.retries)))

    async def _client(self, http: httpx.AsyncClient, tally: KeyTally) -> None:
        await asyncio.sleep(self.rng.uniform(0, CLIENT_SPREAD))
        await send_payment(http, tally, self.config, self.deadline)

    async def _kill_loop(
        self, http: httpx.AsyncClient, server: DemoProcess, every: float, attack_end: float
    ) -> None:
        """SIGKILL at random moments ~``every`` apart, never before the demo served a bit.

        Kills stop at the end of the window or once every client is done,
        unless fewer than ``min_kills`` happened (a slow machine restarts
        slowly): then they go on, and the clients' deadline moves with them.
        """
        loop = asyncio.get_running_loop()
        last_kill = loop.time()
        while True:
            at = max(last_kill + every * self.rng.uniform(0.5, 1.5), loop.time() + every / 4)
            if server.kills < self.config.min_kills:
                await asyncio.sleep(at - loop.time())
            elif at >= attack_end or await self._done_within(at - loop.time()):
                return
            # Its counters die with it: read them first, briefly (a kill must not wait).
            await self.metrics.scrape(http, server.incarnation, timeout=1.0)
            await server.kill()
            last_kill = loop.time()
            self.deadline.extend_to(last_kill + self.config.settle_seconds)
            await server.start()

    async def _partition_loop(self, link: FaultyLink, every: float, attack_end: float) -> None:
        """Partition the database link at random moments ~``every`` apart, within the window.

        Each partition lasts about ``partition_for``; clients keep their
        deadline ``settle_seconds`` past the last heal.
        """
        loop = asyncio.get_running_loop()
        while True:
            at = loop.time() + every * self.rng.uniform(0.5, 1.5)
            if at >= attack_end or await self._done_within(at - loop.time()):
                return
            link.partition()
            try:
                await asyncio.sleep(self.config.partition_for * self.rng.uniform(0.5, 1.5))
            finally:
                link.heal()
            self.deadline.extend_to(loop.time() + self.config.settle_seconds)

    async def _done_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self.done.wait(), max(0.0, seconds))
        except TimeoutError:
            return False
        return True

    async def _report_progress(self, http: httpx.AsyncClient, start: float) -> None:
        """A line every few seconds; and a reading of the counters, in case a kill misses one."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(PROGRESS_EVERY)
            await self.metrics.scrape(http, self._incarnation(), timeout=1.0)
            answered = sum(t.resolved for t in self.tallies)
            requests = sum(t.requests for t in self.tallies)
            kills = self.server.kills if self.server else 0
            self.say(
                f"storm: {loop.time() - start:4.0f} s  {answered}/{len(self.tallies)} keys "
                f"answered  {requests} requests  {kills} kills"
            )

    async def _late_retries(self, http: httpx.AsyncClient) -> None:
        """One more retry per answered key: it must replay the same answer."""
        gate = asyncio.Semaphore(32)

        async def late(tally: KeyTally) -> None:
            async with gate:
                await self._late_retry(http, tally)

        await asyncio.gather(*(late(t) for t in self.tallies if t.resolved))

    async def _late_retry(self, http: httpx.AsyncClient, tally: KeyTally) -> None:
        deadline = Deadline(asyncio.get_running_loop().time() + LATE_RETRY_SECONDS)
        answered = tally.settled
        await send_payment(http, tally, self.config, deadline)
        tally.late_replayed = tally.settled > answered and tally.last_replayed


async def _first_failure(
    clients: asyncio.Future[list[None]], faults: Sequence[asyncio.Future[None]]
) -> None:
    """Wait for the clients, unless a fault fails first (the demo did not come back)."""
    pending: set[asyncio.Future[Any]] = {clients, *faults}
    while not clients.done():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(f.exception() is not None for f in done if f is not clients):
            return
    await clients
