"""
SQLite's writers: queued on the store's per-file lock, or left to SQLite's busy handler.

Run::

    .venv/bin/python -m bench.bench_sqlite_lock [--callers 16] [--seconds N] [--slices N]

``SQLiteStore`` makes this process's writers wait on one lock per database
file (``stores/sqlite``: woken the moment it is free) instead of SQLite's busy
handler, which sleeps 1, 2, 5, 10 … ms between tries, and fails the write
once ``busy_timeout`` has been slept. Three contenders take turns in short
slices on one file, ``--callers`` threads each: the store as shipped
(``lock``), the same store with the lock swapped for a no-op (``busy
handler``: what it did before), and raw ``sqlite3`` sending the same
statements (``bench.bench_core``'s raw side). Each reports operations per
second and the latency of every operation: the median, the 99th percentile
and the slowest, where the busy handler's sleeps show.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from idemflow import Idempotency
from idemflow.stores.sqlite import SQLiteStore

from . import bench_core as core
from ._harness import parse_list


class _NoLock:
    """Stands in for the writer lock: every writer goes straight to SQLite."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        return None


def unlocked(path: Path) -> SQLiteStore:
    """A store whose writers meet SQLite's busy handler, as before the lock."""
    store = SQLiteStore(path)
    connections: Any = store._connections
    opened = connections._open

    def open_without_lock() -> Any:
        writer = opened()
        writer._lock = _NoLock()
        return writer

    connections._open = open_without_lock
    return store


def timed_slice(op: Callable[[], object], callers: int, seconds: float) -> list[float]:
    """Every thread runs ``op`` for ``seconds``; the latency of each operation done."""
    start = threading.Barrier(callers + 1)
    latencies: list[float] = []
    guard = threading.Lock()
    failures: list[BaseException] = []

    def work() -> None:
        mine: list[float] = []
        start.wait()
        deadline = time.perf_counter() + seconds
        try:
            while (now := time.perf_counter()) < deadline:
                op()
                mine.append(time.perf_counter() - now)
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller: a failure measures nothing
            failures.append(exc)
        with guard:
            latencies.extend(mine)

    threads = [threading.Thread(target=work) for _ in range(callers)]
    for thread in threads:
        thread.start()
    start.wait()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return latencies


def run(callers: int, seconds: float, slices: int) -> None:
    with tempfile.TemporaryDirectory(prefix="idemflow-bench-lock-") as folder:
        path = Path(folder) / "keys.db"
        locked = SQLiteStore(path)
        locked.migrate()
        free = unlocked(path)
        raw = core.RawSQLite(path, locked.dialect)
        done = core.prepare_replay(Idempotency(locked), "lock")
        paths = {
            "claim+complete": {
                "lock": core.library_claim_complete(Idempotency(locked), core.Keys("l", "c")),
                "busy handler": core.library_claim_complete(Idempotency(free), core.Keys("f", "c")),
                "raw": raw.claim_complete(core.Keys("r", "c")),
            },
            "replay": {
                "lock": core.library_replay(Idempotency(locked), done),
                "busy handler": core.library_replay(Idempotency(free), done),
                "raw": raw.replay(done),
            },
        }
        print(
            f"{callers} threads, {slices} interleaved slices of {seconds / slices:g} s each; "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
        )
        print("| path | writers | ops/s | median ms | p99 ms | max ms | ops/s vs lock |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for path_name, ops in paths.items():
            names = list(ops)
            for name in names:
                timed_slice(ops[name], callers, 0.3)  # warm up
            seen: dict[str, list[float]] = {name: [] for name in names}
            for round_ in range(slices):
                shift = round_ % len(names)
                for name in [*names[shift:], *names[:shift]]:
                    seen[name] += timed_slice(ops[name], callers, seconds / slices)
            base = len(seen["lock"])
            for name in names:
                got = sorted(seen[name])
                print(
                    f"| {path_name} | {name} | {len(got) / seconds:,.0f} "
                    f"| {statistics.median(got) * 1e3:.2f} "
                    f"| {got[int(len(got) * 0.99)] * 1e3:.1f} | {got[-1] * 1e3:.0f} "
                    f"| {len(got) / base:.2f} |",
                    flush=True,
                )
        raw.close()
        free.close()
        locked.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_sqlite_lock", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--callers", default="16", help="threads (16; a list runs each)")
    parser.add_argument("--seconds", type=float, default=12.0, help="per contender and path")
    parser.add_argument("--slices", type=int, default=12, help="interleaved slices (12)")
    args = parser.parse_args(argv)
    for callers in parse_list(args.callers):
        run(int(callers), args.seconds, args.slices)


if __name__ == "__main__":
    main()
