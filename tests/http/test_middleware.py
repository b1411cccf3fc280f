"""
Middleware mode (``IdempotencyMiddleware``, pure ASGI) on a small Starlette app of its own.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from idemflow import AsyncIdempotency, ConfigurationError, Policy, Record
from idemflow.integrations.starlette import EdgeOptions, IdempotencyMiddleware, RequestIdMiddleware
from idemflow.stores.sqlite import AsyncSQLiteStore
from tests.http.conftest import assert_problem, new_key, serve

pytestmark = pytest.mark.timeout(60)

LIMIT = 4096
BINARY = bytes(range(256)) * 8  # every byte value, 2 KiB


class HeaderAuth(AuthenticationBackend):
    """``X-User: name`` authenticates as ``name`` (tests only)."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        user = conn.headers.get("x-user")
        return None if user is None else (AuthCredentials(["authenticated"]), SimpleUser(user))


def make_app(store: AsyncSQLiteStore, calls: collections.Counter[str]) -> Starlette:
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

    async def stream(request: Request) -> Response:
        calls["stream"] += 1

        async def chunks() -> AsyncIterator[bytes]:
            yield b"one"
            yield b"two"

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
    ]
    options = EdgeOptions(max_response_bytes=LIMIT, authorize_replay=may_replay)
    return Starlette(
        routes=[
            Route("/items", create_item, methods=["POST"]),
            Route("/items", replace_item, methods=["PUT"]),
            Route("/binary", binary, methods=["POST"]),
            Route("/big", big, methods=["POST"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/flaky", flaky, methods=["POST"]),
            Route("/orders/{id}/notes", note, methods=["POST"]),
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


class Server:
    def __init__(self, url: str, store: AsyncSQLiteStore, calls: collections.Counter[str]) -> None:
        self.url, self.store, self.calls = url, store, calls

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
    with serve(make_app(store, calls)) as url:
        yield Server(url, store, calls)


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
            await asyncio.sleep(0.2)
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


def test_a_response_over_the_stored_body_limit_is_refused_not_replayed_empty(
    server: Server,
) -> None:
    key = new_key()
    with server.client(key=key) as client:
        first = client.post("/big")
        before = server.calls["big"]
        again = client.post("/big")
    body = assert_problem(first, 500, "response-not-storable")
    assert str(LIMIT) in body["detail"]
    assert_problem(again, 500, "response-not-storable")
    assert server.calls["big"] == before + 1  # released: the retry ran again
    record = server.record("carol", key)
    assert record is not None
    assert record.state == "released"


def test_a_streaming_response_is_refused_with_an_explicit_error(server: Server) -> None:
    with server.client(key=new_key()) as client:
        body = assert_problem(client.post("/stream"), 500, "response-not-storable")
    assert "stream" in body["detail"]


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
