"""
What the async SQLite store's hop to its thread costs, against the work it carries.

Run::

    .venv/bin/python -m bench.bench_sqlite_hop [--count 5000] [--rounds 6]

``AsyncSQLiteStore`` runs each write (the claim among them) on a thread of its own,
so that SQLite's lock waits never block the event loop: one hop there and back per
operation. Four operations take turns in rounds on one event loop, each timed in
wall-clock and in the process's CPU time (every thread's), per operation:

``hop``
    ``loop.run_in_executor`` of a function that does nothing, on a one-thread
    executor: the hop alone;
``sync replay``
    ``SQLiteStore.claim`` of a completed key, called on the loop's thread (the
    claim that loses, and the read of the record it lost to);
``async replay``
    the same claim through ``AsyncSQLiteStore.claim``: the hop and the work;
``direct``
    an ``await`` of a coroutine that returns at once, the floor of any async call.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.bench_core import RETENTION, intent, lease

Operation = Callable[[], Awaitable[object]]


async def operations(folder: Path) -> tuple[dict[str, Operation], Callable[[], Awaitable[None]]]:
    from idemflow import Response, State
    from idemflow.stores.sqlite import AsyncSQLiteStore

    store = AsyncSQLiteStore(folder / "keys.db")
    await store.migrate()
    key = intent("hop-replay")
    now = time.time()
    claim = await store.claim(key, lease(), now, now + RETENTION)
    await store.complete(claim.record, State.COMPLETED, Response(201, b"{}"), now, now + RETENTION)
    executor = ThreadPoolExecutor(1, thread_name_prefix="bench-hop")
    loop = asyncio.get_running_loop()

    def nothing() -> None:
        return None

    async def direct() -> None:
        return None

    async def hop() -> None:
        await loop.run_in_executor(executor, nothing)

    async def sync_replay() -> None:
        now = time.time()
        if store.sync.claim(key, lease(), now, now + RETENTION).owned:
            raise AssertionError("a completed key was claimed")

    async def async_replay() -> None:
        now = time.time()
        if (await store.claim(key, lease(), now, now + RETENTION)).owned:
            raise AssertionError("a completed key was claimed")

    async def close() -> None:
        executor.shutdown()
        await store.close()

    ops: dict[str, Operation] = {
        "direct": direct,
        "hop": hop,
        "sync replay": sync_replay,
        "async replay": async_replay,
    }
    return ops, close


async def measure(count: int, rounds: int) -> dict[str, tuple[float, float]]:
    with tempfile.TemporaryDirectory(prefix="idemflow-hop-") as folder:
        ops, close = await operations(Path(folder))
        try:
            for op in ops.values():  # warm: connections, the executors' threads
                for _ in range(200):
                    await op()
            wall = dict.fromkeys(ops, 0.0)
            cpu = dict.fromkeys(ops, 0.0)
            names = list(ops)
            per_round = max(count // rounds, 1)
            for round_ in range(rounds):
                shift = round_ % len(names)
                for name in names[shift:] + names[:shift]:
                    op = ops[name]
                    started, before = time.perf_counter(), time.process_time()
                    for _ in range(per_round):
                        await op()
                    wall[name] += time.perf_counter() - started
                    cpu[name] += time.process_time() - before
        finally:
            await close()
    done = per_round * rounds
    return {name: (wall[name] / done * 1e6, cpu[name] / done * 1e6) for name in ops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=5000, help="operations per path")
    parser.add_argument("--rounds", type=int, default=6, help="turns those are cut into")
    args = parser.parse_args(argv)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    result = asyncio.run(measure(args.count, args.rounds))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| operation | wall µs/op | CPU µs/op (every thread) |")
    print("| --- | ---: | ---: |")
    for name, (wall, cpu) in result.items():
        print(f"| {name} | {wall:,.1f} | {cpu:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
