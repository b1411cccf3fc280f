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
   With several databases (``more_databases``: the nodes of a Galera
   cluster), one demo runs on each, each behind a link of its own; each key's
   clients go to different demos, and each kill or partition hits one demo
   (or its link) at random.
3. Settle: after the window, no more faults; clients keep retrying until
   every key is answered (a claim orphaned by a kill answers 409 until the
   sweeper resolves it) or the settle time runs out.
4. Check: one more retry per answered key (it must be a replay of the same
   answer), then the service's payments, the provider's ledger and the
   metrics, judged by :func:`idemflow_demo.storm.verdict.judge`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx

from .clients import Deadline, KeyTally, new_client, send_payment
from .config import KeyPlan, StormConfig, plan_keys
from .network import FaultyLink, LinkFaults
from .server import STARTUP_SECONDS, DemoProcess
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
T = TypeVar("T")


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
    links = [_link(config, url, rng) for url in config.databases] if config.network_faults else []
    for link in links:
        await link.start()
    servers = []
    if data_dir is not None and not config.url:
        for index, url in enumerate(config.databases or (None,)):
            database = links[index].url(url) if links and url else url
            one = replace(config, database=database, more_databases=())
            servers.append(DemoProcess(one, data_dir, index=index))
    storm = _Storm(config, plans, servers, rng, say, links)
    try:
        verdict = await storm.run(run_id)
    finally:
        for server in servers:
            await server.stop()
        for link in links:
            await link.stop()
    keep = data_dir is not None and (config.data_dir is not None or not verdict.ok)
    if data_dir is not None and not keep:
        shutil.rmtree(data_dir, ignore_errors=True)
    partitions = sum(link.partitions for link in links)
    resets = sum(link.resets for link in links)
    return StormResult(
        verdict, storm.target, run_id, config.seed, data_dir if keep else None, partitions, resets
    )


def _link(config: StormConfig, url: str, rng: random.Random) -> FaultyLink:
    faults = LinkFaults(
        config.network_delay_ms, config.network_jitter_ms, config.network_stall_rate
    )
    return FaultyLink.for_url(url, faults, random.Random(rng.random()))


#: Metrics readings are kept per incarnation; demo ``i``'s are numbered from ``i × this``.
_INCARNATIONS_PER_DEMO = 100_000


class _Storm:
    def __init__(
        self,
        config: StormConfig,
        plans: Sequence[KeyPlan],
        servers: Sequence[DemoProcess],
        rng: random.Random,
        say: Progress,
        links: Sequence[FaultyLink] = (),
    ) -> None:
        self.config = config
        self.servers = list(servers)
        self.links = list(links)
        self.rng = rng
        self.say = say
        self.tallies = [KeyTally(plan) for plan in plans]
        self.metrics = MetricsTally()
        self.urls = [config.url] if config.url else [server.url for server in self.servers]
        self.url = self.urls[0] if self.urls else ""
        self.https: list[httpx.AsyncClient] = []
        self.done = asyncio.Event()
        self.deadline = Deadline(0.0)

    @property
    def kills(self) -> int:
        return sum(server.kills for server in self.servers)

    @property
    def target(self) -> str:
        if not self.servers:
            return self.url
        data_dir = self.servers[0].data_dir
        databases = self.config.databases or (
            f"SQLite in {data_dir}" if self.config.data_dir else "SQLite (temporary)",
        )
        mode = ", single-commit claims" if self.config.claim_commit == "single" else ""
        if self.links:
            mode += ", through a faulty network"
        where = ", ".join(database.split("@")[-1] for database in databases)
        if len(self.servers) > 1:
            urls = ", ".join(server.url for server in self.servers)
            return f"{len(self.servers)} demos on {where}{mode} at {urls}"
        return f"the demo on {where}{mode} at {self.url}"

    async def run(self, run_id: str) -> Verdict:
        started = time.monotonic()
        if self.servers:
            self.say(f"storm: starting {self.target}")
        for server in self.servers:
            await server.start()
        async with contextlib.AsyncExitStack() as stack:
            for url in self.urls:
                client = new_client(url, self.config, self.tallies, self.rng)
                self.https.append(await stack.enter_async_context(client))
            await self._scrape()
            if not self.servers:
                self.metrics.set_baseline(0)
            await self._attack()
            self.say("storm: every client is done; checking replays, payments and the ledger")
            await self._late_retries()
            await self._scrape()
            limit = 2 * len(self.tallies) + 1000
            ledger = await read_ledger(self.https[0], self.config, run_id, limit)
        return judge(
            self.tallies,
            ledger,
            self.metrics.totals(),
            run_id=run_id,
            clients_per_key=self.config.retries,
            kills=self.kills,
            elapsed=time.monotonic() - started,
            metrics_missed=self.metrics.missed,
        )

    def _incarnation(self, index: int = 0) -> int:
        if not self.servers:
            return 0
        return index * _INCARNATIONS_PER_DEMO + self.servers[index].incarnation

    async def _scrape(self, *, timeout: float = 10.0) -> None:
        """Every demo's counters (a reading per incarnation of each)."""
        for index, http in enumerate(self.https):
            await self.metrics.scrape(http, self._incarnation(index), timeout=timeout)

    def _http_for(self, tally: KeyTally, client: int) -> httpx.AsyncClient:
        """A key's clients take the demos in turn, from one the key's index picks."""
        return self.https[(tally.plan.index + client) % len(self.https)]

    def _pick(self, choices: Sequence[T]) -> T:
        """One at random; the only one without a draw (a seeded storm stays as it was)."""
        return choices[0] if len(choices) == 1 else self.rng.choice(choices)

    async def _attack(self) -> None:
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
                if self.links and self.config.partition_every is not None
                else ""
            )
            + f"; then up to {self.config.settle_seconds:g} s to settle"
        )
        clients = asyncio.ensure_future(
            asyncio.gather(*(self._key(t, start) for t in self.tallies))
        )
        reporter = asyncio.ensure_future(self._report_progress(start))
        faults = []
        if self.servers and self.config.kill_every is not None:
            faults.append(
                asyncio.ensure_future(self._kill_loop(self.config.kill_every, attack_end))
            )
        if self.links and self.config.partition_every is not None:
            faults.append(
                asyncio.ensure_future(self._partition_loop(self.config.partition_every, attack_end))
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
        return bool(self.servers) and self.config.kill_every is not None

    async def _key(self, tally: KeyTally, start: float) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, start + tally.plan.start - loop.time()))
        await asyncio.gather(*(self._client(tally, n) for n in range(self.config.retries)))

    async def _client(self, tally: KeyTally, client: int) -> None:
        await asyncio.sleep(self.rng.uniform(0, CLIENT_SPREAD))
        await send_payment(self._http_for(tally, client), tally, self.config, self.deadline)

    async def _kill_loop(self, every: float, attack_end: float) -> None:
        """SIGKILL at random moments ~``every`` apart, never before the demo served a bit.

        Kills stop at the end of the window or once every client is done,
        unless fewer than ``min_kills`` happened (a slow machine restarts
        slowly): then they go on, and the clients' deadline moves with them,
        to ``settle_seconds`` past the last restart (:meth:`_restart`).
        """
        loop = asyncio.get_running_loop()
        last_kill = loop.time()
        while True:
            at = max(last_kill + every * self.rng.uniform(0.5, 1.5), loop.time() + every / 4)
            if self.kills < self.config.min_kills:
                await asyncio.sleep(at - loop.time())
            elif at >= attack_end or await self._done_within(at - loop.time()):
                return
            index = self._pick(range(len(self.servers)))
            server = self.servers[index]
            # Its counters die with it: read them first, briefly (a kill must not wait).
            await self.metrics.scrape(self.https[index], self._incarnation(index), timeout=1.0)
            await server.kill()
            last_kill = loop.time()
            await self._restart(server)

    async def _restart(self, server: DemoProcess) -> None:
        """Start ``server`` again; the clients' time to settle runs from when it is back.

        No client gives up while it restarts: a restart slowed by a loaded
        machine (measured: up to 60 s before /healthz answered, with the
        storm's clients crowding the new demo) must not eat the time its
        orphaned claims need to be swept (keys then went unresolved).
        """
        loop = asyncio.get_running_loop()
        settle = self.config.settle_seconds
        before = self.deadline.at
        self.deadline.extend_to(loop.time() + STARTUP_SECONDS + settle)
        await server.start()  # within STARTUP_SECONDS, or the storm cannot run
        self.deadline.at = max(before, loop.time() + settle)

    async def _partition_loop(self, every: float, attack_end: float) -> None:
        """Partition a database link at random moments ~``every`` apart, within the window.

        Each partition lasts about ``partition_for`` and cuts one demo's link
        (picked at random when there are several); clients keep their
        deadline ``settle_seconds`` past the last heal.
        """
        loop = asyncio.get_running_loop()
        while True:
            at = loop.time() + every * self.rng.uniform(0.5, 1.5)
            if at >= attack_end or await self._done_within(at - loop.time()):
                return
            link = self._pick(self.links)
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

    async def _report_progress(self, start: float) -> None:
        """A line every few seconds; and a reading of the counters, in case a kill misses one."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(PROGRESS_EVERY)
            await self._scrape(timeout=1.0)
            answered = sum(t.resolved for t in self.tallies)
            requests = sum(t.requests for t in self.tallies)
            kills = self.kills
            self.say(
                f"storm: {loop.time() - start:4.0f} s  {answered}/{len(self.tallies)} keys "
                f"answered  {requests} requests  {kills} kills"
            )

    async def _late_retries(self) -> None:
        """One more retry per answered key: it must replay the same answer."""
        gate = asyncio.Semaphore(32)

        async def late(tally: KeyTally) -> None:
            async with gate:
                await self._late_retry(self._http_for(tally, 0), tally)

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
