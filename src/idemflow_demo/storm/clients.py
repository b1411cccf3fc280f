"""
The storm's clients: well-behaved retriers, several at once per key.

A client sends its key's payment until it gets a settled answer (201 or 402)
or the deadline passes. On 409 and 503 it sleeps for ``Retry-After`` (capped,
with jitter, so a crowd does not come back in lockstep); on a dropped or
refused connection (the server was just killed) it backs off exponentially.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

import httpx

from .config import KeyPlan, StormConfig

__all__ = ["SETTLED", "Deadline", "KeyTally", "new_client", "retry_until_answered"]

#: Answers that end a client's retries: the payment's outcome, stored for replay.
SETTLED = frozenset({201, 402})
#: Answers a client retries after ``Retry-After``: in progress, transient.
RETRYABLE = frozenset({409, 503})
REPLAYED_HEADER = "idempotent-replayed"

FIRST_BACKOFF = 0.1  # seconds after the first connection error; doubles up to MAX_BACKOFF
MAX_BACKOFF = 1.0


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

    @property
    def resolved(self) -> bool:
        return bool(self.answers)

    @property
    def settled(self) -> int:
        """Settled answers received (several per key: one per client, plus the late retry)."""
        return sum(self.statuses[status] for status in SETTLED)

    def saw(self, response: httpx.Response) -> None:
        self.statuses[response.status_code] += 1
        if response.status_code in SETTLED:
            self.answers.add((response.status_code, response.content))
            self.last_replayed = response.headers.get(REPLAYED_HEADER) == "true"
            self.replays += self.last_replayed


def new_client(url: str, config: StormConfig) -> httpx.AsyncClient:
    """One connection pool for all clients; waiting for a pooled connection never times out."""
    timeout = httpx.Timeout(3 * config.request_timeout + 10, pool=None)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits)


def headers_for(plan: KeyPlan, config: StormConfig) -> dict[str, str]:
    return {
        "authorization": f"Bearer {config.tokens[plan.principal]}",
        "idempotency-key": plan.key,
        "content-type": "application/json",
    }


async def retry_until_answered(
    http: httpx.AsyncClient,
    tally: KeyTally,
    config: StormConfig,
    deadline: Deadline,
    rng: random.Random,
) -> None:
    """Send ``tally.plan``'s payment until a settled answer or the deadline."""
    loop = asyncio.get_running_loop()
    headers = headers_for(tally.plan, config)
    backoff = FIRST_BACKOFF
    while deadline.left(loop) > 0:
        tally.requests += 1
        try:
            response = await http.post("/payments", content=tally.plan.body, headers=headers)
        except httpx.TransportError:
            tally.errors += 1
            await _sleep_until(loop, deadline, backoff * rng.uniform(0.5, 1.0))
            backoff = min(backoff * 2, MAX_BACKOFF)
            continue
        backoff = FIRST_BACKOFF
        tally.saw(response)
        if response.status_code in SETTLED:
            return
        # 409/503 say when to come back; anything else is unexpected (counted
        # as such) and retried like a 503, as a client facing a 500 would.
        await _sleep_until(loop, deadline, retry_after(response, config.max_sleep, rng))


def retry_after(response: httpx.Response, cap: float, rng: random.Random) -> float:
    """``Retry-After`` seconds (1 if absent or not a number), capped, plus up to 25 % jitter."""
    try:
        wanted = float(response.headers.get("retry-after", "1"))
    except ValueError:
        wanted = 1.0
    return min(max(wanted, 0.0), cap) * rng.uniform(1.0, 1.25)


async def _sleep_until(loop: asyncio.AbstractEventLoop, deadline: Deadline, delay: float) -> None:
    await asyncio.sleep(max(0.0, min(delay, deadline.left(loop))))
