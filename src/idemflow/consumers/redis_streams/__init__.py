"""
Redis Streams consumer groups with exactly-once effects (redis-py, imported only here).

Each entry's idempotency key is a field (or a function of the entry), its payload a
field; `RedisStreams` (`AsyncRedisStreams` on ``redis.asyncio``) hands both to the
consumer and performs the ``Decision``: ``ack`` and ``ack_with_stored_result``
``XACK``; ``dead_letter`` copies the entry to the dead-letter stream with its problem
and acks, in one ``MULTI``; every other action leaves the entry pending, where
``XAUTOCLAIM`` hands it to a consumer again once it has been idle ``min_idle`` seconds
(the stream's redelivery delay: Redis has no per-entry one).
"""

from __future__ import annotations

from ._async import AsyncRedisStreams
from ._sync import RedisStreams

__all__ = ["AsyncRedisStreams", "RedisStreams"]
