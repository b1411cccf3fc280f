"""The client's retry policy, sans I/O: the transports send, tell an `Operation` what came
back, and sleep for its `Decision` or stop. The rules: docs/client.md, "What is retried"."""

from __future__ import annotations

import enum
import json
import math
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, timedelta
from email.utils import parsedate_to_datetime
from typing import TypeAlias

from .._errors import ConfigurationError
from .._model import Duration, seconds
from ._keys import (
    REDIRECT_STATUSES,
    KeyFactory,
    KeyForm,
    KeyLedger,
    Redirect,
    SentKey,
    excerpt,
    request_fingerprint,
    scope_of,
    uuid4_key,
)

#: Methods that get a key and the retry loop; others pass through untouched.
DEFAULT_METHODS = frozenset({"POST", "PATCH"})
#: Statuses that settle nothing: retried (409 only while in flight).
DEFAULT_RETRY_STATUSES = frozenset({408, 409, 425, 429, 502, 503, 504})
#: Where a transport puts the `ClientOutcome` (httpx ``response.extensions``).
OUTCOME = "idemflow.client"
#: Where it is kept on what has no extensions: a ``requests.Response``, an error raised.
OUTCOME_ATTRIBUTE = "_idemflow_outcome"
#: A per-request deadline: seconds, a ``timedelta``, or a function returning the seconds left.
Deadline: TypeAlias = Duration | Callable[[], float]

REPLAYED_HEADER = "idempotent-replayed"
#: Problem types (RFC 9457) that mean "the first request with this key is in flight".
IN_FLIGHT_PROBLEMS = ("/in-progress", "/lease-lost")
#: A problem body longer or deeper than this is not read (the JSON parser recurses per level).
MAX_PROBLEM_BYTES = 64 * 1024
MAX_PROBLEM_DEPTH = 32
#: A JSON string (skipped whole; one left open runs to the end: never quadratic) or a bracket.
_STRUCTURE = re.compile(rb'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)


class Failure(enum.Enum):
    """How an attempt ended without an answer; each transport maps its library's errors."""

    CONNECT = "connect error"  # nothing was sent
    TIMEOUT = "read timeout"  # it may have run
    DISCONNECTED = "connection lost"  # it may have run
    FATAL = "not retryable"  # not the network: TLS, a proxy, a protocol error


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do after an attempt: retry after ``delay`` seconds, or stop."""

    retry: bool
    delay: float
    reason: str


@dataclass(frozen=True, slots=True)
class AttemptReport:
    """One attempt, as an ``on_attempt`` observer sees it (``status`` None: ``failure``)."""

    key: str
    number: int
    status: int | None
    failure: Failure | None
    error: BaseException | None
    decision: Decision


#: Called after every attempt (logs, metrics, tests).
Observer: TypeAlias = Callable[[AttemptReport], None]


@dataclass(frozen=True, slots=True)
class ClientOutcome:
    """How an operation ended; see [`idemflow.client.outcome`][idemflow.client.outcome]."""

    key: str
    attempts: int
    #: The final answer is the server's stored one (``Idempotent-Replayed: true``).
    replayed: bool
    status: int | None
    #: Retrying stopped at the deadline or ``max_attempts``: the operation's fate is unknown.
    exhausted: bool
    reason: str
    elapsed: float


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How the client keys and retries unsafe requests (docs/client.md has each field).

    ``deadline`` bounds one operation, attempts and waits together; ``backoff`` is the
    first retry's jitter ceiling, doubling up to ``max_backoff``; ``clock`` (monotonic),
    ``wall_clock`` (for an HTTP-date ``Retry-After``) and ``random`` are injected in tests.
    """

    methods: frozenset[str] = DEFAULT_METHODS
    deadline: Duration = timedelta(seconds=30)
    max_attempts: int | None = None
    backoff: Duration = timedelta(milliseconds=100)
    max_backoff: Duration = timedelta(seconds=5)
    retry_statuses: frozenset[int] = DEFAULT_RETRY_STATUSES
    key_factory: KeyFactory = uuid4_key
    key_form: KeyForm = KeyForm.BARE
    clock: Callable[[], float] = field(default=time.monotonic)
    wall_clock: Callable[[], float] = field(default=time.time)
    random: Callable[[], float] = field(default=random.random)

    def __post_init__(self) -> None:
        for name in ("deadline", "backoff", "max_backoff"):
            value = seconds(getattr(self, name))
            if not math.isfinite(value) or value <= 0:
                msg = f"{name} must be a positive duration, got {getattr(self, name)!r}"
                raise ConfigurationError(msg)
            object.__setattr__(self, name, timedelta(seconds=value))
        if self.max_attempts is not None and self.max_attempts < 1:
            msg = "max_attempts must be at least 1 (or None)"
            raise ConfigurationError(msg)
        object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))
        unsettled = {s for s in self.retry_statuses if not 400 <= s <= 599}
        if unsettled:
            msg = f"retry_statuses must be 4xx or 5xx, got {sorted(unsettled)}"
            raise ConfigurationError(msg)

    def manages(self, method: str) -> bool:
        return method.upper() in self.methods


class Operation:
    """One logical request: its key, and the decisions after each attempt (never shared)."""

    def __init__(
        self,
        policy: RetryPolicy,
        sent: SentKey,
        deadline: Deadline | None = None,
        observer: Observer | None = None,
        on_redirect: Callable[[int, str], None] | None = None,
    ) -> None:
        self.policy = policy
        self.sent = sent
        self._observer: Observer = observer if observer is not None else (lambda report: None)
        # Without a ledger (tests), no rule for where the key may follow a redirect.
        self._on_redirect = on_redirect or (lambda status, location: None)
        self.attempts = 0
        self._started = policy.clock()
        chosen = policy.deadline if deadline is None else deadline  # 0 is a deadline too
        if callable(chosen):
            self._left = chosen
        else:
            end = self._started + seconds(chosen)
            self._left = lambda: end - policy.clock()
        self._last: Decision | None = None
        self._exhausted = False
        self._status: int | None = None
        self._replayed = False

    @property
    def key(self) -> str:
        return self.sent.key

    def time_left(self) -> float:
        """Seconds until the deadline (negative once it passed)."""
        return self._left()

    def cap(self, timeout: float | None) -> float | None:
        """An attempt's timeout cut to the time left; the first attempt is always made."""
        left = self.time_left()
        if left <= 0:
            return timeout
        return left if timeout is None else min(timeout, left)

    def answered(self, status: int, headers: Mapping[str, str], body: bytes = b"") -> Decision:
        """An answer came back; ``headers`` is case-insensitive."""
        self.attempts += 1
        self._status = status
        self._replayed = is_replay(headers)
        decision = self._after_answer(status, headers, body)
        location = headers.get("location")
        if status in REDIRECT_STATUSES and location is not None and not decision.retry:
            self._on_redirect(status, location)
        self._observer(AttemptReport(self.key, self.attempts, status, None, None, decision))
        return decision

    def failed(self, failure: Failure, error: BaseException | None = None) -> Decision:
        """No answer came back; a final ``error`` gets a note saying why retrying stopped."""
        self.attempts += 1
        self._status = None
        self._replayed = False
        if failure is Failure.FATAL:
            decision = self._stop(failure.value)
        else:
            decision = self._retry(self._jitter(), failure.value)
        self._observer(AttemptReport(self.key, self.attempts, None, failure, error, decision))
        if error is not None and not decision.retry:
            # The request may have run: the caller needs the key to retry it by hand.
            setattr(error, OUTCOME_ATTRIBUTE, self.outcome())
            error.add_note(
                f"idemflow.client: Idempotency-Key {excerpt(self.key)}, "
                f"{self.attempts} attempt(s): {decision.reason}"
            )
        return decision

    def outcome(self) -> ClientOutcome:
        why = (self._last or Decision(False, 0.0, "not sent")).reason
        elapsed = self.policy.clock() - self._started
        ended = (self._replayed, self._status, self._exhausted, why, elapsed)
        return ClientOutcome(self.key, self.attempts, *ended)

    def _after_answer(self, status: int, headers: Mapping[str, str], body: bytes) -> Decision:
        if self._replayed:
            return self._stop(f"{status}, replayed: settled")
        if not self._retryable(status, headers, body):
            return self._stop(f"{status}: settled")
        wanted = parse_retry_after(headers.get("retry-after"), self.policy.wall_clock())
        if wanted is None:
            return self._retry(self._jitter(), f"{status}")
        return self._retry(max(wanted, self._jitter()), f"{status}, Retry-After {wanted:g} s")

    def _retryable(self, status: int, headers: Mapping[str, str], body: bytes) -> bool:
        """The status decides; a problem's ``retryable`` vetoes, or marks a 409/5xx transient."""
        problem = read_problem(headers, body)
        says = problem.get("retryable") if problem is not None else None
        if says is False:
            return False
        if status == 409:
            return status in self.policy.retry_statuses and _in_flight(headers, problem, says)
        return status in self.policy.retry_statuses or (status >= 500 and says is True)

    def _jitter(self) -> float:
        """Full jitter: uniform in [0, min(max_backoff, backoff × 2^retries))."""
        retries = max(self.attempts - 1, 0)
        ceiling = seconds(self.policy.backoff) * 2.0 ** min(retries, 60)
        return self.policy.random() * min(seconds(self.policy.max_backoff), ceiling)

    def _retry(self, delay: float, why: str) -> Decision:
        limit = self.policy.max_attempts
        if limit is not None and self.attempts >= limit:
            return self._stop(f"gave up after {self.attempts} attempts: {why}", exhausted=True)
        if delay >= self.time_left():
            return self._stop(f"gave up at the deadline: {why}", exhausted=True)
        self._last = Decision(True, delay, why)
        return self._last

    def _stop(self, why: str, *, exhausted: bool = False) -> Decision:
        self._exhausted = exhausted
        self._last = Decision(False, 0.0, why)
        return self._last


class Operations:
    """A transport's start of every operation: the policy, and the keys it sent (one ledger)."""

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        ledger: KeyLedger | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.policy = policy or RetryPolicy()
        # Not `ledger or …`: an empty ledger is falsy, and a shared one must stay shared.
        self.ledger = ledger if ledger is not None else KeyLedger()
        self.observer = observer

    def start(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        key_values: Sequence[str],
        body: bytes,
        deadline: Deadline | None = None,
    ) -> Operation:
        """One request's key and retry state; InvalidKey, or KeyReusedLocally (sent before)."""
        scope, fingerprint = scope_of(url, headers), request_fingerprint(method, url, body)
        policy = self.policy
        sent = self.ledger.choose(
            key_values, policy.key_factory, policy.key_form, scope=scope, fingerprint=fingerprint
        )

        def redirected(status: int, location: str) -> None:
            self.ledger.redirected(Redirect(scope, sent.key, method, url, body, status, location))

        return Operation(self.policy, sent, deadline, self.observer, redirected)


def is_replay(headers: Mapping[str, str]) -> bool:
    """Is this the server's stored answer (``Idempotent-Replayed: true``)?"""
    value = (headers.get(REPLAYED_HEADER) or "").strip().lower()
    return value in ("true", "?1")


def parse_retry_after(value: str | None, now: float) -> float | None:
    """``Retry-After`` (seconds or an HTTP-date) in seconds from ``now``, or None if invalid."""
    if value is None:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return float(text)
    try:
        when = parsedate_to_datetime(text)
        if when.tzinfo is None:  # asctime carries no zone: HTTP dates are GMT
            when = when.replace(tzinfo=UTC)
        wait = when.timestamp() - now
    except (TypeError, ValueError, IndexError, OverflowError):  # any value a server sends
        return None
    return max(0.0, wait) if math.isfinite(wait) else None


def read_problem(headers: Mapping[str, str], body: bytes) -> dict[str, object] | None:
    """The RFC 9457 problem an answer carries, or None; never raises (a hostile server)."""
    media_type = (headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media_type != "application/problem+json":
        return None
    if len(body) > MAX_PROBLEM_BYTES or _nesting(body) > MAX_PROBLEM_DEPTH:
        return None
    try:
        problem = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):  # RecursionError: the caller's own stack was deep
        return None
    return problem if isinstance(problem, dict) else None


def _nesting(body: bytes) -> int:
    """How deep arrays and objects nest in ``body``, found without recursion."""
    depth = deepest = 0
    for token in _STRUCTURE.finditer(body):
        bracket = token[0]
        if bracket in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif bracket in (b"]", b"}"):
            depth -= 1
    return deepest


def _in_flight(headers: Mapping[str, str], problem: dict[str, object] | None, says: object) -> bool:
    """A 409 that says "still running" (any other is a settled conflict)."""
    if headers.get("retry-after") is not None or says is True:
        return True
    kind = problem.get("type") if problem is not None else None
    return isinstance(kind, str) and kind.endswith(IN_FLIGHT_PROBLEMS)
