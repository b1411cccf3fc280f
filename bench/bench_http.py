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
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return status


@dataclass
class Tally:
    requests: int = 0
    seconds: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    rates: list[float] = field(default_factory=list)

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


async def run_slice(
    clients: list[Client], make: Callable[[], bytes], seconds: float, tally: Tally
) -> None:
    """Every client sends requests back to back until the slice ends."""
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
    tally.requests += done
    tally.seconds += elapsed
    tally.rates.append(done / elapsed)


async def measure(url: str, clients_n: int, seconds: float, rounds: int) -> dict[str, Tally]:
    clients = await open_clients(url, clients_n)
    replay_key = f"bench-replay-{uuid.uuid4().hex}"
    assert await clients[0].send(request_bytes("/payments", replay_key)) == 201
    makers: dict[str, Callable[[], bytes]] = {
        "unprotected": lambda: request_bytes("/_bench/payments", None),
        "protected": lambda: request_bytes("/payments", f"bench-{uuid.uuid4().hex}"),
        "replay": lambda: request_bytes("/payments", replay_key),
    }
    tallies = {name: Tally() for name in PATHS}
    # Warm up every path once (connections, prepared statements, caches).
    for name in PATHS:
        await run_slice(clients, makers[name], min(0.5, seconds), Tally())
    for round_ in range(rounds):
        order = PATHS[round_ % len(PATHS) :] + PATHS[: round_ % len(PATHS)]
        for name in order:
            await run_slice(clients, makers[name], seconds, tallies[name])
    for client in clients:
        client.writer.close()
    return tallies


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
def server(backend: str, workdir: Path) -> Iterator[str]:
    data = workdir / backend
    flags = ("--bench-routes", *BACKENDS[backend])
    if backend == "sqlite":
        with run_demo(data, *flags) as demo:
            yield demo.url
        return
    with postgres_schema() as url, run_demo(data, *flags, database_url=url) as demo:
        yield demo.url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one slice")
    parser.add_argument("--rounds", type=int, default=3, help="slices per path")
    parser.add_argument("--clients", default="1,32", help="concurrent clients, comma-separated")
    parser.add_argument("--backends", default="sqlite,postgres,postgres-single")
    args = parser.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for backend in args.backends.split(","):
            with server(backend, Path(workdir)) as url:
                for n in clients:
                    tallies = asyncio.run(measure(url, n, args.seconds, args.rounds))
                    rows.append((backend, n, tallies))
                    print(row(backend, n, tallies), file=sys.stderr, flush=True)
                    for name, tally in tallies.items():
                        odd = {s: c for s, c in tally.statuses.items() if s >= 300}
                        if odd:
                            print(f"  {backend} {n} {name}: {odd}", file=sys.stderr, flush=True)
    print(table(rows))
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
