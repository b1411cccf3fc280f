"""
What a new MySQL connection costs the client in CPU: TLS context built per connection,
built once and reused, or no TLS at all (issue 12).

Run (from the repository root)::

    .venv/bin/python -m bench.bench_mysql_connect [--connections 40] [--rounds 5]

Against the MariaDB at ``--url`` (the shared one offers no TLS: every row ends in plain
TCP, so the differences are the client's work before the handshake). Each row opens
``--connections`` connections and takes ``time.process_time`` over them (the CPU of
this process, not the server's); rows take turns, ``--rounds`` times, each followed by
an untimed settling run, and the median per connection is printed, with the load
average before and after.

Rows:

- ``pymysql default``: ``pymysql.connect`` told nothing about TLS (PREFERRED): a
  context from ``ssl.create_default_context()`` (the system CA bundle) per connection;
  what every ``MySQLStore`` connection cost before.
- ``pymysql shared context``: the same PREFERRED, through the store's connector
  (``Binding.connector``): PyMySQL's context built once, reused.
- ``pymysql ssl-mode=DISABLED``: ``ssl_disabled=True``, no context.
- ``asyncmy default``: asyncmy builds no context unless given ``ssl`` (no TLS).
- ``MySQLStore pool fill`` (before: a factory calling ``pymysql.connect``; now: the URL;
  ``?ssl-mode=DISABLED``) and ``AsyncMySQLStore pool fill``: ``--connections`` checkouts
  held at once, each a new connection (the store's ``init_command`` and Galera probe
  included), per connection.
- ``context alone``: building one context, ``create_default_context()`` against
  ``SSLContext(PROTOCOL_TLS_CLIENT)`` (what ``ssl-mode=REQUIRED`` builds, once).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import ssl
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import asyncmy
import pymysql

from idemflow.stores.mysql import AsyncMySQLStore, MySQLStore, connect_kwargs
from idemflow.stores.mysql._binding import Binding

URL = "mysql://root@127.0.0.1:3306/test"


def _per_connection(open_n: Callable[[int], None], count: int) -> float:
    """CPU (µs) per connection of ``open_n(count)``.

    The previous row's garbage is collected first, untimed: a store is a cycle, and
    freeing its connections' contexts (each with the CA bundle loaded) would be
    charged to whichever row the collector happened to run in.
    """
    gc.collect()
    started = time.process_time()
    open_n(count)
    return (time.process_time() - started) / count * 1e6


def _each(connect: Callable[[], Any]) -> Callable[[int], None]:
    def run(count: int) -> None:
        for _ in range(count):
            connect().close()

    return run


def _pool_fill(make: Callable[[int], MySQLStore]) -> Callable[[int], None]:
    def run(count: int) -> None:
        store = make(count)
        with contextlib.ExitStack() as stack:
            for _ in range(count):
                stack.enter_context(store.pool.connection())
        store.close()

    return run


def _async_pool_fill(url: str) -> Callable[[int], None]:
    async def fill(count: int) -> None:
        store = AsyncMySQLStore(url, max_size=count)
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(count):
                await stack.enter_async_context(store.pool.connection())
        await store.close()

    return lambda count: asyncio.run(fill(count))


def _asyncmy_each(url: str) -> Callable[[int], None]:
    kwargs = connect_kwargs(url, "asyncmy")

    async def each(count: int) -> None:
        for _ in range(count):
            conn = await asyncmy.connect(**kwargs)
            conn.close()

    return lambda count: asyncio.run(each(count))


def _contexts(make: Callable[[], ssl.SSLContext]) -> Callable[[int], None]:
    def run(count: int) -> None:
        for _ in range(count):
            make()

    return run


def rows(url: str) -> dict[str, Callable[[int], None]]:
    kwargs = connect_kwargs(url)
    disabled = f"{url}{'&' if '?' in url else '?'}ssl-mode=DISABLED"
    shared = Binding.connector(kwargs)

    def before(size: int) -> MySQLStore:
        return MySQLStore(lambda: pymysql.connect(**kwargs, autocommit=True), max_size=size)

    return {
        "pymysql default (a context per connection)": _each(lambda: pymysql.connect(**kwargs)),
        "pymysql shared context (the store's connector)": _each(shared),
        "pymysql ssl-mode=DISABLED": _each(lambda: pymysql.connect(**connect_kwargs(disabled))),
        "asyncmy default (no TLS)": _asyncmy_each(url),
        "MySQLStore pool fill, before (a context per connection)": _pool_fill(before),
        "MySQLStore pool fill, URL (shared context)": _pool_fill(
            lambda size: MySQLStore(url, max_size=size)
        ),
        "MySQLStore pool fill, ssl-mode=DISABLED": _pool_fill(
            lambda size: MySQLStore(disabled, max_size=size)
        ),
        "AsyncMySQLStore pool fill, URL (no TLS)": _async_pool_fill(url),
        "context alone: ssl.create_default_context()": _contexts(ssl.create_default_context),
        "context alone: SSLContext(PROTOCOL_TLS_CLIENT)": _contexts(
            lambda: ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=URL)
    parser.add_argument("--connections", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()
    table = rows(args.url)
    for run in table.values():  # warm: imports, the shared context, the server's caches
        run(2)
    samples: dict[str, list[float]] = {name: [] for name in table}
    settle = table["pymysql ssl-mode=DISABLED"]
    for _ in range(args.rounds):
        for name, run in table.items():
            samples[name].append(_per_connection(run, args.connections))
            # Untimed: the row after one that built and freed a context per connection
            # paid ~+700 µs per connection here (not page faults, not Python's GC: likely
            # the allocator sorting the freed CA stores' many small chunks) until some
            # other work had run.
            settle(args.connections)
    load_after = os.getloadavg()
    print(f"PyMySQL {version('PyMySQL')}, asyncmy {version('asyncmy')}")
    print(f"load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1 min)")
    print(f"| what | CPU per connection, µs (median of {args.rounds}) | min | max |")
    print("| --- | ---: | ---: | ---: |")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"| {name} | {median:,.0f} | {min(values):,.0f} | {max(values):,.0f} |")


if __name__ == "__main__":
    main()
