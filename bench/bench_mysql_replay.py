"""
What a replay costs the client on MySQL/MariaDB, in process: this tree against a baseline.

Run (from the repository root)::

    git worktree add /tmp/before <commit>     # or: git archive <commit> src | tar -x -C /tmp/before
    .venv/bin/python -m bench.bench_mysql_replay --baseline /tmp/before [--rounds 3]

Each round runs, for each tree in turn (this one, then the baseline; the order swaps
every round), a fresh Python process on that tree's ``src``: 256 keys are completed
through ``Idempotency.run`` (``MySQLStore``, PyMySQL) and ``AsyncIdempotency.run``
(``AsyncMySQLStore``, asyncmy), then replayed 12 times each, one caller. Printed per
process: the process CPU time and the wall-clock time per replay. Each process's key
tables are dropped at its end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid
from pathlib import Path

URL = "mysql://root@127.0.0.1:3306/test"
KEYS = 256
PASSES = 12

#: The measurement, run in a process whose ``PYTHONPATH`` is one tree's ``src``.
CHILD = """
import asyncio, sys, time
from idemflow import AsyncIdempotency, Idempotency, Intent, Response
from idemflow.stores.mysql import AsyncMySQLStore, MySQLStore

URL, TABLE, KEYS, PASSES = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
INTENTS = [Intent("bench", f"k{n}", "fp", endpoint="POST /b") for n in range(KEYS)]
FIRST = Response.json(201, {"id": "pay_1", "amount": 100})


def report(name, cpu, wall):
    done = KEYS * PASSES
    print(f"{name}: CPU {cpu / done * 1e6:.0f} µs, wall {wall / done * 1e6:.0f} µs per replay")


def run_sync():
    store = MySQLStore(URL, table=TABLE + "_s")
    store.migrate()
    idem = Idempotency(store)
    for intent in INTENTS:
        idem.run(intent, lambda attempt: FIRST)
    started, began = time.process_time(), time.perf_counter()
    for _ in range(PASSES):
        for intent in INTENTS:
            if not idem.run(intent, lambda attempt: Response(500)).replayed:
                raise AssertionError("a completed key ran again")
    report("MySQLStore (PyMySQL)", time.process_time() - started, time.perf_counter() - began)
    store.close()


async def run_async():
    store = AsyncMySQLStore(URL, table=TABLE + "_a")
    await store.migrate()
    idem = AsyncIdempotency(store)

    async def first(attempt):
        return FIRST

    async def never(attempt):
        return Response(500)

    for intent in INTENTS:
        await idem.run(intent, first)
    started, began = time.process_time(), time.perf_counter()
    for _ in range(PASSES):
        for intent in INTENTS:
            if not (await idem.run(intent, never)).replayed:
                raise AssertionError("a completed key ran again")
    report("AsyncMySQLStore (asyncmy)", time.process_time() - started, time.perf_counter() - began)
    await store.close()


run_sync()
asyncio.run(run_async())
"""

DROP = """
import sys, pymysql
conn = pymysql.connect(host="127.0.0.1", user="root", database="test")
with conn.cursor() as cursor:
    for suffix in ("_s", "_a"):
        cursor.execute(f"DROP TABLE IF EXISTS {sys.argv[1]}{suffix}")
"""


def measure(tree: Path) -> str:
    table = f"bench_replay_{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, URL, table, str(KEYS), str(PASSES)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        subprocess.run([sys.executable, "-c", DROP, table], env=env, check=True)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a tree with the old src/")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    trees = [("this tree", here), ("baseline", args.baseline)]
    for round_ in range(args.rounds):
        for name, tree in trees if round_ % 2 == 0 else trees[::-1]:
            for line in measure(tree).splitlines():
                print(f"round {round_ + 1}, {name}: {line}")


if __name__ == "__main__":
    main()
