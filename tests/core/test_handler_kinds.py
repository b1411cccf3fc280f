"""
A handler of the wrong kind for its driver (issue 31, item 8): refused before anything is
claimed, with the fix, or run as it is; never a claim left behind, never a second run.

Before: an ``async def`` handler given to the sync driver answered a coroutine that was
never awaited, and the flow's verdict on it raised past the release: the key stayed
claimed until the sweeper. A plain function given to the async driver ran, then its
answer could not be awaited: the key was released and the retry ran it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from idemflow import (
    AsyncAttempt,
    AsyncIdempotency,
    Attempt,
    ConfigurationError,
    Idempotency,
    Response,
    State,
)
from idemflow._async.edge import AsyncEdge
from idemflow._sync.edge import Edge
from idemflow.stores.memory import AsyncMemoryStore, MemoryStore
from tests.core.test_sync_edge import request
from tests.factories import CREATED, intent


def call_later(handler: Callable[[Any], Any], attempt: Any) -> Any:
    """A plain function answering what ``handler`` answers (a coroutine, for an async one)."""
    return handler(attempt)


async def async_def(attempt: Any) -> Response:
    raise AssertionError("never run")


class AsyncCall:
    async def __call__(self, attempt: Any) -> Response:
        raise AssertionError("never run")


async def async_generator(attempt: Any) -> AsyncIterator[Response]:
    yield CREATED


SYNC_REFUSED = pytest.mark.parametrize(
    "handler",
    [
        pytest.param(async_def, id="async-def"),
        pytest.param(AsyncCall(), id="async-call"),
        pytest.param(async_generator, id="async-generator"),
    ],
)


@SYNC_REFUSED
def test_the_sync_driver_refuses_an_async_handler_before_claiming(handler: Any) -> None:
    """``Idempotency.run`` and the sync edge: a ConfigurationError naming the fix,
    nothing claimed."""
    store = MemoryStore()
    idem = Idempotency(store)

    with pytest.raises(ConfigurationError, match="AsyncIdempotency"):
        idem.run(intent(), handler)
    with pytest.raises(ConfigurationError, match="AsyncIdempotency"):
        Edge(idem).respond(request(), handler)

    assert store.get("alice", "k-1") is None


def test_the_sync_driver_gives_the_key_back_for_a_coroutine_answer() -> None:
    """A plain function answering a coroutine (a lambda around an ``async def``) ran
    nothing: a ConfigurationError, the coroutine closed (no "never awaited" warning), and
    the key released, so the right handler runs on the retry."""
    store = MemoryStore()
    idem = Idempotency(store)

    answers_a_coroutine: Any = functools.partial(call_later, async_def)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited would warn
        with pytest.raises(ConfigurationError, match="cannot await"):
            idem.run(intent(), answers_a_coroutine)

    record = store.get("alice", "k-1")
    assert record is not None
    assert record.state is State.RELEASED
    assert idem.run(intent(), lambda attempt: CREATED).response == CREATED


@pytest.mark.anyio
async def test_the_async_driver_refuses_an_async_generator_before_claiming() -> None:
    store = AsyncMemoryStore()
    idem = AsyncIdempotency(store)

    with pytest.raises(ConfigurationError, match="async generator"):
        await idem.run(intent(), async_generator)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="async generator"):
        await AsyncEdge(idem).respond(request(), async_generator)  # type: ignore[arg-type]

    assert await store.get("alice", "k-1") is None


@pytest.mark.anyio
@pytest.mark.parametrize("through", ["run", "edge"])
async def test_the_async_driver_takes_a_plain_handlers_answer_and_runs_it_once(
    through: str,
) -> None:
    """A plain function ran when it was called: its answer is the outcome, stored and
    replayed, never released for a second run."""
    store = AsyncMemoryStore()
    idem = AsyncIdempotency(store)
    ran: list[int] = []

    def plain(attempt: AsyncAttempt | Attempt) -> Response:
        ran.append(1)
        return CREATED

    handler: Callable[[AsyncAttempt], Awaitable[Response]] = plain  # type: ignore[assignment]
    for _ in range(2):
        if through == "run":
            assert (await idem.run(intent(), handler)).response == CREATED
        else:
            assert (await AsyncEdge(idem).respond(request(), handler)).status == CREATED.status

    record = await store.get("alice", "k-1")
    assert record is not None
    assert record.state is State.COMPLETED
    assert ran == [1]


# --- the doors: what is configured once is checked once ----------------------------------


async def asgi_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("never run")


async def async_principal(*args: Any) -> str:
    return "alice"


def test_the_wsgi_middleware_refuses_an_asgi_app_and_an_async_principal() -> None:
    from idemflow.integrations.wsgi import IdempotencyMiddleware

    idem = Idempotency(MemoryStore())
    with pytest.raises(ConfigurationError, match="ASGI application"):
        IdempotencyMiddleware(asgi_app, idempotency=idem, endpoints=["POST /payments"])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="principal"):
        IdempotencyMiddleware(
            lambda environ, start_response: [],
            idempotency=idem,
            endpoints=["POST /payments"],
            principal=async_principal,  # type: ignore[arg-type]
        )


def test_flask_refuses_an_async_principal() -> None:
    pytest.importorskip("flask")
    from flask import Flask

    from idemflow.integrations.flask import Idempotency as FlaskIdempotency

    with pytest.raises(ConfigurationError, match="principal"):
        FlaskIdempotency(Flask(__name__), store=MemoryStore(), principal=async_principal)  # type: ignore[arg-type]


def test_starlette_refuses_an_async_principal(tmp_path: Any) -> None:
    from idemflow.integrations.starlette import IdempotencyMiddleware, Idempotent
    from idemflow.stores.sqlite import AsyncSQLiteStore

    with pytest.raises(ConfigurationError, match="principal"):
        IdempotencyMiddleware(
            asgi_app,
            idempotency=AsyncIdempotency(AsyncMemoryStore()),
            endpoints=["POST /payments"],
            principal=async_principal,  # type: ignore[arg-type]
        )
    with pytest.raises(ConfigurationError, match="principal"):
        Idempotent(
            AsyncIdempotency(AsyncSQLiteStore(tmp_path / "keys.db")),
            connect=contextlib.nullcontext,
            transaction=lambda connection: connection,
            principal=async_principal,  # type: ignore[arg-type]
        )


def test_django_refuses_an_async_principal_at_start_up() -> None:
    pytest.importorskip("django")
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    import tests.integrations.django_setup  # noqa: F401 -- settings
    from idemflow.integrations.django.middleware import IdempotencyMiddleware

    idemflow = {"principal": async_principal, "endpoints": ["POST /payments"]}
    with (
        override_settings(IDEMFLOW=idemflow, MIDDLEWARE=[]),
        pytest.raises(ImproperlyConfigured, match="principal"),
    ):
        IdempotencyMiddleware(lambda request: None)


def test_a_principal_that_answers_a_coroutine_is_a_problem_before_the_claim() -> None:
    """Past the check (a plain function answering a coroutine): the 500 problem naming
    the fix, nothing claimed; never a principal that differs on every request."""
    store = MemoryStore()
    ask = async_principal()
    asked = dataclasses.replace(request(), principal=ask)

    answer = Edge(Idempotency(store)).respond(asked, lambda attempt: CREATED)

    assert answer.status == 500
    assert b"principal getter" in answer.body
    assert inspect.getcoroutinestate(ask) == inspect.CORO_CLOSED  # no "never awaited"
    assert store.get("alice", "k-1") is None
