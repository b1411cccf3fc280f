"""
Where a SQLite replay's time goes, one thread: built up step by step, CPU per call.

Run::

    .venv/bin/python -m bench.bench_replay_steps [--rounds 21] [--calls 3000]

Each step adds one layer to the one before, all on one completed key, in one
process, taking turns (every round runs every step ``--calls`` times); the
table gives the minimum over rounds of the thread's CPU time per call (the
least disturbed by other work on the machine):

1. the claim's ``INSERT … DO NOTHING`` and the ``SELECT`` of the record the
   store sends, through ``sqlite3.Connection.execute``, parameters built by
   ``claim_params``;
2. the same on one cursor, as the executor sends them;
3. under the store's writer lock, on the thread's connection;
4. plus the record, the take-over test and the ``Claim`` the store builds;
5. ``SQLiteStore.claim`` itself (the executor's layers);
6. ``Idempotency.run`` on that store (the driver: intent to outcome).

Then the driver's share alone, on the in-memory store (which does almost
nothing): its ``claim`` (and ``complete``) against ``Idempotency.run``.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from idemflow import Idempotency, Intent, State
from idemflow._model import can_take_over, make_claim, new_lease_token
from idemflow.stores.memory import MemoryStore
from idemflow.stores.sql.dialect import claim_params, record_from_values
from idemflow.stores.sqlite import SQLiteStore

from . import bench_core as core

NOW, EXPIRES = 1.7e9, 1.8e9


def measure(steps: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, step in steps.items():
            started = time.thread_time()
            for _ in range(calls):
                step()
            best[name] = min(best[name], (time.thread_time() - started) / calls * 1e6)
    return best


def sqlite_steps(path: Path) -> dict[str, Callable[[], object]]:
    store = SQLiteStore(path)
    store.migrate()
    idem = Idempotency(store)
    done = core.prepare_replay(idem, "steps")
    intent = core.intent(done.keys[0])
    token = new_lease_token()
    claim, read = store.dialect.claim.named, store.dialect.read_for_claim.named
    connections = store._connections
    conn = connections().conn

    def statements() -> object:
        params = claim_params(intent, token, NOW, EXPIRES)
        conn.execute(claim, params).fetchall()
        return conn.execute(read, params).fetchall()

    def one_cursor() -> object:
        params = claim_params(intent, token, NOW, EXPIRES)
        cursor = conn.cursor()
        cursor.execute(claim, params)
        cursor.fetchall()
        cursor.execute(read, params)
        rows = cursor.fetchall()
        cursor.close()
        return rows

    def locked() -> list[object]:
        params = claim_params(intent, token, NOW, EXPIRES)
        with connections() as writer:
            cursor = writer.cursor()
            cursor.execute(claim, params)
            cursor.fetchall()
            cursor.execute(read, params)
            rows: list[object] = cursor.fetchall()
            cursor.close()
        return rows

    def with_record() -> object:
        row = locked()[0]
        record = record_from_values(row, 0)  # type: ignore[arg-type]
        return make_claim(not can_take_over(record, intent.fingerprint, row[16] / 1000), record)  # type: ignore[index]

    return {
        "the two statements, parameters built": statements,
        "on one cursor": one_cursor,
        "under the writer lock (the thread's connection, acquire, release)": locked,
        "the record, the take-over test, the Claim": with_record,
        "SQLiteStore.claim (the executor's layers)": lambda: store.claim(
            intent, token, NOW, EXPIRES
        ),
        "Idempotency.run (the driver)": lambda: idem.run(intent, core.respond),
    }


def memory_steps() -> dict[str, Callable[[], object]]:
    store = MemoryStore()
    idem = Idempotency(store)
    fresh = itertools.count()
    done = [f"done-{n}" for n in range(512)]
    for key in done:
        idem.run(core.intent(key), core.respond)
    cycle = itertools.cycle(done)

    def store_claim_complete() -> None:
        claim = store.claim(core.intent(f"k-{next(fresh)}"), new_lease_token(), NOW, EXPIRES)
        store.complete(claim.record, State.COMPLETED, core.RESPONSE, NOW, EXPIRES)

    def store_replay() -> object:
        return store.claim(core.intent(next(cycle)), new_lease_token(), NOW, EXPIRES)

    def intent_of(key: str) -> Intent:
        return core.intent(key)

    return {
        "memory store: claim + complete": store_claim_complete,
        "memory store: Idempotency.run, claim + complete": lambda: idem.run(
            intent_of(f"k-{next(fresh)}"), core.respond
        ),
        "memory store: replay": store_replay,
        "memory store: Idempotency.run, replay": lambda: idem.run(
            intent_of(next(cycle)), core.respond
        ),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_replay_steps", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds (21)")
    parser.add_argument("--calls", type=int, default=3000, help="calls per step and round")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="idemflow-bench-steps-") as folder:
        sqlite, memory = sqlite_steps(Path(folder) / "keys.db"), memory_steps()
        best = measure({**sqlite, **memory}, args.rounds, args.calls)
    print("| step (a SQLite replay, each adding to the one before) | µs per call | added |")
    print("| --- | ---: | ---: |")
    previous: float | None = None
    for name in sqlite:
        added = "—" if previous is None else f"{best[name] - previous:+.1f}"
        print(f"| {name} | {best[name]:.1f} | {added} |")
        previous = best[name]
    print("\n| the driver alone (memory store) | µs per call | added by Idempotency.run |")
    print("| --- | ---: | ---: |")
    names = list(memory)
    for store_step, run_step in zip(names[::2], names[1::2], strict=True):
        print(f"| {store_step} | {best[store_step]:.1f} | — |")
        print(f"| {run_step} | {best[run_step]:.1f} | {best[run_step] - best[store_step]:+.1f} |")


if __name__ == "__main__":
    main()
