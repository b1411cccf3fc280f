"""
FastAPI with ``IdempotentRoute``: the endpoint runs whole inside the claim and
keeps its ``response_model``; the OpenAPI document describes the key, the
problems and the replay header (and is valid OpenAPI); configuration mistakes
fail when the route is declared. Through uvicorn on 127.0.0.1, over PostgreSQL.
"""

# No ``from __future__ import annotations``: FastAPI must see the local ``Idem`` alias.

import asyncio
import collections
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import httpx
import pytest

pytest.importorskip("fastapi")
psycopg = pytest.importorskip("psycopg")
psycopg_pool = pytest.importorskip("psycopg_pool")
openapi_spec_validator = pytest.importorskip("openapi_spec_validator")

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException  # noqa: E402
from fastapi import Response as FastAPIResponse  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402

import idemflow  # noqa: E402
from idemflow import AsyncAttempt, AsyncIdempotency, ConfigurationError, Event, Policy  # noqa: E402
from idemflow._events import CountingObserver  # noqa: E402
from idemflow.integrations.fastapi import (  # noqa: E402
    IdempotentRequest,
    IdempotentRoute,
    dependency,
)
from idemflow.integrations.starlette import (  # noqa: E402
    EdgeOptions,
    Idempotent,
    RequestIdMiddleware,
)
from idemflow.stores.postgres import AsyncPostgresStore, PostgresStore  # noqa: E402
from idemflow.transactions import AsyncPsycopgTransaction  # noqa: E402
from tests.conftest import POSTGRES_URL, unreachable  # noqa: E402
from tests.http.conftest import assert_problem, new_key, serve  # noqa: E402
from tests.http.rawhttp import (  # noqa: E402
    ErrorLog,
    capture_errors,
    post_chunks,
    post_declaring,
    send_partial,
)

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(90)]

BODY_LIMIT = 65_536
DEADLINE = 20.0


class OrderIn(BaseModel):
    item: str
    quantity: int


class OrderOut(BaseModel):
    id: int
    item: str
    quantity: int


def current_user(authorization: Annotated[str | None, Header()] = None) -> str | None:
    """Auth runs first: a wrong scheme is a 401 of its own; no header yields no principal."""
    if authorization is None:
        return None
    if not authorization.startswith("Bearer "):
        raise HTTPException(401, "bad token")
    return authorization.removeprefix("Bearer ")


class Harness:
    """The app's knobs and counters, shared with the test (uvicorn runs in this process)."""

    def __init__(self, table: str) -> None:
        self.table = table
        #: The schema of the default key table, for the pool-shorthand route (/notes).
        self.schema = f"fa_{table}"
        self.calls: collections.Counter[str] = collections.Counter()
        self.gate = threading.Event()
        self.url = ""
        #: What the pool shorthand's driver counted (its observer=).
        self.notes_counted = CountingObserver()

    def rows(self, item: str) -> int:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            sql = f"SELECT count(*) FROM orders_{self.table} WHERE item = %s"
            return int(conn.execute(sql, (item,)).fetchone()[0])

    def state(self, key: str, principal: str = "dana") -> Any:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            sql = f"SELECT state FROM {self.table} WHERE idempotency_key = %s AND principal = %s"
            row = conn.execute(sql, (key, principal)).fetchone()
            return None if row is None else row[0]

    def schema_url(self) -> str:
        separator = "&" if "?" in POSTGRES_URL else "?"
        return f"{POSTGRES_URL}{separator}options=-csearch_path%3D{self.schema},public"

    def note_state(self, key: str) -> Any:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            sql = f"SELECT state FROM {self.schema}.idemflow_keys WHERE idempotency_key = %s"
            row = conn.execute(sql, (key,)).fetchone()
            return None if row is None else row[0]

    def endpoint_of(self, key: str) -> Any:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            sql = f"SELECT endpoint FROM {self.table} WHERE idempotency_key = %s"
            row = conn.execute(sql, (key,)).fetchone()
            return None if row is None else row[0]

    def client(self, key: str | None = None, user: str | None = "dana") -> httpx.Client:
        headers = {}
        if user is not None:
            headers["Authorization"] = f"Bearer {user}"
        if key is not None:
            headers["Idempotency-Key"] = key
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)


def make_app(harness: Harness) -> FastAPI:
    table = harness.table
    pool = psycopg_pool.AsyncConnectionPool(
        POSTGRES_URL, min_size=1, max_size=4, kwargs={"autocommit": True}, open=False, timeout=10
    )
    idempotent = Idempotent(
        AsyncIdempotency(AsyncPostgresStore(pool, table=table), Policy(request_timeout=10)),
        connect=pool.connection,
        transaction=AsyncPsycopgTransaction,
        options=EdgeOptions(max_body_bytes=BODY_LIMIT),
    )
    Idem = Annotated[IdempotentRequest, Depends(dependency(idempotent, principal=current_user))]
    public = Idempotent(
        idempotent.edge.idempotency,
        connect=pool.connection,
        transaction=AsyncPsycopgTransaction,
        options=EdgeOptions(public=True),
    )
    PublicIdem = Annotated[IdempotentRequest, Depends(dependency(public))]
    # The shorthand: a pool is enough (keys in its database's idemflow_keys).
    notes_pool = psycopg_pool.AsyncConnectionPool(
        harness.schema_url(), min_size=1, max_size=2, kwargs={"autocommit": True}, open=False
    )
    maybe = dependency(
        notes_pool, principal=current_user, required=False, observer=harness.notes_counted
    )
    MaybeIdem = Annotated[IdempotentRequest, Depends(maybe)]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.open(wait=False)
        await notes_pool.open(wait=False)
        yield
        await notes_pool.close()
        await pool.close()

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(RequestIdMiddleware)
    router = APIRouter(route_class=IdempotentRoute)

    async def insert(idem: IdempotentRequest, order: OrderIn) -> int:
        cursor = await idem.connection.execute(
            f"INSERT INTO orders_{table} (item, quantity) VALUES (%s, %s) RETURNING id",
            (order.item, order.quantity),
        )
        row = await cursor.fetchone()
        return int(row[0])

    @router.post("/orders", status_code=201, response_model=OrderOut)
    async def create_order(
        order: OrderIn,
        idem: Idem,
        response: FastAPIResponse,
        x_provider: Annotated[str, Header()] = "up",
    ) -> Any:
        """Create an order (the docstring is the operation's description)."""
        harness.calls["orders"] += 1
        order_id = await insert(idem, order)
        if x_provider == "down":  # a transient answer: the insert rolls back with the release
            return JSONResponse({"title": "provider down"}, status_code=503)
        if x_provider == "slow":
            await asyncio.to_thread(harness.gate.wait, DEADLINE)
        if x_provider == "invalid":  # does not validate against response_model
            return {"id": "not a number", "item": order.item, "quantity": order.quantity}
        if x_provider == "accepted":  # a Response parameter's status applies, as in FastAPI
            response.status_code = 202
        if x_provider == "bad-header":  # CR/LF: this response can never be sent
            response.headers["location"] = f"/orders/{order_id}\r\nx-injected: 1"
        else:
            response.headers["location"] = f"/orders/{order_id}"
        response.set_cookie("seen", "1")
        # response_model drops what it does not declare.
        return {"id": order_id, "item": order.item, "quantity": order.quantity, "secret": "x"}

    @router.post("/notes", status_code=201)
    async def create_note(order: OrderIn, idem: MaybeIdem) -> OrderOut:
        harness.calls["notes"] += 1
        return OrderOut(id=await insert(idem, order), item=order.item, quantity=order.quantity)

    @router.post("/signups", status_code=201)
    async def sign_up(order: OrderIn, idem: PublicIdem) -> OrderOut:
        return OrderOut(id=await insert(idem, order), item=order.item, quantity=order.quantity)

    @router.post("/legacy")
    async def legacy(idem: Idem) -> Any:
        """The earlier form: a handler returning idemflow's Response, under the route class."""

        async def handler(attempt: AsyncAttempt) -> idemflow.Response:
            harness.calls["legacy"] += 1
            return idemflow.Response.json(201, {"legacy": True})

        return await idem.run(handler)

    @router.get("/orders")
    async def list_orders() -> dict[str, int]:
        return {"orders": harness.calls["orders"]}

    app.include_router(router)
    app.include_router(router, prefix="/v2")
    return app


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    table = f"idem_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(
                f"CREATE TABLE orders_{table} (id BIGSERIAL PRIMARY KEY, item TEXT, quantity INT)"
            )
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    store = PostgresStore(POSTGRES_URL, table=table, max_size=1)
    store.migrate()
    store.close()
    running = Harness(table)
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {running.schema}")
    notes = PostgresStore(running.schema_url(), max_size=1)
    notes.migrate()
    notes.close()
    try:
        with serve(make_app(running)) as url:
            running.url = url
            yield running
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"DROP TABLE IF EXISTS {table}, orders_{table}")
            conn.execute(f"DROP SCHEMA IF EXISTS {running.schema} CASCADE")


@pytest.fixture
def errors() -> Iterator[ErrorLog]:
    with capture_errors() as handler:
        yield handler


def order() -> dict[str, Any]:
    return {"item": f"item-{uuid.uuid4().hex}", "quantity": 2}


def wait_for_state(harness: Harness, key: str, state: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while harness.state(key) != state:
        assert time.monotonic() < deadline, f"the key never became {state}"
        time.sleep(0.01)  # polling the key table, with a deadline


# --- the rules, with response_model -----------------------------------------------------------


def test_the_endpoint_runs_once_with_its_response_model_and_a_retry_is_a_byte_identical_replay(
    harness: Harness,
) -> None:
    key, body = new_key(), order()
    with harness.client(key) as client:
        first = client.post("/orders", json=body)
        again = client.post("/orders", json=body)
    assert first.status_code == 201
    assert set(first.json()) == {"id", "item", "quantity"}  # response_model applied: no "secret"
    assert first.headers["location"] == f"/orders/{first.json()['id']}"
    assert "seen=1" in first.headers["set-cookie"]
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotency-original-request-id"] == first.headers["x-request-id"]
    assert again.headers["location"] == first.headers["location"]
    assert "set-cookie" not in again.headers
    assert harness.rows(body["item"]) == 1
    assert harness.state(key) == "completed"


def test_the_same_key_for_another_body_is_422(harness: Harness) -> None:
    key, body = new_key(), order()
    with harness.client(key) as client:
        assert client.post("/orders", json=body).status_code == 201
        assert_problem(client.post("/orders", json={**body, "quantity": 3}), 422, "key-reused")
    assert harness.rows(body["item"]) == 1


def test_a_router_included_twice_is_two_endpoints(harness: Harness) -> None:
    """FastAPI 0.120+ hands the original route to the scope: the prefix used to be lost."""
    key, body = new_key(), order()
    with harness.client(key) as client:
        first = client.post("/v2/orders", json=body)
        other = client.post("/orders", json=body)
    assert first.status_code == 201
    assert_problem(other, 422, "key-reused")
    assert harness.endpoint_of(key) == "POST /v2/orders"


def test_a_duplicate_while_the_first_runs_is_409_with_retry_after(harness: Harness) -> None:
    key, body = new_key(), order()
    harness.gate.clear()
    answers: list[httpx.Response] = []

    def first() -> None:
        with harness.client(key) as client:
            answers.append(client.post("/orders", json=body, headers={"X-Provider": "slow"}))

    runner = threading.Thread(target=first)
    runner.start()
    try:
        wait_for_state(harness, key, "in_progress")
        with harness.client(key) as client:
            conflict = client.post("/orders", json=body)
    finally:
        harness.gate.set()
        runner.join(DEADLINE)
    assert_problem(conflict, 409, "in-progress")
    assert int(conflict.headers["retry-after"]) >= 1
    assert [a.status_code for a in answers] == [201]
    assert harness.rows(body["item"]) == 1


def test_fifty_parallel_identical_posts_write_one_row(harness: Harness) -> None:
    key, body = new_key(), order()
    barrier = threading.Barrier(50)
    limits = httpx.Limits(max_connections=50, max_keepalive_connections=50)
    headers = {"Authorization": "Bearer dana", "Idempotency-Key": key}
    with httpx.Client(base_url=harness.url, headers=headers, timeout=30, limits=limits) as client:

        def post(_: int) -> httpx.Response:
            barrier.wait(DEADLINE)
            return client.post("/orders", json=body)

        with ThreadPoolExecutor(50) as pool:
            answers = list(pool.map(post, range(50)))
    executed = [
        a for a in answers if a.status_code == 201 and "idempotent-replayed" not in a.headers
    ]
    assert len(executed) == 1
    assert {a.status_code for a in answers} <= {201, 409}
    assert harness.rows(body["item"]) == 1


def test_keys_are_scoped_to_the_principal(harness: Harness) -> None:
    key, body = new_key(), order()
    with harness.client(key, "dana") as dana, harness.client(key, "erin") as erin:
        first = dana.post("/orders", json=body)
        other = erin.post("/orders", json=body)
    assert first.status_code == other.status_code == 201
    assert "idempotent-replayed" not in other.headers
    assert harness.rows(body["item"]) == 2


def test_refusals_before_the_claim_are_never_recorded(harness: Harness) -> None:
    key, body = new_key(), order()
    before = harness.calls["orders"]
    with harness.client() as client:
        assert_problem(client.post("/orders", json=body), 400, "missing-key")
    with harness.client(key) as client:
        assert client.post("/orders", json={"item": "x"}).status_code == 422  # FastAPI's own
    with harness.client(key, user=None) as client:
        assert_problem(client.post("/orders", json=body), 401, "missing-principal")
        client.headers["Authorization"] = "Basic x"
        assert client.post("/orders", json=body).status_code == 401  # the auth dependency's
    assert harness.state(key) is None
    assert harness.calls["orders"] == before
    assert harness.rows(body["item"]) == 0


def test_a_content_length_over_the_cap_is_413_before_fastapi_reads_it(harness: Harness) -> None:
    key = new_key()
    headers = {
        "Authorization": "Bearer dana",
        "Idempotency-Key": key,
        "Content-Type": "application/json",
    }
    response = post_declaring(harness.url, "/orders", headers, length=100_000_000)
    assert response.status == 413
    assert response.headers["content-type"] == "application/problem+json"
    assert str(BODY_LIMIT) in response.json()["detail"]
    assert harness.state(key) is None


def test_a_chunked_body_over_the_cap_is_413_while_it_streams(harness: Harness) -> None:
    key = new_key()
    headers = {
        "Authorization": "Bearer dana",
        "Idempotency-Key": key,
        "Content-Type": "application/json",
    }
    chunks = [b" " * 16_384] * (BODY_LIMIT // 16_384 + 1)
    response = post_chunks(harness.url, "/orders", headers, chunks, finish=False)
    assert response.status == 413
    assert response.json()["type"].endswith("/body-too-large")
    assert harness.state(key) is None


def test_a_body_cut_short_is_never_validated_claimed_or_run(
    harness: Harness, errors: ErrorLog
) -> None:
    key, body = new_key(), order()
    raw = httpx.Request("POST", "/", json=body).content
    headers = {
        "Authorization": "Bearer dana",
        "Idempotency-Key": key,
        "Content-Type": "application/json",
    }
    before = harness.calls["orders"]
    send_partial(harness.url, "/orders", headers, declared=len(raw), sent=raw[:9])
    with harness.client(key) as client:  # the same connection order: the cut one was handled
        retry = client.post("/orders", json=body)
    assert retry.status_code == 201
    assert harness.calls["orders"] == before + 1
    assert harness.rows(body["item"]) == 1
    assert errors.texts() == []


def test_a_transient_answer_rolls_back_is_released_and_the_retry_really_runs(
    harness: Harness,
) -> None:
    key, body = new_key(), order()
    with harness.client(key) as client:
        down = client.post("/orders", json=body, headers={"X-Provider": "down"})
        state = harness.state(key)
        retry = client.post("/orders", json=body)
    assert down.status_code == 503
    assert state == "released"
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert harness.rows(body["item"]) == 1  # the 503's insert rolled back


def test_an_unsendable_header_is_refused_and_its_row_rolls_back(harness: Harness) -> None:
    """Transactional mode: the effect rolls back with the claim, so the key is released."""
    key, body = new_key(), order()
    with harness.client(key) as client:
        refused = client.post("/orders", json=body, headers={"X-Provider": "bad-header"})
    problem = assert_problem(refused, 500, "response-not-storable")
    assert "location" in problem["detail"]
    assert harness.rows(body["item"]) == 0
    assert harness.state(key) == "released"


def test_a_return_value_failing_its_response_model_rolls_back_and_releases(
    harness: Harness,
) -> None:
    key, body = new_key(), order()
    with harness.client(key) as client:
        failed = client.post("/orders", json=body, headers={"X-Provider": "invalid"})
    assert failed.status_code == 500
    assert harness.rows(body["item"]) == 0
    assert harness.state(key) == "released"


def test_a_response_parameters_status_is_stored_and_replayed(harness: Harness) -> None:
    key, body = new_key(), order()
    with harness.client(key) as client:
        first = client.post("/orders", json=body, headers={"X-Provider": "accepted"})
        again = client.post("/orders", json=body)
    assert first.status_code == again.status_code == 202
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"


def test_an_optional_key_runs_unprotected_without_one_and_protected_with_one(
    harness: Harness,
) -> None:
    body = order()
    with harness.client() as client:
        first = client.post("/notes", json=body)
        second = client.post("/notes", json=body)
    assert first.status_code == second.status_code == 201
    assert first.json()["id"] != second.json()["id"]  # no key: two notes
    with harness.client(user=None) as client:
        assert_problem(client.post("/notes", json=body), 401, "missing-principal")
    key = new_key()
    with harness.client(key) as client:
        keyed = client.post("/notes", json=body)
        replay = client.post("/notes", json=body)
    assert replay.content == keyed.content
    assert replay.headers["idempotent-replayed"] == "true"
    assert harness.note_state(key) == "completed"
    assert harness.rows(body["item"]) == 3
    counted = harness.notes_counted  # the shorthand's observer: only the keyed requests
    assert [counted.total(e) for e in (Event.CLAIMED, Event.REPLAYED)] == [1, 1]


def test_a_public_endpoint_needs_no_principal_and_shares_one_anonymous_key_space(
    harness: Harness,
) -> None:
    key, body = new_key(), order()
    with harness.client(key, user=None) as client:
        first = client.post("/signups", json=body)
        again = client.post("/signups", json=body)
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert harness.state(key, principal="anonymous") == "completed"
    assert harness.rows(body["item"]) == 1


def test_the_earlier_handler_form_still_works_under_the_route_class(harness: Harness) -> None:
    key = new_key()
    before = harness.calls["legacy"]
    with harness.client(key) as client:
        first = client.post("/legacy")
        again = client.post("/legacy")
    assert (first.status_code, first.json()) == (201, {"legacy": True})
    assert again.headers["idempotent-replayed"] == "true"
    assert harness.calls["legacy"] == before + 1


# --- the OpenAPI document ---------------------------------------------------------------------


def test_the_openapi_document_is_valid_and_documents_the_key_the_problems_and_replays(
    harness: Harness,
) -> None:
    with httpx.Client(base_url=harness.url) as client:
        document = client.get("/openapi.json").json()
    openapi_spec_validator.validate(document)
    operation = document["paths"]["/orders"]["post"]
    parameters = {p["name"]: p for p in operation["parameters"]}
    assert parameters["Idempotency-Key"]["in"] == "header"
    assert parameters["Idempotency-Key"]["required"] is True
    assert "X-Provider" in {p["name"].title() for p in operation["parameters"]}
    responses = operation["responses"]
    assert responses["201"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/OrderOut"
    }
    assert "Idempotent-Replayed" in responses["201"]["headers"]
    for status in ("400", "401", "409", "413", "422", "503"):
        assert "application/problem+json" in responses[status]["content"], status
    assert "application/json" in responses["422"]["content"]  # FastAPI's validation errors too
    for status in ("409", "503"):
        assert "Retry-After" in responses[status]["headers"]
    assert "Retry-After" not in responses["400"].get("headers", {})
    note = document["paths"]["/notes"]["post"]
    optional = {p["name"]: p for p in note["parameters"]}["Idempotency-Key"]
    assert optional["required"] is False
    assert "Idempotency-Key" not in str(document["paths"]["/orders"].get("get", {}))
    assert operation["description"].startswith("Create an order")


# --- configuration mistakes fail when the route is declared -----------------------------------


def mistakes_idempotent() -> Idempotent:
    pool = psycopg_pool.AsyncConnectionPool(POSTGRES_URL, open=False)
    return Idempotent(
        AsyncIdempotency(AsyncPostgresStore(pool)),
        connect=pool.connection,
        transaction=AsyncPsycopgTransaction,
    )


def test_protecting_a_safe_method_fails_at_start_up() -> None:
    Idem = Annotated[
        IdempotentRequest, Depends(dependency(mistakes_idempotent(), principal=current_user))
    ]
    router = APIRouter(route_class=IdempotentRoute)
    with pytest.raises(ConfigurationError, match=r"GET /orders .*idempotent already"):

        @router.get("/orders")
        async def orders(idem: Idem) -> None:
            pass


def test_a_sync_or_streaming_endpoint_fails_at_start_up() -> None:
    Idem = Annotated[
        IdempotentRequest, Depends(dependency(mistakes_idempotent(), principal=current_user))
    ]
    router = APIRouter(route_class=IdempotentRoute)
    with pytest.raises(ConfigurationError, match="not 'async def'"):

        @router.post("/sync")
        def sync(idem: Idem) -> None:
            pass

    with pytest.raises(ConfigurationError, match="StreamingResponse"):

        @router.post("/stream", response_class=StreamingResponse)
        async def stream(idem: Idem) -> Any:
            pass


def test_the_dependency_outside_the_parameters_fails_at_start_up() -> None:
    protect = dependency(mistakes_idempotent(), principal=current_user)
    router = APIRouter(route_class=IdempotentRoute)
    with pytest.raises(ConfigurationError, match="as a parameter"):

        @router.post("/orders", dependencies=[Depends(protect)])
        async def orders() -> None:
            pass


def test_no_authentication_dependency_fails_when_the_dependency_is_made() -> None:
    with pytest.raises(ConfigurationError, match="principal="):
        dependency(mistakes_idempotent())


def test_routes_without_the_dependency_are_ordinary(harness: Harness) -> None:
    with httpx.Client(base_url=harness.url, headers={"Idempotency-Key": "not, a key"}) as client:
        assert client.get("/orders").status_code == 200
