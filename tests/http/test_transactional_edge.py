"""
Transactional mode (``Idempotent.run``) at the HTTP edge, on a Starlette app over PostgreSQL:
bodies cut short or too large, mounts and query strings, responses that cannot be sent.
"""

from __future__ import annotations

import collections
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

psycopg = pytest.importorskip("psycopg")
psycopg_pool = pytest.importorskip("psycopg_pool")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import Response as StarletteResponse  # noqa: E402
from starlette.routing import Mount, Route  # noqa: E402
from starlette.types import Scope  # noqa: E402

import idemflow  # noqa: E402
from idemflow import AsyncAttempt, AsyncIdempotency, Policy  # noqa: E402
from idemflow.integrations.starlette import EdgeOptions, Idempotent  # noqa: E402
from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore  # noqa: E402
from idemflow.transactions import AsyncPsycopgTransaction  # noqa: E402
from tests.conftest import POSTGRES_URL, unreachable  # noqa: E402
from tests.http.conftest import assert_problem, new_key, serve  # noqa: E402
from tests.http.rawhttp import (  # noqa: E402
    ErrorLog,
    Finished,
    capture_errors,
    post_chunks,
    post_declaring,
    send_partial,
)

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(90)]

BODY_LIMIT = 65_536
BAD_HEADERS = {
    "disposition": ("content-disposition", 'attachment; filename="\u20ac.txt"'),  # not latin-1
    "location": ("location", "/notes/1\r\nset-cookie: stolen=1"),
    "nul": ("location", "/notes/1\x00"),
}


def header_principal(scope: Scope) -> str | None:
    """``X-User: name`` is the principal (tests only)."""
    for name, value in scope["headers"]:
        if name == b"x-user":
            return str(value.decode("latin-1"))
    return None


def make_app(table: str, calls: collections.Counter[str]) -> Finished:
    pool = psycopg_pool.AsyncConnectionPool(
        POSTGRES_URL, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False
    )
    idempotent = Idempotent(
        AsyncIdempotency(AsyncPostgresStore(pool, table=table), Policy(request_timeout=10)),
        connect=pool.connection,
        transaction=AsyncPsycopgTransaction,
        principal=header_principal,
        options=EdgeOptions(max_body_bytes=BODY_LIMIT),
    )

    async def insert(attempt: AsyncAttempt, note: str) -> int:
        cursor = await attempt.connection.execute(
            f"INSERT INTO notes_{table} (note) VALUES (%s) RETURNING id", (note,)
        )
        row = await cursor.fetchone()
        return int(row[0])

    async def create(request: Request) -> StarletteResponse:
        # Reads nothing itself: run() reads (and bounds) the body.
        async def handler(attempt: AsyncAttempt) -> idemflow.Response:
            calls[request.url.path] += 1
            note_id = await insert(attempt, request.url.path)
            location = [("location", f"/notes/{note_id}")]
            return idemflow.Response.json(201, {"id": note_id}, location)

        return await idempotent.run(request, handler)

    async def bad_header(request: Request) -> StarletteResponse:
        header = BAD_HEADERS[request.path_params["kind"]]

        async def handler(attempt: AsyncAttempt) -> idemflow.Response:
            calls[request.url.path] += 1
            await insert(attempt, request.url.path)
            return idemflow.Response.json(201, {"ok": True}, [header])

        return await idempotent.run(request, handler)

    async def returns_dict(request: Request) -> StarletteResponse:
        async def handler(attempt: AsyncAttempt) -> Any:
            await insert(attempt, request.url.path)
            return {"id": 1}

        return await idempotent.run(request, handler)

    regional = [Route("/payments", create, methods=["POST"])]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await pool.open(wait=False)
        yield
        await pool.close()

    app = Starlette(
        routes=[
            Route("/notes", create, methods=["POST"]),
            Route("/bad/{kind}", bad_header, methods=["POST"]),
            Route("/dict", returns_dict, methods=["POST"]),
            Mount("/eu", routes=regional),
            Mount("/us", routes=regional),
            Mount("/r/{region}", routes=regional),
        ],
        lifespan=lifespan,
    )
    return Finished(app)


@pytest.fixture(scope="module")
def table() -> Iterator[str]:
    name = f"idem_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE TABLE notes_{name} (id BIGSERIAL PRIMARY KEY, note TEXT)")
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    store = PostgresStore(POSTGRES_URL, table=name, max_size=1)
    store.migrate()
    store.close()
    yield name
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}, notes_{name}")


class App:
    def __init__(self, url: str, table: str, calls: collections.Counter[str], app: Finished):
        self.url, self.table, self.calls, self.finished = url, table, calls, app

    def client(self, key: str) -> httpx.Client:
        headers = {"X-User": "erin", "Idempotency-Key": key}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            rows: list[tuple[Any, ...]] = conn.execute(
                sql.format(table=self.table), params
            ).fetchall()
            return rows

    def key(self, key: str) -> tuple[Any, ...] | None:
        rows = self.query("SELECT state, endpoint FROM {table} WHERE idempotency_key = %s", key)
        return rows[0] if rows else None

    def notes(self, path: str) -> int:
        return int(self.query("SELECT count(*) FROM notes_{table} WHERE note = %s", path)[0][0])


@pytest.fixture(scope="module")
def app(table: str) -> Iterator[App]:
    calls: collections.Counter[str] = collections.Counter()
    asgi = make_app(table, calls)
    with serve(asgi) as url:
        yield App(url, table, calls, asgi)


@pytest.fixture
def errors() -> Iterator[ErrorLog]:
    with capture_errors() as handler:
        yield handler


def test_a_body_cut_short_is_never_run_recorded_or_logged(app: App, errors: ErrorLog) -> None:
    """Issue 9, defects 4 and 15: starlette's ClientDisconnect used to escape with a traceback."""
    key, test_id = new_key(), uuid.uuid4().hex
    body = b"note=a whole body"
    headers = {"X-User": "erin", "Idempotency-Key": key, "X-Test-Id": test_id}
    send_partial(app.url, "/notes", headers, declared=len(body), sent=body[:5])
    assert app.finished.wait(test_id)
    assert app.key(key) is None
    assert errors.texts() == []
    before = app.notes("/notes")
    with app.client(key) as client:
        retry = client.post("/notes", content=body)
    assert retry.status_code == 201
    assert app.notes("/notes") == before + 1
    assert app.key(key) == ("completed", "POST /notes")


def test_a_declared_body_over_the_cap_is_413_before_it_is_read(app: App) -> None:
    """Issue 9, defect 12: run() used to read any body whole before looking at its size."""
    key = new_key()
    response = post_declaring(
        app.url, "/notes", {"X-User": "erin", "Idempotency-Key": key}, length=100_000_000
    )
    assert response.status == 413
    assert response.json()["type"].endswith("/body-too-large")
    assert app.key(key) is None


def test_a_streamed_body_over_the_cap_is_413_while_it_streams(app: App) -> None:
    key = new_key()
    chunks = [b"y" * 16_384] * (BODY_LIMIT // 16_384 + 1)
    response = post_chunks(
        app.url, "/notes", {"X-User": "erin", "Idempotency-Key": key}, chunks, finish=False
    )
    assert response.status == 413
    assert str(BODY_LIMIT) in response.json()["detail"]
    assert app.key(key) is None


def test_a_key_used_under_one_mount_is_422_under_another(app: App) -> None:
    """Issue 9, defect 9: /eu/payments and /us/payments used to share one endpoint."""
    key = new_key()
    with app.client(key) as client:
        eu = client.post("/eu/payments", json={})
        us = client.post("/us/payments", json={})
    assert eu.status_code == 201
    assert_problem(us, 422, "key-reused")
    assert app.notes("/us/payments") == 0
    assert app.key(key) == ("completed", "POST /eu/payments")


def test_a_mount_with_a_parameter_keeps_its_template_and_fingerprints_the_value(
    app: App,
) -> None:
    key = new_key()
    with app.client(key) as client:
        first = client.post("/r/north/payments", json={})
        again = client.post("/r/north/payments", json={})
        other = client.post("/r/south/payments", json={})
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert_problem(other, 422, "key-reused")
    assert app.key(key) == ("completed", "POST /r/{region}/payments")  # a template: bounded


def test_the_query_string_is_part_of_the_request(app: App) -> None:
    """Issue 9, defect 9: ?x=1 and ?x=2 under one key used to replay each other."""
    key = new_key()
    with app.client(key) as client:
        first = client.post("/notes?x=1", content=b"same")
        other = client.post("/notes?x=2", content=b"same")
    assert first.status_code == 201
    assert_problem(other, 422, "key-reused")


@pytest.mark.parametrize("kind", sorted(BAD_HEADERS))
def test_a_header_that_cannot_be_sent_rolls_back_and_releases(app: App, kind: str) -> None:
    """Issue 9, defect 8: such a response used to be stored, then fail every answer."""
    key, path = new_key(), f"/bad/{kind}"
    with app.client(key) as client:
        first = client.post(path)
    body = assert_problem(first, 500, "response-not-storable")
    assert "cannot be sent" in body["detail"]
    assert app.notes(path) == 0  # the handler's insert rolled back with the claim
    assert app.key(key) == ("released", "POST /bad/{kind}")  # the template, not the value


def test_a_handler_returning_a_dict_gets_a_clear_error(app: App, errors: ErrorLog) -> None:
    """Issue 9, defect 15: it used to be told that a dict 'streams its body'."""
    key = new_key()
    with app.client(key) as client:
        assert client.post("/dict").status_code == 500
    texts = errors.wait_for("returned a dict")
    assert any("returned a dict" in text for text in texts), texts
    assert not any("streams its body" in text for text in texts)
    assert app.notes("/dict") == 0
    assert app.key(key) == ("released", "POST /dict")
