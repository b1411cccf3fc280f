"""
One consumer process of the consumer storm: `AsyncRedisStreams` in a loop until killed.

``python -m idemflow_demo.consumer_storm.worker REDIS_URL STREAM NAME DATABASE TABLE TIMEOUT
READY``: once its first poll is done it writes its PID to the file READY (the storm kills
consumers at work, not ones still starting).
Its handler lingers a few milliseconds (so a SIGKILL lands mid-message now and then), then
writes the message's effect row on the completion's connection: the two commit together.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from idemflow import AsyncIdempotency, Policy
from idemflow.consumers import AsyncConsumer
from idemflow.consumers.redis_streams import AsyncRedisStreams

__all__ = ["GROUP", "Effects", "effects_table", "main", "open_effects"]

GROUP = "storm"
#: An entry pending this long (its consumer killed, or one that requeued it) is taken over.
MIN_IDLE = 1.0


def effects_table(table: str) -> str:
    return f"{table}_effects"


@dataclass
class Effects:
    """The app: its key store, its transactions, and the effect row written in one."""

    store: Any
    transaction: Callable[[], contextlib.AbstractAsyncContextManager[Any]]
    write: Callable[[Any, str], Awaitable[None]]  # (attempt.connection, message key)


def open_effects(database: str, table: str, policy: Policy) -> Effects:
    """The key store and the effect rows on ``database``: a PostgreSQL URL or a SQLite path."""
    insert = f"INSERT INTO {effects_table(table)} (message) VALUES "
    if database.startswith(("postgresql:", "postgres:")):
        import psycopg

        from idemflow.stores.postgres import AsyncPostgresStore
        from idemflow.transactions import AsyncPsycopgTransaction

        @contextlib.asynccontextmanager
        async def pg_transaction() -> AsyncIterator[Any]:
            async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
                yield AsyncPsycopgTransaction(conn)

        async def pg_write(conn: Any, key: str) -> None:
            await conn.execute(insert + "(%s)", (key,))

        pg = AsyncPostgresStore(database, table=table, max_size=2, policy=policy)
        return Effects(pg, pg_transaction, pg_write)

    from idemflow.stores.sqlite import AsyncSQLiteStore, connect
    from idemflow.transactions import AsyncSQLite3Connection, AsyncSQLite3Transaction

    @contextlib.asynccontextmanager
    async def sqlite_transaction() -> AsyncIterator[Any]:
        conn = AsyncSQLite3Connection(connect(database, busy_timeout=5.0))
        try:
            yield AsyncSQLite3Transaction(conn)
        finally:
            conn.close()

    async def sqlite_write(conn: Any, key: str) -> None:
        await conn.run(conn.raw.execute, insert + "(?)", (key,))

    store = AsyncSQLiteStore(database, table=table, policy=policy)
    return Effects(store, sqlite_transaction, sqlite_write)


async def consume(
    redis_url: str, stream: str, name: str, effects: Effects, policy: Policy, ready: Path
) -> None:
    import redis.asyncio

    consumer = AsyncConsumer(AsyncIdempotency(effects.store, policy), stream)
    client = redis.asyncio.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=1)
    streams = AsyncRedisStreams(
        consumer, client, stream, GROUP, name, min_idle=MIN_IDLE, transaction=effects.transaction
    )

    async def handle(attempt: Any, fields: dict[bytes, bytes]) -> dict[str, str]:
        key = fields[b"idempotency-key"].decode()
        await asyncio.sleep(random.uniform(0, 0.05))  # claimed: a kill lands here now and then
        await effects.write(attempt.connection, key)
        return {"done": key}

    while True:
        try:
            await streams.poll(handle, count=5, block_ms=200)
            if not ready.exists():
                ready.write_text(str(os.getpid()))
        except Exception as exc:  # noqa: BLE001 -- the broker restarting: go on, say why
            print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            await asyncio.sleep(0.2)


def main(argv: list[str]) -> None:
    redis_url, stream, name, database, table, timeout, ready = argv
    policy = Policy(request_timeout=float(timeout))
    effects = open_effects(database, table, policy)
    asyncio.run(consume(redis_url, stream, name, effects, policy, Path(ready)))


if __name__ == "__main__":
    main(sys.argv[1:])
