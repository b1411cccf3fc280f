"""
Small things many test modules build the same way: intents, responses, a frozen
clock, a PostgreSQL guard, JSON values in random member order.

Only what several modules wrote identically lives here; a module whose intent or
response differs on purpose (another endpoint, a correlation id per key, a body
of its own) keeps its own. ``tests/conftest.py`` registers this module as a
plugin, so its fixtures (``clock``) reach every test.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import strategies as st

from idemflow import Intent, Policy, Response
from idemflow.stores.protocol import NotFused
from idemflow.testing import FrozenClock
from tests.conftest import POSTGRES_URL, unreachable

if TYPE_CHECKING:
    from idemflow_demo.app import DemoService

#: The suite's usual policy: claims stale after 2 × 5 s + 10 s, records kept an hour.
POLICY = Policy(request_timeout=5, retention=3600)

#: A payment created: the JSON body a handler answers with.
CREATED = Response.json(201, {"id": "pay_1"})
#: :data:`CREATED` with the new payment's location, for tests that check headers survive.
CREATED_AT = Response.json(201, {"id": "pay_1"}, [("location", "/payments/pay_1")])


def intent(key: str = "k-1", *, principal: str = "alice", fp: str = "fp-1") -> Intent:
    """A payment request's intent, sent with the correlation id ``req-1``."""
    return Intent(principal, key, fp, endpoint="POST /payments", correlation_id="req-1")


def uncorrelated_intent(key: str = "k-1", *, principal: str = "alice", fp: str = "fp-1") -> Intent:
    """:func:`intent` of a request that sent no correlation id."""
    return Intent(principal, key, fp, endpoint="POST /payments")


@contextlib.asynccontextmanager
async def started(service: DemoService) -> AsyncIterator[DemoService]:
    """The demo service in process: its database opened (and migrated), closed afterwards."""
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture
def clock() -> FrozenClock:
    """A clock of the test's own that moves only when the test advances it."""
    return FrozenClock()


def psycopg_or_skip() -> ModuleType:
    """psycopg, once the PostgreSQL server answers (skipped locally, failed in CI if not)."""
    psycopg: ModuleType = pytest.importorskip("psycopg")
    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except psycopg.OperationalError as exc:
        unreachable("PostgreSQL", exc)
    return psycopg


async def until(
    condition: Callable[[], bool], what: str, timeout: float = 10, *, blocking: bool = False
) -> None:
    """Return once ``condition()`` holds, polling the real state from the loop (which
    stays free meanwhile; a ``blocking`` condition, e.g. a query, runs on a thread); fail
    after ``timeout`` seconds: what a test waits for, never a sleep standing in for an order."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (await asyncio.to_thread(condition) if blocking else condition()):
        assert loop.time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.005)


def free_port() -> int:
    """A loopback TCP port nothing listens on (as of now)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


#: Any JSON document: scalars, and arrays and objects nested a few levels.
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def reordered(value: Any, rnd: random.Random) -> Any:
    """A copy of ``value`` whose objects list their members in random order."""
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {name: reordered(member, rnd) for name, member in items}
    if isinstance(value, list):
        return [reordered(item, rnd) for item in value]
    return value


class ForwardingTransaction:
    """The contract's optional capabilities at their defaults, for a test's wrapper of a sync
    transaction that forwards everything else by ``__getattr__`` (which never reaches a
    method its class has): the wrapper offers none of the inner one's."""

    def execute_and_commit(self, statement: Any, params: Any, *, begin: bool = False) -> int:
        raise NotFused

    def lend(self, sources: tuple[Any, ...]) -> Any:
        return None

    def is_unavailable(self, exc: BaseException) -> bool:
        return False


class AsyncForwardingTransaction:
    """:class:`ForwardingTransaction` for a wrapper of an async transaction."""

    async def execute_and_commit(self, statement: Any, params: Any, *, begin: bool = False) -> int:
        raise NotFused

    async def lend(self, sources: tuple[Any, ...]) -> Any:
        return None

    def is_unavailable(self, exc: BaseException) -> bool:
        return False


#: What a handler may raise: the iteration protocol's own exceptions too, which a
#: generator or coroutine on the way out would turn into a RuntimeError (issue 31).
HANDLER_EXCEPTIONS = pytest.mark.parametrize(
    "make_exception",
    [
        pytest.param(lambda: StopIteration("stopped"), id="StopIteration"),
        pytest.param(lambda: StopAsyncIteration("stopped"), id="StopAsyncIteration"),
        pytest.param(lambda: ValueError("boom"), id="plain"),
    ],
)


def assert_passed_through(raised: BaseException, original: BaseException, *, awaited: bool) -> None:
    """``raised`` is the handler's ``original`` itself. Awaited, a StopIteration cannot be:
    a coroutine it leaves turns it into a RuntimeError (PEP 479), whose cause it is."""
    if awaited and isinstance(original, StopIteration):
        assert isinstance(raised, RuntimeError)
        assert raised.__cause__ is original
    else:
        assert raised is original
