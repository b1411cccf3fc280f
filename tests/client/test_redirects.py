"""
Where the key goes when a library follows a redirect, and what one request object sent twice is.

Two scripted servers on 127.0.0.1, on two ports (two origins). httpx (sync and
async, ``follow_redirects=True``) and requests (which follows by default) each
send a ``POST`` with a generated key or the caller's own, and the server
redirects it:

- ``303`` (and ``302``, ``301`` of a ``POST``) make the next request a ``GET``:
  another request, which must not carry the operation's key;
- ``307``/``308`` to the same origin ask for the same request elsewhere: the
  same operation, same method, body and key;
- any redirect to another origin (another port is another origin) must not
  take the key there; a ``307`` there is a new operation with its own key.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import httpx
import pytest
import requests

from idemflow.client import (
    AsyncIdempotentTransport,
    ClientOutcome,
    IdempotentTransport,
    idempotent_session,
    outcome,
)
from idemflow.client._keys import Followed, KeyLedger, Redirect

from .scripted import Answer, Arrived, ScriptedServer, scripted_server

BODY = b'{"amount": 1000}'
CALLER_KEY = "order-1234-payment"

#: (url, caller's key or None) -> (final status, the outcome of the final response)
Post = Callable[[str, str | None], tuple[int, ClientOutcome | None]]


def key_headers(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Idempotency-Key": key}


def post_httpx(url: str, key: str | None) -> tuple[int, ClientOutcome | None]:
    with httpx.Client(transport=IdempotentTransport(), follow_redirects=True) as client:
        response = client.post(url, content=BODY, headers=key_headers(key))
        return response.status_code, outcome(response)


def post_async_httpx(url: str, key: str | None) -> tuple[int, ClientOutcome | None]:
    async def run() -> tuple[int, ClientOutcome | None]:
        transport = AsyncIdempotentTransport()
        async with httpx.AsyncClient(transport=transport, follow_redirects=True) as client:
            response = await client.post(url, content=BODY, headers=key_headers(key))
            return response.status_code, outcome(response)

    return asyncio.run(run())


def post_requests(url: str, key: str | None) -> tuple[int, ClientOutcome | None]:
    with idempotent_session() as session:
        response = session.post(url, data=BODY, headers=key_headers(key), timeout=10)
        return response.status_code, outcome(response)


TRANSPORTS: dict[str, Post] = {
    "httpx": post_httpx,
    "httpx-async": post_async_httpx,
    "requests": post_requests,
}


@pytest.fixture(scope="module")
def here() -> Iterator[ScriptedServer]:
    with scripted_server() as running:
        yield running


@pytest.fixture(scope="module")
def elsewhere() -> Iterator[ScriptedServer]:
    """Another origin: the same host, another port."""
    with scripted_server() as running:
        yield running


@pytest.fixture(params=list(TRANSPORTS))
def post(request: pytest.FixtureRequest) -> Post:
    return TRANSPORTS[request.param]


@pytest.fixture(params=["generated", "callers"])
def caller_key(request: pytest.FixtureRequest) -> str | None:
    return None if request.param == "generated" else f"{CALLER_KEY}-{id(request)}"


def redirect(server: ScriptedServer, path: str, status: int, location: str) -> str:
    return server.answer(path, Answer(status, [("Location", location)]))


def only(arrived: list[Arrived]) -> Arrived:
    assert len(arrived) == 1, arrived
    return arrived[0]


def the_key(first: Arrived, caller_key: str | None) -> str:
    """The key the first request carried: the caller's, or one generated for it."""
    assert len(first.keys) == 1
    if caller_key is not None:
        assert first.keys == (caller_key,)
    return first.keys[0]


@pytest.mark.parametrize("status", [303, 302, 301])
def test_a_redirect_to_a_get_leaves_the_key_behind(
    here: ScriptedServer,
    post: Post,
    caller_key: str | None,
    status: int,
    request: pytest.FixtureRequest,
) -> None:
    """The GET is another request (reading the result): it goes without the key."""
    case = f"{request.node.originalname}/{request.node.callspec.id}"
    here.answer(f"/result/{case}", Answer(200, [], b"done"))
    url = redirect(here, f"/pay/{case}", status, f"/result/{case}")
    got, done = post(url, caller_key)
    assert got == 200
    first = only(here.requests(f"/pay/{case}"))
    key = the_key(first, caller_key)
    following = only(here.requests(f"/result/{case}"))
    assert (following.method, following.keys) == ("GET", ())
    assert done is not None
    assert done.key == key  # the operation that redirected, from response.history


@pytest.mark.parametrize("status", [307, 308])
def test_a_same_origin_redirect_keeping_the_method_keeps_the_key(
    here: ScriptedServer,
    post: Post,
    caller_key: str | None,
    status: int,
    request: pytest.FixtureRequest,
) -> None:
    """The same request at another URL of the same server: the same operation."""
    case = f"{request.node.originalname}/{request.node.callspec.id}"
    here.answer(f"/v2/pay/{case}", Answer(201, [], b"paid"))
    url = redirect(here, f"/pay/{case}", status, f"/v2/pay/{case}")
    got, done = post(url, caller_key)
    assert got == 201
    key = the_key(only(here.requests(f"/pay/{case}")), caller_key)
    following = only(here.requests(f"/v2/pay/{case}"))
    assert (following.method, following.keys, following.body) == ("POST", (key,), BODY)
    assert done is not None
    assert done.key == key


@pytest.mark.parametrize("status", [302, 303])
def test_a_cross_origin_redirect_to_a_get_leaves_the_key_behind(
    here: ScriptedServer,
    elsewhere: ScriptedServer,
    post: Post,
    caller_key: str | None,
    status: int,
    request: pytest.FixtureRequest,
) -> None:
    case = f"{request.node.originalname}/{request.node.callspec.id}"
    target = elsewhere.answer(f"/result/{case}", Answer(200, [], b"done"))
    url = redirect(here, f"/pay/{case}", status, target)
    got, _ = post(url, caller_key)
    assert got == 200
    the_key(only(here.requests(f"/pay/{case}")), caller_key)
    following = only(elsewhere.requests(f"/result/{case}"))
    assert (following.method, following.keys) == ("GET", ())


@pytest.mark.parametrize("status", [307, 308])
def test_a_cross_origin_redirect_keeping_the_method_never_takes_the_key_there(
    here: ScriptedServer,
    elsewhere: ScriptedServer,
    post: Post,
    caller_key: str | None,
    status: int,
    request: pytest.FixtureRequest,
) -> None:
    """The other origin gets the POST as a new operation, with a key of its own."""
    case = f"{request.node.originalname}/{request.node.callspec.id}"
    target = elsewhere.answer(f"/pay/{case}", Answer(201, [], b"paid"))
    url = redirect(here, f"/pay/{case}", status, target)
    got, done = post(url, caller_key)
    assert got == 201
    key = the_key(only(here.requests(f"/pay/{case}")), caller_key)
    following = only(elsewhere.requests(f"/pay/{case}"))
    assert following.method == "POST"
    assert len(following.keys) == 1
    assert following.keys != (key,)
    assert done is not None
    assert done.key == following.keys[0]


# --- one request object sent twice ----------------------------------------------------------


def test_one_httpx_request_sent_twice_is_one_operation(here: ScriptedServer) -> None:
    """The transport writes its key into the request; sent again, it is a retry."""
    url = here.answer("/twice", Answer(201, [], b"paid"))
    with httpx.Client(transport=IdempotentTransport()) as client:
        request = client.build_request("POST", url, content=BODY)
        first = client.send(request)
        second = client.send(request)
        other = client.send(client.build_request("POST", url, content=BODY))
    keys = [r.keys for r in here.requests("/twice")]
    assert keys[0] == keys[1] == (request.headers["Idempotency-Key"],)
    assert keys[2] != keys[0]
    done = [outcome(r) for r in (first, second, other)]
    assert [d.key if d is not None else None for d in done] == [k[0] for k in keys]


def test_one_prepared_requests_request_sent_twice_is_one_operation(here: ScriptedServer) -> None:
    url = here.answer("/twice-prepared", Answer(201, [], b"paid"))
    with idempotent_session() as session:
        prepared = session.prepare_request(requests.Request("POST", url, data=BODY))
        session.send(prepared, timeout=10)
        session.send(prepared, timeout=10)
    keys = [r.keys for r in here.requests("/twice-prepared")]
    assert keys == [(prepared.headers["Idempotency-Key"],)] * 2


def test_one_httpx_request_redirected_sent_twice(here: ScriptedServer) -> None:
    """Sent twice through a 303: both POSTs carry the key, neither GET does."""
    here.answer("/twice-result", Answer(200, [], b"done"))
    url = redirect(here, "/twice-pay", 303, "/twice-result")
    with httpx.Client(transport=IdempotentTransport(), follow_redirects=True) as client:
        request = client.build_request("POST", url, content=BODY)
        client.send(request)
        client.send(request)
    posts = here.requests("/twice-pay")
    assert [p.keys for p in posts] == [(request.headers["Idempotency-Key"],)] * 2
    assert [g.keys for g in here.requests("/twice-result")] == [(), ()]


# --- the rule, sans I/O ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "status", "follows"),
    [
        ("POST", 303, "GET"),
        ("HEAD", 303, "HEAD"),
        ("PATCH", 302, "GET"),
        ("POST", 301, "GET"),
        ("PATCH", 301, "PATCH"),
        ("POST", 307, "POST"),
        ("PATCH", 308, "PATCH"),
    ],
)
def test_the_method_a_redirect_is_followed_with(method: str, status: int, follows: str) -> None:
    """As httpx and requests both follow it."""
    redirect = Redirect("scope", "k", method, "http://a.example/x/y", b"", status, "z?q=1")
    assert redirect.followed() == Followed(follows, "http://a.example/x/z?q=1")


@pytest.mark.parametrize(
    "values", [[], [""], ['"unterminated'], ["a, b"], ["k", "k"], ["\x00"], ["é" * 300]]
)
@pytest.mark.parametrize("url", ["http://a.example/x", "http://[::1", "http://a:notaport/", ""])
def test_any_request_is_checked_without_raising(values: list[str], url: str) -> None:
    """Every request passes this check, unmanaged ones included: it never raises."""
    ledger = KeyLedger()
    ledger.redirected(Redirect("s", "k", "POST", "http://a.example/p", b"", 303, url))
    assert ledger.stays_behind(values, url) is False
