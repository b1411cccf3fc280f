"""
The core paths in instructions per operation (callgrind): a figure the machine's load cannot move.

Run::

    .venv/bin/python -m bench.bench_core_ir [--backends sqlite] [--paths claim,replay]
                                            [--baseline TREE] [--count 2000]

One thread, in one process: ``bench.bench_core``'s raw side (the dialect's
own statements through ``sqlite3``) and its library side (``Idempotency.run``)
on a SQLite file, or the library's store alone (``store``: the store's
``claim`` and ``complete`` without the driver). Each is run under
``valgrind --tool=callgrind`` twice, with ``--count`` and 3 × ``--count``
operations after the same set-up and warm-up; the difference of the
instructions executed, divided by the operations, is the path's instructions
per operation (start-up and warm-up cancel out). SQLite's own work (the
statement) is in both sides alike, so library / raw here is the one-thread
CPU ratio without the noise of a shared machine. With ``--baseline TREE``
every library figure is taken again on the idemflow of ``TREE/src``
(``git archive main src | tar -x -C /tmp/before``).

Needs ``valgrind``. ``--run SIDE PATH N`` is one measured process.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("raw", "store", "library")
PATHS = ("claim", "replay")
WARMUP = 300


def operations(folder: Path, side: str, path: str) -> Callable[[], object]:
    from idemflow import Idempotency
    from idemflow.stores.sqlite import SQLiteStore

    from . import bench_core as core

    store = SQLiteStore(folder / "keys.db")
    store.migrate()
    idem = Idempotency(store)
    replay_keys = core.prepare_replay(idem, "ir")
    fresh = core.Keys("ir", side)
    if side == "raw":
        raw = core.RawSQLite(folder / "keys.db", store.dialect)
        return raw.claim_complete(fresh) if path == "claim" else raw.replay(replay_keys)
    if side == "store":
        if path == "claim":
            return core.store_claim_complete(store, fresh)
        return core.store_replay(store, replay_keys)
    if path == "claim":
        return core.library_claim_complete(idem, fresh)
    return core.library_replay(idem, replay_keys)


def run(side: str, path: str, count: int) -> None:
    with tempfile.TemporaryDirectory(prefix="idemflow-bench-ir-") as folder:
        op = operations(Path(folder), side, path)
        for _ in range(WARMUP):
            op()
        for _ in range(count):
            op()


_COLLECTED = re.compile(r"Collected : (\d+)")


def instructions(side: str, path: str, count: int, tree: Path | None) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*([str(tree / "src")] if tree is not None else []), str(ROOT), env.get("PYTHONPATH", "")]
    )
    command = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    command += [sys.executable, "-m", "bench.bench_core_ir", "--run", side, path, str(count)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    found = _COLLECTED.search(done.stderr)
    assert found is not None, done.stderr[-2000:]
    return int(found.group(1))


def per_op(side: str, path: str, count: int, tree: Path | None) -> float:
    few = instructions(side, path, count, tree)
    many = instructions(side, path, 3 * count, tree)
    return (many - few) / (2 * count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--count", type=int, default=2000, help="operations of the smaller run")
    parser.add_argument("--baseline", type=Path, help="a tree holding the 'before' src/")
    parser.add_argument("--run", nargs=3, metavar=("SIDE", "PATH", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        side, path, n = args.run
        run(side, path, int(n))
        return 0
    started = time.monotonic()
    sides = [s for s in args.sides.split(",") if s != "raw"]
    trees: list[tuple[str, Path | None]] = [("", None)]
    if args.baseline is not None:
        trees.insert(0, ("before ", args.baseline))
    columns = [f"{name}{side}" for side in sides for name, _ in trees]
    print("| SQLite, 1 thread | raw Ir/op | " + " | ".join(f"{c} Ir/op" for c in columns), end="")
    print(" | " + " | ".join(f"raw / {c}" for c in columns) + " |")
    print("| --- | ---: |" + " ---: |" * (2 * len(columns)))
    for path in args.paths.split(","):
        raw = per_op("raw", path, args.count, None)
        figures = [per_op(side, path, args.count, tree) for side in sides for _, tree in trees]
        cells = [f"{raw:,.0f}", *(f"{f:,.0f}" for f in figures)]
        cells += [f"{raw / f:.2f}" for f in figures]
        label = "claim+complete" if path == "claim" else path
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
