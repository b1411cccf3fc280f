"""
The consumer entry point: one message, exactly one effect, through the core's driver; the
principal is the consumer's scope (a queue, stream or task name), the fingerprint the payload's.

This is the async source of truth; ``idemflow/consumers/_sync.py`` is generated
from it by ``scripts/unasync.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

from .. import AsyncAttempt, AsyncIdempotency, Intent, Response, Verdict, fingerprint
from .._errors import ConfigurationError, MissingKey
from ..stores.protocol import AsyncTransaction
from ._decision import Decision, decide, decide_failure, require_renewals, stored
from ._keeper import AsyncLeaseKeeper

__all__ = ["AsyncConsumer", "AsyncMessageHandler"]

#: A message's handler: its answer is stored and replayed (a Response as it is; any other
#: value as JSON). Raising gives the claim back (redelivered); ``OutcomeUnknown`` keeps it.
AsyncMessageHandler: TypeAlias = Callable[[AsyncAttempt], Awaitable[Any]]


class AsyncConsumer:
    """Exactly-once effects for the messages of one ``scope`` (a queue, stream or task).

    ``renew_every``: seconds between renewals of a running handler's claim (default: the
    policy's ``request_timeout``, the claimed duration; the sweeper waits for twice as
    long and more). Consumers always renew; HTTP requests never do (they time out).
    """

    def __init__(
        self, idempotency: AsyncIdempotency, scope: str, *, renew_every: float | None = None
    ) -> None:
        require_renewals(idempotency.store)
        self.idempotency = idempotency
        self.scope = scope
        policy = idempotency.policy
        self.renew_every = policy.timeout_seconds if renew_every is None else renew_every

    async def handle(
        self,
        key: str | Callable[[], str],
        payload: bytes,
        handler: AsyncMessageHandler,
        *,
        transaction: AsyncTransaction | None = None,
    ) -> Decision:
        """Run ``handler`` once for ``key`` and say what the broker should do with the message.

        ``key``: the message's idempotency key, or a function reading it from the message
        (its ``MissingKey`` dead-letters the message, as an empty key does);
        ``transaction``: the app's (`idemflow.transactions`), where the completion
        commits with the handler's writes before the adapter acks.
        """
        idem = self.idempotency
        try:
            key = key() if callable(key) else key
        except MissingKey as exc:  # any other error of a key function is a mistake: raised
            return decide_failure(exc, idem.policy.retry_after)
        try:
            if not key:
                raise MissingKey("the message carries no idempotency key")
            intent = Intent(
                self.scope, key, fingerprint("MESSAGE", self.scope, payload), self.scope
            )

            async def kept_alive(attempt: AsyncAttempt) -> Response:
                keeper = AsyncLeaseKeeper(idem.store, attempt.record, self.renew_every, idem.clock)
                return stored(await keeper.guard(lambda: handler(attempt)))

            outcome = await idem.run(intent, kept_alive, transaction=transaction)
        except ConfigurationError:
            raise  # a mistake in the code, not in the message
        except Exception as exc:  # noqa: BLE001 -- every failure is a broker action
            return decide_failure(exc, idem.policy.retry_after)
        released = (
            not outcome.replayed and idem.policy.verdict(outcome.response) is Verdict.TRANSIENT
        )
        return decide(outcome, released=released)
