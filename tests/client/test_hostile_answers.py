"""
Hostile answers: whatever a server sends back, the client raises only its documented errors.

An answer comes after the request may have run, so a client that crashes while
reading it loses the one thing the caller needs to retry safely: the key. Any
body the client cannot read is "no problem details"; statuses, ``Retry-After``
values and repeated headers are read without raising. The reading is fuzzed
sans I/O (many examples, fast) and through a real server on 127.0.0.1 for each
transport (httpx sync and async, requests).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, Iterator, Sequence

import httpx
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idemflow.client import (
    AsyncIdempotentTransport,
    IdempotentTransport,
    RetryPolicy,
    idempotent_session,
    outcome,
)
from idemflow.client._retry import (
    MAX_PROBLEM_BYTES,
    MAX_PROBLEM_DEPTH,
    Operations,
    parse_retry_after,
    read_problem,
)

from .scripted import Answer, ScriptedServer, scripted_server

PROBLEM = ("Content-Type", "application/problem+json")
#: 100 000 levels: deeper than any recursion limit.
NESTED = b"[" * 100_000 + b"]" * 100_000
NESTED_OBJECT = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
#: Two attempts at most, no waiting: the fuzzing is about reading, not about time.
POLICY = RetryPolicy(max_attempts=2, backoff=0.001, max_backoff=0.001)


def no_sleep(_: float) -> None:
    pass


async def no_async_sleep(_: float) -> None:
    pass


Post = Callable[[str], tuple[int, str | None]]


def post_httpx(url: str) -> tuple[int, str | None]:
    transport = IdempotentTransport(policy=POLICY, sleep=no_sleep)
    with httpx.Client(transport=transport, timeout=10) as client:
        response = client.post(url, content=b'{"amount": 1}')
        done = outcome(response)
        return response.status_code, None if done is None else done.key


def post_async_httpx(url: str) -> tuple[int, str | None]:
    async def run() -> tuple[int, str | None]:
        transport = AsyncIdempotentTransport(policy=POLICY, sleep=no_async_sleep)
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            response = await client.post(url, content=b'{"amount": 1}')
            done = outcome(response)
            return response.status_code, None if done is None else done.key

    return asyncio.run(run())


def post_requests(url: str) -> tuple[int, str | None]:
    with idempotent_session(POLICY, sleep=no_sleep) as session:
        response = session.post(url, data=b'{"amount": 1}', timeout=10)
        done = outcome(response)
        return response.status_code, None if done is None else done.key


TRANSPORTS: dict[str, Post] = {
    "httpx": post_httpx,
    "httpx-async": post_async_httpx,
    "requests": post_requests,
}


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    with scripted_server() as running:
        yield running


@pytest.mark.parametrize("status", [503, 201])
@pytest.mark.parametrize("body", [NESTED, NESTED_OBJECT], ids=["array", "object"])
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_problem_nested_100_000_levels_is_no_problem(
    server: ScriptedServer, transport: str, body: bytes, status: int
) -> None:
    """The answer comes back with the key; every attempt the server saw carried it."""
    path = f"/nested/{transport}/{status}/{len(body)}"
    url = server.answer(path, Answer(status, [PROBLEM], body))
    got, key = TRANSPORTS[transport](url)
    assert got == status
    sent = server.requests(path)
    assert key is not None
    assert [r.keys for r in sent] == [(key,)] * (2 if status == 503 else 1)


# --- fuzzing ------------------------------------------------------------------------------------

#: Header values as they arrive: any latin-1 text but line breaks, blanks around it.
VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"))
RETRY_AFTER = st.one_of(
    VALUE,
    st.integers(min_value=-(10**30), max_value=10**400).map(str),
    st.floats().map(str),
    st.sampled_from(["NaN", "inf", "-0", "1e999", "0x10", "\xb2", "9" * 5000]),
    st.datetimes().map(lambda d: d.strftime("%a, %d %b %Y %H:%M:%S GMT")),
    st.sampled_from(
        [
            "Fri, 31 Dec 9999 23:59:59 -2359",
            "Mon, 01 Jan 0001 00:00:00 +2359",
            "Sun Nov  6 08:49:37 1994",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Mon, 99 Foo 99999999999 99:99:99 GMT",
        ]
    ),
)
CONTENT_TYPE = st.one_of(
    st.sampled_from(
        [
            "application/problem+json",
            "application/problem+json; charset=utf-8",
            "APPLICATION/PROBLEM+JSON",
            "application/problem+json, text/html",
            "text/html; x=problem+json",
        ]
    ),
    VALUE,
)
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)
PROBLEM_BODY = st.one_of(
    st.binary(max_size=2000),
    JSONISH.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.one_of(st.text(), st.sampled_from(["/in-progress", "/lease-lost"]), JSONISH),
            "retryable": JSONISH,
        },
    ).map(lambda v: json.dumps(v).encode()),
    st.integers(min_value=1, max_value=5000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(min_value=1, max_value=5000).map(lambda n: b"[" * n),
    st.sampled_from([b'{"retryable": true, "n": ' + b"9" * 10_000 + b"}", b"\xff\xfe{\x00}\x00"]),
)
LOCATION = st.one_of(
    VALUE,
    st.sampled_from(
        ["http://[::1", "http://a:port/", "//", "http://%zz/", "/x?" + "&" * 1000, "\\\\x"]
    ),
)
REDIRECT = st.sampled_from([301, 302, 303, 307, 308])
HEADER_NAMES = st.sampled_from(
    ["Content-Type", "Retry-After", "Idempotent-Replayed", "Location", "X-Other"]
)
HEADERS = st.lists(
    st.tuples(HEADER_NAMES, VALUE) | st.tuples(st.just("Location"), LOCATION), max_size=6
)


def headers_of(
    content_type: str | None, retry_after: Sequence[str], extra: Sequence[tuple[str, str]]
) -> list[tuple[str, str]]:
    lines = [] if content_type is None else [("Content-Type", content_type)]
    lines += [("Retry-After", value) for value in retry_after]
    return [*lines, *extra]


@settings(max_examples=500, deadline=None)
@given(
    status=st.integers(min_value=100, max_value=999) | REDIRECT,
    content_type=st.none() | CONTENT_TYPE,
    retry_after=st.lists(RETRY_AFTER, max_size=3),
    extra=HEADERS,
    body=PROBLEM_BODY,
)
def test_any_answer_is_read_without_raising(
    status: int,
    content_type: str | None,
    retry_after: list[str],
    extra: list[tuple[str, str]],
    body: bytes,
) -> None:
    """Sans I/O: the policy reads any status, headers and body into a decision."""
    operation = Operations(POLICY).start("POST", "http://api.example/pay", {}, [], b"{}")
    lines = headers_of(content_type, retry_after, extra)
    raw = [(name.encode(), value.encode("latin-1")) for name, value in lines]
    decision = operation.answered(status, httpx.Headers(raw), body)
    assert decision.delay >= 0
    assert operation.outcome().key == operation.key


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    status=st.sampled_from([200, 201, 400, 409, 422, 429, 500, 502, 503]),
    content_type=st.none() | CONTENT_TYPE,
    retry_after=st.lists(RETRY_AFTER, max_size=2),
    body=PROBLEM_BODY,
    transport=st.sampled_from(list(TRANSPORTS)),
)
def test_any_answer_through_a_real_server_keeps_the_key(
    server: ScriptedServer,
    status: int,
    content_type: str | None,
    retry_after: list[str],
    body: bytes,
    transport: str,
) -> None:
    """Through each transport: the answer comes back, with the key every attempt carried."""
    server.arrived.clear()
    lines = [(n, v.strip()) for n, v in headers_of(content_type, retry_after, [])]
    url = server.answer("/fuzz", Answer(status, lines, body))
    got, key = TRANSPORTS[transport](url)
    assert got == status
    assert key is not None
    assert {r.keys for r in server.requests("/fuzz")} == {(key,)}


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_the_error_raised_after_the_last_attempt_carries_the_key(transport: str) -> None:
    """No answer at all: the library's own error, with the operation's outcome on it."""
    with pytest.raises((httpx.ConnectError, requests.ConnectionError)) as raised:
        TRANSPORTS[transport](f"http://127.0.0.1:{closed_port()}/pay")
    done = outcome(raised.value)
    assert done is not None
    assert done.attempts == 2
    assert f"Idempotency-Key {done.key!r}" in "\n".join(raised.value.__notes__)


NEST = b'{"a": '
DEEPEST = NEST * MAX_PROBLEM_DEPTH + b"1" + b"}" * MAX_PROBLEM_DEPTH


@pytest.mark.parametrize(
    ("content_type", "body", "read"),
    [
        ("application/problem+json", b'{"retryable": false}', True),
        ("Application/Problem+JSON; charset=utf-8", b'{"retryable": false}', True),
        ("application/problem+json", DEEPEST, True),
        ("application/problem+json", b'{"a": [' + DEEPEST + b"]}", False),
        ("application/problem+json", b'{"a": "' + b"[" * 100 + b'"}', True),
        ("application/problem+json", b'{"a": "' + b" " * MAX_PROBLEM_BYTES + b'"}', False),
        ("application/problem+json", b'{"a": "\xff"}', False),
        ("application/problem+json", b"[]", False),
        ("application/problem+json, application/problem+json", b"{}", False),
        ("application/json", b"{}", False),
        ("text/plain; note=problem+json", b"{}", False),
    ],
)
def test_what_is_read_as_a_problem(content_type: str, body: bytes, read: bool) -> None:
    """One media type, UTF-8, an object, at most MAX_PROBLEM_BYTES and MAX_PROBLEM_DEPTH."""
    found = read_problem(httpx.Headers({"content-type": content_type}), body)
    assert (found is not None) is read


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("120", 120.0),
        (" 7 ", 7.0),
        ("-5", None),
        ("1.5", None),
        ("NaN", None),
        ("inf", None),
        ("\xb2", None),
        ("1, 2", None),
        ("9" * 5000, float("inf")),
        ("Mon, 99 Foo 99999999999 99:99:99 GMT", None),
        ("Thu, 01 Jan 1970 00:00:00 GMT", 0.0),
    ],
)
def test_any_retry_after_is_read_without_raising(value: str, seconds: float | None) -> None:
    """A wait beyond the deadline stops retrying; a value that is no wait is ignored."""
    assert parse_retry_after(value, 1_000.0) == seconds


@pytest.mark.parametrize(
    "value", ["Fri, 31 Dec 9999 23:59:59 -2359", "Mon, 01 Jan 0001 00:00:00 +2359", "31 Dec 9999"]
)
def test_an_http_date_at_the_ends_of_the_calendar_is_a_wait_or_nothing(value: str) -> None:
    seconds = parse_retry_after(value, 1_000.0)
    assert seconds is None or seconds >= 0
