"""What a consumer does with a message, sans I/O: its key, its handler's answer as stored,
and the broker `Action` each outcome maps to (`decide`, the whole mapping: docs/consumers.md,
"Outcomes and broker actions"); adapters only perform it."""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from typing import Any

from .._errors import (
    ClientError,
    ConfigurationError,
    IdempotencyError,
    InProgress,
    MissingKey,
    OutcomeUnknown,
    ResponseNotStorable,
    StoreUnavailable,
)
from .._model import Outcome, Response
from ..stores.protocol import AsyncStore, Store

__all__ = ["Action", "Decision", "decide", "decide_failure", "key_in", "require_renewals", "stored"]


class Action(enum.StrEnum):
    """The broker action for one delivery (a ``str``: adapters may compare to its value)."""

    #: First delivery: the handler ran and its outcome committed; ack.
    ACK = "ack"
    #: Already settled: ack without running, the stored result handed back.
    ACK_WITH_STORED_RESULT = "ack_with_stored_result"
    #: In progress elsewhere (or our lease was taken): redeliver after ``delay``, never wait.
    REQUEUE_WITH_DELAY = "requeue_with_delay"
    #: Same key, other payload (or no usable key): dead-letter with ``problem``.
    DEAD_LETTER = "dead_letter"
    #: The handler failed transiently: the claim was given back; redeliver.
    RELEASE_AND_REQUEUE = "release_and_requeue"
    #: The outcome is unknown: the claim stays for the sweeper and reconciler; do not ack.
    KEEP_CLAIMED = "keep_claimed"


@dataclass(frozen=True, slots=True)
class Decision:
    """One delivery's verdict: the ``action``, the (stored) ``response`` where there is
    one, the ``delay`` in seconds before a redelivery, the ``problem`` that led here."""

    action: Action
    response: Response | None = None
    delay: float = 0.0
    problem: IdempotencyError | Exception | None = None


def decide(outcome: Outcome, *, released: bool) -> Decision:
    """A run that returned: ``released`` when its response was transient (given back)."""
    if released:
        return Decision(Action.RELEASE_AND_REQUEUE, outcome.response)
    if outcome.replayed:
        return Decision(Action.ACK_WITH_STORED_RESULT, outcome.response)
    return Decision(Action.ACK, outcome.response)


def decide_failure(exc: Exception, retry_after: float) -> Decision:
    """A run that raised ``exc``; ``retry_after``: the policy's least redelivery delay."""
    if isinstance(exc, InProgress):  # LeaseLost too: the new owner settles it
        return Decision(
            Action.REQUEUE_WITH_DELAY, delay=max(exc.retry_after, retry_after), problem=exc
        )
    if isinstance(exc, ClientError):  # KeyReused: same key, other payload
        return Decision(Action.DEAD_LETTER, problem=exc)
    if isinstance(exc, OutcomeUnknown):
        return Decision(Action.KEEP_CLAIMED, delay=exc.retry_after, problem=exc)
    if isinstance(exc, StoreUnavailable):
        # Nothing claimed, or a claim the flow kept for the sweeper: either way not ours to ack.
        return Decision(
            Action.REQUEUE_WITH_DELAY, delay=max(exc.retry_after, retry_after), problem=exc
        )
    # The handler's own error: the flow gave the claim back.
    return Decision(Action.RELEASE_AND_REQUEUE, delay=retry_after, problem=exc)


def key_in(value: object, missing: str) -> str:
    """The key a message's header or field holds (bytes: UTF-8); ``MissingKey(missing)`` if none."""
    if isinstance(value, bytes):
        value = value.decode()
    if not isinstance(value, str):
        raise MissingKey(missing)
    return value


def require_renewals(store: AsyncStore | Store) -> None:
    if not store.renews_claims:
        msg = (
            f"{type(store).__name__} cannot renew a claim, so a long handler's would age out "
            "under it and run twice: give the consumer one of idemflow's stores, or implement "
            "Store.renew and set renews_claims = True"
        )
        raise ConfigurationError(msg)


def stored(answer: Any) -> Response:
    """A handler's answer as the response replayed for its duplicates: a mistake (an
    answer JSON cannot hold) is raised, never taken for a transient failure."""
    if isinstance(answer, Response):
        return answer
    if inspect.iscoroutine(answer):  # a coroutine function given to the sync consumer
        answer.close()
        msg = "a coroutine function is no handler for the sync consumer: use the asyncio one"
        raise ConfigurationError(msg)
    try:
        return Response.json(200, answer)
    except (TypeError, ValueError) as exc:
        msg = f"a message handler must answer a Response or a JSON value, not {type(answer)!r}"
        raise ResponseNotStorable(msg) from exc
