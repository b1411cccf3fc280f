"""RabbitMQ consumers with exactly-once effects (aio-pika, imported only here): every
handled message is acked after its outcome is settled, dead-lettered or copied to a delay
queue; the mapping and why a delay queue per delay: docs/consumers.md, "RabbitMQ"."""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, TypeAlias

from .._extras import optional
from ..stores.protocol import AsyncTransaction
from ._async import AsyncConsumer
from ._decision import key_in

with optional("idemflow.consumers.rabbitmq"):
    import aio_pika
    from aio_pika.abc import AbstractChannel, AbstractIncomingMessage
    from aiormq.abc import DeliveredMessage

__all__ = ["RabbitMQ"]

#: The handler: the claimed attempt and the message; its answer is stored.
MessageHandler: TypeAlias = Callable[[Any, AbstractIncomingMessage], Awaitable[Any]]

#: A delay queue outlives its last declaration (before each publish) by its TTL and this.
_IDLE_MS = 60_000
#: The properties a published copy keeps (never ``expiration``, nor ``user_id``, which
#: the broker checks against the publishing connection's user).
_KEPT = "content_type content_encoding delivery_mode priority correlation_id reply_to message_id"
_KEPT += " timestamp type app_id"


class RabbitMQ:
    """Consume ``queue`` on ``channel``, each message's effect once.

    ``key``: the header holding the idempotency key, or a function of the message;
    ``dead_letter``: the queue poisoned messages go to (default ``<queue>.dead``);
    ``transaction``: a factory of the app's transaction per message, where the
    completion commits with the handler's writes before the ack.
    """

    def __init__(
        self,
        consumer: AsyncConsumer,
        channel: AbstractChannel,
        queue: str,
        *,
        key: str | Callable[[AbstractIncomingMessage], str] = "Idempotency-Key",
        dead_letter: str | None = None,
        transaction: Callable[[], AbstractAsyncContextManager[AsyncTransaction]] | None = None,
    ) -> None:
        self.consumer, self.channel, self.queue = consumer, channel, queue
        self.dead_letter = dead_letter or f"{queue}.dead"
        self._key = key
        self._transaction = transaction

    async def consume(self, handler: MessageHandler) -> str:
        """Start consuming (each message in a task of its own, as many at once as the
        channel's prefetch allows); returns the consumer tag."""
        queue = await self.channel.get_queue(self.queue, ensure=False)
        return await queue.consume(functools.partial(self.deliver, handler=handler))

    async def deliver(self, message: AbstractIncomingMessage, handler: MessageHandler) -> str:
        """Handle one message and perform its decision; returns the action taken. A mistake
        in the code (``ConfigurationError``, ``ResponseNotStorable``) is raised, the message
        left unacked (the broker redelivers it when the channel closes)."""
        opened = self._transaction() if self._transaction else nullcontext(None)
        async with opened as transaction:
            decision = await self.consumer.handle(
                lambda: self._key_of(message),
                message.body,
                lambda attempt: handler(attempt, message),
                transaction=transaction,
            )
        if decision.action == "dead_letter":
            await self.channel.declare_queue(self.dead_letter, durable=True)
            problem = str(decision.problem or "dead-lettered")
            await self._publish(message, self.dead_letter, {"idemflow-problem": problem})
        elif decision.action not in ("ack", "ack_with_stored_result"):
            await self._publish(message, await self._delay_queue(decision.delay))
        await message.ack()
        return decision.action.value

    def _key_of(self, message: AbstractIncomingMessage) -> str:
        if callable(self._key):
            return self._key(message)
        return key_in(message.headers.get(self._key), f"the message has no {self._key!r} header")

    async def _delay_queue(self, delay: float) -> str:
        """The delay queue for ``delay``, declared before each publish: the broker deletes
        one unused (no consumer, no declaration) past x-expires, publishing or not."""
        seconds = 1 << (max(1, math.ceil(delay)) - 1).bit_length()
        name, ttl = f"{self.queue}.delay.{seconds}s", seconds * 1000
        arguments: dict[str, Any] = {"x-message-ttl": ttl, "x-expires": ttl + _IDLE_MS}
        arguments |= {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": self.queue}
        await self.channel.declare_queue(name, durable=True, arguments=arguments)
        return name

    async def _publish(
        self, message: AbstractIncomingMessage, queue: str, headers: dict[str, Any] | None = None
    ) -> None:
        properties = {name: getattr(message, name) for name in _KEPT.split()}
        copy = aio_pika.Message(
            message.body, headers={**message.headers, **(headers or {})}, **properties
        )
        returned = await self.channel.default_exchange.publish(copy, routing_key=queue)
        if isinstance(returned, DeliveredMessage):  # the queue deleted since declared
            raise RuntimeError(f"the broker could not route the message to {queue!r}")
