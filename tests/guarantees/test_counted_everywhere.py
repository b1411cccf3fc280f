"""
Guarantee 8, read the way Prometheus reads it: every outcome of every request is counted
once, under its own name, in every mode, through every door, on every store.

One script of requests (:func:`script`) goes through each door: the ASGI
``IdempotencyMiddleware`` and ``Idempotent`` (two commits, one), the WSGI middleware,
Flask (two commits, one, none) and Django (its decorator and its middleware, two commits
and one), each on every store it can use (the middleware on the self-started Redis
Cluster and Galera too), in process (httpx's ASGI transport, raw WSGI environs). The
script makes each outcome: a first request, its replay, the key reused for another body
(422), a transient 503 and an exception (both released, then run by
their retry), a duplicate sent while the first runs (409), ``OutcomeUnknown`` (kept, or
given back in single-commit mode), and the store lost under the request (503 unrecorded
and kept, or rolled back and released). After each request ``/metrics`` is scraped over
HTTP from a real ``PrometheusMetrics``' registry, and what that request added to
``idemflow_requests_total`` (every outcome, every endpoint label) must be exactly what it
made, once each. The sweeper's ``stale_reclaimed`` (and the ``lease_lost`` of the request
it took a claim from) is counted the same way on every store, sync and async, the
clusters included.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import inspect
import io
import time
import uuid
import wsgiref.util
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from idemflow import (
    AsyncIdempotency,
    Event,
    Idempotency,
    LeaseLost,
    OutcomeUnknown,
    Policy,
    Record,
    Response,
)
from idemflow.metrics import PrometheusMetrics
from idemflow.stores.memory import MemoryStore
from idemflow.sweeper import AsyncSweeper, DidNotHappen, Happened, Sweeper, Unknown
from idemflow.testing import FrozenClock
from tests.backends import REDIS_POLICY_ARGS, Rig, kinds, open_rig, rig_params, rigs
from tests.ops_support import Samples, metrics_endpoint
from tests.ops_support import intent as payment_intent

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

#: The Redis rigs' store is made with this policy; every door here uses it.
POLICY = Policy(request_timeout=REDIS_POLICY_ARGS[0], retention=REDIS_POLICY_ARGS[1])
BODY = b'{"amount": 10}'
OTHER_BODY = b'{"amount": 11}'
PRINCIPAL = "alice"
REQUESTS = "idemflow_requests_total"


class Boom(Exception):
    """The handler's own failure."""


class Act(enum.StrEnum):
    """What the protected handler does, as the request's ``X-Act`` header says."""

    CREATE = "create"  # answers 201
    TRANSIENT = "transient"  # answers 503 itself
    RAISE = "raise"  # raises its own exception
    UNKNOWN = "unknown"  # raises OutcomeUnknown
    DUPLICATE = "duplicate"  # sends the same request again while it holds the key, then 201
    LOSE = "lose"  # loses its store (or its own connection), then answers 201


class Loss(enum.Enum):
    """What losing the store under a request (:attr:`Act.LOSE`) makes of it, per mode."""

    #: No transaction: the effect stays, its completion failed: 503, the key kept claimed.
    UNRECORDED = "unrecorded"
    #: In a transaction whose connection died: rolled back, 503, the key released.
    ROLLED_BACK = "rolled-back"
    #: SQLite in a transaction: a deferred constraint fails the COMMIT: 500, released.
    COMMIT_FAILED = "commit-failed"
    #: No fault to make (the sync memory store): the script leaves it out.
    NONE = "none"


@dataclass(frozen=True)
class Step:
    key: str
    act: Act
    status: int
    counted: tuple[Event, ...]
    body: bytes = BODY


E = Event


def script(*, single_commit: bool, loss: Loss) -> list[Step]:
    """Every outcome, each request with what it answers and what it must count."""
    steps = [
        Step("k-1", Act.CREATE, 201, (E.CLAIMED, E.COMPLETED)),
        Step("k-1", Act.CREATE, 201, (E.REPLAYED,)),
        Step("k-1", Act.CREATE, 422, (E.FINGERPRINT_MISMATCH,), OTHER_BODY),
        Step("k-2", Act.TRANSIENT, 503, (E.CLAIMED, E.RELEASED)),
        Step("k-2", Act.CREATE, 201, (E.CLAIMED, E.COMPLETED)),
        Step("k-3", Act.RAISE, 500, (E.CLAIMED, E.RELEASED)),
        Step("k-3", Act.CREATE, 201, (E.CLAIMED, E.COMPLETED)),
        # The duplicate's own 409 is counted inside this request's step.
        Step("k-4", Act.DUPLICATE, 201, (E.CLAIMED, E.IN_PROGRESS_CONFLICT, E.COMPLETED)),
    ]
    if single_commit:  # nothing durable before a commit_phase: given back, the retry runs
        steps += [
            Step("k-5", Act.UNKNOWN, 503, (E.CLAIMED, E.RELEASED, E.OUTCOME_UNKNOWN)),
            Step("k-5", Act.CREATE, 201, (E.CLAIMED, E.COMPLETED)),
        ]
    else:  # kept for the sweeper's reconciler: the retry is refused
        steps += [
            Step("k-5", Act.UNKNOWN, 503, (E.CLAIMED, E.OUTCOME_UNKNOWN)),
            Step("k-5", Act.CREATE, 409, (E.IN_PROGRESS_CONFLICT,)),
        ]
    return steps + LOSS_STEPS[loss]


LOSS_STEPS: dict[Loss, list[Step]] = {
    Loss.UNRECORDED: [
        Step("k-6", Act.LOSE, 503, (E.CLAIMED, E.STORE_UNAVAILABLE)),
        Step("k-6", Act.CREATE, 409, (E.IN_PROGRESS_CONFLICT,)),
    ],
    Loss.ROLLED_BACK: [
        Step("k-6", Act.LOSE, 503, (E.CLAIMED, E.RELEASED, E.STORE_UNAVAILABLE)),
        Step("k-6", Act.CREATE, 201, (E.CLAIMED, E.COMPLETED)),
    ],
    Loss.COMMIT_FAILED: [
        Step("k-6", Act.LOSE, 500, (E.CLAIMED, E.RELEASED)),
        Step("k-6", Act.CREATE, 201, (E.CLAIMED, E.COMPLETED)),
    ],
    Loss.NONE: [],
}


# --- what a scrape says -----------------------------------------------------------------


def outcomes(samples: Samples) -> collections.Counter[tuple[str, str]]:
    """Every ``idemflow_requests_total`` sample: (outcome, endpoint) -> count."""
    counted: collections.Counter[tuple[str, str]] = collections.Counter()
    for (name, labels), value in samples.items():
        if name == REQUESTS:
            found = dict(labels)
            counted[found["outcome"], found["endpoint"]] = int(value)
    return counted


def timings(samples: Samples, endpoint: str) -> tuple[int, int]:
    """How many claims and replays were timed (the histograms' ``_count``)."""
    labels = (("endpoint", endpoint),)
    return (
        int(samples.get(("idemflow_claim_seconds_count", labels), 0)),
        int(samples.get(("idemflow_replay_seconds_count", labels), 0)),
    )


# --- the doors ------------------------------------------------------------------------


@dataclass
class Door:
    """One way into idemflow, driven by the script: ``post`` sends one request and returns
    its status; the handler behind it does what the request's ``X-Act`` says."""

    endpoint: str
    post: Callable[[str, Act, bytes], Awaitable[int]]
    #: Undoes a LOSE once its request is over (a lock held on a SQLite file).
    heal: Callable[[], None] = lambda: None
    #: What the duplicates a DUPLICATE request sent were answered.
    duplicates: list[int] = field(default_factory=list)


async def play(door: Door, steps: list[Step], scrape: Callable[[], Samples]) -> None:
    """Send each step; after each, the scrape must have grown by exactly what it counts."""
    before = outcomes(scrape())
    assert not before, before
    expected: collections.Counter[tuple[str, str]] = collections.Counter()
    for number, step in enumerate(steps, 1):
        status = await door.post(step.key, step.act, step.body)
        if step.act is Act.LOSE:
            door.heal()
        expected.update((event.value, door.endpoint) for event in step.counted)
        samples = scrape()
        assert (status, outcomes(samples)) == (step.status, expected), (number, step)
    assert door.duplicates == [409]
    claims = sum(n for (outcome, _), n in expected.items() if outcome == E.CLAIMED.value)
    replays = sum(n for (outcome, _), n in expected.items() if outcome == E.REPLAYED.value)
    assert timings(samples, door.endpoint) == (claims, replays)


async def perform(act: Act, duplicate: Callable[[], Any], lose: Callable[[], Any]) -> None:
    """The handler's part before it answers 201 (or what it answers instead)."""
    if act is Act.RAISE:
        raise Boom("the handler's own failure")
    if act is Act.UNKNOWN:
        raise OutcomeUnknown("the provider did not answer")
    if act is Act.DUPLICATE:
        await _awaited(duplicate())
    if act is Act.LOSE:
        await _awaited(lose())


async def _awaited(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def perform_sync(act: Act, duplicate: Callable[[], Any], lose: Callable[[], Any]) -> None:
    """:func:`perform` for a sync handler: the duplicate is sent from another thread (a
    second client), as a server's second worker thread would serve it."""
    if act is Act.RAISE:
        raise Boom("the handler's own failure")
    if act is Act.UNKNOWN:
        raise OutcomeUnknown("the provider did not answer")
    if act is Act.DUPLICATE:
        with ThreadPoolExecutor(1) as other:
            other.submit(duplicate).result(timeout=30)
    if act is Act.LOSE:
        lose()


# --- ASGI: IdempotencyMiddleware and Idempotent -----------------------------------------


def asgi_client(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://shop.test", timeout=30)


def headers(key: str, act: Act) -> dict[str, str]:
    return {"Idempotency-Key": key, "X-Act": act.value, "Content-Type": "application/json"}


@contextlib.asynccontextmanager
async def asgi_door(rig: Rig, metrics: PrometheusMetrics, mode: str) -> AsyncIterator[Door]:
    """``IdempotencyMiddleware`` (``mode`` "middleware") or ``Idempotent`` ("two-commit",
    "single-commit") in a Starlette app, on the rig's async store."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.routing import Route

    from idemflow.integrations.starlette import IdempotencyMiddleware

    idempotency = AsyncIdempotency(rig.store, POLICY, observer=metrics)
    duplicates: list[int] = []

    async def duplicate(key: str) -> None:
        duplicates.append(await post(key, Act.CREATE, BODY))

    if mode == "middleware":
        endpoint = middleware_endpoint(rig, duplicate)
        protection = [
            Middleware(
                IdempotencyMiddleware,
                idempotency=idempotency,
                endpoints=["POST /payments"],
                principal=lambda scope: PRINCIPAL,
            )
        ]
    else:
        endpoint, protection = idempotent_endpoint(rig, idempotency, mode, duplicate), []
    app = Starlette(routes=[Route("/payments", endpoint, methods=["POST"])], middleware=protection)
    async with asgi_client(app) as client:

        async def post(key: str, act: Act, body: bytes) -> int:
            answer = await client.post("/payments", content=body, headers=headers(key, act))
            return answer.status_code

        yield Door("POST /payments", post, rig.heal, duplicates)


def middleware_endpoint(rig: Rig, duplicate: Callable[[str], Awaitable[None]]) -> Any:
    """A Starlette endpoint whose effect is elsewhere (the middleware protects it)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    async def pay(request: Request) -> JSONResponse:
        act, key = Act(request.headers["x-act"]), request.headers["idempotency-key"]
        if act is Act.TRANSIENT:
            return JSONResponse({"error": "provider down"}, status_code=503)
        await perform(act, lambda: duplicate(key), lambda: rig.lose(None))
        return JSONResponse({"id": key}, status_code=201)

    return pay


def idempotent_endpoint(
    rig: Rig,
    idempotency: AsyncIdempotency,
    mode: str,
    duplicate: Callable[[str], Awaitable[None]],
) -> Any:
    """A Starlette endpoint that runs its handler through ``Idempotent``, in a transaction on
    the rig's pool (SQLite: a connection of its own), with one commit or two."""
    from starlette.requests import Request
    from starlette.responses import Response as StarletteResponse

    from idemflow.integrations.starlette import Idempotent

    assert rig.connect is not None
    assert rig.adapter is not None
    idempotent = Idempotent(
        idempotency,
        connect=rig.connect,
        transaction=rig.adapter,
        principal=lambda scope: PRINCIPAL,
        single_commit=mode == "single-commit",
    )

    async def pay(request: Request) -> StarletteResponse:
        act, key = Act(request.headers["x-act"]), request.headers["idempotency-key"]

        async def handler(attempt: Any) -> Response:
            if act is Act.TRANSIENT:
                return Response.json(503, {"error": "provider down"})
            await perform(act, lambda: duplicate(key), lambda: rig.lose(attempt.connection))
            if act is not Act.LOSE:  # the effect, after the duplicate: SQLite locks on a write
                await rig.write(attempt.connection, key)
            return Response.json(201, {"id": key})

        return await idempotent.run(request, handler)

    return pay


def asgi_cases() -> Iterator[Any]:
    """(kind, mode): the middleware on every async store, ``Idempotent`` on every store
    that shares the endpoint's transaction, with two commits and (PostgreSQL, MariaDB) one."""
    for kind, rig in rigs("transaction", ("async",)):
        yield pytest.param(rig, "two-commit", marks=kind.marks, id=f"{rig}-two-commit")
        if kind.single_commit:
            yield pytest.param(rig, "single-commit", marks=kind.marks, id=f"{rig}-single-commit")
    # The clusters too: Redis Cluster, Galera.
    for kind, rig in rigs("no-transaction", ("async",)):
        yield pytest.param(rig, "middleware", marks=kind.marks, id=f"{rig}-middleware")


def loss_of(kind: str, transactional: bool) -> Loss:
    if not transactional:
        return Loss.UNRECORDED
    return Loss.COMMIT_FAILED if kind.startswith("sqlite") else Loss.ROLLED_BACK


class Serving(CollectorRegistry):
    """What the module's one ``/metrics`` endpoint serves: the running test's registry
    (an endpoint per test would cost each test half a second to stop its server)."""

    def __init__(self) -> None:
        super().__init__()
        self.registry = CollectorRegistry()

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()


@pytest.fixture(scope="module")
def endpoint() -> Iterator[tuple[Serving, Callable[[], Samples]]]:
    serving = Serving()
    with metrics_endpoint(serving) as scrape:
        yield serving, scrape


@pytest.fixture
def metrics(endpoint: tuple[Serving, Callable[[], Samples]]) -> PrometheusMetrics:
    """A new ``PrometheusMetrics``, on its own registry, the one the endpoint serves."""
    made = PrometheusMetrics()
    endpoint[0].registry = made.registry
    return made


@pytest.fixture
def scrape(
    metrics: PrometheusMetrics, endpoint: tuple[Serving, Callable[[], Samples]]
) -> Callable[[], Samples]:
    return endpoint[1]


@pytest.mark.parametrize(("kind", "mode"), list(asgi_cases()))
async def test_every_outcome_is_counted_once_through_the_asgi_doors(
    kind: str,
    mode: str,
    tmp_path: Path,
    table_name: str,
    metrics: PrometheusMetrics,
    scrape: Callable[[], Samples],
) -> None:
    """``IdempotencyMiddleware`` on every async store (a pool of one), ``Idempotent`` in
    its transaction (a pool of two: the duplicate claims while the first holds one)."""
    transactional = mode != "middleware"
    pool_size = 2 if transactional else 1
    async with (
        open_rig(
            kind, table_name, tmp_path, transactional=transactional, pool_size=pool_size
        ) as rig,
        asgi_door(rig, metrics, mode) as door,
    ):
        steps = script(single_commit=mode == "single-commit", loss=loss_of(kind, transactional))
        await play(door, steps, scrape)


# --- WSGI: the middleware, Flask ----------------------------------------------------------


def environ(path: str, key: str, act: Act, body: bytes) -> dict[str, Any]:
    """A POST as a WSGI server presents it."""
    made: dict[str, Any] = {}
    wsgiref.util.setup_testing_defaults(made)
    made.update(
        REQUEST_METHOD="POST",
        PATH_INFO=path,
        CONTENT_TYPE="application/json",
        CONTENT_LENGTH=str(len(body)),
        HTTP_IDEMPOTENCY_KEY=key,
        HTTP_X_ACT=act.value,
    )
    made["wsgi.input"] = io.BytesIO(body)
    return made


def call_wsgi(app: Any, path: str, key: str, act: Act, body: bytes) -> int:
    """Call ``app`` as a WSGI server does; an exception it raises is the server's 500."""
    started: list[int] = []

    def start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
        started[:] = [int(status[:3])]
        return lambda data: None

    try:
        result = app(environ(path, key, act, body), start_response)
    except Boom:
        return 500
    try:
        b"".join(result)
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()  # Django: request_finished, its connections given back
    return started[0]


def sync_door(app: Any, endpoint: str, path: str, heal: Callable[[], None]) -> Door:
    """A door onto a WSGI application, called from a worker thread."""

    async def post(key: str, act: Act, body: bytes) -> int:
        return await asyncio.to_thread(call_wsgi, app, path, key, act, body)

    return Door(endpoint, post, heal)


@contextlib.contextmanager
def wsgi_door(rig: Rig, metrics: PrometheusMetrics, inner: str) -> Iterator[Door]:
    """The WSGI middleware (no transaction) around a WSGI application: a bare one
    (``inner`` "bare"), Flask's or Django's (which answer the view's exception with a 500
    themselves, and report an ``OutcomeUnknown`` through the middleware's slot)."""
    from idemflow.integrations.wsgi import IdempotencyMiddleware

    def act_of(key: str, act: Act) -> tuple[int, bytes]:
        """The view's part: its status and body."""
        if act is Act.TRANSIENT:
            return 503, b'{"error": "provider down"}'
        perform_sync(act, lambda: duplicate(key), lambda: rig.lose(None))
        return 201, b'{"id": 1}'

    with inner_application(inner, act_of) as application:
        app = IdempotencyMiddleware(
            application,
            idempotency=Idempotency(rig.store, POLICY, observer=metrics),
            endpoints=["POST /payments"],
            principal=lambda environ: PRINCIPAL,
        )
        door = sync_door(app, "POST /payments", "/payments", rig.heal)

        def duplicate(key: str) -> None:
            door.duplicates.append(call_wsgi(app, "/payments", key, Act.CREATE, BODY))

        yield door


@contextlib.contextmanager
def inner_application(inner: str, act_of: Callable[[str, Act], tuple[int, bytes]]) -> Iterator[Any]:
    """The application behind the WSGI middleware, its view answering ``act_of``."""
    if inner == "bare":

        def application(environ: dict[str, Any], start_response: Any) -> list[bytes]:
            status, body = act_of(environ["HTTP_IDEMPOTENCY_KEY"], Act(environ["HTTP_X_ACT"]))
            start_response(f"{status} Whatever", [("Content-Type", "application/json")])
            return [body]

        yield application
    elif inner == "flask":
        pytest.importorskip("flask")
        from flask import Flask, request

        from idemflow.integrations.flask import handle_outcome_unknown

        flask_app = Flask(__name__)
        handle_outcome_unknown(flask_app)

        @flask_app.post("/payments")
        def pay() -> Any:
            act, key = Act(request.headers["X-Act"]), request.headers["Idempotency-Key"]
            status, body = act_of(key, act)
            return flask_app.response_class(body, status, mimetype="application/json")

        yield flask_app
    else:
        pytest.importorskip("tests.integrations.django_setup")  # its app reports OutcomeUnknown
        from django.core.handlers.wsgi import WSGIHandler
        from django.http import HttpRequest, HttpResponse
        from django.test import override_settings
        from django.urls import path as route

        def view(request: HttpRequest) -> HttpResponse:
            act, key = Act(request.headers["X-Act"]), request.headers["Idempotency-Key"]
            status, body = act_of(key, act)
            return HttpResponse(body, status=status, content_type="application/json")

        with override_settings(ROOT_URLCONF=_URLs, MIDDLEWARE=[]):
            _URLs.urlpatterns = (route("payments", view),)
            yield WSGIHandler()


def flask_door(rig: Rig, metrics: PrometheusMetrics, mode: str) -> Door:
    """``@idem.protect`` on a Flask view, in the rig's transaction (``transaction=``, two
    commits or one) or with none."""
    pytest.importorskip("flask")
    from flask import Flask, g, request

    from idemflow.integrations.flask import Idempotency as FlaskIdempotency

    app = Flask(__name__)
    app.config.update(
        IDEMFLOW_REQUEST_TIMEOUT=POLICY.request_timeout,
        IDEMFLOW_RETENTION=POLICY.retention,
        IDEMFLOW_SINGLE_COMMIT=mode == "single-commit",
    )

    @contextlib.contextmanager
    def request_transaction() -> Iterator[Any]:
        assert rig.transaction is not None
        with rig.transaction() as opened:
            g.transaction = opened  # the view writes on its connection
            yield opened

    idem = FlaskIdempotency(
        app,
        store=rig.store,
        transaction=request_transaction if mode != "no-transaction" else None,
        principal=lambda: PRINCIPAL,
        observer=metrics,
    )

    @app.post("/payments")
    @idem.protect
    def pay() -> Any:
        act, key = Act(request.headers["X-Act"]), request.headers["Idempotency-Key"]
        if act is Act.TRANSIENT:
            return {"error": "provider down"}, 503
        connection = g.transaction.connection if "transaction" in g else None
        perform_sync(act, lambda: duplicate(key), lambda: rig.lose(connection))
        if connection is not None and act is not Act.LOSE:
            rig.write(connection, key)  # the effect, after the duplicate: SQLite locks on a write
        return {"id": key}, 201

    door = sync_door(app, "POST /payments", "/payments", rig.heal)

    def duplicate(key: str) -> None:
        door.duplicates.append(call_wsgi(app, "/payments", key, Act.CREATE, BODY))

    return door


@contextlib.asynccontextmanager
async def sync_rig(
    kind: str, table: str, tmp_path: Path, transactional: bool
) -> AsyncIterator[Rig]:
    """The rig ``kind`` names (a pool of two in a transaction: the duplicate claims while
    the first holds one); ``memory-sync``: the sync memory store, which has no fault."""
    if kind == "memory-sync":
        yield Rig(kind, MemoryStore(), True, None, lambda conn, note: None, _no_fault, list, _none)
        return
    pool_size = 2 if transactional else 1
    async with open_rig(
        kind, table, tmp_path, transactional=transactional, pool_size=pool_size
    ) as rig:
        yield rig


def _no_fault(conn: Any) -> None:
    raise AssertionError("the memory store has no fault to make")


def _none(key: str) -> None:
    return None


def wsgi_cases() -> Iterator[Any]:
    """(door, kind, mode): the WSGI middleware on every sync store; Flask in its
    transaction (two commits, and one on PostgreSQL and MariaDB), and without one."""
    for kind in kinds(cluster=False):
        name, rig, marks = kind.name, f"{kind.name}-sync", kind.marks
        for door in ("wsgi", "wsgi+flask", "wsgi+django"):
            yield pytest.param(door, rig, "no-transaction", marks=marks, id=f"{door}-{name}")
        modes = ["no-transaction"]
        if kind.shares_transaction:
            modes = ["two-commit"] + (["single-commit"] if kind.single_commit else [])
        for mode in modes:
            yield pytest.param("flask", rig, mode, marks=marks, id=f"flask-{name}-{mode}")


@pytest.mark.parametrize(("door_name", "kind", "mode"), list(wsgi_cases()))
async def test_every_outcome_is_counted_once_through_the_wsgi_doors(
    door_name: str,
    kind: str,
    mode: str,
    tmp_path: Path,
    table_name: str,
    metrics: PrometheusMetrics,
    scrape: Callable[[], Samples],
) -> None:
    """The WSGI middleware and Flask, each request served in a worker thread."""
    transactional = mode != "no-transaction"
    async with sync_rig(kind, table_name, tmp_path, transactional) as rig:
        with contextlib.ExitStack() as stack:
            if door_name == "flask":
                door = flask_door(rig, metrics, mode)
            else:
                inner = door_name.partition("+")[2] or "bare"
                door = stack.enter_context(wsgi_door(rig, metrics, inner))
            loss = Loss.NONE if kind == "memory-sync" else loss_of(kind, transactional)
            await play(door, script(single_commit=mode == "single-commit", loss=loss), scrape)


# --- Django: the decorator and the middleware --------------------------------------------


class _URLs:
    """The Django doors' URLconf (``ROOT_URLCONF``), set per test."""

    urlpatterns: tuple[Any, ...] = ()


#: Its business table, where a loss can be made on SQLite: a deferred foreign key.
_BUSINESS = {
    "sqlite": (
        "CREATE TABLE parent_{t} (id INTEGER PRIMARY KEY)",
        "CREATE TABLE biz_{t} (id INTEGER PRIMARY KEY, note TEXT, parent INTEGER "
        "REFERENCES parent_{t} (id) DEFERRABLE INITIALLY DEFERRED)",
    ),
    "postgres": ("CREATE TABLE biz_{t} (id BIGSERIAL PRIMARY KEY, note TEXT)",),
    "mysql": ("CREATE TABLE biz_{t} (id BIGINT AUTO_INCREMENT PRIMARY KEY, note TEXT)",),
}
ORPHAN_PARENT = 42  # never exists: a business row naming it fails the COMMIT


def lose_django_connection(alias: str, table: str) -> None:
    """Lose the request's own connection, from the view: its server session ended from
    another one (PostgreSQL, MariaDB), or on SQLite a row whose deferred foreign key will
    fail the COMMIT."""
    from django.db import connections

    connection = connections[alias]
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute(
                f"INSERT INTO biz_{table} (note, parent) VALUES ('orphan', %s)", [ORPHAN_PARENT]
            )
            return
        postgres = connection.vendor == "postgresql"
        cursor.execute("SELECT pg_backend_pid()" if postgres else "SELECT CONNECTION_ID()")
        session = int(cursor.fetchone()[0])
    from tests.integrations.django_setup import execute, own_connection

    with own_connection(alias):  # a second connection of this thread's, closed after
        if postgres:
            execute(alias, "SELECT pg_terminate_backend(%s)", [session])
        else:
            execute(alias, f"KILL CONNECTION {session}")


@contextlib.contextmanager
def django_door(
    alias: str, door_name: str, single_commit: bool, metrics: PrometheusMetrics
) -> Iterator[Door]:
    """Django's ``@idempotent`` function view, or its ``IdempotencyMiddleware``, with
    ``IDEMFLOW['observer']`` the metrics, the keys on ``alias`` (DjangoStore)."""
    django_setup = pytest.importorskip("tests.integrations.django_setup")
    from django.core.handlers.wsgi import WSGIHandler
    from django.db import connections, transaction
    from django.http import HttpRequest, JsonResponse
    from django.test import override_settings
    from django.urls import path as route

    from idemflow.integrations.django import get_store, idempotent

    django_setup.require(alias)
    table = f"idem_{uuid.uuid4().hex[:12]}"
    vendor = {"default": "sqlite"}.get(alias, alias)
    for statement in _BUSINESS[vendor]:
        django_setup.execute(alias, statement.format(t=table))

    def pay(request: HttpRequest) -> JsonResponse:
        act, key = Act(request.headers["X-Act"]), request.headers["Idempotency-Key"]
        if act is Act.TRANSIENT:
            return JsonResponse({"error": "provider down"}, status=503)
        assert transaction.get_connection(alias).in_atomic_block  # the completion's
        perform_sync(act, lambda: duplicate(key), lambda: lose_django_connection(alias, table))
        if act is not Act.LOSE:
            django_setup.execute(alias, f"INSERT INTO biz_{table} (note) VALUES (%s)", [key])
        return JsonResponse({"id": key}, status=201)

    path = "/payments" if door_name == "decorator" else "/mw/payments"
    settings = {
        "database": alias,
        "table": table,
        "request_timeout": POLICY.request_timeout,
        "retention": POLICY.retention,
        "single_commit": single_commit,
        "principal": lambda request: PRINCIPAL,
        "endpoints": ["POST /mw/payments"],
        "observer": metrics,
    }
    with override_settings(
        IDEMFLOW=settings,
        ROOT_URLCONF=_URLs,
        MIDDLEWARE=["idemflow.integrations.django.middleware.IdempotencyMiddleware"],
    ):
        _URLs.urlpatterns = (route("payments", idempotent(pay)), route("mw/payments", pay))
        get_store().migrate()
        door = sync_door(WSGIHandler(), f"POST {path}", path, lambda: None)

        def duplicate(key: str) -> None:
            door.duplicates.append(call_wsgi(WSGIHandler(), path, key, Act.CREATE, BODY))

        try:
            yield door
        finally:
            connections[alias].close()
            for dropped in (table, f"biz_{table}", f"parent_{table}"):
                django_setup.execute(alias, f"DROP TABLE IF EXISTS {dropped}")


def django_cases() -> Iterator[Any]:
    """(alias, door, single commit): both doors on each database Django's store can use,
    with two commits, and one on PostgreSQL and MariaDB."""
    for alias, mark in (("default", None), ("postgres", "postgres"), ("mysql", "mysql")):
        marks = () if mark is None else (getattr(pytest.mark, mark),)
        for door_name in ("decorator", "middleware"):
            for single_commit in (False, True) if mark else (False,):
                mode = "single-commit" if single_commit else "two-commit"
                name = f"{alias}-{door_name}-{mode}"
                yield pytest.param(alias, door_name, single_commit, marks=marks, id=name)


@pytest.mark.parametrize(("alias", "door_name", "single_commit"), list(django_cases()))
def test_every_outcome_is_counted_once_through_the_django_doors(
    alias: str,
    door_name: str,
    single_commit: bool,
    metrics: PrometheusMetrics,
    scrape: Callable[[], Samples],
) -> None:
    """``@idempotent`` and ``IdempotencyMiddleware``, in the view's transaction on the
    alias the keys live on, each request served in a worker thread (Django's database
    calls never run on an event loop: the script's loop is only the test's)."""
    with django_door(alias, door_name, single_commit, metrics) as door:
        loss = Loss.COMMIT_FAILED if alias == "default" else Loss.ROLLED_BACK
        asyncio.run(play(door, script(single_commit=single_commit, loss=loss), scrape))


# --- the sweeper: stale_reclaimed, and the lease_lost of the request it swept -------------


class Reconciler:
    """Answers by key (what the provider says about each swept claim), sync or async."""

    def __init__(self) -> None:
        self.answers: dict[str, Any] = {
            "crashed-released": DidNotHappen("never reached the provider"),
            "crashed-completed": Happened(Response.json(201, {"id": "found"})),
            "crashed-unknown": Unknown("the provider does not say yet"),
            "slow": DidNotHappen("its provider call never went out"),
            "abandoned": DidNotHappen("its client gave up before the charge"),
        }

    def __call__(self, record: Record, downstream_keys: Mapping[str, str]) -> Any:
        return self.answers[record.key]

    async def asked(self, record: Record, downstream_keys: Mapping[str, str]) -> Any:
        return self.answers[record.key]


@pytest.mark.parametrize("kind", rig_params())  # every rig
async def test_the_sweeper_counts_each_resolution_once_and_the_swept_request_its_lost_lease(
    kind: str,
    tmp_path: Path,
    table_name: str,
    metrics: PrometheusMetrics,
    scrape: Callable[[], Samples],
) -> None:
    """Three crashed claims, a request released past its recovery point (its client gave
    up), and a request still running past the stale threshold are swept in one pass: the
    reconciler answers released, completed and unknown for the crashed ones, released for
    the others. A second pass, once the unknown one is due again, releases it. Each
    resolution is ``stale_reclaimed`` once under its endpoint and once under its
    resolution; the running request, whose completion then meets the sweeper's lease,
    counts ``claimed`` and ``lease_lost``, never ``completed``. On every store, with the
    sync and the async sweeper."""
    clock = FrozenClock(time.time())
    reconciler = Reconciler()
    async with open_rig(kind, table_name, tmp_path, transactional=False, pool_size=2) as rig:
        for key in ("crashed-released", "crashed-completed", "crashed-unknown"):
            now = clock()
            await rig.call(
                "claim",
                _intent(key),
                f"lease-{key}",
                now,
                now + 3600,
                stale_after=POLICY.stale_seconds,
            )
        sweeper: Any
        idempotency: Any
        if rig.sync:
            sweeper = Sweeper(
                rig.store, POLICY, reconciler=reconciler, clock=clock, observer=metrics
            )
            idempotency = Idempotency(rig.store, POLICY, clock=clock, observer=metrics)
        else:
            sweeper = AsyncSweeper(
                rig.store, POLICY, reconciler=reconciler.asked, clock=clock, observer=metrics
            )
            idempotency = AsyncIdempotency(rig.store, POLICY, clock=clock, observer=metrics)

        async def swept_while_running(attempt: Any) -> Response:
            clock.advance(POLICY.stale_seconds + 1)
            report = await _awaited(sweeper.sweep_once())
            assert (report.released, report.completed, report.unknown) == (3, 1, 1)
            return Response.json(201, {"id": "late"})

        async def charged_then_failed(attempt: Any) -> Response:
            await _awaited(attempt.checkpoint("charge-sent"))
            raise Boom("the provider's answer was lost")

        with pytest.raises(Boom):
            await run(rig, idempotency, "abandoned", charged_then_failed)
        with pytest.raises(LeaseLost):
            await run(rig, idempotency, "slow", swept_while_running)
        first = scrape()
        clock.advance(POLICY.stale_seconds + 1)  # the unknown one is due again (stale_after)
        reconciler.answers["crashed-unknown"] = DidNotHappen("the provider says: never")
        report = await _awaited(sweeper.sweep_once())
        second = scrape()

    endpoint = "POST /payments"
    assert outcomes(first) == {
        ("claimed", endpoint): 2,
        ("released", endpoint): 1,
        ("lease_lost", endpoint): 1,
        ("stale_reclaimed", endpoint): 5,
    }
    assert resolutions(first) == {"released": 3, "completed": 1, "unknown": 1}
    assert (report.released, report.retried) == (1, 1)
    assert outcomes(second) - outcomes(first) == {("stale_reclaimed", endpoint): 1}
    assert resolutions(second) == {"released": 4, "completed": 1, "unknown": 1}


async def run(rig: Rig, idempotency: Any, key: str, handler: Callable[[Any], Any]) -> Any:
    """``idempotency.run``: a sync driver in a worker thread, the async one awaited; either
    way ``handler`` is a coroutine function (run on the test's loop from the thread)."""
    if not rig.sync:
        return await idempotency.run(_intent(key), handler)
    loop = asyncio.get_running_loop()

    def sync_handler(attempt: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(handler(attempt), loop).result(timeout=60)

    return await asyncio.to_thread(idempotency.run, _intent(key), sync_handler)


def resolutions(samples: Samples) -> dict[str, float]:
    return {
        resolution: samples.get(
            ("idemflow_stale_reclaimed_total", (("resolution", resolution),)), 0
        )
        for resolution in ("released", "completed", "unknown")
    }


def _intent(key: str) -> Any:
    return payment_intent(key, principal=PRINCIPAL)


# --- the frameworks' own sweep commands ---------------------------------------------------


def stale_reclaimed(samples: Samples) -> tuple[int, float]:
    """What a sweep of one crashed claim counts: its request outcome and its resolution."""
    return (
        outcomes(samples)["stale_reclaimed", "POST /payments"],
        resolutions(samples)["released"],
    )


def test_flasks_sweep_command_counts_what_it_reclaims(
    tmp_path: Path, metrics: PrometheusMetrics, scrape: Callable[[], Samples]
) -> None:
    """``flask idemflow sweep`` tells the extension's observer: a crashed claim it releases
    is ``stale_reclaimed`` once, as the app's sweeper would count it."""
    pytest.importorskip("flask")
    from flask import Flask

    from idemflow.integrations.flask import Idempotency as FlaskIdempotency
    from idemflow.stores.sqlite import SQLiteStore

    store = SQLiteStore(tmp_path / "keys.db")
    store.migrate()
    crashed_at = time.time() - 600
    store.claim(
        _intent("crashed"),
        "lease-crashed",
        crashed_at,
        crashed_at + 3600,
        stale_after=POLICY.stale_seconds,
    )
    app = Flask(__name__)
    FlaskIdempotency(app, store=store, principal=lambda: PRINCIPAL, observer=metrics)
    try:
        swept = app.test_cli_runner().invoke(args=["idemflow", "sweep"])
    finally:
        store.close()

    assert swept.output.strip() == "swept: released=1 unknown=0", swept.output
    assert stale_reclaimed(scrape()) == (1, 1)


def test_djangos_sweep_command_counts_what_it_reclaims(
    metrics: PrometheusMetrics, scrape: Callable[[], Samples]
) -> None:
    """``manage.py idemflow_sweep`` tells ``IDEMFLOW['observer']``: a crashed claim it
    releases is ``stale_reclaimed`` once."""
    django_setup = pytest.importorskip("tests.integrations.django_setup")
    from django.core.management import call_command
    from django.test import override_settings

    from idemflow.integrations.django import get_store

    table = f"idem_{uuid.uuid4().hex[:12]}"
    settings = {"table": table, "clock": "caller", "observer": metrics}
    with override_settings(IDEMFLOW=settings):
        store: Any = get_store()
        store.migrate()
        try:
            crashed_at = time.time() - 600
            store.claim(
                _intent("crashed"),
                "lease-crashed",
                crashed_at,
                crashed_at + 3600,
                stale_after=POLICY.stale_seconds,
            )
            out = io.StringIO()
            call_command("idemflow_sweep", stdout=out)
        finally:
            django_setup.execute("default", f"DROP TABLE IF EXISTS {table}")

    assert out.getvalue().startswith("swept: released=1 completed=0 unknown=0"), out.getvalue()
    assert stale_reclaimed(scrape()) == (1, 1)
