"""Redis Streams consumer groups with exactly-once effects (redis-py, imported only here):
`RedisStreams`, `AsyncRedisStreams` on ``redis.asyncio``. An entry not acked stays pending
until ``XAUTOCLAIM`` hands it out again after ``min_idle`` seconds: Redis has no per-entry
delay (docs/consumers.md, "Redis Streams")."""

from __future__ import annotations

from ._async import AsyncRedisStreams
from ._sync import RedisStreams

__all__ = ["AsyncRedisStreams", "RedisStreams"]
