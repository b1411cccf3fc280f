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

Then first executions under concurrency (``--tasks``, default 1 and 16): that many
tasks on one loop, each claiming a fresh key, yielding once (its handler) and
completing it, through ``AsyncSQLiteStore``: CPU and wall time per execution, and
the share of the claims and completions that hopped to the store's thread (the
ones that ran its ``sync`` store's methods there).
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


async def first_executions(tasks: int, count: int) -> tuple[float, float, float]:
    """CPU µs, wall µs per first execution, and the share of writes that hopped."""
    from idemflow import Response, State
    from idemflow.stores.sqlite import AsyncSQLiteStore

    with tempfile.TemporaryDirectory(prefix="idemflow-hop-") as folder:
        store = AsyncSQLiteStore(Path(folder) / "keys.db")
        await store.migrate()
        hopped = 0

        def counted(method: Callable[..., object]) -> Callable[..., object]:
            def on_the_thread(*args: object) -> object:
                nonlocal hopped
                hopped += 1
                return method(*args)

            return on_the_thread

        sync = store.sync
        sync.claim, sync.complete = counted(sync.claim), counted(sync.complete)  # type: ignore[method-assign]
        started = iter(range(count))
        response = Response(201, b"{}")

        async def worker() -> None:
            for n in started:
                now = time.time()
                claim = await store.claim(intent(f"first-{n}"), lease(), now, now + RETENTION)
                await asyncio.sleep(0)  # the handler
                done = time.time()
                await store.complete(
                    claim.record, State.COMPLETED, response, done, done + RETENTION
                )

        try:
            wall, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(worker() for _ in range(tasks)))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            await store.close()
    return cpu / count * 1e6, wall / count * 1e6, hopped / (2 * count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=5000, help="operations per path")
    parser.add_argument("--rounds", type=int, default=6, help="turns those are cut into")
    parser.add_argument("--tasks", default="1,16", help="concurrent first executions")
    args = parser.parse_args(argv)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    result = asyncio.run(measure(args.count, args.rounds))
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| operation | wall µs/op | CPU µs/op (every thread) |")
    print("| --- | ---: | ---: |")
    for name, (wall, cpu) in result.items():
        print(f"| {name} | {wall:,.1f} | {cpu:,.1f} |")
    print("\n| first executions: tasks | CPU µs each | wall µs each | writes that hopped |")
    print("| ---: | ---: | ---: | ---: |")
    for tasks in (int(n) for n in args.tasks.split(",")):
        cpu, wall, share = asyncio.run(first_executions(tasks, args.count))
        print(f"| {tasks} | {cpu:,.0f} | {wall:,.0f} | {share:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
