"""
The client's retry policy, sans I/O, under a fake clock: every rule, without a network.

An :class:`Operation` is told what each attempt got (an answer, or a failure)
and says whether to retry and after how long. The clock is a
:class:`~idemflow.testing.FrozenClock` the tests move by the delays the policy
asks for; the jitter's random source is fixed.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest

from idemflow import ConfigurationError, InvalidKey, KeyReused, parse_key
from idemflow.client import AttemptReport, KeyForm, RetryPolicy
from idemflow.client._keys import KeyLedger, KeyReusedLocally, encode_key
from idemflow.client._retry import Failure, Operation, Operations, is_replay, parse_retry_after
from idemflow.testing import FrozenClock

URL = "https://api.example/payments"
ALICE = httpx.Headers({"authorization": "Bearer alice"})
BODY = b'{"amount": 1000}'


def headers(**fields: str) -> httpx.Headers:
    """Case-insensitive, as both libraries' headers are."""
    return httpx.Headers({name.replace("_", "-"): value for name, value in fields.items()})


class Dice:
    """A random source that returns the given numbers, then the last one for ever."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def __call__(self) -> float:
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock()


def policy(clock: FrozenClock, **overrides: object) -> RetryPolicy:
    settings: dict[str, object] = {"clock": clock, "wall_clock": clock, "random": Dice(1.0)}
    return RetryPolicy(**{**settings, **overrides})  # type: ignore[arg-type]


def start(
    policy: RetryPolicy,
    *,
    key: str | None = None,
    body: bytes = BODY,
    ledger: KeyLedger | None = None,
) -> Operation:
    values = [] if key is None else [key]
    return Operations(policy, ledger).start("POST", URL, ALICE, values, body)


# --- keys ----------------------------------------------------------------------------------------


def test_a_generated_key_is_a_uuid4_chosen_once_per_operation(clock: FrozenClock) -> None:
    """The key exists before the first attempt and every decision after it keeps it."""
    operation = start(policy(clock))
    key = operation.key
    assert uuid.UUID(key).version == 4
    assert operation.sent.header_value == key  # bare by default
    for _ in range(3):
        assert operation.answered(503, headers()).retry
        assert operation.key == key
    assert start(policy(clock)).key != key  # the next operation: a new key


def test_the_callers_key_is_kept_verbatim(clock: FrozenClock) -> None:
    """A caller's header is never replaced; its sf-string form is read as the server reads it."""
    operation = start(policy(clock), key='"order-42"')
    assert operation.key == "order-42"
    assert operation.sent.header_value is None  # nothing to add: the caller's line goes out
    assert not operation.sent.generated


def test_a_key_factory_and_the_sf_string_form(clock: FrozenClock) -> None:
    """A caller's factory, written as an RFC 9651 String, parses back to the same key."""
    odd = 'a "quoted" \\ key; with, separators'
    operation = start(policy(clock, key_factory=lambda: odd, key_form=KeyForm.SF_STRING))
    value = operation.sent.header_value
    assert value == '"a \\"quoted\\" \\\\ key; with, separators"'
    assert parse_key([value], strict=True) == odd
    assert operation.key == odd


@pytest.mark.parametrize(
    ("key", "form", "problem"),
    [
        ("x" * 256, KeyForm.BARE, "longer than 255"),
        ("x" * 256, KeyForm.SF_STRING, "longer than 255"),
        ("", KeyForm.BARE, "empty"),
        ("café", KeyForm.SF_STRING, "non-ASCII"),
        ("tab\there", KeyForm.SF_STRING, "a tab"),
        ("bell\x07", KeyForm.SF_STRING, "control character"),
        ("two words", KeyForm.BARE, "a space"),
        ("a;b", KeyForm.BARE, "parameters"),
    ],
)
def test_a_key_the_server_would_refuse_is_refused_here(
    clock: FrozenClock, key: str, form: KeyForm, problem: str
) -> None:
    """≤ 255 printable ASCII, and what a bare key cannot hold: checked by the server's parser."""
    with pytest.raises(InvalidKey, match=problem):
        start(policy(clock, key_factory=lambda: key, key_form=form))
    with pytest.raises(InvalidKey, match=problem):
        encode_key(key, form)


def test_a_malformed_caller_key_is_refused_before_sending(clock: FrozenClock) -> None:
    with pytest.raises(InvalidKey, match="lists are not allowed"):
        start(policy(clock), key="a, b")
    assert encode_key("x" * 255, KeyForm.BARE) == "x" * 255  # the longest allowed


def test_one_key_is_never_sent_with_a_second_request(clock: FrozenClock) -> None:
    """Same key, other body, URL or method: refused locally; same request again: allowed."""
    ledger = KeyLedger()
    operations = Operations(policy(clock), ledger)
    operations.start("POST", URL, ALICE, ["k-1"], BODY)
    operations.start("POST", URL, ALICE, ["k-1"], BODY)  # a retry of the same request
    for method, url, body in [
        ("POST", URL, b'{"amount": 2500}'),
        ("POST", URL + "?x=1", BODY),
        ("PATCH", URL, BODY),
    ]:
        with pytest.raises(KeyReusedLocally, match="different request") as raised:
            operations.start(method, url, ALICE, ["k-1"], body)
        assert isinstance(raised.value, KeyReused)  # the server's 422, caught the same way
    bob = httpx.Headers({"authorization": "Bearer bob"})
    operations.start("POST", URL, bob, ["k-1"], b"other")  # another principal: another key
    operations.start("POST", "https://other.example/payments", ALICE, ["k-1"], b"other")


def test_the_ledger_is_bounded(clock: FrozenClock) -> None:
    """The least recently used keys are forgotten first; the server's 422 still guards them."""
    ledger = KeyLedger(capacity=2)
    operations = Operations(policy(clock), ledger)
    for key in ("a", "b", "a", "c"):
        operations.start("POST", URL, ALICE, [key], BODY)
    assert len(ledger) == 2
    operations.start("POST", URL, ALICE, ["b"], b"forgotten, so allowed")
    with pytest.raises(KeyReusedLocally):
        operations.start("POST", URL, ALICE, ["c"], b"remembered")
    with pytest.raises(ValueError, match="at least 1"):
        KeyLedger(capacity=0)


# --- what is retried -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status", [200, 201, 204, 302, 400, 401, 403, 404, 402, 410, 422, 500, 501]
)
def test_settled_answers_are_never_retried(clock: FrozenClock, status: int) -> None:
    operation = start(policy(clock))
    decision = operation.answered(status, headers(retry_after="1"))
    assert not decision.retry
    assert decision.reason == f"{status}: settled"
    assert not operation.outcome().exhausted


@pytest.mark.parametrize("status", [408, 425, 429, 502, 503, 504])
def test_unsettled_answers_are_retried(clock: FrozenClock, status: int) -> None:
    assert start(policy(clock)).answered(status, headers()).retry


def test_a_replay_is_settled_whatever_its_status(clock: FrozenClock) -> None:
    """The server's stored answer (even a 503 stored by a custom classifier) is final."""
    operation = start(policy(clock))
    assert not operation.answered(503, headers(idempotent_replayed="true")).retry
    assert operation.outcome().replayed
    assert is_replay(headers(idempotent_replayed="?1"))
    assert not is_replay(headers(idempotent_replayed="false"))


def test_a_409_is_retried_only_while_in_flight(clock: FrozenClock) -> None:
    """In flight: Retry-After, or the problem type in-progress / lease-lost. Else settled."""
    problem = "application/problem+json"
    in_flight = [
        (headers(retry_after="1"), b""),
        (headers(content_type=problem), b'{"type": "https://idemflow.dev/problems/in-progress"}'),
        (headers(content_type=problem), b'{"type": "https://idemflow.dev/problems/lease-lost"}'),
    ]
    for fields, body in in_flight:
        assert start(policy(clock)).answered(409, fields, body).retry
    assert (
        start(policy(clock))
        .answered(409, headers(content_type=problem), b'{"type": "about:blank", "retryable": true}')
        .retry
    )
    settled = [
        (headers(), b""),
        (headers(content_type="application/json"), b'{"type": "x/in-progress"}'),
        (headers(content_type=problem), b'{"type": "https://example/problems/duplicate"}'),
        (headers(content_type=problem), b"not json"),
        (headers(content_type=problem), b'["in-progress"]'),
    ]
    for fields, body in settled:
        assert not start(policy(clock)).answered(409, fields, body).retry


def test_a_problems_retryable_member_has_the_last_word(clock: FrozenClock) -> None:
    """false vetoes any retry; true makes a 5xx transient; a settled 4xx stays settled."""
    problem = headers(content_type="application/problem+json", retry_after="1")
    never = b'{"type": "x", "retryable": false}'
    for status in (409, 429, 503):
        assert not start(policy(clock)).answered(status, problem, never).retry
    again = b'{"type": "https://idemflow.dev/problems/response-not-stored", "retryable": true}'
    assert start(policy(clock)).answered(500, problem, again).retry
    for status in (400, 422):
        assert not start(policy(clock)).answered(status, problem, again).retry
    assert not start(policy(clock)).answered(500, problem, b'{"retryable": "yes"}').retry


def test_retry_statuses_are_configurable(clock: FrozenClock) -> None:
    """A server whose 500s are transient: add it; a server whose 429s are final: remove it."""
    assert start(policy(clock, retry_statuses={500, 503})).answered(500, headers()).retry
    assert not start(policy(clock, retry_statuses={503})).answered(429, headers()).retry
    with pytest.raises(ConfigurationError, match="4xx or 5xx"):
        policy(clock, retry_statuses={201})


@pytest.mark.parametrize("failure", [Failure.CONNECT, Failure.TIMEOUT, Failure.DISCONNECTED])
def test_lost_answers_are_retried(clock: FrozenClock, failure: Failure) -> None:
    """No answer: the request may have run, and the key makes finding out safe."""
    operation = start(policy(clock))
    assert operation.failed(failure).retry
    assert operation.outcome().status is None


def test_a_fatal_error_stops_and_says_why(clock: FrozenClock) -> None:
    operation = start(policy(clock))
    error = OSError("certificate verify failed")
    assert not operation.failed(Failure.FATAL, error).retry
    assert any("not retryable" in note for note in error.__notes__)


# --- when ----------------------------------------------------------------------------------------


def test_full_jitter_doubles_to_its_cap(clock: FrozenClock) -> None:
    """Delay = random × min(max_backoff, backoff × 2^retries): 0.1, 0.2, 0.4, 0.8, 1, 1 …"""
    operation = start(policy(clock, backoff=0.1, max_backoff=1, random=Dice(1.0)))
    delays = [operation.failed(Failure.CONNECT).delay for _ in range(6)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    jittered = start(policy(clock, backoff=0.1, random=Dice(0.5, 0.0, 0.25)))
    assert [jittered.failed(Failure.CONNECT).delay for _ in range(3)] == pytest.approx(
        [0.05, 0.0, 0.1]
    )


def test_retry_after_seconds_are_honoured(clock: FrozenClock) -> None:
    """Never sooner than the server asks, even when the backoff would say sooner."""
    operation = start(policy(clock, random=Dice(0.0)))
    decision = operation.answered(503, headers(retry_after="3"))
    assert (decision.retry, decision.delay) == (True, 3.0)
    assert decision.reason == "503, Retry-After 3 s"
    # The backoff wins once it is the longer: honoured is "at least".
    late = start(policy(clock, backoff=8, max_backoff=8, random=Dice(1.0)))
    assert late.answered(429, headers(retry_after="2")).delay == 8.0


def test_retry_after_as_an_http_date(clock: FrozenClock) -> None:
    """An HTTP-date is read on the wall clock; one in the past means now."""
    when = datetime.fromtimestamp(clock() + 7, UTC)
    fixdate = format_datetime(when, usegmt=True)
    assert parse_retry_after(fixdate, clock()) == pytest.approx(7.0)
    rfc850 = when.strftime("%A, %d-%b-%y %H:%M:%S GMT")
    assert parse_retry_after(rfc850, clock()) == pytest.approx(7.0)
    asctime = when.strftime("%a %b %e %H:%M:%S %Y")
    assert parse_retry_after(asctime, clock()) == pytest.approx(7.0)
    assert parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", clock()) == 0.0
    operation = start(policy(clock, random=Dice(0.0)))
    assert operation.answered(503, headers(retry_after=fixdate)).delay == pytest.approx(7.0)


@pytest.mark.parametrize("value", [None, "", "soon", "-1", "1.5", "١٢", "Mon, 99 Foo 2020"])
def test_an_unreadable_retry_after_falls_back_to_the_backoff(
    clock: FrozenClock, value: str | None
) -> None:
    assert parse_retry_after(value, clock()) is None
    if value is not None and not value.isascii():
        return  # no header can carry it; parsing it must still be safe
    operation = start(policy(clock, backoff=0.4, random=Dice(0.5)))
    fields = headers() if value is None else headers(retry_after=value)
    assert operation.answered(503, fields).delay == pytest.approx(0.2)


def test_the_deadline_bounds_the_whole_operation(clock: FrozenClock) -> None:
    """A wait that would end past the deadline is not started: give up, say so, keep the answer."""
    operation = start(policy(clock, deadline=timedelta(seconds=10), random=Dice(0.0)))
    waited = 0.0
    while (decision := operation.answered(503, headers(retry_after="3"))).retry:
        clock.advance(decision.delay + 0.5)  # each attempt takes half a second
        waited += decision.delay + 0.5
    assert operation.attempts == 3  # at 0, 3.5 and 7 s; the next wait would end at 10.5 s
    assert waited == pytest.approx(7.0)
    end = operation.outcome()
    assert end.exhausted
    assert end.status == 503
    assert end.reason == "gave up at the deadline: 503, Retry-After 3 s"
    assert end.elapsed == pytest.approx(7.0)


def test_a_retry_after_beyond_the_deadline_gives_up_at_once(clock: FrozenClock) -> None:
    operation = start(policy(clock, deadline=30))
    assert not operation.answered(503, headers(retry_after="3600")).retry
    assert operation.outcome().exhausted


def test_max_attempts(clock: FrozenClock) -> None:
    operation = start(policy(clock, max_attempts=2))
    assert operation.failed(Failure.TIMEOUT).retry
    assert not operation.failed(Failure.TIMEOUT).retry
    assert operation.outcome().reason == "gave up after 2 attempts: read timeout"


def test_a_deadline_that_moves(clock: FrozenClock) -> None:
    """A per-request deadline may be a function returning the seconds left (extended later)."""
    end = [clock() + 2]
    operation = Operations(policy(clock, random=Dice(0.0))).start(
        "POST", URL, ALICE, [], BODY, lambda: end[0] - clock()
    )
    assert not operation.answered(503, headers(retry_after="5")).retry
    end[0] += 10
    assert operation.answered(503, headers(retry_after="5")).retry


def test_timeouts_are_cut_to_the_time_left(clock: FrozenClock) -> None:
    """Each attempt's timeouts end by the deadline; the first attempt is always made."""
    operation = start(policy(clock, deadline=10))
    assert operation.cap(30.0) == 10.0
    assert operation.cap(None) == 10.0
    assert operation.cap(2.0) == 2.0
    clock.advance(12)
    assert operation.time_left() == -2.0
    assert operation.cap(5.0) == 5.0  # past the deadline: never a timeout of zero


def test_every_attempt_is_reported(clock: FrozenClock) -> None:
    seen: list[AttemptReport] = []
    operations = Operations(policy(clock, random=Dice(0.0)), observer=seen.append)
    operation = operations.start("POST", URL, ALICE, [], BODY)
    error = ConnectionResetError()
    operation.failed(Failure.DISCONNECTED, error)
    operation.answered(409, headers(retry_after="1"))
    operation.answered(201, headers())
    assert [(r.number, r.status, r.failure, r.decision.retry) for r in seen] == [
        (1, None, Failure.DISCONNECTED, True),
        (2, 409, None, True),
        (3, 201, None, False),
    ]
    assert seen[0].error is error
    assert {r.key for r in seen} == {operation.key}
    assert operation.outcome().attempts == 3


def test_the_policy_refuses_nonsense() -> None:
    for field in ("deadline", "backoff", "max_backoff"):
        with pytest.raises(ConfigurationError, match=field):
            RetryPolicy(**{field: 0})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    assert RetryPolicy(methods=frozenset({"post", "put"})).manages("PUT")
    assert not RetryPolicy().manages("GET")
    assert RetryPolicy().deadline == timedelta(seconds=30)


def test_a_zero_deadline_is_a_deadline(clock: FrozenClock) -> None:
    """A per-request deadline of 0 is not "none": no retry, though the attempt is made."""
    operation = Operations(policy(clock)).start("POST", URL, ALICE, [], BODY, 0)
    assert operation.time_left() == 0
    assert not operation.failed(Failure.CONNECT).retry
