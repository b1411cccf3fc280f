"""
What idempotency costs the demo's ``POST /payments``, measured over HTTP.

Run::

    .venv/bin/python -m bench.bench_http [--seconds 2] [--rounds 3] [--clients 1,32]
                                         [--backends sqlite,postgres,postgres-single]

For each backend one demo server is started (``idemflow demo --bench-routes``,
uvicorn, one worker, in its own process). This process is the load generator:
a small asyncio HTTP/1.1 client with one keep-alive connection per concurrent
client, so the client's own cost stays small next to the server's. Three paths
take turns in short slices (A B C, then B C A, …) so a noisy neighbour hits
each about equally:

``unprotected``
    ``POST /_bench/payments``: the same three-phase business write (payment
    row, provider charge, payment succeeded) with idempotency switched off.
``protected``
    ``POST /payments`` with a fresh ``Idempotency-Key`` per request: claim,
    checkpoint and completion on top of the same write.
``replay``
    ``POST /payments`` with a key that already completed: claim (lost), read,
    authorize, replay.

``postgres-single`` runs the demo in single-commit mode (the claim is the first
statement of the endpoint's first transaction) for comparison; it is not the
demo's default.

``--baseline-src DIR`` (a ``src`` folder of another tree, e.g. ``git archive``
of an older commit) also starts, per backend, a demo server running that
tree's idemflow (``PYTHONPATH``), on a schema of its own, and its paths take
their turns in the same rotation: before and after in one run, under the
same load. ``--pool-size`` is passed to every demo (two PostgreSQL servers of
``--pool-size 7`` hold 16 connections with their gauges').

Targets: protected ≥ 0.80 × unprotected on PostgreSQL at 32 clients, and a
replay at least as fast as a first execution.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.http.conftest import run_demo

POSTGRES_URL = os.environ.get(
    "IDEMFLOW_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
BODY = json.dumps({"amount": 1000, "currency": "EUR", "customer": "ada"}).encode()
PATHS = ("unprotected", "protected", "replay")


def request_bytes(path: str, key: str | None) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Authorization: Bearer alice-token",
        "Content-Type: application/json",
        f"Content-Length: {len(BODY)}",
    ]
    if key is not None:
        lines.append(f"Idempotency-Key: {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + BODY


@dataclass
class Client:
    """One keep-alive HTTP/1.1 connection."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def send(self, payload: bytes) -> int:
        self.writer.write(payload)
        status, _ = await self.answer()
        return status

    async def answer(self) -> tuple[int, bytes]:
        """The next response's status and body (its ``Content-Length`` bytes)."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return int(head[9:12]), await self.reader.readexactly(length)


@dataclass
class Tally:
    requests: int = 0
    seconds: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    rates: list[float] = field(default_factory=list)
    #: CPU seconds of the demo process and of the PostgreSQL backends serving it.
    app_cpu: float = 0.0
    db_cpu: float = 0.0

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def open_clients(url: str, count: int) -> list[Client]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    clients = []
    for _ in range(count):
        reader, writer = await asyncio.open_connection(host, int(port))
        clients.append(Client(reader, writer))
    return clients


@dataclass(frozen=True)
class Target:
    """A demo server: where to send requests, and whose CPU to read (``/proc``)."""

    url: str
    pid: int | None = None
    application_name: str | None = None

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far: the server process's, its PostgreSQL backends' (summed)."""
        app = cpu_seconds(self.pid) if self.pid is not None else 0.0
        return app, sum(cpu_seconds(pid) for pid in backends(self.application_name))


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def backends(application_name: str | None) -> list[int]:
    """The PostgreSQL backends of the connections named ``application_name``."""
    if application_name is None:
        return []
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (application_name,)
        ).fetchall()
    return [row[0] for row in rows]


async def run_slice(
    clients: list[Client],
    make: Callable[[], bytes],
    seconds: float,
    tally: Tally,
    target: Target | None = None,
) -> None:
    """Every client sends requests back to back until the slice ends."""
    app_before, db_before = target.cpu() if target is not None else (0.0, 0.0)
    deadline = time.perf_counter() + seconds
    done = 0

    async def worker(client: Client) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            tally.statuses[await client.send(make())] += 1
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients))
    elapsed = time.perf_counter() - started
    if target is not None:
        app_after, db_after = target.cpu()
        tally.app_cpu += app_after - app_before
        tally.db_cpu += db_after - db_before
    tally.requests += done
    tally.seconds += elapsed
    tally.rates.append(done / elapsed)


async def measure(url: str, clients_n: int, seconds: float, rounds: int) -> dict[str, Tally]:
    return (await measure_servers({"": Target(url)}, clients_n, seconds, rounds))[""]


async def measure_servers(
    urls: dict[str, Target], clients_n: int, seconds: float, rounds: int
) -> dict[str, dict[str, Tally]]:
    """Every path of every server (label → server) in one rotation of slices."""
    clients, makers = {}, {}
    for label, target in urls.items():
        clients[label] = await open_clients(target.url, clients_n)
        replay_key = f"bench-replay-{uuid.uuid4().hex}"
        assert await clients[label][0].send(request_bytes("/payments", replay_key)) == 201
        makers[label] = path_makers(replay_key)
    contenders = [(label, name) for label in urls for name in PATHS]
    tallies = {label: {name: Tally() for name in PATHS} for label in urls}
    # Warm up every path once (connections, prepared statements, caches).
    for label, name in contenders:
        await run_slice(clients[label], makers[label][name], min(0.5, seconds), Tally())
    for round_ in range(rounds):
        shift = round_ % len(contenders)
        for label, name in contenders[shift:] + contenders[:shift]:
            if len(urls) > 1:
                # Idle through the other server's slices, longer than uvicorn's
                # keep-alive (5 s): connect afresh, then warm the path again.
                for client in clients[label]:
                    client.writer.close()
                clients[label] = await open_clients(urls[label].url, clients_n)
                await run_slice(clients[label], makers[label][name], 0.2, Tally())
            tally = tallies[label][name]
            await run_slice(clients[label], makers[label][name], seconds, tally, urls[label])
    for group in clients.values():
        for client in group:
            client.writer.close()
    return tallies


def path_makers(replay_key: str) -> dict[str, Callable[[], bytes]]:
    return {
        "unprotected": lambda: request_bytes("/_bench/payments", None),
        "protected": lambda: request_bytes("/payments", f"bench-{uuid.uuid4().hex}"),
        "replay": lambda: request_bytes("/payments", replay_key),
    }


@contextlib.contextmanager
def postgres_schema() -> Iterator[str]:
    import psycopg

    schema = f"bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


#: backend name → the demo's flags (``--claim-commit``: see ``idemflow_demo.db``).
BACKENDS = {
    "sqlite": (),
    "postgres": (),
    "postgres-single": ("--claim-commit", "single"),
    "postgres-pool16": ("--pool-size", "16"),
}


@contextlib.contextmanager
def server(
    backend: str, workdir: Path, *extra: str, source: str | None = None, name: str = ""
) -> Iterator[Target]:
    """One demo server for ``backend``; with ``source``, running that tree's idemflow."""
    data = workdir / (name or backend)
    flags = ("--bench-routes", *BACKENDS[backend], *extra)
    with contextlib.ExitStack() as stack:
        url = app_name = None
        if backend != "sqlite":
            app_name = f"idemflow_bench_{uuid.uuid4().hex[:8]}"
            url = f"{stack.enter_context(postgres_schema())}&application_name={app_name}"
        with python_path(source):
            demo = stack.enter_context(run_demo(data, *flags, database_url=url))
        yield Target(demo.url, demo.process.pid, app_name)


@contextlib.contextmanager
def python_path(source: str | None) -> Iterator[None]:
    """Children started inside import idemflow from ``source`` first (when given)."""
    if source is None:
        yield
        return
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [source, saved]))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one slice")
    parser.add_argument("--rounds", type=int, default=3, help="slices per path")
    parser.add_argument("--clients", default="1,32", help="concurrent clients, comma-separated")
    parser.add_argument("--backends", default="sqlite,postgres,postgres-single")
    parser.add_argument(
        "--baseline-src", help="a src folder of another tree, measured in the same rotation"
    )
    parser.add_argument("--pool-size", type=int, help="the demos' --pool-size")
    args = parser.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    extra = () if args.pool_size is None else ("--pool-size", str(args.pool_size))
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for backend in args.backends.split(","):
            with contextlib.ExitStack() as stack:
                urls = {backend: stack.enter_context(server(backend, Path(workdir), *extra))}
                if args.baseline_src:
                    label = f"{backend} (baseline)"
                    urls[label] = stack.enter_context(
                        server(
                            backend,
                            Path(workdir),
                            *extra,
                            source=args.baseline_src,
                            name=f"{backend}-baseline",
                        )
                    )
                for n in clients:
                    measured = asyncio.run(measure_servers(urls, n, args.seconds, args.rounds))
                    for label, tallies in measured.items():
                        rows.append((label, n, tallies))
                        print(row(label, n, tallies), file=sys.stderr, flush=True)
                        report_odd(label, n, tallies)
    print(table(rows))
    print("\nserver CPU per request (the demo process / its PostgreSQL backends), µs:\n")
    print(cpu_table(rows))
    if args.baseline_src:
        print("\nprotected / unprotected, this tree ÷ the baseline's (same rotation):\n")
        print(versus(rows))
    return 0


def report_odd(label: str, n: int, tallies: dict[str, Tally]) -> None:
    for name, tally in tallies.items():
        odd = {s: c for s, c in tally.statuses.items() if s >= 300}
        if odd:
            print(f"  {label} {n} {name}: {odd}", file=sys.stderr, flush=True)


def versus(rows: list[tuple[str, int, dict[str, Tally]]]) -> str:
    """Per backend and client count: each tree's protected/unprotected, and their ratio."""
    found = {(label, n): tallies for label, n, tallies in rows}
    lines = [
        "| backend | clients | baseline protected/unprotected | this tree | this ÷ baseline |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for (label, n), tallies in found.items():
        base = found.get((f"{label} (baseline)", n))
        if base is None:
            continue
        before = paired(base["protected"], base["unprotected"])
        after = paired(tallies["protected"], tallies["unprotected"])
        ratio = after / before if before else 0.0
        lines.append(f"| {label} | {n} | {before:.2f} | {after:.2f} | {ratio:.2f} |")
    return "\n".join(lines)


HEADER = (
    "| backend | clients | unprotected req/s | protected req/s | protected / unprotected "
    "| replay req/s | replay / protected | non-2xx |\n"
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def paired(numerator: Tally, denominator: Tally) -> float:
    """The median over rounds of one path's rate over another's in the same round.

    Adjacent slices share whatever the machine was doing then, so their ratio
    is steadier than the ratio of totals on a busy host.
    """
    ratios = [n / d for n, d in zip(numerator.rates, denominator.rates, strict=True) if d]
    return statistics.median(ratios) if ratios else 0.0


def row(backend: str, clients: int, tallies: dict[str, Tally]) -> str:
    plain, protected, replay = (tallies[name] for name in PATHS)
    failures = sum(n for t in tallies.values() for s, n in t.statuses.items() if s >= 300)
    return (
        f"| {backend} | {clients} | {plain.rate:,.0f} | {protected.rate:,.0f} "
        f"| {paired(protected, plain):.2f} | {replay.rate:,.0f} "
        f"| {paired(replay, protected):.2f} | {failures} |"
    )


def table(rows: list[tuple[str, int, dict[str, Tally]]]) -> str:
    return "\n".join([HEADER, *(row(b, n, t) for b, n, t in rows)])


def cpu_table(rows: list[tuple[str, int, dict[str, Tally]]]) -> str:
    """Per path: app / PostgreSQL CPU per request, and what protection adds in all."""
    lines = [
        "| backend | clients | unprotected | protected | replay | added by protection |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]

    def per_request(tally: Tally) -> tuple[float, float]:
        done = tally.requests or 1
        return tally.app_cpu / done * 1e6, tally.db_cpu / done * 1e6

    for label, n, tallies in rows:
        cells = {name: per_request(tallies[name]) for name in PATHS}
        added = sum(cells["protected"]) - sum(cells["unprotected"])
        shown = " | ".join(f"{app:,.0f} / {db:,.0f}" for app, db in cells.values())
        lines.append(f"| {label} | {n} | {shown} | {added:+,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
