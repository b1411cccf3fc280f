"""
Real faults for the mode and seam tests: lost server sessions, small shared
pools, a store that tells when its claim is on its way (so a test can cancel
it mid-flight). PostgreSQL only; every helper talks to the real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from idemflow._async.edge import pooled_transaction
from idemflow.stores.protocol import StoreClock
from tests.conftest import POSTGRES_URL


def freeze_process(pid: int, timeout: float = 60.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped: until then a busy
    server still answers what it is sent (seen on a loaded machine). The kernel still takes
    what clients send; nothing answers until SIGCONT."""
    os.kill(pid, signal.SIGSTOP)
    tasks = Path(f"/proc/{pid}/task")
    deadline = time.monotonic() + timeout
    while not all(_stopped(task) for task in tasks.iterdir()):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)  # polling the threads' state, with a deadline


def _stopped(task: Path) -> bool:
    """Is this thread stopped (or gone)? Its state, after the command's name in ``stat``."""
    with contextlib.suppress(OSError):
        return (task / "stat").read_text().rpartition(")")[2].split()[0] in ("T", "t")
    return True


def business_rows(table: str) -> list[str]:
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        return [r[0] for r in conn.execute(f"SELECT note FROM biz_{table} ORDER BY id")]


def terminate(application_name: str) -> int:
    """End every server session of ``application_name`` (a real connection loss), and
    return once each has ended (PostgreSQL waits up to 5 s for it): before, a backend still
    exiting on a loaded machine left its socket open to the next check of its client."""
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            (application_name,),
        ).fetchall()
    return len(rows)


def named_url(application_name: str) -> str:
    return f"{POSTGRES_URL}?application_name={application_name}"


@contextlib.asynccontextmanager
async def shared_pool(
    table: str, size: int = 2, application_name: str = "", *, clock: StoreClock = "database"
) -> AsyncIterator[Any]:
    """An AsyncPostgresStore whose pool the application's transactions use too."""
    from idemflow.stores.postgres import AsyncPostgresStore

    url = named_url(application_name) if application_name else POSTGRES_URL
    store = AsyncPostgresStore(url, table=table, max_size=size, clock=clock)
    await store.pool.open(wait=True)
    try:
        yield store
    finally:
        await store.close()


def transaction_on(store: Any) -> Any:
    """The request's transaction, on a connection of the store's own pool."""
    from idemflow.transactions import AsyncPsycopgTransaction

    return pooled_transaction(store.pool.connection, AsyncPsycopgTransaction)


class SignallingStore:
    """A real store that says when a claim has been sent (so a test can cancel mid-claim)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.claim_sent = asyncio.Event()
        self._cancelled = asyncio.Event()
        self.supports_transactions = store.supports_transactions
        self.supports_single_commit = store.supports_single_commit

    async def claim(self, *args: Any, **kwargs: Any) -> Any:
        return await self._signalled(self.store.claim(*args, **kwargs))

    async def claim_on_lent(self, *args: Any, **kwargs: Any) -> Any:
        """The two-commit claim on the request's own connection (PostgreSQL's)."""
        return await self._signalled(self.store.claim_on_lent(*args, **kwargs))

    def cancel(self, task: asyncio.Task[Any]) -> None:
        """Cancel ``task`` while its claim is held here, then let the claim's answer through:
        the cancellation lands mid-claim however few loop turns the claim takes."""
        task.cancel()
        self._cancelled.set()

    async def _signalled(self, claim: Any) -> Any:
        pending = asyncio.ensure_future(claim)  # starts now (its thread, or its query)
        self.claim_sent.set()
        await self._cancelled.wait()
        return await pending

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)
