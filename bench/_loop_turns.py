"""
How many event-loop iterations, and how much CPU, one request of an ASGI app takes.

Run by ``bench/bench_peers.py --turns`` in each target's own environment::

    python -m bench._loop_turns MODULE [--count N]

``MODULE`` (e.g. ``bench._minimal_app``, ``bench.peers.peer_idemkit``) is imported, its
``app`` started (lifespan) and called in process, no server or socket, with the three
paths of ``bench_middleware`` (unprotected, protected with a fresh key, replay). An
iteration is one ``BaseEventLoop._run_once``: when nothing else is ready (one client),
each is a wake-up of the loop and an ``epoll`` call. Counted, not timed, though a loaded
machine (a slower store) adds some; the CPU is this process's (``time.process_time``),
the store's not in it.
Prints one JSON object: path → [iterations, CPU µs] per request, and the statuses seen.
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.base_events
import importlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from bench._harness import lifespan, post_over_asgi

BODY = b'{"amount":1000,"currency":"EUR","customer":"ada"}'


class Turns:
    """Counts the iterations of every event loop of this process."""

    def __init__(self) -> None:
        self.count = 0
        original = asyncio.base_events.BaseEventLoop._run_once  # type: ignore[attr-defined]

        def counted(loop: Any) -> None:
            self.count += 1
            original(loop)

        asyncio.base_events.BaseEventLoop._run_once = counted  # type: ignore[attr-defined]


async def measure(module: str, count: int, turns: Turns) -> dict[str, Any]:
    app = importlib.import_module(module).app
    stop = await lifespan(app)
    done = f"turns-{uuid.uuid4().hex}"
    paths: dict[str, Callable[[], tuple[str, str | None]]] = {
        "unprotected": lambda: ("/plain/things", None),
        "protected": lambda: ("/things", f"turns-{uuid.uuid4().hex}"),
        "replay": lambda: ("/things", done),
    }
    for make in paths.values():  # warm: pool connections, prepared statements, the done key
        for _ in range(50):
            await post_over_asgi(app, *make(), BODY)
    per_request = {}
    for name, make in paths.items():
        statuses = set()
        turns.count, started = 0, time.process_time()
        for _ in range(count):
            statuses.add(await post_over_asgi(app, *make(), BODY))
        cpu = (time.process_time() - started) / count * 1e6
        per_request[name] = (turns.count / count, cpu, sorted(statuses))
    await stop()
    return per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module")
    parser.add_argument("--count", type=int, default=1000, help="requests per path")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.module, args.count, Turns()))))


if __name__ == "__main__":
    main()
