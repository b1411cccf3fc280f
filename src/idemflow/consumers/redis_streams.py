"""
Redis Streams consumer groups with exactly-once effects (redis-py, imported only here).

Each entry's idempotency key is a field (or a function of the entry), its payload a
field; `RedisStreams` hands both to `Consumer` and
performs the ``Decision``: ``ack`` and ``ack_with_stored_result`` ``XACK``;
``dead_letter`` copies the entry to the dead-letter stream with its problem and acks,
in one ``MULTI``; every other action leaves the entry pending, where ``XAUTOCLAIM``
hands it to a consumer again once it has been idle ``min_idle`` seconds (the stream's
redelivery delay: Redis has no per-entry one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeAlias

from .._errors import MissingKey
from .._extras import optional
from ..stores.protocol import Transaction
from ._sync import Consumer

with optional("idemflow.consumers.redis_streams"):
    import redis

__all__ = ["RedisStreams"]

Fields: TypeAlias = dict[bytes, bytes]
#: The handler: the claimed attempt and the entry's fields; its answer is stored.
StreamHandler: TypeAlias = Callable[[Any, Fields], Any]


class RedisStreams:
    """Consume ``stream`` as ``name`` in consumer ``group``, each entry's effect once.

    ``key``: the field holding the idempotency key, or a function of the fields;
    ``payload``: the field whose bytes are fingerprinted; ``dead_letter``: the stream
    poisoned entries go to (default ``<stream>:dead``); ``transaction``: a factory of
    the app's transaction per entry, where the completion commits with the handler's
    writes before the ``XACK``.
    """

    def __init__(
        self,
        consumer: Consumer,
        client: redis.Redis,
        stream: str,
        group: str,
        name: str,
        *,
        key: str | Callable[[Fields], str] = "idempotency-key",
        payload: str = "payload",
        dead_letter: str | None = None,
        min_idle: float = 30.0,
        transaction: Callable[[], AbstractContextManager[Transaction]] | None = None,
    ) -> None:
        self.consumer = consumer
        # Any: redis-py's stubs type replies as the union of every reply any command can give.
        self.client: Any = client
        self.stream, self.group, self.name = stream, group, name
        self.dead_letter = dead_letter or f"{stream}:dead"
        self.min_idle_ms = int(min_idle * 1000)
        self._key = key if callable(key) else _field(key)
        self._payload = payload.encode()
        self._transaction = transaction

    def create_group(self) -> None:
        """Create the group (and the stream) if missing, reading from its first entry."""
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def poll(
        self, handler: StreamHandler, *, count: int = 10, block_ms: int | None = None
    ) -> list[str]:
        """Handle what is due: entries idle past ``min_idle`` first, then new ones.
        Returns the action taken for each, in order."""
        _, reclaimed, _ = self.client.xautoclaim(
            self.stream, self.group, self.name, self.min_idle_ms, "0-0", count=count
        )
        fresh = self.client.xreadgroup(
            self.group, self.name, {self.stream: ">"}, count=count, block=block_ms
        )
        entries = [*reclaimed, *(entry for _, batch in fresh or () for entry in batch)]
        # An entry deleted while pending comes back empty: nothing to run.
        return [self.deliver(entry_id, fields, handler) for entry_id, fields in entries if fields]

    def deliver(self, entry_id: bytes, fields: Fields, handler: StreamHandler) -> str:
        """Handle one entry and perform its decision; returns the action taken."""
        with self._transaction_for() as transaction:
            decision = self.consumer.handle(
                self._key_of(fields),
                fields.get(self._payload, b""),
                lambda attempt: handler(attempt, fields),
                transaction=transaction,
            )
        if decision.action in ("ack", "ack_with_stored_result"):
            self.client.xack(self.stream, self.group, entry_id)
        elif decision.action == "dead_letter":
            with self.client.pipeline(transaction=True) as pipe:
                problem = str(decision.problem or "dead-lettered").encode()
                pipe.xadd(self.dead_letter, {**fields, b"idemflow-problem": problem})
                pipe.xack(self.stream, self.group, entry_id)
                pipe.execute()
        return decision.action.value

    def _key_of(self, fields: Fields) -> str:
        try:
            return self._key(fields)
        except MissingKey:
            return ""  # dead-lettered by the consumer, as a message without a key

    @contextmanager
    def _transaction_for(self) -> Iterator[Transaction | None]:
        if self._transaction is None:
            yield None
            return
        with self._transaction() as transaction:
            yield transaction


def _field(name: str) -> Callable[[Fields], str]:
    raw = name.encode()

    def key(fields: Fields) -> str:
        value = fields.get(raw)
        if value is None:
            raise MissingKey(f"the entry has no {name!r} field")
        return value.decode()

    return key
