"""
What a shielded store step costs over the same step awaited bare: CPU, tasks, loop turns.

Run::

    .venv/bin/python -m bench.bench_shield [--count 20000] [--rounds 7]

The step waits once on a future the loop settles (``call_soon``), as a store's round trip
does; awaited bare, then through ``_async.driver.async_shielded``, alternating, ``--rounds``
times ``--count`` steps in one process. Prints the median CPU µs per step
(``time.process_time``) with every round's, and the tasks and loop turns per step.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench._loop_turns import Turns
from bench.bench_counts import Tasks
from idemflow._async.driver import async_shielded


async def _step(loop: asyncio.AbstractEventLoop) -> int:
    settled = loop.create_future()
    loop.call_soon(settled.set_result, 1)
    result: int = await settled
    return result


async def _bare(step: Awaitable[int]) -> int:
    return await step


async def _round(wrap: Callable[[Awaitable[int]], Awaitable[Any]], count: int) -> float:
    loop = asyncio.get_running_loop()
    started = time.process_time()
    for _ in range(count):
        await wrap(_step(loop))
    return (time.process_time() - started) / count * 1e6


async def main(count: int, rounds: int) -> None:
    turns, tasks = Turns(), Tasks()
    ways = {"bare": _bare, "shielded": async_shielded}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, wrap in ways.items():
            cpu[name].append(await _round(wrap, count))
    print("| step | CPU µs (median) | rounds | tasks | loop turns |")
    print("| --- | ---: | --- | ---: | ---: |")
    for name, wrap in ways.items():
        turns.count = tasks.count = 0
        await _round(wrap, count)
        median = sorted(cpu[name])[len(cpu[name]) // 2]
        every = ", ".join(f"{value:.1f}" for value in cpu[name])
        print(
            f"| {name} | {median:.1f} | {every} | {tasks.count / count:.2f} | "
            f"{turns.count / count:.2f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(main(args.count, args.rounds))
