"""
The WSGI middleware through a real server: gunicorn (gthread worker, two
processes) serving ``examples/wsgi_app.py`` on 127.0.0.1, on SQLite and on
PostgreSQL. The business rows and the key records are read the way an
operator would, from the databases.
"""

from __future__ import annotations

import contextlib
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import httpx
import pytest

from idemflow import ConfigurationError, Idempotency, Policy, Record, State
from idemflow.integrations.wsgi import EdgeOptions, IdempotencyMiddleware, _compile_endpoint
from idemflow.stores.protocol import Store
from idemflow.stores.sqlite import SQLiteStore
from idemflow.testing import MemoryStore
from tests.conftest import POSTGRES_URL, unreachable
from tests.http.conftest import CONTROL_KEYS, MALFORMED_KEYS, assert_problem
from tests.http.rawhttp import post_chunks, post_declaring, send_partial
from tests.servers import serve_on_socket

if TYPE_CHECKING:
    from idemflow.stores.postgres import PostgresStore

pytestmark = pytest.mark.timeout(120)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEADLINE_SECONDS = 20
MAX_BODY = 1_048_576  # the example's (the default) body cap


def new_key() -> str:
    return f"wsgi-{uuid.uuid4().hex}"


def payment(customer: str | None = None, amount: int = 1000) -> dict[str, Any]:
    return {"amount": amount, "currency": "EUR", "customer": customer or uuid.uuid4().hex}


@dataclass
class Served:
    """A running gunicorn, where its data lives, and how to read it."""

    url: str
    data: Path
    database_url: str | None
    log: Path
    store: Store

    def client(self, user: str | None = "alice", key: str | None = None) -> httpx.Client:
        headers = {}
        if user is not None:
            headers["Authorization"] = f"Bearer {user}"
        if key is not None:
            headers["Idempotency-Key"] = key
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, verify=False)

    def record(self, principal: str, key: str) -> Record | None:
        return self.store.get(principal, key)

    def rows(self, customer: str) -> int:
        sql = "SELECT count(*) FROM payments WHERE customer = "
        if self.database_url is None:
            with contextlib.closing(sqlite3.connect(self.data / "payments.db")) as conn:
                return int(conn.execute(sql + "?", (customer,)).fetchone()[0])
        import psycopg

        with psycopg.connect(self.database_url, autocommit=True) as conn:
            found = conn.execute(sql + "%s", (customer,)).fetchone()
            assert found is not None
            return int(found[0])

    @contextlib.contextmanager
    def payments_locked(self) -> Iterator[None]:
        """Hold a write lock on the payments table: the app's INSERT waits for it."""
        if self.database_url is None:
            conn = sqlite3.connect(self.data / "payments.db", isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                yield
                conn.execute("ROLLBACK")
            finally:
                conn.close()
            return
        import psycopg

        with psycopg.connect(self.database_url) as pg, pg.transaction():
            pg.execute("LOCK TABLE payments IN SHARE ROW EXCLUSIVE MODE")
            yield

    def log_size(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        with self.log.open("rb") as log:
            log.seek(offset)
            return log.read().decode("utf-8", "replace")


@contextlib.contextmanager
def gunicorn(env: dict[str, str], log: Path) -> Iterator[str]:
    """gunicorn (gthread, 2 workers × 8 threads) on a socket we bound: no port race."""

    def command(fd: int) -> list[str]:
        return [
            sys.executable, "-m", "gunicorn", "--chdir", str(EXAMPLES),
            "--worker-class", "gthread", "--workers", "2", "--threads", "8",
            "--bind", f"fd://{fd}", "--no-control-socket", "--graceful-timeout", "5",
            "wsgi_app:app",
        ]  # fmt: skip

    with serve_on_socket(command, log, env=env, backlog=256) as (url, _):
        yield url


@pytest.fixture(scope="module")
def pg_schema_url() -> Iterator[str]:
    """A PostgreSQL URL whose tables land in a schema of their own, dropped afterwards."""
    psycopg = pytest.importorskip("psycopg")
    schema = f"wsgi_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    separator = "&" if "?" in POSTGRES_URL else "?"
    yield f"{POSTGRES_URL}{separator}options=-csearch_path%3D{schema}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    data = tmp_path_factory.mktemp(f"wsgi-{request.param}")
    env = {"WSGI_APP_DATA": str(data)}
    database_url = None
    if request.param == "postgres":
        database_url = request.getfixturevalue("pg_schema_url")
        env["WSGI_APP_DATABASE_URL"] = database_url
    log = data / "gunicorn.log"
    with gunicorn(env, log) as url:
        if database_url is None:
            store: SQLiteStore | PostgresStore = SQLiteStore(data / "keys.db")
        else:
            from idemflow.stores.postgres import PostgresStore

            store = PostgresStore(database_url, max_size=1)
        try:
            yield Served(url, data, database_url, log, store)
        finally:
            store.close()


def wait_for_state(served: Served, principal: str, key: str, state: State) -> Record:
    deadline = time.monotonic() + DEADLINE_SECONDS
    while time.monotonic() < deadline:
        record = served.record(principal, key)
        if record is not None and record.state is state:
            return record
        time.sleep(0.01)  # polling the store, with a deadline
    raise AssertionError(f"the key never reached {state}: {served.record(principal, key)}")


# --- the rules, through gunicorn ------------------------------------------------------------


def test_the_first_request_runs_and_its_retry_is_a_byte_identical_replay(
    served: Served,
) -> None:
    key, body = new_key(), payment()
    with served.client(key=key) as client:
        first = client.post("/payments", json=body)
        again = client.post("/payments", json=body)
    assert first.status_code == 201
    assert first.headers["set-cookie"] == "last_payment=1"
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotency-original-request-id"] == first.headers["x-request-id"]
    assert again.headers["x-request-id"] != first.headers["x-request-id"]
    assert again.headers["location"] == first.headers["location"]
    assert "set-cookie" not in again.headers
    assert served.rows(body["customer"]) == 1
    record = served.record("alice", key)
    assert record is not None
    assert record.state is State.COMPLETED
    assert record.endpoint == "POST /payments"


def test_the_same_key_for_another_body_or_another_refund_target_is_422(served: Served) -> None:
    key, body = new_key(), payment()
    with served.client(key=key) as client:
        assert client.post("/payments", json=body).status_code == 201
        assert_problem(client.post("/payments", json={**body, "amount": 5}), 422, "key-reused")
    key = new_key()
    with served.client(key=key) as client:
        assert client.post("/payments/1/refunds", json={"amount": 1}).status_code == 201
        assert_problem(client.post("/payments/2/refunds", json={"amount": 1}), 422, "key-reused")
    record = served.record("alice", key)
    assert record is not None
    assert record.endpoint == "POST /payments/{id}/refunds"
    assert served.rows(body["customer"]) == 1


def test_a_duplicate_while_the_first_runs_is_409_with_retry_after(served: Served) -> None:
    key, body = new_key(), payment()
    answers: list[httpx.Response] = []

    def first() -> None:
        with served.client(key=key) as client:
            answers.append(client.post("/payments", json=body))

    with served.payments_locked():
        runner = threading.Thread(target=first)
        runner.start()
        wait_for_state(served, "alice", key, State.IN_PROGRESS)
        with served.client(key=key) as client:
            conflict = client.post("/payments", json=body)
    runner.join(DEADLINE_SECONDS)
    assert_problem(conflict, 409, "in-progress")
    assert int(conflict.headers["retry-after"]) >= 1
    assert "x-request-id" in conflict.headers
    assert [answer.status_code for answer in answers] == [201]
    with served.client(key=key) as client:
        assert client.post("/payments", json=body).headers["idempotent-replayed"] == "true"
    assert served.rows(body["customer"]) == 1


def test_fifty_parallel_identical_posts_write_one_row(served: Served) -> None:
    key, body = new_key(), payment()
    barrier = threading.Barrier(50)
    limits = httpx.Limits(max_connections=50, max_keepalive_connections=50)
    headers = {"Authorization": "Bearer alice", "Idempotency-Key": key}
    with httpx.Client(
        base_url=served.url, headers=headers, timeout=30, limits=limits, verify=False
    ) as client:

        def post(_: int) -> httpx.Response:
            barrier.wait(DEADLINE_SECONDS)
            return client.post("/payments", json=body)

        with ThreadPoolExecutor(50) as pool:
            answers = list(pool.map(post, range(50)))
    executed = [
        a for a in answers if a.status_code == 201 and "idempotent-replayed" not in a.headers
    ]
    assert len(executed) == 1
    assert {a.status_code for a in answers} <= {201, 409}
    assert all(a.content == executed[0].content for a in answers if a.status_code == 201)
    assert served.rows(body["customer"]) == 1


def test_keys_are_scoped_to_the_principal(served: Served) -> None:
    key, body = new_key(), payment()
    with served.client("alice", key) as alice, served.client("bob", key) as bob:
        first = alice.post("/payments", json=body)
        other = bob.post("/payments", json=body)
    assert first.status_code == other.status_code == 201
    assert "idempotent-replayed" not in other.headers
    assert first.json()["id"] != other.json()["id"]
    assert served.rows(body["customer"]) == 2


def test_a_missing_key_a_bad_key_and_no_principal_are_refused_and_never_recorded(
    served: Served,
) -> None:
    body = payment()
    with served.client() as client:
        assert_problem(client.post("/payments", json=body), 400, "missing-key")
    key = new_key()
    with served.client(key=key + ", other") as client:
        assert_problem(client.post("/payments", json=body), 400, "invalid-key")
    with served.client(user=None, key=key) as client:
        refused = client.post("/payments", json=body)
    assert_problem(refused, 401, "missing-principal")
    assert "x-request-id" in refused.headers
    assert served.record("alice", key) is None
    assert served.record("anonymous", key) is None
    assert served.rows(body["customer"]) == 0


def test_every_malformed_key_is_a_400_invalid_key_and_never_recorded(served: Served) -> None:
    """The table of malformed keys the ASGI edge and the Django and Flask doors are held to
    (tests/http/conftest.py): each the 400 invalid-key problem, the endpoint never run;
    control characters are gunicorn's own 400 before the middleware sees them."""
    body = payment()
    with served.client() as client:
        for name, lines in MALFORMED_KEYS.items():
            headers = [(b"idempotency-key", line) for line in lines]
            refused = client.post("/payments", json=body, headers=headers)
            assert refused.status_code == 400, (name, refused.text)
            assert_problem(refused, 400, "invalid-key")
        for name, lines in CONTROL_KEYS.items():
            headers = [(b"idempotency-key", line) for line in lines]
            assert client.post("/payments", json=body, headers=headers).status_code == 400, name
    assert served.rows(body["customer"]) == 0


def test_safe_methods_and_routes_not_listed_ignore_the_header(served: Served) -> None:
    with served.client(key="not, a key") as client:
        assert client.get("/payments").status_code == 200
        assert client.post("/elsewhere", json={}).status_code == 404  # the app's own answer


def test_a_content_length_over_the_cap_is_413_at_once(served: Served) -> None:
    key = new_key()
    headers = {"Authorization": "Bearer alice", "Idempotency-Key": key}
    response = post_declaring(served.url, "/payments", headers, length=100_000_000)
    assert response.status == 413
    problem = response.json()
    assert problem["type"].endswith("/body-too-large")
    assert str(MAX_BODY) in problem["detail"]
    assert served.record("alice", key) is None


def test_a_chunked_body_over_the_cap_is_413_while_it_streams(served: Served) -> None:
    key = new_key()
    headers = {"Authorization": "Bearer alice", "Idempotency-Key": key}
    chunks = [b"x" * 65_536] * (MAX_BODY // 65_536 + 1)
    # The body is never finished: the answer can only come while it streams.
    response = post_chunks(served.url, "/payments", headers, chunks, finish=False)
    assert response.status == 413
    assert response.json()["type"].endswith("/body-too-large")
    assert served.record("alice", key) is None


def test_a_whole_chunked_body_is_read_and_run(served: Served) -> None:
    key, body = new_key(), payment()
    raw = httpx.Request("POST", "/", json=body).content
    headers = {
        "Authorization": "Bearer alice",
        "Idempotency-Key": key,
        "Content-Type": "application/json",
    }
    response = post_chunks(served.url, "/payments", headers, [raw[:7], raw[7:]], finish=True)
    assert response.status == 201
    assert served.rows(body["customer"]) == 1


def test_a_body_cut_short_is_never_run_recorded_or_logged(served: Served) -> None:
    """22 declared bytes, 9 sent, then the client hangs up: nothing may run on part of it."""
    key, body = new_key(), payment()
    raw = httpx.Request("POST", "/", json=body).content
    headers = {"Authorization": "Bearer alice", "Idempotency-Key": key}
    offset = served.log_size()
    answer = send_partial(served.url, "/payments", headers, declared=len(raw), sent=raw[:9])
    # The server saw the hang-up and answered (to nobody): the request was handled.
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert b"incomplete-body" in answer
    assert served.record("alice", key) is None
    assert served.rows(body["customer"]) == 0
    with served.client(key=key) as client:
        assert client.post("/payments", json=body).status_code == 201
    assert served.rows(body["customer"]) == 1
    logged = served.log_since(offset)
    assert "Traceback" not in logged
    assert "Error handling request" not in logged


def test_a_transient_503_is_released_and_the_retry_really_runs(served: Served) -> None:
    key, body = new_key(), payment()
    with served.client(key=key) as client:
        down = client.post("/payments", json=body, headers={"X-Provider": "down"})
        record = served.record("alice", key)
        retry = client.post("/payments", json=body)
        replay = client.post("/payments", json=body)
    assert down.status_code == 503
    assert record is not None
    assert record.state is State.RELEASED
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert replay.headers["idempotent-replayed"] == "true"
    assert served.rows(body["customer"]) == 1


def test_the_apps_exception_releases_the_key_and_reaches_the_server(served: Served) -> None:
    key, body = new_key(), payment()
    offset = served.log_size()
    with served.client(key=key) as client:
        crashed = client.post("/payments", json=body, headers={"X-Provider": "error"})
    assert crashed.status_code == 500  # gunicorn's own error page: the exception reached it
    assert "problem" not in crashed.headers.get("content-type", "")
    record = served.record("alice", key)
    assert record is not None
    assert record.state is State.RELEASED
    with served.client(key=key) as client:
        assert client.post("/payments", json=body).status_code == 201
    assert served.rows(body["customer"]) == 1
    assert "the payment provider's client library crashed" in served.log_since(offset)


def test_an_unsendable_header_settles_a_marker_and_the_payment_never_runs_again(
    served: Served,
) -> None:
    """Issue 9, defect 8: the payment happened; releasing would charge again on every retry."""
    key, body = new_key(), payment(customer=f"€uro-{uuid.uuid4().hex}")
    with served.client(key=key) as client:
        first = client.post("/payments", json=body)
        again = client.post("/payments", json=body)
    problem = assert_problem(first, 500, "response-not-stored")
    assert problem["original_status"] == 201
    assert problem["location"].startswith("/payments/")
    assert "content-disposition" in problem["detail"].lower()
    assert assert_problem(again, 500, "response-not-stored") == problem
    assert again.headers["idempotent-replayed"] == "true"
    assert served.rows(body["customer"]) == 1
    record = served.record("alice", key)
    assert record is not None
    assert record.state is State.COMPLETED


# --- mounts, through a dispatcher on a real (wsgiref) server ---------------------------------


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def wsgiref_server(app: Any) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(DEADLINE_SECONDS)


def test_one_app_mounted_twice_is_two_endpoints(tmp_path: Path) -> None:
    """Issue 9, defect 9: SCRIPT_NAME is part of the route, so /eu and /us never replay."""
    store = SQLiteStore(tmp_path / "keys.db")
    store.migrate()
    calls: list[str] = []

    def create(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        calls.append(environ["SCRIPT_NAME"])
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [environ["SCRIPT_NAME"].encode()]

    def authenticated(app: Any) -> Any:
        def wrapped(environ: dict[str, Any], start_response: Any) -> Any:
            environ["REMOTE_USER"] = "carol"
            return app(environ, start_response)

        return wrapped

    protected = IdempotencyMiddleware(
        create,
        idempotency=Idempotency(store, Policy(request_timeout=5)),
        endpoints=["POST /payments"],
    )

    def dispatcher(environ: dict[str, Any], start_response: Any) -> Any:
        prefix = environ["PATH_INFO"][:3]
        environ["SCRIPT_NAME"] += prefix
        environ["PATH_INFO"] = environ["PATH_INFO"][3:]
        return protected(environ, start_response)

    key = new_key()
    try:
        with (
            wsgiref_server(authenticated(dispatcher)) as url,
            httpx.Client(base_url=url, verify=False) as client,
        ):
            headers = {"Idempotency-Key": key}
            eu = client.post("/eu/payments", content=b"{}", headers=headers)
            again = client.post("/eu/payments", content=b"{}", headers=headers)
            us = client.post("/us/payments", content=b"{}", headers=headers)
        assert (eu.status_code, eu.content) == (201, b"/eu")
        assert again.headers["idempotent-replayed"] == "true"
        assert_problem(us, 422, "key-reused")
        assert calls == ["/eu"]
        record = store.get("carol", key)
        assert record is not None
        assert record.endpoint == "POST /eu/payments"
    finally:
        store.close()


# --- how the application's response is captured (wsgiref: a real, single-threaded server) ---

LIMIT = 4096


class Body:
    """A response iterable that says whether it was iterated to its end, and closed."""

    def __init__(self, chunks: list[bytes], events: list[str], *, fail: bool = False) -> None:
        self.chunks, self.events, self.fail = chunks, events, fail

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            yield chunk
            if self.fail:
                raise RuntimeError("the app failed mid-body")
        self.events.append("ended")

    def close(self) -> None:
        self.events.append("closed")


def streaming_app(events: list[str], *, fail: bool = False) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> Body:
        events.append("ran")
        start_response("200 OK", [("Content-Type", "text/plain")])
        return Body([b"z" * LIMIT] * 3, events, fail=fail)

    return app


@contextlib.contextmanager
def protected_by_wsgiref(tmp_path: Path, app: Any) -> Iterator[tuple[str, SQLiteStore]]:
    store = SQLiteStore(tmp_path / "keys.db")
    store.migrate()
    middleware = IdempotencyMiddleware(
        app,
        idempotency=Idempotency(store, Policy(request_timeout=5)),
        endpoints=["POST /export"],
        options=EdgeOptions(max_response_bytes=LIMIT),
    )

    def authenticated(environ: dict[str, Any], start_response: Any) -> Any:
        environ["REMOTE_USER"] = "carol"
        return middleware(environ, start_response)

    try:
        with wsgiref_server(authenticated) as url:
            yield url, store
    finally:
        store.close()


def test_a_body_over_the_stored_limit_runs_to_its_end_is_closed_and_settles_a_marker(
    tmp_path: Path,
) -> None:
    """Issue 9, defect 8: the effect happened; the key is settled, the app never re-run."""
    events: list[str] = []
    key = new_key()
    with protected_by_wsgiref(tmp_path, streaming_app(events)) as (url, store):
        with httpx.Client(base_url=url, headers={"Idempotency-Key": key}, verify=False) as client:
            first = client.post("/export")
            again = client.post("/export")
        record = store.get("carol", key)
    body = assert_problem(first, 500, "response-not-stored")
    assert str(3 * LIMIT) in body["detail"]
    assert body["original_status"] == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert events == ["ran", "ended", "closed"]
    assert record is not None
    assert record.state is State.COMPLETED


def test_an_iterable_that_fails_mid_body_is_closed_and_its_key_released(tmp_path: Path) -> None:
    events: list[str] = []
    key = new_key()
    with protected_by_wsgiref(tmp_path, streaming_app(events, fail=True)) as (url, store):
        with httpx.Client(base_url=url, headers={"Idempotency-Key": key}, verify=False) as client:
            failed = client.post("/export")
        record = store.get("carol", key)
    assert failed.status_code == 500  # wsgiref's own error page: the exception reached it
    assert events == ["ran", "closed"]
    assert record is not None
    assert record.state is State.RELEASED


def test_a_chunked_body_the_server_does_not_end_is_411_and_never_run(tmp_path: Path) -> None:
    """wsgiref, like Django's runserver, passes a chunked body on as it came, without
    ``wsgi.input_terminated``: no reader can tell where it ends. The 411 length-required
    problem, unread, the app never run, nothing recorded. Before: read as the empty body
    PEP 3333 makes of it, claimed, run and recorded (201), the real body never seen."""
    events: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        events.append("ran")
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"made"]

    key = new_key()
    with protected_by_wsgiref(tmp_path, app) as (url, store):
        # The head alone, its body to follow: wsgiref answers without reading a byte of it,
        # then closes; a chunk sent meanwhile would race the close (a broken pipe, a reset).
        answer = post_chunks(url, "/export", {"Idempotency-Key": key}, [], finish=False)
        record = store.get("carol", key)
    assert answer.status == 411
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith("/length-required")
    assert events == []
    assert record is None


# --- configuration mistakes fail when the middleware is built --------------------------------


@pytest.mark.parametrize(
    ("endpoint", "why"),
    [
        ("GET /payments", "idempotent already"),
        ("POST payments", "METHOD /route"),
        ("POST /payments/{id}/{id}", "twice"),
        ("POST /payments/pay_{id}", "whole segment"),
        ("PO ST /x", "METHOD /route"),
    ],
)
def test_a_malformed_or_safe_endpoint_is_refused_at_start_up(endpoint: str, why: str) -> None:
    with pytest.raises(ConfigurationError, match=why):
        _compile_endpoint(endpoint)


def test_no_endpoint_or_an_async_driver_is_refused_at_start_up(tmp_path: Path) -> None:
    from idemflow import AsyncIdempotency
    from idemflow.stores.sqlite import AsyncSQLiteStore

    store = SQLiteStore(tmp_path / "keys.db")

    def app(environ: Any, start_response: Any) -> list[bytes]:
        return []

    with pytest.raises(ConfigurationError, match="at least one endpoint"):
        IdempotencyMiddleware(app, idempotency=Idempotency(store), endpoints=[])
    with pytest.raises(ConfigurationError, match="AsyncIdempotency"):
        IdempotencyMiddleware(
            app,
            idempotency=AsyncIdempotency(AsyncSQLiteStore(tmp_path / "k.db")),  # type: ignore[arg-type]
            endpoints=["POST /x"],
        )
    store.close()


def test_an_async_replay_hook_is_refused_at_start_up_and_a_plain_one_taken() -> None:
    """The sync edge cannot await an ``async def`` hook: refused when the middleware is
    made, not answered as a 500 on every replay."""

    def app(environ: Any, start_response: Any) -> list[bytes]:
        return []

    async def may_replay_later(record: Record) -> bool:
        return True

    def may_replay(record: Record) -> bool:
        return True

    driver = Idempotency(MemoryStore())
    with pytest.raises(ConfigurationError, match="coroutine function"):
        IdempotencyMiddleware(
            app,
            idempotency=driver,
            endpoints=["POST /x"],
            options=EdgeOptions(authorize_replay=may_replay_later),
        )
    made = IdempotencyMiddleware(
        app,
        idempotency=driver,
        endpoints=["POST /x"],
        options=EdgeOptions(authorize_replay=may_replay),
    )
    assert made.edge.options.authorize_replay is may_replay


# --- the header lines: one reader (raw_headers) for the middleware, Flask and Django -------


def test_an_empty_idempotency_key_is_a_400_empty_not_a_missing_key(tmp_path: Path) -> None:
    """A header sent with an empty value is a header line like another (RFC 9110 §5.5):
    ``Idempotency-Key:`` is the client's 400 "empty", and the app never runs. (The reader
    once dropped empty values, and answered it missing-key, as if no header were sent.)"""
    events: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        events.append("ran")
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"made"]

    with protected_by_wsgiref(tmp_path, app) as (url, _):
        refused = httpx.post(
            url + "/export", content=b"x", headers={"Idempotency-Key": ""}, verify=False
        )
    body = assert_problem(refused, 400, "invalid-key")
    assert "empty" in body["detail"]
    assert events == []


def test_django_reads_meta_as_werkzeug_reads_the_environ() -> None:
    """Django's ``request.META`` goes through the same reader: an empty header value is
    kept, an empty CONTENT_TYPE/CONTENT_LENGTH (a server's "the request has none") is no
    line, as in werkzeug's ``request.headers``. (Django's own reader once kept those.)"""
    pytest.importorskip("django")
    from django.test import RequestFactory
    from werkzeug.datastructures import EnvironHeaders

    import tests.integrations.django_setup  # noqa: F401 -- settings
    from idemflow.integrations.django.views import _headers

    meta = {"CONTENT_TYPE": "", "CONTENT_LENGTH": "", "HTTP_IDEMPOTENCY_KEY": ""}
    request = RequestFactory().generic("POST", "/payments", **meta)
    lines = _headers(request)
    werkzeugs = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in EnvironHeaders(request.META)
    ]
    assert lines == werkzeugs
    assert (b"idempotency-key", b"") in lines
    assert not {b"content-type", b"content-length"} & {name for name, _ in lines}


def test_django_reads_a_body_without_its_length_only_where_the_server_ends_it() -> None:
    """Without ``CONTENT_LENGTH`` Django's WSGIRequest sees an empty body. Where the server
    ends the stream (``wsgi.input_terminated``), the doors read it themselves, bounded, and
    the request then holds it (``body``, ``POST`` parsed before from the empty one, DRF's
    length); where it does not, a chunked body is the 411 ``length-required`` problem and no
    body at all is an empty one."""
    pytest.importorskip("django")
    import io

    from django.core.handlers.wsgi import WSGIRequest

    import tests.integrations.django_setup  # noqa: F401 -- settings
    from idemflow import BodyTooLarge, LengthRequired
    from idemflow.integrations.django.views import _body

    def unframed(body: bytes, **meta: Any) -> WSGIRequest:
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/payments",
            "wsgi.input": io.BytesIO(body),
        }
        environ["CONTENT_TYPE"] = "application/x-www-form-urlencoded"
        return WSGIRequest({**environ, **meta})

    ended = unframed(
        b"amount=10", HTTP_TRANSFER_ENCODING="chunked", **{"wsgi.input_terminated": True}
    )
    assert ended.POST == {}  # as CSRF's check reads a form before the view: the empty body
    assert _body(ended, 100) == b"amount=10"
    assert (ended.body, ended.read(), ended.POST["amount"]) == (b"amount=10", b"amount=10", "10")
    assert ended.META["CONTENT_LENGTH"] == "9"
    assert _body(ended, 100) == b"amount=10"  # a second door reads the same body

    big = unframed(b"x" * 1000, **{"wsgi.input_terminated": True})
    with pytest.raises(BodyTooLarge):
        _body(big, 100)
    assert big.META["wsgi.input"].tell() == 101  # read one byte past the cap, no further

    with pytest.raises(LengthRequired):
        _body(unframed(b"amount=10", HTTP_TRANSFER_ENCODING="chunked"), 100)
    assert _body(unframed(b""), 100) == b""


def test_django_under_asgi_refuses_a_body_over_data_upload_max_memory_size_with_a_413() -> None:
    """Under ASGI a body without its length is Django's to read (``request.body``): over
    ``DATA_UPLOAD_MAX_MEMORY_SIZE`` Django raises ``RequestDataTooBig`` (its HTML 400); the
    doors answer it as any body over their cap, which that setting lowers: the 413
    body-too-large problem, nothing claimed. A body within it is read whole."""
    pytest.importorskip("django")
    import io

    from django.core.handlers.asgi import ASGIRequest
    from django.test import override_settings

    import tests.integrations.django_setup  # noqa: F401 -- settings
    from idemflow import BodyTooLarge
    from idemflow.integrations.django.views import _body, _body_limit

    def unframed(body: bytes) -> ASGIRequest:
        scope = {"type": "http", "method": "POST", "path": "/payments", "headers": []}
        return ASGIRequest(scope, io.BytesIO(body))

    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=100):
        assert _body_limit(4096) == 100
        with pytest.raises(BodyTooLarge, match="100 bytes"):
            _body(unframed(b"x" * 500), _body_limit(4096))
        assert _body(unframed(b"x" * 100), _body_limit(4096)) == b"x" * 100
    with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=None):
        assert _body_limit(4096) == 4096
