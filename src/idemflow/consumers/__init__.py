"""Exactly-once effects for message consumers (docs/consumers.md): `Consumer` and
`AsyncConsumer` answer a ``Decision`` the broker adapter performs, one adapter per module
(`.redis_streams`, `.rabbitmq`, `.nats`, `.celery`); importing this package imports none."""

from __future__ import annotations

from ._async import AsyncConsumer
from ._sync import Consumer

__all__ = ["AsyncConsumer", "Consumer"]
