"""
What a protected Django request costs PostgreSQL, values bound on the client or on the server.

Run::

    .venv/bin/python -m bench.bench_django_binding [--requests 600] [--rounds 3]
                                                   [--modes client,server]

The Django example shop (``examples/django_app``, DRF) on a PostgreSQL database
of its own, called as WSGI in one process (``bench/bench_edge.py``'s
``wsgi_caller``), once with Django's default client-side binding and once with
``DATABASES[…]["OPTIONS"] = {"server_side_binding": True}`` (the shop's
``SHOP_SERVER_SIDE_BINDING=1``), each in a process of its own. Per request, on
the ``unprotected`` twin and the ``protected`` endpoint: the CPU of the
PostgreSQL backend serving the shop's one connection (``pg_backend_pid()``,
user + system from ``/proc/<pid>/stat``) and of this process
(``time.process_time``). Both are CPU, not time: another job on the cores
hardly moves them, where it moves throughput a lot. The round trips are the
same in both modes (4 per protected request); what changes is what the server
does with each statement: with client-side binding every statement is a simple
query, parsed and planned each time (and the fused completion, a CTE, costs
more to plan than the ``UPDATE`` it wraps); with server-side binding psycopg
prepares what runs often (its ``prepare_threshold``) and the fenced completion
and its ``COMMIT`` go in one pipeline, prepared.

``--run MODE`` is one measuring process (``client`` or ``server``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.bench_fenced_commit import backend_cpu

ROOT = Path(__file__).resolve().parent.parent
PATHS = ("unprotected", "protected")


def measure(requests: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Per path and round: (backend µs, client µs) per request."""
    from bench.bench_edge import wsgi_caller

    calls = wsgi_caller("django")
    for _ in range(60):
        for path in PATHS:
            assert calls[path]() in (200, 201)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = int(cursor.fetchone()[0])
    found: dict[str, list[tuple[float, float]]] = {path: [] for path in PATHS}
    for _ in range(rounds):
        for path in PATHS:
            call = calls[path]
            client, server = time.process_time(), backend_cpu(pid)
            for _ in range(requests):
                assert call() in (200, 201)
            client, server = time.process_time() - client, backend_cpu(pid) - server
            found[path].append((server / requests * 1e6, client / requests * 1e6))
    with connection.cursor() as cursor:  # the same connection served every request
        cursor.execute("SELECT pg_backend_pid()")
        assert int(cursor.fetchone()[0]) == pid
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=600, help="per path and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="client,server", help="in this order")
    parser.add_argument("--run", choices=("client", "server"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        os.environ["SHOP_SERVER_SIDE_BINDING"] = "1" if args.run == "server" else "0"
        print(json.dumps(measure(args.requests, args.rounds)))
        return 0
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = {}
    for mode in args.modes.split(","):
        command = [sys.executable, "-m", "bench.bench_django_binding", "--run", mode]
        command += ["--requests", str(args.requests), "--rounds", str(args.rounds)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| binding | path | PostgreSQL backend µs/req: min (median) | Django process µs/req |")
    print("| --- | --- | ---: | ---: |")
    for mode, found in results.items():
        for path in PATHS:
            server = [s for s, _ in found[path]]
            client = [c for _, c in found[path]]
            print(
                f"| {mode} | {path} | {min(server):,.0f} ({statistics.median(server):,.0f}) "
                f"| {min(client):,.0f} ({statistics.median(client):,.0f}) |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
