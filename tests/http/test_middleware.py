"""
Middleware mode (``IdempotencyMiddleware``, pure ASGI) on a small Starlette app of its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from idemflow import AsyncIdempotency, ConfigurationError, Policy, Record
from idemflow.integrations.starlette import EdgeOptions, IdempotencyMiddleware, RequestIdMiddleware
from idemflow.stores.sqlite import AsyncSQLiteStore
from tests.factories import until
from tests.http.conftest import STARTUP_SECONDS, assert_problem, new_key, serve
from tests.http.rawhttp import (
    ErrorLog,
    Finished,
    capture_errors,
    post_chunks,
    post_declaring,
    send_partial,
)

pytestmark = pytest.mark.timeout(60)

LIMIT = 4096
BODY_LIMIT = 65_536
BINARY = bytes(range(256)) * 8  # every byte value, 2 KiB
BAD_LOCATION = "/items/9\r\nx-injected: 1"


@pytest.fixture
def errors() -> Iterator[ErrorLog]:
    """Server-side errors logged during the test (uvicorn's tracebacks included)."""
    with capture_errors() as handler:
        yield handler


class HeaderAuth(AuthenticationBackend):
    """``X-User: name`` authenticates as ``name`` (tests only)."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        user = conn.headers.get("x-user")
        return None if user is None else (AuthCredentials(["authenticated"]), SimpleUser(user))


def make_app(store: AsyncSQLiteStore, calls: collections.Counter[str]) -> Finished:
    async def create_item(request: Request) -> Response:
        calls["items"] += 1
        await asyncio.sleep(float(request.query_params.get("sleep", "0")))
        headers = {
            "Location": "/items/1",
            "ETag": '"v1"',
            "Link": "</items>; rel=collection",
            "Set-Cookie": "session=secret",
            "X-RateLimit-Remaining": "41",
        }
        return JSONResponse({"n": calls["items"]}, status_code=201, headers=headers)

    async def replace_item(request: Request) -> Response:
        calls["put"] += 1
        return JSONResponse({"put": True})

    async def binary(request: Request) -> Response:
        calls["binary"] += 1
        return Response(BINARY, media_type="application/octet-stream")

    async def big(request: Request) -> Response:
        calls["big"] += 1
        return Response(b"x" * (LIMIT + 1), media_type="text/plain")

    async def bad_location(request: Request) -> Response:
        calls["bad_location"] += 1
        return JSONResponse({"n": 1}, status_code=201, headers={"Location": BAD_LOCATION})

    async def stream(request: Request) -> Response:
        calls["stream"] += 1

        async def chunks() -> AsyncIterator[bytes]:
            yield b"one"
            yield b"two"

        return StreamingResponse(chunks(), media_type="text/plain")

    async def big_stream(request: Request) -> Response:
        calls["big_stream"] += 1

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"z" * LIMIT
            calls["big_stream_ended"] += 1  # only if no send raised into the app

        return StreamingResponse(chunks(), media_type="text/plain")

    async def flaky(request: Request) -> Response:
        calls["flaky"] += 1
        return JSONResponse({"n": calls["flaky"]}, status_code=503 if calls["flaky"] == 1 else 201)

    async def note(request: Request) -> Response:
        calls["notes"] += 1
        return JSONResponse({"order": request.path_params["id"]}, status_code=201)

    async def unprotected(request: Request) -> Response:
        calls["unprotected"] += 1
        return JSONResponse({"n": calls["unprotected"]})

    def may_replay(record: Record) -> bool:
        return record.principal != "revoked"

    idempotency = AsyncIdempotency(store, Policy(request_timeout=10))
    endpoints = [
        "POST /items",
        "PUT /items",
        "POST /binary",
        "POST /big",
        "POST /stream",
        "POST /flaky",
        "POST /orders/{id}/notes",
        "POST /bad-location",
        "POST /big-stream",
    ]
    options = EdgeOptions(
        max_response_bytes=LIMIT, max_body_bytes=BODY_LIMIT, authorize_replay=may_replay
    )
    app = Starlette(
        routes=[
            Route("/items", create_item, methods=["POST"]),
            Route("/items", replace_item, methods=["PUT"]),
            Route("/binary", binary, methods=["POST"]),
            Route("/big", big, methods=["POST"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/flaky", flaky, methods=["POST"]),
            Route("/orders/{id}/notes", note, methods=["POST"]),
            Route("/bad-location", bad_location, methods=["POST"]),
            Route("/big-stream", big_stream, methods=["POST"]),
            Route("/unprotected", unprotected, methods=["POST", "GET"]),
        ],
        middleware=[
            Middleware(RequestIdMiddleware),
            Middleware(AuthenticationMiddleware, backend=HeaderAuth()),
            Middleware(
                IdempotencyMiddleware, idempotency=idempotency, endpoints=endpoints, options=options
            ),
        ],
    )
    return Finished(app)


class Server:
    def __init__(
        self, url: str, store: AsyncSQLiteStore, calls: collections.Counter[str], app: Finished
    ) -> None:
        self.url, self.store, self.calls, self.finished = url, store, calls, app

    def client(self, user: str = "carol", key: str | None = None) -> httpx.Client:
        headers = {"X-User": user}
        if key is not None:
            headers["Idempotency-Key"] = key
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def record(self, principal: str, key: str) -> Record | None:
        return self.store.sync.get(principal, key)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    store = AsyncSQLiteStore(tmp_path_factory.mktemp("mw") / "keys.db")
    store.sync.migrate()
    calls: collections.Counter[str] = collections.Counter()
    app = make_app(store, calls)
    with serve(app) as url:
        yield Server(url, store, calls, app)


def test_the_first_request_runs_and_a_retry_replays_without_running_again(server: Server) -> None:
    key = new_key()
    with server.client(key=key) as client:
        first = client.post("/items", json={"a": 1})
        before = server.calls["items"]
        again = client.post("/items", json={"a": 1})
    assert first.status_code == 201
    assert again.status_code == 201
    assert server.calls["items"] == before
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotency-original-request-id"] == first.headers["x-request-id"]


def test_a_replay_carries_allow_listed_headers_but_never_set_cookie_or_rate_limits(
    server: Server,
) -> None:
    key = new_key()
    with server.client(key=key) as client:
        first = client.post("/items", json={})
        again = client.post("/items", json={})
    assert first.headers["set-cookie"] == "session=secret"  # the first answer is untouched
    for name in ("location", "etag", "link", "content-type"):
        assert again.headers[name] == first.headers[name]
    assert "set-cookie" not in again.headers
    assert "x-ratelimit-remaining" not in again.headers
    record = server.record("carol", key)
    assert record is not None
    assert record.response is not None
    stored = {name for name, _ in record.response.headers}
    assert stored == {"content-type", "location", "etag", "link"}


def test_the_same_key_with_another_method_body_or_path_parameter_is_422(server: Server) -> None:
    key = new_key()
    with server.client(key=key) as client:
        assert client.post("/items", json={"a": 1}).status_code == 201
        assert_problem(client.put("/items", json={"a": 1}), 422, "key-reused")
        assert_problem(client.post("/items", json={"a": 2}), 422, "key-reused")
    key = new_key()
    with server.client(key=key) as client:
        assert client.post("/orders/1/notes", json={}).json() == {"order": "1"}
        assert_problem(client.post("/orders/2/notes", json={}), 422, "key-reused")
    record = server.record("carol", key)
    assert record is not None
    assert record.endpoint == "POST /orders/{id}/notes"


def test_a_request_while_the_first_runs_gets_409_with_retry_after(server: Server) -> None:
    key = new_key()

    async def race() -> tuple[httpx.Response, httpx.Response]:
        headers = {"X-User": "carol", "Idempotency-Key": key}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as client:
            slow = asyncio.create_task(client.post("/items?sleep=0.5", json={}))
            await until(lambda: server.record("carol", key) is not None, "claimed", blocking=True)
            conflict = await client.post("/items?sleep=0.5", json={})
            return await slow, conflict

    first, conflict = asyncio.run(race())
    assert first.status_code == 201
    assert_problem(conflict, 409, "in-progress")
    assert conflict.headers["retry-after"] == "1"


def test_binary_bodies_are_stored_and_replayed_byte_for_byte(server: Server) -> None:
    with server.client(key=new_key()) as client:
        first = client.post("/binary", content=b"\x00\xff")
        again = client.post("/binary", content=b"\x00\xff")
    assert first.content == BINARY
    assert again.content == BINARY
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"] == "application/octet-stream"


def test_a_response_over_the_stored_body_limit_settles_a_marker_and_never_runs_again(
    server: Server,
) -> None:
    """Issue 9, defect 8: the effect happened; releasing would run it once more per retry."""
    key = new_key()
    before = server.calls["big"]
    with server.client(key=key) as client:
        first = client.post("/big")
        again = client.post("/big")
    body = assert_problem(first, 500, "response-not-stored")
    assert str(LIMIT) in body["detail"]
    assert body["original_status"] == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert assert_problem(again, 500, "response-not-stored") == body
    assert server.calls["big"] == before + 1  # never released: the retry did not run it
    record = server.record("carol", key)
    assert record is not None
    assert record.state == "completed"


def test_a_stream_over_the_limit_runs_to_its_end_and_settles_a_marker(server: Server) -> None:
    """Issue 9, defect 8: the buffer used to raise into the app mid-stream, then release."""
    key = new_key()
    before = server.calls["big_stream"], server.calls["big_stream_ended"]
    with server.client(key=key) as client:
        first = client.post("/big-stream")
        again = client.post("/big-stream")
    body = assert_problem(first, 500, "response-not-stored")
    assert str(3 * LIMIT) in body["detail"]
    assert again.headers["idempotent-replayed"] == "true"
    assert (server.calls["big_stream"], server.calls["big_stream_ended"]) == (
        before[0] + 1,
        before[1] + 1,
    )
    record = server.record("carol", key)
    assert record is not None
    assert record.state == "completed"


def test_a_header_that_cannot_be_sent_is_never_stored_and_never_run_again(
    server: Server,
) -> None:
    """Issue 9, defect 8: a Location with CR/LF used to be stored, then fail every answer."""
    key = new_key()
    before = server.calls["bad_location"]
    with server.client(key=key) as client:
        first = client.post("/bad-location", json={})
        again = client.post("/bad-location", json={})
    body = assert_problem(first, 500, "response-not-stored")
    assert (body["original_status"], body["location"]) == (201, BAD_LOCATION)
    assert "location" in body["detail"]
    assert assert_problem(again, 500, "response-not-stored") == body
    assert again.headers["idempotent-replayed"] == "true"
    assert server.calls["bad_location"] == before + 1
    record = server.record("carol", key)
    assert record is not None
    assert record.state == "completed"
    assert record.response is not None
    assert all("\r" not in v and "\n" not in v for _, v in record.response.headers)


def test_a_response_streamed_in_several_messages_is_stored_whole_and_replayed(
    server: Server,
) -> None:
    """The app runs to its end; a streamed body that fits the limit is a body like any other."""
    before = server.calls["stream"]
    with server.client(key=new_key()) as client:
        first = client.post("/stream")
        again = client.post("/stream")
    assert first.status_code == again.status_code == 200
    assert first.content == again.content == b"onetwo"
    assert again.headers["idempotent-replayed"] == "true"
    assert server.calls["stream"] == before + 1


def test_a_body_cut_short_by_a_disconnect_is_never_run_or_recorded(
    server: Server, errors: ErrorLog
) -> None:
    """Issue 9, defect 4: 9 of 22 declared bytes, then a hang-up, used to run and record."""
    key, test_id = new_key(), uuid.uuid4().hex
    # Not declared JSON: a cut JSON body would fail the fingerprint's parser by luck.
    body = b"amount=1000&note=whole"
    headers = {"X-User": "carol", "Idempotency-Key": key, "X-Test-Id": test_id}
    before = server.calls["items"]
    send_partial(server.url, "/items", headers, declared=len(body), sent=body[:9])
    assert server.finished.wait(test_id)
    assert server.calls["items"] == before
    assert server.record("carol", key) is None
    with server.client(key=key) as client:
        retry = client.post("/items", content=body)
    assert retry.status_code == 201
    assert server.calls["items"] == before + 1
    assert errors.texts() == []


def test_a_body_over_the_cap_is_refused_with_413_before_it_is_read(server: Server) -> None:
    """Issue 9, defect 12: a Content-Length over the cap is answered at once, unread."""
    key = new_key()
    headers = {"X-User": "carol", "Idempotency-Key": key, "Content-Type": "application/json"}
    before = server.calls["items"]
    response = post_declaring(server.url, "/items", headers, length=100_000_000)
    assert response.status == 413
    problem = response.json()
    assert problem["type"].endswith("/body-too-large")
    assert str(BODY_LIMIT) in problem["detail"]
    assert server.calls["items"] == before
    assert server.record("carol", key) is None


def test_a_streamed_body_over_the_cap_is_refused_while_it_streams(server: Server) -> None:
    """Issue 9, defect 12: no Content-Length; refused once the bytes read pass the cap."""
    key = new_key()
    headers = {"X-User": "carol", "Idempotency-Key": key}
    chunks = [b"x" * 16_384] * (BODY_LIMIT // 16_384 + 1)
    before = server.calls["items"]
    # The body is never finished: the answer can only come while it streams.
    response = post_chunks(server.url, "/items", headers, chunks, finish=False)
    assert response.status == 413
    assert response.json()["type"].endswith("/body-too-large")
    assert server.calls["items"] == before
    assert server.record("carol", key) is None


def test_the_query_string_is_part_of_the_request(server: Server) -> None:
    """Issue 9, defect 9: ?x=1 and ?x=2 under one key used to replay each other."""
    key = new_key()
    with server.client(key=key) as client:
        first = client.post("/items?x=1&y=a", json={})
        reordered = client.post("/items?y=a&x=%31", json={})  # the same query, spelled otherwise
        other = client.post("/items?x=2&y=a", json={})
    assert first.status_code == 201
    assert reordered.headers["idempotent-replayed"] == "true"
    assert_problem(other, 422, "key-reused")


def test_a_transient_5xx_is_not_stored_and_the_retry_really_runs(server: Server) -> None:
    key = new_key()
    with server.client(key=key) as client:
        first = client.post("/flaky")
        retry = client.post("/flaky")
        replay = client.post("/flaky")
    assert first.status_code == 503
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"


def test_without_an_authenticated_principal_the_key_is_not_claimed(server: Server) -> None:
    key = new_key()
    with httpx.Client(base_url=server.url, headers={"Idempotency-Key": key}) as client:
        assert_problem(client.post("/items", json={}), 401, "missing-principal")
    assert server.record("", key) is None
    assert server.record("anonymous", key) is None


def test_replay_asks_the_authorization_hook_again(server: Server) -> None:
    with server.client(user="revoked", key=new_key()) as client:
        assert client.post("/items", json={}).status_code == 201
        assert_problem(client.post("/items", json={}), 403, "replay-forbidden")


def test_safe_methods_and_endpoints_not_opted_in_ignore_the_header(server: Server) -> None:
    with server.client(key="bad,key") as client:
        assert client.get("/unprotected").status_code == 200
        before = server.calls["unprotected"]
        assert client.post("/unprotected").status_code == 200
        assert client.post("/unprotected").status_code == 200
    assert server.calls["unprotected"] == before + 2


def test_a_missing_or_malformed_key_is_400_before_anything_runs(server: Server) -> None:
    before = server.calls["items"]
    with server.client() as client:
        assert_problem(client.post("/items", json={}), 400, "missing-key")
    with server.client(key='"unterminated') as client:
        assert_problem(client.post("/items", json={}), 400, "invalid-key")
    assert server.calls["items"] == before


def test_an_unreachable_store_is_503_with_retry_after_and_the_endpoint_does_not_run(
    tmp_path: Path,
) -> None:
    store = AsyncSQLiteStore(tmp_path / "gone" / "keys.db")  # its directory does not exist
    calls: collections.Counter[str] = collections.Counter()
    with serve(make_app(store, calls)) as url, httpx.Client(base_url=url) as client:
        response = client.post(
            "/items", json={}, headers={"X-User": "carol", "Idempotency-Key": new_key()}
        )
    assert_problem(response, 503, "store-unavailable")
    assert response.headers["retry-after"] == "1"
    assert calls["items"] == 0


def regional_app(store: AsyncSQLiteStore, calls: collections.Counter[str]) -> Starlette:
    """One payments route mounted twice, a middleware in each mount."""

    async def create(request: Request) -> Response:
        calls[request.scope["root_path"]] += 1
        return JSONResponse({"region": request.scope["root_path"]}, status_code=201)

    idempotency = AsyncIdempotency(store, Policy(request_timeout=10))
    inner = [
        Middleware(IdempotencyMiddleware, idempotency=idempotency, endpoints=["POST /payments"])
    ]
    routes = [Route("/payments", create, methods=["POST"])]
    return Starlette(
        routes=[
            Mount("/eu", routes=routes, middleware=inner),
            Mount("/us", routes=routes, middleware=inner),
        ],
        middleware=[Middleware(AuthenticationMiddleware, backend=HeaderAuth())],
    )


def test_mounted_routes_are_different_endpoints(tmp_path: Path) -> None:
    """Issue 9, defect 9: a key used on /eu/payments is not a request for /us/payments."""
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    store.sync.migrate()
    calls: collections.Counter[str] = collections.Counter()
    key = new_key()
    headers = {"X-User": "carol", "Idempotency-Key": key}
    with serve(regional_app(store, calls)) as url, httpx.Client(base_url=url) as client:
        eu = client.post("/eu/payments", json={}, headers=headers)
        again = client.post("/eu/payments", json={}, headers=headers)
        us = client.post("/us/payments", json={}, headers=headers)
    assert eu.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert_problem(us, 422, "key-reused")
    assert calls == {"/eu": 1}
    record = store.sync.get("carol", key)
    assert record is not None
    assert record.endpoint == "POST /eu/payments"


@contextlib.contextmanager
def serve_behind_proxy(app: Any, root_path: str) -> Iterator[str]:
    """Like ``serve``, with uvicorn's ``--root-path`` (a proxy that strips ``root_path``)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, root_path=root_path, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            assert time.monotonic() < deadline, "uvicorn did not start in time"
            time.sleep(0.02)  # polling uvicorn's own flag, with a deadline
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(STARTUP_SECONDS)
        sock.close()


def test_behind_a_proxy_root_path_the_routes_are_still_protected(tmp_path: Path) -> None:
    """The ASGI path includes the proxy's root_path; it used to hide every opted-in route."""
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    store.sync.migrate()
    calls: collections.Counter[str] = collections.Counter()

    async def create(request: Request) -> Response:
        calls["items"] += 1
        return JSONResponse({}, status_code=201)

    app = protected([Route("/items", create, methods=["POST"])], "POST /items", tmp_path)
    headers = {"X-User": "carol", "Idempotency-Key": new_key()}
    with serve_behind_proxy(app, "/api") as url, httpx.Client(base_url=url) as client:
        first = client.post("/items", headers=headers)
        again = client.post("/items", headers=headers)
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert calls["items"] == 1
    record = store.sync.get("carol", headers["Idempotency-Key"])
    assert record is not None
    assert record.endpoint == "POST /items"  # the proxy's prefix is not part of the route


def startup_messages(app: Any) -> list[str]:
    """Run ``app`` under uvicorn (default lifespan mode) and return why its startup failed."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    handler = ErrorLog()
    logging.getLogger("uvicorn.error").addHandler(handler)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    exits: list[object] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except SystemExit as exc:  # uvicorn exits with 3 when the startup failed
            exits.append(exc.code)

    try:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(STARTUP_SECONDS)
        if thread.is_alive():
            server.should_exit = True
            thread.join(STARTUP_SECONDS)
            pytest.fail("the server started: the streaming route was not refused")
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
        sock.close()
    assert not server.started
    assert exits == [3]
    return handler.texts()


def protected(routes: list[Any], endpoint: str, tmp_path: Path) -> Starlette:
    """``routes`` with ``endpoint`` protected, keys in ``tmp_path/keys.db``."""
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    idempotency = AsyncIdempotency(store, Policy(request_timeout=10))
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(AuthenticationMiddleware, backend=HeaderAuth()),
            Middleware(IdempotencyMiddleware, idempotency=idempotency, endpoints=[endpoint]),
        ],
    )


async def _chunks() -> AsyncIterator[bytes]:
    yield b"a"


async def declared_stream(request: Request) -> StreamingResponse:
    return StreamingResponse(_chunks())


def test_a_protected_route_declared_to_stream_is_refused_at_startup(tmp_path: Path) -> None:
    """Issue 9, defect 8: what the route already tells is refused before any request."""
    app = protected(
        [Mount("/v1", routes=[Route("/exports", declared_stream, methods=["POST"])])],
        "POST /v1/exports",
        tmp_path,
    )
    messages = startup_messages(app)
    assert any("POST /v1/exports" in m and "StreamingResponse" in m for m in messages), messages


@pytest.mark.parametrize("kind", ["response_class", "generator"])
def test_a_fastapi_route_declared_to_stream_is_refused_at_startup(
    tmp_path: Path, kind: str
) -> None:
    pytest.importorskip("fastapi")
    from fastapi import FastAPI

    api = FastAPI()
    if kind == "response_class":

        @api.post("/exports", response_class=StreamingResponse)
        async def export() -> Any:
            return StreamingResponse(_chunks())

    else:

        @api.post("/exports")
        async def export_lines() -> AsyncIterator[dict[str, int]]:
            yield {"line": 1}

    store = AsyncSQLiteStore(tmp_path / "keys.db")
    idempotency = AsyncIdempotency(store, Policy(request_timeout=10))
    api.add_middleware(IdempotencyMiddleware, idempotency=idempotency, endpoints=["POST /exports"])
    api.add_middleware(AuthenticationMiddleware, backend=HeaderAuth())
    messages = startup_messages(api)
    assert any("POST /exports" in m for m in messages), messages


def test_the_middleware_refuses_to_run_without_authentication_before_it(tmp_path: Path) -> None:
    store = AsyncSQLiteStore(tmp_path / "keys.db")
    store.sync.migrate()
    idempotency = AsyncIdempotency(store)

    async def endpoint(request: Request) -> Response:
        return JSONResponse({})

    app = Starlette(
        routes=[Route("/x", endpoint, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, idempotency=idempotency, endpoints=["POST /x"])
        ],
    )
    with serve(app) as url, httpx.Client(base_url=url) as client:
        response = client.post("/x", headers={"Idempotency-Key": new_key()})
    body = assert_problem(response, 500)
    assert "AuthenticationMiddleware" in body["detail"]
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app, idempotency=idempotency, endpoints=[])
