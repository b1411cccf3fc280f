"""
Django: the migration's schema, the completion inside ``transaction.atomic()``,
enclosing atomic blocks (``ATOMIC_REQUESTS``), settings and the management commands.

Every test runs on SQLite, PostgreSQL and MariaDB through Django's own
connections; a duplicate "request" runs in a thread of its own, with its own
connection, as Django serves requests.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings

from idemflow import (
    Attempt,
    ConfigurationError,
    Idempotency,
    InProgress,
    Intent,
    Response,
    State,
    StoreUnavailable,
)
from idemflow._events import CountingObserver
from idemflow.integrations.django import (
    DjangoTransaction,
    get_idempotency,
    get_store,
)
from idemflow.integrations.django.conf import idemflow_settings, observer_of
from idemflow.stores.django import DjangoStore
from idemflow.stores.sql import SQLStore
from idemflow.stores.urls import open_store
from idemflow.testing import FrozenClock
from tests.backends import MYSQL_URL
from tests.conftest import POSTGRES_URL
from tests.factories import POLICY, intent
from tests.integrations.django_setup import VENDOR_ALIAS, execute, require

CREATED = Response.json(201, {"id": 1})
VENDORS = [
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
]
SERVERS = VENDORS[1:]
_ID = {
    "sqlite": "id INTEGER PRIMARY KEY",
    "postgres": "id BIGSERIAL PRIMARY KEY",
    "mysql": "id BIGINT AUTO_INCREMENT PRIMARY KEY",
}


class Database:
    """One vendor's alias with a key table and a business table of this test's own."""

    def __init__(self, vendor: str, table: str) -> None:
        self.vendor = vendor
        self.alias = VENDOR_ALIAS[vendor]
        self.table = table
        require(self.alias)
        self.store = DjangoStore(self.alias, table=table, clock="caller")
        self.store.migrate()
        execute(self.alias, f"CREATE TABLE biz_{table} ({_ID[vendor]}, note TEXT)")
        self.clock = FrozenClock()
        self.idem = Idempotency(self.store, POLICY, clock=self.clock)

    def write(self, note: str) -> None:
        with connections[self.alias].cursor() as cursor:
            cursor.execute(f"INSERT INTO biz_{self.table} (note) VALUES (%s)", [note])

    def count(self) -> int:
        return int(execute(self.alias, f"SELECT count(*) FROM biz_{self.table}")[0][0])

    def state(self, key: str = "k-1") -> State | None:
        record = self.store.get("alice", key)
        return None if record is None else record.state

    def run(self, handler: Callable[[Attempt], Response], key: str = "k-1") -> Any:
        return self.idem.run(intent(key), handler, transaction=DjangoTransaction(self.alias))

    def in_thread(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` as another request would: another thread, its own connection."""
        result: list[Any] = []

        def target() -> None:
            try:
                result.append(action())
            except BaseException as exc:
                result.append(exc)
            finally:
                connections.close_all()

        thread = threading.Thread(target=target)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive()
        return result[0]

    def drop(self) -> None:
        self.store.close()
        execute(self.alias, f"DROP TABLE IF EXISTS {self.table}")
        execute(self.alias, f"DROP TABLE IF EXISTS biz_{self.table}")


@pytest.fixture(params=VENDORS)
def db(request: pytest.FixtureRequest, table_name: str) -> Iterator[Database]:
    made = Database(request.param, table_name)
    yield made
    made.drop()


# --- completion in the view's transaction ---------------------------------------------------


def test_completion_commits_with_the_business_row(db: Database) -> None:
    """The handler's row and the completed record commit together, on Django's connection."""

    def charge(attempt: Attempt) -> Response:
        assert attempt.connection is connections[db.alias]
        assert connections[db.alias].in_atomic_block  # the handler runs in transaction.atomic()
        db.write("paid")
        return CREATED

    outcome = db.run(charge)

    assert (outcome.response, outcome.replayed) == (CREATED, False)
    assert (db.count(), db.state()) == (1, State.COMPLETED)
    assert not connections[db.alias].in_atomic_block  # nothing left open
    assert db.run(charge).replayed
    assert db.count() == 1


def test_transient_outcome_rolls_the_row_back_and_releases(db: Database) -> None:
    def fail(attempt: Attempt) -> Response:
        db.write("half-done")
        return Response(503, b"provider down")

    assert db.run(fail).response.status == 503
    assert (db.count(), db.state()) == (0, State.RELEASED)


def test_on_commit_callbacks_run_only_after_the_completion_commits(db: Database) -> None:
    """Django's on_commit hooks fire after COMMIT: with the record, never after a rollback."""
    fired: list[State | None] = []

    def charge(attempt: Attempt) -> Response:
        transaction.on_commit(lambda: fired.append(db.state()), using=db.alias)
        return CREATED

    def fail(attempt: Attempt) -> Response:
        transaction.on_commit(lambda: fired.append(db.state("k-2")), using=db.alias)
        return Response(503)

    db.run(charge)
    db.run(fail, key="k-2")

    assert fired == [State.COMPLETED]


def test_a_transaction_marked_for_rollback_is_never_reported_committed(db: Database) -> None:
    """A database error caught inside the view's atomic block (Django marks it for rollback):
    the response must not claim success; the key is released and nothing committed."""

    def swallow(attempt: Attempt) -> Response:
        db.write("paid")
        transaction.set_rollback(True, using=db.alias)
        return CREATED

    with pytest.raises(transaction.TransactionManagementError):  # Django refuses the UPDATE
        db.run(swallow)
    assert (db.count(), db.state()) == (0, State.RELEASED)


# --- inside an enclosing atomic block (ATOMIC_REQUESTS) -------------------------------------


@pytest.fixture(params=SERVERS)
def server_db(request: pytest.FixtureRequest, table_name: str) -> Iterator[Database]:
    made = Database(request.param, table_name)
    yield made
    made.drop()


def test_sqlite_refuses_an_enclosing_atomic_block_and_gives_the_key_back(
    table_name: str,
) -> None:
    """One writer: inside the request's transaction the release could not be written once the
    request wrote, so the attempt is refused before the handler runs, and the key released."""
    db = Database("sqlite", table_name)
    try:
        ran: list[bool] = []

        def handler(attempt: Attempt) -> Response:
            ran.append(True)
            return CREATED

        with (
            pytest.raises(ConfigurationError, match="SQLite admits one writer"),
            transaction.atomic(using=db.alias),
        ):
            db.run(handler)
        assert (ran, db.state()) == ([], State.RELEASED)
    finally:
        db.drop()


def test_in_an_enclosing_atomic_block_the_claim_is_visible_before_the_handler_runs(
    server_db: Database,
) -> None:
    """In an ATOMIC_REQUESTS view the request's transaction is open before idemflow runs: the
    claim goes through a side connection and commits at once, so a duplicate from another
    request gets 409 while the handler runs, and the completion commits with the request."""
    seen: list[Any] = []

    def charge(attempt: Attempt) -> Response:
        seen.append(server_db.in_thread(lambda: server_db.store.get("alice", "k-1")))
        seen.append(server_db.in_thread(lambda: server_db.idem.run(intent(), lambda a: CREATED)))
        server_db.write("paid")
        return CREATED

    with transaction.atomic(using=server_db.alias):
        server_db.run(charge)
        assert connections[server_db.alias].in_atomic_block  # the request's transaction is not ours
        assert (
            server_db.in_thread(server_db.count) == 0
        )  # nor committed by us: it commits with the request
    committed, duplicate = seen

    assert committed.state is State.IN_PROGRESS
    assert isinstance(duplicate, InProgress)
    assert (server_db.count(), server_db.state()) == (1, State.COMPLETED)


def test_an_enclosing_rollback_takes_the_completion_and_the_row_with_it(
    server_db: Database,
) -> None:
    """The request's transaction rolls back after idemflow returned: effect and record go
    together; the key stays claimed (never settled without its effect) for the sweeper."""

    class Abort(Exception):
        pass

    def charge(attempt: Attempt) -> Response:
        server_db.write("paid")
        return CREATED

    def request() -> None:
        with transaction.atomic(using=server_db.alias):
            server_db.run(charge)
            raise Abort

    with pytest.raises(Abort):
        request()

    assert (server_db.count(), server_db.state()) == (0, State.IN_PROGRESS)


def test_a_release_survives_the_enclosing_rollback(server_db: Database) -> None:
    """The handler raises (a DRF ValidationError, say): the key must be given back although
    the exception then rolls the request's transaction back (DRF marks it for rollback)."""

    class Invalid(Exception):
        pass

    def reject(attempt: Attempt) -> Response:
        server_db.write("half-done")
        raise Invalid

    with pytest.raises(Invalid), transaction.atomic(using=server_db.alias):
        server_db.run(reject)

    assert (server_db.count(), server_db.state()) == (0, State.RELEASED)
    assert server_db.run(lambda attempt: CREATED).response == CREATED  # the retry really runs


def test_a_transient_outcome_inside_an_enclosing_block_rolls_back_to_the_savepoint(
    server_db: Database,
) -> None:
    """Only the attempt's writes are undone; the request's own earlier writes stay."""

    def fail(attempt: Attempt) -> Response:
        server_db.write("attempt")
        return Response(503)

    with transaction.atomic(using=server_db.alias):
        server_db.write("before")
        assert server_db.run(fail).response.status == 503

    assert execute(server_db.alias, f"SELECT note FROM biz_{server_db.table}") == [("before",)]
    assert server_db.state() is State.RELEASED


# --- the migration ---------------------------------------------------------------------------


def _schema(vendor: str, alias: str, table: str) -> list[Any]:
    """The table's columns, constraints and indexes as the server reports them."""
    if vendor == "postgres":
        columns = execute(
            alias,
            "SELECT column_name, data_type, is_nullable, column_default, is_identity, "
            "identity_generation FROM information_schema.columns WHERE table_name = %s "
            "ORDER BY ordinal_position",
            [table],
        )
        constraints = execute(
            alias,
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
            "WHERE conrelid = %s::regclass ORDER BY conname",
            [table],
        )
        indexes = execute(
            alias,
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s ORDER BY indexname",
            [table],
        )
        return [columns, constraints, indexes]
    if vendor == "mysql":
        return [execute(alias, f"SHOW CREATE TABLE {table}")[0][1]]
    return execute(
        alias,
        "SELECT type, name, sql FROM sqlite_master WHERE tbl_name = %s ORDER BY name",
        [table],
    )


def _store_url(vendor: str) -> str:
    if vendor == "postgres":
        return POSTGRES_URL
    if vendor == "mysql":
        return MYSQL_URL
    return "sqlite:///" + str(connections["default"].settings_dict["NAME"])


def _forget_idemflow_migrations(alias: str) -> None:
    """The shared server's ``django_migrations`` as if idemflow's were never applied: a run
    stopped between ``migrate`` and ``migrate … zero`` must not fail every later one."""
    from django.db.migrations.recorder import MigrationRecorder

    recorder = MigrationRecorder(connections[alias])
    if recorder.has_table():
        recorder.migration_qs.filter(app="idemflow").delete()


@pytest.mark.parametrize("vendor", VENDORS)
def test_the_migration_creates_the_schema_idemflow_migrate_creates(
    vendor: str, table_name: str
) -> None:
    """`manage.py migrate` and `idemflow migrate` give the same columns, constraints and
    indexes; `migrate idemflow zero` drops the table."""
    alias = VENDOR_ALIAS[vendor]
    require(alias)
    settings = {"table": table_name, "database": alias}
    out = io.StringIO()
    _forget_idemflow_migrations(alias)
    try:
        with override_settings(IDEMFLOW=settings):
            call_command("migrate", "idemflow", database=alias, stdout=out, verbosity=0)
            by_django = _schema(vendor, alias, table_name)
            call_command("migrate", "idemflow", "zero", database=alias, stdout=out, verbosity=0)
        assert table_name not in connections[alias].introspection.table_names()
        store = open_store(_store_url(vendor), table=table_name)
        try:
            store.migrate()  # what `idemflow migrate URL --table …` runs
        finally:
            store.close()
        by_idemflow = _schema(vendor, alias, table_name)
    finally:
        execute(alias, f"DROP TABLE IF EXISTS {table_name}")

    assert by_django
    assert by_django == by_idemflow


@pytest.mark.parametrize("vendor", VENDORS)
def test_the_migration_upgrades_a_table_an_earlier_version_created(
    vendor: str, table_name: str
) -> None:
    """`manage.py migrate` after an upgrade gives the key table each record's own stale
    threshold (0002), so the store claims and sweeps on it; a table made now: untouched."""
    from tests.stores.test_upgrade import earlier_ddl

    alias = VENDOR_ALIAS[vendor]
    require(alias)
    settings = {"table": table_name, "database": alias}
    store = open_store(_store_url(vendor), table=table_name)
    assert isinstance(store, SQLStore)
    _forget_idemflow_migrations(alias)
    try:
        with override_settings(IDEMFLOW=settings):
            call_command("migrate", "idemflow", "0001", database=alias, verbosity=0)
            execute(alias, f"DROP TABLE {table_name}")
            for statement in earlier_ddl(store):  # as the earlier version's 0001 made it
                execute(alias, statement)
            call_command("migrate", "idemflow", database=alias, verbosity=0)
            with connections[alias].cursor() as cursor:
                described = connections[alias].introspection.get_table_description(
                    cursor, table_name
                )
            now = time.time()
            claimed = store.claim(Intent("alice", "k", "fp"), "l", now, now + 60, stale_after=1)
            marked = store.sweep(State.IN_PROGRESS, now + 2, now, now + 60, 10)
            call_command("migrate", "idemflow", "zero", database=alias, verbosity=0)
    finally:
        store.close()
        execute(alias, f"DROP TABLE IF EXISTS {table_name}")

    assert {"stale_after", "stale_at"} <= {column.name for column in described}
    assert claimed.owned
    assert [record.key for record in marked] == ["k"]


def test_the_migration_leaves_other_aliases_alone(table_name: str) -> None:
    """Only IDEMFLOW['database'] gets the key table."""
    require("default")
    settings = {"table": table_name, "database": "postgres"}
    with override_settings(IDEMFLOW=settings):
        call_command("migrate", "idemflow", database="default", verbosity=0)
        try:
            assert _schema("sqlite", "default", table_name) == []
        finally:
            call_command("migrate", "idemflow", "zero", database="default", verbosity=0)


# --- settings and management commands ---------------------------------------------------------


def test_settings_mistakes_are_improperly_configured() -> None:
    with (
        override_settings(IDEMFLOW={"request_timout": 30}),
        pytest.raises(ImproperlyConfigured, match="unknown keys"),
    ):
        idemflow_settings()
    with (
        override_settings(IDEMFLOW={"database": "nowhere"}),
        pytest.raises(ImproperlyConfigured, match="not in DATABASES"),
    ):
        idemflow_settings()
    with (
        override_settings(IDEMFLOW={"request_timeout": -1}),
        pytest.raises(ImproperlyConfigured, match="request_timeout"),
    ):
        idemflow_settings()
    for observer in ("tests.nowhere.METRICS", "idemflow._events.CountingObserver", 42):
        with (  # at start-up (AppConfig.ready asks observer_of), not a 500 on each request
            override_settings(IDEMFLOW={"observer": observer}),
            pytest.raises(ImproperlyConfigured, match="observer"),
        ):
            observer_of(idemflow_settings())


#: What ``IDEMFLOW['observer']`` names by its dotted path below.
COUNTED = CountingObserver()


def test_the_observer_setting_names_the_drivers_observer_by_object_or_path() -> None:
    """``IDEMFLOW['observer']`` is the driver's observer, given as the object or its path."""
    metrics = CountingObserver()
    with override_settings(IDEMFLOW={"observer": metrics}):
        assert get_idempotency().observer is metrics
    with override_settings(IDEMFLOW={"observer": f"{__name__}.COUNTED"}):
        assert get_idempotency().observer is COUNTED


def test_settings_build_the_store_and_policy_once(table_name: str) -> None:
    with override_settings(IDEMFLOW={"table": table_name, "request_timeout": 7, "retention": 60}):
        store = get_store()
        assert isinstance(store, DjangoStore)
        assert (store.using, store.table) == ("default", table_name)
        assert get_idempotency().policy.request_timeout == timedelta(seconds=7)
        assert get_store() is store
    assert get_store() is not store  # the override ended: rebuilt from the settings


def test_a_store_named_by_url_waits_within_the_configured_request_timeout(tmp_path: Any) -> None:
    """``IDEMFLOW['store']``, a URL, is opened with the configured policy: its waits are
    bounded by that policy's store wait (half of 1 s), not ``Policy()``'s 5 s."""
    url = f"sqlite:///{tmp_path / 'keys.db'}"
    with override_settings(IDEMFLOW={"store": url, "request_timeout": 1}):
        store: Any = get_store()
        busy = store._connections().conn.execute("PRAGMA busy_timeout").fetchone()
        store.close()
    assert busy == (500,)


@pytest.mark.parametrize("vendor", VENDORS)
def test_management_commands_sweep_and_purge_the_django_store(vendor: str, table_name: str) -> None:
    alias = VENDOR_ALIAS[vendor]
    require(alias)
    with override_settings(IDEMFLOW={"table": table_name, "database": alias, "clock": "caller"}):
        store = get_store()
        try:
            store.migrate()
            long_ago = 1_000_000.0
            crashed = store.claim(intent("crashed"), "lease-a", long_ago, long_ago + 10)
            settled = store.claim(intent("old"), "lease-b", long_ago, long_ago + 10).record
            store.complete(settled, State.COMPLETED, CREATED, long_ago, long_ago + 10)
            out = io.StringIO()

            call_command("idemflow_sweep", stdout=out)
            call_command("idemflow_purge", stdout=out)

            assert crashed.owned
            released = store.get("alice", "crashed")
            assert released is not None
            assert released.state is State.RELEASED
            assert store.get("alice", "old") is None
            assert "released=1" in out.getvalue()
            assert "purged: 1 records" in out.getvalue()
        finally:
            execute(alias, f"DROP TABLE IF EXISTS {table_name}")


# --- a pool of one that cannot serve the request ------------------------------------------


class _URLs:
    """The two doors: a decorated function view, a view behind the middleware."""

    urlpatterns: tuple[Any, ...] = ()


_POOLED_STORES = [
    pytest.param("django", id="DjangoStore-the-claim"),
    pytest.param(POSTGRES_URL, id="PostgresStore-the-BEGIN"),
]


@pytest.mark.postgres
@pytest.mark.parametrize("store_setting", _POOLED_STORES)
@pytest.mark.parametrize("single_commit", [False, True], ids=["two-commit", "single-commit"])
@pytest.mark.parametrize("path", ["/payments", "/mw/payments"], ids=["idempotent", "middleware"])
def test_a_django_pool_of_one_that_cannot_serve_the_request_is_503_and_nothing_is_left(
    store_setting: str, single_commit: bool, path: str, table_name: str
) -> None:
    """Django's own psycopg pool (``OPTIONS["pool"]``) of one connection, held elsewhere, so
    a checkout waits out the pool's timeout: in the key store's claim (``DjangoStore`` on
    that alias), or at the ``BEGIN`` of the view's ``atomic()`` after a claim the key store's
    own pool served (a ``postgresql://`` store), or in the claim that begins it (single
    commit). Through ``@idempotent`` and the middleware, on Django's request handler: a 503
    store-unavailable problem with ``Retry-After`` (Django's ``OperationalError`` over
    psycopg's ``PoolTimeout`` is the store's outage, not the view's 500), the view never
    ran, the key free at once (no record, or released); the retry, once the pool is free,
    runs the view once."""
    from django.http import HttpRequest, JsonResponse
    from django.test import Client
    from django.urls import path as route

    from idemflow.integrations.django import idempotent
    from tests.integrations.django_setup import POOL_TIMEOUT

    alias = "postgres-pool"
    require(alias)
    ran: list[str] = []

    def pay(request: HttpRequest) -> JsonResponse:
        ran.append(request.path)
        return JsonResponse({"id": len(ran)}, status=201)

    _URLs.urlpatterns = (route("payments", idempotent(pay)), route("mw/payments", pay))
    settings = {
        "database": alias,
        "table": table_name,
        "store": store_setting,
        "single_commit": single_commit,
        "request_timeout": 5,
        "principal": lambda request: "dora",
        "endpoints": ["POST /mw/payments"],
    }
    middleware = ["idemflow.integrations.django.middleware.IdempotencyMiddleware"]
    client = Client()

    def post() -> Any:
        return client.post(path, b"{}", "application/json", HTTP_IDEMPOTENCY_KEY="k-pool")

    with override_settings(IDEMFLOW=settings, ROOT_URLCONF=_URLs, MIDDLEWARE=middleware):
        store = get_store()
        store.migrate()
        pool = connections[alias].pool
        try:
            connections[alias].close()  # the pool's one connection back: ours to hold below
            with pool.connection():  # the pool's one connection, held by "another request"
                first = post()
            left = store.get("dora", "k-pool")
            connections[alias].close()  # as Django does when a request ends
            retry = post()
            replay = post()
        finally:
            connections[alias].close()
            store.close()
            execute("postgres", f"DROP TABLE IF EXISTS {table_name}")

    assert first.status_code == 503, first.content
    assert first["Content-Type"] == "application/problem+json"
    problem = first.json()
    assert problem["type"] == "https://idemflow.dev/problems/store-unavailable"
    assert f"{POOL_TIMEOUT:.2f} sec" in problem["detail"]  # the pool's own wait ran out
    assert int(first["Retry-After"]) >= 1
    assert left is None or left.state is State.RELEASED  # never claimed for the sweeper
    assert retry.status_code == 201, retry.content
    assert replay.status_code == 201
    assert replay["Idempotent-Replayed"] == "true"
    assert ran == [path]


@pytest.mark.postgres
@pytest.mark.parametrize("begun", [False, True], ids=["nothing-sent-yet", "a-read-first"])
def test_in_an_enclosing_atomic_block_a_pool_of_one_serves_the_claim_or_fails_closed(
    begun: bool, table_name: str
) -> None:
    """Django's psycopg pool of one connection (the ``postgres-pool`` alias), the request's
    transaction open (``ATOMIC_REQUESTS``). With nothing sent yet, the claim commits alone
    on the request's one connection before the transaction's BEGIN (a duplicate sees it at
    once), and the completion and the release run there too: never a second connection
    from the pool (before: a side connection from the same pool, which waited out its
    timeout, a 503). After a read of the request's own the transaction has begun: the claim
    cannot commit alone on it, and is never made one of its writes (a crash after an
    external call would take the claim with it, and the retry would run the call again
    under a new downstream key): it needs the side connection, which a pool of one cannot
    give, so a 503 store-unavailable, the handler not run, nothing recorded."""
    alias = "postgres-pool"
    require(alias)
    store = DjangoStore(alias, table=table_name, clock="caller")
    store.migrate()
    execute(alias, f"CREATE TABLE biz_{table_name} (id BIGSERIAL PRIMARY KEY, note TEXT)")
    idem = Idempotency(store, POLICY, clock=FrozenClock())
    connections[alias].close()  # the pool's one connection back: the "request" takes it
    ran: list[str] = []

    def write(note: str) -> None:
        execute(alias, f"INSERT INTO biz_{table_name} (note) VALUES (%s)", [note])

    def charge(attempt: Attempt) -> Response:
        ran.append(attempt.record.key)
        write("paid")
        return CREATED

    def reject(attempt: Attempt) -> Response:
        ran.append(attempt.record.key)
        write("half-done")
        raise KeyError("invalid")

    def request(key: str, handler: Callable[[Attempt], Response]) -> Any:
        with transaction.atomic(using=alias):
            if begun:
                execute(alias, "SELECT 1")  # e.g. a database-backed authentication
            return idem.run(intent(key), handler, transaction=DjangoTransaction(alias))

    try:
        if begun:
            with pytest.raises(StoreUnavailable):
                request("k-1", charge)
        else:
            outcome = request("k-1", charge)
            with pytest.raises(KeyError):
                request("k-2", reject)
            replay = request("k-1", charge)
        notes = sorted(row[0] for row in execute(alias, f"SELECT note FROM biz_{table_name}"))
        states = [store.get("alice", key) for key in ("k-1", "k-2")]
    finally:
        connections[alias].close()
        store.close()
        execute("postgres", f"DROP TABLE IF EXISTS {table_name}")
        execute("postgres", f"DROP TABLE IF EXISTS biz_{table_name}")

    if begun:
        assert (ran, notes, states) == ([], [], [None, None])
        return
    assert (outcome.response, replay.replayed) == (CREATED, True)
    assert (ran, notes) == (["k-1", "k-2"], ["paid"])
    completed, released = (None if found is None else found.state for found in states)
    assert (completed, released) == (State.COMPLETED, State.RELEASED)
