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
    Event,
    InProgress,
    KeyReused,
    MissingPrincipal,
    Record,
    Response,
    ResponseNotStorable,
    StoreUnavailable,
    Verdict,
    default_classifier,
    fingerprint,
)
from idemflow._async.edge import AsyncEdge as Edge
from idemflow._events import CountingObserver
from idemflow._http import (
    EdgeOptions,
    HTTPRequest,
    problem_for,
    request_id_from,
    stored_form,
    storing,
    unsendable,
)
from idemflow.testing import AsyncMemoryStore
from idemflow_demo.settings import parse_duration, parse_token


def storable(response: Response, *, max_bytes: int) -> Response:
    """What the edge stores of ``response`` where the effect rolls back with the claim."""
    return stored_form(storing(response, Verdict.COMPLETED, atomic=True, max_bytes=max_bytes))


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
    ("error", "status", "retry_after", "retryable"),
    [
        (KeyReused("x"), 422, None, False),
        (InProgress("x", retry_after=3), 409, "3", True),
        (StoreUnavailable("x", retry_after=2), 503, "2", True),
        (MissingPrincipal("x"), 401, None, False),
        (ResponseNotStorable("x"), 500, None, False),
    ],
)
def test_every_error_renders_as_an_rfc_9457_problem(
    error: Exception, status: int, retry_after: str | None, retryable: bool
) -> None:
    response = problem_for(error, "rid")  # type: ignore[arg-type]
    body = json.loads(response.body)
    assert response.status == status
    assert response.header("content-type") == "application/problem+json"
    assert set(body) == {"type", "title", "status", "detail", "retryable"}
    assert body["status"] == status
    assert body["retryable"] is retryable
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


# --- issue 9: the whole response is checked before anything is stored --------------------


@pytest.mark.parametrize(
    ("response", "why"),
    [
        (Response(201, b"", (("content-disposition", "attachment; filename=\u20ac"),)), "latin-1"),
        (Response(201, b"", (("location", "/a\r\nset-cookie: x=1"),)), "location"),
        (Response(201, b"", (("location", "/a\nb"),)), "LF"),
        (Response(201, b"", (("location", "/a\x00"),)), "NUL"),
        (Response(201, b"", (("x-bad name", "v"),)), "token"),
        (Response(201, b"", (("", "v"),)), "token"),
        (Response(99, b""), "final HTTP status"),
        (Response(600, b""), "final HTTP status"),
    ],
)
def test_a_response_that_cannot_be_sent_is_named_and_never_storable(
    response: Response, why: str
) -> None:
    reason = unsendable(response)
    assert reason is not None
    assert why in reason
    with pytest.raises(ResponseNotStorable):
        storable(response, max_bytes=10)


def test_tabs_and_latin_1_header_values_are_sendable() -> None:
    response = Response(201, b"{}", (("content-disposition", "inline;\tfilename=caf\u00e9"),))
    assert unsendable(response) is None


def marked_intent_request(key: str) -> HTTPRequest:
    return request(headers=[(b"idempotency-key", key.encode())], path_params={"id": "pay_9"})


@pytest.mark.anyio
async def test_without_a_transaction_an_unsendable_response_settles_a_marker_never_released() -> (
    None
):
    """Defect 8: the effect is not ours to roll back, so the key must not run it again."""
    store = AsyncMemoryStore()
    idempotency = AsyncIdempotency(store)
    edge = Edge(idempotency)
    runs = 0

    async def handler(attempt: object) -> Response:
        nonlocal runs
        runs += 1
        return Response(201, b"{}", (("location", "/payments/9\r\nx: y"),))

    first = await edge.respond(marked_intent_request("k-marker"), handler)
    again = await edge.respond(marked_intent_request("k-marker"), handler)
    assert runs == 1
    body = json.loads(first.body)
    assert first.status == 500
    assert body["type"].endswith("/response-not-stored")
    assert (body["original_status"], body["location"]) == (201, "/payments/9\r\nx: y")
    assert again.body == first.body
    assert again.header("idempotent-replayed") == "true"
    record = await store.get("alice", "k-marker")
    assert record is not None
    assert record.state == "completed"
    assert idempotency.policy.classify is default_classifier  # the caller's driver is untouched


@pytest.mark.anyio
async def test_a_marker_for_a_transient_response_is_released_like_the_response() -> None:
    store = AsyncMemoryStore()
    edge = Edge(AsyncIdempotency(store))

    async def handler(attempt: object) -> Response:
        return Response(503, b"", (("retry-after", "1\r\n"),))

    answer = await edge.respond(marked_intent_request("k-503"), handler)
    assert answer.status == 500
    assert "transient" in json.loads(answer.body)["detail"]
    record = await store.get("alice", "k-503")
    assert record is not None
    assert record.state == "released"


def test_the_query_string_is_fingerprinted_in_canonical_form() -> None:
    """Defect 9: the query string is part of the request."""
    edge = Edge(AsyncIdempotency(AsyncMemoryStore()))
    plain = edge.intent(request())
    assert plain.fingerprint == edge.intent(request(query="")).fingerprint
    one = edge.intent(request(query="x=1&y=2"))
    assert one.fingerprint == edge.intent(request(query="y=2&x=%31")).fingerprint
    assert one.fingerprint != edge.intent(request(query="x=2&y=2")).fingerprint
    assert one.fingerprint != plain.fingerprint
    assert one.endpoint == plain.endpoint  # the label never carries values


def test_negative_body_limits_are_refused() -> None:
    with pytest.raises(ConfigurationError):
        EdgeOptions(max_body_bytes=-1)


@pytest.mark.anyio
async def test_a_refused_replay_is_403_counted_and_the_stored_body_is_not_sent() -> None:
    """The authorization hook asked again on a replay says no: a 403 problem, none of the
    stored body, the handler not run again, and ``replay_forbidden`` counted (next to the
    ``replayed`` the claim found); a first execution never asks it."""
    counted = CountingObserver()
    asked: list[str] = []
    allow = [True]

    def may_replay(record: Record) -> bool:
        asked.append(record.key)
        return allow[0]

    edge = Edge(
        AsyncIdempotency(AsyncMemoryStore(), observer=counted),
        EdgeOptions(authorize_replay=may_replay),
    )
    runs = 0

    async def handler(attempt: object) -> Response:
        nonlocal runs
        runs += 1
        return Response(201, b'{"id": "pay_secret"}')

    first = await edge.respond(request(), handler)
    allow[0] = False
    refused = await edge.respond(request(), handler)
    allow[0] = True
    replayed = await edge.respond(request(), handler)

    assert (first.status, refused.status, replayed.status) == (201, 403, 201)
    assert json.loads(refused.body)["type"].endswith("/replay-forbidden")
    assert b"pay_secret" not in refused.body
    assert replayed.body == first.body
    assert (runs, asked) == (1, ["k-1", "k-1"])
    assert counted.total(Event.REPLAYED) == 2
    assert counted.total(Event.REPLAY_FORBIDDEN) == 1
