"""
What one protected request costs in counts: round trips, loop iterations, tasks, our CPU.

Run::

    .venv/bin/python -m bench.bench_counts [--count 500] [--stores sqlite,postgres,redis]

Each store gets a process of its own running ``bench/_minimal_app.py`` (middleware
mode), the ASGI app called directly (no server, no socket), ``--count`` requests per
path after a warm-up. Per request: store round trips (``bench/_wire``'s counters;
SQLite makes none), event-loop iterations (``BaseEventLoop._run_once``), tasks
created (``asyncio.Task``, directly or by ``create_task``), and app CPU
(``time.process_time``). "added" is protected (or replay) minus unprotected; "floor"
is the same number of round trips of a trivial command (``PING``, a prepared
``SELECT 1``) through the raw driver.

``--slices N`` runs the paths in turns, N slices each, and takes each path's least CPU
per request over its slices (a loaded machine's bursts fall on some slices, not all).
``--bytecodes`` adds what a loaded machine does not move: Python bytecodes executed and
Python calls made per request (``sys.settrace`` with opcode events, over 200 more
requests per path), in all, and in idemflow's own code ("ours").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench._harness import lifespan, post_over_asgi
from bench._loop_turns import BODY, Turns
from bench._wire import read_counts, wire_env

PATHS = ("unprotected", "protected", "replay")


class Tasks:
    """Counts the tasks created: ``asyncio.Task`` made directly or by ``loop.create_task``."""

    def __init__(self) -> None:
        self.count = 0
        tally = self

        class Counted(asyncio.Task):  # type: ignore[type-arg]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                tally.count += 1
                super().__init__(*args, **kwargs)

        asyncio.Task = asyncio.tasks.Task = Counted  # type: ignore[misc]


async def _floor(app: Any, trips: float, count: int) -> float:
    """CPU µs of ``trips`` trivial round trips through the raw driver, per request."""
    kind = os.environ["BENCH_STORE"]
    whole = round(trips * count)
    if kind == "redis":
        client = app.state.store.client
        send = lambda: client.execute_command("PING")  # noqa: E731
    elif kind == "postgres":
        import psycopg

        conn = await psycopg.AsyncConnection.connect(os.environ["BENCH_URL"], autocommit=True)
        send = lambda: conn.execute("SELECT 1", prepare=True)  # noqa: E731
    else:
        return 0.0
    for _ in range(50):
        await send()
    started = time.process_time()
    for _ in range(whole):
        await send()
    return (time.process_time() - started) / count * 1e6


class Bytecodes:
    """Counts bytecodes executed and calls made while on, in all and in idemflow's code."""

    def __init__(self) -> None:
        self.ops = self.calls = self.our_ops = self.our_calls = 0

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        ours = "/idemflow/" in frame.f_code.co_filename
        if event == "call":
            frame.f_trace_opcodes = True
            self.calls += 1
            self.our_calls += ours
        elif event == "opcode":
            self.ops += 1
            self.our_ops += ours
        return self._trace

    async def count(self, send: Any, requests: int) -> list[float]:
        self.ops = self.calls = self.our_ops = self.our_calls = 0
        sys.settrace(self._trace)
        try:
            for _ in range(requests):
                await send()
        finally:
            sys.settrace(None)
        return [n / requests for n in (self.ops, self.our_ops, self.calls, self.our_calls)]


async def child(count: int, wire: Path, bytecodes: bool = False, slices: int = 1) -> dict[str, Any]:
    import bench._minimal_app as minimal

    turns, tasks = Turns(), Tasks()
    app = minimal.app
    stop = await lifespan(app)
    done = f"counts-{uuid.uuid4().hex}"
    make = {
        "unprotected": lambda: ("/plain/things", None),
        "protected": lambda: ("/things", f"counts-{uuid.uuid4().hex}"),
        "replay": lambda: ("/things", done),
    }
    for path in PATHS:  # warm: pool connections, prepared statements, the done key
        for _ in range(50):
            await post_over_asgi(app, *make[path](), BODY)
    rows: dict[str, Any] = {
        path: {"trips": 0.0, "turns": 0.0, "tasks": 0.0, "cpu": math.inf, "statuses": []}
        for path in PATHS
    }
    each = count // slices
    for _ in range(slices):  # the paths take turns, slice by slice
        for path in PATHS:
            row, statuses = rows[path], set()
            trips_before = read_counts(wire)[0]
            turns.count = tasks.count = 0
            started = time.process_time()
            for _ in range(each):
                statuses.add(await post_over_asgi(app, *make[path](), BODY))
            row["cpu"] = min(row["cpu"], (time.process_time() - started) / each * 1e6)
            row["trips"] += (read_counts(wire)[0] - trips_before) / each / slices
            row["turns"] += turns.count / each / slices
            row["tasks"] += tasks.count / each / slices
            row["statuses"] = sorted(statuses | set(row["statuses"]))
    for path in ("protected", "replay"):
        rows[path]["floor"] = await _floor(app, rows[path]["trips"], count)
    if bytecodes:
        for path in PATHS:
            send = lambda path=path: post_over_asgi(app, *make[path](), BODY)  # noqa: E731
            rows[path]["bytecodes"] = await Bytecodes().count(send, 200)
    await stop()
    return rows


def run_store(store: str, count: int, bytecodes: bool = False, slices: int = 1) -> dict[str, Any]:
    from bench.bench_middleware import store_settings

    with tempfile.TemporaryDirectory() as workdir, store_settings(store, Path(workdir)) as env:
        wire = Path(workdir) / "wire"
        wire.mkdir()
        full = {**os.environ, **env, **wire_env(wire), "BENCH_DIR": workdir}
        command = [sys.executable, "-m", "bench.bench_counts", "--child", str(wire)]
        command += ["--count", str(count), "--slices", str(slices)]
        command += ["--bytecodes"] if bytecodes else []
        out = subprocess.run(command, env=full, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=500, help="requests per path")
    parser.add_argument("--stores", default="sqlite,postgres,redis")
    parser.add_argument("--bytecodes", action="store_true", help="count bytecodes and calls")
    parser.add_argument("--slices", type=int, default=1, help="app CPU: the least of N slices")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        rows = asyncio.run(child(args.count, Path(args.child), args.bytecodes, args.slices))
        print(json.dumps(rows))
        return
    head = "| store | path | round trips | loop turns | tasks | app CPU µs | added µs | floor µs |"
    counted = 4 * args.bytecodes
    print(head + " bytecodes | ours | calls | ours |" * args.bytecodes)
    print("| --- | --- |" + " ---: |" * (6 + counted))
    for store in args.stores.split(","):
        rows = run_store(store, args.count, args.bytecodes, args.slices)
        base = rows["unprotected"]["cpu"]
        for path in PATHS:
            row = rows[path]
            added = "" if path == "unprotected" else f"{row['cpu'] - base:.0f}"
            floor = f"{row['floor']:.0f}" if "floor" in row else ""
            counted = "".join(f" {n:.0f} |" for n in row.get("bytecodes", ()))
            print(
                f"| {store} | {path} | {row['trips']:.2f} | {row['turns']:.2f} | "
                f"{row['tasks']:.2f} | {row['cpu']:.0f} | {added} | {floor} |{counted}"
            )


if __name__ == "__main__":
    main()
