"""The vocabulary of idemflow: states, records, responses, the policy, lease tokens.
Durations are ``timedelta`` or seconds; time comes from an injected clock (epoch seconds)."""

from __future__ import annotations

import enum
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeAlias

from ._errors import ConfigurationError

#: Returns the current time in seconds since the epoch. ``time.time`` by default.
Clock: TypeAlias = Callable[[], float]
Duration: TypeAlias = timedelta | float | int


def seconds(duration: Duration) -> float:
    """A duration in seconds; plain numbers already are."""
    if isinstance(duration, timedelta):
        return duration.total_seconds()
    return float(duration)


class State(enum.StrEnum):
    """Where a key record is in its life. Absent records have no state at all."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED_PERMANENT = "failed_permanent"
    #: A transient failure gave the key back; the next attempt takes it over.
    RELEASED = "released"
    #: The sweeper found the claim older than the stale threshold; being reconciled.
    STALE = "stale"

    @property
    def is_settled(self) -> bool:
        return self in (State.COMPLETED, State.FAILED_PERMANENT)


class Verdict(enum.Enum):
    """What an operation's response means for the key."""

    COMPLETED = State.COMPLETED
    FAILED_PERMANENT = State.FAILED_PERMANENT
    #: Dependency down, timeout, 5xx-class: not stored, the claim is released.
    TRANSIENT = None


@dataclass(frozen=True, slots=True)
class Response:
    """A settled outcome as it is stored and replayed: status, headers, body bytes."""

    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, status: int, content: Any, headers: Iterable[tuple[str, str]] = ()) -> Response:
        """A JSON response (compact, UTF-8) with ``Content-Type: application/json``."""
        body = json.dumps(content, separators=(",", ":"), ensure_ascii=False).encode()
        return cls(status, body, (("content-type", "application/json"), *headers))

    def header(self, name: str) -> str | None:
        """The first header called ``name`` (case-insensitive), if any."""
        wanted = name.lower()
        return next((v for k, v in self.headers if k.lower() == wanted), None)

    def json_body(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class Classified(Response):
    """A response that carries its own verdict instead of the policy's classification
    (the edge's 500 marker that must settle where the policy would release)."""

    verdict: Verdict = Verdict.COMPLETED


@dataclass(frozen=True, slots=True)
class Intent:
    """One request's identity: who sent which key, for what (``fingerprint`` is a digest,
    see `idemflow.fingerprint`, never the body)."""

    principal: str
    key: str
    fingerprint: str
    endpoint: str = ""
    correlation_id: str | None = None


@dataclass(frozen=True, slots=True)
class Record:
    """What the store holds for one ``(principal, key)``. Times are epoch seconds."""

    id: int | str
    principal: str
    key: str
    fingerprint: str
    endpoint: str
    state: State
    lease_token: str | None
    created_at: float
    updated_at: float
    expires_at: float
    correlation_id: str | None = None
    recovery_point: str | None = None
    response: Response | None = None
    attempt: int = 1
    #: When the sweeper may act on it: the claim's own stale deadline (in progress, and
    #: released past a recovery point), chosen from the policy it was claimed under; the
    #: moment it was marked (stale). None where a store did not say (a hand-built record).
    stale_at: float | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """The answer of the atomic claim: did *we* get the record, and what it holds now."""

    owned: bool
    record: Record


@dataclass(frozen=True, slots=True)
class Outcome:
    """What `Idempotency.run` returns: the response and whether it was a replay (then
    ``record.correlation_id`` names the original request)."""

    response: Response
    replayed: bool
    record: Record


# Lease tokens need only be unique: a per-process random prefix (drawn again at fork)
# and a counter, cheaper than ``os.urandom`` per claim.
_lease_prefix = ""
_lease_counter = itertools.count()


def _reseed_leases() -> None:
    global _lease_prefix, _lease_counter  # noqa: PLW0603 -- one process-wide sequence, by design
    _lease_prefix = os.urandom(12).hex()
    _lease_counter = itertools.count()


_reseed_leases()
os.register_at_fork(after_in_child=_reseed_leases)


def new_lease_token() -> str:
    """A token no other claim, in this process or any other, has had."""
    # count() is atomic under the GIL; the prefix's fixed length keeps tokens distinct.
    return _lease_prefix + str(next(_lease_counter))


def can_take_over(record: Record, fingerprint: str, now: float) -> bool:
    """May a new claim take this record over? A released one: by the same request; past
    retention: by any; one in flight or being recovered: never. The one definition:
    stores decide it again atomically, and the contract suite checks they agree."""
    return is_retry(record, fingerprint) or is_past_retention(record, now)


def is_retry(record: Record, fingerprint: str) -> bool:
    """The same request again, after a transient failure gave the key back."""
    return record.state is State.RELEASED and record.fingerprint == fingerprint


def is_past_retention(record: Record, now: float) -> bool:
    """Is the key free for a new intent? Settled records past retention, and released ones
    without a recovery point (past one, only a reconcile or a retry may resume it)."""
    if record.expires_at > now:
        return False
    if record.state is State.RELEASED:
        return record.recovery_point is None
    return record.state.is_settled


def starts_new_intent(record: Record, fingerprint: str, now: float) -> bool:
    """Does taking ``record`` over begin a new intent (progress and downstream keys reset)?"""
    return is_past_retention(record, now) and not is_retry(record, fingerprint)


def default_classifier(response: Response) -> Verdict:
    """2xx/3xx are completed; 408, 425, 429 and 5xx are transient; other 4xx are permanent."""
    status = response.status
    if status < 400:
        return Verdict.COMPLETED
    if status in (408, 425, 429) or status >= 500:
        return Verdict.TRANSIENT
    return Verdict.FAILED_PERMANENT


# A claim is stale this many request timeouts old, plus the margin: by then the
# timeout has killed its request.
STALE_MULTIPLIER = 2.0
STALE_MARGIN = timedelta(seconds=10)
# Passes per stale threshold: a crashed claim ends within threshold × 1.1.
SWEEPS_PER_THRESHOLD = 10
# One store call waits at most this share of the request timeout (and the cap): a hung
# store answers 503 while the request still has time to send it.
STORE_WAIT_SHARE = 0.5
STORE_WAIT_CAP = timedelta(seconds=5)
#: The store wait of the run being served (its route's policy): a store whose waits may
#: differ per request (the app's own engine pool) waits no longer; None outside a run.
RUN_STORE_WAIT: ContextVar[float | None] = ContextVar("idemflow_run_store_wait", default=None)


@dataclass(frozen=True, slots=True)
class Policy:
    """How keys behave. Every duration is a ``timedelta`` or a number of seconds.

    Args:
        request_timeout: the longest a protected request can run (what your
            proxy or server enforces). The stale threshold is derived from it.
        retention: how long a settled outcome is replayed, from the moment it settled
            (Stripe keeps at least 24 h); it never ends a claim in flight.
        stale_after: when an ``in_progress`` claim counts as crashed. Defaults to
            ``2 × request_timeout + 10 s``; anything closer to the timeout is
            rejected: the sweeper would release live claims.
        retry_after: the least ``Retry-After`` on 409 answers, in whole seconds
            (the hint itself is derived from the record).
        classify: maps a response to completed / failed_permanent / transient."""

    request_timeout: Duration = timedelta(seconds=30)
    retention: Duration = timedelta(hours=24)
    stale_after: Duration | None = None
    retry_after: int = 1
    classify: Callable[[Response], Verdict] = field(default=default_classifier)

    def __post_init__(self) -> None:
        timeout = _positive("request_timeout", self.request_timeout)
        retention = _positive("retention", self.retention)
        minimum = timeout * STALE_MULTIPLIER + seconds(STALE_MARGIN)
        stale = minimum if self.stale_after is None else seconds(self.stale_after)
        if stale < minimum:
            msg = (
                f"stale_after={stale:g}s is unsafe for request_timeout={timeout:g}s: "
                f"it must be at least {STALE_MULTIPLIER:g} × request_timeout + "
                f"{seconds(STALE_MARGIN):g}s = {minimum:g}s, or the sweeper could "
                "release a claim whose request is still running"
            )
            raise ConfigurationError(msg)
        if self.retry_after < 1:
            msg = "retry_after must be at least 1 second"
            raise ConfigurationError(msg)
        object.__setattr__(self, "request_timeout", timedelta(seconds=timeout))
        object.__setattr__(self, "retention", timedelta(seconds=retention))
        object.__setattr__(self, "stale_after", timedelta(seconds=stale))

    def verdict(self, response: Response) -> Verdict:
        """What ``response`` means for the key: its own verdict, or the classifier's."""
        if isinstance(response, Classified):
            return response.verdict
        return self.classify(response)

    @property
    def stale_seconds(self) -> float:
        return seconds(self.stale_after or 0)

    @property
    def store_wait_seconds(self) -> float:
        """The longest one store call waits (all its waits together) before
        ``StoreUnavailable`` (503): half the request timeout, at most 5 s."""
        return min(self.timeout_seconds * STORE_WAIT_SHARE, seconds(STORE_WAIT_CAP))

    @property
    def retention_seconds(self) -> float:
        return seconds(self.retention)

    @property
    def timeout_seconds(self) -> float:
        return seconds(self.request_timeout)

    @property
    def sweep_interval(self) -> float:
        """Seconds between background sweeps by default: a tenth of the stale threshold,
        or the request timeout if shorter."""
        return min(self.stale_seconds / SWEEPS_PER_THRESHOLD, self.timeout_seconds)


def retry_after(record: Record, policy: Policy, now: float) -> int:
    """Whole seconds a 409 on ``record`` asks the client to wait: a live claim as long as
    it has run (never past its timeout); an orphaned one until the sweeper passes its own
    deadline (``stale_at``); a ``stale`` one, a sweep interval. Within ``policy.retry_after``
    and `swept_within`."""
    interval = policy.sweep_interval
    age = max(0.0, now - record.updated_at)
    stale_at = record.stale_at
    if stale_at is None or record.state is State.STALE:  # undated, or dated at its mark
        stale_at = (record.updated_at if stale_at is None else stale_at) + policy.stale_seconds
    swept_by = stale_at + interval - now
    wait = 0.0
    if record.state is State.IN_PROGRESS:
        timeout = policy.timeout_seconds
        wait = min(age, timeout - age) if age < timeout else max(swept_by, interval)
    elif record.state is State.STALE:
        wait = interval if age < interval else max(swept_by, interval)
    return max(policy.retry_after, min(math.ceil(wait), swept_within(policy)))


def swept_within(policy: Policy) -> int:
    """Whole seconds until the sweeper has passed over a claim left now (the longest
    ``Retry-After``)."""
    return max(policy.retry_after, math.ceil(policy.stale_seconds + policy.sweep_interval))


def _positive(name: str, value: Duration) -> float:
    number = seconds(value)
    if not math.isfinite(number) or number <= 0:
        msg = f"{name} must be a positive duration, got {value!r}"
        raise ConfigurationError(msg)
    return number


#: The stale threshold of the default policy: a claim's when its caller names none.
DEFAULT_STALE_SECONDS = Policy().stale_seconds


# Stored headers as JSON and their tuple, remembered both ways for the stores' hot
# paths (an endpoint's responses mostly share headers; tuples are safe to share).
_DECODED: dict[str | bytes, tuple[tuple[str, str], ...]] = {}
_ENCODED: dict[tuple[tuple[str, str], ...], str] = {}
_CACHED = 512


def stored_headers(text: Any) -> tuple[tuple[str, str], ...]:
    """Headers decoded from their stored JSON (a driver's buffer type is decoded, not kept)."""
    headers = _DECODED.get(text) if isinstance(text, str | bytes) else None
    if headers is None:
        headers = tuple((str(k), str(v)) for k, v in json.loads(text)) if text else ()
        if len(_DECODED) >= _CACHED:
            _DECODED.clear()
        if isinstance(text, str | bytes):
            _DECODED[text] = headers
    return headers


def headers_json(headers: tuple[tuple[str, str], ...]) -> str:
    """Headers as stored: JSON ``[[name, value], …]``."""
    text = _ENCODED.get(headers)
    if text is None:
        text = json.dumps([list(pair) for pair in headers], separators=(",", ":"))
        if len(_ENCODED) >= _CACHED:
            _ENCODED.clear()
        _ENCODED[headers] = text
    return text


# The stores' decoders build these positionally, every field given. Plain construction:
# the ``__class__``-swap builders that stood here saved about 3 µs a request, under 1 %
# of a protected request's added CPU (issue 32: a trick stays only for 5 %).
make_record = Record
make_response = Response
make_claim = Claim


def now_ms(clock: Clock = time.time) -> int:
    return int(clock() * 1000)
