"""
Django ``async def`` views under ``@idempotent`` (issue 31, item 8), through Django's own
WSGI and ASGI handlers (Django 5 runs an async view under both).

An async view once answered 500 ``response-not-storable`` on every request (its
coroutine taken for a streamed body, never awaited). Now it runs as a sync view does:
inside idemflow's ``transaction.atomic()``, its awaited database calls (the async ORM's
``acreate``…, ``sync_to_async``) brought back to the thread that holds that block, on its
connection, so its writes commit with the completion or roll back with a failure.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("django")

from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.wsgi import WSGIHandler
from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.test import override_settings
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View

from idemflow import State
from idemflow.integrations.django import get_store, idempotent
from tests.integrations.django_setup import execute, require

pytestmark = pytest.mark.timeout(60)

ALIASES = ["default", pytest.param("postgres", marks=pytest.mark.postgres)]
PATHS = ["/payments", "/cbv/payments", "/mw/payments"]


class _URLs:
    urlpatterns: tuple[Any, ...] = ()


class Shop:
    """A key table, a business table, and async views writing to it through the ORM's way
    back to the request's thread (``sync_to_async``, as ``acreate`` does)."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.table = f"idem_{uuid.uuid4().hex[:12]}"
        self.ran: list[str] = []
        #: What the next request's view raises after its write, if anything.
        self.failures: list[BaseException] = []

    def notes(self) -> list[str]:
        rows = execute(self.alias, f"SELECT note FROM biz_{self.table} ORDER BY id")
        return [str(row[0]) for row in rows]

    def record(self, key: str) -> Any:
        return get_store().get("alice", key)

    async def view_body(self, request: HttpRequest) -> JsonResponse:
        note = json.loads(request.body)["note"]
        self.ran.append(note)
        await sync_to_async(self._write)(note)
        if self.failures:
            raise self.failures.pop()
        return JsonResponse({"note": note}, status=201)

    def _write(self, note: str) -> None:
        with connections[self.alias].cursor() as cursor:
            cursor.execute(f"INSERT INTO biz_{self.table} (note) VALUES (%s)", [note])


@contextlib.contextmanager
def shop_on(alias: str) -> Iterator[Shop]:
    require(alias)
    shop = Shop(alias)
    serial = "id BIGSERIAL PRIMARY KEY" if alias == "postgres" else "id INTEGER PRIMARY KEY"
    execute(alias, f"CREATE TABLE biz_{shop.table} ({serial}, note TEXT)")

    @idempotent
    async def pay(request: HttpRequest) -> JsonResponse:
        return await shop.view_body(request)

    @method_decorator(idempotent, name="post")
    class PaymentView(View):  # type: ignore[misc]  # Django has no stubs here
        async def post(self, request: HttpRequest) -> JsonResponse:
            return await shop.view_body(request)

    async def unprotected(request: HttpRequest) -> JsonResponse:
        return await shop.view_body(request)

    idemflow = {
        "database": alias,
        "table": shop.table,
        "principal": lambda request: "alice",
        "endpoints": ["POST /mw/payments"],
    }
    with override_settings(
        IDEMFLOW=idemflow,
        ROOT_URLCONF=_URLs,
        MIDDLEWARE=["idemflow.integrations.django.middleware.IdempotencyMiddleware"],
        ALLOWED_HOSTS=["shop"],
    ):
        _URLs.urlpatterns = (
            path("payments", pay),
            path("cbv/payments", PaymentView.as_view()),
            path("mw/payments", unprotected),
        )
        get_store().migrate()
        try:
            yield shop
        finally:
            connections[alias].close()
            for table in (shop.table, f"biz_{shop.table}"):
                execute(alias, f"DROP TABLE IF EXISTS {table}")


Post = Callable[[str, str, str], httpx.Response]


@contextlib.contextmanager
def served(handler: str) -> Iterator[Post]:
    """``post(path, key, note)`` through Django's WSGI handler, or its ASGI one (on an
    event loop of its own, as a server runs it)."""
    app = WSGIHandler() if handler == "wsgi" else ASGIHandler()

    async def asgi_post(at: str, key: str, body: bytes) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
            return await client.post(at, content=body, headers={"Idempotency-Key": key})

    with httpx.Client(transport=httpx.WSGITransport(app=app), base_url="http://shop") as client:

        def post(at: str, key: str, note: str) -> httpx.Response:
            body = json.dumps({"note": note}).encode()
            if handler == "asgi":
                return async_to_sync(asgi_post)(at, key, body)
            return client.post(at, content=body, headers={"Idempotency-Key": key})

        yield post


def test_a_decorated_async_view_stays_a_coroutine_function() -> None:
    """Django awaits what ``@idempotent`` returns for an ``async def`` view (under ASGI it
    would otherwise run it in a thread and get a coroutine back)."""

    @idempotent
    async def pay(request: HttpRequest) -> JsonResponse:
        return JsonResponse({}, status=201)

    assert iscoroutinefunction(pay)


@pytest.mark.parametrize("alias", ALIASES)
@pytest.mark.parametrize("handler", ["wsgi", "asgi"])
@pytest.mark.parametrize("at", PATHS)
def test_an_async_view_runs_once_and_shares_the_completions_transaction(
    alias: str, handler: str, at: str
) -> None:
    """Function view, class-based view, the middleware's endpoint: the async view runs once
    and its write commits (201); the retry replays; a view that writes then raises leaves
    no write (rolled back with its transaction: Django's middleware runs the view in it
    too) and the key released, so its retry runs."""
    with shop_on(alias) as shop:
        with served(handler) as post:
            first = post(at, "k-1", "paid")
            retry = post(at, "k-1", "paid")
            shop.failures.append(LookupError("after the write"))
            failed = post(at, "k-2", "lost")
            failed_record = shop.record("k-2")
            rerun = post(at, "k-2", "lost")
        notes = shop.notes()

    assert first.status_code == 201, first.text
    assert first.json() == {"note": "paid"}
    assert (retry.status_code, retry.headers.get("idempotent-replayed")) == (201, "true")
    assert retry.json() == {"note": "paid"}
    assert failed.status_code == 500
    assert failed_record is not None
    assert failed_record.state is State.RELEASED
    assert rerun.status_code == 201, rerun.text
    assert shop.ran == ["paid", "lost", "lost"]
    assert notes == ["paid", "lost"]


@pytest.mark.parametrize("handler", ["wsgi", "asgi"])
def test_an_async_validate_is_awaited_before_the_claim(handler: str) -> None:
    """An ``async def validate`` is run to its end: what it raises passes through and
    nothing is claimed (before, its coroutine was never awaited: every body valid)."""
    refused: list[str] = []

    async def validate(request: HttpRequest) -> None:
        refused.append(request.method or "")
        raise ValueError("invalid body")

    with shop_on("default") as shop:

        @idempotent(validate=validate)
        async def pay(request: HttpRequest) -> JsonResponse:
            return await shop.view_body(request)

        _URLs.urlpatterns = (path("payments", pay),)
        with served(handler) as post:
            answer = post("/payments", "k-1", "paid")
            record = shop.record("k-1")

    assert answer.status_code == 500
    assert refused == ["POST"]
    assert record is None
    assert shop.ran == []
