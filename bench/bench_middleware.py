"""
What middleware mode costs a minimal endpoint, per store: throughput, server CPU, round trips.

Run::

    .venv/bin/python -m bench.bench_middleware [--seconds 2] [--rounds 5] [--clients 1,16]
                                               [--stores sqlite,postgres,redis,mysql]

For each store one server is started (``bench/_minimal_app.py`` under uvicorn,
one worker, its own process): a Starlette app whose ``POST /things`` is protected
by ``IdempotencyMiddleware`` and whose ``POST /plain/things`` is the same
endpoint, not opted in. The endpoint parses the JSON body and answers 201: no
business write, so the ratio shows protection's whole cost against the
cheapest endpoint there is (the worst case). Three paths take turns in short
slices in one run (``unprotected``, ``protected`` with a fresh key,
``replay`` of a completed key), through the load generator of
``bench/bench_http.py``; each slice also reads the CPU the server process (and,
for PostgreSQL, the backends serving it, found by the ports of its connections; for
Redis, the server) spent.

``--baseline TREE`` measures a change: a second server of each store runs on the
idemflow of ``TREE/src`` (e.g. ``git archive main src | tar -x -C /tmp/before``), with
a schema or key prefix of its own, and its three paths take turns with this tree's in
the same run, rows marked "(before)".

Then a second server of the same store, started with the round-trip counters
of ``bench/_wire`` (a separate one, so counting costs nothing in the timed
run), gets ``--count`` sequential requests per path: the round trips per
request to PostgreSQL or Redis, counted in the server's drivers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tests.factories import free_port

from bench._wire import read_counts, wire_env
from bench.bench_frameworks import _cpu_seconds
from bench.bench_http import POSTGRES_URL, Client, Tally, open_clients, postgres_schema

ROOT = Path(__file__).resolve().parents[1]
POSTGRES_PORT = urllib.parse.urlsplit(POSTGRES_URL).port or 5432
REDIS_URL = os.environ.get("IDEMFLOW_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
MYSQL_URL = os.environ.get("IDEMFLOW_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
BODY = b'{"amount":1000,"currency":"EUR","customer":"ada"}'
PATHS = ("unprotected", "protected", "replay")


def request_bytes(path: str, key: str | None) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {len(BODY)}",
    ]
    if key is not None:
        lines.append(f"Idempotency-Key: {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + BODY


@dataclass
class Server:
    url: str
    pid: int
    store: str
    wire: Path | None


@dataclass
class Metered:
    tally: Tally = field(default_factory=Tally)
    app_cpu: float = 0.0
    db_cpu: float = 0.0


@contextlib.contextmanager
def store_settings(store: str, workdir: Path) -> Iterator[dict[str, str]]:
    """Environment for the app: a schema, a Redis prefix or a MySQL table of its own."""
    if store == "postgres":
        with postgres_schema() as url:
            yield {"BENCH_STORE": store, "BENCH_URL": url}
        return
    if store == "redis":
        prefix = f"bench:{uuid.uuid4().hex[:8]}:"
        try:
            yield {"BENCH_STORE": store, "BENCH_URL": REDIS_URL, "BENCH_PREFIX": prefix}
        finally:
            import redis

            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=prefix + "*", count=1000):
                client.delete(key)
            client.close()
        return
    if store == "mysql":
        table = f"bench_keys_{uuid.uuid4().hex[:8]}"
        try:
            yield {"BENCH_STORE": store, "BENCH_URL": MYSQL_URL, "BENCH_TABLE": table}
        finally:
            import pymysql

            from idemflow.stores.mysql import connect_kwargs

            with contextlib.closing(pymysql.connect(**connect_kwargs(MYSQL_URL))) as conn:
                conn.cursor().execute(f"DROP TABLE IF EXISTS {table}")
        return
    yield {"BENCH_STORE": store, "BENCH_DIR": str(workdir)}


@contextlib.contextmanager
def server(
    settings: dict[str, str],
    wire: Path | None = None,
    tree: Path | None = None,
    *,
    app: str = "bench._minimal_app:app",
    python: str = sys.executable,
) -> Iterator[Server]:
    """``app`` under uvicorn; on the idemflow of ``tree``'s ``src`` if given.

    ``python`` is the interpreter of another environment for a peer's app
    (``bench/bench_peers.py``): it imports ``bench.peers`` from this tree.
    """
    port = free_port()
    command = [python, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--log-level", "warning", "--no-access-log"]
    # The clients stay idle while the other server's slices run: keep them connected.
    command += ["--timeout-keep-alive", "600"]
    env = {**os.environ, **settings, **(wire_env(wire) if wire is not None else {})}
    if tree is not None:  # before the installed (editable) idemflow on sys.path
        env["PYTHONPATH"] = os.pathsep.join([str(tree / "src"), env.get("PYTHONPATH", "")])
    process = subprocess.Popen(command, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.TransportError):
                httpx.get(url + "/", timeout=1)
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{app} did not start")
            time.sleep(0.05)
        yield Server(url, process.pid, settings["BENCH_STORE"], wire)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def backends(target: Server) -> list[int]:
    """The store's processes serving ``target``, whose CPU counts as the store's.

    On PostgreSQL the backends whose client port is one of ``target``'s sockets (found
    by port, not by ``application_name``, so any driver's connections count); on Redis
    the server itself (one process, which only the bench's servers use while it runs);
    MariaDB's threads are not told apart: none.
    """
    if target.store == "redis":
        return [redis_server_pid()]
    if target.store != "postgres":
        return []
    import psycopg

    ports = client_ports(target.pid, POSTGRES_PORT)
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE client_port = ANY(%s)", (sorted(ports),)
        ).fetchall()
    return [row[0] for row in rows]


@functools.cache
def redis_server_pid() -> int:
    import redis

    with contextlib.closing(redis.Redis.from_url(REDIS_URL)) as client:
        return int(client.info("server")["process_id"])


def client_ports(pid: int, server_port: int) -> set[int]:
    """The local ports of process ``pid``'s TCP connections to ``server_port`` on loopback."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, inode = fields[1], fields[2], fields[9]
            if inode in inodes and int(remote.rsplit(":", 1)[1], 16) == server_port:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


async def run_slice(
    target: Server, clients: list[Client], make: Callable[[], bytes], seconds: float, out: Metered
) -> None:
    app_before = _cpu_seconds(target.pid)
    db_before = {pid: _cpu_seconds(pid) for pid in backends(target)}
    deadline = time.perf_counter() + seconds
    done = 0

    async def worker(client: Client) -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            out.tally.statuses[await client.send(make())] += 1
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients))
    elapsed = time.perf_counter() - started
    out.app_cpu += _cpu_seconds(target.pid) - app_before
    # A backend a pool opened mid-slice counts whole; one it closed is lost (unknowable).
    db_after = {pid: _cpu_seconds(pid) for pid in backends(target)}
    out.db_cpu += sum(cpu - db_before.get(pid, 0.0) for pid, cpu in db_after.items())
    out.tally.requests += done
    out.tally.seconds += elapsed
    out.tally.rates.append(done / elapsed)


def makers(replay_key: str) -> dict[str, Callable[[], bytes]]:
    return {
        "unprotected": lambda: request_bytes("/plain/things", None),
        "protected": lambda: request_bytes("/things", f"bench-{uuid.uuid4().hex}"),
        "replay": lambda: request_bytes("/things", replay_key),
    }


async def measure(
    targets: list[Server], n: int, seconds: float, rounds: int
) -> list[dict[str, Metered]]:
    """Every path of every target (this tree's server, a baseline's), taking turns."""
    slices: list[tuple[Server, list[Client], Callable[[], bytes], Metered]] = []
    results: list[dict[str, Metered]] = []
    for target in targets:
        clients = await open_clients(target.url, n)
        replay_key = f"bench-replay-{uuid.uuid4().hex}"
        assert await clients[0].send(request_bytes("/things", replay_key)) == 201
        make = makers(replay_key)
        results.append({name: Metered() for name in PATHS})
        slices += [(target, clients, make[name], results[-1][name]) for name in PATHS]
    for target, clients, make_one, _ in slices:  # warm every path (connections, statements)
        await run_slice(target, clients, make_one, min(0.5, seconds), Metered())
    for round_ in range(rounds):
        shift = round_ % len(slices)
        for target, clients, make_one, out in [*slices[shift:], *slices[:shift]]:
            await run_slice(target, clients, make_one, seconds, out)
    for _, clients, _, _ in slices[:: len(PATHS)]:
        for client in clients:
            client.writer.close()
    return results


async def count_round_trips(target: Server, requests: int) -> dict[str, tuple[float, float]]:
    """Round trips and pool checkouts per request of each path, ``requests`` sequential each."""
    assert target.wire is not None
    (client,) = await open_clients(target.url, 1)
    replay_key = f"bench-replay-{uuid.uuid4().hex}"
    assert await client.send(request_bytes("/things", replay_key)) == 201
    make = makers(replay_key)
    counts = {}
    for name in PATHS:
        for _ in range(5):  # warm: prepared statements, pool connections
            await client.send(make[name]())
        trips, checkouts = read_counts(target.wire)
        for _ in range(requests):
            assert await client.send(make[name]()) == 201
        trips_after, checkouts_after = read_counts(target.wire)
        counts[name] = ((trips_after - trips) / requests, (checkouts_after - checkouts) / requests)
    client.writer.close()
    return counts


def paired(numerator: Tally, denominator: Tally) -> tuple[float, float, float]:
    ratios = [n / d for n, d in zip(numerator.rates, denominator.rates, strict=True) if d]
    return statistics.median(ratios), min(ratios), max(ratios)


def timing_options(doc: str | None) -> argparse.ArgumentParser:
    """The options of every bench built on this one: slices, rounds, clients."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="length of one slice")
    parser.add_argument("--rounds", type=int, default=5, help="slices per path")
    parser.add_argument("--clients", default="1,16", help="concurrent clients, comma-separated")
    return parser


def timed(
    names: list[str],
    targets: list[Server],
    args: argparse.Namespace,
    throughput: list[str],
    cpu: list[str],
) -> None:
    """Every target's three paths at each ``--clients``, taking turns; rows appended."""
    for n in [int(c) for c in args.clients.split(",")]:
        measured = asyncio.run(measure(targets, n, args.seconds, args.rounds))
        for name, results in zip(names, measured, strict=True):
            throughput.append(throughput_row(name, n, results))
            cpu.extend(cpu_rows(name, n, results))
            print(throughput[-1], file=sys.stderr, flush=True)


def print_timed(first_column: str, throughput: list[str], cpu: list[str]) -> None:
    print(
        f"| {first_column} | clients | unprotected req/s | protected req/s "
        "| protected ÷ unprotected (median, min–max) | replay req/s | replay ÷ protected "
        "| non-2xx |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(throughput))
    print()
    print(
        f"| {first_column} | clients | path | app server CPU µs/req | store server CPU µs/req "
        "| total | added by protection |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    print("\n".join(cpu))
    print()


def main(argv: list[str] | None = None) -> int:
    parser = timing_options(__doc__)
    parser.add_argument("--stores", default="sqlite,postgres,redis")
    parser.add_argument("--count", type=int, default=200, help="requests per path counted")
    parser.add_argument("--only-count", action="store_true", help="round trips only, no timing")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a tree holding the 'before' src/ (e.g. git archive main src, unpacked): a second "
        "server runs on it, its paths interleaved with this tree's",
    )
    args = parser.parse_args(argv)
    throughput, cpu, trips = [], [], []
    with tempfile.TemporaryDirectory() as workdir:
        for store in args.stores.split(","):
            with store_settings(store, Path(workdir)) as settings, contextlib.ExitStack() as stack:
                targets = [stack.enter_context(server(settings))]
                names = [store]
                if args.baseline is not None:
                    # Its own schema, prefix or file, so the two servers share no records.
                    (Path(workdir) / "before").mkdir(exist_ok=True)
                    before = stack.enter_context(store_settings(store, Path(workdir) / "before"))
                    targets.append(stack.enter_context(server(before, tree=args.baseline)))
                    names.append(f"{store} (before)")
                if not args.only_count:
                    timed(names, targets, args, throughput, cpu)
                wire = Path(workdir) / f"wire-{store}"
                wire.mkdir()
                with server(settings, wire) as target:
                    counted = asyncio.run(count_round_trips(target, args.count))
                trips.append(
                    f"| {store} | middleware | "
                    + " | ".join(f"{trip:.2f} ({out:.2f})" for trip, out in counted.values())
                    + " |"
                )
    print_timed("store", throughput, cpu)
    print("| store | mode | round trips (pool checkouts): unprotected | protected | replay |")
    print("| --- | --- | ---: | ---: | ---: |")
    print("\n".join(trips))
    return 0


def throughput_row(store: str, n: int, results: dict[str, Metered]) -> str:
    plain, protected, replay = (results[name].tally for name in PATHS)
    ratio, low, high = paired(protected, plain)
    replay_ratio, _, _ = paired(replay, protected)
    odd = sum(c for r in results.values() for s, c in r.tally.statuses.items() if s >= 300)
    return (
        f"| {store} | {n} | {plain.rate:,.0f} | {protected.rate:,.0f} "
        f"| {protected.rate / plain.rate:.2f} ({ratio:.2f}, {low:.2f}–{high:.2f}) "
        f"| {replay.rate:,.0f} | {replay_ratio:.2f} | {odd} |"
    )


def cpu_rows(store: str, n: int, results: dict[str, Metered]) -> list[str]:
    def per_request(name: str) -> tuple[float, float]:
        one = results[name]
        count = max(one.tally.requests, 1)
        return one.app_cpu / count * 1e6, one.db_cpu / count * 1e6

    base = sum(per_request("unprotected"))
    rows = []
    for name in PATHS:
        app, db = per_request(name)
        db_text = f"{db:,.0f}" if "postgres" in store or "redis" in store else "–"
        rows.append(
            f"| {store} | {n} | {name} | {app:,.0f} | {db_text} | {app + db:,.0f} "
            f"| {app + db - base:+,.0f} |"
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
