"""
A streamed answer through every door, once the endpoint has run.

Rule (docs/crash-safety.md, "The response cannot be stored"): once an endpoint has run
without a transaction that rolls it back, no failure of ours (reading, checking or storing
its answer) may release the key. Each door is sent the same key three times while its
endpoint answers with a streamed body, a file (``direct_passthrough``), a generator or
server-sent events; the endpoint's effect (a row) must be committed at most once, and
where it committed the key must be settled, never released.
"""

from __future__ import annotations

import contextlib
import io
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idemflow import State
from idemflow.stores.sqlite import SQLiteStore

pytest.importorskip("flask")

# The Django doors are test_wsgi_doors' (which needs Django and DRF, as the Django test here).
from tests.integrations.test_wsgi_doors import _DJANGO_DOORS, DJANGO_DOORS

NOT_STORED = "https://idemflow.dev/problems/response-not-stored"
KINDS = ["streamed", "file", "generator", "sse", "stream-with-context"]


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


def flask_answer(kind: str, tmp_path: Path) -> Any:
    """What a Flask view returns for ``kind``: each one a response Flask streams."""
    from flask import Response, send_file, stream_with_context

    def events() -> Iterator[str]:
        yield "data: charged\n\n"
        yield "data: done\n\n"

    if kind == "streamed":
        return Response(iter([b"charged"]), status=201, headers={"Location": "/payments/1"})
    if kind == "file":
        receipt = tmp_path / "receipt.txt"
        receipt.write_bytes(b"receipt")
        return send_file(receipt, mimetype="text/plain")
    if kind == "generator":
        return (chunk for chunk in ["charged", "!"])
    if kind == "sse":
        return Response(events(), mimetype="text/event-stream")
    return Response(stream_with_context(events()), status=201)


@pytest.mark.parametrize("kind", KINDS)
def test_flask_without_a_transaction_runs_a_streamed_view_once_and_settles_the_key(
    kind: str, tmp_path: Path
) -> None:
    """``@idem.protect`` with neither ``db=`` nor ``transaction=``: the view answers with a
    body Flask streams. Before, ``from_flask`` refused it inside the handler, after the view
    ran, and the flow took that for the view's own failure: released, and every retry ran
    the view again (three POSTs: three rows, record released). Now the view runs once, the
    first caller gets the 500 ``response-not-stored`` marker naming the view's status, the
    retries its replay, and the record is settled."""
    from flask import Flask

    from idemflow.integrations.flask import Idempotency

    with sqlite_keys(tmp_path) as (path, store):
        app = Flask(__name__)
        idem = Idempotency(app, store=store, principal=lambda: "alice")

        @app.post("/payments")
        @idem.protect
        def pay() -> Any:
            with contextlib.closing(sqlite3.connect(path)) as conn:
                conn.execute("INSERT INTO payment (note) VALUES ('charged')")
                conn.commit()
            return flask_answer(kind, tmp_path)

        client = app.test_client()
        headers = {"Idempotency-Key": f"k-{kind}"}
        answers = [client.post("/payments", json={"amount": 10}, headers=headers) for _ in "123"]
        record = store.get("alice", f"k-{kind}")

    assert payments(path) == 1  # the view ran once
    assert record is not None
    assert record.state is State.COMPLETED, record.state
    first, *retries = answers
    problem = first.get_json()
    assert (first.status_code, problem["type"]) == (500, NOT_STORED), first.data
    created = kind in ("streamed", "stream-with-context")
    assert problem["original_status"] == (201 if created else 200)
    if kind == "streamed":
        assert problem["location"] == "/payments/1"
    for retry in retries:
        assert (retry.status_code, retry.data) == (500, first.data)
        assert retry.headers["Idempotent-Replayed"] == "true"


def test_flask_without_a_transaction_settles_a_view_whose_value_flask_cannot_answer(
    tmp_path: Path,
) -> None:
    """A view that ran and returned what Flask makes no response of (None): Flask's own
    ``TypeError`` came after the view ran, so it settles the key with the marker (its status
    unknown), ``failed_permanent``; before, it released and every retry ran the view again."""
    from flask import Flask

    from idemflow.integrations.flask import Idempotency

    with sqlite_keys(tmp_path) as (path, store):
        app = Flask(__name__)
        idem = Idempotency(app, store=store, principal=lambda: "alice")

        @app.post("/payments")
        @idem.protect
        def pay() -> Any:
            with contextlib.closing(sqlite3.connect(path)) as conn:
                conn.execute("INSERT INTO payment (note) VALUES ('charged')")
                conn.commit()
            return None

        client = app.test_client()
        headers = {"Idempotency-Key": "k-none"}
        answers = [client.post("/payments", json={"amount": 10}, headers=headers) for _ in "123"]
        record = store.get("alice", "k-none")

    assert payments(path) == 1
    assert record is not None
    assert record.state is State.FAILED_PERMANENT
    problem = answers[0].get_json()
    assert (answers[0].status_code, problem["type"], problem["original_status"]) == (
        500,
        NOT_STORED,
        None,
    )
    assert [answer.headers.get("Idempotent-Replayed") for answer in answers] == [
        None,
        "true",
        "true",
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_flask_in_a_transaction_rolls_a_streamed_view_back_and_releases(
    kind: str, tmp_path: Path
) -> None:
    """``transaction=`` (as ``db=``): the view's writes are in the session the completion is
    written in, so an answer that cannot be stored rolls them back with it: the 500
    ``response-not-storable`` problem and the key released. Each retry runs the view again,
    and no run's effect is ever committed."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from flask import Flask, g
    from sqlalchemy.orm import Session

    from idemflow.integrations.flask import Idempotency
    from idemflow.transactions import SQLAlchemyTransaction

    with sqlite_keys(tmp_path) as (path, store):
        engine = sqlalchemy.create_engine(f"sqlite:///{path}")
        app = Flask(__name__)

        @contextlib.contextmanager
        def session_transaction() -> Iterator[SQLAlchemyTransaction]:
            with Session(engine) as session:
                g.session = session
                yield SQLAlchemyTransaction(session)

        idem = Idempotency(
            app, store=store, transaction=session_transaction, principal=lambda: "alice"
        )

        @app.post("/payments")
        @idem.protect
        def pay() -> Any:
            g.session.execute(sqlalchemy.text("INSERT INTO payment (note) VALUES ('charged')"))
            return flask_answer(kind, tmp_path)

        client = app.test_client()
        headers = {"Idempotency-Key": f"k-{kind}"}
        answers = [client.post("/payments", json={"amount": 10}, headers=headers) for _ in "123"]
        record = store.get("alice", f"k-{kind}")
        engine.dispose()

    assert payments(path) == 0
    assert record is not None
    assert record.state is State.RELEASED
    for answer in answers:
        assert answer.status_code == 500
        assert answer.get_json()["type"].endswith("/response-not-storable")


@pytest.mark.parametrize("kind", KINDS)
def test_flask_behind_the_wsgi_middleware_stores_a_streamed_view_whole(
    kind: str, tmp_path: Path
) -> None:
    """The same views behind the generic WSGI middleware: it reads the streamed body to its
    end (a file, a generator, server-sent events), stores it and replays it; the view ran
    once."""
    import httpx
    from flask import Flask

    from idemflow import Idempotency, Policy
    from idemflow.integrations.wsgi import IdempotencyMiddleware

    calls: list[int] = []
    app = Flask(__name__)

    @app.post("/payments")
    def pay() -> Any:
        calls.append(1)
        return flask_answer(kind, tmp_path)

    with sqlite_keys(tmp_path) as (_, store):
        protected = IdempotencyMiddleware(
            app.wsgi_app,
            idempotency=Idempotency(store, Policy(request_timeout=5)),
            endpoints=["POST /payments"],
            principal=lambda environ: "carol",
        )
        transport = httpx.WSGITransport(app=protected)
        with httpx.Client(transport=transport, base_url="http://shop") as client:
            headers = {"Idempotency-Key": f"k-{kind}"}
            answers = [client.post("/payments", content=b"{}", headers=headers) for _ in "123"]
        record = store.get("carol", f"k-{kind}")

    assert calls == [1]
    assert record is not None
    assert record.state is State.COMPLETED
    first, *retries = answers
    assert first.status_code in (200, 201)
    assert first.content == (b"receipt" if kind == "file" else first.content)
    assert first.content
    for retry in retries:
        assert (retry.status_code, retry.content) == (first.status_code, first.content)


def _plain_app(kind: str, calls: list[int]) -> Any:
    """A bare WSGI app answering ``kind``: a generator body, the server's file wrapper,
    server-sent events, or no ``start_response`` at all."""

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        calls.append(1)
        if kind == "none":
            return [b"forgot to start the response"]
        if kind == "file":
            start_response("200 OK", [("Content-Type", "text/plain")])
            wrapper = environ.get("wsgi.file_wrapper")
            receipt = io.BytesIO(b"receipt")
            return wrapper(receipt) if wrapper is not None else iter([receipt.read()])
        content_type = "text/event-stream" if kind == "sse" else "text/plain"
        start_response("201 Created", [("Content-Type", content_type)])
        return (chunk for chunk in [b"data: charged\n\n", b"data: done\n\n"])

    return app


@pytest.mark.parametrize("kind", ["generator", "file", "sse", "none"])
def test_a_bare_wsgi_app_behind_the_middleware_runs_once_whatever_it_answers(
    kind: str, tmp_path: Path
) -> None:
    """A generator body, a file through ``wsgi.file_wrapper``, server-sent events: stored
    whole and replayed. An app that never called ``start_response`` ran all the same:
    before, reading its answer raised after it ran and released the key (every retry ran it
    again); now the key is settled with the marker, its status unknown."""
    from wsgiref.util import FileWrapper

    import httpx

    from idemflow import Idempotency, Policy
    from idemflow.integrations.wsgi import IdempotencyMiddleware

    calls: list[int] = []
    with sqlite_keys(tmp_path) as (_, store):
        protected = IdempotencyMiddleware(
            _plain_app(kind, calls),
            idempotency=Idempotency(store, Policy(request_timeout=5)),
            endpoints=["POST /payments"],
            principal=lambda environ: "carol",
        )

        def server(environ: dict[str, Any], start_response: Any) -> Any:
            environ["wsgi.file_wrapper"] = FileWrapper
            return protected(environ, start_response)

        transport = httpx.WSGITransport(app=server)
        with httpx.Client(transport=transport, base_url="http://shop") as client:
            headers = {"Idempotency-Key": f"k-{kind}"}
            answers = [client.post("/payments", content=b"{}", headers=headers) for _ in "123"]
        record = store.get("carol", f"k-{kind}")

    assert calls == [1]
    assert record is not None
    first, *retries = answers
    if kind == "none":
        assert record.state is State.FAILED_PERMANENT
        assert (first.status_code, first.json()["type"]) == (500, NOT_STORED)
    else:
        assert record.state is State.COMPLETED
        expected = b"receipt" if kind == "file" else b"data: charged\n\ndata: done\n\n"
        assert first.content == expected
    for retry in retries:
        assert (retry.status_code, retry.content) == (first.status_code, first.content)
        assert retry.headers["idempotent-replayed"] == "true"


def test_run_without_a_transaction_never_releases_an_answer_it_cannot_store(
    tmp_path: Path,
) -> None:
    """``run()`` without ``transaction=``: a handler that answers a body the store cannot
    hold (a generator, not bytes) ran; the completion fails after it, and the key stays
    claimed for the sweeper (retries 409), never released for a second run."""
    from idemflow import Idempotency, InProgress, Intent, Policy, Response

    calls: list[int] = []

    def handler(attempt: Any) -> Response:
        calls.append(1)
        return Response(200, (chunk for chunk in [b"charged"]), ())  # type: ignore[arg-type]

    with sqlite_keys(tmp_path) as (_, store):
        idem = Idempotency(store, Policy(request_timeout=5))
        intent = Intent("alice", "k-run", "fingerprint")
        with pytest.raises(sqlite3.ProgrammingError, match="generator"):
            idem.run(intent, handler)
        for _ in "12":
            with pytest.raises(InProgress):
                idem.run(intent, handler)
        record = store.get("alice", "k-run")

    assert calls == [1]
    assert record is not None
    assert record.state is State.IN_PROGRESS


# --- Django: every door runs the view in a transaction that rolls a streamed answer back ---

DJANGO_KINDS = ["streamed", "file", "generator", "sse", "async-iterator"]


def django_answer(kind: str, tmp_path: Path) -> Any:
    """What a Django view returns for ``kind``: each one a body Django streams (or, for
    ``generator``, a bare generator, which Django makes no response of)."""
    from django.http import FileResponse, StreamingHttpResponse

    def events() -> Iterator[bytes]:
        yield b"data: charged\n\n"
        yield b"data: done\n\n"

    async def chunks() -> Any:
        yield b"charged"

    if kind == "streamed":
        return StreamingHttpResponse(iter([b"charged"]), status=201)
    if kind == "file":
        receipt = tmp_path / "receipt.txt"
        receipt.write_bytes(b"receipt")
        return FileResponse(receipt.open("rb"))
    if kind == "generator":
        return events()
    if kind == "sse":
        return StreamingHttpResponse(events(), content_type="text/event-stream")
    return StreamingHttpResponse(chunks(), status=201)


@pytest.mark.parametrize("kind", DJANGO_KINDS)
@pytest.mark.parametrize("door", DJANGO_DOORS)
def test_every_django_door_rolls_a_streamed_view_back_and_releases(
    door: str, kind: str, tmp_path: Path
) -> None:
    """Django's doors (a function view, a class-based view's method, a DRF action, the
    middleware; the method and the action again under ``ATOMIC_REQUESTS`` on PostgreSQL)
    always run the view in a transaction the completion is written in: a streamed body, a
    file, a bare generator, server-sent events or an async iterator (a sync view's, under
    WSGI) cannot be stored, so the view's row rolls back with it, the answer is a 500 and
    the key is released. No run's effect is ever committed, however often it is retried."""
    pytest.importorskip("rest_framework")
    # Django configured before anything of DRF's is imported.
    django_setup = pytest.importorskip("tests.integrations.django_setup")
    execute, require = django_setup.execute, django_setup.require
    import uuid

    from django.core.handlers.wsgi import WSGIHandler
    from django.db import connections
    from django.http import HttpRequest
    from django.test import override_settings
    from django.urls import path as route
    from django.utils.decorators import method_decorator
    from django.views import View
    from rest_framework.viewsets import ViewSet

    from idemflow.integrations.django import get_store, idempotent
    from tests.integrations.test_wsgi_doors import Door, environ

    where, alias, atomic = _DJANGO_DOORS[door]
    require(alias)
    table = f"idem_{uuid.uuid4().hex[:12]}"
    rows = f"pay_{uuid.uuid4().hex[:12]}"
    execute(alias, f"CREATE TABLE {rows} (note VARCHAR(20))")

    def pay(request: Any) -> Any:
        with connections[alias].cursor() as cursor:
            cursor.execute(f"INSERT INTO {rows} (note) VALUES ('charged')")
        return django_answer(kind, tmp_path)

    class URLs:
        urlpatterns: tuple[Any, ...] = ()

    settings = {
        "database": alias,
        "table": table,
        "principal": lambda request: request.META.get("HTTP_X_USER"),
        "endpoints": ["POST /mw/payments"],
    }
    database = connections[alias].settings_dict
    atomic_before = database["ATOMIC_REQUESTS"]
    with override_settings(
        IDEMFLOW=settings,
        ROOT_URLCONF=URLs,
        MIDDLEWARE=["idemflow.integrations.django.middleware.IdempotencyMiddleware"],
        REST_FRAMEWORK={"UNAUTHENTICATED_USER": None},
    ):
        database["ATOMIC_REQUESTS"] = atomic

        @method_decorator(idempotent, name="post")
        class PaymentView(View):  # type: ignore[misc]  # Django has no stubs here
            def post(self, request: HttpRequest) -> Any:
                return pay(request)

        class PaymentViewSet(ViewSet):  # type: ignore[misc]  # nor DRF
            authentication_classes = ()
            permission_classes = ()

            @idempotent
            def create(self, request: Any) -> Any:
                return pay(request)

        URLs.urlpatterns = (
            route("payments", idempotent(pay)),
            route("cbv/payments", PaymentView.as_view()),
            route("drf/payments", PaymentViewSet.as_view({"post": "create"})),
            route("mw/payments", pay),
        )
        store = get_store()
        store.migrate()
        try:
            served = Door(door, WSGIHandler(), where, lambda principal: 0)
            answers = [
                served.call(environ(where, "alice", (f"k-{kind}".encode(),), length="14"))
                for _ in "123"
            ]
            record = store.get("alice", f"k-{kind}")
            committed = execute(alias, f"SELECT count(*) FROM {rows}")[0][0]
        finally:
            database["ATOMIC_REQUESTS"] = atomic_before
            connections[alias].close()
            execute(alias, f"DROP TABLE IF EXISTS {table}")
            execute(alias, f"DROP TABLE IF EXISTS {rows}")

    assert committed == 0
    assert [answer.status_code for answer in answers] == [500, 500, 500]
    assert record is not None
    assert record.state is State.RELEASED


def test_a_classifier_that_fails_after_the_endpoint_ran_settles_never_releases(
    tmp_path: Path,
) -> None:
    """Behind the WSGI middleware, a ``Policy`` classifier that raises on the endpoint's
    answer: the endpoint ran, so the failure is ours and settles the key
    (``failed_permanent``, the marker); before, it released and every retry ran the
    endpoint again."""
    import httpx

    from idemflow import Idempotency, Policy, Response, Verdict
    from idemflow.integrations.wsgi import IdempotencyMiddleware

    def classify(response: Response) -> Verdict:
        raise LookupError("no rule for this status")

    calls: list[int] = []
    with sqlite_keys(tmp_path) as (_, store):
        protected = IdempotencyMiddleware(
            _plain_app("generator", calls),
            idempotency=Idempotency(store, Policy(request_timeout=5, classify=classify)),
            endpoints=["POST /payments"],
            principal=lambda environ: "carol",
        )
        transport = httpx.WSGITransport(app=protected)
        with httpx.Client(transport=transport, base_url="http://shop") as client:
            headers = {"Idempotency-Key": "k-classifier"}
            answers = [client.post("/payments", content=b"{}", headers=headers) for _ in "123"]
        record = store.get("carol", "k-classifier")

    assert calls == [1]
    assert record is not None
    assert record.state is State.FAILED_PERMANENT
    assert (answers[0].status_code, answers[0].json()["type"]) == (500, NOT_STORED)
    assert [answer.headers.get("idempotent-replayed") for answer in answers[1:]] == ["true"] * 2
