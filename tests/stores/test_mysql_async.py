"""
AsyncMySQLStore (asyncmy) beyond the async contract (``tests/core/test_async_driver.py``,
backend ``mysql-asyncmy``) and the async race (``tests/guarantees/test_races.py``): the URL
opener, the takeover path under concurrent tasks, the sweeper's mark, the claim
in the caller's transaction, an unreachable server, and asyncmy's errors read
by the shared rules.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
from typing import Any

import pytest

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    InProgress,
    KeyReused,
    Response,
    State,
    StoreUnavailable,
)
from idemflow.stores.urls import open_async_store
from tests.backends import MYSQL_URL, async_mysql_backend
from tests.factories import CREATED, POLICY, intent

asyncmy = pytest.importorskip("asyncmy")
from idemflow.stores.mysql import (  # noqa: E402
    AsyncMySQLStore,
    connect_kwargs,
    error_code,
    is_unavailable,
)
from idemflow.transactions import AsyncmyTransaction  # noqa: E402

pytestmark = [pytest.mark.mysql, pytest.mark.anyio]

T0 = 1_700_000_000.0
TASKS = 20


async def test_open_async_store_runs_replays_and_refuses(table_name: str) -> None:
    """``open_async_store("mysql://…")`` is AsyncMySQLStore on the server's clock: one
    execution, the replay verbatim, 422 for another body under the same key."""
    store = open_async_store(MYSQL_URL, table=table_name)
    assert isinstance(store, AsyncMySQLStore)
    calls = 0

    async def handler(attempt: AsyncAttempt) -> Response:
        nonlocal calls
        calls += 1
        return CREATED

    try:
        await store.migrate()
        idem = AsyncIdempotency(store, POLICY)
        first = await idem.run(intent(), handler)
        again = await idem.run(intent(), handler)
        with pytest.raises(KeyReused):
            await idem.run(intent(fp="other"), handler)
    finally:
        await store.close()
        await _drop(table_name)
    assert (first.replayed, again.replayed, calls) == (False, True, 1)
    assert again.response == CREATED


async def test_released_key_is_taken_over_by_exactly_one_task(table_name: str) -> None:
    """A released key takes the guarded upsert: of many tasks at once, one owns it."""
    async with async_mysql_backend(table_name) as mysql:
        store = mysql.store
        first = await store.claim(intent(), "lease-0", T0, T0 + 3600)
        assert await store.release(first.record, T0 + 1)
        go = asyncio.Event()

        async def claimant(n: int) -> Any:
            await go.wait()
            return await store.claim(intent(), f"lease-{n}", T0 + 2, T0 + 3600)

        tasks = [asyncio.create_task(claimant(n)) for n in range(1, TASKS + 1)]
        await asyncio.sleep(0)
        go.set()
        claims = await asyncio.gather(*tasks)
    owners = [c for c in claims if c.owned]
    assert len(owners) == 1
    assert owners[0].record.attempt == 2
    assert all(c.record.state is State.IN_PROGRESS for c in claims)


async def test_sweep_marks_a_stale_claim_once_then_it_is_released_and_purged(
    table_name: str,
) -> None:
    """The sweep's mark carries its own token; a second sweep finds nothing."""
    async with async_mysql_backend(table_name) as mysql:
        store = mysql.store
        await store.claim(intent(), "crashed", T0, T0 + 10, stale_after=5)
        [marked] = await store.sweep(State.IN_PROGRESS, T0 + 20, T0 + 20, T0 + 30, 10)
        assert (marked.state, marked.lease_token != "crashed") == (State.STALE, True)
        assert await store.sweep(State.IN_PROGRESS, T0 + 20, T0 + 20, T0 + 30, 10) == []
        assert await store.release_stale(marked, T0 + 21)
        assert await store.purge(T0 + 40, 10) == 1
        assert await store.get("alice", "k-1") is None


async def test_single_commit_duplicate_gets_409_and_a_rollback_leaves_nothing(
    table_name: str,
) -> None:
    """The claim in the caller's transaction (AsyncmyTransaction): a duplicate meeting it
    uncommitted answers 409 after the bounded lock wait; the rollback removes it."""
    async with async_mysql_backend(table_name) as mysql:
        store = mysql.store
        assert mysql.transaction is not None
        async with mysql.transaction() as transaction:
            await transaction.begin()
            claim = await store.claim(intent(), "mine", T0, T0 + 3600, transaction)
            assert claim.owned
            started = time.monotonic()
            with pytest.raises(InProgress):
                await store.claim(intent(), "theirs", T0, T0 + 3600)
            waited = time.monotonic() - started
            await transaction.rollback()
        assert await store.get("alice", "k-1") is None
        assert (await store.claim(intent(), "after", T0, T0 + 3600)).owned
    assert 0.5 < waited < 10.0


async def test_transaction_adapter_joins_a_transaction_already_begun(table_name: str) -> None:
    """An earlier write of the caller's transaction is neither committed early nor lost."""
    async with async_mysql_backend(table_name) as mysql:
        assert mysql.transaction is not None
        async with mysql.transaction() as transaction:
            conn = transaction.connection
            await conn.begin()
            async with conn.cursor() as cursor:
                await cursor.execute(f"INSERT INTO biz_{table_name} (note) VALUES ('before')")

            async def handler(attempt: AsyncAttempt) -> Response:
                async with attempt.connection.cursor() as cursor:
                    await cursor.execute(f"INSERT INTO biz_{table_name} (note) VALUES ('in')")
                return CREATED

            await AsyncIdempotency(mysql.store, POLICY).run(
                intent(), handler, transaction=transaction
            )
        assert mysql.notes() == ["before", "in"]


async def test_a_connection_factory_of_the_callers_is_switched_to_autocommit(
    table_name: str,
) -> None:
    """A claim through connections the caller's coroutine makes (autocommit off) is
    committed at once: another connection sees it."""

    async def factory() -> Any:
        return await asyncmy.connect(**connect_kwargs(MYSQL_URL), autocommit=False)

    async with async_mysql_backend(table_name) as mysql:
        store = AsyncMySQLStore(factory, table=table_name, clock="caller")
        try:
            assert (await store.claim(intent(), "mine", T0, T0 + 3600)).owned
        finally:
            await store.close()
        seen = await mysql.store.get("alice", "k-1")
    assert seen is not None
    assert seen.lease_token == "mine"


async def test_an_idle_connection_the_server_dropped_is_replaced(table_name: str) -> None:
    """asyncmy too: a connection idle past PING_AFTER whose ping fails is closed and
    a new one takes its place; the claim succeeds."""
    async with async_mysql_backend(table_name) as mysql:
        store = mysql.store
        assert await store.get("alice", "k-1") is None
        conn, _ = store.pool._idle.pop()
        async with conn.cursor() as cursor:
            await cursor.execute("SELECT CONNECTION_ID()")
            (ended,) = await cursor.fetchone()
        admin = await asyncmy.connect(**connect_kwargs(MYSQL_URL), autocommit=True)
        try:
            async with admin.cursor() as cursor:
                await cursor.execute(f"KILL {ended}")
        finally:
            await admin.ensure_closed()
        store.pool._idle.append((conn, -1e9))  # given back long ago
        assert (await store.claim(intent(), "mine", T0, T0 + 3600)).owned
        [(again, _)] = store.pool._idle
        assert again is not conn


async def test_unreachable_server_is_store_unavailable() -> None:
    """Nothing listening: 503, the handler never runs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = AsyncMySQLStore(f"mysql://root@127.0.0.1:{port}/test", timeout=2, clock="caller")
    calls: list[int] = []

    async def handler(attempt: AsyncAttempt) -> Response:
        calls.append(1)
        return CREATED

    with pytest.raises(StoreUnavailable) as raised:
        await AsyncIdempotency(store, POLICY).run(intent(), handler)
    await store.close()
    assert (raised.value.status, calls) == (503, [])


async def test_asyncmy_errors_are_read_by_the_shared_rules(table_name: str) -> None:
    """A real duplicate is error 1062; a refused connection is unavailability."""
    conn = await asyncmy.connect(**connect_kwargs(MYSQL_URL), autocommit=True)
    try:
        async with conn.cursor() as cursor:
            await cursor.execute(f"CREATE TEMPORARY TABLE {table_name} (id INT PRIMARY KEY)")
            await cursor.execute(f"INSERT INTO {table_name} VALUES (1)")
            with pytest.raises(asyncmy.errors.IntegrityError) as duplicate:
                await cursor.execute(f"INSERT INTO {table_name} VALUES (1)")
    finally:
        await conn.ensure_closed()
    assert error_code(duplicate.value) == 1062
    assert not is_unavailable(duplicate.value)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(asyncmy.errors.OperationalError) as refused:
        await asyncmy.connect(host="127.0.0.1", port=port, user="root", connect_timeout=2)
    assert is_unavailable(refused.value)


async def test_migrating_an_existing_table_again_logs_nothing(
    table_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every start of an app migrates: an existing table must not make asyncmy log its
    "already exists" note (it asks SHOW WARNINGS after a statement with one, and logs
    each), and the session's own note setting is back once the migration is done."""
    store = AsyncMySQLStore(MYSQL_URL, table=table_name, max_size=1)
    try:
        await store.migrate()
        with caplog.at_level(logging.INFO, logger="asyncmy"):
            await store.migrate()
        assert [r.getMessage() for r in caplog.records if r.name == "asyncmy"] == []
        async with store.pool.connection() as conn, conn.cursor() as cursor:  # its one
            await cursor.execute("SELECT @@session.sql_notes")
            assert (await cursor.fetchone())[0] == 1
    finally:
        await store.close()
        await _drop(table_name)


def test_the_async_adapter_is_exported_by_idemflow_transactions() -> None:
    from idemflow import transactions

    assert transactions.AsyncmyTransaction is AsyncmyTransaction


async def _drop(table: str) -> None:
    conn = await asyncmy.connect(**connect_kwargs(MYSQL_URL), autocommit=True)
    with contextlib.suppress(Exception):
        async with conn.cursor() as cursor:
            await cursor.execute(f"DROP TABLE IF EXISTS {table}")
    await conn.ensure_closed()


async def test_async_claimants_on_every_galera_primary_run_once(table_name: str) -> None:
    """Tasks claiming one key through AsyncMySQLStore on three Galera primaries at once:
    one execution, every other task 409 or the replay (certification losses included)."""
    from tests.backends import galera_urls

    stores = [AsyncMySQLStore(url, table=table_name, clock="caller") for url in galera_urls()]
    calls: list[str] = []

    async def handler(attempt: AsyncAttempt) -> Response:
        calls.append(attempt.record.key)
        return CREATED

    async def claim(store: AsyncMySQLStore, key: str, go: asyncio.Event) -> str:
        await go.wait()
        try:
            outcome = await AsyncIdempotency(store, POLICY).run(intent(key), handler)
        except InProgress:
            return "in_progress"
        return "replayed" if outcome.replayed else "executed"

    try:
        await stores[0].migrate()
        for n in range(10):
            go = asyncio.Event()
            tasks = [
                asyncio.create_task(claim(store, f"g{n}", go)) for store in stores for _ in range(4)
            ]
            await asyncio.sleep(0)
            go.set()
            counts = collections.Counter(await asyncio.gather(*tasks))
            assert counts["executed"] == 1, counts
            assert counts["in_progress"] + counts["replayed"] == 11, counts
        assert sorted(calls) == sorted(f"g{n}" for n in range(10))
    finally:
        for store in stores:
            await store.close()
        conn = await asyncmy.connect(**connect_kwargs(galera_urls()[0]), autocommit=True)
        async with conn.cursor() as cursor:
            await cursor.execute(f"DROP TABLE IF EXISTS {table_name}")
        await conn.ensure_closed()
