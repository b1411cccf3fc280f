"""
Bad input through every WSGI door, in process, on raw WSGI environs.

The doors: the WSGI middleware, Flask's ``@idem.protect``, and Django's four (a function
view with ``@idempotent``, a class-based view's method, a DRF action, the middleware),
the class-based view and the DRF action once more inside the request's transaction
(``ATOMIC_REQUESTS`` on PostgreSQL). Each is called as a WSGI server calls it, with an
environ built here, so what no HTTP server would pass on (a NUL in a header, a chunked
body the server does not end) reaches it too. Every bad request must be a 4xx
``application/problem+json`` answer, the view never run, nothing recorded in the key
table, and the body read no further than the cap whatever its size: the request stream
hands out bytes as they are read (hundreds of MiB if asked), and counts them.
The same doors served by gunicorn are in test_wsgi_apps.py and test_wsgi.py.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import sqlite3
import uuid
import wsgiref.util
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("django")
pytest.importorskip("rest_framework")
pytest.importorskip("flask")

from tests.factories import HANDLER_EXCEPTIONS
from tests.http.conftest import CONTROL_KEYS, MALFORMED_KEYS, assert_problem
from tests.integrations.django_setup import execute, require

#: The body cap of every door here (max_body_bytes, IDEMFLOW_MAX_BODY_BYTES).
CAP = 4096
#: What a stream "without end" holds: far more than any door may read.
ENDLESS = 300 * 2**20
BODY = b'{"amount": 10}'


class Stream(io.RawIOBase):
    """A request body stream: ``data``, then ``endless`` more bytes made as they are read.

    ``consumed`` counts every byte handed out, so a test sees how far a door read.
    """

    def __init__(self, data: bytes = b"", endless: int = 0) -> None:
        self._data = data
        self._left = len(data) + endless
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), self._left)
        start = self.consumed
        given = self._data[start : start + size]
        buffer[: len(given)] = given
        buffer[len(given) : size] = b"x" * (size - len(given))
        self._left -= size
        self.consumed += size
        return size


@dataclass
class Door:
    """One way an application plugs idemflow in, as a WSGI application."""

    name: str
    app: Callable[..., Any]
    path: str
    records: Callable[[str], int]  # key records of a principal
    ran: list[str] = field(default_factory=list)  # principals the view ran for
    #: Sets the framework's own cap on a body in memory while the block runs (Django's
    #: DATA_UPLOAD_MAX_MEMORY_SIZE, Flask's MAX_CONTENT_LENGTH); the WSGI middleware has none.
    framework_cap: Callable[[int], contextlib.AbstractContextManager[None]] | None = None
    #: The stored record of ``(principal, key)`` (an ``idemflow.Record``), or None.
    record: Callable[[str, str], Any] | None = None
    #: Exceptions the view raises, one per request, instead of answering.
    failures: list[BaseException] = field(default_factory=list)
    #: Lets the view's exception out of the framework to the server while the block runs.
    propagating: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext

    def call(self, environ: dict[str, Any]) -> httpx.Response:
        """Call the application as a WSGI server does; its answer as an httpx Response."""
        started: list[Any] = []

        def start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Any:
            started[:] = [int(status[:3]), headers]
            return lambda data: None

        result = self.app(environ, start_response)
        try:
            body = b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()  # Django: request_finished, the connections given back
        return httpx.Response(started[0], headers=started[1], content=body)


def environ(
    path: str,
    principal: str,
    key_lines: tuple[bytes, ...] = (b"k-1",),
    stream: Stream | None = None,
    *,
    length: str | None = None,
    chunked: bool = False,
    terminated: bool = False,
) -> dict[str, Any]:
    """A POST as a server presents it: repeated lines joined by ``,``, values as latin-1."""
    made: dict[str, Any] = {}
    wsgiref.util.setup_testing_defaults(made)
    made.update(
        REQUEST_METHOD="POST",
        PATH_INFO=path,
        CONTENT_TYPE="application/json",
        HTTP_X_USER=principal,
    )
    made["wsgi.input"] = Stream(BODY) if stream is None else stream
    if key_lines:
        made["HTTP_IDEMPOTENCY_KEY"] = b",".join(key_lines).decode("latin-1")
    if length is not None:
        made["CONTENT_LENGTH"] = length
    if chunked:
        made["HTTP_TRANSFER_ENCODING"] = "chunked"
    if terminated:
        made["wsgi.input_terminated"] = True
    return made


def who() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


# --- the doors -------------------------------------------------------------------------------


def _sqlite_records(path: Path) -> Callable[[str], int]:
    def records(principal: str) -> int:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            sql = "SELECT count(*) FROM idemflow_keys WHERE principal = ?"
            return int(conn.execute(sql, (principal,)).fetchone()[0])

    return records


@contextlib.contextmanager
def _wsgi_door(tmp: Path, endpoints: Any = ("POST /payments",)) -> Iterator[Door]:
    """The WSGI middleware; ``endpoints``: its table (a list, or a dict of route policies)."""
    from idemflow import Idempotency, Policy
    from idemflow.integrations.wsgi import EdgeOptions, IdempotencyMiddleware
    from idemflow.stores.sqlite import SQLiteStore

    store = SQLiteStore(tmp / "keys.db")
    store.migrate()
    ran: list[str] = []
    failures: list[BaseException] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        ran.append(environ["HTTP_X_USER"])
        if failures:
            raise failures.pop()
        start_response("201 Created", [("Content-Type", "application/json")])
        return [b'{"id": 1}']

    protected = IdempotencyMiddleware(
        app,
        idempotency=Idempotency(store, Policy(request_timeout=5)),
        endpoints=endpoints,
        principal=lambda environ: environ.get("HTTP_X_USER"),
        options=EdgeOptions(max_body_bytes=CAP),
    )
    try:
        records = _sqlite_records(tmp / "keys.db")
        yield Door(
            "wsgi", protected, "/payments", records, ran, record=store.get, failures=failures
        )
    finally:
        store.close()


@contextlib.contextmanager
def _flask_door(
    tmp: Path,
    ran: list[str] | None = None,
    *,
    extension: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    protect: Mapping[str, Any] | None = None,
) -> Iterator[Door]:
    """Flask's ``@idem.protect``; ``extension``, ``config`` and ``protect``: further
    arguments of ``Idempotency(…)``, ``app.config`` entries, ``idem.protect(…)``'s."""
    from flask import Flask, request

    from idemflow.integrations.flask import Idempotency
    from idemflow.stores.sqlite import SQLiteStore

    store = SQLiteStore(tmp / "keys.db")
    store.migrate()
    app = Flask(__name__)
    app.config["IDEMFLOW_MAX_BODY_BYTES"] = CAP
    app.config.update(config or {})
    idem = Idempotency(
        app, store=store, principal=lambda: request.headers.get("X-User"), **(extension or {})
    )
    ran = [] if ran is None else ran
    failures: list[BaseException] = []
    protected: Callable[[Callable[..., Any]], Callable[..., Any]]
    protected = idem.protect(**(protect or {}))

    @app.post("/payments")
    @protected
    def pay() -> Any:
        ran.append(str(request.headers["X-User"]))
        if failures:
            raise failures.pop()
        return {"id": 1}, 201

    @contextlib.contextmanager
    def max_content_length(size: int) -> Iterator[None]:
        app.config["MAX_CONTENT_LENGTH"] = size
        try:
            yield
        finally:
            app.config["MAX_CONTENT_LENGTH"] = None

    @contextlib.contextmanager
    def propagating() -> Iterator[None]:
        app.config["PROPAGATE_EXCEPTIONS"] = True
        try:
            yield
        finally:
            app.config["PROPAGATE_EXCEPTIONS"] = None

    records = _sqlite_records(tmp / "keys.db")
    try:
        yield Door(
            "flask",
            app,
            "/payments",
            records,
            ran,
            max_content_length,
            store.get,
            failures,
            propagating,
        )
    finally:
        store.close()


class _URLs:
    """The Django doors' URLconf, set per door (``ROOT_URLCONF``)."""

    urlpatterns: tuple[Any, ...] = ()


@contextlib.contextmanager
def _django_door(
    name: str,
    path: str,
    alias: str,
    atomic: bool,
    ran: list[str] | None = None,
    *,
    settings: Mapping[str, Any] | None = None,
    decorator: Mapping[str, Any] | None = None,
) -> Iterator[Door]:
    """One of Django's doors; ``settings``: further ``IDEMFLOW`` entries, ``decorator``:
    arguments of ``@idempotent(…)`` on the function, class-based and DRF views."""
    from django.core.handlers.wsgi import WSGIHandler
    from django.db import connections
    from django.http import HttpRequest, JsonResponse
    from django.test import override_settings
    from django.urls import path as route
    from django.utils.decorators import method_decorator
    from django.views import View
    from rest_framework.parsers import JSONParser
    from rest_framework.renderers import JSONRenderer
    from rest_framework.response import Response
    from rest_framework.viewsets import ViewSet

    from idemflow.integrations.django import get_store, idempotent

    require(alias)
    table = f"idem_{uuid.uuid4().hex[:12]}"
    runs: list[str] = [] if ran is None else ran
    failures: list[BaseException] = []
    protected: Callable[[Callable[..., Any]], Callable[..., Any]]
    protected = idempotent(**(decorator or {}))

    def pay(request: Any) -> JsonResponse:
        runs.append(request.META["HTTP_X_USER"])
        if failures:
            raise failures.pop()
        return JsonResponse({"id": 1}, status=201)

    idemflow = {
        "database": alias,
        "table": table,
        "principal": lambda request: request.META.get("HTTP_X_USER"),
        "endpoints": ["POST /mw/payments"],
        "max_body_bytes": CAP,
        **(settings or {}),
    }
    overridden = override_settings(
        IDEMFLOW=idemflow,
        ROOT_URLCONF=_URLs,
        MIDDLEWARE=["idemflow.integrations.django.middleware.IdempotencyMiddleware"],
        REST_FRAMEWORK={"UNAUTHENTICATED_USER": None},
    )
    database = connections[alias].settings_dict
    atomic_before = database["ATOMIC_REQUESTS"]
    with overridden:
        database["ATOMIC_REQUESTS"] = atomic

        @method_decorator(protected, name="post")
        class PaymentView(View):  # type: ignore[misc]  # Django has no stubs here
            def post(self, request: HttpRequest) -> JsonResponse:
                return pay(request)

        class PaymentViewSet(ViewSet):  # type: ignore[misc]  # nor DRF
            authentication_classes = ()
            permission_classes = ()
            parser_classes = (JSONParser,)
            renderer_classes = (JSONRenderer,)

            @protected
            def create(self, request: Any) -> Response:
                runs.append(request.META["HTTP_X_USER"])
                if failures:
                    raise failures.pop()
                return Response({"id": 1}, status=201)

        _URLs.urlpatterns = (
            route("payments", protected(pay)),
            route("cbv/payments", PaymentView.as_view()),
            route("drf/payments", PaymentViewSet.as_view({"post": "create"})),
            route("mw/payments", pay),
        )
        store = get_store()
        store.migrate()

        def records(principal: str) -> int:
            sql = f"SELECT count(*) FROM {table} WHERE principal = %s"
            return int(execute(alias, sql, [principal])[0][0])

        def data_upload_max_memory_size(size: int) -> Any:
            return override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=size)

        try:
            cap = data_upload_max_memory_size
            propagating = functools.partial(override_settings, DEBUG_PROPAGATE_EXCEPTIONS=True)
            yield Door(
                name, WSGIHandler(), path, records, runs, cap, store.get, failures, propagating
            )
        finally:
            database["ATOMIC_REQUESTS"] = atomic_before
            connections[alias].close()
            execute(alias, f"DROP TABLE IF EXISTS {table}")


_DJANGO_DOORS = {
    "django-function": ("/payments", "default", False),
    "django-cbv": ("/cbv/payments", "default", False),
    "django-drf": ("/drf/payments", "default", False),
    "django-middleware": ("/mw/payments", "default", False),
    # ATOMIC_REQUESTS: the method runs inside the request's transaction (a savepoint).
    "django-atomic-cbv": ("/cbv/payments", "postgres", True),
    "django-atomic-drf": ("/drf/payments", "postgres", True),
}
DJANGO_DOORS = [
    pytest.param(name, marks=pytest.mark.postgres) if alias == "postgres" else name
    for name, (_, alias, _) in _DJANGO_DOORS.items()
]
DOORS = ["wsgi", "flask", *DJANGO_DOORS]
#: The doors of a framework with a body cap of its own.
FRAMEWORK_DOORS = ["flask", *DJANGO_DOORS]


@pytest.fixture(scope="module", params=DOORS)
def door(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Door]:
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    if name == "wsgi":
        made = _wsgi_door(tmp)
    elif name == "flask":
        made = _flask_door(tmp)
    else:
        made = _django_door(name, *_DJANGO_DOORS[name])
    with made as ready:
        yield ready


# --- the rules -------------------------------------------------------------------------------


def test_a_good_request_runs_once_and_a_quoted_key_is_the_same_key(door: Door) -> None:
    """What the refusals below are measured against: on every door a good request runs the
    view and records its key (201), and the same key as a structured-field string
    (``"k-1"``, RFC 9651) is the same key: a replay, the view not run again."""
    alice = who()
    first = door.call(environ(door.path, alice, (b"k-1",), length=str(len(BODY))))
    quoted = door.call(environ(door.path, alice, (b'"k-1"',), length=str(len(BODY))))

    assert first.status_code == 201, first.text
    assert (quoted.status_code, quoted.headers.get("idempotent-replayed")) == (201, "true")
    assert door.ran.count(alice) == 1
    assert door.records(alice) == 1


@HANDLER_EXCEPTIONS
def test_a_views_exception_reaches_the_server_unchanged_and_the_key_is_released(
    door: Door, make_exception: Callable[[], Exception]
) -> None:
    """The view's exception, whatever its type, is the very object the server gets (once
    the framework lets it out): never ``RuntimeError("generator raised StopIteration")``
    from the flow's generator. The key is released, as after any exception, and the
    retry runs the view."""
    from idemflow import State

    alice, raised = who(), make_exception()
    door.failures.append(raised)
    with door.propagating(), pytest.raises(type(raised)) as caught:
        door.call(environ(door.path, alice, length=str(len(BODY))))

    assert caught.value is raised
    assert door.record is not None
    record = door.record(alice, "k-1")
    assert record is not None
    assert record.state is State.RELEASED
    assert door.call(environ(door.path, alice, length=str(len(BODY)))).status_code == 201
    assert door.ran.count(alice) == 2


@dataclass(frozen=True)
class Bad:
    """A bad request and the problem every door answers it with."""

    status: int
    slug: str
    key_lines: tuple[bytes, ...] = (b"k-1",)
    body: bytes = BODY
    endless: int = 0
    length: str | None = str(len(BODY))
    chunked: bool = False
    terminated: bool = False
    #: How far into the stream a door may read before it answers.
    most_read: int = len(BODY)


_KEYS = {**MALFORMED_KEYS, **CONTROL_KEYS, "nul": (b"a\x00b",)}
BAD = {
    **{f"key-{name}": Bad(400, "invalid-key", key_lines=lines) for name, lines in _KEYS.items()},
    "key-missing": Bad(400, "missing-key", key_lines=()),
    "content-length-over-the-cap": Bad(
        413, "body-too-large", endless=ENDLESS, length=str(ENDLESS), most_read=0
    ),
    "content-length-of-5000-digits": Bad(
        413, "body-too-large", endless=ENDLESS, length="9" * 5000, most_read=0
    ),
    "chunked-without-end-ended-by-the-server": Bad(
        413,
        "body-too-large",
        endless=ENDLESS,
        length=None,
        chunked=True,
        terminated=True,
        most_read=CAP + 1,
    ),
    "chunked-the-server-does-not-end": Bad(
        411, "length-required", endless=ENDLESS, length=None, chunked=True, most_read=0
    ),
    "cut-short": Bad(400, "incomplete-body", length=str(len(BODY) + 10)),
}


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
def test_bad_input_is_a_4xx_problem_never_claimed_or_run_and_read_no_further_than_the_cap(
    door: Door, bad: Bad
) -> None:
    """Malformed keys (the table the ASGI edge is held to, plus a NUL no server passes on),
    no key, a body over the cap by its Content-Length (read not at all) or while it streams
    without one (read one byte past the cap at most, of 300 MiB offered), a chunked body
    the server does not end (411), a body cut short: the door's 4xx problem, the view not
    run, no key record, never a 500."""
    alice = who()
    stream = Stream(bad.body, bad.endless)
    sent = environ(
        door.path,
        alice,
        bad.key_lines,
        stream,
        length=bad.length,
        chunked=bad.chunked,
        terminated=bad.terminated,
    )

    answer = door.call(sent)

    assert_problem(answer, bad.status, bad.slug)
    assert door.ran.count(alice) == 0
    assert door.records(alice) == 0
    assert stream.consumed <= bad.most_read


def padded(size: int) -> bytes:
    """A JSON body of ``size`` bytes the views accept."""
    start = b'{"amount": 10, "note": "'
    return start + b"n" * (size - len(start) - 2) + b'"}'


@pytest.mark.parametrize("door", FRAMEWORK_DOORS, indirect=True)
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_the_frameworks_own_body_cap_below_max_body_bytes_is_the_doors_cap(
    door: Door, framing: str
) -> None:
    """Django refuses a body over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` it reads itself (its
    ``RequestDataTooBig``, a 400), Flask one over ``MAX_CONTENT_LENGTH`` (a 413); the doors
    read the body for the framework, so the cap they apply is the lower of that and
    ``max_body_bytes``: a body between the two (2,000 bytes; 1,024 and 4,096) is the 413
    body-too-large problem naming 1,024, with its length (unread) or chunked (read one
    byte past the cap at most), the view not run, nothing recorded; 1,000 bytes run.
    Before: Django with a Content-Length answered its own HTML 400, not a problem;
    chunked, it bypassed the setting: read, claimed, run, recorded (201). Flask, chunked,
    ran the view on the first 1,024 bytes (Werkzeug stops at the maximum and returns what
    it read) and recorded it."""
    assert door.framework_cap is not None
    alice = who()

    def post(body: bytes, key: bytes) -> tuple[httpx.Response, Stream]:
        stream = Stream(body)
        chunked = framing == "chunked"
        length = None if chunked else str(len(body))
        sent = environ(
            door.path, alice, (key,), stream, length=length, chunked=chunked, terminated=chunked
        )
        return door.call(sent), stream

    with door.framework_cap(1024):
        over, stream = post(padded(2000), b"k-over")
        within, _ = post(padded(1000), b"k-within")

    problem = assert_problem(over, 413, "body-too-large")
    assert "1024" in problem["detail"]
    assert stream.consumed <= (0 if framing == "content-length" else 1025)
    assert within.status_code == 201, within.text
    assert door.ran.count(alice) == 1
    assert door.records(alice) == 1
    assert json.loads(within.content) == {"id": 1}
