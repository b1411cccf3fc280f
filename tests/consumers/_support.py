"""
What the broker adapters' tests share: the app (a store, its business table beside it,
the app's transactions on it), the business rows counted, the race of two consumers on
one key, the lease outlived and the lease stolen, and the child consumer that stalls
after its business write (before its commit, or before its ack) and is SIGKILLed by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from idemflow import AsyncAttempt, Intent, State
from idemflow.stores.protocol import AsyncTransaction
from idemflow.testing import FrozenClock
from tests.factories import POLICY
from tests.sweeping import async_sweep_away

ROOT = Path(__file__).resolve().parents[2]


def count_rows(url: str, table: str) -> int:
    """Committed business rows in ``biz_<table>`` on PostgreSQL at ``url``."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM biz_{table}").fetchone()
        assert row is not None
        return int(row[0])


@dataclass
class App:
    """A store, the app's business table beside it, and the app's transactions on it."""

    store: Any
    transaction: Callable[[], AbstractAsyncContextManager[AsyncTransaction]]
    write: Callable[[Any], Awaitable[None]]  # a business row, on ``attempt.connection``
    count: Callable[[], int]  # committed business rows
    close: Callable[[], Awaitable[None]]
    argv: list[str] = field(default_factory=list)  # what a child needs to open it too

    async def charge(self, attempt: AsyncAttempt, message: Any) -> None:
        """A handler: the business row, nothing more."""
        await self.write(attempt.connection)


def open_app(kind: str, where: str, table: str) -> App:
    """``kind``'s store and transactions on ``where`` (a URL, a file), tables made."""
    argv = [kind, where, table]
    if kind == "postgres":
        import psycopg

        from idemflow.stores.postgres import AsyncPostgresStore
        from idemflow.transactions import AsyncPsycopgTransaction

        @contextlib.asynccontextmanager
        async def pg_transaction() -> AsyncIterator[AsyncTransaction]:
            async with await psycopg.AsyncConnection.connect(where, autocommit=True) as conn:
                yield AsyncPsycopgTransaction(conn)

        async def pg_write(conn: Any) -> None:
            await conn.execute(f"INSERT INTO biz_{table} (note) VALUES ('charged')")

        pg = AsyncPostgresStore(where, table=table, clock="caller")
        return App(pg, pg_transaction, pg_write, lambda: count_rows(where, table), pg.close, argv)

    from idemflow.stores.sqlite import AsyncSQLiteStore, connect
    from idemflow.transactions import AsyncSQLite3Connection, AsyncSQLite3Transaction

    @contextlib.asynccontextmanager
    async def sqlite_transaction() -> AsyncIterator[AsyncTransaction]:
        conn = AsyncSQLite3Connection(connect(where, busy_timeout=5.0))
        try:
            yield AsyncSQLite3Transaction(conn)
        finally:
            conn.close()

    async def sqlite_write(conn: Any) -> None:
        await conn.run(conn.raw.execute, f"INSERT INTO biz_{table} (note) VALUES ('charged')")

    def sqlite_count() -> int:
        with contextlib.closing(sqlite3.connect(where)) as conn:
            return int(conn.execute(f"SELECT count(*) FROM biz_{table}").fetchone()[0])

    lite = AsyncSQLiteStore(where, table=table)

    async def sqlite_close() -> None:
        await lite.close()

    return App(lite, sqlite_transaction, sqlite_write, sqlite_count, sqlite_close, argv)


@dataclass
class Race:
    """Two consumers on one key: ``held`` claims it and waits until ``other`` met the
    claim (``raced``), each records its effect."""

    shop: App
    effects: list[str] = field(default_factory=list)
    running: asyncio.Event = field(default_factory=asyncio.Event)
    raced: asyncio.Event = field(default_factory=asyncio.Event)

    async def held(self, attempt: AsyncAttempt, message: Any) -> str:
        self.running.set()
        await asyncio.wait_for(self.raced.wait(), 10)  # until the other consumer met our claim
        return await self.other(attempt, message, "charged")

    async def other(self, attempt: AsyncAttempt, message: Any, answer: str = "again") -> str:
        await self.shop.write(attempt.connection)
        self.effects.append(attempt.record.key)
        return answer


@dataclass
class Flaky:
    """A handler whose first run fails after its business write (rolled back with it),
    whose later runs succeed; ``calls`` holds each run's attempt number."""

    shop: App
    calls: list[int] = field(default_factory=list)

    async def __call__(self, attempt: AsyncAttempt, message: Any) -> str:
        self.calls.append(attempt.record.attempt)
        await self.shop.write(attempt.connection)
        if len(self.calls) == 1:
            raise ConnectionError("the provider is down")  # the write rolls back
        return "charged"


@dataclass
class Overrun:
    """A handler that never finishes by itself: ``started`` once it runs, ``effects``
    holds "never" if it was ever let go on past its wait (it must be cancelled)."""

    effects: list[str] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, attempt: AsyncAttempt, message: Any = None) -> str:
        self.started.set()
        await asyncio.Event().wait()  # cancelled once a renewal meets lease-b
        self.effects.append("never")
        return "too late"


async def outlive_the_lease(
    store: Any, scope: str, clock: FrozenClock, key: str = "order-1"
) -> None:
    """Inside a handler renewing every 0.01 s: its lease outlived, kept by the renewals
    (the sweeper finds nothing stale)."""
    clock.advance(POLICY.stale_seconds - 1)
    deadline = time.monotonic() + 10
    renewed = clock() + POLICY.stale_seconds  # the deadline a renewal now sets
    while (record := await store.get(scope, key)) is None or record.stale_at != renewed:
        assert time.monotonic() < deadline, "never renewed"
        await asyncio.sleep(0.01)
    clock.advance(2)  # past the threshold counted from the claim
    assert await store.sweep(State.IN_PROGRESS, clock(), clock(), clock() + 60, 10) == []


async def steal_the_claim(store: Any, clock: FrozenClock) -> None:
    """The sweeper ends the claim (whatever the renewals did), another consumer takes it
    as ``lease-b``."""
    clock.advance(POLICY.stale_seconds + 1)
    (marked,) = await async_sweep_away(store, clock() + POLICY.stale_seconds + 1)
    intent = Intent(marked.principal, marked.key, marked.fingerprint, marked.endpoint)
    assert (await store.claim(intent, "lease-b", clock(), clock() + 60)).owned


async def stalled(*args: Any, **kwargs: Any) -> None:
    """In a child: says it can be killed now, then waits to be."""
    print("killable", flush=True)
    await asyncio.Event().wait()


def charging(app: App, stall: str) -> Callable[[AsyncAttempt, Any], Awaitable[str]]:
    """In a child: the handler that writes its business row, then stalls there if
    ``stall`` is "before the commit" (else its ack, patched by the child, stalls)."""

    async def charge(attempt: AsyncAttempt, message: Any) -> str:
        await app.write(attempt.connection)
        if stall == "before the commit":
            await stalled()
        return "charged"

    return charge


def child_command(script: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a child running ``script`` with ``args``."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return [sys.executable, "-c", textwrap.dedent(script), *args], env


async def run_until_killable(script: str, *args: str) -> None:
    """Runs ``script`` in a child until it prints "killable", then SIGKILLs it by PID."""
    command, env = child_command(script, *args)
    child = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 30)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        _, errors = await child.communicate()
    assert line == b"killable\n", errors.decode()


def run_until_killable_sync(script: str, *args: str) -> None:
    """:func:`run_until_killable` from synchronous code."""
    command, env = child_command(script, *args)
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
    finally:
        os.kill(child.pid, signal.SIGKILL)
        _, errors = child.communicate(timeout=10)
    assert line == b"killable\n", errors.decode()
