"""
The framework-neutral edge, without a server: problems, stored headers, request ids, intents.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from idemflow import (
    AsyncIdempotency,
    ConfigurationError,
    InProgress,
    KeyReused,
    MissingPrincipal,
    Response,
    StoreUnavailable,
    fingerprint,
)
from idemflow._http import (
    Edge,
    EdgeOptions,
    HTTPRequest,
    ResponseNotStorable,
    problem_for,
    request_id_from,
    storable,
)
from idemflow.demo.settings import parse_duration, parse_token
from idemflow.testing import AsyncMemoryStore


def request(**changes: object) -> HTTPRequest:
    fields: dict[str, object] = {
        "method": "POST",
        "route": "/payments/{id}/refunds",
        "headers": [(b"idempotency-key", b"k-1"), (b"content-type", b"application/json")],
        "body": b'{"amount": 1}',
        "principal": "alice",
        "request_id": "r-1",
        "path_params": {"id": "pay_1"},
    }
    fields.update(changes)
    return HTTPRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (KeyReused("x"), 422, None),
        (InProgress("x", retry_after=3), 409, "3"),
        (StoreUnavailable("x", retry_after=2), 503, "2"),
        (MissingPrincipal("x"), 401, None),
        (ResponseNotStorable("x"), 500, None),
    ],
)
def test_every_error_renders_as_an_rfc_9457_problem(
    error: Exception, status: int, retry_after: str | None
) -> None:
    response = problem_for(error, "rid")  # type: ignore[arg-type]
    body = json.loads(response.body)
    assert response.status == status
    assert response.header("content-type") == "application/problem+json"
    assert set(body) == {"type", "title", "status", "detail"}
    assert body["status"] == status
    assert body["type"].startswith("https://")
    assert response.header("retry-after") == retry_after
    assert response.header("x-request-id") == "rid"


def test_only_allow_listed_headers_are_stored() -> None:
    response = Response(
        201,
        b"{}",
        (
            ("Content-Type", "application/json"),
            ("Set-Cookie", "a=b"),
            ("Date", "Mon"),
            ("ETag", '"1"'),
            ("X-RateLimit-Remaining", "3"),
            ("Link", "<a>"),
            ("Link", "<b>"),
        ),
    )
    stored = storable(response, max_bytes=10)
    assert stored.headers == (
        ("content-type", "application/json"),
        ("etag", '"1"'),
        ("link", "<a>"),
        ("link", "<b>"),
    )


def test_a_body_over_the_limit_is_refused_not_truncated() -> None:
    with pytest.raises(ResponseNotStorable, match="11 bytes"):
        storable(Response(200, b"x" * 11), max_bytes=10)
    assert storable(Response(200, b"x" * 10), max_bytes=10).body == b"x" * 10


@pytest.mark.parametrize(
    ("headers", "echoed"),
    [
        ([(b"x-request-id", b"abc-123")], True),
        ([(b"x-request-id", b"has space")], False),
        ([(b"x-request-id", b"x" * 129)], False),
        ([(b"x-request-id", b"a"), (b"x-request-id", b"b")], False),
        ([], False),
    ],
)
def test_a_sane_client_request_id_is_kept_and_anything_else_replaced(
    headers: list[tuple[bytes, bytes]], echoed: bool
) -> None:
    value = request_id_from(headers)
    assert (value == "abc-123") is echoed
    assert 0 < len(value) <= 128


def test_the_intent_scopes_by_principal_and_fingerprints_template_params_and_body() -> None:
    edge = Edge(AsyncIdempotency(AsyncMemoryStore()))
    intent = edge.intent(request())
    assert (intent.principal, intent.key, intent.correlation_id) == ("alice", "k-1", "r-1")
    assert intent.endpoint == "POST /payments/{id}/refunds"
    expected = fingerprint(
        "POST", "/payments/{id}/refunds?id=pay_1", b'{"amount":1}', content_type="application/json"
    )
    assert intent.fingerprint == expected
    other = edge.intent(request(path_params={"id": "pay_2"}))
    assert other.fingerprint != intent.fingerprint
    assert other.endpoint == intent.endpoint


def test_no_principal_is_refused_unless_the_endpoint_is_public() -> None:
    idempotency = AsyncIdempotency(AsyncMemoryStore())
    with pytest.raises(MissingPrincipal):
        Edge(idempotency).intent(request(principal=None))
    public = Edge(idempotency, EdgeOptions(public=True)).intent(request(principal=None))
    assert public.principal == "anonymous"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("24h", 86400), ("30m", 1800), ("90s", 90), ("90", 90), ("250ms", 0.25), ("2d", 172800)],
)
def test_durations_read_like_people_write_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "h", "-1h", "0s", "1 week"])
def test_nonsense_durations_are_refused(text: str) -> None:
    with pytest.raises(ConfigurationError):
        parse_duration(text)


def test_tokens_are_name_colon_token() -> None:
    assert parse_token("carol:carol-token") == ("carol-token", "carol")
    with pytest.raises(ConfigurationError):
        parse_token("carol")
