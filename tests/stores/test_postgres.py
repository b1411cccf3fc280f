"""PostgreSQL specifics: connection options, and replays that never queue on a lock."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from idemflow import Idempotency, InProgress, Intent, Policy, Response, StoreUnavailable
from tests.conftest import POSTGRES_URL, unreachable

psycopg = pytest.importorskip("psycopg")
from idemflow.stores.postgres import _MIGRATE_LOCK, PostgresStore  # noqa: E402


@pytest.fixture
def schema(table_name: str) -> Iterator[str]:
    name = f"s_{table_name}"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE SCHEMA {name}")
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    yield name
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {name} CASCADE")


def test_options_in_the_url_are_kept(schema: str) -> None:
    """A search_path given in the URL still applies next to our lock timeout."""
    url = f"{POSTGRES_URL}?options=-c%20search_path%3D{schema}"
    store = PostgresStore(url, table="keys", max_size=2, clock="caller")
    try:
        store.migrate()
        with store.pool.connection() as conn:
            search_path, lock_timeout = conn.execute(
                "SELECT current_setting('search_path'), current_setting('lock_timeout')"
            ).fetchone()
    finally:
        store.close()

    assert (search_path, lock_timeout) == (schema, "50ms")
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        assert conn.execute(f"SELECT to_regclass('{schema}.keys')").fetchone()[0] is not None


def test_migrate_waits_for_another_migration(schema: str) -> None:
    """Migrations queue on one advisory lock (any table): the claims' 50 ms must not bound it."""
    url = f"{POSTGRES_URL}?options=-c%20search_path%3D{schema}"
    store = PostgresStore(url, table="keys", max_size=2, clock="caller")
    failures: list[BaseException] = []

    def migrate() -> None:
        try:
            store.migrate()
        except BaseException as exc:
            failures.append(exc)

    try:
        with psycopg.connect(url) as other, psycopg.connect(url, autocommit=True) as watcher:
            other.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_LOCK,))  # mid-migration
            migration = threading.Thread(target=migrate)
            migration.start()
            deadline = time.monotonic() + 10
            while migration.is_alive() and time.monotonic() < deadline:
                # Hold the lock until the migration has waited far longer than 50 ms.
                waited = watcher.execute(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = 'advisory' "
                    "AND now() - waitstart > interval '500 ms'"
                ).fetchone()
                if waited and waited[0]:
                    break
            other.commit()
            migration.join(30)
    finally:
        store.close()

    assert failures == []
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        assert conn.execute(f"SELECT to_regclass('{schema}.keys')").fetchone()[0] is not None


@pytest.mark.slow
def test_concurrent_replays_of_a_settled_key_never_wait_on_each_other(schema: str) -> None:
    """ON CONFLICT DO NOTHING locks nothing: 48 simultaneous replays all get the response."""
    url = f"{POSTGRES_URL}?options=-c%20search_path%3D{schema}"
    store = PostgresStore(url, table="keys", max_size=8, clock="caller")
    store.migrate()
    idem = Idempotency(store, Policy(request_timeout=5))
    intent = Intent("alice", "settled", "fp", "POST /payments")
    idem.run(intent, lambda attempt: Response(201, b"paid"))
    barrier = threading.Barrier(48)
    answers: list[object] = []

    def replay() -> None:
        barrier.wait()
        for _ in range(20):
            try:
                outcome = idem.run(intent, lambda attempt: Response(500, b"must not run"))
                answers.append((outcome.replayed, outcome.response.body))
            except InProgress as exc:  # what a row lock would have caused
                answers.append(exc)

    threads = [threading.Thread(target=replay) for _ in range(48)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close()

    assert answers == [(True, b"paid")] * (48 * 20)


# --- a restart of PostgreSQL under a pool ------------------------------------------------


def _claims_refused_until_one_is_served(store: PostgresStore, label: str) -> int:
    """Fresh claims, one after the other, until one is served: how many were refused
    (StoreUnavailable, a 503: nothing recorded) first."""
    from idemflow import StoreUnavailable
    from tests.factories import uncorrelated_intent

    for refused in range(20):
        now = time.time()
        try:
            claim = store.claim(uncorrelated_intent(f"{label}-{refused}"), "t", now, now + 60)
        except StoreUnavailable:
            continue
        assert claim.owned
        return refused
    pytest.fail(f"{label}: 20 claims refused after the restart")


@contextlib.contextmanager
def _store_on_a_private_postgres(table_name: str) -> Iterator[tuple[Any, PostgresStore]]:
    """A store whose pool holds four connections, on a private cluster of its own."""
    from tests._private_postgres import PrivatePostgresUnavailable, private_postgres

    with contextlib.ExitStack() as stack:
        try:
            cluster = stack.enter_context(private_postgres())
        except PrivatePostgresUnavailable as exc:
            unreachable("a private PostgreSQL", exc)
        store = PostgresStore(cluster.url, table=table_name, max_size=4)
        stack.callback(store.close)
        store.migrate()
        held = [store.pool.getconn() for _ in range(4)]  # four connections in the pool
        for conn in held:
            store.pool.putconn(conn)
        yield cluster, store


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["immediate", "fast"])
def test_after_a_restart_no_claim_is_refused_for_a_dead_pooled_connection(
    table_name: str, mode: str
) -> None:
    """PostgreSQL restarted under a store whose pool holds four connections: they all died
    with it. Each checkout polls its connection's socket (no round trip) and skips the ones
    the server closed, so the first claim after the restart is served, on a new connection
    (before: each dead one refused one claim with a 503; docs/stores.md)."""
    with _store_on_a_private_postgres(table_name) as (cluster, store):
        cluster.stop(mode)
        cluster.start()
        refused = _claims_refused_until_one_is_served(store, "after-restart")
        refused_later = _claims_refused_until_one_is_served(store, "later")

    assert (refused, refused_later) == (0, 0)


@pytest.mark.slow
def test_after_a_restart_the_async_store_refuses_no_claim_either(table_name: str) -> None:
    """The async store's checkout polls its connections too: after a restart under a pool
    of four live connections, the first claim is served."""
    from idemflow.stores.postgres import AsyncPostgresStore
    from tests.factories import uncorrelated_intent

    async def claims_after_a_restart(cluster: Any) -> list[bool]:
        store = AsyncPostgresStore(cluster.url, table=table_name, max_size=4)
        try:
            await store.migrate()
            held = [await store.pool.getconn() for _ in range(4)]
            for conn in held:
                await store.pool.putconn(conn)
            cluster.stop("immediate")
            cluster.start()
            now = time.time()
            intents = [uncorrelated_intent(f"async-{n}") for n in range(5)]
            return [(await store.claim(i, "t", now, now + 60)).owned for i in intents]
        finally:
            await store.close()

    with _store_on_a_private_postgres(table_name) as (cluster, _):
        owned = asyncio.run(claims_after_a_restart(cluster))

    assert owned == [True] * 5


@pytest.mark.slow
@pytest.mark.parametrize("single_commit", [False, True], ids=["two-commit", "single-commit"])
@pytest.mark.parametrize("taken_from", ["store", "pool"])
def test_after_a_restart_a_transactional_request_is_refused_only_off_the_stores_checkout(
    table_name: str, taken_from: str, single_commit: bool
) -> None:
    """The request's transaction on the store's pool (two commits: its claim on that
    connection; one: the claim in it): taken through the store's checkout
    (``store.connection``), no request is refused after a restart; taken from the pool
    directly, each dead pooled connection refuses one (a 503, nothing recorded), as
    psycopg_pool hands it out unchecked."""
    from idemflow.edge import pooled_transaction
    from idemflow.transactions import PsycopgTransaction
    from tests.factories import uncorrelated_intent

    with _store_on_a_private_postgres(table_name) as (cluster, store):
        idem = Idempotency(store, Policy())
        acquire = store.connection if taken_from == "store" else store.pool.connection
        cluster.stop("immediate")
        cluster.start()
        answers = []
        for n in range(6):
            try:
                with pooled_transaction(acquire, PsycopgTransaction) as transaction:
                    outcome = idem.run(
                        uncorrelated_intent(f"tx-{n}"),
                        lambda attempt: Response(201, b"paid"),
                        transaction=transaction,
                        single_commit=single_commit,
                    )
                answers.append(outcome.response.status)
            except StoreUnavailable:
                answers.append(503)

    assert answers == ([201] * 6 if taken_from == "store" else [503] * 4 + [201] * 2)


@pytest.mark.slow
def test_after_a_restart_the_middleware_on_a_pool_of_two_refuses_no_request(
    table_name: str,
) -> None:
    """``IdempotencyMiddleware`` on a store whose pool holds two connections, both used just
    before PostgreSQL restarted: the claims and completions of the next requests take live
    connections, so each answers 201 and its key is completed (before: a 503 for each dead
    connection, and a completion that drew one left its key claimed)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.responses import Response as StarletteResponse

    from idemflow import AsyncIdempotency, State
    from idemflow.stores.postgres import AsyncPostgresStore
    from tests.guarantees.test_modes import call_asgi, middleware_app, status_of

    async def create(request: Request) -> StarletteResponse:
        return JSONResponse({"id": 1}, status_code=201)

    async def requests_after_a_restart(cluster: Any) -> list[tuple[int, Any]]:
        store = AsyncPostgresStore(cluster.url, table=table_name, max_size=2)
        try:
            await store.migrate()
            app = middleware_app(AsyncIdempotency(store, Policy()), create)
            held = [await store.pool.getconn() for _ in range(2)]
            for conn in held:
                await store.pool.putconn(conn)
            cluster.stop("immediate")
            cluster.start()
            answers = []
            for n in range(4):
                status = status_of(await call_asgi(app, f"mw-{n}"))
                record = await store.get("carol", f"mw-{n}")
                answers.append((status, record.state if record else None))
            return answers
        finally:
            await store.close()

    with _store_on_a_private_postgres(table_name) as (cluster, _):
        answers = asyncio.run(requests_after_a_restart(cluster))

    assert answers == [(201, State.COMPLETED)] * 4


def test_a_pooled_connection_with_a_notification_waiting_is_kept(table_name: str) -> None:
    """A socket can be readable for another reason than the server's goodbye: a
    notification for a channel the connection listens on. The checkout asks that one with
    an empty statement and keeps it (the same server session serves the claim), where
    taking readable for dead would drop a live connection."""
    psycopg = pytest.importorskip("psycopg")
    store = PostgresStore(POSTGRES_URL, table=table_name, max_size=1)
    try:
        store.migrate()
        with store.pool.connection() as conn:
            conn.execute("LISTEN idemflow_checkout_test")
            session = conn.info.backend_pid
        with psycopg.connect(POSTGRES_URL, autocommit=True) as other:
            other.execute("NOTIFY idemflow_checkout_test")
        time.sleep(0.2)  # the notification reaches the idle connection's socket
        now = time.time()
        from tests.factories import uncorrelated_intent

        assert store.claim(uncorrelated_intent("notified"), "t", now, now + 60).owned
        with store.pool.connection() as conn:
            assert conn.info.backend_pid == session
    finally:
        with contextlib.suppress(Exception), store.pool.connection() as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table_name}")
        store.close()


@pytest.mark.slow
def test_a_claim_taken_before_a_restart_completes_after_it(table_name: str) -> None:
    """The store restarted while the request ran (its claim committed before): the
    completion takes a live connection, so the key is completed and replays, never left
    claimed with its outcome unknown for the sweeper because it drew a dead connection."""
    from tests.factories import uncorrelated_intent

    with _store_on_a_private_postgres(table_name) as (cluster, store):
        idem = Idempotency(store, Policy())
        intent = uncorrelated_intent("spans-a-restart")

        def handler(attempt: Any) -> Response:
            cluster.stop("immediate")
            cluster.start()
            return Response(201, b"paid")

        first = idem.run(intent, handler)
        again = idem.run(intent, lambda attempt: Response(500, b"must not run"))

    assert (first.replayed, first.response.body) == (False, b"paid")
    assert (again.replayed, again.response.body) == (True, b"paid")
