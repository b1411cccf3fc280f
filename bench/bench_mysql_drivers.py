"""
Which asyncio MySQL driver for AsyncMySQLStore: asyncmy and aiomysql against PyMySQL.

Run (from the repository root)::

    .venv/bin/python -m bench.bench_mysql_drivers [--seconds N] [--callers 1,16]

Every driver sends the very same statements, the store's own (``mysql_statements``
and ``mysql_dialect``): the plain ``INSERT`` that claims a new key, then the
fenced ``UPDATE`` that completes it (``claim+complete``), and, for a key that
exists, the ``INSERT`` that fails with error 1062 then the read of the row
(``replay``). PyMySQL runs ``callers`` threads, one connection each; the async
drivers run ``callers`` tasks on one event loop, one connection each. The
drivers take turns in short slices so the machine's noise hits all alike.
Figures are operations per second; they are ratios on a shared machine, not
absolute capacity (``docs/stores.md`` records a run).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from idemflow.stores.mysql import connect_kwargs, mysql_dialect, mysql_statements
from idemflow.stores.mysql._errors import DUPLICATE, error_code

URL = "mysql://root@127.0.0.1:3306/test"
TABLE = f"bench_drivers_{secrets.token_hex(3)}"
STATEMENTS = mysql_statements(TABLE, "caller")
DIALECT = mysql_dialect(TABLE, "caller")
_counter = itertools.count()


def _claim_params(key: str) -> dict[str, Any]:
    now = int(time.time() * 1000)
    return {
        "principal": "bench",
        "key": key,
        "fingerprint": "f" * 64,
        "endpoint": "POST /pay",
        "lease_token": secrets.token_hex(16),
        "correlation_id": None,
        "began_at": now,
        "now": now,
        "expires_at": now + 60_000,
    }


def _complete_params(row_id: int, lease: str) -> dict[str, Any]:
    now = int(time.time() * 1000)
    return {
        "id": row_id,
        "lease_token": lease,
        "state": "completed",
        "status": 201,
        "headers": '[["content-type","application/json"]]',
        "body": b'{"id":"pay_1"}',
        "now": now,
        "expires_at": now + 3_600_000,
    }


INSERT = (STATEMENTS.insert.pyformat, STATEMENTS.insert.bind)
COMPLETE = (DIALECT.complete.pyformat, DIALECT.complete.bind)
READ = (STATEMENTS.packed_read.pyformat, STATEMENTS.packed_read.bind)
REPLAYED = "replayed-key"


# --- PyMySQL, threads ---------------------------------------------------------


def _pymysql_op(conn: Any, path: str) -> None:
    key = REPLAYED if path == "replay" else f"k{next(_counter)}"
    params = _claim_params(key)
    with conn.cursor() as cursor:
        try:
            cursor.execute(INSERT[0], INSERT[1](params))
        except Exception as exc:
            if error_code(exc) != DUPLICATE:
                raise
            cursor.execute(READ[0], READ[1](params))
            cursor.fetchall()
            return
        done = _complete_params(int(cursor.lastrowid), params["lease_token"])
        cursor.execute(COMPLETE[0], COMPLETE[1](done))


def run_pymysql(path: str, callers: int, seconds: float) -> float:
    import pymysql

    kwargs = connect_kwargs(URL)
    conns = [pymysql.connect(**kwargs, autocommit=True) for _ in range(callers)]
    stop = time.monotonic() + seconds
    counts = [0] * callers

    def work(i: int) -> None:
        while time.monotonic() < stop:
            _pymysql_op(conns[i], path)
            counts[i] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in conns:
        c.close()
    return sum(counts) / seconds


# --- the async drivers, tasks ---------------------------------------------------


async def _async_op(conn: Any, path: str) -> None:
    key = REPLAYED if path == "replay" else f"k{next(_counter)}"
    params = _claim_params(key)
    async with conn.cursor() as cursor:
        try:
            await cursor.execute(INSERT[0], INSERT[1](params))
        except Exception as exc:
            if error_code(exc) != DUPLICATE:
                raise
            await cursor.execute(READ[0], READ[1](params))
            await cursor.fetchall()
            return
        done = _complete_params(int(cursor.lastrowid), params["lease_token"])
        await cursor.execute(COMPLETE[0], COMPLETE[1](done))


async def _connect(driver: str) -> Any:
    kwargs = connect_kwargs(URL)
    if driver == "aiomysql":
        import aiomysql

        kwargs["db"] = kwargs.pop("database")
        return await aiomysql.connect(**kwargs, autocommit=True)
    import asyncmy

    return await asyncmy.connect(**kwargs, autocommit=True)


async def _run_async(driver: str, path: str, callers: int, seconds: float) -> float:
    conns = [await _connect(driver) for _ in range(callers)]
    stop = time.monotonic() + seconds
    counts = [0] * callers

    async def work(i: int) -> None:
        while time.monotonic() < stop:
            await _async_op(conns[i], path)
            counts[i] += 1

    await asyncio.gather(*(work(i) for i in range(callers)))
    for c in conns:
        await c.ensure_closed()
    return sum(counts) / seconds


def runner(driver: str) -> Callable[[str, int, float], float]:
    if driver == "pymysql":
        return run_pymysql
    return lambda path, callers, seconds: asyncio.run(_run_async(driver, path, callers, seconds))


def _add(total: float | None, driver: str, path: str, callers: int, seconds: float) -> float | None:
    """The rate added to ``total``; None once the driver failed on these statements.

    aiomysql 0.3.2 cannot send a ``bytes`` parameter (the completion's body)
    with PyMySQL >= 2.2: it calls ``escape_bytes_prefixed``, which PyMySQL
    replaced by a string telling callers not to import it (a TypeError).
    """
    if total is None:
        return None
    try:
        return total + runner(driver)(path, callers, seconds)
    except TypeError as exc:
        print(f"{driver} fails on {path}: {exc}")
        return None


def _rate(total: float | None, slices: int) -> str:
    return f"{'fails':>12}" if total is None else f"{total / slices:>12.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--seconds", type=float, default=6.0, help="per driver, path and callers")
    parser.add_argument("--callers", default="1,16")
    parser.add_argument("--slices", type=int, default=3)
    args = parser.parse_args()
    import pymysql

    setup = pymysql.connect(**connect_kwargs(URL), autocommit=True)
    with setup.cursor() as cursor:
        for ddl in DIALECT.ddl:
            cursor.execute(ddl)
    _pymysql_op(setup, "replay")  # the replayed key exists
    drivers = ["pymysql", "aiomysql", "asyncmy"]
    try:
        print(f"{'path':<16}{'callers':>8}" + "".join(f"{d:>12}" for d in drivers))
        for path in ("claim+complete", "replay"):
            for callers in (int(c) for c in args.callers.split(",")):
                totals: dict[str, float | None] = dict.fromkeys(drivers, 0.0)
                for _ in range(args.slices):  # interleaved slices
                    for d in drivers:
                        totals[d] = _add(totals[d], d, path, callers, args.seconds / args.slices)
                rates = "".join(_rate(totals[d], args.slices) for d in drivers)
                print(f"{path:<16}{callers:>8}{rates}")
    finally:
        with setup.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {TABLE}")
        setup.close()


if __name__ == "__main__":
    main()
