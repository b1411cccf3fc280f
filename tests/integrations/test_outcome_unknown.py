"""
``OutcomeUnknown`` through every framework's own door: the WSGI middleware, the FastAPI
dependency (Starlette's ``Idempotent``), Flask's ``protect`` and Django's ``@idempotent``,
in process. An endpoint that charged and then cannot tell whether the charge went through
raises ``OutcomeUnknown``: the caller gets a 503 outcome-unknown problem with
``Retry-After``, the key stays ``in_progress`` (the endpoint's transaction rolled back what
it wrote), and a retry gets 409 instead of running the endpoint again. The ASGI middleware,
on every store, is in tests/guarantees/test_outcome_unknown.py.
"""

# No ``from __future__ import annotations``: FastAPI must see the local ``Idem`` alias.

import contextlib
import json
import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest

from idemflow import Idempotency, OutcomeUnknown, Policy, State
from idemflow.stores.sqlite import SQLiteStore
from tests.backends import KINDS, kind_params

POLICY = Policy(request_timeout=5)
#: POLICY's sweeper horizon (20 s threshold, 2 s interval): the least Retry-After to expect.
SWEPT_WITHIN = 22
UNKNOWN = "https://idemflow.dev/problems/outcome-unknown"


def assert_outcome_unknown(status: int, headers: Any, body: bytes) -> None:
    problem = json.loads(body)
    assert status == 503, body
    assert (problem["type"], problem["status"], problem["retryable"]) == (UNKNOWN, 503, True)
    assert int(headers["retry-after"]) >= SWEPT_WITHIN


@contextlib.contextmanager
def sqlite_keys(tmp_path: Path) -> Iterator[tuple[Path, SQLiteStore]]:
    path = tmp_path / "app.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE payment (id INTEGER PRIMARY KEY, note TEXT)")
        conn.commit()
    store = SQLiteStore(path)
    store.migrate()
    try:
        yield path, store
    finally:
        store.close()


def payments(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("SELECT count(*) FROM payment").fetchone()[0])


def test_the_wsgi_middleware_keeps_the_claim_of_an_unknown_outcome(tmp_path: Path) -> None:
    """Middleware mode (no shared transaction): the endpoint's exception reaches the
    middleware, which answers 503 and leaves the key claimed for the sweeper."""
    from idemflow.integrations.wsgi import IdempotencyMiddleware

    calls: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        calls.append(environ["PATH_INFO"])
        raise OutcomeUnknown("the provider did not answer")

    with sqlite_keys(tmp_path) as (_, store):
        protected = IdempotencyMiddleware(
            app, idempotency=Idempotency(store, POLICY), endpoints=["POST /payments"]
        )

        def authenticated(environ: dict[str, Any], start_response: Any) -> Any:
            environ["REMOTE_USER"] = "carol"
            return protected(environ, start_response)

        transport = httpx.WSGITransport(app=authenticated)
        with httpx.Client(transport=transport, base_url="http://shop") as client:
            headers = {"Idempotency-Key": "k-wsgi"}
            first = client.post("/payments", content=b"{}", headers=headers)
            retry = client.post("/payments", content=b"{}", headers=headers)
        held = store.get("carol", "k-wsgi")

    assert_outcome_unknown(first.status_code, first.headers, first.content)
    assert retry.status_code == 409
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert calls == ["/payments"]


def test_flask_protect_keeps_the_claim_and_rolls_the_session_back(tmp_path: Path) -> None:
    """Transactional (two commits): the view's row rolls back with its session, the claim
    stays, 503 then 409."""
    pytest.importorskip("flask")
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from flask import Flask, g
    from sqlalchemy.orm import Session

    from idemflow.integrations.flask import Idempotency as FlaskIdempotency
    from idemflow.transactions import SQLAlchemyTransaction

    with sqlite_keys(tmp_path) as (path, store):
        engine = sqlalchemy.create_engine(f"sqlite:///{path}")
        app = Flask(__name__)

        @contextlib.contextmanager
        def session_transaction() -> Iterator[SQLAlchemyTransaction]:
            with Session(engine) as session:
                g.session = session
                yield SQLAlchemyTransaction(session)

        idem = FlaskIdempotency(
            app, store=store, transaction=session_transaction, principal=lambda: "alice"
        )
        calls: list[int] = []

        @app.post("/payments")
        @idem.protect
        def pay() -> Any:
            calls.append(1)
            g.session.execute(sqlalchemy.text("INSERT INTO payment (note) VALUES ('pending')"))
            raise OutcomeUnknown("the provider did not answer")

        client = app.test_client()
        headers = {"Idempotency-Key": "k-flask"}
        first = client.post("/payments", headers=headers, json={})
        retry = client.post("/payments", headers=headers, json={})
        held = store.get("alice", "k-flask")
        engine.dispose()
        rows = payments(path)

    assert_outcome_unknown(first.status_code, first.headers, first.data)
    assert retry.status_code == 409
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert (calls, rows) == ([1], 0)


def test_django_idempotent_keeps_the_claim_and_rolls_the_atomic_block_back(
    table_name: str,
) -> None:
    """``@idempotent`` on a function view, on Django's SQLite alias: the view's row rolls
    back with idemflow's ``atomic()`` block, the claim stays, 503 then 409."""
    pytest.importorskip("django")
    from django.db import connections
    from django.http import HttpRequest, HttpResponse
    from django.test import RequestFactory, override_settings

    from idemflow.integrations.django import get_store, idempotent
    from idemflow.stores.django import DjangoStore
    from tests.integrations.django_setup import execute, require

    require("default")
    business = f"biz_{table_name}"
    execute("default", f"CREATE TABLE {business} (id INTEGER PRIMARY KEY, note TEXT)")
    calls: list[int] = []

    @idempotent
    def pay(request: HttpRequest) -> HttpResponse:
        calls.append(1)
        with connections["default"].cursor() as cursor:
            cursor.execute(f"INSERT INTO {business} (note) VALUES ('pending')")
        raise OutcomeUnknown("the provider did not answer")

    settings = {"table": table_name, "request_timeout": 5, "principal": lambda r: "dora"}
    try:
        with override_settings(IDEMFLOW=settings):
            DjangoStore("default", table=table_name).migrate()
            store = get_store()
            factory = RequestFactory()
            answers = [
                pay(factory.post("/payments", b"{}", "application/json", HTTP_IDEMPOTENCY_KEY="k"))
                for _ in range(2)
            ]
            held = store.get("dora", "k")
        rows = execute("default", f"SELECT count(*) FROM {business}")[0][0]
    finally:
        execute("default", f"DROP TABLE IF EXISTS {business}")
        execute("default", f"DROP TABLE IF EXISTS {table_name}")

    first, retry = answers
    assert_outcome_unknown(first.status_code, first.headers, first.content)
    assert retry.status_code == 409
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert (calls, rows) == ([1], 0)


@pytest.mark.postgres
@pytest.mark.anyio
async def test_the_fastapi_dependency_keeps_the_claim_and_rolls_the_rows_back(
    table_name: str,
) -> None:
    """``IdempotentRequest.run`` (Starlette's ``Idempotent``) on PostgreSQL: the endpoint's
    row rolls back with its transaction, the claim stays, 503 then 409."""
    pytest.importorskip("fastapi")
    psycopg = pytest.importorskip("psycopg")
    psycopg_pool = pytest.importorskip("psycopg_pool")
    from fastapi import Depends, FastAPI
    from starlette.responses import Response as StarletteResponse

    import idemflow
    from idemflow import AsyncAttempt, AsyncIdempotency
    from idemflow.integrations.fastapi import IdempotentRequest, dependency
    from idemflow.integrations.starlette import Idempotent
    from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore
    from idemflow.transactions import AsyncPsycopgTransaction
    from tests.conftest import POSTGRES_URL, unreachable

    try:
        admin = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    business = f"biz_{table_name}"
    admin.execute(f"CREATE TABLE {business} (id BIGSERIAL PRIMARY KEY, note TEXT)")
    PostgresStore(POSTGRES_URL, table=table_name, max_size=1).migrate()
    pool = psycopg_pool.AsyncConnectionPool(
        POSTGRES_URL, min_size=1, max_size=2, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True)
    idempotent = Idempotent(
        AsyncIdempotency(AsyncPostgresStore(pool, table=table_name), POLICY),
        connect=pool.connection,
        transaction=AsyncPsycopgTransaction,
    )
    Idem = Annotated[IdempotentRequest, Depends(dependency(idempotent, principal=lambda: "erin"))]
    app = FastAPI()
    calls: list[int] = []

    @app.post("/payments")
    async def pay(idem: Idem) -> StarletteResponse:
        async def handler(attempt: AsyncAttempt) -> idemflow.Response:
            calls.append(1)
            await attempt.connection.execute(f"INSERT INTO {business} (note) VALUES ('pending')")
            raise OutcomeUnknown("the provider did not answer")

        return await idem.run(handler)

    key = str(uuid.uuid4())
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
            headers = {"Idempotency-Key": key}
            first = await client.post("/payments", content=b"{}", headers=headers)
            retry = await client.post("/payments", content=b"{}", headers=headers)
        held = await idempotent.edge.idempotency.store.get("erin", key)
        rows = admin.execute(f"SELECT count(*) FROM {business}").fetchone()[0]
    finally:
        await pool.close()
        admin.execute(f"DROP TABLE IF EXISTS {table_name}, {business}")
        admin.close()

    assert_outcome_unknown(first.status_code, first.headers, first.content)
    assert retry.status_code == 409
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert (calls, rows) == ([1], 0)


# --- an OutcomeUnknown the framework answered itself, behind the WSGI middleware -------------
# (over real servers, Flask and Django: tests/integrations/test_outcome_unknown_served.py)


def _behind_wsgi_middleware(app: Any, store: Any) -> httpx.Client:
    from idemflow.integrations.wsgi import IdempotencyMiddleware

    protected = IdempotencyMiddleware(
        app, idempotency=Idempotency(store, POLICY), endpoints=["POST /payments"]
    )

    def authenticated(environ: dict[str, Any], start_response: Any) -> Any:
        environ["REMOTE_USER"] = "carol"
        return protected(environ, start_response)

    return httpx.Client(transport=httpx.WSGITransport(app=authenticated), base_url="http://shop")


@contextlib.contextmanager
def slot_keys(kind: str, tmp_path: Path, table: str) -> Iterator[Any]:
    """The sync store ``kind`` names (its contract store, tests/backends.py), for the keys
    of the slot's tests, dropped after."""
    made = KINDS[kind].contract[kind](tmp_path, table, True)
    try:
        yield made.store
    finally:
        made.close()


#: SQLite, and the shared PostgreSQL, MariaDB and Redis.
SLOT_STORES = kind_params(cluster=False, in_process=False)


@pytest.mark.parametrize("kind", SLOT_STORES)
@pytest.mark.parametrize("testing", [False, True])
@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "no-hook"])
def test_flask_behind_the_wsgi_middleware_reports_its_outcome_unknown(
    tmp_path: Path, table_name: str, testing: bool, kind: str, hooked: bool
) -> None:
    """With or without ``PROPAGATE_EXCEPTIONS`` (``TESTING``), and with or without
    ``handle_outcome_unknown``, the view's exception keeps the claim; the first caller gets
    the 503 problem, the retries 409, the view runs once. Before, without the hook (a line
    to remember) Flask's own 500 released the key and the retry ran the view again: two
    executions. On SQLite, PostgreSQL, MariaDB and Redis keys."""
    pytest.importorskip("flask")
    from flask import Flask

    from idemflow.integrations.flask import handle_outcome_unknown

    app = Flask(__name__)
    app.config["TESTING"] = testing
    if hooked:
        handle_outcome_unknown(app)
    calls: list[int] = []

    @app.post("/payments")
    def pay() -> Any:
        calls.append(1)
        raise OutcomeUnknown("the provider did not answer")

    with (
        slot_keys(kind, tmp_path, table_name) as store,
        _behind_wsgi_middleware(app.wsgi_app, store) as client,
    ):
        headers = {"Idempotency-Key": "k-flask-mw"}
        first, *retries = [client.post("/payments", content=b"{}", headers=headers) for _ in "123"]
        held = store.get("carol", "k-flask-mw")

    assert_outcome_unknown(first.status_code, first.headers, first.content)
    assert [retry.status_code for retry in retries] == [409, 409]
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert calls == [1]


def _framework_like(view: Callable[[], tuple[str, bytes]]) -> Any:
    """A bare WSGI app that answers every exception of its view with its own 500, as most
    frameworks do, with no hook anyone could configure."""

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        try:
            status, body = view()
        except Exception:  # what a framework's last resort does
            status, body = "500 Internal Server Error", b"oops"
        start_response(status, [("Content-Type", "text/plain")])
        return [body]

    return app


@pytest.mark.parametrize("answer", ["raised", "503-after-it"])
def test_a_bare_wsgi_app_that_turns_an_outcome_unknown_into_a_500_keeps_the_claim(
    tmp_path: Path, answer: str
) -> None:
    """No framework, no hook: the app turns its view's ``OutcomeUnknown`` into a 500 of its
    own (or catches it and answers a 503 of its own). The middleware noted the
    ``OutcomeUnknown`` made while the app ran, and the app then failed: the claim is kept
    (503 problem, then 409), never released for a second execution."""
    calls: list[int] = []

    def view() -> tuple[str, bytes]:
        calls.append(1)
        try:
            raise OutcomeUnknown("the provider did not answer")
        except OutcomeUnknown:
            if answer == "raised":
                raise
        return "503 Service Unavailable", b"try later"

    with (
        sqlite_keys(tmp_path) as (_, store),
        _behind_wsgi_middleware(_framework_like(view), store) as client,
    ):
        headers = {"Idempotency-Key": "k-bare"}
        first, *retries = [client.post("/payments", content=b"{}", headers=headers) for _ in "123"]
        held = store.get("carol", "k-bare")

    assert_outcome_unknown(first.status_code, first.headers, first.content)
    assert [retry.status_code for retry in retries] == [409, 409]
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert calls == [1]


def test_an_outcome_unknown_the_app_caught_and_answered_from_is_stored(tmp_path: Path) -> None:
    """An ``OutcomeUnknown`` made and caught, after which the app found out and answered (a
    201): that answer is the outcome, stored and replayed, not a claim kept."""
    calls: list[int] = []

    def view() -> tuple[str, bytes]:
        calls.append(1)
        try:
            raise OutcomeUnknown("the provider did not answer")
        except OutcomeUnknown:
            return "201 Created", b"charged after all"

    with (
        sqlite_keys(tmp_path) as (_, store),
        _behind_wsgi_middleware(_framework_like(view), store) as client,
    ):
        headers = {"Idempotency-Key": "k-found"}
        first, retry = [client.post("/payments", content=b"{}", headers=headers) for _ in "12"]
        held = store.get("carol", "k-found")

    assert (first.status_code, first.content) == (201, b"charged after all")
    assert (retry.status_code, retry.headers["idempotent-replayed"]) == (201, "true")
    assert held is not None
    assert held.state is State.COMPLETED
    assert calls == [1]


def test_only_a_reported_outcome_unknown_keeps_the_claim(tmp_path: Path) -> None:
    """A 503 that looks like ours, or another exception reported in the slot, is released: the
    slot takes an ``OutcomeUnknown`` object only, and the problem's bytes mean nothing."""
    from idemflow.integrations.wsgi import report_outcome_unknown

    reported: list[bool] = []

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        reported.append(report_outcome_unknown(environ, RuntimeError("not an OutcomeUnknown")))
        body = json.dumps({"type": UNKNOWN, "status": 503}).encode()
        headers = [("Content-Type", "application/problem+json"), ("Retry-After", "30")]
        headers.append(("idemflow.outcome_unknown", "1"))
        start_response("503 Service Unavailable", headers)
        return [body]

    with sqlite_keys(tmp_path) as (_, store), _behind_wsgi_middleware(app, store) as client:
        first = client.post("/payments", content=b"{}", headers={"Idempotency-Key": "k-fake"})
        held = store.get("carol", "k-fake")

    assert first.status_code == 503
    assert reported == [False]
    assert held is not None
    assert held.state is State.RELEASED  # transient: the retry runs again
    assert report_outcome_unknown({}, OutcomeUnknown()) is False  # no middleware to tell


@pytest.mark.anyio
@pytest.mark.parametrize("kind", SLOT_STORES)
@pytest.mark.parametrize("handler", ["wsgi", "asgi"])
@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "no-hook"])
async def test_django_behind_the_generic_middleware_reports_its_outcome_unknown(
    tmp_path: Path, table_name: str, handler: str, kind: str, hooked: bool
) -> None:
    """The Django app's ``got_request_exception`` receiver, in process: Django's WSGI handler
    behind the WSGI middleware (``request.environ``), its ASGI handler behind the ASGI one
    (``request.scope``). Django answers the view's exception with a 500; the receiver's report
    keeps the claim: 503 problem, then 409. So it does without the receiver (the app not in
    ``INSTALLED_APPS``): the middleware noted the ``OutcomeUnknown`` made while Django ran.
    On SQLite, PostgreSQL, MariaDB and Redis keys (the ASGI ones async, each on a pool of
    one connection)."""
    pytest.importorskip("django")
    from django.core.handlers.asgi import ASGIHandler
    from django.core.handlers.wsgi import WSGIHandler
    from django.http import HttpRequest, HttpResponse
    from django.test import override_settings
    from django.urls import path

    import tests.integrations.django_setup  # noqa: F401 -- settings, with the idemflow app

    calls: list[int] = []

    def pay(request: HttpRequest) -> HttpResponse:
        calls.append(1)
        raise OutcomeUnknown("the provider did not answer")

    class URLs:
        urlpatterns = (path("payments", pay),)

    key = f"k-django-{handler}"
    unhooked = contextlib.nullcontext() if hooked else _without_the_django_receiver()
    with override_settings(ROOT_URLCONF=URLs, ALLOWED_HOSTS=["shop"]), unhooked:
        if handler == "wsgi":
            with (
                slot_keys(kind, tmp_path, table_name) as store,
                _behind_wsgi_middleware(WSGIHandler(), store) as client,
            ):
                answers = [
                    client.post("/payments", content=b"{}", headers={"Idempotency-Key": key})
                    for _ in range(2)
                ]
                held = store.get("carol", key)
        else:
            from idemflow import AsyncIdempotency
            from idemflow.integrations.starlette import IdempotencyMiddleware
            from tests.backends import open_rig

            async with open_rig(kind, table_name, tmp_path, transactional=False) as rig:
                app = IdempotencyMiddleware(
                    ASGIHandler(),
                    idempotency=AsyncIdempotency(rig.store, POLICY),
                    endpoints=["POST /payments"],
                    principal=lambda scope: "carol",
                )
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://shop") as c:
                    answers = [
                        await c.post("/payments", content=b"{}", headers={"Idempotency-Key": key})
                        for _ in range(2)
                    ]
                held = await rig.call("get", "carol", key)

    first, retry = answers
    assert_outcome_unknown(first.status_code, first.headers, first.content)
    assert retry.status_code == 409
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert calls == [1]


@contextlib.contextmanager
def _without_the_django_receiver() -> Iterator[None]:
    """As if ``idemflow.integrations.django`` were not in ``INSTALLED_APPS``: its
    ``got_request_exception`` receiver disconnected, then connected again."""
    from django.core.signals import got_request_exception

    from idemflow.integrations.django.views import _outcome_unknown_received

    assert got_request_exception.disconnect(dispatch_uid="idemflow.outcome")
    try:
        yield
    finally:
        got_request_exception.connect(_outcome_unknown_received, dispatch_uid="idemflow.outcome")


def test_flask_behind_the_wsgi_middleware_keeps_an_outcome_unknown_made_in_another_thread(
    tmp_path: Path,
) -> None:
    """The view's provider call runs in a worker thread, which does not carry the request's
    context, and ``future.result()`` raises its ``OutcomeUnknown`` again in the view: the
    slot never saw it made. The middleware found the Flask app under ``app.wsgi_app`` when
    it was made and registered Flask's handler (``handle_outcome_unknown``) on it, so
    Flask's report keeps the claim all the same: 503, then 409, one run."""
    pytest.importorskip("flask")
    from concurrent.futures import ThreadPoolExecutor

    from flask import Flask

    app = Flask(__name__)
    calls: list[int] = []

    def charge() -> None:
        raise OutcomeUnknown("the provider did not answer")

    @app.post("/payments")
    def pay() -> Any:
        calls.append(1)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(charge).result()
        return {"id": 1}, 201

    with (
        sqlite_keys(tmp_path) as (_, store),
        _behind_wsgi_middleware(app.wsgi_app, store) as client,
    ):
        headers = {"Idempotency-Key": "k-thread"}
        first, *retries = [client.post("/payments", content=b"{}", headers=headers) for _ in "123"]
        held = store.get("carol", "k-thread")

    assert_outcome_unknown(first.status_code, first.headers, first.content)
    assert [retry.status_code for retry in retries] == [409, 409]
    assert held is not None
    assert held.state is State.IN_PROGRESS
    assert calls == [1]


def test_the_wsgi_middleware_keeps_a_flask_apps_own_outcome_unknown_handler(
    tmp_path: Path,
) -> None:
    """An app's own ``errorhandler(OutcomeUnknown)`` is its answer: the middleware registers
    nothing over it."""
    pytest.importorskip("flask")
    from flask import Flask

    app = Flask(__name__)

    @app.errorhandler(OutcomeUnknown)
    def own(error: OutcomeUnknown) -> Any:
        return {"mine": True}, 504

    with sqlite_keys(tmp_path) as (_, store), _behind_wsgi_middleware(app.wsgi_app, store):
        assert app.error_handler_spec[None][None][OutcomeUnknown] is own
