"""NATS JetStream pull consumers with exactly-once effects (nats-py, imported only here):
each outcome as JetStream's own action (``ack_sync``, ``nak(delay=…)``, ``term()`` and a
dead-letter copy, ``in_progress()`` beats), as docs/consumers.md, "NATS JetStream", says."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, TypeAlias

from .._extras import optional
from ..stores.protocol import AsyncTransaction
from ._async import AsyncConsumer
from ._decision import key_in

with optional("idemflow.consumers.nats"):
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

__all__ = ["JetStream"]

#: The handler: the claimed attempt and the message; its answer is stored.
MessageHandler: TypeAlias = Callable[[Any, Msg], Awaitable[Any]]


class JetStream:
    """Consume the durable pull consumer ``durable`` of ``stream`` on ``js``.

    ``key``: the header holding the idempotency key, or a function of the message;
    ``dead_letter``: the subject poisoned messages are published to (default
    ``<subject>.dead``); ``transaction``: a factory of the app's transaction per
    message, where the completion commits with the handler's writes before the ack;
    ``ack_wait``: the consumer's ack wait in seconds (``in_progress`` pace).
    """

    def __init__(
        self,
        consumer: AsyncConsumer,
        js: JetStreamContext,
        stream: str,
        durable: str,
        *,
        key: str | Callable[[Msg], str] = "Idempotency-Key",
        dead_letter: str | None = None,
        transaction: Callable[[], AbstractAsyncContextManager[AsyncTransaction]] | None = None,
        ack_wait: float = 30.0,
    ) -> None:
        self.consumer, self.js, self.stream, self.durable = consumer, js, stream, durable
        self.dead_letter, self.ack_wait = dead_letter, ack_wait
        self._key = key
        self._transaction = transaction

    async def fetch(self, handler: MessageHandler, batch: int = 1, timeout: float = 1.0) -> int:
        """Pull up to ``batch`` messages and handle them concurrently; returns how many."""
        sub = await self.js.pull_subscribe_bind(self.durable, self.stream)
        try:
            messages = await sub.fetch(batch, timeout=timeout)
        except TimeoutError:
            return 0
        finally:
            await sub.unsubscribe()
        await asyncio.gather(*(self.deliver(m, handler) for m in messages))
        return len(messages)

    async def deliver(self, message: Msg, handler: MessageHandler) -> str:
        """Handle one message and perform its decision; returns the action taken. A mistake
        in the code is raised, the message left unacked (redelivered after ack wait)."""
        beat = asyncio.create_task(self._in_progress(message))
        try:
            opened = self._transaction() if self._transaction else nullcontext(None)
            async with opened as transaction:
                decision = await self.consumer.handle(
                    lambda: self._key_of(message),
                    message.data,
                    lambda attempt: handler(attempt, message),
                    transaction=transaction,
                )
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
        if decision.action in ("ack", "ack_with_stored_result"):
            await message.ack_sync()
        elif decision.action == "dead_letter":
            problem = str(decision.problem or "dead-lettered")
            headers = {**(message.headers or {}), "Idemflow-Problem": problem}
            await self.js.publish(
                self.dead_letter or f"{message.subject}.dead", message.data, headers=headers
            )
            await message.term()
        else:
            await message.nak(delay=max(decision.delay, 0.001))
        return decision.action.value

    def _key_of(self, message: Msg) -> str:
        if callable(self._key):
            return self._key(message)
        value = (message.headers or {}).get(self._key)
        return key_in(value, f"the message has no {self._key!r} header")

    async def _in_progress(self, message: Msg) -> None:
        while True:
            await asyncio.sleep(self.ack_wait / 3)
            await message.in_progress()
