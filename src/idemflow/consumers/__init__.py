"""
Exactly-once effects for message consumers, on the same core, stores and guarantees.

`Consumer` and `AsyncConsumer` take one delivery (its idempotency key
and payload) and a handler, and answer a ``Decision`` whose ``action`` the broker
adapter performs: ``ack``, ``ack_with_stored_result``, ``requeue_with_delay``,
``dead_letter``, ``release_and_requeue`` or ``keep_claimed`` (docs/consumers.md).
Adapters live one per module (`idemflow.consumers.redis_streams`, `.rabbitmq`, `.nats`,
`.celery`), each importing its broker's client; importing this package imports none.
"""

from __future__ import annotations

from ._async import AsyncConsumer
from ._sync import Consumer

__all__ = ["AsyncConsumer", "Consumer"]
