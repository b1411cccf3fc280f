"""
psycopg against asyncpg on the claim's statement: CPU per statement, one connection.

Run (asyncpg is no dependency of idemflow: install it beside, e.g. ``pip install
--target DIR asyncpg`` and put DIR on ``PYTHONPATH``)::

    .venv/bin/python -m bench.bench_pg_drivers [--count 2000] [--rounds 5] [--url URL]

The claim's shape (``INSERT … ON CONFLICT DO NOTHING RETURNING``) with a fresh key
each time, psycopg's prepared ``execute`` and asyncpg's prepared statement, alternating,
``--rounds`` times ``--count`` statements, in a table of its own dropped afterwards.
Prints the median CPU (``time.process_time``) and wall µs per statement, and every round's
CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

TABLE = f"bench_drivers_{uuid.uuid4().hex[:8]}"


async def main(url: str, count: int, rounds: int) -> None:
    import asyncpg  # not a dependency: measured, not adopted (docs/benchmarks.md)

    fast: Any = await asyncpg.connect(url)
    await fast.execute(f"CREATE TABLE {TABLE} (k text PRIMARY KEY, v text)")
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    claim = await fast.prepare(
        f"INSERT INTO {TABLE} (k, v) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING k"
    )
    query = f"INSERT INTO {TABLE} (k, v) VALUES (%s, %s) ON CONFLICT DO NOTHING RETURNING k"

    async def with_psycopg() -> None:
        cursor = await conn.execute(query, (uuid.uuid4().hex, "x"), prepare=True)
        await cursor.fetchone()

    async def with_asyncpg() -> None:
        await claim.fetchrow(uuid.uuid4().hex, "x")

    drivers: dict[str, Callable[[], Awaitable[None]]] = {
        "psycopg": with_psycopg,
        "asyncpg": with_asyncpg,
    }
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in drivers}
    try:
        for send in drivers.values():
            for _ in range(100):
                await send()
        for _ in range(rounds):
            for name, send in drivers.items():
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(count):
                    await send()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                seen[name].append((cpu / count * 1e6, wall / count * 1e6))
    finally:
        await fast.execute(f"DROP TABLE {TABLE}")
        await fast.close()
        await conn.close()
    print("| driver | CPU µs (median) | wall µs (median) | rounds' CPU |")
    print("| --- | ---: | ---: | --- |")
    for name, rows in seen.items():
        cpus, walls = sorted(row[0] for row in rows), sorted(row[1] for row in rows)
        every = ", ".join(f"{row[0]:.0f}" for row in rows)
        print(f"| {name} | {cpus[rounds // 2]:.0f} | {walls[rounds // 2]:.0f} | {every} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="statements per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--url", default="postgresql://postgres@localhost:5432/postgres")
    args = parser.parse_args()
    asyncio.run(main(args.url, args.count, args.rounds))
