"""
The storm's clients: several at once per key, each one operation of ``idemflow.client``.

A client sends its key's payment once through the library's async transport
(:class:`idemflow.client.AsyncIdempotentTransport`), the client half of the
protocol, so the storm proves it too: the transport keeps the plan's key,
retries dropped and refused connections (the server was just killed) with
jittered exponential backoff, retries 409 and 503 after ``Retry-After``, and
stops at a settled answer (201 or 402) or the storm's deadline, which kills
past the window push back. Every attempt is counted through the transport's
``on_attempt`` observer, and every 409 or 503 answered without the
``Retry-After`` its problem promises is counted apart (a violation).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from idemflow.client import (
    DEADLINE,
    DEFAULT_RETRY_STATUSES,
    AsyncIdempotentTransport,
    AttemptReport,
    RetryPolicy,
    replayed,
)

from .config import KeyPlan, StormConfig

__all__ = ["SETTLED", "Deadline", "KeyTally", "new_client", "send_payment"]

#: Answers that end a client's retries: the payment's outcome, stored for replay.
SETTLED = frozenset({201, 402})
#: Answers that must say when to come back: in flight (409), unavailable (503).
NEEDS_RETRY_AFTER = frozenset({409, 503})
#: Retried besides the client's defaults (409 in flight, 503, …): a 500 releases
#: the key too, and a storm client presses on through it as HTTP allows.
RETRIED = DEFAULT_RETRY_STATUSES | {500}
FIRST_BACKOFF = 0.1  # seconds: the first backoff ceiling; it doubles up to the storm's cap


@dataclass
class Deadline:
    """When clients give up, on the event loop's clock; kills past the window push it back."""

    at: float

    def extend_to(self, at: float) -> None:
        self.at = max(self.at, at)

    def left(self, loop: asyncio.AbstractEventLoop) -> float:
        return self.at - loop.time()


@dataclass
class KeyTally:
    """Everything the clients of one key saw."""

    plan: KeyPlan
    requests: int = 0
    errors: int = 0
    replays: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    #: The distinct settled answers, ``(status, body)``: exactly one is correct.
    answers: set[tuple[int, bytes]] = field(default_factory=set)
    #: Was the latest settled answer marked as a replay?
    last_replayed: bool = False
    #: The closing retry after the storm: None if not made, else did it replay the answer?
    late_replayed: bool | None = None
    #: 409 and 503 answers that came without ``Retry-After``.
    without_retry_after: int = 0

    @property
    def resolved(self) -> bool:
        return bool(self.answers)

    @property
    def settled(self) -> int:
        """Settled answers received (several per key: one per client, plus the late retry)."""
        return sum(self.statuses[status] for status in SETTLED)

    def saw(self, response: httpx.Response) -> None:
        """The answer an operation ended with."""
        self.statuses[response.status_code] += 1
        if response.status_code in SETTLED:
            self.answers.add((response.status_code, response.content))
            self.last_replayed = replayed(response)
            self.replays += self.last_replayed

    def attempted(self, report: AttemptReport) -> None:
        """One attempt; an answer the client retried is counted here, the last by :meth:`saw`."""
        self.requests += 1
        if report.failure is not None:
            self.errors += 1
        elif report.status is not None and report.decision.retry:
            self.statuses[report.status] += 1


def new_client(
    url: str, config: StormConfig, tallies: Sequence[KeyTally], rng: random.Random
) -> httpx.AsyncClient:
    """One connection pool and one keyed transport for all clients; attempts tallied by key.

    Waiting for a pooled connection never times out (the deadline still bounds it).
    """
    by_key = {tally.plan.key: tally for tally in tallies}

    def attempted(report: AttemptReport) -> None:
        tally = by_key.get(report.key)
        if tally is not None:
            tally.attempted(report)

    policy = RetryPolicy(
        backoff=FIRST_BACKOFF,
        max_backoff=config.max_backoff,
        retry_statuses=RETRIED,
        random=rng.random,
    )
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    checked = RetryAfterCheck(httpx.AsyncHTTPTransport(limits=limits), by_key)
    transport = AsyncIdempotentTransport(checked, policy=policy, on_attempt=attempted)
    timeout = httpx.Timeout(3 * config.request_timeout + 10, pool=None)
    return httpx.AsyncClient(base_url=url, timeout=timeout, transport=transport)


class RetryAfterCheck(httpx.AsyncBaseTransport):
    """Under the retrying transport: every answer, each 409 and 503 checked for ``Retry-After``."""

    def __init__(self, inner: httpx.AsyncBaseTransport, tallies: dict[str, KeyTally]) -> None:
        self.inner = inner
        self.tallies = tallies

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if response.status_code in NEEDS_RETRY_AFTER and "retry-after" not in response.headers:
            tally = self.tallies.get(request.headers.get("idempotency-key", ""))
            if tally is not None:
                tally.without_retry_after += 1
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def headers_for(plan: KeyPlan, config: StormConfig) -> dict[str, str]:
    return {
        "authorization": f"Bearer {config.tokens[plan.principal]}",
        "idempotency-key": plan.key,
        "content-type": "application/json",
    }


async def send_payment(
    http: httpx.AsyncClient, tally: KeyTally, config: StormConfig, deadline: Deadline
) -> None:
    """Send ``tally.plan``'s payment: the client retries it until settled or the deadline."""
    loop = asyncio.get_running_loop()
    if deadline.left(loop) <= 0:
        return

    def left() -> float:
        return deadline.left(loop)

    try:
        response = await http.post(
            "/payments",
            content=tally.plan.body,
            headers=headers_for(tally.plan, config),
            extensions={DEADLINE: left},
        )
    except httpx.TransportError:
        return  # no answer by the deadline (every attempt was counted)
    tally.saw(response)
