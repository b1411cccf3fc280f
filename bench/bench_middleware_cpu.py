"""
What middleware mode costs a minimal endpoint in the app's own CPU: a figure load barely moves.

Run::

    .venv/bin/python -m bench.bench_middleware_cpu [--stores postgres,redis] [--count 2000]
                                                   (--stores: any of sqlite,postgres,redis)
                                                   [--profile FILE]

``bench/_minimal_app.py``'s app (the same middleware stack ``bench_middleware``
serves under uvicorn) is called in this process, as ASGI, by one sequential
caller, with no HTTP server and no socket to the client: each path
(``unprotected``, ``protected`` with a fresh key, ``replay``) runs ``--count``
requests, taking turns in slices, and this process's CPU time
(``time.process_time``: user + system, this process only, so the store
server's work and the machine's other load are not in it) is divided by the
requests. ``protected - unprotected`` is what protection adds in the app
process: the statements' client side (drivers, pool) and everything around
them. ``--profile FILE`` writes a cProfile of the protected path instead.

Two more paths take their turns in the same rotation: the **raw floor**, the
very statements protection sends, and nothing else, through the same driver
and the app's own store connection (``raw first``: the store's claim, then its
completion, each on a pool checkout of its own as the middleware takes them;
``raw replay``: the claim that finds a completed record, and the decoding a
hand-written replay does). No implementation that makes these round trips
through this driver spends less, so ``protected - unprotected - raw first`` is
idemflow's own share, the part it can cut, and the raw floor is what a target
on the added CPU has to leave room for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import itertools
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench._harness import lifespan, post_over_asgi
from bench.bench_middleware import BODY, store_settings

PATHS = ("unprotected", "protected", "replay")
#: The stores whose raw floors this bench knows (SQLite: none, it makes no round trip).
STORES = ("sqlite", "postgres", "redis")
FLOORS = ("raw first", "raw replay")


def makers(replay_key: str) -> dict[str, Callable[[], tuple[str, str | None]]]:
    return {
        "unprotected": lambda: ("/plain/things", None),
        "protected": lambda: ("/things", f"cpu-{uuid.uuid4().hex}"),
        "replay": lambda: ("/things", replay_key),
    }


async def raw_floors(store: Any) -> dict[str, Callable[[], Awaitable[object]]]:
    """The raw driver sending the store's own statements on the app's store connection."""
    run = f"floor-{uuid.uuid4().hex[:8]}"
    if hasattr(store, "pool"):  # PostgreSQL: the dialect's texts on the store's pool
        from bench.bench_core import Keys, RawAsyncPostgres

        raw = RawAsyncPostgres(store.pool, store.dialect)
        done = f"{run}-done"
        await raw.claim_complete(lambda: done)()
        return {
            "raw first": raw.claim_complete(Keys(run, "first")),
            "raw replay": raw.replay(lambda: done),
        }
    if not hasattr(store, "client"):  # SQLite: in process, no driver round trips to floor
        return {}
    from bench.bench_stores import (
        check_redis_claim,
        check_redis_replay,
        lease,
        redis_claim,
        redis_complete,
    )
    from idemflow.stores.redis._scripts import SCRIPTS

    client = store.client
    sha = {name: await client.script_load(lua) for name, lua in SCRIPTS.items()}
    fresh = (f"{run}-{n}" for n in itertools.count())

    async def first_on(key: str) -> None:
        token = lease()
        check_redis_claim(await client.evalsha(*redis_claim(store, sha, key, token)))
        if await client.evalsha(*redis_complete(store, sha, key, token)) != 1:
            raise AssertionError("completion refused")

    async def first() -> None:
        await first_on(next(fresh))

    async def replay() -> None:
        check_redis_replay(await client.evalsha(*redis_claim(store, sha, done, lease())))

    done = next(fresh)
    await first_on(done)
    return {"raw first": first, "raw replay": replay}


async def measure(count: int, rounds: int, profile: str | None) -> dict[str, float]:
    module = importlib.import_module("bench._minimal_app")
    app = module.make_app()
    stop = await lifespan(app)
    replay_key = f"cpu-replay-{uuid.uuid4().hex}"
    assert await post_over_asgi(app, "/things", replay_key, BODY) == 201
    make = makers(replay_key)
    for name in PATHS:  # warm: pool connections, prepared statements
        for _ in range(50):
            assert await post_over_asgi(app, *make[name](), BODY) == 201
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(count):
            await post_over_asgi(app, *make["protected"](), BODY)
        profiler.disable()
        profiler.dump_stats(profile)
    ops: dict[str, Callable[[], Awaitable[object]]] = {
        name: functools.partial(_post, app, make[name]) for name in PATHS
    }
    ops |= await raw_floors(app.state.store)
    for op in ops.values():  # the floors' warm-up too
        for _ in range(50):
            await op()
    cpu = dict.fromkeys(ops, 0.0)
    system = dict.fromkeys(ops, 0.0)
    per_round = max(count // rounds, 1)
    names = list(ops)
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            one = ops[name]
            started, before = time.process_time(), os.times().system
            for _ in range(per_round):
                await one()
            cpu[name] += time.process_time() - started
            system[name] += os.times().system - before
    await stop()
    done = per_round * rounds
    return {
        **{name: value / done * 1e6 for name, value in cpu.items()},
        **{f"{name} sys": value / done * 1e6 for name, value in system.items()},
    }


async def _post(app: Any, make: Callable[[], tuple[str, str | None]]) -> None:
    if await post_over_asgi(app, *make(), BODY) != 201:
        raise AssertionError("the minimal endpoint did not answer 201")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default="postgres,redis")
    parser.add_argument("--count", type=int, default=2000, help="requests per path")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", help="cProfile the protected path into FILE.<store>")
    args = parser.parse_args(argv)
    print(
        "| store | unprotected µs/req (system) | protected µs/req (system) "
        "| replay µs/req (system) | added by protection: protected, replay "
        "| raw floor: first, replay (system) | idemflow's own: protected, replay |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    stores = args.stores.split(",")
    if unknown := set(stores) - set(STORES):
        parser.error(f"--stores: {', '.join(sorted(unknown))} not measured here ({STORES})")
    for store in stores:
        with contextlib.ExitStack() as stack:
            # bench_middleware's: a schema, a key prefix or a file of this run's own,
            # dropped, deleted or removed at the end.
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            os.environ.update(stack.enter_context(store_settings(store, workdir)))
            profile = f"{args.profile}.{store}" if args.profile else None
            sys.modules.pop("bench._minimal_app", None)
            result = asyncio.run(measure(args.count, args.rounds, profile))
        print(f"| {store} | " + " | ".join(_cells(result)) + " |", flush=True)
    return 0


def _cells(result: dict[str, float]) -> list[str]:
    """One row: each path's µs (system), what protection adds, the floors and the rest."""

    def cell(name: str) -> str:
        return f"{result[name]:,.0f} ({result[name + ' sys']:,.0f})"

    added = {name: result[name] - result["unprotected"] for name in PATHS[1:]}
    cells = [cell(name) for name in PATHS]
    cells.append(", ".join(f"{value:+,.0f}" for value in added.values()))
    if "raw first" not in result:  # no driver between the app and the store (SQLite)
        return [*cells, "—", "—"]
    floors = (result["raw first"], result["raw replay"])
    own = (added["protected"] - floors[0], added["replay"] - floors[1])
    cells.append(", ".join(cell(name) for name in FLOORS))
    cells.append(", ".join(f"{value:+,.0f}" for value in own))
    return cells


if __name__ == "__main__":
    sys.exit(main())
