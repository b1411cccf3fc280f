"""
Policy: the stale threshold is derived from the request timeout, and unsafe settings are refused.
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest

from idemflow import (
    ConfigurationError,
    Policy,
    Record,
    Response,
    State,
    Verdict,
    default_classifier,
)
from idemflow._model import retry_after
from idemflow.testing import FrozenClock


def test_defaults_derive_the_stale_threshold_from_the_timeout() -> None:
    """By default: 30 s timeout, 24 h retention, stale after 2 × 30 s + 10 s."""
    policy = Policy()

    assert policy.request_timeout == timedelta(seconds=30)
    assert policy.retention == timedelta(hours=24)
    assert policy.stale_after == timedelta(seconds=70)
    assert policy.stale_seconds == 70.0
    assert policy.retention_seconds == 86_400.0
    assert policy.retry_after == 1
    assert policy.classify is default_classifier


@pytest.mark.parametrize(("timeout", "expected"), [(1, 12.0), (5, 20.0), (60, 130.0), (0.5, 11.0)])
def test_stale_threshold_is_twice_the_timeout_plus_ten_seconds(
    timeout: float, expected: float
) -> None:
    """No request outlives its timeout, so twice that plus a margin is unambiguously dead."""
    assert Policy(request_timeout=timeout).stale_seconds == expected


def test_timedelta_and_seconds_are_the_same_duration() -> None:
    """Every duration takes a timedelta or a number of seconds (int or float)."""
    as_numbers = Policy(request_timeout=2.5, retention=600, stale_after=30.0)
    as_timedeltas = Policy(
        request_timeout=timedelta(seconds=2.5),
        retention=timedelta(minutes=10),
        stale_after=timedelta(seconds=30),
    )

    assert as_numbers == as_timedeltas
    assert as_numbers.request_timeout == timedelta(seconds=2.5)
    assert as_numbers.stale_after == timedelta(seconds=30)
    assert as_numbers.retention == timedelta(seconds=600)


def test_stale_threshold_may_be_longer_than_the_minimum() -> None:
    """A more patient sweeper is always safe."""
    policy = Policy(request_timeout=30, stale_after=timedelta(minutes=15))

    assert policy.stale_seconds == 900.0


def test_stale_threshold_exactly_at_the_minimum_is_accepted() -> None:
    """2 × timeout + 10 s is the boundary, and it is inclusive."""
    assert Policy(request_timeout=30, stale_after=70).stale_seconds == 70.0


@pytest.mark.parametrize("stale_after", [69.999, 60, 30, timedelta(seconds=45), 1])
def test_stale_threshold_below_the_minimum_is_rejected(stale_after: float | timedelta) -> None:
    """A sweeper closer to the timeout could release a live claim: ConfigurationError."""
    with pytest.raises(ConfigurationError) as raised:
        Policy(request_timeout=30, stale_after=stale_after)

    assert "70s" in str(raised.value)
    assert "request_timeout=30s" in str(raised.value)


def test_configuration_error_is_a_value_error() -> None:
    """Callers that catch ValueError for bad settings keep working."""
    with pytest.raises(ValueError, match="stale_after"):
        Policy(request_timeout=30, stale_after=10)


@pytest.mark.parametrize("retention", [70, 2, 0.5, timedelta(seconds=20)])
def test_any_positive_retention_is_accepted_whatever_the_stale_threshold(
    retention: float | timedelta,
) -> None:
    """Retention counts from settlement and never ends a claim in flight (only the
    sweeper does), so it need not exceed the stale threshold: 2 s is a valid retention."""
    policy = Policy(request_timeout=30, retention=retention)
    expected = retention.total_seconds() if isinstance(retention, timedelta) else retention
    assert policy.retention_seconds == expected
    assert policy.stale_seconds == 70


@pytest.mark.parametrize("bad", [0, -1, timedelta(0), math.inf, math.nan, timedelta(seconds=-5)])
@pytest.mark.parametrize("field", ["request_timeout", "retention"])
def test_durations_must_be_positive_and_finite(field: str, bad: float | timedelta) -> None:
    """Zero, negative, infinite and NaN durations are refused with the field's name."""
    with pytest.raises(ConfigurationError, match=field):
        Policy(**{field: bad})  # type: ignore[arg-type]


def test_retry_after_must_be_at_least_one_second() -> None:
    """Retry-After: 0 would invite a hot retry loop."""
    with pytest.raises(ConfigurationError, match="retry_after"):
        Policy(retry_after=0)


def test_policy_is_frozen() -> None:
    """A policy is a value: it cannot be changed after the checks ran."""
    policy = Policy()

    with pytest.raises(AttributeError):
        policy.request_timeout = timedelta(seconds=1)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (200, Verdict.COMPLETED),
        (201, Verdict.COMPLETED),
        (303, Verdict.COMPLETED),
        (400, Verdict.FAILED_PERMANENT),
        (402, Verdict.FAILED_PERMANENT),
        (404, Verdict.FAILED_PERMANENT),
        (409, Verdict.FAILED_PERMANENT),
        (422, Verdict.FAILED_PERMANENT),
        (408, Verdict.TRANSIENT),
        (425, Verdict.TRANSIENT),
        (429, Verdict.TRANSIENT),
        (500, Verdict.TRANSIENT),
        (503, Verdict.TRANSIENT),
        (599, Verdict.TRANSIENT),
    ],
)
def test_default_classifier(status: int, verdict: Verdict) -> None:
    """2xx/3xx completed; 408, 425, 429 and 5xx transient; every other 4xx permanent."""
    assert default_classifier(Response(status)) is verdict


# --- Retry-After: derived from the record, the policy's value is the floor ------

SLOW = Policy(request_timeout=30)  # stale after 70 s, swept every 7 s: nothing ends after 77 s


def claimed_at(clock: FrozenClock, state: State = State.IN_PROGRESS) -> Record:
    """A record whose claim was taken (or last renewed) at the clock's now."""
    now = clock()
    return Record(1, "alice", "k-1", "fp-1", "POST /x", state, "lease", now, now, now + 3600)


def test_the_background_sweep_interval_is_a_tenth_of_the_threshold() -> None:
    """A crashed claim ends within 1.1 × the threshold, not threshold + a request timeout."""
    assert SLOW.sweep_interval == 7.0
    assert Policy(request_timeout=10).sweep_interval == 3.0
    assert Policy(request_timeout=1).sweep_interval == 1.0  # never less often than before


@pytest.mark.parametrize(
    ("age", "expected"),
    [
        (0.0, 1),  # just claimed: it is probably about to finish
        (0.3, 1),
        (10.0, 10),  # has run 10 s: wait as long again
        (25.0, 5),  # but never past the request's own deadline (30 s)
        (30.0, 47),  # timed out without ending: the sweeper ends it at 70 + 7 s
        (60.0, 17),
        (76.5, 7),  # the sweep is due any moment: one interval
        (500.0, 7),  # the sweeper is late (not running?): ask again every interval
    ],
)
def test_a_claims_retry_after_follows_its_age(
    clock: FrozenClock, age: float, expected: int
) -> None:
    """Live: as long as it has run, up to its deadline; orphaned: until the next sweep."""
    record = claimed_at(clock)
    clock.advance(age)

    assert retry_after(record, SLOW, clock()) == expected


@pytest.mark.parametrize(("age", "expected"), [(0.5, 7), (20.0, 57), (100.0, 7)])
def test_a_stale_claims_retry_after_waits_for_its_resolution(
    clock: FrozenClock, age: float, expected: int
) -> None:
    """Fresh marks are being reconciled (one interval); unknown ones are asked again later."""
    record = claimed_at(clock, State.STALE)
    clock.advance(age)

    assert retry_after(record, SLOW, clock()) == expected


@pytest.mark.parametrize("state", [State.RELEASED, State.COMPLETED, State.FAILED_PERMANENT])
def test_records_about_to_change_hands_get_the_floor(clock: FrozenClock, state: State) -> None:
    """Released (a retry is taking it over) or settled without a response: retry soon."""
    record = claimed_at(clock, state)
    clock.advance(40)

    assert retry_after(record, SLOW, clock()) == 1
    assert retry_after(record, Policy(request_timeout=30, retry_after=4), clock()) == 4


def test_the_policys_retry_after_is_a_floor(clock: FrozenClock) -> None:
    """``Policy.retry_after`` (1 s by default) still holds: never less, more when known."""
    policy = Policy(request_timeout=30, retry_after=5)
    record = claimed_at(clock)

    assert retry_after(record, policy, clock()) == 5
    clock.advance(60)
    assert retry_after(record, policy, clock()) == 17


def test_retry_after_is_whole_seconds_within_bounds_at_every_age(clock: FrozenClock) -> None:
    """At least 1 s, at most threshold + one interval, also for a record dated in the future."""
    record = claimed_at(clock)
    clock.advance(-5)  # the store's clock runs ahead of ours
    hints = [retry_after(record, SLOW, clock())]
    for _ in range(400):
        clock.advance(0.25)
        hints += [retry_after(record, SLOW, clock()), retry_after(record, SLOW, clock())]
    assert all(isinstance(hint, int) and 1 <= hint <= 77 for hint in hints)


@pytest.mark.parametrize("timeout", [1, 5, 30, 300])
def test_a_client_honouring_retry_after_asks_a_handful_of_times(
    clock: FrozenClock, timeout: float
) -> None:
    """From the crash until the worst-case sweep, a client asks ~10 times, not once a second.

    With the old constant 1 s it asked threshold + interval times (77 for a 30 s timeout).
    """
    policy = Policy(request_timeout=timeout)
    record = claimed_at(clock)
    resolved_by = record.updated_at + policy.stale_seconds + policy.sweep_interval
    asked = 0
    while clock() < resolved_by:
        asked += 1
        clock.advance(retry_after(record, policy, clock()))
    assert asked <= 12
    assert clock() - resolved_by <= policy.sweep_interval + 1  # and not long after it ended
