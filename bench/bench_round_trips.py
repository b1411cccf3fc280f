"""
Round trips to PostgreSQL per request, counted in the server's driver, per mode and app.

Run::

    .venv/bin/python -m bench.bench_round_trips [--count 200]
                                                [--targets demo,demo-single,flask,django]

Each target is started with the counters of ``bench/_wire`` (every request
psycopg sends and waits for: a statement, its ``PREPARE``, ``BEGIN``,
``COMMIT``, ``ROLLBACK``, a pool's check; and every ``psycopg_pool`` checkout,
which does not see SQLAlchemy's pool nor Django's persistent connection) and
gets ``--count`` sequential requests per path after a warm-up, one keep-alive
connection:

- ``demo``: ``idemflow demo --bench-routes`` on PostgreSQL (transactional,
  two commits: the claim commits alone; the three-phase payment with its
  ``payment_created`` checkpoint), ``POST /_bench/payments`` unprotected;
- ``demo-single``: the same with ``--claim-commit single``;
- ``flask``, ``django``: the example shops of ``bench/bench_frameworks.py``
  under gunicorn (the claim commits alone, then the payment row and the
  completion commit together), against their unprotected twins.

The middleware rows (and Redis) come from ``bench/bench_middleware.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from bench import bench_frameworks, bench_http
from bench._wire import read_counts, wire_env

PATHS = ("unprotected", "protected", "replay")


@contextlib.contextmanager
def counted_env(wire: Path) -> Iterator[None]:
    """Children started inside count their round trips into ``wire``."""
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "IDEMFLOW_BENCH_WIRE")}
    os.environ.update(wire_env(wire))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def demo(workdir: Path, *flags: str) -> Iterator[tuple[str, dict[str, Callable[[], bytes]]]]:
    replay = f"rt-replay-{uuid.uuid4().hex}"
    make = {
        "unprotected": lambda: bench_http.request_bytes("/_bench/payments", None),
        "protected": lambda: bench_http.request_bytes("/payments", f"rt-{uuid.uuid4().hex}"),
        "replay": lambda: bench_http.request_bytes("/payments", replay),
    }
    all_flags = ("--bench-routes", "--sweep-every", "off", *flags)
    with (
        bench_http.postgres_schema() as url,
        bench_http.run_demo(workdir, *all_flags, database_url=url) as server,
    ):
        yield server.url, make


@contextlib.contextmanager
def shop(name: str, workdir: Path) -> Iterator[tuple[str, dict[str, Callable[[], bytes]]]]:
    app = bench_frameworks.APPS[name]
    replay = f"rt-replay-{uuid.uuid4().hex}"
    make = {
        "unprotected": lambda: bench_frameworks.request_bytes(app.unprotected, "alice", None),
        "protected": lambda: bench_frameworks.request_bytes(
            app.protected, "alice", f"rt-{uuid.uuid4().hex}"
        ),
        "replay": lambda: bench_frameworks.request_bytes(app.protected, "alice", replay),
    }
    with bench_frameworks.servers([name], workdir) as shops:
        yield shops[name][1].base, make


async def count(
    url: str, make: dict[str, Callable[[], bytes]], wire: Path, n: int
) -> list[tuple[float, float]]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    client = bench_frameworks.Client(reader, writer)

    async def send(payload: bytes) -> int:
        status, _ = await client.send(payload)
        return status

    assert await send(make["replay"]()) == 201  # the replay key completes first
    per_request = []
    for name in PATHS:
        for _ in range(5):  # warm: pool connections, prepared statements
            await send(make[name]())
        trips, checkouts = read_counts(wire)
        for _ in range(n):
            status = await send(make[name]())
            assert status == 201, (name, status)
        trips_after, checkouts_after = read_counts(wire)
        per_request.append(((trips_after - trips) / n, (checkouts_after - checkouts) / n))
    writer.close()
    return per_request


TARGETS = {
    "demo": ("demo (PostgreSQL, transactional, two commits)", demo),
    "demo-single": (
        "demo (PostgreSQL, transactional, single commit)",
        lambda w: demo(w, "--claim-commit", "single"),
    ),
    "flask": ("Flask (PostgreSQL, transactional)", lambda w: shop("flask", w)),
    "django": ("Django+DRF (PostgreSQL, transactional)", lambda w: shop("django", w)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200, help="requests per path counted")
    parser.add_argument("--targets", default=",".join(TARGETS))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.targets.split(","):
            label, start = TARGETS[name]
            workdir = Path(tmp) / name
            wire = Path(tmp) / f"wire-{name}"
            workdir.mkdir()
            wire.mkdir()
            with counted_env(wire), start(workdir) as (url, make):
                counts = asyncio.run(count(url, make, wire, args.count))
            (plain, plain_out), (protected, protected_out), (replay, replay_out) = counts
            rows.append(
                f"| {label} | {plain:.2f} | {protected:.2f} | {protected - plain:+.2f} "
                f"| {replay:.2f} | {plain_out:.2f} / {protected_out:.2f} / {replay_out:.2f} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    print(
        "| app and mode | round trips: unprotected | protected | added | replay "
        "| psycopg_pool checkouts: unprotected / protected / replay |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
