"""
The Redis Streams adapter's I/O (`idemflow.consumers.redis_streams` says what it does).

This is the async source of truth; ``idemflow/consumers/redis_streams/_sync.py`` is generated
from it by ``scripts/unasync.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, TypeAlias

from ..._extras import optional
from ...stores.protocol import AsyncTransaction
from .. import AsyncConsumer
from .._decision import key_in

with optional("idemflow.consumers.redis_streams"):
    import redis.asyncio

__all__ = ["AsyncRedisStreams"]

Fields: TypeAlias = dict[bytes, bytes]
#: The handler: the claimed attempt and the entry's fields; its answer is stored.
AsyncStreamHandler: TypeAlias = Callable[[Any, Fields], Awaitable[Any]]


class AsyncRedisStreams:
    """Consume ``stream`` as ``name`` in consumer ``group``, each entry's effect once.

    ``key``: the field holding the idempotency key, or a function of the fields;
    ``payload``: the field whose bytes are fingerprinted; ``dead_letter``: the stream
    poisoned entries go to (default ``<stream>:dead``); ``transaction``: a factory of
    the app's transaction per entry, where the completion commits with the handler's
    writes before the ``XACK``.
    """

    def __init__(
        self,
        consumer: AsyncConsumer,
        client: redis.asyncio.Redis,
        stream: str,
        group: str,
        name: str,
        *,
        key: str | Callable[[Fields], str] = "idempotency-key",
        payload: str = "payload",
        dead_letter: str | None = None,
        min_idle: float = 30.0,
        transaction: Callable[[], AbstractAsyncContextManager[AsyncTransaction]] | None = None,
    ) -> None:
        self.consumer = consumer
        # Any: redis-py's stubs type replies as the union of every reply any command can give.
        self.client: Any = client
        self.stream, self.group, self.name = stream, group, name
        self.dead_letter = dead_letter or f"{stream}:dead"
        self.min_idle_ms = int(min_idle * 1000)
        self._key = key
        self._payload = payload.encode()
        self._transaction = transaction

    async def create_group(self) -> None:
        """Create the group (and the stream) if missing, reading from its first entry."""
        try:
            await self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def poll(
        self, handler: AsyncStreamHandler, *, count: int = 10, block_ms: int | None = None
    ) -> list[str]:
        """Handle what is due: entries idle past ``min_idle`` first, then new ones.
        Returns the action taken for each, in order."""
        _, reclaimed, _ = await self.client.xautoclaim(
            self.stream, self.group, self.name, self.min_idle_ms, "0-0", count=count
        )
        fresh = await self.client.xreadgroup(
            self.group, self.name, {self.stream: ">"}, count=count, block=block_ms
        )
        entries = [*reclaimed, *(entry for _, batch in fresh or () for entry in batch)]
        # An entry deleted while pending comes back empty: nothing to run.
        return [
            await self.deliver(entry_id, fields, handler) for entry_id, fields in entries if fields
        ]

    async def deliver(self, entry_id: bytes, fields: Fields, handler: AsyncStreamHandler) -> str:
        """Handle one entry and perform its decision; returns the action taken."""
        opened = self._transaction() if self._transaction else nullcontext(None)
        async with opened as transaction:
            decision = await self.consumer.handle(
                lambda: self._key_of(fields),
                fields.get(self._payload, b""),
                lambda attempt: handler(attempt, fields),
                transaction=transaction,
            )
        if decision.action in ("ack", "ack_with_stored_result"):
            await self.client.xack(self.stream, self.group, entry_id)
        elif decision.action == "dead_letter":
            async with self.client.pipeline(transaction=True) as pipe:
                problem = str(decision.problem or "dead-lettered").encode()
                pipe.xadd(self.dead_letter, {**fields, b"idemflow-problem": problem})
                pipe.xack(self.stream, self.group, entry_id)
                await pipe.execute()
        return decision.action.value

    def _key_of(self, fields: Fields) -> str:
        if callable(self._key):
            return self._key(fields)
        return key_in(fields.get(self._key.encode()), f"the entry has no {self._key!r} field")
